"""Memory models: host (cold start, pinned, cgroup vs physical), HBM, Figure 1 approaches, calibrations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.repro import deployment
from benchmarks.repro.published import MODELS, PUBLISHED, compare, published, relative_error
from dlo_fn.cost import calibration as cal
from dlo_fn.cost.accounting import memory_accounting
from dlo_fn.cost.hbm import approach_memory, hbm_per_card, scale_activation_bytes
from dlo_fn.cost.memory import (
    GB,
    ModelSizes,
    cold_start,
    host_capacity,
    host_steady_state,
    parse_bytes,
    pinned_host_bytes_per_rank,
)
from dlo_fn.plan.layout import model_layout
from dlo_fn.plan.spec import BlockSpec, ModelSpec, TensorSpec
from dlo_fn.plan.summary import plan_summary

SMALL = ModelSizes("small", (100, 300, 200), resident_bytes=50)
# The plan's models take the deployment's two constants as inputs; these tests pass the published calibration.
FW, CTX = cal.FRAMEWORK_HOST_BYTES_PER_RANK, cal.DEVICE_CONTEXT_BYTES


@pytest.mark.parametrize(
    "text, expected",
    [
        ("124GB", 124 * 10**9),
        ("33e9", 33 * 10**9),
        ("1.5TiB", int(1.5 * 2**40)),
        ("512MiB", 512 * 2**20),
        ("1000", 1000),
        (" 2 gb ", 2 * 10**9),
        (7, 7),
        ("0", 0),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["12XB", "GB", "-3GB", "1e400", "", "1,5GB"])
def test_parse_bytes_rejects_bad_sizes(text):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


def test_model_sizes_factories():
    u = ModelSizes.uniform("u", 1003, 4, resident_bytes=3)
    assert u.block_bytes == (250, 250, 250, 250) and u.total_bytes == 1003
    v = ModelSizes.uniform("v", 10, 3)
    assert sorted(v.block_bytes) == [3, 3, 4] and v.total_bytes == 10
    m = ModelSizes.from_max_block("m", 1050, 300, resident_bytes=50)
    assert m.block_bytes == (300, 300, 300, 100) and m.max_block_bytes == 300
    with pytest.raises(ValueError, match="blocks"):
        ModelSizes.uniform("x", 3, 4)
    with pytest.raises(ValueError, match="positive"):
        ModelSizes("x", (0,))


def test_shards_small_numbers():
    # A = 8, W = 3: ceil(100/3)=34 -> 40, ceil(300/3)=100 -> 104, ceil(200/3)=67 -> 72
    assert SMALL.shard_bytes(3, 8) == (40, 104, 72)
    assert SMALL.shard_bytes_per_rank(3, 8) == 216
    assert SMALL.max_shard_bytes(3, 8) == 104 and SMALL.max_padded_block_bytes(3, 8) == 312
    assert pinned_host_bytes_per_rank(SMALL, 3, "allgather", 8) == 216
    assert pinned_host_bytes_per_rank(SMALL, 3, "rank-local", 8) == 104 + 304 + 200  # aligned whole blocks
    assert pinned_host_bytes_per_rank(SMALL, 3, "rank-local-mmap", 8) == 0


def test_cold_start_small_numbers():
    m = SMALL.total_bytes  # 650
    mm = cold_start(SMALL, 3, "mmap", framework_bytes_per_rank=10, transient_bytes=5, alignment_bytes=8)
    assert mm.cgroup_peak_bytes == m + 3 * 10 + 5
    assert mm.rss_bytes == 35
    assert mm.hwm_bytes_per_rank == 216 + 50 + 10  # own shards + resident + c
    pc = cold_start(SMALL, 3, "private-copy", framework_bytes_per_rank=10)
    assert pc.cgroup_peak_bytes == 3 * m + m + 30
    assert pc.hwm_bytes_per_rank == m + 10
    rl = cold_start(SMALL, 3, "mmap", "rank-local", framework_bytes_per_rank=10)
    assert rl.hwm_bytes_per_rank == m + 10


@given(st.integers(1, 15))
@settings(max_examples=30, deadline=None)
def test_monotonic_in_dp(n):
    s = ModelSizes.uniform("m", 10**9, 7, resident_bytes=10**6)
    c = FW
    a, b = (cold_start(s, k, "mmap", framework_bytes_per_rank=FW) for k in (n, n + 1))
    assert b.cgroup_peak_bytes - a.cgroup_peak_bytes == c  # O(model + N x constant)
    a, b = (cold_start(s, k, "private-copy", framework_bytes_per_rank=FW) for k in (n, n + 1))
    assert b.cgroup_peak_bytes - a.cgroup_peak_bytes == s.total_bytes + c  # O(N x model)
    assert pinned_host_bytes_per_rank(s, n + 1) <= pinned_host_bytes_per_rank(s, n)
    total = host_steady_state(s, n, framework_bytes_per_rank=FW).pinned_bytes
    assert s.total_block_bytes <= total < s.total_block_bytes + n * s.num_blocks * 256
    a, b = (host_steady_state(s, k, mode="rank-local", framework_bytes_per_rank=FW) for k in (n, n + 1))
    assert b.pinned_bytes > a.pinned_bytes


@pytest.mark.parametrize("mode", ["allgather", "rank-local", "rank-local-mmap"])
def test_ascend_hides_pinned_from_the_cgroup(mode):
    cuda, asc = (host_steady_state(SMALL, 4, p, mode, framework_bytes_per_rank=FW) for p in ("cuda", "ascend"))
    assert cuda.physical_bytes == asc.physical_bytes
    assert cuda.cgroup_bytes == cuda.physical_bytes
    assert cuda.cgroup_bytes - asc.cgroup_bytes == asc.cgroup_invisible_bytes == 4 * asc.pinned_bytes_per_rank
    assert asc.rss_bytes == asc.framework_bytes  # the shards are not in the Ascend cgroup's RSS


def test_page_cache_can_be_reclaimed_except_in_mmap_streaming():
    assert host_steady_state(SMALL, 2, page_cache_retained=False, framework_bytes_per_rank=FW).page_cache_bytes == 0
    streamed = host_steady_state(
        SMALL, 2, mode="rank-local-mmap", page_cache_retained=False, framework_bytes_per_rank=FW
    )
    assert streamed.page_cache_bytes == 650


def test_hbm_small_numbers():
    h = hbm_per_card(
        SMALL,
        3,
        num_slots=2,
        num_landing=2,
        activation_bytes=7,
        communication_bytes=11,
        context_bytes=1000,
        alignment_bytes=8,
    )
    assert (h.slot_bytes, h.landing_bytes, h.resident_bytes) == (2 * 312, 2 * 104, 50)
    assert h.idle_bytes == 624 + 208 + 50 + 1000 and h.peak_bytes == h.idle_bytes + 18
    r = hbm_per_card(SMALL, 3, "rank-local", context_bytes=0, alignment_bytes=8)
    assert r.landing_bytes == 0 and r.slot_bytes == 2 * 304  # align_up(300, 8) = 304, whole blocks
    with pytest.raises(ValueError, match="num_slots"):
        hbm_per_card(SMALL, 3, num_slots=0, context_bytes=CTX)
    with pytest.raises(ValueError, match="mode"):
        hbm_per_card(SMALL, 3, "zero-copy", context_bytes=CTX)


@given(st.integers(1, 500), st.integers(1, 16), st.integers(2, 4))
@settings(max_examples=40, deadline=None)
def test_hbm_independent_of_depth(num_blocks, w, slots):
    big = 123_457
    deep = ModelSizes("deep", (big,) + (1000,) * num_blocks)
    shallow = ModelSizes("shallow", (big,))
    for mode in ("allgather", "rank-local"):
        a = hbm_per_card(deep, w, mode, num_slots=slots, context_bytes=CTX)
        b = hbm_per_card(shallow, w, mode, num_slots=slots, context_bytes=CTX)
        assert a.weight_bytes == b.weight_bytes and a.peak_bytes == b.peak_bytes


def _spec(shapes_by_block, resident=()):
    blocks = tuple(
        BlockSpec(
            f"blocks.{i}", tuple(TensorSpec(f"t{j}", shape, dtype, "param") for j, (shape, dtype) in enumerate(tensors))
        )
        for i, tensors in enumerate(shapes_by_block)
    )
    return ModelSpec("m", blocks, tuple(TensorSpec(f"r{k}", s, torch.float32, "param") for k, s in enumerate(resident)))


_tensor = st.tuples(
    st.lists(st.integers(1, 40), min_size=1, max_size=2).map(tuple),
    st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
)


@given(st.lists(st.lists(_tensor, min_size=1, max_size=4), min_size=1, max_size=5), st.integers(1, 8))
@settings(max_examples=40, deadline=None)
def test_agrees_with_layout_and_plan_summary(blocks, w):
    spec = _spec(blocks, resident=((3, 5),))
    sizes = ModelSizes.from_spec(spec)
    layout = model_layout(spec, w)
    assert sizes.shard_bytes_per_rank(w) == layout.shard_bytes_per_rank
    assert sizes.max_shard_bytes(w) == layout.max_shard_bytes
    assert sizes.max_padded_block_bytes(w) == layout.max_padded_block_bytes
    assert sizes.total_bytes - sizes.total_block_bytes == spec.resident_bytes == 60
    for mode in ("allgather", "rank-local"):
        summary = plan_summary(spec, w, mode)
        assert hbm_per_card(sizes, w, mode, context_bytes=CTX).weight_bytes == summary.hbm_weight_bytes
        assert pinned_host_bytes_per_rank(sizes, w, mode) == summary.pinned_host_bytes_per_rank


def test_approaches_of_figure_1():
    s = ModelSizes.uniform("s", 120_000, 12)  # blocks of 10_000 bytes; A = 256
    dlo = approach_memory(s, 4, "dlo", context_bytes=0)
    assert dlo.host_weight_bytes_per_rank == pinned_host_bytes_per_rank(s, 4) == 12 * 2560
    assert dlo.hbm.weight_bytes == hbm_per_card(s, 4, context_bytes=0).weight_bytes == 2 * 4 * 2560 + 2 * 2560
    lw = approach_memory(s, 4, "layerwise-dp", context_bytes=0)
    assert lw.host_weight_bytes_per_rank == 12 * 10240 and lw.host_weight_bytes_total == 4 * 12 * 10240
    assert lw.hbm.weight_bytes == 2 * 10240 and lw.hbm.landing_bytes == 0
    hsdp = approach_memory(s, 4, "hsdp", context_bytes=0, activation_bytes=5)
    assert (hsdp.hbm.resident_bytes, hsdp.hbm.communication_bytes, hsdp.hbm.peak_bytes) == (30_000, 20_000, 50_005)
    assert hsdp.host_weight_bytes_per_rank == 0
    assert approach_memory(s, 4, "tp", context_bytes=0).hbm.peak_bytes == 30_000
    # Only DLO is small on both sides.
    assert dlo.hbm.peak_bytes < hsdp.hbm.peak_bytes and dlo.host_weight_bytes_per_rank < lw.host_weight_bytes_per_rank
    with pytest.raises(ValueError, match="approach"):
        approach_memory(s, 4, "pipeline", context_bytes=CTX)


def test_host_capacity():
    s = ModelSizes.uniform("400", 400 * GB, 128)
    c4 = host_capacity(s, 4, "ascend", framework_bytes_per_rank=0)
    assert c4.cgroup_peak_bytes == 400 * GB
    assert 800 * GB <= c4.physical_bytes < 800 * GB + 4 * 128 * 256
    assert c4.private_copy_peak_bytes == 5 * 400 * GB and c4.fits
    assert not host_capacity(s, 4, host_ram_bytes=500 * GB, framework_bytes_per_rank=FW).fits
    cuda = host_capacity(s, 4, "cuda", framework_bytes_per_rank=FW)
    assert cuda.cgroup_peak_bytes == cuda.physical_bytes


def test_the_deployment_constants_are_inputs_of_the_plan():
    # The plan never picks a deployment's constants itself; repro.deployment binds the published ones.
    with pytest.raises(TypeError, match="framework_bytes_per_rank"):
        cold_start(SMALL, 2)
    with pytest.raises(TypeError, match="context_bytes"):
        hbm_per_card(SMALL, 2)
    assert deployment.cold_start(SMALL, 2) == cold_start(SMALL, 2, framework_bytes_per_rank=FW)
    assert deployment.host_steady_state(SMALL, 2, "ascend") == host_steady_state(
        SMALL, 2, "ascend", framework_bytes_per_rank=FW
    )
    assert deployment.host_capacity(SMALL, 2) == host_capacity(SMALL, 2, framework_bytes_per_rank=FW)
    assert deployment.hbm_per_card(SMALL, 2, activation_bytes=3) == hbm_per_card(
        SMALL, 2, activation_bytes=3, context_bytes=CTX
    )
    assert deployment.approach_memory(SMALL, 2, "tp") == approach_memory(SMALL, 2, "tp", context_bytes=CTX)


def test_scale_activation_bytes():
    a, b = ModelSizes("a", (100,)), ModelSizes("b", (400,))
    assert scale_activation_bytes(1000, a, b) == 2000  # 4x block bytes = 2x width


def test_calibrations_rederive_from_their_published_sources():
    assert cal.FRAMEWORK_HOST_BYTES_PER_RANK == published("fig6.framework_per_rank").value_bytes
    m = MODELS["cosmos3-nano"]
    nano = ModelSizes.uniform("nano", m.checkpoint_bytes, m.num_blocks)
    weights = hbm_per_card(nano, 4, context_bytes=0).idle_bytes
    assert cal.DEVICE_CONTEXT_BYTES == published("hbm.nano_dp4.idle").value_bytes - weights
    assert cal.ACTIVATION_COMM_BYTES_NANO_720P_10S_SP == (
        published("fig4.nano.peak").value_bytes - published("fig4.nano.idle").value_bytes
    )
    assert cal.ACTIVATION_COMM_BYTES_NANO_480P_29F_DP4 == (
        published("perf.nano.dlo_ag_dp4.hbm_per_card").value_bytes - published("hbm.nano_dp4.idle").value_bytes
    )
    for name, (value, keys) in cal.CALIBRATIONS.items():
        assert value == getattr(cal, name) and all(k in PUBLISHED for k in keys)


def test_published_numbers_have_sources_and_compare():
    assert all(p.source and p.unit for p in PUBLISHED.values())
    assert relative_error(110, 100) == pytest.approx(0.1)
    row = compare("fig2.nano_dp4.mmap.cgroup_peak", 47.47)
    assert row.rel_error == pytest.approx(0.01) and row.as_row()["rel_error_pct"] == 1.0
    with pytest.raises(KeyError, match="no published number"):
        published("fig99.nothing")
    with pytest.raises(ValueError, match="byte unit"):
        _ = published("fig2.nano_dp4.reduction_pct").value_bytes


def test_accounting_rows_add_up():
    rows = memory_accounting(
        SMALL,
        2,
        platform="ascend",
        activation_bytes=9,
        context_bytes=100,
        alignment_bytes=8,
        framework_bytes_per_rank=10,
    )
    v = {(r.section, r.item): r.value_bytes for r in rows}
    cs, ss, hs = "host: cold start", "host: steady state", "hbm per card"
    assert v[(cs, "cgroup peak")] == sum(v[(cs, k)] for k in ("page cache", "private copies", "framework", "transient"))
    assert v[(ss, "physical RAM")] == v[(ss, "page cache")] + v[(ss, "framework")] + v[(ss, "pinned, all ranks")]
    assert v[(ss, "cgroup-visible")] == v[(ss, "physical RAM")] - v[(ss, "cgroup-invisible")]
    assert v[(hs, "peak")] == v[(hs, "idle")] + 9 and v[(hs, "device context")] == 100
    assert not any(
        r.section == hs
        for r in memory_accounting(SMALL, 2, with_hbm=False, framework_bytes_per_rank=FW, context_bytes=CTX)
    )
    assert all(math.isfinite(r.value_bytes) for r in rows)
