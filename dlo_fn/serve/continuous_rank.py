"""One rank's side of continuous serving: the requests it holds, advanced one ring step at a time.

Continuous mode (:mod:`dlo_fn.serve.continuous`) runs the ring one denoising step per executor run: before
ring step ``k`` rank 0 tells every rank which new requests it starts; then every rank calls
:meth:`ContinuousRank.step`, which runs **one** executor run of one step with ``R_r`` computes per loaded block,
``R_r`` = the requests this rank holds (block-major, in admission order)::

    e_q = model.embed(*model_inputs(state_q), t_q)             for every held q (t_q: its text, encoded once)
    for block b in model.blocks:                               one load (H2D + all-gather) of block b ...
        x_q = b(x_q, **e_q.block_kwargs)                       ... serves every held q in turn
    state_q = update(state_q, model.head(x_q, e_q))            for every held q

or, holding nothing, :meth:`~dlo_fn.runtime.offload.Offloaded.idle` (one gather-only run). Why ranks may hold
different ``R_r`` (and different shapes, step counts, guidance) and stay in lockstep: a run's loads are
``L = T x B`` whatever ``R`` is (:mod:`dlo_fn.plan.lowering`: ``R`` only adds compute ops between the same loads),
and the ring after a run depends only on ``L`` and ``prefetch_next`` (:meth:`dlo_fn.plan.schedule.Ring.after`),
so every rank issues the same all-gathers in the same order at every step, computing or not. Each request
keeps the exact tensors and kernels of a single :func:`dlo_fn.models.generate` call, so its output is
bit-identical whoever its neighbours are. A request that reaches its last step is decoded (:func:`finish`) at
once and leaves with the step's reply.

On an sp replica (``sp``: its :class:`~dlo_fn.models.sp.SPContext`) every sp rank holds the same requests and
embeds its tokens (``model.embed(..., sp=sp)``, what strict waves run); the blocks' all-to-alls and the head's
gather stay inside the replica's sp group.

A rank whose step raises gives an error to every request it held in that step (nothing else), drains the open
run (its loads and all-gathers are issued without compute, so the others' step completes) and keeps serving;
on an sp replica a drain would leave its partners in an all-to-all, so it first runs a *shadow* of the rest of
the step (the remaining block calls and heads on its partial activations, results discarded: the same
collectives in the same order; it matches when the raise came between block calls, as the injected fault does,
else the step breaks and fails closed within the timeout); the partners drop the request at the next step;
if draining fails (a peer died or timed out), :class:`~dlo_fn.serve.batch.WaveAborted` propagates. The
injected :class:`~dlo_fn.serve.batch.Fault` fires at block 0 of ring step ``fault.step`` when this rank computes
there (the ring has no waves: a fault naming a wave other than 0 is refused when the engine is built).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from typing import Any, Sequence

import torch

from dlo_fn.models.lora import block_chooser
from dlo_fn.models.sampler import finish, finished, init_state, model_inputs, update
from dlo_fn.serve.batch import Fault, Outcome, WaveAborted, _drain, abort_run, collective_failure
from dlo_fn.serve.requests import from_wire
from dlo_fn.serve.wire import StatusBoard

__all__ = ["ContinuousRank", "follow_step"]

log = logging.getLogger(__name__)


class ContinuousRank:
    """The requests rank ``rank`` holds (by submission index, in admission order) and their sampler states."""

    def __init__(self, model: Any, offloaded: Any, rank: int, fault: Fault | None = None, sp: Any = None) -> None:
        self.model, self.offloaded, self.rank = model, offloaded, rank
        self.sp = sp if sp is not None and sp.size > 1 else None  # this rank's SPContext on an sp replica
        self.fault = fault if fault is not None and fault.rank == rank else None
        self.held: dict[int, Any] = {}
        self.texts: dict[int, Any] = {}  # each held request's text states, encoded once (serve.batch does the same)
        self.compute_s: dict[int, float] = {}
        self.last_compute_s = 0.0  # this rank's block compute seconds in the last step (the measured x_r)
        # The last ring step this rank completed and what it returned: a recovery asks for them
        # (dlo_fn.serve.recover), since that step's reply may not have reached rank 0.
        self.last_step, self.last_outcomes = -1, []

    def report(self, k: int) -> dict:
        """For a recovery after ring step ``k`` failed: the requests held (admission order) with the steps they
        completed, and step ``k``'s outcomes if this rank completed it (its pre-step states otherwise stayed)."""
        return {
            "rank": self.rank,
            "held": [(i, s.step) for i, s in self.held.items()],
            "outcomes": list(self.last_outcomes) if self.last_step == k else [],
        }

    def step(self, k: int, starts: Sequence[tuple[int, dict]], ended: Sequence[int] = ()) -> list[Outcome]:
        """Drop ``ended`` (requests that ended on an sp partner: see :func:`follow_step`), admit ``starts``
        (``(index, request as a dict)``), run ring step ``k``; outcomes of the requests that ended in it
        (finished, or failed), ``position`` = the submission index. Raises
        :class:`~dlo_fn.serve.batch.WaveAborted` (the held states stay as before the step) when the step's
        collectives broke."""
        for i in ended:
            self.held.pop(i, None)
            self.texts.pop(i, None)
            self.compute_s.pop(i, None)
        out = self._step(k, starts)
        self.last_step, self.last_outcomes = k, out
        return out

    @torch.no_grad()
    def _step(self, k: int, starts: Sequence[tuple[int, dict]]) -> list[Outcome]:
        out: list[Outcome] = []
        for index, wire in starts:
            try:
                self.held[index] = init_state(self.model, from_wire(wire))
                self.texts.pop(index, None)
                self.compute_s[index] = 0.0
            except Exception as exc:  # noqa: BLE001 - a bad request gets its own error, nothing else changes
                out.append(Outcome(index, False, error=f"rank {self.rank}: {type(exc).__name__}: {exc}"))
        items = list(self.held.items())
        self.last_compute_s = 0.0
        executor = getattr(self.offloaded, "executor", None)
        if not items:
            try:
                self.offloaded.idle(1)
            except Exception as exc:
                raise WaveAborted(
                    f"idle rank {self.rank} could not serve its all-gathers at ring step {k}: "
                    f"{type(exc).__name__}: {exc}",
                    exc,
                ) from exc
            return out
        t0 = time.perf_counter()
        opened = False
        calls_s = 0.0
        done, embeds, xs = 0, [], []  # block calls completed this step (a shadow run goes on from there)
        # The executor's own block-call seconds exclude the loads and all-gathers it issues inside each call
        # (on CPU the synchronous all-gather, where a rank waits for a slower neighbour).
        before_s = executor.stats.call_s if executor is not None else 0.0
        try:
            if executor is not None:
                executor.begin_run(1, len(items))
                opened = True
            for i, s in items:
                if i not in self.texts:
                    self.texts[i] = self.model.encode_text(s.text_tokens)
            sp_kwargs = {"sp": self.sp} if self.sp is not None else {}
            embeds = [self.model.embed(*model_inputs(s), self.texts[i], **sp_kwargs) for i, s in items]
            xs = [e.x for e in embeds]
            calls = len(self.model.blocks) * len(embeds)
            choose = block_chooser(self.model)  # each request's adapter (Request.lora) before its block call
            while done < calls:  # block-major: call n is block n // R_r for held request n % R_r
                b, r = divmod(done, len(embeds))
                if choose is not None:
                    choose(self.model.blocks[b], items[r][1].request)
                c0 = time.perf_counter()
                xs[r] = self.model.blocks[b](xs[r], **embeds[r].block_kwargs)
                calls_s += time.perf_counter() - c0
                done += 1
                if self.fault is not None and done == len(embeds) and k == self.fault.step:
                    self.fault.fire()
            states = [update(s, self.model.head(x, e)) for (_, s), x, e in zip(items, xs, embeds)]
            if opened:
                executor.end_run()
                opened = False
        except Exception as exc:  # noqa: BLE001 - every request held here gets this error, then keep serving
            text = f"rank {self.rank}: {type(exc).__name__}: {exc}"
            if opened and collective_failure(exc):  # a peer broke the step: no drain or shadow can finish it
                log.debug("%s (ring step %d)\n%s", text, k, traceback.format_exc())  # the abort says it in one line
                raise abort_run(executor, self.rank, exc) from exc
            log.error("%s (ring step %d)\n%s", text, k, traceback.format_exc())
            if opened:  # on an sp replica a shadow run lets the partners finish their step; else drain
                if not self._shadow(k, embeds, xs, done):
                    _drain(executor, self.rank, exc)
            elif executor is not None:
                try:
                    self.offloaded.idle(1)
                except Exception as idle_exc:
                    raise WaveAborted(f"{text}; then serving the all-gathers failed: {idle_exc}", exc) from idle_exc
            dt = time.perf_counter() - t0
            out.extend(Outcome(i, False, error=text, compute_s=self.compute_s.pop(i, 0.0) + dt) for i, _ in items)
            self.held.clear()
            self.texts.clear()
            return out
        self.last_compute_s = executor.stats.call_s - before_s if executor is not None else calls_s
        dt = time.perf_counter() - t0
        for (index, _), state in zip(items, states):
            self.compute_s[index] += dt / len(items)
            if not finished(state):
                self.held[index] = state
                continue
            del self.held[index]
            self.texts.pop(index, None)
            spent = self.compute_s.pop(index)
            try:
                res = finish(state)
                out.append(Outcome(index, True, res.video, res.sha256, compute_s=spent))
            except Exception as exc:  # noqa: BLE001 - decoding one request must not lose the others
                out.append(
                    Outcome(index, False, error=f"rank {self.rank}: {type(exc).__name__}: {exc}", compute_s=spent)
                )
        return out

    def _shadow(self, k: int, embeds: list, xs: list, done: int) -> bool:
        """After a raise inside block call ``done`` on an sp replica: run the step's remaining block calls and
        heads on whatever ``xs`` hold, results discarded, so this rank's all-to-alls and the head's gather
        meet its sp partners' (a drain without compute would leave them waiting in an all-to-all while it
        issues all-gathers). It matches only when the raise came before the call's first all-to-all (between
        block calls, as the injected fault does); otherwise the collectives break and the step fails closed
        within the timeout. True: the run ended (its loads and all-gathers issued); False: no sp, or the raise
        came before the blocks or after them (the heads' gather), or the shadow run failed."""
        if self.sp is None or not embeds or done >= len(self.model.blocks) * len(embeds):
            return False
        try:
            for n in range(done, len(self.model.blocks) * len(embeds)):
                b, r = divmod(n, len(embeds))
                xs[r] = self.model.blocks[b](xs[r], **embeds[r].block_kwargs)
            for x, e in zip(xs, embeds):
                self.model.head(x, e)
            self.offloaded.executor.end_run()
        except Exception as exc:  # noqa: BLE001 - then drain as without sp (the step fails closed)
            log.error("rank %d: the shadow run of ring step %d failed: %s: %s", self.rank, k, type(exc).__name__, exc)
            return False
        return True


