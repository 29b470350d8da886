"""The variants `bench real` runs side by side, each from the checkpoint folder to one timed forward.

=====================  ===========================================================================================
``resident``           the whole model on the device (made there with random weights, then saved)
``ours-*``             ``load_model(folder)`` + ``offload(model, ctx=ctx, **OURS[name])``: the public API
``diffusers-block``    ``from_pretrained`` + ``enable_group_offload("block_level", num_blocks_per_group=1,
                       use_stream=True)`` (diffusers 0.42.1; ``use_stream`` only where the device has streams)
``diffusers-leaf``     the same, ``offload_type="leaf_level"``
``ours-hbm-<N>GB``     ``offload(..., hbm_budget="<N>GB", example=inputs)``: the blocks that fit <N> GB of device
                       weights resident, placed by the blocks' measured compute, the rest streamed
                       (``ours-fp8-hbm-*``: with FP8 shards); the row records the plan's predicted pass
``ours-fp8-hbm-<N>GB-host-only``  the same budget placed without the device's copy rate: no device-stored
                       shards, dequantising not priced (what the plan picks without the third tier)
``ours-hbm-fastest``   the same at the model's fastest point: the least device bytes whose predicted pass is
                       within 1% of the blocks' compute (:func:`dlo_fn.plan.resident.at_speed`), slots chosen
``accelerate-<N>GiB``  ``from_pretrained(..., device_map="auto", max_memory={0: "<N>GiB", "cpu": ...})``: accelerate
                       fills the device with the first modules and moves the rest at each forward
``model-offload``      ``from_pretrained`` + accelerate's ``cpu_offload_with_hook`` (what ``enable_model_cpu_offload``
                       installs): the whole model moves to the device for the forward and back after it (the
                       pipeline frees it at the end of every request)
=====================  ===========================================================================================

Every timed forward runs back to back after warm-up, timed with events on the compute stream (the device time of
a denoising loop's step); the last output is compared byte for byte with the resident one, and measured against it
(:func:`error_to_resident`: relative L2, max-abs and cosine, in float64 on the host; what FP8 shards cost).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import statistics
import time
from typing import Any, Callable

import torch

from benchmarks.repro.variants import REAL
from dlo_fn.io.memstat import process_memory

__all__ = [
    "OURS",
    "ACCELERATE",
    "PREQUANTIZED",
    "QUANTIZED_SUFFIX",
    "VARIANTS",
    "digest",
    "error_to_resident",
    "time_forwards",
    "measure",
    "ours_setup",
    "fastest_budget",
    "budget_facts",
    "diffusers_setup",
    "model_offload_setup",
    "device_map_setup",
    "release",
    "options_missing",
]

# Our variants: name -> offload() keyword arguments, from the one table of variants (a row there adds one).
OURS = {v.name: v.options for v in REAL if v.options is not None}
# accelerate's device map at a device budget (the peer users reach for): name -> max_memory of device 0.
ACCELERATE = {v.name: v.name.removeprefix("accelerate-") for v in REAL if v.name.startswith("accelerate-")}
# Variants that load the checkpoint `python -m dlo_fn quantize` wrote from the model's (once per run, timed as the
# entry's "quantized_checkpoint"), so their ready time is the FP8 bytes' and no rank quantises anything.
PREQUANTIZED = ("ours-fp8-prequantized",)
QUANTIZED_SUFFIX = "-fp8"
VARIANTS = tuple(v.name for v in REAL)  # run order (benchmarks.repro.variants)
GRAPH_WARMUP = 4  # block graphs: cold, warm, captured, replayed


def options_missing(kwargs: dict) -> list[str]:
    """The keys of ``kwargs`` that :class:`~dlo_fn.runtime.options.OffloadOptions` has no field for (a feature that
    has not landed yet)."""
    from dlo_fn.runtime.options import OffloadOptions

    fields = {f.name for f in dataclasses.fields(OffloadOptions)} | BENCH_OPTIONS
    return [k for k in kwargs if k not in fields]


BENCH_OPTIONS = {"device_tier"}  # what a row asks of its set-up, not of offload (ours_setup)


def digest(t: torch.Tensor) -> str:
    """SHA-256 of the tensor's bytes (on the host)."""
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def error_to_resident(out: torch.Tensor, want_host: torch.Tensor) -> dict:
    """A row's output against the resident one (kept on the host): ``rel_error_to_resident`` (0.0 for
    byte-identical outputs), ``max_abs_error_to_resident``, ``cosine_to_resident``
    (:func:`benchmarks.bench.fp8_quality.output_error`)."""
    from benchmarks.bench.fp8_quality import output_error

    err = output_error(out, want_host)
    return {
        "rel_error_to_resident": err.rel_l2,
        "max_abs_error_to_resident": err.max_abs,
        "cosine_to_resident": err.cosine,
    }


