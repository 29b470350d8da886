"""Notebook 11's tables (dlo_fn.repro.host_cost_tables): the plan's count of driver calls per block matches what
the executor issues (counted with the host driver), and the tables read the committed H200 JSON."""

from __future__ import annotations

from dlo_fn.repro import host_cost_tables as hc


def test_the_plans_driver_calls_are_the_executors():
    from dlo_fn.bench.hostloop import measure

    planned = hc.planned_stream_ops(hc.steady_schedule(24))
    assert planned == {"waits": 2.0, "copies": 1.0, "records": 2.0, "total": 5.0, "collectives": 0.0}
    assert measure(num_blocks=24, passes=6)["stream_ops_per_block"] == planned["total"]
    # The ring's first pass loads blocks 0 and 1 before the first compute and block 0 of the next pass during
    # its last block: 25 copies for 24 computes, each with its wait and record.
    from dlo_fn.plan.schedule import Ring

    cold = hc.planned_stream_ops(Ring.cold(24, num_slots=2, mode="rank-local").next_schedule(1))
    assert cold["copies"] == 25 / 24 and cold["total"] == 5 + 3 / 24


def test_load_groups_planned_calls_are_the_executors():
    # Groups of G on 2G slots: per group one wait, one (merged) copy and one record per stream, plus the run's
    # boundary (each slot's first use waits on the previous run); a run prefetches whole groups, so the copies are
    # one per group exactly.
    from dlo_fn.bench.hostloop import measure

    totals = {}
    for g in (2, 4):
        planned = hc.planned_stream_ops(hc.steady_schedule(24, 2 * g, g))
        assert measure(num_blocks=24, passes=4, load_group=g)["stream_ops_per_block"] == planned["total"]
        assert planned["copies"] == (24 // g) / 24
        totals[g] = planned["total"]
    assert 5 / 2 < totals[2] < 3 and 5 / 4 < totals[4] < totals[2]


def test_tables_from_the_committed_runs():
    published = {r["part"]: r for r in hc.published_rows()}
    assert published["total"]["us_per_block"] == "2083"  # 150 ms / 72 blocks
    dc = hc.load("driver_cost")
    rows = {r["call"]: r for r in hc.driver_rows(dc)}
    assert float(rows["all, per block"]["in_pass_us"]) < float(rows["all, per block"]["in_pass_us_record_after_block"])
    assert rows["cuStreamBatchMemOp 1 op"]["after_a_block_us"].startswith("error")
    ex = hc.executor_rows(hc.load("bench_small40"), hc.load("bench_step"))
    assert {r["variant"] for r in ex} >= {"dlo-rank-local-swap", "dlo-rank-local-bgraph", "dlo-rank-local-graph"}
    graphs = hc.graph_rows(hc.load("bench_step"))
    assert {(r["workload"], r["variant"]) for r in graphs} >= {("image", "block graphs"), ("video", "step graph")}
    assert all(r["equal_to_resident"] is True for r in graphs)


def test_the_takeaway_is_computed_from_the_reports():
    bench = hc.load("bench_step")
    s = hc.summary(hc.load("driver_cost"), hc.load("bench_small40"), bench)
    eager = [r["proxy_host_us_per_block"] for rep in (hc.load("bench_small40"), bench)
             for n, r in rep["dispatch"]["variants"].items() if n in ("dlo-rank-local", "dlo-rank-local-swap")]
    assert s["ours, eager"] == f"{min(eager):.1f}-{max(eager):.1f} us"
    assert s["reference host work per block"] == "2083 us" and set(s) >= {"block graphs, video", "block graphs, image"}


def test_the_takeaway_gives_load_groups_where_a_run_measured_them():
    import copy

    small40 = copy.deepcopy(hc.load("bench_small40"))
    for g in (2, 4):
        small40["dispatch"]["variants"].pop(f"dlo-rank-local-swap-g{g}")
    assert not any("load groups" in k for k in hc.summary(hc.load("driver_cost"), small40, hc.load("bench_step")))
    small40["dispatch"]["variants"]["dlo-rank-local-swap-g2"] = {"proxy_host_us_per_block": 21.25}
    s = hc.summary(hc.load("driver_cost"), small40, hc.load("bench_step"))
    assert s["ours, eager, load groups of 2"] == "21.2-21.2 us" and "ours, eager, load groups of 4" not in s


def test_load_group_tables_from_the_committed_runs():
    # The H200 runs with load groups: the A/B of two trees in alternating processes, and the bench model's step
    # time with and without groups (every output byte-identical to resident).
    ab = hc.load("hostcost_ab")
    rows = {r["variant"]: r for r in hc.ab_rows(ab)}
    assert set(rows) >= {"dlo-rank-local-swap", "dlo-rank-local-swap-g2", "dlo-rank-local-swap-g4"}
    for tree in ("base", "new"):
        assert len(rows["dlo-rank-local-swap"][f"{tree}_rounds_us"].split(" / ")) == 3
        # four loads share five calls: the cheapest eager loop in each tree
        assert float(rows["dlo-rank-local-swap-g4"][f"{tree}_median_us"]) < float(
            rows["dlo-rank-local-swap"][f"{tree}_median_us"])
    s = hc.summary(hc.load("driver_cost"), hc.load("groups_bench_step"), hc.load("bench_step"), ab=ab)
    g4 = [r["proxy_host_us_per_block"]["dlo-rank-local-swap-g4"] for r in ab["rounds"]]
    assert s["ours, eager, load groups of 4, 6 processes"] == f"{min(g4):.1f}-{max(g4):.1f} us"
    groups = hc.graph_rows(hc.load("groups_bench_step"), hc.GROUP_VARIANTS)
    assert {r["variant"] for r in groups} == set(hc.GROUP_VARIANTS.values())
    assert all(r["equal_to_resident"] is True for r in groups)


def ag_col(report, variant):
    return [r["nccl_one_rank"]["variants"][variant]["collective_call_us_per_block"] for r in report["runs"]]


def test_allgather_tables_from_the_committed_runs():
    # bench.allgather_host's two runs: every variant of both set-ups, every output equal to resident, two runs per
    # row; the driver path and load groups cut the executor's own part
    ag = hc.load("allgather_host")
    rows = {(r["set_up"], r["variant"]): r for r in hc.allgather_rows(ag)}
    own_variants = ("own", "own-g2", "own-g4", "own-g8", "own-g4-perblock")
    assert {v for _, v in rows} == {"torch-events", "driver", "driver-g2", "driver-g4", "graph", *own_variants}
    assert all(("2 gloo ranks", v) not in rows for v in ("graph", *own_variants))
    assert all(r["equal"] is True for r in rows.values())
    assert all(len(r[k].split(" / ")) == 2 for r in rows.values() for k in ("executor_us", "in_collective_us"))
    for part in ("1 NCCL rank", "2 gloo ranks"):
        own = {v: max(float(x) for x in rows[part, v]["own_us"].split(" / ")) for v in
               ("torch-events", "driver", "driver-g2", "driver-g4")}
        assert own["driver-g4"] < own["driver-g2"] < own["driver"] < own["torch-events"], own
    for g in ("", "-g2", "-g4"):  # the own communicator's NCCL calls cost less than c10d's, in every run
        c10d, own = (ag_col(ag, v) for v in (f"driver{g}", f"own{g}"))
        assert all(o < c for o, c in zip(own, c10d)), (g, own, c10d)
    reading = hc.allgather_reading(ag)
    total_own4 = [r["nccl_one_rank"]["variants"]["own-g4"]["proxy_host_us_per_block"] for r in ag["runs"]]
    assert reading["own communicator, G = 4"].startswith(f"{min(total_own4):.1f}-{max(total_own4):.1f} us per block")
    assert ("not under" in reading["own communicator, G = 4"]) is (max(total_own4) >= 30)
    # the grouped shard layout (one all-gather per group) against the per-block one (four), in every run
    per_block = [r["nccl_one_rank"]["variants"]["own-g4-perblock"]["proxy_host_us_per_block"] for r in ag["runs"]]
    assert all(g < p for g, p in zip(total_own4, per_block)), (total_own4, per_block)
    assert [r["nccl_one_rank"]["variants"][v]["layout_load_group"] for r in ag["runs"]
            for v in ("own-g4", "own-g4-perblock")] == [4, 1, 4, 1]
    own4 = [r["nccl_one_rank"]["variants"]["driver-g4"]["executor_own_us_per_block"] for r in ag["runs"]]
    assert reading["own part at G = 4"].startswith(f"{min(own4):.1f}-{max(own4):.1f} us per block")
    assert ("not under" in reading["own part at G = 4"]) is (max(own4) >= 30)
    s = hc.summary(hc.load("driver_cost"), hc.load("bench_small40"), hc.load("bench_step"), allgather=ag)
    total4 = [float(x) for x in rows["1 NCCL rank", "driver-g4"]["executor_us"].split(" / ")]
    assert s["ours, allgather program over NCCL (one rank), load groups of 4"].startswith(
        f"{min(total4):.1f}-{max(total4):.1f} us, of which NCCL calls")


def test_the_policy_takes_load_groups_only_where_the_host_is_the_bound():
    # One H200's topology (48 us of host work per block at one load per block, 55 GB/s H2D), 20 us of compute per
    # block: the host bounds blocks whose H2D is shorter than its work, and there groups halve the step.
    rows = {r["block_MB"]: r for r in hc.policy_rows()}
    assert rows["0.5"]["chosen"] == "S8 R1 G4" and rows["0.5"]["bound"] == "host"
    assert float(rows["0.5"]["step_ms"]) < 0.6 * float(rows["0.5"]["one_load_per_block_ms"])
    for mb in ("3", "4", "8"):  # H2D >= the host's work: one load per block on two slots, the cheapest plan
        assert rows[mb]["chosen"] == "S2 R1" and rows[mb]["bound"] == "h2d"
        assert rows[mb]["step_ms"] == rows[mb]["one_load_per_block_ms"]
