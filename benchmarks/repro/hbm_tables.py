"""FLUX.1-dev's time/HBM frontier: every plan an HBM budget can buy (:func:`dlo_fn.plan.resident.frontier`, on
the model's spec at its published config: :func:`benchmarks.bench.real_models.meta_spec`), its predicted forward
``max(resident forward, H2D bytes / pinned peak)`` from the committed H200 run's resident forward and peak, and
that run's measured rows beside it (notebook 12)."""

from __future__ import annotations

import json

from benchmarks.repro.data import DATA_DIR

__all__ = ["HBM_FILE", "load", "frontier_rows", "measured_rows"]

HBM_FILE = "hbm_bench_real_flux_nvidia-h200.json"


def load() -> dict:
    return json.loads((DATA_DIR / HBM_FILE).read_text())["model"]


def frontier_rows(spec, quantization: str | None = None, every: int = 4) -> list[dict]:
    """Every ``every``-th plan of the frontier (and the last), rank-local on one device, with its predicted
    forward against the measured resident one."""
    from dlo_fn.plan.resident import frontier, layout_for

    run = load()
    resident_s, peak = run["resident_s"], run["pinned_h2d_peak_bytes_per_s"]
    plans = frontier(spec, lambda s: layout_for(s, 1, quantization=quantization), 2, 0)
    picked = plans[::every] + (plans[-1:] if (len(plans) - 1) % every else ())
    return [
        {
            "device GB": f"{p.device_weight_bytes / 1e9:.2f}",
            "resident blocks": len(p.resident),
            "H2D GB per pass": f"{p.h2d_bytes_per_pass / 1e9:.2f}",
            "predicted / resident": f"{max(resident_s, p.h2d_bytes_per_pass / peak) / resident_s:.3f}",
        }
        for p in picked
    ]


def measured_rows(prefix: str) -> list[dict]:
    """The run's rows of one family (``ours-hbm-`` or ``ours-fp8-hbm-``): device bytes, predicted and measured."""
    run = load()
    resident_s, peak = run["resident_s"], run["pinned_h2d_peak_bytes_per_s"]
    rows = [v for v in run["variants"] if v["variant"].startswith(prefix) and v.get("forward_s")]
    return [
        {
            "variant": v["variant"],
            "device GB": f"{v['weight_device_bytes'] / 1e9:.2f}",
            "resident blocks": v["resident_blocks"],
            "predicted / resident": f"{max(resident_s, v['h2d_bytes_per_forward'] / peak) / resident_s:.3f}",
            "measured / resident": f"{v['ratio_to_resident']:.3f}",
            "byte-identical": v["equal_to_resident"],
        }
        for v in sorted(rows, key=lambda v: v["weight_device_bytes"])
    ]
