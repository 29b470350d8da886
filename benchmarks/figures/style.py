"""Fixed figure style and byte-stable saving: regenerating a figure changes no committed byte."""

from __future__ import annotations

import contextlib
import csv
import pathlib
import sys
from typing import Iterable, Iterator, Mapping, Sequence

import matplotlib

if "ipykernel" not in sys.modules:  # scripts and tests render off-screen; notebooks keep their inline backend
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RC = {
    "figure.dpi": 100,
    "savefig.dpi": 110,
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.frameon": False,
    "svg.hashsalt": "dlo_fn",
    "path.simplify": True,
}

# One colour per stream / series family, used by every figure.
COLORS = {
    "h2d": "#4C72B0",
    "allgather": "#DD8452",
    "compute": "#55A868",
    "published": "#C44E52",
    "predicted": "#8172B3",
    "measured": "#937860",
    "other": "#8C8C8C",
}


@contextlib.contextmanager
def figure_style() -> Iterator[None]:
    with plt.rc_context(RC):
        yield


def save_png(fig: "plt.Figure", path: pathlib.Path) -> pathlib.Path:
    """Save without timestamps or version strings in the metadata, so the bytes are reproducible."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", metadata={"Software": None}, pil_kwargs={"optimize": False})
    plt.close(fig)
    return path


def write_csv(path: pathlib.Path, rows: Iterable[Mapping[str, object]], fields: Sequence[str]) -> pathlib.Path:
    """Write rows with a fixed column order and '\\n' line ends (byte-stable across platforms)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields), lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt(row.get(k, "")) for k in fields})
    return path


def _fmt(value: object) -> object:
    if isinstance(value, float):
        return f"{value:.6g}"
    return value
