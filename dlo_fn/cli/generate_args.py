"""`generate`'s command line: its flags (``add_*_arguments``), the offload options and requests they build, and
the checks that run on every rank before anything loads (:func:`check_generate_args`).

Nothing here loads a model or starts a process group: the checks turn a bad flag, checkpoint or prompts line
into one :class:`~dlo_fn.cli.UsageError` line (see :mod:`dlo_fn.cli.generate` for what the command does).
"""

from __future__ import annotations

import argparse
from typing import Any

from dlo_fn.cli import UsageError
from dlo_fn.plan.modes import MODES


def _int_or_auto(flag: str):
    """The argparse type of ``flag``: an int, or ``auto`` (the policy chooses it from start-up probes)."""

    def parse(text: str):
        if text == "auto":
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes an int >= 1 or 'auto', got {text!r}") from None

    return parse


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory or .safetensors file")
    parser.add_argument(
        "--mode",
        choices=MODES + ("auto",),
        default=None,
        help="weight placement (default allgather; auto: the policy chooses from start-up probes)",
    )
    parser.add_argument("--no-allgather", action="store_true", help="same as --mode rank-local")
    parser.add_argument("--resident", action="store_true", help="same as --mode resident (no offload)")
    parser.add_argument(
        "--slots",
        type=_int_or_auto("--slots"),
        default=None,
        help="device slots (default 2 = double buffer, 2G with --load-group G; auto: the policy "
        "chooses from start-up probes)",
    )
    parser.add_argument(
        "--landing", type=int, default=None, help="landing buffers (allgather; default 2, 2G with --load-group G)"
    )
    parser.add_argument(
        "--rank-local-source",
        choices=("pinned", "mmap"),
        default="pinned",
        help="rank-local: private pinned copy (fast H2D) or stream from the shared mmap",
    )
    parser.add_argument(
        "--block-call",
        choices=("functional_call", "swap"),
        default="swap",
        help="how a block runs on its slot's views: swap puts them in the block's parameter tables "
        "for the call (resolved once); functional_call is torch.func's (same bits, more "
        "host time)",
    )
    parser.add_argument(
        "--async-collectives", action="store_true", help="CPU/gloo: overlap all-gathers with compute (async_op)"
    )
    parser.add_argument(
        "--cuda-graph",
        nargs="?",
        const="block",
        default=None,
        choices=("block",),
        help="replay each block's compute as a CUDA graph, the copies staying eager (CUDA only; "
        "eager elsewhere, logged once): host time per block falls to a replay, for models of "
        "small blocks; block outputs live in two buffers reused along the chain",
    )
    parser.add_argument(
        "--graph-shapes",
        type=int,
        default=4,
        metavar="N",
        help="with --cuda-graph: keep the graphs of the N most recently used input shapes (a new "
        "shape beyond frees the least recently used one's graphs and buffers)",
    )
    parser.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="fp8: keep every >= 2-D block weight as FP8 (e4m3) with a float32 scale per output "
        "channel in host memory, move those bytes (about half of bf16's) and dequantise on the "
        "device into the slot; outputs equal the model with its weights fake-quantised "
        "(dlo_fn.runtime.quant.fake_quantize), not the bf16 model",
    )
    parser.add_argument(
        "--load-group",
        type=_int_or_auto("--load-group"),
        default=1,
        metavar="G",
        help="move G consecutive blocks as one load (one wait and one record for their copies, and "
        "for their computes): for models of many small blocks, where the host's 5 stream "
        "operations per block are the bound (5 per G blocks with groups). "
        "Every mode (allgather over W > 1 ranks: a group's all-gathers as one collective, "
        "--landing a multiple of G, default 2G); needs --slots a multiple of G and >= 2G "
        "(default 2G; with --slots auto the policy picks them). auto: the policy chooses G in 1, "
        "2, 4 (and the slots, unless --slots is given) from the start-up probes (at W > 1 on 2G "
        "landing buffers)",
    )
    parser.add_argument("--platform", choices=("cuda", "npu", "cpu"), default=None, help="default: detect")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective fails")
    parser.add_argument("--trace", default=None, help="write the measured timelines as Chrome trace JSON here")
    parser.add_argument(
        "--sp",
        type=_int_or_auto("--sp"),
        default=1,
        metavar="S|auto",
        help="sequence-parallel ranks per replica (Ulysses); dp = ranks / S. auto: the policy "
        "chooses dp x sp among the divisors of the ranks that the model's heads allow, from "
        "start-up probes (an all-to-all of an activation-sized tensor over the ranks, one "
        "all-gather, one block; logged with the runner-up and the predicted step)",
    )
    parser.add_argument(
        "--shard-group",
        choices=("world", "dp", "sp"),
        default="world",
        help="allgather: the ranks that split the block weights (dp: as the reference)",
    )
    parser.add_argument(
        "--host-budget",
        default=None,
        metavar="BYTES",
        help="host bytes the ranks on this host may hold together (e.g. 64GB): pin the shards "
        "that fit, stream the rest from the mapping (pageable), or refuse at start-up",
    )
    parser.add_argument(
        "--hbm-budget",
        default=None,
        metavar="BYTES",
        help="device weight bytes per rank (e.g. 16GB, 12GiB): keep the blocks that fit resident, spread "
        "through the forward, and stream the rest; the whole model if it fits; refused below the two slots",
    )


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="a prompt (repeat for several; each gets the flags below); or give --prompts",
    )
    parser.add_argument(
        "--prompts",
        default=None,
        metavar="FILE.jsonl",
        help='JSON lines, one request per line with any Request fields (+ optional "id"); '
        "the flags below are the defaults for fields a line leaves out",
    )
    parser.add_argument("--negative-prompt", default="", help="unconditional-branch prompt")
    parser.add_argument("--seed", type=int, default=0, help="noise seed (every prompt uses it)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: Request's 35)")
    parser.add_argument(
        "--height", type=int, default=None, help="pixel height, a multiple of 16 (default: the Request default, 480)"
    )
    parser.add_argument(
        "--width", type=int, default=None, help="pixel width, a multiple of 16 (default: the Request default, 832)"
    )
    parser.add_argument("--frames", type=int, default=None, help="pixel frames, 1 + 4k (1 = image)")
    parser.add_argument("--guidance", type=float, default=None, help="CFG scale (1 = off)")
    parser.add_argument("--shift", type=float, default=None, help="timestep shift")
    parser.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="FILE",
        help="a LoRA adapter (make-checkpoint --lora writes one) loaded after offload, named by its file stem "
        '(repeat for several); every request runs the first unless its prompts line names another ("lora": '
        '"NAME") or none ("lora": null)',
    )
    parser.add_argument("--lora-scale", type=float, default=None, help="the adapter's scale (default 1)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("DP engine")
    group.add_argument(
        "--requests-per-rank",
        type=int,
        default=1,
        metavar="R",
        help="requests each rank runs block-major per wave (one weight load serves R requests)",
    )
    group.add_argument(
        "--max-wait-s", type=float, default=0.0, help="bounded wait to fill a wave (a closed prompts file never waits)"
    )
    group.add_argument(
        "--out-exists",
        choices=("refuse", "clean"),
        default="refuse",
        help="an --out that holds an earlier run's outputs (manifest.jsonl, waves.jsonl, steps.jsonl, "
        "auto_policy.json, NNNN-*.npy/.png) is refused before anything loads (refuse), or those "
        "files are deleted first (clean; nothing else there is touched)",
    )
    group.add_argument(
        "--serving",
        choices=("strict", "continuous"),
        default="continuous",
        help="continuous (default): a rank whose request ends takes the next queued one at the next "
        "step boundary, and a stalled or dead rank's peers go on without it; strict: waves that "
        "hold the ring until their last request ends",
    )


def mode_from_args(args: argparse.Namespace) -> str:
    chosen = {m for m, on in (("rank-local", args.no_allgather), ("resident", args.resident)) if on}
    if args.mode:
        chosen.add(args.mode)
    if len(chosen) > 1:
        raise UsageError(
            f"generate: conflicting modes {sorted(chosen)}: pick one of --mode, --no-allgather, --resident"
        )
    return chosen.pop() if chosen else "allgather"


def slots_from_args(args: argparse.Namespace, auto: Any) -> Any:
    """``--slots``: the number given, ``auto`` for ``auto``, else the default: 2 slots per load group."""
    if args.slots == "auto" or (args.slots is None and args.load_group == "auto"):
        return auto
    return args.slots if args.slots is not None else 2 * args.load_group


def options_from_args(args: argparse.Namespace):
    from dlo_fn.runtime.offload import OffloadOptions

    mode = mode_from_args(args)
    group = 1 if args.load_group == "auto" else args.load_group  # auto: replaced once probed, as the slots are
    return OffloadOptions(
        mode="allgather" if mode == "auto" else mode,  # auto: replaced once probed
        num_slots=slots_from_args(args, 2 * group),
        num_landing=args.landing,
        rank_local_source=args.rank_local_source,
        block_call=args.block_call,
        async_collectives=args.async_collectives,
        record_timeline=bool(args.trace),
        progress=True,
        graph=args.cuda_graph or False,
        graph_shapes=args.graph_shapes,
        shard_group=args.shard_group,
        load_group=group,
        quantization=args.quantization,
        hbm_budget=_hbm_budget(args),
    )


def _hbm_budget(args: argparse.Namespace) -> int | None:
    from dlo_fn.plan.sizes import parse_bytes

    if getattr(args, "hbm_budget", None) is None:
        return None
    try:
        return parse_bytes(args.hbm_budget)
    except ValueError as exc:
        raise UsageError(f"generate: --hbm-budget: {exc}") from None


def _defaults(args: argparse.Namespace) -> dict:
    """The request fields the flags set (a prompts line may override them)."""
    fields = {
        "negative_prompt": args.negative_prompt or None,
        "num_inference_steps": args.steps,
        "height": args.height,
        "width": args.width,
        "num_frames": args.frames,
        "guidance_scale": args.guidance,
        "shift": args.shift,
        "seed": args.seed,
        "lora": lora_names(args)[0] if args.lora else None,
        "lora_scale": args.lora_scale,
    }
    return {k: v for k, v in fields.items() if v is not None}


def lora_names(args: argparse.Namespace) -> list[str]:
    """The adapter name of each ``--lora`` file: its stem."""
    import pathlib

    return [pathlib.Path(f).stem for f in args.lora or ()]


def check_lora_args(args: argparse.Namespace) -> None:
    """Each ``--lora`` an adapter file (a rank in its header) with a name of its own; whether it fits the model
    is checked once it is loaded (:func:`dlo_fn.models.lora.load_adapter`)."""
    import pathlib

    if args.lora_scale is not None and not args.lora:
        raise UsageError("generate: --lora-scale scales an adapter: give --lora FILE too")
    names = lora_names(args)
    for file, name in zip(args.lora or (), names):
        path = pathlib.Path(file)
        if not path.is_file():
            raise UsageError(f"generate: --lora {file}: no such file: write one with make-checkpoint --lora {file}")
        try:
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                rank = (f.metadata() or {}).get("rank")
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the same one line
            raise UsageError(f"generate: --lora {file}: not a safetensors file ({exc})") from None
        if rank is None:
            raise UsageError(
                f"generate: --lora {file}: no 'rank' in its metadata: write it with make-checkpoint --lora or "
                "dlo_fn.models.lora.write_adapter"
            )
        if names.count(name) > 1:
            raise UsageError(f"generate: --lora {file}: another --lora has the name {name!r}: rename one file")


def submissions_from_args(args: argparse.Namespace, config=None) -> list:
    """``--prompt``s (ids ``req0000``, ...) or the ``--prompts`` file's lines, with the flags as defaults. With
    ``config``, every request is validated against the model: a bad flag raises :class:`UsageError` naming it;
    a bad, invalid or duplicate-id prompts line becomes an error submission naming ``FILE:LINE``."""
    from dlo_fn.cli.checks import check_prompts, request_from_flags
    from dlo_fn.serve.requests import as_submissions, read_prompts

    if args.prompts is not None:
        try:
            subs = read_prompts(args.prompts, _defaults(args))
        except (FileNotFoundError, OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"generate: --prompts {args.prompts}: {exc}") from None
        return check_prompts(args.prompts, subs, config)
    return as_submissions([request_from_flags(_defaults(args), p, config) for p in args.prompt])


def check_sp_args(args: argparse.Namespace, config) -> None:
    """``--sp`` against the ranks torchrun starts (``WORLD_SIZE``) and the model's heads, before anything loads."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.sp == "auto":
        if args.mode != "auto" and mode_from_args(args) == "resident":
            raise UsageError(
                "generate: --sp auto plans the offload modes (allgather, rank-local): drop --resident "
                "(or --mode resident), or give --sp S"
            )
        if args.shard_group != "world":
            raise UsageError(
                f"generate: --sp auto chooses the shard group too: drop --shard-group "
                f"{args.shard_group}, or give --sp S"
            )
        return
    if args.sp < 1 or world % args.sp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise UsageError(
            f"generate: --sp {args.sp} does not divide the {world} rank(s) "
            f"(torchrun --nproc-per-node): use --sp in {divisors}"
        )
    if args.sp > 1 and config is not None and hasattr(config, "num_heads"):
        from dlo_fn.models.sp import check_sp_heads

        try:
            check_sp_heads(config.num_heads, args.sp)
        except ValueError as exc:
            raise UsageError(f"generate: --sp {args.sp}: {exc}") from None


def check_generate_args(args: argparse.Namespace) -> tuple:
    """``(options, submissions)`` from the command line, or :class:`UsageError` naming the flag, file or line:
    run on every rank before any process group or model exists, so a mistake costs nothing and prints once."""
    from dlo_fn.cli.checks import check_checkpoint, check_engine_args
    from dlo_fn.cli.plan import check_layout_args

    if (args.prompt is None) == (args.prompts is None):
        raise UsageError("generate: give --prompt (one or more) or --prompts FILE.jsonl, not both")
    check_layout_args(args, "generate")
    check_engine_args(args)
    check_lora_args(args)
    try:
        options = options_from_args(args)
    except ValueError as exc:
        raise UsageError(f"generate: {exc}") from None
    config = check_checkpoint(args.checkpoint)
    check_sp_args(args, config)
    check_fault(args)
    return options, submissions_from_args(args, config)


def check_fault(args: argparse.Namespace) -> None:
    """``DLO_FN_FAULT`` (the fault-injection hook) readable, and meaningful for the serving it will meet."""
    import os

    from dlo_fn.serve.batch import Fault

    try:
        fault = Fault.from_env()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if fault is not None and args.serving == "continuous" and (world == 1 or mode_from_args(args) == "allgather"):
            fault.check_serving(continuous=True)
    except ValueError as exc:
        raise UsageError(f"generate: {exc}") from None
