"""Three-stream simulator, Timeline accounting, Chrome trace round trip, and the H200 predictions."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import build_case, schedule_cases

from dlo_fn.cost.ceilings import (
    H200_BLOCK_COMPUTE_S,
    H200_PASS,
    H200_PINNED_H2D_BYTES_PER_S,
    IMAGE_1024_CFG,
    REF_BLOCK_BYTES,
    REF_PASS_NUM_BLOCKS,
    VIDEO_832X480X29_CFG,
    h200_durations,
)
from dlo_fn.plan.schedule import AG, H2D, C, build_schedule, next_schedule
from dlo_fn.plan.timeline import Span, Timeline, bandwidth_durations, block_summary, simulate, simulate_runs
from dlo_fn.plan.trace import from_chrome_trace, to_chrome_trace
from dlo_fn.plan.workload import Workload


def _kind_cost(h2d: float, ag: float, c: float):
    return lambda op: {H2D: h2d, AG: ag, C: c}[op.kind]


def test_accounting_on_a_hand_made_timeline():
    tl = Timeline.from_records(
        [
            ("H2D k0 b0>l0", "h2d", 0.0, 4.0),
            ("AG k0 b0 l0>s0", "allgather", 4.0, 6.0),
            ("C k0 b0@s0 r0", "compute", 6.0, 9.0),
            ("H2D k1 b1>l1", "h2d", 4.0, 8.0),
            ("AG k1 b1 l1>s1", "allgather", 8.0, 10.0),
            ("C k1 b1@s1 r0", "compute", 12.0, 15.0),  # 10..12: nothing runs (host work)
            ("C k1 b1@s1 r1", "compute", 14.0, 16.0),  # overlapping measured spans count once
        ],
        meta=[("source", "hand")],
    )
    assert tl.makespan_s == 16.0
    assert tl.busy_s("h2d") == 8.0 and tl.busy_s("allgather") == 4.0 and tl.busy_s("compute") == 7.0
    assert tl.compute_idle_s() == 9.0
    # Compute idle 0..6 (transfers busy throughout) + 9..12 (transfers busy 9..10 only) = 6 + 1.
    assert tl.exposed_transfer_s() == 7.0
    assert tl.meta == (("source", "hand"),)
    rows = {r.block: r for r in block_summary(tl)}
    assert (rows[0].num_loads, rows[0].h2d_s, rows[0].compute_s, rows[0].wait_s) == (1, 4.0, 3.0, 6.0)
    assert (rows[1].allgather_s, rows[1].compute_s, rows[1].wait_s) == (2.0, 5.0, 3.0)


def test_multi_rank_timelines_need_a_rank():
    tl = Timeline.from_records([("C k0 b0@s0 r0", "compute", 0, 1, 0), ("C k0 b0@s0 r0", "compute", 0, 2, 1)])
    assert tl.ranks == (0, 1)
    with pytest.raises(ValueError, match="rank="):
        tl.busy_s("compute")
    assert (tl.busy_s("compute", rank=0), tl.busy_s("compute", rank=1)) == (1.0, 2.0)


def test_bad_records_and_spans_are_named():
    with pytest.raises(ValueError, match="record 1"):
        Timeline.from_records([("a", "h2d", 0, 1), ("b", "h2d", 0)])
    with pytest.raises(ValueError, match="start_s <= end_s"):
        Span("C k0 b0@s0 r0", "compute", 2.0, 1.0)


def test_landing_buffers_decide_whether_h2d_and_allgather_overlap():
    # h = 3, a = 2, no compute: one landing buffer serialises them (period h + a), two overlap them (max(h, a)).
    cost = _kind_cost(3.0, 2.0, 0.0)
    one = simulate(build_schedule(6, 1, num_landing=1), cost)
    two = simulate(build_schedule(6, 1, num_landing=2), cost)
    assert one.makespan_s == 6 * (3 + 2)
    assert two.makespan_s == 6 * 3 + 2


def test_one_slot_is_the_synchronous_baseline():
    cost = _kind_cost(3.0, 0.0, 5.0)
    sync = simulate(build_schedule(4, 1, num_slots=1, mode="rank-local"), cost)
    double = simulate(build_schedule(4, 1, num_slots=2, mode="rank-local"), cost)
    assert sync.makespan_s == 4 * (3 + 5)
    assert double.makespan_s == 3 + 4 * 5


cases = schedule_cases


_build = build_case


@settings(max_examples=80, deadline=None)
@given(cases, st.integers(0, 2**31))
def test_simulation_respects_streams_and_waits_and_bounds(case, seed):
    s = _build(case)
    rng = random.Random(seed)
    cost = {}
    tl = simulate(s, lambda op: cost.setdefault(str(op), float(rng.randint(0, 9))))
    ends = [span.end_s for span in tl.spans]
    last_on_stream: dict[str, float] = {}
    for i, (op, span) in enumerate(zip(s.ops, tl.spans)):
        assert span.op == str(op) and span.stream == op.stream
        ready = max([last_on_stream.get(op.stream, 0.0)] + [ends[d] for d in s.deps[i]])
        assert span.start_s == ready and span.end_s == ready + cost[str(op)]
        last_on_stream[op.stream] = span.end_s
    busiest = max(tl.busy_s(stream) for stream in ("h2d", "allgather", "compute"))
    assert busiest <= tl.makespan_s <= sum(cost[str(op)] for op in s.ops)


@settings(max_examples=80, deadline=None)
@given(cases, st.integers(0, 2**31))
def test_makespan_equals_the_dominant_stream_total(case, seed):
    s = _build(case)
    rng = random.Random(seed)
    h2d = {str(op): float(rng.randint(1, 9)) for op in s.ops if op.kind == H2D}
    comp = {str(op): float(rng.randint(1, 9)) for op in s.ops if op.kind == C}
    transfer_bound = simulate(s, lambda op: h2d.get(str(op), 0.0))
    assert transfer_bound.makespan_s == sum(h2d.values()) == transfer_bound.busy_s("h2d")
    compute_bound = simulate(s, lambda op: comp.get(str(op), 0.0))
    assert compute_bound.makespan_s == sum(comp.values()) == compute_bound.busy_s("compute")
    assert compute_bound.exposed_transfer_s() == 0.0


@settings(max_examples=40, deadline=None)
@given(cases, st.integers(0, 2**31))
def test_chrome_trace_round_trip(case, seed):
    s = _build(case)
    rng = random.Random(seed)
    cost = lambda op: rng.random() * 1e-2  # noqa: E731 - arbitrary floats: the round trip must be exact
    a = simulate(s, cost, rank=0, meta=[("case", "a")])
    b = simulate(s, cost, rank=3)
    tl = Timeline(a.spans + b.spans, a.meta)
    trace = json.loads(json.dumps(to_chrome_trace(tl)))
    assert from_chrome_trace(trace) == tl
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 3} and {e["tid"] for e in xs} <= {0, 1, 2}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert all(names[(e["pid"], e["tid"])] == e["cat"] for e in xs)
    assert all(e["ts"] == pytest.approx(e["args"]["start_s"] * 1e6) for e in xs)


def test_foreign_chrome_trace_is_read_from_ts_and_dur():
    trace = {
        "traceEvents": [
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "compute"}},
            {"ph": "X", "name": "C k0 b0@s0 r0", "pid": 1, "tid": 7, "ts": 1500.0, "dur": 250.0},
        ]
    }
    tl = from_chrome_trace(trace)
    assert tl.spans == (Span("C k0 b0@s0 r0", "compute", 1.5e-3, 1.75e-3, 1),)
    with pytest.raises(ValueError, match="traceEvents"):
        from_chrome_trace({"events": []})
    with pytest.raises(ValueError, match="event 0 lacks field 'dur'"):
        from_chrome_trace({"traceEvents": [{"ph": "X", "name": "x", "pid": 0, "tid": 0, "ts": 1.0}]})


def test_bandwidth_durations():
    d = bandwidth_durations(
        2,
        h2d_bytes=(100.0, 200.0),
        allgather_bytes=400.0,
        compute_s=(1.0, 2.0),
        h2d_bytes_per_s=100.0,
        allgather_bytes_per_s=200.0,
        launch_latency_s=0.5,
    )
    s = build_schedule(2, 1)
    got = {str(op): d(op) for op in s.ops}
    assert got == {
        "H2D k0 b0>l0": 1.5,
        "AG k0 b0 l0>s0": 2.5,
        "H2D k1 b1>l1": 2.5,
        "AG k1 b1 l1>s1": 2.5,
        "C k0 b0@s0 r0": 1.5,
        "C k1 b1@s1 r0": 2.5,
    }
    with pytest.raises(ValueError, match="h2d_bytes has 3 entries"):
        bandwidth_durations(
            2, h2d_bytes=(1, 2, 3), allgather_bytes=0, compute_s=0, h2d_bytes_per_s=1, allgather_bytes_per_s=1
        )
    with pytest.raises(ValueError, match="bandwidths"):
        bandwidth_durations(2, h2d_bytes=1, allgather_bytes=0, compute_s=0, h2d_bytes_per_s=0, allgather_bytes_per_s=1)


def _h200_pass(workload, num_slots=2, mode="rank-local"):
    s = build_schedule(REF_PASS_NUM_BLOCKS, 1, num_slots=num_slots, mode=mode)
    return simulate(s, h200_durations(REF_PASS_NUM_BLOCKS, workload, mode=mode))


@pytest.mark.parametrize("workload", [IMAGE_1024_CFG, VIDEO_832X480X29_CFG])
def test_h200_prediction_matches_the_measured_double_buffer(workload):
    # The measured "minimal two-slot double buffer" is a rank-local schedule with two slots on one GPU.
    ideal = H200_PASS[(workload.name, "ideal")].seconds
    measured = ideal * H200_PASS[(workload.name, "double buffer")].ratio_to_ideal
    predicted = _h200_pass(workload).makespan_s
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


def test_h200_video_is_compute_bound_and_image_is_pcie_bound():
    h2d_s = REF_BLOCK_BYTES / H200_PINNED_H2D_BYTES_PER_S
    video = _h200_pass(VIDEO_832X480X29_CFG)
    image = _h200_pass(IMAGE_1024_CFG)
    # Video: only the first load is exposed. Image: the H2D stream never idles; only the last compute sticks out.
    assert video.exposed_transfer_s() == pytest.approx(h2d_s)
    video_c, image_c = H200_BLOCK_COMPUTE_S[VIDEO_832X480X29_CFG.name], H200_BLOCK_COMPUTE_S[IMAGE_1024_CFG.name]
    assert video.makespan_s == pytest.approx(h2d_s + REF_PASS_NUM_BLOCKS * video_c)
    assert image.makespan_s == pytest.approx(REF_PASS_NUM_BLOCKS * h2d_s + image_c)
    assert image.busy_s("h2d") == pytest.approx(REF_PASS_NUM_BLOCKS * h2d_s)


def test_h200_all_gather_needs_a_bandwidth_beyond_one_rank():
    with pytest.raises(ValueError, match="allgather_bus_bytes_per_s"):
        h200_durations(4, IMAGE_1024_CFG, world_size=2)
    d = h200_durations(4, IMAGE_1024_CFG, world_size=4, allgather_bus_bytes_per_s=1e11)
    ag = next(op for op in build_schedule(4, 1).ops if op.kind == AG)
    assert d(ag) == pytest.approx(0.75 * REF_BLOCK_BYTES / 1e11)


def test_h200_durations_need_a_measured_workload():
    with pytest.raises(ValueError, match="no measured H200 block compute for workload 'other'"):
        h200_durations(4, Workload("other", 4096))


def test_prefetch_next_hides_block_zero_at_run_boundaries():
    # Compute-bound waves chained on one ring. The next wave is only issued after the previous one's last
    # compute: cold waves then load block 0 while the device waits; with prefetch + warm start only the very
    # first load of the first wave is exposed.
    cost = _kind_cost(2.0, 1.0, 5.0)
    warm = [build_schedule(3, 2, prefetch_next=True)]
    for steps in (1, 3):
        warm.append(next_schedule(warm[-1], steps))
    cold = [build_schedule(3, t) for t in (2, 1, 3)]
    tl_warm, tl_cold = simulate_runs(warm, cost), simulate_runs(cold, cost)
    assert tl_warm.busy_s("compute") == tl_cold.busy_s("compute") == 18 * 5.0
    assert tl_warm.exposed_transfer_s() == 2.0 + 1.0
    assert tl_cold.exposed_transfer_s() == 3 * (2.0 + 1.0)
    assert (tl_warm.makespan_s, tl_cold.makespan_s) == (3.0 + 90.0, 9.0 + 90.0)
    rows = block_summary(tl_warm)
    assert [r.num_loads for r in rows] == [7, 6, 6]  # block 0 once more: the last run's prefetch
    assert rows[0].wait_s == 3.0 and rows[1].wait_s == rows[2].wait_s == 0.0
    # A host gap between waves is pure compute idle with nothing transferring in the warm chain.
    gapped = simulate_runs(warm, cost, boundary_s=4.0)
    assert gapped.makespan_s == 93.0 + 2 * 4.0 and gapped.exposed_transfer_s() == 3.0
