"""`python -m benchmarks bench load --phases`: what each of N real gloo ranks holds, phase by phase, vs the plan.

Each rank (a fresh process, :func:`dlo_fn.runtime.dist.run_ranks`) loads the checkpoint (mmap views), offloads
it (``allgather``, ``rank-local`` with its pinned copy, or ``rank-local-mmap``) and generates one tiny request;
at each phase every rank waits at a barrier, reads its own ``/proc/self/smaps_rollup`` (RSS, USS, PSS, VmHWM)
and the RSS of its checkpoint mappings, and waits again, so the sum of PSS is over ranks in the same phase:

    load      the model bound (views), no weight page read: the process constant c of the model
    fill      the host store filled, the mapping still open (sampled just before the release)
    offload   offload() returned: the mapping closed
    generate  after one request (slots and landing buffers used)

The constant ``c`` is the mean of the ranks' ``load`` row (the ``ProcessConstant`` of
:func:`dlo_fn.cost.rank_memory.rank_memory`); every later phase is predicted from it and the plan's sizes.
``--device cuda`` runs the N ranks on one GPU over gloo (memory only: such timings are no performance figure).
"""

from __future__ import annotations

import dataclasses
import datetime

from dlo_fn.io.memstat import format_bytes, host_description

__all__ = ["PHASE_FIELDS", "MODES", "rank_phases", "run_phases", "phase_rows", "print_rows"]

MODES = ("allgather", "rank-local", "rank-local-mmap")
PHASE_FIELDS = (
    "machine",
    "checkpoint",
    "command",
    "date",
    "device",
    "mode",
    "ranks",
    "phase",
    "rss_bytes",
    "uss_bytes",
    "pss_bytes",
    "hwm_bytes",
    "sum_pss_bytes",
    "file_rss_bytes",
    "predicted_rss_bytes",
    "predicted_uss_bytes",
    "predicted_pss_bytes",
    "predicted_hwm_bytes",
    "predicted_sum_pss_bytes",
    "arena_bytes",
    "pinned_bytes",
    "planned_arena_bytes",
)


def _sample(ctx, files, tag: str, out: list) -> None:
    import torch.distributed as dist

    from dlo_fn.io.memstat import mapped_file_memory, process_memory

    if ctx.group is not None:
        dist.barrier(ctx.group)
    m = process_memory()
    out.append((tag, m.rss_bytes, m.uss_bytes, m.pss_bytes, m.hwm_bytes, mapped_file_memory(files)["rss_bytes"]))
    if ctx.group is not None:
        dist.barrier(ctx.group)


def rank_phases(ctx, checkpoint: str, mode: str, device: str) -> dict:
    """One rank's samples (run by :func:`run_phases` in each process)."""
    import torch

    import dlo_fn.runtime.offload as offload_mod
    from dlo_fn.io.checkpoint import open_checkpoint
    from dlo_fn.io.load import load_checkpoint
    from dlo_fn.models import BLOCK_PATHS, Request, generate
    from dlo_fn.runtime.platform import Platform

    if device == "cuda":  # every rank on the one GPU, over gloo (memory only)
        torch.cuda.set_device(0)
        ctx = dataclasses.replace(ctx, platform=Platform("cuda", torch.device("cuda", 0), "gloo"))
        torch.empty(1, device="cuda")  # the CUDA context belongs to the constant
    files = [str(f) for f in open_checkpoint(checkpoint).files]
    samples: list = []
    model, _ = load_checkpoint(checkpoint, None, progress=False)
    _sample(ctx, files, "load", samples)
    release = offload_mod.release_mapped_tensors

    def sampled_release(*args, **kwargs):  # instrumentation: the "fill" sample is taken just before the release
        _sample(ctx, files, "fill", samples)
        return release(*args, **kwargs)

    offload_mod.release_mapped_tensors = sampled_release
    try:
        source = "mmap" if mode == "rank-local-mmap" else "pinned"
        o = offload_mod.offload(
            model, BLOCK_PATHS, ctx, mode="allgather" if mode == "allgather" else "rank-local", rank_local_source=source
        )
    finally:
        offload_mod.release_mapped_tensors = release
    if mode == "rank-local-mmap":  # no release: the store streams from the mapping
        _sample(ctx, files, "fill", samples)
    _sample(ctx, files, "offload", samples)
    with torch.no_grad():
        generate(
            o.model, Request(prompt="a fox", seed=ctx.rank, num_inference_steps=1, height=32, width=32, num_frames=5)
        )
    o.synchronize()
    _sample(ctx, files, "generate", samples)
    return {
        "samples": samples,
        "arena_bytes": o.store.arena_bytes,
        "pinned_bytes": o.pinned_host_bytes,
        "planned_arena_bytes": o.layout.shard_bytes_per_rank if source == "pinned" else 0,
    }


