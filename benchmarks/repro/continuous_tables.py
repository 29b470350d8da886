"""Notebook 10's tables: continuous vs strict serving, from the committed ``bench continuous`` run and the
planner (:mod:`dlo_fn.cost.dispatch`).

* :func:`policy_rows` - the measured trace (2 gloo CPU ranks): throughput, p50 / p95 latency per policy, next to
  the planner's prediction for the same nominal trace;
* :func:`loss_rows` - the lockstep loss per block pass, measured vs planned;
* :func:`timeline_lines` - the dispatch timeline of the continuous run, planned and measured, one line per ring
  step (``s3 0.41-0.52 r0:t03 r1:t01``);
* :func:`scenario_rows` - synthetic traces through :func:`~dlo_fn.cost.dispatch.compare_policies`: when
  continuous beats strict and when it does not;
* :func:`r_sweep_rows` - the one-device R sweep (H200), when committed.
"""

from __future__ import annotations

import csv
import json
import pathlib
from typing import Any

from benchmarks.repro.data import DATA_DIR
from dlo_fn.cost.dispatch import PassCosts, QueuedRequest, Replicas, compare_policies

__all__ = ["load", "policy_rows", "loss_rows", "timeline_lines", "scenario_rows", "r_sweep_rows", "SCENARIOS"]


def load(path: pathlib.Path | None = None) -> dict[str, Any]:
    return json.loads((path or DATA_DIR / "continuous_cpu.json").read_text())


def policy_rows(detail: dict[str, Any]) -> list[dict[str, object]]:
    keep = (
        "policy",
        "throughput_requests_per_s",
        "p50_latency_s",
        "p95_latency_s",
        "planned_p50_latency_s",
        "planned_p95_latency_s",
        "makespan_s",
        "planned_makespan_s",
    )
    return [{k: _fmt(r.get(k, "")) for k in keep} for r in detail["rows"]]


def loss_rows(detail: dict[str, Any]) -> list[dict[str, object]]:
    out = []
    for name in ("measured", "planned"):
        x = detail["lockstep_loss"][name]
        out.append(
            {
                "": name,
                "loss_per_pass_ms": _fmt(1e3 * x["loss_per_pass_s"]),
                "lockstep_part_per_pass_ms": _fmt(1e3 * x["lockstep_part_per_pass_s"]),
                "samples": x["samples"],
            }
        )
    return out


def timeline_lines(detail: dict[str, Any], which: str, limit: int | None = None) -> list[str]:
    """``which``: ``measured`` or ``planned`` steps of the continuous run, as one line per ring step."""
    lines = []
    for s in detail[f"{which}_steps"]:
        k = s.get("step", s.get("first_step"))
        n = s.get("num_steps", 1)
        span = f"s{k}" + (f"-{k + n - 1}" if n > 1 else "")
        cells = " ".join(f"r{r}:" + ("+".join(h) or "-") for r, h in enumerate(s["held"]))
        lines.append(f"{span:<7} {s['start_s']:6.2f}-{s['end_s']:6.2f} s  {cells}")
    return lines[:limit] if limit else lines


def _q(i: int, arrival_s: float, steps: int, key: str, cost: float) -> QueuedRequest:
    return QueuedRequest(f"q{i}", arrival_s, steps, key, cost)


SCENARIOS = {
    "one shape, one step count, all at 0": [_q(i, 0, 4, "a", 1.0) for i in range(8)],
    "one shape, steps 2 / 8, arriving every 1 s": [_q(i, float(i), (2, 8)[i % 2], "a", 1.0) for i in range(8)],
    "one shape, steps 2 / 8, all at 0": [_q(i, 0, (2, 8)[i % 2], "a", 1.0) for i in range(8)],
    "cheap (1) / expensive (8) alternating, all at 0": [_q(i, 0, 4, "ab"[i % 2], (1.0, 8.0)[i % 2]) for i in range(8)],
    "cheap / expensive in runs of 4, all at 0": [_q(i, 0, 4, "ab"[i // 4], (1.0, 8.0)[i // 4]) for i in range(8)],
}


def scenario_rows(
    costs: PassCosts = PassCosts.uniform(1, 0.5), replicas: Replicas = Replicas(2)
) -> list[dict[str, object]]:
    """Per scenario, one row per policy (continuous FIFO, continuous cost-aware, strict)."""
    out = []
    for name, reqs in SCENARIOS.items():
        for row in compare_policies(reqs, costs, replicas, admissions=("fifo", "cost")):
            out.append(
                {
                    "trace": name,
                    "policy": row["policy"],
                    "makespan_s": row["makespan_s"],
                    "p50_latency_s": row["p50_latency_s"],
                    "p95_latency_s": row["p95_latency_s"],
                    "utilisation": row["utilisation"],
                }
            )
    return out


def r_sweep_rows(path: pathlib.Path | None = None) -> list[dict[str, object]]:
    path = path or DATA_DIR / "continuous_r_sweep_h200.csv"
    if not path.is_file():
        return []
    keep = ("requests_per_rank", "per_output_step_s", "bound_s", "ratio_to_bound", "identical_to_resident")
    with path.open() as f:
        return [{k: r[k] for k in keep} for r in csv.DictReader(f)]


def _fmt(x: object) -> object:
    return float(f"{x:.4g}") if isinstance(x, float) else x
