"""The published numbers, as data: used only for the *published* column of a comparison, never as an input.

Every value comes from the DLO write-up (the seed document ``seed/000_b5cb1b405e92fadb.txt`` and its English
original, the vLLM blog post "Distributed Layerwise Offload", 2026-07-30), transcribed in the shared
``PUBLISHED_NUMBERS.md``; ``source`` names the figure or table. Units: ``GB`` = 1e9 bytes, ``GiB`` = 2**30
bytes, as each source states them; ``approx`` marks values the source writes with "~".

What is *not* here: the constants fitted to some of these numbers (:mod:`dlo_fn.cost.calibration`, each naming
the one number it was fitted to), and the model sizes, which are inputs of the memory models, not results:
:data:`MODELS` describes the published models for when the reference configs (:mod:`dlo_fn.models`) are not
available, and says so in its ``source``.

A comparison is ``(predicted - published) / published`` (:func:`relative_error`); :func:`compare` returns one
row of a comparison table.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "UNIT_BYTES",
    "PublishedModel",
    "Published",
    "Comparison",
    "MODELS",
    "PUBLISHED",
    "published",
    "relative_error",
    "compare",
    "compare_bytes",
]

UNIT_BYTES = {"GB": 10**9, "GiB": 2**30}

_SEED = "seed (vLLM blog 'Distributed Layerwise Offload')"


@dataclass(frozen=True, slots=True)
class PublishedModel:
    """A published model as its write-up describes it (sizes only; no layer shapes are published)."""

    name: str
    num_params: int
    num_blocks: int
    checkpoint_bytes: int
    source: str


@dataclass(frozen=True, slots=True)
class Published:
    key: str
    value: float
    unit: str
    source: str
    approx: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        if not self.key or not self.source:
            raise ValueError("a published number needs a key and a source")

    @property
    def value_bytes(self) -> int:
        """The value in bytes (``GB``/``GiB`` only)."""
        try:
            return round(self.value * UNIT_BYTES[self.unit])
        except KeyError:
            raise ValueError(f"{self.key}: unit {self.unit!r} is not a byte unit") from None


MODELS = {
    "cosmos3-nano": PublishedModel(
        "cosmos3-nano",
        17 * 10**9,
        72,
        33 * 10**9,
        f"published sizes: {_SEED}, references: 'Cosmos3-Nano: 33 GB safetensors (17B params, 72 blocks)'",
    ),
    "cosmos3-super": PublishedModel(
        "cosmos3-super",
        64 * 10**9,
        128,
        124 * 10**9,
        f"published sizes: {_SEED}, references: 'Cosmos3-Super: 124 GB safetensors (64B params, 128 blocks)'",
    ),
}


def _p(key: str, value: float, unit: str, source: str, approx: bool = False, note: str = "") -> Published:
    return Published(key, value, unit, f"{_SEED}: {source}", approx, note)


_F1, _F2, _F3 = "Figure 1 / approach table", "Figure 2 (cold start, Nano DP4)", "Figure 3 (host weights)"
_HT, _HBM, _F4 = "host memory table (cgroup peak)", "NPU HBM table", "Figure 4 (720p 10 s, dist_offload+SP)"
_F6, _PERF, _CAP = "Figure 6 (Ascend accounting, Nano DP2)", "Ascend performance table", "host-capacity table"
_B300, _MM = "B300 1024^2 T2I table", "MiniMax-H3 8x B300 study"
_T2V, _WL = "B300 832x480x29 T2V table (35 steps)", "B300 workloads table (35 steps, DLO vs HSDP+USP4)"

_ROWS = (
    # Platform.
    _p("ascend.hbm_per_card", 64, "GB", "Ascend 910B3 test platform"),
    _p("ascend.host_ram", 2000, "GB", "Ascend 910B3 test platform (2 TB)"),
    # Figure 1 (Super).
    _p("fig1.super.hsdp.weights_per_card", 31, "GB", _F1, True),
    _p("fig1.super.hsdp.activations_comm_per_card", 25, "GB", _F1, True),
    _p("fig1.super.hsdp.hbm_per_card", 56, "GB", _F1, True),
    _p("fig1.super.hsdp.headroom", 8, "GB", _F1),
    _p("fig1.super.layerwise_dp4.host_total", 496, "GB", _F1, note="4 x 124 GB"),
    # Figure 2.
    _p("fig2.nano_dp4.private_copy.cgroup_peak", 178, "GB", _F2),
    _p("fig2.nano_dp4.private_copy.private_copies", 132, "GB", _F2),
    _p("fig2.nano_dp4.private_copy.page_cache", 33, "GB", _F2),
    _p("fig2.nano_dp4.private_copy.framework_transient", 13, "GB", _F2, True),
    _p("fig2.nano_dp4.mmap.cgroup_peak", 47, "GB", _F2),
    _p("fig2.nano_dp4.reduction_pct", 73, "%", _F2),
    # Figure 3.
    _p("fig3.nano_dp4.layerwise.pinned_total", 132, "GB", _F3),
    _p("fig3.super_dp4.dlo.pinned_total", 124, "GB", _F3),
    _p("fig3.super_dp4.dlo.pinned_per_rank", 31, "GB", _F3),
    # Host memory table.
    _p("host.nano_dp4_mmap.cgroup_peak", 47, "GB", _HT),
    _p("host.nano_dp4_mmap.page_cache", 31, "GB", _HT),
    _p("host.nano_dp4_mmap.rss", 14, "GB", _HT),
    _p("host.nano_dp4_mmap.worker_hwm", 12.1, "GB", _HT),
    _p("host.nano_dp4_copy.cgroup_peak", 178, "GB", _HT),
    _p("host.nano_dp4_copy.worker_hwm", 36, "GB", _HT),
    _p("host.super_dp2.cgroup_peak", 157, "GB", _HT),
    _p("host.super_dp2.page_cache", 149, "GB", _HT),
    _p("host.super_dp2.rss", 7, "GB", _HT),
    _p("host.super_dp2.worker_hwm", 65.2, "GB", _HT),
    _p("host.super_dp4.cgroup_peak", 172, "GB", _HT),
    _p("host.super_dp4.page_cache", 149, "GB", _HT),
    _p("host.super_dp4.rss", 14, "GB", _HT),
    _p("host.super_dp4.worker_hwm", 35.5, "GB", _HT),
    # HBM table.
    _p("hbm.nano_dp2.idle", 9.9, "GB", _HBM),
    _p("hbm.nano_dp2.inference", 10.4, "GB", _HBM),
    _p("hbm.nano_dp4.idle", 9.4, "GB", _HBM),
    _p("hbm.nano_dp4.inference", 10.2, "GB", _HBM),
    _p("hbm.super_dp2.idle", 15, "GB", _HBM, True),
    _p("hbm.super_dp4.idle", 10, "GB", _HBM, True),
    _p("hbm.nano.two_layers", 2, "GB", _HBM, True, "'2 layers of weights on device'"),
    _p("hbm.super.two_layers", 3, "GB", _HBM, True, "'2 layers of weights on device'"),
    # Figure 4.
    _p("fig4.nano.peak", 23.1, "GB", _F4),
    _p("fig4.super.peak", 28.1, "GB", _F4),
    _p("fig4.nano.idle", 11.5, "GB", _F4),
    _p("fig4.super.idle", 14.6, "GB", _F4),
    _p("fig4.peak_growth_pct", 22, "%", _F4, True),
    _p("fig4.idle_growth_pct", 27, "%", _F4, True),
    _p("fig4.super.hsdp_sp.peak", 56.3, "GB", _F4),
    # Figure 6.
    _p("fig6.nano_dp2.cgroup", 49, "GB", _F6),
    _p("fig6.nano_dp2.page_cache", 31, "GB", _F6),
    _p("fig6.nano_dp2.rss", 18, "GB", _F6),
    _p("fig6.nano_dp2.cgroup_kmem", 0, "GB", _F6),
    _p("fig6.nano_dp2.hbm_per_card", 10, "GB", _F6),
    _p("fig6.nano_dp2.shard_per_rank", 14.5, "GB", _F6),
    _p("fig6.nano_dp2.shards_total", 29, "GB", _F6),
    _p("fig6.nano_dp2.slab", 3.3, "GB", _F6),
    _p("fig6.framework_per_rank", 3.5, "GB", _F6, True, "component table: framework ~3.5 GB x dp"),
    # Ascend performance table (Nano, 832x480x29, 35 steps).
    _p("perf.nano.hsdp_sp.hbm_per_card", 20.3, "GB", _PERF),
    _p("perf.nano.dlo_ag_dp4.hbm_per_card", 12.4, "GB", _PERF),
    _p("perf.nano.dlo_noag_dp4.hbm_per_card", 14.1, "GB", _PERF),
    _p("perf.nano.dlo_ag_dp4.cpu_per_rank", 3.5, "GB", _PERF),
    _p("perf.nano.dlo_noag_dp4.cpu_per_rank", 28.3, "GB", _PERF),
    _p("perf.nano.hsdp_sp.ms_per_step", 870, "ms", _PERF),
    _p("perf.nano.dlo_ag_dp4_1req.ms_per_step", 1020, "ms", _PERF),
    _p("perf.nano.dlo_ag_dp4_4req.ms_per_step", 1020, "ms", _PERF),
    _p("perf.nano.dlo_noag_dp4.ms_per_step", 1877, "ms", _PERF),
    _p("perf.nano.hsdp_sp.frames_per_s", 0.967, "frames/s", _PERF),
    _p("perf.nano.dlo_ag_dp4_1req.frames_per_s", 0.806, "frames/s", _PERF),
    _p("perf.nano.dlo_ag_dp4_4req.frames_per_s", 3.22, "frames/s", _PERF),
    _p("perf.nano.dlo_noag_dp4.frames_per_s", 0.439, "frames/s", _PERF),
    _p("perf.nano.dlo_ag_dp4_4req.vs_hsdp", 3.3, "x", _PERF),
    _p("perf.nano.dlo_ag_dp4_4req.fraction_of_ideal", 83, "%", _PERF, True),
    _p("perf.nano.allgather_overhead.total", 150, "ms/step", _PERF),
    _p("perf.nano.allgather_overhead.stream_switch", 72, "ms/step", _PERF),
    _p("perf.nano.allgather_overhead.hccl", 10, "ms/step", _PERF),
    _p("perf.nano.allgather_overhead.python_dispatch", 68, "ms/step", _PERF),
    # Host-capacity extrapolation (estimates in the source, never run).
    _p("capacity.33gb_dp4.cgroup_peak", 47, "GB", _CAP),
    _p("capacity.33gb_dp4.physical", 80, "GB", _CAP, True),
    _p("capacity.124gb_dp4.cgroup_peak", 172, "GB", _CAP),
    _p("capacity.124gb_dp4.physical", 296, "GB", _CAP, True),
    _p("capacity.185gb_dp4.cgroup_peak", 220, "GB", _CAP, True),
    _p("capacity.185gb_dp4.physical", 405, "GB", _CAP, True),
    _p("capacity.400gb_dp4.cgroup_peak", 423, "GB", _CAP, True),
    _p("capacity.400gb_dp4.physical", 823, "GB", _CAP, True),
    _p("capacity.400gb_dp8.cgroup_peak", 443, "GB", _CAP, True),
    _p("capacity.400gb_dp8.physical", 843, "GB", _CAP, True),
    _p("capacity.400gb_dp4.private_copy_peak", 2000, "GB", _CAP, True, "'200B at dp 4 without mmap: ~2000 GB'"),
    # B300, Super, 1024^2 T2I (process-tree PSS, peak HBM per card).
    _p("b300.super.dlo_ag_dp4.pss", 200, "GiB", _B300, True, "reported as 198-202 GiB"),
    _p("b300.super.dlo_noag_dp4.pss", 532, "GiB", _B300),
    _p("b300.super.dlo_ag_dp4.hbm_per_card", 12.62, "GiB", _B300),
    _p("b300.super.dlo_noag_dp4.hbm_per_card", 11.43, "GiB", _B300),
    # B300, Super: wave latencies and throughputs (4x B300 SXM6, torch 2.11.0+cu130).
    _p("b300.t2i.dlo_ag_dp4.wave_s", 43.69, "s", _B300, note="4 outputs per wave, 50 steps"),
    _p("b300.t2i.dlo_noag_dp4.wave_s", 112.96, "s", _B300, note="4 outputs per wave"),
    _p("b300.t2i.hsdp_usp4.wave_s", 15.19, "s", _B300, note="1 output per wave"),
    _p("b300.t2i.legacy_usp4.wave_s", 105.22, "s", _B300, note="1 output per wave"),
    _p("b300.t2i.dlo_ag_dp4.outputs_per_s", 0.0915, "outputs/s", _B300),
    _p("b300.t2i.dlo_noag_dp4.outputs_per_s", 0.0354, "outputs/s", _B300),
    _p("b300.t2i.hsdp_usp4.outputs_per_s", 0.0658, "outputs/s", _B300),
    _p("b300.t2i.dlo_ag_dp4.vs_hsdp", 1.39, "x", _B300, note="'1.39x HSDP+USP4 throughput at 30% of its HBM'"),
    _p("b300.t2i.hsdp_usp4.hbm_per_card", 42.00, "GiB", _B300),
    _p("b300.t2v.dlo_ag_dp4.wave_s", 38.79, "s", _T2V, note="4 outputs per wave"),
    _p("b300.t2v.hsdp_usp4.wave_s", 15.38, "s", _T2V),
    _p("b300.t2v.dlo_ag_usp4.wave_s", 30.79, "s", _T2V),
    _p("b300.t2v.legacy_usp4.wave_s", 81.46, "s", _T2V),
    _p("b300.t2v.dlo_ag_dp4.outputs_per_s", 0.1033, "outputs/s", _T2V),
    _p("b300.t2v.hsdp_usp4.outputs_per_s", 0.0653, "outputs/s", _T2V),
    _p("b300.t2v.dlo_ag_usp4.outputs_per_s", 0.0326, "outputs/s", _T2V),
    _p("b300.workloads.480p_121f.dlo_wave_s", 102.58, "s", _WL, note="DLO+AG DP4, 4 outputs"),
    _p("b300.workloads.480p_125f.hsdp_wave_s", 41.36, "s", _WL, note="HSDP ran 125 frames"),
    _p("b300.workloads.480p_241f.dlo_wave_s", 226.70, "s", _WL, note="DLO+AG DP4, 4 outputs"),
    _p("b300.workloads.480p_245f.hsdp_wave_s", 82.47, "s", _WL, note="HSDP ran 245 frames"),
    _p("b300.workloads.720p_121f.dlo_wave_s", 288.29, "s", _WL, note="DLO+AG DP4, 4 outputs"),
    _p("b300.workloads.720p_121f.hsdp_wave_s", 87.47, "s", _WL),
    _p("b300.workloads.720p_241f.dlo_wave_s", 214.53, "s", _WL, note="DLO+AG+USP4, 1 output"),
    _p("b300.workloads.720p_241f.hsdp_wave_s", 210.05, "s", _WL),
    _p("b300.workloads.720p_241f.dlo_vs_hsdp_pct", 2.13, "%", _WL, note="'within 2.13% of HSDP at 47% of its HBM'"),
    # MiniMax-H3, 8x B300 (objective table and paired deltas).
    _p("minimax.t2va.dp1sp8.allgather.wave_p50", 34.55, "s", _MM),
    _p("minimax.t2va.dp1sp8.allgather.wave_p95", 35.25, "s", _MM),
    _p("minimax.t2va.dp1sp8.allgather.videos_per_hour", 103.84, "videos/h", _MM),
    _p("minimax.t2va.dp1sp8.allgather.peak_gib", 26.37, "GiB", _MM),
    _p("minimax.t2va.dp1sp8.allgather.energy_wh", 68.08, "Wh", _MM),
    _p("minimax.t2va.dp4sp2.allgather.wave_p50", 94.73, "s", _MM),
    _p("minimax.t2va.dp4sp2.allgather.wave_p95", 95.31, "s", _MM),
    _p("minimax.t2va.dp4sp2.allgather.videos_per_hour", 151.89, "videos/h", _MM),
    _p("minimax.t2va.dp4sp2.allgather.peak_gib", 25.11, "GiB", _MM),
    _p("minimax.t2va.dp4sp2.allgather.energy_wh", 51.76, "Wh", _MM),
    _p("minimax.t2va.dp8sp1.ranklocal.wave_p50", 156.74, "s", _MM),
    _p("minimax.t2va.dp8sp1.ranklocal.wave_p95", 157.03, "s", _MM),
    _p("minimax.t2va.dp8sp1.ranklocal.videos_per_hour", 183.78, "videos/h", _MM),
    _p("minimax.t2va.dp8sp1.ranklocal.peak_gib", 20.05, "GiB", _MM),
    _p("minimax.t2va.dp8sp1.ranklocal.energy_wh", 43.97, "Wh", _MM),
    _p("minimax.delta.dp1sp8.throughput_pct", 129.4, "%", _MM, note="AllGather vs rank-local, paired 5 waves"),
    _p("minimax.delta.dp1sp8.p50_pct", -56.6, "%", _MM),
    _p("minimax.delta.dp4sp2.throughput_pct", 2.2, "%", _MM),
    _p("minimax.delta.dp8sp1.throughput_pct", -4.1, "%", _MM),
    _p("minimax.delta.dp8sp1.p50_pct", 3.8, "%", _MM),
    _p("minimax.delta.dp8sp1.ranklocal_peak_gib", 20.03, "GiB", _MM),
    _p("minimax.delta.dp8sp1.allgather_peak_gib", 94.03, "GiB", _MM),
)

PUBLISHED: dict[str, Published] = {row.key: row for row in _ROWS}
assert len(PUBLISHED) == len(_ROWS), "duplicate published key"


def published(key: str) -> Published:
    try:
        return PUBLISHED[key]
    except KeyError:
        raise KeyError(f"no published number {key!r}; see benchmarks.repro.published.PUBLISHED") from None


def relative_error(predicted: float, reference: float) -> float:
    """``(predicted - reference) / reference``; a zero reference needs a zero prediction."""
    if reference == 0:
        return 0.0 if predicted == 0 else float("inf")
    return (predicted - reference) / reference


@dataclass(frozen=True, slots=True)
class Comparison:
    """One row of a comparison table: a published number beside what a model predicts, in its unit."""

    key: str
    unit: str
    published: float
    predicted: float
    approx: bool
    source: str
    calibrated: bool = False  # True where a constant was fitted to this very number: agreement by construction

    @property
    def rel_error(self) -> float:
        return relative_error(self.predicted, self.published)

    def as_row(self) -> dict:
        return {
            "key": self.key,
            "unit": self.unit,
            "published": ("~" if self.approx else "") + f"{self.published:g}",
            "predicted": round(self.predicted, 2),
            "rel_error_pct": round(100 * self.rel_error, 1) + 0.0,  # + 0.0: no "-0.0"
            "note": "calibration point" if self.calibrated else "",
        }


def compare(key: str, predicted: float, *, calibrated: bool = False) -> Comparison:
    """``predicted`` is in the published number's own unit (bytes: divide by :data:`UNIT_BYTES` first)."""
    p = published(key)
    return Comparison(key, p.unit, p.value, float(predicted), p.approx, p.source, calibrated)


def compare_bytes(key: str, predicted_bytes: int, *, calibrated: bool = False) -> Comparison:
    """Like :func:`compare`, for a prediction in bytes against a published ``GB``/``GiB`` number."""
    p = published(key)
    return compare(key, predicted_bytes / UNIT_BYTES[p.unit], calibrated=calibrated)
