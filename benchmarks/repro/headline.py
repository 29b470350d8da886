"""The README's headline: which ``bench real`` reports it draws, and its alt text and caption, from their data.

:func:`find_real_reports` picks the committed reports (``figures/data/bench_real_<model>_<machine>.json``, quick
CPU runs left out) of the machine with the most models, each joined by the rows of runs of their own
(``bench_real_<model>_<what>_<machine>.json``, each ratio to its own run's resident forward).
``benchmarks.figures.real`` draws them; :func:`headline` writes the image line and its caption that
``benchmarks.repro.doc_tables`` renders into README.md, so every number the caption quotes is one the figure shows.
"""

from __future__ import annotations

import json
import pathlib
import re

from benchmarks.repro.data import DATA_DIR

__all__ = ["MODEL_ORDER", "TITLES", "find_real_reports", "timed", "panel_title", "headline"]

MODEL_ORDER = ("flux", "wan480", "wan720", "ltx")
TITLES = {"flux": "FLUX.1-dev", "wan480": "Wan2.1-T2V-14B", "wan720": "Wan2.1-T2V-14B", "ltx": "LTX-Video"}


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


def timed(report: dict) -> list[dict]:
    """The timed rows, FP8 shards' and adapters' left out: the headline sets offloading against the bound at the
    model's own precision, where every output is the resident one (FP8 against BF16: docs/measurements.md#fp8-shards;
    adapters against the resident model with the adapter: #lora-adapters-after-offload)."""
    skip = ("ours-fp8", "ours-lora", "resident-lora")
    return [
        v
        for v in report["model"]["variants"]
        if v.get("status") == "ok" and v.get("ratio_to_bound") and not v["variant"].startswith(skip)
    ]


def panel_title(model: dict) -> str:
    """``FLUX.1-dev 1024x1024``: the model and its workload (``xF`` frames for video, ``, CFG`` for batch 2)."""
    w = model["workload"]
    shape = f"{w['width']}x{w['height']}" + (f"x{w['frames']}" if w["frames"] > 1 else "")
    return f"{TITLES.get(model['name'], model['name'])} {shape}" + (", CFG" if w["batch"] > 1 else "")


def _span(values: list[float], fmt: str) -> str:
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def headline(reports: list[dict], figure: str = "figures/fig_bench_real.png") -> str:
    """The README's image line (alt text: every model and workload drawn) and its caption: the ratio to the bound
    of ours (2 slots), of diffusers' group offloading (block and leaf level) and of a whole-model move per forward,
    each as the range over the models that ran it; time to ready; whether every output equals resident."""
    if not reports:
        return "(no `bench real` report committed)"
    by = [{v["variant"]: v for v in timed(r)} for r in reports]
    device = reports[0]["machine"].get("device_name", reports[0]["machine"].get("platform", "?"))

    def ratios(variant: str) -> str:
        got = [b[variant]["ratio_to_bound"] for b in by if variant in b]
        if not got:
            return "not measured"
        text = _span(got, ".3f" if max(got) < 10 else ".0f") + "x"
        return text if len(got) == len(by) else f"{text} ({len(got)} of {len(by)} workloads)"

    models = "; ".join(panel_title(r["model"]) for r in reports)
    alt = f"One forward per offload variant over its bound on one {device}: {models}"
    sizes = {TITLES.get(r["model"]["name"], r["model"]["name"]): r["model"]["block_bytes"] / 1e9 for r in reports}
    ready = [b["ours-rank-local"]["ready_s"] for b in by if b.get("ours-rank-local", {}).get("ready_s")]
    same = all(v.get("equal_to_resident") is not False for r in reports for v in timed(r))
    caption = (
        ", ".join(f"{name} ({gb:.1f} GB)" for name, gb in sizes.items())
        + f" at their published configs with random weights, one {device}, through "
        f"`load_model` + `offload`: ours (2 slots) runs a forward at {ratios('ours-rank-local')} of the bound "
        f"(max(resident forward, block bytes / pinned copy rate)) where diffusers' group offloading takes "
        f"{ratios('diffusers-block')} at block level and {ratios('diffusers-leaf')} at leaf level, and a "
        f"whole-model move per forward (`enable_model_cpu_offload`'s hook) {ratios('model-offload')}; ours is "
        f"ready in {_span(ready, '.1f')} s; "
        + ("every output byte-identical to resident" if same else "NOT every output equal to resident")
        + " ([data](@/docs/measurements.md#users-own-models))."
    )
    return f"![{alt}](@/{figure})\n*{caption}*"
