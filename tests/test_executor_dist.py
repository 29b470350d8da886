"""Real gloo ranks on CPU: offloaded outputs are bit-identical to the resident model for W in {1, 2, 4},
allgather and rank-local, over several steps and two requests in a row, with the reference DiT (checkpoint
written by its writer, loaded through the mmap binding) and third-party DiTs (diffusers Wan, Flux); partial waves,
R requests per rank, the memory bound and the cross-rank digest check, all in one spawn per world size."""

from __future__ import annotations

import pytest
import torch
from conftest import scenario
from test_third_party import FLUX_BLOCKS, flux, flux_inputs, wan, wan_inputs

from dlo_fn.plan.spec import spec_from_module
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.offload import offload
from dlo_fn.runtime.platform import platform_for

SIZE = {"height": 32, "width": 32, "num_frames": 5}


def load_reference(ckpt: str):
    """Meta-built reference DiT bound to zero-copy mmap views of the checkpoint."""
    from dlo_fn.io.load import load_model
    from dlo_fn.models import build_model, load_config

    config, dtype = load_config(ckpt)
    model = build_model(config, "meta", dtype)
    model.init_buffers("cpu")
    return load_model(ckpt, model, progress=False)


def _requests(rank: int):
    from dlo_fn.models import Request

    return [
        Request(prompt=f"a fox, rank {rank}", seed=rank, num_inference_steps=3, **SIZE),
        Request(prompt="an owl", negative_prompt="blur", seed=10 + rank, num_inference_steps=2, **SIZE),
    ]


def _staged_block_major(o, requests):
    """R requests of one rank through each loaded block in turn (the engine's way)."""
    from dlo_fn.models import finish, finished, init_state, model_inputs, update

    model = o.model
    states = [init_state(model, r) for r in requests]
    with o.run(num_steps=states[0].num_steps, requests_per_load=len(states)):
        while not finished(states[0]):
            embeds = [model.embed(*model_inputs(s)) for s in states]
            xs = [e.x for e in embeds]
            for block in model.blocks:
                xs = [block(x, **e.block_kwargs) for x, e in zip(xs, embeds)]
            states = [update(s, model.head(x, e)) for s, x, e in zip(states, xs, embeds)]
    return [finish(s) for s in states]


@torch.no_grad()
def check_rank(ctx: DistContext, ckpt: str, full: bool) -> dict:
    """Everything one rank checks; returns a dict of named booleans and numbers (asserted by the parent)."""
    from dlo_fn.models import BLOCK_PATHS, generate

    torch.set_num_threads(1)
    out: dict = {}
    reqs = _requests(ctx.rank)
    expected = [generate(load_reference(ckpt), r) for r in reqs]
    variants = [("allgather", {}), ("rank-local", {}), ("allgather", {"num_slots": 4, "load_group": 2})]
    if full:
        variants += [
            ("allgather", {"async_collectives": True, "block_call": "swap"}),
            ("rank-local", {"rank_local_source": "mmap"}),
            # a group's all-gathers as one coalesced collective, its work waited for by the group's last AG
            ("allgather", {"async_collectives": True, "num_slots": 4, "num_landing": 2, "load_group": 2}),
        ]
    for mode, opts in variants:
        name = mode + "".join(f",{k}={v}" for k, v in sorted(opts.items()))
        o = offload(load_reference(ckpt), BLOCK_PATHS, ctx, mode=mode, **opts)
        got = [generate(o.model, r) for r in reqs]
        out[f"exact[{name}]"] = all(
            torch.equal(g.latents, e.latents) and g.sha256 == e.sha256 for g, e in zip(got, expected)
        )
        ex = o.executor
        out[f"weights_planned[{name}]"] = ex.device_weight_bytes == ex.planned_device_weight_bytes
        # stripped: every block parameter a stand-in of one element
        out[f"stripped[{name}]"] = all(
            t.untyped_storage().nbytes() == t.element_size() for p in o.model.blocks for t in p.block.parameters()
        )
        if mode == "allgather" and not opts:
            out["arena_bytes"] = o.store.arena_bytes
            out["shard_bytes_per_rank"] = o.layout.shard_bytes_per_rank
            out["total_block_bytes"] = o.layout.total_block_bytes
            out["device_weight_bytes"] = ex.device_weight_bytes
            # Partial wave: rank 0 computes a 3-step request, the others only serve their shards.
            if ctx.rank == 0:
                with o.run(num_steps=3):
                    got0 = generate(o.model, reqs[0])
                out["partial_wave_exact"] = torch.equal(got0.latents, expected[0].latents)
            else:
                o.idle(num_steps=3)
            # R = 2 requests block-major, then a plain request: the ring is still in step everywhere.
            got2 = _staged_block_major(o, [reqs[0], _requests(ctx.rank + 100)[0]])
            out["block_major_exact"] = torch.equal(got2[0].latents, expected[0].latents)
            out["after_exact"] = torch.equal(generate(o.model, reqs[1]).latents, expected[1].latents)
    out.update(_budget_path(ctx, ckpt, reqs, expected))
    out.update(_stream_ops_path(ctx, ckpt, reqs, expected))
    # Third-party DiTs (diffusers): four passes with different inputs per rank.
    cases = (("wan", wan, wan_inputs, "blocks"),) + ((("flux", flux, flux_inputs, FLUX_BLOCKS),) if full else ())
    for name, build, inputs, paths in cases:
        ref = build()
        want = [ref(**inputs(10 * ctx.rank + s))[0] for s in range(4)]
        runs = [("allgather", {}), ("rank-local", {})]
        if name == "flux":  # load groups over unequal blocks (2 double-stream, then 2 single-stream blocks)
            # G = 2: two grouped layouts of their own strides (the single blocks' group lands at its smaller stride
            # inside its slots); G = 4: one group padded to the double blocks; G = 3 does not divide the 4 blocks:
            # the per-block layout, its all-gathers in one launch per group
            runs += [("allgather", {"num_slots": 2 * g, "load_group": g}) for g in (2, 4, 3)]
        for mode, opts in runs:
            o = offload(build(), paths, ctx, mode=mode, **opts)
            key = mode + "".join(f",G={v}" for k, v in opts.items() if k == "load_group")
            out[f"{name}_exact[{key}]"] = all(
                torch.equal(o.model(**inputs(10 * ctx.rank + s))[0], w) for s, w in enumerate(want)
            )
            if opts and ctx.world_size > 1:
                g = opts["load_group"]
                out[f"{name}_layout_group[{key}]"] = o.layout.load_group == (g if 4 % g == 0 else 1)
                out[f"{name}_arena_is_planned[{key}]"] = o.store.arena_bytes == o.layout.shard_bytes_per_rank
    if full and ctx.group is not None:
        # Shard layouts that differ across ranks are refused on every rank, naming the ranks.
        try:
            offload(wan(), "blocks", ctx, alignment_bytes=256 if ctx.rank == 0 else 512)
            out["digest_error"] = ""
        except RuntimeError as exc:
            out["digest_error"] = str(exc)
    return out


