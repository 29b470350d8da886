"""Three-stream timeline: the simulator's prediction and the executor's measurement, as one type.

A :class:`Timeline` is a bag of :class:`Span` (op string, stream, start, end, rank). :func:`simulate` replays a
:class:`~dlo_fn.plan.schedule.Schedule` with per-op durations, each op starting at

    start_i = max(end of the previous op on its stream, max_{d in deps_i} end_d)

(host issue time is not modelled: the host is assumed to run ahead; put per-op launch cost into the
durations). The executor fills the same type with measured times (:meth:`Timeline.from_records`), so a
prediction and a measurement compare op by op.

Derived quantities, per rank, over the window ``[t0, t1]`` of the whole timeline (``makespan_s = t1 - t0``):

* ``busy_s(stream)``: length of the union of that stream's spans;
* ``compute_idle_s = makespan_s - busy_s("compute")``;
* ``exposed_transfer_s``: the part of the compute-idle time during which a transfer stream (H2D or all-gather)
  is busy: transfer time not hidden behind compute. In a simulation every compute gap is such a wait (compute
  waits only on loads); in a measurement the rest, ``compute_idle_s - exposed_transfer_s``, is time when no
  stream runs at all (host dispatch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from dlo_fn.plan.schedule import AG, DQ, H2D, Op, Schedule

__all__ = [
    "Span",
    "Timeline",
    "BlockSummary",
    "BandwidthDurations",
    "simulate",
    "simulate_runs",
    "bandwidth_durations",
    "block_summary",
]

TRANSFER_STREAMS = ("h2d", "allgather")


@dataclass(frozen=True, slots=True)
class Span:
    op: str
    stream: str
    start_s: float
    end_s: float
    rank: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start_s) and math.isfinite(self.end_s)) or self.end_s < self.start_s:
            raise ValueError(f"Span {self.op!r}: need finite start_s <= end_s, got {self.start_s}, {self.end_s}")

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass(frozen=True, slots=True)
class Timeline:
    spans: tuple[Span, ...]
    meta: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def from_records(records: Iterable[Sequence], meta: Iterable[tuple[str, str]] = ()) -> "Timeline":
        """From ``(op, stream, start_s, end_s)`` or ``(op, stream, start_s, end_s, rank)`` records."""
        spans = []
        for n, rec in enumerate(records):
            if len(rec) not in (4, 5):
                raise ValueError(f"record {n}: expected (op, stream, start_s, end_s[, rank]), got {rec!r}")
            rank = int(rec[4]) if len(rec) == 5 else 0
            spans.append(Span(str(rec[0]), str(rec[1]), float(rec[2]), float(rec[3]), rank))
        return Timeline(tuple(spans), tuple((str(k), str(v)) for k, v in meta))

    @property
    def start_s(self) -> float:
        return min((s.start_s for s in self.spans), default=0.0)

    @property
    def end_s(self) -> float:
        return max((s.end_s for s in self.spans), default=0.0)

    @property
    def makespan_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({s.rank for s in self.spans}))

    def _rank(self, rank: int | None) -> int:
        ranks = self.ranks
        if rank is None:
            if len(ranks) > 1:
                raise ValueError(f"timeline has ranks {ranks}: pass rank=")
            return ranks[0] if ranks else 0
        return rank

    def spans_of(self, stream: str | None = None, rank: int | None = None) -> tuple[Span, ...]:
        r = self._rank(rank)
        return tuple(s for s in self.spans if s.rank == r and (stream is None or s.stream == stream))

    def busy_s(self, stream: str, rank: int | None = None) -> float:
        return _length(_union((s.start_s, s.end_s) for s in self.spans_of(stream, rank)))

    def compute_idle_s(self, rank: int | None = None) -> float:
        return self.makespan_s - self.busy_s("compute", rank)

    def exposed_transfer_s(self, rank: int | None = None) -> float:
        busy = _union((s.start_s, s.end_s) for s in self.spans_of("compute", rank))
        idle, t = [], self.start_s
        for a, b in busy:
            if a > t:
                idle.append((t, a))
            t = max(t, b)
        if self.end_s > t:
            idle.append((t, self.end_s))
        transfers = _union((s.start_s, s.end_s) for s in self.spans_of(None, rank) if s.stream in TRANSFER_STREAMS)
        return _length(_intersect(idle, transfers))

    def shifted(self, offset_s: float) -> "Timeline":
        """Every span moved by ``-offset_s`` (e.g. ``tl.shifted(tl.start_s)`` starts at 0)."""
        return Timeline(
            tuple(Span(s.op, s.stream, s.start_s - offset_s, s.end_s - offset_s, s.rank) for s in self.spans), self.meta
        )


@dataclass(frozen=True, slots=True)
class BandwidthDurations:
    """Duration of an op from bytes and bandwidths; per-block tuples (index = block).

    ``H2D``: ``launch_latency_s + h2d_bytes[b] / h2d_bytes_per_s`` (the shard in allgather mode, the whole
    block in rank-local mode); ``AG``: ``launch_latency_s + allgather_bytes[b] / allgather_bytes_per_s``;
    ``DQ``: ``launch_latency_s + dequant_s[b]`` (quantised loads: reading the stored block and writing the slot,
    :func:`dlo_fn.plan.quant.dequant_seconds`); ``C``: ``launch_latency_s + compute_s[b]`` (one request).
    """

    h2d_bytes: tuple[float, ...]
    allgather_bytes: tuple[float, ...]
    compute_s: tuple[float, ...]
    h2d_bytes_per_s: float
    allgather_bytes_per_s: float
    launch_latency_s: float = 0.0
    dequant_s: tuple[float, ...] = ()  # empty: no quantised loads (a DQ op then costs its launch latency)

    def __post_init__(self) -> None:
        if not len(self.h2d_bytes) == len(self.allgather_bytes) == len(self.compute_s):
            raise ValueError("h2d_bytes, allgather_bytes and compute_s need one entry per block")
        if self.dequant_s and len(self.dequant_s) != len(self.compute_s):
            raise ValueError("dequant_s needs one entry per block (or none)")
        if self.h2d_bytes_per_s <= 0 or self.allgather_bytes_per_s <= 0 or self.launch_latency_s < 0:
            raise ValueError("bandwidths must be > 0 and launch_latency_s >= 0")

    def __call__(self, op: Op) -> float:
        if op.block >= len(self.compute_s):
            raise ValueError(f"{op}: durations know {len(self.compute_s)} blocks")
        if op.kind == H2D:
            work = self.h2d_bytes[op.block] / self.h2d_bytes_per_s
        elif op.kind == AG:
            work = self.allgather_bytes[op.block] / self.allgather_bytes_per_s
        elif op.kind == DQ:
            work = self.dequant_s[op.block] if self.dequant_s else 0.0
        else:
            work = self.compute_s[op.block]
        return self.launch_latency_s + work


def bandwidth_durations(
    num_blocks: int,
    *,
    h2d_bytes: float | Sequence[float],
    allgather_bytes: float | Sequence[float],
    compute_s: float | Sequence[float],
    h2d_bytes_per_s: float,
    allgather_bytes_per_s: float,
    launch_latency_s: float = 0.0,
    dequant_s: float | Sequence[float] | None = None,
) -> BandwidthDurations:
    """Scalars are broadcast over ``num_blocks``; sequences must have one entry per block."""

    def per_block(name: str, value: float | Sequence[float]) -> tuple[float, ...]:
        if isinstance(value, (int, float)):
            return (float(value),) * num_blocks
        if len(value) != num_blocks:
            raise ValueError(f"{name} has {len(value)} entries, expected num_blocks = {num_blocks}")
        return tuple(float(v) for v in value)

    return BandwidthDurations(
        per_block("h2d_bytes", h2d_bytes),
        per_block("allgather_bytes", allgather_bytes),
        per_block("compute_s", compute_s),
        float(h2d_bytes_per_s),
        float(allgather_bytes_per_s),
        float(launch_latency_s),
        () if dequant_s is None else per_block("dequant_s", dequant_s),
    )


def _simulate_one(
    schedule: Schedule,
    duration_s: Callable[[Op], float],
    stream_free: dict[str, float],
    buffer_done: dict[str, float],
    rank: int,
    not_before_s: float = 0.0,
) -> list[Span]:
    firsts: dict[int, list[str]] = {}
    for buf, i in schedule.first_use:
        firsts.setdefault(i, []).append(buf)
    end: list[float] = []
    spans = []
    for i, op in enumerate(schedule.ops):
        duration = float(duration_s(op))
        if not (duration >= 0 and math.isfinite(duration)):
            raise ValueError(f"duration of {op} must be finite and >= 0, got {duration}")
        start = max(
            [not_before_s, stream_free.get(op.stream, 0.0)]
            + [end[d] for d in schedule.deps[i]]
            + [buffer_done.get(buf, 0.0) for buf in firsts.get(i, ())]
        )
        end.append(start + duration)
        stream_free[op.stream] = end[-1]
        spans.append(Span(str(op), op.stream, start, end[-1], rank))
    for buf, i in schedule.last_use:
        buffer_done[buf] = end[i]
    return spans


def _meta(schedule: Schedule, extra: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    base = (
        ("source", "simulated"),
        ("mode", schedule.mode),
        ("num_blocks", str(schedule.num_blocks)),
        ("num_slots", str(schedule.num_slots)),
        ("num_landing", str(schedule.num_landing)),
        ("requests_per_load", str(schedule.requests_per_load)),
    )
    if schedule.quantized:
        base += (("quantization", "fp8"),)
    return base + tuple((str(k), str(v)) for k, v in extra)


def simulate(
    schedule: Schedule, duration_s: Callable[[Op], float], *, rank: int = 0, meta: Iterable[tuple[str, str]] = ()
) -> Timeline:
    """One run from idle streams at t = 0 (a warm start's resident slots count as ready at 0)."""
    spans = _simulate_one(schedule, duration_s, {}, {}, rank)
    return Timeline(tuple(spans), _meta(schedule, (("num_steps", str(schedule.num_steps)),) + tuple(meta)))


def simulate_runs(
    schedules: Sequence[Schedule],
    duration_s: Callable[[Op], float],
    *,
    rank: int = 0,
    boundary_s: float = 0.0,
    meta: Iterable[tuple[str, str]] = (),
) -> Timeline:
    """Runs back to back on the same streams, as the executor runs consecutive waves.

    A wave's results leave after its last compute, and the next wave is dispatched ``boundary_s`` later
    (decode, wave formation): no op of run ``j+1`` starts before that. Loads that run ``j`` issued for the next
    run (``prefetch_next``) are not held back. Across runs, the first use of a buffer waits for the previous
    run's last use (the executor's cross-run waits). Span op strings get a ``"run<j> "`` prefix.
    """
    if not schedules:
        raise ValueError("simulate_runs needs at least one schedule")
    stream_free: dict[str, float] = {}
    buffer_done: dict[str, float] = {}
    spans: list[Span] = []
    not_before_s = 0.0
    for j, schedule in enumerate(schedules):
        run = _simulate_one(schedule, duration_s, stream_free, buffer_done, rank, not_before_s)
        spans.extend(Span(f"run{j} {s.op}", s.stream, s.start_s, s.end_s, s.rank) for s in run)
        not_before_s = max(s.end_s for s in run if s.stream == "compute") + boundary_s
    return Timeline(
        tuple(spans),
        _meta(schedules[0], (("num_runs", str(len(schedules))), ("boundary_s", repr(boundary_s))) + tuple(meta)),
    )


@dataclass(frozen=True, slots=True)
class BlockSummary:
    """Per block: loads and total seconds on each stream; ``wait_s`` = compute-stream gaps just before it."""

    block: int
    num_loads: int
    h2d_s: float
    allgather_s: float
    compute_s: float
    wait_s: float


def _parse(span: Span) -> Op | None:
    text = span.op.split(" ", 1)[1] if span.op.startswith("run") else span.op
    try:
        return Op.from_str(text)
    except ValueError:
        return None  # not a schedule op (e.g. host work the executor also recorded)


def block_summary(timeline: Timeline, rank: int | None = None) -> tuple[BlockSummary, ...]:
    """Per-block totals over the spans that are schedule ops; other spans are ignored."""
    rows: dict[int, list[float]] = {}
    prev_end = timeline.start_s
    for span in sorted(timeline.spans_of(None, rank), key=lambda s: (s.start_s, s.end_s)):
        op = _parse(span)
        if op is None:
            continue
        row = rows.setdefault(op.block, [0, 0.0, 0.0, 0.0, 0.0])
        if op.kind == H2D:
            row[0] += 1
            row[1] += span.duration_s
        elif op.kind in (AG, DQ):  # the all-gather stream's work
            row[2] += span.duration_s
        else:
            row[3] += span.duration_s
            row[4] += max(0.0, span.start_s - prev_end)
            prev_end = max(prev_end, span.end_s)
    return tuple(BlockSummary(b, int(r[0]), r[1], r[2], r[3], r[4]) for b, r in sorted(rows.items()))
