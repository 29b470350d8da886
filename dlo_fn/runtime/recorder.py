"""What the executor ran, recorded as the :class:`~dlo_fn.plan.timeline.Timeline` the simulator produces.

Per op of a recorded run, two timing events: one recorded on the op's stream after its event waits (its start)
and its completion event (its end). Times are seconds from the origin, an event recorded on the compute stream
when the first recorded run opens: device clocks on CUDA/NPU, host clocks on CPU (``time_ns``). A CPU
all-gather issued asynchronously has no stream to record on: its end is stamped when its work completes.
Span names are ``"run<j> <op>"`` (``j`` = the executor's run counter, see :func:`dlo_fn.plan.compare.single_run`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from dlo_fn.plan.schedule import Schedule
    from dlo_fn.plan.timeline import Timeline
    from dlo_fn.runtime.platform import Platform

__all__ = ["RunRecorder", "stamp_on_completion"]


def stamp_on_completion(work: Any, event: Any) -> None:
    """Record ``event`` now and again when ``work`` (an async collective) completes, where it can say when."""
    event.record()
    try:
        work.get_future().add_done_callback(lambda _f: event.record())
    except (AttributeError, RuntimeError):
        pass


class RunRecorder:
    """The timing events of one executor's recorded runs, and the spans they become."""

    def __init__(self, platform: Platform, rank: int) -> None:
        self.platform, self.rank = platform, rank
        self._origin: Any = None
        self._records: list[tuple[str, str, Any, Any]] = []

    def run_events(self, num_ops: int) -> tuple[list[Any], list[Any]]:
        """``(ends, starts)``: fresh timing events for a run of ``num_ops`` ops (the first call sets the origin)."""
        new = self.platform.new_event
        ends, starts = [new(timing=True) for _ in range(num_ops)], [new(timing=True) for _ in range(num_ops)]
        if self._origin is None:
            self._origin = new(timing=True)
            self._origin.record(self.platform.current_stream())
        return ends, starts

    def add_run(self, index: int, schedule: Schedule, starts: Sequence[Any], ends: Sequence[Any]) -> None:
        self._records.extend((f"run{index} {op}", op.stream, starts[i], ends[i]) for i, op in enumerate(schedule.ops))

    @property
    def origin_s(self) -> float | None:
        """Host-clock seconds of the origin on CPU; None on devices or before the first recorded run."""
        origin = self._origin
        return origin.time_ns / 1e9 if origin is not None and hasattr(origin, "time_ns") else None

    def take(self, meta: Sequence[tuple[str, str]]) -> Timeline:
        """The spans recorded since the last call (the caller has synchronised), then forget them."""
        from dlo_fn.plan.timeline import Timeline  # the simulator's type, loaded when a recording is taken

        origin = self._origin
        recs = [
            (op, stream, origin.elapsed_time(s) / 1e3, origin.elapsed_time(e) / 1e3, self.rank)
            for op, stream, s, e in self._records
        ]
        self._records = []
        return Timeline.from_records(recs, tuple(meta))
