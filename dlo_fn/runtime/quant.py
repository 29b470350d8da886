"""FP8 shards at run time: quantising a rank's own pieces, the dequantise op, and the reference ``fake_quantize``.

The math and which tensors it applies to are :mod:`dlo_fn.plan.quant`'s. A row (one output channel) needs only its
own scale, so :class:`StoredBlock` quantises only the rows a rank's pieces read: no rank holds a whole FP8 (or BF16)
copy. :func:`dequantize_into` is the one dequantise kernel, called by the executor's DQ op and by
:func:`fake_quantize`, so the offloaded model and the fake-quantised resident one compute from the same bits
(their cost against BF16: :func:`benchmarks.bench.fp8_quality.output_error`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from dlo_fn.plan.layout import BlockLayout
from dlo_fn.plan.quant import FP8_DTYPE, FP8_MAX, SCALE_SUFFIX, quantized_tensors
from dlo_fn.plan.spec import spec_from_module
from dlo_fn.runtime.blocks import make_views

__all__ = [
    "quantize_rows",
    "dequantize_into",
    "StoredBlock",
    "QuantizeOnLoad",
    "needed_ranges",
    "TorchDequant",
    "fake_quantize",
    "fp32_modules",
]


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of the rows of ``w`` (dimension 0 = output channels; module doc of plan.quant), on ``w``'s
    device: the same bits on the host and a GPU (``tests/test_quant.py`` crosses the two on CUDA)."""
    rows = w.detach().reshape(w.shape[0], -1).float()
    amax = rows.abs().amax(dim=1)
    # Divided by a tensor, not a Python number: CUDA multiplies by the reciprocal of a host scalar, which rounds
    # differently from the host's division; a tensor divisor is an IEEE division on both.
    scale = torch.where(amax > 0, amax / amax.new_full((), FP8_MAX), torch.ones_like(amax))
    q = (rows / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(w.shape), scale


def dequantize_into(dst: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``dst = dtype(float32(q) * scale)`` without a float32 temporary: every e4m3 value is exact in bf16, fp16 and
    fp32, so ``dst.copy_(q)`` loses nothing, and the in-place multiply by the float32 scale computes in float32 and
    rounds once into ``dst``'s dtype (two kernels; ``tests/test_quant.py`` checks the bits against the formula).
    ``scale`` None: a tensor stored as computed, copied."""
    dst.copy_(q)
    return dst if scale is None else dst.mul_(scale.view(-1, *(1,) * (q.dim() - 1)))


class StoredBlock(Mapping):
    """A block's stored tensors for ``build_host_store``: an unquantised tensor is the module's own (an mmap view);
    a quantised one and its scales are computed on first access, only for the rows covering ``needed[name]`` (the
    byte ranges this rank's pieces read; other pages never touched), the last one computed kept for the next piece."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        stored: BlockLayout,
        needed: Mapping[str, Sequence[tuple[int, int]]],
        device: torch.device | None = None,
    ) -> None:
        self._tensors, self._stored, self._needed = tensors, stored, needed
        self._device = device  # where the rows are quantised (the same bits on the host and a GPU; faster there)
        self._fp8 = {p.name for p in stored.placements if p.dtype == FP8_DTYPE}
        self._last: tuple[str, torch.Tensor] | None = None

    def __iter__(self) -> Iterator[str]:
        return (p.name for p in self._stored.placements)

    def __len__(self) -> int:
        return len(self._stored.placements)

    def __getitem__(self, name: str) -> torch.Tensor:
        source = name.removesuffix(SCALE_SUFFIX)
        if source not in self._fp8:
            return self._tensors[name]
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        w = self._tensors[source]
        row_bytes = w.numel() // w.shape[0] if name == source else 4  # an FP8 row, or one float32 scale
        out = torch.empty(w.shape, dtype=FP8_DTYPE) if name == source else torch.empty(w.shape[0])
        for lo, hi in self._needed.get(name, ()):
            r0, r1 = lo // row_bytes, -(-hi // row_bytes)
            q, scale = quantize_rows(w[r0:r1].to(self._device or w.device))
            out[r0:r1] = q if name == source else scale
        self._last = (name, out)
        return out


@dataclass(frozen=True, slots=True)
class QuantizeOnLoad:
    """The stored weights of a model quantised as it is offloaded: the interface of a quantised checkpoint's
    (:class:`dlo_fn.io.quantized.StoredWeights`), so ``offload`` fills the host store one way from either. A block's
    FP8 rows and scales are computed as the store reads them (:class:`StoredBlock`, on ``device`` where given: the
    same bits), and only those the rank's pieces read."""

    exclude: tuple[str, ...]
    device: torch.device | None = None
    files: tuple[str, ...] = ()  # no checkpoint files of its own: the model's views are released as usual

    def check(self, fp8: set[str], paths: tuple[str, ...]) -> None:
        """Nothing to check: the FP8 tensors are the layout's by construction."""

    def block(self, stored: BlockLayout, tensors: Mapping[str, torch.Tensor], pieces: Sequence) -> StoredBlock:
        return StoredBlock(tensors, stored, needed_ranges(pieces), self.device)


def needed_ranges(pieces: Sequence) -> dict[str, list[tuple[int, int]]]:
    """Per stored tensor, the source byte ranges ``pieces`` (one rank's, of one block) read."""
    out: dict[str, list[tuple[int, int]]] = {}
    for p in pieces:
        out.setdefault(p.tensor, []).append((p.src_start, p.src_stop))
    return out


class TorchDequant:
    """The executor's DQ op through torch ops: per tensor a cast and a multiply (:func:`dequantize_into`), or a
    copy. The CUDA plug-in (:mod:`dlo_fn.runtime.cuda.dequant`) does a block in one kernel launch, with the same
    bits; an object with this ``prepare`` is what the executor takes."""

    name = "torch"

    def prepare(self, staging: torch.Tensor, slot: torch.Tensor, stored: BlockLayout, compute: BlockLayout):
        """The call that dequantises ``staging`` (a stored block) into ``slot`` on the current stream."""
        src, dst = make_views(staging, stored, {}), make_views(slot, compute, {})
        ops = tuple((d, src[n], src[n + SCALE_SUFFIX] if src[n].dtype == FP8_DTYPE else None) for n, d in dst.items())

        def run() -> None:
            for d, q, scale in ops:
                dequantize_into(d, q, scale)

        return run


def fp32_modules(model: nn.Module) -> tuple[str, ...]:
    """The module names a diffusers model keeps in fp32 (never quantised), none for other models."""
    return tuple(getattr(model, "_keep_in_fp32_modules", None) or ())


@torch.no_grad()
def fake_quantize(
    model: nn.Module, block_paths: str | Sequence[str] | None = None, exclude: Sequence[str] = ()
) -> nn.Module:
    """In place: every block weight that ``offload(..., quantization="fp8")`` stores as FP8 becomes
    ``dequantise(quantise(w))`` in its own dtype, on its own device: the reference the offloaded model equals bit
    for bit. ``block_paths`` as ``offload`` takes them (None: the model's own); ``exclude`` adds to the model's fp32
    modules. A model loaded from a quantised checkpoint (:mod:`dlo_fn.io.quantized`) gets its stored weights
    dequantised, each into a new tensor of its module's dtype (the arguments are the checkpoint's then)."""
    from dlo_fn.io.bind import drop_stored, stored_weights
    from dlo_fn.io.diffusers_load import block_paths_for

    stored = stored_weights(model)
    if stored is not None:
        for name, (q, scale) in stored.tensors.items():
            path, _, attr = name.rpartition(".")
            owner = model.get_submodule(path)
            declared = getattr(owner, attr)  # on meta, in the module's dtype
            w = dequantize_into(torch.empty(declared.shape, dtype=declared.dtype), q, scale)
            setattr(owner, attr, nn.Parameter(w, requires_grad=False) if attr in owner._parameters else w)
        drop_stored(model)
        return model
    spec = spec_from_module(model, block_paths_for(model) if block_paths is None else block_paths)
    for name, t in quantized_tensors(spec, tuple(exclude) + fp32_modules(model)).items():
        w = model.get_parameter(name) if t.kind == "param" else model.get_buffer(name)
        dequantize_into(w, *quantize_rows(w))  # both on w's device
    return model
