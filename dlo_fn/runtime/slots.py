"""The executor's device buffers for weights: ``S`` slots and ``N`` landing buffers, one allocation each.

A slot holds one gathered block (``ModelLayout.slot_bytes``), a landing buffer one local shard
(``max_shard_bytes``), so device weight bytes are ``S x slot + N x max_shard`` whatever the depth. With quantised
shards (:mod:`dlo_fn.plan.quant`) each slot also has a staging buffer of the largest stored block
(``max_padded_block_bytes``), where its load lands before the dequantise op writes the slot.
Slot ``s`` starts at ``s x`` the slot size, so a load group's copies into consecutive slots can be one; in a grouped
layout (:mod:`dlo_fn.plan.layout`) member ``g`` of a group's ``G`` consecutive slots lies ``g`` times the group's
stride from the first of them, where one all-gather of the group writes it (:meth:`SlotBuffers.slot_span`).

**The warm-up all-gather** (allgather mode, W > 1): one all-gather of block 0's shard from landing buffer 0 into
slot 0 before the first run, so a device backend creates its communicator (NCCL / HCCL do it lazily, with
allocations) and gloo over device tensors allocates its host staging, outside the first step. It moves a whole
shard (gloo: through host memory), so ``offload`` starts it asynchronously before it fills the host store
(:func:`start_warm_gather`) and waits for it once the store is full: the collective overlaps the fill instead of
following it. What that saves depends on the cores the fill leaves free: 2 gloo ranks on a 2-core CPU host (a
2.9 GB Flux-shaped checkpoint) took 6-7 s for it after the fill and about as long in all beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dlo_fn.plan.layout import ModelLayout
from dlo_fn.runtime.dist import all_gather_bytes
from dlo_fn.runtime.platform import Platform

__all__ = ["SlotBuffers", "WarmGather", "start_warm_gather"]


class SlotBuffers:
    """``num_slots`` slots and ``num_landing`` landing buffers for ``layout`` on ``platform``'s device."""

    def __init__(self, platform: Platform, layout: ModelLayout, num_slots: int, num_landing: int) -> None:
        self.layout = layout
        before = platform.memory_allocated()
        slot, landing, staging = layout.slot_bytes, layout.max_shard_bytes, layout.max_padded_block_bytes
        num_staging = num_slots if layout.quantized else 0
        new = lambda n: torch.empty(n, dtype=torch.uint8, device=platform.device)  # noqa: E731
        self._slots, self._landing, self._staging = new(num_slots * slot), new(num_landing * landing), new(
            num_staging * staging)
        self.slots = tuple(self._slots[s * slot : (s + 1) * slot] for s in range(num_slots))
        self.landing = tuple(self._landing[n * landing : (n + 1) * landing] for n in range(num_landing))
        self.staging = tuple(self._staging[s * staging : (s + 1) * staging] for s in range(num_staging))
        self.measured_device_bytes = platform.memory_allocated() - before
        self.planned_device_bytes = num_slots * slot + num_landing * landing + num_staging * staging

    @property
    def device_bytes(self) -> int:
        """Bytes of the slots and landing buffers (their storages): the executor's whole weight footprint."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in self.slots + self.landing + self.staging}
        return sum(storages.values())

    def slot_span(self, block: int, slot: int) -> torch.Tensor:
        """The bytes of ``slot`` that ``block`` occupies there (see the module doc)."""
        size = (self.layout.compute_block(block).nbytes if self.layout.quantized else
                self.layout.shards[block].padded_bytes)
        return self._span(self._slots, self.layout.slot_bytes, slot, size)

    def staging_span(self, block: int, slot: int) -> torch.Tensor:
        """The bytes of ``slot``'s staging buffer that ``block``'s stored bytes (gathered) land in."""
        return self.staging[slot][: self.layout.shards[block].padded_bytes]

    def dequantize(self, block: int, slot: int, dequantizer: Any) -> Callable[[], None]:
        """The call of ``block``'s dequantise op, from its slot's staging buffer into the slot
        (``dequantizer.prepare``: :class:`~dlo_fn.runtime.quant.TorchDequant`, or a plug-in's)."""
        return dequantizer.prepare(self.staging_span(block, slot), self.slot_span(block, slot),
                                   self.layout.shards[block].block, self.layout.compute_block(block))

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


@dataclass(frozen=True)
class WarmGather:
    """The warm-up all-gather (module doc) in flight on ``buffers``: :meth:`wait` ends it and returns the seconds
    the caller waited (0 when it ended during the work that overlapped it)."""

    buffers: SlotBuffers
    work: Any
    platform: Platform
    started_s: float  # time.perf_counter() when it was issued

    def wait(self) -> float:
        t0 = time.perf_counter()
        if self.work is not None:
            self.work.wait()  # a device: the current stream waits for it; the host, below
        self.platform.synchronize()
        return time.perf_counter() - t0


def start_warm_gather(platform: Platform, buffers: SlotBuffers, group: Any, *, async_op: bool = True) -> WarmGather:
    """Issue the warm-up all-gather of ``buffers.layout``'s block 0 over ``group`` (every rank of the shard group
    calls it, in the same order as every other collective); ``async_op=False`` waits for it here."""
    layout = buffers.layout
    n = layout.shards[0].shard_bytes
    t0 = time.perf_counter()
    work = all_gather_bytes(buffers.slots[0][: n * layout.num_shards], buffers.landing[0][:n], group,
                            async_op=async_op)
    return WarmGather(buffers, work if async_op else None, platform, t0)