def release(platform) -> None:
    gc.collect()
    if platform.kind == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()


@torch.no_grad()
def time_forwards(
    platform, forward: Callable[[], torch.Tensor], warmup: int, repeats: int
) -> tuple[list[float], torch.Tensor]:
    """``repeats`` forwards back to back after ``warmup``, each timed with events on the compute stream; returns
    the seconds of each and the last output."""
    for _ in range(warmup):
        forward()
    platform.synchronize()
    stream = platform.current_stream()
    events = [(platform.new_event(timing=True), platform.new_event(timing=True)) for _ in range(repeats)]
    out = None
    for start, end in events:
        start.record(stream)
        out = forward()
        end.record(stream)
    platform.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in events], out


def _caching_pinned_bytes() -> int | None:
    """Bytes the caching host allocator holds pinned (``pin_memory()``: powers of two), where torch says."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_initialized():
        return None
    s = stats()
    for key in ("allocated_bytes.current", "allocated_bytes.all.current"):
        if key in s:
            return int(s[key])
    return None


def measure(
    platform,
    setup: Callable[[], tuple[Callable[[], torch.Tensor], dict, Callable[[], None]]],
    *,
    want: torch.Tensor | None,
    warmup: int,
    repeats: int,
    base_device_bytes: int | None = None,
    profile: Callable[[Callable[[], torch.Tensor], Any], dict | None] | None = None,
) -> dict:
    """Set up a variant (``setup()`` returns ``(forward, facts, teardown)``), time it to ready, sample memory,
    time the forwards, compare the output with ``want``; the variant is torn down and released before returning.
    A ``facts["after_ready"]`` callable runs once the clock has stopped (a probe; its dict joins the row). Peak
    device bytes are counted above ``base_device_bytes`` (default: what was allocated before the set-up).
    ``profile(forward, model)``: once timed, where the forward's time goes (``forward_profile``; ``bench real
    --block-spans`` and ``--profile``); the set-up's ``facts["model"]`` is the model it runs (never written)."""
    release(platform)
    before = process_memory()
    base_dev = platform.memory_allocated() if base_device_bytes is None else base_device_bytes
    base_pinned = _caching_pinned_bytes()
    platform.reset_peak_memory_stats()
    t0 = time.perf_counter()
    forward, facts, teardown = setup()
    try:
        platform.synchronize()
        ready_s = time.perf_counter() - t0
        after = process_memory()
        probe = facts.pop("after_ready", None)
        model = facts.pop("model", None)
        facts.update(probe() if probe is not None else {})
        row: dict[str, Any] = {
            "status": "ok",
            "ready_s": ready_s,
            "host_rss_before_bytes": before.rss_bytes,
            "host_rss_bytes": after.rss_bytes,
            "host_uss_bytes": after.uss_bytes,
            **facts,
        }
        if row.get("pinned_bytes") is None and base_pinned is not None:
            row["pinned_bytes"] = _caching_pinned_bytes() - base_pinned
        if repeats > 0:
            times, out = time_forwards(platform, forward, warmup, repeats)
            row.update(
                forward_s=statistics.median(times),
                forward_s_all=times,
                sha256=digest(out),
                finite=bool(torch.isfinite(out).all()),
                equal_to_resident=None if want is None else bool(torch.equal(out, want)),
            )
            row["output"] = out  # taken out by the caller (the resident reference), never written
            if profile is not None:
                row["forward_profile"] = profile(forward, model)
        row["peak_device_bytes"] = platform.max_memory_allocated() - base_dev
    finally:
        teardown()
        release(platform)
    return row


