"""The one table of benchmark variants (benchmarks.repro.variants): each name once, no two variants a table or a
figure cannot tell apart, the benches run exactly its rows, and every option of ours is an offload() option."""

from __future__ import annotations

import pytest

from benchmarks.bench import real_variants, step_variants
from benchmarks.repro.variants import REAL, STEP, labels, short_labels


@pytest.mark.parametrize("table", [REAL, STEP], ids=["real", "step"])
def test_names_and_labels_are_distinct(table):
    names = [v.name for v in table]
    assert len(set(names)) == len(names)
    for named in (labels(table), short_labels(table)):
        assert len(set(named.values())) == len(named), named


def test_the_benches_run_the_tables_rows():
    assert real_variants.VARIANTS == tuple(v.name for v in REAL) and REAL[0].name == "resident"
    assert real_variants.OURS == {v.name: v.options for v in REAL if v.options is not None}
    assert set(real_variants.PREQUANTIZED) <= set(real_variants.OURS)
    assert step_variants.VARIANTS == tuple(v.name for v in STEP if v.runs)
    for name, options in real_variants.OURS.items():
        assert real_variants.options_missing(options) == [], name
