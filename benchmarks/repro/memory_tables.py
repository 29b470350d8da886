"""The numbers behind the memory figures and notebook 04: every published memory number beside its prediction.

Predictions come only from :mod:`dlo_fn.cost.memory` / :mod:`dlo_fn.cost.hbm` with the named constants of
:mod:`dlo_fn.cost.calibration` bound (:mod:`benchmarks.repro.deployment`) and the model sizes; published values
(:mod:`benchmarks.repro.published`) fill only the *published* column. Each ``*_comparisons`` function returns a list of
:class:`~benchmarks.repro.published.Comparison`.

Deployment assumptions, stated once:

* Nano and Super are the reference configs ``cosmos3-nano`` / ``cosmos3-super`` (:data:`dlo_fn.models.CONFIGS`,
  sized to the published files), or, if those cannot be built, the published sizes themselves.
* The Ascend runs shard over every rank (``W = dp``); Figures 1 and 4 use 4 cards (Super HSDP: "~31 GB weights"
  = 124 GB / 4), with the 720p 10 s SP workload on each card.
* Workload bytes at a fixed token count scale with hidden width, ``sqrt(max block)``
  (:func:`dlo_fn.cost.hbm.scale_activation_bytes`), and with the tokens each card holds (SP over 4 cards holds
  a quarter of one request; DP holds a whole request per card).
"""

from __future__ import annotations

import json
import pathlib
from functools import lru_cache

from benchmarks.repro.data import DATA_DIR
from benchmarks.repro.deployment import approach_memory, cold_start, hbm_per_card, host_capacity, host_steady_state
from benchmarks.repro.published import MODELS, PUBLISHED, Comparison, compare, compare_bytes, published
from dlo_fn.cost import calibration as cal
from dlo_fn.cost.hbm import scale_activation_bytes
from dlo_fn.cost.memory import GB, GIB, ModelSizes

__all__ = [
    "FIG_CARDS",
    "CAPACITY_CASES",
    "model_sizes",
    "published_sizes",
    "workload_bytes",
    "host_comparisons",
    "hbm_comparisons",
    "capacity_rows",
    "capacity_comparisons",
    "approach_rows",
    "measured_hbm_records",
    "sizes_rows",
    "comparison_rows",
    "misses",
    "accounting_rows",
    "rounded",
    "calibration_rows",
]

FIG_CARDS = 4
CAPACITY_CASES = ((33, 4), (33, 8), (124, 4), (124, 8), (185, 4), (185, 8), (400, 4), (400, 8))


def published_sizes(name: str) -> ModelSizes:
    """The published description: equal blocks, resident bytes unknown (0)."""
    m = MODELS[name]
    return ModelSizes.uniform(name, m.checkpoint_bytes, m.num_blocks, source=m.source)


@lru_cache(maxsize=None)
def model_sizes(name: str) -> ModelSizes:
    """Sizes of a named reference config, built on the meta device; the published description as fallback
    when :mod:`dlo_fn.models` is not importable. ``source`` says which one was used."""
    try:
        from dlo_fn.models.specs import config_spec

        spec = config_spec(name)
    except ImportError:
        return published_sizes(name)
    return ModelSizes.from_spec(spec, source=f"dlo_fn.models.CONFIGS[{name!r}] (meta-built spec)")


