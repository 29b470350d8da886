"""Figures 7 and 8 of the seed: the MiniMax-H3 DLO route study on 8x B300, recomputed from its raw CSVs.

Every number drawn here is computed from ``figures/data/minimax_h3_b300/`` (see its ``SOURCE.md``); the
published values (:mod:`dlo_fn.repro.published`) are drawn beside them, with the relative error.

* ``fig7_minimax_frontier``: wave latency vs throughput of every T2VA topology x mode, energy per video, and the
  paired five-wave AllGather vs rank-local deltas (+129.4% at DP1xSP8, +2.2% at DP4xSP2, -4.1% at DP8xSP1).
* ``fig8_minimax_tasks``: the three selected routes for T2VA, FL2VA and Ref2VA: the same frontier ordering.
"""

from __future__ import annotations

import csv
import pathlib
from dataclasses import dataclass

import numpy as np

from dlo_fn.figures.style import COLORS, figure_style, save_png, write_csv
from dlo_fn.repro.published import compare, published

__all__ = [
    "DATA_DIR", "TOPOLOGIES", "SELECTED", "Case", "Route", "PairedDelta",
    "load_cases", "route", "selected_routes", "route_rows", "case_routes", "task_frontiers", "frontier_ordered",
    "ordering_rows", "paired_delta", "paired_deltas", "frontier_comparisons",
    "fig7_minimax_frontier", "fig8_minimax_tasks", "FIGURES",
]

DATA_DIR = pathlib.Path(__file__).resolve().parents[2] / "figures" / "data" / "minimax_h3_b300"
TOPOLOGIES = ((1, 8), (4, 2), (8, 1))
# The route the study selects at each topology: AllGather for latency and the knee, rank-local for throughput.
SELECTED = {(1, 8): "allgather", (4, 2): "allgather", (8, 1): "ranklocal"}
TASKS = ("t2va", "fl2va", "ref2va")
MODE_LABEL = {"allgather": "AllGather", "ranklocal": "rank-local"}


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
            cases[name] = Case(name, row["task"], row["mode"], int(row["dp"]), int(row["sp"]),
                               int(row["measured_videos"]), float(row["energy_wh_per_video"]),
                               float(row["measured_peak_memory_gib"]), tuple(waves[name]))
    return cases


def route(cases: dict[str, Case], task: str, mode: str, dp: int, sp: int, *, pool_soak: bool = True) -> Route:
    """Pool the five-wave case with its fifteen-wave soak repeat (if any and ``pool_soak``)."""
    found = [c for c in cases.values() if (c.task, c.mode, c.dp, c.sp) == (task, mode, dp, sp)
             and (pool_soak or not c.soak)]
    if not found:
        raise KeyError(f"no MiniMax case for task={task} mode={mode} DP{dp}xSP{sp}")
    videos = sum(c.measured_videos for c in found)
    energy = sum(c.energy_wh_per_video * c.measured_videos for c in found) / videos
    return Route(task, mode, dp, sp, tuple(c.case for c in found), tuple(w for c in found for w in c.waves_s),
                 energy, max(c.peak_gib for c in found))


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
        rows.append({"task": task, **{r.label: f"{r.p50_s:.1f} s, {r.videos_per_hour:.1f} v/h" for r in rs},
                     "ordered": frontier_ordered(rs)})
    return rows


def paired_delta(cases: dict[str, Case], dp: int, sp: int) -> PairedDelta:
    ag = route(cases, "t2va", "allgather", dp, sp, pool_soak=False)
    rl = route(cases, "t2va", "ranklocal", dp, sp, pool_soak=False)
    return PairedDelta(dp, sp, 100 * (ag.videos_per_hour / rl.videos_per_hour - 1), 100 * (ag.p50_s / rl.p50_s - 1),
                       ag.peak_gib, rl.peak_gib)


def paired_deltas(cases: dict[str, Case]) -> tuple[PairedDelta, ...]:
    return tuple(paired_delta(cases, *t) for t in TOPOLOGIES)


def frontier_comparisons(cases: dict[str, Case]) -> list:
    """Every published MiniMax number beside the value computed from the CSVs."""
    rows = []
    for r in selected_routes(cases):
        key = f"minimax.t2va.dp{r.dp}sp{r.sp}.{r.mode}"
        for field, value in (("wave_p50", r.p50_s), ("wave_p95", r.p95_s), ("videos_per_hour", r.videos_per_hour),
                             ("peak_gib", r.peak_gib), ("energy_wh", r.energy_wh_per_video)):
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


