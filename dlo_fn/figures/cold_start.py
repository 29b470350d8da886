"""Figure 2 of the seed: cold-start host memory, private copies vs meta init + mmap (numbers:
:mod:`dlo_fn.repro.cold_start`).

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

import pathlib

import numpy as np

from dlo_fn.figures.style import COLORS, figure_style, save_png, write_csv
from dlo_fn.plan.memory import GB
from dlo_fn.repro.cold_start import (
    DP, LOADINGS, MB, NANO, fit_rows, fit_sweep, nano_cold_starts, nano_comparisons, read_sweep,
)

__all__ = ["fig2_cold_start_host_memory", "FIGURES"]

LABELS = {"copy": "private copies", "mmap": "meta init + mmap"}


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
