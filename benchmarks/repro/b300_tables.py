"""The published 4x B300 throughput tables beside the timeline model (:mod:`benchmarks.repro.b300`): the rows
notebook 07 prints and ``figures/b300_throughput.png`` draws (published, predicted, relative error, bound).
"""

from __future__ import annotations

from benchmarks.repro import b300
from benchmarks.repro.published import compare

__all__ = ["CASES", "FIELDS", "comparison_rows", "headline_rows", "cost_rows"]

# (published key, workload, strategy, calibrated): every published B300 wave latency of Super.
CASES = (
    ("b300.t2i.hsdp_usp4.wave_s", "t2i 1024^2", "HSDP+USP4", True),
    ("b300.t2i.dlo_ag_dp4.wave_s", "t2i 1024^2", "DLO+AG DP4", False),
    ("b300.t2i.dlo_noag_dp4.wave_s", "t2i 1024^2", "DLO no-AG DP4", True),
    ("b300.t2v.hsdp_usp4.wave_s", "480p 29f", "HSDP+USP4", False),
    ("b300.t2v.dlo_ag_dp4.wave_s", "480p 29f", "DLO+AG DP4", False),
    ("b300.t2v.dlo_ag_usp4.wave_s", "480p 29f", "DLO+AG+USP4", False),
    ("b300.workloads.480p_125f.hsdp_wave_s", "480p 125f", "HSDP+USP4", False),
    ("b300.workloads.480p_121f.dlo_wave_s", "480p 121f", "DLO+AG DP4", False),
    ("b300.workloads.480p_245f.hsdp_wave_s", "480p 245f", "HSDP+USP4", False),
    ("b300.workloads.480p_241f.dlo_wave_s", "480p 241f", "DLO+AG DP4", True),
    ("b300.workloads.720p_121f.hsdp_wave_s", "720p 121f", "HSDP+USP4", False),
    ("b300.workloads.720p_121f.dlo_wave_s", "720p 121f", "DLO+AG DP4", False),
    ("b300.workloads.720p_241f.hsdp_wave_s", "720p 241f", "HSDP+USP4", False),
    ("b300.workloads.720p_241f.dlo_wave_s", "720p 241f", "DLO+AG+USP4", False),
)
FIELDS = (
    "key",
    "workload",
    "strategy",
    "outputs_per_wave",
    "published_wave_s",
    "predicted_wave_s",
    "rel_error_pct",
    "published_outputs_per_s",
    "predicted_outputs_per_s",
    "bound",
    "note",
)


def comparison_rows() -> list[dict]:
    rows = []
    for key, workload, strategy, calibrated in CASES:
        p = b300.predict(workload, strategy)
        c = compare(key, p.wave_s, calibrated=calibrated)
        rows.append(
            {
                "key": key,
                "workload": workload,
                "strategy": strategy,
                "outputs_per_wave": p.outputs_per_wave,
                "published_wave_s": c.published,
                "predicted_wave_s": round(p.wave_s, 2),
                "rel_error_pct": round(100 * c.rel_error, 1) + 0.0,
                "published_outputs_per_s": round(p.outputs_per_wave / c.published, 4),
                "predicted_outputs_per_s": round(p.outputs_per_s, 4),
                "bound": p.bound,
                "note": "calibration point" if calibrated else "",
            }
        )
    return rows


def headline_rows() -> list[dict]:
    """The two claims of the write-up, as ratios of predicted waves."""
    t2i_dlo, t2i_hsdp = b300.predict("t2i 1024^2", "DLO+AG DP4"), b300.predict("t2i 1024^2", "HSDP+USP4")
    v_dlo, v_hsdp = b300.predict("720p 241f", "DLO+AG+USP4"), b300.predict("720p 241f", "HSDP+USP4")
    return [
        compare("b300.t2i.dlo_ag_dp4.vs_hsdp", t2i_dlo.outputs_per_s / t2i_hsdp.outputs_per_s).as_row(),
        compare("b300.workloads.720p_241f.dlo_vs_hsdp_pct", 100 * (v_dlo.wave_s / v_hsdp.wave_s - 1)).as_row(),
    ]


def cost_rows() -> list[dict]:
    """Per-step costs of one rank (seconds): ``c`` compute of a whole request on one GPU, ``h`` shard H2D,
    ``a`` weight all-gather, ``u`` Ulysses all-to-all; what bounds DLO+AG DP4 and HSDP+USP4."""
    rows = []
    for name in ("t2i 1024^2", "480p 29f", "480p 121f", "480p 241f", "720p 121f", "720p 241f"):
        w = b300.WORKLOADS[name]
        c = b300.step_costs(w.tokens)
        rows.append(
            {
                "workload": name,
                "tokens": w.tokens,
                "c_s": round(c.compute_s, 3),
                "c/W+u_s": round(c.compute_s / b300.NUM_GPUS + c.all_to_all_s, 3),
                "h_s": round(c.h2d_shard_s, 3),
                "a_s": round(c.allgather_s, 3),
                "dp4_bound": b300.predict(w, "DLO+AG DP4").bound,
                "hsdp_bound": b300.predict(w, "HSDP+USP4").bound,
            }
        )
    return rows
