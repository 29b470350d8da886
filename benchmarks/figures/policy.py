"""The topology policy beside measurement (:mod:`benchmarks.repro.policy_tables`).

``fig_policy``: left, the H200 slots run (``figures/data/slots_auto_h200.csv``): per-output step over its bound
for each workload, mode and slot count, the probe-driven ``auto`` choice marked, the 1.02x target drawn; right,
MiniMax-H3 on 8x B300: AllGather vs rank-local throughput delta at each route, published vs the policy's
prediction. The right panel is pure model output; the left reads only committed data, so regenerating changes no
byte.
"""

from __future__ import annotations

import pathlib

from benchmarks.figures.style import COLORS, figure_style, save_png, write_csv
from benchmarks.repro.policy_tables import h200_rows, minimax_delta_rows

__all__ = ["FIGURES", "fig_policy"]

FIELDS = (
    "workload",
    "mode",
    "slots",
    "choice",
    "per_output_step_ms",
    "bound_ms",
    "ratio_to_bound",
    "probe_predicted_ms",
    "same_bytes",
)


def fig_policy(out_dir: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    rows, deltas = h200_rows(), minimax_delta_rows()
    with figure_style():
        fig, (ax, ax_d) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": (1.6, 1)})
        labels = [f"{r['workload']}\n{r['mode']}\nS{r['slots']}" for r in rows]
        colors = [COLORS["h2d"] if r["mode"] == "rank-local" else COLORS["allgather"] for r in rows]
        ax.bar(
            range(len(rows)),
            [r["ratio_to_bound"] for r in rows],
            color=colors,
            edgecolor=["black" if r["choice"] == "auto" else "none" for r in rows],
            linewidth=1.5,
        )
        ax.axhline(1.02, color=COLORS["published"], linestyle="--", linewidth=1, label="1.02x target")
        for i, r in enumerate(rows):
            ax.annotate(
                f"{r['ratio_to_bound']:.3f}" + (" auto" if r["choice"] == "auto" else ""),
                (i, r["ratio_to_bound"]),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                fontsize=7,
            )
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylim(0.95, 1.06)
        ax.set_ylabel("per-output step / max(resident, bytes / pinned peak)")
        ax.set_title("one H200, 24 steps, R = 1 (outlined: the probe-driven auto choice)")
        ax.legend(loc="upper left")
        x = range(len(deltas))
        ax_d.bar(
            [i - 0.2 for i in x],
            [d["published_pct"] for d in deltas],
            width=0.38,
            color=COLORS["published"],
            label="published",
        )
        ax_d.bar(
            [i + 0.2 for i in x],
            [d["predicted_pct"] for d in deltas],
            width=0.38,
            color=COLORS["predicted"],
            label="policy",
        )
        ax_d.axhline(0, color="black", linewidth=0.8)
        ax_d.set_xticks(list(x), [f"{d['route']}\nchooses {d['policy_chooses']}" for d in deltas], fontsize=7)
        ax_d.set_ylabel("AllGather vs rank-local throughput (%)")
        ax_d.set_title("MiniMax-H3, 8x B300")
        ax_d.legend()
        auto = [r for r in rows if r["choice"] == "auto"]
        worst = max(auto, key=lambda r: r["ratio_to_bound"])
        signs = ", ".join(
            f"{d['route']} {d['published_pct']:+.1f}% vs {d['predicted_pct']:+.1f}%"
            + ("" if d["choice_matches"] else " (missed)")
            for d in deltas
        )
        fig.suptitle(
            f"Slots: the probe-driven choice is within {max(r['ratio_to_bound'] for r in auto):.3f}x of "
            f"the bound in every case (worst: {worst['workload']} {worst['mode']} S{worst['slots']}); "
            f"auto took {', '.join(sorted({str(r['slots']) for r in auto}))} slot(s).\n"
            f"Mode, published vs predicted: {signs}",
            fontsize=9,
        )
        fig.tight_layout()
        png = save_png(fig, out_dir / "fig_policy.png")
    csv = write_csv(out_dir / "data" / "fig_policy.csv", rows, FIELDS)
    return [png, csv]


FIGURES = {"fig_policy": fig_policy}
