"""`python -m dlo_fn generate` (or under `torchrun`): generate videos with offloaded weights, served by the DP engine.

Requests come from ``--prompt`` (repeat for several; each takes the flags' settings and ``--seed``; ids
``req0000``, ``req0001``, ... in the order given) or from ``--prompts FILE.jsonl`` (one request per line, the
flags are the defaults). Under ``torchrun --nproc-per-node N`` every rank loads the checkpoint (mmap) and wraps
it for ``--mode``; rank 0 rejects bad lines and invalid requests before dispatch and groups the rest into waves
of up to ``N x --requests-per-rank`` compatible requests (:class:`dlo_fn.serve.engine.Engine`). In allgather
mode the waves run in lockstep and a rank with no request in a wave serves its shards to the all-gathers
without computing (a partial wave); rank-local and resident ranks work through their own queues. Rank 0 writes
under ``--out`` (:mod:`dlo_fn.serve.outputs`):

    <index>-<id>.npy           uint8 video [N, F, H, W, 3] (N = outputs per prompt)
    <index>-<id>.png           preview: one row per output, up to 8 evenly spaced frames side by side
    manifest.jsonl             one JSON line per request: settings, seed, shape, sha256, rank, wave, timings, mode
    waves.jsonl                one JSON line per wave: who ran what, latency, status
    --trace FILE               every rank's measured three-stream timeline (Chrome / Perfetto)

The same request and seed give the same sha256 in every mode and for any number of ranks. Exit code 0 when
every request produced an output, 1 otherwise (each failure is in the manifest with its reason).
``DLO_FN_FAULT`` injects a fault for tests (:mod:`dlo_fn.serve.batch`).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib

from dlo_fn.cli import HelpFormatter
from dlo_fn.plan.modes import MODES

log = logging.getLogger(__name__)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory or .safetensors file")
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="weight placement (default allgather)")
    parser.add_argument("--no-allgather", action="store_true", help="same as --mode rank-local")
    parser.add_argument("--resident", action="store_true", help="same as --mode resident (no offload)")
    parser.add_argument("--slots", type=int, default=2, help="device slots (2 = double buffer)")
    parser.add_argument("--landing", type=int, default=None, help="landing buffers (allgather; default 2)")
    parser.add_argument("--rank-local-source", choices=("pinned", "mmap"), default="pinned",
                        help="rank-local: private pinned copy (fast H2D) or stream from the shared mmap")
    parser.add_argument("--block-call", choices=("functional_call", "swap"), default="functional_call",
                        help="how a block runs on its slot's views")
    parser.add_argument("--async-collectives", action="store_true",
                        help="CPU/gloo: overlap all-gathers with compute (async_op)")
    parser.add_argument("--platform", choices=("cuda", "npu", "cpu"), default=None, help="default: detect")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective fails")
    parser.add_argument("--trace", default=None, help="write the measured timelines as Chrome trace JSON here")
    parser.add_argument("--host-budget", default=None, metavar="BYTES",
                        help="host bytes the ranks on this host may hold together (e.g. 64GB): pin the shards "
                             "that fit, stream the rest from the mapping (pageable), or refuse at start-up")


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", default=None,
                        help="a prompt (repeat for several; each gets the flags below); or give --prompts")
    parser.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                        help="JSON lines, one request per line with any Request fields (+ optional \"id\"); "
                             "the flags below are the defaults for fields a line leaves out")
    parser.add_argument("--negative-prompt", default="", help="unconditional-branch prompt")
    parser.add_argument("--seed", type=int, default=0, help="noise seed (every prompt uses it)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: Request's 35)")
    parser.add_argument("--height", type=int, default=None, help="pixel height, a multiple of 16 (default: the Request default, 480)")
    parser.add_argument("--width", type=int, default=None, help="pixel width, a multiple of 16 (default: the Request default, 832)")
    parser.add_argument("--frames", type=int, default=None, help="pixel frames, 1 + 4k (1 = image)")
    parser.add_argument("--guidance", type=float, default=None, help="CFG scale (1 = off)")
    parser.add_argument("--shift", type=float, default=None, help="timestep shift")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("DP engine")
    group.add_argument("--requests-per-rank", type=int, default=1, metavar="R",
                       help="requests each rank runs block-major per wave (one weight load serves R requests)")
    group.add_argument("--max-wait-s", type=float, default=0.0,
                       help="bounded wait to fill a wave (a closed prompts file never waits)")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate videos with layerwise-offloaded weights (torchrun for several ranks)",
        description=__doc__.split("\n\n")[0] + " Run under torchrun --nproc-per-node N for N ranks; without "
        "torchrun it runs as one process. CPU ranks use gloo.",
        formatter_class=HelpFormatter)
    add_model_arguments(parser)
    add_request_arguments(parser)
    parser.add_argument("--out", required=True, help="output directory")
    add_engine_arguments(parser)
    parser.set_defaults(func=run_generate)


def mode_from_args(args: argparse.Namespace) -> str:
    chosen = {m for m, on in (("rank-local", args.no_allgather), ("resident", args.resident)) if on}
    if args.mode:
        chosen.add(args.mode)
    if len(chosen) > 1:
        raise SystemExit(f"generate: conflicting modes {sorted(chosen)}: pick one of --mode, --no-allgather, "
                         f"--resident")
    return chosen.pop() if chosen else "allgather"


def options_from_args(args: argparse.Namespace):
    from dlo_fn.runtime.offload import OffloadOptions

    return OffloadOptions(mode=mode_from_args(args), num_slots=args.slots, num_landing=args.landing,
                          rank_local_source=args.rank_local_source, block_call=args.block_call,
                          async_collectives=args.async_collectives, record_timeline=bool(args.trace),
                          progress=True)


def _defaults(args: argparse.Namespace) -> dict:
    """The request fields the flags set (a prompts line may override them)."""
    fields = {"negative_prompt": args.negative_prompt or None, "num_inference_steps": args.steps,
              "height": args.height, "width": args.width, "num_frames": args.frames,
              "guidance_scale": args.guidance, "shift": args.shift, "seed": args.seed}
    return {k: v for k, v in fields.items() if v is not None}


def submissions_from_args(args: argparse.Namespace) -> list:
    """``--prompt``s (ids ``req0000``, ...) or the ``--prompts`` file's lines, with the flags as defaults."""
    from dlo_fn.models import Request
    from dlo_fn.serve.requests import as_submissions, read_prompts

    if args.prompts is not None:
        try:
            return read_prompts(args.prompts, _defaults(args))
        except FileNotFoundError as exc:
            raise SystemExit(f"generate: --prompts {exc}") from None
    return as_submissions([Request.from_dict({**_defaults(args), "prompt": p}) for p in args.prompt])


