"""Flat block layout and shard layout: golden example + properties over generated blocks."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
        (
            BlockSpec(
                "blocks.0",
                (TensorSpec("q.weight", (64, 16), torch.float16), TensorSpec("norm.weight", (64,), torch.float32)),
            ),
        ),
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
    data = {p.name: torch.randint(0, 256, (p.nbytes,), dtype=torch.uint8, generator=gen) for p in layout.placements}
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


@settings(max_examples=60, deadline=None)
@given(group=st.lists(blocks(), min_size=1, max_size=4), num_groups=st.integers(1, 3), world=st.integers(1, 6))
def test_grouped_layout_gathers_each_group_in_one_all_gather(group, num_groups, world):
    """Grouped layout (load_group G): every rank's chunk of a group is its G pieces back to back, and ONE
    all-gather of the chunks (rank-major) is the group's blocks concatenated at the stride padded_bytes, every
    tensor exact; a rank's host bytes are the sum of the grouped shard sizes."""
    from dlo_fn.plan.layout import grouped_shard_bytes

    g = len(group)
    spec = ModelSpec("m", tuple(BlockSpec(f"blocks.{i}", group[i % g].tensors) for i in range(g * num_groups)))
    layout = model_layout(spec, world, 64, load_group=g)
    flat = model_layout(spec, world, 64)
    assert layout.max_padded_block_bytes == flat.max_padded_block_bytes  # the slot size
    assert layout.max_shard_bytes == flat.max_shard_bytes  # the landing-buffer size
    sizes = ModelSizes.from_spec(spec, 64)
    assert layout.shard_bytes_per_rank == sum(grouped_shard_bytes(sizes.block_bytes, world, g, 64))
    # what the plan prices (plan.memory, the policy) is the layout offload() builds: grouped at W > 1 only
    from dlo_fn.cost.memory import pinned_host_bytes_per_rank

    built = layout if world > 1 else flat
    assert pinned_host_bytes_per_rank(sizes, world, "allgather", 64, load_group=g) == built.shard_bytes_per_rank
    if g == 1:
        assert layout.digest == flat.digest and layout.shards == flat.shards
    gen = torch.Generator().manual_seed(1)
    data = {
        (b, p.name): torch.randint(0, 256, (p.nbytes,), dtype=torch.uint8, generator=gen)
        for b, s in enumerate(layout.shards)
        for p in s.block.placements
    }
    for first in range(0, len(layout.shards), g):
        members = layout.shards[first : first + g]
        q, stride = members[0].shard_bytes, members[0].padded_bytes
        chunks = []
        for r in range(world):
            chunk = torch.zeros(g * q, dtype=torch.uint8)
            for m, shard in enumerate(members):
                assert (shard.group_size, shard.member, shard.shard_bytes) == (g, m, q)
                assert shard.rank_range(r) == ((r * g + m) * q, (r * g + m + 1) * q)
                for pc in shard.pieces[r]:
                    owner = first + m if pc.block is None else pc.block
                    src = data[(owner, pc.tensor)][pc.src_start : pc.src_stop]
                    chunk[m * q + pc.dst_start : m * q + pc.dst_stop] = src
            chunks.append(chunk)
        gathered = torch.cat(chunks)  # what all_gather_into_tensor of the chunks writes
        assert gathered.numel() == g * stride
        for m, shard in enumerate(members):
            for p in shard.block.placements:
                got = gathered[m * stride + p.offset_bytes : m * stride + p.end_bytes]
                assert torch.equal(got, data[(first + m, p.name)]), (first + m, p.name)


def test_grouped_layout_needs_the_group_to_divide_the_blocks():
    import pytest

    spec = ModelSpec("m", tuple(BlockSpec(f"blocks.{i}", _docstring_block().tensors) for i in range(6)))
    with pytest.raises(ValueError, match="load_group = 4 does not divide the 6 blocks"):
        model_layout(spec, 2, load_group=4)
    two = model_layout(spec, 2, load_group=2)
    assert two.digest != model_layout(spec, 2).digest  # ranks that group differently disagree at start-up
    assert "b1.q.weight" in two.shards[0].table()  # rank 1's piece of block 0's slot holds block 1's bytes
