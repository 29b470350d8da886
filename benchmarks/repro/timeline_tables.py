"""The three-stream timeline on H200 ceilings, as numbers: simulated passes, the measured 24-block pass beside
its prediction, the slots x requests sweep, the Nano / Super per-block H2D, and committed recordings replayed.

Every timeline here is *simulated* (:func:`dlo_fn.plan.timeline.simulate`) from the measured H200 ceilings in
:mod:`dlo_fn.cost.ceilings` (DESIGN.md section 6): pinned H2D 54.7 GB/s, per-block compute 26.4 ms (832x480x29
video, CFG) and 6.1 ms (1024^2 image, CFG), the 604 MB reference block, one GPU (so the all-gather of the
allgather-mode schedule is a device copy). The measured 24-block pass is the comparison (:func:`prediction_rows`).
"""

from __future__ import annotations

import json
import pathlib

from benchmarks.repro.data import DATA_DIR
from benchmarks.repro.tables import text_table
from dlo_fn.cost.ceilings import (
    H200_BLOCK_COMPUTE_S,
    H200_PASS,
    H200_PINNED_H2D_BYTES_PER_S,
    IMAGE_1024_CFG,
    REF_BLOCK_BYTES,
    REF_PASS_NUM_BLOCKS,
    VIDEO_832X480X29_CFG,
    h200_durations,
)
from dlo_fn.plan.compare import fit_durations, schedule_from_params
from dlo_fn.plan.schedule import build_schedule
from dlo_fn.plan.timeline import Timeline, simulate
from dlo_fn.plan.trace import from_chrome_trace
from dlo_fn.plan.workload import Workload

__all__ = [
    "CASES",
    "MACHINE",
    "IMAGE_1024_CFG",
    "VIDEO_832X480X29_CFG",
    "h200_pass",
    "bound_of",
    "prediction_rows",
    "sweep_rows",
    "sweep_grid",
    "nano_super_rows",
    "MEASURED_TIMELINE",
    "MEASURED_TIMELINE_H200",
    "measured_vs_predicted",
]

CASES = (VIDEO_832X480X29_CFG, IMAGE_1024_CFG)  # compute-bound, then transfer-bound
MACHINE = "simulated on H200 ceilings (DESIGN.md section 6), one GPU"
MEASURED_TIMELINE = DATA_DIR / "measured_timeline_cpu.json"
MEASURED_TIMELINE_H200 = DATA_DIR / "measured_timeline_cuda.json"


def h200_pass(
    workload: Workload,
    *,
    num_blocks: int = REF_PASS_NUM_BLOCKS,
    num_steps: int = 1,
    num_slots: int = 2,
    requests_per_load: int = 1,
    mode: str = "allgather",
) -> Timeline:
    """Simulated pass(es) over reference blocks on one H200, cold start."""
    schedule = build_schedule(
        num_blocks, num_steps, num_slots=num_slots, requests_per_load=requests_per_load, mode=mode
    )
    return simulate(
        schedule,
        h200_durations(num_blocks, workload, mode=mode),
        meta=(("workload", workload.name), ("machine", MACHINE)),
    )


def bound_of(timeline: Timeline) -> str:
    """The stream that is busy longest: what bounds the timeline."""
    busy = {name: timeline.busy_s(name) for name in ("compute", "h2d", "allgather")}
    return {"compute": "compute", "h2d": "PCIe", "allgather": "all-gather"}[max(busy, key=busy.get)]


