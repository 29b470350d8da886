"""One rank of a W-rank allgather set-up in `bench real` (``ranks-W``): W gloo ranks sharing the device, each timed
from ``load_model`` to ready and set against the floor for its share (:func:`dlo_fn.bench.real_ready.measure_floor`),
every rank at once, after one forward compared byte for byte with the resident output."""

from __future__ import annotations

import gc
import pathlib
import time

import torch

from dlo_fn.bench.real_ready import measure_floor

__all__ = ["rank_ready"]


def rank_ready(ctx, folder: str, device: str, ref_path: str) -> dict:
    """One rank of a W-rank allgather set-up (run by :func:`dlo_fn.serve.ranks.run_ranks`): time to ready, memory,
    one forward compared with the resident output, then the floor for its share, every rank at once."""
    import dataclasses

    import torch.distributed as dist

    from dlo_fn.bench.real_variants import digest

    from dlo_fn.io.load import load_model
    from dlo_fn.io.memstat import process_memory
    from dlo_fn.runtime.offload import offload
    from dlo_fn.runtime.platform import Platform

    if device == "cuda":  # every rank on the one GPU, over gloo
        torch.cuda.set_device(0)
        ctx = dataclasses.replace(ctx, platform=Platform("cuda", torch.device("cuda", 0), "gloo"))
        torch.empty(1, device="cuda")  # the CUDA context is made before the clock starts
    import diffusers  # noqa: F401  the libraries a user's process has imported already: not part of the set-up

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
    with torch.no_grad():
        got = o.model(**inputs)[0].cpu()
    out = {"rank": ctx.rank, "ready_s": t2 - t0, "load_s": t1 - t0, "offload_s": t2 - t1,
           "store": o.store.timings, "arena_bytes": o.store.arena_bytes,
           "pinned_bytes": o.pinned_host_bytes, "host_rss_bytes": mem.rss_bytes, "host_uss_bytes": mem.uss_bytes,
           "num_shards": o.layout.num_shards, "equal_to_resident": bool(torch.equal(got, ref["want"])),
           "sha256": digest(got)}
    arena = o.store.arena_bytes
    o.synchronize()
    o.store.close()
    del o, model, inputs, got
    gc.collect()
    dist.barrier(ctx.group)
    out["floor"] = measure_floor(platform, arena, files, share=(ctx.rank, ctx.world_size), untouched=False,
                                 hugepages=False)
    out["ready_over_floor"] = out["ready_s"] / out["floor"]["floor_s"]
    return out
