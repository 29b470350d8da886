"""The variants of `bench step`, each a function ``pass(x, kwargs) -> x`` over the same blocks.

=======================  =====================================================================================
variant                  how the blocks' weights reach the device
=======================  =====================================================================================
``resident``             all on the device (the baseline; no weight traffic)
``dlo-rank-local``       our executor, H2D of whole blocks from the pinned arena straight into 2 slots
``dlo-allgather``        our executor in allgather mode; over one rank the plan lowers it to the rank-local
                         program (H2D straight into the slots, no landing buffer, no all-gather)
``dlo-rank-local-swap``  as dlo-rank-local, blocks called through the pre-resolved swap (not functional_call)
``dlo-*-bgraph``         as dlo-rank-local / dlo-allgather, each block's compute replayed as a CUDA graph (the
                         block-graph plug-in; eager where capture is unsupported, e.g. on CPU)
``resident-graph``       resident, the whole pass captured as one CUDA graph (CUDA only; a diagnostic)
``resident-compile``     resident, every block compiled with ``torch.compile`` (``nn.Module.compile``)
``dlo-rank-local-compile``  dlo-rank-local on blocks compiled the same way (compared with resident-compile)
``dlo-*-g2``, ``-g4``    load groups (``load_group`` G on 2G slots): G blocks' copies as one, one wait and one
                         record per group on each stream
``dlo-*-fp8``            FP8 shards (``quantization="fp8"``): half the bytes moved, dequantised into the slot;
                         compared with ``resident-fp8`` (the blocks fake-quantised, resident)
``diffusers``            diffusers group offloading: block_level, num_blocks_per_group=1, use_stream=True
``diffusers-record-stream``  the same with ``record_stream=True`` (the allocator told that the compute stream
                         uses each onloaded tensor)
``naive-sync``           per block: synchronous copy from the pinned arena into one slot, then compute
=======================  =====================================================================================
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.repro.variants import STEP
from dlo_fn.plan.layout import ModelLayout
from dlo_fn.runtime.blocks import BlockProxy, block_state, make_caller, make_views
from dlo_fn.runtime.cuda import plugins_for
from dlo_fn.runtime.executor import Executor
from dlo_fn.runtime.host_store import HostStore
from dlo_fn.runtime.options import OffloadOptions
from dlo_fn.runtime.platform import Platform

__all__ = [
    "VARIANTS",
    "PassResult",
    "time_passes",
    "host_pass_delta_s",
    "narrow_config",
    "random_model",
    "cpu_blocks",
    "executor_pass",
    "diffusers_pass",
    "naive_pass",
    "pinned_peak_bytes_per_s",
    "pinning_overhead",
]

VARIANTS = tuple(v.name for v in STEP if v.runs)  # benchmarks.repro.variants
# compiling takes minutes on a CPU; resident-graph is a diagnostic (CUDA only)
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if not v.endswith(("-compile", "resident-graph")))
GRAPH_WARMUP = 4  # passes before timing a graph variant: cold, warm (recorded), captured, replayed


def variant_options(variant: str) -> dict:
    """Executor options of a ``dlo-*`` variant: its mode, then suffixes ``-swap`` / ``-compile`` (block call),
    ``-bgraph`` (block graphs), ``-g<G>`` (load groups of G on 2G slots), ``-fp8`` (FP8 shards)."""
    parts = variant.split("-")
    group = next((int(p[1:]) for p in parts if p[:1] == "g" and p[1:].isdigit()), 1)
    return {
        "mode": "allgather" if variant.startswith("dlo-allgather") else "rank-local",
        "block_call": "swap" if "swap" in parts else "compile" if "compile" in parts else "functional_call",
        "graph": "block" if "bgraph" in parts else False,
        "load_group": group,
        "quantization": "fp8" if "fp8" in parts else None,
    }


PassFn = Callable[[torch.Tensor, dict], torch.Tensor]


@dataclass
class PassResult:
    step_s: list[float]  # device time of each timed pass (steady state: passes back to back)
    host_s: list[float]  # host time of passes started on an idle device (dispatch cost)
    peak_device_bytes: int
    extra: dict[str, Any] = field(default_factory=dict)


@torch.no_grad()
def host_pass_delta_s(
    platform: Platform,
    run_pass: PassFn,
    reference: PassFn,
    x: torch.Tensor,
    kwargs: dict,
    *,
    warmup: int = 3,
    repeats: int = 21,
    reset: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """``(median host time of a pass, median of (pass - reference pass))``, the two timed alternately, each
    pass started on an idle device, so drift of the host's speed cancels in the difference. Use small
    activations and blocks, so the device keeps up and the host timer sees host work only. ``reset`` runs
    after the warm-up."""
    for _ in range(warmup):
        run_pass(x, kwargs)
        reference(x, kwargs)
    if reset is not None:
        reset()
    times, deltas = [], []
    for _ in range(repeats):
        pair = []
        for fn in (reference, run_pass):
            platform.synchronize()
            t0 = time.perf_counter()
            fn(x, kwargs)
            pair.append(time.perf_counter() - t0)
        times.append(pair[1])
        deltas.append(pair[1] - pair[0])
    platform.synchronize()
    return statistics.median(times), statistics.median(deltas)


@torch.no_grad()
def time_passes(
    platform: Platform,
    run_pass: PassFn,
    x: torch.Tensor,
    kwargs: dict,
    *,
    warmup: int,
    repeats: int,
    host_repeats: int,
    reset: Callable[[], None] | None = None,
) -> PassResult:
    """Warm up, then ``repeats`` passes back to back timed with events on the compute stream (no host sync
    between them), then ``host_repeats`` passes each started after a synchronize, timed on the host."""
    for _ in range(warmup):
        run_pass(x, kwargs)
    platform.synchronize()
    stream = platform.current_stream()
    events = [(platform.new_event(timing=True), platform.new_event(timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record(stream)
        run_pass(x, kwargs)
        end.record(stream)
    platform.synchronize()
    step_s = [start.elapsed_time(end) / 1e3 for start, end in events]
    if reset is not None:
        reset()
    host_s = []
    for _ in range(host_repeats):
        platform.synchronize()
        t0 = time.perf_counter()
        run_pass(x, kwargs)
        host_s.append(time.perf_counter() - t0)
    platform.synchronize()
    return PassResult(step_s, host_s, platform.max_memory_allocated())


def small_config(config_name: str = "bench"):
    """Many small blocks: 40 blocks of ~90 MB bf16 (hidden 1280, 10 heads of 128, MLP x4), so that at 1024^2 with
    CFG a block computes in ~1-3 ms on an H200 and copies in ~1.6 ms: per-block host costs are not hidden."""
    import dataclasses

    from dlo_fn.models import get_config

    base = get_config(config_name)
    return dataclasses.replace(
        base, name=f"{base.name}-small40", num_blocks=40, hidden_dim=1280, num_heads=10, mlp_dim=5120
    )


def bench_config(name: str):
    """A named model config, or ``<base>-small40`` / ``<base>-narrow`` (see :func:`small_config`,
    :func:`narrow_config`)."""
    for suffix, fn in (("-small40", small_config), ("-narrow", narrow_config)):
        if name.endswith(suffix):
            return fn(name[: -len(suffix)])
    return name


def narrow_config(config_name: str):
    """``config_name`` with the same blocks (same modules, same tensors per block) at hidden 256: for host
    dispatch timing, where the device must never fall behind the host (no launch-queue back-pressure)."""
    import dataclasses

    from dlo_fn.models import get_config

    base = get_config(config_name)
    return dataclasses.replace(
        base,
        name=f"{base.name}-narrow",
        hidden_dim=256,
        num_heads=2,
        mlp_dim=1024,
        cond_dim=256 if base.adaln_rank == 0 else base.cond_dim,
    )


def random_model(config_name, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """The reference DiT with random weights made directly on ``device`` (fast; no checkpoint): N(0, 1/fan_in)
    for matrices, N(1, 0.1) for norm weights, N(0, 0.02) for the rest."""
    from dlo_fn.models import build_model

    model = build_model(config_name, "meta", dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
            elif "norm" in name:
                p.normal_(1.0, 0.1, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.init_buffers(device)
    return model.eval().requires_grad_(False)


def fake_quantized(blocks: list[nn.Module]) -> nn.ModuleList:
    """Copies of ``blocks`` with every weight FP8 shards store fake-quantised (``runtime.quant.fake_quantize``)."""
    from dlo_fn.runtime.quant import fake_quantize

    holder = nn.Module()
    holder.blocks = nn.ModuleList(copy.deepcopy(b) for b in blocks)
    return fake_quantize(holder, "blocks").blocks


def fp8_store(spec: Any, tensors: list[dict], platform: Platform) -> tuple[ModelLayout, HostStore]:
    """The FP8 layout of ``spec`` on one rank and its host store, quantised from ``tensors``."""
    from dlo_fn.plan.layout import model_layout
    from dlo_fn.runtime.host_store import build_host_store
    from dlo_fn.runtime.quant import StoredBlock, needed_ranges

    layout = model_layout(spec, 1, quantization="fp8")
    stored = [StoredBlock(t, sh.block, needed_ranges(sh.pieces[0])) for t, sh in zip(tensors, layout.shards)]
    return layout, build_host_store(layout, 0, stored, platform)


def cpu_blocks(blocks: list[nn.Module]) -> nn.ModuleList:
    """Pageable CPU copies of device blocks, one block at a time (what a CPU-offload library starts from)."""
    out = nn.ModuleList()
    for block in blocks:
        cpu = copy.deepcopy(block).to("cpu")
        out.append(cpu)
    return out


class _Stack(nn.Module):
    """A container whose forward runs its blocks in order (diffusers learns the prefetch order from it)."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, **kwargs)
        return x


