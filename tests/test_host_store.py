"""Host store: one exact-size arena per rank, each rank's pieces only, shards reassemble every tensor."""

from __future__ import annotations

import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlo_fn.plan.layout import model_layout
from dlo_fn.plan.spec import BlockSpec, ModelSpec, TensorSpec
from dlo_fn.runtime.host_store import alloc_host, build_host_store, tensor_bytes
from dlo_fn.runtime.platform import platform_for

CPU = platform_for("cpu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn)


def _random_tensor(shape, dtype, gen):
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def _model(block_shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks, tensors = [], []
    for b, shapes in enumerate(block_shapes):
        specs, values = [], {}
        for i, (shape, dtype) in enumerate(shapes):
            name = f"t{i}.weight"
            specs.append(TensorSpec(name, shape, dtype))
            values[name] = _random_tensor(shape, dtype, gen)
        blocks.append(BlockSpec(f"blocks.{b}", tuple(sorted(specs, key=lambda s: s.name))))
        tensors.append(values)
    return ModelSpec("m", tuple(blocks)), tensors


def _reassemble(layout, stores, b):
    shard = layout.shards[b]
    return torch.cat([stores[r].shard(b) for r in range(layout.num_shards)])[: shard.block.nbytes]


shapes_st = st.lists(
    st.lists(
        st.tuples(st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), st.sampled_from(DTYPES)),
        min_size=1,
        max_size=5,
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=25, deadline=None)
@given(shapes=shapes_st, world=st.integers(1, 5))
def test_shards_reassemble_every_tensor_exactly(shapes, world):
    spec, tensors = _model(shapes)
    layout = model_layout(spec, world)
    stores = [build_host_store(layout, r, tensors, CPU) for r in range(world)]
    for store in stores:
        assert store.arena_bytes == layout.shard_bytes_per_rank  # one exact-size allocation per rank
        assert store.arena.untyped_storage().nbytes() == layout.shard_bytes_per_rank
        assert store.how == "pageable" and not store.pinned
    for b, shard in enumerate(layout.shards):
        flat = _reassemble(layout, stores, b)
        for p in shard.block.placements:
            assert torch.equal(flat[p.offset_bytes : p.end_bytes], tensor_bytes(tensors[b][p.name]))
        # Padding and alignment gaps are zero, so every gathered byte is defined.
        covered = torch.zeros(shard.padded_bytes, dtype=torch.bool)
        for p in shard.block.placements:
            covered[p.offset_bytes : p.end_bytes] = True
        full = torch.cat([stores[r].shard(b) for r in range(world)])
        assert not full[~covered].any()


def test_each_rank_reads_only_its_pieces():
    """Rank r gets tensors whose bytes outside its own pieces are poisoned: its shard is still exact, so
    it reads nothing else (each rank touches only its 1/W of the mmap'd pages)."""
    spec, tensors = _model([[((64, 8), torch.float32), ((8,), torch.float32), ((5, 3), torch.bfloat16)]] * 3)
    layout = model_layout(spec, 4)
    for rank in range(4):
        poisoned = []
        for b, shard in enumerate(layout.shards):
            values = {}
            for name, t in tensors[b].items():
                raw = torch.full((t.numel() * t.element_size(),), 0xAB, dtype=torch.uint8)
                for pc in shard.pieces[rank]:
                    if pc.tensor == name:
                        raw[pc.src_start : pc.src_stop] = tensor_bytes(t)[pc.src_start : pc.src_stop]
                values[name] = raw.view(t.dtype).view(t.shape)
            poisoned.append(values)
        store = build_host_store(layout, rank, poisoned, CPU)
        for b, shard in enumerate(layout.shards):
            lo, hi = shard.rank_range(rank)
            flat = torch.zeros(shard.padded_bytes, dtype=torch.uint8)
            for p in shard.block.placements:
                flat[p.offset_bytes : p.end_bytes] = tensor_bytes(tensors[b][p.name])
            assert torch.equal(store.shard(b), flat[lo:hi])
            assert sum(pc.nbytes for pc in shard.pieces[rank]) <= shard.shard_bytes


def test_mmap_source_keeps_views_and_copies_nothing():
    spec, tensors = _model([[((16, 4), torch.bfloat16), ((4,), torch.float32)]] * 2)
    layout = model_layout(spec, 1)
    store = build_host_store(layout, 0, tensors, CPU, source="mmap")
    assert store.arena is None and store.arena_bytes == 0 and store.how == "mmap"
    for b in range(2):
        ptrs = {s.src.data_ptr() for s in store.sources[b]}
        assert ptrs == {t.data_ptr() for t in tensors[b].values()}  # zero-copy
    with pytest.raises(ValueError, match="rank-local"):
        build_host_store(model_layout(spec, 2), 0, tensors, CPU, source="mmap")


def test_bad_block_tensors_are_named():
    spec, tensors = _model([[((4, 4), torch.float32)]])
    layout = model_layout(spec, 2)
    with pytest.raises(ValueError, match=r"blocks.0.*t0.weight.*missing"):
        build_host_store(layout, 0, [{}], CPU)
    bad = [{"t0.weight": torch.zeros(4, 5)}]
    with pytest.raises(ValueError, match=r"t0.weight.*layout says"):
        build_host_store(layout, 0, bad, CPU)
    meta = [{"t0.weight": torch.zeros(4, 4, device="meta")}]
    with pytest.raises(ValueError, match="meta device"):
        build_host_store(layout, 0, meta, CPU)
    with pytest.raises(ValueError, match="source"):
        build_host_store(layout, 0, tensors, CPU, source="disk")


def test_alloc_host_is_exact_size():
    for n in (1, 4097, 3 * 2**20 + 5):
        buf, how, _ = alloc_host(n, CPU)
        assert buf.numel() == n and buf.untyped_storage().nbytes() == n and how == "pageable"


@pytest.mark.cuda
def test_cuda_arena_is_pinned_exactly_by_host_register():
    cuda = platform_for("cuda", 0)
    n = (1 << 30) + 12345  # a caching-allocator pin would round this to 2 GiB
    before = (
        torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
        if hasattr(torch.cuda, "host_memory_stats")
        else 0
    )
    buf, how, fin = alloc_host(n, cuda)
    assert how == "cudaHostRegister" and buf.numel() == n and buf.is_pinned()
    if hasattr(torch.cuda, "host_memory_stats"):  # the caching host allocator saw nothing
        assert torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) == before
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    buf[-1] = 7
    dev.copy_(buf, non_blocking=True)
    torch.cuda.synchronize()
    assert int(dev[-1]) == 7
    fin()


@pytest.mark.cuda
def test_cuda_registration_is_undone_when_the_buffer_is_collected():
    """Without close(): dropping the last reference unlocks the pages (the finalizer must not keep them)."""
    import gc

    buf, how, fin = alloc_host(3 * 2**20 + 5, platform_for("cuda", 0))
    assert how == "cudaHostRegister" and buf.is_pinned() and fin.alive
    ptr = buf.data_ptr()
    del buf
    gc.collect()
    assert not fin.alive
    # The registration is gone: the driver knows no flags for these pages. Asked through the driver API, which
    # leaves the runtime's last-error alone (a refused cudaHostUnregister here would stay as the runtime's last
    # error, and torch reports it at its next kernel launch, in whatever test runs next).
    import ctypes

    flags = ctypes.c_uint(0)
    assert ctypes.CDLL("libcuda.so.1").cuMemHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(ptr)) != 0


