"""FP8 shards' dequantise op as one kernel launch per block (Triton): ``OffloadOptions(dequant="kernel")``.

The core's DQ op (:class:`~dlo_fn.runtime.quant.TorchDequant`) is two torch kernels per tensor: a cast, then a
multiply by the row scales whose mixed dtypes (a bf16 tensor, float32 scales) take torch's per-element casting
path. A DQ op runs on multiprocessors the block before it needs, so its time adds to the step
(``docs/performance.md``). Here one launch does a block's FP8 tensors: a program per (tensor, row) finds its tensor
among the block's by counting the tensors' first rows at or below its own (one small descriptor table per
(block, slot)), loads the row's scale once and walks the row in tiles that divide it, so no load or store is
masked and each moves 16-byte vectors (rows that are no whole number of vectors take a masked loop). The
unquantised tensors (norms, biases, excluded modules) are copied byte for byte by a second launch over fixed
tiles. What it saves against torch ops: ``docs/performance.md`` (``figures/data/fp8_dequant_flux_nvidia-h200.json``).

Bits: ``dtype(float32(q) * scale)`` with float32 arithmetic and one round-to-nearest-even into the slot's dtype,
as :func:`~dlo_fn.runtime.quant.dequantize_into` computes it (``tests/test_quant.py`` compares the two on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlo_fn.plan.layout import BlockLayout
from dlo_fn.plan.quant import FP8_DTYPE, SCALE_SUFFIX

__all__ = ["KernelDequant"]

MAX_TILE = 4096  # elements per step of a row: the largest power of two up to this that divides every row
COPY_TILE = 4096  # bytes per program of a copy
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _dequant_rows(
    src,
    dst,
    desc,
    first,
    NUM: tl.constexpr,
    TILE: tl.constexpr,
    OUT: tl.constexpr,
    ALIGN: tl.constexpr,
    EVEN: tl.constexpr,
):
    # desc row j (int64): source byte offset, destination element offset, scale byte offset, row length
    # (elements); first[j]: the tensor's first program (= row) among the launch's. EVEN: TILE divides every row
    # and every start is 16-byte aligned (ALIGN: the elements in 16 bytes of OUT), so nothing is masked.
    pid = tl.program_id(0)
    j = tl.sum((tl.load(first + tl.arange(0, NUM)) <= pid).to(tl.int32)) - 1
    row = desc + j * 4
    src_at, dst_at, scale_at, row_len = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    r = (pid - tl.load(first + j)).to(tl.int64)
    scale = tl.load((src + scale_at).to(tl.pointer_type(tl.float32)) + r)
    if EVEN:
        start = tl.multiple_of(r * tl.multiple_of(row_len, TILE), TILE)
        q_row = (src + tl.multiple_of(src_at, 16)).to(tl.pointer_type(tl.float8e4nv)) + start
        out_row = dst.to(tl.pointer_type(OUT)) + tl.multiple_of(dst_at, ALIGN) + start
        for k in range(0, row_len // TILE):  # a multiple of TILE the compiler can see: unmasked 16-byte vectors
            cols = k * TILE + tl.arange(0, TILE)
            q = tl.load(q_row + cols)
            tl.store(out_row + cols, (q.to(tl.float32) * scale).to(OUT, fp_downcast_rounding="rtne"))
    else:
        q_row = (src + src_at).to(tl.pointer_type(tl.float8e4nv)) + r * row_len
        out_row = dst.to(tl.pointer_type(OUT)) + dst_at + r * row_len
        for c in range(0, row_len, TILE):
            cols = c + tl.arange(0, TILE)
            mask = cols < row_len
            q = tl.load(q_row + cols, mask=mask)
            tl.store(out_row + cols, (q.to(tl.float32) * scale).to(OUT, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _copy_bytes(src, dst, desc, first, NUM: tl.constexpr, TILE: tl.constexpr):
    # desc row j: source byte offset, destination byte offset, bytes; first[j]: the tensor's first program.
    pid = tl.program_id(0)
    j = tl.sum((tl.load(first + tl.arange(0, NUM)) <= pid).to(tl.int32)) - 1
    row = desc + j * 3
    src_at, dst_at, nbytes = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    at = (pid - tl.load(first + j)).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = at < nbytes
    tl.store(dst + dst_at + at, tl.load(src + src_at + at, mask=mask), mask=mask)


def _tile(row_len: int) -> int:
    return min(MAX_TILE, row_len & -row_len)  # the largest power of two dividing the row, at most MAX_TILE


def _table(descs: list[tuple[int, ...]], programs: list[int], device: torch.device):
    """The descriptor table and each tensor's first program (padded to a power of two with never-reached ids)."""
    num = triton.next_power_of_2(len(descs))
    starts, total = [], 0
    for n in programs:
        starts.append(total)
        total += n
    starts += [1 << 62] * (num - len(starts))
    table = torch.tensor(descs, dtype=torch.int64, device=device).reshape(-1)
    return table, torch.tensor(starts, dtype=torch.int64, device=device), total, num


class KernelDequant:
    """The dequantiser the executor takes in place of the core's (``prepare``): per block one launch per (slot
    dtype, row tile) its FP8 tensors need (usually one) and one for the tensors it copies."""

    name = "kernel"

    def prepare(self, staging: torch.Tensor, slot: torch.Tensor, stored: BlockLayout, compute: BlockLayout):
        rows: dict[tuple, tuple[list, list]] = {}
        copies: tuple[list, list] = ([], [])
        for p in compute.placements:
            src = stored.placement(p.name)
            if src.dtype == FP8_DTYPE and src.shape[0]:
                num_rows, row_len = src.shape[0], src.nbytes // src.shape[0]
                scale = stored.placement(p.name + SCALE_SUFFIX).offset_bytes
                item = p.dtype.itemsize
                # 16-byte vectors need 16-byte starts on both sides (the layout aligns every tensor) and rows
                # of whole vectors; other rows take the masked loop.
                even = not (src.offset_bytes % 16 or p.offset_bytes % 16 or row_len % 16)
                tile = _tile(row_len) if even else min(MAX_TILE, triton.next_power_of_2(row_len))
                descs, programs = rows.setdefault((p.dtype, tile, even), ([], []))
                descs.append((src.offset_bytes, p.offset_bytes // item, scale, row_len))
                programs.append(num_rows)
            elif p.nbytes:
                copies[0].append((src.offset_bytes, p.offset_bytes, p.nbytes))
                copies[1].append(-(-p.nbytes // COPY_TILE))
        launches = []
        for (dtype, tile, even), (descs, programs) in rows.items():
            table, starts, total, num = _table(descs, programs, slot.device)
            launches.append(
                (
                    _dequant_rows,
                    (total,),
                    (staging, slot, table, starts),
                    dict(
                        NUM=num,
                        TILE=tile,
                        OUT=_TL[dtype],
                        ALIGN=16 // dtype.itemsize,
                        EVEN=even,
                        num_warps=max(1, min(8, tile // 512)),
                    ),
                )
            )
        if copies[0]:
            table, starts, total, num = _table(*copies, slot.device)
            launches.append((_copy_bytes, (total,), (staging, slot, table, starts), dict(NUM=num, TILE=COPY_TILE)))

        def run() -> None:
            for kernel, grid, args, meta in launches:
                kernel[grid](*args, **meta)

        return run
