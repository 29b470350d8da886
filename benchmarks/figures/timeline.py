"""The three-stream timeline on H200 ceilings: video hides PCIe behind compute, image is bound by it.

The timelines are simulated by :mod:`benchmarks.repro.timeline_tables` from the measured H200 ceilings (DESIGN.md
section 6); this module only draws them.

* ``timeline_three_streams``: static Gantt of both cases (PNG) + the spans as CSV.
* ``timeline_animation``: the first blocks of both cases, drawn as time advances, with the event waits of each
  compute (GIF, fixed palette, deterministic bytes).
"""

from __future__ import annotations

import io
import pathlib

from benchmarks.figures.style import COLORS, figure_style, save_png, write_csv
from benchmarks.repro.timeline_tables import (
    CASES,
    MEASURED_TIMELINE,
    MEASURED_TIMELINE_H200,
    bound_of,
    h200_pass,
    measured_vs_predicted,
)
from dlo_fn.cost.ceilings import REF_PASS_NUM_BLOCKS
from dlo_fn.plan.ops import Op
from dlo_fn.plan.timeline import Timeline
from dlo_fn.plan.workload import Workload

__all__ = [
    "draw_gantt",
    "plot_three_streams",
    "plot_overlay",
    "plot_beside",
    "fig_timeline_three_streams",
    "fig_timeline_animation",
    "fig_timeline_measured_vs_predicted",
    "fig_timeline_measured_vs_predicted_h200",
    "FIGURES",
]

ROWS = (("h2d", "H2D\n(copy stream)"), ("allgather", "all-gather\n(W=1: copy)"), ("compute", "compute"))
ANIMATION_BLOCKS = 6
ANIMATION_FRAMES = 36
ANIMATION_FRAME_MS = 90
ANIMATION_HOLD_MS = 1500
ANIMATION_DPI = 90


def draw_gantt(
    ax,
    timeline: Timeline,
    *,
    until_s: float | None = None,
    arrows: bool = False,
    labels: bool = True,
    slots: bool = False,
    rows: tuple[tuple[str, str], ...] = ROWS,
) -> None:
    """Three rows (H2D, all-gather, compute; ``rows`` names them); spans cut at ``until_s``; ``arrows``: the event
    wait of each compute on its load, drawn once the compute has started; ``slots``: label computes
    ``b<block>@s<slot>``."""
    y_of = {stream: len(rows) - 1 - i for i, (stream, _) in enumerate(rows)}
    color = {"h2d": COLORS["h2d"], "allgather": COLORS["allgather"], "compute": COLORS["compute"]}
    loaded_at: dict[int, float] = {}
    for span in timeline.spans:
        op = Op.from_str(span.op)
        if op.kind != "C":
            loaded_at[op.load] = span.end_s
    for span in timeline.spans:
        end = span.end_s if until_s is None else min(span.end_s, until_s)
        if end <= span.start_s and not (until_s is None and span.end_s == span.start_s):
            continue
        y = y_of[span.stream]
        # Bars under 1% of the axis get an edge of their own colour so that they stay visible.
        narrow = end - span.start_s < 0.01 * timeline.makespan_s
        ax.barh(
            y,
            1e3 * (end - span.start_s),
            left=1e3 * span.start_s,
            height=0.62,
            color=color[span.stream],
            edgecolor=color[span.stream] if narrow else "white",
            linewidth=0.8 if narrow else 0.6,
        )
        op = Op.from_str(span.op)
        wide = span.duration_s > (0.07 if slots else 0.03) * timeline.makespan_s
        if labels and end == span.end_s and wide:
            text = f"b{op.block}@s{op.slot}" if op.kind == "C" and slots else f"b{op.block}"
            ax.text(
                1e3 * (span.start_s + span.end_s) / 2, y, text, ha="center", va="center", fontsize=6.5, color="white"
            )
        if arrows and op.kind == "C" and op.load in loaded_at:
            ax.annotate(
                "",
                xy=(1e3 * span.start_s, y + 0.31),
                xytext=(1e3 * loaded_at[op.load], y_of["allgather"] - 0.31),
                arrowprops={"arrowstyle": "->", "color": COLORS["published"], "linestyle": "--", "linewidth": 0.8},
            )
    ax.set_yticks([y_of[s] for s, _ in rows], [label for _, label in rows])
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(0, 1e3 * timeline.makespan_s * 1.01)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="y", visible=False)


def _caption(workload: Workload, tl: Timeline) -> str:
    bound = bound_of(tl)
    stream = "compute" if bound == "compute" else "h2d"
    return (
        f"{workload.name}: {bound}-bound, {REF_PASS_NUM_BLOCKS} blocks in {1e3 * tl.makespan_s:.0f} ms "
        f"({'H2D' if stream == 'h2d' else stream} busy {100 * tl.busy_s(stream) / tl.makespan_s:.0f}%, "
        f"exposed transfer {1e3 * tl.exposed_transfer_s():.1f} ms)"
    )


