"""Notebook 11's tables: the host's work per offloaded block, the reference's (published, Ascend) against ours
(one H200), and where ours goes.

* :func:`published_rows` - the reference's AllGather overhead per step (Nano DP4, 72 blocks) and per block;
* :func:`planned_stream_ops` - the driver calls per block the eager loop makes for a schedule (pure: a wait per
  dependency, a record per op, a copy per H2D op), over a steady run of the ring (from :mod:`dlo_fn.plan.host_cost`);
* :func:`driver_rows` - per driver call kind, its cost on the H200: inside the pass (each compute's record sent
  with the next block's calls, and right after the block), back to back, and one call right after a block
  forward; with the stream memory operations measured beside them;
* :func:`executor_rows` - the executor's own host time per block and the whole pass's over resident, per variant
  (``bench step``'s dispatch rows), in the runs committed;
* :func:`ab_rows` - the executor's host time per block in alternating processes of two trees (load groups of
  1 / 2 / 4 and the modes side by side, median and every round);
* :func:`graph_rows` - eager, block graphs and the step graph on the bench model (or, with ``GROUP_VARIANTS``,
  eager with and without load groups): ratio to the bound, host time per step, peak device memory;
* :func:`policy_rows` - what the policy chooses, load groups on offer, for blocks of a given size and compute on
  the H200's measured topology (pure: the planner's prediction, no measurement);
* :func:`allgather_rows` / :func:`allgather_reading` - allgather mode with the all-gather a collective
  (``bench.allgather_host``): the executor's host time per block, the collective calls' share and its own, on one
  NCCL rank with the allgather op sequence kept (through c10d's calls and the executor's own communicator) and
  on two gloo ranks sharing the GPU, per run;
* :func:`summary` - the takeaway, computed from the same reports.

Every number comes from the committed JSON under ``figures/data/`` (machine, command and date inside).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from dlo_fn.plan.host_cost import host_scale, planned_stream_ops, steady_schedule
from dlo_fn.repro.data import DATA_DIR
from dlo_fn.repro.published import published

__all__ = ["NANO_BLOCKS", "load", "published_rows", "planned_stream_ops", "steady_schedule", "driver_rows",
           "executor_rows", "ab_rows", "policy_rows", "graph_rows", "GRAPH_VARIANTS", "GROUP_VARIANTS", "summary",
           "allgather_rows", "allgather_reading"]

NANO_BLOCKS = 72  # the reference's Nano DiT: the 150 ms/step is over its 72 blocks


def load(name: str, data_dir: pathlib.Path = DATA_DIR) -> dict[str, Any]:
    """A committed JSON report (``driver_cost``, ``bench_step``, ``bench_small40``), for the H200."""
    return json.loads((pathlib.Path(data_dir) / f"{name}_nvidia-h200.json").read_text())


def published_rows() -> list[dict[str, object]]:
    rows = []
    for part in ("stream_switch", "python_dispatch", "hccl", "total"):
        p = published(f"perf.nano.allgather_overhead.{part}")
        rows.append({"part": part, "ms_per_step": f"{p.value:g}", "us_per_block": f"{1e3 * p.value / NANO_BLOCKS:.0f}"})
    return rows


def driver_rows(report: dict[str, Any]) -> list[dict[str, object]]:
    deferred, immediate = report["in_pass_us"], report["record_after_block_call"]["in_pass_us"]
    outside = report["outside"]
    names = {"cuEventRecord": ("cuEventRecord", "cuEventRecord"), "cuStreamWaitEvent": ("cuStreamWaitEvent",) * 2,
             "cuMemcpyHtoDAsync_v2": ("cuMemcpyHtoDAsync registered block", "cuMemcpyHtoDAsync 256 B")}
    rows = []
    for call, (after, tight) in names.items():
        rows.append({"call": call, "per_block": f"{report['calls_per_block'][call]:.2f}",
                     "in_pass_us": f"{deferred[call]:.1f}", "in_pass_us_record_after_block": f"{immediate[call]:.1f}",
                     "after_a_block_us": f"{outside[after]['after_block_us_median']:.1f}",
                     "back_to_back_us": f"{outside[tight]['tight_us']:.1f}"})
    for call in ("cuMemcpyAsync registered block", "cuStreamWriteValue64_v2", "cuStreamWaitValue64_v2",
                 "cuStreamBatchMemOp_v2 2 ops", "cuStreamBatchMemOp 1 op"):
        o = outside.get(call, {})
        rows.append({"call": call, "per_block": "-", "in_pass_us": "-", "in_pass_us_record_after_block": "-",
                     "after_a_block_us": (f"{o['after_block_us_median']:.1f}" if "after_block_us_median" in o
                                          else f"error {o.get('error', '?')}"),
                     "back_to_back_us": f"{o['tight_us']:.1f}" if "tight_us" in o else "-"})
    rows.append({"call": "all, per block", "per_block": f"{sum(report['calls_per_block'].values()):.2f}",
                 "in_pass_us": f"{report['driver_us_per_block']:.1f}",
                 "in_pass_us_record_after_block": f"{report['record_after_block_call']['driver_us_per_block']:.1f}",
                 "after_a_block_us": "", "back_to_back_us": ""})
    return rows


def executor_rows(*reports: dict[str, Any]) -> list[dict[str, object]]:
    """One row per variant of each report's dispatch measurement (bench-narrow: the host is the bottleneck)."""
    rows = []
    for report in reports:
        d = report["dispatch"]
        run = f"{report['config']} {report['date'][11:16]} UTC"
        for name, r in d["variants"].items():
            rows.append({"run": run, "variant": name,
                         "executor_us_per_block": f"{r['proxy_host_us_per_block']:.1f}"
                         if "proxy_host_us_per_block" in r else "-",
                         "pass_over_resident_us_per_block": f"{r['dispatch_us_per_block']:.0f}"})
    return rows


