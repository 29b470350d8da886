"""FP8 shards' dequantise op as one kernel launch per block (Triton): ``OffloadOptions(dequant="kernel")``.

The core's DQ op (:class:`~dlo_fn.runtime.quant.TorchDequant`) is two torch kernels per tensor: a cast, then a
multiply by the row scales whose mixed dtypes (a bf16 tensor, float32 scales) take torch's per-element casting
path. On the H200 that dequantised about 0.3 TB of output per second, and a DQ op runs on multiprocessors the
block before it needs: its time adds to the step (``docs/performance.md``). Here one launch does the block: the
grid has a program per (tensor, row, column tile); a program finds its tensor among the block's by counting the
tensors' first programs at or below its own, so the descriptors are one small table per (block, slot), and loads
one scale, a tile of FP8 bytes (16-byte vectors where the rows allow) and stores the tile in the slot's dtype.

Bits: ``dtype(float32(q) * scale)`` with float32 arithmetic and one round-to-nearest-even into the slot's dtype,
as :func:`~dlo_fn.runtime.quant.dequantize_into` computes it; unquantised tensors are copied byte for byte
(``tests/test_quant.py`` compares the two on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlo_fn.plan.layout import BlockLayout
from dlo_fn.plan.quant import FP8_DTYPE, SCALE_SUFFIX

__all__ = ["KernelDequant"]

TILE = 2048
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _dequant(src, dst, desc, first, NUM: tl.constexpr, TILE: tl.constexpr, OUT: tl.constexpr,
             ALIGNED: tl.constexpr):
    # desc row j (int64): kind (0: FP8 rows, 1: bytes as one row), source byte offset, destination element offset,
    # scale byte offset, row length (elements or bytes), tiles per row; first[j]: the tensor's first program.
    pid = tl.program_id(0)
    j = tl.sum((tl.load(first + tl.arange(0, NUM)) <= pid).to(tl.int32)) - 1
    row = desc + j * 6
    kind, src_at, dst_at, scale_at = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    row_len, tiles = tl.load(row + 4), tl.load(row + 5)
    t = pid - tl.load(first + j)
    r, c = t // tiles, (t % tiles) * TILE
    cols = c + tl.arange(0, TILE)
    mask = cols < row_len
    at = r * row_len + c
    if ALIGNED:  # every row starts on 16 bytes: vector loads and stores
        at = tl.multiple_of(at, 16)
        src_at = tl.multiple_of(src_at, 16)
        dst_at = tl.multiple_of(dst_at, 16)
    if kind == 0:
        q = tl.load((src + src_at).to(tl.pointer_type(tl.float8e4nv)) + at + tl.arange(0, TILE), mask=mask)
        scale = tl.load((src + scale_at).to(tl.pointer_type(tl.float32)) + r)
        out = (q.to(tl.float32) * scale).to(OUT, fp_downcast_rounding="rtne")
        tl.store(dst.to(tl.pointer_type(OUT)) + dst_at + at + tl.arange(0, TILE), out, mask=mask)
    else:
        b = tl.load(src + src_at + at + tl.arange(0, TILE), mask=mask)
        tl.store(dst + dst_at + at + tl.arange(0, TILE), b, mask=mask)


class KernelDequant:
    """The dequantiser the executor takes in place of the core's (``prepare``): one launch per block and per
    (slot dtype, alignment) its tensors need, usually one."""

    name = "kernel"

    def prepare(self, staging: torch.Tensor, slot: torch.Tensor, stored: BlockLayout, compute: BlockLayout):
        groups: dict[tuple, list[tuple[int, ...]]] = {}
        for p in compute.placements:
            src = stored.placement(p.name)
            if src.dtype == FP8_DTYPE:
                rows, row_len = src.shape[0], src.nbytes // src.shape[0]
                scale = stored.placement(p.name + SCALE_SUFFIX).offset_bytes
                item = p.dtype.itemsize
                aligned = row_len % 16 == 0 and src.offset_bytes % 16 == 0 and p.offset_bytes % (16 * item) == 0
                key, d = (p.dtype, aligned), (0, src.offset_bytes, p.offset_bytes // item, scale, row_len)
            else:  # its bytes, as one row
                rows, row_len = 1, p.nbytes
                aligned = row_len % 16 == 0 and src.offset_bytes % 16 == 0 and p.offset_bytes % 16 == 0
                key, d = (torch.uint8, aligned), (1, src.offset_bytes, p.offset_bytes, 0, row_len)
            if row_len:
                groups.setdefault(key, []).append((*d, -(-row_len // TILE), rows))
        launches = []
        for (dtype, aligned), descs in groups.items():
            out = _TL.get(dtype, tl.float32)  # a byte-copy-only launch: its OUT is never stored
            num = triton.next_power_of_2(len(descs))
            starts, total = [], 0
            for d in descs:
                starts.append(total)
                total += d[5] * d[6]
            starts += [1 << 62] * (num - len(starts))  # padding: never at or below a program id
            table = torch.tensor([d[:6] for d in descs], dtype=torch.int64, device=slot.device).reshape(-1)
            launches.append((table, torch.tensor(starts, dtype=torch.int64, device=slot.device), total, num, out,
                             aligned))

        def run() -> None:
            for table, starts, total, num, out, aligned in launches:
                _dequant[(total,)](staging, slot, table, starts, NUM=num, TILE=TILE, OUT=out, ALIGNED=aligned)

        return run
