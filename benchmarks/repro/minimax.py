"""The MiniMax-H3 DLO route study on 8x B300 (Figures 7 and 8 of the seed), recomputed from its raw CSVs.

Every number here is computed from ``figures/data/minimax_h3_b300/`` (see its ``SOURCE.md``); the published
values (:mod:`benchmarks.repro.published`) are compared with them (:func:`frontier_comparisons`): the selected
route's wave P50 / P95, videos per hour, peak memory and energy per video, and the paired five-wave AllGather vs
rank-local deltas (+129.4% at DP1xSP8, +2.2% at DP4xSP2, -4.1% at DP8xSP1).
"""

from __future__ import annotations

import csv
import pathlib
from dataclasses import dataclass

import numpy as np

from benchmarks.repro.data import DATA_DIR as FIGURES_DATA_DIR
from benchmarks.repro.published import compare, published

__all__ = [
    "DATA_DIR",
    "TOPOLOGIES",
    "SELECTED",
    "TASKS",
    "Case",
    "Route",
    "PairedDelta",
    "load_cases",
    "route",
    "selected_routes",
    "route_row",
    "route_rows",
    "case_routes",
    "task_frontiers",
    "frontier_ordered",
    "ordering_rows",
    "paired_delta",
    "paired_deltas",
    "delta_rows",
    "frontier_comparisons",
]

DATA_DIR = FIGURES_DATA_DIR / "minimax_h3_b300"
TOPOLOGIES = ((1, 8), (4, 2), (8, 1))
# The route the study selects at each topology: AllGather for latency and the knee, rank-local for throughput.
SELECTED = {(1, 8): "allgather", (4, 2): "allgather", (8, 1): "ranklocal"}
TASKS = ("t2va", "fl2va", "ref2va")


@dataclass(frozen=True, slots=True)
class Case:
    """One row of ``industrial_results.csv`` with its wave samples."""

    case: str
    task: str
    mode: str
    dp: int
    sp: int
    measured_videos: int
    energy_wh_per_video: float
    peak_gib: float
    waves_s: tuple[float, ...]

    @property
    def soak(self) -> bool:
        return self.case.startswith("soak-")


@dataclass(frozen=True, slots=True)
class Route:
    """A topology x mode of one task, its cases' waves pooled."""

    task: str
    mode: str
    dp: int
    sp: int
    cases: tuple[str, ...]
    waves_s: tuple[float, ...]
    energy_wh_per_video: float
    peak_gib: float

    @property
    def label(self) -> str:
        return f"DP{self.dp}xSP{self.sp}"

    @property
    def p50_s(self) -> float:
        return float(np.percentile(self.waves_s, 50))

    @property
    def p95_s(self) -> float:
        return float(np.percentile(self.waves_s, 95))

    @property
    def videos_per_hour(self) -> float:
        """Outputs per wave time: ``3600 * dp * waves / sum(wave seconds)``."""
        return 3600.0 * self.dp * len(self.waves_s) / float(np.sum(self.waves_s))


@dataclass(frozen=True, slots=True)
class PairedDelta:
    """AllGather relative to rank-local at one topology, from the two five-wave T2VA cases."""

    dp: int
    sp: int
    throughput_pct: float
    p50_pct: float
    allgather_peak_gib: float
    ranklocal_peak_gib: float


