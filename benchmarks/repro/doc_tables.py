"""Every measured table of ``README.md`` and ``docs/``, rendered as Markdown from the committed data.

A table sits in a Markdown file between ``<!-- table: NAME -->`` and ``<!-- /table -->``; :func:`refresh` rewrites
each such block from ``TABLES[NAME]()``. ``python -m benchmarks figures`` refreshes every file (:data:`DOC_FILES`), and
``tests/test_docs.py`` fails when a committed block differs from what its function renders now. So a new run
committed under ``figures/data/`` (same name, same schema) updates the docs by regeneration, never by hand.

Each table ends with a line naming its data file(s), the machine and the command inside them; the README's
headline block is its figure's image line and caption (:mod:`benchmarks.repro.headline`).
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any, Callable, Iterable

from benchmarks.repro import (
    continuous_tables,
    fp8_tables,
    headline,
    host_cost_tables,
    lora_tables,
    pcie_tables,
    policy_tables,
    real_tables,
    waves_tables,
)
from benchmarks.repro.data import DATA_DIR
from benchmarks.repro.variants import STEP, labels

__all__ = ["TABLES", "DOC_FILES", "markdown_table", "refresh", "render", "stale"]

ROOT = DATA_DIR.parents[1]
DOC_FILES = ("README.md", "docs/measurements.md", "docs/performance.md", "docs/serving.md")
_BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)

LABELS = labels(STEP)  # bench step's variants as the docs call them
CURRENT = (
    "resident",
    "dlo-rank-local-swap",
    "dlo-rank-local",
    "dlo-allgather",
    "dlo-rank-local-bgraph",
    "diffusers",
    "naive-sync",
)


def markdown_table(rows: Iterable[dict[str, Any]]) -> str:
    rows = list(rows)
    if not rows:
        return "(no rows)"
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in head) + " |" for r in rows]
    return "\n".join(lines)


def _json(name: str) -> dict[str, Any]:
    return json.loads((DATA_DIR / name).read_text())


def _source(files: Iterable[str], report: dict[str, Any] | None = None) -> str:
    names = ", ".join(f"[`{f}`](@/figures/data/{f})" for f in files)
    if report is None:
        return f"Data: {names}."
    machine = report.get("machine", {})
    device = machine.get("device_name", machine) if isinstance(machine, dict) else machine
    # a report written while `bench` was a command of the library names `python -m dlo_fn bench`: the same command
    # is the lab's now, and the docs give the one a reader can run
    command = report["command"].split(" --variants")[0].replace("python -m dlo_fn bench", "python -m benchmarks bench")
    return f"Data: {names} (one {device}; `{command} ...`)."


def _x(r: dict[str, Any]) -> str:
    return f"{r['ratio_to_bound']:.3f}x"


def bench_table(file: str, variants: Iterable[str] = CURRENT) -> str:
    """Per variant: step time against the bound per workload, host time per step, peak device memory, equal."""
    report = _json(file)
    wls = report["workloads"]
    by = [{r["variant"]: r for r in w["variants"]} for w in wls]
    rows = [
        {
            "": "bound = max(resident, bytes / pinned peak)",
            **{w["name"]: f"{1e3 * w['bound_s']:.1f} ms" for w in wls},
            "host ms per step": "",
            "peak device GB": "",
            "bytes equal to resident": "",
        }
    ]
    for v in (v for v in variants if all(v in b for b in by)):
        rs = [b[v] for b in by]
        rows.append(
            {
                "": LABELS.get(v, v),
                **{w["name"]: _x(r) for w, r in zip(wls, rs)},
                "host ms per step": " / ".join(f"{1e3 * r['host_s']:.1f}" for r in rs),
                "peak device GB": " / ".join(f"{r['peak_device_bytes'] / 1e9:.2f}" for r in rs),
                "bytes equal to resident": " / ".join(str(r.get("equal_to_resident", "-")) for r in rs),
            }
        )
    note = (
        ""
        if host_cost_tables.is_current(report)
        else " Its eager variants issued their stream operations as direct CUDA driver calls, where the runtime "
        "issues them through torch streams and events."
    )
    return markdown_table(rows) + "\n\n" + _source([file], report) + note


def step_graph_table() -> str:
    """Eager, block graphs and the step graph side by side, per run and workload: why the runtime has no step
    graphs."""
    rows = []
    for file in (
        "bench_step_nvidia-h200.json",
        "bgraph_bench_step_nvidia-h200.json",
        "bench_small40_nvidia-h200.json",
        "bgraph_bench_small40_nvidia-h200.json",
    ):
        report = _json(file)
        for w in report["workloads"]:
            v = {r["variant"]: r for r in w["variants"]}
            eager = v.get("dlo-rank-local-swap", v.get("dlo-rank-local"))
            if eager is None or "dlo-rank-local-bgraph" not in v or "dlo-rank-local-graph" not in v:
                continue  # a run without the step graph (it is no longer in the runtime)
            rows.append(
                {
                    "run": f"`{file}`",
                    "model, workload": f"{report['config']}, {w['name']}",
                    "eager": _x(eager),
                    "block graphs": _x(v["dlo-rank-local-bgraph"]),
                    "step graph": _x(v["dlo-rank-local-graph"]),
                    "peak GB eager / block graphs / step graph": " / ".join(
                        f"{v[k]['peak_device_bytes'] / 1e9:.2f}"
                        for k in (eager["variant"], "dlo-rank-local-bgraph", "dlo-rank-local-graph")
                    ),
                }
            )
    return markdown_table(rows) + "\n\n" + "Data: the files named in the first column (one NVIDIA H200)."


def weight_hbm_table() -> str:
    report = _json("bench_step_nvidia-h200.json")
    rows = []
    for w in report["workloads"]:
        for r in w["variants"]:
            if "weight_device_bytes" in r and r["variant"] in CURRENT:
                rows.append(
                    {
                        "workload": w["name"],
                        "variant": LABELS[r["variant"]],
                        "measured weight bytes": f"{r['weight_device_bytes']:,d}",
                        "planned": f"{r['weight_device_bytes_planned']:,d}",
                        "equal": r["weight_device_bytes"] == r["weight_device_bytes_planned"],
                    }
                )
    return markdown_table(rows) + "\n\n" + _source(["bench_step_nvidia-h200.json"], report)


def compile_table() -> str:
    report = _json("compile_small40_nvidia-h200.json")
    rows = [
        {
            "variant": LABELS[r["variant"]],
            "step ms": f"{1e3 * r['step_s']:.1f}",
            "x resident": f"{r['ratio_to_resident']:.3f}",
            "bytes equal to its resident": r["equal_to_resident"],
        }
        for r in report["workloads"][0]["variants"]
    ]
    return markdown_table(rows) + "\n\n" + _source(["compile_small40_nvidia-h200.json"], report)


def diffusers_table() -> str:
    """Per diffusers variant: in how many of the committed runs its output equalled the resident model's, and its
    step time over the bound across them."""
    files = ("diffusers_equality_small40_nvidia-h200.json", "diffusers_record_stream_small40_nvidia-h200.json")
    eq, rs = _json(files[0]), _json(files[1])
    runs: dict[str, list[tuple[float, bool]]] = {"diffusers": []}
    runs["diffusers"] += [(r["diffusers_x_bound"], r["diffusers_equal_to_resident"]) for r in eq["runs"]]
    for run in rs["runs"]:
        for r in run["rows"]:
            if r["variant"].startswith("diffusers"):
                runs.setdefault(r["variant"], []).append((r["ratio_to_bound"], r["equal_to_resident"]))
    rows = [
        {
            "variant": LABELS[v],
            "runs": len(got),
            "x bound (min-max)": f"{min(x for x, _ in got):.3f}x-{max(x for x, _ in got):.3f}x",
            "runs whose bytes equal resident": sum(bool(e) for _, e in got),
        }
        for v, got in runs.items()
    ]
    return markdown_table(rows) + "\n\n" + _source(files)


def torch_path_table() -> str:
    reports = [host_cost_tables.load(n) for n in host_cost_tables.BENCH_REPORTS]
    rows = host_cost_tables.torch_path_rows(*reports)
    if not rows:
        return (
            "No committed H200 run of the runtime as it is yet: this table fills from the first `bench step` "
            "report under `figures/data/` whose rows carry `stream_ops_per_block`."
        )
    return _rows(rows, [f"{n}_nvidia-h200.json" for n in host_cost_tables.BENCH_REPORTS])


def _rows(rows: list[dict], files: Iterable[str]) -> str:
    return markdown_table(rows) + "\n\n" + _source(files)


def results_table() -> str:
    """README's results: one ratio per row, each linking the doc that holds its method and data."""
    step, small = _json("bench_step_nvidia-h200.json"), _json("bench_small40_nvidia-h200.json")
    real, wan = (
        {v["variant"]: v for v in _json(f).get("model", {}).get("variants", ())}
        for f in (real_tables.REAL_FILE, real_tables.WAN_FILE)
    )

    hbm = {v["variant"]: v for v in _json(HBM_FILE)["model"]["variants"]}

    def x(report: dict, variant: str) -> str:
        return " / ".join(_x(r) for w in report["workloads"] for r in w["variants"] if r["variant"] == variant)

    ops = {r["load_group"]: float(r["per_block"]) for r in host_cost_tables.planned_rows(24, (1, 4))}
    r_rows = {int(r["R"]): r for r in waves_tables.h200_r_rows()}
    cont = {r["policy"]: r for r in continuous_tables.policy_rows(continuous_tables.load())}
    ref = float(host_cost_tables.published_rows()[-1]["us_per_block"])
    bg = [float(r["executor_us_per_block"]) for r in host_cost_tables.block_graph_host_rows(step, small)]
    b300 = policy_tables.b300_rows()[1]
    rows = [
        (
            "one step / bound, 24 blocks of 0.56 GB, one H200, video / image",
            x(step, "dlo-rank-local-swap"),
            "measurements.md#one-step-on-one-h200",
        ),
        ("the same with block graphs", x(step, "dlo-rank-local-bgraph"), "performance.md#block-graphs"),
        (
            "forward / bound, one H200, ours (2 slots) / diffusers group offloading (block_level): FLUX.1-dev 1024²; "
            "Wan2.1-14B 480p",
            "; ".join(
                " / ".join(f"{r[v]['ratio_to_bound']:.3f}x" for v in ("ours-rank-local", "diffusers-block"))
                for r in (real, wan)
            ),
            "measurements.md#users-own-models",
        ),
        (
            "FLUX.1-dev, FP8 shards (the policy's slots) / BF16 offloaded: bytes moved / forward time",
            f"{real['ours-fp8-auto']['h2d_bytes_per_forward'] / real['ours-rank-local']['h2d_bytes_per_forward']:.3f}"
            " / "
            f"{real['ours-fp8-auto']['forward_s'] / real['ours-rank-local']['forward_s']:.3f}",
            "measurements.md#fp8-shards",
        ),
        (
            "FLUX.1-dev forward / resident under an HBM budget, placed by measured compute: ours at 20 / 16 GB (device "
            "weights) / every block streamed; FP8 at 8 GB; accelerate's device map at 16 GiB",
            " / ".join(
                f"{hbm[v]['ratio_to_resident']:.3f}x ({hbm[v]['weight_device_bytes'] / 1e9:.1f} GB)"
                for v in ("ours-hbm-20GB", "ours-hbm-16GB", "ours-rank-local")
            )
            + f"; {hbm['ours-fp8-hbm-8GB']['ratio_to_resident']:.3f}x "
            f"({hbm['ours-fp8-hbm-8GB']['weight_device_bytes'] / 1e9:.1f} GB)"
            + f"; {hbm['accelerate-16GiB']['ratio_to_resident']:.2f}x",
            "measurements.md#resident-blocks-under-an-hbm-budget",
        ),
        (
            "one step / bound, 40 blocks of 75 MB: eager / block graphs",
            f"{x(small, 'dlo-rank-local-swap')} / {x(small, 'dlo-rank-local-bgraph')}",
            "measurements.md#many-small-blocks",
        ),
        (
            "per-output step / bound, R = 8 requests per loaded block, one H200",
            f"{r_rows[8]['ratio_to_bound']:.3f}x",
            "measurements.md#several-requests-per-loaded-block",
        ),
        (
            "stream operations per block, load groups of 4 / one load per block (planned = counted)",
            f"{ops[4] / ops[1]:.3f}",
            "performance.md#load-groups",
        ),
        (
            "host work per block, the reference (published) / ours with block graphs",
            f"{ref / max(bg):.0f}-{ref / min(bg):.0f}x",
            "performance.md#host-work-per-block",
        ),
        (
            "throughput, continuous / strict serving, a mixed trace on 2 CPU ranks",
            f"{cont['continuous']['throughput_requests_per_s'] / cont['strict']['throughput_requests_per_s']:.2f}x",
            "serving.md#measured",
        ),
        (
            "4 B300, 1024² throughput, DLO+AG DP4 / HSDP+USP4: published / our model",
            f"{b300['published']}x / {b300['predicted']:.2f}x",
            "measurements.md#published-results-reproduced",
        ),
    ]
    return markdown_table(
        {"result": r, "ratio": v, "method and data": f"[docs/{d.split('#')[0]}](@/docs/{d})"} for r, v, d in rows
    )


