"""Issuing a run's ops through torch streams and events: the one path on every platform (CUDA, NPU, CPU).

Each op waits on the events of its ``deps`` in the run (and, for a buffer's first use in the run, on the previous
run's last use of it), is launched on its stream (an H2D op: ``copy_(non_blocking=True)`` per pair; an AG op: one
collective for its pairs; a DQ op: its block's dequantise kernels, :mod:`dlo_fn.runtime.quant`) and records its
event if something waits on it (``CompiledOp.recorded``; a recorded
timeline records every op, with a start event too). The executor's compute ops call :meth:`Issuer.issue_until`
for the loads in front of each block (the schedule puts the loads of block ``k + S - 1`` before the compute of
block ``k``), and ``end_run`` for what is left. There is no host synchronisation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from dlo_fn.plan.ops import AG, DQ, H2D
from dlo_fn.plan.schedule import ScheduleError
from dlo_fn.runtime.dist import all_gather_pairs
from dlo_fn.runtime.program import CompiledOp, ExecutorStats, RunState
from dlo_fn.runtime.recorder import stamp_on_completion

__all__ = ["Issuer"]


@dataclass(frozen=True, slots=True)
class Issuer:
    """How one executor issues ops: ``set_stream`` makes a stream current (one call per switch), ``group`` is
    the shard group the all-gathers run on (None: no all-gather op exists), ``async_collectives`` (CPU/gloo)
    issues them with ``async_op=True`` and waits for them at their dependents."""

    set_stream: Callable[[Any], None]
    group: Any
    async_collectives: bool
    stats: ExecutorStats

    def wait_for(self, stream: Any, op: CompiledOp, run: RunState) -> None:
        """Make ``stream`` wait for ``op``'s dependencies in ``run`` and for the previous run's last use of the
        buffers ``op`` uses first."""
        events, n = run.events, 0
        for d in op.waits:
            stream.wait_event(events[d])
            n += 1
        for buf in op.carry:
            ev = run.carry.get(buf)
            if ev is not None:
                stream.wait_event(ev)
                n += 1
        self.stats.waits += n

    def issue_until(self, run: RunState, stop: int) -> None:
        """Issue ops ``run.cursor .. stop-1``; a compute op among them only when the run has no compute (its
        waits and record, so the loads that wait on it stay ordered). Streams are switched once per change and
        the compute stream is current again at the end."""
        if run.cursor >= stop:
            return
        t0 = time.perf_counter()
        ops, events, starts, stats = run.program.ops, run.events, run.starts, self.stats
        current, group_work = run.stream, None
        try:
            for i in range(run.cursor, stop):
                op = ops[i]
                stream = op.stream if op.stream is not None else run.stream
                if stream is not current:
                    self.set_stream(stream)
                    current = stream
                self.wait_for(stream, op, run)
                if starts is not None:
                    starts[i].record(stream)
                if op.kind == H2D:
                    for dst, src in op.pairs:
                        dst.copy_(src, non_blocking=True)
                    stats.copies += len(op.pairs)
                    stats.loads += 1
                elif op.kind == AG:  # W > 1: a shard group of one has no AG op (plan.lowering)
                    if op.pairs:
                        t1 = time.perf_counter()
                        work = group_work = all_gather_pairs(op.pairs, self.group, self.async_collectives)
                        stats.collective_s += time.perf_counter() - t1
                        stats.collectives += 1
                    else:  # joined its group's first AG: with async collectives, that call's work is its own
                        work = group_work
                    if work is not None:
                        events[i].work = work
                        if starts is not None:
                            stamp_on_completion(work, events[i])
                            continue
                elif op.kind == DQ:
                    op.caller()
                elif run.compute:
                    raise ScheduleError(f"internal: compute op {i} reached by the load cursor")
                if starts is not None or op.recorded:
                    events[i].record(stream)
                    stats.records += op.recorded
        finally:
            if current is not run.stream:
                self.set_stream(run.stream)
            run.cursor = max(run.cursor, stop)
            stats.load_issue_s += time.perf_counter() - t0
