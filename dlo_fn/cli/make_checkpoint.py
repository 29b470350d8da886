"""`python -m dlo_fn make-checkpoint`: write a random-initialised reference-DiT checkpoint (safetensors)."""

from __future__ import annotations

import argparse

from dlo_fn.cli import HelpFormatter


def register(subparsers) -> None:
    from dlo_fn.models.configs import CONFIGS

    parser = subparsers.add_parser(
        "make-checkpoint",
        help="write a random-initialised reference DiT checkpoint as safetensors",
        description=(
            "Write the named reference DiT's weights, initialised deterministically from --seed, as safetensors "
            "(one model.safetensors, or shards plus model.safetensors.index.json above --max-shard-size) and a "
            "config.json. Streams one tensor at a time: memory stays flat whatever the model size. Norm weights "
            "stay fp32 in bf16 checkpoints."
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--model", required=True, choices=tuple(CONFIGS), help="named config")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weights are a function of (seed, tensor name)")
    parser.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16", help="linear weight dtype")
    parser.add_argument(
        "--max-shard-size", default="2GB", help="largest shard, e.g. 2GB (1e9 bytes), 500MB, 1GiB, 100KB"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dlo_fn.models.checkpoint import parse_size, write_checkpoint
    from dlo_fn.models.dit import DTYPES, build_model
    from dlo_fn.models.init import init_plan

    try:
        max_shard_bytes = parse_size(args.max_shard_size)
    except ValueError as exc:
        raise SystemExit(f"make-checkpoint: --max-shard-size: {exc}") from None
    try:
        out = write_checkpoint(
            args.model, args.out, seed=args.seed, dtype=args.dtype, max_shard_bytes=max_shard_bytes,
            overwrite=args.overwrite, progress=not args.no_progress,
        )
    except FileExistsError as exc:
        raise SystemExit(f"make-checkpoint: {exc}") from None
    model = build_model(args.model, device="meta", dtype=DTYPES[args.dtype])
    total = sum(t.nbytes for t in init_plan(model))
    files = sorted(p.name for p in out.glob("*.safetensors"))
    print(f"wrote {args.model} ({args.dtype}, seed {args.seed}) to {out}: {len(files)} file(s), {total:,} bytes of tensors")
    return 0
