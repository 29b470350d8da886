"""The followers' half of the engine's protocol (ranks != 0): serve rank 0's messages until it says stop.

Messages (from :mod:`dlo_fn.serve.driver`, one ``broadcast`` each): ``wave`` (allgather: run this rank's share,
post the result on the board, send the outcomes to rank 0), ``round`` (rank-local / resident: run this rank's
queue, post ``done``, wait on the board for rank 0's go, send everything), ``timeline`` (send this rank's
measured executor timeline), ``cstep`` (continuous serving: one ring step, see :mod:`dlo_fn.serve.continuous`),
``idle`` (rank 0 is waiting for requests: wait again) and ``stop``. A ring step that fails (a stalled or dead
peer) is followed by rank 0's recovery plan (:mod:`dlo_fn.serve.recover`): a survivor goes on as a rank-local
replica on the survivors' fresh group. :meth:`Follower.follow` returns why it
stopped following when that was not a ``stop``: after a failed exchange the group is unusable. Shares and
queues are per replica: every rank runs its replica's, and only the replica's leader (its sp-rank 0) sends the
outcomes; its sp partners post on the board like everyone else.
"""

from __future__ import annotations

import logging
import time

from dlo_fn.serve.batch import Outcome, WaveAborted
from dlo_fn.serve.continuous import ContinuousRank, follow_step
from dlo_fn.serve.recover import Reload, rank_local_replica, rejoin, wait_plan
from dlo_fn.serve.share import ProtocolEnd, TraceSpan, own_timeline
from dlo_fn.serve.wire import POLL_S

__all__ = ["Follower"]

log = logging.getLogger(__name__)


