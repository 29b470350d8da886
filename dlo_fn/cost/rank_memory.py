"""What one rank holds in host memory, phase by phase: RSS, USS, PSS, VmHWM, and the sum of PSS over ranks.

Notation (bytes per rank unless stated; ``N`` ranks on one host; ``W`` shards: ``N`` allgather, ``1`` rank-local):

==========  =====================================================================================
``c``       the process constant (RSS / USS / PSS of a rank with the model bound, nothing touched):
            Python, torch, the comm library, the device context; measured (``ProcessConstant``)
``s``       the arena: ``sum_b align_up(ceil(n_b / W), A)`` (allgather), every block (rank-local
            pinned), 0 (rank-local mmap)
``F``       checkpoint bytes the rank reads to fill its arena: ``sum_b n_b / W`` (allgather), ``sum_b n_b``
            (rank-local pinned); those file pages are mapped by ``k`` ranks (``k = 1`` allgather, ``N``
            rank-local), so they count ``F / k`` in PSS and in USS only when ``k = 1``
``R``       resident (non-block) bytes: read once from the file; on CPU a private copy stays
``S, L``    slot (largest padded block) and landing (largest shard) bytes; ``n_S``, ``n_L`` of each.
            On CPU they are host memory, touched on first use; the allgather warm-up writes one slot
            (``w = S`` with a process group), gloo's all-gather adds a transient ``g = S`` (its output copy)
``a``       activations and other per-request scratch (workload; an input, 0 by default)
``x``       host staging of the collective on an accelerator (gloo over CUDA tensors); an input, 0 for
            NCCL / HCCL
==========  =====================================================================================

Phases (CPU; on CUDA ``S, L`` and the resident copy live on the device, ``w = g = 0`` (the warm-up gathers a
byte per rank: it only creates the communicator), and ``x`` is added from the first step's all-gather on)::

    after load     rss = c                   (views bound, no page read)
    fill           rss = c + s + F + w       (the store filled, the mapping still open; on an accelerator
                                             c + s: moving the resident tensors closed it, F in hwm only)
                   hwm = c + s + F + w + max(g, 2R)          (warm-up transient, or release: file + copy)
    after offload  rss = c + s + R + w       (mapping closed: no checkpoint page mapped)
    generation     rss = c + s + R + n_S S + n_L L + a + x,  hwm = max(fill, rss + g)

Rank-local mmap streams every block from the open mapping: after offload ``c`` (+ ``R`` read on CUDA), during
generation ``+ sum_b n_b`` file pages (PSS ``/ N``, USS only when ``N = 1``) + slots.

Not modelled, measured on one H200 (figures/data/load_phases_h200.csv, notebook 04): on CUDA the first compute loads
kernel modules and library state into host memory beside ``x``: pass it as ``a`` once measured; and gloo's staging
peaks a little above ``x`` while a gather runs.

USS = RSS minus shared pages (the constant's own split, file pages read by more than one rank); PSS divides
shared file pages by ``N``. With the mapping closed the ranks share no weight page, so the sum of PSS over
the ``N`` ranks is ``N`` times a rank's PSS; the page cache stays the OS's (in no process's PSS).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dlo_fn.plan.layout import DEFAULT_ALIGNMENT_BYTES
from dlo_fn.plan.modes import check_mode
from dlo_fn.plan.sizes import ModelSizes, _check_positive

__all__ = [
    "PHASES",
    "RANK_MODES",
    "DEVICES",
    "ProcessConstant",
    "RankTerms",
    "RankPhase",
    "RankMemory",
    "rank_terms",
    "rank_memory",
    "gloo_cuda_staging_bytes",
]

PHASES = ("load", "fill", "offload", "generate")
RANK_MODES = ("allgather", "rank-local", "rank-local-mmap")
DEVICES = ("cpu", "cuda", "npu")  # npu: the pinned arena is driver memory, outside the process (Figure 6)


@dataclass(frozen=True, slots=True)
class ProcessConstant:
    """One rank's bytes with the model bound and no weight page read (measured: ``bench load --phases``)."""

    rss_bytes: int
    uss_bytes: int
    pss_bytes: int

    def __post_init__(self) -> None:
        if not 0 <= self.uss_bytes <= self.rss_bytes or not 0 <= self.pss_bytes <= self.rss_bytes:
            raise ValueError(f"ProcessConstant needs 0 <= USS, PSS <= RSS, got {self}")


