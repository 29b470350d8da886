"""CUDA graphs on a real GPU (skipped without one; run on the H200, output in the issue 16 note): every graphed
step is bit-identical to the eager executor and to the resident model, in rank-local and allgather (W = 1)
mode, for R requests per load, through generate(), with the timeline recorded, and falls back when the block
cannot be captured."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from dlo_fn.models import Request, build_model, generate
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.offload import offload
from dlo_fn.runtime.platform import platform_for
from tests.test_executor import ToyBlock, toy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _ctx() -> DistContext:
    return DistContext(0, 1, 0, platform_for("cuda", 0), None)


@pytest.mark.parametrize("mode", ["rank-local", "allgather"])
@pytest.mark.parametrize("num_blocks", [8, 7])  # odd depth: two step signatures (the slots alternate)
@torch.no_grad()
def test_graph_steps_bit_exact(mode, num_blocks):
    ref = toy(num_blocks, d=1024).to("cuda")
    eager = offload(toy(num_blocks, d=1024), "blocks", _ctx(), mode=mode)
    graph = offload(toy(num_blocks, d=1024), "blocks", _ctx(), mode=mode, graph=True)
    assert graph.executor.graphs is not None
    xs = [torch.randn(64, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(s)) for s in range(8)]
    want = [ref(x) for x in xs]
    got_eager = [eager.model(x) for x in xs]
    got = [graph.model(x) for x in xs]  # back to back, no host synchronisation
    torch.cuda.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(got_eager, want))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    g = graph.executor.graphs
    assert g.captures == (1 if num_blocks % 2 == 0 else 2) and g.replays == len(xs) - 2 * g.captures - 1 + g.captures


@pytest.mark.parametrize("scope", [True, "block"])
@torch.no_grad()
def test_graph_requests_per_load_and_multi_step_runs(scope):
    import contextlib

    ref = toy(6, d=512).to("cuda")
    o = offload(toy(6, d=512), "blocks", _ctx(), mode="allgather", graph=scope)

    def steps(model, run, xs, cs):
        with run:
            for _ in range(3):
                for block in model.blocks:
                    for r in range(2):
                        xs[r], cs[r] = block(xs[r], ctx=cs[r])
                xs = [x.clone() for x in xs]  # the graph's outputs are static: keep each step's
                cs = [c.clone() for c in cs]
        return xs, cs

    for seed in range(4):
        gen = torch.Generator("cuda").manual_seed(seed)
        x0 = [torch.randn(32, 512, device="cuda", generator=gen) for _ in range(2)]
        want = steps(ref, contextlib.nullcontext(), list(x0), list(x0))
        got = steps(o.model, o.run(3, 2), list(x0), list(x0))
        assert all(torch.equal(a, b) for a, b in zip(want[0] + want[1], got[0] + got[1]))
    if scope is True:
        assert o.executor.graphs.captures >= 1 and o.executor.graphs.replays >= 4
    else:  # a graph per (block, request); each block keeps its slot (even depth)
        bg = o.executor.block_graphs
        assert bg.captures == 6 * 2 and bg.replays > 6 * 2 * 3 * 2


@pytest.mark.parametrize("scope", [True, "block"])
@pytest.mark.parametrize("mode", ["rank-local", "allgather"])
def test_generate_with_graph_is_byte_identical(mode, scope):
    ref = build_model("tiny", "cuda", seed=0)
    ref.init_buffers("cuda")
    request = Request("a red fox", seed=0, height=32, width=32, num_frames=5, num_inference_steps=6)
    want = generate(ref, request).sha256
    o = offload(copy.deepcopy(ref), "blocks", _ctx(), mode=mode, graph=scope)
    assert generate(o.model, request).sha256 == want
    assert generate(o.model, request).sha256 == want
    if scope is True:
        assert o.executor.graphs.replays >= 6
    else:  # our DiT keeps no block output past the next block: after the first steps every block replays
        bg = o.executor.block_graphs
        assert bg.replays > 0 and bg.held_eager == 0 and not bg._eager


@torch.no_grad()
def test_graph_timeline_has_every_op():
    o = offload(toy(4, d=256), "blocks", _ctx(), mode="rank-local", graph=True, record_timeline=True)
    ref = toy(4, d=256).to("cuda")
    x = torch.randn(16, 256, device="cuda")
    for _ in range(5):
        assert torch.equal(o.model(x), ref(x))
    assert o.executor.graphs.replays == 3  # runs 2, 3, 4 (run 0 cold, run 1 the first warm one: eager)
    per_run = len(o.executor.next_schedule().ops)
    tl = o.executor.take_timeline()
    for j in range(1, 5):
        spans = [s for s in tl.spans if s.op.startswith(f"run{j} ")]
        assert len(spans) == per_run
        if j >= 2:  # captured: per-step spans, every op of the step spans the launch
            assert len({(s.start_s, s.end_s) for s in spans}) == 1 and spans[0].end_s > spans[0].start_s


class _Syncing(ToyBlock):
    def forward(self, x, *, ctx):
        if float(x.abs().max()) < 0:  # a host sync: not capturable
            x = -x
        return super().forward(x, ctx=ctx)


def _syncing_toy():
    m = toy(4, d=128)
    for i in range(4):
        b = _Syncing(128)
        b.load_state_dict(m.blocks[i].state_dict())
        m.blocks[i] = b
    return m.eval()


@pytest.mark.parametrize("scope", [True, "block"])
@torch.no_grad()
def test_uncapturable_block_falls_back(caplog, scope):
    ref = _syncing_toy().to("cuda")
    o = offload(_syncing_toy(), "blocks", _ctx(), mode="rank-local", graph=scope)
    x = torch.randn(8, 128, device="cuda")
    rng = torch.cuda.get_rng_state()
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            assert torch.equal(o.model(x), ref(x))
    assert (o.executor.graphs if scope is True else o.executor.block_graphs).captures == 0
    assert any("capture failed" in r.getMessage() for r in caplog.records)
    # The failed capture leaves the random stream as it was, and usable (torch left it marked as capturing).
    assert torch.equal(torch.cuda.get_rng_state(), rng) and torch.randn(4, device="cuda").isfinite().all()


# -- graph="block": each block's compute a graph, copies and events eager ------------------------------------

@pytest.mark.parametrize("mode", ["rank-local", "allgather"])
@pytest.mark.parametrize("num_blocks", [8, 7])  # odd depth: a block alternates between the slots
@torch.no_grad()
def test_block_graphs_bit_exact(mode, num_blocks):
    ref = toy(num_blocks, d=1024).to("cuda")
    o = offload(toy(num_blocks, d=1024), "blocks", _ctx(), mode=mode, graph="block")
    bg = o.executor.block_graphs
    assert bg is not None and o.executor.graphs is None
    xs = [torch.randn(64, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(s)) for s in range(8)]
    want = [ref(x).clone() for x in xs]
    got = [o.model(x).clone() for x in xs]  # back to back; the clone reads each pass before the next
    torch.cuda.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    keys = num_blocks * (1 if num_blocks % 2 == 0 else 2)
    assert bg.captures == keys and bg.replays >= len(xs) * num_blocks - 2 * keys


@torch.no_grad()
def test_block_graphs_chain_outputs_copy_inputs_once_per_pass_and_fall_back_on_other_wiring(caplog):
    ref = toy(4, d=256).to("cuda")
    o = offload(toy(4, d=256), "blocks", _ctx(), mode="rank-local", graph="block")
    bg = o.executor.block_graphs

    def chain(blocks, x, ctx, detach_at=None):
        for i, block in enumerate(blocks):
            if i == detach_at:
                x = x.clone()  # this block's input is no longer the previous graph's static output
            x, ctx = block(x, ctx=ctx)
        return x.clone(), ctx.clone()

    x, c = torch.randn(16, 256, device="cuda"), torch.randn(16, 256, device="cuda")
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(chain(o.model.blocks, x, c), chain(ref.blocks, x, c)))
    before = bg.input_copies
    for seed in range(3):  # new inputs each pass: block 0's x and ctx are copied in, blocks 1-3 read in place
        x = torch.randn(16, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        assert all(torch.equal(a, b) for a, b in zip(chain(o.model.blocks, x, c), chain(ref.blocks, x, c)))
    assert bg.input_copies - before == 3 * 2
    with caplog.at_level(logging.WARNING):
        got = chain(o.model.blocks, x, c, detach_at=2)
    assert all(torch.equal(a, b) for a, b in zip(got, chain(ref.blocks, x, c, detach_at=2)))
    assert any("not the chain buffer it was at capture" in r.getMessage() for r in caplog.records)


@torch.no_grad()
def test_block_graphs_never_overwrite_an_output_the_model_keeps(caplog):
    """Block graphs write two chain buffers per output, alternating: a model that keeps every block's output (a
    list of hidden states, or views of them) would see them overwritten two blocks later. Those calls run eager
    instead, and the result is the resident one."""
    ref = toy(6, d=256).to("cuda")
    o = offload(toy(6, d=256), "blocks", _ctx(), mode="rank-local", graph="block")
    bg = o.executor.block_graphs

    def keep_all(blocks, x, ctx, view: bool):
        kept = []
        for block in blocks:
            x, ctx = block(x, ctx=ctx)
            kept.append(x[:, :128] if view else x)
        return torch.cat([k[:, :128] for k in kept], 1).clone()

    x, c = torch.randn(16, 256, device="cuda"), torch.randn(16, 256, device="cuda")
    for view in (False, True):
        for _ in range(4):
            assert torch.equal(keep_all(o.model.blocks, x, c, view), keep_all(ref.blocks, x, c, view))
    assert bg.held_eager > 0 and any("keeps a block's output" in r.getMessage() for r in caplog.records)
    before = bg.replays
    for _ in range(2):  # a plain chain again: every block replays its graph
        assert all(torch.equal(a, b) for a, b in zip(_chain(o.model.blocks, x, c), _chain(ref.blocks, x, c)))
    assert bg.replays - before == 2 * 6


def _chain(blocks, x, ctx):
    for block in blocks:
        x, ctx = block(x, ctx=ctx)
    return x.clone(), ctx.clone()


@torch.no_grad()
def test_block_graph_memory_does_not_grow_with_depth():
    """The blocks' outputs go to two chain buffers per output and the graphs' temporaries share one pool, so the
    device memory the graphs add hardly grows with depth: under half an activation per block (the H200 measured
    20 MB for 8 more blocks, ~1 small pool segment per graph), where the earlier design held every block's
    outputs, 2 activations per block (+128 MB here)."""
    tokens, d = 2048, 1024  # 8 MB activations
    act = tokens * d * 4
    extra = {}
    for n in (8, 16):
        o = offload(toy(n, d=d), "blocks", _ctx(), mode="rank-local", graph="block")
        x, c = torch.randn(tokens, d, device="cuda"), torch.randn(tokens, d, device="cuda")
        _chain(o.model.blocks, x, c)
        torch.cuda.synchronize(), torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        for _ in range(4):  # seen, captured, replayed (n even: one slot per block)
            _chain(o.model.blocks, x, c)
        torch.cuda.synchronize(), torch.cuda.empty_cache()
        extra[n] = torch.cuda.memory_reserved() - before
        bg = o.executor.block_graphs
        assert bg.captures == n and bg.chain_bytes == 2 * 2 * act  # 2 parities x (x, ctx)
        del o, bg
    assert extra[16] - extra[8] < 8 * act / 2, extra


@pytest.mark.parametrize("scope", ["block", "step"])
@pytest.mark.parametrize("name", ["wan", "flux"])
@torch.no_grad()
def test_graphs_on_diffusers_dits_bit_exact(name, scope):
    """Diffusers' blocks take keyword arguments, tuples of tensors (the rotary embeddings) and None; Flux's
    return tuples over two block lists. With block graphs every block is captured and replayed, bit-identical
    to the resident model on the GPU; the step graph replays Wan's steps (Flux does work between its two block
    lists, which a step graph does not capture: it stays eager, logged), bit-identical too."""
    pytest.importorskip("diffusers")
    from tests.test_third_party import CASES

    build, inputs, paths = CASES[name]

    def on_gpu(kw):
        return {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in kw.items()}

    ref = build().to("cuda")
    o = offload(build(), paths, _ctx(), mode="rank-local", graph=scope)
    for s in range(6):  # seen, captured (each slot), replayed
        want, got = ref(**on_gpu(inputs(s)))[0], o.model(**on_gpu(inputs(s)))[0]
        assert torch.equal(got, want), s
    if scope == "step":
        assert o.executor.graphs.replays > 0 or name == "flux"
        return
    bg = o.executor.block_graphs
    n = o.layout.num_blocks
    assert bg.captures == n * (1 if n % 2 == 0 else 2) and not bg._eager and bg.held_eager == 0
    assert bg.replays >= 2 * n


@pytest.mark.parametrize("scope", ["block", "step"])
@torch.no_grad()
def test_many_shapes_keep_graph_memory_bounded(scope):
    """Serving several resolutions: beyond graph_shapes the least recently used shape's graphs (and, for block
    graphs, its chain buffers and shared inputs) are dropped, every output stays bit-identical, and the memory
    the graphs hold stops growing."""
    ref = toy(4, d=256).to("cuda")
    o = offload(toy(4, d=256), "blocks", _ctx(), mode="rank-local", graph=scope, graph_shapes=2)
    ex = o.executor
    reserved = []
    for cycle in range(3):
        for tokens in (64, 128, 192, 256):  # four shapes, two kept
            x = torch.randn(tokens, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(tokens))
            for _ in range(3):  # seen, captured, replayed (block graphs; the step graph records, then captures)
                assert torch.equal(o.model(x).clone(), ref(x))
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    graphs = ex.block_graphs if scope == "block" else ex.graphs
    assert graphs.evictions >= 8 and graphs.replays > 0
    assert len(graphs._graphs) <= 2 * (4 if scope == "block" else 1)
    if scope == "block":
        assert len(graphs._bufs) <= 2 * 2 * 2  # shapes x parities x outputs (x, ctx)
    assert reserved[2] <= reserved[1], reserved  # the third cycle allocates nothing new


def _block_major_steps(model, run, x0, c0):
    """Three passes of two requests through each block in turn (block-major: what a run of R = 2 expects) inside
    ``run``; the outputs of both requests, hidden states then contexts."""
    xs, cs = list(x0), list(c0)
    with run:
        for _ in range(3):
            for block in model.blocks:
                for r in range(2):
                    xs[r], cs[r] = block(xs[r], ctx=cs[r])
            xs, cs = [x.clone() for x in xs], [c.clone() for c in cs]
    return xs + cs


# -- W = 2: two gloo ranks sharing the GPU (the all-gathers go through the host; correctness only) -------------

def _gloo_cuda_rank(ctx, scope, num_blocks: int, load_group: int = 1) -> dict:
    import contextlib
    import dataclasses

    from dlo_fn.runtime.platform import Platform

    torch.cuda.set_device(0)
    ctx = dataclasses.replace(ctx, platform=Platform("cuda", torch.device("cuda", 0), "gloo"))
    ref = toy(num_blocks, d=1024).to("cuda")
    o = offload(toy(num_blocks, d=1024), "blocks", ctx, mode="allgather", graph=scope, num_slots=2 * load_group,
                load_group=load_group)
    ex = o.executor
    gen = torch.Generator("cuda").manual_seed(100 * ctx.rank)  # each rank serves its own requests
    xs = [torch.randn(64, 1024, device="cuda", generator=gen) for _ in range(6)]
    with torch.no_grad():
        want = [ref(x).clone() for x in xs]
        got = [o.model(x).clone() for x in xs]  # back to back, no host synchronisation
        if scope is False:  # and a multi-step run, two requests per load (block-major)
            want += _block_major_steps(ref, contextlib.nullcontext(), xs[:2], xs[:2])
            got += _block_major_steps(o.model, o.run(3, 2), xs[:2], xs[:2])
    torch.cuda.synchronize()
    graphs = ex.block_graphs or ex.graphs
    return {"equal": all(torch.equal(g, w) for g, w in zip(got, want)), "sharded": ex.layout.num_shards,
            "step_graphs": ex.graphs is not None, "block_graphs": ex.block_graphs is not None,
            "captures": getattr(graphs, "captures", 0), "replays": getattr(graphs, "replays", 0),
            "driver_calls": ex._raw is not None and ex.stats.computes > 0}


@pytest.mark.parametrize("scope", ["block", True])
def test_two_gloo_ranks_on_one_gpu_block_graphs_and_step_fallback(scope):
    """Allgather mode at W = 2 on real CUDA streams: block graphs capture each block while the gloo all-gathers
    run eager (thread_local capture), and the step graph, which cannot capture gloo, falls back to eager; every
    rank's outputs are bit-identical to its resident model."""
    from dlo_fn.runtime.dist import run_ranks

    num_blocks = 7
    for r in run_ranks(_gloo_cuda_rank, 2, scope, num_blocks, timeout_s=300):
        assert r["equal"] and r["sharded"] == 2
        assert r["driver_calls"]  # the eager ops through driver calls, the all-gathers the group's own calls
        if scope == "block":
            assert r["block_graphs"] and r["captures"] == 2 * num_blocks and r["replays"] > 0
        else:
            assert not r["step_graphs"] and r["captures"] == 0  # eager, logged once


