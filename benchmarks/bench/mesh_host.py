"""`python -m benchmarks bench mesh-host`: per-rank host bytes of the weight arena for each shard group of a mesh.

``dp x sp`` CPU ranks (gloo, real processes) each map one safetensors checkpoint (meta init + mmap views) and,
for each shard group of :mod:`dlo_fn.cost.mesh` (``world``, ``dp``, ``sp``), build their real host store
(:func:`dlo_fn.runtime.host_store.build_host_store`, shard index = the rank's place in its group) and measure:

    arena_bytes      what the store allocated                          vs  MeshPlan.pinned_bytes_per_rank (exact)
    anon_delta       growth of the process's anonymous memory (smaps)  ~   arena_bytes (rounded to pages)
    uss_delta        growth of its USS: the arena plus the checkpoint pages it read that no other rank maps at
                     that moment (private-clean file pages: timing-dependent, shown for contrast only)

Large allocations are forced to ``mmap`` (``MALLOC_MMAP_THRESHOLD_``) so a freed arena returns to the OS
before the next group's is built. Written to ``figures/data/mesh_host_cpu.json`` with machine, command, date.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import tempfile

from dlo_fn.cli import HelpFormatter

__all__ = ["mesh_host_config", "measure", "register", "run"]


def mesh_host_config():
    """A small config whose arenas (MBs) stand well above the measurement noise: 8 blocks of ~7.9 MB."""
    from dlo_fn.models import get_config

    return dataclasses.replace(
        get_config("tiny"),
        name="mesh-host",
        num_blocks=8,
        hidden_dim=512,
        num_heads=8,
        mlp_dim=2048,
        cond_dim=512,
        adaln_rank=64,
    )


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "mesh-host",
        help="per-rank host arena bytes for each shard group vs the plan",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("figures/data/mesh_host_cpu.json"))
    p.set_defaults(func=run)


def _rank(ctx, checkpoint: str, dp: int, sp: int) -> list[dict]:
    import gc

    from dlo_fn.cost.mesh import SHARD_GROUPS, MeshPlan
    from dlo_fn.io.load import load_model
    from dlo_fn.io.memstat import process_memory
    from dlo_fn.models import BLOCK_PATHS
    from dlo_fn.plan.layout import model_layout
    from dlo_fn.plan.sizes import ModelSizes
    from dlo_fn.plan.spec import spec_from_module
    from dlo_fn.runtime.host_store import build_host_store

    model = load_model(checkpoint)
    spec = spec_from_module(model, BLOCK_PATHS)
    sizes = ModelSizes.from_spec(spec)
    blocks = [dict(model.get_submodule(b.name).state_dict()) for b in spec.blocks]
    out = []
    for group in SHARD_GROUPS:
        mesh = MeshPlan(dp, sp, group)
        layout = model_layout(spec, mesh.num_shards)
        gc.collect()
        before = process_memory()
        store = build_host_store(layout, mesh.shard_index(ctx.rank), blocks, ctx.platform)
        after = process_memory()
        out.append(
            {
                "shard_group": group,
                "rank": ctx.rank,
                "coordinate": list(mesh.coordinate(ctx.rank)),
                "shard_group_ranks": list(mesh.shard_group_of(ctx.rank)),
                "num_shards": mesh.num_shards,
                "shard_index": mesh.shard_index(ctx.rank),
                "arena_bytes": store.arena_bytes,
                "planned_bytes": mesh.pinned_bytes_per_rank(sizes),
                "layout_digest": layout.digest,
                "anon_delta_bytes": after.pss_anon_bytes - before.pss_anon_bytes,
                "uss_delta_bytes": after.uss_bytes - before.uss_bytes,
            }
        )
        store.close()
        del store
    return out


def measure(dp: int = 2, sp: int = 2) -> dict:
    """Write the checkpoint to a temporary folder, run the ``dp x sp`` ranks, return the records and the sizes."""
    from dlo_fn.models import write_checkpoint
    from dlo_fn.serve.ranks import run_ranks

    config = mesh_host_config()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # inherited by the spawned ranks
    with tempfile.TemporaryDirectory(prefix="dlo_fn_mesh_host_") as tmp:
        ckpt = write_checkpoint(config, pathlib.Path(tmp, "ckpt"), seed=0, progress=False)
        per_rank = run_ranks(_rank, dp * sp, str(ckpt), dp, sp, timeout_s=300)
    order = {"world": 0, "dp": 1, "sp": 2}
    records = sorted((r for rank in per_rank for r in rank), key=lambda r: (order[r["shard_group"]], r["rank"]))
    return {"config": config.to_dict(), "dp": dp, "sp": sp, "records": records}


def run(args: argparse.Namespace) -> int:
    from dlo_fn.io.memstat import host_description

    doc = {
        "machine": {"platform": "cpu", "cpu": host_description()},
        "command": f"python -m benchmarks bench mesh-host --dp {args.dp} --sp {args.sp}",
        "date": datetime.date.today().isoformat(),
        **measure(args.dp, args.sp),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for r in doc["records"]:
        print(
            f"{r['shard_group']:6s} rank {r['rank']} (W {r['num_shards']}, shard {r['shard_index']}): arena "
            f"{r['arena_bytes']} (plan {r['planned_bytes']}), anon +{r['anon_delta_bytes']}, "
            f"USS +{r['uss_delta_bytes']}"
        )
    print(f"wrote {args.out}")
    return 0
