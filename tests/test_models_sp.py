"""Ulysses SP on real gloo ranks: sp = 2 and 3 give latents ``torch.equal`` to (and the SHA-256 of) the single
process, in bf16 and fp32, with CFG, for token counts that divide by sp and one that does not (35 tokens, which
also puts 3 queries in the last SDPA block of the single process); staged == forward; blocks run through
``functional_call`` with the sp argument, and as offloaded executor proxies (all-gathered weights); heads not
divisible by sp fail with one clear line on every rank."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from conftest import scenario

from dlo_fn.models import CONFIGS, Request, SPContext, TokenShard, build_model, generate, init_state, model_inputs
from dlo_fn.models.layers import attention, linear
from dlo_fn.runtime.dist import DistContext

TINY = CONFIGS["tiny"]  # 4 heads: sp 2
SIX_HEADS = dataclasses.replace(TINY, name="tiny-6-heads", hidden_dim=96, num_heads=6)  # head_dim 16: sp 2, 3
REJECTED = {2: dataclasses.replace(TINY, name="tiny-3-heads", hidden_dim=48, num_heads=3), 3: TINY}
SHAPES = ((32, 48, 5), (80, 112, 1))  # 2 x 2 x 3 = 12 tokens; 1 x 5 x 7 = 35 tokens
DTYPES = (torch.bfloat16, torch.float32)


def _request(shape, seed: int) -> Request:
    height, width, frames = shape
    return Request(
        prompt="a red kite over the dunes",
        negative_prompt="blur",
        seed=seed,
        height=height,
        width=width,
        num_frames=frames,
        num_inference_steps=2,
        guidance_scale=4.0,
    )


@torch.no_grad()
def _check(sp: SPContext, config) -> dict:
    """One sp group's checks of ``config`` (run by each of its ranks); a dict of named results."""
    from torch.func import functional_call

    out: dict = {}
    for dtype in DTYPES:
        model = build_model(config, "cpu", dtype)
        for shape in SHAPES:
            key = f"{str(dtype)[6:]},{shape}"
            req = _request(shape, seed=3)
            ref, got = generate(model, req), generate(model, req, sp=sp)
            out[f"exact[{key}]"] = torch.equal(got.latents, ref.latents) and got.sha256 == ref.sha256
            out[f"sha[{key}]"] = got.sha256
            # Staged, with every block run as the runtime runs it (functional_call, sp passed through).
            inputs = model_inputs(init_state(model, req))
            state = model.embed(*inputs, sp=sp)
            x = state.x
            out[f"local_tokens[{key}]"] = x.shape[1]
            for block in model.blocks:
                x = functional_call(block, dict(block.named_parameters()), (x,), state.block_kwargs)
            out[f"staged[{key}]"] = torch.equal(model.head(x, state), model(*inputs, sp=sp))
    try:
        generate(build_model(REJECTED[sp.size], "cpu", torch.bfloat16), _request(SHAPES[0], seed=3), sp=sp)
        out["heads_error"] = None
    except ValueError as exc:
        out["heads_error"] = str(exc)
    return out


def _rank(ctx: DistContext) -> dict:
    """Three ranks (process start-up dominates this file): sp 2 on ranks {0, 1}, then sp 3 on all three."""
    pair = dist.new_group([0, 1])  # every rank creates every group
    out = {2: _check(SPContext.from_group(pair), TINY)} if ctx.rank < 2 else {}
    sp = SPContext.from_group(dist.group.WORLD)
    out[3] = _check(sp, SIX_HEADS)
    # Offloaded: blocks are executor proxies (weights sharded over the 3 ranks, all-gathered per block).
    from dlo_fn.models import BLOCK_PATHS
    from dlo_fn.runtime.offload import offload

    req = _request(SHAPES[1], seed=5)
    ref = generate(build_model(SIX_HEADS, "cpu", torch.float32), req)
    o = offload(build_model(SIX_HEADS, "cpu", torch.float32), BLOCK_PATHS, ctx, mode="allgather")
    got = generate(o.model, req, sp=sp)
    out[3]["offloaded"] = torch.equal(got.latents, ref.latents) and got.sha256 == ref.sha256
    return out


