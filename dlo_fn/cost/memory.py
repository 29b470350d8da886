"""Host memory models: cold-start peak, pinned weights per rank, and what the cgroup sees vs physical RAM.

Notation (bytes unless stated):

=========  =================================================================================
``M``      checkpoint bytes (every offloaded block + the resident tensors), the file size
``n_b``    flat bytes of block ``b`` (:mod:`dlo_fn.plan.layout`); ``R`` resident (non-block) bytes
``N``      ranks (processes) on the host; ``W`` ranks in the shard group (``W = N`` by default)
``A``      per-tensor / per-shard alignment (256)
``c``      framework bytes per rank (Python + torch + comm library): an input, measured on one deployment
``t``      load-time transient bytes (an explicit input, 0 by default)
=========  =================================================================================

**Cold start** (the cgroup-visible peak while N ranks load one checkpoint)::

    private copies (param.data.copy_):  N*M (private) + M (page cache of the file read) + N*c + t
    meta init + mmap views:                               M (shared page cache)        + N*c + t

and a rank's high-water mark (VmHWM) is the file or copy bytes it *touches* plus ``c``: ``M`` with private
copies or rank-local mmap views, its shards ``sum_b s_b + R`` with mmap + AllGather (each rank copies only its
own 1/W of each block out of the mapping).

**Pinned weights per rank** (host arena the H2D copies read)::

    allgather        sum_b s_b,   s_b = align_up(ceil(n_b / W), A)      (~ M / W; total over ranks ~ M)
    rank-local       sum_b align_up(n_b, A)   (a private pinned copy of every block: N x model in total)
    rank-local-mmap  0            (blocks streamed, pageable, from the shared page cache)

**cgroup vs physical RAM** in the steady state. Physical = page cache ``M`` (while not reclaimed) + ``N*c`` +
``N * pinned``. On CUDA the pinned arena is page-locked anonymous memory of the process: the cgroup counts it.
On Ascend, ``pin_memory()`` allocates through ``/dev/davinci_manager`` in kernel DMA memory that the cgroup
memory controller does not see (the published Figure 6): cgroup = ``M + N*c``, physical = cgroup + pinned.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo_fn.plan.layout import DEFAULT_ALIGNMENT_BYTES
from dlo_fn.plan.modes import check_mode
from dlo_fn.plan.sizes import GB, GIB, ModelSizes, _check_positive, parse_bytes  # re-exported: one entry point

__all__ = [
    "GB",
    "GIB",
    "LOADINGS",
    "HOST_MODES",
    "PLATFORMS",
    "parse_bytes",
    "ModelSizes",
    "ColdStart",
    "cold_start",
    "pinned_host_bytes_per_rank",
    "HostSteadyState",
    "host_steady_state",
    "HostCapacity",
    "host_capacity",
]

LOADINGS = ("mmap", "private-copy")
HOST_MODES = ("allgather", "rank-local", "rank-local-mmap")
PLATFORMS = ("cuda", "ascend")


def pinned_host_bytes_per_rank(
    sizes: ModelSizes,
    num_shards: int,
    mode: str = "allgather",
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    load_group: int = 1,
) -> int:
    """Host bytes of one rank's weight arena (see the module docstring); ``load_group``: the ring's, whose
    grouped shard layout (``W > 1``, :func:`~dlo_fn.plan.layout.layout_load_group`) pads a group's shards to
    its largest."""
    check_mode(mode, HOST_MODES, "mode")
    if mode == "allgather":
        return sizes.shard_bytes_per_rank(num_shards, alignment_bytes, load_group)
    if mode == "rank-local":
        return sizes.shard_bytes_per_rank(1, alignment_bytes)  # whole blocks, each at an aligned offset
    return 0


@dataclass(frozen=True, slots=True)
class ColdStart:
    """The cgroup-visible host peak while ``num_ranks`` ranks load one checkpoint, term by term."""

    loading: str
    num_ranks: int
    page_cache_bytes: int
    private_copy_bytes: int
    framework_bytes: int
    transient_bytes: int
    touched_bytes_per_rank: int
    framework_bytes_per_rank: int

    @property
    def cgroup_peak_bytes(self) -> int:
        return self.page_cache_bytes + self.private_copy_bytes + self.framework_bytes + self.transient_bytes

    @property
    def rss_bytes(self) -> int:
        """Anonymous (non page-cache) part of the peak."""
        return self.private_copy_bytes + self.framework_bytes + self.transient_bytes

    @property
    def hwm_bytes_per_rank(self) -> int:
        """One rank's high-water mark: the weight bytes it touches plus the framework constant."""
        return self.touched_bytes_per_rank + self.framework_bytes_per_rank


