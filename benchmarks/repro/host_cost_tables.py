"""Notebook 05's host-cost tables: the work per offloaded block, the reference's (published, Ascend) against ours.

* :func:`published_rows` - the reference's AllGather overhead per step (Nano DP4, 72 blocks) and per block;
* :func:`planned_stream_ops` / :func:`planned_rows` - the stream operations per block the executor issues for a
  schedule (pure: a wait per dependency, a record per event something waits on, a copy per H2D op, a load
  group's copies merged), over a steady run of the ring (from :mod:`dlo_fn.cost.host_cost`), per load group;
* :func:`is_current` / :func:`torch_path_rows` - the executor's host time and stream operations per block on a
  GPU, from the ``bench step`` reports written by the runtime as it is (their variant rows carry
  ``stream_ops_per_block``, which the executor counts since its one issue path through torch streams and events);
* :func:`graph_rows` - block graphs against eager and resident on the bench model (or, with ``GROUP_VARIANTS``,
  eager with and without load groups): ratio to the bound, host time per step, peak device memory, output equal
  to resident;
* :func:`block_graph_host_rows` - the executor's host time per block with block graphs (``bench step``'s dispatch
  rows, bench-narrow: the host is the bottleneck);
* :func:`policy_rows` - what the policy chooses, load groups on offer, for blocks of a given size and compute on
  the H200's topology (pure: the planner's prediction, no measurement);
* :func:`summary` - the takeaway, computed from the same reports.

Every measured number comes from the committed JSON under ``figures/data/`` (machine, command and date inside).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from benchmarks.repro.data import DATA_DIR
from benchmarks.repro.published import published
from dlo_fn.cost.host_cost import host_scale, planned_stream_ops, steady_schedule

__all__ = [
    "NANO_BLOCKS",
    "load",
    "published_rows",
    "planned_stream_ops",
    "steady_schedule",
    "planned_rows",
    "is_current",
    "torch_path_rows",
    "graph_rows",
    "block_graph_host_rows",
    "policy_rows",
    "summary",
    "GRAPH_VARIANTS",
    "GROUP_VARIANTS",
    "BENCH_REPORTS",
]

NANO_BLOCKS = 72  # the reference's Nano DiT: the 150 ms/step is over its 72 blocks
BENCH_REPORTS = ("bench_step", "bench_small40", "groups_bench_step")  # bench step's committed H200 runs


def load(name: str, data_dir: pathlib.Path = DATA_DIR) -> dict[str, Any]:
    """A committed JSON report (``bench_step``, ``bench_small40``, ``groups_bench_step``), for the H200."""
    return json.loads((pathlib.Path(data_dir) / f"{name}_nvidia-h200.json").read_text())


def published_rows() -> list[dict[str, object]]:
    rows = []
    for part in ("stream_switch", "python_dispatch", "hccl", "total"):
        p = published(f"perf.nano.allgather_overhead.{part}")
        rows.append({"part": part, "ms_per_step": f"{p.value:g}", "us_per_block": f"{1e3 * p.value / NANO_BLOCKS:.0f}"})
    return rows


def planned_rows(num_blocks: int = 24, load_groups: tuple[int, ...] = (1, 2, 4)) -> list[dict[str, object]]:
    """Per load group G on 2G slots: the stream operations per block of a steady pass over ``num_blocks``."""
    rows = []
    for g in load_groups:
        ops = planned_stream_ops(steady_schedule(num_blocks, num_slots=2 * g, load_group=g))
        rows.append(
            {
                "load_group": g,
                "slots": 2 * g,
                **{k: f"{ops[k]:.3f}" for k in ("waits", "copies", "records")},
                "per_block": f"{ops['total']:.3f}",
            }
        )
    return rows


def is_current(report: dict[str, Any]) -> bool:
    """Was ``report`` written by the runtime as it is? Its ``dlo-*`` rows then carry ``stream_ops_per_block``."""
    return any(
        "stream_ops_per_block" in r
        for w in report.get("workloads", ())
        for r in w["variants"]
        if r["variant"].startswith("dlo-")
    )


def torch_path_rows(*reports: dict[str, Any]) -> list[dict[str, object]]:
    """The executor's host time per block on the bench-narrow model (``bench step``'s dispatch rows: the host is
    the bottleneck) and its stream operations per block, per eager variant, from the reports :func:`is_current`
    accepts; [] when none is."""
    rows = []
    for report in (r for r in reports if is_current(r)):
        ops = {
            r["variant"]: r["stream_ops_per_block"]
            for w in report["workloads"]
            for r in w["variants"]
            if "stream_ops_per_block" in r
        }
        for name, r in report["dispatch"]["variants"].items():
            if name.startswith("dlo-") and "proxy_host_us_per_block" in r and "graph" not in name:
                rows.append(
                    {
                        "bench config": report["config"],
                        "variant": name,
                        "executor_us_per_block": f"{r['proxy_host_us_per_block']:.1f}",
                        "stream_ops_per_block": f"{ops[name]:.3f}" if name in ops else "-",
                    }
                )
    return rows


GRAPH_VARIANTS = {"resident": "resident", "dlo-rank-local-swap": "eager", "dlo-rank-local-bgraph": "block graphs"}
GROUP_VARIANTS = {
    "resident": "resident",
    "dlo-rank-local-swap": "eager",
    "dlo-rank-local-swap-g2": "load groups of 2",
    "dlo-rank-local-swap-g4": "load groups of 4",
}


def graph_rows(report: dict[str, Any], variants: dict[str, str] = GRAPH_VARIANTS) -> list[dict[str, object]]:
    rows = []
    for w in report["workloads"]:
        for r in w["variants"]:
            if r["variant"] not in variants:
                continue
            rows.append(
                {
                    "workload": w["name"],
                    "variant": variants[r["variant"]],
                    "step_ms": f"{1e3 * r['step_s']:.1f}",
                    "x_bound": f"{r['ratio_to_bound']:.3f}",
                    "host_ms_per_step": f"{1e3 * r['host_s']:.1f}",
                    "peak_GB": f"{r['peak_device_bytes'] / 1e9:.2f}",
                    "equal_to_resident": r.get("equal_to_resident", ""),
                }
            )
    return rows


def block_graph_host_rows(*reports: dict[str, Any]) -> list[dict[str, object]]:
    """Per report: the executor's host time per block with block graphs (dispatch rows, bench-narrow)."""
    rows = []
    for rep in reports:
        row = rep.get("dispatch", {}).get("variants", {}).get("dlo-rank-local-bgraph")
        if row is not None:
            rows.append(
                {
                    "bench config": rep["config"],
                    "variant": "block graphs",
                    "executor_us_per_block": f"{row['proxy_host_us_per_block']:.1f}",
                }
            )
    return rows


