"""Per-rank host rows for notebook 04: published (where the seed has a per-rank number), predicted by
:mod:`dlo_fn.cost.rank_memory`, measured (``figures/data/load_phases*.csv``)."""

from __future__ import annotations

import csv
import pathlib

from benchmarks.repro.data import DATA_DIR
from benchmarks.repro.memory_tables import model_sizes
from benchmarks.repro.published import published
from dlo_fn.cost.calibration import FRAMEWORK_HOST_BYTES_PER_RANK
from dlo_fn.cost.memory import GB
from dlo_fn.cost.rank_memory import ProcessConstant, rank_memory

__all__ = ["PHASES_CSV", "PHASES_H200_CSV", "read_phases", "published_rank_rows", "measured_rank_rows"]

PHASES_CSV = DATA_DIR / "load_phases.csv"
PHASES_H200_CSV = DATA_DIR / "load_phases_h200.csv"
_KEYS = ("rss", "uss", "pss", "hwm", "sum_pss")


def read_phases(path: pathlib.Path = PHASES_CSV) -> list[dict]:
    with pathlib.Path(path).open(newline="") as f:
        return [
            {k: int(v) if k.endswith("_bytes") or k == "ranks" else v for k, v in r.items()} for r in csv.DictReader(f)
        ]


def published_rank_rows() -> list[dict]:
    """Super DP4 on Ascend (the published deployment; c = 3.5 GB): a worker's high-water mark and its pinned
    shards, published vs the per-rank model (the arena is driver memory there, outside the worker's RSS)."""
    c = FRAMEWORK_HOST_BYTES_PER_RANK
    m = rank_memory(model_sizes("cosmos3-super"), 4, "allgather", "npu", constant=ProcessConstant(c, c, c))
    rows = []
    for item, key, value in (
        ("worker VmHWM (fill)", "host.super_dp4.worker_hwm", m.phase("fill").hwm_bytes),
        ("pinned shards per rank", "fig3.super_dp4.dlo.pinned_per_rank", m.terms.arena_bytes),
    ):
        p = published(key).value
        rows.append(
            {
                "item": item,
                "published_gb": p,
                "predicted_gb": round(value / GB, 1),
                "error_%": round(100 * (value / GB / p - 1), 1),
                "measured": "-",
            }
        )
    return rows


def measured_rank_rows(
    rows: list[dict], phases: tuple[str, ...] = ("fill", "offload", "generate"), ranks: tuple[int, ...] = (1, 2, 3, 4)
) -> list[dict]:
    """Measured vs predicted MB per (mode, N, phase), with the worst relative error of the five values."""
    out = []
    for r in rows:
        if r["phase"] not in phases or r["ranks"] not in ranks:
            continue
        row = {"mode": r["mode"], "N": r["ranks"], "phase": r["phase"]}
        worst = 0.0
        for k in _KEYS:
            m, p = r[f"{k}_bytes"], r[f"predicted_{k}_bytes"]
            row[f"{k} MB"] = f"{m / 1e6:.0f}/{p / 1e6:.0f}"
            worst = max(worst, abs(p / m - 1))
        row["worst_%"] = round(100 * worst, 1)
        out.append(row)
    return out
