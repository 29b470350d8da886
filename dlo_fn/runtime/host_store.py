"""Per-rank host store of block weights: one exact-size arena of this rank's shards (technique 2).

**Sharded (allgather mode).** Rank ``r`` allocates ONE buffer of ``ModelLayout.shard_bytes_per_rank`` bytes
and copies into it, for every block ``b``, the pieces ``layout.shards[b].pieces[r]`` (tensor bytes ->
``shard_offsets[b] + dst``). It reads only the pages of the mmap'd checkpoint that hold its ``1/W`` of each
block; gaps (alignment between tensors, tail padding) are zeroed so every gathered byte is defined. The caller
then drops the mmap views (the block modules go to the meta device).

In a grouped layout (``ModelLayout.load_group > 1``) the arena holds, group after group, the rank's chunk of
the group's blocks concatenated (:mod:`dlo_fn.plan.layout`): a load group's H2D is one copy of the chunk, its
all-gather one collective.

**Exact-size pinning.** ``torch.empty(n, pin_memory=True)`` goes through the caching host allocator, which
rounds every request up to a power of two (an arena just over one pins nearly twice its size). On CUDA we allocate ``n``
pageable bytes and page-lock exactly those pages with ``cudaHostRegister`` (``torch.cuda.cudart()``); pinned
bytes = ``n`` rounded up to the page size. The registration is undone when the store is closed or collected
(what the two cost in resident memory, measured: ``docs/measurements.md``, ``bench step``'s
``pinning_overhead``). On NPU the driver's host allocator is used (``pin_memory=True`` on one arena); its pages are
invisible to the cgroup (DESIGN.md, Figure 6). CPU has no pinned memory: the arena is plain (pageable) memory.

**The fill.** The core registers the arena, zeroes its gaps and copies the pieces on one thread. ``fill=`` takes a
plug-in with the same contract (:data:`Fill`); the CUDA start-up plug-in
(:class:`dlo_fn.runtime.cuda.host_fill.ParallelFill`, chosen by ``OffloadOptions.host_fill``) fills in 2 MiB pages
on several threads and registers range by range while it copies.

**Rank-local mode** (``layout.num_shards == 1``): every rank streams whole blocks. Two sources:

=============  ===========================================  ===============================================
source         host memory per node (W ranks, model M)      H2D
=============  ===========================================  ===============================================
``"pinned"``   W x M private pinned (each rank its copy)    pinned: the link's full rate
``"mmap"``     M shared page cache (views kept, no copy)    pageable: a fraction of it (docs/performance.md),
                                                            one copy per tensor through a staging buffer
=============  ===========================================  ===============================================
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from dlo_fn.plan.layout import ModelLayout, cut_layout
from dlo_fn.runtime.platform import Platform

__all__ = [
    "HostStore",
    "H2DSource",
    "Filled",
    "Fill",
    "FillJob",
    "alloc_host",
    "pin_in_place",
    "register_cuda",
    "build_host_store",
    "with_device_blocks",
    "plain_fill",
    "tensor_bytes",
    "SOURCES",
]

log = logging.getLogger(__name__)
SOURCES = ("pinned", "mmap")
FillTask = tuple[int, int, Any]  # (arena offset, bytes, key): copy read(key) (flat uint8) to arena[offset:]


@dataclass(frozen=True, slots=True)
class Filled:
    """What a fill hands back: the arena, how it is pinned (:func:`alloc_host`'s ``how``), the finalizer that
    unpins it, the source address ranges it read (``HostStore.copied_ranges``) and its phases' seconds
    (``alloc_s``, ``copy_s``, ``zero_s``, ``pin_s``) and ``threads``."""

    arena: torch.Tensor
    how: str
    finalizer: object | None
    copied: tuple[tuple[int, int], ...]
    timings: dict


@dataclass(frozen=True, slots=True)
class FillJob:
    """What a fill is asked for: an arena of ``nbytes`` holding blocks ``0..k-1`` of ``layout``, every ``[lo, hi)``
    of ``gaps`` zeroed, every task's bytes (``read(key)``, flat uint8) copied to its offset, on ``platform``."""

    layout: ModelLayout
    k: int
    nbytes: int
    tasks: Sequence[FillTask]
    gaps: Sequence[tuple[int, int]]
    read: Callable[[Any], torch.Tensor]
    platform: Platform


# fill(job) -> Filled; :func:`plain_fill` is the core's.
Fill = Callable[[FillJob], Filled]


@dataclass(frozen=True, slots=True)
class H2DSource:
    """Copy ``src`` (uint8, host) to bytes ``[dst_start, dst_start + src.numel())`` of the destination buffer."""

    src: torch.Tensor
    dst_start: int


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    if not t.is_contiguous():
        raise ValueError(f"tensor of shape {tuple(t.shape)} is not contiguous; cannot take a byte view")
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def register_cuda(buf: torch.Tensor) -> int:
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0)  # torch's binding releases the GIL
    if rc != cudart.cudaError.success:
        raise RuntimeError(
            f"cudaHostRegister of {buf.numel()} bytes failed with {rc}: not enough lockable "
            f"host memory (check `ulimit -l` and the container's memory limit)"
        )
    return buf.data_ptr()


