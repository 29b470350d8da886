"""Real host-memory accounting: per process (RSS, PSS, USS), per process tree, and per cgroup.

Definitions (all from the kernel, in bytes):

* RSS: resident pages mapped by the process, shared ones counted in full.
* PSS: each resident page divided by the number of processes mapping it, so
  ``sum(PSS over processes) = unique memory of the set`` (for pages not mapped outside it). N processes that
  each map the same 1 GB file page by page have PSS ~1 GB / N each.
* USS: pages mapped by this process only (``Private_Clean + Private_Dirty``): what ending it would free.
* HWM: peak RSS (``VmHWM``).

A page-cache page that no process maps is in nobody's PSS: it shows up only in the cgroup's file memory. The
cgroup (v2 ``memory.current`` / ``memory.stat``; v1 ``memory.usage_in_bytes`` / ``memory.stat``) charges
page cache to the cgroup that first read it, and anonymous memory to its owner.
"""

from __future__ import annotations

import os
import pathlib
import platform
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = [
    "ProcessMemory",
    "CgroupMemory",
    "process_memory",
    "tree_memory",
    "sum_memory",
    "cgroup_memory",
    "parse_smaps_rollup",
    "parse_kv_stat",
    "file_mappings",
    "in_mappings",
    "mapped_file_memory",
    "host_description",
    "format_bytes",
]

from dlo_fn.io.mappings import file_mappings, in_mappings  # noqa: F401 (memory readings by file)

KIB = 1024


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    pid: int
    rss_bytes: int
    pss_bytes: int
    uss_bytes: int
    pss_anon_bytes: int
    pss_file_bytes: int
    swap_bytes: int = 0
    hwm_bytes: int = 0

    def __post_init__(self) -> None:
        if self.uss_bytes > self.rss_bytes or self.pss_bytes > self.rss_bytes:
            raise ValueError(f"pid {self.pid}: USS/PSS exceed RSS ({self})")


@dataclass(frozen=True, slots=True)
class CgroupMemory:
    """One cgroup's memory counters. ``file_bytes`` is page cache, ``anon_bytes`` anonymous memory."""

    version: int  # 1 or 2
    path: str
    current_bytes: int
    file_bytes: int
    anon_bytes: int
    peak_bytes: int | None = None
    limit_bytes: int | None = None


def parse_smaps_rollup(text: str) -> dict[str, int]:
    """``{"Rss": bytes, "Pss": bytes, ...}`` from ``/proc/PID/smaps_rollup``; repeated keys are summed, so
    the per-mapping ``/proc/PID/smaps`` (kernels before 4.14) gives the same totals."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[key.strip()] = out.get(key.strip(), 0) + int(parts[0]) * KIB
    return out


def parse_kv_stat(text: str) -> dict[str, int]:
    """``{"anon": 123, ...}`` from a cgroup ``memory.stat`` (``key value`` lines)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def process_memory(pid: int | None = None) -> ProcessMemory:
    """RSS / PSS / USS of one process from ``/proc/PID/smaps_rollup`` (``smaps`` summed on old kernels)."""
    pid = os.getpid() if pid is None else int(pid)
    proc = pathlib.Path(f"/proc/{pid}")
    try:
        fields = parse_smaps_rollup((proc / "smaps_rollup").read_text())
    except FileNotFoundError:
        if not proc.exists():
            raise ProcessLookupError(f"no process {pid}") from None
        fields = parse_smaps_rollup((proc / "smaps").read_text())
    status = parse_smaps_rollup((proc / "status").read_text())
    pss_anon = fields.get("Pss_Anon", fields.get("Anonymous", 0))
    return ProcessMemory(
        pid=pid,
        rss_bytes=fields["Rss"],
        pss_bytes=fields["Pss"],
        uss_bytes=fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
        pss_anon_bytes=pss_anon,
        pss_file_bytes=fields.get("Pss_File", fields["Pss"] - pss_anon - fields.get("Pss_Shmem", 0)),
        swap_bytes=fields.get("Swap", 0),
        hwm_bytes=status.get("VmHWM", 0),
    )


def tree_memory(pid: int | None = None, include_root: bool = True) -> tuple[ProcessMemory, ...]:
    """:func:`process_memory` of ``pid`` (default: this process) and all its descendants; processes that end
    while being read are skipped."""
    import psutil

    root = psutil.Process(os.getpid() if pid is None else pid)
    procs = ([root] if include_root else []) + root.children(recursive=True)
    out = []
    for p in procs:
        try:
            out.append(process_memory(p.pid))
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return tuple(out)


