"""``offload(model, ctx=ctx, mode="auto", num_slots="auto", load_group="auto")`` for any model: :func:`resolve` runs
first and returns concrete options, from which ``offload`` builds once. The links are probed on block 0's bytes,
then with ``workload=`` (a Workload: block FLOPs at a measured matmul rate; a :class:`~dlo_fn.serve.probe.Probe`)
the policy chooses (:mod:`dlo_fn.cost.auto`; rank 0's choice on every rank). Without one, ``example=`` (one call's
inputs) is timed through a plain probe (:func:`time_one_call`): a layerwise pass of the model (each block's tensors
on the device only for its call, nothing to copy on CPU), with no resident copy and no offloaded state, whose
per-block times the policy (and the HBM budget's placement) reads. Every rank resolves (a broadcast), as DP calls do.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace

import torch

from dlo_fn.cost import auto as plan_auto
from dlo_fn.cost.topology import BlockCompute, PolicyModel
from dlo_fn.plan.sizes import ModelSizes
from dlo_fn.plan.workload import Workload
from dlo_fn.runtime.probe import best_s, flat_block, probe_links
from dlo_fn.runtime.quant import fp32_modules

__all__ = ["resolve", "decide", "time_one_call", "flop_per_s"]

log = logging.getLogger(__name__)
GROUPS = {"world": "mesh", "dp": "dp"}  # OffloadOptions.shard_group -> the policy's shard group


def decide(topology, model, workload, fields, options, ctx, *, sps=(1,), source="probe", **kw):
    """Rank 0's :class:`~dlo_fn.cost.auto.AutoChoice` for the ``auto`` ``fields`` (the others as ``options`` has
    them; one sp > 1: its shard group), on every rank; logged with the runner-up."""
    fixed = {f: None if f in fields else getattr(options, f) for f in plan_auto.AUTO_FIELDS}
    result = plan_auto.choose(topology, model, workload, sps=tuple(sps), hbm_budget=options.hbm_budget, **fixed, **kw)
    rows = [
        r
        for r in result.rows
        if sps[0] == 1 or len(sps) > 1 or r.candidate.shard_group in ("-", GROUPS.get(options.shard_group))
    ] or [result.chosen]
    picked = [rows[0], rows[1] if len(rows) > 1 else None]
    if ctx.group is not None and ctx.world_size > 1:
        torch.distributed.broadcast_object_list(picked, src=0, group=ctx.group)
    choice = plan_auto.AutoChoice(picked[0], picked[1], tuple(fields), source, result)
    if ctx.is_main:
        log.info("auto: %s", choice.why())
    return choice


def resolve(model, entries, spec, ctx, options, fields, workload, mesh, example):
    """``offload``'s ``auto`` fields (module docstring): ``(options, choice)``, the options with every ``auto`` field
    concrete and the :class:`~dlo_fn.cost.auto.AutoChoice` (chosen and runner-up, logged on rank 0).
    ``entries``: the (block list, index) of every block."""
    sp = (mesh.sp_size if mesh is not None else 1,)

    def concrete(choice):
        return replace(options, **plan_auto.option_values(choice.chosen)), choice

    if hasattr(workload, "topology"):  # a start-up probe
        return concrete(decide(workload.topology, workload.model, workload.workload, fields, options, ctx, sps=sp))
    if workload is not None and not isinstance(workload, Workload):
        raise TypeError(
            f"offload(workload=...) takes a dlo_fn.plan.workload.Workload or a serve.probe.Probe, got "
            f"{type(workload).__name__}"
        )
    if workload is None and example is None:
        raise ValueError(
            "offload(mode/num_slots/load_group='auto') chooses from workload= (a dlo_fn.plan.workload.Workload) or "
            "from one timed call: pass example= (that call's keyword arguments as a dict, or its positional ones as "
            "a tuple)"
        )
    first = entries[0][0][entries[0][1]]
    dtype = next(iter(first.state_dict().values())).dtype
    links = probe_links(flat_block(first), ctx, dtype=dtype)
    q = options.quantization  # priced as offload lays it out: stored FP8 blocks, the model's fp32 modules kept
    exclude = (q.exclude + fp32_modules(model)) if q is not None else ()
    sizes = ModelSizes.from_spec(spec, options.alignment_bytes, "the model's spec", q, exclude)
    if workload is not None:
        pmodel = PolicyModel(
            sizes,
            plan_auto.hidden_dim(first),
            dtype.itemsize,
            source="the model's spec",
            tensor_block_bytes=spec.block_bytes,
        )
        topo = plan_auto.topology_from(
            "probe and workload", ctx.world_size, links, BlockCompute(flop_per_s=flop_per_s(ctx.platform, dtype))
        )
        return concrete(decide(topo, pmodel, workload, fields, options, ctx, sps=sp, source="workload"))
    times, outside_s, peak = time_one_call(model, [lst[i] for lst, i in entries], ctx.platform, example)
    act = max(peak - max(sizes.block_bytes), 0)  # activations: the peak beyond the one block on the device
    topo, pmodel, wl = plan_auto.measured_inputs(
        sizes,
        plan_auto.hidden_dim(first),
        dtype.itemsize,
        times,
        outside_s,
        act,
        links,
        ctx.world_size,
        spec.block_bytes,
    )
    return concrete(decide(topo, pmodel, wl, fields, options, ctx, sps=sp, source="example call"))


# The spin kernel's length over the block's measured enqueue time: the host's second enqueue of a block varies (the
# allocator, Python), and a delay that ends early lets the device idle inside the timed block.
DELAY_FACTOR, DELAY_MARGIN_S = 2.0, 1e-3


@torch.no_grad()
def time_one_call(model, blocks, platform, example) -> tuple[tuple[float, ...], float, int]:
    """One call of ``model`` on ``example`` (a dict of keyword arguments or a tuple of positional ones) through the
    plain probe of the module docstring: each block's compute seconds, the seconds outside the blocks, their loads
    and the probe's own work, and the allocator's peak above where the call started (0 on CPU). The blocks' tensors
    go back where they were; the other tensors stay on the device, where ``offload`` puts them anyway.

    A block's compute is what the forward spends on it. In a forward the host enqueues ahead of a busy device, so
    on CUDA, once the block's weights are in, the block runs once untimed (its host enqueue time measured, first-call
    set-up out of the way), then a spin kernel keeps the device busy for longer than that enqueue while the host
    enqueues the block again behind it; the compute is the device time between events around that second run.
    Timed on the host around syncs instead, each block would start from an empty queue and also pay the host's
    launches. On CPU (no queue) and NPU (no spin kernel used here) the host clock around syncs times the one run."""
    dev, sync, clock = platform.device, platform.synchronize, time.perf_counter
    acc = platform if platform.is_accelerator else None
    delay = _device_delay(platform)
    _to_device(model, {id(m) for b in blocks for m in b.modules()}, dev)
    times, hooks, st = [0.0] * len(blocks), [], {"inside_s": 0.0}

    def before(b, mod, args, kwargs):  # the block's tensors onto the device (a no-op on CPU), then the clock starts
        sync()  # what ran before the block is outside it
        st["in"] = clock()
        st[b] = _to_device(mod, set(), dev)
        sync()
        if delay is None:
            st["t"] = clock()
            return
        t0 = clock()
        mod.forward(*args, **kwargs)  # untimed, past the hooks; its output is dropped before the timed run
        enqueue_s = clock() - t0
        sync()
        delay(DELAY_FACTOR * enqueue_s + DELAY_MARGIN_S)
        st["start"] = platform.new_event(timing=True)
        st["start"].record()

    def after(b, mod, args, out):
        if delay is None:
            sync()
            times[b] += clock() - st["t"]
        else:
            end = platform.new_event(timing=True)
            end.record()
            sync()
            times[b] += st["start"].elapsed_time(end) / 1e3
        for table, key, tensor in st.pop(b):
            table[key] = tensor
        st["inside_s"] += clock() - st["in"]

    for b, block in enumerate(blocks):
        hooks += [
            block.register_forward_pre_hook(functools.partial(before, b), with_kwargs=True),
            block.register_forward_hook(functools.partial(after, b)),
        ]
    args, kwargs = (example, {}) if isinstance(example, tuple) else ((), dict(example))
    try:
        sync()
        if acc is not None:
            acc.reset_peak_memory_stats()
        base, t0 = (acc.memory_allocated() if acc else 0), clock()
        model(*args, **kwargs)
        sync()
        wall = clock() - t0
    finally:
        for h in hooks:
            h.remove()
    peak = acc.max_memory_allocated() - base if acc else 0
    return tuple(times), wall - st["inside_s"], peak


def _device_delay(platform):
    """CUDA: a function that keeps the current stream busy for about ``s`` seconds (PyTorch's spin kernel, which
    counts clock cycles; their rate measured here once). None elsewhere."""
    sleep = getattr(torch.cuda, "_sleep", None) if platform.kind == "cuda" else None
    if sleep is None:
        return None
    cycles = 10**7  # a few ms: long enough for the events' resolution
    start, end = platform.new_event(timing=True), platform.new_event(timing=True)
    sleep(cycles)  # the kernel's first launch loads it
    start.record()
    sleep(cycles)
    end.record()
    end.synchronize()
    per_s = cycles / (start.elapsed_time(end) / 1e3)
    return lambda s: sleep(max(int(s * per_s), 1))


def _to_device(module, skip: set, dev) -> list:
    """Put every tensor of ``module`` (outside the modules in ``skip``) on ``dev``; returns what it replaced."""
    saved = []
    for mod in module.modules():
        if id(mod) in skip:
            continue
        for table in (mod._parameters, mod._buffers):
            for key, t in table.items():
                if t is not None and t.device != dev:
                    saved.append((table, key, t))
                    moved = t.detach().to(dev)
                    table[key] = (
                        torch.nn.Parameter(moved, t.requires_grad) if isinstance(t, torch.nn.Parameter) else moved
                    )
    return saved


def flop_per_s(platform, dtype) -> float:
    """A square matmul's rate on the device in the blocks' dtype (fp32 on CPU, where bf16 kernels are slow)."""
    n = 2048 if platform.is_accelerator else 256
    dt = dtype if platform.is_accelerator else torch.float32
    a = torch.ones(n, n, dtype=dt, device=platform.device)
    return 2 * n**3 / best_s(lambda: a @ a, platform, 3)
