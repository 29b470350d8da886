"""`python -m dlo_fn make-checkpoint`: write a random-initialised reference-DiT checkpoint (safetensors), and with
``--lora FILE`` a random LoRA adapter for it (:func:`dlo_fn.models.lora.write_adapter`; ``generate --lora`` runs it)."""

from __future__ import annotations

import argparse

from dlo_fn.cli import HelpFormatter, UsageError

# Tensor bytes of each config in bf16, for --help (building every config to measure it would make --help take
# seconds); tests/test_cli_errors.py checks each against the built model, so the table cannot drift.
SIZES_BF16_BYTES = {
    "tiny": 648_032,
    "bench": 13_614_477_440,
    "cosmos3-nano": 33_038_165_632,
    "cosmos3-super": 123_952_864_384,
    "400gb": 399_657_371_776,
    "load-200mb": 215_849_088,
    "load-1gb": 989_325_440,
}


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def config_names() -> tuple[str, ...]:
    """The named configs (:data:`dlo_fn.models.CONFIGS`) and the load benchmark's sizes (~200 MB, ~1 GB)."""
    from dlo_fn.models.configs import CONFIGS, LOAD_CONFIGS

    return tuple(CONFIGS) + tuple(LOAD_CONFIGS)


def _config(name: str):
    from dlo_fn.models.configs import CONFIGS, LOAD_CONFIGS, load_config

    return load_config(name) if name in LOAD_CONFIGS else CONFIGS[name]


def register(subparsers) -> None:
    names = config_names()
    sizes = "\n".join(f"  {n:14s} {_size(SIZES_BF16_BYTES[n]):>9s} in bf16 (fp32: about twice)" for n in names)
    parser = subparsers.add_parser(
        "make-checkpoint",
        help="write a random-initialised reference DiT checkpoint as safetensors",
        description=(
            "Write the named reference DiT's weights, initialised deterministically from --seed, as safetensors "
            "(one model.safetensors, or shards plus model.safetensors.index.json above --max-shard-size) and a "
            "config.json. Streams one tensor at a time: memory stays flat whatever the model size. Norm weights "
            "stay fp32 in bf16 checkpoints. The weights are random: `generate` from them is bit-exact and "
            "repeatable but its videos are noise."
        ),
        epilog=f"sizes (tensor bytes; the disk needs as much free):\n{sizes}\n\n"
        "tiny generates on a CPU in seconds; load-1gb is a ~1 GB checkpoint for load and memory tests.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--model", required=True, choices=names, metavar="NAME", help=f"named config: {', '.join(names)} (sizes below)"
    )
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weights are a function of (seed, tensor name)")
    parser.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16", help="linear weight dtype")
    parser.add_argument(
        "--max-shard-size", default="2GB", help="largest shard, e.g. 2GB (1e9 bytes), 500MB, 1GiB, 100KB"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    parser.add_argument(
        "--lora",
        default=None,
        metavar="FILE",
        help="also write a random LoRA adapter for this model to FILE (.safetensors; generate --lora loads it)",
    )
    parser.add_argument("--lora-rank", type=int, default=4, help="the adapter's rank")
    parser.add_argument(
        "--lora-targets",
        default=None,
        metavar="REGEX",
        help="the linears it adapts, a regex full-matching their names (default: every attention and MLP linear "
        "of the blocks, dlo_fn.models.lora.TARGETS)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dlo_fn.models.checkpoint import parse_size, write_checkpoint
    from dlo_fn.models.dit import DTYPES, build_model
    from dlo_fn.models.init import init_plan

    try:
        max_shard_bytes = parse_size(args.max_shard_size)
    except ValueError as exc:
        raise UsageError(f"--max-shard-size {args.max_shard_size}: {exc}") from None
    config = _config(args.model)
    lora = _check_lora(args, config)
    try:
        out = write_checkpoint(
            config,
            args.out,
            seed=args.seed,
            dtype=args.dtype,
            max_shard_bytes=max_shard_bytes,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except FileExistsError as exc:
        raise UsageError(f"--out {args.out}: {exc}") from None
    except OSError as exc:  # e.g. a directory that cannot be created or written
        raise UsageError(
            f"--out {args.out}: cannot write there ({exc.strerror or exc}): choose a writable directory"
        ) from None
    model = build_model(config, device="meta", dtype=DTYPES[args.dtype])
    total = sum(t.nbytes for t in init_plan(model))
    files = sorted(p.name for p in out.glob("*.safetensors"))
    print(
        f"wrote {args.model} ({args.dtype}, seed {args.seed}) to {out}: {len(files)} file(s), {total:,} bytes of "
        f"tensors (random weights: generate makes noise from them)"
    )
    if lora is not None:
        _write_lora(model, lora, args)
    return 0


def _check_lora(args: argparse.Namespace, config):
    """``--lora`` as a path (None without it); its flags checked before the checkpoint is written."""
    import pathlib
    import re

    from torch import nn

    from dlo_fn.models.dit import build_model
    from dlo_fn.models.lora import TARGETS

    if args.lora is None:
        return None
    if args.lora_rank < 1:
        raise UsageError(f"--lora-rank {args.lora_rank}: give a rank >= 1")
    try:
        targets = re.compile(args.lora_targets or TARGETS)
    except re.error as exc:
        raise UsageError(f"--lora-targets {args.lora_targets!r}: not a regex ({exc})") from None
    names = [n for n, m in build_model(config, device="meta").named_modules() if isinstance(m, nn.Linear)]
    if not any(targets.fullmatch(n) for n in names):
        raise UsageError(
            f"--lora-targets {args.lora_targets!r}: matches none of the model's linears (e.g. {names[0]!r})"
        )
    path = pathlib.Path(args.lora)
    if path.suffix != ".safetensors" or path.is_dir():
        raise UsageError(f"--lora {args.lora}: give a file name ending in .safetensors")
    if path.exists() and not args.overwrite:
        raise UsageError(f"--lora {args.lora}: already exists: pass --overwrite to replace it, or choose another")
    return path


def _write_lora(model, path, args: argparse.Namespace) -> None:
    from dlo_fn.models.lora import TARGETS, write_adapter

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_adapter(model, path, rank=args.lora_rank, seed=args.seed, targets=args.lora_targets or TARGETS)
    except OSError as exc:
        raise UsageError(f"--lora {args.lora}: cannot write there ({exc.strerror or exc}): choose a writable path")
    print(f"wrote a random rank-{args.lora_rank} LoRA adapter to {path} (generate --lora {path} uses it)")