def ours_setup(
    ctx,
    folder: str,
    kwargs: dict,
    inputs: dict,
    probe_peak: bool = False,
    adapters: tuple = (),
    adapter_counts: tuple[int, int, str] = (1, 3, "ours-lora"),
):
    """``load_model`` + ``offload``: the public API, timed in parts; ``probe_peak``: the pinned H2D peak from the
    arena, once ready; ``adapters``: once ready, the forward timed without one (``adapter_counts``: warm-up,
    repeats, the row's name), then LoRA files loaded, switched and one removed
    (:func:`benchmarks.bench.real_lora.adapter_work`), the forwards then run with the first."""
    from dlo_fn.io.load import load_model
    from dlo_fn.runtime.offload import offload

    fastest = kwargs.get("hbm_budget") == "fastest"
    host_only = kwargs.get("device_tier") is False
    kwargs = {k: v for k, v in kwargs.items() if k != "device_tier"}

    def setup():
        t0 = time.perf_counter()
        model = load_model(folder, progress=False)
        t1 = time.perf_counter()
        # mode="auto" or a budget: one call on the inputs, timed through the plain probe, chooses or places
        auto = any(v == "auto" for v in kwargs.values()) or "hbm_budget" in kwargs
        options = dict(kwargs, hbm_budget=fastest_budget(model, ctx, kwargs, inputs)) if fastest else kwargs
        placed = {"example": inputs} if auto else {}
        if host_only:  # the same measured placement without the device's rate: no device-stored tier
            placed = {"placement": dataclasses.replace(_placement(model, ctx, inputs), device_bytes_per_s=None)}
        o = offload(model, ctx=ctx, **options, **placed)
        ctx.platform.synchronize()
        t2 = time.perf_counter()
        store = o.store
        facts = {
            "load_s": t1 - t0,
            "offload_s": t2 - t1,
            "pinned_bytes": o.pinned_host_bytes,
            "arena_bytes": store.arena_bytes if store else 0,
            "pinning": store.how if store else None,
            "num_slots": o.executor.num_slots if o.executor else 0,
            # W = 1, every streamed block in the arena: one pass moves the arena (FP8: its stored bytes)
            "h2d_bytes_per_forward": store.arena_bytes if store else 0,
            "store": store.timings if store else None,
            # offload's work besides filling the store (layout, slots, moving the rest, closing the mapping)
            "offload_other_s": t2 - t1 - ((store.timings if store else None) or {}).get("total_s", 0.0),
            "weight_device_bytes": o.device_weight_bytes,
            "resident_blocks": len(o.resident_blocks) if o.executor else len(o.spec.blocks),
            "num_blocks": len(o.spec.blocks),
            "options": {k: str(v) for k, v in kwargs.items()},
            "chosen": str(getattr(o, "auto", None)) if kwargs.get("mode") == "auto" else None,
            **budget_facts(o),
            "model": o.model,
        }
        if probe_peak and ctx.platform.kind == "cuda" and store and store.pinned:
            from benchmarks.bench.step_variants import pinned_peak_bytes_per_s

            facts["after_ready"] = lambda: {
                "arena_h2d_peak_bytes_per_s": pinned_peak_bytes_per_s(ctx.platform, store, o.layout)
            }
        if adapters:
            from benchmarks.bench.real_lora import adapter_work

            peak = facts.pop("after_ready", dict)
            facts["after_ready"] = lambda: {
                **peak(),
                **adapter_work(o, adapters, ctx.platform, forward, time_without, adapter_counts[2]),
            }

        def forward():
            return o.model(**inputs)[0]

        def time_without() -> list[float]:
            return time_forwards(ctx.platform, forward, *adapter_counts[:2])[0]

        def teardown():
            o.synchronize()
            if o.store is not None:
                o.store.close()

        return forward, facts, teardown

    return setup


def _placement(model, ctx, inputs: dict):
    """What ``offload(..., example=inputs)`` places a budget's blocks by
    (:func:`dlo_fn.runtime.budget.block_compute`)."""
    from dlo_fn.io.diffusers_load import block_paths_for
    from dlo_fn.plan.spec import normalize_block_paths, spec_from_module
    from dlo_fn.runtime.budget import block_compute

    paths = normalize_block_paths(block_paths_for(model))
    blocks = [b for path in paths for b in model.get_submodule(path)]
    return block_compute(model, blocks, spec_from_module(model, paths), ctx, None, inputs)


def fastest_budget(model, ctx, kwargs: dict, inputs: dict) -> int:
    """The device weight bytes of the model's fastest point (:func:`dlo_fn.plan.resident.at_speed` on the frontier
    priced with one timed call's block compute), rank-local on one device."""
    from dlo_fn.io.diffusers_load import block_paths_for
    from dlo_fn.plan.resident import at_speed, frontier, layout_for
    from dlo_fn.plan.spec import normalize_block_paths, spec_from_module

    spec = spec_from_module(model, normalize_block_paths(block_paths_for(model)))
    placed = _placement(model, ctx, inputs)
    q = kwargs.get("quantization")
    plans = frontier(
        spec,
        lambda s: layout_for(s, 1, quantization=q),
        kwargs.get("num_slots", 2),
        0,
        **placed.plan_inputs(),
    )
    return at_speed(plans).device_weight_bytes