@pytest.mark.parametrize("load_group", [1, 2, 4])
def test_two_gloo_ranks_on_one_gpu_driver_calls_and_load_groups(load_group):
    """Allgather mode at W = 2 on the driver-call path (bound driver calls on the copy and all-gather streams'
    handles, the collective a bound call with the all-gather stream current), one load per block and load groups
    (a group's all-gathers one coalesced collective): bit-identical to resident on every rank."""
    from dlo_fn.runtime.dist import run_ranks

    for r in run_ranks(_gloo_cuda_rank, 2, False, 8, load_group, timeout_s=300):
        assert r["equal"] and r["sharded"] == 2 and r["driver_calls"]


@pytest.mark.parametrize("scope", [False, True, "block"])
@pytest.mark.parametrize("load_group", [2, 4])
@torch.no_grad()
def test_load_groups_bit_exact_on_cuda_streams(scope, load_group):
    """Load groups (dlo_fn.plan.lowering): one wait, one merged copy and one record per group on the real copy
    stream, one wait and record per group on the compute stream; blocks large enough that a missing wait would
    let a compute read a slot still being written. Eager, step graphs and block graphs; implicit passes back to
    back and a multi-step run with two requests per load."""
    import contextlib

    ref = toy(8, d=1024).to("cuda")
    o = offload(toy(8, d=1024), "blocks", _ctx(), mode="rank-local", num_slots=2 * load_group,
                load_group=load_group, graph=scope)
    ex = o.executor
    xs = [torch.randn(64, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(s)) for s in range(8)]
    want = [ref(x).clone() for x in xs]
    got = [o.model(x).clone() for x in xs]  # no host synchronisation in between
    torch.cuda.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(got, want))

    x0 = [torch.randn(32, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(9 + r)) for r in range(2)]
    want2 = _block_major_steps(ref, contextlib.nullcontext(), x0, x0)
    got2 = _block_major_steps(o.model, o.run(3, 2), x0, x0)
    assert all(torch.equal(a, b) for a, b in zip(want2, got2))
    if scope is False:
        copy_fn = ex._raw._fast["cuMemcpyHtoDAsync_v2"]
        prog = next(p for p in ex._programs._cache.values() if p.schedule.num_steps == 1 and p.schedule.warm_start)
        segs = next(iter(prog.fast.values()))
        copies = sum(1 for seg in segs if seg is not None for fn, _ in seg[1] if fn is copy_fn)
        loads = sum(1 for op in prog.schedule.ops if op.kind == "H2D")
        assert copies < loads and copies <= -(-loads // load_group) + 1, (copies, loads)


# -- one NCCL rank with the allgather op sequence kept (Executor(gather_one_rank=True)) -------------------------

def nccl_one_rank_executor(ctx, scope, load_group: int, timeout_s: float | None = None,
                           grouped: bool = True) -> tuple:
    """``(executor, block proxies, run(stack, x), inputs)``: an executor over a NCCL group of one rank that keeps
    the W > 1 program (H2D into landing buffers, an NCCL all-gather per load, or per group: on the grouped shard
    layout, ``grouped``, one of the group's chunk, else one per block in one launch, into the slots), eager on
    driver calls or captured as step graphs (``scope``), the NCCL collectives inside the capture; the resident
    reference is ``run(reference blocks, x)``, returned as proxies' ``.ref``."""
    from dlo_fn.bench.step_variants import block_states
    from dlo_fn.plan.layout import model_layout
    from dlo_fn.plan.spec import spec_from_module
    from dlo_fn.runtime.blocks import BlockProxy, strip_block
    from dlo_fn.runtime.executor import Executor
    from dlo_fn.runtime.host_store import build_host_store

    ref, model = toy(8, d=1024).to("cuda"), toy(8, d=1024).to("cuda")
    blocks = list(model.blocks)
    layout = model_layout(spec_from_module(model, "blocks"), 1, load_group=load_group if grouped else 1)
    tensors, aliases = block_states(blocks)
    store = build_host_store(layout, 0, tensors, ctx.platform)
    for block in blocks:
        strip_block(block, ctx.platform.device)
    ex = Executor(ctx.platform, layout, store, blocks, aliases, group=ctx.group, mode="allgather", graph=scope,
                  num_slots=2 * load_group, load_group=load_group, gather_one_rank=True,
                  collective_timeout_s=timeout_s)
    proxies = [BlockProxy(ex.compute, b, blocks[b]) for b in range(len(blocks))]

    def run(stack, x):
        h, c = x, x
        for block in stack:
            h, c = block(h, ctx=c)
        return (h + c).clone()

    xs = [torch.randn(64, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(s)) for s in range(8)]
    run.ref = list(ref.blocks)
    return ex, proxies, run, xs


def _nccl_one_rank(ctx, scope, load_group: int, timeout_s: float | None = None, grouped: bool = True) -> dict:
    """:func:`nccl_one_rank_executor`'s passes back to back (recorded, captured, replayed), each output against
    resident; with ``timeout_s`` also ~2 s more of them (the watchdog's timeout must not fire on a busy stream)."""
    import time

    ex, proxies, run, xs = nccl_one_rank_executor(ctx, scope, load_group, timeout_s, grouped)
    with torch.no_grad():
        want = [run(run.ref, x) for x in xs]
        got = [run(proxies, x) for x in xs]
        equal = all(torch.equal(g, w) for g, w in zip(got, want))
        t0 = busy = time.monotonic()
        while timeout_s is not None and busy - t0 < 2.0:
            equal &= all(torch.equal(run(proxies, x), w) for x, w in zip(xs, want))
            torch.cuda.synchronize()
            busy = time.monotonic()
    torch.cuda.synchronize()
    graphs, own = ex.graphs or ex.block_graphs, ex._nccl
    segs = [seg for prog in ex._programs._cache.values() for segs in prog.fast.values() for seg in segs if seg]
    return {"equal": equal, "backend": ctx.platform.backend,
            "gathers": ex._gather_group is not None and ex.ring.mode == "allgather"
            and ex.num_landing == 2 * load_group,
            "step_graphs": ex.graphs is not None, "captures": getattr(graphs, "captures", 0),
            "replays": getattr(graphs, "replays", 0), "driver_calls": ex._raw is not None,
            "own_nccl": own is not None, "busy_s": busy - t0,
            "watchdog_alive": own is not None and own.watchdog.alive and own.watchdog.fault is None,
            "nccl_calls": sum(1 for seg in segs for fn, _ in seg[1] if getattr(fn, "__name__", "") == "ncclAllGather"),
            "layout_load_group": ex.layout.load_group,
            # per compiled program: its all-gather ops that gather (a group's first), and their pairs
            "pairs_per_gather": sorted({len(a) for prog in ex._programs._cache.values()
                                        for k, a in zip(prog.kinds, prog.args) if k == 1 and a})}
