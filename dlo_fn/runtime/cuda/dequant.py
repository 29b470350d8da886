"""FP8 shards' dequantise op as ONE kernel launch per block (Triton): ``OffloadOptions(dequant="kernel")``.

The core's DQ op (:class:`~dlo_fn.runtime.quant.TorchDequant`) is two torch kernels per tensor (a cast, a multiply by
the row scales) and a copy per unquantised tensor: ~30 launches for a DiT block. They run on the all-gather stream
beside the block before, and a compute kernel that holds every multiprocessor until it ends (a GEMM) lets the next
launch in only between its own kernels, so a block's DQ finished after that block's compute, not during it: on the
H200 the bench block (0.56 GB) then cost ~1.9 ms more per block, video and image alike (``docs/performance.md``).
Here one launch does the block: each program takes a tile of one tensor from a descriptor table built once per
(block, slot), so the whole DQ needs one gap between two compute kernels.

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

TILE = 4096
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _dequant(src, dst, table, TILE: tl.constexpr, OUT: tl.constexpr):
    # table row (int64): kind (0: FP8 tile, 1: byte tile), source byte offset, destination byte offset, scale byte
    # offset, elements per row, first element (or byte) of the tile, its count
    row = table + tl.program_id(0) * 7
    kind, src_at, dst_at, scale_at = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    row_len, first, count = tl.load(row + 4), tl.load(row + 5), tl.load(row + 6)
    i = first + tl.arange(0, TILE)
    mask = i < first + count
    if kind == 0:
        q = tl.load((src + src_at).to(tl.pointer_type(tl.float8e4nv)) + i, mask=mask)
        scale = tl.load((src + scale_at).to(tl.pointer_type(tl.float32)) + i // row_len, mask=mask)
        out = (q.to(tl.float32) * scale).to(OUT, fp_downcast_rounding="rtne")
        tl.store((dst + dst_at).to(tl.pointer_type(OUT)) + i, out, mask=mask)
    else:
        tl.store(dst + dst_at + i, tl.load(src + src_at + i, mask=mask), mask=mask)


class KernelDequant:
    """The dequantiser the executor takes in place of the core's (``prepare``): one launch per block and
    compute dtype (a block whose FP8 weights compute in two dtypes takes two)."""

    name = "kernel"

    def prepare(self, staging: torch.Tensor, slot: torch.Tensor, stored: BlockLayout, compute: BlockLayout):
        rows: dict[torch.dtype, list[tuple[int, ...]]] = {}
        for p in compute.placements:
            src = stored.placement(p.name)
            if src.dtype == FP8_DTYPE:
                scale = stored.placement(p.name + SCALE_SUFFIX).offset_bytes
                n, per_row = src.nbytes, src.nbytes // src.shape[0]
                rows.setdefault(p.dtype, []).extend(
                    (0, src.offset_bytes, p.offset_bytes, scale, per_row, i, min(TILE, n - i)) for i in range(0, n, TILE))
            else:  # copied as it is: its bytes, in any launch
                rows.setdefault(next(iter(rows), p.dtype), []).extend(
                    (1, src.offset_bytes, p.offset_bytes, 0, 1, i, min(TILE, p.nbytes - i))
                    for i in range(0, p.nbytes, TILE))
        launches = [(torch.tensor(t, dtype=torch.int64, device=slot.device).reshape(-1), _TL[d])
                    for d, t in rows.items() if t]

        def run() -> None:
            for table, out in launches:
                _dequant[(table.numel() // 7,)](staging, slot, table, TILE=TILE, OUT=out)

        return run
