"""Issuing a run's load and all-gather ops up to a cursor: the executor's loop over its compiled program.

:func:`issue_until` walks the ops ``run.cursor .. stop-1`` of the executor's open run in issue order: each op
waits on the events of its ``deps`` (and, for a buffer's first use in the run, on the previous run's last use of
it), is launched on its stream and records its event if something waits on it (``Program.recorded``; a timeline
records every op). Through torch's streams and events, or, where the
executor has driver calls (:mod:`dlo_fn.runtime.cuda_raw`), through bare driver calls with the handles bound
at compile time. The executor's compute ops call it for the loads in front of each block, and ``end_run`` for
what is left.
"""

from __future__ import annotations

import time
from typing import Any

from dlo_fn.plan.schedule import ScheduleError
from dlo_fn.runtime.dist import all_gather_pairs
from dlo_fn.runtime.program import _AG, _C, _H2D, RunState
from dlo_fn.runtime.recorder import stamp_on_completion

__all__ = ["flush_record", "issue_until", "wait_for"]


def flush_record(ex: Any, run: RunState) -> None:
    """Issue the compute record the driver-call path held back (:meth:`Executor._compute_fast`), if any."""
    pending, run.pending = run.pending, None
    if pending is not None:
        fn, args, i = pending
        if code := fn(*args):
            ex._driver_failed(run, fn, code, i)


def wait_for(stream: Any, p: Any, i: int, events: list[Any], carry: dict[str, Any]) -> None:
    """Make ``stream`` wait for op ``i``'s dependencies in the run, and for the previous run's last use of the
    buffers it uses first (``carry``: buffer -> event)."""
    for d in p.waits[i]:
        stream.wait_event(events[d])
    for buf in p.carry[i]:
        ev = carry.get(buf)
        if ev is not None:
            stream.wait_event(ev)


def issue_until(ex: Any, run: RunState, stop: int) -> None:
    """Issue ops ``run.cursor .. stop-1``; compute ops among them only when the run has no compute.
    Streams are switched with one ``set_stream`` per change (the compute stream is restored at the end)."""
    flush_record(ex, run)
    if run.cursor >= stop:
        return
    if ex._raw is not None:
        return _issue_until_raw(ex, run, stop)
    t0 = time.perf_counter()
    p, events, starts, set_stream = run.program, run.events, run.starts, ex._set_stream
    current, group_work = run.stream, None
    try:
        for i in range(run.cursor, stop):
            kind = p.kinds[i]
            stream = p.streams[i] if kind != _C else run.stream
            if stream is not current:
                set_stream(stream)
                current = stream
            wait_for(stream, p, i, events, ex._carry)
            if starts is not None:
                starts[i].record(stream)
            if kind == _H2D:
                for dst, src in p.args[i]:
                    dst.copy_(src, non_blocking=True)
                ex.stats.loads += 1
            elif kind == _AG:  # W > 1: a shard group of one has no AG op (plan.lowering)
                if p.args[i]:
                    work = group_work = all_gather_pairs(p.args[i], ex._gather_group, ex.async_collectives)
                else:  # joined its group's first AG (Program): with async collectives, that call's work is its own
                    work = group_work
                if work is not None:
                    events[i].work = work
                    if starts is not None:
                        stamp_on_completion(work, events[i])
                        continue
            elif run.compute:
                raise ScheduleError(f"internal: compute op {i} reached by the load cursor")
            if starts is not None or i in p.recorded:  # an event nothing waits on is not recorded (Program)
                events[i].record(stream)
    finally:
        if current is not run.stream:
            set_stream(run.stream)
        run.cursor = max(run.cursor, stop)
        ex.stats.load_issue_s += time.perf_counter() - t0


def _issue_until_raw(ex: Any, run: RunState, stop: int) -> None:
    """:func:`issue_until` through driver calls: explicit stream handles, no copy_; an all-gather is the
    executor's collective call on its stream."""
    t0 = time.perf_counter()
    p, events, carry, cu = run.program, run.events, ex._carry, ex._raw
    wait, record, copy, check = cu._wait, cu._record, cu.copy, cu.check
    loads = 0
    try:
        for i in range(run.cursor, stop):
            op = p.raw[i]
            if op is None:
                if run.compute:
                    raise ScheduleError(f"internal: compute op {i} reached by the load cursor")
                if i in p.recorded:
                    events[i].record(run.cstream)
                continue
            h, copies = op
            for d in p.waits[i]:
                code = wait(h, events[d].handle, 0)
                if code:
                    check(code, "cuStreamWaitEvent")
            for buf in p.carry[i]:
                ev = carry.get(buf)
                if ev is not None:
                    check(wait(h, ev.handle, 0), "cuStreamWaitEvent")
            for dst, src, n, dev in copies:
                copy(dst, src, n, h, dev)
            if p.kinds[i] == _AG and p.args[i]:
                ex._gather_now(p.args[i], run.stream)
            loads += 1
            if i in p.recorded:
                code = record(events[i].handle, h)
                if code:
                    check(code, "cuEventRecord")
    finally:
        run.cursor = max(run.cursor, stop)
        ex.stats.loads += loads
        ex.stats.load_issue_s += time.perf_counter() - t0
