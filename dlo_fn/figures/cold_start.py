"""Figure 2 of the seed: cold-start host memory, private copies vs meta init + mmap.

Left, the memory model (:func:`dlo_fn.plan.memory.cold_start`) for Cosmos3-Nano at DP4 beside the published
cgroup peaks (178 GB -> 47 GB)::

    private copies:  N M (private) + M (page cache) + N c        mmap:  M (shared page cache) + N c

Right, our measurement (``figures/data/load_sweep.csv``, written by ``python -m dlo_fn bench load``; never
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

from dlo_fn.figures.style import COLORS, figure_style, save_png, write_csv
from dlo_fn.plan.memory import GB, cold_start
from dlo_fn.repro.published import Comparison, compare, compare_bytes

__all__ = [
    "SWEEP_CSV", "NANO", "DP", "SweepFit", "nano_cold_starts", "term_rows", "nano_comparisons", "read_sweep",
    "sweep_table", "fit_sweep", "fit_rows", "fig2_cold_start_host_memory", "FIGURES",
]

DATA_DIR = pathlib.Path(__file__).resolve().parents[2] / "figures" / "data"
SWEEP_CSV = DATA_DIR / "load_sweep.csv"
NANO, DP = "cosmos3-nano", 4
LOADINGS = {"private-copy": "copy", "mmap": "mmap"}  # memory-model name -> load-bench mode
LABELS = {"copy": "private copies", "mmap": "meta init + mmap"}
MB = 10**6


def nano_cold_starts() -> dict[str, object]:
    """``{"private-copy": ColdStart, "mmap": ColdStart}`` for Nano at DP4 (sizes as in notebook 04)."""
    from dlo_fn.repro.memory_tables import model_sizes

    sizes = model_sizes(NANO)
    return {loading: cold_start(sizes, DP, loading) for loading in LOADINGS}


def term_rows() -> list[dict]:
    """The model's terms for Nano DP4, in GB, one row per loading (the numbers behind the left panel)."""
    rows = []
    for loading, c in nano_cold_starts().items():
        rows.append({
            "loading": loading, "N": c.num_ranks, "private copies N*M": round(c.private_copy_bytes / GB, 2),
            "page cache M": round(c.page_cache_bytes / GB, 2), "framework N*c": round(c.framework_bytes / GB, 2),
            "cgroup peak": round(c.cgroup_peak_bytes / GB, 2), "HWM per rank": round(c.hwm_bytes_per_rank / GB, 2),
        })
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
        raise ValueError(f"{path}: no rows; run `python -m dlo_fn bench load ... --out {path}`")
    return rows


def sweep_table(rows: list[dict]) -> list[dict]:
    """The sweep in MB (1e6 bytes): measured sum of PSS beside the law, USS, and the cgroup's counters."""
    def mb(value) -> object:
        return round(value / MB) if value != "" else "-"

    return [{
        "mode": r["mode"], "N": r["ranks"], "sum PSS": mb(r["sum_pss_bytes"]), "law": mb(r["predicted_pss_bytes"]),
        "err %": round(100 * (r["sum_pss_bytes"] / r["predicted_pss_bytes"] - 1), 1) + 0.0,
        "sum USS": mb(r["sum_uss_bytes"]), "weights PSS": mb(r["sum_weights_pss_bytes"]),
        "max HWM": mb(r["max_hwm_bytes"]), "cgroup": mb(r["cgroup_current_bytes"]),
        "cgroup file": mb(r["cgroup_file_bytes"]), "cgroup anon": mb(r["cgroup_anon_bytes"]),
    } for r in rows]


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
        fits[mode] = SweepFit(mode, metric, tuple(int(x) for x in n), float(slope), float(intercept),
                              int(sel[0]["model_bytes"]), int(sel[0]["constant_pss_bytes"]))
    return fits


def fit_rows(fits: dict[str, SweepFit], cgroup_fits: dict[str, SweepFit] | None = None) -> list[dict]:
    """The fits as table rows, in MB (1e6 bytes); with ``cgroup_fits``, the cgroup's slope beside PSS's."""
    rows = []
    for f in fits.values():
        row = {
            "mode": f.mode, "law": "N (M + c)" if f.mode == "copy" else "M + N c",
            "expected_slope_mb": round(f.expected_slope_bytes / MB, 1), "pss_slope_mb": round(f.slope_bytes / MB, 1),
            "pss_slope_ratio": round(f.slope_ratio, 3),
            "expected_intercept_mb": round(f.expected_intercept_bytes / MB, 1),
            "pss_intercept_mb": round(f.intercept_bytes / MB, 1),
        }
        if cgroup_fits:
            row["cgroup_slope_mb"] = round(cgroup_fits[f.mode].slope_bytes / MB, 1)
        rows.append(row)
    return rows