def _unregister_cuda(ptrs: tuple[int, ...]) -> None:
    try:
        torch.cuda.synchronize()  # no copy from these pages may still be in flight when they are unlocked
        # Only ever once per registration (weakref.finalize runs once): a refused unregister would stay as the
        # runtime's last error and surface at torch's next kernel launch as an unrelated failure.
        for ptr in ptrs:
            torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the driver releases the registration with the process
        pass


def alloc_host(nbytes: int, platform: Platform, pin: bool = True) -> tuple[torch.Tensor, str, object | None]:
    """One uint8 host buffer of exactly ``nbytes`` bytes; returns (buffer, how, finalizer).

    ``how`` is ``"cudaHostRegister"`` (exact pinned), ``"pin_memory"`` (driver allocator, NPU) or
    ``"pageable"``.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if not pin or not platform.supports_pinned or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8), "pageable", None
    if platform.kind == "cuda":
        buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf, "cudaHostRegister", pin_in_place(buf)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "pin_memory", None


def pin_in_place(buf: torch.Tensor, ptrs: Sequence[int] | None = None) -> object:
    """Page-lock the pages of the CUDA host buffer ``buf`` (``cudaHostRegister``); returns the finalizer that
    undoes it (run by ``close()`` or when ``buf`` is collected). ``ptrs``: ``buf`` is already registered, as the
    ranges starting at these addresses; only the finalizer is made."""
    ptrs = (register_cuda(buf),) if ptrs is None else tuple(ptrs)
    # The finalizer must not hold ``buf`` (weakref.finalize keeps its arguments alive): pass the addresses.
    return weakref.finalize(buf, _unregister_cuda, ptrs)


class HostStore:
    """The host side of the offload: for each block, the :class:`H2DSource` list its H2D op copies.

    Built by :func:`build_host_store`. ``arena`` is None for the rank-local ``"mmap"`` source.
    """

    def __init__(
        self,
        layout: ModelLayout,
        rank: int,
        sources: tuple[tuple[H2DSource, ...], ...],
        arena: torch.Tensor | None,
        how: str,
        finalizer: object | None = None,
    ) -> None:
        if len(sources) != layout.num_blocks:
            raise ValueError(f"{len(sources)} source lists for {layout.num_blocks} blocks")
        self.layout, self.rank, self.sources, self.arena, self.how = layout, rank, sources, arena, how
        self._finalizer = finalizer
        self.num_pinned_blocks = layout.num_blocks if arena is not None else 0
        self.pageable: tuple[int, ...] = () if arena is not None else tuple(range(layout.num_blocks))
        # Device-stored blocks (an HBM budget's tier): their shards in one device buffer, loaded from there.
        self.device_arena: torch.Tensor | None = None
        self.device_blocks: frozenset[int] = frozenset()
        self.copied_ranges: tuple[tuple[int, int], ...] = ()  # source bytes copied into the arena
        # Seconds of the fill's phases (copy_s includes the first touch of pageable pages and runs beside the
        # registration of the ranges already filled; pin_s the registration left after it), its threads and the
        # total; None for the "mmap" source.
        self.timings: dict | None = None

    @property
    def streamed_bytes(self) -> int:
        """Bytes per pass this rank's H2D reads from outside its arena (pageable: the mapping)."""
        return sum(s.src.numel() for b in self.pageable for s in self.sources[b])

    @property
    def pinned(self) -> bool:
        return self.how in ("cudaHostRegister", "pin_memory")

    @property
    def arena_bytes(self) -> int:
        """Host bytes this rank allocated for weights (0 for the shared-mmap source)."""
        return 0 if self.arena is None else self.arena.numel()

    @property
    def device_bytes(self) -> int:
        """Device bytes of the device-stored blocks' shards."""
        return 0 if self.device_arena is None else self.device_arena.numel()

    def shard(self, block: int) -> torch.Tensor:
        """Rank-local shard of ``block`` in the arena (a view)."""
        if block in self.pageable:
            raise ValueError(f"block {block} is read from the mapping (mmap source or a host budget); use .sources")
        return self.sources[block][0].src  # one view of its arena (host or device)

    def close(self) -> None:
        """Unpin and drop the arena (views taken from it stay valid as pageable memory)."""
        if self._finalizer is not None:
            self._finalizer()  # type: ignore[operator]
        self.arena = self.device_arena = None
        self.sources = tuple(() for _ in self.sources)


