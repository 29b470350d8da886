"""Notebook 05's host tables (benchmarks.repro.host_cost_tables): the plan's count of stream operations per block
is what the executor issues (counted on the CPU), and the tables read the committed H200 JSON."""

from __future__ import annotations

import copy

from benchmarks.repro import host_cost_tables as hc


def test_the_plans_stream_ops_are_the_executors():
    from benchmarks.bench.hostloop import measure

    planned = hc.planned_stream_ops(hc.steady_schedule(24))
    assert planned == {"waits": 2.0, "copies": 1.0, "records": 2.0, "total": 5.0, "collectives": 0.0}
    assert measure(num_blocks=24, passes=6)["stream_ops_per_block"] == planned["total"]
    # The ring's first pass loads blocks 0 and 1 before the first compute and block 0 of the next pass during
    # its last block: 25 copies for 24 computes, each with its wait and record.
    from dlo_fn.plan.schedule import Ring

    cold = hc.planned_stream_ops(Ring.cold(24, num_slots=2, mode="rank-local").next_schedule(1))
    assert cold["copies"] == 25 / 24 and cold["total"] == 5 + 3 / 24


def test_load_groups_planned_ops_are_the_executors():
    # Groups of G on 2G slots: per group one wait, one (merged) copy and one record per stream, plus the run's
    # boundary (each slot's first use waits on the previous run); a run prefetches whole groups, so the copies are
    # one per group exactly.
    from benchmarks.bench.hostloop import measure

    rows = {r["load_group"]: r for r in hc.planned_rows(24, (1, 2, 4))}
    for g in (2, 4):
        planned = hc.planned_stream_ops(hc.steady_schedule(24, 2 * g, g))
        assert measure(num_blocks=24, passes=4, load_group=g)["stream_ops_per_block"] == planned["total"]
        assert planned["copies"] == (24 // g) / 24 and rows[g]["per_block"] == f"{planned['total']:.3f}"
    per_block = {g: float(rows[g]["per_block"]) for g in (2, 4)}
    assert 5 / 2 < per_block[2] < 3 and 5 / 4 < per_block[4] < per_block[2]


def test_tables_from_the_committed_runs():
    published = {r["part"]: r for r in hc.published_rows()}
    assert published["total"]["us_per_block"] == "2083"  # 150 ms / 72 blocks
    graphs = hc.graph_rows(hc.load("bench_step"))
    assert {(r["workload"], r["variant"]) for r in graphs} == {
        (w, v) for w in ("video", "image") for v in hc.GRAPH_VARIANTS.values()
    }
    assert all(r["equal_to_resident"] is True for r in graphs)
    bg = hc.block_graph_host_rows(*(hc.load(n) for n in hc.BENCH_REPORTS))
    assert [r["bench config"] for r in bg] == ["bench", "bench-small40"]
    groups = hc.graph_rows(hc.load("groups_bench_step"), hc.GROUP_VARIANTS)
    assert {r["variant"] for r in groups} == set(hc.GROUP_VARIANTS.values())
    assert all(r["equal_to_resident"] is True for r in groups)


def test_only_runs_of_the_runtime_as_it_is_give_the_torch_paths_host_cost():
    # bench step and bench-small40 ran on the issue loop (their rows count stream operations); the load groups' run
    # is older (its eager rows issued driver calls): only the first two give the torch path's host cost.
    reports = [hc.load(n) for n in hc.BENCH_REPORTS]
    assert [hc.is_current(r) for r in reports] == [True, True, False]
    rows = hc.torch_path_rows(*reports)
    assert rows and all(r["stream_ops_per_block"] for r in rows)
    old = copy.deepcopy(reports[0])
    for w in old["workloads"]:
        for r in w["variants"]:
            r.pop("stream_ops_per_block", None)
    assert hc.torch_path_rows(old) == []
    assert hc.summary(old)["ours, eager (torch streams and events), host per block"] == "no committed H200 run yet"
    s = hc.summary(*reports)
    eager = [float(r["executor_us_per_block"]) for r in rows]
    assert s["ours, eager (torch streams and events), host per block"] == f"{min(eager):.1f}-{max(eager):.1f} us"


def test_the_takeaway_is_computed_from_the_reports():
    bench = hc.load("bench_step")
    s = hc.summary(hc.load("bench_small40"), bench)
    bg = [
        r["proxy_host_us_per_block"]
        for rep in (hc.load("bench_small40"), bench)
        for n, r in rep["dispatch"]["variants"].items()
        if n == "dlo-rank-local-bgraph"
    ]
    assert s["ours, block graphs, host per block"] == f"{min(bg):.1f}-{max(bg):.1f} us"
    assert s["reference host work per block"] == "2083 us"
    assert set(s) >= {"block graphs, bench video", "block graphs, bench image", "block graphs, bench-small40 image"}
    assert s["stream operations per block, planned = counted"] == "5 (load groups of 4: 1.625)"


def test_the_policy_takes_load_groups_only_where_the_host_is_the_bound():
    # One H200's topology (48 us of host work per block at one load per block, 55 GB/s H2D), 20 us of compute per
    # block: the host bounds blocks whose H2D is shorter than its work, and there groups halve the step (groups of 4
    # bring the host's work to about the compute's: either may bound the grouped step).
    rows = {r["block_MB"]: r for r in hc.policy_rows()}
    assert rows["0.5"]["chosen"] == "S8 R1 G4" and rows["0.5"]["bound"] in ("host", "compute")
    assert float(rows["0.5"]["step_ms"]) < 0.6 * float(rows["0.5"]["one_load_per_block_ms"])
    for mb in ("3", "4", "8"):  # H2D >= the host's work: one load per block on two slots, the cheapest plan
        assert rows[mb]["chosen"] == "S2 R1" and rows[mb]["bound"] == "h2d"
        assert rows[mb]["step_ms"] == rows[mb]["one_load_per_block_ms"]
