"""An HBM budget in the cost models: the blocks a plan keeps resident (the runtime's own choice,
:func:`dlo_fn.plan.resident.choose_resident`) and the :class:`~dlo_fn.plan.sizes.ModelSizes` of what it streams,
which the memory and time models then take as they take any model.

The cost models know a model by its sizes (each block's packed bytes, with FP8 its stored bytes too), not by its
tensors. To run the plan's choice on them, the sizes stand in for a spec: block ``b`` becomes one tensor of ``t_b``
bytes, the bytes the resident model holds for it (``ModelSpec.block_bytes``, unpacked: ``tensor_block_bytes``; the
packed ``n_b`` where they are not known), and the layout of any streamed subset is built from the packed (and
stored) sizes, one tensor per block (:func:`sizes_layout`). A layout's shard, slot, landing and staging bytes depend
on those sizes only, so the choice and its device bytes are the runtime's to the byte, at O(blocks) per plan.

With resident set ``K`` (whole on every rank, in the compute dtype, in allgather mode too)::

    streamed sizes   the blocks not in K, whose resident bytes are R + sum_{b in K} t_b
    HBM weights      the ring of the streamed sizes (S slots, L landing, with FP8 S staging) + R + sum_{b in K} t_b
                     + the device-stored shards
    pinned host      the streamed blocks' shards only (FP8: as stored), less the device-stored ones

Device-stored shards (``device_link``, the device's copy rate: the plan's third tier, where a streamed block's stored
shard holds less than the block resident) are streamed blocks whose shards this rank keeps on the device; their
loads copy from there (:attr:`ResidentPlan.stored`, numbered among the streamed blocks).

Where the budget holds the whole model every block is resident: no ring, nothing pinned, HBM = the model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dlo_fn.plan.layout import (
    DEFAULT_ALIGNMENT_BYTES,
    BlockLayout,
    ModelLayout,
    block_layout,
    shard_layout,
)
from dlo_fn.plan.resident import ResidentChoice, choose_resident, frontier, layout_for, ring_num_landing
from dlo_fn.plan.sizes import ModelSizes
from dlo_fn.plan.spec import BlockSpec, ModelSpec, TensorSpec

__all__ = ["ResidentPlan", "sizes_spec", "sizes_layout", "streamed_sizes", "resident_plan", "format_size"]


def format_size(nbytes: int) -> str:
    """``15.87 GB``, ``648.03 kB`` (decimal units): budgets from a test model's to a card's in one form."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True, slots=True)
class ResidentPlan:
    """The resident blocks for a budget (``choice``), the sizes the ring streams (None: every block resident), the
    bytes the resident blocks hold, the plans of the frontier that hold more (what a larger budget buys), and the
    device-stored blocks with their bytes (module docstring)."""

    budget_bytes: int
    choice: ResidentChoice
    num_blocks: int
    streamed: ModelSizes | None
    resident_block_bytes: int
    larger: tuple[ResidentChoice, ...]
    stored: frozenset[int] = frozenset()  # device-stored blocks, numbered among the streamed ones (the ring's)
    stored_bytes: int = 0  # their shards' bytes on each rank: device bytes, not pinned

    @property
    def resident(self) -> tuple[int, ...]:
        return self.choice.resident

    def to_dict(self) -> dict:
        return {
            "budget_bytes": self.budget_bytes,
            **self.choice.to_dict(),
            "resident_block_bytes": self.resident_block_bytes,
            "larger_budgets": [p.to_dict() for p in self.larger],
        }


def sizes_spec(sizes: ModelSizes, tensor_block_bytes: tuple[int, ...] = ()) -> ModelSpec:
    """``sizes`` as a spec of one uint8 tensor per block (named by its index) of ``t_b`` bytes (module docstring)."""
    held = tensor_block_bytes or sizes.block_bytes
    if len(held) != sizes.num_blocks:
        raise ValueError(f"tensor_block_bytes: one entry per block of {sizes.name!r}, got {len(held)}")
    blocks = tuple(BlockSpec(str(b), (TensorSpec("w", (n,), torch.uint8),)) for b, n in enumerate(held))
    resident = (TensorSpec("resident", (sizes.resident_bytes,), torch.uint8),) if sizes.resident_bytes else ()
    return ModelSpec(sizes.name, blocks, resident)


@functools.lru_cache(maxsize=4096)
def _flat(nbytes: int, alignment_bytes: int) -> BlockLayout:
    return block_layout(BlockSpec(f"{nbytes}B", (TensorSpec("w", (nbytes,), torch.uint8),)), alignment_bytes)


@functools.lru_cache(maxsize=4096)
def _shard(nbytes: int, num_shards: int, alignment_bytes: int):
    return shard_layout(_flat(nbytes, alignment_bytes), num_shards)


