"""Users' own models: one denoising forward per offload variant against the bound, from `bench real`'s JSON.

Reads the committed ``bench real`` reports that :func:`benchmarks.repro.headline.find_real_reports` picks (one
machine's, each model joined by the rows of runs of its own) and draws one row per model. The README's alt text
and caption come from the same reports (:func:`benchmarks.repro.headline.headline`).
The figure is registered only once such data is committed, so ``python -m benchmarks figures`` skips it until then.
"""

from __future__ import annotations

import pathlib

from benchmarks.figures.style import COLORS, figure_style, save_png, write_csv
from benchmarks.repro.headline import find_real_reports, panel_title, timed
from benchmarks.repro.variants import REAL, short_labels

__all__ = ["FIGURES", "find_real_reports", "real_rows", "plot_bench_real", "fig_bench_real"]

LABELS = short_labels(REAL)
FIELDS = (
    "model",
    "variant",
    "forward_s",
    "ratio_to_bound",
    "ratio_to_resident",
    "equal_to_resident",
    "ready_s",
    "host_rss_GB",
    "pinned_GB",
    "peak_device_GB",
)
X_MAX = 2.0  # bars past this (whole-model offload) are drawn to the edge with their value written


def real_rows(reports: list[dict]) -> list[dict]:
    rows = []
    for r in reports:
        for v in timed(r):
            rows.append(
                {
                    "model": r["model"]["name"],
                    "variant": v["variant"],
                    "forward_s": v["forward_s"],
                    "ratio_to_bound": v["ratio_to_bound"],
                    "ratio_to_resident": v.get("ratio_to_resident"),
                    "equal_to_resident": v.get("equal_to_resident", ""),
                    "ready_s": v.get("ready_s") or "",
                    "host_rss_GB": v.get("host_rss_bytes", 0) / 1e9,
                    "pinned_GB": (v.get("pinned_bytes") or 0) / 1e9,
                    "peak_device_GB": v.get("peak_device_bytes", 0) / 1e9,
                }
            )
    return rows


def _color(variant: str) -> str:
    if variant == "resident":
        return COLORS["other"]
    return COLORS["compute"] if variant.startswith("ours-") else COLORS["published"]


def _panel_title(model: dict) -> str:
    return (
        f"{panel_title(model)}: {model['block_bytes'] / 1e9:.1f} GB, {model['num_blocks']} blocks, "
        f"bound {model['bound_s'] * 1e3:.0f} ms ({model['bound']})"
    )


def plot_bench_real(reports: list[dict], out_dir: pathlib.Path, name: str = "fig_bench_real") -> list[pathlib.Path]:
    """One row per model (legible at the README's width): a bar per variant, forward time over the bound."""
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    paths = [write_csv(out_dir / "data" / f"{name}.csv", real_rows(reports), FIELDS)]
    heights = [len(timed(r)) + 1.6 for r in reports]  # one unit per bar, plus the title and the axis
    with figure_style():
        fig, axes = plt.subplots(
            len(reports),
            1,
            figsize=(7.6, 0.24 * sum(heights) + 0.5),
            sharex=True,
            squeeze=False,
            gridspec_kw={"height_ratios": heights},
        )
        for ax, r in zip(axes[:, 0], reports):
            rows = timed(r)
            values = [min(v["ratio_to_bound"], X_MAX) for v in rows]
            y = list(range(len(rows)))
            ax.barh(y, values, color=[_color(v["variant"]) for v in rows], height=0.75)
            for i, v in enumerate(rows):
                mark = "" if v.get("equal_to_resident") is not False else "  (differs!)"
                ax.text(values[i], i, f" {v['ratio_to_bound']:.3f}x, {v['forward_s'] * 1e3:.0f} ms{mark}", va="center")
            ax.axvline(1.0, color="black", lw=1)
            ax.set_yticks(y, [LABELS.get(v["variant"], v["variant"]) for v in rows])
            ax.set_ylim(len(rows) - 0.5, -0.5)
            ax.set_xlim(0, X_MAX * 1.45)
            ax.set_title(_panel_title(r["model"]), loc="left", fontsize=9)
        axes[-1, 0].set_xlabel("forward time / bound (bound: max(resident forward, block bytes / pinned copy rate))")
        device = reports[0]["machine"].get("device_name", "?")
        fig.suptitle(f"One forward per offload variant, one {device}, random weights at the published configs")
        fig.tight_layout()
        paths.insert(0, save_png(fig, out_dir / f"{name}.png"))
    return paths


def fig_bench_real(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Forward time over the bound max(resident, block bytes / pinned peak) for every variant, per model."""
    reports = find_real_reports()
    return plot_bench_real(reports, out_dir) if reports else []


# Registered only once the data is committed: without it there is nothing to draw (and nothing to compare).
FIGURES = {"fig_bench_real": fig_bench_real} if find_real_reports() else {}
