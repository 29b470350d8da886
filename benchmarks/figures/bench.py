"""Benchmark figure: one denoising pass per offload variant, against the bound, from `bench step`'s JSON.

Reads the committed ``figures/data/bench_step_<machine>.json`` (written by ``python -m benchmarks bench step`` on
a GPU; quick CPU smoke runs, ``*_quick.json``, are ignored). No JSON, no figure.
"""

from __future__ import annotations

import json
import pathlib
import textwrap

from benchmarks.figures.style import COLORS, figure_style, save_png, write_csv
from benchmarks.repro.data import DATA_DIR
from benchmarks.repro.variants import STEP, short_labels

__all__ = ["FIGURES", "fig_bench_step", "fig_bench_small40", "plot_bench_step", "bench_rows", "find_bench_json"]

FIELDS = (
    "workload",
    "variant",
    "step_s",
    "ratio_to_resident",
    "ratio_to_bound",
    "h2d_GB_per_s",
    "h2d_fraction_of_peak",
    "proxy_host_us_per_block",
    "host_ms_per_step",
    "equal_to_resident",
    "peak_device_GB",
    "weight_device_GB_planned",
)
LABELS = short_labels(STEP)
COLOR = {
    "resident": COLORS["other"],
    "diffusers": COLORS["published"],
    "diffusers-record-stream": COLORS["published"],
    "naive-sync": COLORS["measured"],
}


def find_bench_json(data_dir: pathlib.Path = DATA_DIR, pattern: str = "bench_step_*.json") -> pathlib.Path | None:
    found = sorted(p for p in pathlib.Path(data_dir).glob(pattern) if not p.stem.endswith("_quick"))
    return found[0] if found else None


def bench_rows(report: dict) -> list[dict]:
    rows = []
    for w in report["workloads"]:
        for r in w["variants"]:
            rows.append(
                {
                    "workload": w["name"],
                    "variant": r["variant"],
                    "step_s": r["step_s"],
                    "ratio_to_resident": r["ratio_to_resident"],
                    "ratio_to_bound": r["ratio_to_bound"],
                    "h2d_GB_per_s": r["h2d_bytes_per_s"] / 1e9,
                    "h2d_fraction_of_peak": r["h2d_fraction_of_peak"],
                    "proxy_host_us_per_block": r.get("proxy_host_us_per_block", ""),
                    "host_ms_per_step": 1e3 * r["host_s"] if "host_s" in r else "",
                    "equal_to_resident": r.get("equal_to_resident", ""),
                    "peak_device_GB": r["peak_device_bytes"] / 1e9,
                    "weight_device_GB_planned": r.get("weight_device_bytes_planned", 0) / 1e9,
                }
            )
    return rows


def _title(report: dict) -> str:
    parts = []
    for w in report["workloads"]:
        ratio = {r["variant"]: r["ratio_to_bound"] for r in w["variants"]}
        ours = ratio.get(
            "dlo-rank-local", min((v for k, v in ratio.items() if k.startswith("dlo-")), default=float("nan"))
        )
        text = f"{w['name']}: ours {ours:.3f}x bound"
        if "diffusers" in ratio:
            text += f", diffusers {ratio['diffusers']:.3f}x"
        if "naive-sync" in ratio:
            text += f", naive {ratio['naive-sync']:.2f}x"
        parts.append(text)
    device = report["machine"].get("device_name", report["machine"].get("platform", "?"))
    return f"One pass over {report['num_blocks']} blocks on {device}: " + "; ".join(parts)


def plot_bench_step(report: dict, out_dir: pathlib.Path, name: str = "fig_bench_step") -> list[pathlib.Path]:
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    rows = bench_rows(report)
    paths = [write_csv(out_dir / "data" / f"{name}.csv", rows, FIELDS)]
    workloads = report["workloads"]
    with figure_style():
        fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 3.6), squeeze=False)
        for ax, w in zip(axes[0], workloads):
            variants = w["variants"]
            names = [LABELS.get(r["variant"], r["variant"]) for r in variants]
            values = [r["ratio_to_bound"] for r in variants]
            colors = [COLOR.get(r["variant"], COLORS["compute"]) for r in variants]
            y = range(len(variants))
            ax.barh(list(y), values, color=colors)
            for i, r in enumerate(variants):
                ax.text(values[i], i, f" {r['step_s'] * 1e3:.0f} ms", va="center", fontsize=8)
            ax.axvline(1.0, color="black", lw=1)
            ax.axvline(1.02, color="black", lw=0.8, ls="--")
            ax.set_yticks(list(y), names)
            ax.invert_yaxis()
            ax.set_xlim(0, max(values) * 1.25)
            bound = "PCIe" if w["transfer_s_at_peak"] > w["resident_s"] else "compute"
            ax.set_title(
                f"{w['name']} {w['width']}x{w['height']}x{w['frames']} CFG\n({bound}-bound: "
                f"{w['bound_s'] * 1e3:.0f} ms)",
                fontsize=9,
            )
            ax.set_xlabel("step time / bound  (dashed: +2% target)")
        fig.suptitle(textwrap.fill(_title(report), width=int(13 * fig.get_figwidth())), fontsize=9)
        fig.tight_layout()
        paths.insert(0, save_png(fig, out_dir / f"{name}.png"))
    return paths


def fig_bench_step(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Step time of every variant over the bound max(resident compute, weight bytes / pinned peak)."""
    path = find_bench_json()
    if path is None:
        return []
    return plot_bench_step(json.loads(path.read_text()), out_dir)


def fig_bench_small40(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """The same for many small blocks (40 x 75 MB, 1024^2 CFG), where host work per block is not hidden."""
    path = find_bench_json(pattern="bench_small40_*.json")
    if path is None:
        return []
    return plot_bench_step(json.loads(path.read_text()), out_dir, "fig_bench_small40")


FIGURES = {"fig_bench_step": fig_bench_step, "fig_bench_small40": fig_bench_small40}
