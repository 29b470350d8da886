"""Where the committed measurements live: the repository's ``figures/data/`` (each file names its machine and
the command that wrote it), beside the figures drawn from them."""

from __future__ import annotations

import pathlib

__all__ = ["FIGURES_DIR", "DATA_DIR"]

FIGURES_DIR = pathlib.Path(__file__).resolve().parents[2] / "figures"
DATA_DIR = FIGURES_DIR / "data"