def budget_facts(o) -> dict:
    """A budget row's plan: how it was placed, its slots, its predicted pass over the blocks' compute, and the
    compute and link it was placed by (the notebook's frontier reads them)."""
    if o.options.hbm_budget is None:
        return {}
    placed = o.placement
    facts = {
        "placed_by": placed.source if placed else "bytes",
        "plan_num_slots": o.budget.num_slots,
        "resident_block_ids": list(o.budget.resident),
        "device_stored_block_ids": list(o.budget.device_stored),
    }
    if placed is not None:
        facts.update(
            predicted_pass_s=o.budget.pass_s,
            blocks_compute_s=sum(placed.compute_s),
            predicted_to_compute=o.budget.pass_s / sum(placed.compute_s),
            block_compute_s=list(placed.compute_s),
            placement_link_bytes_per_s=placed.link_bytes_per_s,
            placement_device_bytes_per_s=placed.device_bytes_per_s,
        )
    return facts


def diffusers_setup(platform, folder: str, cls_name: str, offload_type: str, inputs: dict):
    """diffusers group offloading as its docs show it, from the folder."""
    import diffusers

    def setup():
        cls = getattr(diffusers, cls_name)
        t0 = time.perf_counter()
        model = cls.from_pretrained(folder, torch_dtype=torch.bfloat16)
        t1 = time.perf_counter()
        use_stream = platform.is_accelerator
        kw = dict(num_blocks_per_group=1) if offload_type == "block_level" else {}
        model.enable_group_offload(
            onload_device=platform.device,
            offload_device=torch.device("cpu"),
            offload_type=offload_type,
            use_stream=use_stream,
            **kw,
        )
        facts = {
            "load_s": t1 - t0,
            "offload_s": time.perf_counter() - t1,
            "use_stream": use_stream,
            "options": {"offload_type": offload_type, **{k: str(v) for k, v in kw.items()}},
        }
        return (lambda: model(**inputs)[0]), facts, (lambda: None)

    return setup


def model_offload_setup(platform, folder: str, cls_name: str, inputs: dict):
    """The whole model to the device for each forward and back after it (accelerate's hook, as diffusers' model
    CPU offload installs it; the pipeline calls ``offload()`` at the end of every request)."""
    import diffusers
    from accelerate import cpu_offload_with_hook

    def setup():
        t0 = time.perf_counter()
        model = getattr(diffusers, cls_name).from_pretrained(folder, torch_dtype=torch.bfloat16)
        t1 = time.perf_counter()
        _, hook = cpu_offload_with_hook(model, platform.device)
        there, back = [], []  # per forward (warm-up first): to the device and the forward; back to the host

        def forward():
            t = time.perf_counter()
            out = model(**inputs)[0]
            platform.synchronize()  # the move back waits for the forward anyway; this only splits the time
            there.append(time.perf_counter() - t)
            hook.offload()
            back.append(time.perf_counter() - t - there[-1])
            return out

        facts = {
            "load_s": t1 - t0,
            "offload_s": time.perf_counter() - t1,
            "pinned_bytes": 0,
            "to_device_and_forward_s_all": there,
            "back_to_host_s_all": back,
        }
        return forward, facts, (lambda: None)

    return setup


def device_map_setup(platform, folder: str, cls_name: str, max_memory: str, inputs: dict):
    """accelerate's device map within ``max_memory`` of the device (the rest on the host, moved at each forward),
    as ``from_pretrained(..., device_map="auto", max_memory=...)`` sets it up."""
    import diffusers

    def setup():
        t0 = time.perf_counter()
        index = platform.device.index or 0 if platform.kind == "cuda" else "cpu"
        # Off CUDA, the host only: "auto" would otherwise place layers on a GPU the machine happens to have.
        budget = {index: max_memory, "cpu": "400GiB"} if platform.kind == "cuda" else {"cpu": "400GiB"}
        model = getattr(diffusers, cls_name).from_pretrained(
            folder, torch_dtype=torch.bfloat16, device_map="auto", max_memory=budget
        )
        on_device = sum(
            p.numel() * p.element_size() for p in model.parameters() if p.device.type == platform.device.type
        )
        facts = {
            "load_s": time.perf_counter() - t0,
            "offload_s": 0.0,
            "weight_device_bytes": on_device,
            "options": {"device_map": "auto", "max_memory": str(budget)},
            "model": model,
        }
        return (lambda: model(**inputs)[0]), facts, (lambda: None)

    return setup
