"""The executor's device buffers for weights: ``S`` slots and ``N`` landing buffers, one allocation each.

A slot holds one gathered block (``ModelLayout.slot_bytes``), a landing buffer one local shard
(``max_shard_bytes``), so device weight bytes are ``S x slot + N x max_shard`` whatever the depth. With quantised
shards (:mod:`dlo_fn.plan.quant`) each slot also has a staging buffer of the largest stored block
(``max_padded_block_bytes``), where its load lands before the dequantise op writes the slot.
Slot ``s`` starts at ``s x`` the slot size, so a load group's copies into consecutive slots can be one; in a grouped
layout (:mod:`dlo_fn.plan.layout`) member ``g`` of a group's ``G`` consecutive slots lies ``g`` times the group's
stride from the first of them, where one all-gather of the group writes it (:meth:`SlotBuffers.slot_span`).
"""

from __future__ import annotations

import torch

from dlo_fn.plan.layout import ModelLayout
from dlo_fn.runtime.platform import Platform

__all__ = ["SlotBuffers"]


class SlotBuffers:
    """``num_slots`` slots and ``num_landing`` landing buffers for ``layout`` on ``platform``'s device."""

    def __init__(self, platform: Platform, layout: ModelLayout, num_slots: int, num_landing: int) -> None:
        self.layout = layout
        before = platform.memory_allocated()
        slot, landing, staging = layout.slot_bytes, layout.max_shard_bytes, layout.max_padded_block_bytes
        num_staging = num_slots if layout.quantized else 0
        new = lambda n: torch.empty(n, dtype=torch.uint8, device=platform.device)  # noqa: E731
        self._slots, self._landing, self._staging = (
            new(num_slots * slot),
            new(num_landing * landing),
            new(num_staging * staging),
        )
        self.slots = tuple(self._slots[s * slot : (s + 1) * slot] for s in range(num_slots))
        self.landing = tuple(self._landing[n * landing : (n + 1) * landing] for n in range(num_landing))
        self.staging = tuple(self._staging[s * staging : (s + 1) * staging] for s in range(num_staging))
        self.measured_device_bytes = platform.memory_allocated() - before
        self.planned_device_bytes = num_slots * slot + num_landing * landing + num_staging * staging

    @property
    def device_bytes(self) -> int:
        """Bytes of the slots and landing buffers (their storages): the executor's whole weight footprint."""
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in self.slots + self.landing + self.staging
        }
        return sum(storages.values())

    def slot_span(self, block: int, slot: int) -> torch.Tensor:
        """The bytes of ``slot`` that ``block`` occupies there (see the module doc)."""
        size = (
            self.layout.compute_block(block).nbytes if self.layout.quantized else self.layout.shards[block].padded_bytes
        )
        return self._span(self._slots, self.layout.slot_bytes, slot, size)

    def staging_span(self, block: int, slot: int) -> torch.Tensor:
        """The bytes of ``slot``'s staging buffer that ``block``'s stored bytes (gathered) land in."""
        return self.staging[slot][: self.layout.shards[block].padded_bytes]

    def landing_span(self, block: int, landing: int) -> torch.Tensor:
        """The bytes of landing buffer ``landing`` that ``block``'s shard lands in (as :meth:`slot_span`)."""
        return self._span(self._landing, self.layout.max_shard_bytes, landing, self.layout.shards[block].shard_bytes)

    def _span(self, buffer: torch.Tensor, unit: int, index: int, size: int) -> torch.Tensor:
        g = self.layout.load_group
        start = (index - index % g) * unit + (index % g) * size
        return buffer[start : start + size]

    def release(self) -> None:
        """Drop the buffers (their memory goes once nothing else points into them)."""
        self._slots = self._landing = self._staging = None
        self.slots, self.landing, self.staging = (), (), ()
