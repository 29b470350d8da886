"""Tables for notebook 05 (DP concurrency): published performance, the wave timeline model, the AllGather
overhead split, and our measured waves, read from committed files (``figures/data/waves_cpu.csv``, the
recorded wave ``waves_fig5_trace.csv``, both written by ``python -m benchmarks bench waves``, and the H200
``waves_r_sweep_h200.csv``).

Published numbers (the Ascend performance table included) come from :mod:`benchmarks.repro.published`, for the
comparison columns only.
"""

from __future__ import annotations

import csv
import pathlib

from benchmarks.repro.data import DATA_DIR
from benchmarks.repro.published import MODELS, Published, published, relative_error
from benchmarks.repro.wave_model import WaveCosts, predict_wave

__all__ = [
    "perf",
    "NANO_BLOCKS",
    "SHARD_H2D_BYTES_PER_S",
    "TRACE_CSV",
    "SCALING_CSV",
    "TRACE_FIELDS",
    "read_trace",
    "read_scaling",
    "reference_costs",
    "published_rows",
    "model_rows",
    "overhead_rows",
    "sensitivity_rows",
    "cpu_rows",
    "cpu_host_us",
    "h200_r_rows",
    "trace_rows",
    "cost_rows",
]

TRACE_CSV = DATA_DIR / "waves_fig5_trace.csv"
SCALING_CSV = DATA_DIR / "waves_cpu.csv"
TRACE_FIELDS = ("wave", "kind", "rank", "lane", "label", "start_s", "end_s")

NANO_BLOCKS = MODELS["cosmos3-nano"].num_blocks
# Ascend 910B3 host-to-device bandwidth is not published; 25 GB/s (PCIe Gen4 x16 class) is an assumption, and
# the shard copy (33 GB / 72 blocks / 4 ranks = 115 MB, 4.6 ms) stays hidden behind 12 ms of compute for any
# rate above ~10 GB/s, so the result does not depend on it.
SHARD_H2D_BYTES_PER_S = 25e9


def read_trace(path: pathlib.Path = TRACE_CSV) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["wave"], r["rank"] = int(r["wave"]), int(r["rank"])
        r["start_s"], r["end_s"] = float(r["start_s"]), float(r["end_s"])
    return rows


def read_scaling(path: pathlib.Path = SCALING_CSV) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def perf(key: str) -> Published:
    return published(key)


def _ms(key: str) -> float:
    return perf(key).value / 1e3


def reference_costs(host_s: float | None = None, dp_size: int = 4, requests_per_rank: int = 1) -> WaveCosts:
    """Nano DP4 per block: compute ``T_hsdp / B``; host = (stream switching + Python dispatch) / B unless given;
    all-gather = HCCL / B; H2D = the shard at :data:`SHARD_H2D_BYTES_PER_S`."""
    b = NANO_BLOCKS
    if host_s is None:
        host_s = (
            _ms("perf.nano.allgather_overhead.stream_switch") + _ms("perf.nano.allgather_overhead.python_dispatch")
        ) / b
    shard_bytes = MODELS["cosmos3-nano"].checkpoint_bytes / b / dp_size
    return WaveCosts(
        b,
        dp_size,
        _ms("perf.nano.hsdp_sp.ms_per_step") / b,
        host_s,
        _ms("perf.nano.allgather_overhead.hccl") / b,
        shard_bytes / SHARD_H2D_BYTES_PER_S,
        requests_per_rank,
    )


def published_rows() -> list[dict]:
    rows = []
    for name, tag in (
        ("HSDP+SP (baseline)", "hsdp_sp"),
        ("DLO+AG DP4, 1 request", "dlo_ag_dp4_1req"),
        ("DLO+AG DP4, 4 requests", "dlo_ag_dp4_4req"),
        ("DLO no-AG DP4", "dlo_noag_dp4"),
    ):
        rows.append(
            {
                "strategy": name,
                "ms_per_step": perf(f"perf.nano.{tag}.ms_per_step").value,
                "frames_per_s": perf(f"perf.nano.{tag}.frames_per_s").value,
                "vs_hsdp_frames": round(
                    perf(f"perf.nano.{tag}.frames_per_s").value / perf("perf.nano.hsdp_sp.frames_per_s").value, 3
                ),
            }
        )
    return rows


def cost_rows(costs: WaveCosts) -> list[dict]:
    def row(item, formula, value_s):
        return {"per block": item, "formula": formula, "ms": round(1e3 * value_s, 3)}

    return [
        row("compute c", "T_hsdp / B = 870 / 72", costs.compute_s),
        row("host h", "(72 stream switching + 68 dispatch) / 72", costs.host_s),
        row("all-gather a", "10 HCCL / 72", costs.allgather_s),
        row("H2D d", "33 GB / 72 / 4 at 25 GB/s (assumed)", costs.h2d_s),
    ]


def _row(key: str, predicted: float, note: str = "") -> dict:
    p = perf(key)
    return {
        "key": key,
        "unit": p.unit,
        "published": ("~" if p.approx else "") + f"{p.value:g}",
        "predicted": round(predicted, 3),
        "rel_error_pct": round(100 * relative_error(predicted, p.value), 1),
        "note": note,
    }


