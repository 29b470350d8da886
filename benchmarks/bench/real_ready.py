"""Time to ready against the host's floor, measured in the same run (`bench real`).

The floor of filling an arena of ``n`` bytes from a checkpoint in the page cache is the sum of what the host
cannot avoid, each step measured alone on a buffer of its own, with the threads the fill uses:

    touch_s     first touch of ``n`` fresh bytes (the kernel faults and zeroes every page), ``threads`` threads
    register_s  ``cudaHostRegister`` of those touched pages (CUDA; 0 elsewhere)
    copy_s      the files' bytes (``n`` of them, from this rank's share) copied from the page cache into the
                touched buffer: the faster of ``pread`` and ``memmove`` from a mapping, ``threads`` threads

``floor_s = touch_s + register_s + copy_s`` with 4 KiB pages; with 2 MiB pages the same sum of ``copy_s`` and
``touch_hugepage_s`` / ``register_hugepage_s``, measured on a buffer advised ``MADV_HUGEPAGE`` (2 MiB pages where the
kernel gives them: ``hugepage_bytes``, under the host's ``thp`` mode), as the CUDA arena is
(:func:`dlo_fn.runtime.cuda.host_fill.huge_page_buffer`). The floor is a sum of phases each measured alone; the store
overlaps two of them (it locks filled ranges while it copies the next), so it can come in under it. Beside them,
``register_untouched_s``: register of a fresh buffer, which makes the driver fault every page itself (the other
order).
Cold cache: :func:`evict` drops the files' pages (``posix_fadvise(DONTNEED)``) and :func:`resident_fraction`
checks with ``mincore`` that they are gone.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import pathlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from dlo_fn.runtime.cuda.host_fill import fill_threads

__all__ = ["measure_floor", "h2d_peak_bytes_per_s", "evict", "resident_fraction", "cold_read_s", "touch_host"]

CHUNK = 64 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def _spans(files: Sequence[pathlib.Path], start: int, nbytes: int) -> list[tuple[str, int, int, int]]:
    """``(file, file offset, buffer offset, bytes)`` chunks of the files' bytes ``[start, start + nbytes)``
    (the files concatenated in order), each at most :data:`CHUNK`."""
    out, pos, dst = [], 0, 0
    for f in files:
        size = os.path.getsize(f)
        lo, hi = max(start, pos), min(start + nbytes, pos + size)
        for off in range(lo, hi, CHUNK):
            n = min(CHUNK, hi - off)
            out.append((str(f), off - pos, dst, n))
            dst += n
        pos += size
    return out


def _parallel(fn, items, threads: int) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(fn, items))
    return time.perf_counter() - t0


def _touch(addr: int, nbytes: int, threads: int) -> float:
    """Write zeros over ``nbytes`` at ``addr`` in chunks on ``threads`` threads (every page's first touch)."""
    return _parallel(lambda lo: ctypes.memset(addr + lo, 0, min(CHUNK, nbytes - lo)), range(0, nbytes, CHUNK), threads)


def _copy_pread(buf: torch.Tensor, spans, threads: int) -> float:
    fds = {f: os.open(f, os.O_RDONLY) for f in {s[0] for s in spans}}
    try:

        def read(span):
            f, off, dst, n = span
            view = (ctypes.c_char * n).from_address(buf.data_ptr() + dst)
            got = os.preadv(fds[f], [view], off)
            assert got == n, (f, off, got, n)

        return _parallel(read, spans, threads)
    finally:
        for fd in fds.values():
            os.close(fd)


def _copy_mmap(buf: torch.Tensor, spans, threads: int) -> float:
    maps = {}
    try:
        for f in {s[0] for s in spans}:
            with open(f, "rb") as fh:
                m = mmap.mmap(fh.fileno(), 0, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            maps[f] = (m, ctypes.addressof(ctypes.c_char.from_buffer(m)))

        def copy(span):
            f, off, dst, n = span
            ctypes.memmove(buf.data_ptr() + dst, maps[f][1] + off, n)

        return _parallel(copy, spans, threads)
    finally:
        gc.collect()  # the from_buffer exports must be gone before a mapping closes
        for m, _ in maps.values():
            m.close()


def h2d_peak_bytes_per_s(
    platform, host: torch.Tensor, chunk_bytes: int = 512 << 20, chunks: int = 4, reps: int = 3
) -> float | None:
    """Best of ``reps`` rounds of ``chunks`` H2D copies of ``chunk_bytes`` from the pinned ``host`` buffer."""
    if platform.kind != "cuda" or not host.is_pinned():
        return None
    chunk_bytes = min(chunk_bytes, host.numel() // max(1, chunks)) or host.numel()
    dst = torch.empty(chunk_bytes, dtype=torch.uint8, device=platform.device)
    best = 0.0
    for _ in range(reps + 1):  # the first round warms up
        start, end = platform.new_event(timing=True), platform.new_event(timing=True)
        start.record(platform.current_stream())
        for c in range(chunks):
            dst.copy_(host[c * chunk_bytes : (c + 1) * chunk_bytes], non_blocking=True)
        end.record(platform.current_stream())
        platform.synchronize()
        best = max(best, chunks * chunk_bytes / (start.elapsed_time(end) / 1e3))
    return best


def _thp_mode() -> str:
    try:
        text = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()


def _anon_huge_bytes() -> int:
    from dlo_fn.io.memstat import parse_smaps_rollup

    return parse_smaps_rollup(pathlib.Path("/proc/self/smaps_rollup").read_text()).get("AnonHugePages", 0)


def _hugepages(platform, nbytes: int, threads: int) -> dict:
    """Touch (and register) ``nbytes`` in 2 MiB pages, allocated as the CUDA arena is (``huge_page_buffer``)."""
    from dlo_fn.runtime.cuda.host_fill import huge_page_buffer
    from dlo_fn.runtime.host_store import pin_in_place

    buf, before = huge_page_buffer(nbytes), _anon_huge_bytes()
    out = {"thp": _thp_mode(), "touch_hugepage_s": _touch(buf.data_ptr(), nbytes, threads)}
    out["hugepage_bytes"] = _anon_huge_bytes() - before
    if platform.kind == "cuda":
        t0 = time.perf_counter()
        fin = pin_in_place(buf)
        out["register_hugepage_s"] = time.perf_counter() - t0
        fin()
    del buf
    gc.collect()
    return out


def measure_floor(
    platform,
    nbytes: int,
    files: Sequence[pathlib.Path],
    *,
    share: tuple[int, int] = (0, 1),
    threads: int | None = None,
    untouched: bool = True,
    hugepages: bool = True,
) -> dict:
    """The floor of filling ``nbytes`` (module docstring); ``share=(r, W)`` copies the r-th ``nbytes`` of the
    files (a rank's part of an allgather set-up); ``untouched`` / ``hugepages``: the evidence beside it."""
    from dlo_fn.runtime.host_store import pin_in_place

    threads = threads or fill_threads(nbytes)  # one rank alone: every CPU, at most 16
    out: dict = {
        "bytes": nbytes,
        "threads": threads,
        "register_untouched_s": None,
        "register_s": 0.0,
        "h2d_peak_bytes_per_s": None,
    }
    cuda = platform.kind == "cuda"
    if cuda and untouched:  # the other order: the driver faults the pages in itself, on one thread
        fresh = torch.empty(nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        fin = pin_in_place(fresh)
        out["register_untouched_s"] = time.perf_counter() - t0
        fin()
        del fresh
    buf = torch.empty(nbytes, dtype=torch.uint8)
    out["touch_s"] = _touch(buf.data_ptr(), nbytes, threads)
    fin = None
    if cuda:
        t0 = time.perf_counter()
        fin = pin_in_place(buf)
        out["register_s"] = time.perf_counter() - t0
        out["h2d_peak_bytes_per_s"] = h2d_peak_bytes_per_s(platform, buf)
    total = sum(os.path.getsize(f) for f in files)
    rank, world = share
    n = min(nbytes, max(0, total - rank * nbytes))
    spans = _spans(files, rank * nbytes, n)
    out["copy_bytes"] = n
    out["copy_pread_s"] = _copy_pread(buf, spans, threads)
    out["copy_mmap_s"] = _copy_mmap(buf, spans, threads)
    out["copy_s"] = min(out["copy_pread_s"], out["copy_mmap_s"])
    out["floor_s"] = out["touch_s"] + out["register_s"] + out["copy_s"]
    if fin is not None:
        fin()
    del buf
    if hugepages and nbytes:
        out.update(_hugepages(platform, nbytes, threads))
    return out


def touch_host(nbytes: int, threads: int = 16) -> float:
    """Write every page of ``nbytes`` of fresh memory (2 MiB pages) once, then free it; returns the seconds. On a
    VM whose hypervisor backs guest memory at its first use (the H200 machine here is a Firecracker microVM: two
    ranks filled 22 GB in 5.5 s the first time, in 1.2-1.6 s every time after), whichever variant first lands on
    such memory pays the hypervisor's faults; touched once, every variant and floor meets memory as a bare host's."""
    from dlo_fn.runtime.cuda.host_fill import huge_page_buffer

    buf = huge_page_buffer(nbytes)
    seconds = _touch(buf.data_ptr(), nbytes, threads)
    del buf
    gc.collect()
    return seconds


def evict(files: Sequence[pathlib.Path]) -> None:
    """Write back, then drop every page of ``files`` from the page cache (pages still mapped by a process stay)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(files: Sequence[pathlib.Path]) -> float:
    """Fraction of the files' pages in the page cache (``mincore`` on a fresh read-only mapping: no page read)."""
    page = mmap.PAGESIZE
    resident = total = 0
    for f in files:
        size = os.path.getsize(f)
        if size == 0:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {f} failed")
            try:
                npages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * npages)()
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {f} failed")
                resident += sum(v & 1 for v in vec)
                total += npages
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


def cold_read_s(files: Sequence[pathlib.Path], threads: int | None = None) -> dict:
    """Evict the files, then read them once with ``threads`` threads (``pread`` into one buffer per thread)."""
    evict(files)
    before = resident_fraction(files)
    spans = _spans(files, 0, sum(os.path.getsize(f) for f in files))
    threads = threads or fill_threads(sum(s[3] for s in spans))
    bufs = {}
    fds = {f: os.open(f, os.O_RDONLY) for f in {s[0] for s in spans}}

    def read(span):
        import threading

        buf = bufs.setdefault(threading.get_ident(), bytearray(CHUNK))
        f, off, _, n = span
        os.preadv(fds[f], [memoryview(buf)[:n]], off)

    try:
        seconds = _parallel(read, spans, threads)
    finally:
        for fd in fds.values():
            os.close(fd)
    nbytes = sum(s[3] for s in spans)
    return {"resident_fraction_before": before, "read_s": seconds, "bytes": nbytes, "bytes_per_s": nbytes / seconds}
