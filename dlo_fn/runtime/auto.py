"""``offload(model, ctx=ctx, mode="auto", num_slots="auto", load_group="auto")`` for any model: the links probed
on block 0's bytes, then with ``workload=`` (a Workload: block FLOPs at a measured matmul rate; a
:class:`~dlo_fn.serve.probe.Probe`) the choice (:mod:`dlo_fn.cost.auto`; rank 0's on every rank) and one build with
concrete options. Without, the **first call** is a synchronous layerwise pass (each block's tensors on the device
only for its call, nothing to copy on CPU; timed around syncs): no resident copy, the plain model's output; its end
chooses and builds. Every rank makes that first call (a broadcast, a collective build), as DP calls do.
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

__all__ = ["resolve", "decide", "flop_per_s"]

log = logging.getLogger(__name__)
GROUPS = {"world": "mesh", "dp": "dp"}  # OffloadOptions.shard_group -> the policy's shard group


def decide(topology, model, workload, fields, options, ctx, *, sps=(1,), source="probe", **kw):
    """Rank 0's :class:`~dlo_fn.cost.auto.AutoChoice` for the ``auto`` ``fields`` (the others as ``options`` has
    them; one sp > 1: its shard group), on every rank; logged with the runner-up."""
    fixed = {f: None if f in fields else getattr(options, f) for f in plan_auto.AUTO_FIELDS}
    result = plan_auto.choose(topology, model, workload, sps=tuple(sps), **fixed, **kw)
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


def resolve(pending, paths, entries, fields, workload, mesh, build):
    """``offload``'s ``auto`` fields (module docstring): the :class:`~dlo_fn.runtime.offload.Offloaded` of
    ``build(model, paths, spec, ctx, options, mesh)`` at the chosen options, or ``pending``, built at the end of
    the first call."""
    model, ctx, options, spec = pending.model, pending.ctx, pending.options, pending.spec
    sp = (mesh.sp_size if mesh is not None else 1,)

    def built(choice):
        done = build(model, paths, spec, ctx, replace(options, **plan_auto.option_values(choice.chosen)), mesh)
        done.auto = choice
        return done

    if hasattr(workload, "topology"):  # a start-up probe
        return built(decide(workload.topology, workload.model, workload.workload, fields, options, ctx, sps=sp))
    first = entries[0][0][entries[0][1]]
    dtype = next(iter(first.state_dict().values())).dtype
    links = probe_links(flat_block(first), ctx, dtype=dtype)
    sizes = ModelSizes.from_spec(spec, source="the model's spec")
    if isinstance(workload, Workload):
        pmodel = PolicyModel(sizes, plan_auto.hidden_dim(first), dtype.itemsize, source="the model's spec")
        topo = plan_auto.topology_from(
            "probe and workload", ctx.world_size, links, BlockCompute(flop_per_s=flop_per_s(ctx.platform, dtype))
        )
        return built(decide(topo, pmodel, workload, fields, options, ctx, sps=sp, source="workload"))
    if workload is not None:
        raise TypeError(
            f"offload(workload=...) takes a dlo_fn.plan.workload.Workload, a serve.probe.Probe or "
            f"None (measured on the first call), got {type(workload).__name__}"
        )
    blocks = [lst[i] for lst, i in entries]
    dev, sync = ctx.platform.device, ctx.platform.synchronize
    _to_device(model, {id(m) for b in blocks for m in b.modules()}, dev)
    times, hooks, clock, st = [0.0] * len(blocks), [], time.perf_counter, {"load_s": 0.0}
    acc = ctx.platform if ctx.platform.is_accelerator else None

    def before(b, mod, args):  # the block's tensors onto the device (a no-op on CPU), timed apart from its call
        sync()
        t0 = clock()
        st[b] = _to_device(mod, set(), dev)
        sync()
        st["load_s"], st["t"] = st["load_s"] + clock() - t0, clock()

    def after(b, mod, args, out):
        sync()
        times[b] += clock() - st["t"]
        for table, key, tensor in st.pop(b):
            table[key] = tensor

    def start(mod, args):
        sync()
        if acc is not None:
            acc.reset_peak_memory_stats()
        st.update(base=acc.memory_allocated() if acc else 0, t0=clock())

    def end(mod, args, out):
        sync()
        wall = clock() - st["t0"]
        for h in hooks:
            h.remove()
        act = max(acc.max_memory_allocated() - st["base"] - max(sizes.block_bytes), 0) if acc else 0
        topo, pmodel, wl = plan_auto.measured_inputs(
            sizes,
            plan_auto.hidden_dim(first),
            dtype.itemsize,
            tuple(times),
            wall - st["load_s"] - sum(times),
            act,
            links,
            ctx.world_size,
        )
        vars(pending).update(vars(built(decide(topo, pmodel, wl, fields, options, ctx, sps=sp, source="first call"))))

    for b, block in enumerate(blocks):
        hooks += [
            block.register_forward_pre_hook(functools.partial(before, b)),
            block.register_forward_hook(functools.partial(after, b)),
        ]
    hooks += [model.register_forward_pre_hook(start), model.register_forward_hook(end)]
    return pending


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
