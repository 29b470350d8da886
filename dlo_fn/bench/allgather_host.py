"""The executor's host time per block in allgather mode with the all-gather as a collective, on one GPU.

``python -m dlo_fn.bench.allgather_host`` runs bench step's dispatch method (bench-narrow blocks, 64 tokens: the
device keeps up, the host timer sees host work) in allgather mode, in two set-ups that fit one GPU:

* **two ranks joined by gloo** sharing the GPU, each block sharded over both (W = 2): every rank's output is
  checked ``torch.equal`` to its resident blocks. gloo gathers CUDA tensors through the host (a copy out, an
  exchange, a copy back: milliseconds), which says nothing about NCCL and leaves the host's caches cold;
* **one rank on a NCCL group** with the allgather op sequence kept (``Executor(gather_one_rank=True)``: a group of
  one is otherwise lowered to the rank-local sequence): the W > 1 program op for op, its all-gathers real NCCL
  calls (over one rank, a copy), so the host work per block is that of W > 1 less the traffic of more GPUs.

Per variant (the torch-event loop; the driver-call path at load groups G = 1 / 2 / 4 with c10d's all-gather; on
the NCCL rank also the same with the executor's own communicator, ``own*``: bound ``ncclAllGather`` calls,
:mod:`dlo_fn.runtime.nccl_raw`, and the step graph, c10d's NCCL all-gathers captured; a load group on the grouped
shard layout, one all-gather per group, and ``own-g4-perblock`` on the per-block one, four)::

    proxy_host_us_per_block       the executor's host time outside the block calls, per block (ExecutorStats)
    collective_call_us_per_block  of which inside the process group's all-gather calls (timed around each call)
    executor_own_us_per_block     the difference: what the executor adds besides the collective calls

and the host microseconds of one NCCL all-gather call as the executor makes it (``runtime.dist.bound_all_gather``,
the all-gather stream made current and the compute stream restored), single and coalesced over G blocks, next to
``torch.distributed``'s wrapper and the own communicator's bound calls (``own_call_G*``). Written with machine,
command, date. On a CPU (``--quick``, the tests) only the
gloo part runs, its driver variants on :class:`~dlo_fn.bench.hostloop.HostDriver` (the driver-call path's Python;
copies are memmoves).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Any

import torch

__all__ = ["VARIANTS", "measure", "main"]

# name -> (driver calls, load group, step graphs, own NCCL communicator, grouped shard layout); "graph" and "own*":
# the one-rank NCCL part only (gloo is not capturable, and has no NCCL communicator). "driver*" call c10d's
# all-gather (DLO_FN_RAW_NCCL=0), "own*" the executor's own communicator (runtime.nccl_raw). A load group runs on
# the grouped shard layout (one all-gather per group, plan.layout), as offload() builds it where G divides the
# blocks; "*-perblock" on the per-block layout (G all-gathers per group, in one launch).
VARIANTS = {"torch-events": (False, 1, False, False, False), "driver": (True, 1, False, False, False),
            "driver-g2": (True, 2, False, False, True), "driver-g4": (True, 4, False, False, True),
            "own": (True, 1, False, True, False), "own-g2": (True, 2, False, True, True),
            "own-g4": (True, 4, False, True, True), "own-g8": (True, 8, False, True, True),
            "own-g4-perblock": (True, 4, False, True, False), "graph": (True, 1, True, False, False)}


def _timed(fn: Any, acc: list[float]) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += time.perf_counter() - t0
    return call


def _rank(ctx: Any, config: str, variants: tuple[str, ...], quick: bool, one_rank: bool = False) -> dict:
    """The dispatch rows of ``variants`` on this rank (gloo ranks sharing GPU 0, or ``one_rank``: a NCCL group of
    one, the allgather op sequence kept)."""
    import dlo_fn.runtime.executor as executor_mod
    import dlo_fn.runtime.issue as issue_mod
    import dlo_fn.runtime.nccl_raw as nccl_raw
    from dlo_fn.bench import step_variants as sv
    from dlo_fn.bench.hostloop import HostDriver
    from dlo_fn.bench.step_dispatch import DISPATCH_SIZE
    from dlo_fn.models import BLOCK_PATHS
    from dlo_fn.plan.layout import grouped_layout_problem, model_layout
    from dlo_fn.plan.spec import spec_from_module
    from dlo_fn.runtime.blocks import strip_block
    from dlo_fn.runtime.host_store import build_host_store
    from dlo_fn.runtime.platform import Platform
    from dlo_fn.runtime.program import Programs

    torch.set_num_threads(1)
    platform = ctx.platform
    if torch.cuda.is_available() and not platform.is_accelerator:  # gloo ranks, all on GPU 0
        torch.cuda.set_device(0)
        platform = Platform("cuda", torch.device("cuda", 0), "gloo")
    cfg = config if quick else sv.narrow_config(config)
    model = sv.random_model(cfg, platform.device)
    x, kwargs, tokens = sv.block_inputs(model, *((32, 32, 1) if quick else DISPATCH_SIZE), platform.device)
    blocks = list(model.blocks)
    spec = spec_from_module(model, BLOCK_PATHS)
    layout = model_layout(spec, ctx.world_size)
    # one layout per load group the variants lay out per group (plan.layout: its arena holds the group's chunks)
    layouts = {1: layout} | {VARIANTS[v][1]: model_layout(spec, ctx.world_size, load_group=VARIANTS[v][1])
                             for v in variants
                             if VARIANTS[v][4] and grouped_layout_problem(spec.num_blocks, VARIANTS[v][1]) is None}
    reps = dict(warmup=2, repeats=3) if quick else dict(warmup=sv.GRAPH_WARMUP, repeats=31)
    resident_blocks = [copy.deepcopy(b) for b in blocks]

    def resident_pass(x: torch.Tensor, kw: dict) -> torch.Tensor:
        for block in resident_blocks:
            x = block(x, **kw)
        return x

    acc = [0.0]
    bound, pairs, handle = executor_mod.bound_all_gather, issue_mod.all_gather_pairs, executor_mod.stream_handle
    own_bind = nccl_raw.NcclComm.bind
    executor_mod.bound_all_gather = lambda p, g: _timed(bound(p, g), acc)
    issue_mod.all_gather_pairs = _timed(pairs, acc)
    # the own communicator's bound calls, each timed (a Python frame around each ctypes call: ~0.2 us more)
    nccl_raw.NcclComm.bind = lambda comm, p, st: tuple((_timed(fn, acc), a) for fn, a in own_bind(comm, p, st))
    rows: dict[str, dict] = {}
    try:
        with torch.no_grad():
            want = resident_pass(x, kwargs)
            tensors, aliases = sv.block_states(blocks)
            stores = {g: build_host_store(lay, ctx.rank, tensors, platform) for g, lay in layouts.items()}
            del tensors
            for block in blocks:
                strip_block(block, platform.device)
            for name in variants:
                driver, group, graph, own, grouped = VARIANTS[name]
                if (graph or own) and not (one_rank and platform.kind == "cuda"):
                    continue
                lay = layouts.get(group if grouped else 1)
                if lay is None:
                    continue  # G does not divide the blocks
                os.environ["DLO_FN_RAW_CUDA"] = "1" if driver else "0"  # read when the executor is built
                os.environ[nccl_raw.RAW_NCCL_ENV] = "1" if own else "0"
                run_pass, ex = sv.executor_pass(platform, lay, stores[lay.load_group], blocks, aliases,
                                                mode="allgather",
                                                group=ctx.group, block_call="swap", load_group=group, graph=graph,
                                                gather_one_rank=one_rank)
                if driver and not platform.is_accelerator:  # the driver-call path's Python, on the host's driver
                    executor_mod.stream_handle = id
                    ex._raw, ex._programs = HostDriver(), Programs(ex._compile)
                equal = torch.equal(run_pass(x, kwargs), want)

                def reset() -> None:
                    ex.stats.reset()
                    acc[0] = 0.0

                host, delta = sv.host_pass_delta_s(platform, run_pass, resident_pass, x, kwargs, reset=reset, **reps)
                n = max(ex.stats.computes, 1)
                proxy, coll = ex.stats.issue_us_per_compute, 1e6 * acc[0] / n
                if ex._gather_group is None:
                    raise RuntimeError("internal: the executor runs no all-gather")
                if (ex._nccl is not None) != own:
                    raise RuntimeError(f"internal: variant {name} wants own_nccl={own}, the executor has "
                                       f"{ex._nccl is not None}")
                rows[name] = {"driver_calls": ex._raw is not None, "host_driver": isinstance(ex._raw, HostDriver),
                              "own_nccl": own, "layout_load_group": lay.load_group,
                              "load_group": group, "graph_replays": ex.graphs.replays if ex.graphs else 0,
                              "num_slots": ex.num_slots, "num_landing": ex.num_landing,
                              "proxy_host_us_per_block": proxy,
                              "collective_call_us_per_block": coll, "executor_own_us_per_block": proxy - coll,
                              "dispatch_us_per_block": 1e6 * delta / layout.num_blocks, "pass_host_s": host,
                              "equal_to_resident": equal}
                ex.release()
    finally:
        executor_mod.bound_all_gather, issue_mod.all_gather_pairs = bound, pairs
        executor_mod.stream_handle, nccl_raw.NcclComm.bind = handle, own_bind
        os.environ.pop("DLO_FN_RAW_CUDA", None)
        os.environ.pop(nccl_raw.RAW_NCCL_ENV, None)
    return {"rank": ctx.rank, "platform": platform.kind, "backend": platform.backend, "num_blocks": layout.num_blocks,
            "tensors_per_block": len(layout.shards[0].block.placements), "tokens_per_sample": tokens,
            "shard_bytes": layout.shards[0].shard_bytes, "config": getattr(cfg, "name", cfg), "variants": rows}


def _nccl_calls(ctx: Any, shard_bytes: int, groups: tuple[int, ...], calls: int) -> dict:
    """Host microseconds per all-gather call on a one-rank NCCL group: the executor's bound call (with the
    all-gather stream made current and the compute stream restored, as the executor does) for G blocks at once,
    and ``torch.distributed``'s wrapper for one block."""
    import torch.distributed as dist

    from dlo_fn.runtime.dist import all_gather_bytes, bound_all_gather
    from dlo_fn.runtime.nccl_raw import own_communicator

    platform = ctx.platform
    side, main_stream = torch.cuda.Stream(), torch.cuda.current_stream()
    set_stream = platform.stream_setter()
    out: dict[str, float] = {}

    def time_calls(fn: Any) -> float:
        rounds = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls // 5):
                fn()
            rounds.append(1e6 * (time.perf_counter() - t0) / (calls // 5))
        torch.cuda.synchronize()
        return statistics.median(rounds)

    def new_pairs(g: int) -> list[tuple[torch.Tensor, torch.Tensor]]:  # (output, input): over one rank, a copy
        return [(torch.zeros(shard_bytes, dtype=torch.uint8, device="cuda"),
                 torch.randint(0, 256, (shard_bytes,), dtype=torch.uint8, device="cuda")) for _ in range(g)]

    gathered = {}
    for g in groups:
        pairs = new_pairs(g)
        call = bound_all_gather(pairs, ctx.group)
        set_stream(side)
        call()  # once, checked: the gather over one rank is a copy
        set_stream(main_stream)
        torch.cuda.synchronize()
        gathered[f"G{g}"] = all(torch.equal(o, i) for o, i in pairs)

        def executor_call() -> None:
            set_stream(side)
            call()
            set_stream(main_stream)

        for _ in range(50):
            executor_call()
        out[f"bound_call_G{g}"] = time_calls(executor_call)
    o, i = pairs[0]
    for _ in range(50):
        all_gather_bytes(o, i, ctx.group)
    out["torch_distributed_wrapper_G1"] = time_calls(lambda: all_gather_bytes(o, i, ctx.group))
    comm, why = own_communicator(ctx.group, platform.device, True)
    if comm is None:
        raise RuntimeError(f"no own NCCL communicator: {why}")
    for g in groups:  # the executor's own communicator: its bound ncclAllGather calls on the side stream
        pairs = new_pairs(g)
        calls_g = comm.bind(pairs, side.cuda_stream)

        def own_call() -> None:
            for fn, a in calls_g:
                if fn(*a):
                    raise RuntimeError("ncclAllGather failed")

        own_call()
        torch.cuda.synchronize()
        gathered[f"own_G{g}"] = all(torch.equal(o, i) for o, i in pairs)
        for _ in range(50):
            own_call()
        out[f"own_call_G{g}"] = time_calls(own_call)
    comm.close()
    return {"backend": dist.get_backend(ctx.group), "world_size": ctx.world_size, "shard_bytes": shard_bytes,
            "calls": calls, "host_us_per_call": out, "gathered_equal": gathered}


def _nccl_rank(ctx: Any, config: str, variants: tuple[str, ...], quick: bool, shard_bytes: int) -> dict:
    return {"executor": _rank(ctx, config, variants, quick, one_rank=True),
            "calls": _nccl_calls(ctx, shard_bytes, tuple(sorted({VARIANTS[v][1] for v in variants})),
                                 50 if quick else 2000)}


def _summary(per_rank: list[dict], variants: tuple[str, ...]) -> dict:
    out = {k: per_rank[0][k] for k in ("platform", "backend", "num_blocks", "tensors_per_block", "tokens_per_sample",
                                       "shard_bytes", "config")}
    out["world_size"] = len(per_rank)
    out["by_rank"] = [r["variants"] for r in per_rank]
    out["variants"] = {v: {k: statistics.median(r["variants"][v][k] for r in per_rank)
                           for k in ("proxy_host_us_per_block", "collective_call_us_per_block",
                                     "executor_own_us_per_block", "dispatch_us_per_block")}
                       | {"equal_to_resident": all(r["variants"][v]["equal_to_resident"] for r in per_rank),
                          "driver_calls": per_rank[0]["variants"][v]["driver_calls"], "load_group": VARIANTS[v][1],
                          "own_nccl": VARIANTS[v][3],
                          "layout_load_group": per_rank[0]["variants"][v]["layout_load_group"],
                          "graph_replays": per_rank[0]["variants"][v]["graph_replays"]}
                       for v in variants if v in per_rank[0]["variants"]}
    return out


def measure(config: str = "bench", variants: tuple[str, ...] = tuple(VARIANTS), quick: bool = False,
            nccl: bool | None = None) -> dict:
    """Both set-ups (module doc): ``gloo_two_ranks``, and with ``nccl`` (default: when CUDA is there)
    ``nccl_one_rank`` (its executor rows and ``calls``, the NCCL call's host time)."""
    from dlo_fn.runtime.dist import run_ranks

    variants = tuple(variants)
    result: dict[str, Any] = {"gloo_two_ranks": _summary(run_ranks(_rank, 2, config, variants, quick,
                                                                   timeout_s=900), variants)}
    if nccl if nccl is not None else torch.cuda.is_available():
        shard = result["gloo_two_ranks"]["shard_bytes"]
        r = run_ranks(_nccl_rank, 1, config, variants, quick, shard, platform="cuda", timeout_s=600)[0]
        result["nccl_one_rank"] = _summary([r["executor"]], variants) | {"calls": r["calls"]}
    return result


def _variants(text: str) -> tuple[str, ...]:
    names = tuple(v for v in text.split(",") if v)
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"give a comma list of {', '.join(VARIANTS)}; got {text!r}")
    return names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dlo_fn.bench.allgather_host", description=__doc__.splitlines()[0],
                                epilog="Two gloo ranks sharing the GPU (W = 2, outputs checked), then one rank on "
                                       "NCCL with the allgather op sequence kept (the host work of W > 1).")
    p.add_argument("--config", default="bench", help="the model config whose blocks are narrowed (default bench)")
    p.add_argument("--variants", type=_variants, default=tuple(VARIANTS), metavar="V,...",
                   help=f"comma list of {', '.join(VARIANTS)} (default all)")
    p.add_argument("--quick", action="store_true", help="the tiny config, a few passes (a smoke run, CPU too)")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    result = measure("tiny" if a.quick else a.config, a.variants, a.quick)
    from dlo_fn.bench.report import emit, stamp
    from dlo_fn.runtime.platform import platform_for

    emit(stamp(result, "dlo_fn.bench.allgather_host", argv,
               platform_for("cuda", 0) if torch.cuda.is_available() else platform_for("cpu")), a.out)
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
