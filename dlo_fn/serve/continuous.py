"""Continuous DP serving: the ring never stops between requests; a replica whose request ends takes the next
queued one at the next step boundary (``EngineOptions(serving="continuous")``, the default; ``"strict"`` keeps
the waves).

**When it wins.** Requests that arrive over time, or differ in shape or step count, never wait for a wave to
fill or for its longest member (measured on CPU gloo ranks: ``figures/data/continuous_cpu.*``, notebook 10). It
loses on a burst of requests of very different cost, where every lockstep step waits for the replica with the
largest request (the planner says so for such a trace, and ``admission="cost"`` does not fix it without
overtaking): there strict's one-key waves keep like with like.

**Protocol** (lockstep allgather ranks, or one rank in any mode). Ring step ``k`` is one executor run of one
denoising step on every rank (:mod:`dlo_fn.serve.continuous_rank` says why ranks holding different requests
stay in lockstep). The unit of admission is a *replica*: one rank, or on a (dp, sp) mesh the ``sp`` ranks of
one mesh row, which all get the same starts and run each request together (Ulysses, as strict waves do: every
sp rank its tokens, the all-to-alls within the replica's sp group); the replica's leader (its sp-rank 0) sends
the videos, its partners their outcomes without them. Before each step rank 0

1. retires what ended, admits arrived requests with the live rule of the planner
   (:func:`dlo_fn.cost.dispatch.admit_continuous`: FIFO, no overtaking; the head goes to the first empty
   replica, else to the replica of its key with the fewest held, ``< R``; key = the request's shape:
   :func:`admission_key`; or, with ``EngineOptions(admission="cost")``,
   :func:`~dlo_fn.cost.dispatch.admit_cost_aware` on the relative costs of :func:`admission_cost`), and
2. broadcasts ``{"kind": "cstep", "step": k, "starts": [[(index, request), ...] per rank], "ended": [...]}``
   (one ``broadcast_object_list``: every rank agrees on who does what before the step, bounded by
   ``timeout_s``; ``ended``: the requests that ended on an sp replica since the last step, which a partner
   that did not fail drops before it);

then every rank runs its step (holding nothing: a gather-only run) and each follower answers with
``{"step": k, "outcomes": [...], "compute_s": x}``: the requests that ended in the step (their videos, or their
errors) and its block-call seconds. Requests of different height, width, frames, steps, guidance and CFG on/off
run side by side on different replicas; ``R > 1`` per replica only for requests of one shape.

When no rank holds anything and the queue is empty the ring waits (followers get ``idle`` every
``timeout_s / 3``); when the input ends and the last request left, :meth:`Engine.close` sends ``stop``.

**Failing closed, and going on.** A rank that raises: every request it held in that step gets its error, the
others go on (its run is drained; on an sp replica it runs the step's remaining block calls without keeping
their results, so its partners' all-to-alls complete, and a replica's request fails when any of its sp ranks
reports an error). A follower that stalls or dies breaks the step's all-gathers or the reply:
within ``timeout_s`` rank 0 names it from the status board (dead / stalled, at which ring step) and every
request it held gets that reason. The survivors do not lose theirs: they agree on a degraded plan through the
store and go on as rank-local replicas streaming whole blocks from the checkpoint mapping
(:mod:`dlo_fn.serve.recover` says how and why not a re-shard), each resuming its requests from the last step it
completed (a failed step leaves the pre-step latents in place, so it is redone from its start); what was
queued is served by them. Every request that completes is byte-identical to a resident run (same weights,
same kernels, same latents). It needs ``Engine(checkpoint=...)`` (``generate`` and ``serve_local`` pass it);
without it, with no culprit on the board, or on a mesh with sp > 1 (the culprit's replica lost its SP group;
not re-formed), the step fails closed as in strict mode: the culprit's replica's requests get the reason
naming it, the other replicas' "not completed: held by rank r, whose ring broke when ...", the queue "not
dispatched" (exactly one result each), and the engine stops; the followers wait for rank 0's (empty)
recovery plan before they return, so none reads as dead in the diagnosis. Out of scope: rank 0's own death (it is the
client's
process); under ``torchrun`` a worker that *exits* makes the elastic agent stop every worker, so the recovery
from a death applies to launchers that let the others run (``serve_local``, a scheduler's own processes); a
stall is recovered under torchrun too. Tested on gloo only: on NCCL the watchdog by default ends a process
whose collective timed out (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), and the hung communicator would have to be
aborted before the device is used again.

Rank-local and resident replicas with ``W > 1`` have no lockstep: each already works through its own queue
back to back, so ``serving="continuous"`` serves them as ``strict`` does.

This module holds rank 0's ring loop (:class:`ContinuousDriver`); the admission rule is in
:mod:`dlo_fn.serve.admission`, a failed step's reason and recovery in :mod:`dlo_fn.serve.continuous_fail`, one
rank's step in :mod:`dlo_fn.serve.continuous_rank` (their public names stay importable from here).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Sequence

from dlo_fn.serve.admission import admission_cost, admission_key, admit, queued_request
from dlo_fn.serve.batch import Outcome, WaveAborted
from dlo_fn.serve.continuous_fail import recover_ring, step_failure
from dlo_fn.serve.continuous_rank import ContinuousRank, follow_step
from dlo_fn.serve.progress import RingProgress, ring_progress
from dlo_fn.serve.recover import Reload
from dlo_fn.serve.requests import (
    EngineOptions,
    RequestResult,
    ResultBook,
    StepRecord,
    Submission,
    not_dispatched,
    to_wire,
)
from dlo_fn.serve.wave_results import outcome_result
from dlo_fn.serve.wire import StatusBoard, diagnosis_wait_s

__all__ = ["ContinuousDriver", "ContinuousRank", "Served", "admission_key", "admission_cost", "follow_step"]

log = logging.getLogger(__name__)


class Served:
    """What one continuous serve produced: results by submission index (each handed to ``publish`` as it is
    recorded), the ring steps, why it stopped."""

    def __init__(self, publish: Callable[[RequestResult], None] | None = None, keep_videos: bool = True) -> None:
        self.results = ResultBook(publish, keep_videos)
        self.steps: list[StepRecord] = []
        self.stopped: str | None = None


class ContinuousDriver:
    """Rank 0's half (see module doc); ``own`` runs rank 0's requests. The ring step counter lives across
    serves (a fault names a ring step); so do ``ranks`` (the global ranks still serving, rank 0 first) and,
    after a recovery, ``degraded`` (why) and the survivors' ``channel``."""

    def __init__(
        self,
        channel: Any,
        board: StatusBoard,
        own: ContinuousRank,
        options: EngineOptions,
        *,
        world_size: int,
        config: Any,
        reload: Reload | None = None,
        replicas: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.channel, self.board, self.own, self.options = channel, board, own, options
        self.world_size, self.config, self.reload = world_size, config, reload
        self.next_step = 0
        self.ranks = tuple(range(world_size))
        # The units of admission: the global ranks of each replica, its leader first (sp > 1: one request
        # runs on all of them; without a mesh every rank is its own).
        self.replicas = tuple(tuple(u) for u in replicas) if replicas else tuple((g,) for g in self.ranks)
        self.epoch = 0
        self.degraded: str | None = None

    def serve(
        self,
        subs: Sequence[Submission],
        arrived: Callable[[], Sequence[tuple[int, float]]],
        closed: Callable[[], bool],
        wait: Callable[[float], None],
        t0: float,
        publish: Callable[[RequestResult], None] | None = None,
    ) -> Served:
        """Serve until the input is ``closed`` and nothing is held. ``arrived()``: new valid submissions as
        ``(index, arrival time.monotonic)``; ``wait(until_s)``: block for input until then (monotonic);
        ``publish(result)``: each result as it ends. A bar shows the progress (:mod:`dlo_fn.serve.progress`)."""
        with ring_progress(self.options.progress) as bar:
            return self._serve(bar, subs, arrived, closed, wait, t0, publish)

    def _serve(self, bar: RingProgress, subs, arrived, closed, wait, t0, publish) -> Served:
        """:meth:`serve` (its arguments are typed there) with the progress ``bar`` open."""
        W, R = self.world_size, self.options.requests_per_rank
        keepalive_s = self.options.timeout_s / 3
        out = Served(publish, self.options.keep_videos)
        held: list[list[int]] = [[] for _ in range(W)]  # by global rank; a lost rank's stays empty
        left: dict[int, int] = {}
        queue: list[tuple[int, float]] = []
        start: dict[int, tuple[int, float, int]] = {}  # index -> (rank, start monotonic, first ring step)
        mono0 = time.monotonic() - (time.perf_counter() - t0)
        last_message = time.monotonic()
        arrival: dict[int, float] = {}
        ended: list[int] = []  # what ended since the last cstep: an sp partner that did not fail still holds it
        while True:
            new = arrived()
            queue.extend(new)
            arrival.update(new)
            bar.show(sum(i in out.results for i in arrival), len(arrival), len(queue), self.next_step)
            live = self.ranks
            if not queue and not any(held):
                if closed():
                    break
                wait(last_message + keepalive_s)
                if len(live) > 1 and time.monotonic() - last_message >= keepalive_s:
                    try:
                        self.channel.broadcast({"kind": "idle"})
                    except Exception as exc:  # noqa: BLE001 - a follower lost while nothing was held
                        reason, bad = self._fail(self.next_step, "sending a keep-alive", exc)
                        self.next_step += 1
                        if self._recover(self.next_step - 1, reason, bad) is None:
                            out.stopped = reason
                            break
                    last_message = time.monotonic()
                continue
            k = self.next_step
            units = self._units()
            placed = admit(
                self.options.admission,
                [queued_request(self.config, i, subs[i].request) for i, _ in queue],
                [[queued_request(self.config, i, subs[i].request) for i in held[u[0]]] for u in units],
                R,
            )
            starts: list[list[tuple[int, dict]]] = [[] for _ in live]
            now = time.monotonic()
            for rid, j in placed:
                i = int(rid)
                wire = to_wire(subs[i].request)
                for g in units[j]:  # every sp rank of the replica starts it
                    starts[live.index(g)].append((i, wire))
                    held[g].append(i)
                left[i] = subs[i].request.num_inference_steps
                start[i] = (units[j][0], now, k)
                log.info(
                    "ring step %d: %s starts on replica %s, %d step(s)", k, subs[i].request_id, list(units[j]), left[i]
                )
            placed_ids = {int(rid) for rid, _ in placed}
            queue = [(i, a) for i, a in queue if i not in placed_ids]
            during = tuple(tuple(h) for h in held)
            stage = "broadcasting the step"
            try:
                if len(live) > 1:
                    self.channel.broadcast({"kind": "cstep", "step": k, "starts": starts, "ended": ended})
                self.board.post("running", wave=k, step=k)
                stage = "running its own step"
                outcomes: dict[int, Sequence[Outcome]] = {0: self.own.step(k, starts[0], ended)}
                ended = []
                compute = [0.0] * W
                compute[0] = self.own.last_compute_s
                self.board.post("done", wave=k)
                for j in range(1, len(live)):
                    stage = f"receiving rank {live[j]}'s step reply"
                    reply = self.channel.recv(j)
                    if reply.get("step") != k:
                        raise RuntimeError(f"rank {live[j]} answered for ring step {reply.get('step')}, not {k}")
                    outcomes[live[j]] = reply["outcomes"]
                    compute[live[j]] = float(reply.get("compute_s", 0.0))
            except Exception as exc:  # noqa: BLE001 - every failure ends the step closed, with a reason
                if isinstance(exc, WaveAborted):
                    self.board.post("collective-failed", wave=k, error=str(exc))
                reason, bad = self._fail(k, stage, exc)
                self.next_step += 1
                reports = self._recover(k, reason, bad)
                if reports is None:
                    out.stopped = reason
                    lost = {g for u in units if set(u) & bad for g in u}  # a culprit's whole replica
                    for r, h in enumerate(during):
                        for i in h:
                            why = (
                                reason
                                if r in lost or not bad
                                else (f"not completed: held by rank {r}, whose ring broke when {reason}")
                            )
                            if i not in out.results:
                                out.results[i] = self._result(subs, i, None, start[i][0], start, arrival[i], mono0, why)
                    break
                # Degraded: the culprits' requests are lost with them; every survivor resumes what it held
                # (from its last completed step); what a survivor never started goes back to the queue's head.
                back = []
                for g, h in enumerate(during):
                    keep = {i: done for i, done in reports[g]["held"]} if g in reports else {}
                    for o in reports.get(g, {}).get("outcomes", ()):
                        if o.position not in out.results:
                            out.results[o.position] = self._result(
                                subs, o.position, o, g, start, arrival[o.position], mono0
                            )
                    for i in h:
                        if i in out.results or i in keep:
                            continue
                        if g in bad:
                            out.results[i] = self._result(subs, i, None, g, start, arrival[i], mono0, reason)
                        else:
                            back.append((i, arrival[i]))
                    held[g] = [i for i in keep if i not in out.results]
                    left.update({i: subs[i].request.num_inference_steps - keep[i] for i in held[g]})
                queue = back + queue
                continue
            self.next_step += 1
            end = time.monotonic()
            last_message = end
            out.steps.append(StepRecord(k, now - mono0, end - mono0, during, tuple(compute), len(queue)))
            for u in units:  # what ended in a step of the degraded ring was served by it (and says so)
                for r, o in _merged(u, outcomes):
                    out.results[o.position] = self._result(
                        subs, o.position, o, r, start, arrival[o.position], mono0, degraded=self.degraded
                    )
                for i in during[u[0]]:
                    if i not in out.results:
                        left[i] -= 1
                        if left[i]:
                            continue
                        out.results[i] = self._result(
                            subs,
                            i,
                            None,
                            u[0],
                            start,
                            arrival[i],
                            mono0,
                            f"rank {u[0]} returned no result at its last ring step {k}",
                            degraded=self.degraded,
                        )
                    for g in u:
                        held[g].remove(i)
                    if len(u) > 1:
                        ended.append(i)
        for i, _ in queue:
            out.results[i] = not_dispatched(i, subs[i], out.stopped)
        return out

    def _recover(self, k: int, reason: str, bad: set[int]) -> dict[int, dict] | None:
        """After ring step ``k`` failed with culprits ``bad``: agree with the survivors on a degraded plan
        (:func:`~dlo_fn.serve.continuous_fail.recover_ring`) and return every survivor's report by global rank;
        None: no recovery (no culprit found, no checkpoint to read the lost shards from, or the recovery itself
        failed)."""
        if self.board.store is None:
            return None
        self.epoch += 1
        got = recover_ring(
            self.board,
            self.epoch,
            k,
            reason,
            bad,
            ranks=self.ranks,
            replicas=self.replicas,
            own=self.own,
            reload=self.reload,
            options=self.options,
        )
        if got is None:
            return None
        self.channel, self.ranks = got.channel, got.survivors
        self.degraded = got.degraded
        log.warning("%s", self.degraded)
        return dict(got.reports)

    # -- helpers ---------------------------------------------------------------------------------------------
    def _units(self) -> tuple[tuple[int, ...], ...]:
        """The replicas still serving (a recovery, sp = 1 only, leaves the survivors, one rank each)."""
        if all(len(u) == 1 for u in self.replicas):
            return tuple((g,) for g in self.ranks)
        return self.replicas

    def _result(
        self,
        subs: Sequence[Submission],
        i: int,
        o: Outcome | None,
        rank: int,
        start: Mapping[int, tuple[int, float, int]],
        arrival: float,
        mono0: float,
        error: str | None = None,
        degraded: str | None = None,
    ) -> RequestResult:
        _, started, first = start.get(i, (rank, arrival, -1))
        end = time.monotonic()
        timings = {
            "arrival_s": arrival - mono0,
            "queued_s": started - arrival,
            "latency_s": end - arrival,
            "first_step": float(first),
            "last_step": float(self.next_step - 1),
        }
        return outcome_result(i, subs[i], o, error, rank, timings, degraded=degraded)

    def _fail(self, k: int, where: str, exc: BaseException) -> tuple[str, set[int]]:
        """The reason ring step ``k`` failed closed and the culprit ranks the status board names."""
        wait_s = diagnosis_wait_s(self.options.grace_s, self.options.timeout_s, self.replicas)
        return step_failure(self.board, self.ranks[1:], k, where, exc, wait_s)


def _merged(unit: Sequence[int], outcomes: Mapping[int, Sequence[Outcome]]) -> list[tuple[int, Outcome]]:
    """One replica's outcomes of a step, ``(rank, outcome)``: its leader's (with the videos), unless an sp
    rank of it reports an error for that request (it raised there, so the request failed on the replica)."""
    merged: dict[int, tuple[int, Outcome]] = {}
    for g in unit:  # leader first
        for o in outcomes.get(g, ()):
            if o.position not in merged or (not o.ok and merged[o.position][1].ok):
                merged[o.position] = (g, o)
    return list(merged.values())
