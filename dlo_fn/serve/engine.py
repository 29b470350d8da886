"""DP multi-concurrency (technique 4): rank 0 drives waves of compatible requests over torch.distributed.

Every rank builds the same model and :class:`Engine`; rank 0 calls :meth:`Engine.serve` (then
:meth:`Engine.close`), the others :meth:`Engine.follow`. :meth:`Engine.run` does the right one.

**Allgather mode: lockstep waves.** Rank 0 validates every submission (a bad one is rejected before any
dispatch), forms waves with :func:`dlo_fn.plan.waves.form_waves` (``W`` ranks, ``R`` requests per rank), and
for each wave:

1. broadcasts it (one ``broadcast_object_list``): rank ``r`` runs the requests at positions ``r, r+W, ...``;
2. every rank runs its share block-major (:func:`dlo_fn.serve.batch.run_batch`); the per-block all-gathers
   keep all ranks in lockstep, and a rank with nothing to do serves its shards without computing;
3. each follower sends its outcomes to rank 0, which matches them to requests by wave position.

**Rank-local and resident modes: independent replicas.** There is no collective inside a wave, so ranks
need not wait for each other: rank 0 cuts the requests into batches of up to ``R`` compatible requests, deals
them round-robin into one queue per rank, broadcasts the queues once, and every rank works through its own
queue. A finished follower posts ``done`` on the status board and waits (on the board, not in a collective,
so no timeout fires while others are still busy) until rank 0 asks for its results.

**Failing closed.** A rank that raises gets error results for its requests and keeps serving the wave's
all-gathers (see :mod:`dlo_fn.serve.batch`). A rank that stalls or dies breaks the collectives: every call
is bounded by ``timeout_s`` (the process group's timeout; in independent mode also a progress watchdog on the
board), the wave fails closed (every request in it gets an error naming the wave and the culprit rank, from
:class:`~dlo_fn.serve.wire.StatusBoard`), the engine stops, and every request not yet dispatched gets a
"not dispatched" error. Nothing hangs and nothing is dropped silently.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Iterable, Sequence

from dlo_fn.models.request import Request
from dlo_fn.plan.waves import Pending, WavePlan, compat_key, form_waves, validate_wave
from dlo_fn.serve.batch import Outcome, WaveAborted, run_batch
from dlo_fn.serve.requests import (
    ENGINE_MODES, EngineOptions, RequestResult, ServeReport, Submission, WaveRecord, as_submissions, from_wire,
)
from dlo_fn.serve.wire import Channel, StatusBoard, culprits, default_store

__all__ = ["Engine", "EngineStopped"]

log = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine failed closed earlier; it dispatches nothing more."""