def fig2_cold_start_host_memory(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Private copies grow host memory by a whole model per rank; mmap by one framework constant per rank:
    the model reproduces the published 178 GB -> 47 GB, and our 1 GB sweep shows the same two slopes."""
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    comparisons, starts = nano_comparisons(), nano_cold_starts()
    sweep = read_sweep()
    fits = fit_sweep(sweep)
    cgroup = fit_sweep(sweep, "cgroup_current_bytes") if all(r["cgroup_current_bytes"] != "" for r in sweep) else None
    table = fit_rows(fits, cgroup)
    paths = [
        write_csv(out_dir / "data" / "fig2_cold_start_model.csv", [c.as_row() for c in comparisons],
                  ("key", "unit", "published", "predicted", "rel_error_pct", "note")),
        write_csv(out_dir / "data" / "fig2_cold_start_fit.csv", table, tuple(table[0])),
    ]
    with figure_style():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        _model_panel(ax1, starts, {c.key: c for c in comparisons})
        _sweep_panel(ax2, sweep, fits, cgroup)
        fig.suptitle("Cold start: private copies cost a model per rank, mmap a framework constant per rank")
        fig.tight_layout()
        paths.insert(0, save_png(fig, out_dir / "fig2_cold_start_host_memory.png"))
    return paths


def _model_panel(ax, starts, comparisons) -> None:
    parts = (("private copies", "private_copy_bytes", COLORS["allgather"]),
             ("page cache", "page_cache_bytes", COLORS["h2d"]),
             ("framework (N c)", "framework_bytes", COLORS["other"]))
    keys = {"private-copy": "fig2.nano_dp4.private_copy.cgroup_peak", "mmap": "fig2.nano_dp4.mmap.cgroup_peak"}
    for i, loading in enumerate(LOADINGS):
        bottom = 0.0
        for j, (label, field, color) in enumerate(parts):
            value = getattr(starts[loading], field) / GB
            ax.bar(i - 0.18, value, 0.36, bottom=bottom, color=color, label=label if i == 0 else None)
            bottom += value
        comp = comparisons[keys[loading]]
        ax.bar(i + 0.18, comp.published, 0.36, color=COLORS["published"], label="published" if i == 0 else None)
        ax.annotate(f"{comp.predicted:.0f}", (i - 0.18, bottom), ha="center", textcoords="offset points",
                    xytext=(0, 3), fontsize=8)
        ax.annotate(f"{comp.published:g}\n({100 * comp.rel_error:+.1f}%)", (i + 0.18, comp.published),
                    ha="center", textcoords="offset points", xytext=(0, 3), fontsize=8)
    ax.set(xticks=range(2), xticklabels=[LABELS[m] for m in LOADINGS.values()], ylim=(0, 215),
           ylabel="cgroup-visible host peak (GB)",
           title=f"model vs published: Nano ({NANO}), DP{DP} cold start")
    ax.legend(fontsize=7, loc="upper right")


def _sweep_panel(ax, sweep, fits, cgroup) -> None:
    grid = np.linspace(0.5, max(r["ranks"] for r in sweep) + 0.5, 20)
    for mode, color in (("copy", COLORS["allgather"]), ("mmap", COLORS["compute"])):
        f = fits[mode]
        sel = sorted((r for r in sweep if r["mode"] == mode), key=lambda r: r["ranks"])
        ax.plot([r["ranks"] for r in sel], [r["sum_pss_bytes"] / GB for r in sel], "o", color=color,
                label=f"{LABELS[mode]}: measured")
        ax.plot(grid, (f.slope_bytes * grid + f.intercept_bytes) / GB, "-", color=color, lw=1,
                label=f"fit: {f.slope_bytes / MB:.0f} MB/rank (law {f.expected_slope_bytes / MB:.0f})")
        ax.plot(grid, (f.expected_slope_bytes * grid + f.expected_intercept_bytes) / GB, ":", color=color, lw=1)
        if cgroup:
            ax.plot([r["ranks"] for r in sel], [r["cgroup_current_bytes"] / GB for r in sel], "x", color=color,
                    alpha=0.6, label=f"cgroup usage: {cgroup[mode].slope_bytes / MB:.0f} MB/rank")
    m, c = fits["mmap"].model_bytes, fits["mmap"].constant_bytes
    ax.set(xlabel="processes N", ylabel="host memory (GB): sum of PSS (dots), cgroup (x)", xticks=sorted({r["ranks"] for r in sweep}),
           title=f"measured: M = {m / GB:.2f} GB checkpoint, c = {c / MB:.0f} MB (dotted: law)")
    ax.legend(fontsize=7, loc="upper left")


FIGURES = {"fig2_cold_start_host_memory": fig2_cold_start_host_memory}