class Follower:
    """Rank ``rank``'s side of the protocol over ``end.channel``; ``end.runner`` runs its shares."""

    def __init__(
        self,
        end: ProtocolEnd,
        *,
        rank: int,
        replica: int | None = None,
        leader: bool = True,
        reload: Reload | None = None,
    ) -> None:
        self.channel, self.board, self.runner, self.options = end
        self.rank = rank
        self.replica = rank if replica is None else replica
        self.leader = leader
        self.continuous = ContinuousRank(
            self.runner.model, self.runner.offloaded, rank, self.options.fault, self.runner.sp
        )  # "cstep" messages
        # Recovery of continuous serving (dlo_fn.serve.recover): this rank's place among the ranks serving,
        # the recoveries so far, and where a rank-local replica reads its blocks (None: no recovery; only
        # continuous serving recovers, and its rank 0 posts a plan after every failure).
        self.index, self.epoch, self.reload = rank, 0, reload
        self.degraded: str | None = None
        self.stepped = False  # a cstep came: rank 0 serves continuously and posts a plan after every failure
        self.why_stopped: str | None = None  # set by _rejoin: rank 0 gone, or this rank left behind

    def follow(self) -> str | None:
        """Serve until ``stop`` (returns None) or a failure (returns the reason)."""
        last_wave = None
        while True:
            try:
                msg = self.channel.broadcast(None)
            except Exception as exc:  # noqa: BLE001 - rank 0 stopped answering: nothing more to serve
                self.board.post(
                    "collective-failed",
                    wave=None if last_wave is None else last_wave + 1,
                    error=f"waiting for the next wave: {type(exc).__name__}: {exc}",
                )
                log.error("rank %d: lost rank 0 while waiting for work: %s", self.rank, exc)
                if self._rejoin():
                    continue
                return self.why_stopped or f"lost rank 0 while waiting for work: {exc}"
            kind = msg.get("kind")
            if kind == "stop":
                self.board.post("idle")
                return None
            if kind == "idle":  # rank 0 is waiting for requests: nothing to do, wait again
                continue
            if kind == "wave":
                last_wave = msg["wave"]
                ok = self._wave(msg)
            elif kind == "round":
                ok = self._round(msg)
            elif kind == "cstep":  # continuous serving: one ring step (dlo_fn.serve.continuous)
                self.stepped = True
                ok = follow_step(self.continuous, self.channel, self.board, msg, self.index, self.leader)
                if not ok and self._rejoin():
                    continue
            elif kind == "timeline":
                self.channel.send(own_timeline(self.runner.offloaded, msg.get("meta") or ()))
                continue
            else:
                raise RuntimeError(f"rank {self.rank}: unknown message kind {kind!r} from rank 0")
            if not ok:
                return self.why_stopped or f"rank {self.rank} stopped following after a failed exchange"

    def _rejoin(self) -> bool:
        """After a failed ring step: wait for rank 0's recovery plan; if this rank survives, become a
        rank-local replica, join the survivors' group and send rank 0 this rank's report (see
        :mod:`dlo_fn.serve.recover`). False: not recovered (no plan, not a survivor, no checkpoint, or it
        failed). In continuous serving without a checkpoint (or on an sp mesh) it still waits for rank 0's plan,
        which then names no survivor: a rank that returned (and exited) earlier would read as dead in rank 0's
        diagnosis."""
        if self.board.store is None or (self.reload is None and not self.stepped):
            return False
        opts = self.options
        bound_s = 2 * opts.timeout_s + opts.grace_s + 5.0  # rank 0's detection, its diagnosis, its rebuild
        self.epoch += 1
        plan = wait_plan(self.board, self.epoch, bound_s)
        if plan is None:
            self.why_stopped = (
                f"lost rank 0 (no recovery plan from it within {bound_s:.0f} s): rank 0 died, or it went on and "
                "ended without this rank, which stalled past --timeout"
            )
        elif self.rank not in plan.survivors:
            self.why_stopped = (
                f"rank {self.rank} was left behind: the others went on without it ({plan.reason}; survivors "
                f"{list(plan.survivors)})"
            )
        if plan is None or self.rank not in plan.survivors or self.reload is None:
            log.debug("rank %d: not recovered: %s", self.rank, self.why_stopped)
            return False
        try:
            rank_local_replica(self.runner.offloaded, self.reload)
            channel = rejoin(self.board, plan, self.rank, opts.timeout_s, bound_s)
            channel.send(self.continuous.report(plan.step))
        except Exception as exc:  # noqa: BLE001 - rank 0 then times out on this rank and fails it closed
            log.error("rank %d: recovery %d failed: %s: %s", self.rank, plan.epoch, type(exc).__name__, exc)
            return False
        self.channel, self.index = channel, plan.survivors.index(self.rank)
        self.degraded = plan.reason
        self.board.post("running", wave=plan.step, step=plan.step)
        return True

    def _wave(self, msg: dict) -> bool:
        wave_id, rank = msg["wave"], self.rank
        trace: list[TraceSpan] | None = [] if msg.get("trace") else None
        if trace is not None:
            trace.append((rank, "control", "wave received", time.perf_counter(), time.perf_counter()))
        try:
            run = self.runner.run(wave_id, msg["steps"], msg["shares"][self.replica], trace=trace is not None)
        except WaveAborted as exc:
            self.board.post("collective-failed", wave=wave_id, error=str(exc))
            log.error("rank %d: wave %d aborted: %s", rank, wave_id, exc)
            return False
        if trace is not None:
            trace.extend(run.spans)
        failed = [o for o in run.outcomes if not o.ok]
        self.board.post("error" if failed else "done", wave=wave_id, **({"error": failed[0].error} if failed else {}))
        if not self.leader:
            return True
        try:
            self.channel.send({"wave": wave_id, "rank": rank, "outcomes": run.outcomes, "trace": trace})
        except Exception as exc:  # noqa: BLE001
            self.board.post("collective-failed", wave=wave_id, error=f"sending results: {exc}")
            log.error("rank %d: could not send wave %d's results: %s", rank, wave_id, exc)
            return False
        return True

    def _round(self, msg: dict) -> bool:
        """Independent mode: run this rank's queue, post done, wait for rank 0's go, send everything."""
        round_id, rank, board = msg["round"], self.rank, self.board
        queue = msg["queues"][self.replica]
        if not queue:
            return True
        trace: list[TraceSpan] | None = [] if msg.get("trace") else None
        results = []
        for wave_id, steps, share in queue:
            try:
                run = self.runner.run(wave_id, steps, share, trace=trace is not None)
            except WaveAborted as exc:  # no collectives in this mode: report it as the batch's errors
                results.append((wave_id, tuple(Outcome(p, False, error=str(exc)) for p, _ in share)))
                continue
            results.append((wave_id, run.outcomes))
            if trace is not None:
                trace.extend(run.spans)
        board.post("done", round=round_id)
        timeout_s = self.options.timeout_s
        while not board.has_flag(f"go/{round_id}/{rank}"):
            rec = board.read(0)
            if board.store is None:
                break
            if rec is not None and board.age_s(rec) >= timeout_s:
                log.error(
                    "rank %d: rank 0 made no progress for %.1f s; giving up on round %d",
                    rank,
                    board.age_s(rec),
                    round_id,
                )
                return False
            time.sleep(POLL_S)
        if not self.leader:
            return True
        try:
            self.channel.send({"round": round_id, "rank": rank, "outcomes": results, "trace": trace})
        except Exception as exc:  # noqa: BLE001
            board.post("collective-failed", round=round_id, error=f"sending results: {exc}")
            return False
        return True
