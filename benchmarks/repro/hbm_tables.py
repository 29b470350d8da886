"""FLUX.1-dev's time/HBM frontier and the committed H200 run's budget rows (notebook 12).

Every plan an HBM budget can buy (:func:`dlo_fn.plan.resident.frontier`, on the model's spec at its published
config: :func:`benchmarks.bench.real_models.meta_spec`) is priced by the pass model
(:func:`dlo_fn.plan.resident.pass_seconds`) with the run's per-block compute and pinned peak. The compute is what the
budget rows placed by: one call timed block by block through the plain probe (``block_compute_s`` in the run).
Two predictions appear: the plan's own (that compute as measured), and the same model with that compute scaled so
that its sum is the run's resident forward ("calibrated": the probe's block-by-block call runs each block from an
empty device queue and so times more than a pipelined forward spends).
"""

from __future__ import annotations

import json

from benchmarks.repro.data import DATA_DIR

__all__ = ["HBM_FILE", "TIER_FILE", "load", "frontier_rows", "measured_rows", "row_plan"]

HBM_FILE = "hbm_bench_real_flux_nvidia-h200.json"
TIER_FILE = "hbm_tier_bench_real_flux_nvidia-h200.json"  # FP8 budgets with and without device-stored shards


def load(file: str = HBM_FILE) -> dict:
    return json.loads((DATA_DIR / file).read_text())["model"]


def _placed(run: dict, fp8: bool) -> dict:
    """The first budget row of the family that was placed by measured compute."""
    return next(
        v
        for v in run["variants"]
        if v.get("block_compute_s") and v["variant"].startswith("ours-fp8-hbm-" if fp8 else "ours-hbm-")
    )


def _layout_of(quantization):
    from dlo_fn.plan.resident import layout_for

    return lambda s: layout_for(s, 1, quantization=quantization)


def _calibrated(run: dict, compute: list[float]) -> tuple[float, ...]:
    scale = run["resident_s"] / sum(compute)
    return tuple(c * scale for c in compute)


def frontier_rows(spec, quantization: str | None = None, every: int = 4) -> list[dict]:
    """Every ``every``-th plan of the frontier, its fastest point and the last, rank-local on one device, 2 to 4
    slots, priced with the run's calibrated compute (FP8: with the device's copy rate, so the dequantise is priced and
    device-stored shards are among the plans): the predicted forward over the resident one."""
    from dlo_fn.plan.resident import at_speed, frontier

    run = load()
    placed = _placed(run, quantization is not None)
    compute = _calibrated(run, placed["block_compute_s"])
    device = {"device_link": placed["placement_device_bytes_per_s"]} if quantization else {}
    plans = frontier(
        spec, _layout_of(quantization), "auto", 0, compute=compute, link=run["pinned_h2d_peak_bytes_per_s"], **device
    )
    fastest = at_speed(plans)  # the least device bytes within 1% of resident
    picked = sorted(set(plans[::every]) | {fastest, plans[-1]}, key=lambda p: p.device_weight_bytes)
    return [
        {
            "device GB": f"{p.device_weight_bytes / 1e9:.2f}",
            "resident blocks": len(p.resident),
            "device-stored": len(p.device_stored),
            "slots": p.num_slots,
            "H2D GB per pass": f"{p.h2d_bytes_per_pass / 1e9:.2f}",
            "predicted / resident": f"{p.pass_s / run['resident_s']:.3f}",
        }
        for p in picked
    ]


def row_plan(spec, row: dict):
    """The plan a budget row ran (its resident and device-stored blocks and slots, as recorded), priced with the
    row's compute and links, and checked against the row's device bytes."""
    from dlo_fn.plan.resident import ResidentChoice, price_plan

    name = row["variant"]
    recorded = ResidentChoice(
        tuple(row["resident_block_ids"]),
        0,
        0,
        row["plan_num_slots"],
        None,
        tuple(row.get("device_stored_block_ids") or ()),
    )
    plan = price_plan(spec, recorded, _layout_of("fp8" if "-fp8-" in name else None), 0, **_inputs(row))
    if plan.device_weight_bytes != row["weight_device_bytes"]:
        raise ValueError(
            f"{name}: the plan holds {plan.device_weight_bytes} bytes, the run {row['weight_device_bytes']}"
        )
    return plan


def _inputs(row: dict, compute=None) -> dict:
    """What the row's plan was placed by: its compute (or ``compute``), the link and the device's copy rate."""
    device = row.get("placement_device_bytes_per_s")
    return {
        "compute": tuple(row["block_compute_s"] if compute is None else compute),
        "link": row["placement_link_bytes_per_s"],
        **({"device_link": device} if device else {}),
    }


def measured_rows(spec, prefix: str, file: str = HBM_FILE) -> list[dict]:
    """A run's rows of one family (``ours-hbm-`` or ``ours-fp8-hbm-``) placed by measured compute: device bytes, the
    plan's prediction, the calibrated one (the same plan and model, the compute scaled to the resident forward), the
    row's own bound and the measured forward, over resident."""
    from dlo_fn.plan.resident import price_plan

    run = load(file)
    resident_s, peak = run["resident_s"], run["pinned_h2d_peak_bytes_per_s"]
    rows = [v for v in run["variants"] if v["variant"].startswith(prefix) and v.get("block_compute_s")]
    out = []
    for v in sorted(rows, key=lambda v: v["weight_device_bytes"]):
        plan = row_plan(spec, v)
        calibrated = resident_s
        if len(plan.resident) < spec.num_blocks:
            inputs = _inputs(v, _calibrated(run, v["block_compute_s"]))
            calibrated = price_plan(spec, plan, _layout_of("fp8" if "-fp8-" in prefix else None), 0, **inputs).pass_s
        out.append(
            {
                "variant": v["variant"],
                "device GB": f"{v['weight_device_bytes'] / 1e9:.2f}",
                "resident blocks": v["resident_blocks"],
                "device-stored": len(plan.device_stored),
                "plan's prediction": f"{v['predicted_to_compute']:.3f}",
                "calibrated prediction": f"{calibrated / resident_s:.3f}",
                "own bound": f"{max(resident_s, v['h2d_bytes_per_forward'] / peak) / resident_s:.3f}",
                "measured": f"{v['ratio_to_resident']:.3f}",
                "byte-identical": v["equal_to_resident"],
            }
        )
    return out