def ab_rows(report: dict[str, Any]) -> list[dict[str, object]]:
    """Per variant: the median of each tree's rounds and every round in run order (``hostcost_ab``)."""
    trees = list(report["median_proxy_host_us_per_block"])
    rows = []
    for name in report["rounds"][0]["proxy_host_us_per_block"]:
        row: dict[str, object] = {"variant": name}
        for t in trees:
            rounds = [r["proxy_host_us_per_block"][name] for r in report["rounds"] if r["tree"] == t]
            row[f"{t}_median_us"] = f"{report['median_proxy_host_us_per_block'][t][name]:.1f}"
            row[f"{t}_rounds_us"] = " / ".join(f"{v:.1f}" for v in rounds)
        rows.append(row)
    return rows


_AG_PARTS = {"nccl_one_rank": "1 NCCL rank", "gloo_two_ranks": "2 gloo ranks"}


def _ag_values(report: dict[str, Any], part: str, variant: str, key: str) -> list[float]:
    return [run[part]["variants"][variant][key] for run in report["runs"]]


def allgather_rows(report: dict[str, Any]) -> list[dict[str, object]]:
    """Per set-up and variant: the executor's host time per block, the part inside the collective calls and its
    own (us, every run in order) and whether every output equalled resident (``allgather_host``)."""
    rows = []
    for part, label in _AG_PARTS.items():
        for variant in report["runs"][0][part]["variants"]:
            row: dict[str, object] = {"set_up": label, "variant": variant}
            for key, name in (("proxy_host_us_per_block", "executor_us"),
                              ("collective_call_us_per_block", "in_collective_us"),
                              ("executor_own_us_per_block", "own_us")):
                row[name] = " / ".join(f"{v:.1f}" for v in _ag_values(report, part, variant, key))
            row["equal"] = all(run[part]["variants"][variant]["equal_to_resident"] for run in report["runs"])
            rows.append(row)
    return rows


