"""FP8 shards at run time: quantising a rank's own pieces, the dequantise op, and the reference ``fake_quantize``.

The math and which tensors it applies to are :mod:`dlo_fn.plan.quant`'s. Quantisation runs on the host, row by row
(a row is one output channel, whose scale needs only that row), or on the device where there is one (the same
bits; ``tests/test_quant.py`` crosses the two on a GPU): :class:`StoredBlock` hands ``build_host_store`` the
stored tensors of a block, computing only the rows that cover the bytes a piece asks for, so a rank reads and
quantises its own share of the checkpoint and never holds a whole FP8 (or BF16) copy. :func:`dequantize_into` is
the one dequantise kernel: the executor's DQ op and :func:`fake_quantize` both call it, so the offloaded model and
the fake-quantised resident one compute from the same bits. :func:`output_error` measures what the bits cost
against the unquantised model's output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from dlo_fn.plan.layout import BlockLayout
from dlo_fn.plan.quant import FP8_DTYPE, FP8_MAX, SCALE_SUFFIX, quantized
from dlo_fn.plan.spec import spec_from_module

__all__ = ["quantize_rows", "dequantize_into", "StoredBlock", "dequant_ops", "TorchDequant", "fake_quantize",
           "fp32_modules", "OutputError", "output_error"]


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of the rows of ``w`` (dimension 0 = output channels; module doc of plan.quant), on ``w``'s
    device: IEEE float32 division and c10's one e4m3 conversion give the same bits on the host and on a GPU (the
    CUDA tests compare a host-quantised offload with a GPU fake-quantised model)."""
    rows = w.detach().reshape(w.shape[0], -1).float()
    amax = rows.abs().amax(dim=1)
    # Divided by a tensor, not a Python number: CUDA multiplies by the reciprocal of a host scalar, which rounds
    # differently from the host's division; a tensor divisor is an IEEE division on both.
    scale = torch.where(amax > 0, amax / amax.new_full((), FP8_MAX), torch.ones_like(amax))
    q = (rows / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(w.shape), scale


def dequantize_into(dst: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``dst = dtype(float32(q) * scale)`` without a float32 temporary: every e4m3 value is exact in bf16, fp16 and
    fp32, so ``dst.copy_(q)`` loses nothing, and the in-place multiply by the float32 scale computes in float32 and
    rounds once into ``dst``'s dtype (two kernels; ``tests/test_quant.py`` checks the bits against the formula)."""
    dst.copy_(q)
    return dst.mul_(scale.view(-1, *(1,) * (q.dim() - 1)))


class StoredBlock(Mapping):
    """A block's stored tensors (FP8, scales and the unquantised ones) for ``build_host_store``: an unquantised
    tensor is the module's own (an mmap view); a quantised one and its scales are computed on first access, only
    for the rows that cover ``needed[name]`` (the byte ranges this rank's pieces read), the rest left unwritten
    (pages never touched). The last tensor computed is kept, so a piece that follows another of the same tensor
    costs nothing more."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], stored: BlockLayout,
                 needed: Mapping[str, Sequence[tuple[int, int]]], device: torch.device | None = None) -> None:
        self._tensors, self._stored, self._needed = tensors, stored, needed
        self._device = device  # where the rows are quantised (the same bits on the host and a GPU; faster there)
        self._fp8 = {p.name for p in stored.placements if p.dtype == FP8_DTYPE}
        self._last: tuple[str, torch.Tensor] | None = None

    def __iter__(self) -> Iterator[str]:
        return (p.name for p in self._stored.placements)

    def __len__(self) -> int:
        return len(self._stored.placements)

    def __getitem__(self, name: str) -> torch.Tensor:
        source = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
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


def needed_ranges(pieces: Sequence) -> dict[str, list[tuple[int, int]]]:
    """Per stored tensor, the source byte ranges ``pieces`` (one rank's, of one block) read."""
    out: dict[str, list[tuple[int, int]]] = {}
    for p in pieces:
        out.setdefault(p.tensor, []).append((p.src_start, p.src_stop))
    return out


def dequant_ops(staging: torch.Tensor, slot: torch.Tensor, stored: BlockLayout, compute: BlockLayout
                ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], ...]:
    """The DQ op of one block: per compute tensor ``(slot view, stored view, scale view or None)``, dequantised
    (:func:`dequantize_into`) or copied as it is."""

    def view(buf: torch.Tensor, p) -> torch.Tensor:
        return buf[p.offset_bytes : p.offset_bytes + p.nbytes].view(p.dtype).view(p.shape)

    out = []
    for p in compute.placements:
        src = stored.placement(p.name)
        scale = view(staging, stored.placement(p.name + SCALE_SUFFIX)) if src.dtype == FP8_DTYPE else None
        out.append((view(slot, p), view(staging, src), scale))
    return tuple(out)


class TorchDequant:
    """The executor's DQ op through torch ops: per tensor a cast and a multiply (:func:`dequantize_into`), or a
    copy. The CUDA plug-in (:mod:`dlo_fn.runtime.cuda.dequant`) does a block in one kernel launch, with the same
    bits; an object with this ``prepare`` is what the executor takes."""

    name = "torch"

    def prepare(self, staging: torch.Tensor, slot: torch.Tensor, stored: BlockLayout, compute: BlockLayout):
        """The call that dequantises ``staging`` (a stored block) into ``slot`` on the current stream."""
        ops = dequant_ops(staging, slot, stored, compute)

        def run() -> None:
            for dst, src, scale in ops:
                if scale is None:
                    dst.copy_(src)
                else:
                    dequantize_into(dst, src, scale)

        return run


def fp32_modules(model: nn.Module) -> tuple[str, ...]:
    """The module names a diffusers model keeps in fp32 (never quantised), none for other models."""
    return tuple(getattr(model, "_keep_in_fp32_modules", None) or ())


@torch.no_grad()
def fake_quantize(model: nn.Module, block_paths: str | Sequence[str] | None = None,
                  exclude: Sequence[str] = ()) -> nn.Module:
    """In place: every block weight that ``offload(..., quantization="fp8")`` stores as FP8 becomes
    ``dequantise(quantise(w))`` in its own dtype, on its own device: the reference the offloaded model equals
    bit for bit. ``block_paths`` as ``offload`` takes them (None: the model's own block lists); ``exclude`` adds
    to the model's fp32 modules. A model loaded from a quantised checkpoint (:mod:`dlo_fn.io.quantized`) gets
    its stored weights dequantised, each into a new tensor of its module's dtype (the arguments are the
    checkpoint's then)."""
    from dlo_fn.io.quantized import drop_stored, stored_weights

    stored = stored_weights(model)
    if stored is not None:
        for name, (q, scale) in stored.tensors.items():
            path, _, attr = name.rpartition(".")
            owner = model.get_submodule(path)
            table = owner._parameters if attr in owner._parameters else owner._buffers
            w = torch.empty(table[attr].shape, dtype=table[attr].dtype)
            dequantize_into(w, q, scale)
            table[attr] = nn.Parameter(w, requires_grad=False) if table is owner._parameters else w
        drop_stored(model)
        return model
    if block_paths is None:
        from dlo_fn.io.diffusers_load import block_paths_for

        block_paths = block_paths_for(model)
    spec = spec_from_module(model, block_paths)
    exclude = tuple(exclude) + fp32_modules(model)
    for block in spec.blocks:
        module = model.get_submodule(block.name)
        for t in block.tensors:
            if quantized(t, block.name, exclude):
                w = module.get_parameter(t.name) if t.kind == "param" else module.get_buffer(t.name)
                q, scale = quantize_rows(w)
                dequantize_into(w, q.to(w.device), scale.to(w.device))
    return model


@dataclass(frozen=True, slots=True)
class OutputError:
    """How far an output ``y`` is from its reference ``r`` (:func:`output_error`), over every element::

        rel_l2  = ||y - r||_2 / ||r||_2          max_abs = max |y - r|          cosine = <y, r> / (||y|| ||r||)
    """

    rel_l2: float
    max_abs: float
    cosine: float
    num_elements: int


def output_error(got: torch.Tensor, want: torch.Tensor) -> OutputError:
    """:class:`OutputError` of ``got`` against ``want`` (same shape), computed on the host in float64, so the
    measure adds next to no rounding of its own: equal outputs give exactly ``rel_l2 = max_abs = 0.0`` and
    ``cosine = 1.0`` (two zero tensors too); a zero ``want`` with a non-zero ``got`` has ``rel_l2`` inf and
    ``cosine`` 0."""
    if got.shape != want.shape:
        raise ValueError(f"output_error: shapes differ, {tuple(got.shape)} against {tuple(want.shape)}")
    y, r = (t.detach().to("cpu", torch.float64).reshape(-1) for t in (got, want))
    diff, ref = (y - r).norm().item(), r.norm().item()
    norms = y.norm().item() * ref
    return OutputError(
        rel_l2=diff / ref if ref > 0 else (0.0 if diff == 0 else float("inf")),
        max_abs=(y - r).abs().max().item() if y.numel() else 0.0,
        cosine=1.0 if diff == 0 else max(-1.0, min(1.0, (y @ r).item() / norms)) if norms > 0 else 0.0,
        num_elements=y.numel())