def _real(name: str, *own_runs: str, skip: tuple[str, ...] = ()) -> str:
    """``bench real``'s rows of ``name``, then those of runs of their own (``own_runs``: their resident rows left
    out, each ratio to its own run's), with every file named."""
    rows = real_tables.real_rows(name, skip)
    for other in own_runs:
        rows += real_tables.real_rows(other, skip=("resident",))
    return _rows(rows, [name, *own_runs])


HBM_FILE = "hbm_bench_real_flux_nvidia-h200.json"
HBM_ORDER = (
    "resident",
    "ours-rank-local",
    "ours-hbm-12GB",
    "ours-hbm-fastest",
    "ours-hbm-16GB",
    "ours-hbm-20GB",
    "ours-hbm-24GB",
    "ours-fp8",
    "ours-fp8-hbm-6GB",
    "ours-fp8-hbm-8GB",
    "ours-fp8-hbm-10GB",
    "ours-fp8-hbm-fastest",
    "accelerate-12GiB",
    "accelerate-16GiB",
)
HBM_WAN_FILE = "hbm_bench_real_wan480_nvidia-h200.json"
HBM_TIER_FILE = "hbm_tier_bench_real_flux_nvidia-h200.json"  # the device-stored tier against none, one run
HBM_STORED_FILE = "hbm_bench_real_flux_most_stored_nvidia-h200.json"  # plans that store the most shards


