"""`python -m dlo_fn generate` (or under `torchrun`): generate videos with offloaded weights, served by the DP engine.

Requests come from ``--prompt`` (repeat for several; each takes the flags' settings and ``--seed``; ids
``req0000``, ``req0001``, ... in the order given) or from ``--prompts FILE.jsonl`` (one request per line, the
flags are the defaults). Under ``torchrun --nproc-per-node N`` every rank loads the checkpoint (mmap) and wraps
it for ``--mode``; rank 0 rejects bad lines and invalid requests before dispatch and groups the rest into waves
of up to ``N x --requests-per-rank`` compatible requests (:class:`dlo_fn.serve.engine.Engine`). In allgather
mode the waves run in lockstep and a rank with no request in a wave serves its shards to the all-gathers
without computing (a partial wave); rank-local and resident ranks work through their own queues. With ``--sp S``
the N ranks form a (N / S, S) mesh: waves go to the N / S replicas, the S ranks of each run its request together
(Ulysses sequence parallelism) and ``--shard-group`` picks which ranks split the block weights (world: all N,
each holding 1/N; dp: the reference's choice, 1/(N/S)). With ``--serving continuous`` (the default) the
allgather ring never stops between requests: a rank whose request ends takes the next queued one at the next
step boundary, and a stalled rank's peers go on without it (:mod:`dlo_fn.serve.continuous`). Rank 0 writes
under ``--out`` (:mod:`dlo_fn.serve.outputs`):

    <index>-<id>.npy           uint8 video [N, F, H, W, 3] (N = outputs per prompt)
    <index>-<id>.png           preview: one row per output, up to 8 evenly spaced frames side by side
    manifest.jsonl             one JSON line per request: settings, seed, shape, sha256, rank, wave, timings, mode
    waves.jsonl                strict serving: one JSON line per wave: who ran what, latency, status
    steps.jsonl                continuous serving: one JSON line per ring step: who computed what, when
    --trace FILE               every rank's measured three-stream timeline (Chrome / Perfetto)
    auto_policy.json           with --mode/--slots/--sp auto: the probed topology the policy chose from
                               (``python -m dlo_fn policy --topology`` it prints the ranked table)

The manifest's ``sha256`` is the SHA-256 of the video's uint8 bytes in C order (``np.load(npy).tobytes()``),
not of any file: the same request and seed give the same sha256 in every mode and for any number of ranks, while
the ``.npy`` and ``.png`` bytes also depend on numpy and PIL; ``file_sha256`` lists each written file's own hash.

Everything the command line decides is checked before a model is loaded (:func:`check_generate_args`): a bad
flag, checkpoint or request is one line on stderr and exit code 2. A ``--prompts`` line that cannot be
parsed, repeats an id or fails validation is printed as one line naming ``FILE:LINE`` before loading; the other
lines still run and the bad one gets a manifest line with its reason. Exit codes: 0 when every request produced
an output, 1 when any failed or was rejected (so torchrun then prints its ChildFailedError summary for rank 0:
the reasons are in the lines above it and in the manifest), 2 when nothing could run.
Rank 0 shows a bar of denoising steps per wave and one line per wave on stderr.
``DLO_FN_FAULT`` injects a fault for tests (:mod:`dlo_fn.serve.batch`).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib

from dlo_fn.cli import HelpFormatter, UsageError
from dlo_fn.plan.modes import MODES

log = logging.getLogger(__name__)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory or .safetensors file")
    parser.add_argument("--mode", choices=MODES + ("auto",), default=None,
                        help="weight placement (default allgather; auto: the policy chooses from start-up probes)")
    parser.add_argument("--no-allgather", action="store_true", help="same as --mode rank-local")
    parser.add_argument("--resident", action="store_true", help="same as --mode resident (no offload)")
    parser.add_argument("--slots", type=_slots_arg, default=2, help="device slots (2 = double buffer; auto: the "
                        "policy chooses from start-up probes)")
    parser.add_argument("--landing", type=int, default=None, help="landing buffers (allgather; default 2)")
    parser.add_argument("--rank-local-source", choices=("pinned", "mmap"), default="pinned",
                        help="rank-local: private pinned copy (fast H2D) or stream from the shared mmap")
    parser.add_argument("--block-call", choices=("functional_call", "swap"), default="functional_call",
                        help="how a block runs on its slot's views")
    parser.add_argument("--async-collectives", action="store_true",
                        help="CPU/gloo: overlap all-gathers with compute (async_op)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture each offloaded step as a CUDA graph and replay it (eager where unsupported)")
    parser.add_argument("--platform", choices=("cuda", "npu", "cpu"), default=None, help="default: detect")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective fails")
    parser.add_argument("--trace", default=None, help="write the measured timelines as Chrome trace JSON here")
    parser.add_argument("--sp", type=_sp_arg, default=1, metavar="S|auto",
                        help="sequence-parallel ranks per replica (Ulysses); dp = ranks / S. auto: the policy "
                             "chooses dp x sp among the divisors of the ranks that the model's heads allow, from "
                             "start-up probes (an all-to-all of an activation-sized tensor over the ranks, one "
                             "all-gather, one block; logged with the runner-up and the predicted step)")
    parser.add_argument("--shard-group", choices=("world", "dp", "sp"), default="world",
                        help="allgather: the ranks that split the block weights (dp: as the reference)")
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
    group.add_argument("--serving", choices=("strict", "continuous"), default="continuous",
                       help="continuous (default): a rank whose request ends takes the next queued one at the next "
                            "step boundary, and a stalled or dead rank's peers go on without it; strict: waves that "
                            "hold the ring until their last request ends")


EPILOG = """\
outputs: --out gets <index>-<id>.npy (uint8 video), .png previews, manifest.jsonl, waves.jsonl (strict) or
  steps.jsonl (continuous). The sha256
  printed and in the manifest is the SHA-256 of the video's uint8 bytes (np.load(npy).tobytes()), not of a file:
  it is the same in every mode and world size; the manifest's file_sha256 hashes each written file.