def allgather_reading(report: dict[str, Any], target_us: float = 30.0) -> dict[str, str]:
    """The reading of :func:`allgather_rows`: on the NCCL rank, the executor's own part and the NCCL calls' per
    block at G = 4 against ``target_us``, the own communicator's at G = 4 (grouped and per-block shard layouts) and
    G = 8, and one NCCL call's host time back to back (ranges over the runs)."""
    def span(values: list[float]) -> str:
        return f"{min(values):.1f}-{max(values):.1f} us"

    def under(values: list[float]) -> str:
        return f"{'under' if max(values) < target_us else 'not under'} {target_us:.0f} us in every run"

    def calls(name: str) -> list[float]:
        return [run["nccl_one_rank"]["calls"]["host_us_per_call"][name] for run in report["runs"]]

    own = _ag_values(report, "nccl_one_rank", "driver-g4", "executor_own_us_per_block")
    coll = _ag_values(report, "nccl_one_rank", "driver-g4", "collective_call_us_per_block")
    total = _ag_values(report, "nccl_one_rank", "own-g4", "proxy_host_us_per_block")  # the own communicator
    own_coll = _ag_values(report, "nccl_one_rank", "own-g4", "collective_call_us_per_block")
    per_block = _ag_values(report, "nccl_one_rank", "own-g4-perblock", "proxy_host_us_per_block")
    g8 = _ag_values(report, "nccl_one_rank", "own-g8", "proxy_host_us_per_block")
    return {"own part at G = 4": f"{span(own)} per block ({under(own)})",
            "NCCL calls at G = 4": f"{span(coll)} per block (one call per 4 blocks)",
            "one NCCL call, back to back": f"{span(calls('bound_call_G1'))} (coalesced over 4 blocks: "
                                           f"{span(calls('bound_call_G4'))})",
            "own communicator, G = 4": f"{span(total)} per block ({under(total)}), of which NCCL calls "
                                       f"{span(own_coll)} (the grouped shard layout: one all-gather per group)",
            "own communicator, G = 4, per-block layout": f"{span(per_block)} per block (four all-gathers per group, "
                                                         f"in one launch)",
            "own communicator, G = 8": f"{span(g8)} per block ({under(g8)})",
            "one ncclAllGather, back to back": f"{span(calls('own_call_G1'))} (4 in one group launch: "
                                               f"{span(calls('own_call_G4'))})",
            "runs": ", ".join(run["date"] for run in report["runs"])}


def policy_rows(block_mb: tuple[float, ...] = (0.5, 1, 2, 3, 4, 8), compute_us: float = 20.0,
                num_blocks: int = 72) -> list[dict[str, object]]:
    """Per block size: the policy's choice among 2 / 4 / 8 slots and load groups of 1 / 2 / 4 (rank-local, one H200:
    ``repro.topologies`` ``1xH200``, its measured H2D rate and host work per block, the per-step and per-request
    work left out), for ``num_blocks`` blocks of ``compute_us`` each; beside it the best plan with one load per
    block. The host bounds the step only while a block's H2D takes less than the host's work per block."""
    import dataclasses

    from dlo_fn.plan.policy import plan
    from dlo_fn.plan.sizes import ModelSizes
    from dlo_fn.plan.topology import BlockCompute, PolicyModel
    from dlo_fn.plan.workload import Workload
    from dlo_fn.repro.topologies import topology

    wl = Workload("small blocks", tokens=256, num_steps=4, cfg_branches=1)
    topo = dataclasses.replace(topology("1xH200"), compute=BlockCompute(table=((wl.tokens, 1, compute_us * 1e-6),)),
                               step_overhead=(), request_overhead=())
    rows = []
    for mb in block_mb:
        model = PolicyModel(ModelSizes.uniform(f"{mb:g} MB blocks", round(num_blocks * mb * 10**6), num_blocks),
                            hidden_dim=1024)
        chosen = plan(model, topo, wl, slots=(2, 4, 8), modes=("rank-local",), load_groups=(1, 2, 4)).chosen
        one = plan(model, topo, wl, slots=(2, 4, 8), modes=("rank-local",)).chosen
        c = chosen.candidate
        host_s = topo.host_s("rank-local") * host_scale(num_blocks, c.num_slots, c.load_group)
        rows.append({"block_MB": f"{mb:g}", "h2d_us_per_block": f"{1e6 * mb * 10**6 / topo.h2d_bytes_per_s:.0f}",
                     "host_us_per_block": f"{1e6 * host_s:.0f}",
                     "chosen": chosen.candidate.label.removeprefix("DP1xSP1 rank-local "), "bound": chosen.bound,
                     "step_ms": f"{1e3 * chosen.step_s:.2f}", "one_load_per_block_ms": f"{1e3 * one.step_s:.2f}"})
    return rows


GRAPH_VARIANTS = {"dlo-rank-local-swap": "eager (swap)", "dlo-rank-local-bgraph": "block graphs",
                  "dlo-rank-local-graph": "step graph", "resident": "resident"}