def sum_memory(processes: Iterable[ProcessMemory]) -> dict[str, int]:
    """Field-wise sums; ``pss_bytes`` of the sum is the set's unique footprint."""
    fields = ("rss_bytes", "pss_bytes", "uss_bytes", "pss_anon_bytes", "pss_file_bytes", "swap_bytes")
    procs = tuple(processes)
    return {f: sum(getattr(p, f) for p in procs) for f in fields}


def _cgroup_lines(pid: int) -> list[tuple[str, str]]:
    """``[(controllers, path)]`` from ``/proc/PID/cgroup``."""
    out = []
    for line in pathlib.Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        out.append((controllers, path))
    return out


def _mounts() -> list[tuple[str, str, str, str]]:
    """``[(root, mount point, fstype, super options)]`` of cgroup mounts from ``/proc/self/mountinfo``."""
    out = []
    for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        lparts, rparts = left.split(), right.split()
        if len(rparts) >= 3 and rparts[0] in ("cgroup", "cgroup2"):
            out.append((lparts[3], lparts[4], rparts[0], rparts[2]))
    return out


def _cgroup_dir(mount_root: str, mount_point: str, cgroup_path: str) -> pathlib.Path:
    rel = cgroup_path
    if mount_root != "/" and (cgroup_path == mount_root or cgroup_path.startswith(mount_root + "/")):
        rel = cgroup_path[len(mount_root) :]
    return pathlib.Path(mount_point) / rel.lstrip("/")


def _read_int(path: pathlib.Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    return int(text) if text.isdigit() else None


def cgroup_memory(pid: int | None = None) -> CgroupMemory | None:
    """The memory counters of the cgroup holding ``pid``; v2 first, then the v1 memory controller. ``None``
    when neither is readable (no cgroup fs, or no permission)."""
    pid = os.getpid() if pid is None else int(pid)
    try:
        lines, mounts = _cgroup_lines(pid), _mounts()
    except OSError:
        return None
    for controllers, path in lines:
        if controllers == "":  # v2 unified line "0::/path"
            for root, point, fstype, _ in mounts:
                if fstype != "cgroup2":
                    continue
                d = _cgroup_dir(root, point, path)
                current = _read_int(d / "memory.current")
                if current is None:
                    continue
                stat = parse_kv_stat((d / "memory.stat").read_text())
                return CgroupMemory(
                    2,
                    str(d),
                    current,
                    stat.get("file", 0),
                    stat.get("anon", 0),
                    _read_int(d / "memory.peak"),
                    _read_int(d / "memory.max"),
                )
    for controllers, path in lines:
        if "memory" not in controllers.split(","):
            continue
        for root, point, fstype, options in mounts:
            if fstype != "cgroup" or "memory" not in options.split(","):
                continue
            d = _cgroup_dir(root, point, path)
            current = _read_int(d / "memory.usage_in_bytes")
            if current is None:
                continue
            stat = parse_kv_stat((d / "memory.stat").read_text())
            limit = _read_int(d / "memory.limit_in_bytes")
            return CgroupMemory(
                1,
                str(d),
                current,
                stat.get("total_cache", stat.get("cache", 0)),
                stat.get("total_rss", stat.get("rss", 0)),
                _read_int(d / "memory.max_usage_in_bytes"),
                None if limit is None or limit >= 1 << 62 else limit,
            )
    return None


def mapped_file_memory(paths: Sequence[str | os.PathLike], pid: int | None = None) -> dict[str, int]:
    """``{"rss_bytes", "pss_bytes"}`` of the mappings of ``paths`` only (``/proc/PID/smaps``): how much of a
    process's footprint is those files' pages."""
    wanted = {str(pathlib.Path(p).resolve()) for p in paths}
    pid = os.getpid() if pid is None else int(pid)
    rss = pss = 0
    inside = False
    for line in pathlib.Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split(None, 5)
        if parts and "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
            inside = len(parts) == 6 and parts[5] in wanted
        elif inside and parts[0] in ("Rss:", "Pss:"):
            value = int(parts[1]) * KIB
            if parts[0] == "Rss:":
                rss += value
            else:
                pss += value
    return {"rss_bytes": rss, "pss_bytes": pss}


def host_description() -> str:
    """Hostname-free machine description: CPU model, cores, RAM, OS kernel."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import psutil

        ram = f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM"
    except Exception:  # noqa: BLE001 - description only
        ram = "RAM unknown"
    return f"{cpu}, {os.cpu_count()} cores, {ram}, {platform.system()} {platform.release().split('-')[0]}"


def format_bytes(nbytes: int | float) -> str:
    """``1.23 GB`` (decimal units, as the published numbers)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"
