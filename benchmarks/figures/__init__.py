"""One function per figure, used by the notebooks and by `python -m benchmarks figures`.

Each figure module defines ``FIGURES: dict[str, Callable[[pathlib.Path], list[pathlib.Path]]]``: a figure
name mapped to a function that takes the output folder (``figures/``), writes the PNG (and GIF) plus the data
behind it under ``figures/data/``, and returns the paths it wrote. Output is deterministic: see ``style``.
"""

from __future__ import annotations

import importlib
import pathlib
from typing import Callable

# Figure modules; each contributes FIGURES.
FIGURE_MODULES = (
    "benchmarks.figures.timeline",
    "benchmarks.figures.fp8",
    "benchmarks.figures.memory",
    "benchmarks.figures.minimax",
    "benchmarks.figures.cold_start",
    "benchmarks.figures.bench",
    "benchmarks.figures.waves",
    "benchmarks.figures.b300",
    "benchmarks.figures.policy",
    "benchmarks.figures.real",  # contributes its figure once bench real data is committed
)


def all_figures() -> dict[str, Callable[[pathlib.Path], list[pathlib.Path]]]:
    figures: dict[str, Callable[[pathlib.Path], list[pathlib.Path]]] = {}
    for name in FIGURE_MODULES:
        figures.update(importlib.import_module(name).FIGURES)
    return figures
