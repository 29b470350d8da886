"""Resident blocks under an HBM budget: which blocks stay on the device, and what the device then holds.

Streaming every block makes a link-bound model pay ``bytes / link`` per pass even where the card could hold most
of it. With a set ``R`` of blocks kept resident (whole on every rank, in the compute dtype) and the rest streamed
through the ring, a pass takes at least

    max(sum_b compute_b, sum_{b not in R} h2d_b / link)

so a budget buys resident speed once the streamed bytes hide under the compute.

**Where the resident blocks go.** A streamed load into a ring of ``S = 2`` slots starts when the slot's previous
block has computed and must end before its own block computes, so it hides under the compute of the blocks
between two streamed blocks; the ring cannot bank the slack of one gap for the next. So every streamed block
needs, before it, compute in proportion to its bytes. Taking a block's bytes as the measure of its compute (the
plan knows no more), a streamed fraction ``f`` of the bytes is spread by credit: walking the blocks in forward
order, each adds ``f n_b`` to the credit, and block ``b`` streams where the credit covers its ``n_b`` bytes (which
it then spends), else stays resident. A streamed block so follows about ``n_b / f`` bytes of forward since the
last one, and the pass opens with resident blocks. Examples (``f = m / 8``; blocks of bytes ``2 1 1 2 1 1`` at
``f = 1/2``: the large blocks stay resident, their loads would be the hardest to hide)::

    equal blocks, m = 2   R R R S R R R S
    equal blocks, m = 4   R S R S R S R S
    equal blocks, m = 6   R S S S R S S S
    2 1 1 2 1 1, m = 4    R S S R S S

**The plan.** :func:`with_resident` moves the resident blocks' tensors into the spec's resident tensors (named
``<block>.<tensor>``), so the layout, the ring, the schedule and the timeline are those of the streamed blocks
only (the ring is shorter; lowering never sees a resident block's load), and ``total_bytes`` is unchanged.

**Device weight bytes** of a plan (what ``Offloaded.device_weight_bytes`` reports; :func:`device_weight_bytes`)::

    S x slot + N x landing + S_q x staging  +  resident bytes (non-block tensors + resident blocks)

with ``S_q = S`` for quantised shards (else 0); every block resident is ``total_bytes`` and no ring at all.
:func:`frontier` lists every such plan, device bytes against streamed bytes; :func:`choose_resident` takes the one
that streams the least within the budget; the two-slot minimum (nothing resident) is the least a budget may be.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from dlo_fn.plan.layout import DEFAULT_ALIGNMENT_BYTES, ModelLayout, layout_load_group, model_layout
from dlo_fn.plan.lowering import default_num_landing, lowered_mode
from dlo_fn.plan.spec import ModelSpec, TensorSpec

__all__ = [
    "spread_resident",
    "with_resident",
    "buffer_bytes",
    "device_weight_bytes",
    "layout_for",
    "ring_num_landing",
    "ResidentChoice",
    "frontier",
    "choose_resident",
    "BudgetError",
]


class BudgetError(ValueError):
    """An HBM budget below the least a plan can hold (the message names the minimum)."""


def spread_resident(block_bytes: tuple[int, ...], streamed: int, steps: int) -> tuple[int, ...]:
    """The blocks kept on the device when a fraction ``f = streamed / steps`` of the bytes streams, by credit
    (module docstring; integers, so a plan is the same on every rank)."""
    if not block_bytes or any(n < 1 for n in block_bytes):
        raise ValueError(f"block_bytes must be positive sizes, one per block, got {block_bytes!r}")
    if not isinstance(steps, int) or steps < 1 or not isinstance(streamed, int) or not 0 <= streamed <= steps:
        raise ValueError(f"the streamed fraction must be m / steps with 0 <= m <= steps, got {streamed!r}/{steps!r}")
    credit, keep = 0, []
    for b, n in enumerate(block_bytes):
        credit += streamed * n  # in units of 1 / steps bytes
        if credit >= steps * n:
            credit -= steps * n
        else:
            keep.append(b)
    return tuple(keep)


def with_resident(spec: ModelSpec, resident: tuple[int, ...]) -> ModelSpec:
    """``spec`` with blocks ``resident`` moved into its resident tensors: the spec of the streamed blocks."""
    keep = set(resident)
    if not keep <= set(range(spec.num_blocks)):
        raise ValueError(f"resident blocks {sorted(keep)} outside [0, {spec.num_blocks})")
    if len(keep) == spec.num_blocks:
        raise ValueError("every block resident leaves nothing to stream: run the model resident")
    moved = tuple(
        TensorSpec(f"{b.name}.{t.name}", t.shape, t.dtype, t.kind)
        for i, b in enumerate(spec.blocks)
        if i in keep
        for t in b.tensors
    )
    blocks = tuple(b for i, b in enumerate(spec.blocks) if i not in keep)
    return replace(spec, blocks=blocks, resident=spec.resident + moved)


def buffer_bytes(layout: ModelLayout, num_slots: int, num_landing: int) -> int:
    """The ring's device buffers: ``S x slot + N x landing (+ S x staging for quantised shards)``."""
    staging = num_slots * layout.max_padded_block_bytes if layout.quantized else 0
    return num_slots * layout.slot_bytes + num_landing * layout.max_shard_bytes + staging


