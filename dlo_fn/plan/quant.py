"""Quantised shards: which block tensors are stored as FP8, and what a block stores against what it computes with.

``quantization="fp8"``: every floating tensor of a block with two or more dimensions (a Linear's ``(out, in)``
weight, a conv's ``(out, in, ...)``) is stored as ``float8_e4m3fn`` with one float32 scale per output channel
(dimension 0), and dequantised on the device into its slot in the compute dtype::

    s_o = amax_o / 448            (1 where amax_o = 0; 448 is the largest finite e4m3 value)
    q   = e4m3(clamp(w / s_o, -448, 448))        round to nearest, in float32
    w'  = dtype(float32(q) * s_o)                what the slot holds, and what ``fake_quantize`` writes

One-dimensional tensors (norms, biases), non-floating ones, and tensors under a module named in ``exclude`` (the
modules a diffusers model keeps in fp32, ``_keep_in_fp32_modules``, and any the user names) stay as they are.

The *stored* block (:func:`stored_block`) lists, in the block's order, every tensor as it is stored: a quantised
one as FP8 under its own name followed by its scales under ``<name>_scale`` (float32, ``(out,)``). The shard
layout is built from the stored blocks (host arena, H2D, all-gather: about half the bytes of bf16), the slots from
the compute blocks (:class:`~dlo_fn.plan.layout.ModelLayout`'s ``compute``), and a dequantise op per load writes
one from the other ("Quantised loads" in :mod:`dlo_fn.plan.lowering`). Pure: no tensor data is touched here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from dlo_fn.plan.spec import BlockSpec, ModelSpec, TensorSpec

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "SCALE_SUFFIX",
    "check_quantization",
    "Quantization",
    "as_quantization",
    "quantized",
    "quantized_tensors",
    "stored_block",
    "stored_spec",
    "compute_block",
    "dequant_seconds",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_SUFFIX = "_scale"
_FLOATING = (torch.float32, torch.bfloat16, torch.float16)


def check_quantization(quantization: "str | Quantization | None") -> str | None:
    """The format (``"fp8"``) of a quantisation option value, or None; anything else is a ``ValueError``."""
    if isinstance(quantization, Quantization):
        return quantization.format
    if quantization not in (None, "fp8"):
        raise ValueError(
            f"quantization must be None or 'fp8' (FP8 e4m3 weights, one float32 scale per output "
            f"channel); got {quantization!r}"
        )
    return quantization


@dataclass(frozen=True, slots=True)
class Quantization:
    """A storage codec as an option value (``OffloadOptions.quantization``): its ``format`` (``"fp8"``) and the
    modules it keeps as they are (``exclude``, besides a diffusers model's fp32 ones). ``str()`` is the format."""

    format: str = "fp8"
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_quantization(self.format)
        if self.format is None:
            raise ValueError("Quantization needs a format ('fp8'); for none pass quantization=None")
        if isinstance(self.exclude, str) or not all(isinstance(m, str) for m in self.exclude):
            raise ValueError(f"Quantization exclude must be a tuple of module names, got {self.exclude!r}")
        object.__setattr__(self, "exclude", tuple(self.exclude))

    def __str__(self) -> str:
        return self.format


def as_quantization(value: "str | Quantization | None") -> Quantization | None:
    """``"fp8"`` -> ``Quantization("fp8")``; a :class:`Quantization` or None as it is; anything else is a
    ``ValueError`` saying what is taken."""
    if value is None or isinstance(value, Quantization):
        return value
    if isinstance(value, str):
        return Quantization(value)
    raise ValueError(f"quantization must be None, 'fp8' or a Quantization('fp8', exclude=(...)); got {value!r}")


def quantized(tensor: TensorSpec, block: str, exclude: Sequence[str] = ()) -> bool:
    """Whether ``tensor`` of block ``block`` is stored as FP8: floating, two or more dimensions, and no module
    named in ``exclude`` on its path (``exclude`` names match whole dotted components, as diffusers matches its
    ``_keep_in_fp32_modules``)."""
    parts = f"{block}.{tensor.name}".split(".")
    return (
        tensor.dtype in _FLOATING
        and len(tensor.shape) >= 2
        and tensor.shape[0] > 0
        and not any(name in parts for name in exclude)
    )


def quantized_tensors(spec: ModelSpec, exclude: Sequence[str] = ()) -> dict[str, TensorSpec]:
    """Dotted name -> tensor, for every block tensor of ``spec`` stored as FP8 (:func:`quantized`)."""
    return {f"{b.name}.{t.name}": t for b in spec.blocks for t in b.tensors if quantized(t, b.name, exclude)}


def stored_block(block: BlockSpec, exclude: Sequence[str] = ()) -> BlockSpec:
    """``block`` as FP8 shards store it (module doc); an already stored block (FP8 tensors with their scales, as
    a ``quantize``d checkpoint holds them) is returned as it is."""
    if any(t.dtype == FP8_DTYPE for t in block.tensors):
        return block
    tensors: list[TensorSpec] = []
    for t in block.tensors:
        tensors += (
            [
                TensorSpec(t.name, t.shape, FP8_DTYPE, t.kind),
                TensorSpec(t.name + SCALE_SUFFIX, (t.shape[0],), torch.float32, "buffer"),
            ]
            if quantized(t, block.name, exclude)
            else [t]
        )
    return BlockSpec(block.name, tuple(tensors))


def compute_block(stored: BlockSpec, dtype: torch.dtype) -> BlockSpec:
    """The block a stored FP8 block dequantises into: each FP8 tensor in ``dtype``, its scales dropped."""
    fp8 = {t.name for t in stored.tensors if t.dtype == FP8_DTYPE}
    kept = (t for t in stored.tensors if not (t.name.endswith(SCALE_SUFFIX) and t.name[: -len(SCALE_SUFFIX)] in fp8))
    return BlockSpec(
        stored.name, tuple(replace(t, dtype=dtype, residue_bytes=0) if t.dtype == FP8_DTYPE else t for t in kept)
    )


def stored_spec(spec: ModelSpec, exclude: Sequence[str] = ()) -> ModelSpec:
    """Every block of ``spec`` as FP8 shards store it; the resident tensors unchanged."""
    return replace(spec, blocks=tuple(stored_block(b, exclude) for b in spec.blocks))


def dequant_seconds(stored_bytes: float, compute_bytes: float, device_bytes_per_s: float) -> float:
    """A dequantise op's time on a memory-bound device: read the stored block, write the slot."""
    return (stored_bytes + compute_bytes) / device_bytes_per_s
