"""Filling a rank's host arena at the host's speed: the start-up plug-in :class:`ParallelFill` of
:func:`dlo_fn.runtime.host_store.build_host_store` (``OffloadOptions.host_fill``; on by default on CUDA, where it
measured faster: ``docs/measurements.md``, "Time to ready", and ``figures/data/host_fill_pages_nvidia-h200.json``).

The core fills its exact-size arena on one thread, registered (``cudaHostRegister``) before the copy. Three costs
dominate that: the first touch of fresh pages, registering them (the driver faults each fresh page in on one
thread), and the copy from the page cache. This plug-in attacks each:

* **2 MiB pages** (:func:`huge_page_buffer`): the first touch and the registration handle one 2 MiB page where
  they would handle 512 of 4 KiB.
* **Fill threads** (:func:`fill_threads`): the pieces are copied on several threads (``ctypes.memmove`` releases
  the GIL), so the copies are the pages' first touch on every thread at once; only the gaps are zeroed. Each piece
  has its own byte range: the bytes do not depend on the threads. W ranks on one host fill at the same time, so
  each takes its share of the cores; small arenas fill on one thread, where thread stacks and malloc arenas would
  cost more than they save.
* **Range-by-range registration** (:func:`pin_bounds`): on CUDA the arena is allocated pageable and locked range
  by range (about :data:`PIN_RANGE_BYTES` each, ending at block starts), each as soon as its pieces are in, on a
  thread of its own, while the next ranges are copied: registration overlaps the copy.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from dlo_fn.plan.layout import ModelLayout
from dlo_fn.runtime.host_store import Filled, FillJob, alloc_host, pin_in_place, register_cuda

__all__ = ["ParallelFill", "huge_page_buffer", "fill_threads", "fill_arena", "pin_bounds", "PIN_RANGE_BYTES"]

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
    """Threads one rank fills an arena of ``nbytes`` with: one below 256 MiB (each thread's stack and malloc arena
    stay in the process's anonymous memory), else its share of the CPUs this process may use among ``local_ranks``
    ranks filling at once, at most 16."""
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
    alignment, so two ranges may share a page: the driver takes that (tests/test_host_store.py registers a range per
    block at such starts and reads every block back through H2D)."""
    out = []
    for b in range(layout.load_group, k, layout.load_group):
        if layout.shard_offsets[b] - (out[-1] if out else 0) >= PIN_RANGE_BYTES:
            out.append(layout.shard_offsets[b])
    return out + [nbytes]


@dataclass(frozen=True, slots=True)
class ParallelFill:
    """The arena fill of the module docstring, for :func:`~dlo_fn.runtime.host_store.build_host_store`'s ``fill``:
    ``threads`` (default :func:`fill_threads`: the CPUs this process may use, shared by ``local_ranks`` ranks filling
    at once, at most 16). On CUDA the arena is 2 MiB pages registered range by range; elsewhere it is the core's
    (pageable on CPU, the driver's pinned allocator on NPU), filled on the threads."""

    threads: int | None = None
    local_ranks: int = 1

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.local_ranks < 1:
            raise ValueError(f"local_ranks must be >= 1, got {self.local_ranks}")

    def __call__(self, job: FillJob) -> Filled:
        t0 = time.perf_counter()
        # CUDA: pageable now, locked once filled (the copies are the pages' first touch, on every thread).
        late_pin = job.platform.kind == "cuda" and job.platform.supports_pinned and job.nbytes > 0
        if late_pin:
            arena, how, fin = huge_page_buffer(job.nbytes), "cudaHostRegister", None
        else:
            arena, how, fin = alloc_host(job.nbytes, job.platform, pin=True)
        alloc_s = time.perf_counter() - t0
        threads = self.threads or fill_threads(job.nbytes, self.local_ranks)
        bounds = pin_bounds(job.layout, job.k, job.nbytes) if late_pin else ()
        pinned: list[Future] = []  # each range is locked while the next ones are copied
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlo_fn-pin") as pinner:

            def lock(lo: int, hi: int) -> None:
                pinned.append(pinner.submit(register_cuda, arena[lo:hi]))

            try:
                copied, copy_s, zero_s = fill_arena(
                    arena, job.tasks, job.read, job.gaps, threads, bounds, lock if late_pin else None
                )
            finally:  # what was locked is unlocked with the arena, also when the fill failed
                t1 = time.perf_counter()
                wait(pinned)
                if late_pin:
                    fin = pin_in_place(arena, [f.result() for f in pinned if f.exception() is None])
        pin_s = time.perf_counter() - t1 if late_pin else 0.0
        failed = next((f.exception() for f in pinned if f.exception() is not None), None)
        if failed is not None:
            fin()
            raise failed
        timings = dict(alloc_s=alloc_s, copy_s=copy_s, zero_s=zero_s, pin_s=pin_s, threads=threads)
        return Filled(arena, how, fin, tuple(copied), timings)
