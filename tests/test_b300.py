"""The B300 timeline model: constants re-derived from their one published number; bounds; golden comparisons."""

from __future__ import annotations

import pytest

from benchmarks.repro import b300
from benchmarks.repro import b300_tables as fb
from benchmarks.repro.published import published


def _super_bytes() -> int:
    return b300.SUPER.num_blocks * b300.block_bytes()


def test_block_bytes_match_the_reference_config():
    assert b300.block_bytes() == 966_059_264  # dlo_fn.models.configs: blocks 0.966 GB


def test_each_calibration_rederives_from_its_published_number():
    n = _super_bytes()
    h2d = n / (published("b300.t2i.dlo_noag_dp4.wave_s").value / 50)
    nv = 0.75 * n / (published("b300.t2i.hsdp_usp4.wave_s").value / 50)
    rate = b300.step_flops(b300.WORKLOADS["480p 241f"].tokens) / (
        published("b300.workloads.480p_241f.dlo_wave_s").value / 35
    )
    assert b300.B300_PINNED_H2D_BYTES_PER_S == pytest.approx(h2d, rel=1e-4)
    assert b300.B300_NVLINK_ALLGATHER_BYTES_PER_S == pytest.approx(nv, rel=1e-4)
    assert b300.B300_EFFECTIVE_FLOP_PER_S == pytest.approx(rate, rel=1e-4)
    for _, key in b300.B300_CALIBRATIONS.values():
        published(key)  # every calibration names a published key that exists


def test_flops_formula_by_hand():
    d, m, lt, dt = 5632, 23680, 512, 1024
    L = 4096
    per_seq = L * (12 * d * d + 4 * d * m + 4 * d * (L + lt)) + 4 * d * dt * lt
    assert b300.step_flops(L) == 2 * 128 * per_seq


def test_serial_load_chain_is_h_plus_a_and_ours_is_max():
    costs = b300.step_costs(b300.WORKLOADS["t2i 1024^2"].tokens)
    ref, bound = b300.simulate_step_s(costs, "DLO+AG DP4", num_landing=1)
    ours, ours_bound = b300.simulate_step_s(costs, "DLO+AG DP4", num_landing=2)
    assert ref == pytest.approx(costs.h2d_shard_s + costs.allgather_s, rel=2e-3) and bound == "h2d+allgather"
    assert ours == pytest.approx(max(costs.h2d_shard_s, costs.allgather_s), rel=2e-3) and ours_bound == "h2d"


def test_bounds_images_transfer_long_video_compute():
    assert b300.predict("t2i 1024^2", "HSDP+USP4").bound == "allgather"
    assert b300.predict("t2i 1024^2", "DLO+AG DP4").bound == "h2d+allgather"
    assert b300.predict("t2i 1024^2", "DLO no-AG DP4").bound == "h2d"
    for w in ("480p 241f", "720p 121f", "720p 241f"):
        assert b300.predict(w, "DLO+AG DP4").bound == "compute"
        assert b300.predict(w, "HSDP+USP4").bound == "compute"


def test_unknown_strategy_is_rejected():
    with pytest.raises(ValueError, match="unknown strategy"):
        b300.predict("480p 29f", "TP4")


def test_golden_comparison():
    rows = {r["key"]: (r["predicted_wave_s"], r["rel_error_pct"], r["bound"]) for r in fb.comparison_rows()}
    assert rows["b300.t2i.dlo_ag_dp4.wave_s"] == (43.43, -0.6, "h2d+allgather")
    assert rows["b300.t2v.dlo_ag_usp4.wave_s"] == (30.4, -1.3, "h2d+allgather")
    assert rows["b300.workloads.720p_121f.dlo_wave_s"] == (297.94, 3.3, "compute")
    assert rows["b300.workloads.720p_241f.dlo_wave_s"] == (273.26, 27.4, "compute")
    head = {r["key"]: r["predicted"] for r in fb.headline_rows()}
    assert head["b300.t2i.dlo_ag_dp4.vs_hsdp"] == 1.4


def test_all_to_all_is_ulysses_bytes_at_nccl_nvlink_bus_rate():
    """u: 4 exchanges (q, k, v, out) x 2 CFG branches x each rank's L / W tokens x D x bf16, (W - 1) / W of it
    remote, at 18 NVLink 5 links x NCCL's 40.1 GB/s each; not the fitted all-gather rate."""
    assert b300.B300_NVLINK_ALL_TO_ALL_BYTES_PER_S == pytest.approx(721.8e9)
    assert "B300_NVLINK_ALL_TO_ALL_BYTES_PER_S" not in b300.B300_CALIBRATIONS
    tokens, d = b300.WORKLOADS["720p 241f"].tokens, b300.SUPER.hidden_dim
    sent = 4 * 2 * (tokens / 4) * d * 2 * 3 / 4 * b300.SUPER.num_blocks
    assert b300.step_costs(tokens).all_to_all_s == pytest.approx(sent / 721.8e9, rel=1e-12)
