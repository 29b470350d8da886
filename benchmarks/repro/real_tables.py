"""The tables of users' own models, FP8 shards and the runtime core's before/after, from committed H200 data.

* :func:`real_rows` - one forward of a diffusers model at its published config per variant (``bench real``):
  time against the bound, equality with its reference, time to ready against the host's floor, memory;
* :func:`fp8_rows` - FP8 shards against BF16 on the same model and machine, per model: forward time against BF16
  offloaded, BF16 resident and its own bound, bytes moved and pinned, host memory, time to ready (on the fly and
  from a pre-quantised checkpoint), and the output's error against the resident one;
* :func:`pipeline_rows` - a full FLUX.1-dev request (28 steps) with the transformer resident, offloaded, and FP8;
* :func:`ready_rows` - time to ready, one rank and W gloo ranks sharing the H200, 4 KiB and 2 MiB arena pages;
* :func:`core_rows` - the runtime core (after) against a heavier one (before: the driver-call issuer, step graphs),
  each pair measured side by side: step time / bound of the default variant, and on FLUX.1-dev.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from benchmarks.repro.data import DATA_DIR
from benchmarks.repro.variants import REAL, labels

__all__ = [
    "REAL_FILE",
    "WAN_FILE",
    "FP8_FILE",
    "WAN_FP8_FILE",
    "WAN720_FILE",
    "WAN720_DIFFUSERS_FILE",
    "LTX_FILE",
    "MODEL_OFFLOAD_FILE",
    "READY_FILE",
    "READY_AFTER_FILE",
    "CORE_FILE",
    "load",
    "real_rows",
    "fp8_rows",
    "pipeline_rows",
    "ready_rows",
    "model_offload_rows",
    "core_rows",
]

REAL_FILE = "bench_real_flux_nvidia-h200.json"  # every variant of FLUX.1-dev, diffusers' offloading beside ours
WAN_FILE = "bench_real_wan480_nvidia-h200.json"  # every variant of Wan2.1-T2V-14B at 480p
FP8_FILE = "fp8_bench_real_flux_nvidia-h200.json"  # FLUX.1-dev: the full pipeline request (BF16 and FP8)
WAN_FP8_FILE = "fp8_bench_real_wan480_nvidia-h200.json"  # Wan2.1-T2V-14B at 480p: BF16 and FP8 (its error)
WAN720_FILE = "bench_real_wan720_nvidia-h200.json"  # Wan2.1-T2V-14B at 720p
WAN720_DIFFUSERS_FILE = "bench_real_wan720_diffusers_nvidia-h200.json"  # its diffusers row, a run of its own
LTX_FILE = "bench_real_ltx_nvidia-h200.json"  # LTX-Video, 512x704, 161 frames
MODEL_OFFLOAD_FILE = "bench_real_{model}_model_offload_nvidia-h200.json"  # whole-model offload, a run of its own
READY_FILE = "ready_bench_real_flux_nvidia-h200.json"  # FLUX.1-dev's time to ready: 2 MiB pages, locked while filled
READY_AFTER_FILE = "ready_locked_after_bench_real_flux_nvidia-h200.json"  # the same run's 2 MiB pages, locked after
CORE_FILE = "core_before_after_nvidia-h200.json"
LABELS = labels(REAL)


def load(name: str) -> dict[str, Any]:
    return json.loads((DATA_DIR / name).read_text())


def _model(report: dict) -> dict:
    return report.get("model", report)


def _by(name: str) -> dict[str, dict]:
    return {v["variant"]: v for v in _model(load(name))["variants"] if v.get("status") == "ok"}


def _ready(v: dict, floor: dict, digits: int = 1) -> str:
    """Ready seconds and their ratio to the host's floor (:func:`benchmarks.bench.real_ready.measure_floor`) with
    4 KiB pages (``floor_s``) and, where measured, with 2 MiB pages: the same sum with the huge pages' touch and
    register."""
    if not v.get("ready_over_floor"):
        return "-"
    text = f"{v['ready_s']:.{digits}f} ({v['ready_over_floor']:.2f}"
    if "touch_hugepage_s" not in floor:
        return text + ")"
    huge = floor["touch_hugepage_s"] + floor.get("register_hugepage_s", 0.0) + floor["copy_s"]
    return text + f", {v['ready_s'] / huge:.2f})"


def real_rows(name: str = REAL_FILE, skip: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """Per variant that ran (but those starting with one of ``skip``): forward time, / bound (FP8: / its own bound
    too), equal, ready, host and pinned bytes."""
    rows, model = [], _model(load(name))
    for v in model["variants"]:
        if v.get("status") != "ok" or v["variant"] not in LABELS or v["variant"].startswith(skip or ("\0",)):
            continue
        own = v.get("ratio_to_own_bound")
        ratio = f"{v['ratio_to_bound']:.3f}x" if v.get("ratio_to_bound") else "-"
        if own and v["variant"].startswith("ours-fp8"):
            ratio += f" (own bound {own:.3f}x)"
        rows.append(
            {
                "variant": LABELS[v["variant"]],
                "forward ms": f"{1e3 * v['forward_s']:.1f}" if v.get("forward_s") else "-",
                "/ bound": ratio,
                "equal": "-" if v["variant"] in ("resident", "ours-cold") else str(v.get("equal_to_resident")),
                "ready s (/ floor: 4 KiB, 2 MiB pages)": _ready(v, model.get("floor", {})),
                "host RSS GB": f"{v['host_rss_bytes'] / 1e9:.1f}" if v.get("host_rss_bytes") else "-",
                "pinned GB": f"{v['pinned_bytes'] / 1e9:.1f}" if v.get("pinned_bytes") else "-",
            }
        )
    return rows


def _fp8_row(model: str, v: dict, bf16: dict | None, resident_s: float) -> dict[str, str]:
    x = lambda a, b: f"{a / b:.3f}" if a and b else "-"  # noqa: E731
    return {
        "model": model,
        "variant": LABELS[v["variant"]],
        "slots": str(v.get("num_slots", "-")),
        "forward ms": f"{1e3 * v['forward_s']:.1f}",
        "/ BF16 offloaded": x(v["forward_s"], bf16 and bf16["forward_s"]),
        "/ BF16 resident": x(v["forward_s"], resident_s),
        "/ own bound": x(v.get("ratio_to_own_bound"), 1),
        "H2D GB per forward": f"{v['h2d_bytes_per_forward'] / 1e9:.2f}",
        "pinned GB": f"{v['pinned_bytes'] / 1e9:.2f}",
        "host RSS GB": f"{v['host_rss_bytes'] / 1e9:.2f}",
        "ready s": f"{v['ready_s']:.1f}",
        "equal": str(v["equal_to_resident"]),
        "rel. error vs BF16": f"{v['rel_error_to_resident']:.4f}" if "rel_error_to_resident" in v else "-",
    }


def fp8_rows() -> list[dict[str, str]]:
    """FP8 shards beside BF16, per model, each model's rows from one run (``equal``: BF16 to the resident model,
    FP8 to the fake-quantised one; the error is against BF16 resident); FLUX.1-dev's pre-quantised row beside its
    on-the-fly FP8 of the same run."""
    rows = []
    for model, name, keys in (
        ("FLUX.1-dev 1024²", REAL_FILE, ("ours-rank-local", "ours-fp8", "ours-fp8-auto", "ours-fp8-prequantized")),
        ("Wan2.1-14B 480p", WAN_FP8_FILE, ("ours-rank-local", "ours-fp8-auto")),
    ):
        by, resident_s = _by(name), _model(load(name))["resident_s"]
        rows += [_fp8_row(model, by[k], by["ours-rank-local"], resident_s) for k in keys]
    return rows


def pipeline_rows(name: str = FP8_FILE) -> list[dict[str, str]]:
    """A whole FLUX.1-dev request (28 steps at 1024², text encoders and VAE resident) per transformer."""
    p = _by(name)["pipeline"]
    base = p["resident"]["request_s"]
    return [
        {
            "transformer": LABELS[k],
            "request s": f"{p[k]['request_s']:.2f}",
            "/ resident": f"{p[k]['request_s'] / base:.3f}",
            "images equal to resident": "-" if k == "resident" else str(p[k]["equal_to_resident"]),
            "rel. error vs resident": "-" if k == "resident" else f"{p[k]['rel_error_to_resident']:.4f}",
        }
        for k in ("resident", "ours-rank-local", "ours-fp8")
    ]


def ready_rows() -> list[dict[str, str]]:
    """FLUX.1-dev's time to ready per set-up: one rank alone (the bench's own process) and each of W gloo ranks
    sharing the H200 (allgather; the slowest rank), with the CUDA arena in 4 KiB pages locked after the copy
    (``REAL_FILE``), and, one after the other, in 2 MiB pages locked after the copy (``READY_AFTER_FILE``) and range by
    range during it (``READY_FILE``, the store as it is), against the host's floor for the same bytes with either
    page size, measured in the same run (for W ranks: by each rank after its set-up, every rank at once). The warm-up
    all-gather moves a byte per rank; the first forward of W ranks is gloo's (every all-gather of device tensors
    through host memory): no performance figure."""
    rows = []
    for name, pages, locked in (
        (REAL_FILE, "4 KiB", "after the copy"),
        (READY_AFTER_FILE, "2 MiB", "after the copy"),
        (READY_FILE, "2 MiB", "while copying"),
    ):
        model = _model(load(name))
        for k, v in _by(name).items():
            if k == "ours-rank-local":
                r, floor, who = v, model["floor"], "1 rank"
            elif k.startswith("ranks-"):
                r = max(v["ranks"], key=lambda x: x["ready_s"])
                floor, who = r["floor"], f"W = {v['world_size']} ranks (slowest)"
            else:
                continue
            ranks = k.startswith("ranks-")
            rows.append(
                {
                    "set-up": who,
                    "arena pages": pages,
                    "locked": locked,
                    "pinned GB per rank": f"{r['pinned_bytes'] / 1e9:.2f}",
                    "ready s (/ floor: 4 KiB, 2 MiB pages)": _ready(r, floor, 2),
                    "store fill s": f"{r['store']['total_s']:.2f}",
                    "fill threads": str(r["store"]["threads"]),
                    "warm-up all-gather s": f"{r['offload']['warm_up_s']:.3f}" if ranks else "-",
                    "first forward s": f"{r['first_forward_s']:.1f}" if ranks else "-",
                    "equal": str(v["equal_to_resident"]),
                }
            )
    return rows


def model_offload_rows(models: tuple[str, ...] = ("flux", "wan480")) -> list[dict[str, str]]:
    """Whole-model offload per model (``MODEL_OFFLOAD_FILE``): each forward split in the move to the device with the
    forward, and the move back to the host (medians of the timed forwards, the warm-up left out), beside that run's
    resident forward and bound."""
    rows = []
    for m in models:
        report = load(MODEL_OFFLOAD_FILE.format(model=m))
        model, v = _model(report), _by(MODEL_OFFLOAD_FILE.format(model=m))["model-offload"]
        timed = lambda key: statistics.median(v[key][report["warmup"] :])  # noqa: E731
        rows.append(
            {
                "model": m,
                "forward s": f"{v['forward_s']:.1f}",
                "/ bound": f"{v['ratio_to_bound']:.1f}x",
                "to the device + forward s": f"{timed('to_device_and_forward_s_all'):.1f}",
                "back to the host s": f"{timed('back_to_host_s_all'):.1f}",
                "resident forward ms": f"{1e3 * model['resident_s']:.0f}",
                "bound ms": f"{1e3 * model['bound_s']:.0f}",
                "equal": str(v["equal_to_resident"]),
            }
        )
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
            rows.append(
                {
                    "model, workload": f"{after['config']}, {wa['name']}",
                    "before: ms (/ bound)": f"{1e3 * b['step_s']:.1f} ({b['ratio_to_bound']:.3f}x)",
                    "after: ms (/ bound)": f"{1e3 * a['step_s']:.1f} ({a['ratio_to_bound']:.3f}x)",
                    "after / before": f"{a['step_s'] / b['step_s']:.4f}",
                    "step graph before / block graphs after": " / ".join(
                        f"{r['ratio_to_bound']:.3f}x"
                        for r in (vb.get("dlo-rank-local-graph"), va.get("dlo-rank-local-bgraph"))
                        if r
                    ),
                }
            )
    f = d["flux_1024"]
    rows.append(
        {
            "model, workload": "FLUX.1-dev, 1024² (load_model + offload, rank-local)",
            "before: ms (/ bound)": f"{1e3 * f['before']['forward_s']:.1f}",
            "after: ms (/ bound)": f"{1e3 * f['after']['forward_s']:.1f}",
            "after / before": f"{f['after']['forward_s'] / f['before']['forward_s']:.4f}",
            "step graph before / block graphs after": "same output SHA-256: "
            + str(f["before"]["sha256"] == f["after"]["sha256"]),
        }
    )
    return rows
