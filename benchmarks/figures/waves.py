"""Figure 5 (a DP wave, drawn from a real recorded wave) and our CPU wave scaling, from committed data.

* ``fig5_dp_waves``: reads ``figures/data/waves_fig5_trace.csv`` (recorded once by ``python -m benchmarks bench
  waves`` on 2 CPU ranks: one full wave and one partial wave, 2 denoising steps of the 4-block tiny DiT) and
  draws, per rank, the control messages (one broadcast per wave, results back to rank 0), the H2D of its own
  shard, the all-gathers that rebuild every block on both ranks, and the block computes, coloured by the wave
  position of the request they serve. In the partial wave rank 1 has no request: it only serves its shards.
* ``waves_cpu_scaling``: reads ``figures/data/waves_cpu.csv`` (same command) and plots outputs/s and the
  efficiency against ideal (dp x the resident single-request rate) vs R for each dp.

Both only read committed measurements (through :mod:`benchmarks.repro.waves_tables`), so regenerating them
changes no byte.
"""

from __future__ import annotations

import pathlib

from benchmarks.figures.style import COLORS, figure_style, save_png, write_csv
from benchmarks.repro.waves_tables import TRACE_FIELDS, read_scaling, read_trace

__all__ = ["FIGURES", "fig5_dp_waves", "waves_cpu_scaling"]

LANES = ("control", "h2d", "allgather", "compute")
LANE_NAMES = {"control": "control", "h2d": "H2D shard", "allgather": "all-gather", "compute": "compute"}
REQUEST_COLORS = (COLORS["compute"], COLORS["predicted"], COLORS["measured"], COLORS["published"])


def _plot_wave(ax, rows: list[dict], ranks: list[int]) -> None:
    y_of = {}
    ticks, names = [], []
    for i, rank in enumerate(ranks):
        for j, lane in enumerate(LANES):
            y = -(i * (len(LANES) + 1) + j)
            y_of[(rank, lane)] = y
            ticks.append(y)
            names.append(f"rank {rank} {LANE_NAMES[lane]}")
    end = max(r["end_s"] for r in rows)
    for r in rows:
        y = y_of[(r["rank"], r["lane"])]
        start, width = 1e3 * r["start_s"], 1e3 * max(r["end_s"] - r["start_s"], 0.0)
        if r["lane"] == "compute":
            pos = int(r["label"].split()[0][1:])
            color = REQUEST_COLORS[pos % len(REQUEST_COLORS)]
        else:
            color = {"h2d": COLORS["h2d"], "allgather": COLORS["allgather"]}.get(r["lane"], COLORS["other"])
        if width < 1e3 * end / 400:  # instant events (a message arriving): a tick mark
            ax.plot([start, start], [y - 0.4, y + 0.4], color=color, lw=1.5)
        else:
            ax.barh(y, width, left=start, height=0.8, color=color, edgecolor="white", linewidth=0.3)
        if r["lane"] == "control" and r["rank"] == 0:
            ax.annotate(r["label"], (start, y + 0.45), fontsize=7, va="bottom")
    ax.set_yticks(ticks, names, fontsize=7)
    ax.set_xlabel("ms since the wave was dispatched")
    ax.grid(axis="y", visible=False)


def fig5_dp_waves(out_dir: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib.pyplot as plt

    rows = read_trace()
    waves = sorted({r["wave"] for r in rows})
    ranks = sorted({r["rank"] for r in rows})
    with figure_style():
        fig, axes = plt.subplots(1, len(waves), figsize=(6.2 * len(waves), 3.6), sharey=True)
        axes = [axes] if len(waves) == 1 else list(axes)
        for ax, wave in zip(axes, waves):
            wr = [r for r in rows if r["wave"] == wave]
            kind = wr[0]["kind"]
            busy = {rank: any(r["lane"] == "compute" and r["rank"] == rank for r in wr) for rank in ranks}
            who = ", ".join(f"rank {k}: {'its own request' if v else 'idle (shards only)'}" for k, v in busy.items())
            _plot_wave(ax, wr, ranks)
            ax.set_title(f"wave {wave} ({kind}): {who}", fontsize=8)
        handles = [
            plt.Rectangle((0, 0), 1, 1, color=c)
            for c in (COLORS["h2d"], COLORS["allgather"], REQUEST_COLORS[0], REQUEST_COLORS[1])
        ]
        fig.legend(
            handles,
            [
                "H2D of the local shard",
                "all-gather (rebuilds the block on every rank)",
                "compute, request at position 0",
                "compute, request at position 1",
            ],
            loc="lower center",
            ncol=4,
            fontsize=7,
        )
        fig.suptitle(
            "Figure 5, measured on 2 CPU ranks: one broadcast per wave, each rank computes a different "
            "request, every block's all-gather is shared; an idle rank still serves its shards",
            fontsize=9,
        )
        fig.tight_layout(rect=(0, 0.08, 1, 0.94))
        png = save_png(fig, out_dir / "fig5_dp_waves.png")
    data = write_csv(out_dir / "data" / "waves_fig5_trace.csv", rows, TRACE_FIELDS)
    return [png, data]


def waves_cpu_scaling(out_dir: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib.pyplot as plt

    rows = read_scaling()
    fields = list(rows[0].keys())
    with figure_style():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.5, 3.4))
        for dp, color in zip(
            sorted({int(r["dp"]) for r in rows}),
            (COLORS["measured"], COLORS["allgather"], COLORS["compute"], COLORS["h2d"]),
        ):
            full = sorted(
                (r for r in rows if int(r["dp"]) == dp and r["kind"] == "full"),
                key=lambda r: int(r["requests_per_rank"]),
            )
            xs = [int(r["requests_per_rank"]) for r in full]
            ax1.plot(xs, [float(r["outputs_per_s"]) for r in full], "o-", color=color, label=f"dp {dp}, full waves")
            ax2.plot(xs, [float(r["efficiency"]) for r in full], "o-", color=color, label=f"dp {dp}")
            single = [r for r in rows if int(r["dp"]) == dp and r["kind"] == "single"]
            if single:
                ax1.axhline(
                    float(single[0]["outputs_per_s"]), color=color, ls=":", lw=1, label=f"dp {dp}, one request per wave"
                )
        base = [r for r in rows if r["kind"] == "resident"]
        if base:
            ax1.axhline(float(base[0]["outputs_per_s"]), color=COLORS["other"], ls="--", lw=1, label="resident, 1 rank")
        ax1.set_xlabel("R (requests per rank per wave)")
        ax1.set_ylabel("outputs / s")
        ax1.legend(fontsize=7)
        ax2.axhline(1.0, color=COLORS["other"], ls="--", lw=1)
        ax2.set_xlabel("R (requests per rank per wave)")
        ax2.set_ylabel("efficiency vs dp x resident rate")
        ax2.set_ylim(0, 1.2)
        ax2.legend(fontsize=7)
        for ax in (ax1, ax2):
            ax.set_xticks(sorted({int(r["requests_per_rank"]) for r in rows}))
        fig.suptitle(
            f"CPU waves ({rows[0]['machine'].split(',')[0]}): more requests per rank amortise each "
            f"block load; dp 2 on 2 cores",
            fontsize=9,
        )
        fig.tight_layout()
        png = save_png(fig, out_dir / "waves_cpu_scaling.png")
    data = write_csv(out_dir / "data" / "waves_cpu.csv", rows, fields)
    return [png, data]


FIGURES = {"fig5_dp_waves": fig5_dp_waves, "waves_cpu_scaling": waves_cpu_scaling}
