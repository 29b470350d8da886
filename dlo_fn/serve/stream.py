"""Rank 0's intake of a live stream of submissions, for :meth:`~dlo_fn.serve.engine.Engine.serve_stream`.

Submissions arrive on a ``queue.Queue`` (a :class:`~dlo_fn.models.Request` or a
:class:`~dlo_fn.serve.requests.Submission`; ``None`` closes the stream). :class:`StreamIntake` validates each on
arrival (a bad one gets its error result at once and never stops the stream) and holds the rest in
:func:`dlo_fn.cost.waves.form_waves`: a wave is due as soon as it is full, or when its oldest request has waited
``max_wait_s`` (the bounded wait to fill a wave), or when the stream closes. The engine dispatches what is due
and, while nothing is, keeps the followers alive (they wait in the wave broadcast) with an ``idle`` message.
"""

from __future__ import annotations

import math
import queue
import time
from typing import Any, Callable

from dlo_fn.cost.waves import Pending, WavePlan, compat_key, form_waves
from dlo_fn.models.config import DiTConfig
from dlo_fn.models.request import Request
from dlo_fn.serve.requests import RequestResult, Submission, rejection

__all__ = ["StreamIntake"]


class StreamIntake:
    """What arrived on ``source`` so far: every ``submissions`` entry (by arrival index), the ``rejected``
    ones' results, and the valid ones still waiting for a wave."""

    def __init__(
        self,
        source: "queue.Queue[Any]",
        config: DiTConfig | None,
        *,
        width: int,
        requests_per_rank: int,
        max_wait_s: float,
        on_result: Callable[[RequestResult], None] | None = None,
        memory: Any = None,
        adapters: tuple[str, ...] = (),
    ) -> None:
        self.source, self.config, self.on_result, self.memory = source, config, on_result, memory
        self.adapters = adapters
        self.width, self.requests_per_rank, self.max_wait_s = width, requests_per_rank, max_wait_s
        self.submissions: list[Submission] = []
        self.rejected: dict[int, RequestResult] = {}
        self.closed = False
        self._seen: set[str] = set()
        self._pending: list[Pending] = []

    def due_waves(self, first_wave_id: int) -> tuple[WavePlan, ...]:
        """The waves due now (every waiting request once the stream closed), numbered from ``first_wave_id``;
        they stop waiting."""
        plan = form_waves(
            self._pending,
            self.width,
            self.requests_per_rank,
            now_s=math.inf if self.closed else time.monotonic(),
            max_wait_s=self.max_wait_s,
            first_wave_id=first_wave_id,
        )
        if plan.waves:
            waiting = set(plan.waiting)
            self._pending = [p for p in self._pending if p.index in waiting]
        return plan.waves

    def take_valid(self) -> tuple[tuple[int, float], ...]:
        """Continuous serving: every valid waiting request as ``(index, arrival time.monotonic)``, in arrival
        order; they stop waiting here (no waves are formed)."""
        out = tuple((p.index, p.arrival_s) for p in self._pending)
        self._pending = []
        return out

    def take_arrived(self, stopped: str | None = None) -> tuple[tuple[int, float], ...]:
        """Continuous serving: take what is on the queue now, without waiting, then :meth:`take_valid`."""
        while not self.closed and not self.source.empty():
            self.receive(until_s=time.monotonic(), stopped=stopped)
        return self.take_valid()

    def receive(self, until_s: float, stopped: str | None = None) -> None:
        """Take at most one item, waiting until the oldest partial wave is due or ``until_s``
        (``time.monotonic``) at the latest. ``stopped``: the engine failed earlier (why), so a valid
        arrival gets a "not dispatched" error."""
        now = time.monotonic()
        due = min((p.arrival_s + self.max_wait_s for p in self._pending), default=math.inf)
        wait = max(0.0, min(due, until_s) - now)
        try:
            item = self.source.get(timeout=wait if wait > 0 else 1e-4)
        except queue.Empty:
            return
        if item is None:
            self.closed = True
            return
        index = len(self.submissions)
        sub = self._submission(item, index)
        self.submissions.append(sub)
        reason = rejection(sub, self.config, self.memory, self.adapters)
        if reason is not None or stopped is not None:
            self.rejected[index] = RequestResult(
                index,
                sub.request_id,
                sub.request,
                False,
                error=reason or (f"not dispatched: the engine stopped earlier ({stopped})"),
            )
            if self.on_result is not None:
                self.on_result(self.rejected[index])
        else:
            self._pending.append(Pending(index, compat_key(sub.request), time.monotonic()))

    def _submission(self, item: Any, index: int) -> Submission:
        """A bad item becomes a submission that carries its error, so it gets an error result like any rejected
        request and never stops the stream (results already served and requests still queued are kept)."""
        if isinstance(item, Request):
            item = Submission(f"req{index:04d}", item)
        if not isinstance(item, Submission):
            return Submission(
                f"item{index:04d}",
                None,
                error=(
                    f"rejected before dispatch: stream item {index} is a {type(item).__name__}; put a Request, a "
                    f"Submission, or None (end of stream) on the queue"
                ),
            )
        if item.request_id in self._seen:
            return Submission(
                f"{item.request_id}#dup{index}",
                None,
                error=(
                    f"rejected before dispatch: duplicate request id {item.request_id!r} (stream item {index}); give "
                    f"each submission its own id"
                ),
            )
        self._seen.add(item.request_id)
        return item
