"""Compatibility key, wave formation and forced-wave validation (pure; hypothesis properties)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlo_fn.cost.waves import (
    PER_REQUEST_FIELDS,
    IncompatibleWaveError,
    Pending,
    WavePlan,
    assign_positions,
    compat_key,
    form_waves,
    validate_wave,
)
from dlo_fn.models import Request


def _req(**kw) -> Request:
    base = dict(prompt="a red fox", seed=0, height=32, width=32, num_frames=5, num_inference_steps=2)
    base.update(kw)
    return Request(**base)


def test_key_ignores_prompt_seed_and_negative_prompt():
    a = _req(prompt="a", seed=1)
    b = _req(prompt="b", seed=2, negative_prompt="blurry")
    assert compat_key(a) == compat_key(b)
    assert hash(compat_key(a)) == hash(compat_key(b))


@pytest.mark.parametrize(
    "field, value",
    [
        ("height", 48),
        ("width", 48),
        ("num_frames", 9),
        ("fps", 7),
        ("num_inference_steps", 3),
        ("guidance_scale", 1.0),
        ("shift", 2.5),
        ("outputs_per_prompt", 2),
        ("lora", "style-a"),
        ("lora_scale", 0.5),
        ("sampler", "unipc"),
        ("quality", "high"),
        ("extra_args", {"tile": 2}),
    ],
)
def test_every_key_field_separates(field, value):
    a, b = _req(), _req(**{field: value})
    assert compat_key(a).differing(compat_key(b)) == (field,)


def test_every_request_field_is_key_or_per_request():
    # The key is closed by default: a field is either per-request or compared.
    names = {f.name for f in dataclasses.fields(Request)}
    key_names = {n for n, _ in compat_key(_req()).items}
    assert key_names == names - PER_REQUEST_FIELDS
    assert {"prompt", "seed", "negative_prompt"} <= names


def test_extra_args_compared_as_canonical_json():
    a = _req(extra_args={"b": 1, "a": [1, 2]})
    b = _req(extra_args={"a": [1, 2], "b": 1})
    c = _req(extra_args={"a": [2, 1], "b": 1})
    assert compat_key(a) == compat_key(b)
    assert compat_key(a).differing(compat_key(c)) == ("extra_args",)


def test_int_and_float_guidance_agree():
    assert compat_key(_req(guidance_scale=5)) == compat_key(_req(guidance_scale=5.0))


def test_forced_mixed_wave_rejected_naming_fields():
    wave = [_req(), _req(seed=3), _req(num_inference_steps=3, height=48)]
    with pytest.raises(IncompatibleWaveError) as info:
        validate_wave(wave, dp_size=2, requests_per_rank=2)
    assert info.value.fields == ("height", "num_inference_steps")
    assert info.value.positions == (2,)
    assert "height = 48" in str(info.value) and "request 0: 32" in str(info.value)


def test_forced_wave_size_checks():
    with pytest.raises(ValueError, match="empty wave"):
        validate_wave([], 2)
    with pytest.raises(ValueError, match="exceeds its capacity"):
        validate_wave([_req()] * 3, dp_size=2, requests_per_rank=1)
    assert validate_wave([_req(), _req(seed=9)], dp_size=2) == compat_key(_req())


def test_round_robin_positions_and_idle_ranks():
    assert assign_positions(3, 2) == ((0, 2), (1,))
    assert assign_positions(2, 4) == ((0,), (1,), (), ())
    wave = WavePlan(0, compat_key(_req()), (7, 8), dp_size=4)
    assert wave.rank_indices == ((7,), (8,), (), ()) and wave.idle_ranks == (2, 3) and wave.is_partial


def test_bounded_wait_holds_partial_chunk_until_deadline():
    k = compat_key(_req())
    pend = [Pending(0, k, 0.0), Pending(1, k, 0.5)]
    held = form_waves(pend, 4, now_s=1.0, max_wait_s=2.0)
    assert held.waves == () and held.waiting == (0, 1)
    due = form_waves(pend, 4, now_s=2.0, max_wait_s=2.0)
    assert [w.indices for w in due.waves] == [(0, 1)] and due.waiting == ()
    # A full chunk never waits.
    full = form_waves(pend + [Pending(2, k, 0.9), Pending(3, k, 0.9)], 4, now_s=1.0, max_wait_s=9.0)
    assert [w.indices for w in full.waves] == [(0, 1, 2, 3)]


def test_mixed_stream_split_by_key_in_arrival_order():
    a, b = compat_key(_req()), compat_key(_req(height=48))
    pend = [Pending(0, a), Pending(1, b), Pending(2, a), Pending(3, a), Pending(4, b)]
    sched = form_waves(pend, dp_size=2, first_wave_id=5)
    assert [(w.wave_id, w.indices) for w in sched.waves] == [(5, (0, 2)), (6, (1, 4)), (7, (3,))]


# ---- properties ---------------------------------------------------------------------------------------------

KEYS = [compat_key(_req(height=32 + 16 * i)) for i in range(4)]


@st.composite
def _pending(draw):
    n = draw(st.integers(0, 30))
    keys = draw(st.lists(st.integers(0, len(KEYS) - 1), min_size=n, max_size=n))
    gaps = draw(st.lists(st.floats(0, 2, allow_nan=False), min_size=n, max_size=n))
    arrival = [sum(gaps[: i + 1]) for i in range(n)]
    return [Pending(i, KEYS[k], t) for i, (k, t) in enumerate(zip(keys, arrival))]


@settings(max_examples=150, deadline=None)
@given(
    pend=_pending(),
    dp=st.integers(1, 5),
    r=st.integers(1, 3),
    now=st.one_of(st.just(math.inf), st.floats(0, 70, allow_nan=False)),
    wait=st.floats(0, 5, allow_nan=False),
)
def test_wave_formation_invariants(pend, dp, r, now, wait):
    sched = form_waves(pend, dp, r, now_s=now, max_wait_s=wait)
    placed = [i for w in sched.waves for i in w.indices] + list(sched.waiting)
    assert sorted(placed) == [p.index for p in pend]  # nothing lost, nothing duplicated
    by_index = {p.index: p for p in pend}
    for w in sched.waves:
        assert 1 <= len(w.indices) <= dp * r
        assert {by_index[i].key for i in w.indices} == {w.key}  # homogeneous
        ranks = w.rank_indices
        assert sorted(i for idx in ranks for i in idx) == sorted(w.indices)
        assert max(map(len, ranks)) <= r and len(ranks) == dp
    for key in set(KEYS):
        order = [i for w in sched.waves if w.key == key for i in w.indices]
        assert order == sorted(order)  # first-come within a key
        waiting = [i for i in sched.waiting if by_index[i].key == key]
        assert not order or not waiting or max(order) < min(waiting)
        assert len(waiting) < dp * r  # only the last partial chunk of a key may wait
    if now == math.inf:
        assert sched.waiting == ()
    for key in set(KEYS):
        waiting = [by_index[i] for i in sched.waiting if by_index[i].key == key]
        if waiting:  # the partial chunk waits only while its oldest request is within the bound
            assert now - waiting[0].arrival_s < wait


# ---- the wave timeline model (benchmarks.repro.wave_model) -----------------------------------------------------------

from benchmarks.repro.wave_model import WaveCosts, host_for_fraction, predict_wave  # noqa: E402


def test_hidden_transfers_give_the_ideal():
    pred = predict_wave(WaveCosts(8, 4, compute_s=0.01, allgather_s=0.002, h2d_s=0.004), baseline_step_s=0.08)
    assert pred.step_s == pytest.approx(0.08) and pred.speedup == pytest.approx(4.0)


def test_host_work_on_the_compute_path_is_lost_from_the_ideal():
    c = 0.012
    h = host_for_fraction(0.8, c)
    pred = predict_wave(WaveCosts(16, 4, compute_s=c, host_s=h, allgather_s=0.001), baseline_step_s=16 * c)
    assert pred.fraction_of_ideal == pytest.approx(0.8)
    assert pred.exposed_s_per_step == pytest.approx(16 * h)


def test_requests_per_rank_amortise_a_transfer_bound_load():
    # H2D of a block takes 3x one request's compute: R = 1 is transfer-bound, R = 4 compute-bound again.
    one = predict_wave(WaveCosts(6, 1, compute_s=1.0, h2d_s=3.0), baseline_step_s=6.0)
    four = predict_wave(WaveCosts(6, 1, compute_s=1.0, h2d_s=3.0, requests_per_rank=4), baseline_step_s=6.0)
    assert one.step_s == pytest.approx(18.0) and one.fraction_of_ideal == pytest.approx(1 / 3)
    assert four.step_s == pytest.approx(24.0) and four.fraction_of_ideal == pytest.approx(1.0)


def test_published_overhead_split_reproduces_the_published_wave():
    from benchmarks.repro.waves_tables import perf, reference_costs

    pred = predict_wave(reference_costs(), baseline_step_s=0.870)
    published_step = perf("perf.nano.dlo_ag_dp4_4req.ms_per_step").value / 1e3
    assert abs(pred.step_s - published_step) / published_step < 0.02
    assert abs(pred.speedup - perf("perf.nano.dlo_ag_dp4_4req.vs_hsdp").value) / 3.3 < 0.05


def test_key_label_says_no_cfg_for_guidance_1():
    """Guidance 1 turns CFG off (``Request.cfg``), whether the prompts file wrote it as 1 or 1.0."""
    shape = dict(height=32, width=32, num_frames=5, num_inference_steps=2)
    assert compat_key(Request("a", guidance_scale=1, **shape)).short() == "32x32x5f 2st nocfg"
    assert compat_key(Request("a", guidance_scale=1.0, **shape)).short() == "32x32x5f 2st nocfg"
    assert compat_key(Request("a", guidance_scale=5, **shape)).short() == "32x32x5f 2st cfg5"
