"""The models of `bench real`: diffusers classes at their published configs, seeded random weights made on the
device, written once with ``save_pretrained``, and the inputs of one denoising forward at a workload's shapes.

Every config below is the ``transformer/config.json`` of the public repository named in ``source`` (the
arguments of the class; the ``_class_name`` / ``_diffusers_version`` keys are added by ``save_pretrained``).
``quick`` is a tiny config of the same class (CPU tests). Inputs follow what the class's pipeline hands the
transformer: latents in the model's dtype, text embeddings of the pipeline's ``max_sequence_length``, classifier-free
guidance as two batch rows where the pipeline uses it (Wan, LTX-Video; FLUX.1-dev has guidance distilled into an
embedding instead, batch 1).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["ModelCase", "MODELS", "build_random", "materialize", "write_checkpoint", "forward_inputs"]

MARKER = "bench_real.json"  # written last into a checkpoint folder: the folder is complete and what it holds


@dataclass(frozen=True)
class ModelCase:
    """One model at one workload. ``checkpoint`` names the folder (cases of one model share it)."""

    name: str
    checkpoint: str
    cls: str
    config: dict
    source: str
    workload: dict  # height, width, frames, batch (2: CFG), text_len
    quick_config: dict
    quick_workload: dict
    family: str = field(default="")

    def at(self, quick: bool) -> tuple[dict, dict]:
        return (self.quick_config, self.quick_workload) if quick else (self.config, self.workload)


FLUX_DEV = {
    "attention_head_dim": 128,
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
    "axes_dims_rope": [16, 56, 56],
}
WAN_14B = {
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 13824,
    "freq_dim": 256,
    "image_dim": None,
    "in_channels": 16,
    "num_attention_heads": 40,
    "num_layers": 40,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}
LTX_VIDEO = {
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_head_dim": 64,
    "attention_out_bias": True,
    "caption_channels": 4096,
    "cross_attention_dim": 2048,
    "in_channels": 128,
    "norm_elementwise_affine": False,
    "norm_eps": 1e-06,
    "num_attention_heads": 32,
    "num_layers": 28,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "qk_norm": "rms_norm_across_heads",
}

FLUX_QUICK = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 2,
    "num_single_layers": 3,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "guidance_embeds": True,
    "axes_dims_rope": [4, 6, 6],
}
WAN_QUICK = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 16,
    "freq_dim": 32,
    "ffn_dim": 32,
    "num_layers": 3,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}
LTX_QUICK = {
    "in_channels": 8,
    "out_channels": 8,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "cross_attention_dim": 16,
    "num_layers": 3,
    "caption_channels": 16,
}

_FLUX = "https://huggingface.co/black-forest-labs/FLUX.1-dev/blob/main/transformer/config.json"
_WAN = "https://huggingface.co/Wan-AI/Wan2.1-T2V-14B-Diffusers/blob/main/transformer/config.json"
_LTX = "https://huggingface.co/Lightricks/LTX-Video/blob/main/transformer/config.json"
MODELS = {
    m.name: m
    for m in (
        ModelCase(
            "flux",
            "flux1-dev",
            "FluxTransformer2DModel",
            FLUX_DEV,
            _FLUX,
            dict(height=1024, width=1024, frames=1, batch=1, text_len=512),
            FLUX_QUICK,
            dict(height=64, width=64, frames=1, batch=1, text_len=8),
            "flux",
        ),
        ModelCase(
            "wan480",
            "wan2.1-t2v-14b",
            "WanTransformer3DModel",
            WAN_14B,
            _WAN,
            dict(height=480, width=832, frames=33, batch=2, text_len=512),
            WAN_QUICK,
            dict(height=32, width=32, frames=5, batch=2, text_len=8),
            "wan",
        ),
        # 720p at the 480p row's frame count: the rows differ in resolution only (~2.3x the tokens).
        ModelCase(
            "wan720",
            "wan2.1-t2v-14b",
            "WanTransformer3DModel",
            WAN_14B,
            _WAN,
            dict(height=720, width=1280, frames=33, batch=2, text_len=512),
            WAN_QUICK,
            dict(height=48, width=48, frames=5, batch=2, text_len=8),
            "wan",
        ),
        ModelCase(
            "ltx",
            "ltx-video",
            "LTXVideoTransformer3DModel",
            LTX_VIDEO,
            _LTX,
            dict(height=512, width=704, frames=161, batch=2, text_len=128),
            LTX_QUICK,
            dict(height=64, width=64, frames=9, batch=2, text_len=8),
            "ltx",
        ),
    )
}


def _init_tensor(t: torch.Tensor, norm_weight: bool, gen: torch.Generator) -> None:
    """N(0, 1/fan_in) for matrices, convolutions and embeddings (fan_in: every dimension but the first), N(1, 0.1)
    for a normalisation layer's weight, N(0, 0.02) for every other vector: activations stay O(1) through
    dozens of residual blocks, so outputs are finite and comparable byte for byte."""
    if not t.is_floating_point():
        t.zero_()
    elif t.dim() >= 2:
        t.normal_(0.0, float(torch.tensor(t.shape[1:]).prod()) ** -0.5, generator=gen)
    elif norm_weight:
        t.normal_(1.0, 0.1, generator=gen)
    else:
        t.normal_(0.0, 0.02, generator=gen)


def materialize(model: nn.Module, device: torch.device, seed: int, dtype: torch.dtype | None = None) -> nn.Module:
    """Give every parameter of ``model`` (on ``meta``) storage on ``device`` (in ``dtype`` for floating ones when
    given, else its own) filled by one seeded generator in registration order; move the buffers (computed on the
    CPU by the model's own init) to ``device``. Nothing of the weights ever exists in host memory."""
    gen = torch.Generator(device=device).manual_seed(seed)
    made: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for module in model.modules():
            norm = "Norm" in type(module).__name__
            for attr, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) not in made:
                    want = dtype if dtype is not None and p.is_floating_point() else p.dtype
                    t = torch.empty(p.shape, dtype=want, device=device)
                    _init_tensor(t, norm and attr == "weight", gen)
                    made[id(p)] = nn.Parameter(t, requires_grad=False)
                module._parameters[attr] = made[id(p)]
            for attr, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[attr] = b.to(device)
    return model.eval().requires_grad_(False)