def policy_rows(
    block_mb: tuple[float, ...] = (0.5, 1, 2, 3, 4, 8), compute_us: float = 20.0, num_blocks: int = 72
) -> list[dict[str, object]]:
    """Per block size: the policy's choice among 2 / 4 / 8 slots and load groups of 1 / 2 / 4 (rank-local, one H200:
    ``repro.topologies`` ``1xH200``, its measured H2D rate and host work per block, the per-step and per-request
    work left out), for ``num_blocks`` blocks of ``compute_us`` each; beside it the best plan with one load per
    block. The host bounds the step only while a block's H2D takes less than the host's work per block."""
    import dataclasses

    from benchmarks.repro.topologies import topology
    from dlo_fn.cost.policy import plan
    from dlo_fn.cost.topology import BlockCompute, PolicyModel
    from dlo_fn.plan.sizes import ModelSizes
    from dlo_fn.plan.workload import Workload

    wl = Workload("small blocks", tokens=256, num_steps=4, cfg_branches=1)
    topo = dataclasses.replace(
        topology("1xH200"),
        compute=BlockCompute(table=((wl.tokens, 1, compute_us * 1e-6),)),
        step_overhead=(),
        request_overhead=(),
    )
    rows = []
    for mb in block_mb:
        model = PolicyModel(
            ModelSizes.uniform(f"{mb:g} MB blocks", round(num_blocks * mb * 10**6), num_blocks), hidden_dim=1024
        )
        chosen = plan(model, topo, wl, slots=(2, 4, 8), modes=("rank-local",), load_groups=(1, 2, 4)).chosen
        one = plan(model, topo, wl, slots=(2, 4, 8), modes=("rank-local",)).chosen
        c = chosen.candidate
        host_s = topo.host_s("rank-local") * host_scale(num_blocks, c.num_slots, c.load_group)
        rows.append(
            {
                "block_MB": f"{mb:g}",
                "h2d_us_per_block": f"{1e6 * mb * 10**6 / topo.h2d_bytes_per_s:.0f}",
                "host_us_per_block": f"{1e6 * host_s:.0f}",
                "chosen": chosen.candidate.label.removeprefix("DP1xSP1 rank-local "),
                "bound": chosen.bound,
                "step_ms": f"{1e3 * chosen.step_s:.2f}",
                "one_load_per_block_ms": f"{1e3 * one.step_s:.2f}",
            }
        )
    return rows


def summary(*reports: dict[str, Any]) -> dict[str, str]:
    """The notebook's takeaway, computed: the reference's host work per block; the stream operations per block
    the plan gives the executor at one load per block and in groups of 4; with block graphs, the executor's host
    time per block (range over the reports' dispatch rows), and per report and workload that ran both, their step
    time against eager's and what they add in peak device memory; and the torch path's host time per block where a
    report of the runtime as it is measured it."""
    reference_us = 1e3 * published("perf.nano.allgather_overhead.total").value / NANO_BLOCKS
    ops = {g: planned_stream_ops(steady_schedule(24, num_slots=2 * g, load_group=g))["total"] for g in (1, 4)}
    out = {
        "reference host work per block": f"{reference_us:.0f} us",
        "stream operations per block, planned = counted": f"{ops[1]:g} (load groups of 4: {ops[4]:g})",
    }
    bg = [float(r["executor_us_per_block"]) for r in block_graph_host_rows(*reports)]
    if bg:
        out["ours, block graphs, host per block"] = f"{min(bg):.1f}-{max(bg):.1f} us"
    torch_path = [float(r["executor_us_per_block"]) for r in torch_path_rows(*reports)]
    out["ours, eager (torch streams and events), host per block"] = (
        f"{min(torch_path):.1f}-{max(torch_path):.1f} us" if torch_path else "no committed H200 run yet"
    )
    for rep in reports:
        for w in rep.get("workloads", ()):
            v = {r["variant"]: r for r in w["variants"]}
            if "dlo-rank-local-swap" not in v or "dlo-rank-local-bgraph" not in v:
                continue
            eager, bg_row = v["dlo-rank-local-swap"], v["dlo-rank-local-bgraph"]
            extra_gb = (bg_row["peak_device_bytes"] - eager["peak_device_bytes"]) / 1e9
            out[f"block graphs, {rep['config']} {w['name']}"] = (
                f"{bg_row['ratio_to_bound']:.3f}x bound (eager {eager['ratio_to_bound']:.3f}x), +{extra_gb:.2f} GB peak"
            )
    return out
