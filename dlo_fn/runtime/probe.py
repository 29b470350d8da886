"""Start-up measurements for ``--mode auto`` / ``--slots auto``: what the policy (:mod:`dlo_fn.plan.policy`) needs,
measured on this machine in bounded time (a few seconds), before the model is offloaded.

=======================  ==========================================================================================
measured                 how (each the best of ``reps`` after one warm-up, host clock around a device sync)
=======================  ==========================================================================================
``h2d_bytes_per_s``      H2D copies of block 0's real bytes from a pinned staging buffer (pageable on CPU)
``allgather / d2d``      one all-gather of block 0's shards over the group (``W > 1``), else a device copy of it
``all_to_all``           (``W > 1``) one ``all_to_all_single`` over the group of an activation-sized tensor: the
                         request's ``g L`` tokens x hidden in the model's dtype, split over the ``W`` ranks as Ulysses
                         at ``sp = W`` splits it (each rank's part capped at 64 MiB, so the time is bounded); bytes/s
                         one rank sends, ``(W - 1) / W`` of its part over the time
``block_compute_s``      block 0 on the device on a real input: the request's latents through ``embed``
``step_overhead_s``      the per-step work outside the blocks as the engine runs it (``serve.batch.run_batch``:
                         sampler inputs, ``embed`` on the request's text encoded once, ``head``, sampler update)
``request_s``            the per-request host work outside the ring: ``init_state`` (noise, text tokens in) and
                         ``finish`` (latents out, decode, hash)
``activation bytes``     the allocator's peak during the block call, per token (accelerators; 0 on CPU)
``host_s_per_block``     host time to issue a small copy + event record + wait (rank-local), plus an all-gather or
                         device copy issue (allgather)
``hbm / host``           the device's total memory; the host's RAM / local ranks
=======================  ==========================================================================================

:func:`probe` returns the :class:`~dlo_fn.plan.topology.Topology` and :class:`~dlo_fn.plan.topology.PolicyModel`;
:func:`choose` calls the planner and returns the chosen mode and slots with the result (ranked table, runner-up,
predicted step) for the caller to log.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time

import torch

from dlo_fn.models.sampler import finish, init_state, model_inputs, update
from dlo_fn.plan.modes import OFFLOAD_MODES
from dlo_fn.plan.policy import PolicyResult, plan
from dlo_fn.plan.sizes import ModelSizes
from dlo_fn.plan.spec import spec_from_module
from dlo_fn.plan.topology import BlockCompute, PolicyModel, Topology
from dlo_fn.plan.workload import Workload
from dlo_fn.runtime.dist import DistContext, all_gather_bytes

__all__ = ["Probe", "probe", "choose", "auto_slots", "sp_choices", "AUTO_SLOTS", "AUTO_LOAD_GROUPS"]

log = logging.getLogger(__name__)

AUTO_SLOTS = (2, 3, 4, 5, 6)
AUTO_LOAD_GROUPS = (1, 2, 4)
A2A_CAP_BYTES = 64 << 20  # per rank: bounds the probe's all-to-all on a long video


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    topology: Topology
    model: PolicyModel
    workload: Workload
    seconds: float  # wall time the probe took


def _best(fn, platform, reps: int) -> float:
    fn()
    platform.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        platform.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _flat_block(block: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).view(torch.uint8).cpu() for t in block.state_dict().values()])


def _host_ram_per_rank(ctx: DistContext) -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local, 1)


def _device_bytes(platform) -> int:
    if platform.kind == "cuda":
        return int(torch.cuda.mem_get_info(platform.device)[1])
    if platform.kind == "npu":
        return int(torch.npu.mem_get_info(platform.device)[1])  # type: ignore[attr-defined]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@torch.no_grad()
def probe(model, ctx: DistContext, request, *, reps: int = 3, block_path: str = "blocks") -> Probe:
    """Measure this machine for ``model`` (a :class:`~dlo_fn.models.dit.VideoDiT`, not yet offloaded) and the
    ``request`` it will serve. Moves the non-block modules to the device (offloading does that anyway)."""
    started = time.perf_counter()
    platform, dev = ctx.platform, ctx.platform.device
    spec = spec_from_module(model, (block_path,), name=type(model).__name__)
    sizes = ModelSizes.from_spec(spec, source="probe: the model's spec")
    for name, child in model.named_children():
        if name != block_path:
            child.to(dev)
    model.init_buffers(dev)
    blocks = model.get_submodule(block_path)
    # Block 0's bytes: pinned staging -> device (H2D), then its shards gathered (or copied) into a full block.
    flat = _flat_block(blocks[0])
    staged = flat.pin_memory() if platform.supports_pinned else flat
    dst = torch.empty_like(flat, device=dev)
    h2d = flat.numel() / _best(lambda: dst.copy_(staged, non_blocking=True), platform, reps)
    w = ctx.world_size
    if ctx.group is not None and w > 1:
        shard = -(-flat.numel() // w)
        gathered = torch.empty(shard * w, dtype=torch.uint8, device=dev)
        mine = gathered[ctx.rank * shard: (ctx.rank + 1) * shard].clone()
        gather_s = _best(lambda: all_gather_bytes(gathered, mine, ctx.group), platform, reps)
        bus = (w - 1) * shard / gather_s
        d2d = bus
    else:
        other = torch.empty_like(dst)
        d2d = flat.numel() / _best(lambda: other.copy_(dst), platform, reps)
        bus = d2d
        del other
    # Host issue cost per block: a small copy + event + wait; plus the collective's (or copy's) issue.
    n = max(1, min(1 << 20, flat.numel() // 2))
    small = staged[:n]
    stream = platform.current_stream()

    def issue(extra=None):
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
    host_rl = min(issue() for _ in range(reps))
    tail = (lambda: all_gather_bytes(gathered[: w * 4096], gathered[ctx.rank * 4096: (ctx.rank + 1) * 4096],
                                     ctx.group)) if (ctx.group is not None and w > 1) else (
        lambda: dst[n: 2 * n].copy_(dst[:n]))
    host_ag = min(issue(tail) for _ in range(reps))
    platform.synchronize()
    # One block on a real input, and the per-step work outside the blocks.
    block = copy.deepcopy(blocks[0]).to(dev)
    state = init_state(model, request, dev)
    inputs = model_inputs(state)
    embedded = model.embed(*inputs)
    x, kwargs = embedded.x, embedded.block_kwargs
    before = platform.memory_allocated() if platform.is_accelerator else 0
    if platform.is_accelerator:
        platform.reset_peak_memory_stats()
    block_s = _best(lambda: block(x, **kwargs), platform, reps)
    tokens = x.shape[1]
    act = ((platform.max_memory_allocated() - before) // max(x.shape[0] * tokens, 1)
           if platform.is_accelerator else 0)

    text = model.encode_text(inputs.text_tokens)  # once per request, as the engine does

    a2a = _all_to_all_rate(ctx, x.shape[0] * tokens * model.config.hidden_dim, block.parameters(), reps)

    def outside():  # one step's work outside the blocks, as serve.batch.run_batch runs it
        e = model.embed(*model_inputs(state), text)
        update(state, model.head(e.x, e))

    overhead = _best(outside, platform, reps)
    done = request.num_inference_steps
    request_s = _best(lambda: finish(dataclasses.replace(init_state(model, request, dev), step=done)), platform, 1)
    del block, dst, staged, embedded, x
    branches = 2 if request.cfg else 1
    workload = Workload(f"{request.height}x{request.width}x{request.num_frames}", tokens,
                        request.num_inference_steps, branches)
    src = "probe on this machine"
    topology = Topology(
        f"probe {platform.kind} x{w}", w, h2d, bus, a2a or bus, d2d,
        BlockCompute(table=((tokens, branches, block_s),)), _device_bytes(platform), _host_ram_per_rank(ctx),
        (("allgather", host_ag), ("rank-local", host_rl)), False, ((tokens, branches, overhead),), 0, 0,
        tuple((f, src) for f in ("h2d_bytes_per_s", "allgather_bus_bytes_per_s", "d2d_copy_bytes_per_s",
                                 *(("all_to_all_bytes_per_s",) if a2a else ()),
                                 "compute", "host_s_per_block", "step_overhead", "hbm_bytes_per_rank",
                                 "host_bytes_per_rank", "request_overhead")), ((tokens, request_s),))
    config = model.config
    pmodel = PolicyModel(sizes, config.hidden_dim, next(blocks[0].parameters()).element_size(), int(act),
                         source="probe: the model's spec; activations from the allocator's peak")
    seconds = time.perf_counter() - started
    log.info("probe (%.1f s): H2D %.1f GB/s, all-gather/copy %.1f GB/s, all-to-all %s, block %.2f ms on %d tokens x %d, "
             "outside the blocks %.2f ms per step, per request %.1f ms, host per block %.0f / %.0f us "
             "(allgather / rank-local)",
             seconds, h2d / 1e9, bus / 1e9, f"{a2a / 1e6:.1f} MB/s" if a2a else "- (one rank)", 1e3 * block_s,
             tokens, branches, 1e3 * overhead,
             1e3 * request_s, 1e6 * host_ag, 1e6 * host_rl)
    return Probe(topology, pmodel, workload, seconds)


def _all_to_all_rate(ctx: DistContext, elements: int, params, reps: int) -> float | None:
    """Bytes/s one rank sends in an ``all_to_all_single`` of an activation-sized tensor (module docstring); None
    on one rank."""
    w = ctx.world_size
    if ctx.group is None or w < 2:
        return None
    dtype = next(iter(params)).dtype
    size = torch.empty((), dtype=dtype).element_size()
    n = min(-(-elements // w), A2A_CAP_BYTES // size)  # this rank's part at sp = W
    n = max(w, n // w * w)  # all_to_all_single splits it into W equal chunks
    send = torch.ones(n, dtype=dtype, device=ctx.platform.device)
    recv = torch.empty_like(send)
    seconds = _best(lambda: torch.distributed.all_to_all_single(recv, send, group=ctx.group), ctx.platform, reps)
    return n * send.element_size() * (w - 1) / w / seconds


def sp_choices(world_size: int, num_heads: int | None) -> tuple[int, ...]:
    """The sp sizes ``--sp auto`` may take: divisors of the world that divide the model's heads (Ulysses)."""
    return tuple(d for d in range(1, world_size + 1)
                 if world_size % d == 0 and (num_heads is None or num_heads % d == 0))