def _hbm_rows(model: str, file: str, order) -> list[dict]:
    """One run's budget rows (``order``: the variants, in table order, those the run has)."""

    def cell(v: dict, key: str, fmt: str) -> str:
        return "-" if v.get(key) is None else format(v[key], fmt)

    report = _json(file)
    rows = {v["variant"]: v for v in report["model"]["variants"]}
    blocks = report["model"]["num_blocks"]
    out = []
    for name in (n for n in (order or rows) if n in rows):
        v = rows[name]
        kept = blocks if name == "resident" else v.get("resident_blocks")
        stored = v.get("device_stored_block_ids")
        out.append(
            {
                "model": model,
                "variant": f"`{name}`",
                "device weights GB": f"{v['weight_device_bytes'] / 1e9:.2f}",
                "resident blocks": "-" if kept is None else f"{kept} of {blocks}",
                "device-stored": "-" if stored is None else str(len(stored)),
                "slots": "-" if kept == blocks else cell(v, "plan_num_slots", "d"),
                "H2D GB per forward": "-"
                if v.get("h2d_bytes_per_forward") is None
                else f"{v['h2d_bytes_per_forward'] / 1e9:.2f}",
                "predicted / compute": cell(v, "predicted_to_compute", ".3f"),
                "forward ms": f"{v['forward_s'] * 1e3:.1f}",
                "/ resident": cell(v, "ratio_to_resident", ".3f"),
                "/ own bound": cell(v, "ratio_to_own_bound", ".3f"),
                "equal": "-" if v.get("equal_to_resident") is None else str(v["equal_to_resident"]),
            }
        )
    return out


