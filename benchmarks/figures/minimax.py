"""Figures 7 and 8 of the seed: the MiniMax-H3 DLO route study on 8x B300, recomputed from its raw CSVs.

Every number drawn here is computed by :mod:`benchmarks.repro.minimax` from ``figures/data/minimax_h3_b300/`` (see
its ``SOURCE.md``); the published values (:mod:`benchmarks.repro.published`) are drawn beside them, with the
relative error.

* ``fig7_minimax_frontier``: wave latency vs throughput of every T2VA topology x mode, energy per video, and the
  paired five-wave AllGather vs rank-local deltas (+129.4% at DP1xSP8, +2.2% at DP4xSP2, -4.1% at DP8xSP1).
* ``fig8_minimax_tasks``: the three selected routes for T2VA, FL2VA and Ref2VA: the same frontier ordering.
"""

from __future__ import annotations

import pathlib

import numpy as np

from benchmarks.figures.style import COLORS, figure_style, save_png, write_csv
from benchmarks.repro.minimax import (
    DATA_DIR,
    TOPOLOGIES,
    delta_rows,
    frontier_ordered,
    load_cases,
    paired_deltas,
    route,
    route_row,
    selected_routes,
    task_frontiers,
)
from benchmarks.repro.published import published

__all__ = ["fig7_minimax_frontier", "fig8_minimax_tasks", "FIGURES"]

MODE_LABEL = {"allgather": "AllGather", "ranklocal": "rank-local"}


def fig7_minimax_frontier(out_dir: pathlib.Path, data_dir: pathlib.Path = DATA_DIR) -> list[pathlib.Path]:
    """Increasing DP trades wave latency for concurrent outputs, and the better DLO mode flips with topology:
    AllGather at DP1xSP8, rank-local at DP8xSP1 (paired five-wave deltas computed from the CSVs)."""
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    cases = load_cases(data_dir)
    five = {(m, t): route(cases, "t2va", m, *t, pool_soak=False) for m in MODE_LABEL for t in TOPOLOGIES}
    chosen = selected_routes(cases)
    deltas = paired_deltas(cases)
    rows = [route_row(r, False) for r in five.values()] + [route_row(r, True) for r in chosen]
    paths = [write_csv(out_dir / "data" / "fig7_minimax_frontier.csv", rows, list(rows[0]))]
    deltas_table = delta_rows(deltas)
    paths.append(write_csv(out_dir / "data" / "fig7_minimax_paired_deltas.csv", deltas_table, list(deltas_table[0])))

    with figure_style():
        fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13.5, 4.2))
        for mode, color, marker in (("allgather", COLORS["allgather"], "o"), ("ranklocal", COLORS["h2d"], "s")):
            rs = [five[(mode, t)] for t in TOPOLOGIES]
            ax1.errorbar(
                [r.videos_per_hour for r in rs],
                [r.p50_s for r in rs],
                yerr=[[0] * 3, [r.p95_s - r.p50_s for r in rs]],
                color=color,
                marker=marker,
                capsize=3,
                label=f"{MODE_LABEL[mode]} (5 waves, P50 to P95)",
            )
            for r in rs:
                ax1.annotate(
                    r.label,
                    (r.videos_per_hour, r.p50_s),
                    textcoords="offset points",
                    fontsize=7,
                    xytext=(6, -12) if mode == "ranklocal" else (-52, 4),
                    color=color,
                )
        ax1.plot(
            [r.videos_per_hour for r in chosen],
            [r.p50_s for r in chosen],
            "*",
            ms=11,
            color=COLORS["measured"],
            label="selected route, 20 waves pooled (CSV)",
        )
        pub = [
            (
                published(f"minimax.t2va.dp{r.dp}sp{r.sp}.{r.mode}.videos_per_hour").value,
                published(f"minimax.t2va.dp{r.dp}sp{r.sp}.{r.mode}.wave_p50").value,
            )
            for r in chosen
        ]
        ax1.plot(*zip(*pub), "x", ms=9, mew=2, color=COLORS["published"], label="published")
        ax1.set(xlabel="throughput (videos / h)", ylabel="wave latency (s)", title="T2VA serving frontier")
        ax1.legend(fontsize=7, loc="upper left")

        x = np.arange(len(TOPOLOGIES))
        for i, (mode, color) in enumerate((("allgather", COLORS["allgather"]), ("ranklocal", COLORS["h2d"]))):
            ax2.bar(
                x + (i - 0.5) * 0.38,
                [five[(mode, t)].energy_wh_per_video for t in TOPOLOGIES],
                0.38,
                color=color,
                label=MODE_LABEL[mode],
            )
        for r in chosen:
            i = TOPOLOGIES.index((r.dp, r.sp))
            p = published(f"minimax.t2va.dp{r.dp}sp{r.sp}.{r.mode}.energy_wh").value
            ax2.plot(i + (-0.19 if r.mode == "allgather" else 0.19), p, "x", ms=9, mew=2, color=COLORS["published"])
            err = round(100 * (r.energy_wh_per_video / p - 1), 1) + 0.0
            ax2.annotate(f"{r.energy_wh_per_video:.2f} Wh\n({err:+.1f}% vs pub.)", (i, 100), ha="center", fontsize=7)
        ax2.set(
            xticks=x,
            xticklabels=[f"DP{d}xSP{s}" for d, s in TOPOLOGIES],
            ylabel="energy per video (Wh)",
            ylim=(0, 110),
            title="energy per video (x: published, selected route)",
        )
        ax2.legend(fontsize=7)

        ax3.bar(
            x,
            [d.throughput_pct for d in deltas],
            0.5,
            color=COLORS["measured"],
            label="computed from the CSV (5 + 5 waves)",
        )
        for i, d in enumerate(deltas):
            p = published(f"minimax.delta.dp{d.dp}sp{d.sp}.throughput_pct").value
            ax3.plot(i, p, "x", ms=10, mew=2, color=COLORS["published"], label="published" if i == 0 else None)
            ax3.annotate(
                f"{d.throughput_pct:+.1f}%\n(pub. {p:+.1f}%)",
                (i, max(d.throughput_pct, 0)),
                ha="center",
                textcoords="offset points",
                xytext=(0, 6),
                fontsize=7,
            )
        ax3.axhline(0, color="k", lw=0.8)
        ax3.set(
            xticks=x,
            xticklabels=[f"DP{d}xSP{s}" for d, s in TOPOLOGIES],
            ylim=(-20, 150),
            ylabel="AllGather vs rank-local throughput (%)",
            title="paired mode comparison",
        )
        ax3.legend(fontsize=7, loc="upper right")
        best = {t: max(MODE_LABEL, key=lambda m: five[(m, t)].videos_per_hour) for t in TOPOLOGIES}
        fig.suptitle(
            "MiniMax-H3, 8x B300: the faster DLO mode depends on topology ("
            + ", ".join(f"DP{d}xSP{s}: {MODE_LABEL[best[(d, s)]]}" for d, s in TOPOLOGIES)
            + ")"
        )
        fig.tight_layout()
        paths.insert(0, save_png(fig, out_dir / "fig7_minimax_frontier.png"))
    return paths


