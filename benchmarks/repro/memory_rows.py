"""The rows behind Figures 3, 4 and 6 (drawn by :mod:`benchmarks.figures.memory`, written beside them as CSV):
host weights per rank against DP, the HBM terms per card at 720p 10 s, and the Ascend host accounting.

Same models, sizes and constants as :mod:`benchmarks.repro.memory_tables`; values in GB (1e9 bytes).
"""

from __future__ import annotations

from benchmarks.repro.deployment import approach_memory, hbm_per_card, host_steady_state
from benchmarks.repro.memory_tables import FIG_CARDS, model_sizes, workload_bytes
from benchmarks.repro.published import published
from dlo_fn.cost.hbm import HbmPerCard
from dlo_fn.cost.memory import GB, pinned_host_bytes_per_rank

__all__ = [
    "HOST_WEIGHTS_DPS",
    "host_weights_rows",
    "hbm_parts",
    "hbm_bars",
    "hbm_rows",
    "ACCOUNTING_FIELDS",
    "ascend_accounting_columns",
    "ascend_accounting_rows",
]

HOST_WEIGHTS_DPS = tuple(range(1, 9))
ACCOUNTING_FIELDS = ("page_cache_gb", "rss_gb", "pinned_visible_gb", "pinned_invisible_gb")


def host_weights_rows(dps: tuple[int, ...] = HOST_WEIGHTS_DPS) -> list[dict]:
    """Figure 3: pinned host weights per rank and in total, a full copy per rank (rank-local) or one shard."""
    rows = []
    for name in ("cosmos3-nano", "cosmos3-super"):
        s = model_sizes(name)
        for dp in dps:
            for mode in ("rank-local", "allgather"):
                per = pinned_host_bytes_per_rank(s, dp, mode) / GB
                rows.append({"model": name, "dp": dp, "mode": mode, "per_rank_gb": per, "total_gb": dp * per})
    return rows


def hbm_parts(h: HbmPerCard) -> dict[str, float]:
    """The four stacked terms of one card, in GB."""
    return {
        "context": h.context_bytes / GB,
        "resident": h.resident_bytes / GB,
        "weights": h.weight_bytes / GB,
        "workload": (h.activation_bytes + h.communication_bytes) / GB,
    }


def hbm_bars() -> list[tuple[str, dict[str, float], str]]:
    """Figure 4: ``(label, parts in GB, published key)`` for DLO idle / peak of Nano and Super, and Super
    HSDP+SP peak, on 4 cards at 720p 10 s."""
    bars = []
    for name, short in (("cosmos3-nano", "Nano"), ("cosmos3-super", "Super")):
        h = hbm_per_card(model_sizes(name), FIG_CARDS, activation_bytes=workload_bytes(name, "720p10s-sp"))
        idle = dict(hbm_parts(h), workload=0.0)
        bars += [
            (f"{short}\nDLO idle", idle, f"fig4.{short.lower()}.idle"),
            (f"{short}\nDLO peak", hbm_parts(h), f"fig4.{short.lower()}.peak"),
        ]
    hsdp = approach_memory(
        model_sizes("cosmos3-super"), FIG_CARDS, "hsdp", activation_bytes=workload_bytes("cosmos3-super", "720p10s-sp")
    ).hbm
    bars.append(("Super\nHSDP+SP peak", hbm_parts(hsdp), "fig4.super.hsdp_sp.peak"))
    return bars


def hbm_rows(bars: list[tuple[str, dict[str, float], str]]) -> list[dict]:
    """:func:`hbm_bars` as rows: each term, the predicted total, the published one and the relative error."""
    return [
        {
            "bar": label.replace("\n", " "),
            **{f"{k}_gb": v for k, v in parts.items()},
            "predicted_gb": sum(parts.values()),
            "published_gb": published(key).value,
            "rel_error_pct": round(100 * (sum(parts.values()) / published(key).value - 1), 1),
        }
        for label, parts, key in bars
    ]


def ascend_accounting_columns() -> list[tuple[str, float, float, float, float]]:
    """Figure 6, Nano DP2: ``(label, page cache, RSS, pinned charged to the cgroup, pinned invisible to it)``
    in GB, for the published Ascend cgroup and our Ascend cgroup, Ascend physical and CUDA predictions."""
    nano = model_sizes("cosmos3-nano")
    asc, cuda = host_steady_state(nano, 2, "ascend"), host_steady_state(nano, 2, "cuda")
    return [
        (
            "published\nAscend cgroup",
            published("fig6.nano_dp2.page_cache").value,
            published("fig6.nano_dp2.rss").value,
            0.0,
            0.0,
        ),
        ("predicted\nAscend cgroup", asc.page_cache_bytes / GB, asc.framework_bytes / GB, 0.0, 0.0),
        (
            "predicted\nAscend physical",
            asc.page_cache_bytes / GB,
            asc.framework_bytes / GB,
            0.0,
            asc.cgroup_invisible_bytes / GB,
        ),
        (
            "predicted\nCUDA cgroup = physical",
            cuda.page_cache_bytes / GB,
            cuda.framework_bytes / GB,
            cuda.pinned_bytes / GB,
            0.0,
        ),
    ]


def ascend_accounting_rows(cols: list[tuple[str, float, float, float, float]]) -> list[dict]:
    return [
        {"bar": c[0].replace("\n", " "), **dict(zip(ACCOUNTING_FIELDS, c[1:])), "total_gb": sum(c[1:])} for c in cols
    ]
