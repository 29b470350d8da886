"""Dispatch of queued requests to DP replicas on a lockstep block ring: continuous vs strict waves (pure).

**The ring.** Every replica passes over the ``B`` blocks in the same order (the all-gather of block ``b`` needs
every rank at once), step after step: ring step ``k`` is the ``B`` *block passes* ``b = 0 .. B-1``, and the
*step boundaries* between ring steps are the only moments a replica's work may change. Time 0 is the first
boundary; arrival times are measured from it. What a replica computes on a loaded block is its own: the
requests it holds (block-major, one after another), or nothing (a *gather-only* pass: it serves its shards).

==============  =========================================================================================
symbol          meaning
==============  =========================================================================================
``W``           replicas in lockstep (``Replicas.dp_size``)
``R``           most requests a replica holds at once, all of one ``key`` (``Replicas.requests_per_replica``)
``t_b, h_b``    block ``b``'s load (H2D + all-gather, paid every pass) and host cost (``PassCosts``)
``c_qb``        request ``q``'s compute on block ``b`` (``QueuedRequest.block_compute_s``)
``A_r(k)``      the requests replica ``r`` holds during ring step ``k``
``n_q``         request ``q``'s denoising steps: it holds a replica for ``n_q`` consecutive ring steps
==============  =========================================================================================

**Lockstep cost.** A pass lasts as long as its slowest member, the load included::

    pass_s(k, b) = max(t_b, max_r sum_{q in A_r(k)} c_qb) + h_b        step_s(k) = sum_b pass_s(k, b)

and boundary ``k + 1`` is at ``T_{k+1} = T_k + step_s(k)``. A request started at boundary ``k`` finishes at
``T_{k + n_q}`` (its result leaves with its last step); its latency is ``finish_s - arrival_s``.

**Policies.** Both see the queue in FIFO order (arrival, then id) and decide only at boundaries, with the
requests that have arrived by then.

* *continuous* (:func:`admit_continuous`): a replica whose requests are done takes the next queued ones at the
  next boundary. The head of the queue goes to the first empty replica, else to the replica of its ``key`` that
  holds the fewest (``< R``) requests, lowest index first; placement stops at the first request that fits
  nowhere (no overtaking, so nothing starves and starts follow FIFO order).
* *continuous, cost-aware* (:func:`admit_cost_aware`, ``plan_continuous(..., admission="cost")``): the same
  FIFO without overtaking, but the head is placed only where it does not raise the step's busy time
  ``P = sum_b max(t_b, max_r sum_{q in A_r} c_qb)`` (on the candidate replica that gives the smallest new ``P``), or
  when
  no replica computes; otherwise it (and everything behind it) waits for the next boundary. An expensive head
  therefore waits for cheaper running work to drain instead of slowing every replica's passes, and a cheap head
  fills a free replica beside expensive work at no cost to anyone. It never starves: held requests finish, and
  an empty ring admits the head.
* *strict* (today's waves, :func:`dlo_fn.cost.waves.form_waves`): when no wave runs, the waiting requests are
  cut into waves (one key per wave, ``key = (key, n_q)`` since today's compatibility key holds the step count;
  at most ``W R`` requests; a partial wave waits ``max_wait_s`` for company); the waves formed then run one
  after another, members dealt round-robin over replicas, and a wave holds the ring until its last member ends.

**Counts.** Per replica every pass is exactly one of: *compute* (``A_r(k)`` non-empty), *idle* (gather-only,
no request waiting) or *waiting* (gather-only while arrived requests wait: the policy holds them back). A stretch
where no replica computes lasts until the first boundary at or after the next event (an arrival, or a partial
wave's deadline): ``m`` steps of ``sum_b (t_b + h_b)`` each, kept as one :class:`PlanStep`.

**Scores.** ``makespan_s = max_q finish_s``; ``throughput_requests_per_s = N / makespan_s``; latency
percentiles by nearest rank: ``P_p = x_(ceil(p N / 100))`` of the sorted latencies ``x_(1) <= ... <= x_(N)``.

String form of a step (golden tests): ``s3 r0:a@2 r1:b@0+c@1 q2`` = ring step 3, replica 0 computes request
``a``'s step 2 (0-based), replica 1 computes ``b``'s step 0 then ``c``'s step 1 on each block, 2 requests wait;
``s4-9 r0:- r1:-`` = steps 4 to 9 gather-only (``q<n>`` present: waiting, absent: idle).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from dlo_fn.cost import dispatch_types
from dlo_fn.cost.dispatch_types import *  # noqa: F403  (the data types: re-exported by __all__)
from dlo_fn.cost.dispatch_types import (
    DispatchPlan,
    PassCosts,
    PlanStep,
    QueuedRequest,
    Replicas,
    ReplicaUsage,
    RequestRecord,
)
from dlo_fn.cost.waves import CompatKey, Pending, form_waves

__all__ = [
    *dispatch_types.__all__,
    "ADMISSIONS",
    "admit_continuous",
    "admit_cost_aware",
    "plan_continuous",
    "plan_strict",
    "compare_policies",
]


ADMISSIONS = ("fifo", "cost")


def admit_continuous(
    queued: Sequence[QueuedRequest], held: Sequence[Sequence[QueuedRequest]], requests_per_replica: int
) -> tuple[tuple[str, int], ...]:
    """The continuous policy at one boundary: ``(request_id, replica)`` placements for the FIFO ``queued``
    requests, given what each replica still ``held`` after retiring finished ones (see module doc)."""
    keys = [[q.key for q in h] for h in held]
    out = []
    for q in queued:
        empty = [r for r, k in enumerate(keys) if not k]
        same = [r for r, k in enumerate(keys) if k and k[0] == q.key and len(k) < requests_per_replica]
        if not empty and not same:
            break  # no overtaking: later requests wait behind the head
        r = empty[0] if empty else min(same, key=lambda r: (len(keys[r]), r))
        keys[r].append(q.key)
        out.append((q.request_id, r))
    return tuple(out)


def admit_cost_aware(
    queued: Sequence[QueuedRequest],
    held: Sequence[Sequence[QueuedRequest]],
    requests_per_replica: int,
    costs: PassCosts,
) -> tuple[tuple[str, int], ...]:
    """The cost-aware continuous rule at one boundary (module doc): ``(request_id, replica)`` placements."""
    num_blocks = costs.num_blocks
    loads = [[q.compute_s(num_blocks) for q in h] for h in held]
    keys = [[q.key for q in h] for h in held]

    def pass_max(per_replica: list[list[tuple[float, ...]]]) -> float:
        sums = [[sum(xs) for xs in zip(*c)] for c in per_replica if c]
        if not sums:
            return 0.0
        return sum(max([t] + list(col)) for t, col in zip(costs.block_transfer_s, zip(*sums)))

    out = []
    for q in queued:
        cands = [r for r, k in enumerate(keys) if not k or (k[0] == q.key and len(k) < requests_per_replica)]
        if not cands:
            break
        before = pass_max(loads)
        cost = q.compute_s(num_blocks)
        after = {r: pass_max([c + [cost] if i == r else c for i, c in enumerate(loads)]) for r in cands}
        r = min(cands, key=lambda r: (after[r], len(keys[r]), r))
        if before > 0 and after[r] > before:
            break  # it would slow every computing replica's passes: wait for the next boundary
        keys[r].append(q.key)
        loads[r].append(cost)
        out.append((q.request_id, r))
    return tuple(out)


# One admission rule per policy: (boundary time, FIFO queue, held per replica) -> placements.
_Admit = Callable[[float, list[QueuedRequest], list[list[QueuedRequest]]], Sequence[tuple[str, int]]]


def _fifo(requests: Sequence[QueuedRequest], costs: PassCosts) -> tuple[QueuedRequest, ...]:
    if not requests:
        raise ValueError("a dispatch plan needs at least one request")
    ids = [q.request_id for q in requests]
    if len(set(ids)) != len(ids):
        raise ValueError(f"request ids must be unique, got duplicates {sorted({i for i in ids if ids.count(i) > 1})}")
    for q in requests:
        q.compute_s(costs.num_blocks)  # checks the per-block length now, with the request named
    return tuple(sorted(requests, key=lambda q: (q.arrival_s, q.request_id)))


def _plan(
    policy: str,
    requests: Sequence[QueuedRequest],
    costs: PassCosts,
    replicas: Replicas,
    admit: _Admit,
    is_due: Callable[[float, list[QueuedRequest]], bool] = lambda t, queue: False,
    due_s: Callable[[list[QueuedRequest]], float] = lambda queue: math.inf,
) -> DispatchPlan:
    """Walk the boundaries: admit arrivals, let ``admit`` place requests, run one step (or one stretch).
    ``is_due(T, queue)``: whether the queue alone gives ``admit`` work at ``T`` (a partial wave's deadline);
    ``due_s(queue)``: about when that happens (the stretch's estimate, made exact with ``is_due``)."""
    reqs = _fifo(requests, costs)
    cost = {q.request_id: q.compute_s(costs.num_blocks) for q in reqs}
    total = {i: sum(c) for i, c in cost.items()}
    W = replicas.dp_size
    held: list[list[QueuedRequest]] = [[] for _ in range(W)]
    done: dict[str, int] = {}
    started: dict[str, tuple[int, int, float]] = {}
    finished: dict[str, float] = {}
    counts = [[0, 0, 0, 0.0] for _ in range(W)]
    memo: dict[tuple, float] = {}
    queue: list[QueuedRequest] = []
    steps: list[PlanStep] = []
    t, k, arrived = 0.0, 0, 0
    idle_step_s = costs.step_s(())
    while len(finished) < len(reqs):
        while arrived < len(reqs) and reqs[arrived].arrival_s <= t:
            queue.append(reqs[arrived])
            arrived += 1
        placed = dict(admit(t, queue, held))
        for q in queue:
            if q.request_id in placed:
                held[placed[q.request_id]].append(q)
                started[q.request_id] = (placed[q.request_id], k, t)
                done[q.request_id] = 0
        queue = [q for q in queue if q.request_id not in placed]
        if not any(held):
            next_s = reqs[arrived].arrival_s if arrived < len(reqs) else math.inf
            n = _stretch(t, idle_step_s, min(next_s, due_s(queue)), lambda T: T >= next_s or is_due(T, queue), policy)
            end = t + n * idle_step_s
            steps.append(PlanStep(k, n, t, end, idle_step_s, ((),) * W, len(queue)))
            for c in counts:
                c[2 if queue else 1] += n * costs.num_blocks
            t, k = end, k + n
            continue
        sig = tuple(tuple(q.request_id for q in h) for h in held)
        if sig not in memo:
            memo[sig] = costs.step_s([[sum(xs) for xs in zip(*(cost[q.request_id] for q in h))] for h in held if h])
        step_s = memo[sig]
        cells = tuple(tuple((q.request_id, done[q.request_id]) for q in h) for h in held)
        steps.append(PlanStep(k, 1, t, t + step_s, step_s, cells, len(queue)))
        for r, h in enumerate(held):
            c = counts[r]
            c[0 if h else (2 if queue else 1)] += costs.num_blocks
            c[3] += sum(total[q.request_id] for q in h)
        t, k = t + step_s, k + 1
        for h in held:
            for q in h:
                done[q.request_id] += 1
                if done[q.request_id] == q.num_steps:
                    finished[q.request_id] = t
            h[:] = [q for q in h if q.request_id not in finished]
    records = tuple(
        RequestRecord(
            q.request_id,
            q.arrival_s,
            started[q.request_id][0],
            started[q.request_id][1],
            q.num_steps,
            started[q.request_id][2],
            finished[q.request_id],
        )
        for q in reqs
    )
    usage = tuple(ReplicaUsage(r, c[0], c[1], c[2], c[3]) for r, c in enumerate(counts))
    return DispatchPlan(policy, costs, replicas, reqs, tuple(steps), records, usage)


def _stretch(t: float, idle_step_s: float, event_s: float, wakes: Callable[[float], bool], policy: str) -> int:
    """Ring steps of ``idle_step_s`` from ``t`` to the first boundary ``T`` that ``wakes`` (about ``event_s``)."""
    assert math.isfinite(event_s), f"{policy}: nothing runs at t = {t} and no event follows"
    if idle_step_s <= 0:
        raise ValueError(
            f"{policy}: nothing runs at t = {t} s until t = {event_s} s, and a gather-only step lasts "
            f"0 s (PassCosts.block_transfer_s + block_host_s are all 0): give the ring a load time"
        )
    n = max(1, math.ceil((event_s - t) / idle_step_s))
    while not wakes(t + n * idle_step_s):  # rounding of the estimate, either way
        n += 1
    while n > 1 and wakes(t + (n - 1) * idle_step_s):
        n -= 1
    return n


def plan_continuous(
    requests: Sequence[QueuedRequest], costs: PassCosts, replicas: Replicas, *, admission: str = "fifo"
) -> DispatchPlan:
    """The continuous policy on a trace (module doc). ``admission="fifo"`` (:func:`admit_continuous`) never
    leaves a replica waiting; ``"cost"`` (:func:`admit_cost_aware`) may, to keep the pass maximum down."""
    R = replicas.requests_per_replica
    if admission == "fifo":
        return _plan("continuous", requests, costs, replicas, lambda t, queue, held: admit_continuous(queue, held, R))
    if admission == "cost":
        return _plan(
            "continuous", requests, costs, replicas, lambda t, queue, held: admit_cost_aware(queue, held, R, costs)
        )
    raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")


def plan_strict(
    requests: Sequence[QueuedRequest], costs: PassCosts, replicas: Replicas, *, max_wait_s: float = 0.0
) -> DispatchPlan:
    """Today's strict waves on a trace (module doc), formed by :func:`~dlo_fn.cost.waves.form_waves`."""
    if not (math.isfinite(max_wait_s) and max_wait_s >= 0):
        raise ValueError(f"max_wait_s must be finite seconds >= 0, got {max_wait_s}")
    W, R = replicas.dp_size, replicas.requests_per_replica
    formed: list[list[tuple[str, int]]] = []  # waves formed at one boundary, not yet started

    def admit(t: float, queue: list[QueuedRequest], held: list[list[QueuedRequest]]) -> list[tuple[str, int]]:
        if any(held):
            return []
        if not formed:
            pending = [
                Pending(i, CompatKey((("key", q.key), ("num_steps", q.num_steps))), q.arrival_s)
                for i, q in enumerate(queue)
            ]
            for wave in form_waves(pending, W, R, now_s=t, max_wait_s=max_wait_s).waves:
                formed.append([(queue[i].request_id, r) for r, idx in enumerate(wave.rank_indices) for i in idx])
        return formed.pop(0) if formed else []

    def is_due(t: float, queue: list[QueuedRequest]) -> bool:
        # form_waves' own test; a chunk's oldest request is due no later than any of its members
        return any(t - q.arrival_s >= max_wait_s for q in queue)

    def due_s(queue: list[QueuedRequest]) -> float:
        return min((q.arrival_s + max_wait_s for q in queue), default=math.inf)

    return _plan("strict", requests, costs, replicas, admit, is_due, due_s)


def compare_policies(
    requests: Sequence[QueuedRequest],
    costs: PassCosts,
    replicas: Replicas,
    *,
    max_wait_s: float = 0.0,
    admissions: Sequence[str] = ("fifo",),
) -> tuple[dict[str, object], ...]:
    """One row per policy on the same trace, for :func:`benchmarks.repro.tables.text_table` (6 significant
    digits): continuous with each of ``admissions`` (``continuous``, ``continuous (cost)``), then strict.
    ``utilisation = sum_r compute_s / (W makespan_s)``."""
    rows = []
    plans = [
        (
            ("continuous" if a == "fifo" else f"continuous ({a})"),
            plan_continuous(requests, costs, replicas, admission=a),
        )
        for a in admissions
    ]
    plans.append(("strict", plan_strict(requests, costs, replicas, max_wait_s=max_wait_s)))
    for name, plan in plans:
        u = plan.usage
        rows.append(
            {
                "policy": name,
                "makespan_s": _g(plan.makespan_s),
                "throughput_requests_per_s": _g(plan.throughput_requests_per_s),
                "p50_latency_s": _g(plan.p50_latency_s),
                "p95_latency_s": _g(plan.p95_latency_s),
                "mean_latency_s": _g(plan.mean_latency_s),
                "ring_steps": plan.num_ring_steps,
                "compute_passes": sum(x.num_compute_passes for x in u),
                "idle_passes": sum(x.num_idle_passes for x in u),
                "waiting_passes": sum(x.num_waiting_passes for x in u),
                "utilisation": _g(sum(x.compute_s for x in u) / (len(u) * plan.makespan_s) if plan.makespan_s else 0.0),
            }
        )
    return tuple(rows)


def _g(x: float) -> float:
    return float(f"{x:.6g}")