def _budget_path(ctx: DistContext, ckpt: str, reqs, expected) -> dict:
    """An HBM budget of the ring's minimum plus one block: one block resident (whole on every rank), the others
    streamed; outputs bit-identical, the device weight bytes as planned and within the budget, and as `memory` and
    the policy price them (test_hbm_budget_cost). (One landing buffer: with two, the tiny model's 4 blocks leave no
    budget between the ring and the whole model at W = 2.)"""
    from test_hbm_budget_cost import runtime_matches_cost

    from dlo_fn.models import BLOCK_PATHS, generate

    out, budgets = {}, {}
    for mode, opts in (("allgather", {"num_landing": 1}), ("rank-local", {})):
        minimum = offload(load_reference(ckpt), BLOCK_PATHS, ctx, mode=mode, **opts).device_weight_bytes
        budget = budgets[mode] = minimum + max(spec_from_module(load_reference(ckpt), BLOCK_PATHS).block_bytes)
        o = offload(load_reference(ckpt), BLOCK_PATHS, ctx, mode=mode, hbm_budget=budget, **opts)
        got = [generate(o.model, r) for r in reqs]
        out[f"budget_exact[{mode}]"] = all(torch.equal(g.latents, e.latents) for g, e in zip(got, expected))
        out[f"budget_one_resident[{mode}]"] = o.resident_blocks == (0,) and o.executor.ring.num_blocks == 3
        out[f"budget_within[{mode}]"] = minimum < o.device_weight_bytes <= budget
        out[f"budget_whole_on_device[{mode}]"] = not any(t.is_meta for t in o.model.blocks[0].parameters())
        out[f"budget_store_streamed_only[{mode}]"] = o.store.arena_bytes == o.layout.shard_bytes_per_rank
        for k, v in runtime_matches_cost(o, budget, None, o.shards.size).items():
            out[f"budget_cost_{k}[{mode}]"] = v
    # Placed by compute: every rank times the example call, and plans with rank 0's times (the same plan everywhere).
    from dlo_fn.models.sampler import init_state, model_inputs

    model = load_reference(ckpt)
    state = init_state(model, reqs[0])
    example = (*model_inputs(state), model.encode_text(state.text_tokens))
    budget = budgets["allgather"]
    o = offload(model, BLOCK_PATHS, ctx, mode="allgather", num_landing=1, hbm_budget=budget, example=example)
    got = [generate(o.model, r) for r in reqs]
    out["budget_by_compute_exact"] = all(torch.equal(g.latents, e.latents) for g, e in zip(got, expected))
    out["budget_by_compute_within"] = o.device_weight_bytes <= budget and o.budget.pass_s is not None
    out["budget_by_compute_placement"] = (o.placement.compute_s, o.budget.resident)
    if ctx.world_size > 1:  # a 1/W shard holds less than its block: with a slow link, room for two shards (one
        # block) keeps shards on the device (loaded from there, all-gathered as every block is)
        from dlo_fn.runtime.budget import Placement

        ring = offload(load_reference(ckpt), BLOCK_PATHS, ctx, mode="allgather", num_landing=1)
        budget = ring.device_weight_bytes + 2 * ring.layout.max_shard_bytes
        o = _allgather_budget(ctx, ckpt, budget, Placement((1e-3,) * ring.spec.num_blocks, 1e3, "given", 1e9))
        got = [generate(o.model, r) for r in reqs]
        out["device_stored_exact"] = all(torch.equal(g.latents, e.latents) for g, e in zip(got, expected))
        out["device_stored_kept"] = o.store is not None and len(o.store.device_blocks) == 2 and o.resident_blocks == ()
        out["device_stored_once"] = o.store.arena_bytes + o.store.device_bytes == o.layout.shard_bytes_per_rank
        out["device_stored_within"] = o.device_weight_bytes == o.budget.device_weight_bytes <= budget
        # the policy prices the same tier: placed by its row, offload keeps its shards, to the byte
        out.update(_policy_tier(ctx, ckpt, ring, budget))
    return out


