"""Resident blocks under an HBM budget: the spread set (golden strings, properties), the budget's choice and its
refusal, the shorter ring, and offloaded outputs bit-identical to resident (FP8: to ``fake_quantize``) with the
device weight bytes as planned and within the budget."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlo_fn.plan.layout import model_layout
from dlo_fn.plan.resident import BudgetError, choose_resident, device_weight_bytes, spread_resident, with_resident
from dlo_fn.plan.schedule import Ring
from dlo_fn.plan.spec import spec_from_module
from dlo_fn.runtime.offload import offload
from dlo_fn.runtime.quant import fake_quantize
from tests.test_executor import CTX, toy


def _marks(num_blocks: int, k: int) -> str:
    keep = spread_resident(num_blocks, k)
    return " ".join("R" if b in keep else "S" for b in range(num_blocks))


def test_spread_golden():
    assert [_marks(8, k) for k in range(9)] == [
        "S S S S S S S S",
        "R S S S S S S S",
        "R S S S R S S S",
        "R S S R S S R S",
        "R S R S R S R S",
        "R S R S R R S R",
        "R S R R R S R R",
        "R S R R R R R R",
        "R R R R R R R R",
    ]


@settings(deadline=None, max_examples=60)
@given(st.integers(1, 64), st.data())
def test_spread_properties(num_blocks, data):
    k = data.draw(st.integers(0, num_blocks))
    keep = spread_resident(num_blocks, k)
    assert len(keep) == k and list(keep) == sorted(set(keep)) and all(0 <= b < num_blocks for b in keep)
    # evenly spread: any window of w consecutive blocks holds floor(w k / B) or one more resident ones
    before = [0]
    for b in range(num_blocks):
        before.append(before[-1] + (b in keep))
    for w in range(1, num_blocks + 1):
        counts = {before[s + w] - before[s] for s in range(num_blocks - w + 1)}
        assert counts <= {(w * k) // num_blocks, (w * k) // num_blocks + 1}


def _spec(num_blocks=6):
    return spec_from_module(toy(num_blocks, d=32), "blocks")


def _layout_of(spec):
    return model_layout(spec, 1)


def test_choice_fits_the_budget_and_keeps_the_most_blocks():
    spec = _spec()
    minimum = device_weight_bytes(spec, _layout_of(spec), 2, 0)
    full = choose_resident(spec, spec.total_bytes, _layout_of, 2, 0)
    assert full.resident == tuple(range(6)) and full.device_weight_bytes == spec.total_bytes
    previous = -1
    for budget in range(minimum, spec.total_bytes, (spec.total_bytes - minimum) // 7):
        choice = choose_resident(spec, budget, _layout_of, 2, 0)
        assert choice.device_weight_bytes <= budget
        assert len(choice.resident) >= previous  # a larger budget never keeps fewer blocks (equal blocks)
        previous = len(choice.resident)
        more = spread_resident(6, len(choice.resident) + 1)
        if len(more) < 6:
            bigger = with_resident(spec, more)
            assert device_weight_bytes(bigger, _layout_of(bigger), 2, 0) > budget
    assert previous == 3  # 3 resident + 2 slots of 6 equal blocks: the most below the whole model


def test_budget_below_the_two_slot_minimum_is_refused_naming_it():
    spec = _spec()
    minimum = device_weight_bytes(spec, _layout_of(spec), 2, 0)
    assert choose_resident(spec, minimum, _layout_of, 2, 0).resident == ()
    with pytest.raises(BudgetError, match=f"pass at least {minimum}$"):
        choose_resident(spec, minimum - 1, _layout_of, 2, 0)


def test_the_ring_streams_only_the_streamed_blocks():
    spec = with_resident(_spec(4), spread_resident(4, 2))
    assert [b.name for b in spec.blocks] == ["blocks.1", "blocks.3"]
    assert spec.total_bytes == _spec(4).total_bytes
    ring = Ring.cold(spec.num_blocks, mode="rank-local")
    assert ring.next_schedule(1, prefetch_next=False).to_strs() == (
        "H2D k0 b0>s0",
        "H2D k1 b1>s1",
        "C k0 b0@s0 r0",
        "C k1 b1@s1 r0",
    )


def _budgets(ref, mode, quantization=None):
    """The two-slot minimum, a budget between, and the whole model: what offload reports at each."""
    spec = spec_from_module(ref, "blocks")
    probe = offload(copy.deepcopy(ref), "blocks", CTX, mode=mode, quantization=quantization)
    minimum = probe.device_weight_bytes
    return [minimum, (minimum + spec.total_bytes) // 2, spec.total_bytes]


@pytest.mark.parametrize("mode", ["rank-local", "allgather"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
@torch.no_grad()
def test_offloaded_with_a_budget_equals_resident(mode, quantization):
    ref = toy(6, d=32)
    want = fake_quantize(copy.deepcopy(ref), "blocks") if quantization else ref
    kept = []
    for budget in _budgets(ref, mode, quantization):
        o = offload(copy.deepcopy(ref), "blocks", CTX, mode=mode, quantization=quantization, hbm_budget=budget)
        for seed in range(3):
            x = torch.randn(3, 32, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(o.model(x), want(x))
        assert o.device_weight_bytes <= budget
        kept.append(len(o.resident_blocks))
        if o.executor is not None:
            assert o.executor.device_weight_bytes == o.executor.planned_device_weight_bytes
            assert o.executor.ring.num_blocks == 6 - len(o.resident_blocks)
            assert o.layout.total_block_bytes < sum(o.spec.block_bytes) or not o.resident_blocks
        else:
            assert o.mode == "resident" and o.store is None
    assert kept[0] == 0 and 0 < kept[1] < 6


def test_budget_as_a_size_string_and_bad_budgets():
    ref = toy(4, d=32)
    o = offload(copy.deepcopy(ref), "blocks", CTX, mode="rank-local", hbm_budget="1GB")
    assert o.options.hbm_budget == 10**9 and o.mode == "resident"
    with pytest.raises(ValueError, match="^hbm_budget: cannot read 'lots'"):
        offload(copy.deepcopy(ref), "blocks", CTX, mode="rank-local", hbm_budget="lots")
    with pytest.raises(BudgetError, match="hbm_budget = 100 bytes is below"):
        offload(copy.deepcopy(ref), "blocks", CTX, mode="rank-local", hbm_budget=100)
