"""The executor's host time per block in allgather mode (W > 1), and the host cost of one all-gather call.

``python -m benchmarks.bench.allgather_host`` runs ``bench step``'s dispatch method (bench-narrow blocks, 64 tokens: the
device keeps up, so the host timer sees host work) in allgather mode on two ranks joined by gloo, each block sharded
over both (W = 2); on a CUDA machine both ranks share GPU 0 and gloo gathers the CUDA tensors through the host.
Every rank's output is checked ``torch.equal`` to its resident blocks. Per load group G = 1 / 2 / 4 (on the grouped
shard layout, one all-gather per group, as ``offload`` builds it where G divides the blocks)::

    proxy_host_us_per_block       the executor's host time outside the block calls, per block (ExecutorStats)
    collective_call_us_per_block  of which inside the process group's all-gather calls (ExecutorStats.collective_s)
    executor_own_us_per_block     the difference: what the executor adds besides the collective calls
    stream_ops_per_block          waits, copies and records issued (what plan.host_cost counts)

gloo's calls cost milliseconds, which says nothing of NCCL; so on CUDA a one-rank NCCL group also times the host
microseconds of one all-gather call as the executor issues it (``runtime.dist.all_gather_pairs`` on the all-gather
stream), for G blocks at once (``nccl_call_us``). The executor's own part on gloo plus that call is the W > 1 host
cost on NCCL that ``plan.host_cost`` fits. Written with machine, command, date.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch

__all__ = ["LOAD_GROUPS", "measure", "main"]

LOAD_GROUPS = (1, 2, 4)


def _rank(ctx: Any, config: str, groups: tuple[int, ...], quick: bool) -> dict:
    """The dispatch rows of each load group on this rank."""
    from benchmarks.bench import step_variants as sv
    from benchmarks.bench.step_dispatch import DISPATCH_SIZE
    from dlo_fn.models import BLOCK_PATHS
    from dlo_fn.plan.layout import model_layout
    from dlo_fn.plan.spec import spec_from_module
    from dlo_fn.runtime.blocks import strip_block
    from dlo_fn.runtime.host_store import build_host_store
    from dlo_fn.runtime.platform import Platform

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
    layouts = {g: model_layout(spec, ctx.world_size, load_group=g) for g in groups}
    reps = dict(warmup=2, repeats=3) if quick else dict(warmup=5, repeats=31)
    resident_blocks = [copy.deepcopy(b) for b in blocks]

    def resident_pass(x: torch.Tensor, kw: dict) -> torch.Tensor:
        for block in resident_blocks:
            x = block(x, **kw)
        return x

    rows: dict[str, dict] = {}
    with torch.no_grad():
        want = resident_pass(x, kwargs)
        tensors, aliases = sv.block_states(blocks)
        stores = {g: build_host_store(lay, ctx.rank, tensors, platform) for g, lay in layouts.items()}
        del tensors
        for block in blocks:
            strip_block(block, platform.device)
        for g, lay in layouts.items():
            run_pass, ex = sv.executor_pass(
                platform,
                lay,
                stores[g],
                blocks,
                aliases,
                mode="allgather",
                group=ctx.group,
                block_call="swap",
                load_group=g,
            )
            equal = torch.equal(run_pass(x, kwargs), want)
            host, delta = sv.host_pass_delta_s(
                platform, run_pass, resident_pass, x, kwargs, reset=ex.stats.reset, **reps
            )
            st, n = ex.stats, max(ex.stats.computes, 1)
            proxy, coll = st.issue_us_per_compute, 1e6 * st.collective_s / n
            rows[f"g{g}"] = {
                "load_group": g,
                "layout_load_group": lay.load_group,
                "num_slots": ex.num_slots,
                "num_landing": ex.num_landing,
                "proxy_host_us_per_block": proxy,
                "collective_call_us_per_block": coll,
                "executor_own_us_per_block": proxy - coll,
                "stream_ops_per_block": st.stream_ops / n,
                "collectives_per_block": st.collectives / n,
                "dispatch_us_per_block": 1e6 * delta / lay.num_blocks,
                "pass_host_s": host,
                "equal_to_resident": equal,
            }
            ex.release()
    layout = layouts[groups[0]]
    return {
        "rank": ctx.rank,
        "platform": platform.kind,
        "backend": platform.backend,
        "num_blocks": layout.num_blocks,
        "tensors_per_block": len(layout.shards[0].block.placements),
        "tokens_per_sample": tokens,
        "shard_bytes": layout.shards[0].shard_bytes,
        "config": getattr(cfg, "name", cfg),
        "variants": rows,
    }


def _nccl_calls(ctx: Any, shard_bytes: int, groups: tuple[int, ...], calls: int) -> dict:
    """Host microseconds per all-gather call on a one-rank NCCL group, issued as the executor issues it (the
    all-gather stream made current, the compute stream restored) for G blocks at once."""
    from dlo_fn.runtime.dist import all_gather_pairs

    side, main_stream = torch.cuda.Stream(), torch.cuda.current_stream()
    set_stream = ctx.platform.stream_setter()
    out: dict[str, float] = {}
    gathered = {}
    for g in groups:
        pairs = [
            (
                torch.zeros(shard_bytes, dtype=torch.uint8, device="cuda"),
                torch.randint(0, 256, (shard_bytes,), dtype=torch.uint8, device="cuda"),
            )
            for _ in range(g)
        ]

        def call() -> None:
            set_stream(side)
            all_gather_pairs(pairs, ctx.group)
            set_stream(main_stream)

        call()
        torch.cuda.synchronize()
        gathered[f"G{g}"] = all(torch.equal(o, i) for o, i in pairs)  # over one rank a gather is a copy
        for _ in range(50):
            call()
        rounds = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls // 5):
                call()
            rounds.append(1e6 * (time.perf_counter() - t0) / (calls // 5))
        torch.cuda.synchronize()
        out[f"G{g}"] = statistics.median(rounds)
    return {
        "world_size": ctx.world_size,
        "shard_bytes": shard_bytes,
        "calls": calls,
        "host_us_per_call": out,
        "gathered_equal": gathered,
    }


def _summary(per_rank: list[dict]) -> dict:
    out = {
        k: per_rank[0][k]
        for k in (
            "platform",
            "backend",
            "num_blocks",
            "tensors_per_block",
            "tokens_per_sample",
            "shard_bytes",
            "config",
        )
    }
    out["world_size"] = len(per_rank)
    out["by_rank"] = [r["variants"] for r in per_rank]
    keys = (
        "proxy_host_us_per_block",
        "collective_call_us_per_block",
        "executor_own_us_per_block",
        "dispatch_us_per_block",
        "stream_ops_per_block",
        "collectives_per_block",
    )
    out["variants"] = {
        v: {k: statistics.median(r["variants"][v][k] for r in per_rank) for k in keys}
        | {
            "equal_to_resident": all(r["variants"][v]["equal_to_resident"] for r in per_rank),
            "load_group": row["load_group"],
            "layout_load_group": row["layout_load_group"],
        }
        for v, row in per_rank[0]["variants"].items()
    }
    return out


def measure(
    config: str = "bench", groups: tuple[int, ...] = LOAD_GROUPS, quick: bool = False, nccl: bool | None = None
) -> dict:
    """``gloo_two_ranks`` (module doc), and with ``nccl`` (default: when CUDA is there) ``nccl_calls``."""
    from dlo_fn.serve.ranks import run_ranks

    result: dict[str, Any] = {"gloo_two_ranks": _summary(run_ranks(_rank, 2, config, groups, quick, timeout_s=900))}
    if nccl if nccl is not None else torch.cuda.is_available():
        shard = result["gloo_two_ranks"]["shard_bytes"]
        result["nccl_calls"] = run_ranks(
            _nccl_calls, 1, shard, groups, 50 if quick else 2000, platform="cuda", timeout_s=600
        )[0]
    return result


def _groups(text: str) -> tuple[int, ...]:
    try:
        groups = tuple(int(g) for g in text.split(",") if g)
    except ValueError:
        groups = ()
    if not groups or any(g < 1 for g in groups):
        raise argparse.ArgumentTypeError(f"give a comma list of load groups >= 1, e.g. 1,2,4; got {text!r}")
    return groups


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench.allgather_host",
        description=__doc__.splitlines()[0],
        epilog="Two gloo ranks (sharing GPU 0 on CUDA; outputs checked), then on CUDA one "
        "NCCL rank timing the all-gather call's host cost.",
    )
    p.add_argument("--config", default="bench", help="the model config whose blocks are narrowed (default bench)")
    p.add_argument(
        "--load-groups",
        type=_groups,
        default=LOAD_GROUPS,
        metavar="G,...",
        help="load groups to measure, each dividing the blocks (default 1,2,4)",
    )
    p.add_argument("--quick", action="store_true", help="the tiny config, a few passes (a smoke run, CPU too)")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    result = measure("tiny" if a.quick else a.config, a.load_groups, a.quick)
    from benchmarks.bench.report import emit, stamp
    from dlo_fn.runtime.platform import platform_for

    emit(
        stamp(
            result,
            "benchmarks.bench.allgather_host",
            argv,
            platform_for("cuda", 0) if torch.cuda.is_available() else platform_for("cpu"),
        ),
        a.out,
    )
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
