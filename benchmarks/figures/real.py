"""Users' own models: one denoising forward per offload variant against the bound, from `bench real`'s JSON.

Reads the committed ``figures/data/bench_real_<model>_<machine>.json`` (``python -m benchmarks bench real`` on a GPU;
quick CPU runs, ``*_quick.json``, are ignored); the machine with the most models wins. Rows of runs of their own
(``bench_real_<model>_<what>_<machine>.json``, each ratio to its own run's resident forward) join their model's.
The figure is registered only once such data is committed, so ``python -m benchmarks figures`` skips it until then.
"""

from __future__ import annotations

import json
import pathlib
import re
import textwrap

from benchmarks.figures.style import COLORS, figure_style, save_png, write_csv
from benchmarks.repro.data import DATA_DIR
from benchmarks.repro.variants import REAL, short_labels

__all__ = ["FIGURES", "find_real_reports", "real_rows", "plot_bench_real", "fig_bench_real"]

MODEL_ORDER = ("flux", "wan480", "wan720", "ltx")
TITLES = {"flux": "FLUX.1-dev", "wan480": "Wan2.1-T2V-14B", "wan720": "Wan2.1-T2V-14B", "ltx": "LTX-Video"}
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


def find_real_reports(data_dir: pathlib.Path = DATA_DIR) -> list[dict]:
    """The committed reports of one machine, in :data:`MODEL_ORDER` (empty when none is committed)."""
    by_machine: dict[str, dict[str, pathlib.Path]] = {}
    for path in sorted(pathlib.Path(data_dir).glob("bench_real_*.json")):
        m = re.fullmatch(r"bench_real_([a-z0-9]+)_(.+)\.json", path.name)
        if m and m.group(1) in MODEL_ORDER and not m.group(2).endswith("quick"):
            by_machine.setdefault(m.group(2), {})[m.group(1)] = path
    if not by_machine:
        return []
    machine = max(sorted(by_machine), key=lambda k: len(by_machine[k]))
    files = by_machine[machine]
    reports = {m: json.loads(files[m].read_text()) for m in MODEL_ORDER if m in files}
    for extra in sorted(k for k in by_machine if k.endswith("_" + machine)):  # rows measured in runs of their own
        for m, path in by_machine[extra].items():
            if m in reports:
                reports[m]["model"]["variants"] += [
                    v for v in json.loads(path.read_text())["model"]["variants"] if v["variant"] != "resident"
                ]
    return list(reports.values())


def _timed(report: dict) -> list[dict]:
    """The timed rows, FP8 shards' left out: this figure sets offloading against the bound at the model's own
    precision, where every output is the resident one (FP8 against BF16: docs/measurements.md#fp8-shards)."""
    return [
        v
        for v in report["model"]["variants"]
        if v.get("status") == "ok" and v.get("ratio_to_bound") and not v["variant"].startswith("ours-fp8")
    ]


def real_rows(reports: list[dict]) -> list[dict]:
    rows = []
    for r in reports:
        for v in _timed(r):
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
    w = model["workload"]
    shape = f"{w['width']}x{w['height']}" + (f"x{w['frames']}" if w["frames"] > 1 else "")
    cfg = ", CFG" if w["batch"] > 1 else ""
    return (
        f"{TITLES.get(model['name'], model['name'])} {shape}{cfg}\n{model['block_bytes'] / 1e9:.1f} GB in "
        f"{model['num_blocks']} blocks; {model['bound']}-bound: {model['bound_s'] * 1e3:.0f} ms"
    )


def _finding(reports: list[dict]) -> str:
    parts = []
    for r in reports:
        ratio = {v["variant"]: v["ratio_to_bound"] for v in _timed(r)}
        ours = ratio.get("ours-rank-local")
        if ours is None:
            continue
        text = f"{TITLES.get(r['model']['name'], r['model']['name'])}: ours {ours:.3f}x the bound"
        if "diffusers-block" in ratio:
            text += f", diffusers {ratio['diffusers-block']:.2f}x"
        parts.append(text)
    same = all(v.get("equal_to_resident") is not False for r in reports for v in _timed(r))
    device = reports[0]["machine"].get("device_name", reports[0]["machine"].get("platform", "?"))
    return (
        f"One forward on {device}, random weights at the published configs: "
        + "; ".join(parts)
        + ("; every output byte-identical to resident" if same else "; NOT every output equals resident")
    )


def plot_bench_real(reports: list[dict], out_dir: pathlib.Path, name: str = "fig_bench_real") -> list[pathlib.Path]:
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    paths = [write_csv(out_dir / "data" / f"{name}.csv", real_rows(reports), FIELDS)]
    with figure_style():
        fig, axes = plt.subplots(1, len(reports), figsize=(5.4 * len(reports), 3.8), squeeze=False)
        for ax, r in zip(axes[0], reports):
            rows = _timed(r)
            values = [min(v["ratio_to_bound"], X_MAX) for v in rows]
            y = list(range(len(rows)))
            ax.barh(y, values, color=[_color(v["variant"]) for v in rows])
            for i, v in enumerate(rows):
                mark = "" if v.get("equal_to_resident") is not False else "  (differs!)"
                ax.text(
                    values[i],
                    i,
                    f" {v['ratio_to_bound']:.3f}x, {v['forward_s'] * 1e3:.0f} ms{mark}",
                    va="center",
                    fontsize=7.5,
                )
            ax.axvline(1.0, color="black", lw=1)
            ax.axvline(1.01, color="black", lw=0.8, ls="--")
            ax.set_yticks(y, [LABELS.get(v["variant"], v["variant"]) for v in rows])
            ax.invert_yaxis()
            ax.set_xlim(0, X_MAX * 1.45)
            ax.set_title(_panel_title(r["model"]), fontsize=9)
            ax.set_xlabel("forward time / bound  (dashed: +1%)")
        fig.suptitle(textwrap.fill(_finding(reports), width=int(14 * fig.get_figwidth())), fontsize=9)
        fig.tight_layout()
        paths.insert(0, save_png(fig, out_dir / f"{name}.png"))
    return paths


def fig_bench_real(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Forward time over the bound max(resident, block bytes / pinned peak) for every variant, per model."""
    reports = find_real_reports()
    return plot_bench_real(reports, out_dir) if reports else []


# Registered only once the data is committed: without it there is nothing to draw (and nothing to compare).
FIGURES = {"fig_bench_real": fig_bench_real} if find_real_reports() else {}
