"""Memory figures of the seed (1, 3, 4, 6 and the host-capacity table), predicted by :mod:`dlo_fn.cost.memory`
and :mod:`dlo_fn.cost.hbm` and drawn beside the published numbers with the relative error.

The numbers come from :mod:`benchmarks.repro.memory_tables` (which states the deployment assumptions) and
:mod:`benchmarks.repro.memory_rows`; each figure writes its data as CSV under ``figures/data/``. Titles state the
finding.
"""

from __future__ import annotations

import pathlib

from benchmarks.figures.style import COLORS, figure_style, save_png, write_csv
from benchmarks.repro.memory_rows import (
    ACCOUNTING_FIELDS,
    HOST_WEIGHTS_DPS,
    ascend_accounting_columns,
    ascend_accounting_rows,
    hbm_bars,
    hbm_rows,
    host_weights_rows,
)
from benchmarks.repro.memory_tables import approach_rows, capacity_rows, measured_hbm_records, model_sizes
from benchmarks.repro.published import published
from dlo_fn.cost.memory import GB

__all__ = [
    "fig1_offload_vs_parallel",
    "fig3_host_weights_per_rank",
    "fig4_hbm",
    "fig6_ascend_memory_accounting",
    "table_host_capacity",
    "FIGURES",
]

HBM_GB = published("ascend.hbm_per_card").value
PARTS = (
    ("context", COLORS["other"]),
    ("resident", COLORS["measured"]),
    ("weights", COLORS["h2d"]),
    ("workload", COLORS["compute"]),
)
LABEL = {
    "context": "device context (calibrated)",
    "resident": "sharded / resident weights",
    "weights": "weight slots + landing",
    "workload": "activations + communication",
}


def _err(pred: float, pub: float) -> str:
    return f"{100 * (pred / pub - 1):+.1f}%"


def _stack(ax, x, parts: dict[str, float], width=0.6):
    bottom = 0.0
    for name, color in PARTS:
        value = parts.get(name, 0.0)
        ax.bar(x, value, width, bottom=bottom, color=color, label=LABEL[name] if x == 0 else None)
        bottom += value
    return bottom