def load_cases(data_dir: pathlib.Path = DATA_DIR) -> dict[str, Case]:
    data_dir = pathlib.Path(data_dir)
    waves: dict[str, list[float]] = {}
    with (data_dir / "wave_samples.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            waves.setdefault(row["case"], []).append(float(row["wave_s"]))
    cases = {}
    with (data_dir / "industrial_results.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            name = row["case"]
            if name not in waves:
                raise ValueError(f"{data_dir / 'wave_samples.csv'}: no waves for case {name!r}")
            cases[name] = Case(
                name,
                row["task"],
                row["mode"],
                int(row["dp"]),
                int(row["sp"]),
                int(row["measured_videos"]),
                float(row["energy_wh_per_video"]),
                float(row["measured_peak_memory_gib"]),
                tuple(waves[name]),
            )
    return cases


def route(cases: dict[str, Case], task: str, mode: str, dp: int, sp: int, *, pool_soak: bool = True) -> Route:
    """Pool the five-wave case with its fifteen-wave soak repeat (if any and ``pool_soak``)."""
    found = [
        c for c in cases.values() if (c.task, c.mode, c.dp, c.sp) == (task, mode, dp, sp) and (pool_soak or not c.soak)
    ]
    if not found:
        raise KeyError(f"no MiniMax case for task={task} mode={mode} DP{dp}xSP{sp}")
    videos = sum(c.measured_videos for c in found)
    energy = sum(c.energy_wh_per_video * c.measured_videos for c in found) / videos
    return Route(
        task,
        mode,
        dp,
        sp,
        tuple(c.case for c in found),
        tuple(w for c in found for w in c.waves_s),
        energy,
        max(c.peak_gib for c in found),
    )


def selected_routes(cases: dict[str, Case], task: str = "t2va") -> tuple[Route, ...]:
    return tuple(route(cases, task, SELECTED[t], *t) for t in TOPOLOGIES)


def task_frontiers(cases: dict[str, Case]) -> dict[str, tuple[Route, ...]]:
    """The selected route at each topology, per task, from the five-wave cases (what Figure 8 draws)."""
    return {task: tuple(route(cases, task, SELECTED[t], *t, pool_soak=False) for t in TOPOLOGIES) for task in TASKS}


def frontier_ordered(routes: tuple[Route, ...]) -> bool:
    """Each step to more DP raises both wave latency and throughput."""
    return all(a.p50_s < b.p50_s and a.videos_per_hour < b.videos_per_hour for a, b in zip(routes, routes[1:]))


def ordering_rows(cases: dict[str, Case]) -> list[dict]:
    rows = []
    for task, rs in task_frontiers(cases).items():
        rows.append(
            {
                "task": task,
                **{r.label: f"{r.p50_s:.1f} s, {r.videos_per_hour:.1f} v/h" for r in rs},
                "ordered": frontier_ordered(rs),
            }
        )
    return rows


def paired_delta(cases: dict[str, Case], dp: int, sp: int) -> PairedDelta:
    ag = route(cases, "t2va", "allgather", dp, sp, pool_soak=False)
    rl = route(cases, "t2va", "ranklocal", dp, sp, pool_soak=False)
    return PairedDelta(
        dp,
        sp,
        100 * (ag.videos_per_hour / rl.videos_per_hour - 1),
        100 * (ag.p50_s / rl.p50_s - 1),
        ag.peak_gib,
        rl.peak_gib,
    )


def paired_deltas(cases: dict[str, Case]) -> tuple[PairedDelta, ...]:
    return tuple(paired_delta(cases, *t) for t in TOPOLOGIES)


def frontier_comparisons(cases: dict[str, Case]) -> list:
    """Every published MiniMax number beside the value computed from the CSVs."""
    rows = []
    for r in selected_routes(cases):
        key = f"minimax.t2va.dp{r.dp}sp{r.sp}.{r.mode}"
        for field, value in (
            ("wave_p50", r.p50_s),
            ("wave_p95", r.p95_s),
            ("videos_per_hour", r.videos_per_hour),
            ("peak_gib", r.peak_gib),
            ("energy_wh", r.energy_wh_per_video),
        ):
            rows.append(compare(f"{key}.{field}", value))
    for d in paired_deltas(cases):
        key = f"minimax.delta.dp{d.dp}sp{d.sp}"
        rows.append(compare(f"{key}.throughput_pct", d.throughput_pct))
        if d.dp != 4:  # the source gives no P50 delta at DP4xSP2
            rows.append(compare(f"{key}.p50_pct", d.p50_pct))
    d8 = paired_delta(cases, 8, 1)
    rows.append(compare("minimax.delta.dp8sp1.ranklocal_peak_gib", d8.ranklocal_peak_gib))
    rows.append(compare("minimax.delta.dp8sp1.allgather_peak_gib", d8.allgather_peak_gib))
    return rows


def route_row(r: Route, selected: bool) -> dict:
    """One route with every wave statistic at full precision (the figure CSVs' row)."""
    return {
        "task": r.task,
        "topology": r.label,
        "mode": r.mode,
        "selected": selected,
        "cases": "+".join(r.cases),
        "waves": len(r.waves_s),
        "wave_p50_s": r.p50_s,
        "wave_p95_s": r.p95_s,
        "videos_per_hour": r.videos_per_hour,
        "energy_wh_per_video": r.energy_wh_per_video,
        "peak_gib": r.peak_gib,
    }


def route_rows(routes, ndigits: int = 2) -> list[dict]:
    """Routes as display rows (rounded; the figure CSVs keep full precision)."""
    rows = []
    for r in routes:
        row = route_row(r, SELECTED.get((r.dp, r.sp)) == r.mode)
        del row["cases"]
        rows.append({k: round(v, ndigits) if isinstance(v, float) else v for k, v in row.items()})
    return rows


def case_routes(cases: dict[str, Case]) -> tuple[Route, ...]:
    """Every five-wave case as a route (soak repeats left out), in file order."""
    return tuple(route(cases, c.task, c.mode, c.dp, c.sp, pool_soak=False) for c in cases.values() if not c.soak)


def delta_rows(deltas: tuple[PairedDelta, ...]) -> list[dict]:
    """The paired deltas beside the published throughput deltas (the rows of Figure 7's right panel)."""
    return [
        {
            "topology": f"DP{d.dp}xSP{d.sp}",
            "throughput_pct": d.throughput_pct,
            "p50_pct": d.p50_pct,
            "allgather_peak_gib": d.allgather_peak_gib,
            "ranklocal_peak_gib": d.ranklocal_peak_gib,
            "published_throughput_pct": published(f"minimax.delta.dp{d.dp}sp{d.sp}.throughput_pct").value,
        }
        for d in deltas
    ]
