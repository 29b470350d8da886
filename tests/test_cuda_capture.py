"""The block-graph plug-in without a GPU (dlo_fn.runtime.cuda): the option, the CLI flag and the eager fallback,
and what a capture needs (runtime.cuda.capture): the guard, a block call flattened and rebuilt, the shapes kept,
the chain buffers' holders. Its bookkeeping with a host stand-in for the capture: tests/test_block_graph_host.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from dlo_fn.cli import build_parser
from dlo_fn.cli.generate import options_from_args
from dlo_fn.runtime.offload import OffloadOptions, offload
from tests.test_executor import CTX, toy


def test_option_and_cli_flag():
    assert OffloadOptions().graph is False and OffloadOptions(graph="block").graph == "block"
    for bad in (True, "step", "blocks"):  # step graphs are not part of the runtime: one plug-in, per block
        with pytest.raises(ValueError, match="graph must be False or 'block'"):
            OffloadOptions(graph=bad)
    args = build_parser().parse_args(["generate", "--checkpoint", "c", "--prompt", "p", "--out", "o", "--cuda-graph"])
    assert options_from_args(args).graph == "block"
    args = build_parser().parse_args(
        ["generate", "--checkpoint", "c", "--cuda-graph", "block", "--prompt", "p", "--out", "o"]
    )
    assert options_from_args(args).graph == "block" and options_from_args(args).block_call == "swap"
    assert options_from_args(args).graph_shapes == 4
    args = build_parser().parse_args(
        ["generate", "--checkpoint", "c", "--cuda-graph", "block", "--graph-shapes", "2", "--prompt", "p", "--out", "o"]
    )
    assert options_from_args(args).graph_shapes == 2
    args = build_parser().parse_args(["generate", "--checkpoint", "c", "--prompt", "p", "--out", "o"])
    assert options_from_args(args).graph is False


def test_block_graphs_fall_back_to_eager_on_cpu_logged_once(caplog):
    ref = toy()
    with caplog.at_level(logging.WARNING):
        o = offload(copy.deepcopy(ref), "blocks", CTX, mode="allgather", graph="block")
    assert o.executor.plugin is None
    assert [r.getMessage() for r in caplog.records if "cuda graph" in r.getMessage()] == [
        "cuda graph (per block): CUDA graphs need a CUDA device (platform 'cpu'); running eager"
    ]
    for seed in range(3):
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(o.model(x), ref(x))


def test_capture_guard_pauses_collection_and_restores_it_after_a_failure():
    import gc

    from dlo_fn.runtime.cuda.capture import capture_guard

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
    # Block graphs never overwrite a chain buffer the model still holds (runtime.cuda.block_graph): holders() is what
    # tells, and it must move for a plain reference and for a view, and come back when they are gone. (Each
    # count is taken outside an assert: pytest's rewritten asserts keep their operands alive.)
    from dlo_fn.runtime.cuda.block_graph import holders

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
    # What a block graph keys on and captures (runtime.cuda.block_graph): tensors, tuples of tensors (diffusers' rotary
    # embeddings) and constants; anything else is refused (the block then runs eager).
    from dlo_fn.runtime.cuda.capture import flatten_call, rebuild_call

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
    from dlo_fn.runtime.cuda.capture import ShapeLRU

    lru = ShapeLRU(2)
    assert lru.use("a") == [] and lru.use("b") == []
    lru.add("a", 1), lru.add("a", 2), lru.add("b", 3)
    assert lru.use("a") == []  # touched: "b" is now the oldest
    assert lru.use("c") == [{3}] and len(lru) == 2 and lru.evictions == 1
    assert lru.use("b") == [{1, 2}] and lru.evictions == 2  # "b" comes back with no keys, "a" goes


def test_graph_shapes_option_is_checked():
    with pytest.raises(ValueError, match="graph_shapes must be >= 1"):
        OffloadOptions(graph="block", graph_shapes=0)
