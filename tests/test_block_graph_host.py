"""Block graphs' bookkeeping on the CPU (runtime/cuda/block_graph.py): the keys, the chain buffers and their parity, the
shared inputs copied once per pass, the eager fallback for outputs the model keeps, the input-shape cap and its
freeing, diffusers' call signatures. CUDA graphs do not exist on the CPU, so a host stand-in for the capture keeps
the captured work and runs it again at each replay, on the same static tensors: what a replay does with its
kernels. A wrong buffer, a copy skipped or a buffer overwritten while the model holds it changes the output. What
only a GPU shows (the capture itself, the pool's memory) is in tests/test_block_graph_cuda.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from dlo_fn.runtime.blocks import BlockProxy
from dlo_fn.runtime.cuda.block_graph import BlockGraphs
from dlo_fn.runtime.executor import Executor
from dlo_fn.runtime.offload import offload
from tests.test_executor import CTX, toy


class _Replay:
    def __init__(self, work) -> None:
        self.work = work

    def replay(self) -> None:
        self.work()


class HostCapture:
    """:class:`~dlo_fn.runtime.cuda.block_graph.CudaCapture`'s interface on the host: the work runs at capture (a CUDA
    capture runs nothing; the work is idempotent on its static inputs) and again at every replay."""

    device = "cpu"

    def reset(self) -> None:
        pass

    def capture(self, work):
        return _Replay(work), work()


def block_graphed(model, paths="blocks", max_shapes: int = 4, **options):
    """``model`` offloaded with the block-graph plug-in on the host capture: the executor ``offload`` built is
    replaced by one given the plug-in, the proxies pointed at it (as serve.recover does)."""
    o = offload(model, paths, CTX, **options)
    old, bg = o.executor, BlockGraphs(max_shapes, capture=HostCapture())
    old.release()
    o.executor = Executor(CTX.platform, o.layout, o.store, old.blocks, old.aliases, o.options, plugin=bg)
    for module in o.model.modules():
        if isinstance(module, BlockProxy):
            module.__dict__["_dlo_compute"] = o.executor.compute
    return o, bg


def chain(blocks, x, ctx):
    for block in blocks:
        x, ctx = block(x, ctx=ctx)
    return x.clone(), ctx.clone()


def same(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("num_blocks", [6, 7])  # odd depth: a block alternates between the two slots
@pytest.mark.parametrize("mode", ["rank-local", "allgather"])
@torch.no_grad()
def test_chain_buffers_bit_exact(mode, num_blocks):
    ref = toy(num_blocks)
    o, bg = block_graphed(copy.deepcopy(ref), mode=mode)
    for seed in range(6):
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(o.model(x), ref(x)), seed
    keys = num_blocks * (1 if num_blocks % 2 == 0 else 2)
    assert bg.captures == keys and bg.replays >= 6 * num_blocks - 2 * keys - num_blocks
    assert bg.chain_bytes == 2 * 2 * 3 * 16 * 4  # 2 parities x (x, ctx), whatever the depth
    assert bg.input_copies <= 2 * 6  # block 0's x and ctx, once per pass


@torch.no_grad()
def test_requests_per_load_keep_their_own_buffers():
    ref = toy(5)
    o, bg = block_graphed(copy.deepcopy(ref), mode="allgather")
    xs = [torch.randn(3, 16, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    want = [chain(ref.blocks, x, x) for x in xs]
    for _ in range(4):
        with o.executor.run(1, 2):
            cur = [(x, x) for x in xs]
            for block in o.model.blocks:
                cur = [block(h, ctx=c) for h, c in cur]  # block-major: both requests through each loaded block
            got = [(h.clone(), c.clone()) for h, c in cur]
        assert all(same(g, w) for g, w in zip(got, want))
    assert bg.replays > 0 and len({k[0] for k in bg._bufs}) == 2  # chain buffers per request


@torch.no_grad()
def test_a_kept_output_is_never_overwritten_and_a_changed_wiring_runs_eager(caplog):
    ref = toy(6)
    o, bg = block_graphed(copy.deepcopy(ref), mode="rank-local")

    def keep_all(blocks, x, ctx, view: bool):
        kept = []
        for block in blocks:
            x, ctx = block(x, ctx=ctx)
            kept.append(x[:, :8] if view else x)  # a view holds the buffer's storage
        return torch.cat([k[:, :8] for k in kept], 1).clone()

    x, c = torch.randn(3, 16), torch.randn(3, 16)
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            assert same(chain(o.model.blocks, x, c), chain(ref.blocks, x, c))
        for view in (False, True):
            for _ in range(3):
                assert torch.equal(keep_all(o.model.blocks, x, c, view), keep_all(ref.blocks, x, c, view))
        assert bg.held_eager > 0
        before = bg.replays
        for _ in range(2):
            assert same(chain(o.model.blocks, x, c), chain(ref.blocks, x, c))
        assert bg.replays - before == 2 * 6  # a plain chain again: every block replays

        def detached(blocks, x, ctx):
            for i, block in enumerate(blocks):
                x, ctx = block(x.clone() if i == 3 else x, ctx=ctx)
            return x.clone()

        assert torch.equal(detached(o.model.blocks, x, c), detached(ref.blocks, x, c))
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert "keeps a block's output" in msgs and "not the chain buffer it was at capture" in msgs


@torch.no_grad()
def test_the_shape_cap_drops_and_frees_the_least_recently_used_shape(caplog):
    ref = toy(4)
    o, bg = block_graphed(copy.deepcopy(ref), mode="rank-local", max_shapes=2)
    with caplog.at_level(logging.INFO):
        for cycle in range(3):
            for rows in (2, 3, 4, 5):  # four shapes, two kept
                x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(rows))
                for _ in range(3):  # seen, captured, replayed
                    assert torch.equal(o.model(x), ref(x)), (cycle, rows)
            assert len(bg._graphs) <= 2 * 4 and len(bg._bufs) <= 2 * 2 * 2 and len(bg._shared) <= 2 * 2
    assert bg.evictions == 10 and bg.replays >= 3 * 4 * 4
    assert any("more than 2 input shapes" in r.getMessage() for r in caplog.records)
    shapes = {k[2][0] for k in bg._bufs}  # what is left belongs to the two latest shapes
    assert shapes == {(4, 16), (5, 16)}


@pytest.mark.parametrize("name", ["wan", "flux"])
@torch.no_grad()
def test_diffusers_blocks_are_captured(name):
    """Keyword arguments, tuples of tensors (the rotary embeddings), None, and (Flux) tuple outputs over two block
    lists: every block is captured, and replays give the resident bits."""
    pytest.importorskip("diffusers")
    from tests.test_third_party import CASES, _reference

    _, inputs, paths = CASES[name]
    ref, want = _reference(name)
    o, bg = block_graphed(copy.deepcopy(ref), paths, mode="rank-local")
    for _ in range(2):
        for s, w in enumerate(want):
            assert torch.equal(o.model(**inputs(s))[0], w), s
    n = o.layout.num_blocks
    assert bg.captures == n * (1 if n % 2 == 0 else 2) and not bg._eager and bg.held_eager == 0


@torch.no_grad()
def test_inputs_are_copied_whenever_they_may_have_changed():
    """A key captured while its input came from outside the chain reads it from a shared buffer. Later a chain
    buffer may come in that position, one that a replay rewrote since it was last copied without bumping its
    version counter: it is copied every time. And every pass copies block 0's inputs again, even the same tensor
    with the same version (its bytes may have changed through ``.data``)."""
    ref = toy(6)
    o, bg = block_graphed(copy.deepcopy(ref), mode="rank-local")

    def run(blocks, x, c, clone_even: bool):
        # c: one conditioning tensor for every block (a copied input, copied once per pass)
        for i, block in enumerate(blocks):
            x, out = block(x.clone() if clone_even and i % 2 == 0 else x, ctx=c)
        return torch.cat([x, out])  # the last block's ctx output is computed from c

    x, c = torch.randn(3, 16), torch.randn(3, 16)
    for _ in range(2):  # seen, then captured: the even blocks' x copied, the odd ones' read in place
        assert torch.equal(run(o.model.blocks, x, c, True), run(ref.blocks, x, c, True))
    assert bg.captures == 6 and [bool(bg._graphs[k].direct) for k in sorted(bg._graphs)] == [False, True] * 3
    replays = bg.replays
    for seed in range(3):  # a plain chain: blocks 2 and 4 get the same chain buffer, rewritten by block 3
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(run(o.model.blocks, x, c, False), run(ref.blocks, x, c, False))
    assert bg.replays - replays == 3 * 6 and bg.held_eager == 0  # no shared input holds a chain buffer
    for seed in range(2):  # the same c, its bytes changed without a version bump
        c.data.copy_(torch.randn(3, 16, generator=torch.Generator().manual_seed(10 + seed)))
        assert torch.equal(run(o.model.blocks, x, c, False), run(ref.blocks, x, c, False))


@torch.no_grad()
def test_the_timeline_records_every_op_of_a_block_graphed_run():
    """Block graphs keep the executor's per-op events: every op of every run is in the timeline, in the planned
    order on each stream, whether its compute was replayed or not."""
    ref = toy(4)
    o, bg = block_graphed(copy.deepcopy(ref), mode="rank-local", record_timeline=True)
    x = torch.randn(3, 16)
    for _ in range(4):
        assert torch.equal(o.model(x), ref(x))
    assert bg.replays >= 2 * 4
    per_run = len(o.executor.next_schedule().ops)
    tl = o.executor.take_timeline()
    for j in range(1, 4):  # run 0 starts the ring cold (its own schedule)
        spans = [s for s in tl.spans if s.op.startswith(f"run{j} ")]
        assert len(spans) == per_run and all(s.end_s >= s.start_s for s in spans)


def test_the_wrapper_benchmark_replays_every_block():
    # bench.hostloop --block-graphs times the wrapper's host work per replayed call: after the first (eager) pass
    # every call is a replay (the capturing call replays once too), else it would time eager calls.
    from benchmarks.bench.hostloop import block_graph_call_us

    r = block_graph_call_us(num_blocks=4, passes=10)
    assert r["block_graph_captures"] == 4 and r["block_graph_replays"] == 4 * (5 + 10) - 4  # pass 1 eager
    assert r["block_graph_call_us"] > 0
