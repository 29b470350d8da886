"""The start-up fill plug-in (dlo_fn.runtime.cuda.host_fill: ParallelFill, fill_arena) on several threads: the same
bytes as the core's one-thread fill, every piece copied once from one call of its source, gaps zeroed over dirty
memory, the phases timed, and each range handed over (to be locked) as soon as it is whole."""

from __future__ import annotations

import threading

import pytest
import torch

from dlo_fn.plan.layout import model_layout
from dlo_fn.plan.spec import BlockSpec, ModelSpec, TensorSpec
from dlo_fn.runtime.cuda.host_fill import ParallelFill, fill_arena
from dlo_fn.runtime.host_store import build_host_store, tensor_bytes
from dlo_fn.runtime.platform import platform_for

CPU = platform_for("cpu")
MIB = 1 << 20


def _model(num_blocks: int, seed: int = 0):
    """Blocks of ~11 MiB (bf16 matrices, an fp32 vector, an odd-sized tensor so that gaps exist)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "a.weight": ((1024, 2048), torch.bfloat16),
        "b.weight": ((2048, 1536), torch.bfloat16),
        "c.bias": ((1023,), torch.float32),
        "d.weight": ((33, 7), torch.bfloat16),
    }
    blocks, tensors = [], []
    for b in range(num_blocks):
        values = {n: torch.randn(s, generator=gen).to(d) for n, (s, d) in shapes.items()}
        blocks.append(BlockSpec(f"blocks.{b}", tuple(TensorSpec(n, s, d) for n, (s, d) in sorted(shapes.items()))))
        tensors.append(values)
    return ModelSpec("m", tuple(blocks)), tensors


@pytest.mark.parametrize("world,group", [(1, 1), (3, 1), (2, 2)])
def test_threads_fill_the_same_bytes_as_one_thread(world, group):
    spec, tensors = _model(6)
    layout = model_layout(spec, world, load_group=group)
    for rank in range(world):
        plain = build_host_store(layout, rank, tensors, CPU)
        one = build_host_store(layout, rank, tensors, CPU, fill=ParallelFill(threads=1))
        many = build_host_store(layout, rank, tensors, CPU, fill=ParallelFill(threads=4))
        assert torch.equal(one.arena, many.arena) and torch.equal(plain.arena, many.arena)
        assert many.timings["threads"] == 4 and one.timings["threads"] == 1 == plain.timings["threads"]
        assert sorted(many.copied_ranges) == sorted(one.copied_ranges) == sorted(plain.copied_ranges)
        assert sum(b - a for a, b in many.copied_ranges) == sum(p.nbytes for s in layout.shards for p in s.pieces[rank])
    # And the bytes are the tensors' (W = 1: each block's shard is the block, padded).
    if world == 1:
        store = build_host_store(layout, 0, tensors, CPU, fill=ParallelFill(threads=4))
        for b, shard in enumerate(layout.shards):
            flat = store.shard(b)
            for p in shard.block.placements:
                assert torch.equal(flat[p.offset_bytes : p.end_bytes], tensor_bytes(tensors[b][p.name]))


def test_fill_arena_zeroes_gaps_over_dirty_memory_and_calls_each_source_once():
    n = 36 * MIB + 5
    arena = torch.full((n,), 0xAB, dtype=torch.uint8)  # dirty memory: gaps must be written, not assumed zero
    gen = torch.Generator().manual_seed(1)
    pieces = {}
    tasks, gaps, pos = [], [], 0
    for i, size in enumerate([5 * MIB, 7, 9 * MIB + 3, 1, 4 * MIB, 12 * MIB]):
        gaps.append((pos, pos + 100 + i))  # a gap before every piece
        pos += 100 + i
        pieces[i] = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        tasks.append((pos, size, i))
        pos += size
    gaps.append((pos, n))
    calls: dict[int, int] = {}
    lock = threading.Lock()

    def source(key):
        with lock:
            calls[key] = calls.get(key, 0) + 1
        return pieces[key]

    copied, copy_s, zero_s = fill_arena(arena, tasks, source, gaps, threads=3)
    assert calls == {i: 1 for i in pieces} and copy_s > 0 and zero_s >= 0
    for dst, size, key in tasks:
        assert torch.equal(arena[dst : dst + size], pieces[key])
    for lo, hi in gaps:
        assert not arena[lo:hi].any()
    assert sorted(copied) == sorted((p.data_ptr(), p.data_ptr() + p.numel()) for p in pieces.values())


def test_a_bad_tensor_fails_from_a_worker_thread_with_its_name():
    spec, tensors = _model(4)
    tensors[2] = dict(tensors[2], **{"b.weight": torch.zeros(3, 3, dtype=torch.bfloat16)})
    for fill in (None, ParallelFill(threads=4)):
        with pytest.raises(ValueError, match=r"blocks.2: tensor 'b.weight'.*layout says"):
            build_host_store(model_layout(spec, 1), 0, tensors, CPU, fill=fill)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        build_host_store(model_layout(spec, 1), 0, tensors, CPU, fill=ParallelFill(threads=0))


def test_small_arenas_fill_on_one_thread_by_default():
    """Below 256 MiB threads would cost more (their stacks and malloc arenas stay in the process's anonymous
    memory, which `bench mesh-host` checks to the page) than they save."""
    spec, tensors = _model(4)
    assert build_host_store(model_layout(spec, 1), 0, tensors, CPU, fill=ParallelFill()).timings["threads"] == 1


def test_timings_add_up():
    spec, tensors = _model(4)
    for fill, threads in ((ParallelFill(threads=2), 2), (None, 1)):
        t = build_host_store(model_layout(spec, 1), 0, tensors, CPU, fill=fill).timings
        assert t["pin_s"] == 0.0 and min(t["alloc_s"], t["zero_s"]) >= 0 and t["copy_s"] > 0
        assert t["threads"] == threads and t["total_s"] == pytest.approx(t["alloc_s"] + t["copy_s"] + t["zero_s"])
    assert build_host_store(model_layout(spec, 1), 0, tensors, CPU, source="mmap").timings is None


@pytest.mark.cuda
def test_cuda_arena_is_filled_then_registered():
    """On CUDA the plug-in's arena is filled pageable on several threads and registered after, the core's registered
    first and filled on one thread: the same bytes as a store built on the CPU, pinned exactly, and an H2D from it
    lands them."""
    spec, tensors = _model(6)
    layout = model_layout(spec, 2)
    for rank in range(2):
        cpu = build_host_store(layout, rank, tensors, CPU)
        cuda = build_host_store(layout, rank, tensors, platform_for("cuda", 0), fill=ParallelFill(threads=4))
        core = build_host_store(layout, rank, tensors, platform_for("cuda", 0))
        assert cuda.how == "cudaHostRegister" and cuda.arena.is_pinned() and cuda.timings["pin_s"] > 0
        assert cuda.timings["threads"] == 4 and torch.equal(cpu.arena, cuda.arena)
        assert core.how == "cudaHostRegister" and core.arena.is_pinned() and core.timings["pin_s"] == 0.0
        assert core.timings["threads"] == 1 and torch.equal(cpu.arena, core.arena)
        for store in (cuda, core):
            dev = store.shard(1).to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(dev.cpu(), cpu.shard(1))
            store.close()


@pytest.mark.parametrize("threads", [1, 4])
def test_each_range_is_handed_over_once_as_soon_as_its_pieces_and_gaps_are_in(threads):
    """fill_arena's ``on_full``: once per range of ``bounds`` (one of gaps alone too), and its bytes are final then."""
    src = torch.arange(100, dtype=torch.int64).to(torch.uint8) + 1
    arena = torch.full((100,), 0xEE, dtype=torch.uint8)
    # pieces [0, 10) [10, 30) [40, 60) [60, 70); gaps [30, 40) [70, 100); ranges end at 30, 60, 70, 100
    tasks = [(0, 10, 0), (10, 20, 10), (40, 20, 40), (60, 10, 60)]
    seen, lock = [], threading.Lock()
    want = src.clone()
    want[30:40] = want[70:] = 0

    def on_full(lo, hi):
        with lock:
            seen.append((lo, hi, torch.equal(arena[lo:hi], want[lo:hi])))

    copied, _, _ = fill_arena(
        arena,
        tasks,
        lambda off: src[off : off + dict((t[0], t[1]) for t in tasks)[off]],
        [(30, 40), (70, 100)],
        threads,
        [30, 60, 70, 100],
        on_full,
    )
    assert torch.equal(arena, want) and len(copied) == 4
    assert sorted(seen) == [(0, 30, True), (30, 60, True), (60, 70, True), (70, 100, True)]


