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

__all__ = ["HBM_FILE", "load", "frontier_rows", "measured_rows", "row_plan"]

HBM_FILE = "hbm_bench_real_flux_nvidia-h200.json"


def load() -> dict:
    return json.loads((DATA_DIR / HBM_FILE).read_text())["model"]


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
    slots, priced with the run's calibrated compute: the predicted forward over the resident one."""
    from dlo_fn.plan.resident import at_speed, frontier

    run = load()
    compute = _calibrated(run, _placed(run, quantization is not None)["block_compute_s"])
    plans = frontier(
        spec, _layout_of(quantization), "auto", 0, compute=compute, link=run["pinned_h2d_peak_bytes_per_s"]
    )
    fastest = at_speed(plans)  # the least device bytes within 1% of resident
    picked = sorted(set(plans[::every]) | {fastest, plans[-1]}, key=lambda p: p.device_weight_bytes)
    return [
        {
            "device GB": f"{p.device_weight_bytes / 1e9:.2f}",
            "resident blocks": len(p.resident),
            "slots": p.num_slots,
            "H2D GB per pass": f"{p.h2d_bytes_per_pass / 1e9:.2f}",
            "predicted / resident": f"{p.pass_s / run['resident_s']:.3f}",
        }
        for p in picked
    ]


def row_plan(spec, row: dict):
    """The plan a budget row ran (its budget, slots, compute and link given to
    :func:`~dlo_fn.plan.resident.choose_resident`), checked against the row's device bytes."""
    from dlo_fn.plan.resident import choose_resident
    from dlo_fn.plan.sizes import parse_bytes

    name = row["variant"]
    budget = row["weight_device_bytes"] if name.endswith("fastest") else parse_bytes(name.rsplit("-", 1)[1])
    plan = choose_resident(
        spec,
        budget,
        _layout_of("fp8" if "-fp8-" in name else None),
        row["plan_num_slots"],
        0,
        compute=tuple(row["block_compute_s"]),
        link=row["placement_link_bytes_per_s"],
    )
    if plan.device_weight_bytes != row["weight_device_bytes"]:
        raise ValueError(
            f"{name}: the plan holds {plan.device_weight_bytes} bytes, the run {row['weight_device_bytes']}"
        )
    return plan


def measured_rows(spec, prefix: str) -> list[dict]:
    """The run's rows of one family (``ours-hbm-`` or ``ours-fp8-hbm-``) placed by measured compute: device bytes,
    the plan's prediction, the calibrated one, the row's own bound and the measured forward, over resident."""
    from dlo_fn.plan.resident import pass_seconds, with_resident

    run = load()
    resident_s, peak = run["resident_s"], run["pinned_h2d_peak_bytes_per_s"]
    rows = [v for v in run["variants"] if v["variant"].startswith(prefix) and v.get("block_compute_s")]
    out = []
    for v in sorted(rows, key=lambda v: v["weight_device_bytes"]):
        plan = row_plan(spec, v)
        calibrated = resident_s
        if len(plan.resident) < spec.num_blocks:
            shards = iter(
                s.shard_bytes
                for s in _layout_of(None if "-fp8-" not in prefix else "fp8")(with_resident(spec, plan.resident)).shards
            )
            h2d = tuple(0 if b in plan.resident else next(shards) for b in range(spec.num_blocks))
            calibrated = pass_seconds(_calibrated(run, v["block_compute_s"]), h2d, plan.num_slots, peak)
        out.append(
            {
                "variant": v["variant"],
                "device GB": f"{v['weight_device_bytes'] / 1e9:.2f}",
                "resident blocks": v["resident_blocks"],
                "plan's prediction": f"{v['predicted_to_compute']:.3f}",
                "calibrated prediction": f"{calibrated / resident_s:.3f}",
                "own bound": f"{max(resident_s, v['h2d_bytes_per_forward'] / peak) / resident_s:.3f}",
                "measured": f"{v['ratio_to_resident']:.3f}",
                "byte-identical": v["equal_to_resident"],
            }
        )
    return out
