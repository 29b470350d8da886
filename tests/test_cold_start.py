"""Figure 2 data (benchmarks.repro.cold_start): the model's Nano DP4 terms, the sweep reader and the slope fit."""

from __future__ import annotations

import pytest

from benchmarks.repro import cold_start as fig2
from dlo_fn.cost.memory import GB


def _rows(m, c, ns=(1, 2, 3, 4)):
    return [
        {"mode": "mmap", "ranks": n, "sum_pss_bytes": m + n * c, "model_bytes": m, "constant_pss_bytes": c} for n in ns
    ] + [
        {"mode": "copy", "ranks": n, "sum_pss_bytes": n * (m + c), "model_bytes": m, "constant_pss_bytes": c}
        for n in ns
    ]


def test_fit_recovers_the_two_laws():
    fits = fig2.fit_sweep(_rows(1000, 150))
    assert fits["mmap"].slope_bytes == pytest.approx(150) and fits["mmap"].intercept_bytes == pytest.approx(1000)
    assert fits["copy"].slope_bytes == pytest.approx(1150) and abs(fits["copy"].intercept_bytes) < 1e-6
    assert fits["mmap"].slope_ratio == pytest.approx(1) and fits["copy"].expected_intercept_bytes == 0
    (copy, mmap) = fig2.fit_rows(fits)
    assert (copy["mode"], mmap["law"]) == ("copy", "M + N c")


def test_fit_needs_two_points_per_mode():
    with pytest.raises(ValueError, match="a slope needs two or more"):
        fig2.fit_sweep(_rows(1000, 150, ns=(2,)))


def test_model_terms_match_the_published_decomposition():
    starts = fig2.nano_cold_starts()
    copy, mmap = starts["private-copy"], starts["mmap"]
    assert copy.private_copy_bytes == 4 * copy.page_cache_bytes and mmap.private_copy_bytes == 0
    assert copy.cgroup_peak_bytes - mmap.cgroup_peak_bytes == copy.private_copy_bytes
    assert {c.key: abs(c.rel_error) < 0.02 for c in fig2.nano_comparisons() if "cgroup_peak" in c.key} == {
        "fig2.nano_dp4.private_copy.cgroup_peak": True,
        "fig2.nano_dp4.mmap.cgroup_peak": True,
    }
    assert 45 * GB < mmap.cgroup_peak_bytes < 49 * GB


def test_committed_sweep_shows_both_laws():
    """The committed measurement itself: slopes within 10% of c (mmap) and M + c (copy)."""
    sweep = fig2.read_sweep()
    assert sorted({r["ranks"] for r in sweep}) == [1, 2, 3, 4] and {r["mode"] for r in sweep} == {"mmap", "copy"}
    assert all(
        r["machine"] and r["command"].startswith(("python -m benchmarks bench load", "python -m dlo_fn bench load"))
        for r in sweep
    )
    fits = fig2.fit_sweep(sweep)
    assert all(abs(f.slope_ratio - 1) < 0.1 for f in fits.values()), fig2.fit_rows(fits)
    assert 0.9e9 < fits["copy"].model_bytes < 1.1e9