def _anon_huge_kb(addr: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds ``addr``."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not pathlib.Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_huge_page_buffer_is_zeroed_private_memory_in_2mib_pages_where_the_kernel_gives_them():
    from dlo_fn.runtime.cuda.host_fill import huge_page_buffer

    n = 16 << 20
    buf = huge_page_buffer(n)
    assert buf.dtype == torch.uint8 and buf.numel() == n and not buf.any()
    buf.fill_(7)
    assert int(buf.sum()) == 7 * n
    thp = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = thp.read_text().split("[")[1].split("]")[0] if thp.exists() else "never"
    huge_kb = _anon_huge_kb(buf.data_ptr())
    assert huge_kb > 0 if mode in ("always", "madvise") else huge_kb == 0, (mode, huge_kb)


@pytest.mark.cuda
def test_a_cuda_arena_locked_range_by_range_is_pinned_and_unlocked_with_its_store(monkeypatch):
    """Several registrations (small ranges): every H2D reads pinned pages, the bytes are the model's, and close()
    unlocks every range."""
    import ctypes

    from dlo_fn.runtime.cuda import host_fill

    spec, tensors = _model([[((256, 256), torch.float32), ((7,), torch.bfloat16)]] * 5)
    layout = model_layout(spec, 1)
    monkeypatch.setattr(host_fill, "PIN_RANGE_BYTES", 1)  # a range per block
    store = build_host_store(layout, 0, tensors, platform_for("cuda", 0), fill=host_fill.ParallelFill())
    flags, libcuda = ctypes.c_uint(0), ctypes.CDLL("libcuda.so.1")

    def locked(b: int) -> bool:  # the driver knows flags for a registered range's first page
        at = ctypes.c_void_p(store_ptr + layout.shard_offsets[b])
        return libcuda.cuMemHostGetFlags(ctypes.byref(flags), at) == 0

    store_ptr = store.arena.data_ptr()
    assert store.how == "cudaHostRegister" and all(locked(b) for b in range(layout.num_blocks))
    for b in range(layout.num_blocks):
        got = store.shard(b).cuda(non_blocking=True).cpu()
        for p in layout.shards[b].block.placements:
            assert torch.equal(got[p.offset_bytes : p.offset_bytes + p.nbytes], tensor_bytes(tensors[b][p.name]))
    store.close()
    assert not any(locked(b) for b in range(layout.num_blocks))
