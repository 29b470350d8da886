"""The tables of users' own models, FP8 shards and the runtime core's before/after, from committed H200 data.

* :func:`real_rows` - one forward of a diffusers model at its published config per variant (``bench real``):
  time against the bound, equality with its reference, time to ready against the host's floor, memory;
* :func:`fp8_rows` - FP8 shards against BF16 on the same model and machine: bytes moved, pinned and resident host
  bytes, forward time, and the output's error against the resident one where the run measured it;
* :func:`core_rows` - the runtime before its core was reduced (the driver-call issuer, step graphs) and after, each
  pair measured side by side in one device call: step time / bound of the default variant, and on FLUX.1-dev.
"""

from __future__ import annotations

import json
from typing import Any

from dlo_fn.repro.data import DATA_DIR

__all__ = ["REAL_FILE", "FP8_FILE", "CORE_FILE", "load", "real_rows", "fp8_rows", "core_rows"]

REAL_FILE = "bench_real_flux_nvidia-h200.json"
FP8_FILE = "fp8_bench_real_flux_nvidia-h200.json"
CORE_FILE = "core_before_after_nvidia-h200.json"
LABELS = {"resident": "resident", "ours-rank-local": "ours, 2 slots", "ours-fp8": "ours, FP8 shards",
          "ours-allgather": "ours, allgather (W = 1)", "ours-bgraph": "ours, block graphs",
          "ours-3-slots": "ours, 3 slots", "ours-auto": "ours, the policy's choice",
          "ours-fp8-auto": "ours, FP8 shards, the policy's choice",
          "diffusers-block": "diffusers group offloading, block_level + stream",
          "diffusers-leaf": "diffusers group offloading, leaf_level + stream", "ranks-2": "ours, 2 gloo ranks (allgather)"}


def load(name: str) -> dict[str, Any]:
    return json.loads((DATA_DIR / name).read_text())


def _model(report: dict) -> dict:
    return report.get("model", report)


def real_rows(name: str = REAL_FILE) -> list[dict[str, str]]:
    """Per variant that ran: forward time, / bound (FP8: / its own bound too), equal, ready, host and device bytes."""
    m = _model(load(name))
    rows = []
    for v in m["variants"]:
        if v.get("status") != "ok" or v["variant"] not in LABELS:
            continue
        own = v.get("ratio_to_own_bound")
        ratio = f"{v['ratio_to_bound']:.3f}x" if v.get("ratio_to_bound") else "-"
        if own and v["variant"].startswith("ours-fp8"):
            ratio += f" (own bound {own:.3f}x)"
        rows.append({"variant": LABELS[v["variant"]],
                     "forward ms": f"{1e3 * v['forward_s']:.1f}" if v.get("forward_s") else "-", "/ bound": ratio,
                     "equal": "-" if v["variant"] == "resident" else str(v.get("equal_to_resident")),
                     "ready s (/ floor)": (f"{v['ready_s']:.1f} ({v['ready_over_floor']:.2f})"
                                           if v.get("ready_over_floor") else "-"),
                     "host RSS GB": f"{v['host_rss_bytes'] / 1e9:.1f}" if v.get("host_rss_bytes") else "-",
                     "pinned GB": f"{v['pinned_bytes'] / 1e9:.1f}" if v.get("pinned_bytes") else "-"})
    return rows


def fp8_rows(name: str = FP8_FILE) -> list[dict[str, str]]:
    """BF16 and FP8 shards of one model in one run: bytes per forward, pinned and host bytes, forward time."""
    m = _model(load(name))
    by = {v["variant"]: v for v in m["variants"] if v.get("status") == "ok"}
    bf16, fp8 = by["ours-rank-local"], by["ours-fp8"]
    rows = []
    for what, key, scale in (("H2D bytes per forward, GB", "h2d_bytes_per_forward", 1e9),
                             ("pinned host bytes, GB", "pinned_bytes", 1e9), ("host RSS, GB", "host_rss_bytes", 1e9),
                             ("forward, ms", "forward_s", 1e-3)):
        rows.append({"": what, "BF16": f"{bf16[key] / scale:.2f}", "FP8": f"{fp8[key] / scale:.2f}",
                     "FP8 / BF16": f"{fp8[key] / bf16[key]:.3f}"})
    rows.append({"": "forward / BF16 resident", "BF16": f"{bf16['forward_s'] / m['resident_s']:.3f}",
                 "FP8": f"{fp8['forward_s'] / m['resident_s']:.3f}", "FP8 / BF16": ""})
    if "rel_error_to_resident" in fp8:  # runs since bench real measured it
        rows.append({"": "output error vs BF16 resident (relative L2)", "BF16": f"{bf16['rel_error_to_resident']:.4f}",
                     "FP8": f"{fp8['rel_error_to_resident']:.4f}", "FP8 / BF16": ""})
    return rows


def core_rows(name: str = CORE_FILE) -> list[dict[str, str]]:
    """The default eager variant before and after, per run and workload, and FLUX.1-dev through the public API."""
    d = load(name)
    rows = []
    for bench in ("bench_step", "bench_small40"):
        before, after = (d[bench][k] for k in ("before", "after"))
        for wb, wa in zip(before["workloads"], after["workloads"]):
            vb = {r["variant"]: r for r in wb["variants"]}
            va = {r["variant"]: r for r in wa["variants"]}
            b, a = vb["dlo-rank-local-swap"], va["dlo-rank-local-swap"]
            rows.append({"model, workload": f"{after['config']}, {wa['name']}",
                         "before: ms (/ bound)": f"{1e3 * b['step_s']:.1f} ({b['ratio_to_bound']:.3f}x)",
                         "after: ms (/ bound)": f"{1e3 * a['step_s']:.1f} ({a['ratio_to_bound']:.3f}x)",
                         "after / before": f"{a['step_s'] / b['step_s']:.4f}",
                         "step graph before / block graphs after": " / ".join(
                             f"{r['ratio_to_bound']:.3f}x" for r in (vb.get("dlo-rank-local-graph"),
                                                                      va.get("dlo-rank-local-bgraph")) if r)})
    f = d["flux_1024"]
    rows.append({"model, workload": "FLUX.1-dev, 1024² (load_model + offload, rank-local)",
                 "before: ms (/ bound)": f"{1e3 * f['before']['forward_s']:.1f}",
                 "after: ms (/ bound)": f"{1e3 * f['after']['forward_s']:.1f}",
                 "after / before": f"{f['after']['forward_s'] / f['before']['forward_s']:.4f}",
                 "step graph before / block graphs after": "same output SHA-256: "
                                                           + str(f["before"]["sha256"] == f["after"]["sha256"])})
    return rows
