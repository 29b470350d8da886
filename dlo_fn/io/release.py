"""Let go of the checkpoint mapping once the host store is filled (after technique 2).

``safe_open(...).get_tensor`` returns views into ONE copy-on-write mapping of the whole file, and that mapping
lives as long as any view of it does. After :func:`~dlo_fn.runtime.host_store.build_host_store` each rank has
*read* its ``1/W`` of every block out of the mapping; those pages stay in the rank's page tables (counted in
its RSS and, since no other rank touched the same pages, in its USS) for as long as the mapping is open. The
blocks' views are dropped when the blocks go to meta, but the resident (non-block) tensors still view the same
mapping, so it stays open and the touched pages stay charged to the rank (about half the rank's share of the
checkpoint in USS beyond the plan, measured: ``docs/performance.md``).

:func:`release_mapped_tensors` (run after the resident tensors moved to the device) closes the mapping:

* every parameter / buffer still inside a mapping of the checkpoint files gets a private copy (on CPU, where
  "moving to the device" is a no-op, that is the resident tensors: small); ties stay ties, ``Parameter``
  objects keep their identity (``p.data`` is swapped);
* then ``/proc/self/maps`` is read again: ``mapped_bytes_after`` is what is still mapped (0 unless someone
  else holds views, e.g. the rank-local ``"mmap"`` source or the partly pinned host budget, which stream from
  the mapping on purpose).

The page cache itself stays the OS's: closing a mapping unmaps pages, it does not evict them, so the next rank
(or the next start) still reads the file from memory.

:func:`release_ranges` is the other way, for views that must stay: ``madvise(MADV_DONTNEED)`` on the whole
pages of the byte ranges already copied out; a private file mapping then drops those (clean) pages from the
process, and a later read maps them again from the page cache.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import pathlib
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

from dlo_fn.io.mappings import file_mappings, in_mappings
from dlo_fn.plan.spec import KERNEL_ALIGNMENT_BYTES

__all__ = [
    "ReleaseReport",
    "release_mapped_tensors",
    "release_ranges",
    "release_copied_pages",
    "mapped_bytes",
    "viewed_files",
]

log = logging.getLogger(__name__)
MADV_DONTNEED = 4


@dataclass(frozen=True, slots=True)
class ReleaseReport:
    """What :func:`release_mapped_tensors` did: tensors copied out of the mapping (and their bytes), and the
    address-space bytes of the mappings the model's tensors viewed, before and after (another model of the same
    file, alive in the process, keeps its own mapping and is not counted)."""

    copied_tensors: int
    copied_bytes: int
    mapped_bytes_before: int
    mapped_bytes_after: int
    verified: bool  # /proc was readable
    source_ranges: tuple[tuple[int, int], ...] = ()  # the address ranges the copies were read from

    @property
    def closed(self) -> bool:
        return self.verified and self.mapped_bytes_after == 0


def mapped_bytes(files: Sequence[str | os.PathLike]) -> int | None:
    """Address-space bytes of this process's mappings of ``files`` (``None`` without ``/proc``)."""
    try:
        ranges = file_mappings(files)
    except OSError:
        return None
    return sum(stop - start for r in ranges.values() for start, stop in r)


def _file_maps() -> list[tuple[int, int, str]]:
    """``[(start, stop, path)]`` of every file-backed mapping of this process."""
    out = []
    for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            start, stop = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, stop, parts[5]))
    return sorted(out)


def viewed_files(model: nn.Module) -> tuple[str, ...]:
    """The files whose mappings hold at least one CPU tensor of ``model`` (its checkpoint's safetensors files,
    whichever loader bound them); ``()`` without ``/proc``."""
    try:
        maps = _file_maps()
    except OSError:
        return ()
    starts = [m[0] for m in maps]
    found = set()
    for _, _, t, _ in _tensor_slots(model):
        if t.device.type != "cpu" or t.is_meta or not t.numel():
            continue
        i = bisect.bisect_right(starts, t.data_ptr()) - 1
        if i >= 0 and maps[i][0] <= t.data_ptr() < maps[i][1]:
            found.add(maps[i][2])
    return tuple(sorted(found))