def _route_row(r: Route, selected: bool) -> dict:
    return {"task": r.task, "topology": r.label, "mode": r.mode, "selected": selected, "cases": "+".join(r.cases),
            "waves": len(r.waves_s), "wave_p50_s": r.p50_s, "wave_p95_s": r.p95_s,
            "videos_per_hour": r.videos_per_hour, "energy_wh_per_video": r.energy_wh_per_video,
            "peak_gib": r.peak_gib}


def route_rows(routes, ndigits: int = 2) -> list[dict]:
    """Routes as display rows (rounded; the figure CSVs keep full precision)."""
    rows = []
    for r in routes:
        row = _route_row(r, SELECTED.get((r.dp, r.sp)) == r.mode)
        del row["cases"]
        rows.append({k: round(v, ndigits) if isinstance(v, float) else v for k, v in row.items()})
    return rows


def case_routes(cases: dict[str, Case]) -> tuple[Route, ...]:
    """Every five-wave case as a route (soak repeats left out), in file order."""
    return tuple(route(cases, c.task, c.mode, c.dp, c.sp, pool_soak=False) for c in cases.values() if not c.soak)


def fig7_minimax_frontier(out_dir: pathlib.Path, data_dir: pathlib.Path = DATA_DIR) -> list[pathlib.Path]:
    """Increasing DP trades wave latency for concurrent outputs, and the better DLO mode flips with topology:
    AllGather at DP1xSP8, rank-local at DP8xSP1 (paired five-wave deltas computed from the CSVs)."""
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    cases = load_cases(data_dir)
    five = {(m, t): route(cases, "t2va", m, *t, pool_soak=False) for m in MODE_LABEL for t in TOPOLOGIES}
    chosen = selected_routes(cases)
    deltas = paired_deltas(cases)
    rows = [_route_row(r, False) for r in five.values()] + [_route_row(r, True) for r in chosen]
    paths = [write_csv(out_dir / "data" / "fig7_minimax_frontier.csv", rows, list(rows[0]))]
    delta_rows = [{"topology": f"DP{d.dp}xSP{d.sp}", "throughput_pct": d.throughput_pct, "p50_pct": d.p50_pct,
                   "allgather_peak_gib": d.allgather_peak_gib, "ranklocal_peak_gib": d.ranklocal_peak_gib,
                   "published_throughput_pct": published(f"minimax.delta.dp{d.dp}sp{d.sp}.throughput_pct").value}
                  for d in deltas]
    paths.append(write_csv(out_dir / "data" / "fig7_minimax_paired_deltas.csv", delta_rows, list(delta_rows[0])))

    with figure_style():
        fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13.5, 4.2))
        for mode, color, marker in (("allgather", COLORS["allgather"], "o"), ("ranklocal", COLORS["h2d"], "s")):
            rs = [five[(mode, t)] for t in TOPOLOGIES]
            ax1.errorbar([r.videos_per_hour for r in rs], [r.p50_s for r in rs],
                         yerr=[[0] * 3, [r.p95_s - r.p50_s for r in rs]], color=color, marker=marker,
                         capsize=3, label=f"{MODE_LABEL[mode]} (5 waves, P50 to P95)")
            for r in rs:
                ax1.annotate(r.label, (r.videos_per_hour, r.p50_s), textcoords="offset points", fontsize=7,
                             xytext=(6, -12) if mode == "ranklocal" else (-52, 4), color=color)
        ax1.plot([r.videos_per_hour for r in chosen], [r.p50_s for r in chosen], "*", ms=11,
                 color=COLORS["measured"], label="selected route, 20 waves pooled (CSV)")
        pub = [(published(f"minimax.t2va.dp{r.dp}sp{r.sp}.{r.mode}.videos_per_hour").value,
                published(f"minimax.t2va.dp{r.dp}sp{r.sp}.{r.mode}.wave_p50").value) for r in chosen]
        ax1.plot(*zip(*pub), "x", ms=9, mew=2, color=COLORS["published"], label="published")
        ax1.set(xlabel="throughput (videos / h)", ylabel="wave latency (s)", title="T2VA serving frontier")
        ax1.legend(fontsize=7, loc="upper left")

        x = np.arange(len(TOPOLOGIES))
        for i, (mode, color) in enumerate((("allgather", COLORS["allgather"]), ("ranklocal", COLORS["h2d"]))):
            ax2.bar(x + (i - 0.5) * 0.38, [five[(mode, t)].energy_wh_per_video for t in TOPOLOGIES], 0.38,
                    color=color, label=MODE_LABEL[mode])
        for r in chosen:
            i = TOPOLOGIES.index((r.dp, r.sp))
            p = published(f"minimax.t2va.dp{r.dp}sp{r.sp}.{r.mode}.energy_wh").value
            ax2.plot(i + (-0.19 if r.mode == "allgather" else 0.19), p, "x", ms=9, mew=2, color=COLORS["published"])
            err = round(100 * (r.energy_wh_per_video / p - 1), 1) + 0.0
            ax2.annotate(f"{r.energy_wh_per_video:.2f} Wh\n({err:+.1f}% vs pub.)", (i, 100), ha="center",
                         fontsize=7)
        ax2.set(xticks=x, xticklabels=[f"DP{d}xSP{s}" for d, s in TOPOLOGIES], ylabel="energy per video (Wh)",
                ylim=(0, 110), title="energy per video (x: published, selected route)")
        ax2.legend(fontsize=7)

        ax3.bar(x, [d.throughput_pct for d in deltas], 0.5, color=COLORS["measured"],
                label="computed from the CSV (5 + 5 waves)")
        for i, d in enumerate(deltas):
            p = published(f"minimax.delta.dp{d.dp}sp{d.sp}.throughput_pct").value
            ax3.plot(i, p, "x", ms=10, mew=2, color=COLORS["published"], label="published" if i == 0 else None)
            ax3.annotate(f"{d.throughput_pct:+.1f}%\n(pub. {p:+.1f}%)", (i, max(d.throughput_pct, 0)),
                         ha="center", textcoords="offset points", xytext=(0, 6), fontsize=7)
        ax3.axhline(0, color="k", lw=0.8)
        ax3.set(xticks=x, xticklabels=[f"DP{d}xSP{s}" for d, s in TOPOLOGIES], ylim=(-20, 150),
                ylabel="AllGather vs rank-local throughput (%)", title="paired mode comparison")
        ax3.legend(fontsize=7, loc="upper right")
        best = {t: max(MODE_LABEL, key=lambda m: five[(m, t)].videos_per_hour) for t in TOPOLOGIES}
        fig.suptitle("MiniMax-H3, 8x B300: the faster DLO mode depends on topology ("
                     + ", ".join(f"DP{d}xSP{s}: {MODE_LABEL[best[(d, s)]]}" for d, s in TOPOLOGIES) + ")")
        fig.tight_layout()
        paths.insert(0, save_png(fig, out_dir / "fig7_minimax_frontier.png"))
    return paths


