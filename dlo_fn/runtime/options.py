"""What selects how weights move: :class:`OffloadOptions`, one frozen value for ``offload``, the executor and the
results that record it.

Every execution choice is a field here, never an environment variable. The core runtime (``executor``,
``program``, ``issue``) reads the fields it needs; the plug-ins (:mod:`dlo_fn.runtime.cuda`: block graphs,
``graph``; the FP8 dequantise kernel, ``dequant``; the start-up fill, ``host_fill``) are chosen by
:func:`dlo_fn.runtime.offload.offload` from these fields and handed to the core, which never imports them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo_fn.plan.layout import DEFAULT_ALIGNMENT_BYTES
from dlo_fn.plan.lowering import check_load_group
from dlo_fn.plan.modes import check_mode
from dlo_fn.plan.quant import Quantization, as_quantization
from dlo_fn.runtime.blocks import CALLS
from dlo_fn.runtime.mesh import check_shard_group

__all__ = ["GRAPHS", "HOST_FILLS", "OffloadOptions"]

GRAPHS = (False, "block")  # False: eager; "block": each block's compute a CUDA graph (runtime.cuda)
# "plain": the core's fill (runtime.host_store.plain_fill); "parallel": the start-up plug-in
# (runtime.cuda.host_fill.ParallelFill); "auto": the plug-in on CUDA, where it measured faster, else plain.
HOST_FILLS = ("auto", "parallel", "plain")


@dataclass(frozen=True, slots=True)
class OffloadOptions:
    """Everything that selects how weights move. ``mode`` is the one switch between the three variants."""

    mode: str = "allgather"
    num_slots: int = 2
    num_landing: int | None = None  # allgather default 2 (2G with load groups)
    rank_local_source: str = "pinned"  # "pinned": private pinned copy; "mmap": stream from the shared mmap
    block_call: str = "swap"  # or "functional_call" (same bits, more host time; dlo_fn.runtime.blocks)
    async_collectives: bool = False  # CPU/gloo: overlap all-gathers with compute
    record_timeline: bool = False
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES
    progress: bool = False
    # CUDA graphs: "block" replays each block's compute as a CUDA graph while the copies, waits and records stay
    # the eager loop's (dlo_fn.runtime.cuda.block_graph); a plug-in, eager where unsupported (logged once).
    graph: bool | str = False
    # The input shapes (per request slot) whose graphs are kept; a new one beyond drops the least recently used
    # shape's graphs and buffers, so serving many resolutions keeps device memory bounded.
    graph_shapes: int = 4
    # Loads that move as one (dlo_fn.plan.lowering, "Load groups"): G consecutive blocks' H2D with one wait and one
    # record, their all-gathers as one collective (W > 1), and their computes with one wait and one record, so
    # small blocks cost the host the stream operations of one load per G blocks. Needs num_slots a multiple of G
    # and >= 2G and, in allgather mode over W > 1 ranks, num_landing a multiple of G (default 2G). There, where G
    # divides the number of blocks, the shards are laid out per group (dlo_fn.plan.layout, "Grouped shard
    # layout"): one all-gather per group instead of G; else one per block, in one coalesced launch.
    load_group: int = 1
    shard_group: str = "world"  # allgather: "world" | "dp" | "sp" of the mesh (dlo_fn.runtime.mesh)
    # Host budget (dlo_fn.cost.host_budget): pin the leading blocks whose shards fit in this many bytes and
    # stream the rest from the checkpoint mapping (pageable H2D); None pins every shard.
    pinned_budget_bytes: int | None = None
    # Quantised shards (dlo_fn.plan.quant): "fp8" stores and moves every >= 2-D floating block weight as FP8,
    # dequantised on the device; Quantization("fp8", exclude=(...)) keeps the named modules as they are too. Held as
    # a Quantization (or None).
    quantization: str | Quantization | None = None
    # The dequantise op: "torch" (torch ops: a cast and a multiply per tensor), "kernel" (one Triton launch per
    # block, the CUDA plug-in dlo_fn.runtime.cuda.dequant), "auto" (the kernel where CUDA and Triton are there).
    dequant: str = "auto"
    # How the host arena is filled at start-up (HOST_FILLS).
    host_fill: str = "auto"
    # HBM budget (dlo_fn.plan.resident): device weight bytes (int, or a size such as "16GB" / "12GiB") within which
    # as many blocks as fit stay resident, spread through the forward, and the rest stream; None streams every block.
    hbm_budget: int | None = None

    def __post_init__(self) -> None:
        check_mode(self.mode)
        if self.hbm_budget is not None:
            from dlo_fn.plan.sizes import parse_bytes  # only with a budget: the README's API stays lean

            try:
                object.__setattr__(self, "hbm_budget", parse_bytes(self.hbm_budget))
            except ValueError as e:
                raise ValueError(f"hbm_budget: {e}") from None
        check_shard_group(self.shard_group)
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.rank_local_source not in ("pinned", "mmap"):
            raise ValueError(f"rank_local_source must be 'pinned' or 'mmap', got {self.rank_local_source!r}")
        if self.block_call not in CALLS:
            raise ValueError(f"block_call must be one of {', '.join(CALLS)}; got {self.block_call!r}")
        if self.graph not in GRAPHS or self.graph is True:
            raise ValueError(
                f"graph must be False or 'block' (each block's compute replayed as a CUDA graph, the "
                f"copies eager); got {self.graph!r}"
            )
        if self.graph_shapes < 1:
            raise ValueError(f"graph_shapes must be >= 1, got {self.graph_shapes}")
        if self.host_fill not in HOST_FILLS:
            raise ValueError(f"host_fill must be one of {', '.join(map(repr, HOST_FILLS))}; got {self.host_fill!r}")
        object.__setattr__(self, "quantization", as_quantization(self.quantization))
        if self.dequant not in ("auto", "torch", "kernel"):
            raise ValueError(f"dequant must be 'auto', 'torch' or 'kernel'; got {self.dequant!r}")
        # The group's own rules and the slots it needs (the mode is checked by the ring: allgather over one rank
        # is the rank-local sequence, known only with the shard group).
        check_load_group(self.load_group, self.num_slots, "rank-local", quantized=self.quantization is not None)
        if self.quantization is not None and self.rank_local_source == "mmap":
            raise ValueError(
                "rank_local_source='mmap' streams the checkpoint's own bytes: quantised shards need the "
                "pinned source (the default)"
            )
        if self.pinned_budget_bytes is not None and self.pinned_budget_bytes < 0:
            raise ValueError(f"pinned_budget_bytes must be >= 0, got {self.pinned_budget_bytes}")

    def describe(self) -> tuple[tuple[str, str], ...]:
        """The execution choices as (key, value) strings: for a Timeline's metadata and benchmark records."""
        return (
            ("block_call", self.block_call),
            ("graph", str(self.graph or "none")),
            ("load_group", str(self.load_group)),
            ("async_collectives", str(self.async_collectives)),
            ("quantization", str(self.quantization or "none")),
        )