def device_weight_bytes(spec: ModelSpec, layout: ModelLayout | None, num_slots: int, num_landing: int) -> int:
    """Weights on the device: the ring's buffers for ``layout`` (of ``spec``'s streamed blocks; None: no ring,
    every block resident) plus ``spec``'s resident tensors (its non-block tensors and its resident blocks)."""
    if layout is None:
        return spec.total_bytes
    return buffer_bytes(layout, num_slots, num_landing) + spec.resident_bytes


def layout_for(
    spec: ModelSpec,
    num_shards: int,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    load_group: int = 1,
    quantization: str | None = None,
    exclude: tuple[str, ...] = (),
) -> ModelLayout:
    """The layout ``offload`` builds for ``spec``'s blocks on a shard group of ``num_shards`` ranks."""
    group = layout_load_group(spec.num_blocks, num_shards, load_group)
    return model_layout(spec, num_shards, alignment_bytes, group, quantization, exclude)


def ring_num_landing(mode: str, num_shards: int, num_landing: int | None, load_group: int = 1) -> int:
    """The landing buffers the ring holds: none where ``mode`` lowers to rank-local, else ``num_landing`` (None:
    the default, two per load group)."""
    if lowered_mode(mode, num_shards) == "rank-local":
        return 0
    return num_landing if num_landing is not None else default_num_landing(load_group)


@dataclass(frozen=True, slots=True)
class ResidentChoice:
    """The blocks kept resident for a budget, the device weight bytes of that plan, and the bytes one pass moves
    to each rank (its streamed shards; FP8: as stored)."""

    resident: tuple[int, ...]
    device_weight_bytes: int
    h2d_bytes_per_pass: int

    def to_dict(self) -> dict:
        return {
            "resident_blocks": list(self.resident),
            "num_resident": len(self.resident),
            "device_weight_bytes": self.device_weight_bytes,
            "h2d_bytes_per_pass": self.h2d_bytes_per_pass,
        }


def frontier(
    spec: ModelSpec, layout_of: Callable[[ModelSpec], ModelLayout], num_slots: int, num_landing: int
) -> tuple[ResidentChoice, ...]:
    """Every plan :func:`choose_resident` can pick, from the most streamed (the ring alone) to the whole model
    resident: device weight bytes against the bytes a pass streams, each plan holding more and streaming less than
    the one before (with the link and the compute, the time/HBM frontier: ``max(compute, h2d_bytes_per_pass /
    link)``)."""
    steps, seen, out = 4 * spec.num_blocks, set(), []
    for m in range(steps, 0, -1):
        resident = spread_resident(spec.block_bytes, m, steps)
        if len(resident) == spec.num_blocks or resident in seen:
            continue
        seen.add(resident)
        streamed = with_resident(spec, resident)
        layout = layout_of(streamed)
        choice = ResidentChoice(
            resident, device_weight_bytes(streamed, layout, num_slots, num_landing), layout.shard_bytes_per_rank
        )
        if not out or choice.h2d_bytes_per_pass < out[-1].h2d_bytes_per_pass:
            out.append(choice)
    kept = [ResidentChoice(tuple(range(spec.num_blocks)), spec.total_bytes, 0)]
    for choice in reversed(out):  # a plan that holds as much as one streaming less is no choice
        if choice.device_weight_bytes < kept[-1].device_weight_bytes:
            kept.append(choice)
    return tuple(reversed(kept))


def choose_resident(
    spec: ModelSpec,
    budget_bytes: int,
    layout_of: Callable[[ModelSpec], ModelLayout],
    num_slots: int,
    num_landing: int,
    owner: str = "hbm_budget",
) -> ResidentChoice:
    """The plan of the :func:`frontier` that streams the least within ``budget_bytes`` of device weight bytes
    (``layout_of`` lays out a streamed spec as the runtime will): everything resident where the whole model fits;
    :class:`BudgetError` naming the minimum (nothing resident, the ring alone) below it."""
    if budget_bytes >= spec.total_bytes:
        return ResidentChoice(tuple(range(spec.num_blocks)), spec.total_bytes, 0)
    plans = frontier(spec, layout_of, num_slots, num_landing)
    fits = [p for p in plans if p.device_weight_bytes <= budget_bytes]
    if not fits:
        need = plans[0].device_weight_bytes
        raise BudgetError(
            f"{owner} = {budget_bytes} bytes is below the {need} bytes of device weights the ring of {num_slots} "
            f"slots needs with every block streamed (and the non-block weights resident): pass at least {need}"
        )
    return min(fits, key=lambda p: p.h2d_bytes_per_pass)
