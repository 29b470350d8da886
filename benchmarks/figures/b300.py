"""The published 4x B300 throughput tables beside the timeline model (:mod:`benchmarks.repro.b300`).

``fig_b300_throughput``: per published (workload, strategy) row, the published and predicted wave latency and
throughput, with the stream that bounds the predicted step named; pure model output
(:func:`benchmarks.repro.b300_tables.comparison_rows`, the table notebook 07 prints), so regenerating changes no
byte.
"""

from __future__ import annotations

import pathlib

from benchmarks.figures.style import COLORS, figure_style, save_png, write_csv
from benchmarks.repro.b300_tables import FIELDS, comparison_rows

__all__ = ["FIGURES", "fig_b300_throughput"]


def fig_b300_throughput(out_dir: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    rows = comparison_rows()
    labels = [f"{r['workload']}\n{r['strategy']}" for r in rows]
    y = range(len(rows))
    with figure_style():
        fig, (ax_w, ax_t) = plt.subplots(1, 2, figsize=(11, 6.5), sharey=True)
        for ax, col, xlabel in ((ax_w, "wave_s", "wave latency (s)"), (ax_t, "outputs_per_s", "outputs / s")):
            ax.barh(
                [i - 0.2 for i in y],
                [r[f"published_{col}"] for r in rows],
                height=0.38,
                color=COLORS["published"],
                label="published",
            )
            ax.barh(
                [i + 0.2 for i in y],
                [r[f"predicted_{col}"] for r in rows],
                height=0.38,
                color=COLORS["predicted"],
                label="predicted",
            )
            ax.set_xlabel(xlabel)
        for i, r in enumerate(rows):
            tag = f"{r['bound']}, {r['rel_error_pct']:+.0f}%" + (" (fit)" if r["note"] else "")
            ax_w.annotate(
                tag,
                (max(r["published_wave_s"], r["predicted_wave_s"]), i),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
        ax_w.set_yticks(list(y), labels, fontsize=7)
        ax_w.invert_yaxis()
        ax_w.set_xlim(0, 1.45 * max(max(r["published_wave_s"], r["predicted_wave_s"]) for r in rows))
        ax_t.legend(loc="lower right")
        fig.suptitle(
            "4x B300, Cosmos3-Super: images are bound by weight traffic (NVLink all-gather for HSDP, "
            "serial H2D + all-gather for DLO DP4),\nlong videos by compute; the FLOP model misses short "
            "videos (too fast) and 720p 241f (too slow)",
            fontsize=9,
        )
        fig.tight_layout()
        png = save_png(fig, out_dir / "b300_throughput.png")
    csv = write_csv(out_dir / "data" / "fig_b300_throughput.csv", rows, FIELDS)
    return [png, csv]


FIGURES = {"fig_b300_throughput": fig_b300_throughput}