def build_random(
    case: ModelCase, device: torch.device, quick: bool, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> nn.Module:
    """``case``'s class at its (quick) config, exactly as ``load_model`` builds it from a checkpoint (dtype,
    ``_keep_in_fp32_modules`` in fp32, buffers from the class's own init), with random weights on ``device``."""
    import diffusers

    from dlo_fn.io.diffusers_load import _meta_build  # the loader's own build: same dtypes as load_model

    config, _ = case.at(quick)
    return materialize(_meta_build(getattr(diffusers, case.cls), config, dtype), device, seed)


def _marker(case: ModelCase, quick: bool, seed: int) -> dict:
    config, _ = case.at(quick)
    return {
        "class": case.cls,
        "config": config,
        "seed": seed,
        "dtype": "bfloat16",
        "quick": quick,
        "source": case.source,
    }


def checkpoint_ready(folder: pathlib.Path, case: ModelCase, quick: bool, seed: int) -> bool:
    """Whether ``folder`` holds this case's checkpoint, completely written by :func:`write_checkpoint`."""
    try:
        want = dict(_marker(case, quick, seed), complete=True)
        return json.loads((folder / MARKER).read_text()) == json.loads(json.dumps(want))
    except (OSError, ValueError):
        return False


def write_checkpoint(model: nn.Module, folder: pathlib.Path, case: ModelCase, quick: bool, seed: int) -> dict:
    """``model.save_pretrained(folder)`` in shards of at most 5 GB (``save_pretrained`` brings one shard at a
    time to the host); the marker is written first (the folder is ours: a later run may delete it) and completed
    last (the checkpoint is whole: a later run may reuse it). Returns what was written and how long it took."""
    if folder.exists():
        if not (folder / MARKER).exists() and any(folder.iterdir()):
            raise ValueError(f"{folder} exists and was not written by bench real (no {MARKER}): pass another --folder")
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    marker = _marker(case, quick, seed)
    (folder / MARKER).write_text(json.dumps(dict(marker, complete=False)))
    t0 = time.perf_counter()
    model.save_pretrained(folder, max_shard_size="5GB", safe_serialization=True)
    seconds = time.perf_counter() - t0
    (folder / MARKER).write_text(json.dumps(dict(marker, complete=True), indent=1, sort_keys=True))
    files = sorted(folder.glob("*.safetensors"))
    return {"write_s": seconds, "files": len(files), "bytes": sum(f.stat().st_size for f in files)}


def checkpoint_files(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(pathlib.Path(folder).glob("*.safetensors"))


def forward_inputs(
    case: ModelCase, quick: bool, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> dict[str, Any]:
    """Keyword arguments of one transformer forward at the workload's shapes (CPU-seeded, then moved)."""
    config, w = case.at(quick)
    gen = torch.Generator().manual_seed(seed)
    B, L = w["batch"], w["text_len"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    kwargs: dict[str, Any] = {"return_dict": False}
    if case.family == "flux":  # 2x2-packed latents of the VAE's 8x downsampling
        h, w_ = w["height"] // 16, w["width"] // 16
        ids = torch.zeros(h * w_, 3)
        ids[:, 1], ids[:, 2] = torch.arange(h * w_) // w_, torch.arange(h * w_) % w_
        kwargs.update(
            hidden_states=randn(B, h * w_, config["in_channels"]),
            encoder_hidden_states=randn(B, L, config["joint_attention_dim"]),
            pooled_projections=randn(B, config["pooled_projection_dim"]),
            timestep=torch.full((B,), 0.5, device=device, dtype=dtype),
            img_ids=ids.to(device, dtype),
            txt_ids=torch.zeros(L, 3, device=device, dtype=dtype),
            guidance=torch.full((B,), 3.5, device=device, dtype=dtype) if config["guidance_embeds"] else None,
        )
    elif case.family == "wan":  # the VAE: 4x in time, 8x in space
        frames = (w["frames"] - 1) // 4 + 1
        kwargs.update(
            hidden_states=randn(B, config["in_channels"], frames, w["height"] // 8, w["width"] // 8),
            timestep=torch.full((B,), 500.0, device=device),
            encoder_hidden_states=randn(B, L, config["text_dim"]),
        )
    elif case.family == "ltx":  # the VAE: 8x in time, 32x in space; the pipeline's rope scale at 25 fps
        f, h, w_ = (w["frames"] - 1) // 8 + 1, w["height"] // 32, w["width"] // 32
        kwargs.update(
            hidden_states=randn(B, f * h * w_, config["in_channels"]),
            encoder_hidden_states=randn(B, L, config["caption_channels"]),
            timestep=torch.full((B,), 500.0, device=device),
            encoder_attention_mask=torch.ones(B, L, dtype=torch.long, device=device),
            num_frames=f,
            height=h,
            width=w_,
            rope_interpolation_scale=(8 / 25, 32, 32),
        )
    else:
        raise ValueError(f"no inputs for the family of {case.name!r}")
    return kwargs


def tokens_per_row(case: ModelCase, quick: bool) -> int:
    """Latent tokens of one batch row (text tokens excluded)."""
    _, w = case.at(quick)
    patch = {"flux": (1, 16, 16), "wan": (4, 16, 16), "ltx": (8, 32, 32)}[case.family]
    frames = (w["frames"] - 1) // patch[0] + 1 if w["frames"] > 1 else 1
    return frames * (w["height"] // patch[1]) * (w["width"] // patch[2])


Forward = Callable[[], torch.Tensor]


def meta_spec(name: str):
    """The spec of model ``name`` (:data:`MODELS`) at its published config, built on meta (no weights)."""
    import diffusers

    from dlo_fn.io.diffusers_load import _meta_build, block_paths_for
    from dlo_fn.plan.spec import spec_from_module

    case = MODELS[name]
    config, _ = case.at(False)
    model = _meta_build(getattr(diffusers, case.cls), config, torch.bfloat16)
    return spec_from_module(model, block_paths_for(model), name=case.cls)