def auto_slots(load_groups: tuple[int, ...]) -> tuple[int, ...]:
    """The slot counts ``--slots auto`` offers: ``AUTO_SLOTS``, and two groups' worth for each load group."""
    return tuple(sorted(set(AUTO_SLOTS) | {2 * g for g in load_groups}))


def choose(found: Probe, *, mode: str | None = None, num_slots: int | None = None, requests_per_rank: int = 1,
           objective: str = "throughput", sps: tuple[int, ...] = (1,), load_group: int | None = 1) -> PolicyResult:
    """The planner on the probed topology; ``mode`` / ``num_slots`` / ``load_group`` None = the policy chooses
    (``auto``: slots from ``AUTO_SLOTS``, and with the load group chosen too their multiples up to 2 x 4);
    ``sps``: the sp sizes to consider (one: fixed; :func:`sp_choices` for ``--sp auto``)."""
    modes = OFFLOAD_MODES if mode is None else (mode,)
    groups = AUTO_LOAD_GROUPS if load_group is None else (load_group,)
    slots = auto_slots(groups) if num_slots is None else (num_slots,)
    result = plan(found.model, found.topology, found.workload, objective=objective, slots=slots,
                  requests_per_rank=(requests_per_rank,), modes=modes, sps=tuple(sps), load_groups=groups)
    log.info("policy: %s", result.why())
    return result
