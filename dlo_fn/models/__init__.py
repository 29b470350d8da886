"""Reference video DiT, flow-matching sampler and checkpoint writer; named configs.

Read in this order: ``config`` (shapes, tokens) -> ``configs`` (named sizes and their sources) -> ``layers``
-> ``text`` -> ``sp`` (Ulysses sequence parallelism) -> ``dit`` (the model and the runtime contract) -> ``init``
-> ``request`` -> ``sampler`` -> ``decode`` -> ``checkpoint``.
"""

from dlo_fn.models.checkpoint import CONFIG_NAME, MODEL_TYPE, load_config, parse_size, write_checkpoint
from dlo_fn.models.config import DiTConfig, latent_shape, tokens_for
from dlo_fn.models.configs import CONFIGS, get_config
from dlo_fn.models.decode import decode_latents
from dlo_fn.models.dit import BLOCK_PATHS, DTYPES, DiTBlock, EmbedState, VideoDiT, build_model
from dlo_fn.models.request import SAMPLERS, Request
from dlo_fn.models.sampler import (
    ModelInputs,
    Result,
    SamplerState,
    finish,
    finished,
    generate,
    init_state,
    model_inputs,
    sigmas,
    update,
)
from dlo_fn.models.sp import SPContext, TokenShard, check_sp_heads
from dlo_fn.models.text import tokenize

__all__ = [
    "BLOCK_PATHS",
    "CONFIGS",
    "CONFIG_NAME",
    "DTYPES",
    "MODEL_TYPE",
    "SAMPLERS",
    "DiTBlock",
    "DiTConfig",
    "EmbedState",
    "ModelInputs",
    "Request",
    "Result",
    "SPContext",
    "SamplerState",
    "TokenShard",
    "VideoDiT",
    "build_model",
    "check_sp_heads",
    "decode_latents",
    "finish",
    "finished",
    "generate",
    "get_config",
    "init_state",
    "latent_shape",
    "load_config",
    "model_inputs",
    "parse_size",
    "sigmas",
    "tokenize",
    "tokens_for",
    "update",
    "write_checkpoint",
]