def test_registration_ranges_end_at_block_starts_after_at_least_their_size(monkeypatch):
    from dlo_fn.runtime.cuda import host_fill

    spec = ModelSpec(
        "m", tuple(BlockSpec(f"blocks.{b}", (TensorSpec("w", (64, 64), torch.float32),)) for b in range(6))
    )
    for group in (1, 2, 3):
        layout = model_layout(spec, 2, load_group=group)
        block_bytes = layout.shard_offsets[1] - layout.shard_offsets[0]
        monkeypatch.setattr(host_fill, "PIN_RANGE_BYTES", 2 * block_bytes)
        n = layout.shard_bytes_per_rank
        bounds = host_fill.pin_bounds(layout, layout.num_blocks, n)
        starts = {layout.shard_offsets[b] for b in range(0, layout.num_blocks, group)}
        assert bounds[-1] == n and all(b in starts for b in bounds[:-1]), (group, bounds)
        assert all(hi - lo >= 2 * block_bytes for lo, hi in zip([0, *bounds], bounds[:-1])), (group, bounds)
        assert host_fill.pin_bounds(layout, 2, layout.shard_offsets[2])[-1] == layout.shard_offsets[2]


def test_offload_chooses_the_fill_from_its_options():
    """``host_fill``: "auto" is the core's fill off CUDA, "parallel" the plug-in with this host's ranks, "plain" the
    core's; anything else is one line naming the option."""
    from dlo_fn.runtime.dist import DistContext
    from dlo_fn.runtime.offload import _filler
    from dlo_fn.runtime.options import OffloadOptions

    ctx = DistContext(0, 1, 0, CPU, None)
    assert _filler(OffloadOptions(), ctx) is None and _filler(OffloadOptions(host_fill="plain"), ctx) is None
    assert _filler(OffloadOptions(host_fill="parallel"), ctx) == ParallelFill(local_ranks=1)
    with pytest.raises(ValueError, match="host_fill must be one of 'auto', 'parallel', 'plain'; got 'fast'"):
        OffloadOptions(host_fill="fast")