@pytest.fixture(params=[2, 3], ids=["sp2", "sp3"])
def ranks(request):
    sp = request.param
    every_rank = scenario(request, 3, "models_sp")  # the shared spawn of 3 ranks (conftest.SCENARIOS)
    return sp, {2: TINY, 3: SIX_HEADS}[sp], [res[sp] for res in every_rank if sp in res]


@pytest.mark.timeout(600)
def test_sp_latents_equal_single_process(ranks):
    sp, config, results = ranks
    assert len(results) == sp and all(("offloaded" in res) == (sp == 3) for res in results)
    for r, res in enumerate(results):
        bad = [k for k, v in res.items() if k.startswith(("exact", "staged", "offloaded")) and v is not True]
        assert not bad, (sp, r, bad)
    # Every sp rank ends with the same whole result, and it is the parent's single-process result too.
    for dtype in DTYPES:
        model = build_model(config, "cpu", dtype)
        for shape in SHAPES:
            key = f"{str(dtype)[6:]},{shape}"
            assert {res[f"sha[{key}]"] for res in results} == {generate(model, _request(shape, seed=3)).sha256}


@pytest.mark.timeout(600)
def test_tokens_are_split_with_padding(ranks):
    sp, _, results = ranks
    for res in results:
        assert res["local_tokens[bfloat16,(32, 48, 5)]"] == 12 // sp
        assert res["local_tokens[float32,(80, 112, 1)]"] == -(-35 // sp)  # 35 = 2 x 18 - 1 = 3 x 12 - 1


@pytest.mark.timeout(600)
def test_heads_not_divisible_by_sp_is_one_clear_error(ranks):
    """Raised in ``embed`` before any collective, so every rank fails alike and none waits on the others."""
    sp, _, results = ranks
    heads = REJECTED[sp].num_heads
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    for res in results:
        assert res["heads_error"] == (
            f"num_heads {heads} is not divisible by sp {sp}: Ulysses SP gives each sp "
            f"rank num_heads / sp heads; use sp in {divisors}"
        )


def test_token_shard_arithmetic_without_a_group():
    """The local slice of one rank, its padding, and ranks that hold only padding (L < sp)."""
    x = torch.arange(2 * 5 * 3).reshape(2, 5, 3)
    parts = [TokenShard(SPContext(object(), 3, r), 5).local(x) for r in range(3)]
    assert [p.shape[1] for p in parts] == [2, 2, 2]
    assert torch.equal(torch.cat(parts, dim=1)[:, :5], x) and not parts[2][:, 1].any()
    tiny = [TokenShard(SPContext(object(), 3, r), 1).local(x[:, :1]) for r in range(3)]
    assert torch.equal(tiny[0], x[:, :1]) and not tiny[1].any() and not tiny[2].any()
    with pytest.raises(ValueError, match="needs a process group"):
        SPContext(None, 2, 0)
    with pytest.raises(ValueError, match="0 <= rank < size"):
        SPContext(object(), 2, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_layers_are_row_count_independent(dtype):
    """What SP's bit-exactness rests on: a row of ``linear`` / a query of ``attention`` has the same bits
    whatever rows come with it. The unpadded fp32 SDPA fails this (67 queries vs 96: rows 64-66 differ)."""
    torch.manual_seed(0)
    x, w, b = torch.randn(96, 64).to(dtype), torch.randn(192, 64).to(dtype), torch.randn(192).to(dtype)
    q, k, v = (torch.randn(2, n, 4, 16).to(dtype) for n in (96, 64, 64))
    full_linear, full_attention = linear(x, w, b), attention(q, k, v)
    for start, stop in ((0, 67), (64, 67), (3, 38), (90, 96), (0, 1), (48, 96)):
        assert torch.equal(linear(x[start:stop], w, b), full_linear[start:stop]), (start, stop)
        assert torch.equal(attention(q[:, start:stop], k, v), full_attention[:, start:stop]), (start, stop)
    # Why the layers exist: on the CPUs CI runs on, raw fp32 SDPA gives other bits for a slice of the rows than for
    # the same rows inside the whole; whether it does depends on the CPU's kernels (on the H200 host's it did not),
    # so that is not asserted here, only that ours never depend on the row count.
