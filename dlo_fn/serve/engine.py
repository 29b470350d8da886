"""DP multi-concurrency (technique 4): rank 0 drives waves of compatible requests over torch.distributed.

**Serving.** ``EngineOptions(serving="continuous")``, the default, runs lockstep allgather ranks (or a single
rank) as :mod:`dlo_fn.serve.continuous`: a ring that never stops between requests and goes on without a
follower that stalls or dies (given ``checkpoint=``; on a mesh with sp > 1 the unit of admission is a replica,
and a lost rank fails closed). What follows is ``serving="strict"`` (waves), which also serves rank-local and
resident replicas with ``W > 1`` whatever the option says.

Every rank builds the same model and :class:`Engine`; rank 0 calls :meth:`Engine.serve` (then
:meth:`Engine.close`), the others :meth:`Engine.follow`. :meth:`Engine.run` does the right one.

**Replicas.** On a (dp, sp) mesh (:func:`dlo_fn.runtime.mesh.build_mesh`, passed as ``mesh=``) a wave is dealt
to the ``dp`` replicas, not to the ranks: the ``sp`` ranks of replica ``d`` (row ``d`` of the mesh) all run
replica ``d``'s share together (Ulysses: each its tokens, all-to-alls between them), and only the replica's
sp-rank 0 (its *leader*) sends the outcomes to rank 0 (the leader of replica 0). Without a mesh every rank is
its own replica (sp = 1) and what follows reads "rank" for "replica". Everything else, the compatibility key,
validation before dispatch, idle replicas that only serve their shards, the timeouts that fail a wave closed,
holds per wave as below; a rank that raises or stalls inside an all-to-all breaks its replica's collectives
like a broken all-gather does, and the wave fails closed within ``timeout_s``.

The engine owns what lives across serves: the control channel and status board (:mod:`dlo_fn.serve.wire`),
the wave numbering, validation before dispatch, and whether it stopped. Its collaborators own the rest and
return what they did: :class:`~dlo_fn.serve.driver.Driver` (rank 0's dispatch),
:class:`~dlo_fn.serve.follower.Follower` (the other ranks), :class:`~dlo_fn.serve.stream.StreamIntake` (a live
queue of submissions) and :class:`~dlo_fn.serve.share.ShareRunner` (one rank's share of a wave); they are
checked and wired once, when the engine is built (:func:`dlo_fn.serve.engine_parts.build_parts`), and this
module handles the requests.

**Allgather mode: lockstep waves.** Rank 0 validates every submission (a bad one, or one that needs more memory
than a rank has left, :class:`~dlo_fn.serve.admission.MemoryAdmission`, is rejected before any dispatch; in
continuous serving too), forms waves with :func:`dlo_fn.cost.waves.form_waves` (``W`` ranks, ``R`` requests per
rank), and
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
"not dispatched" error. Nothing hangs and nothing is dropped silently. Every result goes to the caller's
``on_result`` the moment it
exists (:meth:`Engine.serve`), so it can be on disk before the serve ends (:mod:`dlo_fn.serve.writer`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from torch import nn

from dlo_fn.cost.waves import Pending, WavePlan, compat_key, form_waves, validate_wave
from dlo_fn.models.lora import adapter_names
from dlo_fn.models.request import Request
from dlo_fn.plan.timeline import Timeline
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.mesh import Mesh
from dlo_fn.runtime.offload import Offloaded
from dlo_fn.serve.admission import MemoryAdmission
from dlo_fn.serve.engine_parts import build_parts, executor_stats, memory_admission
from dlo_fn.serve.outputs import RunInfo
from dlo_fn.serve.recover import Reload
from dlo_fn.serve.requests import (
    EngineOptions,
    RequestResult,
    ServeReport,
    Submission,
    WaveRecord,
    as_submissions,
    not_dispatched,
    rejection,
)
from dlo_fn.serve.share import gather_timelines
from dlo_fn.serve.stream import StreamIntake

__all__ = ["Engine", "OnResult"]

log = logging.getLogger(__name__)

OnResult = Callable[[RequestResult], None]


def _ignore(result: RequestResult) -> None:
    """No ``on_result`` given: the report alone carries the results."""


class Engine:
    """One per rank. ``offloaded`` is what :func:`dlo_fn.runtime.offload.offload` returned for ``model``;
    ``mesh`` the (dp, sp) mesh the ranks form (None: dp = world, sp = 1); ``checkpoint`` where continuous
    serving's survivors read the blocks of a lost rank (:mod:`dlo_fn.serve.recover`: the path the model was
    loaded from, on every host, or a callable that loads it again; None: a lost rank fails everything)."""

    def __init__(
        self,
        model: nn.Module,
        offloaded: Offloaded,
        ctx: DistContext,
        options: EngineOptions | None = None,
        *,
        session: str = "engine",
        mesh: Mesh | None = None,
        checkpoint: str | os.PathLike | Reload | None = None,
    ) -> None:
        self.model, self.offloaded, self.ctx = model, offloaded, ctx
        self.options = options or EngineOptions()
        self.rank, self.world_size = ctx.rank, ctx.world_size
        parts = build_parts(model, offloaded, ctx, self.options, session=session, mesh=mesh, checkpoint=checkpoint)
        self.mode, self.replicas, self.replica, self.config = parts.mode, parts.replicas, parts.replica, parts.config
        self.dp_size, self.sp_size = len(self.replicas), len(self.replicas[0])
        self.lockstep, self.continuous = parts.lockstep, parts.continuous
        self.channel, self.board = parts.channel, parts.board
        self._driver, self._follower, self._continuous = parts.driver, parts.follower, parts.ring
        self._room, self._memory = parts.room, None
        self.stopped: str | None = None  # why the engine failed closed; it dispatches nothing more
        self._next_wave = 0
        self._closed = False
        self._publish: OnResult = _ignore
        self._on_result: OnResult | None = None  # what the driver hands each result to (None: nobody)
        self.board.post("idle")

    @property
    def degraded(self) -> str | None:
        """Why this rank serves degraded (continuous serving lost a rank and went on without it), or None."""
        return self._continuous.degraded if self._continuous is not None else self._follower.degraded

    @property
    def _width(self) -> int:
        """Replicas per wave: all of them in lockstep, one otherwise (each replica runs its own batches)."""
        return self.dp_size if self.lockstep else 1

    # -- public API ------------------------------------------------------------------------------------------
    @property
    def run_info(self) -> RunInfo:
        """What every manifest line repeats about this engine's runs (mode, replicas, R, serving)."""
        return RunInfo(
            self.mode,
            self.dp_size,
            self.sp_size,
            self.options.requests_per_rank,
            "continuous" if self.continuous else "strict",
        )

    def run(self, submissions: Iterable[Request | Submission] | None = None) -> ServeReport | None:
        """Rank 0: :meth:`serve` then :meth:`close`, returning the report; other ranks: :meth:`follow`."""
        if self.rank != 0:
            self.follow()
            return None
        try:
            return self.serve(submissions or ())
        finally:
            self.close()

    def serve(self, submissions: Iterable[Request | Submission], on_result: OnResult | None = None) -> ServeReport:
        """Rank 0: validate, form waves, dispatch, collect; results in submission order (see module doc).
        ``on_result(result)`` gets every result the moment it exists (a rejection at once, the others as their
        wave or ring step ends), so a caller can write it before the serve ends
        (:class:`~dlo_fn.serve.writer.ResultWriter`)."""
        self._require_driver()
        t0 = time.perf_counter()
        self._publish, self._on_result = on_result or _ignore, on_result
        subs = as_submissions(submissions)
        results: dict[int, RequestResult] = {}
        pending: list[Pending] = []
        valid: list[tuple[int, float]] = []
        memory = self.memory_admission()
        for i, sub in enumerate(subs):
            reason = rejection(sub, self.config, memory, adapter_names(self.model))
            if reason is not None:
                results[i] = RequestResult(i, sub.request_id, sub.request, False, error=reason)
                self._publish(results[i])
            else:
                pending.append(Pending(i, compat_key(sub.request), 0.0))
                valid.append((i, time.monotonic()))
        if self._continuous is not None:
            batch = [valid]
            return self._serve_continuous(
                subs, results, lambda: batch.pop() if batch else (), lambda: True, lambda until_s: None, t0
            )
        plan = form_waves(pending, self._width, self.options.requests_per_rank, first_wave_id=self._next_wave)
        self._next_wave += len(plan.waves)
        done, waves = self._dispatch(plan.waves, subs, t0)
        return self._report(subs, {**results, **done}, waves, t0)

    def serve_stream(self, source: Any, on_result: OnResult | None = None) -> ServeReport:
        """Rank 0: serve submissions as they arrive on a ``queue.Queue`` (``None`` closes it), with the bounded
        wait ``options.max_wait_s`` to fill a wave (see :mod:`dlo_fn.serve.stream`). While nothing is due the
        followers get an ``idle`` message every ``timeout_s / 3``, so an empty queue never trips the
        process-group timeout. ``on_result``: as for :meth:`serve`."""
        self._require_driver()
        opts = self.options
        keepalive_s = opts.timeout_s / 3
        t0 = time.perf_counter()
        self._publish, self._on_result = on_result or _ignore, on_result
        intake = StreamIntake(
            source,
            self.config,
            width=self._width,
            requests_per_rank=opts.requests_per_rank,
            max_wait_s=opts.max_wait_s,
            on_result=self._publish,
            memory=self.memory_admission(),
            adapters=adapter_names(self.model),
        )
        results: dict[int, RequestResult] = {}
        records: list[WaveRecord] = []
        last_message = time.monotonic()
        if self._continuous is not None:

            def wait(until_s: float) -> None:
                intake.receive(until_s=until_s, stopped=self.stopped)

            report = self._serve_continuous(
                intake.submissions,
                intake.rejected,
                lambda: intake.take_arrived(self.stopped),
                lambda: intake.closed,
                wait,
                t0,
            )
            while not intake.closed:  # the engine stopped: what still arrives gets "not dispatched"
                intake.receive(until_s=time.monotonic() + keepalive_s, stopped=self.stopped)
            return self._report(
                intake.submissions,
                {**{r.index: r for r in report.results}, **intake.rejected},
                (),
                t0,
                steps=report.steps,
            )
        while True:
            waves = intake.due_waves(self._next_wave)
            if waves:
                self._next_wave += len(waves)
                done, dispatched = self._dispatch(waves, intake.submissions, t0)
                results.update(done)
                records.extend(dispatched)
                last_message = time.monotonic()
                continue
            if intake.closed:
                break
            intake.receive(until_s=last_message + keepalive_s, stopped=self.stopped)
            if self.lockstep and self.stopped is None and time.monotonic() - last_message >= keepalive_s:
                self.channel.broadcast({"kind": "idle"})
                last_message = time.monotonic()
        return self._report(intake.submissions, {**results, **intake.rejected}, records, t0)

    def serve_forced(self, waves: Sequence[Sequence[Request]], on_result: OnResult | None = None) -> ServeReport:
        """Rank 0: dispatch caller-formed waves as given. Every wave is checked first
        (:func:`~dlo_fn.cost.waves.validate_wave`): a mixed one raises ``IncompatibleWaveError`` naming the
        differing fields before anything is dispatched."""
        self._require_driver()
        width = self._width
        for w in waves:
            validate_wave(list(w), width, self.options.requests_per_rank)
        t0 = time.perf_counter()
        self._publish, self._on_result = on_result or _ignore, on_result
        subs = as_submissions([r for w in waves for r in w])
        plans, start = [], 0
        for w in waves:
            for r in w:
                r.validate(self.config)
                if r.lora is not None and r.lora not in adapter_names(self.model):
                    raise ValueError(f"lora={r.lora!r} is not loaded (loaded: {list(adapter_names(self.model))})")
            idx = tuple(range(start, start + len(w)))
            plans.append(WavePlan(self._next_wave, compat_key(w[0]), idx, width, self.options.requests_per_rank))
            self._next_wave += 1
            start += len(w)
        done, records = self._dispatch(tuple(plans), subs, t0)
        return self._report(subs, done, records, t0)

    def memory_admission(self) -> MemoryAdmission | None:
        """Rank 0: the admission against memory (:class:`~dlo_fn.serve.admission.MemoryAdmission`) over every
        rank's posted room, built at the first serve; None for a model without a DiT config to size."""
        if self._memory is None:
            self._memory = memory_admission(
                self.model, self.board, self._room, self.options, self.world_size, self.sp_size
            )
        return self._memory

    def close(self) -> None:
        """Rank 0: tell the followers to return (skipped when the engine failed: the group is broken)."""
        if self.rank != 0 or self._closed:
            return
        self._closed = True
        channel = self._continuous.channel if self._continuous is not None else self.channel
        if self.stopped is None and channel.world_size > 1:
            try:
                channel.broadcast({"kind": "stop"})
            except Exception as exc:  # noqa: BLE001
                log.error("could not tell the followers to stop: %s", exc)

    def follow(self) -> None:
        """Ranks != 0: serve waves (or queues) until rank 0 says stop or a wave fails."""
        if self.rank == 0:
            raise RuntimeError("rank 0 drives: call serve()/close() (or run()), not follow()")
        reason = self._follower.follow()
        if reason is not None:
            self.stopped = reason

    def gather_timeline(self, meta: Sequence[tuple[str, str]] = ()) -> Timeline:
        """Rank 0, before :meth:`close`: every rank's measured executor timeline since the last call (needs
        ``record_timeline``), in rank order, as one Timeline (empty when none was recorded). ``meta`` is added
        to each rank's. Not after a failure (the group is broken): raises ``RuntimeError``."""
        self._require_driver()
        if self.stopped is not None or self.degraded is not None:
            raise RuntimeError(
                f"engine {'stopped' if self.stopped else 'degraded'} ({self.stopped or self.degraded}):"
                f" no timelines to gather"
            )
        return gather_timelines(self.channel, self.offloaded, self.world_size, meta)

    # -- dispatch --------------------------------------------------------------------------------------------
    def _require_driver(self) -> None:
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank}: only rank 0 serves requests; other ranks call follow()")
        if self._closed:
            raise RuntimeError("engine closed: build a new one")

    def _dispatch(
        self, waves: Sequence[WavePlan], subs: Sequence[Submission], t0: float
    ) -> tuple[dict[int, RequestResult], list[WaveRecord]]:
        """Results of every request in ``waves`` (a "not dispatched" error for those a failure kept from
        running) and the records of the waves that ran."""
        results: dict[int, RequestResult] = {}
        records: list[WaveRecord] = []
        if self.stopped is None:
            done = self._driver.dispatch(waves, subs, t0, self._on_result)
            results.update(done.results)
            records.extend(done.waves)
            if done.stopped is not None:
                self.stopped = done.stopped
        for w in waves:  # whatever was not reached: the engine stopped before it
            for i in w.indices:
                if i not in results:
                    results[i] = not_dispatched(i, subs[i], self.stopped)
                    self._publish(results[i])
        return results, records

    def _serve_continuous(
        self,
        subs: Sequence[Submission],
        rejected: Mapping[int, RequestResult],
        arrived: Any,
        closed: Any,
        wait: Any,
        t0: float,
    ) -> ServeReport:
        """Continuous serving (:mod:`dlo_fn.serve.continuous`) of what ``arrived()`` gives until ``closed()``."""
        if self.stopped is not None:
            done = {i: not_dispatched(i, s, self.stopped) for i, s in enumerate(subs) if i not in rejected}
            for result in done.values():
                self._publish(result)
            return self._report(subs, {**done, **rejected}, (), t0)
        served = self._continuous.serve(subs, arrived, closed, wait, t0, self._on_result)
        if served.stopped is not None:
            self.stopped = served.stopped
        return self._report(subs, {**rejected, **served.results}, (), t0, steps=tuple(served.steps))

    def _report(
        self,
        subs: Sequence[Submission],
        results: Mapping[int, RequestResult],
        waves: Sequence[WaveRecord],
        t0: float,
        steps: tuple = (),
    ) -> ServeReport:
        results = dict(results)
        for i, s in enumerate(subs):  # anything the engine never reached (it stopped first)
            if i not in results:
                results[i] = not_dispatched(i, s, self.stopped)
                self._publish(results[i])
        return ServeReport(
            tuple(results[i] for i in range(len(subs))),
            tuple(waves),
            self.mode,
            self.dp_size,
            self.options.requests_per_rank,
            time.perf_counter() - t0,
            executor_stats(self.offloaded),
            sp_size=self.sp_size,
            steps=steps,
            serving="continuous" if self.continuous else "strict",
            degraded=self.degraded,
        )
