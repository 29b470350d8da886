"""The data of a dispatch plan: a trace's requests, the replicas, the pass costs, and the plan with its scores (pure).

The model and the policies are in :mod:`dlo_fn.cost.dispatch`, which re-exports every name here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Hashable, Sequence

__all__ = [
    "POLICIES",
    "QueuedRequest",
    "Replicas",
    "PassCosts",
    "PlanStep",
    "RequestRecord",
    "ReplicaUsage",
    "DispatchPlan",
    "nearest_rank",
]

POLICIES = ("continuous", "strict")
_ID = re.compile(r"[^\s:@+]+")


def _seconds(name: str, values: Sequence[float]) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        out = (math.nan,)
    if not all(math.isfinite(v) and v >= 0 for v in out):
        raise ValueError(f"{name} must be finite seconds >= 0, got {values!r}")
    return out


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """One request of a trace. ``key``: requests of equal keys may share a replica (``R > 1``) and a strict
    wave; ``block_compute_s``: seconds per block pass, one number for every block or one per block."""

    request_id: str
    arrival_s: float
    num_steps: int
    key: Hashable = ""
    block_compute_s: float | tuple[float, ...] = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not _ID.fullmatch(self.request_id):
            raise ValueError(
                f"request_id must be a non-empty str without spaces, ':', '@' or '+', got {self.request_id!r}"
            )
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"request {self.request_id}: arrival_s must be finite and >= 0, got {self.arrival_s}")
        if not isinstance(self.num_steps, int) or isinstance(self.num_steps, bool) or self.num_steps < 1:
            raise ValueError(f"request {self.request_id}: num_steps must be an int >= 1, got {self.num_steps!r}")
        cost = self.block_compute_s
        values = _seconds(f"request {self.request_id}: block_compute_s", cost if isinstance(cost, tuple) else (cost,))
        object.__setattr__(self, "arrival_s", float(self.arrival_s))
        object.__setattr__(self, "block_compute_s", values if isinstance(cost, tuple) else values[0])

    def compute_s(self, num_blocks: int) -> tuple[float, ...]:
        """``c_qb`` for ``b = 0 .. num_blocks - 1``."""
        cost = self.block_compute_s
        if not isinstance(cost, tuple):
            return (float(cost),) * num_blocks
        if len(cost) != num_blocks:
            raise ValueError(
                f"request {self.request_id}: block_compute_s has {len(cost)} entries, the ring has {num_blocks} blocks"
            )
        return tuple(float(c) for c in cost)


@dataclass(frozen=True, slots=True)
class Replicas:
    dp_size: int
    requests_per_replica: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_size", "requests_per_replica"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Replicas.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class PassCosts:
    """Per block: the load every pass pays (``t_b``) and the host cost added to it (``h_b``)."""

    block_transfer_s: tuple[float, ...]
    block_host_s: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_transfer_s", _seconds("PassCosts.block_transfer_s", self.block_transfer_s))
        object.__setattr__(self, "block_host_s", _seconds("PassCosts.block_host_s", self.block_host_s))
        if not self.block_transfer_s or len(self.block_transfer_s) != len(self.block_host_s):
            raise ValueError("PassCosts needs one block_transfer_s and one block_host_s per block (at least one block)")

    @staticmethod
    def uniform(num_blocks: int, transfer_s: float, host_s: float = 0.0) -> "PassCosts":
        return PassCosts((transfer_s,) * num_blocks, (host_s,) * num_blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.block_transfer_s)

    def step_s(self, replica_compute_s: Sequence[Sequence[float]]) -> float:
        """``sum_b max(t_b, max_r x_rb) + h_b`` for per-replica, per-block compute ``x_rb``."""
        total = 0.0
        for b, (t, h) in enumerate(zip(self.block_transfer_s, self.block_host_s)):
            total += max([t] + [x[b] for x in replica_compute_s]) + h
        return total


@dataclass(frozen=True, slots=True)
class PlanStep:
    """Ring steps ``first_step .. first_step + num_steps - 1`` (``num_steps > 1`` only for a stretch where
    no replica computes), each ``step_s`` long. ``replicas[r]``: ``(request_id, request step)`` pairs replica
    ``r`` computes, in order; ``num_queued``: arrived requests not started, after this boundary's admissions."""

    first_step: int
    num_steps: int
    start_s: float
    end_s: float
    step_s: float
    replicas: tuple[tuple[tuple[str, int], ...], ...]
    num_queued: int

    def __str__(self) -> str:
        last = self.first_step + self.num_steps - 1
        steps = f"s{self.first_step}" + (f"-{last}" if self.num_steps > 1 else "")
        cells = [f"r{r}:" + ("+".join(f"{i}@{k}" for i, k in held) or "-") for r, held in enumerate(self.replicas)]
        return " ".join([steps] + cells + ([f"q{self.num_queued}"] if self.num_queued else []))


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    arrival_s: float
    replica: int
    first_step: int
    num_steps: int
    start_s: float
    finish_s: float

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def queue_s(self) -> float:
        return self.start_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class ReplicaUsage:
    """Block passes of one replica by kind (they sum to the plan's ``num_passes``) and its own compute."""

    replica: int
    num_compute_passes: int
    num_idle_passes: int
    num_waiting_passes: int
    compute_s: float


def nearest_rank(values: Sequence[float], percent: float) -> float:
    """``x_(ceil(p N / 100))`` of the sorted values (1-based; ``p = 0`` gives the minimum)."""
    if not values:
        raise ValueError("nearest_rank needs at least one value")
    if not 0 <= percent <= 100:
        raise ValueError(f"percent must be in [0, 100], got {percent}")
    xs = sorted(values)
    return xs[max(1, math.ceil(percent * len(xs) / 100)) - 1]


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    """``requests`` and ``records`` in FIFO order (arrival, then id); ``steps`` cover ``[0, makespan_s]``."""

    policy: str
    costs: PassCosts
    replicas: Replicas
    requests: tuple[QueuedRequest, ...]
    steps: tuple[PlanStep, ...]
    records: tuple[RequestRecord, ...]
    usage: tuple[ReplicaUsage, ...]

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"DispatchPlan.policy must be one of {POLICIES}, got {self.policy!r}")

    def lines(self) -> tuple[str, ...]:
        return tuple(str(s) for s in self.steps)

    def record(self, request_id: str) -> RequestRecord:
        for rec in self.records:
            if rec.request_id == request_id:
                return rec
        raise KeyError(request_id)

    @property
    def num_ring_steps(self) -> int:
        return sum(s.num_steps for s in self.steps)

    @property
    def num_passes(self) -> int:
        return self.num_ring_steps * self.costs.num_blocks

    @property
    def makespan_s(self) -> float:
        return max(r.finish_s for r in self.records)

    @property
    def throughput_requests_per_s(self) -> float:
        return len(self.records) / self.makespan_s if self.makespan_s > 0 else math.inf

    def latency_percentile_s(self, percent: float) -> float:
        return nearest_rank([r.latency_s for r in self.records], percent)

    @property
    def p50_latency_s(self) -> float:
        return self.latency_percentile_s(50)

    @property
    def p95_latency_s(self) -> float:
        return self.latency_percentile_s(95)

    @property
    def mean_latency_s(self) -> float:
        return sum(r.latency_s for r in self.records) / len(self.records)
