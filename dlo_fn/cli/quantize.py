"""`python -m dlo_fn quantize SRC DST`: write a checkpoint's FP8 shards once (:mod:`dlo_fn.runtime.quantize`)."""

from __future__ import annotations

import argparse
import os

from dlo_fn.cli import HelpFormatter, UsageError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "quantize",
        help="write a checkpoint with FP8 block weights, so no rank quantises at start-up",
        description=(
            "Write SRC to the new folder DST with every block weight `generate --quantization fp8` would store as FP8 "
            "written as float8_e4m3fn plus float32 scales per output channel (<name>_scale): the on-the-fly bits. "
            "The rest is copied byte for byte; DST keeps SRC's files, index and config.json, marked quantised. "
            "Memory stays flat.\n\nSRC: a dlo_fn checkpoint (folder, .safetensors file or index) or a diffusers "
            "model folder (a pipeline's transformer/; its _keep_in_fp32_modules kept).\nDST loads as any checkpoint, "
            "offloads with --quantization fp8 only; reference: dlo_fn.runtime.quant.fake_quantize(load_model(DST))."
        ),
        epilog="example:\n  python -m dlo_fn make-checkpoint --model tiny --out ckpt\n"
        "  python -m dlo_fn quantize ckpt ckpt-fp8\n"
        "  python -m dlo_fn generate --checkpoint ckpt-fp8 --quantization fp8 --prompt 'a fox' --out out",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("src", metavar="SRC", help="the checkpoint to quantise (folder, file or index)")
    parser.add_argument("dst", metavar="DST", help="a new folder for the quantised checkpoint")
    parser.add_argument(
        "--exclude",
        nargs="+",
        default=None,
        metavar="MOD",
        help="modules to keep as they are (a dotted component of the tensor name, as diffusers "
        "matches _keep_in_fp32_modules), besides the model's fp32 ones",
    )
    parser.add_argument("--force", action="store_true", help="replace a checkpoint already in DST")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dlo_fn.runtime.quantize import quantize_checkpoint

    if not os.path.lexists(args.src):
        raise UsageError(
            f"quantize: SRC {args.src}: no such folder or file: give a checkpoint (write one with "
            "`python -m dlo_fn make-checkpoint --model tiny --out ckpt`)"
        )
    try:
        report = quantize_checkpoint(
            args.src,
            args.dst,
            exclude=tuple(args.exclude or ()),
            overwrite=args.force,
            progress=False if args.no_progress else None,
        )
    except FileExistsError as exc:
        raise UsageError(f"quantize: DST {exc}") from None
    except OSError as exc:  # e.g. a folder that cannot be created or written
        raise UsageError(
            f"quantize: DST {args.dst}: cannot write there ({exc.strerror or exc}): choose a writable folder"
        ) from None
    print(
        f"wrote {report.out}: {report.num_quantized} block tensor(s) as FP8 (block lists "
        f"{', '.join(report.block_paths)}), {report.source_bytes:,} -> {report.written_bytes:,} bytes of tensors "
        f"in {len(report.files)} file(s)"
    )
    return 0