GROUP_VARIANTS = {"resident": "resident", "dlo-rank-local-swap": "eager (swap)",
                  "dlo-rank-local-swap-g2": "swap, load groups of 2",
                  "dlo-rank-local-swap-g4": "swap, load groups of 4",
                  "dlo-rank-local": "eager (functional_call)", "dlo-rank-local-g2": "functional_call, groups of 2"}


def graph_rows(report: dict[str, Any], variants: dict[str, str] = GRAPH_VARIANTS) -> list[dict[str, object]]:
    rows = []
    for w in report["workloads"]:
        for r in w["variants"]:
            if r["variant"] not in variants:
                continue
            rows.append({"workload": w["name"], "variant": variants[r["variant"]],
                         "step_ms": f"{1e3 * r['step_s']:.1f}", "x_bound": f"{r['ratio_to_bound']:.3f}",
                         "host_ms_per_step": f"{1e3 * r['host_s']:.1f}",
                         "peak_GB": f"{r['peak_device_bytes'] / 1e9:.2f}",
                         "equal_to_resident": r.get("equal_to_resident", "")})
    return rows


def summary(driver: dict[str, Any], *reports: dict[str, Any], ab: dict[str, Any] | None = None,
            allgather: dict[str, Any] | None = None) -> dict[str, str]:
    """The notebook's takeaway, computed: the executor's cost per block eager (with load groups too, where a run
    measured them) and with block graphs (range over the runs' dispatch rows; with ``ab``, a ``hostcost_ab``
    report, also the load groups' range over its processes), the driver's share, what block graphs add in
    device memory and step time on the bench model (the last report with workloads that has both variants) and,
    with ``allgather`` (an ``allgather_host`` report), the allgather program's cost over NCCL at one load per
    block and in groups of 4, with the NCCL calls' part."""
    def us(names: tuple[str, ...]) -> str:
        vals = [r["proxy_host_us_per_block"] for rep in reports for n, r in rep["dispatch"]["variants"].items()
                if n in names]
        return f"{min(vals):.1f}-{max(vals):.1f} us"

    reference_us = 1e3 * published("perf.nano.allgather_overhead.total").value / NANO_BLOCKS
    out = {"reference host work per block": f"{reference_us:.0f} us",
           "ours, eager": us(("dlo-rank-local", "dlo-rank-local-swap")),
           "ours, block graphs": us(("dlo-rank-local-bgraph",)),
           "of which driver calls, eager": f"{driver['driver_us_per_block']:.1f} us"}
    for g in (2, 4):  # load groups, in the reports that measured them (bench step's -g<G> variants)
        name = f"dlo-rank-local-swap-g{g}"
        if any(name in rep["dispatch"]["variants"] for rep in reports):
            out[f"ours, eager, load groups of {g}"] = us((name,))
        if ab is not None and name in ab["rounds"][0]["proxy_host_us_per_block"]:
            vals = [r["proxy_host_us_per_block"][name] for r in ab["rounds"]]
            out[f"ours, eager, load groups of {g}, {len(vals)} processes"] = f"{min(vals):.1f}-{max(vals):.1f} us"
    if allgather is not None:
        for variant, label in (("driver", "one load per block"), ("driver-g4", "load groups of 4"),
                               ("own", "own communicator, one load per block"),
                               ("own-g4", "own communicator, load groups of 4"),
                               ("own-g4-perblock", "own communicator, load groups of 4, per-block layout")):
            total = _ag_values(allgather, "nccl_one_rank", variant, "proxy_host_us_per_block")
            coll = _ag_values(allgather, "nccl_one_rank", variant, "collective_call_us_per_block")
            out[f"ours, allgather program over NCCL (one rank), {label}"] = (
                f"{min(total):.1f}-{max(total):.1f} us, of which NCCL calls {min(coll):.1f}-{max(coll):.1f} us")
    for w in reports[-1]["workloads"]:
        v = {r["variant"]: r for r in w["variants"]}
        eager, bg = v["dlo-rank-local-swap"], v["dlo-rank-local-bgraph"]
        extra_gb = (bg["peak_device_bytes"] - eager["peak_device_bytes"]) / 1e9
        out[f"block graphs, {w['name']}"] = (f"{bg['ratio_to_bound']:.3f}x bound (eager "
                                             f"{eager['ratio_to_bound']:.3f}x), +{extra_gb:.2f} GB peak")
    return out
