"""One rank of a W-rank allgather set-up in `bench real` (``ranks-W``): W gloo ranks sharing the device, each timed from
``load_model`` to ready and set against the floor for its share (:func:`benchmarks.bench.real_ready.measure_floor`),
every rank at once, after one forward compared byte for byte with the resident output.

Ready is timed from the call to ``load_model`` (``ready_from``), as the rank-local rows of the same run are: the
process has started, imported torch and the model's class and joined the process group. Those come first and are
recorded beside it, with each phase of ``offload`` (:attr:`dlo_fn.runtime.offload.Offloaded.timings`):

    start_s          the parent's spawn to the rank's function: Python, torch, the process group
    import_s         the model's diffusers class imported (diffusers imports it lazily: in a fresh process about
                     2 s of 2.4 s of a first ``load_model`` on a 2-core host, all of it outside the load)
    load_s           load_model: the model built on meta, every weight a view of the mapped files
    offload          describe_s, digest_s, store_s, warm_up_s, executor_s, to_device_s, release_s
    first_forward_s  the forward after ready (its all-gathers' first host staging on gloo over CUDA tensors)
"""

from __future__ import annotations

import gc
import json
import pathlib
import time

import torch

from benchmarks.bench.real_ready import measure_floor

__all__ = ["rank_ready", "READY_FROM"]

READY_FROM = "the call to load_model (process started, torch and the model's class imported, process group joined)"


def _import_class(folder: str) -> float:
    """Import the diffusers class ``folder``'s config names (what a user's process has done before it loads)."""
    import diffusers

    t0 = time.perf_counter()
    name = json.loads((pathlib.Path(folder) / "config.json").read_text()).get("_class_name")
    if name:
        getattr(diffusers, name)
    return time.perf_counter() - t0


def rank_ready(ctx, folder: str, device: str, ref_path: str, spawned_at: float | None = None) -> dict:
    """One rank of a W-rank allgather set-up (run by :func:`dlo_fn.serve.ranks.run_ranks`): time to ready, its
    phases, memory, one forward compared with the resident output, then the floor for its share, every rank at
    once. ``spawned_at``: the parent's ``time.time()`` when it started the ranks."""
    import dataclasses

    import torch.distributed as dist

    from benchmarks.bench.real_variants import digest
    from dlo_fn.io.load import load_model
    from dlo_fn.io.memstat import process_memory
    from dlo_fn.runtime.offload import offload
    from dlo_fn.runtime.platform import Platform

    start_s = time.time() - spawned_at if spawned_at is not None else None
    if device == "cuda":  # every rank on the one GPU, over gloo
        torch.cuda.set_device(0)
        ctx = dataclasses.replace(ctx, platform=Platform("cuda", torch.device("cuda", 0), "gloo"))
        torch.empty(1, device="cuda")  # the CUDA context is made before the clock starts
    import_s = _import_class(folder)

    platform = ctx.platform
    files = sorted(pathlib.Path(folder).glob("*.safetensors"))
    dist.barrier(ctx.group)
    t0 = time.perf_counter()
    model = load_model(folder, progress=False)
    t1 = time.perf_counter()
    o = offload(model, ctx=ctx, mode="allgather")
    platform.synchronize()
    t2 = time.perf_counter()
    mem = process_memory()
    ref = torch.load(ref_path, weights_only=True)
    inputs = {k: v.to(platform.device) if torch.is_tensor(v) else v for k, v in ref["inputs"].items()}
    t3 = time.perf_counter()
    with torch.no_grad():
        got = o.model(**inputs)[0].cpu()
    first_forward_s = time.perf_counter() - t3
    out = {
        "rank": ctx.rank,
        "ready_s": t2 - t0,
        "ready_from": READY_FROM,
        "start_s": start_s,
        "import_s": import_s,
        "load_s": t1 - t0,
        "offload_s": t2 - t1,
        "offload": o.timings,
        "store": o.store.timings,
        "first_forward_s": first_forward_s,
        "arena_bytes": o.store.arena_bytes,
        "pinned_bytes": o.pinned_host_bytes,
        "host_rss_bytes": mem.rss_bytes,
        "host_uss_bytes": mem.uss_bytes,
        "num_shards": o.layout.num_shards,
        "equal_to_resident": bool(torch.equal(got, ref["want"])),
        "sha256": digest(got),
    }
    arena = o.store.arena_bytes
    o.synchronize()
    o.store.close()
    del o, model, inputs, got
    gc.collect()
    dist.barrier(ctx.group)
    out["floor"] = measure_floor(platform, arena, files, share=(ctx.rank, ctx.world_size), untouched=False)
    out["ready_over_floor"] = out["ready_s"] / out["floor"]["floor_s"]
    return out