def follow_step(
    rank_state: ContinuousRank,
    channel: Any,
    board: StatusBoard,
    msg: dict,
    index: int | None = None,
    leader: bool = True,
) -> bool:
    """A follower's ``cstep``: run its part of ring step ``msg["step"]`` (its ``starts`` at ``index``, its
    place among the ranks serving; its rank unless a recovery renumbered them), answer rank 0; False when
    the exchange failed (the group is unusable). An sp rank that does not lead its replica answers its
    outcomes without the videos (its leader sends them; rank 0 needs only its errors); ``msg["ended"]``: the
    requests that ended on a partner in an earlier step (an error there), dropped before the step."""
    k, rank = msg["step"], rank_state.rank
    board.post("running", wave=k, step=k)
    try:
        outcomes = rank_state.step(k, msg["starts"][rank if index is None else index], msg.get("ended", ()))
        if not leader:
            outcomes = [dataclasses.replace(o, video=None) for o in outcomes]
    except WaveAborted as exc:
        board.post("collective-failed", wave=k, error=str(exc))
        log.error("rank %d: ring step %d aborted: %s", rank, k, exc)
        return False
    board.post("done", wave=k)
    try:
        channel.send({"step": k, "rank": rank, "outcomes": outcomes, "compute_s": rank_state.last_compute_s})
    except Exception as exc:  # noqa: BLE001
        board.post("collective-failed", wave=k, error=f"sending the step reply: {exc}")
        log.error("rank %d: could not send ring step %d's reply: %s", rank, k, exc)
        return False
    return True
