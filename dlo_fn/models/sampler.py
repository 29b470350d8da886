"""Flow-matching Euler sampling with classifier-free guidance, as pure state transitions.

The model predicts the velocity v = noise - data of the straight path x_sigma = (1 - sigma) data + sigma noise.
With shifted noise levels (K = num_inference_steps, s = shift)::

    sigma_i = s u_i / (1 + (s - 1) u_i),   u_i = 1 - i / K,   i = 0..K      (sigma_0 = 1, sigma_K = 0)
    v       = v_uncond + g (v_cond - v_uncond)        (g = guidance_scale > 1; otherwise v = v_cond)
    x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v,        model timestep = 1000 sigma_i

The CFG pair runs as one batch-2 forward (rows: N conditional, then N unconditional), so one step is one pass
over the blocks. The output is a function of (weights, prompt, negative prompt, seed, shape, steps, guidance,
shift) only: the initial noise comes from a CPU ``torch.Generator(seed)`` whatever the device.

Two ways to run it:

* ``generate(model, request) -> Result`` runs every step with ``model(...)``;
* for engines that interleave requests: ``state = init_state(model, request)``; then while not
  ``finished(state)``: ``out = run(*model_inputs(state))``; ``state = update(state, out)``; finally
  ``finish(state) -> Result``. States are frozen; ``update`` returns a new one.

Sequence parallel: ``generate(model, request, sp=ctx)``, or ``model(*model_inputs(state), sp=ctx)`` /
``model.embed(*model_inputs(state), sp=ctx)`` in the stepping API; states stay whole and identical on every
sp rank (the model returns the whole velocity there).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dlo_fn.models.config import DiTConfig, latent_shape
from dlo_fn.models.decode import decode_latents
from dlo_fn.models.lora import adapter_names, use_adapter
from dlo_fn.models.request import Request
from dlo_fn.models.text import tokenize

__all__ = [
    "ModelInputs",
    "Result",
    "SamplerState",
    "sigmas",
    "init_state",
    "model_inputs",
    "update",
    "finished",
    "finish",
    "generate",
]


def sigmas(num_steps: int, shift: float) -> tuple[float, ...]:
    """The K + 1 shifted noise levels from 1 down to 0 (Python floats, so exactly reproducible)."""
    levels = []
    for i in range(num_steps + 1):
        u = 1.0 - i / num_steps
        levels.append(shift * u / (1.0 + (shift - 1.0) * u))
    return tuple(levels)


class ModelInputs(NamedTuple):
    """Positional arguments of ``model(...)`` / ``model.embed(...)`` for one step."""

    latents: torch.Tensor  # [B, C, T, h, w] fp32
    timestep: torch.Tensor  # [B] fp32, 1000 sigma
    text_tokens: torch.Tensor  # [B, text_len] int64


@dataclass(frozen=True, slots=True)
class Result:
    """``video`` uint8 [N, F, H, W, 3] (N = outputs_per_prompt) on the CPU, ``sha256`` of its bytes (C order),
    and the final ``latents`` fp32 [N, C, T, h, w] on the CPU."""

    video: torch.Tensor
    sha256: str
    latents: torch.Tensor


@dataclass(frozen=True, slots=True)
class SamplerState:
    request: Request
    config: DiTConfig
    latents: torch.Tensor  # [N, C, T, h, w] fp32, on the model's device
    text_tokens: torch.Tensor  # [B, text_len] int64, on the model's device
    sigmas: tuple[float, ...]
    step: int = 0

    @property
    def num_steps(self) -> int:
        return len(self.sigmas) - 1


def _config_and_device(model_or_config, device) -> tuple[DiTConfig, torch.device]:
    if isinstance(model_or_config, DiTConfig):
        return model_or_config, torch.device("cpu" if device is None else device)
    config, model_device = model_or_config.config, model_or_config.device
    if device is None:
        device = model_device
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("the model is on the meta device: load or materialise its weights before sampling")
    _check_materialised(model_or_config)
    return config, device


def _check_materialised(model: torch.nn.Module) -> None:
    """A tensor left on meta runs without an error and gives NaN (a checkpoint written by ``quantize`` keeps its
    FP8 block weights aside, their module entries on meta). An offloaded model's blocks are proxies whose meta
    blocks are not registered, so they do not count."""
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if tensor.is_meta:
            raise ValueError(
                f"{type(model).__name__}'s {name} is not loaded (it is on the meta device): load the model's "
                "weights first, or offload it (dlo_fn.runtime.offload.offload); a checkpoint written by "
                "`python -m dlo_fn quantize` runs only offloaded, with quantization='fp8'"
            )


def init_state(model_or_config, request: Request, device: torch.device | str | None = None) -> SamplerState:
    """Validate the request and draw its initial noise. ``device`` defaults to the model's (CPU for a config)."""
    config, device = _config_and_device(model_or_config, device)
    request.validate(config)
    shape = latent_shape(config, request.height, request.width, request.num_frames)
    generator = torch.Generator(device="cpu").manual_seed(request.seed)
    noise = torch.stack(
        [torch.randn(shape, generator=generator, dtype=torch.float32) for _ in range(request.outputs_per_prompt)]
    )
    prompts = [request.prompt] * request.outputs_per_prompt
    if request.cfg:
        prompts += [request.negative_prompt] * request.outputs_per_prompt
    return SamplerState(
        request=request,
        config=config,
        latents=noise.to(device),
        text_tokens=tokenize(prompts, config.text_len).to(device),
        sigmas=sigmas(request.num_inference_steps, float(request.shift)),
    )