exit codes: 0 every request produced an output; 1 some did not (each reason is printed and in the manifest);
  2 a usage error, printed as one line before any model is loaded (nothing ran).
example (a CPU, seconds; random weights, so the video is noise):
  python -m dlo_fn make-checkpoint --model tiny --out ckpt/tiny
  python -m dlo_fn generate --checkpoint ckpt/tiny --prompt "a red fox" --height 64 --width 64 --frames 5 \\
      --steps 4 --out out/
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate videos with layerwise-offloaded weights (torchrun for several ranks)",
        description=__doc__.split("\n\n")[0] + " Run under torchrun --nproc-per-node N for N ranks; without "
        "torchrun it runs as one process. CPU ranks use gloo.", epilog=EPILOG,
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
        raise UsageError(f"generate: conflicting modes {sorted(chosen)}: pick one of --mode, --no-allgather, "
                         f"--resident")
    return chosen.pop() if chosen else "allgather"


# --- --mode auto / --slots auto (issue 14): probe at start-up, let the policy choose, log why -----------------
def _slots_arg(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--slots takes an int >= 1 or 'auto', got {text!r}") from None


def _sp_arg(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sp takes an int >= 1 or 'auto', got {text!r}") from None


def is_auto(args: argparse.Namespace) -> bool:
    return (args.mode == "auto" or args.sp == "auto"
            or (args.slots == "auto" and mode_from_args(args) != "resident"))


def auto_sps(args: argparse.Namespace, world_size: int, num_heads: int | None) -> tuple[int, ...]:
    """The sp sizes the policy may choose: ``--sp`` itself, or (``auto``) the divisors of the ranks that the
    heads allow (an sp > 1 mesh is served as ``--serving`` says: continuous per replica, or strict waves)."""
    from dlo_fn.runtime.probe import sp_choices

    return (args.sp,) if args.sp != "auto" else sp_choices(world_size, num_heads)


def choose_auto(args: argparse.Namespace, model, ctx):
    """Probe this machine for the first request, ask the policy (rank 0 decides for every rank), log the choice
    with the runner-up and the predicted step; returns the chosen :class:`~dlo_fn.plan.policy.PlanRow`."""
    import torch

    from dlo_fn.runtime.probe import choose, probe

    request = next(s.request for s in submissions_from_args(args) if s.request is not None)
    found = probe(model, ctx, request)
    mode = None if args.mode == "auto" else mode_from_args(args)
    sps = auto_sps(args, ctx.world_size, getattr(model.config, "num_heads", None))
    result = choose(found, mode=mode, num_slots=None if args.slots == "auto" else args.slots,
                    requests_per_rank=args.requests_per_rank, sps=sps)
    chosen = [result.chosen]
    if ctx.group is not None:
        torch.distributed.broadcast_object_list(chosen, src=0, group=ctx.group)
    if ctx.is_main:
        log.info("auto: %s; predicted step %.1f ms (%s)", result.why(), 1e3 * chosen[0].step_s, chosen[0].bound)
        _write_probe(args, found, sps)
    return chosen[0]


def _write_probe(args: argparse.Namespace, found, sps) -> None:
    """``<out>/auto_policy.json``: the measured topology, model and workload, so ``python -m dlo_fn policy
    --topology`` that file prints the table this choice was made from."""
    from dlo_fn.repro.topologies import probe_to_dict

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "auto_policy.json"
    path.write_text(json.dumps(probe_to_dict(found.topology, found.model, found.workload, sps), indent=1))
    log.info("auto: measured topology in %s (python -m dlo_fn policy --topology %s --slots 2,3,4,5,6 prints "
             "its table)", path, path)


def log_predicted_vs_measured(report, chosen) -> None:
    rows = [(f"wave {w.wave_id}", w.latency_s / w.num_steps) for w in report.waves[:2] if w.num_steps]
    rows = rows or [(f"ring step {s.step}", s.end_s - s.start_s) for s in report.steps[1:3]]  # continuous
    for what, measured in rows:
        log.info("auto: %s: measured %.1f ms per step, predicted %.1f ms (%+.1f%%)", what,
                 1e3 * measured, 1e3 * chosen.step_s, 100 * (measured / chosen.step_s - 1))


def options_from_args(args: argparse.Namespace):
    from dlo_fn.runtime.offload import OffloadOptions

    mode = mode_from_args(args)
    return OffloadOptions(mode="allgather" if mode == "auto" else mode,  # auto: replaced once probed
                          num_slots=2 if args.slots == "auto" else args.slots, num_landing=args.landing,
                          rank_local_source=args.rank_local_source, block_call=args.block_call,
                          async_collectives=args.async_collectives, record_timeline=bool(args.trace),
                          progress=True, graph=args.cuda_graph, shard_group=args.shard_group)


def _defaults(args: argparse.Namespace) -> dict:
    """The request fields the flags set (a prompts line may override them)."""
    fields = {"negative_prompt": args.negative_prompt or None, "num_inference_steps": args.steps,
              "height": args.height, "width": args.width, "num_frames": args.frames,
              "guidance_scale": args.guidance, "shift": args.shift, "seed": args.seed}
    return {k: v for k, v in fields.items() if v is not None}


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
            raise UsageError("generate: --sp auto plans the offload modes (allgather, rank-local): drop --resident "
                             "(or --mode resident), or give --sp S")
        if args.shard_group != "world":
            raise UsageError(f"generate: --sp auto chooses the shard group too: drop --shard-group "
                             f"{args.shard_group}, or give --sp S")
        return
    if args.sp < 1 or world % args.sp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise UsageError(f"generate: --sp {args.sp} does not divide the {world} rank(s) "
                         f"(torchrun --nproc-per-node): use --sp in {divisors}")
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
    try:
        options = options_from_args(args)
    except ValueError as exc:
        raise UsageError(f"generate: {exc}") from None
    config = check_checkpoint(args.checkpoint)
    check_sp_args(args, config)
    return options, submissions_from_args(args, config)


def mesh_from_args(args: argparse.Namespace, ctx):
    """The (dp, sp) mesh for ``--sp`` (dp = ranks / sp), or None for the plain world (and for ``--sp auto``,
    whose mesh is built once the policy chose: :func:`load_offloaded`)."""
    from dlo_fn.runtime.mesh import build_mesh

    if args.sp == "auto":
        return None
    if args.sp < 1 or ctx.world_size % args.sp:
        raise UsageError(f"generate: --sp {args.sp} does not divide the {ctx.world_size} rank(s)")
    return build_mesh(ctx, sp=args.sp) if args.sp > 1 or args.shard_group != "world" else None


def load_offloaded(checkpoint: str, ctx, options, auto=None, mesh=None, sp_auto: bool = False):
    """Load a checkpoint (its config names the model; mmap views, nothing copied) and offload per ``options``
    (with ``auto``, a callable model -> PlanRow, its chosen mode and slots) on ``mesh`` (None: the world; with
    ``sp_auto`` the (dp, sp) mesh and shard group the policy chose). Returns ``(offloaded, mesh)``."""
    from dlo_fn.runtime.load import load_model
    from dlo_fn.runtime.mesh import build_mesh
    from dlo_fn.runtime.offload import offload

    model = load_model(checkpoint, progress=False)
    if auto is not None:
        import dataclasses

        chosen = auto(model).candidate
        options = dataclasses.replace(options, mode=chosen.mode, num_slots=chosen.num_slots)
        if sp_auto:
            group = "dp" if chosen.shard_group == "dp" else "world"
            options = dataclasses.replace(options, shard_group=group)
            mesh = build_mesh(ctx, sp=chosen.sp) if chosen.sp > 1 or group != "world" else None
    return offload(model, ctx=ctx, options=options, mesh=mesh), mesh


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from dlo_fn.plan.trace import to_chrome_trace
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.platform import detect_platform
    from dlo_fn.serve.batch import Fault
    from dlo_fn.serve.engine import Engine
    from dlo_fn.serve.outputs import write_outputs
    from dlo_fn.serve.requests import EngineOptions, result_table, wave_table

    from dlo_fn.cli.checks import report_failures

    options, submissions = check_generate_args(args)
    platform = detect_platform(prefer=args.platform)
    ctx = init_distributed(platform, timeout_s=args.timeout)
    from dlo_fn.cli.budget import apply_host_budget

    options = apply_host_budget(args, ctx, options)
    code = 0
    engine = None
    try:
        picked = []
        auto = (lambda m: picked.append(choose_auto(args, m, ctx)) or picked[-1]) if is_auto(args) else None
        mesh = mesh_from_args(args, ctx)
        offloaded, mesh = load_offloaded(args.checkpoint, ctx, options, auto, mesh, sp_auto=args.sp == "auto")
        engine = Engine(offloaded.model, offloaded, ctx,
                        EngineOptions(requests_per_rank=args.requests_per_rank, max_wait_s=args.max_wait_s,
                                      timeout_s=args.timeout, fault=Fault.from_env(), progress=True,
                                      serving=args.serving), mesh=mesh, checkpoint=args.checkpoint)
        if ctx.is_main:
            timeline = None
            try:
                report = engine.serve(submissions)
                if picked:
                    log_predicted_vs_measured(report, picked[0])
                if args.trace and engine.stopped is None and engine.degraded is None:
                    timeline = engine.gather_timeline((("checkpoint", str(args.checkpoint)),))
            finally:
                engine.close()
            manifest = write_outputs(pathlib.Path(args.out), report)
            print(wave_table(report) if report.waves or not report.steps else
                  f"continuous serving: {len(report.steps)} ring step(s) on {report.dp_size} rank(s)"
                  + (f"; {report.degraded}" if report.degraded else ""))
            print(result_table(report))
            print(f"wrote {sum(r.ok for r in report.results)} output(s), {len(report.results)} manifest line(s): "
                  f"{manifest}")
            if timeline is not None:
                pathlib.Path(args.trace).write_text(json.dumps(to_chrome_trace(timeline)))
                print(f"wrote every rank's measured timeline ({len(timeline.spans)} spans): {args.trace}")
            code = report_failures(report, [s.error for s in submissions if s.error])
        else:
            engine.follow()
        offloaded.synchronize()
    finally:
        if ctx.group is not None and (engine is None or (engine.stopped is None and engine.degraded is None)):
            torch.distributed.destroy_process_group()
    return code
