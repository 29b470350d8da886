"""Prediction vs measurement: check a measured :class:`~dlo_fn.plan.timeline.Timeline` against its schedule and
fit the durations that let :func:`~dlo_fn.plan.timeline.simulate` replay it.

The executor records one span per schedule op, named ``"run<j> <op>"`` (``j`` = the executor's run counter).
:func:`single_run` keeps one run's spans under their plain op names, the names :func:`simulate` gives.

A measurement *agrees* with schedule ``S`` (:func:`check_against_schedule`) when

* every op of ``S`` was measured exactly once, and on each stream the measured ops, ordered by start time, are
  ``S``'s ops of that stream in issue order (a stream runs in issue order);
* every op starts at or after the end of each op it waits on, ``start_i >= end_d`` for ``d in S.deps[i]``,
  and of the op before it on its stream (the waits that stream order implies, which ``deps`` leaves out). The
  executor records an op's start after its event waits, on the host clock on CPU and on the op's stream on
  devices, so a missing or misplaced wait shows up here.

:func:`fit_durations` gives one duration per op kind, the median of its measured spans (the median, because
the first call of a block pays one-off costs that a mean would spread over every op).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from dlo_fn.plan.ops import AG, H2D, KINDS, STREAMS, C, Op
from dlo_fn.plan.schedule import Schedule
from dlo_fn.plan.timeline import Span, Timeline

__all__ = ["KindDurations", "ScheduleAgreement", "single_run", "fit_durations", "check_against_schedule"]

_RUN_PREFIX = re.compile(r"^run(\d+) (.*)$")


def single_run(timeline: Timeline, run: int | None = None) -> Timeline:
    """The spans of run ``run`` with the ``"run<j> "`` prefix dropped (``run=None``: the only run recorded;
    a timeline without prefixes is returned as is). Spans of other runs are left out."""
    runs = sorted({int(m.group(1)) for s in timeline.spans if (m := _RUN_PREFIX.match(s.op))})
    if not runs:
        return timeline
    if run is None:
        if len(runs) > 1:
            raise ValueError(f"timeline holds runs {runs}: pass run= to pick one")
        run = runs[0]
    if run not in runs:
        raise ValueError(f"timeline holds runs {runs}, not run {run}")
    prefix = f"run{run} "
    spans = tuple(
        Span(s.op[len(prefix) :], s.stream, s.start_s, s.end_s, s.rank)
        for s in timeline.spans
        if s.op.startswith(prefix)
    )
    return Timeline(spans, timeline.meta + (("run", str(run)),))


def _ops(timeline: Timeline, rank: int | None) -> list[tuple[Op, Span]]:
    out = []
    for span in timeline.spans_of(None, rank):
        if _RUN_PREFIX.match(span.op):
            raise ValueError(f"span {span.op!r} carries a run prefix: pass single_run(timeline, run) first")
        try:
            out.append((Op.from_str(span.op), span))
        except ValueError:
            continue  # not a schedule op (other host work recorded beside the ops)
    return out


@dataclass(frozen=True, slots=True)
class KindDurations:
    """``duration(op)`` = the fitted seconds of ``op.kind``; None for a kind that was not measured (no AG in
    rank-local mode), which raises when asked for."""

    h2d_s: float | None
    allgather_s: float | None
    compute_s: float | None

    def __post_init__(self) -> None:
        for name in ("h2d_s", "allgather_s", "compute_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"KindDurations.{name} must be >= 0 or None, got {value}")

    def __call__(self, op: Op) -> float:
        value = {H2D: self.h2d_s, AG: self.allgather_s, C: self.compute_s}[op.kind]
        if value is None:
            raise ValueError(f"no measured {op.kind} op to fit a duration for {op}: measure the same mode")
        return value


def fit_durations(measured: Timeline, rank: int | None = None) -> KindDurations:
    """Median measured duration of each op kind (see the module docstring)."""
    by_kind: dict[str, list[float]] = {k: [] for k in KINDS}
    for op, span in _ops(measured, rank):
        by_kind[op.kind].append(span.duration_s)
    if not any(by_kind.values()):
        raise ValueError("the timeline has no schedule ops to fit durations from")
    med = {k: statistics.median(v) if v else None for k, v in by_kind.items()}
    return KindDurations(med[H2D], med[AG], med[C])


@dataclass(frozen=True, slots=True)
class ScheduleAgreement:
    """Outcome of :func:`check_against_schedule`; true when both checks hold. ``problems`` names the first
    few offending ops."""

    num_ops: int
    same_order: bool
    deps_respected: bool
    problems: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.same_order and self.deps_respected


def check_against_schedule(
    measured: Timeline, schedule: Schedule, rank: int | None = None, max_problems: int = 5
) -> ScheduleAgreement:
    """Does ``measured`` (one run, see :func:`single_run`) follow ``schedule``? See the module docstring."""
    ops = _ops(measured, rank)
    problems: list[str] = []
    by_name: dict[str, Span] = {}
    for op, span in ops:
        if str(op) in by_name:
            problems.append(f"{op} measured twice")
        by_name[str(op)] = span
    wanted = schedule.to_strs()
    missing = [s for s in wanted if s not in by_name]
    extra = sorted(set(by_name) - set(wanted))
    problems += [f"{s} not measured" for s in missing] + [f"{s} measured but not in the schedule" for s in extra]
    same_order = not problems
    for stream in STREAMS:
        want = [str(op) for op in schedule.ops if op.stream == stream]
        # Stable sort: spans are recorded in issue order, which breaks ties of equal clock readings.
        got = [str(op) for op, s in sorted(ops, key=lambda p: (p[1].start_s, p[1].end_s)) if s.stream == stream]
        if got != want:
            same_order = False
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            problems.append(
                f"stream {stream}: position {first} measured {got[first : first + 1]}, "
                f"schedule {want[first : first + 1]}"
            )
    deps_respected = not missing
    prev_on: dict[str, int] = {}
    for i, op in enumerate(schedule.ops):
        span = by_name.get(str(op))
        waits = schedule.deps[i] + ((prev_on[op.stream],) if op.stream in prev_on else ())
        prev_on[op.stream] = i
        for d in waits:
            dep = by_name.get(wanted[d])
            if span is not None and dep is not None and span.start_s < dep.end_s:
                deps_respected = False
                problems.append(f"{op} started {span.start_s - dep.end_s:.3g} s before {wanted[d]} ended")
    return ScheduleAgreement(len(ops), same_order, deps_respected, tuple(problems[:max_problems]))


# What rebuilds a schedule: a measured run is stored with these (figures/data/measured_timeline_*.json) so the
# prediction can be replayed from the committed file alone.
SCHEDULE_FIELDS = (
    "num_blocks",
    "num_steps",
    "requests_per_load",
    "num_slots",
    "num_landing",
    "mode",
    "slot_offset",
    "landing_offset",
    "warm_start",
    "prefetch_next",
)


def schedule_params(schedule: Schedule) -> dict:
    return {f: getattr(schedule, f) for f in SCHEDULE_FIELDS}


def schedule_from_params(params: dict) -> Schedule:
    from dlo_fn.plan.schedule import build_schedule

    rest = dict(params)
    return build_schedule(rest.pop("num_blocks"), rest.pop("num_steps"), **rest)
