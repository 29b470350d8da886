"""Start-up measurements of the machine for ``auto`` options (what and how: :mod:`dlo_fn.cost.auto`): pinned H2D of
block 0's bytes, its all-gather over the group (else a device copy), an all-to-all (``W > 1``, 64 MiB a rank at
most), the host's issue cost per block, the memories; each the best of ``reps`` around syncs, seconds in all.
:func:`dlo_fn.serve.probe.probe` adds what the reference DiT's engine does with a request.
"""

from __future__ import annotations

import os
import time

import torch

from dlo_fn.cost.auto import LinkRates
from dlo_fn.runtime.dist import DistContext, all_gather_bytes

__all__ = ["best_s", "flat_block", "probe_links", "device_copy_rate", "busy_h2d_rate"]

A2A_CAP_BYTES = 64 << 20  # per rank: bounds the probe's all-to-all on a long video


def best_s(fn, platform, reps: int) -> float:
    fn()
    platform.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        platform.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def flat_block(block: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).view(torch.uint8).cpu() for t in block.state_dict().values()])


def device_copy_rate(flat: torch.Tensor, platform, reps: int = 3) -> float:
    """Bytes/s of copying ``flat``'s bytes within the device (each byte counted once: it is read and written)."""
    src = flat.to(platform.device)
    dst = torch.empty_like(src)
    return src.numel() / best_s(lambda: dst.copy_(src), platform, reps)


def busy_h2d_rate(flat: torch.Tensor, platform, reps: int = 3) -> float:
    """Bytes/s of the pinned H2D of ``flat`` while the device computes (square matmuls queued on another stream
    for about twice the copy): the link a streamed load gets beside a block's compute, which a plan balancing
    the two runs at. Off accelerators (no copy beside compute): the copy alone."""
    dev = platform.device
    staged = flat.pin_memory() if platform.supports_pinned else flat
    dst = torch.empty_like(flat, device=dev)
    copy_s = best_s(lambda: dst.copy_(staged, non_blocking=True), platform, reps)
    if not platform.is_accelerator:
        return flat.numel() / copy_s
    a = torch.ones(4096, 4096, dtype=torch.bfloat16, device=dev)
    matmuls = int(2 * copy_s / best_s(lambda: a @ a, platform, reps)) + 1
    side, best = platform.new_stream("probe"), float("inf")
    for _ in range(reps):
        with platform.use_stream(side):
            for _ in range(matmuls):
                a @ a
        start, end = platform.new_event(timing=True), platform.new_event(timing=True)
        start.record()
        dst.copy_(staged, non_blocking=True)
        end.record()
        platform.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return flat.numel() / best


def probe_links(
    flat: torch.Tensor, ctx: DistContext, *, reps: int = 3, a2a_elements: int = 0, dtype: torch.dtype = torch.bfloat16
) -> LinkRates:
    """The machine's links for block bytes ``flat`` (module docstring); the all-to-all of ``a2a_elements``
    elements of ``dtype`` (0: not measured). Every rank of ``ctx`` calls it (collectives at ``W > 1``)."""
    platform, dev, w = ctx.platform, ctx.platform.device, ctx.world_size
    staged = flat.pin_memory() if platform.supports_pinned else flat
    dst = torch.empty_like(flat, device=dev)
    h2d = flat.numel() / best_s(lambda: dst.copy_(staged, non_blocking=True), platform, reps)
    many = ctx.group is not None and w > 1
    if many:
        shard = -(-flat.numel() // w)
        gathered = torch.empty(shard * w, dtype=torch.uint8, device=dev)
        mine = gathered[ctx.rank * shard : (ctx.rank + 1) * shard].clone()
        bus = d2d = (w - 1) * shard / best_s(lambda: all_gather_bytes(gathered, mine, ctx.group), platform, reps)

        def tail():
            return all_gather_bytes(
                gathered[: w * 4096],
                gathered[ctx.rank * 4096 : (ctx.rank + 1) * 4096],
                ctx.group,
            )
    else:
        other = torch.empty_like(dst)
        bus = d2d = flat.numel() / best_s(lambda: other.copy_(dst), platform, reps)
        n2 = max(1, min(1 << 20, flat.numel() // 2))

        def tail():
            return dst[n2 : 2 * n2].copy_(dst[:n2])

    small, stream = staged[: max(1, min(1 << 20, flat.numel() // 2))], platform.current_stream()

    def issue(extra=None):  # a small copy + event record + wait, and the collective's (or copy's) issue
        t0 = time.perf_counter()
        for _ in range(16):
            dst[: small.numel()].copy_(small, non_blocking=True)
            if extra is not None:
                extra()
            event = platform.new_event()
            event.record(stream)
            stream.wait_event(event)
        return (time.perf_counter() - t0) / 16

    platform.synchronize()
    host_rl, host_ag = min(issue() for _ in range(reps)), min(issue(tail) for _ in range(reps))
    platform.synchronize()
    a2a = None
    if many and a2a_elements:
        n = max(w, min(-(-a2a_elements // w), A2A_CAP_BYTES // dtype.itemsize) // w * w)  # this rank's part, sp = W
        send = torch.ones(n, dtype=dtype, device=dev)
        recv = torch.empty_like(send)
        seconds = best_s(lambda: torch.distributed.all_to_all_single(recv, send, group=ctx.group), platform, reps)
        a2a = n * dtype.itemsize * (w - 1) / w / seconds
    local = int(os.environ.get("LOCAL_WORLD_SIZE", w))  # torchrun's; run_ranks sets the world
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    hbm = int(getattr(torch, platform.kind).mem_get_info(dev)[1]) if platform.is_accelerator else host
    return LinkRates(h2d, bus, d2d, (("allgather", host_ag), ("rank-local", host_rl)), hbm, host // max(local, 1), a2a)
