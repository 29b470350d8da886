"""`python -m benchmarks bench link-share`: W gloo ranks sharing one device, each loading blocks as the allgather
program does, against the shared-link model (:mod:`dlo_fn.cost.links`).

Each rank keeps ``num_blocks`` shards of ``s = B / W`` bytes in one pinned arena (:func:`alloc_host`) and, every
rank at once (a barrier before each phase), times per block:

    h2d_s        the H2D of its shard into a landing buffer (the W ranks' copies share the device's one link)
    allgather_s  gloo's all-gather of the landing buffers into a slot of B bytes (CUDA tensors: gloo copies them
                 to host memory, exchanges them there and copies the block back: the ``host`` peer path)
    load_s       both, one after the other: the allgather program's load of a block, without the overlap

medians over ``repeats`` passes after one warm-up pass. The gathered bytes are checked against every rank's shard.

The model of the same machine in :mod:`dlo_fn.cost.links`' terms (:func:`topology`): ``W`` ranks, ``k = W`` of
them behind one link (``gpus_per_uplink``) whose rate is the H2D rate measured at ``W = 1`` (``B / h2d_s``),
``peer_link="host"``, host memory at the rate a large copy measured here. Per block it predicts

    predicted_h2d_s   the shards' H2D alone: the link carries ``k s = B`` (rank-local loads of s-byte blocks)
    predicted_load_s  the allgather load: the busiest shared link per block (uplink ``k W s``, host memory
                      ``N (2W - 1) s``; ``W = 1``: one block over the link)
    independent_s     what the simulator charges the H2D with links of their own: ``s / rate``

``figures/data/link_share_<machine>.json`` (machine, command, date). ``--quick``: tiny sizes on the CPU (the
schema; CPU timings say nothing about a PCIe link).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from dlo_fn.cli import HelpFormatter

__all__ = ["register", "run", "topology", "predict"]

PAGE = 4096


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "link-share",
        help="W gloo ranks on one device: H2D + all-gather per block vs plan.links",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--ranks", default="1,2,4", help="comma list of W (must include 1: the link's rate alone)")
    p.add_argument("--block-mb", type=float, default=256.0, help="block bytes B, in MB (10^6)")
    p.add_argument("--blocks", type=int, default=4, help="blocks per pass")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per phase (after one warm-up pass)")
    p.add_argument("--platform", choices=("cuda", "cpu"), default=None, help="default: cuda where there is one")
    p.add_argument("--quick", action="store_true", help="tiny blocks on the CPU (CPU test)")
    p.add_argument("--out", default=None, help="JSON path (default figures/data/link_share_<machine>.json)")
    p.set_defaults(func=run)


def _block_bytes(block_mb: float, worlds) -> int:
    """``B`` rounded down to whole-page shards at every ``W`` of ``worlds`` (no padding in the model's sums)."""
    unit = math.lcm(*worlds) * PAGE
    return max(unit, int(block_mb * 1e6) // unit * unit)


def _rank(ctx, device: str, block_bytes: int, num_blocks: int, repeats: int) -> dict:
    """One rank (run by :func:`dlo_fn.serve.ranks.run_ranks`): the three phases of the module docstring."""
    import dataclasses

    import torch.distributed as dist

    from dlo_fn.runtime.dist import all_gather_bytes
    from dlo_fn.runtime.host_store import alloc_host
    from dlo_fn.runtime.platform import Platform

    if device == "cuda":  # every rank on the one GPU, over gloo
        torch.cuda.set_device(0)
        ctx = dataclasses.replace(ctx, platform=Platform("cuda", torch.device("cuda", 0), "gloo"))
    p, w, r = ctx.platform, ctx.world_size, ctx.rank
    s = block_bytes // w
    arena, how, fin = alloc_host(num_blocks * s, p)
    for b in range(num_blocks):  # shard b of rank r: one byte value, checked after each gather
        arena[b * s : (b + 1) * s].fill_((31 * r + b) % 256)
    landing = torch.empty(s, dtype=torch.uint8, device=p.device)
    slot = torch.empty(w * s, dtype=torch.uint8, device=p.device)
    h2d_stream = p.new_stream("h2d")

    def h2d(b: int) -> None:
        with p.use_stream(h2d_stream):
            landing.copy_(arena[b * s : (b + 1) * s], non_blocking=True)
        h2d_stream.synchronize()

    def gather(b: int) -> None:
        all_gather_bytes(slot, landing, ctx.group)
        p.synchronize()

    def load(b: int) -> None:
        h2d(b)
        gather(b)

    out = {"rank": r, "shard_bytes": s, "pinning": how}
    for name, step in (("h2d", h2d), ("allgather", gather), ("load", load)):
        times = []
        for rep in range(repeats + 1):
            dist.barrier(ctx.group)
            for b in range(num_blocks):
                t0 = time.perf_counter()
                step(b)
                if rep:
                    times.append(time.perf_counter() - t0)
        out[f"{name}_s"] = statistics.median(times)
    got = slot.view(w, s)[:, [0, -1]].cpu()  # the last block's gather: each rank's shard in its place
    out["exact"] = all(int(v) == (31 * q + num_blocks - 1) % 256 for q in range(w) for v in got[q])
    if fin is not None:
        fin()
    return out


def host_copy_bytes_per_s(nbytes: int, repeats: int = 3) -> float:
    """DRAM traffic of a large host copy (bytes read + written per second, the best of ``repeats``)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def topology(world: int, link_bytes_per_s: float, host_memory_bytes_per_s: float | None):
    """``W`` gloo ranks sharing one device's link (module docstring), as a :class:`~dlo_fn.cost.topology.Topology`
    (only its link fields matter here; the others are placeholders no prediction reads)."""
    from dlo_fn.cost.topology import BlockCompute, Topology

    return Topology(
        f"1 device shared by {world} gloo ranks",
        world,
        link_bytes_per_s,
        1.0,
        1.0,
        1.0,
        BlockCompute(flop_per_s=1.0),
        1,
        1,
        peer_link="host",
        gpus_per_uplink=world,
        uplink_bytes_per_s=link_bytes_per_s,
        host_memory_bytes_per_s=host_memory_bytes_per_s,
        ranks_per_host=world,
    )


def predict(
    world: int, block_bytes: int, num_blocks: int, link_bytes_per_s: float, host_memory_bytes_per_s: float | None
) -> dict:
    """The module docstring's predictions per block, from :func:`dlo_fn.cost.links.link_busy_s`."""
    from dlo_fn.cost.links import link_busy_s
    from dlo_fn.plan.sizes import ModelSizes

    t = topology(world, link_bytes_per_s, host_memory_bytes_per_s)
    shard = block_bytes // world
    h2d = link_busy_s(ModelSizes("shards", (shard,) * num_blocks, 0), t, "rank-local", 1)
    load = link_busy_s(ModelSizes("blocks", (block_bytes,) * num_blocks, 0), t, "allgather", world)
    return {
        "predicted_h2d_s": dict(h2d)["uplink"] / num_blocks,
        "predicted_load_s": load[0][1] / num_blocks,
        "predicted_load_link": load[0][0],
        "links_s": {k: v / num_blocks for k, v in load},
        "independent_s": shard / link_bytes_per_s,
    }


def run(args: argparse.Namespace) -> int:
    from benchmarks.bench.report import emit, stamp
    from benchmarks.bench.step import slug
    from benchmarks.repro.data import DATA_DIR
    from dlo_fn.runtime.platform import detect_platform
    from dlo_fn.serve.ranks import run_ranks

    try:
        worlds = sorted({int(x) for x in args.ranks.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"bench link-share: --ranks must be a comma list of integers, got {args.ranks!r}")
    if 1 not in worlds or min(worlds) < 1 or args.blocks < 1 or args.repeats < 1 or args.block_mb <= 0:
        raise SystemExit("bench link-share: --ranks must include 1 (all >= 1), --blocks, --repeats and --block-mb > 0")
    if args.quick:
        args.block_mb, args.blocks, args.repeats = 0.5, 2, 1
    platform = detect_platform(prefer=args.platform or ("cpu" if args.quick else None))
    report = stamp(
        {"quick": args.quick, "blocks": args.blocks, "repeats": args.repeats, "block_mb": args.block_mb},
        "benchmarks",
        [
            "bench",
            "link-share",
            "--ranks",
            args.ranks,
            "--block-mb",
            f"{args.block_mb:g}",
            "--blocks",
            str(args.blocks),
            "--repeats",
            str(args.repeats),
        ]
        + (["--quick"] if args.quick else [])
        + (["--platform", args.platform] if args.platform else []),
        platform,
    )
    block = _block_bytes(args.block_mb, worlds)  # one B for every W
    host = host_copy_bytes_per_s(min(1 << 30, 64 * block))
    report["host_memory_bytes_per_s"] = host
    rows, link = [], None
    for w in worlds:
        t0 = time.perf_counter()
        ranks = run_ranks(
            _rank, w, platform.kind, block, args.blocks, args.repeats, timeout_s=120 + 60 * w, platform="cpu"
        )
        slowest = {k: max(x[k] for x in ranks) for k in ("h2d_s", "allgather_s", "load_s")}
        if w == 1:
            link = block / slowest["h2d_s"]
        rows.append(
            {
                "world_size": w,
                "block_bytes": block,
                "shard_bytes": block // w,
                "ranks": ranks,
                "exact": all(x["exact"] for x in ranks),
                "wall_s": time.perf_counter() - t0,
                **slowest,
            }
        )
    for row in rows:
        row.update(predict(row["world_size"], row["block_bytes"], args.blocks, link, host))
        row["load_over_predicted"] = row["load_s"] / row["predicted_load_s"]
        row["h2d_over_predicted"] = row["h2d_s"] / row["predicted_h2d_s"]
    report.update(link_bytes_per_s=link, rows=rows)
    out = args.out or str(DATA_DIR / f"link_share_{slug(platform)}{'_quick' if args.quick else ''}.json")
    emit(report, out)
    return 0