def prediction_rows() -> list[dict]:
    """The measured 24-block pass (DESIGN.md section 6) beside the simulation of the same variant.

    resident = ``24 c``; ideal = ``max(24 c, 24 n / B_h2d)``; double buffer = rank-local schedule, 2 slots;
    synchronous = rank-local, 1 slot (every copy waits for the previous compute).
    """
    rows = []
    for w in CASES:
        ideal_s = H200_PASS[(w.name, "ideal")].seconds
        compute_s = H200_BLOCK_COMPUTE_S[w.name]
        predicted = {
            "resident": REF_PASS_NUM_BLOCKS * compute_s,
            "ideal": REF_PASS_NUM_BLOCKS * max(compute_s, REF_BLOCK_BYTES / H200_PINNED_H2D_BYTES_PER_S),
            "double buffer": h200_pass(w, mode="rank-local").makespan_s,
            "synchronous": h200_pass(w, mode="rank-local", num_slots=1).makespan_s,
        }
        for variant, value in predicted.items():
            m = H200_PASS[(w.name, variant)]
            measured = m.seconds if m.seconds is not None else ideal_s * m.ratio_to_ideal
            rows.append(
                {
                    "workload": w.name,
                    "variant": variant,
                    "predicted_s": round(value, 4),
                    "measured_s": round(measured, 4),
                    "rel_error_pct": round(100 * (value - measured) / measured, 1),
                }
            )
    return rows


def sweep_rows(
    workload: Workload = IMAGE_1024_CFG,
    slots: tuple[int, ...] = (1, 2, 3, 4),
    requests: tuple[int, ...] = (1, 2, 3, 4),
    num_steps: int = 4,
) -> list[dict]:
    """Seconds per pass per request over ``num_steps`` passes, for slots x requests per load (allgather, W=1)."""
    rows = []
    for num_slots in slots:
        for r in requests:
            tl = h200_pass(workload, num_steps=num_steps, num_slots=num_slots, requests_per_load=r)
            rows.append(
                {
                    "num_slots": num_slots,
                    "requests_per_load": r,
                    "ms_per_pass_per_request": round(1e3 * tl.makespan_s / (num_steps * r), 1),
                    "exposed_transfer_ms": round(1e3 * tl.exposed_transfer_s(), 1),
                    "bound": bound_of(tl),
                }
            )
    return rows


def sweep_grid(rows: list[dict]) -> str:
    """:func:`sweep_rows` as a grid: slots down, requests per load across; ``P`` = PCIe-bound, ``C`` = compute."""
    slots = sorted({r["num_slots"] for r in rows})
    reqs = sorted({r["requests_per_load"] for r in rows})
    at = {(r["num_slots"], r["requests_per_load"]): r for r in rows}
    grid = [
        {
            "slots \\ R": s,
            **{f"R={q}": f"{at[s, q]['ms_per_pass_per_request']} {at[s, q]['bound'][0].upper()}" for q in reqs},
        }
        for s in slots
    ]
    return text_table(grid)


def nano_super_rows(world_sizes: tuple[int, ...] = (1, 2, 4, 8)) -> list[dict]:
    """Per rank, for the Nano and Super configs: H2D time of the largest block's shard (the compute per block,
    times requests per load, that hides it) and of one denoising step's shards, at the H200 pinned ceiling."""
    from dlo_fn.models.specs import config_spec
    from dlo_fn.plan.layout import model_layout

    rows = []
    for name in ("cosmos3-nano", "cosmos3-super"):
        spec = config_spec(name)
        for w in world_sizes:
            layout = model_layout(spec, w)
            rows.append(
                {
                    "model": name,
                    "W": w,
                    "num_blocks": layout.num_blocks,
                    "max_shard_MB": round(layout.max_shard_bytes / 1e6, 1),
                    "h2d_ms_per_block": round(1e3 * layout.max_shard_bytes / H200_PINNED_H2D_BYTES_PER_S, 2),
                    "h2d_s_per_step": round(layout.shard_bytes_per_rank / H200_PINNED_H2D_BYTES_PER_S, 3),
                }
            )
    return rows


def measured_vs_predicted(path: pathlib.Path = MEASURED_TIMELINE) -> tuple[Timeline, Timeline, dict]:
    """``(measured, predicted, record)`` from a committed ``bench timeline`` recording: the prediction simulates
    the recorded schedule with one duration per op kind, the median of the measured spans."""
    record = json.loads(pathlib.Path(path).read_text())
    measured = from_chrome_trace(record["trace"])
    predicted = simulate(schedule_from_params(record["schedule"]), fit_durations(measured))
    return measured, predicted, record
