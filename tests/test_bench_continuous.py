"""bench continuous: the trace it serves, its scores, the lockstep loss and the planner it is compared with; the
committed run and the notebook's tables read from it."""

from __future__ import annotations

import pytest

from benchmarks.bench.continuous import FIELDS, SIZES, STEPS, lockstep_loss, planned, scores, trace
from benchmarks.repro import continuous_tables as ct
from dlo_fn.serve.requests import RequestResult


def test_trace_mixes_sizes_steps_and_cfg_and_arrives_over_time():
    subs, arrivals, gaps = trace(16, 0.15, 0)
    reqs = [s.request for s in subs]
    assert len(reqs) == 16 and len({s.request_id for s in subs}) == 16
    assert {(r.height, r.width, r.num_frames) for r in reqs} == set(SIZES)
    assert {r.num_inference_steps for r in reqs} == set(STEPS) and {r.cfg for r in reqs} == {True, False}
    assert arrivals[0] == 0.0 and list(arrivals) == sorted(arrivals) and arrivals[-1] > 1.0
    assert trace(16, 0.15, 0) == (subs, arrivals, gaps)  # fixed by the seed
    assert trace(16, 0.15, 1)[1] != arrivals


def _res(i, arrival_s, latency_s):
    return RequestResult(i, f"r{i}", None, True, timings={"arrival_s": arrival_s, "latency_s": latency_s})


def test_scores_are_nearest_rank_on_finish_minus_nominal_arrival():
    results = [_res(0, 0.0, 1.0), _res(1, 0.5, 2.0), _res(2, 1.0, 0.5), _res(3, 1.0, 4.0)]
    s = scores(results, [0.0, 0.5, 1.0, 1.0])  # latencies 1, 2, 0.5, 4; finishes 1, 2.5, 1.5, 5
    assert s["makespan_s"] == 5.0 and s["throughput_requests_per_s"] == 0.8
    assert (s["p50_latency_s"], s["p95_latency_s"]) == (1.0, 4.0)  # x_(2), x_(4) of 0.5, 1, 2, 4


def test_lockstep_loss_counts_computing_ranks_only():
    # B = 2: step 1 s, ranks computed 1.0 and 0.2 s -> losses (0 + 0.8) / 2 per pass; lockstep part the same
    # minus nothing (no overhead); step 2: only rank 0 computes 0.5 of 0.6 s.
    loss = lockstep_loss([(1.0, (1.0, 0.2), (True, True)), (0.6, (0.5, 0.0), (True, False))], 2)
    assert loss["samples"] == 3
    assert loss["loss_per_pass_s"] == pytest.approx((0.0 + 0.4 + 0.05) / 3)
    assert loss["lockstep_part_per_pass_s"] == pytest.approx((0.0 + 0.4 + 0.0) / 3)


def test_planned_policies_use_the_engine_keys():
    subs, arrivals, _ = trace(16, 0.15, 0)
    costs = {(h, w, f, cfg): 0.01 * h / 32 for h, w, f in SIZES for cfg in (True, False)}
    cont, strict = (planned(subs, arrivals, costs, 0.02, 4, p) for p in ("continuous", "strict"))
    assert len(cont.records) == len(strict.records) == 16
    assert cont.policy == "continuous" and strict.policy == "strict"
    assert all(u.num_waiting_passes == 0 for u in cont.usage)


def test_committed_run_and_notebook_tables():
    detail = ct.load()
    assert {"machine", "command", "date"} <= set(detail) and detail["command"].startswith(
        ("python -m benchmarks bench", "python -m dlo_fn bench")
    )
    policies = [r["policy"] for r in ct.policy_rows(detail)]
    assert policies == ["continuous", "continuous-cost", "strict", "independent rank-local"]
    assert all(r["all_ok"] for r in detail["rows"]) and len(detail["trace"]) >= 16
    assert set(FIELDS) >= {"p50_latency_s", "p95_latency_s", "planned_p50_latency_s"}
    assert [r[""] for r in ct.loss_rows(detail)] == ["measured", "planned"]
    assert ct.timeline_lines(detail, "measured", 1)[0].startswith("s0 ")
    rows = ct.scenario_rows()
    by = {(r["trace"], r["policy"]): r["makespan_s"] for r in rows}
    mixed = "cheap (1) / expensive (8) alternating, all at 0"
    assert by[(mixed, "strict")] < by[(mixed, "continuous")]  # lockstep loss: strict wins
    spread = "one shape, steps 2 / 8, arriving every 1 s"
    assert by[(spread, "continuous")] < by[(spread, "strict")]  # arrivals over time: continuous wins
    sweep = ct.r_sweep_rows()
    assert [r["requests_per_rank"] for r in sweep] == ["1", "2", "4"] and all(
        r["identical_to_resident"] == "True" for r in sweep
    )
