"""CI fails when a regenerated figure or the data behind it differs from the committed bytes."""

from __future__ import annotations

import pathlib

import pytest

from benchmarks.figures import all_figures

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIGURES = all_figures()


def test_every_registered_module_contributes_figures():
    assert FIGURES, "no figure modules are importable"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIGURES))
def test_regenerated_figure_matches_committed(name, tmp_path):
    out = tmp_path / "figures"
    # Figures drawn from measurements read their inputs from the committed figures/data/.
    written = FIGURES[name](out)
    assert written, f"figure {name} wrote nothing"
    for path in written:
        rel = path.relative_to(out)
        committed = ROOT / "figures" / rel
        assert committed.exists(), f"{rel} is not committed: run `python -m benchmarks figures --only {name}`"
        assert path.read_bytes() == committed.read_bytes(), (
            f"{rel} differs from the committed file: regenerate with `python -m benchmarks figures --only {name}` "
            f"and commit, or make the figure deterministic"
        )
