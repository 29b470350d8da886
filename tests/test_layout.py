"""Flat block layout and shard layout: golden example + properties over generated blocks."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from dlo_fn.plan.layout import align_up, block_layout, equal_shard_bytes, model_layout, shard_layout
from dlo_fn.plan.sizes import ModelSizes
from dlo_fn.plan.spec import BlockSpec, ModelSpec, TensorSpec

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.float8_e4m3fn)


def _docstring_block() -> BlockSpec:
    return BlockSpec(
        "blocks.0",
        (TensorSpec("q.weight", (64, 16), torch.bfloat16), TensorSpec("norm.weight", (64,), torch.float32)),
    )


def test_docstring_example_table():
    shards = shard_layout(block_layout(_docstring_block(), 256), 3)
    assert (shards.block.nbytes, shards.shard_bytes, shards.padding_bytes) == (2304, 768, 0)
    got = [[(p.tensor, p.src_start, p.src_stop, p.dst_start, p.dst_stop) for p in r] for r in shards.pieces]
    assert got == [
        [("q.weight", 0, 768, 0, 768)],
        [("q.weight", 768, 1536, 0, 768)],
        [("q.weight", 1536, 2048, 0, 512), ("norm.weight", 0, 256, 512, 768)],
    ], shards.table()
    assert "norm.weight[0:256] -> [512:768]" in shards.table()


def test_more_ranks_than_alignment_units_leaves_padding_only_ranks():
    block = BlockSpec("b.0", (TensorSpec("w", (10,), torch.float32),))
    shards = shard_layout(block_layout(block, 256), 4)
    assert shards.shard_bytes == 256
    assert [len(p) for p in shards.pieces] == [1, 0, 0, 0]
    assert "(padding only)" in shards.table()


def test_rejects_bad_alignment_and_empty_block():
    import pytest

    with pytest.raises(ValueError, match="power of two"):
        block_layout(_docstring_block(), 100)
    with pytest.raises(ValueError, match="stores no bytes"):
        block_layout(BlockSpec("b.0", ()), 256)


def test_digest_changes_with_any_disagreement():
    spec = ModelSpec("m", (_docstring_block(),))
    base = model_layout(spec, 2).digest
    assert base == model_layout(spec, 2).digest
    assert base != model_layout(spec, 3).digest
    assert base != model_layout(spec, 2, alignment_bytes=512).digest
    other = ModelSpec(
        "m",
        (BlockSpec("blocks.0", (TensorSpec("q.weight", (64, 16), torch.float16), TensorSpec("norm.weight", (64,), torch.float32))),),
    )
    assert base != model_layout(other, 2).digest


tensor_specs = st.lists(
    st.tuples(
        st.lists(st.integers(1, 9), min_size=0, max_size=3),
        st.sampled_from(DTYPES),
    ),
    min_size=1,
    max_size=64,
)


@st.composite
def blocks(draw):
    specs = draw(tensor_specs)
    return BlockSpec("blocks.0", tuple(TensorSpec(f"t{i}", tuple(shape), dt) for i, (shape, dt) in enumerate(specs)))


@settings(max_examples=150, deadline=None)
@given(block=blocks(), world=st.integers(1, 16), alignment=st.sampled_from((8, 64, 256)))
def test_shards_partition_every_byte_and_reassemble(block, world, alignment):
    layout = block_layout(block, alignment)
    shards = shard_layout(layout, world)
    # Equal shards, aligned, padding < one alignment unit per rank.
    assert shards.shard_bytes % alignment == 0
    assert 0 <= shards.padding_bytes < world * alignment
    # Pack real tensor bytes, split per the pieces, reassemble, compare every tensor exactly.
    gen = torch.Generator().manual_seed(0)
    data = {
        p.name: torch.randint(0, 256, (p.nbytes,), dtype=torch.uint8, generator=gen) for p in layout.placements
    }
    owner = torch.full((shards.padded_bytes,), -1, dtype=torch.int64)
    gathered = torch.zeros(shards.padded_bytes, dtype=torch.uint8)
    for r in range(world):
        shard = torch.zeros(shards.shard_bytes, dtype=torch.uint8)
        lo, hi = shards.rank_range(r)
        for piece in shards.pieces[r]:
            shard[piece.dst_start : piece.dst_stop] = data[piece.tensor][piece.src_start : piece.src_stop]
            place = layout.placement(piece.tensor)
            region = owner[place.offset_bytes + piece.src_start : place.offset_bytes + piece.src_stop]
            assert bool((region == -1).all()), "a byte belongs to two ranks"
            assert lo <= place.offset_bytes + piece.src_start and place.offset_bytes + piece.src_stop <= hi
            region.fill_(r)
        gathered[lo:hi] = shard
    for p in layout.placements:
        assert bool((owner[p.offset_bytes : p.end_bytes] >= 0).all()), f"{p.name} has unowned bytes"
        assert torch.equal(gathered[p.offset_bytes : p.end_bytes], data[p.name])
        if p.nbytes:
            view = gathered[p.offset_bytes : p.end_bytes].view(p.dtype).view(p.shape)
            assert view.stride() == p.stride or view.numel() <= 1


@settings(max_examples=40, deadline=None)
@given(block=blocks(), depth=st.integers(1, 32), world=st.integers(1, 16))
def test_slot_and_landing_sizes_are_independent_of_depth(block, depth, world):
    one = model_layout(ModelSpec("m", (block,)), world)
    deep = model_layout(ModelSpec("m", tuple(BlockSpec(f"blocks.{i}", block.tensors) for i in range(depth))), world)
    assert deep.max_padded_block_bytes == one.max_padded_block_bytes
    assert deep.max_shard_bytes == one.max_shard_bytes
    assert deep.shard_bytes_per_rank == depth * one.shard_bytes_per_rank
    assert deep.shard_offsets[-1] == (depth - 1) * one.shards[0].shard_bytes
    packed = block_layout(block).nbytes
    assert one.max_padded_block_bytes == world * align_up(-(-packed // world), 256)


def test_shard_size_is_exact_above_2_to_the_53_bytes():
    # n = 3 * 2^58 + 1: as a float, n / 3 is 2^58 (the 1/3 is below its precision), so a float ceil would
    # leave the last byte in no shard; the integer formula gives 2^58 + 1, aligned up to 2^58 + 256.
    n = 3 * 2**58 + 1
    assert equal_shard_bytes(n, 3, 256) == 2**58 + 256
    shards = shard_layout(block_layout(BlockSpec("huge", (TensorSpec("w", (n,), torch.uint8),))), 3)
    assert shards.shard_bytes == 2**58 + 256 and shards.padded_bytes >= n
    assert ModelSizes("huge", (n,)).shard_bytes(3) == (shards.shard_bytes,)  # one formula for both planners
