"""Deterministic, streamable random initialisation: every tensor is a function of (seed, name) only.

Tensor ``name`` gets ``mean + std * N(0, 1)`` drawn in fp32 from a CPU ``torch.Generator`` seeded with the first
63 bits of ``sha256(f"{seed}:{name}")``, then cast to its dtype. No tensor depends on any other, so a checkpoint
can be written one tensor at a time (:mod:`dlo_fn.models.checkpoint`) and ``build_model(..., device="cpu")``
produces exactly the weights that ``write_checkpoint`` stores for the same seed.

Scales keep activations O(1) through any depth (a random model must give meaningful, non-degenerate hashes):

    Linear weight     std = gain / sqrt(fan_in)     (gain 1; adaLN up-projections 0.5; see dit.py)
    Linear bias       std = 0.02
    RMSNorm weight    1 + 0.1 N(0, 1)               (not all ones, so a misplaced norm weight changes outputs)
    Embedding, text positions    std 1, 0.1
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from dlo_fn.models.layers import RMSNorm

__all__ = ["TensorInit", "init_plan", "stable_seed", "init_tensor", "init_weights"]


@dataclass(frozen=True, slots=True)
class TensorInit:
    """How to materialise one stored tensor: its full dotted name, shape, dtype and N(mean, std^2) law."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    mean: float
    std: float

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, tensor name), stable across processes and Python versions."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _law(module: nn.Module, param_name: str, qualified: str) -> tuple[float, float]:
    if isinstance(module, RMSNorm):
        return 1.0, 0.1
    if isinstance(module, nn.Linear):
        if param_name == "weight":
            return 0.0, getattr(module, "init_gain", 1.0) / math.sqrt(module.in_features)
        return 0.0, 0.02
    if isinstance(module, nn.Embedding):
        return 0.0, 1.0
    if param_name == "pos_embed":
        return 0.0, 0.1
    raise ValueError(
        f"no initialisation rule for {qualified!r} ({type(module).__name__}.{param_name}): "
        f"add one to dlo_fn.models.init._law"
    )


def init_plan(model: nn.Module) -> tuple[TensorInit, ...]:
    """One :class:`TensorInit` per parameter and persistent buffer, in ``state_dict`` order (works on meta)."""
    plan = []
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        persistent = [
            (n, t) for n, t in module._buffers.items() if t is not None and n not in module._non_persistent_buffers_set
        ]
        for name, tensor in [*module._parameters.items(), *persistent]:
            if tensor is None:
                continue
            mean, std = _law(module, name, prefix + name)
            plan.append(TensorInit(prefix + name, tuple(tensor.shape), tensor.dtype, mean, std))
    return tuple(plan)


def init_tensor(spec: TensorInit, seed: int) -> torch.Tensor:
    """Materialise one tensor on the CPU (contiguous, ``spec.dtype``)."""
    generator = torch.Generator(device="cpu").manual_seed(stable_seed(seed, spec.name))
    values = torch.randn(spec.shape, generator=generator, dtype=torch.float32)
    if spec.std != 1.0:
        values.mul_(spec.std)
    if spec.mean != 0.0:
        values.add_(spec.mean)
    return values.to(spec.dtype)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter and persistent buffer of a materialised model in place from (seed, name)."""
    state = model.state_dict(keep_vars=True)
    for spec in init_plan(model):
        state[spec.name].copy_(init_tensor(spec, seed))
