"""``offload(model, ctx=ctx, mode="auto", num_slots="auto", load_group="auto")`` on diffusers models (tiny Wan and
Flux of tests/test_third_party.py): the workload given, or one example call timed through the plain probe; resolved
before the build, which sees concrete options only; bit-exact to the plain model; the choice logged and recorded; on
real gloo ranks every rank follows rank 0's choice."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from conftest import scenario

from dlo_fn.cost.auto import AUTO_FIELDS
from dlo_fn.cost.topology import BlockCompute, PolicyModel, Topology
from dlo_fn.plan.sizes import ModelSizes
from dlo_fn.plan.workload import Workload
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.offload import offload
from dlo_fn.runtime.platform import platform_for

diffusers = pytest.importorskip("diffusers")
from test_third_party import CASES  # noqa: E402  (needs diffusers)

AUTO = dict(mode="auto", num_slots="auto", load_group="auto")
WORKLOAD = Workload("tiny", tokens=64, num_steps=20, cfg_branches=1)


def _platforms():
    return ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else [])


@torch.no_grad()
def _check(ctx, name: str, workload, seeds, **fields) -> dict:
    build, inputs, _ = CASES[name]
    ref = build().to(ctx.platform.device)
    want = [ref(**_on(inputs(s), ctx))[0] for s in seeds]
    chooses = {"workload": workload} if workload is not None else {"example": _on(inputs(seeds[0]), ctx)}
    o = offload(copy.deepcopy(ref).cpu(), ctx=ctx, **chooses, **fields)
    pending = o.executor is None
    before = str(o)
    got = [o.model(**_on(inputs(s), ctx))[0] for s in seeds]
    c = o.auto.chosen.candidate
    return {
        "printed": (before, str(o)),
        "why": o.auto.why(),
        "equal": all(torch.equal(g, w) for g, w in zip(got, want)),
        "pending": pending,
        "chosen": c.label,
        "runner_up": o.auto.runner_up.candidate.label if o.auto.runner_up else None,
        "own": o.auto.result.chosen.candidate.label,
        "source": o.auto.source,
        "fields": o.auto.fields,
        "options": (o.options.mode, o.options.num_slots, o.options.load_group),
        "candidate": (c.mode, c.num_slots, c.load_group),
        "computes": o.executor.stats.computes,
        "blocks": o.layout.num_blocks,
        "shards": o.layout.num_shards,
        "step_s": o.auto.chosen.step_s,
    }


def _on(kw: dict, ctx) -> dict:
    return {k: v.to(ctx.platform.device) if torch.is_tensor(v) else v for k, v in kw.items()}


@pytest.mark.parametrize("platform", _platforms())
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("workload", [None, WORKLOAD], ids=["example-call", "workload"])
def test_auto_offload_is_bit_exact_and_records_its_choice(name, workload, platform, caplog):
    ctx = DistContext(0, 1, 0, platform_for(platform), None)
    with caplog.at_level(logging.INFO, logger="dlo_fn.runtime.auto"):
        r = _check(ctx, name, workload, (0, 1, 2), **AUTO)
    assert r["equal"] and not r["pending"]  # offload returned a built model: the choice came first
    assert r["source"] == ("example call" if workload is None else "workload") and r["fields"] == AUTO_FIELDS
    assert r["options"] == r["candidate"] and r["step_s"] > 0  # OffloadOptions holds the concrete choice
    # The example call ran through the probe, before the executor existed: every call after ran through it.
    assert r["computes"] == 3 * r["blocks"]
    text = caplog.text
    assert f"auto: {r['chosen']}: predicted step" in text and f"runner-up {r['runner_up']}:" in text
    # print(offloaded) says the same without logging set up: what it runs, then the choice and the runner-up.
    before, after = r["printed"]
    assert before == after  # built with its choice when offload returns: the first call changes nothing
    mode, slots, group = r["options"]
    assert after.splitlines()[0].split(": ")[1].startswith(f"{mode}, ") and f"{slots} device slots" in after
    assert f"load group {group};" in after and after.splitlines()[1] == f"auto: {r['why']}"
    assert f"runner-up {r['runner_up']}:" in after and "predicted step" in after


def test_fixed_fields_stay_and_bad_workloads_are_one_line():
    ctx = DistContext(0, 1, 0, platform_for("cpu"), None)
    r = _check(ctx, "wan", WORKLOAD, (0,), mode="allgather", num_slots="auto")
    assert r["options"][0] == "allgather" and r["fields"] == ("num_slots",) and r["equal"]
    with pytest.raises(TypeError, match=r"offload\(workload=...\) takes a dlo_fn.plan.workload.Workload"):
        offload(CASES["wan"][0](), ctx=ctx, workload=64, **AUTO)
    with pytest.raises(ValueError, match="pass them with mode, num_slots or load_group = 'auto'"):
        offload(CASES["wan"][0](), ctx=ctx, workload=WORKLOAD)
    with pytest.raises(ValueError, match=r"chooses from workload= .* or from one timed call: pass example="):
        offload(CASES["wan"][0](), ctx=ctx, **AUTO)


@pytest.mark.parametrize("quantization", [None, "fp8"])
@torch.no_grad()
def test_auto_keeps_the_resident_set_of_its_choice_within_a_budget(tiny_checkpoint, quantization):
    """``offload(mode="auto", hbm_budget=...)``: each plan the policy ranks keeps the blocks its compute buys within
    the budget; the built model keeps the chosen row's (placed by the same compute), holds its device weight bytes,
    within the budget, and equals the plain (FP8: fake-quantised) model; the choice says what a larger budget
    buys."""
    from test_executor_dist import load_reference

    from dlo_fn.cost.hbm_budget import format_size
    from dlo_fn.models import BLOCK_PATHS, Request, generate
    from dlo_fn.runtime.quant import fake_quantize

    ctx = DistContext(0, 1, 0, platform_for("cpu"), None)
    ref = load_reference(tiny_checkpoint)
    request = Request("a fox", seed=0, height=32, width=32, num_frames=5, num_inference_steps=2)
    want = generate(fake_quantize(ref, BLOCK_PATHS) if quantization else ref, request).sha256
    kw = dict(workload=WORKLOAD, quantization=quantization, **AUTO)
    streamed = offload(load_reference(tiny_checkpoint), BLOCK_PATHS, ctx, mode="rank-local", quantization=quantization)
    kept = []
    for budget in (streamed.device_weight_bytes, 640_000, streamed.spec.total_bytes):
        o = offload(load_reference(tiny_checkpoint), BLOCK_PATHS, ctx, hbm_budget=budget, **kw)
        row = o.auto.chosen
        assert o.resident_blocks == row.resident and o.device_weight_bytes == row.hbm_bytes <= budget
        assert generate(o.model, request).sha256 == want
        assert f"hbm budget {format_size(budget)}: {len(row.resident)} blocks resident" in o.auto.why()
        assert all(t <= row.step_s * (1 + 1e-9) for _, t in o.auto.result.larger_budgets)  # more never slows
        kept.append(len(row.resident))
    assert kept[0] == 0 and kept[2] == 4  # between: what the predicted step buys (each offload probes anew)
    with pytest.raises(ValueError, match="pass at least"):
        offload(load_reference(tiny_checkpoint), BLOCK_PATHS, ctx, hbm_budget=100_000, **kw)


def _rank(ctx) -> dict:
    seeds = tuple(10 * ctx.rank + s for s in range(3))  # each rank its own requests (DP)
    out = {
        f"{name}-{how}": _check(ctx, name, wl, seeds, **AUTO)
        for name in sorted(CASES)
        for how, wl in (("example-call", None), ("workload", WORKLOAD))
    }
    out["wan-allgather"] = _check(ctx, "wan", None, seeds, mode="allgather", num_slots="auto", load_group="auto")
    out["agree"] = _disagreeing_inputs(ctx)
    return out


def _disagreeing_inputs(ctx) -> tuple[str, str]:
    """Rank 0 sees a transfer-bound machine (3 slots hide the per-step work), the others a compute-bound one (2
    slots): each rank's own choice differs, and every rank builds rank 0's."""
    from dlo_fn.runtime.auto import decide
    from dlo_fn.runtime.options import OffloadOptions

    mb = 10**6
    model = PolicyModel(ModelSizes.uniform("toy", 400 * mb, 4), hidden_dim=64)
    block_s = 0.05 if ctx.rank == 0 else 0.2
    topo = Topology(
        "toy",
        ctx.world_size,
        1e9,
        4e9,
        4e9,
        1e11,
        BlockCompute(table=((100, 1, block_s),)),
        10**10,
        10**10,
        step_overhead=((100, 1, 0.12),),
    )
    choice = decide(topo, model, Workload("toy", 100, 4, 1), ("num_slots",), OffloadOptions(mode="rank-local"), ctx)
    return choice.result.chosen.candidate.label, choice.chosen.candidate.label


@pytest.mark.slow
def test_auto_on_two_gloo_ranks_agrees_and_is_bit_exact(request):
    ranks = scenario(request, 2, "policy_api")  # the shared spawn of 2 ranks (conftest.SCENARIOS)
    for key in ranks[0]:
        if key == "agree":
            continue
        for r in ranks:
            assert r[key]["equal"], (key, r[key])
            assert r[key]["chosen"] == ranks[0][key]["chosen"] == ranks[0][key]["own"], key  # rank 0 decides
            assert r[key]["options"] == r[key]["candidate"], key
    assert ranks[0]["wan-allgather"]["shards"] == 2  # a W = 2 shard layout, built once, on both ranks
    own = [r["agree"][0] for r in ranks]
    assert own[0] != own[1] and own[0].endswith("S3 R1"), own  # the inputs disagree ...
    assert {r["agree"][1] for r in ranks} == {own[0]}  # ... and every rank takes rank 0's choice


def test_measured_inputs_are_the_first_calls_times():
    """Pure: the first call's per-block times become the mean block compute (a median over the blocks' FLOP
    shares: one slow block, a first call's lazy set-up, does not move it), its time outside the blocks the
    per-step work; the prediction of a compute-bound plan is then the measured pass."""
    from dlo_fn.cost.auto import LinkRates, measured_inputs, option_values
    from dlo_fn.cost.policy import Candidate, predict

    sizes = ModelSizes.uniform("toy", 8 * 10**6, 8)
    links = LinkRates(1e12, 1e12, 1e12, (("allgather", 0.0), ("rank-local", 0.0)), 10**10, 10**10)
    times = (0.5,) + (0.01,) * 7  # block 0 paid a one-off cost
    topo, model, wl = measured_inputs(sizes, 64, 2, times, 0.003, 0, links, 1)
    row = predict(model, topo, wl, Candidate(1, 1, "rank-local", "-", 2, 1, 0))
    assert row.bound == "compute" and row.step_s == pytest.approx(8 * 0.01 + 0.003)
    assert option_values(row) == {"mode": "rank-local", "num_slots": 2, "load_group": 1, "shard_group": "world"}
    grouped = Candidate(2, 1, "allgather", "mesh", 8, 1, 8, 4)
    assert option_values(dataclasses.replace(row, candidate=grouped))["num_landing"] == 8  # the 2G it priced
    with pytest.raises(ValueError, match="7 block times for 8 blocks"):
        measured_inputs(sizes, 64, 2, times[:7], 0.0, 0, links, 1)