def _span_rows(cases: dict[str, Timeline]) -> list[dict]:
    return [
        {"case": name, "op": s.op, "stream": s.stream, "start_ms": 1e3 * s.start_s, "end_ms": 1e3 * s.end_s}
        for name, tl in cases.items()
        for s in tl.spans
    ]


def plot_three_streams(cases: dict[str, Timeline] | None = None):
    """The static figure: one Gantt per case (default: both H200 cases); returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    cases = cases or {w.name: h200_pass(w) for w in CASES}
    workloads = {w.name: w for w in CASES}
    with figure_style():
        fig, axes = plt.subplots(len(cases), 1, figsize=(10, 2.6 * len(cases)), squeeze=False)
        for ax, (name, tl) in zip(axes[:, 0], cases.items()):
            draw_gantt(ax, tl)
            ax.set_title(_caption(workloads[name], tl), loc="left")
        fig.suptitle(
            "Two slots on one H200, 24 blocks of 604 MB: video hides the PCIe copies, image is bound by them",
            fontsize=10,
        )
        fig.tight_layout()
    return fig


def plot_overlay(measured: Timeline, predicted: Timeline, *, title: str | None = None):
    """Measured (solid, upper half of each stream row) over predicted (light, lower half) on one time axis,
    both from their own start; returns the matplotlib Figure (not saved: the measurement varies per run)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    y_of = {stream: len(ROWS) - 1 - i for i, (stream, _) in enumerate(ROWS)}
    end_ms = 1e3 * max(measured.makespan_s, predicted.makespan_s)
    with figure_style():
        fig, ax = plt.subplots(figsize=(10, 3.0))
        for tl, dy, alpha in ((measured, 0.19, 1.0), (predicted, -0.19, 0.45)):
            for s in tl.spans:
                color = COLORS[s.stream]
                ax.barh(
                    y_of[s.stream] + dy,
                    1e3 * s.duration_s,
                    left=1e3 * (s.start_s - tl.start_s),
                    height=0.34,
                    color=color,
                    alpha=alpha,
                    edgecolor=color,
                    linewidth=0.6,
                )
        ax.set_yticks([y_of[s] for s, _ in ROWS], [label for _, label in ROWS])
        ax.set_ylim(-0.6, len(ROWS) - 0.4)
        ax.set_xlim(0, end_ms * 1.01)
        ax.set_xlabel("time from the run's first op (ms)")
        ax.grid(axis="y", visible=False)
        ax.legend(
            handles=[Patch(color="0.3", label="measured"), Patch(color="0.3", alpha=0.45, label="predicted")],
            loc="lower right",
            bbox_to_anchor=(1.0, 1.0),
            ncol=2,
            fontsize=7,
            frameon=False,
        )
        ax.set_title(title or "Measured vs predicted (same schedule, median duration per op kind)", loc="left")
        fig.tight_layout()
    return fig


def plot_beside(measured: Timeline, predicted: Timeline, *, title: str | None = None):
    """The measured Timeline (top) and ``predicted``, the simulator's of the same schedule (bottom), each from its
    own first op on one shared time axis, ops labelled by block; returns the matplotlib Figure (not saved: a live
    measurement varies run to run)."""
    import matplotlib.pyplot as plt

    with figure_style():
        fig, axes = plt.subplots(2, 1, figsize=(10, 4.4), sharex=True)
        for ax, tl, what in ((axes[0], measured, "measured"), (axes[1], predicted, "simulated")):
            draw_gantt(ax, tl.shifted(tl.start_s))
            ax.set_title(f"{what}: {1e3 * tl.makespan_s:.1f} ms", loc="left", fontsize=9)
        end_ms = 1e3 * max(measured.makespan_s, predicted.makespan_s)
        axes[1].set_xlim(0, end_ms * 1.01)
        axes[0].set_xlabel("")
        axes[1].set_xlabel("time from the run's first op (ms)")
        if title:
            fig.suptitle(title, fontsize=10)
        fig.tight_layout()
    return fig


def fig_timeline_three_streams(out_dir: pathlib.Path) -> list[pathlib.Path]:
    out_dir = pathlib.Path(out_dir)
    cases = {w.name: h200_pass(w) for w in CASES}
    with figure_style():
        png = save_png(plot_three_streams(cases), out_dir / "timeline_three_streams.png")
    csv = write_csv(
        out_dir / "data" / "timeline_three_streams.csv",
        _span_rows(cases),
        ("case", "op", "stream", "start_ms", "end_ms"),
    )
    return [png, csv]