def _tensor_slots(model: nn.Module) -> Iterable[tuple[dict, str, torch.Tensor, bool]]:
    for mod in model.modules():
        for n, p in mod._parameters.items():
            if p is not None:
                yield mod._parameters, n, p, True
        for n, b in mod._buffers.items():
            if b is not None:
                yield mod._buffers, n, b, False


def _copy_at_residue(t: torch.Tensor, modulus: int = KERNEL_ALIGNMENT_BYTES) -> torch.Tensor:
    """A private contiguous copy of ``t`` whose address has the same residue mod ``modulus`` as ``t``'s: CPU
    kernels (MKL's one-row fp32 GEMV) round differently at different alignments, so a copy must keep the
    alignment the model computed with before (the offloaded slots keep it too: :mod:`dlo_fn.plan.layout`)."""
    nbytes = t.numel() * t.element_size()
    buf = torch.empty(nbytes + modulus, dtype=torch.uint8)
    shift = (t.data_ptr() - buf.data_ptr()) % modulus
    out = buf[shift : shift + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def release_mapped_tensors(model: nn.Module, files: Sequence[str | os.PathLike], warn: bool = True) -> ReleaseReport:
    """Give every tensor of ``model`` that still views a mapping of ``files`` a private copy, so the mapping
    closes (see the module docstring). Call it after the resident tensors moved to the device."""
    try:
        by_file = file_mappings(files)
    except OSError:  # no /proc: cannot tell views from copies, so leave the model alone
        return ReleaseReport(0, 0, 0, 0, False)
    ranges = sorted(r for rs in by_file.values() for r in rs)
    held: set[tuple[int, int]] = set()  # the mappings the model's tensors view (not other models' of the file)
    copied: dict[int, torch.Tensor] = {}
    sources: list[tuple[int, int]] = []
    nbytes = 0
    if ranges:
        for table, name, t, is_param in _tensor_slots(model):
            if t.device.type != "cpu" or t.is_meta or not t.numel():
                continue
            key = id(t)
            if key not in copied:
                start, size = t.data_ptr(), t.numel() * t.element_size()
                if not in_mappings(ranges, start, size):
                    continue
                held.add(ranges[bisect.bisect_right(ranges, (start, float("inf"))) - 1])
                sources.append((start, start + size))
                if is_param:
                    with torch.no_grad():
                        t.data = _copy_at_residue(t.detach())
                    copied[key] = t
                else:
                    copied[key] = _copy_at_residue(t)
                nbytes += size
            table[name] = copied[key] if not is_param else t
    before = sum(stop - start for start, stop in held)
    still = {r for rs in file_mappings(files).values() for r in rs} & held
    after = sum(stop - start for start, stop in still)
    if after and warn:
        log.warning(
            "%d bytes of %s are still mapped after the release: something outside the model holds views "
            "of the checkpoint (their pages stay charged to this process)",
            after,
            ", ".join(pathlib.Path(f).name for f in files),
        )
    return ReleaseReport(len(copied), nbytes, before, after, True, tuple(sources))


def release_ranges(ranges: Iterable[tuple[int, int]]) -> int:
    """``madvise(MADV_DONTNEED)`` the whole pages inside each ``[start, stop)`` address range (bytes already
    copied out of a private file mapping); returns the bytes advised. Partial pages at the ends are kept (they
    may hold bytes still in use)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.PAGESIZE
    done = 0
    for start, stop in ranges:
        lo, hi = -(-start // page) * page, stop // page * page
        if hi <= lo:
            continue
        if libc.madvise(lo, hi - lo, MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) of {hi - lo} bytes at {lo:#x} failed")
        done += hi - lo
    return done


def release_copied_pages(ranges: Sequence[tuple[int, int]], files: Sequence[str | os.PathLike]) -> int:
    """:func:`release_ranges` on the parts of ``ranges`` inside the mappings of ``files`` only: on anonymous
    memory ``MADV_DONTNEED`` would zero the bytes, on a clean private file mapping it only unmaps them."""
    try:
        maps = sorted(r for rs in file_mappings(files).values() for r in rs)
    except OSError:
        return 0
    inside = []
    for start, stop in ranges:
        for lo, hi in maps:
            if lo < stop and start < hi:
                inside.append((max(lo, start), min(hi, stop)))
    return release_ranges(inside)
