"""Rank 0's side of a ring step that failed in continuous serving: why, who, and whether the ring goes on.

:func:`step_failure` turns the exception rank 0 saw into the step's reason and the culprit ranks the status
board names (dead / stalled, at which ring step); :func:`recover_ring` then agrees with the survivors on a
degraded plan (the agreement of :mod:`dlo_fn.serve.recover`: rank 0 rebuilds as a rank-local replica, posts
the plan, rejoins them on a fresh group and collects each one's report) or posts an empty plan and says why
not. What every request held in the step then gets is :class:`~dlo_fn.serve.continuous.ContinuousDriver`'s
business (see :mod:`dlo_fn.serve.continuous`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dlo_fn.serve.continuous_rank import ContinuousRank
from dlo_fn.serve.recover import RecoveryPlan, Reload, post_plan, rank_local_replica, rejoin
from dlo_fn.serve.requests import EngineOptions
from dlo_fn.serve.wire import StatusBoard, culprits

__all__ = ["Recovered", "recover_ring", "step_failure"]

# Rank 0's ring log, under the name it had before this module was split out of serve.continuous (not a literal:
# a module name in a string reads as an import to tests/test_layering.py, and continuous imports this module).
log = logging.getLogger(f"{__package__}.continuous")


@dataclass(frozen=True, slots=True)
class Recovered:
    """The ring after a recovery: the survivors' ``channel`` (``survivors`` in its order, rank 0 first), why
    it is ``degraded``, and every survivor's report by global rank (:meth:`ContinuousRank.report`)."""

    channel: Any
    survivors: tuple[int, ...]
    degraded: str
    reports: Mapping[int, dict]


def step_failure(
    board: StatusBoard, followers: Sequence[int], k: int, where: str, exc: BaseException, grace_s: float
) -> tuple[str, set[int]]:
    """The reason ring step ``k`` failed closed and the culprit ranks the status board names among
    ``followers``."""
    verdicts = board.diagnose(followers, k, grace_s)
    bad = culprits(verdicts)
    blame = "; ".join(str(v) for v in bad) if bad else "no culprit found on the status board"
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    reason = f"ring step {k} failed closed: {blame}. Rank 0 saw, {where}: {type(exc).__name__}: {text}"
    log.error(reason)
    return reason, {v.rank for v in bad}


def recover_ring(
    board: StatusBoard,
    epoch: int,
    k: int,
    reason: str,
    bad: set[int],
    *,
    ranks: Sequence[int],
    replicas: Sequence[Sequence[int]],
    own: ContinuousRank,
    reload: Reload | None,
    options: EngineOptions,
) -> Recovered | None:
    """Recovery ``epoch`` after ring step ``k`` failed with culprits ``bad`` among the serving ``ranks``;
    None: no recovery (an sp replica lost its SP group, no culprit found, no checkpoint to read the lost shards
    from, or the recovery itself failed), with an empty plan posted so the followers stop waiting."""
    if any(len(u) > 1 for u in replicas):  # an sp replica that lost a rank lost its SP group
        post_plan(board, RecoveryPlan(epoch, k, (), reason))
        log.error("no recovery after ring step %d on an sp mesh: the serve stops (%s)", k, reason)
        return None
    survivors = tuple(g for g in ranks if g not in bad)
    why = (
        "no culprit found"
        if not bad
        else "no checkpoint to rebuild from (Engine(checkpoint=...))"
        if reload is None
        else None
    )
    if why is None:
        try:
            rank_local_replica(own.offloaded, reload)
        except Exception as exc:  # noqa: BLE001 - then fail closed as without recovery
            why = f"rank 0 could not rebuild as a rank-local replica: {type(exc).__name__}: {exc}"
    if why is not None:
        post_plan(board, RecoveryPlan(epoch, k, (), reason))
        log.error("no recovery after ring step %d: %s", k, why)
        return None
    plan = RecoveryPlan(epoch, k, survivors, reason)
    post_plan(board, plan)
    try:
        channel = rejoin(board, plan, 0, options.timeout_s, 2 * options.timeout_s + options.grace_s + 5.0)
        reports = {0: own.report(k)}
        for j in range(1, len(survivors)):
            reports[survivors[j]] = channel.recv(j)
    except Exception as exc:  # noqa: BLE001
        log.error("recovery %d failed: %s: %s", epoch, type(exc).__name__, exc)
        return None
    degraded = (
        f"degraded since ring step {k}: ranks {list(survivors)} serve as rank-local replicas "
        f"({reason.split('. Rank 0 saw')[0]})"
    )
    return Recovered(channel, survivors, degraded, reports)
