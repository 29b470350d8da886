"""Which address ranges of this process map a file (``/proc/PID/maps``): what the loader checks its zero-copy views
against, and what releasing the mapping looks for."""

from __future__ import annotations

import bisect
import os
import pathlib
from typing import Sequence

__all__ = ["file_mappings", "in_mappings"]


def file_mappings(paths: Sequence[str | os.PathLike], pid: int | None = None) -> dict[str, list[tuple[int, int]]]:
    """``{resolved path: [(start, stop) address ranges]}`` of the mappings of ``paths`` in ``/proc/PID/maps``."""
    wanted = {str(pathlib.Path(p).resolve()) for p in paths}
    out: dict[str, list[tuple[int, int]]] = {p: [] for p in wanted}
    pid = os.getpid() if pid is None else int(pid)
    for line in pathlib.Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5] in wanted:
            start, stop = (int(x, 16) for x in parts[0].split("-"))
            out[parts[5]].append((start, stop))
    return {p: sorted(r) for p, r in out.items()}


def in_mappings(ranges: Sequence[tuple[int, int]], start: int, nbytes: int) -> bool:
    """Whether ``[start, start + nbytes)`` lies inside one of the sorted ``ranges``."""
    i = bisect.bisect_right(ranges, (start, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= start and start + nbytes <= ranges[i][1]