def fig8_minimax_tasks(out_dir: pathlib.Path, data_dir: pathlib.Path = DATA_DIR) -> list[pathlib.Path]:
    """FL2VA and Ref2VA change absolute latency and throughput but keep the DP1xSP8 -> DP4xSP2 -> DP8xSP1
    ordering: each step right buys throughput with latency (n = 5 waves per route)."""
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    cases = load_cases(data_dir)
    routes = task_frontiers(cases)
    rows = [_route_row(r, True) for rs in routes.values() for r in rs]
    paths = [write_csv(out_dir / "data" / "fig8_minimax_tasks.csv", rows, list(rows[0]))]
    ordered = all(frontier_ordered(rs) for rs in routes.values())
    colors = {"t2va": COLORS["compute"], "fl2va": COLORS["allgather"], "ref2va": COLORS["h2d"]}
    offsets = {"t2va": (6, -12), "fl2va": (-62, 6), "ref2va": (6, -4)}
    with figure_style():
        fig, ax = plt.subplots(figsize=(6.8, 4.4))
        for task, rs in routes.items():
            ax.plot([r.videos_per_hour for r in rs], [r.p50_s for r in rs], "-o", color=colors[task],
                    label=task.upper())
            for r in rs:
                ax.plot([r.videos_per_hour] * len(r.waves_s), r.waves_s, ".", ms=3, alpha=0.5, color=colors[task])
                ax.annotate(r.label, (r.videos_per_hour, r.p50_s), fontsize=7, textcoords="offset points",
                            xytext=offsets[task], color=colors[task])
        verdict = "the same" if ordered else "NOT the same"
        ax.set(xlabel="throughput (videos / h)", ylabel="wave latency (s); dots: every wave, line: P50",
               title=f"{verdict} DP1xSP8 -> DP4xSP2 -> DP8xSP1 ordering for every task\n"
                     "(AllGather at DP1xSP8 and DP4xSP2, rank-local at DP8xSP1; 5 waves each)")
        ax.legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        paths.insert(0, save_png(fig, out_dir / "fig8_minimax_tasks.png"))
    return paths


FIGURES = {"fig7_minimax_frontier": fig7_minimax_frontier, "fig8_minimax_tasks": fig8_minimax_tasks}