def model_rows(costs: WaveCosts | None = None) -> list[dict]:
    """Simulated step, speedup and fraction of ideal beside the published ones."""
    pred = predict_wave(costs or reference_costs(), _ms("perf.nano.hsdp_sp.ms_per_step"))
    hsdp = perf("perf.nano.hsdp_sp.frames_per_s").value
    four = perf("perf.nano.dlo_ag_dp4_4req.frames_per_s").value
    return [
        _row("perf.nano.dlo_ag_dp4_4req.ms_per_step", 1e3 * pred.step_s, "simulated steady-state step"),
        _row(
            "perf.nano.allgather_overhead.total",
            1e3 * pred.exposed_s_per_step,
            "exposed per step = step - B c; HCCL hidden by the double buffer",
        ),
        _row("perf.nano.dlo_ag_dp4_4req.vs_hsdp", pred.speedup, f"published frames/s ratio {four / hsdp:.3f}"),
        _row(
            "perf.nano.dlo_ag_dp4_4req.fraction_of_ideal",
            100 * pred.fraction_of_ideal,
            f"published frames/s ratio / 4 = {100 * four / hsdp / 4:.1f}%",
        ),
    ]


def overhead_rows(ours_cpu_us: float, ours_h200_us: float) -> list[dict]:
    """The published 150 ms/step split, per block, beside our measured host work per block."""
    b = NANO_BLOCKS
    rows = []
    for part, key, where in (
        ("stream switching", "stream_switch", "host, serial with compute"),
        ("HCCL collective", "hccl", "comm stream, hidden behind compute"),
        ("Python dispatch", "python_dispatch", "host, serial with compute"),
    ):
        ms = perf(f"perf.nano.allgather_overhead.{key}").value
        rows.append(
            {"component": part, "published_ms_per_step": ms, "ms_per_block": round(ms / b, 3), "in the model": where}
        )
    rows.append(
        {
            "component": "total",
            "published_ms_per_step": perf("perf.nano.allgather_overhead.total").value,
            "ms_per_block": round(perf("perf.nano.allgather_overhead.total").value / b, 3),
            "in the model": "",
        }
    )
    rows.append(
        {
            "component": "ours: executor host work, CPU (measured)",
            "published_ms_per_step": "",
            "ms_per_block": round(ours_cpu_us / 1e3, 4),
            "in the model": "figures/data/waves_cpu.csv",
        }
    )
    rows.append(
        {
            "component": "ours: copy + event + wait, H200 (measured)",
            "published_ms_per_step": "",
            "ms_per_block": round(ours_h200_us / 1e3, 4),
            "in the model": "DESIGN.md section 6",
        }
    )
    return rows


def sensitivity_rows(hosts_us: dict[str, float]) -> list[dict]:
    """Predicted step, speedup and fraction of ideal at DP4 for each host cost per block."""
    rows = []
    for name, us in hosts_us.items():
        pred = predict_wave(reference_costs(host_s=us / 1e6), _ms("perf.nano.hsdp_sp.ms_per_step"))
        rows.append(
            {
                "host per block": name,
                "us": round(us, 1),
                "step_ms": round(1e3 * pred.step_s, 1),
                "speedup_vs_hsdp": round(pred.speedup, 3),
                "fraction_of_ideal": round(pred.fraction_of_ideal, 3),
            }
        )
    return rows


def cpu_rows() -> list[dict]:
    keep = (
        "dp",
        "requests_per_rank",
        "kind",
        "outputs_per_wave",
        "wave_latency_s",
        "outputs_per_s",
        "frames_per_s",
        "efficiency",
        "issue_wait_us_per_block",
    )
    rows = []
    for r in read_scaling():
        row = {k: r[k] for k in keep}
        for k in ("wave_latency_s", "outputs_per_s", "frames_per_s", "efficiency", "issue_wait_us_per_block"):
            row[k] = round(float(r[k]), 3) if r[k] else ""
        rows.append(row)
    return rows


def h200_r_rows() -> list[dict]:
    """``figures/data/waves_r_sweep_h200.csv``: per-output step vs R on one H200 (1024^2 image, CFG)."""
    with open(DATA_DIR / "waves_r_sweep_h200.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return [
        {
            "R": r["requests_per_rank"],
            "per_output_step_ms": round(1e3 * float(r["per_output_step_s"]), 1),
            "resident_step_ms": round(1e3 * float(r["resident_step_s"]), 1),
            "transfer_step_ms": round(1e3 * float(r["transfer_step_s"]), 1),
            "bound_ms": round(1e3 * float(r["bound_s"]), 1),
            "ratio_to_bound": round(float(r["ratio_to_bound"]), 3),
            "same_bytes": r["identical_to_resident"],
        }
        for r in rows
    ]


def cpu_host_us() -> float:
    """Our executor's host work per block, one CPU rank without a process group (the bench's ``host`` row)."""
    return float(next(r["issue_wait_us_per_block"] for r in read_scaling() if r["kind"] == "host"))


def trace_rows() -> list[dict]:
    """Per recorded wave and rank: broadcasts, H2Ds, all-gathers, block computes and the requests computed."""
    rows = []
    trace = read_trace()
    for wave in sorted({r["wave"] for r in trace}):
        for rank in sorted({r["rank"] for r in trace}):
            mine = [r for r in trace if r["wave"] == wave and r["rank"] == rank]
            count = {lane: sum(r["lane"] == lane for r in mine) for lane in ("h2d", "allgather", "compute")}
            reqs = sorted({r["label"].split()[0] for r in mine if r["lane"] == "compute"})
            rows.append(
                {
                    "wave": wave,
                    "kind": mine[0]["kind"],
                    "rank": rank,
                    "broadcast": sum(r["label"] == "broadcast" for r in mine),
                    "h2d": count["h2d"],
                    "allgather": count["allgather"],
                    "computes": count["compute"],
                    "requests": ",".join(reqs) or "idle",
                }
            )
    return rows
