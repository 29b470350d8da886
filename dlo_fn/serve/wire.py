"""How the engine's ranks talk: a control channel for waves and results, and a status board for diagnosis.

**Control channel.** Rank 0 drives. Waves go out with one ``broadcast_object_list`` (the wave's requests are
small frozen dataclasses); results come back point to point (``send_object_list`` / ``recv_object_list``,
rank by rank), so a healthy rank's results never depend on a collective that a dead rank would break. All of
it runs on a CPU (gloo) group: the default group on CPU, a second gloo group beside NCCL/HCCL, so videos never
have to be staged on the device. Every call is bounded by the group's timeout (gloo enforces it per call;
after a timeout or a peer's death every later call on the broken pair fails at once, measured with
torch 2.13: "Application timeout caused pair closure").

**Status board.** A collective that fails says *that* something went wrong, not *which* rank. Each rank
therefore posts its state to the process group's key-value store (the rendezvous store: TCPStore under
torchrun, FileStore for ``file://``): ``{"state", "wave", "step", "t", "pid", "host"}`` at every denoising step
and at every transition (``running``, ``done``, ``error``, ``collective-failed``). After a failure the driver
gives the others a short grace period to post, then reads the board: a rank that posted ``collective-failed``
is a victim; one that did not is the culprit, *dead* if its process is gone (checked by pid when it runs on
this host), *stalled* otherwise, with the step it was last seen at.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import pickle
import socket
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "Channel",
    "GroupChannel",
    "StatusBoard",
    "RankStatus",
    "default_store",
    "culprits",
    "diagnosis_wait_s",
    "POLL_S",
]

log = logging.getLogger(__name__)

TERMINAL = ("done", "error", "collective-failed")

POLL_S = 0.02  # how often a rank waiting on the channel or the status board looks again


def default_store() -> Any:
    """The default process group's store, or None (no process group, or a torch without the accessor)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None


class Channel:
    """Rank-0-driven messaging over a CPU group. ``group`` None means a single process (no messages)."""

    def __init__(self, group: Any, backend: str, timeout_s: float) -> None:
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        if group is not None and backend != "gloo":
            import datetime

            # Collective new_group: every rank constructs its Channel at the same point. Same members as the
            # device group (all ranks for the default group); messages go over gloo on the host.
            group = dist.new_group(
                ranks=dist.get_process_group_ranks(group), backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
            )
        self.group = group

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj``, on every rank."""
        if self.group is None:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def send(self, obj: Any, dst: int = 0) -> None:
        dist.send_object_list(
            [obj], dst=dist.get_global_rank(self.group, dst) if _has_global(self.group) else dst, group=self.group
        )

    def recv(self, src: int) -> Any:
        box = [None]
        dist.recv_object_list(
            box, src=dist.get_global_rank(self.group, src) if _has_global(self.group) else src, group=self.group
        )
        return box[0]


class GroupChannel:
    """:class:`Channel`'s interface on a bare gloo group of the survivors of a failure
    (:mod:`dlo_fn.serve.recover`), built on a ``PrefixStore`` of the old group's store: no collective of the
    old group (whose pairs with the culprit are closed) and no entry in torch's group registry (which would
    need every old rank). Objects travel pickled: a length, then the bytes; every call is bounded by
    ``timeout_s`` as in the old group."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size

    @classmethod
    def build(cls, store: Any, prefix: str, rank: int, world_size: int, timeout_s: float) -> "GroupChannel":
        group = (
            None
            if world_size == 1
            else dist.ProcessGroupGloo(
                dist.PrefixStore(prefix, store), rank, world_size, datetime.timedelta(seconds=timeout_s)
            )
        )
        return cls(group, rank, world_size)

    def broadcast(self, obj: Any = None) -> Any:
        if self.group is None:
            return obj
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        data = _pack(obj) if self.rank == 0 else None
        size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
        self.group.broadcast([size], opts).wait()
        buf = data if data is not None else torch.empty(int(size.item()), dtype=torch.uint8)
        self.group.broadcast([buf], opts).wait()
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    def send(self, obj: Any, dst: int = 0) -> None:
        data = _pack(obj)
        self.group.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, 0).wait()
        self.group.send([data], dst, 0).wait()

    def recv(self, src: int) -> Any:
        size = torch.zeros(1, dtype=torch.int64)
        self.group.recv([size], src, 0).wait()
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        self.group.recv([buf], src, 0).wait()
        return pickle.loads(buf.numpy().tobytes())


