"""FP8 shards on the timeline: one warm image step of the bench model in BF16 and with FP8 shards, simulated from
one H200 run's measured inputs (:func:`benchmarks.repro.fp8_tables.h200_passes`); the dequantise ops have the
all-gather stream's lane (rank-local: no all-gather), between each block's copy and its compute."""

from __future__ import annotations

import pathlib

from benchmarks.figures.style import figure_style, save_png, write_csv
from benchmarks.figures.timeline import draw_gantt
from benchmarks.repro.fp8_tables import h200_passes
from dlo_fn.plan.timeline import Timeline

__all__ = ["FIGURES", "plot_fp8_pass", "fig_timeline_fp8"]

ROWS = (("h2d", "H2D\n(copy stream)"), ("allgather", "DQ\n(all-gather stream)"), ("compute", "compute"))
FIELDS = ("weights", "op", "stream", "start_ms", "end_ms")


def plot_fp8_pass(passes: dict[str, Timeline] | None = None):
    """One Gantt per pass on a shared time axis; returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    passes = passes or h200_passes()
    end_ms = 1e3 * max(tl.makespan_s for tl in passes.values()) * 1.01
    with figure_style():
        fig, axes = plt.subplots(len(passes), 1, figsize=(10, 2.4 * len(passes)), squeeze=False, sharex=True)
        for ax, (name, tl) in zip(axes[:, 0], passes.items()):
            draw_gantt(ax, tl, rows=ROWS)
            ax.set_xlim(0, end_ms)
            ax.set_title(
                f"{name}: {1e3 * tl.makespan_s:.0f} ms, H2D busy {1e3 * tl.busy_s('h2d'):.0f} ms, "
                f"DQ {1e3 * tl.busy_s('allgather'):.1f} ms, compute {1e3 * tl.busy_s('compute'):.0f} ms",
                loc="left",
            )
        fig.suptitle(
            "FP8 shards halve the copies: the bench model's image step turns from PCIe- to compute-bound "
            "(simulated, one H200's inputs)",
            fontsize=10,
        )
        fig.tight_layout()
    return fig


def fig_timeline_fp8(out_dir: pathlib.Path) -> list[pathlib.Path]:
    out_dir = pathlib.Path(out_dir)
    passes = h200_passes()
    with figure_style():
        png = save_png(plot_fp8_pass(passes), out_dir / "timeline_fp8.png")
    rows = [
        {"weights": name, "op": s.op, "stream": s.stream, "start_ms": 1e3 * s.start_s, "end_ms": 1e3 * s.end_s}
        for name, tl in passes.items()
        for s in tl.spans
    ]
    return [png, write_csv(out_dir / "data" / "timeline_fp8.csv", rows, FIELDS)]


FIGURES = {"timeline_fp8": fig_timeline_fp8}