def _allgather_budget(ctx: DistContext, ckpt: str, budget: int, placement):
    """The tiny checkpoint offloaded in allgather mode (one landing buffer) under ``budget``, placed by
    ``placement``."""
    from dlo_fn.models import BLOCK_PATHS

    return offload(
        load_reference(ckpt), BLOCK_PATHS, ctx, mode="allgather", num_landing=1, hbm_budget=budget, placement=placement
    )


def _policy_tier(ctx: DistContext, ckpt: str, ring, budget: int) -> dict:
    """The policy's allgather row under ``budget`` on a link-bound machine keeps ``1/W`` shards on the device, and
    ``offload`` placed by that row holds its device weights and pinned bytes."""
    import dataclasses

    from dlo_fn.cost import topology_file
    from dlo_fn.cost.policy import Candidate, predict
    from dlo_fn.cost.topology import PolicyModel
    from dlo_fn.plan.sizes import ModelSizes
    from dlo_fn.runtime.budget import Placement

    w = ctx.world_size
    top = dataclasses.replace(topology_file.topology("1xH200"), num_ranks=w, h2d_bytes_per_s=1e3)
    model = PolicyModel(ModelSizes.from_spec(ring.spec), 64, tensor_block_bytes=ring.spec.block_bytes)
    cand = Candidate(w, 1, "allgather", "mesh", 2, 1, 1)
    row = predict(model, top, topology_file.workload("image 1024^2 CFG, 24 steps"), cand, hbm_budget=budget)
    o = _allgather_budget(ctx, ckpt, budget, Placement.from_policy(row.placed_by))
    return {
        "policy_tier_stored": bool(o.budget.device_stored) and o.resident_blocks == row.resident,
        "policy_tier_device_weights": row.hbm_bytes == o.device_weight_bytes <= budget,
        "policy_tier_pinned": row.host_bytes - top.framework_host_bytes == o.store.arena_bytes,
    }