def _gaps(pieces: Sequence, size: int) -> list[tuple[int, int]]:
    out, pos = [], 0
    for p in sorted(pieces, key=lambda p: p.dst_start):
        if p.dst_start > pos:
            out.append((pos, p.dst_start))
        pos = max(pos, p.dst_stop)
    if pos < size:
        out.append((pos, size))
    return out


def _check_tensor(layout: ModelLayout, b: int, name: str, t: torch.Tensor | None) -> torch.Tensor:
    block = layout.shards[b].block
    if t is None:
        raise ValueError(f"block {block.name}: tensor {name!r} is missing from the module")
    pl = block.placement(name)
    if tuple(t.shape) != pl.shape or t.dtype != pl.dtype:
        raise ValueError(
            f"block {block.name}: tensor {name!r} is {tuple(t.shape)} {t.dtype}, the layout says {pl.shape} {pl.dtype}"
        )
    if t.device.type == "meta":
        raise ValueError(
            f"block {block.name}: tensor {name!r} is on the meta device: load the checkpoint "
            f"(dlo_fn.io.load.load_model) before offloading"
        )
    return t.detach()


def plain_fill(job: FillJob) -> Filled:
    """The core's fill (:data:`Fill`): an exact-size arena from :func:`alloc_host`, pinned before the copy, its
    gaps zeroed and the pieces copied on this thread."""
    t0 = time.perf_counter()
    arena, how, fin = alloc_host(job.nbytes, job.platform, pin=True)
    t1 = time.perf_counter()
    for lo, hi in job.gaps:
        arena[lo:hi].zero_()
    t2 = time.perf_counter()
    copied = []
    for dst, n, key in job.tasks:
        src = job.read(key)
        arena[dst : dst + n].copy_(src)
        if n:
            copied.append((src.data_ptr(), src.data_ptr() + n))
    t3 = time.perf_counter()
    timings = dict(alloc_s=t1 - t0, copy_s=t3 - t2, zero_s=t2 - t1, pin_s=0.0, threads=1)
    return Filled(arena, how, fin, tuple(copied), timings)