class Engine:
    """One per rank. ``offloaded`` is what :func:`dlo_fn.runtime.offload.offload` returned for ``model``."""

    def __init__(self, model: Any, offloaded: Any, ctx: Any, options: EngineOptions | None = None, *,
                 session: str = "engine") -> None:
        self.model, self.offloaded, self.ctx = model, offloaded, ctx
        self.options = options or EngineOptions()
        self.mode = offloaded.mode
        if self.mode not in ENGINE_MODES:
            raise ValueError(f"engine mode must be one of {ENGINE_MODES}, got {self.mode!r}")
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.lockstep = self.mode == "allgather" and self.world_size > 1
        self.channel = Channel(ctx.group, ctx.platform.backend, self.options.timeout_s)
        self.board = StatusBoard(default_store(), self.rank, self.world_size, session)
        self.tick: Any = None  # rank 0's progress bar, set while serving
        self.config = getattr(model, "config", None)
        self.stopped: str | None = None
        self._next_wave = 0
        self._round = 0
        self._closed = False
        self.board.post("idle")

    # -- public API ------------------------------------------------------------------------------------------
    def run(self, submissions: Iterable[Request | Submission] | None = None) -> ServeReport | None:
        """Rank 0: :meth:`serve` then :meth:`close`, returning the report; other ranks: :meth:`follow`."""
        if self.rank != 0:
            self.follow()
            return None
        try:
            return self.serve(submissions or ())
        finally:
            self.close()

    def serve(self, submissions: Iterable[Request | Submission]) -> ServeReport:
        """Rank 0: validate, form waves, dispatch, collect; results in submission order (see module doc)."""
        self._require_driver()
        t0 = time.perf_counter()
        subs = as_submissions(submissions)
        results: dict[int, RequestResult] = {}
        pending: list[Pending] = []
        for i, sub in enumerate(subs):
            reason = sub.error
            if reason is None:
                try:
                    sub.request.validate(self.config)
                except ValueError as exc:
                    reason = f"rejected before dispatch: {exc}"
            if reason is not None:
                results[i] = RequestResult(i, sub.request_id, sub.request, False, error=reason)
            else:
                pending.append(Pending(i, compat_key(sub.request), 0.0))
        width = self.world_size if self.lockstep else 1
        plan = form_waves(pending, width, self.options.requests_per_rank, first_wave_id=self._next_wave)
        self._next_wave += len(plan.waves)
        waves = self._dispatch(plan.waves, subs, results, t0)
        return ServeReport(tuple(results[i] for i in range(len(subs))), tuple(waves), self.mode,
                           self.world_size, self.options.requests_per_rank, time.perf_counter() - t0,
                           self._stats())

    def serve_stream(self, source: Any) -> ServeReport:
        """Rank 0: serve submissions as they arrive on a ``queue.Queue`` (``None`` closes it), with the bounded
        wait ``options.max_wait_s`` to fill a wave (see :mod:`dlo_fn.serve.engine_stream`)."""
        from dlo_fn.serve.engine_stream import serve_stream

        return serve_stream(self, source)

    def serve_forced(self, waves: Sequence[Sequence[Request]]) -> ServeReport:
        """Rank 0: dispatch caller-formed waves as given. Every wave is checked first
        (:func:`~dlo_fn.plan.waves.validate_wave`): a mixed one raises ``IncompatibleWaveError`` naming the
        differing fields before anything is dispatched."""
        self._require_driver()
        width = self.world_size if self.lockstep else 1
        for w in waves:
            validate_wave(list(w), width, self.options.requests_per_rank)
        t0 = time.perf_counter()
        subs = as_submissions([r for w in waves for r in w])
        results: dict[int, RequestResult] = {}
        plans, start = [], 0
        for w in waves:
            for r in w:
                r.validate(self.config)
            idx = tuple(range(start, start + len(w)))
            plans.append(WavePlan(self._next_wave, compat_key(w[0]), idx, width, self.options.requests_per_rank))
            self._next_wave += 1
            start += len(w)
        records = self._dispatch(tuple(plans), subs, results, t0)
        return ServeReport(tuple(results[i] for i in range(len(subs))), tuple(records), self.mode,
                           self.world_size, self.options.requests_per_rank, time.perf_counter() - t0,
                           self._stats())

    def _stats(self) -> dict[str, float]:
        """Rank 0's executor counters so far: block computes, loads, host issue and block-call seconds."""
        ex = getattr(self.offloaded, "executor", None)
        if ex is None:
            return {}
        st = ex.stats
        return {"computes": float(st.computes), "loads": float(st.loads), "runs": float(st.runs),
                "issue_s": st.issue_s, "call_s": st.call_s}

    def close(self) -> None:
        """Rank 0: tell the followers to return (skipped when the engine failed: the group is broken)."""
        if self.rank != 0 or self._closed:
            return
        self._closed = True
        if self.stopped is None and self.world_size > 1:
            try:
                self.channel.broadcast({"kind": "stop"})
            except Exception as exc:  # noqa: BLE001
                log.error("could not tell the followers to stop: %s", exc)

    def follow(self) -> None:
        """Ranks != 0: serve waves (or queues) until rank 0 says stop or a wave fails."""
        if self.rank == 0:
            raise RuntimeError("rank 0 drives: call serve()/close() (or run()), not follow()")
        from dlo_fn.serve import engine_follow

        engine_follow.follow(self)

    # -- dispatch --------------------------------------------------------------------------------------------
    def _require_driver(self) -> None:
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank}: only rank 0 serves requests; other ranks call follow()")
        if self._closed:
            raise RuntimeError("engine closed: build a new one")

    def _dispatch(self, waves: Sequence[WavePlan], subs: Sequence[Submission],
                  results: dict[int, RequestResult], t0: float) -> list[WaveRecord]:
        from dlo_fn.serve import engine_drive

        if self.stopped is not None:
            records: list[WaveRecord] = []
        elif self.lockstep:
            records = engine_drive.lockstep(self, waves, subs, results, t0)
        else:
            records = engine_drive.independent(self, waves, subs, results, t0)
        for w in waves:  # whatever was not reached: the engine stopped before it
            for i in w.indices:
                if i not in results:
                    results[i] = RequestResult(
                        i, subs[i].request_id, subs[i].request, False,
                        error=f"not dispatched: the engine stopped earlier ({self.stopped})")
        return records

    # -- helpers shared by the drive / follow modules ---------------------------------------------------------
    def run_share(self, wave_id: int, num_steps: int, share: Sequence[tuple[int, dict]],
                  trace: list | None) -> list[Outcome]:
        """Run this rank's ``(position, request as a dict)`` pairs of a wave, posting progress on the board."""
        fault = self.options.fault
        fault = fault if fault is not None and fault.rank == self.rank and fault.wave == wave_id else None
        self.board.post("running", wave=wave_id, step=0)
        spans: list | None = [] if trace is not None else None
        on_block = None
        if spans is not None:
            def on_block(label: str, step: int, block: int, s: float, e: float) -> None:
                spans.append((self.rank, "compute", f"{label} s{step} b{block}", s, e))
        positions = [p for p, _ in share]
        outcomes = run_batch(
            self.model, self.offloaded, [from_wire(r) for _, r in share], positions, num_steps=num_steps,
            rank=self.rank, fault=fault, on_block=on_block,
            on_step=lambda s: self._on_step(wave_id, s),
        )
        if trace is not None:
            measured = self._executor_spans(positions)
            # The executor's compute spans start after the block's weights arrived; the engine's own spans
            # (``on_block``) include that wait, so they are used only when there is no executor (resident).
            trace.extend(measured if any(lane == "compute" for _, lane, *_ in measured) else spans + measured)
        return outcomes

    def _on_step(self, wave_id: int, step: int) -> None:
        self.board.post("running", wave=wave_id, step=step + 1)
        if self.tick is not None:
            self.tick()

    def _executor_spans(self, positions: Sequence[int]) -> list[tuple[int, str, str, float, float]]:
        """The executor's measured spans of the last run(s), on the engine's clock (``time.perf_counter``);
        compute ops relabelled ``p<wave position> s<step> b<block>``."""
        ex = getattr(self.offloaded, "executor", None)
        if ex is None or not ex.record_timeline:
            return []
        timeline = ex.take_timeline()
        base = ex.timeline_origin_s
        if base is None:
            return []  # device events: no host-clock origin to align with
        num_blocks = ex.layout.num_blocks
        out = []
        for sp in timeline.spans:
            label = sp.op
            if sp.stream == "compute":
                m = re.search(r"C k(\d+) b(\d+)@s\d+ r(\d+)", sp.op)
                if m is None or int(m.group(3)) >= len(positions):
                    continue
                k, b, r = (int(g) for g in m.groups())
                label = f"p{positions[r]} s{k // num_blocks} b{b}"
            out.append((self.rank, sp.stream, label, base + sp.start_s, base + sp.end_s))
        return out

    def fail(self, wave_id: int | None, where: str, exc: BaseException, ranks: Sequence[int],
             what: str | None = None) -> str:
        """Record a failed wave (or ``what`` failed): diagnose the ``ranks`` on the board, stop the engine,
        return the reason."""
        verdicts = self.board.diagnose(ranks, wave_id, self.options.grace_s)
        bad = culprits(verdicts)
        blame = "; ".join(str(v) for v in bad) if bad else "no culprit found on the status board"
        reason = (f"{what or f'wave {wave_id}'} failed closed: {blame}. Rank 0 saw, {where}: "
                  f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        log.error(reason)
        self.stopped = reason
        return reason


def request_result(index: int, sub: Submission, outcome: Outcome | None, *, rank: int, wave_id: int,
                   position: int, queued_s: float, wave_s: float, error: str | None = None) -> RequestResult:
    """A result from a rank's outcome (or an error when there is none)."""
    timings = {"queued_s": queued_s, "wave_s": wave_s}
    if outcome is None or error is not None:
        return RequestResult(index, sub.request_id, sub.request, False, error=error or "no outcome returned",
                             rank=rank, wave_id=wave_id, position=position, timings=timings)
    timings["compute_s"] = outcome.compute_s
    return RequestResult(index, sub.request_id, sub.request, outcome.ok, outcome.video, outcome.sha256,
                         outcome.error, rank, wave_id, position, timings)
