"""Resident blocks under an HBM budget: the spread set (golden strings, properties), the budget's choice and its
refusal, the shorter ring, and offloaded outputs bit-identical to resident (FP8: to ``fake_quantize``) with the
device weight bytes as planned and within the budget."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlo_fn.plan.layout import model_layout
from dlo_fn.plan.resident import (
    REFINE_GAIN,
    BudgetError,
    at_speed,
    choose_resident,
    device_weight_bytes,
    frontier,
    pass_ends,
    pass_seconds,
    price_plan,
    spread_resident,
    with_resident,
)
from dlo_fn.plan.schedule import Ring, build_schedule
from dlo_fn.plan.spec import BlockSpec, ModelSpec, TensorSpec, spec_from_module
from dlo_fn.plan.timeline import bandwidth_durations, simulate
from dlo_fn.runtime.offload import offload
from dlo_fn.runtime.quant import fake_quantize
from tests.test_executor import CTX, toy


def _marks(block_bytes: tuple[int, ...], m: int, steps: int, weights=None) -> str:
    return _string(spread_resident(block_bytes, m, steps, weights), len(block_bytes))


def _string(keep: tuple[int, ...], num_blocks: int) -> str:
    return " ".join("R" if b in keep else "S" for b in range(num_blocks))


def test_spread_golden():
    assert [_marks((5,) * 8, m, 8) for m in range(9)] == [
        "R R R R R R R R",
        "R R R R R R R S",
        "R R R S R R R S",
        "R R S R R S R S",
        "R S R S R S R S",
        "R S R S S R S S",
        "R S S S R S S S",
        "R S S S S S S S",
        "S S S S S S S S",
    ]
    # unequal blocks: the large ones stay (their loads are the hardest to hide), the pass opens resident
    assert _marks((2, 1, 1, 2, 1, 1), 1, 2) == "R S S R S S"
    assert _marks((3, 1, 1, 1, 3, 1, 1, 1), 1, 2) == "R S S S R S S S"


@settings(deadline=None, max_examples=80)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=64), st.data())
def test_spread_properties(block_bytes, data):
    steps = data.draw(st.integers(1, 4 * len(block_bytes)))
    m = data.draw(st.integers(0, steps))
    keep = spread_resident(tuple(block_bytes), m, steps)
    assert list(keep) == sorted(set(keep)) and all(0 <= b < len(block_bytes) for b in keep)
    streamed = [n for b, n in enumerate(block_bytes) if b not in keep]
    # the streamed bytes never run ahead of the credit: every prefix streams at most f of its bytes
    done = credit = 0
    for b, n in enumerate(block_bytes):
        credit += m * n
        done += 0 if b in keep else steps * n
        assert done <= credit
    # and fall behind it by less than one block
    assert m * sum(block_bytes) - steps * sum(streamed) < steps * max(block_bytes)
    assert (m > 0 or len(keep) == len(block_bytes)) and (m < steps or keep == ())


def test_spread_by_compute_golden():
    # FLUX-like: large blocks of little compute, then small ones of much; the small ones stream first
    assert _marks((3, 3, 1, 1, 1, 1), 4, 8, weights=(1, 1, 2, 2, 2, 2)) == "R R S S S S"
    assert _marks((3, 3, 1, 1, 1, 1), 4, 8) == "R S R S R S"  # by bytes: a large block streams after one
    assert _marks((3, 3, 3, 1, 1, 1, 1, 1, 1), 1, 2, weights=(1,) * 9) == "R R R S S S S S S"


@settings(deadline=None, max_examples=60)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=40), st.integers(1, 5), st.data())
def test_compute_weights_equal_to_bytes_reproduce_the_spread_by_bytes(block_bytes, scale, data):
    steps = data.draw(st.integers(1, 4 * len(block_bytes)))
    m = data.draw(st.integers(0, steps))
    weights = tuple(scale * n for n in block_bytes)
    assert spread_resident(tuple(block_bytes), m, steps, weights) == spread_resident(tuple(block_bytes), m, steps)


@settings(deadline=None, max_examples=40)
@given(
    st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)), min_size=1, max_size=12),
    st.integers(1, 4),
    st.integers(1, 4),
)
def test_pass_model_is_the_simulated_schedule_with_nothing_resident(blocks, num_slots, passes):
    h2d = tuple(n for n, _ in blocks)
    compute = tuple(c / 4 for _, c in blocks)
    ends = pass_ends(compute, h2d, num_slots, 2.0, passes)
    schedule = build_schedule(len(blocks), passes, num_slots=num_slots, mode="rank-local")
    durations = bandwidth_durations(
        len(blocks), h2d_bytes=h2d, allgather_bytes=0, compute_s=compute, h2d_bytes_per_s=2.0, allgather_bytes_per_s=1
    )
    spans = simulate(schedule, durations).spans_of("compute")
    want = [max(s.end_s for s in spans if s.op.startswith(f"C k{(p + 1) * len(blocks) - 1} ")) for p in range(passes)]
    assert ends == pytest.approx(want, rel=1e-12, abs=1e-12)


def _flux_like(num_large=4, num_small=8, bf16=False):
    """Large blocks (3 units) then small ones (1 unit), each of the same compute: FLUX's double then single blocks
    (``bf16``: matrices of 2-byte elements, which FP8 shards store in half the bytes)."""
    blocks = tuple(
        BlockSpec(
            f"blocks.{b}",
            (
                TensorSpec("w", (30 if b < num_large else 10, 100), torch.bfloat16, "param")
                if bf16
                else TensorSpec("w", (3000 if b < num_large else 1000,), torch.float32, "param"),
            ),
        )
        for b in range(num_large + num_small)
    )
    return ModelSpec("flux-like", blocks, (TensorSpec("x", (100,), torch.float32, "param"),))


def test_flux_like_placement_by_compute_golden():
    spec = _flux_like()
    compute, link = (1e-3,) * 12, 4e6  # one block's compute moves one small block (4000 bytes), a third of a large
    budget = 58_000  # of 80_400
    by_bytes = choose_resident(spec, budget, _layout_of, 2, 0)
    by_compute = choose_resident(spec, budget, _layout_of, 2, 0, compute=compute, link=link)
    assert _string(by_bytes.resident, 12) == "R S R S S S S S R S S R"
    # the large blocks stay (and the slots shrink to a small block): the small ones stream under the whole pass
    assert _string(by_compute.resident, 12) == "R R R R S S S S S S S S"
    assert by_compute.device_weight_bytes <= budget and by_bytes.pass_s is None
    h2d = tuple(0 if b in by_bytes.resident else n for b, n in enumerate(spec.block_bytes))
    assert by_compute.pass_s < pass_seconds(compute, h2d, 2, link) - 0.5e-3


def test_local_moves_refine_the_spreads_plan_golden():
    spec, compute, link = _flux_like(), (1e-3,) * 12, 4e6
    plans = frontier(spec, _layout_of, 2, 0, compute=compute, link=link)

    def spread_and_refined(budget):
        spread = min((p for p in plans if p.device_weight_bytes <= budget), key=lambda p: p.pass_s)
        return spread, choose_resident(spec, budget, _layout_of, 2, 0, compute=compute, link=link)

    # what the ring alone leaves of the budget keeps two small blocks, late in the pass where loads queue up
    spread, refined = spread_and_refined(33_786)
    assert _string(spread.resident, 12) == "S S S S S S S S S S S S"
    assert _string(refined.resident, 12) == "S S S S S S S S S R R S"
    # the same bytes, one resident block moved: block 1 covers the large blocks' loads that block 3 covered late
    spread, refined = spread_and_refined(54_296)
    assert _string(spread.resident, 12) == "R S S R S S S S S S S R"
    assert _string(refined.resident, 12) == "R R S S S S S S S S S R"
    assert refined.device_weight_bytes == spread.device_weight_bytes
    assert refined.pass_s == pytest.approx(13.184e-3) and spread.pass_s == pytest.approx(14.136e-3)


def test_what_the_budget_leaves_keeps_more_blocks_resident_golden():
    """Past the model's fastest point the pass is at the compute; the rest of a budget still goes to resident
    blocks (their loads' slack is what a slower link or a late host eats first)."""
    spec, compute, link = _flux_like(), (1e-3,) * 12, 4e6
    fastest = at_speed(frontier(spec, _layout_of, 2, 0, compute=compute, link=link), within=1e-9)
    assert _string(fastest.resident, 12) == "R R R R S S R S R S R S" and fastest.device_weight_bytes == 68_592
    choice = choose_resident(spec, 79_000, _layout_of, 2, 0, compute=compute, link=link)
    assert _string(choice.resident, 12) == "R R R R R R S R S R R S" and choice.device_weight_bytes == 76_592
    assert choice.pass_s == fastest.pass_s == pytest.approx(sum(compute))


@settings(deadline=None, max_examples=25)
@given(
    st.lists(st.tuples(st.integers(1, 4), st.integers(0, 6)), min_size=2, max_size=10),
    st.sampled_from([2, 3, "auto"]),
    st.floats(0.0, 1.0),
)
def test_priced_plans_fit_and_never_beat_the_bound(blocks, num_slots, where):
    spec = ModelSpec(
        "m",
        tuple(
            BlockSpec(f"blocks.{b}", (TensorSpec("w", (250 * n,), torch.float32, "param"),))
            for b, (n, _) in enumerate(blocks)
        ),
        (),
    )
    compute, link = tuple(c * 1e-3 for _, c in blocks), 1e6
    plans = frontier(spec, _layout_of, num_slots, 0, compute=compute, link=link)
    for p in plans:
        assert p.pass_s >= max(sum(compute), p.h2d_bytes_per_pass / link) * (1 - 1e-9)
    assert plans[-1].h2d_bytes_per_pass == 0 and at_speed(plans) in plans
    budget = round(plans[0].device_weight_bytes + where * (spec.total_bytes - plans[0].device_weight_bytes))
    choice = choose_resident(spec, budget, _layout_of, num_slots, 0, compute=compute, link=link)
    priced = dict(layout_of=_layout_of, num_landing=0, compute=compute, link=link)
    assert choice.device_weight_bytes <= budget
    assert choice.pass_s >= max(sum(compute), choice.h2d_bytes_per_pass / link) * (1 - 1e-9)
    # the frontier's fastest within the budget, or a plan its local moves found faster (topped up: as fast, to the
    # pass model's resolution)
    assert choice.pass_s <= min(p.pass_s for p in plans if p.device_weight_bytes <= budget) * (1 + REFINE_GAIN)
    # what the budget leaves is spent: every block left streamed would not fit, or would slow the pass
    for b in set(range(spec.num_blocks)) - set(choice.resident):
        if len(choice.resident) + 1 < spec.num_blocks:
            more = price_plan(spec, replace(choice, resident=tuple(sorted({*choice.resident, b}))), **priced)
            assert more.device_weight_bytes > budget or more.pass_s > choice.pass_s
    if choice.h2d_bytes_per_pass:  # the pass of the streamed blocks' own layout
        shards = iter(s.shard_bytes for s in _layout_of(with_resident(spec, choice.resident)).shards)
        h2d = tuple(0 if b in choice.resident else next(shards) for b in range(spec.num_blocks))
        assert choice.pass_s == pass_seconds(compute, h2d, choice.num_slots, link)


def _spec(num_blocks=6):
    return spec_from_module(toy(num_blocks, d=32), "blocks")


def _layout_of(spec):
    return model_layout(spec, 1)


def test_choice_fits_the_budget_and_keeps_the_most_blocks():
    spec = _spec()
    minimum = device_weight_bytes(spec, _layout_of(spec), 2, 0)
    full = choose_resident(spec, spec.total_bytes, _layout_of, 2, 0)
    assert full.resident == tuple(range(6)) and full.device_weight_bytes == spec.total_bytes
    kept = []
    for budget in range(minimum, spec.total_bytes, (spec.total_bytes - minimum) // 7):
        choice = choose_resident(spec, budget, _layout_of, 2, 0)
        assert choice.device_weight_bytes <= budget
        kept.append(len(choice.resident))
        # no spread set that streams less fits (the equal blocks' sets, by streamed fraction)
        for m in range(1, 24):
            more = spread_resident(spec.block_bytes, m, 24)
            if len(choice.resident) < len(more) < 6:
                bigger = with_resident(spec, more)
                assert device_weight_bytes(bigger, _layout_of(bigger), 2, 0) > budget
    assert kept == sorted(kept) and kept[0] == 0
    assert kept[-1] == 3  # 3 resident + 2 slots of 6 equal blocks: the most below the whole model


def test_budget_below_the_two_slot_minimum_is_refused_naming_it():
    spec = _spec()
    minimum = device_weight_bytes(spec, _layout_of(spec), 2, 0)
    assert choose_resident(spec, minimum, _layout_of, 2, 0).resident == ()
    with pytest.raises(BudgetError, match=f"pass at least {minimum}$"):
        choose_resident(spec, minimum - 1, _layout_of, 2, 0)


def test_the_ring_streams_only_the_streamed_blocks():
    spec = with_resident(_spec(4), spread_resident(_spec(4).block_bytes, 1, 2))
    assert [b.name for b in spec.blocks] == ["blocks.1", "blocks.3"]
    assert spec.total_bytes == _spec(4).total_bytes
    ring = Ring.cold(spec.num_blocks, mode="rank-local")
    assert ring.next_schedule(1, prefetch_next=False).to_strs() == (
        "H2D k0 b0>s0",
        "H2D k1 b1>s1",
        "C k0 b0@s0 r0",
        "C k1 b1@s1 r0",
    )


def _budgets(ref, mode, quantization=None, paths="blocks"):
    """The two-slot minimum, a budget between, and the whole model: what offload reports at each."""
    spec = spec_from_module(ref, paths)
    probe = offload(copy.deepcopy(ref), paths, CTX, mode=mode, quantization=quantization)
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


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_the_searchs_cut_layout_is_the_streamed_specs_layout(quantization):
    from dlo_fn.plan.resident import _Pricer, layout_for

    spec = _flux_like()
    layout_of = lambda s: layout_for(s, 2, quantization=quantization)  # noqa: E731
    price = _Pricer(spec, layout_of, 2, (1e-3,) * 12, 1e6)
    for resident in ((), (0,), (1, 4, 5), (0, 1, 2, 3), tuple(range(11))):
        for slots in (2, 3):
            assert price(resident, slots) == price(resident, slots, exact=True)
        assert price._layout(resident, False)[0].digest == layout_of(with_resident(spec, resident)).digest


def test_frontier_holds_more_and_streams_less_at_each_step():
    spec = _spec(8)
    plans = frontier(spec, _layout_of, 2, 0)
    assert plans[0].resident == () and plans[-1].resident == tuple(range(8)) and plans[-1].h2d_bytes_per_pass == 0
    for a, b in zip(plans, plans[1:]):
        assert a.device_weight_bytes < b.device_weight_bytes and a.h2d_bytes_per_pass > b.h2d_bytes_per_pass
    for p in plans:  # each is the plan its own budget buys
        assert choose_resident(spec, p.device_weight_bytes, _layout_of, 2, 0) == p


def _placed_as_planned(o, mode):
    """The resident set ``offload`` kept is the pure plan's for the compute it measured."""
    from dlo_fn.plan.resident import layout_for, ring_num_landing

    assert o.placement is not None and o.placement.source.startswith("measured compute")
    want = choose_resident(
        o.spec,  # as offload read it (on CPU with the tensors' address residues)
        o.options.hbm_budget,
        lambda s: layout_for(s, 1),
        o.options.num_slots,
        ring_num_landing(mode, 1, None),
        **o.placement.plan_inputs(),
    )
    assert o.budget == want and o.resident_blocks == want.resident and o.device_weight_bytes <= o.options.hbm_budget
    assert f"predicted pass {want.pass_s:.4g} s" in o.describe()


@pytest.mark.parametrize("mode", ["rank-local", "allgather"])
@torch.no_grad()
def test_placed_by_measured_compute_equals_resident(mode, caplog):
    from tests.test_third_party import FLUX_BLOCKS, flux, flux_inputs

    ref = flux()
    want = [ref(**flux_inputs(s))[0] for s in range(2)]
    budget = _budgets(ref, mode, paths=FLUX_BLOCKS)[1]
    with caplog.at_level("INFO", logger="dlo_fn.runtime.budget"):
        o = offload(copy.deepcopy(ref), FLUX_BLOCKS, CTX, mode=mode, hbm_budget=budget, example=flux_inputs(0))
    assert "placed by measured compute (example call), predicted pass" in caplog.text
    for s in range(2):
        assert torch.equal(o.model(**flux_inputs(s))[0], want[s])
    _placed_as_planned(o, mode)


@torch.no_grad()
def test_budget_chooses_the_slots_and_says_how_to_place_by_compute(caplog):
    ref = toy(6, d=32)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    budget = _budgets(ref, "rank-local")[1]
    with caplog.at_level("INFO", logger="dlo_fn.runtime.budget"):
        by_bytes = offload(copy.deepcopy(ref), "blocks", CTX, mode="rank-local", hbm_budget=budget)
    assert "placed by bytes (pass example= or workload= to place by compute" in caplog.text
    assert by_bytes.placement is None and by_bytes.budget.pass_s is None
    o = offload(copy.deepcopy(ref), "blocks", CTX, mode="rank-local", num_slots="auto", hbm_budget=budget, example=(x,))
    assert torch.equal(o.model(x), ref(x)) and o.executor.num_slots == o.budget.num_slots in (2, 3, 4)
    _placed_as_planned(o, "rank-local")


def test_device_tier_keeps_stored_shards_where_they_hold_less_than_the_block():
    """FP8 shards hold half a block: the budget a plan leaves buys device-stored shards (loaded at the device's
    copy rate, dequantised each pass), never where the shard is the block (BF16 on one rank)."""
    from dlo_fn.plan.resident import layout_for

    spec = _flux_like(bf16=True)
    fp8 = lambda s: layout_for(s, 1, quantization="fp8")  # noqa: E731
    compute, link, device = (1e-3,) * 12, 1e6, 4e9  # link-bound: a small block's load is two computes
    ring = choose_resident(spec, 10**9, fp8, 2, 0, compute=compute, link=link)  # the whole model
    minimum = frontier(spec, fp8, 2, 0, compute=compute, link=link)[0].device_weight_bytes
    budget = minimum + 4_000
    plain = choose_resident(spec, budget, fp8, 2, 0, compute=compute, link=link)
    tiered = choose_resident(spec, budget, fp8, 2, 0, compute=compute, link=link, device_link=device)
    assert ring.resident == tuple(range(12)) and plain.device_stored == ()
    assert tiered.device_stored and not set(tiered.device_stored) & set(tiered.resident)
    layout = fp8(with_resident(spec, tiered.resident))
    shard = dict(zip((b for b in range(12) if b not in tiered.resident), (s.shard_bytes for s in layout.shards)))
    stored = sum(shard[b] for b in tiered.device_stored)
    assert (
        tiered.device_weight_bytes == device_weight_bytes(with_resident(spec, tiered.resident), layout, 2, 0) + stored
    )
    assert tiered.device_weight_bytes <= budget and tiered.h2d_bytes_per_pass == sum(shard.values()) - stored
    assert tiered.h2d_bytes_per_pass < plain.h2d_bytes_per_pass and tiered.pass_s < plain.pass_s
    bf16 = choose_resident(spec, budget, _layout_of, 2, 0, compute=compute, link=link, device_link=device)
    assert bf16.device_stored == ()
    tiers = frontier(spec, fp8, 2, 0, compute=compute, link=link, device_link=device)
    assert any(p.device_stored for p in tiers)
    for a, b in zip(tiers, tiers[1:]):
        assert a.device_weight_bytes < b.device_weight_bytes and a.pass_s > b.pass_s


def test_pass_model_loads_device_stored_blocks_at_the_device_rate_and_adds_dequantising():
    from dlo_fn.plan.resident import DeviceLoads

    compute, h2d = (1.0, 1.0, 1.0), (4, 4, 4)
    assert pass_ends(compute, h2d, 2, 1.0, 1) == (4.0 + 1 + 3 + 1 + 3 + 1,)  # each 4 s load after the last
    fast = DeviceLoads(4.0, frozenset({0, 1, 2}), (0.5, 0.0, 0.25))
    assert pass_ends(compute, h2d, 2, 1.0, 1, device=fast) == (1.0 + 1.5 + 1.0 + 1.25,)
    resident = DeviceLoads(4.0, frozenset(), (0.5, 0.5, 0.5))  # a resident block (no load) is not dequantised
    assert pass_ends(compute, (0, 0, 0), 2, 1.0, 1, device=resident) == (3.0,)


def _platforms():
    return ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("platform", _platforms())
@pytest.mark.parametrize("mode", ["rank-local", "allgather"])
@torch.no_grad()
def test_device_stored_fp8_shards_equal_fake_quantize(mode, platform):
    from dlo_fn.runtime.budget import Placement
    from dlo_fn.runtime.dist import DistContext
    from dlo_fn.runtime.platform import platform_for

    ctx = CTX if platform == "cpu" else DistContext(0, 1, 0, platform_for(platform), None)
    dev = ctx.platform.device
    ref = toy(6, d=32)
    want = fake_quantize(copy.deepcopy(ref).to(dev), "blocks")
    minimum = _budgets(ref, mode, "fp8")[0]
    placement = Placement((1e-3,) * 6, 1e6, "given", 1e9)  # a slow link: every shard the budget holds helps
    o = offload(
        copy.deepcopy(ref),
        "blocks",
        ctx,
        mode=mode,
        quantization="fp8",
        hbm_budget=minimum + 15_000,
        placement=placement,
    )
    for seed in range(3):
        x = torch.randn(3, 32, generator=torch.Generator().manual_seed(seed)).to(dev)
        assert torch.equal(o.model(x), want(x))
    stored = o.budget.device_stored
    assert stored and o.store.device_blocks == frozenset(stored) and o.resident_blocks == ()
    assert o.store.device_arena.device.type == dev.type
    assert o.store.device_bytes == sum(o.layout.shards[b].shard_bytes for b in stored)
    assert o.store.arena_bytes + o.store.device_bytes == o.layout.shard_bytes_per_rank  # each shard held once
    assert o.device_weight_bytes == o.budget.device_weight_bytes <= o.options.hbm_budget
    assert f"{len(stored)} blocks' stored shards on the device" in o.describe()


@torch.no_grad()
def test_device_stored_shards_beside_a_host_budget():
    """A host budget pins the first of the blocks left on the host; the later ones are read from the tensors
    (pageable) and the device-stored ones from the device buffer: each shard in one place, outputs exact."""
    from dlo_fn.runtime.budget import Placement

    ref = toy(6, d=32)
    want = fake_quantize(copy.deepcopy(ref), "blocks")
    minimum = _budgets(ref, "rank-local", "fp8")[0]
    placement = Placement((1e-3,) * 6, 1e6, "given", 1e9)
    o = offload(
        copy.deepcopy(ref),
        "blocks",
        CTX,
        mode="rank-local",
        quantization="fp8",
        hbm_budget=minimum + 15_000,
        placement=placement,
        pinned_budget_bytes=8_000,
    )
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(o.model(x), want(x))
    store, shards = o.store, [s.shard_bytes for s in o.layout.shards]
    assert store.device_blocks and store.pageable and not set(store.pageable) & store.device_blocks
    assert store.arena_bytes == sum(
        shards[b] for b in range(len(shards)) if b not in store.device_blocks | set(store.pageable)
    )
    pieces = [sum(p.nbytes for p in s.pieces[0]) for s in o.layout.shards]  # read as they are, no gaps
    assert store.streamed_bytes == sum(pieces[b] for b in store.pageable)
    assert store.device_bytes == sum(shards[b] for b in store.device_blocks)
