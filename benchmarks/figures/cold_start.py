"""Figure 2 of the seed: cold-start host memory, private copies vs meta init + mmap (numbers:
:mod:`benchmarks.repro.cold_start`).

Left, the memory model (:func:`dlo_fn.cost.memory.cold_start`) for Cosmos3-Nano at DP4 beside the published
cgroup peaks (178 GB -> 47 GB)::

    private copies:  N M (private) + M (page cache) + N c        mmap:  M (shared page cache) + N c

Right, our measurement (``figures/data/load_sweep.csv``, written by ``python -m benchmarks bench load``; never
re-measured here): the sum of PSS over N real processes that each load the same ~1 GB checkpoint. A straight
line fitted in N (numpy least squares) has slope ``~ M + c`` with private copies and ``~ c`` with mmap, and
intercept ``~ 0`` and ``~ M``: the same law, with our ``c`` (one process's torch footprint) in place of the
published deployment's.

Third panel, after the load: one rank's USS once its weights are offloaded (``figures/data/load_phases.csv``,
``python -m benchmarks bench load --phases``) against :func:`dlo_fn.cost.rank_memory.rank_memory`'s prediction. With
the all-gather a rank keeps ``M / N`` (its arena shard) and the mapping is released, so USS falls as ``1 / N``;
rank-local keeps a private ``M`` per rank, and rank-local from the mapping keeps almost nothing private (the page
cache is shared, counted in PSS).
"""

from __future__ import annotations

import pathlib

import numpy as np

from benchmarks.figures.style import COLORS, figure_style, save_png, write_csv
from benchmarks.repro.cold_start import (
    DP,
    LOADINGS,
    MB,
    NANO,
    fit_rows,
    fit_sweep,
    nano_cold_starts,
    nano_comparisons,
    read_sweep,
)
from benchmarks.repro.rank_memory_tables import read_phases
from dlo_fn.cost.memory import GB

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
        write_csv(
            out_dir / "data" / "fig2_cold_start_model.csv",
            [c.as_row() for c in comparisons],
            ("key", "unit", "published", "predicted", "rel_error_pct", "note"),
        ),
        write_csv(out_dir / "data" / "fig2_cold_start_fit.csv", table, tuple(table[0])),
    ]
    with figure_style():
        fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.2))
        _model_panel(ax1, starts, {c.key: c for c in comparisons})
        _sweep_panel(ax2, sweep, fits, cgroup)
        _rank_panel(ax3, read_phases())
        fig.suptitle("Cold start: private copies cost a model per rank, mmap a framework constant per rank")
        fig.tight_layout()
        paths.insert(0, save_png(fig, out_dir / "fig2_cold_start_host_memory.png"))
    return paths


def _model_panel(ax, starts, comparisons) -> None:
    parts = (
        ("private copies", "private_copy_bytes", COLORS["allgather"]),
        ("page cache", "page_cache_bytes", COLORS["h2d"]),
        ("framework (N c)", "framework_bytes", COLORS["other"]),
    )
    keys = {"private-copy": "fig2.nano_dp4.private_copy.cgroup_peak", "mmap": "fig2.nano_dp4.mmap.cgroup_peak"}
    for i, loading in enumerate(LOADINGS):
        bottom = 0.0
        for j, (label, field, color) in enumerate(parts):
            value = getattr(starts[loading], field) / GB
            ax.bar(i - 0.18, value, 0.36, bottom=bottom, color=color, label=label if i == 0 else None)
            bottom += value
        comp = comparisons[keys[loading]]
        ax.bar(i + 0.18, comp.published, 0.36, color=COLORS["published"], label="published" if i == 0 else None)
        ax.annotate(
            f"{comp.predicted:.0f}",
            (i - 0.18, bottom),
            ha="center",
            textcoords="offset points",
            xytext=(0, 3),
            fontsize=8,
        )
        ax.annotate(
            f"{comp.published:g}\n({100 * comp.rel_error:+.1f}%)",
            (i + 0.18, comp.published),
            ha="center",
            textcoords="offset points",
            xytext=(0, 3),
            fontsize=8,
        )
    ax.set(
        xticks=range(2),
        xticklabels=[LABELS[m] for m in LOADINGS.values()],
        ylim=(0, 215),
        ylabel="cgroup-visible host peak (GB)",
        title=f"model vs published: Nano ({NANO}), DP{DP} cold start",
    )
    ax.legend(fontsize=7, loc="upper right")


def _sweep_panel(ax, sweep, fits, cgroup) -> None:
    grid = np.linspace(0.5, max(r["ranks"] for r in sweep) + 0.5, 20)
    for mode, color in (("copy", COLORS["allgather"]), ("mmap", COLORS["compute"])):
        f = fits[mode]
        sel = sorted((r for r in sweep if r["mode"] == mode), key=lambda r: r["ranks"])
        ax.plot(
            [r["ranks"] for r in sel],
            [r["sum_pss_bytes"] / GB for r in sel],
            "o",
            color=color,
            label=f"{LABELS[mode]}: measured",
        )
        ax.plot(
            grid,
            (f.slope_bytes * grid + f.intercept_bytes) / GB,
            "-",
            color=color,
            lw=1,
            label=f"fit: {f.slope_bytes / MB:.0f} MB/rank (law {f.expected_slope_bytes / MB:.0f})",
        )
        ax.plot(grid, (f.expected_slope_bytes * grid + f.expected_intercept_bytes) / GB, ":", color=color, lw=1)
        if cgroup:
            ax.plot(
                [r["ranks"] for r in sel],
                [r["cgroup_current_bytes"] / GB for r in sel],
                "x",
                color=color,
                alpha=0.6,
                label=f"cgroup usage: {cgroup[mode].slope_bytes / MB:.0f} MB/rank",
            )
    m, c = fits["mmap"].model_bytes, fits["mmap"].constant_bytes
    ax.set(
        xlabel="processes N",
        ylabel="host memory (GB): sum of PSS (dots), cgroup (x)",
        xticks=sorted({r["ranks"] for r in sweep}),
        title=f"measured: M = {m / GB:.2f} GB checkpoint, c = {c / MB:.0f} MB (dotted: law)",
    )
    ax.legend(fontsize=7, loc="upper left")


def _rank_panel(ax, phases, phase: str = "offload") -> None:
    modes = (("allgather", COLORS["allgather"]), ("rank-local", COLORS["h2d"]), ("rank-local-mmap", COLORS["compute"]))
    rows = [r for r in phases if r["phase"] == phase]
    for mode, color in modes:
        sel = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["ranks"])
        if not sel:
            continue
        n = [r["ranks"] for r in sel]
        worst = max(abs(r["predicted_uss_bytes"] / r["uss_bytes"] - 1) for r in sel)
        ax.plot(n, [r["uss_bytes"] / GB for r in sel], "o", color=color, label=f"{mode}: measured")
        ax.plot(
            n,
            [r["predicted_uss_bytes"] / GB for r in sel],
            "-",
            color=color,
            lw=1,
            label=f"{mode}: model (worst {100 * worst:.1f}%)",
        )
    top = max(r["uss_bytes"] for r in rows) / GB
    ax.set(
        xlabel="processes N",
        ylabel="USS of one rank (GB)",
        xticks=sorted({r["ranks"] for r in rows}),
        ylim=(0, 1.9 * top),
        title=f"per rank after the {phase}: measured vs rank_memory",
    )
    ax.legend(fontsize=6.5, loc="upper right", ncol=2)


FIGURES = {"fig2_cold_start_host_memory": fig2_cold_start_host_memory}
