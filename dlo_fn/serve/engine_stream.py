"""Rank 0 serving requests as they arrive: :meth:`~dlo_fn.serve.engine.Engine.serve_stream`.

Submissions arrive on a ``queue.Queue`` (a :class:`~dlo_fn.models.Request` or a
:class:`~dlo_fn.serve.requests.Submission`; ``None`` closes the stream). Each is validated on arrival (a bad
one gets its error result at once), then waits in :func:`dlo_fn.plan.waves.form_waves`: a wave goes out as soon
as it is full, or when its oldest request has waited ``EngineOptions.max_wait_s`` (the bounded wait to fill a
wave), or when the stream closes. While nothing is ready the followers, blocked in the wave broadcast, get an
``idle`` message every ``timeout_s / 3`` so that an empty queue never trips the process-group timeout.
"""

from __future__ import annotations

import math
import queue
import time
from typing import Any

from dlo_fn.models.request import Request
from dlo_fn.plan.waves import Pending, compat_key, form_waves
from dlo_fn.serve.requests import RequestResult, ServeReport, Submission

__all__ = ["serve_stream"]


def _submission(item: Any, index: int, seen: set[str]) -> Submission:
    """A bad item becomes a submission that carries its error, so it gets an error result like any rejected
    request and never stops the stream (results already served and requests still queued are kept)."""
    if isinstance(item, Request):
        item = Submission(f"req{index:04d}", item)
    if not isinstance(item, Submission):
        return Submission(f"item{index:04d}", None, error=(
            f"rejected before dispatch: stream item {index} is a {type(item).__name__}; put a Request, a "
            f"Submission, or None (end of stream) on the queue"))
    if item.request_id in seen:
        return Submission(f"{item.request_id}#dup{index}", None, error=(
            f"rejected before dispatch: duplicate request id {item.request_id!r} (stream item {index}); give "
            f"each submission its own id"))
    seen.add(item.request_id)
    return item


def serve_stream(engine: Any, source: "queue.Queue[Any]") -> ServeReport:
    engine._require_driver()
    opts = engine.options
    width = engine.world_size if engine.lockstep else 1
    keepalive_s = opts.timeout_s / 3
    t0 = time.perf_counter()
    subs: list[Submission] = []
    seen: set[str] = set()
    results: dict[int, RequestResult] = {}
    pending: list[Pending] = []
    records: list = []
    closed = False
    last_message = time.monotonic()
    while True:
        now = time.monotonic()
        plan = form_waves(pending, width, opts.requests_per_rank, now_s=math.inf if closed else now,
                          max_wait_s=opts.max_wait_s, first_wave_id=engine._next_wave)
        if plan.waves:
            engine._next_wave += len(plan.waves)
            records.extend(engine._dispatch(plan.waves, subs, results, t0))
            waiting = set(plan.waiting)
            pending = [p for p in pending if p.index in waiting]
            last_message = time.monotonic()
            continue
        if closed:
            break
        # Sleep until the oldest partial wave is due, a keep-alive is due, or something arrives.
        due = min((p.arrival_s + opts.max_wait_s for p in pending), default=math.inf)
        wait = max(0.0, min(due, last_message + keepalive_s) - now)
        try:
            item = source.get(timeout=wait if wait > 0 else 1e-4)
        except queue.Empty:
            item = ...
        if item is None:
            closed = True
        elif item is not ...:
            index = len(subs)
            sub = _submission(item, index, seen)
            subs.append(sub)
            reason = sub.error
            if reason is None:
                try:
                    sub.request.validate(engine.config)
                except ValueError as exc:
                    reason = f"rejected before dispatch: {exc}"
            if reason is not None or engine.stopped is not None:
                results[index] = RequestResult(index, sub.request_id, sub.request, False, error=reason or (
                    f"not dispatched: the engine stopped earlier ({engine.stopped})"))
            else:
                pending.append(Pending(index, compat_key(sub.request), time.monotonic()))
        if (engine.lockstep and engine.stopped is None
                and time.monotonic() - last_message >= keepalive_s):
            engine.channel.broadcast({"kind": "idle"})
            last_message = time.monotonic()
    return ServeReport(tuple(results[i] for i in range(len(subs))), tuple(records), engine.mode,
                       engine.world_size, opts.requests_per_rank, time.perf_counter() - t0, engine._stats())