def _stream_ops_path(ctx: DistContext, ckpt: str, reqs, expected) -> dict:
    """The issue loop's stream operations and collectives at W > 1, counted by the executor (ExecutorStats) against
    the plan's count: one load per block and groups of 2 (one collective per group)."""
    from dlo_fn.cost.host_cost import planned_stream_ops
    from dlo_fn.models import BLOCK_PATHS, generate

    out = {}
    for g in (1, 2):
        o = offload(
            load_reference(ckpt),
            BLOCK_PATHS,
            ctx,
            mode="allgather",
            block_call="functional_call",
            num_slots=2 * g,
            load_group=g,
        )
        ex, shard = o.executor, o.layout.shards[0].shard_bytes
        got = [generate(o.model, r) for r in reqs]
        out[f"ops_exact[G={g}]"] = all(
            torch.equal(a.latents, b.latents) and a.sha256 == b.sha256 for a, b in zip(got, expected)
        )
        out[f"stream_ops_per_block[G={g}]"] = ex.stats.stream_ops / ex.stats.computes
        gathers = [op.pairs for p in ex._programs.compiled() for op in p.ops if op.kind == "AG" and op.pairs]
        out[f"blocks_per_collective[G={g}]"] = sorted(
            {sum(inp.numel() for _, inp in pairs) // shard for pairs in gathers}
        )
        # a grouped layout (G divides the 4 blocks): one all-gather of the group's pieces, one pair
        out[f"grouped_layout[G={g}]"] = o.layout.load_group == (g if ctx.world_size > 1 else 1) and all(
            len(pairs) == 1 for pairs in gathers
        )
        if ctx.rank == 0:  # a partial wave: the others serve their shards
            with o.run(num_steps=3):
                out[f"ops_partial_exact[G={g}]"] = torch.equal(generate(o.model, reqs[0]).latents, expected[0].latents)
        else:
            o.idle(num_steps=3)
        out[f"ops_after_exact[G={g}]"] = torch.equal(generate(o.model, reqs[1]).latents, expected[1].latents)
        c0, n0, k0 = ex.stats.stream_ops, ex.stats.computes, ex.stats.collectives  # one run of all 3 steps
        with o.run(num_steps=3) as schedule:
            out[f"ops_run_exact[G={g}]"] = torch.equal(generate(o.model, reqs[0]).latents, expected[0].latents)
        out[f"stream_ops_per_block_in_a_run[G={g}]"] = (ex.stats.stream_ops - c0) / (ex.stats.computes - n0)
        # the plan's count of the same run (what the policy's host_scale prices, plan.host_cost)
        planned = planned_stream_ops(schedule, o.layout.load_group > 1)
        out[f"planned_ops_per_block_in_a_run[G={g}]"] = planned["total"]
        out[f"collectives_as_planned[G={g}]"] = (ex.stats.collectives - k0) / (ex.stats.computes - n0) == planned[
            "collectives"
        ]
    return out


def _assert_all(results: list[dict], world: int) -> None:
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res.items() if v is False}
        assert not bad, f"rank {rank}: {bad}"
        assert res["arena_bytes"] == res["shard_bytes_per_rank"]
        # Host: each rank pins ~1/W of the blocks; device: slots + landing, not the model.
        assert res["arena_bytes"] * world < res["total_block_bytes"] + world * 256 * 64
        if world > 1:  # 2 slots + 2 landing shards < the tiny model's 4 blocks
            assert res["device_weight_bytes"] < res["total_block_bytes"]
        if world > 1 and "digest_error" in res:
            assert (
                "differs across ranks" in res["digest_error"]
                and f"ranks {list(range(1, world))}" in res["digest_error"]
            )
    if world > 1:
        assert "partial_wave_exact" in results[0] and "partial_wave_exact" not in results[1]
        assert len({r["budget_by_compute_placement"] for r in results}) == 1  # rank 0's compute, one plan
        assert all(r["device_stored_kept"] and r["device_stored_exact"] for r in results)
        for res in results:  # W > 1: one collective per block, or per group of 2
            assert res["blocks_per_collective[G=1]"] == [1] and res["blocks_per_collective[G=2]"][-1] == 2, res
            # per block: H2D wait, copy, record; AG wait (x2: landing, slot), record; compute wait, record = 8
            # (and the first uses' waits on the previous run); per group of 2 as many (the tiny model's 4 blocks
            # per one-step run: a run boundary inside a group splits it)
            assert res["stream_ops_per_block[G=1]"] == pytest.approx(8, abs=0.5), res
            assert res["stream_ops_per_block[G=2]"] < 0.85 * res["stream_ops_per_block[G=1]"], res
            # in one 3-step run (12 blocks and the next run's prefetch): 8 per block, 5 with groups of 2 (4 in the
            # steady state: 8 per group)
            in_run = res["stream_ops_per_block_in_a_run[G=1]"], res["stream_ops_per_block_in_a_run[G=2]"]
            assert in_run[0] == pytest.approx(8) and in_run[1] <= 0.65 * in_run[0], res
            for g in (1, 2):  # the plan counts what the executor issues, in allgather mode too
                assert res[f"planned_ops_per_block_in_a_run[G={g}]"] == pytest.approx(in_run[g - 1]), res


def test_single_rank_reference_and_third_party(tiny_checkpoint):
    res = check_rank(DistContext(0, 1, 0, platform_for("cpu"), None), tiny_checkpoint, full=True)
    _assert_all([res], 1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_gloo_ranks(request):
    results = scenario(request, 2, "executor_dist")  # check_rank(ctx, tiny_checkpoint, True): conftest.SCENARIOS
    assert all("digest_error" in r for r in results)
    _assert_all(results, 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_four_gloo_ranks(request):
    results = scenario(request, 4, "executor_dist")  # check_rank(ctx, tiny_checkpoint, False)
    _assert_all(results, 4)