def fig8_minimax_tasks(out_dir: pathlib.Path, data_dir: pathlib.Path = DATA_DIR) -> list[pathlib.Path]:
    """FL2VA and Ref2VA change absolute latency and throughput but keep the DP1xSP8 -> DP4xSP2 -> DP8xSP1
    ordering: each step right buys throughput with latency (n = 5 waves per route)."""
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    cases = load_cases(data_dir)
    routes = task_frontiers(cases)
    rows = [route_row(r, True) for rs in routes.values() for r in rs]
    paths = [write_csv(out_dir / "data" / "fig8_minimax_tasks.csv", rows, list(rows[0]))]
    ordered = all(frontier_ordered(rs) for rs in routes.values())
    colors = {"t2va": COLORS["compute"], "fl2va": COLORS["allgather"], "ref2va": COLORS["h2d"]}
    offsets = {"t2va": (6, -12), "fl2va": (-62, 6), "ref2va": (6, -4)}
    with figure_style():
        fig, ax = plt.subplots(figsize=(6.8, 4.4))
        for task, rs in routes.items():
            ax.plot(
                [r.videos_per_hour for r in rs], [r.p50_s for r in rs], "-o", color=colors[task], label=task.upper()
            )
            for r in rs:
                ax.plot([r.videos_per_hour] * len(r.waves_s), r.waves_s, ".", ms=3, alpha=0.5, color=colors[task])
                ax.annotate(
                    r.label,
                    (r.videos_per_hour, r.p50_s),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=offsets[task],
                    color=colors[task],
                )
        verdict = "the same" if ordered else "NOT the same"
        ax.set(
            xlabel="throughput (videos / h)",
            ylabel="wave latency (s); dots: every wave, line: P50",
            title=f"{verdict} DP1xSP8 -> DP4xSP2 -> DP8xSP1 ordering for every task\n"
            "(AllGather at DP1xSP8 and DP4xSP2, rank-local at DP8xSP1; 5 waves each)",
        )
        ax.legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        paths.insert(0, save_png(fig, out_dir / "fig8_minimax_tasks.png"))
    return paths


FIGURES = {"fig7_minimax_frontier": fig7_minimax_frontier, "fig8_minimax_tasks": fig8_minimax_tasks}