def run_phases(checkpoint: str, ranks: int, mode: str, device: str = "cpu", timeout_s: float = 600.0) -> list[dict]:
    """Every rank's result of :func:`rank_phases` (rank order)."""
    from dlo_fn.serve.ranks import run_ranks

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return run_ranks(rank_phases, ranks, checkpoint, mode, device, timeout_s=timeout_s)


def phase_rows(checkpoint: str, ranks: int, mode: str, results: list[dict], device: str, meta: dict) -> list[dict]:
    """One CSV row per (rank-averaged) phase, with the plan's prediction from the measured ``load`` constant."""
    from dlo_fn.cost.rank_memory import ProcessConstant, gloo_cuda_staging_bytes, rank_memory
    from dlo_fn.io.sources import spec_for
    from dlo_fn.plan.sizes import ModelSizes

    n = len(results)
    by_phase: dict[str, list] = {}
    for r in results:
        for tag, *vals in r["samples"]:
            by_phase.setdefault(tag, []).append(vals)
    mean = {tag: [sum(v[i] for v in vals) // n for i in range(5)] for tag, vals in by_phase.items()}
    sums = {tag: sum(v[2] for v in vals) for tag, vals in by_phase.items()}
    c = ProcessConstant(*mean["load"][:3])
    sizes = ModelSizes.from_spec(spec_for(checkpoint))
    gloo = device == "cuda" and mode == "allgather" and ranks > 1  # the ranks share the GPU over gloo
    plan = rank_memory(
        sizes,
        ranks,
        mode,
        device,
        constant=c,
        staging_bytes=gloo_cuda_staging_bytes(sizes, ranks) * gloo,
        process_group=True,
    )  # run_ranks always makes one, even for N = 1
    rows = []
    for p in plan.phases:
        rss, uss, pss, hwm, file_rss = mean[p.phase]
        rows.append(
            {
                **meta,
                "device": device,
                "mode": mode,
                "ranks": ranks,
                "phase": p.phase,
                "rss_bytes": rss,
                "uss_bytes": uss,
                "pss_bytes": pss,
                "hwm_bytes": hwm,
                "sum_pss_bytes": sums[p.phase],
                "file_rss_bytes": file_rss,
                "predicted_rss_bytes": p.rss_bytes,
                "predicted_uss_bytes": p.uss_bytes,
                "predicted_pss_bytes": p.pss_bytes,
                "predicted_hwm_bytes": p.hwm_bytes,
                "predicted_sum_pss_bytes": p.sum_pss_bytes,
                "arena_bytes": results[0]["arena_bytes"],
                "pinned_bytes": results[0]["pinned_bytes"],
                "planned_arena_bytes": results[0]["planned_arena_bytes"],
            }
        )
    return rows


def sweep(
    checkpoint: str, ranks: list[int], modes: list[str], device: str, command: str, describe: str, timeout_s: float
) -> list[dict]:
    meta = {
        "machine": host_description() + (f", {_gpu()}" if device == "cuda" else ""),
        "checkpoint": describe,
        "command": command,
        "date": datetime.date.today().isoformat(),
    }
    rows = []
    for mode in modes:
        for n in ranks:
            rows += phase_rows(checkpoint, n, mode, run_phases(checkpoint, n, mode, device, timeout_s), device, meta)
    return rows


def _gpu() -> str:
    import torch

    return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}; ranks share it over gloo)"


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'mode':16} {'N':>2} {'phase':9} {'RSS':>9} {'pred':>9} {'USS':>9} {'pred':>9} {'PSS':>9} "
        f"{'pred':>9} {'HWM':>9} {'pred':>9} {'sumPSS':>9} {'pred':>9} worst"
    )
    for r in rows:
        pairs = [(r[k + "_bytes"], r["predicted_" + k + "_bytes"]) for k in ("rss", "uss", "pss", "hwm", "sum_pss")]
        worst = max(abs(p / m - 1) for m, p in pairs if m)
        print(
            f"{r['mode']:16} {r['ranks']:>2} {r['phase']:9} "
            + " ".join(f"{format_bytes(m):>9} {format_bytes(p):>9}" for m, p in pairs)
            + f" {worst:+.1%}"
        )