def executor_pass(
    platform: Platform,
    layout: ModelLayout,
    store: HostStore,
    blocks: list[nn.Module],
    aliases: list[dict],
    *,
    mode: str,
    group: Any,
    block_call: str,
    graph: bool | str = False,
    load_group: int = 1,
    **options: Any,
) -> tuple[PassFn, Executor]:
    opts = OffloadOptions(
        mode=mode, block_call=block_call, graph=graph, num_slots=2 * load_group, load_group=load_group, **options
    )
    ex = Executor(
        platform,
        layout,
        store,
        blocks,
        aliases,
        opts,
        group=group if mode == "allgather" else None,
        plugin=plugins_for(opts, platform),
    )
    proxies = [BlockProxy(ex.compute, b, blocks[b]) for b in range(len(blocks))]

    def run_pass(x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        for proxy in proxies:
            x = proxy(x, **kwargs)
        return x

    return run_pass, ex


def diffusers_pass(platform: Platform, blocks: nn.ModuleList, record_stream: bool = False) -> PassFn:
    """diffusers group offloading on ``blocks`` (CPU modules; it pins a copy of every tensor at set-up; each
    variant needs blocks of its own: the hooks move their tensors); ``record_stream`` as diffusers takes it."""
    from diffusers.hooks import apply_group_offloading
    from diffusers.utils import is_accelerate_available

    if not is_accelerate_available():  # group offloading's hooks call accelerate.utils.send_to_device
        raise ImportError("diffusers group offloading needs the `accelerate` package")

    stack = _Stack(blocks)
    apply_group_offloading(
        stack,
        onload_device=platform.device,
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
        use_stream=platform.is_accelerator,
        record_stream=record_stream and platform.is_accelerator,
    )

    def run_pass(x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        return stack(x, **kwargs)

    return run_pass


def naive_pass(
    platform: Platform, layout: ModelLayout, store: HostStore, blocks: list[nn.Module], aliases: list[dict]
) -> PassFn:
    """Per block: blocking copy of the whole block from the pinned arena into one slot, then compute."""
    slot = torch.empty(layout.max_padded_block_bytes, dtype=torch.uint8, device=platform.device)
    callers, srcs = [], []
    for b, shard in enumerate(layout.shards):
        callers.append(make_caller("swap", blocks[b], make_views(slot, shard.block, aliases[b])))
        srcs.append((slot[: shard.shard_bytes], store.shard(b)))

    def run_pass(x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        for (dst, src), call in zip(srcs, callers):
            dst.copy_(src, non_blocking=False)
            x = call((x,), kwargs)
        return x

    return run_pass


def pinned_peak_bytes_per_s(platform: Platform, store: HostStore, layout: ModelLayout, reps: int = 3) -> float:
    """Best of ``reps`` rounds of H2D copies of up to 8 consecutive shards from the arena into one buffer."""
    dst = torch.empty(layout.max_shard_bytes, dtype=torch.uint8, device=platform.device)
    n = min(8, layout.num_blocks)
    stream = platform.current_stream()
    best = 0.0
    for _ in range(reps + 1):  # the first round warms up
        start, end = platform.new_event(timing=True), platform.new_event(timing=True)
        start.record(stream)
        nbytes = 0
        for b in range(n):
            src = store.shard(b)
            dst[: src.numel()].copy_(src, non_blocking=True)
            nbytes += src.numel()
        end.record(stream)
        platform.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        if seconds > 0:
            best = max(best, nbytes / seconds)
    del dst
    return best


def pinning_overhead(platform: Platform, nbytes: int = int(1.2 * 2**30)) -> dict:
    """Resident host bytes (RSS growth) of pinning ``nbytes`` through ``pin_memory()`` (the caching host
    allocator: next power of two) and through our exact ``cudaHostRegister`` arena. CUDA only."""
    if platform.kind != "cuda":
        return {}
    import psutil

    from dlo_fn.runtime.host_store import alloc_host

    proc = psutil.Process()
    before = proc.memory_info().rss
    rounded = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pin_memory_bytes = proc.memory_info().rss - before
    del rounded
    release(platform)
    before = proc.memory_info().rss
    exact, how, fin = alloc_host(nbytes, platform)
    register_bytes = proc.memory_info().rss - before
    fin()
    del exact
    return {
        "requested_bytes": nbytes,
        "pin_memory_rss_bytes": pin_memory_bytes,
        "host_register_rss_bytes": register_bytes,
    }


def release(platform: Platform) -> None:
    gc.collect()
    if platform.kind == "cuda":
        torch.cuda.empty_cache()
        empty_host = getattr(torch.cuda, "host_empty_cache", None) or getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()


def block_states(blocks: list[nn.Module]) -> tuple[list[dict], list[dict]]:
    states = [block_state(b) for b in blocks]
    return [t for t, _ in states], [a for _, a in states]


def block_inputs(model, height: int, width: int, frames: int, device):
    from dlo_fn.models import latent_shape, tokenize

    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn((2, *latent_shape(cfg, height, width, frames)), generator=gen).to(device)
    timestep = torch.full((2,), 500.0, device=device)
    tokens = tokenize(["a benchmark prompt", ""], cfg.text_len).to(device)
    with torch.no_grad():
        state = model.embed(latents, timestep, tokens)
    return state.x, state.block_kwargs, int(state.x.shape[1])