def finished(state: SamplerState) -> bool:
    return state.step >= state.num_steps


def model_inputs(state: SamplerState) -> ModelInputs:
    """The batch for this step: latents repeated for the CFG pair, timestep 1000 sigma_step, text tokens."""
    if finished(state):
        raise ValueError(f"sampler state already finished its {state.num_steps} steps: call finish(state)")
    latents = torch.cat([state.latents, state.latents]) if state.request.cfg else state.latents
    timestep = torch.full(
        (latents.shape[0],), 1000.0 * state.sigmas[state.step], dtype=torch.float32, device=latents.device
    )
    return ModelInputs(latents, timestep, state.text_tokens)


def update(state: SamplerState, model_output: torch.Tensor) -> SamplerState:
    """One Euler step from the model's velocity prediction for :func:`model_inputs` (state)."""
    if finished(state):
        raise ValueError(f"sampler state already finished its {state.num_steps} steps")
    rows = state.request.batch_size
    expected = (rows, *state.latents.shape[1:])
    if tuple(model_output.shape) != expected:
        raise ValueError(f"model output has shape {tuple(model_output.shape)}, expected {expected}")
    v = model_output.to(device=state.latents.device, dtype=torch.float32)
    if state.request.cfg:
        v_cond, v_uncond = v.chunk(2)
        v = v_uncond + float(state.request.guidance_scale) * (v_cond - v_uncond)
    dt = state.sigmas[state.step + 1] - state.sigmas[state.step]
    return dataclasses.replace(state, latents=state.latents + dt * v, step=state.step + 1)


def finish(state: SamplerState) -> Result:
    """Decode the final latents (CPU, deterministic stand-in for a VAE) and hash the video bytes."""
    if not finished(state):
        raise ValueError(f"sampler state is at step {state.step} of {state.num_steps}: keep stepping")
    latents = state.latents.detach().to("cpu")
    video = decode_latents(latents, state.config)
    return Result(video=video, sha256=hashlib.sha256(video.numpy().tobytes()).hexdigest(), latents=latents)


@torch.no_grad()
def generate(model, request: Request, *, sp=None) -> Result:
    """Run a whole request through ``model`` (a :class:`~dlo_fn.models.dit.VideoDiT`, possibly with offloaded blocks).

    ``sp``: a :class:`~dlo_fn.models.sp.SPContext`; every rank of its group calls ``generate`` with the same
    request (same seed, so the same noise), computes its share of the tokens and gets the whole result.
    ``request.lora`` (at ``lora_scale``) is made the active adapter first where the model has adapters
    (:mod:`dlo_fn.models.lora`)."""
    if request.lora is not None or adapter_names(model):
        use_adapter(model, request.lora, request.lora_scale)
    state = init_state(model, request)
    kwargs = {} if sp is None else {"sp": sp}
    text = model.encode_text(state.text_tokens)  # the prompt's states do not change across steps: encode once
    while not finished(state):
        state = update(state, model(*model_inputs(state), text, **kwargs))
    return finish(state)