def fig1_offload_vs_parallel(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Super on 4 cards: HSDP and TP keep a quarter of the model on every card (~58 GB with the 720p 10 s
    workload, under 64 GB by a few GB); layerwise pure DP and DLO keep two blocks, and DLO alone also cuts host
    weights to a quarter of the model per rank."""
    import matplotlib.pyplot as plt

    out_dir, rows = pathlib.Path(out_dir), approach_rows()
    paths = [write_csv(out_dir / "data" / "fig1_offload_vs_parallel.csv", rows, list(rows[0]))]
    names = {
        "hsdp": "HSDP (FSDP2)",
        "layerwise-dp": "layerwise\npure DP",
        "tp": "tensor\nparallel",
        "dlo": "DLO\n(AllGather)",
    }
    with figure_style():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for i, r in enumerate(rows):
            total = _stack(
                ax1,
                i,
                {
                    "context": r["context_gb"],
                    "resident": r["resident_weights_gb"],
                    "weights": r["slot_weights_gb"],
                    "workload": r["activations_comm_gb"],
                },
            )
            ax1.annotate(f"{total:.1f}", (i, total), ha="center", textcoords="offset points", xytext=(0, 3))
        pub = published("fig1.super.hsdp.hbm_per_card")
        ax1.plot(0.33, pub.value, "x", ms=10, mew=2, color=COLORS["published"], label="published (~56 GB)")
        ax1.annotate(
            _err(rows[0]["hbm_per_card_gb"], pub.value),
            (0.33, pub.value),
            textcoords="offset points",
            xytext=(6, -12),
            fontsize=7,
            color=COLORS["published"],
        )
        ax1.axhline(HBM_GB, color="k", ls="--", lw=1)
        ax1.text(3.4, HBM_GB - 3, f"{HBM_GB:g} GB HBM", ha="right", fontsize=8)
        ax1.set(
            xticks=range(4),
            xticklabels=[names[r["approach"]] for r in rows],
            ylim=(0, 88),
            ylabel="HBM per card (GB)",
            title="device memory per card (Super, 4 cards, 720p 10 s)",
        )
        ax1.legend(fontsize=7, loc="upper center", ncol=2)
        host = [r["host_weights_per_rank_gb"] for r in rows]
        ax2.bar(range(4), host, 0.6, color=COLORS["predicted"], label="predicted")
        for i, r in enumerate(rows):
            ax2.annotate(
                f"{host[i]:.1f} per rank\n{r['host_weights_total_gb']:.0f} in total",
                (i, host[i]),
                ha="center",
                textcoords="offset points",
                xytext=(0, 3),
                fontsize=7,
            )
        for i, key, per in (
            (1, "fig1.super.layerwise_dp4.host_total", 4),
            (3, "fig3.super_dp4.dlo.pinned_per_rank", 1),
        ):
            p = published(key).value / per
            ax2.plot(i, p, "x", ms=10, mew=2, color=COLORS["published"], label="published" if i == 1 else None)
            ax2.annotate(
                f"pub. {p:g}: {_err(host[i], p)}",
                (i, p),
                textcoords="offset points",
                xytext=(0, -22),
                ha="center",
                fontsize=7,
                color="white",
            )
        ax2.set(
            xticks=range(4),
            xticklabels=[names[r["approach"]] for r in rows],
            ylim=(0, 150),
            ylabel="host weight bytes per rank (GB)",
            title="host memory per rank (pinned weights)",
        )
        ax2.legend(fontsize=7, loc="upper right")
        fig.suptitle(
            f"Only DLO keeps both small: 2 blocks in HBM and 1/{rows[0]['cards']} of the model per rank on the host"
        )
        fig.tight_layout()
        paths.insert(0, save_png(fig, out_dir / "fig1_offload_vs_parallel.png"))
    return paths


def fig3_host_weights_per_rank(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """A full model per rank grows host weights linearly in DP (N x model in total); one shard per rank keeps
    the total at one model and divides the per-rank share by DP."""
    import matplotlib.pyplot as plt

    out_dir, dps = pathlib.Path(out_dir), HOST_WEIGHTS_DPS
    rows = host_weights_rows(dps)
    paths = [write_csv(out_dir / "data" / "fig3_host_weights_per_rank.csv", rows, list(rows[0]))]
    pubs = (
        ("per_rank_gb", "cosmos3-super", "fig3.super_dp4.dlo.pinned_per_rank", "allgather", (8, 6)),
        ("total_gb", "cosmos3-super", "fig3.super_dp4.dlo.pinned_total", "allgather", (8, -14)),
        ("total_gb", "cosmos3-super", "fig1.super.layerwise_dp4.host_total", "rank-local", (8, 2)),
        ("total_gb", "cosmos3-nano", "fig3.nano_dp4.layerwise.pinned_total", "rank-local", (8, 6)),
    )
    with figure_style():
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, col in zip(axes, ("per_rank_gb", "total_gb")):
            for name, ls in (("cosmos3-nano", "--"), ("cosmos3-super", "-")):
                for mode, color in (("rank-local", COLORS["h2d"]), ("allgather", COLORS["allgather"])):
                    ys = [r[col] for r in rows if r["model"] == name and r["mode"] == mode]
                    label = f"{name.split('-')[1].title()}: " + (
                        "one full model per rank" if mode == "rank-local" else "one shard per rank (DLO)"
                    )
                    ax.plot(list(dps), ys, ls, marker="o", ms=3, color=color, label=label)
            for c, name, key, mode, offset in pubs:
                if c != col:
                    continue
                pred = next(r[col] for r in rows if (r["model"], r["mode"], r["dp"]) == (name, mode, 4))
                p = published(key).value
                ax.plot(4, p, "x", ms=10, mew=2, color=COLORS["published"])
                ax.annotate(
                    f"pub. {p:g} ({_err(pred, p)})",
                    (4, p),
                    textcoords="offset points",
                    xytext=offset,
                    fontsize=7,
                    color=COLORS["published"],
                )
            ax.set(xlabel="DP degree (ranks on the host)", xticks=list(dps))
        axes[0].set(ylabel="pinned host weights per rank (GB)", title="per rank")
        axes[1].set(ylabel="pinned host weights, all ranks (GB)", title="all ranks (x: published)")
        axes[0].legend(fontsize=7)
        fig.suptitle("Host weights: N x model with a full copy per rank, 1 x model with one shard per rank")
        fig.tight_layout()
        paths.insert(0, save_png(fig, out_dir / "fig3_host_weights_per_rank.png"))
    return paths


def _variant_label(variant: str) -> str:
    """``dlo-rank-local-swap-g4`` -> ``groups\nof 4`` (load groups of 4): short enough to sit under its bar (the
    names in full print over each other)."""
    rest = variant.removeprefix("dlo-").removeprefix("rank-local").removeprefix("-swap")
    if rest.startswith("-g") and rest[2:].isdigit():
        return f"groups\nof {rest[2:]}"
    return {"": "2 slots", "-fp8": "FP8 shards"}.get(rest, variant.removeprefix("dlo-").replace("-", "\n"))


def fig4_hbm(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """HBM per card at 720p 10 s on 4 cards: DLO's weight term grows only with the largest block (Super's
    is 2.1x Nano's) while HSDP+SP holds a quarter of the model; measured GPU HBM is drawn when committed."""
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    bars = hbm_bars()
    rows = hbm_rows(bars)
    paths = [write_csv(out_dir / "data" / "fig4_hbm.csv", rows, list(rows[0]))]
    measured = measured_hbm_records()
    nano_w, super_w = bars[0][1]["weights"], bars[2][1]["weights"]
    ratio = model_sizes("cosmos3-super").total_bytes / model_sizes("cosmos3-nano").total_bytes
    hsdp_vs_dlo = rows[4]["predicted_gb"] / rows[3]["predicted_gb"]
    with figure_style():
        if measured:
            fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": (2.2, 1)})
        else:
            fig, ax1 = plt.subplots(figsize=(8.8, 4.6))
        for i, (label, parts, key) in enumerate(bars):
            total = _stack(ax1, i, parts)
            p = published(key).value
            ax1.plot(i + 0.36, p, "x", ms=9, mew=2, color=COLORS["published"], label="published" if i == 0 else None)
            ax1.annotate(
                f"{total:.1f} (pub. {p:g},\n{_err(total, p)})",
                (i, max(total, p)),
                ha="center",
                textcoords="offset points",
                xytext=(0, 4),
                fontsize=7,
                bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none"},  # legible over the HBM line
            )
        ax1.axhline(HBM_GB, color="k", ls="--", lw=1)
        ax1.set(
            xticks=range(len(bars)),
            xticklabels=[b[0] for b in bars],
            ylim=(0, 90),
            ylabel="HBM per card (GB)",
            title="predicted terms vs published (Ascend 910B3, 720p 10 s, 4 cards)",
        )
        ax1.legend(fontsize=7, loc="upper left", ncol=2)
        if measured:
            for i, m in enumerate(measured):
                ax2.bar(
                    i - 0.2,
                    m["planned_bytes"] / GB,
                    0.4,
                    color=COLORS["predicted"],
                    label="planned" if i == 0 else None,
                )
                ax2.bar(
                    i + 0.2,
                    m["measured_bytes"] / GB,
                    0.4,
                    color=COLORS["measured"],
                    label="measured" if i == 0 else None,
                )
                ax2.annotate(
                    _err(m["planned_bytes"], m["measured_bytes"]),
                    (i, m["measured_bytes"] / GB),
                    ha="center",
                    textcoords="offset points",
                    xytext=(0, 3),
                    fontsize=7,
                )
            ax2.set(
                xticks=range(len(measured)),
                xticklabels=[_variant_label(m["variant"]) for m in measured],
                ylabel="weight HBM (GB)",
                title=f"measured weight HBM, bench config ({measured[0]['machine']})",
            )
            ax2.legend(fontsize=7)
        else:
            ax1.text(
                4.4,
                75,
                "no measured GPU HBM under figures/data/ yet:\npublished vs predicted only",
                ha="right",
                fontsize=7,
                color=COLORS["measured"],
            )
        fig.suptitle(
            f"DLO's HBM tracks the largest block, not the model: Super ({ratio:.1f}x Nano) adds "
            f"{super_w - nano_w:.1f} GB of weight slots;\nHSDP+SP needs {hsdp_vs_dlo:.1f}x DLO's peak"
        )
        fig.tight_layout()
        paths.insert(0, save_png(fig, out_dir / "fig4_hbm.png"))
    return paths


def fig6_ascend_memory_accounting(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Nano DP2: the Ascend cgroup sees the page cache and framework RSS but not the pinned shards, which live
    in driver DMA memory; physical RAM is cgroup + shards. On CUDA the same shards are charged to the cgroup."""
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    cols = ascend_accounting_columns()
    rows = ascend_accounting_rows(cols)
    paths = [
        write_csv(out_dir / "data" / "fig6_ascend_memory_accounting.csv", rows, ["bar", *ACCOUNTING_FIELDS, "total_gb"])
    ]
    style = (
        ("page cache (safetensors, shared)", COLORS["h2d"], None),
        ("RSS (framework)", COLORS["compute"], None),
        ("pinned shards, charged to cgroup", COLORS["allgather"], None),
        ("pinned shards in driver DMA memory (invisible)", "white", "//"),
    )
    with figure_style():
        fig, ax = plt.subplots(figsize=(8.4, 4.6))
        for i, c in enumerate(cols):
            bottom = 0.0
            for (label, color, hatch), value in zip(style, c[1:]):
                ax.bar(
                    i,
                    value,
                    0.6,
                    bottom=bottom,
                    color=color,
                    hatch=hatch,
                    edgecolor=COLORS["allgather"] if hatch else None,
                )
                bottom += value
            ax.annotate(f"{bottom:.1f} GB", (i, bottom), ha="center", textcoords="offset points", xytext=(0, 3))
        pub = published("fig6.nano_dp2.cgroup").value
        ax.annotate(
            f"cgroup: {_err(rows[1]['total_gb'], pub)} vs published {pub:g} GB",
            (1, rows[1]["total_gb"]),
            ha="center",
            textcoords="offset points",
            xytext=(0, 16),
            fontsize=7,
            color=COLORS["published"],
        )
        ax.set(
            xticks=range(len(cols)),
            xticklabels=[c[0] for c in cols],
            ylabel="host memory (GB)",
            ylim=(0, 95),
            title="Ascend hides pinned shards from the cgroup; CUDA charges them (Nano, DP2)",
        )
        from matplotlib.patches import Patch

        ax.legend(
            [Patch(facecolor=c, hatch=h, edgecolor=COLORS["allgather"] if h else c) for _, c, h in style],
            [label for label, _, _ in style],
            fontsize=7,
            loc="upper left",
        )
        fig.tight_layout()
        paths.insert(0, save_png(fig, out_dir / "fig6_ascend_memory_accounting.png"))
    return paths


def table_host_capacity(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Host capacity with mmap + AllGather on Ascend: the cgroup grows by one model plus 3.5 GB per rank, the
    physical RAM by two models; 400 GB fits 2 TB even at DP8, while private copies would need ~2 TB at DP4."""
    import matplotlib.pyplot as plt

    out_dir, rows = pathlib.Path(out_dir), capacity_rows()
    paths = [write_csv(out_dir / "data" / "table_host_capacity.csv", rows, list(rows[0]))]
    head = (
        "model",
        "dp",
        "cgroup peak",
        "published",
        "err",
        "physical RAM",
        "published",
        "err",
        "no mmap",
        "fits 2 TB",
    )
    cells = [
        [
            f"{r['model_gb']} GB",
            r["dp"],
            f"{r['cgroup_peak_gb']:.0f} GB",
            r["published_cgroup_peak_gb"],
            f"{r['cgroup_peak_rel_error_pct']:+.1f}%" if r["published_cgroup_peak_gb"] else "",
            f"{r['physical_gb']:.0f} GB",
            r["published_physical_gb"],
            f"{r['physical_rel_error_pct']:+.1f}%" if r["published_physical_gb"] else "",
            f"{r['no_mmap_peak_gb']:.0f} GB",
            "yes" if r["fits_2tb"] else "no",
        ]
        for r in rows
    ]
    with figure_style():
        fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.1))
        ax.axis("off")
        table = ax.table(cellText=cells, colLabels=head, loc="center", cellLoc="center")
        table.auto_set_font_size(False)
        table.set_fontsize(8)
        table.scale(1, 1.25)
        ax.set_title("Host capacity, Ascend, mmap + AllGather (predicted vs published extrapolation)")
        fig.tight_layout()
        paths.insert(0, save_png(fig, out_dir / "table_host_capacity.png"))
    return paths


FIGURES = {
    "fig1_offload_vs_parallel": fig1_offload_vs_parallel,
    "fig3_host_weights_per_rank": fig3_host_weights_per_rank,
    "fig4_hbm": fig4_hbm,
    "fig6_ascend_memory_accounting": fig6_ascend_memory_accounting,
    "table_host_capacity": table_host_capacity,
}