def sizes_layout(
    sizes: ModelSizes, num_shards: int, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES, load_group: int = 1
) -> ModelLayout:
    """The layout ``offload`` builds for blocks of these sizes (one tensor each: the same shard, slot, landing and
    staging bytes as the real tensors' layout); quantised sizes shard the stored blocks and slot the computed ones."""
    if sizes.quantized:
        shards = tuple(_shard(n, num_shards, alignment_bytes) for n in sizes.stored_block_bytes)
        compute = tuple(_flat(n, alignment_bytes) for n in sizes.block_bytes)
        return ModelLayout(sizes.name, shards, num_shards, alignment_bytes, 1, compute)
    if load_group == 1:
        shards = tuple(_shard(n, num_shards, alignment_bytes) for n in sizes.block_bytes)
        return ModelLayout(sizes.name, shards, num_shards, alignment_bytes)
    return layout_for(sizes_spec(sizes), num_shards, alignment_bytes, load_group)  # grouped: the plan's own code


def streamed_sizes(
    sizes: ModelSizes, resident: tuple[int, ...], tensor_block_bytes: tuple[int, ...] = ()
) -> ModelSizes | None:
    """The sizes of the blocks not in ``resident``, the resident blocks' ``t_b`` added to the resident bytes
    (None: every block resident)."""
    keep = set(resident)
    if len(keep) == sizes.num_blocks:
        return None
    held = tensor_block_bytes or sizes.block_bytes
    left = [b for b in range(sizes.num_blocks) if b not in keep]
    return ModelSizes(
        sizes.name,
        tuple(sizes.block_bytes[b] for b in left),
        sizes.resident_bytes + sum(held[b] for b in keep),
        sizes.source,
        tuple(sizes.stored_block_bytes[b] for b in left) if sizes.quantized else (),
    )


@functools.lru_cache(maxsize=256)
def resident_plan(
    sizes: ModelSizes,
    budget_bytes: int,
    *,
    num_shards: int,
    mode: str,
    num_slots: int = 2,
    num_landing: int | None = None,
    load_group: int = 1,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    tensor_block_bytes: tuple[int, ...] = (),
    owner: str = "hbm_budget",
    larger: bool = True,
    compute: tuple[float, ...] | None = None,
    link: float | None = None,
    device_link: float | None = None,
) -> ResidentPlan:
    """What ``offload(..., hbm_budget=budget_bytes)`` keeps resident for a model of these sizes on a shard group of
    ``num_shards`` ranks in ``mode`` with ``num_slots`` slots (``num_landing`` None: the ring's default), and
    (``larger``) the plans a larger budget buys. ``compute`` (seconds per block, in block order) and ``link``
    (bytes/s of a load): placed by compute, the predicted fastest plan (:func:`~dlo_fn.plan.resident.frontier`);
    without them, by bytes; ``device_link`` (bytes/s of a device copy): the dequantise priced and, where stored shards
    hold less than resident blocks, device-stored shards. :class:`~dlo_fn.plan.resident.BudgetError` (one line
    naming the minimum) below the ring of every block streamed. Cached (sequences as tuples): a policy asks for the
    same plan for many rows."""
    spec = sizes_spec(sizes, tensor_block_bytes)
    index = {b.name: int(b.name) for b in spec.blocks}
    ring = (num_slots, ring_num_landing(mode, num_shards, num_landing, load_group))
    w = num_shards if mode == "allgather" else 1

    @functools.cache
    def layout(kept: tuple[int, ...]) -> ModelLayout:
        return sizes_layout(streamed_sizes(sizes, kept, tensor_block_bytes), w, alignment_bytes, load_group)

    def layout_of(streamed: ModelSpec) -> ModelLayout:
        left = {index[b.name] for b in streamed.blocks}
        return layout(tuple(b for b in range(sizes.num_blocks) if b not in left))

    by = {"compute": compute, "link": link} | ({"device_link": device_link} if device_link else {})
    choice = choose_resident(spec, budget_bytes, layout_of, *ring, owner=owner, **by)
    more = ()
    if larger and choice.h2d_bytes_per_pass:  # the frontier holds more at each plan, and streams less or runs faster
        more = tuple(
            p for p in frontier(spec, layout_of, *ring, **by) if p.device_weight_bytes > choice.device_weight_bytes
        )
    held = tensor_block_bytes or sizes.block_bytes
    streamed = [b for b in range(sizes.num_blocks) if b not in set(choice.resident)]
    stored = frozenset(streamed.index(b) for b in choice.device_stored)
    shards = layout(choice.resident).shards if stored else ()
    return ResidentPlan(
        budget_bytes,
        choice,
        sizes.num_blocks,
        streamed_sizes(sizes, choice.resident, tensor_block_bytes),
        sum(held[b] for b in choice.resident),
        more,
        stored,
        sum(shards[j].shard_bytes for j in stored),
    )