def build_host_store(
    layout: ModelLayout,
    rank: int,
    block_tensors: Sequence[Mapping[str, torch.Tensor]],
    platform: Platform,
    *,
    source: str = "pinned",
    progress: bool = False,
    pinned_blocks: int | None = None,
    fill: Fill | None = None,
    device_blocks: frozenset[int] = frozenset(),
) -> HostStore:
    """Fill this rank's store from the block tensors (typically zero-copy mmap views).

    ``block_tensors[b]`` maps each tensor name of block ``b`` (relative, as in the layout) to its tensor.
    ``source="mmap"`` is for rank-local layouts only: nothing is copied, the H2D ops read the views.
    ``pinned_blocks=k`` (a host budget, :mod:`dlo_fn.cost.host_budget`): only blocks ``0..k-1`` go into the
    arena (exact size: their shards); the H2D of every later block reads this rank's pieces straight from the
    tensors (pageable), which must then stay alive (the store holds them). ``fill``: who allocates and fills the
    arena (module docstring; default :func:`plain_fill`); ``progress`` logs ``store.timings``. ``device_blocks``:
    blocks whose shards go to one buffer on the platform's device instead (:func:`with_device_blocks`)."""
    if device_blocks:
        return with_device_blocks(
            layout,
            rank,
            block_tensors,
            platform,
            device_blocks,
            source=source,
            progress=progress,
            pinned_blocks=pinned_blocks,
            fill=fill,
        )
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if len(block_tensors) != layout.num_blocks:
        raise ValueError(f"got tensors for {len(block_tensors)} blocks, the layout has {layout.num_blocks}")
    if not 0 <= rank < layout.num_shards and layout.num_shards > 1:
        raise ValueError(f"rank {rank} outside the shard group of {layout.num_shards}")
    shard_rank = rank if layout.num_shards > 1 else 0
    if source == "mmap":
        if layout.num_shards != 1:
            raise ValueError("source='mmap' streams whole blocks: it needs a rank-local (num_shards 1) layout")
        sources = tuple(
            tuple(
                H2DSource(tensor_bytes(_check_tensor(layout, b, p.name, block_tensors[b].get(p.name))), p.offset_bytes)
                for p in shard.block.placements
            )
            for b, shard in enumerate(layout.shards)
        )
        return HostStore(layout, rank, sources, None, "mmap")
    k = layout.num_blocks if pinned_blocks is None else pinned_blocks
    if not 0 <= k <= layout.num_blocks:
        raise ValueError(f"pinned_blocks must be in [0, {layout.num_blocks}], got {pinned_blocks}")

    def piece_bytes(b: int, p) -> torch.Tensor:  # a grouped layout's piece may hold another block's bytes
        owner = b if p.block is None else p.block
        return tensor_bytes(_check_tensor(layout, owner, p.tensor, block_tensors[owner].get(p.tensor)))[
            p.src_start : p.src_stop
        ]

    nbytes = layout.shard_offsets[k] if k < layout.num_blocks else layout.shard_bytes_per_rank
    tasks, gaps, streamed = [], [], {}
    for b, shard in enumerate(layout.shards):
        base, pieces = layout.shard_offsets[b], shard.pieces[shard_rank]
        if b >= k:  # streamed: the H2D reads the rank's pieces where they are
            streamed[b] = tuple(H2DSource(piece_bytes(b, p), p.dst_start) for p in pieces)
            continue
        tasks.extend((base + p.dst_start, p.nbytes, (b, p)) for p in pieces)
        gaps.extend((base + lo, base + hi) for lo, hi in _gaps(pieces, shard.shard_bytes))
    filled = (fill or plain_fill)(FillJob(layout, k, nbytes, tasks, gaps, lambda key: piece_bytes(*key), platform))
    arena, offsets = filled.arena, layout.shard_offsets
    sources = tuple(
        streamed[b] if b >= k else (H2DSource(arena[offsets[b] : offsets[b] + shard.shard_bytes], 0),)
        for b, shard in enumerate(layout.shards)
    )
    timings = {**filled.timings}
    timings["total_s"] = sum(timings[key] for key in ("alloc_s", "copy_s", "zero_s", "pin_s"))
    from dlo_fn.io.memstat import format_bytes

    (log.info if progress else log.debug)(
        "host store: rank %d, %s (%s), %d/%d blocks in the arena, filled in %.1f ms (allocate %.1f, copy %.1f, "
        "zero %.1f, pin %.1f ms) on %d thread(s)",
        rank,
        format_bytes(arena.numel()),
        filled.how,
        k,
        layout.num_blocks,
        *(1e3 * timings[key] for key in ("total_s", "alloc_s", "copy_s", "zero_s", "pin_s")),
        timings["threads"],
    )
    store = HostStore(layout, rank, sources, arena, filled.how, filled.finalizer)
    store.num_pinned_blocks, store.copied_ranges, store.timings = k, filled.copied, timings
    store.pageable = tuple(range(k, layout.num_blocks))
    return store


