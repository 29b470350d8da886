"""Figure 2 of the seed as numbers: cold-start host memory, private copies vs meta init + mmap.

The memory model (:func:`dlo_fn.cost.memory.cold_start`, with the calibrated framework constant) for
Cosmos3-Nano at DP4 beside the published cgroup peaks (178 GB -> 47 GB)::

    private copies:  N M (private) + M (page cache) + N c        mmap:  M (shared page cache) + N c

and our measurement (``figures/data/load_sweep.csv``, written by ``python -m benchmarks bench load``; never
re-measured here): the sum of PSS over N real processes that each load the same ~1 GB checkpoint. A straight
line fitted in N (numpy least squares) has slope ``~ M + c`` with private copies and ``~ c`` with mmap, and
intercept ``~ 0`` and ``~ M``: the same law, with our ``c`` (one process's torch footprint) in place of the
published deployment's.
"""

from __future__ import annotations

import csv
import pathlib
from dataclasses import dataclass

import numpy as np

from benchmarks.repro.data import DATA_DIR
from benchmarks.repro.deployment import cold_start
from benchmarks.repro.memory_tables import model_sizes
from benchmarks.repro.published import Comparison, compare, compare_bytes
from dlo_fn.cost.memory import GB, ColdStart

__all__ = [
    "SWEEP_CSV",
    "NANO",
    "DP",
    "LOADINGS",
    "MB",
    "SweepFit",
    "nano_cold_starts",
    "term_rows",
    "nano_comparisons",
    "read_sweep",
    "sweep_table",
    "fit_sweep",
    "fit_rows",
]

SWEEP_CSV = DATA_DIR / "load_sweep.csv"
NANO, DP = "cosmos3-nano", 4
LOADINGS = {"private-copy": "copy", "mmap": "mmap"}  # memory-model name -> load-bench mode
MB = 10**6


def nano_cold_starts() -> dict[str, ColdStart]:
    """``{"private-copy": ColdStart, "mmap": ColdStart}`` for Nano at DP4 (sizes as in notebook 04)."""
    sizes = model_sizes(NANO)
    return {loading: cold_start(sizes, DP, loading) for loading in LOADINGS}


def term_rows() -> list[dict]:
    """The model's terms for Nano DP4, in GB, one row per loading (the numbers behind the left panel)."""
    rows = []
    for loading, c in nano_cold_starts().items():
        rows.append(
            {
                "loading": loading,
                "N": c.num_ranks,
                "private copies N*M": round(c.private_copy_bytes / GB, 2),
                "page cache M": round(c.page_cache_bytes / GB, 2),
                "framework N*c": round(c.framework_bytes / GB, 2),
                "cgroup peak": round(c.cgroup_peak_bytes / GB, 2),
                "HWM per rank": round(c.hwm_bytes_per_rank / GB, 2),
            }
        )
    return rows


def nano_comparisons() -> list[Comparison]:
    """Every published Figure 2 number beside the memory model's."""
    c = nano_cold_starts()
    copy, mmap = c["private-copy"], c["mmap"]
    return [
        compare_bytes("fig2.nano_dp4.private_copy.private_copies", copy.private_copy_bytes),
        compare_bytes("fig2.nano_dp4.private_copy.page_cache", copy.page_cache_bytes),
        compare_bytes("fig2.nano_dp4.private_copy.framework_transient", copy.framework_bytes + copy.transient_bytes),
        compare_bytes("fig2.nano_dp4.private_copy.cgroup_peak", copy.cgroup_peak_bytes),
        compare_bytes("fig2.nano_dp4.mmap.cgroup_peak", mmap.cgroup_peak_bytes),
        compare("fig2.nano_dp4.reduction_pct", 100 * (1 - mmap.cgroup_peak_bytes / copy.cgroup_peak_bytes)),
    ]


def read_sweep(path: pathlib.Path = SWEEP_CSV) -> list[dict]:
    """The committed sweep rows, numbers parsed (bytes as int)."""
    rows = []
    with pathlib.Path(path).open(newline="") as f:
        for row in csv.DictReader(f):
            out: dict[str, object] = dict(row)
            for key, value in row.items():
                if key.endswith("_bytes") and value:
                    out[key] = int(value)
            out["ranks"] = int(row["ranks"])
            rows.append(out)
    if not rows:
        raise ValueError(f"{path}: no rows; run `python -m benchmarks bench load ... --out {path}`")
    return rows