def _palette_image():
    from PIL import Image

    colors = ["#ffffff", "#000000", "#262626", "#4d4d4d", "#808080", "#b3b3b3", "#d9d9d9", "#ebebeb"]
    colors += [COLORS[k] for k in ("h2d", "allgather", "compute", "published")]
    rgb: list[int] = []
    for c in colors:
        rgb += [int(c[i : i + 2], 16) for i in (1, 3, 5)]
    # Tints of the stream colours for anti-aliased edges.
    for c in colors[8:]:
        base = [int(c[i : i + 2], 16) for i in (1, 3, 5)]
        for t in (0.25, 0.5, 0.75):
            rgb += [round(v + (255 - v) * t) for v in base]
    palette = Image.new("P", (1, 1))
    palette.putpalette(rgb + [0] * (768 - len(rgb)))
    return palette


def fig_timeline_animation(out_dir: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib.pyplot as plt
    from PIL import Image

    out_dir = pathlib.Path(out_dir)
    cases = {w.name: h200_pass(w, num_blocks=ANIMATION_BLOCKS) for w in CASES}
    palette = _palette_image()
    frames = []
    with figure_style():
        for n in range(ANIMATION_FRAMES + 1):
            fig, axes = plt.subplots(2, 1, figsize=(8.0, 4.4), dpi=ANIMATION_DPI)
            for ax, w in zip(axes, CASES):
                tl = cases[w.name]
                draw_gantt(ax, tl, until_s=tl.makespan_s * n / ANIMATION_FRAMES, arrows=True, slots=True)
                ax.set_title(f"{w.name}: {bound_of(tl)}-bound", loc="left")
            fig.suptitle("Slots refill while the other computes; dashed: compute waits for its load", fontsize=9)
            fig.tight_layout()
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=ANIMATION_DPI, metadata={"Software": None})
            plt.close(fig)
            buf.seek(0)
            frames.append(Image.open(buf).convert("RGB").quantize(palette=palette, dither=Image.Dither.NONE))
    path = out_dir / "timeline_animation.gif"
    path.parent.mkdir(parents=True, exist_ok=True)
    durations = [ANIMATION_FRAME_MS] * ANIMATION_FRAMES + [ANIMATION_HOLD_MS]
    frames[0].save(
        path,
        format="GIF",
        save_all=True,
        append_images=frames[1:],
        duration=durations,
        loop=0,
        optimize=False,
        disposal=1,
    )
    csv = write_csv(
        out_dir / "data" / "timeline_animation.csv", _span_rows(cases), ("case", "op", "stream", "start_ms", "end_ms")
    )
    return [path, csv]


def _measured_figure(name: str, path: pathlib.Path, what: str):
    def fig(out_dir: pathlib.Path) -> list[pathlib.Path]:
        out_dir = pathlib.Path(out_dir)
        measured, predicted, record = measured_vs_predicted(path)
        pred = {s.op: s for s in predicted.spans}
        rows = [
            {
                "op": s.op,
                "stream": s.stream,
                "measured_start_ms": 1e3 * (s.start_s - measured.start_s),
                "measured_end_ms": 1e3 * (s.end_s - measured.start_s),
                "predicted_start_ms": 1e3 * (pred[s.op].start_s - predicted.start_s),
                "predicted_end_ms": 1e3 * (pred[s.op].end_s - predicted.start_s),
            }
            for s in measured.spans
        ]
        csv = write_csv(
            out_dir / "data" / f"{name}.csv",
            rows,
            ("op", "stream", "measured_start_ms", "measured_end_ms", "predicted_start_ms", "predicted_end_ms"),
        )
        err_pct = 100 * (predicted.makespan_s / measured.makespan_s - 1)
        title = (
            f"{what}:\nmeasured {1e3 * measured.makespan_s:.1f} ms, replayed {1e3 * predicted.makespan_s:.1f} ms "
            f"({err_pct:+.1f}%)"
        )
        png = save_png(plot_overlay(measured, predicted, title=title), out_dir / f"{name}.png")
        return [png, csv]

    fig.__name__ = f"fig_{name}"
    fig.__doc__ = f"The committed recording {path.name} (`python -m benchmarks bench timeline`) over its replay."
    return fig


fig_timeline_measured_vs_predicted = _measured_figure(
    "timeline_measured_vs_predicted", MEASURED_TIMELINE, "tiny DiT on CPU (host clocks)"
)
fig_timeline_measured_vs_predicted_h200 = _measured_figure(
    "timeline_measured_vs_predicted_h200", MEASURED_TIMELINE_H200, "bench DiT (24 x 0.56 GB) on one H200 (CUDA events)"
)


FIGURES = {
    "timeline_measured_vs_predicted": fig_timeline_measured_vs_predicted,
    "timeline_measured_vs_predicted_h200": fig_timeline_measured_vs_predicted_h200,
    "timeline_three_streams": fig_timeline_three_streams,
    "timeline_animation": fig_timeline_animation,
}