def load_offloaded(checkpoint: str, ctx, options):
    """Meta-build the reference DiT from ``config.json``, bind mmap views, offload per ``options``."""
    from dlo_fn.models import BLOCK_PATHS, build_model, load_config
    from dlo_fn.runtime.load import load_model
    from dlo_fn.runtime.offload import offload

    config, dtype = load_config(checkpoint)
    model = build_model(config, "meta", dtype)
    model.init_buffers("cpu")
    model = load_model(checkpoint, model, progress=False)
    return offload(model, BLOCK_PATHS, ctx, options)


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from dlo_fn.plan.trace import to_chrome_trace
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.platform import detect_platform
    from dlo_fn.serve.batch import Fault
    from dlo_fn.serve.engine import Engine
    from dlo_fn.serve.outputs import write_outputs
    from dlo_fn.serve.requests import EngineOptions, result_table, wave_table

    if (args.prompt is None) == (args.prompts is None):
        raise SystemExit("generate: give --prompt (one or more) or --prompts FILE.jsonl, not both")
    options = options_from_args(args)
    platform = detect_platform(prefer=args.platform)
    ctx = init_distributed(platform, timeout_s=args.timeout)
    from dlo_fn.cli.budget import apply_host_budget

    options = apply_host_budget(args, ctx, options)
    code = 0
    engine = None
    try:
        offloaded = load_offloaded(args.checkpoint, ctx, options)
        engine = Engine(offloaded.model, offloaded, ctx,
                        EngineOptions(requests_per_rank=args.requests_per_rank, max_wait_s=args.max_wait_s,
                                      timeout_s=args.timeout, fault=Fault.from_env(), progress=None))
        if ctx.is_main:
            timeline = None
            try:
                report = engine.serve(submissions_from_args(args))
                if args.trace and engine.stopped is None:
                    timeline = engine.gather_timeline((("checkpoint", str(args.checkpoint)),))
            finally:
                engine.close()
            manifest = write_outputs(pathlib.Path(args.out), report)
            print(wave_table(report))
            print(result_table(report))
            print(f"wrote {sum(r.ok for r in report.results)} output(s), {len(report.results)} manifest line(s): "
                  f"{manifest}")
            if timeline is not None:
                pathlib.Path(args.trace).write_text(json.dumps(to_chrome_trace(timeline)))
                print(f"wrote every rank's measured timeline ({len(timeline.spans)} spans): {args.trace}")
            code = 0 if report.ok else 1
        else:
            engine.follow()
        offloaded.synchronize()
    finally:
        if ctx.group is not None and (engine is None or engine.stopped is None):
            torch.distributed.destroy_process_group()
    return code
