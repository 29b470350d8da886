"""Filling a rank's host arena at the host's speed (:func:`dlo_fn.runtime.host_store.build_host_store`).

For 25.8 GB on one H200 host: first touch of fresh pages 3.0 s, ``cudaHostRegister``
of touched pages 2.5 s, a multi-threaded copy from the page cache 0.5-0.7 s; registering fresh pages makes the driver
fault each one in on one thread. So the CUDA arena is allocated pageable in 2 MiB pages (:func:`huge_page_buffer`:
touch and register of 25.8 GB took 0.6 s and 0.7 s), the pieces are copied on several threads (``ctypes.memmove``
releases the GIL), the copies being the pages' first touch on every thread at once, and the arena is locked range
by range (about 1 GiB each, ending at block starts), each as soon as its pieces are in, on a thread of its own,
while the next ranges are copied. Only the gaps are zeroed. Each piece has its own byte range: the bytes do not
depend on the threads. W ranks on one host fill at the same time, so each takes its share of the cores
(:func:`fill_threads`): on a 2-core host, 2 gloo ranks filling 1.45 GB each took 2.2 s with 2 threads each and
0.8-1.2 s with one. Filling and locking 22 GB from the page cache on the H200 host, 1, 2 and 4 ranks together took
1.2, 1.3-1.6 and 1.2 s in 2 MiB pages against 2.9, 2.2-2.9 and 2.0 s in 4 KiB pages; locking the ranges during the
copy took 4 KiB pages to 2.2, 1.7-1.8 and 1.5-1.6 s and changed 2 MiB pages little (1.2 and 1.4 s for 1 and 2
ranks; ``figures/data/host_fill_pages_nvidia-h200.json``), and a rank's store of FLUX.1-dev from 1.34 s to 0.82 s
(``bench real``'s ``ready_*`` rows).
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from dlo_fn.plan.layout import ModelLayout

__all__ = ["huge_page_buffer", "fill_threads", "fill_arena", "pin_bounds", "PIN_RANGE_BYTES"]

PIN_RANGE_BYTES = 1 << 30  # a CUDA arena is registered in ranges of about this much, each once it is filled


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of pageable memory (a private anonymous mapping) advised ``MADV_HUGEPAGE``: where the kernel's
    transparent huge pages allow it (``madvise`` or ``always``), the first touch and ``cudaHostRegister`` handle one
    2 MiB page where they would handle 512 of 4 KiB. The tensor keeps the mapping alive."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(m, dtype=torch.uint8)


def fill_threads(nbytes: int, local_ranks: int = 1) -> int:
    """Threads one rank fills an arena of ``nbytes`` with: one below 256 MiB (threads keep ~150 kB of stacks and
    arenas), else its share of the CPUs this process may use among ``local_ranks`` ranks filling at once, at
    most 16."""
    if local_ranks < 1:
        raise ValueError(f"local_ranks must be >= 1, got {local_ranks}")
    return 1 if nbytes < 256 << 20 else max(1, min(16, len(os.sched_getaffinity(0)) // local_ranks))


def fill_arena(
    arena: torch.Tensor,
    tasks: Sequence[tuple[int, int, Any]],
    source: Callable[[Any], torch.Tensor],
    gaps: Sequence[tuple[int, int]],
    threads: int,
    bounds: Sequence[int] = (),
    on_full: Callable[[int, int], None] | None = None,
) -> tuple[list[tuple[int, int]], float, float]:
    """Zero the ``[lo, hi)`` gaps, then copy ``source(key)`` (flat uint8, called once per task on the thread that
    copies it) to ``arena[dst:]`` for each ``(dst, nbytes, key)`` on ``threads`` threads: range after range of
    ``bounds`` (increasing ends, the last the arena's size; no piece crosses one), largest first within a range.
    ``on_full(lo, hi)`` is called, on the thread that copied its last piece, as soon as a range is whole. Returns
    the source address ranges read, the copy seconds and the zeroing seconds."""
    t0 = time.perf_counter()
    for lo, hi in gaps:
        ctypes.memset(arena.data_ptr() + lo, 0, hi - lo)
    zero_s = time.perf_counter() - t0
    bounds = list(bounds) or [arena.numel()]
    # each piece with its range, range after range, largest first within one
    ranged = sorted(((bisect.bisect_right(bounds, t[0]), t) for t in tasks), key=lambda it: (it[0], -it[1][1]))
    left = [0] * len(bounds)  # pieces not yet copied, per range
    for i, _ in ranged:
        left[i] += 1
    lock = threading.Lock()

    def full(i: int) -> None:
        if on_full is not None:
            on_full(bounds[i - 1] if i else 0, bounds[i])

    def run(item: tuple[int, tuple[int, int, Any]]) -> tuple[int, int]:
        i, (dst, nbytes, key) = item
        src = source(key)
        if src.device.type == "cpu":
            ctypes.memmove(arena.data_ptr() + dst, src.data_ptr(), nbytes)
        elif nbytes:  # a source on a device (a model offloaded from where it sits)
            arena[dst : dst + nbytes].copy_(src)
        with lock:
            left[i] -= 1
            last = left[i] == 0
        if last:
            full(i)
        return src.data_ptr(), src.data_ptr() + nbytes

    for i in (i for i, n in enumerate(left) if n == 0):  # ranges of gaps alone
        full(i)
    t1 = time.perf_counter()
    if threads == 1:
        copied = [run(it) for it in ranged]
    else:  # each free thread takes the next task: big pieces start early, small ones fill the tail
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dlo_fn-fill") as pool:
            copied = list(pool.map(run, ranged))
    return [c for c in copied if c[1] > c[0]], time.perf_counter() - t1, zero_s


def pin_bounds(layout: ModelLayout, k: int, nbytes: int) -> list[int]:
    """Where the arena's registrations end: after at least :data:`PIN_RANGE_BYTES`, at the start of a block (of a
    load group: its H2D is one copy), so every H2D copy reads within one registration. Blocks start at the layout's
    alignment (256 bytes), so two ranges may share a 4 KiB page: the driver takes that (the CUDA test registers a
    range per block at such starts, and FLUX.1-dev's forwards run at the PCIe bound from 1 GiB ranges)."""
    out = []
    for b in range(layout.load_group, k, layout.load_group):
        if layout.shard_offsets[b] - (out[-1] if out else 0) >= PIN_RANGE_BYTES:
            out.append(layout.shard_offsets[b])
    return out + [nbytes]
