"""CUDA-graph steps without a GPU: the option and its fallback, how a schedule splits into steps, and the
recorded wiring; on CPU every capture falls back to eager (logged once) and stays bit-exact."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from dlo_fn.cli import build_parser
from dlo_fn.cli.generate import options_from_args
from dlo_fn.plan.ops import C
from dlo_fn.runtime.graph import StepGraphs, graph_support, split_steps
from dlo_fn.runtime.offload import OffloadOptions, offload
from tests.test_executor import CTX, toy


def test_option_and_cli_flag():
    assert OffloadOptions().graph is False and OffloadOptions(graph=True).graph is True
    args = build_parser().parse_args(["generate", "--checkpoint", "c", "--prompt", "p", "--out", "o", "--cuda-graph"])
    assert options_from_args(args).graph == "step"
    args = build_parser().parse_args(["generate", "--checkpoint", "c", "--cuda-graph", "block", "--prompt", "p",
                                      "--out", "o"])
    assert options_from_args(args).graph == "block" and options_from_args(args).block_call == "swap"
    assert options_from_args(args).graph_shapes == 4
    args = build_parser().parse_args(["generate", "--checkpoint", "c", "--cuda-graph", "block", "--graph-shapes",
                                      "2", "--prompt", "p", "--out", "o"])
    assert options_from_args(args).graph_shapes == 2
    args = build_parser().parse_args(["generate", "--checkpoint", "c", "--prompt", "p", "--out", "o"])
    assert options_from_args(args).graph is False


def test_support_decision_for_shard_groups():
    # The decision before anything runs (no GPU needed: it reads the platform kind, the group size and backend).
    from types import SimpleNamespace

    cuda = SimpleNamespace(kind="cuda")
    assert graph_support(cuda) is None and graph_support(cuda, 1, None, env={}) is None  # W = 1: no collective
    assert "runs on 'gloo', which a CUDA graph cannot capture" in graph_support(cuda, 2, "gloo", env={})
    assert graph_support(cuda, 4, "nccl", env={}) == (
        "capturing the NCCL all-gather (W = 4) is not validated on a multi-GPU machine yet (set "
        "DLO_FN_GRAPH_NCCL=1 to try it)")
    assert graph_support(cuda, 4, "nccl", env={"DLO_FN_GRAPH_NCCL": "1"}) is None
    assert graph_support(SimpleNamespace(kind="npu"), 2, "hccl", env={"DLO_FN_GRAPH_NCCL": "1"}).startswith(
        "CUDA graphs need a CUDA device")


def test_cpu_falls_back_to_eager_logged_once(caplog):
    assert graph_support(CTX.platform) == "CUDA graphs need a CUDA device (platform 'cpu')"
    ref = toy()
    with caplog.at_level(logging.WARNING):
        o = offload(copy.deepcopy(ref), "blocks", CTX, mode="rank-local", graph=True)
    assert o.executor.graphs is None
    assert [r.getMessage() for r in caplog.records if "cuda graph" in r.getMessage()] == [
        "cuda graph: CUDA graphs need a CUDA device (platform 'cpu'); running eager"]
    for seed in range(3):
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(o.model(x), ref(x))


@pytest.mark.parametrize("num_blocks,steps,r", [(4, 4, 1), (5, 3, 2), (4, 1, 3)])
def test_steps_partition_the_run_and_steady_steps_share_a_key(num_blocks, steps, r):
    o = offload(toy(num_blocks), "blocks", CTX, mode="allgather")
    ex = o.executor
    with ex.run(1):  # warm the ring: the next run starts from prefetched slots
        x = torch.randn(2, 16)
        o.model(x)
    program = ex._programs.get(ex.ring, steps, r, None)
    sch = program.schedule
    parts = split_steps(program)
    assert len(parts) == steps and parts[0].start == 0 and parts[-1].end == len(sch.ops)
    assert all(a.end == b.start for a, b in zip(parts, parts[1:]))
    for p in parts:
        assert len(p.computes) == num_blocks * r and sch.ops[p.computes[0]].block == 0
        assert all(sch.ops[i].kind == C for i in p.computes) and p.first_compute == p.computes[0]
        assert all(d < p.start for d in p.ext_waits)
    assert {i for _, i in sch.last_use} <= {i for p in parts for i in p.exported}
    if num_blocks % 2 == 0 and steps > 2:  # even depth: the slots line up again every step
        assert len({p.key for p in parts[1:-1]}) == 1


def test_forced_capture_on_cpu_records_wiring_then_runs_eager(caplog):
    """The graph path up to the capture runs on CPU (no CUDA graph exists there, so it fails and falls back)."""
    ref = toy(4)
    o = offload(copy.deepcopy(ref), "blocks", CTX, mode="allgather")
    ex = o.executor
    ex.graphs = StepGraphs(ex)
    with caplog.at_level(logging.WARNING):
        for seed in range(5):
            x = torch.randn(3, 16, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(o.model(x), ref(x))
    msgs = [r.getMessage() for r in caplog.records if "cuda graph" in r.getMessage()]
    assert len(msgs) == 1 and msgs[0].startswith("cuda graph: capture failed")
    wirings = {tuple(sorted(rec.wiring.items())) for rec in ex.graphs._records.values()}
    # The toy block returns (x, ctx) and the model feeds both to the next block: outputs 0 and 1.
    assert wirings == {tuple(((b, 0), (("out", 0), ("out", 1))) for b in range(1, 4))}
    assert ex.graphs.captures == 0 and ex.graphs.replays == 0 and ex.graphs._eager


class _Extra(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        x, ctx = self.inner.embed(x), x
        for block in self.inner.blocks:
            x, ctx = block(x, ctx=ctx + 0)  # work between blocks: not a chain of blocks
        return self.inner.head(x + ctx)


def test_work_between_blocks_is_not_captured(caplog):
    ref = _Extra(toy(4))
    o = offload(copy.deepcopy(ref), "inner.blocks", CTX, mode="rank-local")
    o.executor.graphs = StepGraphs(o.executor)
    with caplog.at_level(logging.WARNING):
        for seed in range(4):
            x = torch.randn(3, 16, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(o.model(x), ref(x))
    msgs = {r.getMessage() for r in caplog.records if "cuda graph" in r.getMessage()}
    assert msgs == {"cuda graph: a block input is neither a block-0 input nor an output of the block before "
                    "(the model does work between blocks); those steps run eager"}
    assert not o.executor.graphs._records


def test_block_scope_option_and_cpu_fallback(caplog):
    assert OffloadOptions(graph="block").graph == "block" and OffloadOptions(graph="step").graph == "step"
    with pytest.raises(ValueError, match="graph must be one of False, True, 'step', 'block'; got 'blocks'"):
        OffloadOptions(graph="blocks")
    ref = toy()
    with caplog.at_level(logging.WARNING):
        o = offload(copy.deepcopy(ref), "blocks", CTX, mode="allgather", graph="block")
    assert o.executor.block_graphs is None and o.executor.graphs is None
    assert [r.getMessage() for r in caplog.records if "cuda graph" in r.getMessage()] == [
        "cuda graph (per block): CUDA graphs need a CUDA device (platform 'cpu'); running eager"]
    for seed in range(3):
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(o.model(x), ref(x))


def test_capture_guard_pauses_collection_and_restores_it_after_a_failure():
    import gc

    from dlo_fn.runtime.graph_parts import capture_guard

    assert gc.isenabled()
    with capture_guard():
        assert not gc.isenabled()  # a finalizer run inside a capture would invalidate it
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="uncapturable"):
        with capture_guard():
            raise RuntimeError("uncapturable")
    assert gc.isenabled()
    gc.disable()
    try:  # collection off before stays off after
        with capture_guard():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_chain_buffer_holders_see_a_kept_reference_and_a_view():
    # Block graphs never overwrite a chain buffer the model still holds (runtime.block_graph): holders() is what
    # tells, and it must move for a plain reference and for a view, and come back when they are gone. (Each
    # count is taken outside an assert: pytest's rewritten asserts keep their operands alive.)
    from dlo_fn.runtime.block_graph import holders

    bufs = {"k": torch.zeros(4, 8)}
    base = holders(bufs["k"])
    kept = [bufs["k"]]
    with_ref = holders(bufs["k"])
    kept.clear()
    view = bufs["k"][:, :2]
    with_view = holders(bufs["k"])
    del view
    after = holders(bufs["k"])
    assert with_ref == (base[0] + 1, base[1]) and with_view[1] == base[1] + 1 and after == base


def test_block_call_flatten_and_rebuild_round_trip():
    # What a block graph keys on and captures (runtime.block_graph): tensors, tuples of tensors (diffusers' rotary
    # embeddings) and constants; anything else is refused (the block then runs eager).
    from dlo_fn.runtime.graph_parts import flatten_call, rebuild_call

    x, c, s = torch.randn(2), torch.randn(3), torch.randn(3)
    args, kwargs = (x,), {"temb": c, "image_rotary_emb": (c, s), "joint_attention_kwargs": None, "scale": 0.5}
    tensors, structure = flatten_call(args, kwargs)
    assert [t is u for t, u in zip(tensors, (x, c, c, s))] == [True] * 4 and len(tensors) == 4
    hash(structure)  # part of the graph's key
    new = [t.clone() for t in tensors]
    a2, k2 = rebuild_call(len(args), tuple(kwargs), structure, new)
    assert a2[0] is new[0] and k2["temb"] is new[1] and isinstance(k2["image_rotary_emb"], tuple)
    assert k2["image_rotary_emb"][1] is new[3] and k2["joint_attention_kwargs"] is None and k2["scale"] == 0.5
    assert list(k2) == list(kwargs)
    assert flatten_call((x,), {"mask": {"a": x}}) is None and flatten_call((x, [x, 1]), {}) is None
    assert flatten_call((x,), {"scale": 0.5})[1] != flatten_call((x,), {"scale": 0.25})[1]  # another graph
    assert flatten_call((x,), {"flag": True})[1] != flatten_call((x,), {"flag": 1})[1]


def test_shape_lru_keeps_the_most_recent_shapes_and_hands_back_the_dropped_keys():
    from dlo_fn.runtime.graph_parts import ShapeLRU

    lru = ShapeLRU(2)
    assert lru.use("a") == [] and lru.use("b") == []
    lru.add("a", 1), lru.add("a", 2), lru.add("b", 3)
    assert lru.use("a") == []  # touched: "b" is now the oldest
    assert lru.use("c") == [{3}] and len(lru) == 2 and lru.evictions == 1
    assert lru.use("b") == [{1, 2}] and lru.evictions == 2  # "b" comes back with no keys, "a" goes


def test_graph_shapes_option_is_checked():
    with pytest.raises(ValueError, match="graph_shapes must be >= 1"):
        OffloadOptions(graph="block", graph_shapes=0)


def test_step_graph_records_a_diffusers_call_with_a_rotary_tuple(caplog):
    """Wan's blocks take the rotary embedding as a tuple of tensors: the step graph records the wiring of its
    flattened tensors (the capture itself then fails on the CPU and the steps run eager, bit-exact)."""
    pytest.importorskip("diffusers")
    from tests.test_third_party import CASES, _reference

    _, inputs, paths = CASES["wan"]
    ref, want = _reference("wan")
    o = offload(copy.deepcopy(ref), paths, CTX, mode="rank-local")
    o.executor.graphs = StepGraphs(o.executor)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # 3 blocks: the steps of consecutive passes alternate between two signatures
            for s, w in enumerate(want):
                assert torch.equal(o.model(**inputs(s))[0], w)
    msgs = [r.getMessage() for r in caplog.records if "cuda graph" in r.getMessage()]
    assert len(msgs) == 1 and msgs[0].startswith("cuda graph: capture failed"), msgs
    recs = list(o.executor.graphs._records.values())
    assert recs and all(r.ok and len(r.structure[2]) == 4 and set(r.wiring) == {(1, 0), (2, 0)} for r in recs)
    # hidden_states chains; the text states, the time embedding and both rotary tensors are block 0's inputs
    assert all(r.wiring[(1, 0)] == (("out", 0), ("in", 1), ("in", 2), ("in", 3), ("in", 4)) for r in recs)


def test_step_graph_keeps_the_records_of_at_most_graph_shapes_shapes():
    ref = toy(4)
    o = offload(copy.deepcopy(ref), "blocks", CTX, mode="rank-local", graph_shapes=2)
    assert o.executor.graph_shapes == 2
    g = o.executor.graphs = StepGraphs(o.executor)
    for _ in range(2):
        for rows in (2, 3, 4):  # three shapes, two kept
            x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(rows))
            assert torch.equal(o.model(x), ref(x))
    assert g.evictions == 4 and {k[2][0][0] for k in g._records} == {(3, 16), (4, 16)}
