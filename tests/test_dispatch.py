"""Dispatch planner: golden plans on hand-checked traces, and hypothesis properties of both policies.

Every number in the traces is a small multiple of 1/4, so sums of seconds are exact in binary floating point and
the comparisons below are exact.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlo_fn.cost.dispatch import (
    PassCosts,
    Replicas,
    admit_continuous,
    compare_policies,
    nearest_rank,
    plan_continuous,
    plan_strict,
)
from dlo_fn.cost.dispatch import (
    QueuedRequest as Q,
)


def _lines(reqs, costs, dp, r=1, **kw):
    return (
        plan_continuous(reqs, costs, Replicas(dp, r)).lines(),
        plan_strict(reqs, costs, Replicas(dp, r), **kw).lines(),
    )


# ---- golden plans (each checked by hand; the arithmetic is in the comments) ----------------------------------


def test_golden_mixed_steps_two_replicas():
    # 2 blocks, load 0.25 s, compute 0.5 s: a busy pass is 0.5 s, a busy step 1 s. Strict keys are (key, steps),
    # so a (x, 1) and c (x, 2) are separate waves; d arrives at 2.5 and starts at the next boundary.
    reqs = [Q("a", 0, 1, "x", 0.5), Q("b", 0, 3, "y", 0.5), Q("c", 0, 2, "x", 0.5), Q("d", 2.5, 1, "x", 0.5)]
    costs = PassCosts.uniform(2, 0.25)
    cont, strict = plan_continuous(reqs, costs, Replicas(2)), plan_strict(reqs, costs, Replicas(2))
    assert cont.lines() == ("s0 r0:a@0 r1:b@0 q1", "s1 r0:c@0 r1:b@1", "s2 r0:c@1 r1:b@2", "s3 r0:d@0 r1:-")
    assert [(r.request_id, r.replica, r.start_s, r.finish_s) for r in cont.records] == [
        ("a", 0, 0.0, 1.0),
        ("b", 1, 0.0, 3.0),
        ("c", 0, 1.0, 3.0),
        ("d", 0, 3.0, 4.0),
    ]
    assert strict.lines() == (
        "s0 r0:a@0 r1:- q2",
        "s1 r0:b@0 r1:- q1",
        "s2 r0:b@1 r1:- q1",
        "s3 r0:b@2 r1:- q2",
        "s4 r0:c@0 r1:- q1",
        "s5 r0:c@1 r1:- q1",
        "s6 r0:d@0 r1:-",
    )
    # latencies 1, 3, 3, 1.5 -> sorted 1, 1.5, 3, 3: p50 = x_(2) = 1.5, p95 = x_(ceil 3.8) = x_(4) = 3
    assert (cont.makespan_s, cont.throughput_requests_per_s, cont.p50_latency_s, cont.p95_latency_s) == (4, 1, 1.5, 3)
    assert (cont.mean_latency_s, strict.makespan_s, strict.p50_latency_s, strict.p95_latency_s) == (2.125, 7, 4, 6)
    # passes per replica: continuous r1 computes 3 steps and idles 1 (2 blocks each); strict r1 idles only in s6
    assert [(u.num_compute_passes, u.num_idle_passes, u.num_waiting_passes, u.compute_s) for u in cont.usage] == [
        (8, 0, 0, 4.0),
        (6, 2, 0, 3.0),
    ]
    assert [(u.num_compute_passes, u.num_idle_passes, u.num_waiting_passes) for u in strict.usage] == [
        (14, 0, 0),
        (0, 2, 12),
    ]


def test_golden_idle_stretch_until_arrival():
    # Idle step = load 0.5 s; after a ends at 1 s the first boundary at or after 3.2 s is 1 + 5 x 0.5 = 3.5 s.
    reqs = [Q("a", 0, 1, "x", 1.0), Q("b", 3.2, 1, "x", 1.0)]
    cont = plan_continuous(reqs, PassCosts.uniform(1, 0.5), Replicas(1))
    assert cont.lines() == ("s0 r0:a@0", "s1-5 r0:-", "s6 r0:b@0")
    assert (cont.steps[1].start_s, cont.steps[1].end_s, cont.record("b").start_s, cont.makespan_s) == (1, 3.5, 3.5, 4.5)
    assert (cont.usage[0].num_idle_passes, cont.num_ring_steps) == (5, 7)
    assert plan_strict(reqs, PassCosts.uniform(1, 0.5), Replicas(1)).lines() == cont.lines()


def test_golden_requests_per_replica_and_no_overtaking():
    # R = 2: c joins a (key x), d joins b (key y); e (key z) fits nowhere, and f (x) waits behind it although it
    # could join a. Step 0: max(0.25, 0.5 + 0.5, 0.5 + 0.25) = 1 s; step 1: 0.5 s; step 2: 0.5 s.
    reqs = [
        Q("a", 0, 2, "x", 0.5),
        Q("b", 0, 2, "y", 0.5),
        Q("c", 0, 1, "x", 0.5),
        Q("d", 0, 1, "y", 0.25),
        Q("e", 0, 1, "z", 0.5),
        Q("f", 0, 1, "x", 0.5),
    ]
    cont, strict = _lines(reqs, PassCosts.uniform(1, 0.25), 2, 2)
    assert cont == ("s0 r0:a@0+c@0 r1:b@0+d@0 q2", "s1 r0:a@1 r1:b@1 q2", "s2 r0:e@0 r1:f@0")
    assert plan_continuous(reqs, PassCosts.uniform(1, 0.25), Replicas(2, 2)).makespan_s == 2.0
    # strict waves by oldest member: a, b, {c, f} (dealt round-robin), d, e -> 1 + 1 + 0.5 + 0.25 + 0.5 s
    assert strict == (
        "s0 r0:a@0 r1:- q5",
        "s1 r0:a@1 r1:- q5",
        "s2 r0:b@0 r1:- q4",
        "s3 r0:b@1 r1:- q4",
        "s4 r0:c@0 r1:f@0 q2",
        "s5 r0:d@0 r1:- q1",
        "s6 r0:e@0 r1:-",
    )
    assert plan_strict(reqs, PassCosts.uniform(1, 0.25), Replicas(2, 2)).makespan_s == 3.25


def test_golden_strict_partial_wave_waits_for_company():
    # max_wait_s = 2: {a} alone is not ready until 2 s; b arrives at 1.5, and at 2 s the wave {a, b} is full.
    reqs = [Q("a", 0, 1, "x", 1.0), Q("b", 1.5, 1, "x", 1.0)]
    cont, strict = _lines(reqs, PassCosts.uniform(1, 1.0), 2, max_wait_s=2.0)
    assert strict == ("s0-1 r0:- r1:- q1", "s2 r0:a@0 r1:b@0")
    assert cont == ("s0 r0:a@0 r1:-", "s1 r0:- r1:-", "s2 r0:b@0 r1:-")
    plan = plan_strict(reqs, PassCosts.uniform(1, 1.0), Replicas(2), max_wait_s=2.0)
    assert [u.num_waiting_passes for u in plan.usage] == [2, 2]


def test_strict_can_beat_continuous_with_mixed_steps():
    """Not a property: FIFO continuous puts the long e behind the short ones, strict pairs it with a."""
    reqs = [
        Q("a", 0, 4, "x", 1.0),
        Q("b", 0, 1, "y", 1.0),
        Q("c", 0, 1, "y", 1.0),
        Q("d", 0, 1, "y", 1.0),
        Q("e", 0, 4, "x", 1.0),
    ]
    cont, strict = (f(reqs, PassCosts.uniform(1, 1.0), Replicas(2)) for f in (plan_continuous, plan_strict))
    assert cont.lines()[3] == "s3 r0:a@3 r1:e@0" and strict.lines()[0] == "s0 r0:a@0 r1:e@0 q3"
    assert (cont.makespan_s, strict.makespan_s) == (7, 6)


def test_strict_can_beat_continuous_when_idle_steps_are_shorter():
    """Not a property: an idle step (load 3 s) is shorter than a busy one (compute 10 s), so the two policies'
    boundaries drift apart; continuous, idle since 10 s, next reaches a boundary at 22 s, strict at 20 s."""
    reqs = [Q("a", 0, 1, "x", 10.0), Q("b", 0, 1, "y", 10.0), Q("c", 20, 1, "z", 10.0)]
    cont, strict = (f(reqs, PassCosts.uniform(1, 3.0), Replicas(2)) for f in (plan_continuous, plan_strict))
    assert cont.lines() == ("s0 r0:a@0 r1:b@0", "s1-4 r0:- r1:-", "s5 r0:c@0 r1:-")
    assert (cont.makespan_s, strict.makespan_s) == (32, 30)


def test_per_block_costs_and_host_cost():
    # block 0: max(1, 0.5) + 0.25; block 1: max(0.25, 2) + 0.25 -> 3.5 s per step with a; idle 1.75 s.
    costs = PassCosts((1.0, 0.25), (0.25, 0.25))
    plan = plan_continuous([Q("a", 0, 2, "", (0.5, 2.0))], costs, Replicas(2))
    assert [s.step_s for s in plan.steps] == [3.5, 3.5] and plan.makespan_s == 7.0
    assert costs.step_s(()) == 1.75 and plan.usage[0].compute_s == 5.0


def test_admit_continuous_alone():
    a, b, c = Q("a", 0, 1, "x"), Q("b", 0, 1, "x"), Q("c", 0, 1, "y")
    assert admit_continuous([b, c], [[a], []], 2) == (("b", 1),)  # empty replica first; c then fits nowhere
    assert admit_continuous([c, b], [[a], []], 2) == (("c", 1), ("b", 0))  # b joins a
    assert admit_continuous([c, b], [[a], []], 1) == (("c", 1),)


def test_compare_policies_rows():
    reqs = [Q("a", 0, 1, "x", 0.5), Q("b", 0, 3, "y", 0.5), Q("c", 0, 2, "x", 0.5), Q("d", 2.5, 1, "x", 0.5)]
    rows = compare_policies(reqs, PassCosts.uniform(2, 0.25), Replicas(2))
    assert [r["policy"] for r in rows] == ["continuous", "strict"]
    assert rows[0] == {
        "policy": "continuous",
        "makespan_s": 4.0,
        "throughput_requests_per_s": 1.0,
        "p50_latency_s": 1.5,
        "p95_latency_s": 3.0,
        "mean_latency_s": 2.125,
        "ring_steps": 4,
        "compute_passes": 14,
        "idle_passes": 2,
        "waiting_passes": 0,
        "utilisation": 0.875,
    }
    assert (rows[1]["makespan_s"], rows[1]["waiting_passes"], rows[1]["throughput_requests_per_s"]) == (7, 12, 0.571429)


def test_nearest_rank():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert [nearest_rank(xs, p) for p in (0, 20, 21, 50, 95, 100)] == [1, 1, 2, 3, 5, 5]
    with pytest.raises(ValueError, match="percent"):
        nearest_rank(xs, 101)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Q("a b", 0, 1), "request_id"),
        (lambda: Q("a", -1, 1), "arrival_s"),
        (lambda: Q("a", 0, 0), "num_steps"),
        (lambda: Q("a", 0, 1, "", -0.5), "block_compute_s"),
        (lambda: Q("a", 0, 1, "", (0.5, None)), "block_compute_s"),
        (lambda: Replicas(0), "dp_size"),
        (lambda: Replicas(1, 0), "requests_per_replica"),
        (lambda: PassCosts((0.5,), ()), "one block_transfer_s"),
        (lambda: plan_continuous([Q("a", 0, 1), Q("a", 1, 1)], PassCosts.uniform(1, 1), Replicas(1)), "unique"),
        (lambda: plan_continuous([Q("a", 0, 1, "", (1.0,))], PassCosts.uniform(2, 1), Replicas(1)), "2 blocks"),
        (lambda: plan_continuous([], PassCosts.uniform(1, 1), Replicas(1)), "at least one request"),
        (lambda: plan_continuous([Q("a", 1, 1)], PassCosts.uniform(1, 0.0), Replicas(1)), "give the ring a load time"),
        (lambda: plan_strict([Q("a", 0, 1)], PassCosts.uniform(1, 1), Replicas(1), max_wait_s=math.inf), "max_wait_s"),
    ],
)
def test_bad_input_names_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---- properties ------------------------------------------------------------------------------------------------

_quarters = st.integers(0, 16).map(lambda n: n / 4)


@st.composite
def traces(draw, identical: bool = False, at_zero: bool = False):
    """(requests, costs, replicas, max_wait_s). ``identical``: one step count and one cost for every request."""
    num_blocks = draw(st.integers(1, 3))
    costs = PassCosts(
        tuple(draw(st.lists(st.sampled_from((0.25, 0.5, 1.0)), min_size=num_blocks, max_size=num_blocks))),
        tuple(draw(st.lists(st.sampled_from((0.0, 0.25)), min_size=num_blocks, max_size=num_blocks))),
    )
    cost = st.sampled_from((0.0, 0.25, 0.5, 1.0, 1.5))
    request_costs = st.one_of(cost, st.lists(cost, min_size=num_blocks, max_size=num_blocks).map(tuple))
    same_steps, same_cost = draw(st.integers(1, 4)), draw(request_costs)
    n = draw(st.integers(1, 8))
    reqs = [
        Q(
            f"q{i}",
            0.0 if at_zero else draw(_quarters),
            same_steps if identical else draw(st.integers(1, 4)),
            draw(st.sampled_from("xyz")),
            same_cost if identical else draw(request_costs),
        )
        for i in range(n)
    ]
    replicas = Replicas(draw(st.integers(1, 3)), 1 if identical else draw(st.integers(1, 3)))
    return reqs, costs, replicas, draw(st.sampled_from((0.0, 0.5, 2.5)))


def _cost(q: Q, b: int) -> float:
    return q.block_compute_s[b] if isinstance(q.block_compute_s, tuple) else q.block_compute_s


def check_plan(plan, reqs, costs, replicas):
    """Invariants both policies keep, checked from the plan's cells, not from the planner's arithmetic."""
    by_id = {q.request_id: q for q in reqs}
    B, W, R = costs.num_blocks, replicas.dp_size, replicas.requests_per_replica
    runs: dict[str, list[tuple[int, int, int]]] = {i: [] for i in by_id}  # (ring step, replica, request step)
    t, k = 0.0, 0
    passes = [[0, 0, 0] for _ in range(W)]
    for step in plan.steps:
        assert (step.first_step, step.start_s) == (k, t)  # contiguous from boundary 0 at 0 s
        assert len(step.replicas) == W
        assert step.end_s == step.start_s + step.num_steps * step.step_s
        held = [[by_id[i] for i, _ in cell] for cell in step.replicas]
        # lockstep: every pass lasts as long as its slowest member, the load included
        assert step.step_s == sum(
            max([costs.block_transfer_s[b]] + [sum(_cost(q, b) for q in h) for h in held]) + costs.block_host_s[b]
            for b in range(B)
        )
        assert step.num_steps == 1 or not any(held)  # only gather-only stretches are merged
        for r, cell in enumerate(step.replicas):
            assert len(cell) <= R and len({by_id[i].key for i, _ in cell}) <= 1  # one key, at most R requests
            assert len({i for i, _ in cell}) == len(cell)
            for i, s in cell:
                assert by_id[i].arrival_s <= step.start_s
                runs[i].append((k, r, s))
            passes[r][0 if cell else (2 if step.num_queued else 1)] += step.num_steps * B
        queued = [
            q
            for q in reqs
            if q.arrival_s <= step.start_s
            and all(rk >= k for rk, _, _ in runs[q.request_id])
            and not any(i == q.request_id for c in step.replicas for i, _ in c)
        ]
        assert step.num_queued == len(queued)
        t, k = step.end_s, k + step.num_steps
    assert t == plan.makespan_s and plan.num_ring_steps == k
    for i, run in runs.items():  # every request exactly once: its steps 0..n-1 on consecutive ring steps, one replica
        first = run[0][0]
        assert run == [(first + s, run[0][1], s) for s in range(by_id[i].num_steps)]
        rec = plan.record(i)
        assert (rec.first_step, rec.replica, rec.num_steps) == (first, run[0][1], by_id[i].num_steps)
        start = next(s for s in plan.steps if s.first_step == first)
        last = next(s for s in plan.steps if s.first_step == first + by_id[i].num_steps - 1)
        assert (rec.start_s, rec.finish_s) == (start.start_s, last.end_s)
    assert [r.request_id for r in plan.records] == [
        q.request_id for q in sorted(reqs, key=lambda q: (q.arrival_s, q.request_id))
    ]
    for u, (c, i, w) in zip(plan.usage, passes):
        assert (u.num_compute_passes, u.num_idle_passes, u.num_waiting_passes) == (c, i, w)
        assert c + i + w == plan.num_passes
    assert plan.p50_latency_s <= plan.p95_latency_s <= max(r.latency_s for r in plan.records)


@settings(max_examples=300, deadline=None)
@given(traces())
def test_continuous_plan_invariants(case):
    reqs, costs, replicas, _ = case
    plan = plan_continuous(reqs, costs, replicas)
    check_plan(plan, reqs, costs, replicas)
    # never waits: a replica is gather-only only when the queue is empty
    assert all(u.num_waiting_passes == 0 for u in plan.usage)
    # no overtaking: starts follow FIFO order
    assert [r.start_s for r in plan.records] == sorted(r.start_s for r in plan.records)
    # an idle stretch ends at the first boundary at or after the next arrival, and that request starts there
    for s in plan.steps:
        if not any(s.replicas) and s.end_s < plan.makespan_s:
            nxt = min(q.arrival_s for q in reqs if q.arrival_s > s.start_s)
            assert s.end_s - s.step_s < nxt <= s.end_s
            assert any(r.arrival_s == nxt and r.start_s == s.end_s for r in plan.records)
    # deterministic, and independent of the input's order
    shuffled = list(reqs)
    random.Random(len(reqs)).shuffle(shuffled)
    assert plan_continuous(shuffled, costs, replicas) == plan


def test_golden_cost_aware_keeps_the_expensive_head_back():
    # 1 block, load 0.25 s. a (cost 1, 2 steps) on r0; b (cost 4) would raise the pass max from 1 to 4: it waits
    # until a ends (r1 waits 2 steps), then b and the cheap c run side by side (c does not raise 4).
    reqs = [Q("a", 0, 2, "x", 1.0), Q("b", 0, 1, "y", 4.0), Q("c", 0, 1, "z", 1.0)]
    costs = PassCosts.uniform(1, 0.25)
    fifo = plan_continuous(reqs, costs, Replicas(2))
    cost = plan_continuous(reqs, costs, Replicas(2), admission="cost")
    assert fifo.lines() == ("s0 r0:a@0 r1:b@0 q1", "s1 r0:a@1 r1:c@0")
    assert cost.lines() == ("s0 r0:a@0 r1:- q2", "s1 r0:a@1 r1:- q2", "s2 r0:b@0 r1:c@0")
    # fifo: 4 + 1 = 5 s, latencies a 5, b 4, c 5; cost-aware: 1 + 1 + 4 = 6 s, latencies 2, 6, 6
    assert (fifo.makespan_s, cost.makespan_s) == (5.0, 6.0)
    assert [r.latency_s for r in cost.records] == [2.0, 6.0, 6.0]
    assert cost.usage[1].num_waiting_passes == 2
    with pytest.raises(ValueError, match="admission must be one of"):
        plan_continuous(reqs, costs, Replicas(2), admission="lifo")


@settings(max_examples=200, deadline=None)
@given(traces())
def test_cost_aware_plan_invariants(case):
    reqs, costs, replicas, _ = case
    plan = plan_continuous(reqs, costs, replicas, admission="cost")
    check_plan(plan, reqs, costs, replicas)  # every request exactly once, its steps back to back: nothing starves
    assert [r.start_s for r in plan.records] == sorted(r.start_s for r in plan.records)  # no overtaking
    # one cost for every request, R = 1: a placement never raises the busy time, so it is the FIFO rule
    if (
        replicas.requests_per_replica == 1
        and len({q.block_compute_s for q in reqs}) == 1
        and not isinstance(reqs[0].block_compute_s, tuple)
    ):
        assert plan.lines() == plan_continuous(reqs, costs, replicas).lines()


@settings(max_examples=300, deadline=None)
@given(traces())
def test_strict_plan_invariants(case):
    reqs, costs, replicas, max_wait_s = case
    plan = plan_strict(reqs, costs, replicas, max_wait_s=max_wait_s)
    check_plan(plan, reqs, costs, replicas)
    W, R = replicas.dp_size, replicas.requests_per_replica
    waves: dict[int, list] = {}
    for rec in plan.records:
        waves.setdefault(rec.first_step, []).append(rec)
    spans = []
    for first, members in sorted(waves.items()):
        qs = [next(q for q in reqs if q.request_id == m.request_id) for m in members]
        assert len({(q.key, q.num_steps) for q in qs}) == 1 and len(members) <= W * R  # one key, <= W R
        assert [m.replica for m in members] == [p % W for p in range(len(members))]  # dealt round-robin (FIFO)
        spans.append((first, first + qs[0].num_steps))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # one wave at a time, each to its end


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_continuous_beats_strict_on_identical_requests(data):
    """R = 1, every request with the same steps n and cost, on a uniform grid of boundaries (every step equally
    long: compute <= load on every block, or all arrivals at 0 so the ring never idles before the end).

    Proof: continuous starts the FIFO k-th request at s_k = max(s_{k-1}, g(a_k), s_{k-W} + n) (g = first
    boundary at or after the arrival); in any schedule with <= W requests at once, the k-th start sigma_k obeys
    the same three lower bounds, so s_k <= sigma_k by induction. So the sorted finish times of continuous are
    no later one by one: makespan and mean latency (sum of finishes - sum of arrivals) are no larger."""
    at_zero = data.draw(st.booleans())
    reqs, costs, replicas, max_wait_s = data.draw(traces(identical=True, at_zero=at_zero))
    if not at_zero:
        costs = PassCosts(
            tuple(max(t, _cost(reqs[0], b)) for b, t in enumerate(costs.block_transfer_s)), costs.block_host_s
        )
    cont, strict = plan_continuous(reqs, costs, replicas), plan_strict(reqs, costs, replicas, max_wait_s=max_wait_s)
    assert cont.makespan_s <= strict.makespan_s
    assert sum(r.finish_s for r in cont.records) <= sum(r.finish_s for r in strict.records)
    assert cont.mean_latency_s <= strict.mean_latency_s


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_more_replicas_never_slow_continuous_on_identical_requests(data):
    """Same conditions; with W + 1 replicas s'_k = max(s'_{k-1}, g(a_k), s'_{k-W-1} + n) <= s_k by induction, so
    every request finishes no later (with mixed steps or costs this fails: Graham's list-scheduling anomalies)."""
    at_zero = data.draw(st.booleans())
    reqs, costs, replicas, _ = data.draw(traces(identical=True, at_zero=at_zero))
    if not at_zero:
        costs = PassCosts(
            tuple(max(t, _cost(reqs[0], b)) for b, t in enumerate(costs.block_transfer_s)), costs.block_host_s
        )
    few = plan_continuous(reqs, costs, replicas)
    more = plan_continuous(reqs, costs, Replicas(replicas.dp_size + 1))
    assert all(m.finish_s <= f.finish_s for f, m in zip(few.records, more.records))
    assert more.makespan_s <= few.makespan_s


@settings(max_examples=150, deadline=None)
@given(traces(), st.integers(1, 12), st.integers(1, 3))
def test_policies_agree_where_they_must(case, n, steps):
    reqs, costs, replicas, _ = case
    # one replica, R = 1: both run the queue in FIFO order, one request at a time
    one = Replicas(1)
    assert plan_continuous(reqs, costs, one).lines() == plan_strict(reqs, costs, one).lines()
    # a homogeneous batch at 0: both deal full waves round-robin, one after another
    batch = [Q(f"b{i:02d}", 0, steps, "x", reqs[0].block_compute_s) for i in range(n)]
    assert plan_continuous(batch, costs, replicas).lines() == plan_strict(batch, costs, replicas).lines()