def sweep_table(rows: list[dict]) -> list[dict]:
    """The sweep in MB (1e6 bytes): measured sum of PSS beside the law, USS, and the cgroup's counters."""

    def mb(value) -> object:
        return round(value / MB) if value != "" else "-"

    return [
        {
            "mode": r["mode"],
            "N": r["ranks"],
            "sum PSS": mb(r["sum_pss_bytes"]),
            "law": mb(r["predicted_pss_bytes"]),
            "err %": round(100 * (r["sum_pss_bytes"] / r["predicted_pss_bytes"] - 1), 1) + 0.0,
            "sum USS": mb(r["sum_uss_bytes"]),
            "weights PSS": mb(r["sum_weights_pss_bytes"]),
            "max HWM": mb(r["max_hwm_bytes"]),
            "cgroup": mb(r["cgroup_current_bytes"]),
            "cgroup file": mb(r["cgroup_file_bytes"]),
            "cgroup anon": mb(r["cgroup_anon_bytes"]),
        }
        for r in rows
    ]


@dataclass(frozen=True, slots=True)
class SweepFit:
    """``sum PSS ~= slope N + intercept`` for one load mode, next to what the law expects."""

    mode: str
    metric: str  # the CSV column fitted: sum_pss_bytes or cgroup_current_bytes
    ranks: tuple[int, ...]
    slope_bytes: float
    intercept_bytes: float
    model_bytes: int
    constant_bytes: int

    @property
    def expected_slope_bytes(self) -> int:
        """``c`` (mmap) or ``M + c`` (copy)."""
        return self.constant_bytes + (self.model_bytes if self.mode == "copy" else 0)

    @property
    def expected_intercept_bytes(self) -> int:
        """``M`` (mmap: one shared copy) or ``0`` (copy)."""
        return self.model_bytes if self.mode == "mmap" else 0

    @property
    def slope_ratio(self) -> float:
        return self.slope_bytes / self.expected_slope_bytes


def fit_sweep(rows: list[dict], metric: str = "sum_pss_bytes") -> dict[str, SweepFit]:
    """Least-squares line of ``metric`` in N, per mode (the cgroup's intercept also holds the driver and every
    other file it cached, so only its slope is comparable)."""
    fits = {}
    for mode in ("copy", "mmap"):
        sel = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["ranks"])
        if len(sel) < 2:
            raise ValueError(f"the sweep has {len(sel)} {mode} row(s); a slope needs two or more values of N")
        n = np.array([r["ranks"] for r in sel], dtype=float)
        if any(r[metric] == "" for r in sel):
            raise ValueError(f"the sweep has no {metric} for some {mode} rows")
        y = np.array([r[metric] for r in sel], dtype=float)
        slope, intercept = np.polyfit(n, y, 1)
        fits[mode] = SweepFit(
            mode,
            metric,
            tuple(int(x) for x in n),
            float(slope),
            float(intercept),
            int(sel[0]["model_bytes"]),
            int(sel[0]["constant_pss_bytes"]),
        )
    return fits


def fit_rows(fits: dict[str, SweepFit], cgroup_fits: dict[str, SweepFit] | None = None) -> list[dict]:
    """The fits as table rows, in MB (1e6 bytes); with ``cgroup_fits``, the cgroup's slope beside PSS's."""
    rows = []
    for f in fits.values():
        row = {
            "mode": f.mode,
            "law": "N (M + c)" if f.mode == "copy" else "M + N c",
            "expected_slope_mb": round(f.expected_slope_bytes / MB, 1),
            "pss_slope_mb": round(f.slope_bytes / MB, 1),
            "pss_slope_ratio": round(f.slope_ratio, 3),
            "expected_intercept_mb": round(f.expected_intercept_bytes / MB, 1),
            "pss_intercept_mb": round(f.intercept_bytes / MB, 1),
        }
        if cgroup_fits:
            row["cgroup_slope_mb"] = round(cgroup_fits[f.mode].slope_bytes / MB, 1)
        rows.append(row)
    return rows