def _pack(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _has_global(group: Any) -> bool:
    return group is not None and group is not dist.group.WORLD and hasattr(dist, "get_global_rank")


@dataclass(frozen=True, slots=True)
class RankStatus:
    """What the board says about one rank after a failure. ``verdict``: ok, victim, error, dead, stalled,
    silent (never posted)."""

    rank: int
    verdict: str
    detail: str

    def __str__(self) -> str:
        return f"rank {self.rank} {self.verdict}" + (f" ({self.detail})" if self.detail else "")


class StatusBoard:
    """Per-rank state in the rendezvous store (see the module docstring). ``store`` None disables it: posts
    are dropped and a diagnosis can only say "unknown"."""

    def __init__(self, store: Any, rank: int, world_size: int, session: str = "engine") -> None:
        self.store = store
        self.rank, self.world_size = rank, world_size
        self.prefix = f"dlo_fn/{session}/"
        self.pid, self.host = os.getpid(), socket.gethostname()

    # -- posting ---------------------------------------------------------------------------------------------
    def post(self, state: str, **info: Any) -> None:
        if self.store is None:
            return
        record = {"state": state, "t": time.time(), "pid": self.pid, "host": self.host, **info}
        try:
            self.store.set(f"{self.prefix}r{self.rank}", json.dumps(record))
        except Exception as exc:  # noqa: BLE001 - the board is diagnostics; never let it mask the real error
            log.debug("status board post failed: %s", exc)

    def set_flag(self, name: str, value: str = "1") -> None:
        if self.store is not None:
            self.store.set(f"{self.prefix}flag/{name}", value)

    def has_flag(self, name: str) -> bool:
        if self.store is None:
            return False
        return bool(self.store.check([f"{self.prefix}flag/{name}"]))

    # -- reading ---------------------------------------------------------------------------------------------
    def read(self, rank: int) -> dict[str, Any] | None:
        if self.store is None:
            return None
        key = f"{self.prefix}r{rank}"
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key).decode())
        except Exception:  # noqa: BLE001
            return None

    def alive(self, record: dict[str, Any] | None) -> bool | None:
        """Whether the process behind ``record`` still runs: True / False on this host, None elsewhere."""
        if record is None or record.get("host") != self.host:
            return None
        try:
            import psutil

            proc = psutil.Process(int(record["pid"]))
            return proc.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
        except Exception:  # noqa: BLE001 - NoSuchProcess and friends
            return False

    def age_s(self, record: dict[str, Any] | None) -> float:
        return math.inf if record is None else time.time() - float(record.get("t", 0.0))

    def status(self, rank: int, wave: int | None = None) -> RankStatus:
        """One rank's verdict about ``wave`` (see :class:`RankStatus`); anything not terminal is ``stalled``."""
        rec = self.read(rank)
        if rec is None:
            return RankStatus(rank, "silent", "no status posted" if self.store is not None else "no status board")
        where = _where(rec)
        state, same_wave = rec.get("state"), wave is None or rec.get("wave") == wave
        # A rank that posted how the wave ended for it and then left (a broken group ends the process) did not
        # crash: its own words come before its liveness.
        if same_wave and state == "collective-failed":
            return RankStatus(rank, "victim", str(rec.get("error", ""))[:300])
        if same_wave and state == "error":
            return RankStatus(rank, "error", str(rec.get("error", ""))[:300])
        alive = self.alive(rec)
        if alive is False:
            return RankStatus(rank, "dead", f"process {rec.get('pid')} exited; {where}")
        if same_wave and state == "done":
            return RankStatus(rank, "ok", where)
        how = "alive" if alive else "liveness unknown: another host"
        return RankStatus(rank, "stalled", f"{how}, no progress for {self.age_s(rec):.1f} s; {where}")

    def diagnose(self, ranks: Sequence[int], wave: int | None, grace_s: float) -> tuple[RankStatus, ...]:
        """After a failed wave: wait up to ``grace_s`` for every rank in ``ranks`` to post a terminal state
        (or die), then return each rank's verdict; the culprits are the ``dead``, ``stalled`` and ``silent``."""
        deadline = time.monotonic() + grace_s
        while True:
            verdicts = tuple(self.status(r, wave) for r in ranks)
            if all(v.verdict in ("victim", "error", "dead", "ok") for v in verdicts) or time.monotonic() > deadline:
                return verdicts
            time.sleep(0.05)


def _where(rec: dict[str, Any]) -> str:
    out = f"last seen: {rec.get('state')}"
    if rec.get("wave") is not None:
        out += f" in wave {rec['wave']}"
    if rec.get("step") is not None:
        out += f" at step {rec['step']}"
    return out


def diagnosis_wait_s(grace_s: float, timeout_s: float, replicas: Sequence[Sequence[int]]) -> float:
    """How long rank 0 waits for the followers' own word (:meth:`StatusBoard.diagnose`) before naming culprits.
    On an sp mesh a stalled rank's partners wait for it inside an all-to-all, which gives up only ``timeout_s``
    after they entered it, possibly later than rank 0's own collective did: until they post that their
    collective failed they look stalled too, so rank 0 waits one timeout more for them (the step fails closed
    either way)."""
    return grace_s + (timeout_s if any(len(u) > 1 for u in replicas) else 0.0)


def culprits(verdicts: Sequence[RankStatus]) -> tuple[RankStatus, ...]:
    return tuple(v for v in verdicts if v.verdict in ("dead", "stalled", "silent"))
