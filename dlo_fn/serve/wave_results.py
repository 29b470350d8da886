"""How a strict wave's requests reach its replicas and their outcomes become results, for rank 0's
:class:`~dlo_fn.serve.driver.Driver`.

A wave's requests go to its replicas by position (:func:`dlo_fn.cost.waves.assign_positions`): :func:`wave_shares`
builds each replica's share of the ``wave`` message, :func:`fill_wave` matches the outcomes that come back to the
requests by wave position (a missing one becomes an error naming the replica's leader), and :func:`fail_wave`
gives every request of a wave that failed closed its reason. A result's ``rank`` is the leader of the replica
that ran it; its ``timings`` are ``queued_s``, ``wave_s`` and the outcome's ``compute_s``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from dlo_fn.cost.waves import WavePlan, assign_positions
from dlo_fn.serve.batch import Outcome
from dlo_fn.serve.requests import RequestResult, Submission, to_wire
from dlo_fn.serve.share import TraceSpan

__all__ = [
    "request_result",
    "outcome_result",
    "wave_steps",
    "wave_shares",
    "relative_spans",
    "spread",
    "fill_wave",
    "fail_wave",
]


def request_result(
    index: int,
    sub: Submission,
    outcome: Outcome | None,
    *,
    rank: int,
    wave_id: int,
    position: int,
    queued_s: float,
    wave_s: float,
    error: str | None = None,
) -> RequestResult:
    """A result from a rank's outcome (or an error when there is none)."""
    timings = {"queued_s": queued_s, "wave_s": wave_s}
    return outcome_result(index, sub, outcome, error, rank, timings, wave_id=wave_id, position=position)


def outcome_result(
    index: int,
    sub: Submission,
    outcome: Outcome | None,
    error: str | None,
    rank: int,
    timings: dict[str, float],
    **where,
) -> RequestResult:
    """The result of submission ``index`` from ``outcome`` (its compute time joins ``timings``), or a failure
    with ``error`` when there is one or no outcome came; ``where``: the wave fields (``wave_id``, ``position``)
    or ``degraded``."""
    if outcome is None or error is not None:
        return RequestResult(
            index,
            sub.request_id,
            sub.request,
            False,
            error=error or "no outcome returned",
            rank=rank,
            timings=timings,
            **where,
        )
    timings["compute_s"] = outcome.compute_s
    return RequestResult(
        index,
        sub.request_id,
        sub.request,
        outcome.ok,
        outcome.video,
        outcome.sha256,
        outcome.error,
        rank,
        timings=timings,
        **where,
    )


def wave_steps(subs: Sequence[Submission], wave: WavePlan) -> int:
    """The wave's denoising steps (one compatibility key: its first request's)."""
    return subs[wave.indices[0]].request.num_inference_steps


def wave_shares(subs: Sequence[Submission], wave: WavePlan) -> list[list[tuple[int, dict]]]:
    """Each replica's share of the wave: ``(position, request as a dict)`` pairs, by replica."""
    return [
        [(p, to_wire(subs[wave.indices[p]].request)) for p in pos]
        for pos in assign_positions(len(wave.indices), wave.dp_size)
    ]


def _owners(wave: WavePlan) -> dict[int, int]:
    """Wave position -> the replica it was assigned to."""
    return {p: r for r, pos in enumerate(assign_positions(len(wave.indices), wave.dp_size)) for p in pos}


def relative_spans(trace: Sequence[TraceSpan], t_start: float) -> tuple[TraceSpan, ...]:
    """The spans with their times relative to ``t_start`` (the dispatch)."""
    return tuple((r, lane, label, s - t_start, e - t_start) for r, lane, label, s, e in trace)


def spread(w: WavePlan, rank: int, world: int) -> tuple[tuple[int, ...], ...]:
    """A wave's ``rank_indices`` when replica ``rank`` of ``world`` ran all of it (independent mode)."""
    return tuple(w.indices if r == rank else () for r in range(world))


def fill_wave(
    subs: Sequence[Submission],
    wave: WavePlan,
    outcomes: Mapping[int, Sequence[Outcome]],
    *,
    queued_s: float,
    wave_s: float,
    leaders: Sequence[int] | None = None,
) -> dict[int, RequestResult]:
    """Match outcomes (by replica) to the wave's requests by wave position (a missing one becomes an error);
    a result's rank is its replica's leader (``leaders[d]``, default ``d``)."""
    owner = _owners(wave)
    lead = (lambda d: leaders[d]) if leaders is not None else (lambda d: d)
    got = {o.position: (d, o) for d, outs in outcomes.items() for o in outs}
    out = {}
    for p, i in enumerate(wave.indices):
        d, o = got.get(p, (owner[p], None))
        err = (
            None if o is not None else f"rank {lead(owner[p])} returned no result for wave {wave.wave_id} position {p}"
        )
        out[i] = request_result(
            i, subs[i], o, rank=lead(d), wave_id=wave.wave_id, position=p, queued_s=queued_s, wave_s=wave_s, error=err
        )
    return out


def fail_wave(
    subs: Sequence[Submission],
    wave: WavePlan,
    reason: str,
    *,
    queued_s: float,
    wave_s: float,
    owner_rank: int | None = None,
    leaders: Sequence[int] | None = None,
) -> dict[int, RequestResult]:
    """Every request of a wave that failed closed gets ``reason``."""
    owners = {p: (leaders[d] if leaders is not None else d) for p, d in _owners(wave).items()}
    return {
        i: RequestResult(
            i,
            subs[i].request_id,
            subs[i].request,
            False,
            error=reason,
            rank=owner_rank if owner_rank is not None else owners[p],
            wave_id=wave.wave_id,
            position=p,
            timings={"queued_s": queued_s, "wave_s": wave_s},
        )
        for p, i in enumerate(wave.indices)
    }
