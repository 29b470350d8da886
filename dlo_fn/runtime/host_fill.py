"""Filling a host arena at the speed of the host: the copies of :func:`~dlo_fn.runtime.host_store.build_host_store`.

Where the time of a fill goes (one H200 host, 25.8 GB, measured): the first touch of fresh pages (the kernel
faults and zeroes each one) 3.0 s, ``cudaHostRegister`` of touched pages 2.5 s, a multi-threaded copy from the
page cache 0.5-0.7 s. Registering a fresh buffer makes the driver fault every page in itself, on one thread, and
a copy on one thread reads the checkpoint at 2-3 GB/s. So an arena is filled in this order, with one pass over
its bytes:

1. allocate pageable memory (no page touched yet; NPU: the driver's pinned allocator, which touches them);
2. copy every piece with ``threads`` threads, a piece per task, largest first (``ctypes.memmove`` of the source
   bytes: a plain libc copy that releases the GIL and starts no thread team of its own); these copies are the
   pages' first touch, so the kernel's faults run on every thread at once;
3. zero only the gaps (alignment between tensors, tail padding);
4. page-lock the filled pages (CUDA: ``cudaHostRegister``, which now only pins pages that are present).

The bytes are those of the sources whatever the number of threads: each task writes its own disjoint range.
"""

from __future__ import annotations

import ctypes
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch

__all__ = ["FillTimings", "FillResult", "default_threads", "fill_arena", "SERIAL_BELOW_BYTES"]

MAX_THREADS = 16  # past this the copies are bound by memory bandwidth, not by faults
SERIAL_BELOW_BYTES = 32 << 20  # a small arena costs less than starting threads


@dataclass(frozen=True, slots=True)
class FillTimings:
    """Wall time of each phase of one arena fill (seconds) and what it moved."""

    alloc_s: float
    copy_s: float  # the pieces' copies, which are also the first touch of pageable arena pages
    zero_s: float  # the gaps only
    pin_s: float  # cudaHostRegister after the copies (0 when pinned at allocation, or not pinned)
    threads: int
    copied_bytes: int
    zeroed_bytes: int

    @property
    def total_s(self) -> float:
        return self.alloc_s + self.copy_s + self.zero_s + self.pin_s

    def as_dict(self) -> dict:
        return {"alloc_s": self.alloc_s, "copy_s": self.copy_s, "zero_s": self.zero_s, "pin_s": self.pin_s,
                "total_s": self.total_s, "threads": self.threads, "copied_bytes": self.copied_bytes,
                "zeroed_bytes": self.zeroed_bytes}


def default_threads() -> int:
    """The CPUs this process may run on, at most :data:`MAX_THREADS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


def _copy_into(arena: torch.Tensor, dst: int, src: torch.Tensor) -> None:
    n = src.numel()
    if n == 0:
        return
    if src.device.type == "cpu":
        ctypes.memmove(arena.data_ptr() + dst, src.data_ptr(), n)
    else:  # a source on a device (a model offloaded from where it already sits): torch's copy
        arena[dst : dst + n].copy_(src)


class FillResult(NamedTuple):
    copied_ranges: tuple[tuple[int, int], ...]  # source address ranges read (for releasing their pages)
    copy_s: float
    zero_s: float
    threads: int
    copied_bytes: int
    zeroed_bytes: int


def fill_arena(arena: torch.Tensor, tasks: Sequence[tuple[int, int, Any]], source: Callable[[Any], torch.Tensor],
               gaps: Sequence[tuple[int, int]], threads: int | None = None) -> FillResult:
    """Copy ``source(key)`` to ``arena[dst : dst + nbytes]`` for every ``(dst, nbytes, key)`` of ``tasks``, then
    zero the ``gaps`` (``[lo, hi)`` byte ranges), with ``threads`` threads (default :func:`default_threads`; one for
    arenas under :data:`SERIAL_BELOW_BYTES`). ``source`` is called once per task, on the thread that copies it,
    and must return a flat uint8 tensor of ``nbytes`` bytes."""
    threads = default_threads() if threads is None else threads
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if arena.numel() < SERIAL_BELOW_BYTES:
        threads = 1

    def run(task: tuple[int, int, Any]) -> tuple[int, int]:
        dst, nbytes, key = task
        src = source(key)
        assert src.numel() == nbytes and dst + nbytes <= arena.numel(), (dst, nbytes, src.numel())
        _copy_into(arena, dst, src)
        return src.data_ptr(), src.data_ptr() + nbytes

    t0 = time.perf_counter()
    if threads == 1:
        copied = [run(t) for t in tasks]
    else:
        # Largest first: the pool hands each free thread the next task, so the big pieces start early and the
        # small ones fill the tail (longest-processing-time order).
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dlo_fn-fill") as pool:
            copied = list(pool.map(run, sorted(tasks, key=lambda t: -t[1])))
    t1 = time.perf_counter()
    zeroed = 0
    for lo, hi in gaps:
        if hi <= lo:
            continue
        ctypes.memset(arena.data_ptr() + lo, 0, hi - lo)
        zeroed += hi - lo
    t2 = time.perf_counter()
    return FillResult(tuple(c for c in copied if c[1] > c[0]), t1 - t0, t2 - t1, threads,
                      sum(b - a for a, b in copied), zeroed)