def with_device_blocks(
    layout: ModelLayout,
    rank: int,
    block_tensors: Sequence[Mapping[str, torch.Tensor]],
    platform: Platform,
    device_blocks: frozenset[int],
    **host: Any,
) -> HostStore:
    """The store of :func:`build_host_store` (``host``: its keywords) with blocks ``device_blocks`` kept on the
    device: their shards (this rank's pieces, gaps zeroed, as the arena would hold them) in one device buffer, which
    their H2D ops then copy from; the other blocks' store as usual, sized for them alone."""
    if layout.load_group != 1 or not set(device_blocks) <= set(range(layout.num_blocks)):
        raise ValueError(
            f"device-stored blocks {sorted(device_blocks)} need blocks of the layout (0..{layout.num_blocks - 1}), "
            f"laid out one by one (load group 1, not {layout.load_group})"
        )
    on_host = [b for b in range(layout.num_blocks) if b not in device_blocks]
    on_device = sorted(device_blocks)
    store = None
    if on_host:
        store = build_host_store(
            cut_layout(layout, on_host), rank, [block_tensors[b] for b in on_host], platform, **host
        )
    cut = cut_layout(layout, on_device)
    shard_rank = rank if layout.num_shards > 1 else 0
    arena = torch.zeros(cut.shard_bytes_per_rank, dtype=torch.uint8, device=platform.device)
    sources: dict[int, tuple[H2DSource, ...]] = {}
    for j, (b, base) in enumerate(zip(on_device, cut.shard_offsets)):
        for p in cut.shards[j].pieces[shard_rank]:
            src = tensor_bytes(_check_tensor(cut, j, p.tensor, block_tensors[b].get(p.tensor)))
            arena[base + p.dst_start : base + p.dst_stop].copy_(src[p.src_start : p.src_stop])
        sources[b] = (H2DSource(arena[base : base + cut.shards[j].shard_bytes], 0),)
    platform.synchronize()  # the loads read the buffer from the executor's streams
    if store is not None:
        sources.update(zip(on_host, store.sources))
    merged = HostStore(
        layout,
        rank,
        tuple(sources[b] for b in range(layout.num_blocks)),
        None if store is None else store.arena,
        "none" if store is None else store.how,
        None if store is None else store._finalizer,
    )
    if store is not None:
        merged.num_pinned_blocks, merged.copied_ranges, merged.timings = (
            store.num_pinned_blocks,
            store.copied_ranges,
            store.timings,
        )
        store._finalizer = None  # the merged store unpins the arena
    merged.pageable = tuple(on_host[i] for i in (store.pageable if store is not None else ()))
    merged.device_arena, merged.device_blocks = arena, frozenset(device_blocks)
    return merged