def cold_start(
    sizes: ModelSizes,
    num_ranks: int,
    loading: str = "mmap",
    mode: str = "allgather",
    *,
    framework_bytes_per_rank: int,
    transient_bytes: int = 0,
    num_shards: int | None = None,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> ColdStart:
    """``N*M (private copies only) + M + N*c + t``; ``mode`` only changes the pages each rank touches (its
    shards over ``num_shards`` ranks, default ``num_ranks``: a mesh may shard over a sub-group).

    ``framework_bytes_per_rank`` is ``c``, a property of the deployment: pass a measured value (the published
    deployment's is ``dlo_fn.cost.calibration.FRAMEWORK_HOST_BYTES_PER_RANK``)."""
    _check_positive("num_ranks", num_ranks)
    check_mode(loading, LOADINGS, "loading")
    check_mode(mode, HOST_MODES, "mode")
    m = sizes.total_bytes
    if loading == "private-copy" or mode != "allgather":
        touched = m
    else:
        touched = (
            sizes.shard_bytes_per_rank(num_ranks if num_shards is None else num_shards, alignment_bytes)
            + sizes.resident_bytes
        )
    return ColdStart(
        loading=loading,
        num_ranks=num_ranks,
        page_cache_bytes=m,
        private_copy_bytes=num_ranks * m if loading == "private-copy" else 0,
        framework_bytes=num_ranks * framework_bytes_per_rank,
        transient_bytes=transient_bytes,
        touched_bytes_per_rank=touched,
        framework_bytes_per_rank=framework_bytes_per_rank,
    )


@dataclass(frozen=True, slots=True)
class HostSteadyState:
    """Host memory once every rank holds its weight arena: what the cgroup sees and what RAM must hold."""

    platform: str
    mode: str
    num_ranks: int
    page_cache_bytes: int
    framework_bytes: int
    pinned_bytes_per_rank: int

    @property
    def pinned_bytes(self) -> int:
        return self.num_ranks * self.pinned_bytes_per_rank

    @property
    def cgroup_invisible_bytes(self) -> int:
        """Ascend: pinned memory comes from the driver's kernel DMA pool, outside the memory cgroup."""
        return self.pinned_bytes if self.platform == "ascend" else 0

    @property
    def physical_bytes(self) -> int:
        return self.page_cache_bytes + self.framework_bytes + self.pinned_bytes

    @property
    def cgroup_bytes(self) -> int:
        return self.physical_bytes - self.cgroup_invisible_bytes

    @property
    def rss_bytes(self) -> int:
        """cgroup-visible anonymous memory: framework, plus the pinned arena on CUDA."""
        return self.cgroup_bytes - self.page_cache_bytes


def host_steady_state(
    sizes: ModelSizes,
    num_ranks: int,
    platform: str = "cuda",
    mode: str = "allgather",
    *,
    num_shards: int | None = None,
    framework_bytes_per_rank: int,
    page_cache_retained: bool = True,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> HostSteadyState:
    """Steady-state host accounting; ``num_shards`` defaults to ``num_ranks`` (every rank shards);
    ``framework_bytes_per_rank`` is ``c`` (see :func:`cold_start`).

    ``page_cache_retained``: the mapped file stays in the page cache after the views are dropped until the
    kernel reclaims it (the published cgroup numbers still show it); pass False for a host under pressure.
    """
    _check_positive("num_ranks", num_ranks)
    check_mode(platform, PLATFORMS, "platform")
    w = num_ranks if num_shards is None else num_shards
    cached = sizes.total_bytes if page_cache_retained or mode == "rank-local-mmap" else 0
    return HostSteadyState(
        platform=platform,
        mode=mode,
        num_ranks=num_ranks,
        page_cache_bytes=cached,
        framework_bytes=num_ranks * framework_bytes_per_rank,
        pinned_bytes_per_rank=pinned_host_bytes_per_rank(sizes, w, mode, alignment_bytes),
    )


@dataclass(frozen=True, slots=True)
class HostCapacity:
    """One row of the host-capacity table: the cgroup-visible peak and the physical RAM a host needs."""

    model_bytes: int
    num_ranks: int
    platform: str
    cgroup_peak_bytes: int
    physical_bytes: int
    private_copy_peak_bytes: int
    host_ram_bytes: int

    @property
    def fits(self) -> bool:
        return self.physical_bytes <= self.host_ram_bytes


def host_capacity(
    sizes: ModelSizes,
    num_ranks: int,
    platform: str = "ascend",
    *,
    host_ram_bytes: int = 2 * 10**12,
    framework_bytes_per_rank: int,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> HostCapacity:
    """mmap + AllGather: cgroup peak = max(cold start, steady state); physical = steady state (page cache +
    framework + pinned shards), which is also the cold-start peak plus the shards being filled. The
    private-copy peak (no mmap) is given beside it for contrast."""
    steady = host_steady_state(
        sizes,
        num_ranks,
        platform,
        "allgather",
        framework_bytes_per_rank=framework_bytes_per_rank,
        alignment_bytes=alignment_bytes,
    )
    start = cold_start(sizes, num_ranks, "mmap", framework_bytes_per_rank=framework_bytes_per_rank)
    copies = cold_start(sizes, num_ranks, "private-copy", framework_bytes_per_rank=framework_bytes_per_rank)
    return HostCapacity(
        model_bytes=sizes.total_bytes,
        num_ranks=num_ranks,
        platform=platform,
        cgroup_peak_bytes=max(start.cgroup_peak_bytes, steady.cgroup_bytes),
        physical_bytes=max(start.cgroup_peak_bytes, steady.physical_bytes),
        private_copy_peak_bytes=copies.cgroup_peak_bytes,
        host_ram_bytes=host_ram_bytes,
    )