@dataclass(frozen=True, slots=True)
class RankTerms:
    """The per-rank terms of the module docstring, in bytes."""

    arena_bytes: int  # s
    read_bytes: int  # F
    readers: int  # k: ranks that map each page of F
    resident_bytes: int  # R
    resident_copy_bytes: int  # R on CPU (a private copy), 0 on CUDA
    warm_bytes: int  # w
    transient_bytes: int  # g
    slot_bytes: int  # n_S S on the host (CPU), 0 on CUDA
    landing_bytes: int  # n_L L on the host (CPU), 0 on CUDA
    streamed_bytes: int  # blocks read from the mapping while generating (rank-local mmap)
    activation_bytes: int  # a
    staging_bytes: int  # x

    def items(self) -> tuple[tuple[str, int], ...]:
        return tuple((f, getattr(self, f)) for f in self.__dataclass_fields__)


@dataclass(frozen=True, slots=True)
class RankPhase:
    """One phase of one rank: its RSS / USS / PSS then, its VmHWM so far, and the sum of PSS over the N ranks."""

    phase: str
    rss_bytes: int
    uss_bytes: int
    pss_bytes: int
    hwm_bytes: int
    sum_pss_bytes: int


@dataclass(frozen=True, slots=True)
class RankMemory:
    name: str
    num_ranks: int
    mode: str
    device: str
    constant: ProcessConstant
    terms: RankTerms
    phases: tuple[RankPhase, ...]

    def phase(self, name: str) -> RankPhase:
        for p in self.phases:
            if p.phase == name:
                return p
        raise ValueError(f"phase must be one of {PHASES}, got {name!r}")


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def gloo_cuda_staging_bytes(sizes: ModelSizes, num_shards: int, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> int:
    """``x`` for gloo over CUDA tensors: gloo stages the all-gather's input (one shard, ``L``) and output (one
    slot, ``S``) in pinned host buffers from the caching host allocator, which rounds each up to a power of
    two and keeps them from the first step's all-gather on: ``x = pow2(L) + pow2(S)``. (NCCL / HCCL: 0.) Seen on
    one H200 (figures/data/load_phases_h200.csv, N = 2; ``docs/performance.md``): the allgather rank's first step
    adds a little more than ``x`` over the rank-local one's once their arenas' difference is taken out."""
    return _pow2(sizes.max_shard_bytes(num_shards, alignment_bytes)) + _pow2(
        sizes.max_padded_block_bytes(num_shards, alignment_bytes)
    )


def rank_terms(
    sizes: ModelSizes,
    num_ranks: int,
    mode: str = "allgather",
    device: str = "cpu",
    *,
    num_slots: int = 2,
    num_landing: int = 2,
    activation_bytes: int = 0,
    staging_bytes: int = 0,
    process_group: bool | None = None,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    load_group: int = 1,
) -> RankTerms:
    """The terms for ``num_ranks`` ranks on one host (allgather shards over all of them). ``process_group``:
    whether the ranks have one (the allgather warm-up runs a real collective); default ``num_ranks > 1``
    (a single process runs without a group unless launched by torchrun or ``run_ranks``). ``load_group``: the
    ring's, whose grouped shard layout pads a group's shards to its largest (:mod:`dlo_fn.plan.layout`)."""
    _check_positive("num_ranks", num_ranks)
    check_mode(mode, RANK_MODES, "mode")
    check_mode(device, DEVICES, "device")
    gather = mode == "allgather"
    w = num_ranks if gather else 1
    blocks = sizes.total_block_bytes
    arena = 0 if mode == "rank-local-mmap" else sizes.shard_bytes_per_rank(w, alignment_bytes, load_group)
    read = 0 if mode == "rank-local-mmap" else (blocks + w - 1) // w
    slot = sizes.max_padded_block_bytes(w, alignment_bytes) + sizes.staging_bytes(w, alignment_bytes)
    cpu = device == "cpu"
    collective = gather and (num_ranks > 1 if process_group is None else process_group)
    return RankTerms(
        arena_bytes=arena,
        read_bytes=read,
        readers=1 if gather else num_ranks,
        resident_bytes=sizes.resident_bytes,
        resident_copy_bytes=sizes.resident_bytes if cpu and mode != "rank-local-mmap" else 0,
        warm_bytes=slot if cpu and collective else 0,
        transient_bytes=slot if cpu and collective else 0,
        slot_bytes=num_slots * slot if cpu else 0,
        # An all-gather over one rank lowers to H2D straight into the slot: no landing buffer (plan.lowering).
        landing_bytes=(num_landing if gather and w > 1 else 0) * sizes.max_shard_bytes(w, alignment_bytes)
        if cpu
        else 0,
        streamed_bytes=blocks if mode == "rank-local-mmap" else 0,
        activation_bytes=activation_bytes,
        staging_bytes=0 if cpu else staging_bytes,
    )


def rank_memory(
    sizes: ModelSizes,
    num_ranks: int,
    mode: str = "allgather",
    device: str = "cpu",
    *,
    constant: ProcessConstant,
    **kwargs,
) -> RankMemory:
    """Every phase of one rank (module docstring); ``kwargs`` go to :func:`rank_terms`."""
    terms = rank_terms(sizes, num_ranks, mode, device, **kwargs)
    # npu: the driver's pinned pages are in no process's RSS; RankMemory.terms still gives the arena.
    t = replace(terms, arena_bytes=0) if device == "npu" else terms
    n = num_ranks
    c = constant

    # A file page read by k ranks: RSS in full, PSS / k, USS only when no other rank maps it.
    def file(nbytes: int, readers: int) -> tuple[int, int, int]:
        return nbytes, nbytes if readers == 1 else 0, nbytes // readers

    def phase(name: str, private: int, files: tuple[tuple[int, int], ...], hwm: int) -> RankPhase:
        rss, uss, pss = c.rss_bytes + private, c.uss_bytes + private, c.pss_bytes + private
        for nbytes, readers in files:
            fr, fu, fp = file(nbytes, readers)
            rss, uss, pss = rss + fr, uss + fu, pss + fp
        return RankPhase(name, rss, uss, pss, max(hwm, rss), n * pss)

    load = phase("load", 0, (), c.rss_bytes)
    if mode == "rank-local-mmap":
        resident_read = ((t.resident_bytes, n),) if device == "cuda" else ()
        after = phase("offload", t.staging_bytes, resident_read, load.hwm_bytes)
        fill = phase("fill", 0, resident_read, load.hwm_bytes)
        gen_private = t.staging_bytes + t.slot_bytes + t.activation_bytes
        gen = phase(
            "generate",
            gen_private,
            resident_read + ((t.resident_bytes if device == "cpu" else 0, n), (t.streamed_bytes, n)),
            after.hwm_bytes,
        )
        return RankMemory(sizes.name, n, mode, device, c, terms, (load, fill, after, gen))
    # Fill: the store filled and the mapping still open (the state just before the release). Its high-water
    # mark is one of two moments: the warm-up all-gather (CPU: slot w + gloo's transient g) or the release
    # (the resident tensors read once more by every rank, copied on CPU).
    filled = phase(
        "fill", t.arena_bytes + t.warm_bytes, ((t.read_bytes, t.readers),), c.rss_bytes
    )  # the warm-up all-gather already ran (CPU: slot 0 touched)
    release_rss = filled.rss_bytes + t.resident_copy_bytes + t.resident_bytes
    fill = RankPhase(
        "fill",
        filled.rss_bytes,
        filled.uss_bytes,
        filled.pss_bytes,
        max(filled.rss_bytes + t.transient_bytes, release_rss),
        filled.sum_pss_bytes,
    )
    if device != "cpu":  # the resident tensors' move to the device dropped the mapping's last views: closed
        closed = phase("fill", t.arena_bytes + t.warm_bytes, (), c.rss_bytes)
        fill = replace(closed, hwm_bytes=fill.hwm_bytes)
    after_private = t.arena_bytes + t.resident_copy_bytes + t.warm_bytes
    after = phase("offload", after_private, (), fill.hwm_bytes)
    gen_private = (
        t.arena_bytes + t.resident_copy_bytes + t.staging_bytes + t.slot_bytes + t.landing_bytes + t.activation_bytes
    )
    gen = phase("generate", gen_private, (), fill.hwm_bytes)
    gen = RankPhase(
        "generate",
        gen.rss_bytes,
        gen.uss_bytes,
        gen.pss_bytes,
        max(gen.hwm_bytes, gen.rss_bytes + t.transient_bytes),
        gen.sum_pss_bytes,
    )
    return RankMemory(sizes.name, n, mode, device, c, terms, (load, fill, after, gen))