def workload_bytes(name: str, workload: str, *, cards_per_request: int = 1) -> int:
    """Activation + communication bytes per card of ``workload`` for model ``name`` (see the module docstring).

    ``720p10s-sp``: Nano's Figure 4 constant, width-scaled to ``name``. ``480p29f``: one whole request per card
    (DLO DP4), width-scaled, divided by ``cards_per_request`` for SP."""
    base = {
        "720p10s-sp": cal.ACTIVATION_COMM_BYTES_NANO_720P_10S_SP,
        "480p29f": cal.ACTIVATION_COMM_BYTES_NANO_480P_29F_DP4,
    }[workload]
    scaled = scale_activation_bytes(base, model_sizes("cosmos3-nano"), model_sizes(name))
    return -(-scaled // cards_per_request)


def _gb(key: str, value_bytes: float, calibrated: bool = False) -> Comparison:
    return compare_bytes(key, int(value_bytes), calibrated=calibrated)


def host_comparisons() -> list[Comparison]:
    nano, sup = model_sizes("cosmos3-nano"), model_sizes("cosmos3-super")
    rows = []
    copy4, mmap4 = cold_start(nano, 4, "private-copy"), cold_start(nano, 4, "mmap")
    rows += [
        _gb("fig2.nano_dp4.private_copy.cgroup_peak", copy4.cgroup_peak_bytes),
        _gb("fig2.nano_dp4.private_copy.private_copies", copy4.private_copy_bytes),
        _gb("fig2.nano_dp4.private_copy.page_cache", copy4.page_cache_bytes),
        _gb("fig2.nano_dp4.private_copy.framework_transient", copy4.framework_bytes + copy4.transient_bytes),
        _gb("fig2.nano_dp4.mmap.cgroup_peak", mmap4.cgroup_peak_bytes),
        compare("fig2.nano_dp4.reduction_pct", 100 * (1 - mmap4.cgroup_peak_bytes / copy4.cgroup_peak_bytes)),
        _gb("fig3.nano_dp4.layerwise.pinned_total", host_steady_state(nano, 4, mode="rank-local").pinned_bytes),
        _gb("fig3.super_dp4.dlo.pinned_total", host_steady_state(sup, 4).pinned_bytes),
        _gb("fig3.super_dp4.dlo.pinned_per_rank", host_steady_state(sup, 4).pinned_bytes_per_rank),
        _gb("fig1.super.layerwise_dp4.host_total", host_steady_state(sup, 4, mode="rank-local").pinned_bytes),
    ]
    for key, sizes, n in (("nano_dp4_mmap", nano, 4), ("super_dp2", sup, 2), ("super_dp4", sup, 4)):
        c = cold_start(sizes, n, "mmap")
        rows += [
            _gb(f"host.{key}.cgroup_peak", c.cgroup_peak_bytes),
            _gb(f"host.{key}.page_cache", c.page_cache_bytes),
            _gb(f"host.{key}.rss", c.rss_bytes),
            _gb(f"host.{key}.worker_hwm", c.hwm_bytes_per_rank),
        ]
    rows += [
        _gb("host.nano_dp4_copy.cgroup_peak", copy4.cgroup_peak_bytes),
        _gb("host.nano_dp4_copy.worker_hwm", copy4.hwm_bytes_per_rank),
    ]
    asc = host_steady_state(nano, 2, "ascend")
    rows += [
        _gb("fig6.nano_dp2.cgroup", asc.cgroup_bytes),
        _gb("fig6.nano_dp2.page_cache", asc.page_cache_bytes),
        _gb("fig6.nano_dp2.rss", asc.rss_bytes),
        _gb("fig6.nano_dp2.cgroup_kmem", 0),  # driver DMA memory is not charged to the cgroup at all
        _gb("fig6.nano_dp2.shard_per_rank", asc.pinned_bytes_per_rank),
        _gb("fig6.nano_dp2.shards_total", asc.pinned_bytes),
        _gb("fig6.framework_per_rank", cal.FRAMEWORK_HOST_BYTES_PER_RANK, calibrated=True),
        _gb("perf.nano.dlo_ag_dp4.cpu_per_rank", host_steady_state(nano, 4, "ascend").rss_bytes // 4),
        _gb(
            "perf.nano.dlo_noag_dp4.cpu_per_rank",
            host_steady_state(nano, 4, "ascend", "rank-local").pinned_bytes_per_rank,
        ),
    ]
    # CUDA (B300, Super DP4): process-tree PSS counts the pinned arenas; the framework terms cancel in the
    # difference between rank-local (4 full copies) and AllGather (one model in shards).
    pss = host_steady_state(sup, 4, "cuda", "rank-local").cgroup_bytes - host_steady_state(sup, 4, "cuda").cgroup_bytes
    pub = published("b300.super.dlo_noag_dp4.pss").value - published("b300.super.dlo_ag_dp4.pss").value
    rows.append(
        Comparison(
            "b300.super.pss(no-AG) - pss(AG)",
            "GiB",
            pub,
            pss / GIB,
            False,
            published("b300.super.dlo_ag_dp4.pss").source,
        )
    )
    return rows


def hbm_comparisons() -> list[Comparison]:
    nano, sup = model_sizes("cosmos3-nano"), model_sizes("cosmos3-super")
    rows = [
        _gb("hbm.nano.two_layers", hbm_per_card(nano, 4).slot_bytes),
        _gb("hbm.super.two_layers", hbm_per_card(sup, 4).slot_bytes),
    ]
    for key, sizes, n in (("nano_dp2", nano, 2), ("nano_dp4", nano, 4), ("super_dp2", sup, 2), ("super_dp4", sup, 4)):
        rows.append(_gb(f"hbm.{key}.idle", hbm_per_card(sizes, n).idle_bytes, calibrated=key == "nano_dp4"))
    rows.append(_gb("fig6.nano_dp2.hbm_per_card", hbm_per_card(nano, 2).idle_bytes))
    f4 = {
        name: hbm_per_card(model_sizes(name), FIG_CARDS, activation_bytes=workload_bytes(name, "720p10s-sp"))
        for name in ("cosmos3-nano", "cosmos3-super")
    }
    n4, s4 = f4["cosmos3-nano"], f4["cosmos3-super"]
    rows += [
        _gb("fig4.nano.idle", n4.idle_bytes),
        _gb("fig4.nano.peak", n4.peak_bytes),
        _gb("fig4.super.idle", s4.idle_bytes),
        _gb("fig4.super.peak", s4.peak_bytes),
        compare("fig4.peak_growth_pct", 100 * (s4.peak_bytes / n4.peak_bytes - 1)),
        compare("fig4.idle_growth_pct", 100 * (s4.idle_bytes / n4.idle_bytes - 1)),
    ]
    hsdp = approach_memory(sup, FIG_CARDS, "hsdp", activation_bytes=workload_bytes("cosmos3-super", "720p10s-sp"))
    h = hsdp.hbm
    rows += [
        _gb("fig4.super.hsdp_sp.peak", h.peak_bytes),
        _gb("fig1.super.hsdp.hbm_per_card", h.peak_bytes),
        _gb("fig1.super.hsdp.weights_per_card", h.resident_bytes),
        # the source splits HSDP's card into weights and "activations/comm": everything but the weights
        _gb("fig1.super.hsdp.activations_comm_per_card", h.peak_bytes - h.resident_bytes),
        _gb("fig1.super.hsdp.headroom", published("ascend.hbm_per_card").value_bytes - h.peak_bytes),
    ]
    a480 = workload_bytes("cosmos3-nano", "480p29f")
    rows += [
        _gb("perf.nano.dlo_ag_dp4.hbm_per_card", hbm_per_card(nano, 4, activation_bytes=a480).peak_bytes, True),
        _gb(
            "perf.nano.dlo_noag_dp4.hbm_per_card", hbm_per_card(nano, 1, "rank-local", activation_bytes=a480).peak_bytes
        ),
        _gb(
            "perf.nano.hsdp_sp.hbm_per_card",
            approach_memory(
                nano, FIG_CARDS, "hsdp", activation_bytes=workload_bytes("cosmos3-nano", "480p29f", cards_per_request=4)
            ).hbm.peak_bytes,
        ),
    ]
    # CUDA (B300, Super DP4, 1024^2): AllGather adds landing buffers and padding over rank-local's two slots.
    diff = hbm_per_card(sup, 4).weight_bytes - hbm_per_card(sup, 1, "rank-local").weight_bytes
    pub = (
        published("b300.super.dlo_ag_dp4.hbm_per_card").value - published("b300.super.dlo_noag_dp4.hbm_per_card").value
    )
    rows.append(
        Comparison(
            "b300.super.hbm(AG) - hbm(no-AG)",
            "GiB",
            round(pub, 2),
            diff / GIB,
            False,
            published("b300.super.dlo_ag_dp4.hbm_per_card").source,
        )
    )
    return rows


def _capacity_sizes(model_gb: int) -> ModelSizes:
    # Only the bytes matter here (block count changes the ceil rounding by < 256 B per block per rank).
    return ModelSizes.uniform(f"{model_gb} GB", model_gb * GB, 128, source="model size as the input")


def capacity_rows() -> list[dict]:
    rows = []
    for model_gb, dp in CAPACITY_CASES:
        c = host_capacity(_capacity_sizes(model_gb), dp, "ascend")
        key = f"capacity.{model_gb}gb_dp{dp}"
        row = {
            "model_gb": model_gb,
            "dp": dp,
            "cgroup_peak_gb": c.cgroup_peak_bytes / GB,
            "physical_gb": c.physical_bytes / GB,
            "no_mmap_peak_gb": c.private_copy_peak_bytes / GB,
            "fits_2tb": c.fits,
        }
        for col in ("cgroup_peak", "physical"):
            pub = PUBLISHED.get(f"{key}.{col}")
            row[f"published_{col}_gb"] = ("~" if pub and pub.approx else "") + (f"{pub.value:g}" if pub else "")
            row[f"{col}_rel_error_pct"] = round(100 * (row[f"{col}_gb"] / pub.value - 1), 1) + 0.0 if pub else ""
        rows.append(row)
    return rows


def capacity_comparisons() -> list[Comparison]:
    rows = []
    for model_gb, dp in CAPACITY_CASES:
        key = f"capacity.{model_gb}gb_dp{dp}"
        if f"{key}.cgroup_peak" not in PUBLISHED:
            continue
        c = host_capacity(_capacity_sizes(model_gb), dp, "ascend")
        rows += [_gb(f"{key}.cgroup_peak", c.cgroup_peak_bytes), _gb(f"{key}.physical", c.physical_bytes)]
    rows.append(
        _gb("capacity.400gb_dp4.private_copy_peak", host_capacity(_capacity_sizes(400), 4).private_copy_peak_bytes)
    )
    return rows


def approach_rows(name: str = "cosmos3-super", cards: int = FIG_CARDS) -> list[dict]:
    """Figure 1: each approach's HBM per card (by term) and host weight bytes per rank, in GB."""
    sizes, act = model_sizes(name), workload_bytes(name, "720p10s-sp")
    rows = []
    for approach in ("hsdp", "layerwise-dp", "tp", "dlo"):
        a = approach_memory(sizes, cards, approach, activation_bytes=act)
        h = a.hbm
        rows.append(
            {
                "approach": approach,
                "cards": cards,
                "context_gb": h.context_bytes / GB,
                "resident_weights_gb": h.resident_bytes / GB,
                "slot_weights_gb": h.weight_bytes / GB,
                "activations_comm_gb": (h.activation_bytes + h.communication_bytes) / GB,
                "hbm_per_card_gb": h.peak_bytes / GB,
                "host_weights_per_rank_gb": a.host_weight_bytes_per_rank / GB,
                "host_weights_total_gb": a.host_weight_bytes_total / GB,
            }
        )
    return rows


def measured_hbm_records(data_dir: pathlib.Path = DATA_DIR) -> list[dict]:
    """Measured device weight bytes of the offload variants in the committed ``bench_step_*.json`` files
    (``python -m benchmarks bench step`` on a GPU): per variant, the executor's planned weight bytes (slots +
    landing buffers) and what it measured on the device allocator, from the first workload of each file (the
    weight buffers do not depend on the workload)."""
    found = []
    for path in sorted(pathlib.Path(data_dir).glob("bench_step_*.json")):
        doc = json.loads(path.read_text())
        machine = doc.get("machine", {})
        device = machine.get("device_name", "") if isinstance(machine, dict) else str(machine)
        if machine.get("platform") == "cpu" if isinstance(machine, dict) else False:
            continue
        workloads = doc.get("workloads") or []
        if not workloads:
            continue
        for v in workloads[0].get("variants", []):
            planned, measured = v.get("weight_device_bytes_planned"), v.get("weight_device_bytes")
            if str(v.get("variant", "")).startswith("dlo-") and isinstance(planned, int) and isinstance(measured, int):
                found.append(
                    {
                        "file": path.name,
                        "machine": device,
                        "variant": v["variant"],
                        "workload": workloads[0].get("name", ""),
                        "metric": "weight_device_bytes",
                        "measured_bytes": measured,
                        "planned_bytes": planned,
                        "peak_device_bytes": v.get("peak_device_bytes"),
                    }
                )
    return found


# -- notebook helpers: stable text tables ------------------------------------------------------------------


def sizes_rows(names=("cosmos3-nano", "cosmos3-super")) -> list[dict]:
    """The model sizes used as inputs, beside the published description, with their source."""
    rows = []
    for name in names:
        s, m = model_sizes(name), MODELS[name]
        rows.append(
            {
                "model": name,
                "blocks": s.num_blocks,
                "total_gb": round(s.total_bytes / GB, 3),
                "published_gb": m.checkpoint_bytes / GB,
                "max_block_gb": round(s.max_block_bytes / GB, 4),
                "resident_gb": round(s.resident_bytes / GB, 4),
                "source": s.source,
            }
        )
    return rows


def comparison_rows(rows: list[Comparison]) -> list[dict]:
    return [r.as_row() for r in rows]


def misses(rows: list[Comparison], threshold: float = 0.10) -> list[str]:
    """Keys whose prediction misses the published value by more than ``threshold`` (relative)."""
    return [r.key for r in rows if abs(r.rel_error) > threshold]


def accounting_rows(rows) -> list[dict]:
    """:func:`dlo_fn.cost.accounting.memory_accounting` rows as item / formula / value (GB)."""
    return [
        {"section": r.section, "item": r.item, "formula": r.formula, "value_gb": f"{r.value_bytes / GB:.3f}"}
        for r in rows
    ]


def rounded(rows: list[dict], ndigits: int = 2) -> list[dict]:
    """Floats rounded for display (the CSVs keep full precision)."""
    return [{k: round(v, ndigits) if isinstance(v, float) else v for k, v in r.items()} for r in rows]


def calibration_rows() -> list[dict]:
    """The named constants of :mod:`dlo_fn.cost.calibration` with the published numbers each was fitted to."""
    return [
        {"constant": name, "GB": value / GB, "fitted to": " - ".join(keys)}
        for name, (value, keys) in cal.CALIBRATIONS.items()
    ]
