"""The start-up probe of ``generate --mode/--slots/--sp/--load-group auto`` and ``bench slots``: the machine's links
(:func:`dlo_fn.runtime.probe.probe_links`) and, for the reference DiT and a request, what its engine does:

=====================  ===========================================================================================
``block_compute_s``    block 0 on the device on a real input: the request's latents through ``embed``
``step_overhead_s``    the per-step work outside the blocks as the engine runs it (``serve.batch.run_batch``:
                       sampler inputs, ``embed`` on the request's text encoded once, ``head``, sampler update)
``request_s``          the per-request host work outside the ring: ``init_state`` (noise, text tokens in) and
                       ``finish`` (latents out, decode, hash)
``activation bytes``   the allocator's peak during the block call, per token (accelerators; 0 on CPU)
=====================  ===========================================================================================

:func:`probe` returns a :class:`Probe` (topology, model, workload), which ``offload(..., workload=probe)`` chooses
from (:mod:`dlo_fn.runtime.auto`); :func:`choose` is the planner on it, logged.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time

import torch

from dlo_fn.cost import auto as plan_auto
from dlo_fn.cost.auto import topology_from
from dlo_fn.cost.policy import PolicyResult
from dlo_fn.cost.topology import BlockCompute, PolicyModel, Topology
from dlo_fn.models.sampler import finish, init_state, model_inputs, update
from dlo_fn.plan.sizes import ModelSizes
from dlo_fn.plan.spec import spec_from_module
from dlo_fn.plan.workload import Workload
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.probe import best_s, flat_block, probe_links

__all__ = ["Probe", "probe", "choose"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    topology: Topology
    model: PolicyModel
    workload: Workload
    seconds: float  # wall time the probe took


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
    block = copy.deepcopy(blocks[0]).to(dev)
    state = init_state(model, request, dev)
    embedded = model.embed(*model_inputs(state))
    x, kwargs = embedded.x, embedded.block_kwargs
    dtype = next(block.parameters()).dtype
    links = probe_links(
        flat_block(blocks[0]),
        ctx,
        reps=reps,
        a2a_elements=x.shape[0] * x.shape[1] * model.config.hidden_dim,
        dtype=dtype,
    )
    before = platform.memory_allocated() if platform.is_accelerator else 0
    if platform.is_accelerator:
        platform.reset_peak_memory_stats()
    block_s = best_s(lambda: block(x, **kwargs), platform, reps)  # noqa: F821 (a closure; the name is deleted after its last call)
    tokens = x.shape[1]
    act = (platform.max_memory_allocated() - before) // max(x.shape[0] * tokens, 1) if platform.is_accelerator else 0
    text = model.encode_text(model_inputs(state).text_tokens)  # once per request, as the engine does

    def outside():  # one step's work outside the blocks, as serve.batch.run_batch runs it
        e = model.embed(*model_inputs(state), text)
        update(state, model.head(e.x, e))

    overhead = best_s(outside, platform, reps)
    done = request.num_inference_steps
    request_s = best_s(lambda: finish(dataclasses.replace(init_state(model, request, dev), step=done)), platform, 1)
    del block, embedded, x
    branches = 2 if request.cfg else 1
    workload = Workload(
        f"{request.height}x{request.width}x{request.num_frames}", tokens, request.num_inference_steps, branches
    )
    topology = dataclasses.replace(
        topology_from(
            f"probe {platform.kind} x{ctx.world_size}",
            ctx.world_size,
            links,
            BlockCompute(table=((tokens, branches, block_s),)),
            ((tokens, branches, overhead),),
            "probe on this machine",
        ),
        request_overhead=((tokens, request_s),),
    )
    pmodel = PolicyModel(
        sizes,
        model.config.hidden_dim,
        dtype.itemsize,
        int(act),
        source="probe: the model's spec; activations from the allocator's peak",
        tensor_block_bytes=spec.block_bytes,  # what a block kept resident under an HBM budget holds
    )
    seconds = time.perf_counter() - started
    log.info(
        "probe (%.1f s): H2D %.1f GB/s, all-gather/copy %.1f GB/s, all-to-all %s, block %.2f ms on %d tokens x "
        "%d, outside the blocks %.2f ms per step, per request %.1f ms, host per block %.0f / %.0f us "
        "(allgather / rank-local)",
        seconds,
        links.h2d_bytes_per_s / 1e9,
        links.allgather_bus_bytes_per_s / 1e9,
        f"{links.all_to_all_bytes_per_s / 1e6:.1f} MB/s" if links.all_to_all_bytes_per_s else "- (one rank)",
        1e3 * block_s,
        tokens,
        branches,
        1e3 * overhead,
        1e3 * request_s,
        *(1e6 * s for _, s in links.host_s_per_block),
    )
    return Probe(topology, pmodel, workload, seconds)


def choose(found: Probe, **kw) -> PolicyResult:
    """:func:`dlo_fn.cost.auto.choose` on a probe's topology, model and workload, logged."""
    result = plan_auto.choose(found.topology, found.model, found.workload, **kw)
    log.info("policy: %s", result.why())
    return result
