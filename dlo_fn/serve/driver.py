"""Rank 0's dispatch of formed waves: lockstep waves (allgather) and independent queues (rank-local, resident).

:meth:`Driver.dispatch` takes waves that :class:`~dlo_fn.serve.engine.Engine` formed (or a caller forced) and
returns a :class:`Dispatched`: the results of the requests it reached, one :class:`WaveRecord` per wave, and
the reason the engine must stop when a wave failed closed. It owns the round counter of independent mode and
nothing of the engine's; see :mod:`dlo_fn.serve.engine` for the protocol and how failures close a wave.
Waves and queues go to replicas (``replicas[d]``: the global ranks of replica ``d``, its leader first); the
results come from the leaders, and a request's ``rank`` is the leader of the replica that ran it
(:mod:`dlo_fn.serve.wave_results`: the shares a wave sends and how its outcomes become results).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

from dlo_fn.cost.waves import WavePlan
from dlo_fn.serve.batch import Outcome, WaveAborted
from dlo_fn.serve.requests import RequestResult, ResultBook, Submission, WaveRecord
from dlo_fn.serve.share import ProtocolEnd, TraceSpan
from dlo_fn.serve.wave_results import (
    fail_wave,
    fill_wave,
    relative_spans,
    request_result,
    spread,
    wave_shares,
    wave_steps,
)
from dlo_fn.serve.wire import POLL_S, culprits, diagnosis_wait_s

__all__ = ["Driver", "Dispatched", "request_result"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Dispatched:
    """What one dispatch produced: ``results`` by submission index (only the requests it reached), the waves'
    records in wave order, and ``stopped``, the reason of the last wave that failed closed (None: none did)."""

    results: Mapping[int, RequestResult]
    waves: tuple[WaveRecord, ...]
    stopped: str | None = None


class Driver:
    """Rank 0's half of the protocol over ``end.channel``; ``end.runner`` runs rank 0's own shares."""

    def __init__(
        self,
        end: ProtocolEnd,
        *,
        mode: str,
        world_size: int,
        lockstep: bool,
        replicas: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.channel, self.board, self.runner, self.options = end
        self.mode, self.world_size, self.lockstep = mode, world_size, lockstep
        self.replicas = tuple(tuple(r) for r in replicas) if replicas else tuple((r,) for r in range(world_size))
        self.leaders = tuple(r[0] for r in self.replicas)
        self._next_round = 0

    def dispatch(
        self,
        waves: Sequence[WavePlan],
        subs: Sequence[Submission],
        t0: float,
        publish: Callable[[RequestResult], None] | None = None,
    ) -> Dispatched:
        """Run ``waves`` (indices into ``subs``); ``t0`` is when serving began (``time.perf_counter``);
        ``publish(result)`` gets each result as its wave (or queue) ends."""
        results = ResultBook(publish, keep_videos=self.options.keep_videos)
        if self.lockstep:
            return self._lockstep(waves, subs, t0, results)
        return self._independent(waves, subs, t0, results)

    # -- allgather: one wave at a time, every rank in it ------------------------------------------------------
    def _lockstep(
        self, waves: Sequence[WavePlan], subs: Sequence[Submission], t0: float, results: ResultBook
    ) -> Dispatched:
        records: list[WaveRecord] = []
        stopped = None
        world, leaders = self.world_size, self.leaders
        for wave in waves:
            steps, shares = wave_steps(subs, wave), wave_shares(subs, wave)
            with self._progress(subs, wave, steps, len(waves)) as tick:
                trace: list[TraceSpan] | None = [] if self.options.trace else None
                t_start = time.perf_counter()
                queued_s = t_start - t0
                stage = "broadcasting the wave"
                try:
                    self.channel.broadcast(
                        {
                            "kind": "wave",
                            "wave": wave.wave_id,
                            "steps": steps,
                            "shares": shares,
                            "trace": trace is not None,
                        }
                    )
                    if trace is not None:
                        trace.append((0, "control", "broadcast", t_start, time.perf_counter()))
                    stage = "running its own share"
                    own = self.runner.run(wave.wave_id, steps, shares[0], trace=trace is not None, on_step=tick)
                    if trace is not None:
                        trace.extend(own.spans)
                    outcomes = {0: own.outcomes}
                    self.board.post("done", wave=wave.wave_id)
                    for d in range(1, len(leaders)):
                        r = leaders[d]
                        stage = f"receiving rank {r}'s results"
                        c0 = time.perf_counter()
                        reply = self.channel.recv(r)
                        if trace is not None:
                            trace.append((0, "control", f"recv r{r}", c0, time.perf_counter()))
                            trace.extend(reply.get("trace") or ())
                        if reply.get("wave") != wave.wave_id:
                            raise RuntimeError(f"rank {r} answered for wave {reply.get('wave')}, not {wave.wave_id}")
                        outcomes[d] = reply["outcomes"]
                except Exception as exc:  # noqa: BLE001 - every failure ends the wave closed, with a reason
                    if isinstance(exc, WaveAborted):
                        self.board.post("collective-failed", wave=wave.wave_id, error=str(exc))
                    stopped = self._fail(wave.wave_id, stage, exc, range(1, world))
                    wave_s = time.perf_counter() - t_start
                    results.update(fail_wave(subs, wave, stopped, queued_s=queued_s, wave_s=wave_s, leaders=leaders))
                    records.append(
                        WaveRecord(wave.wave_id, wave.key.short(), wave.rank_indices, steps, wave_s, "failed", stopped)
                    )
                    break
                wave_s = time.perf_counter() - t_start
                filled = fill_wave(subs, wave, outcomes, queued_s=queued_s, wave_s=wave_s, leaders=leaders)
                results.update(filled)
                status = "ok" if all(r.ok for r in filled.values()) else "partial"
                errors = sorted({r.error for r in filled.values() if not r.ok})
                records.append(
                    WaveRecord(
                        wave.wave_id,
                        wave.key.short(),
                        wave.rank_indices,
                        steps,
                        wave_s,
                        status,
                        "; ".join(errors) or None,
                        relative_spans(trace, t_start) if trace is not None else (),
                    )
                )
                log.info(
                    "wave %d: %d request(s) on %d replica(s), %s, %.3f s",
                    wave.wave_id,
                    len(wave.indices),
                    len(leaders) - len(wave.idle_ranks),
                    status,
                    wave_s,
                )
        return Dispatched(results, tuple(records), stopped)

    # -- rank-local / resident: one queue per rank, results collected rank by rank ----------------------------
    def _independent(
        self, waves: Sequence[WavePlan], subs: Sequence[Submission], t0: float, results: ResultBook
    ) -> Dispatched:
        world, replicas = self.world_size, self.replicas
        dp = len(replicas)
        queues: list[list[WavePlan]] = [[] for _ in range(dp)]
        for j, wave in enumerate(waves):
            queues[j % dp].append(wave)
        round_id = self._next_round
        self._next_round += 1
        trace: list[TraceSpan] | None = [] if self.options.trace else None
        msg_queues = [[(w.wave_id, wave_steps(subs, w), wave_shares(subs, w)[0]) for w in q] for q in queues]
        t_start = time.perf_counter()
        owner = {w.wave_id: r for r, q in enumerate(queues) for w in q}
        by_id = {w.wave_id: w for w in waves}
        records: dict[int, WaveRecord] = {}
        stopped = None
        if world > 1 and waves:
            try:
                self.channel.broadcast(
                    {"kind": "round", "round": round_id, "queues": msg_queues, "trace": trace is not None}
                )
            except Exception as exc:  # noqa: BLE001
                stopped = self._fail(
                    None,
                    "broadcasting the queues",
                    exc,
                    range(1, world),
                    what=f"round {round_id} (waves {', '.join(str(w.wave_id) for w in waves)})",
                )
                for w in waves:
                    results.update(
                        fail_wave(subs, w, stopped, queued_s=0.0, wave_s=0.0, owner_rank=replicas[owner[w.wave_id]][0])
                    )
                return Dispatched(results, (), stopped)
        outcomes: dict[int, Sequence[Outcome]] = {}

        def fill(wave_id: int, outs: Sequence[Outcome]) -> dict[int, RequestResult]:
            w, d = by_id[wave_id], owner[wave_id]
            filled = fill_wave(
                subs, w, {0: outs}, queued_s=t_start - t0, wave_s=max((o.compute_s for o in outs), default=0.0)
            )
            # ran on replica d, whose leader wrote it
            return {i: dataclasses.replace(res, rank=replicas[d][0]) for i, res in filled.items()}

        for (wave_id, steps, share), wave in zip(msg_queues[0], queues[0]):
            with self._progress(subs, wave, steps, len(waves)) as tick:
                own = self.runner.run(wave_id, steps, share, trace=trace is not None, on_step=tick)
            outcomes[wave_id] = own.outcomes
            results.update(fill(wave_id, own.outcomes))  # rank 0's own: published now, not after the others
            if trace is not None:
                trace.extend(own.spans)
        if world > 1 and any(queues[1:]):
            log.info(
                "rank 0's queue done; waiting for rank(s) %s to finish theirs",
                ", ".join(str(replicas[d][0]) for d in range(1, dp) if queues[d]),
            )
        self.board.post("done", round=round_id)
        for r in replicas[0][1:]:  # rank 0's sp partners ran its queue with it: nothing to collect
            self.board.set_flag(f"go/{round_id}/{r}")
        for d in range(1, dp):
            if not queues[d]:
                continue
            r = replicas[d][0]
            failure = self._await_done(r, round_id)
            stage = f"collecting rank {r}'s queue"
            if failure is None:
                try:
                    for partner in replicas[d]:
                        self.board.set_flag(f"go/{round_id}/{partner}")
                    reply = self.channel.recv(r)
                    for wave_id, outs in reply["outcomes"]:
                        outcomes[wave_id] = outs
                    if trace is not None:
                        trace.extend(reply.get("trace") or ())
                    continue
                except Exception as exc:  # noqa: BLE001
                    failure = exc
            stopped = self._fail(
                None,
                stage,
                failure,
                list(replicas[d]),
                what=f"rank {r}'s queue (waves {', '.join(str(w.wave_id) for w in queues[d])})",
            )
            for w in queues[d]:
                wave_s = time.perf_counter() - t_start
                results.update(fail_wave(subs, w, stopped, queued_s=0.0, wave_s=wave_s, owner_rank=r))
                records[w.wave_id] = WaveRecord(
                    w.wave_id,
                    w.key.short(),
                    spread(w, d, dp),
                    wave_steps(subs, w),
                    time.perf_counter() - t_start,
                    "failed",
                    stopped,
                    lockstep=False,
                )
        for wave_id, outs in outcomes.items():
            w, d = by_id[wave_id], owner[wave_id]
            compute_s = max((o.compute_s for o in outs), default=0.0)
            results.update({i: res for i, res in fill(wave_id, outs).items() if i not in results})
            filled = {i: results[i] for i in w.indices}
            status = "ok" if all(res.ok for res in filled.values()) else "partial"
            errors = sorted({res.error for res in filled.values() if not res.ok})
            records[wave_id] = WaveRecord(
                wave_id,
                w.key.short(),
                spread(w, d, dp),
                wave_steps(subs, w),
                compute_s,
                status,
                "; ".join(errors) or None,
                lockstep=False,
            )
        out = [records[k] for k in sorted(records)]
        if trace is not None and out:
            out[0] = dataclasses.replace(out[0], trace=relative_spans(trace, t_start))
        return Dispatched(results, tuple(out), stopped)

    # -- helpers ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _progress(
        self, subs: Sequence[Submission], wave: WavePlan, steps: int, num_waves: int
    ) -> Iterator[Callable[[], None]]:
        """One line when a wave starts (log, INFO) and a tqdm bar of its denoising steps, named by its request
        ids, on rank 0 (stderr; ``options.progress`` None: only on a terminal); yields the bar's tick."""
        from tqdm.auto import tqdm

        ids = [subs[i].request_id for i in wave.indices]
        where = f"{self.world_size} rank(s) in lockstep" if self.lockstep else "rank 0"
        log.info(
            "wave %d (%d in this dispatch): %d request(s) [%s], %d step(s), on %s",
            wave.wave_id,
            num_waves,
            len(ids),
            ", ".join(ids),
            steps,
            where,
        )
        enabled = self.options.progress
        shown = ",".join(ids) if len(ids) <= 3 else f"{ids[0]},...,{ids[-1]}"
        bar = tqdm(
            total=steps,
            unit="step",
            desc=f"wave {wave.wave_id} {shown}",
            disable=None if enabled is None else not enabled,
            leave=True,
        )
        from tqdm.contrib.logging import logging_redirect_tqdm

        try:
            with logging_redirect_tqdm():  # log lines during the wave print above the bar, not through it
                yield lambda: bar.update(1)
        finally:
            bar.close()

    def _fail(
        self, wave_id: int | None, where: str, exc: BaseException, ranks: Sequence[int], what: str | None = None
    ) -> str:
        """The reason a wave (or ``what``) failed closed, with the culprits the board names among ``ranks``."""
        wait_s = diagnosis_wait_s(self.options.grace_s, self.options.timeout_s, self.replicas)
        verdicts = self.board.diagnose(ranks, wave_id, wait_s)
        bad = culprits(verdicts)
        # No rank stalled or died: one raised where its peers could not go on without it (inside an sp
        # all-to-all its partners wait for it, and its drain then waits for them); every rank's first error
        # is in what it reported, so name those.
        told = tuple(v for v in verdicts if v.verdict in ("error", "victim"))
        blame = (
            "; ".join(str(v) for v in bad)
            if bad
            else "no rank stalled or died; reported: " + "; ".join(str(v) for v in told)
            if told
            else "no culprit found on the status board"
        )
        reason = (
            f"{what or f'wave {wave_id}'} failed closed: {blame}. Rank 0 saw, {where}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        )
        log.error(reason)
        return reason

    def _await_done(self, rank: int, round_id: int) -> BaseException | None:
        """Wait on the board until ``rank`` finished its queue; a dead rank or no progress for ``timeout_s``
        returns the failure (a ``TimeoutError``) instead."""
        board, timeout_s = self.board, self.options.timeout_s
        started = last_beat = time.monotonic()
        while True:
            rec = board.read(rank)
            if rec is not None and rec.get("state") == "done" and rec.get("round") == round_id:
                return None
            if board.alive(rec) is False:
                return RuntimeError(f"rank {rank}'s process exited before finishing its queue")
            if board.store is None:
                return None  # no board: fall back to the bounded recv
            if rec is not None and board.age_s(rec) >= timeout_s:
                return TimeoutError(
                    f"rank {rank} made no progress for {board.age_s(rec):.1f} s (timeout_s {timeout_s})"
                )
            if rec is None and time.monotonic() - started >= timeout_s:
                return TimeoutError(f"rank {rank} never posted a status within {timeout_s} s")
            if time.monotonic() - last_beat >= 1.0:
                board.post("collecting", round=round_id)  # keep rank 0 visibly alive for the waiting followers
                last_beat = time.monotonic()
            time.sleep(POLL_S)
