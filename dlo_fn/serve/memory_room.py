"""What each rank has left for requests once the model is offloaded: device memory and host memory, measured.

Every rank measures its :class:`Room` when its engine is built (the weights, slots and arena are in place by
then) and posts it on the status board's store; rank 0 reads them all (:func:`gather_rooms`) and admits against
each rank's share (:func:`rank_shares`):

* **host**: the least of the system's available memory (``psutil``: free + reclaimable), the cgroup's limit
  minus its anonymous memory (page cache is reclaimable), and the address space ``ulimit -v`` leaves
  (``RLIMIT_AS`` minus this process's size); on a CPU rank minus the executor's slots and landing buffers, which
  are allocated but not touched before the first run;
* **device** (CUDA): the driver's free memory plus what torch's allocator caches but does not use.

Ranks on one host share its host memory, and ranks on one device share the device: each gets ``1 / n`` of
what is left, after a reserve (:data:`RESERVE_FRACTION`) for what the plan does not model (allocator caching
and fragmentation, Python objects, kernel scratch).
"""

from __future__ import annotations

import json
import logging
import resource
import socket
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Sequence

__all__ = ["RESERVE_FRACTION", "Room", "Share", "measure_room", "post_room", "gather_rooms", "rank_shares"]

log = logging.getLogger(__name__)

RESERVE_FRACTION = 0.1


@dataclass(frozen=True, slots=True)
class Room:
    """One rank's free memory: ``host_bytes`` on ``host``; ``device_bytes`` on ``device`` (None on a CPU rank,
    whose device is the host); ``why``: what bounded the host figure."""

    rank: int
    host: str
    device: str
    host_bytes: int
    device_bytes: int | None
    why: str


def _host_room(extra_used: int = 0) -> tuple[int, str]:
    """The least of the three host bounds of the module docstring, and which one it was."""
    import psutil

    from dlo_fn.io.memstat import cgroup_memory

    bounds = [(psutil.virtual_memory().available, "available host memory")]
    cg = cgroup_memory()
    if cg is not None and cg.limit_bytes is not None:
        bounds.append((cg.limit_bytes - cg.anon_bytes, f"the cgroup's limit {cg.limit_bytes:,} B"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        size = psutil.Process().memory_info().vms
        bounds.append((soft - size, f"the address space ulimit -v leaves ({soft:,} B)"))
    free, why = min(bounds)
    return max(0, free - extra_used), why


def measure_room(rank: int, offloaded: Any, device: Any) -> Room:
    """This rank's :class:`Room` now (see the module docstring); ``device`` is the platform's torch device."""
    import torch

    device = torch.device(device)
    executor = getattr(offloaded, "executor", None)
    untouched = 0
    if device.type == "cpu" and executor is not None:  # slots and landing buffers: allocated, touched in use
        untouched = int(getattr(executor, "planned_device_weight_bytes", 0) or 0)
    host_bytes, why = _host_room(untouched)
    device_bytes = None
    if device.type in ("cuda", "npu"):  # torch_npu mirrors torch.cuda's memory calls
        api = getattr(torch, device.type)
        free, _ = api.mem_get_info(device)
        device_bytes = int(free + api.memory_reserved(device) - api.memory_allocated(device))
    where = f"{device.type}:{device.index if device.index is not None else 0}" if device.type != "cpu" else "cpu"
    return Room(rank, socket.gethostname(), where, host_bytes, device_bytes, why)


def post_room(store: Any, prefix: str, room: Room) -> None:
    if store is not None:
        store.set(f"{prefix}room/r{room.rank}", json.dumps(asdict(room)))


def gather_rooms(store: Any, prefix: str, world_size: int, own: Room, timeout_s: float) -> tuple[Room, ...]:
    """Every rank's posted :class:`Room` (rank 0's is ``own``). A rank that posted nothing within ``timeout_s``
    (it never built its engine) is left out: admission then uses the others'."""
    if store is None or world_size == 1:
        return (own,)
    rooms = [own]
    for r in range(1, world_size):
        key = f"{prefix}room/r{r}"
        try:
            store.wait([key], timedelta(seconds=timeout_s))
            rooms.append(Room(**json.loads(store.get(key).decode())))
        except Exception as exc:  # noqa: BLE001 - its room is unknown; the serve goes on with the others'
            log.warning(
                "rank %d posted no memory room within %.0f s (%s): admission uses the other ranks'", r, timeout_s, exc
            )
    return tuple(rooms)


@dataclass(frozen=True, slots=True)
class Share:
    """One rank's part of what its host and its device have left (``device_bytes`` None: a CPU rank), and where
    each figure comes from."""

    host_bytes: int
    device_bytes: int | None
    host_why: str
    device_why: str = "free device memory"

    def capped(self, cap_bytes: int) -> "Share":
        """At most ``cap_bytes`` each (``EngineOptions.memory_budget_bytes``)."""
        why = f"EngineOptions.memory_budget_bytes {cap_bytes:,} B"
        host = (self.host_bytes, self.host_why) if self.host_bytes <= cap_bytes else (cap_bytes, why)
        if self.device_bytes is None:
            return Share(host[0], None, host[1])
        device = (self.device_bytes, self.device_why) if self.device_bytes <= cap_bytes else (cap_bytes, why)
        return Share(host[0], device[0], host[1], device[1])


def rank_shares(rooms: Sequence[Room]) -> dict[int, Share]:
    """Rank -> its :class:`Share`: what its host and its device have left after the reserve, split evenly
    between the ranks on that host (on that device)."""
    on_host: dict[str, int] = {}
    on_device: dict[tuple[str, str], int] = {}
    for room in rooms:
        on_host[room.host] = on_host.get(room.host, 0) + 1
        on_device[(room.host, room.device)] = on_device.get((room.host, room.device), 0) + 1
    keep = 1.0 - RESERVE_FRACTION
    out = {}
    for room in rooms:
        n_host, n_dev = on_host[room.host], on_device[(room.host, room.device)]
        host_why = f"{room.why}, after a {RESERVE_FRACTION:.0%} reserve" + (
            f", shared by {n_host} ranks on its host" if n_host > 1 else ""
        )
        device_why = f"free device memory, after a {RESERVE_FRACTION:.0%} reserve" + (
            f", shared by {n_dev} ranks on the device" if n_dev > 1 else ""
        )
        out[room.rank] = Share(
            int(room.host_bytes * keep) // n_host,
            None if room.device_bytes is None else int(room.device_bytes * keep) // n_dev,
            host_why,
            device_why,
        )
    return out