def hbm_budget_table() -> str:
    """FLUX.1-dev and Wan2.1-14B under HBM budgets: device weights, resident and device-stored blocks and slots,
    bytes streamed, the plan's predicted pass over the blocks' compute, time against resident and the row's own
    bound, byte-identical or not (measurements.md, "Resident blocks under an HBM budget")."""
    wan = None  # the run's variants, in its order
    out = _hbm_rows("FLUX.1-dev 1024²", HBM_FILE, HBM_ORDER) + _hbm_rows("Wan2.1-14B 480p", HBM_WAN_FILE, wan)
    return _rows(out, [HBM_FILE, HBM_WAN_FILE])


def hbm_tier_table() -> str:
    """FP8 budgets with and without the device-stored tier side by side, and the plans that store the most shards
    (measurements.md, "Device-stored shards")."""
    out = _hbm_rows("tier / host only", HBM_TIER_FILE, None) + _hbm_rows(
        "most stored", HBM_STORED_FILE, ("resident", "ours-fp8-hbm-6GB", "ours-fp8-hbm-8GB", "ours-fp8-hbm-10GB")
    )
    return _rows(out, [HBM_TIER_FILE, HBM_STORED_FILE])


TABLES: dict[str, Callable[[], str]] = {
    "headline": lambda: headline.headline(headline.find_real_reports()),  # README's figure, alt text and caption
    "results": results_table,
    "hbm-budget": hbm_budget_table,
    "hbm-tier": hbm_tier_table,
    "lora": lambda: _rows(lora_tables.lora_rows(), [lora_tables.LORA_FILE]),
    "lora-blocks": lambda: _rows(lora_tables.lora_block_rows(), [lora_tables.LORA_BLOCKS_FILE]),
    # the FP8 and gloo-rank rows of the Flux comparison are an earlier kernel's and set-up's: their own runs below
    "real-flux": lambda: _real(
        real_tables.REAL_FILE, real_tables.MODEL_OFFLOAD_FILE.format(model="flux"), skip=("ours-fp8", "ranks-")
    ),
    "real-wan": lambda: _real(real_tables.WAN_FILE, real_tables.MODEL_OFFLOAD_FILE.format(model="wan480")),
    "real-pipeline": lambda: _rows(real_tables.pipeline_rows(), [real_tables.FP8_FILE]),
    "real-ready": lambda: _rows(
        real_tables.ready_rows(), [real_tables.REAL_FILE, real_tables.READY_AFTER_FILE, real_tables.READY_FILE]
    ),
    "fp8-real": lambda: _rows(real_tables.fp8_rows(), [real_tables.REAL_FILE, real_tables.WAN_FP8_FILE]),
    "real-wan720": lambda: _real(real_tables.WAN720_FILE, real_tables.WAN720_DIFFUSERS_FILE),
    "real-ltx": lambda: _real(real_tables.LTX_FILE),
    "model-offload": lambda: _rows(
        real_tables.model_offload_rows(), [real_tables.MODEL_OFFLOAD_FILE.format(model=m) for m in ("flux", "wan480")]
    ),
    "link-share": lambda: _rows(pcie_tables.link_share_rows(), [pcie_tables.LINK_SHARE.name]),
    "fp8-quality-tiny": lambda: _rows(fp8_tables.quality_rows(), [fp8_tables.QUALITY_FILE]),
    "fp8-step-simulated": lambda: _rows(
        fp8_tables.pass_rows(fp8_tables.h200_passes()), [fp8_tables.FP8_STEP_FILE, "timeline_fp8.csv"]
    ),
    "core-before-after": lambda: _rows(real_tables.core_rows(), [real_tables.CORE_FILE]),
    "bench-step": lambda: bench_table("bench_step_nvidia-h200.json"),
    "bench-small40": lambda: bench_table(
        "bench_small40_nvidia-h200.json", (*CURRENT, "dlo-rank-local-swap-g2", "dlo-rank-local-swap-g4")
    ),
    "load-groups": lambda: bench_table("groups_bench_step_nvidia-h200.json", tuple(host_cost_tables.GROUP_VARIANTS)),
    "weight-hbm": weight_hbm_table,
    "compile": compile_table,
    "diffusers-equality": diffusers_table,
    "step-graphs": step_graph_table,
    "r-sweep": lambda: _rows(waves_tables.h200_r_rows(), ["waves_r_sweep_h200.csv"]),
    "published-b300": lambda: (
        markdown_table(policy_tables.b300_rows()) + "\n\n(Model: `benchmarks.repro.b300` through "
        "the policy; notebooks 07 and 09.)"
    ),
    "published-ascend": lambda: (
        markdown_table(policy_tables.ascend_rows()) + "\n\n(Model: `benchmarks.repro.wave_model`; notebooks 05 and 09.)"
    ),
    "slots-auto": lambda: _rows(policy_tables.h200_rows(), ["slots_auto_h200.csv", "slots_auto_h200.json"]),
    "serve-profile": lambda: _rows(policy_tables.serve_profile_rows(), ["serve_step_profile_h200.json"]),
    "continuous-cpu": lambda: _rows(continuous_tables.policy_rows(continuous_tables.load()), ["continuous_cpu.json"]),
    "continuous-loss": lambda: _rows(continuous_tables.loss_rows(continuous_tables.load()), ["continuous_cpu.json"]),
    "continuous-r-h200": lambda: _rows(continuous_tables.r_sweep_rows(), ["continuous_r_sweep_h200.csv"]),
    "continuous-scenarios": lambda: (
        markdown_table(continuous_tables.scenario_rows()) + "\n\n(Planned, not measured: "
        "`benchmarks.repro.continuous_tables.scenario_rows`.)"
    ),
    "stream-ops": lambda: (
        markdown_table(host_cost_tables.planned_rows(24, (1, 2, 4))) + "\n\n(Planned, "
        "`dlo_fn.cost.host_cost.planned_stream_ops`; the executor's count on the CPU "
        "equals it: `tests/test_host_cost_tables.py`.)"
    ),
    "block-graph-host": lambda: _rows(
        host_cost_tables.block_graph_host_rows(*(host_cost_tables.load(n) for n in host_cost_tables.BENCH_REPORTS)),
        [f"{n}_nvidia-h200.json" for n in host_cost_tables.BENCH_REPORTS],
    ),
    "torch-path-host": lambda: torch_path_table(),
}


def render(text: str, root_link: str = "") -> str:
    """``text`` with every table block rendered now (an unknown name raises ``KeyError``); ``root_link`` is the
    repository root relative to the file (``""`` for README.md, ``"../"`` under docs/), which links start from."""

    def block(m: re.Match) -> str:
        return m.group(1) + TABLES[m.group("name")]().replace("](@/", f"]({root_link}") + "\n" + m.group(4)

    return _BLOCK.sub(block, text)


def _root_link(doc: str) -> str:
    return "../" * doc.count("/")


def stale(root: pathlib.Path = ROOT) -> list[str]:
    """The doc files whose table blocks differ from what their functions render now."""
    return [
        f
        for f in DOC_FILES
        if (root / f).is_file() and render((root / f).read_text(), _root_link(f)) != (root / f).read_text()
    ]


def refresh(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """Rewrite every doc file's table blocks in place; return the files that changed."""
    changed = []
    for f in DOC_FILES:
        path = root / f
        if path.is_file():
            new = render(path.read_text(), _root_link(f))
            if new != path.read_text():
                path.write_text(new)
                changed.append(path)
    return changed
