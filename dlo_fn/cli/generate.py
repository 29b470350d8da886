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
under ``--out`` (:mod:`dlo_fn.serve.outputs`), each request's files and manifest line as soon as it ends
(:mod:`dlo_fn.serve.writer`; a killed run keeps them, and on SIGTERM or Ctrl-C every request still running or
queued gets a "not completed" line):

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
On a terminal rank 0 shows a bar on stderr: the denoising steps of each wave (strict), or the requests done and
queued and the ring step (continuous); logs (stderr not a terminal) get only the log lines.
``DLO_FN_FAULT`` injects a fault for tests (:mod:`dlo_fn.serve.batch`).

This module registers the command and runs it (:func:`run_generate`: load, offload, serve, write); its flags,
the options and requests they build and the checks before loading are in :mod:`dlo_fn.cli.generate_args`, the
start-up probe and policy choice of ``auto`` in :mod:`dlo_fn.cli.generate_auto`. Every name stays importable
from here.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from dlo_fn.cli import HelpFormatter, UsageError
from dlo_fn.cli.generate_args import (
    add_engine_arguments,
    add_model_arguments,
    add_request_arguments,
    check_generate_args,
    check_sp_args,
    mode_from_args,
    options_from_args,
    submissions_from_args,
)
from dlo_fn.cli.generate_auto import auto_sps, choose_auto, is_auto, log_predicted_vs_measured

__all__ = [
    "EPILOG",
    "add_engine_arguments",
    "add_model_arguments",
    "add_request_arguments",
    "auto_sps",
    "check_generate_args",
    "check_sp_args",
    "choose_auto",
    "is_auto",
    "load_loras",
    "load_offloaded",
    "log_predicted_vs_measured",
    "mesh_from_args",
    "mode_from_args",
    "options_from_args",
    "register",
    "run_generate",
    "submissions_from_args",
]


EPILOG = """\
outputs: --out gets <index>-<id>.npy (uint8 video), .png previews, manifest.jsonl, waves.jsonl (strict) or
  steps.jsonl (continuous). Each request's files and manifest line are written when it ends (files renamed into
  place, the line appended), so a run that is killed keeps every finished request; on SIGTERM (torchrun sends it
  to every worker when one exits) or Ctrl-C, rank 0 adds a "not completed" line for each request still running
  or queued (exit 143 / 130). An --out that holds an earlier run's outputs is refused before anything loads;
  --out-exists clean deletes those files first. The sha256
  printed and in the manifest is the SHA-256 of the video's uint8 bytes (np.load(npy).tobytes()), not of a file:
  it is the same in every mode and world size; the manifest's file_sha256 hashes each written file.
exit codes: 0 every request produced an output; 1 some did not (each reason is printed and in the manifest);
  2 a usage error, printed as one line before any model is loaded (nothing ran); 143 stopped by SIGTERM (every
  request still without a result gets a "not completed" line first). On NCCL a collective that times out
  (--timeout; a peer died or stalled) ends its process through torch.distributed's watchdog.
environment: DLO_FN_FAULT (tests and drills) injects a fault:
  '{"rank": R, "kind": "raise|stall|exit", "step": S, "wave": W}' makes rank R raise, stall or exit at block 0
  of denoising step S of wave W (strict serving), or of ring step S (continuous serving, which has no waves:
  "wave" must be 0 or left out); "step" and "wave" default to 0.
example (a CPU, seconds; random weights, so the video is noise):
  python -m dlo_fn make-checkpoint --model tiny --out ckpt/tiny
  python -m dlo_fn generate --checkpoint ckpt/tiny --prompt "a red fox" --height 64 --width 64 --frames 5 \\
      --steps 4 --out out/
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate videos with layerwise-offloaded weights (torchrun for several ranks)",
        description=__doc__.split("\n\n")[0] + " Run under torchrun --nproc-per-node N for N ranks; without "
        "torchrun it runs as one process. CPU ranks use gloo. Without --height/--width/--frames/--steps each "
        "prompt runs the published size (832x480, 29 frames, 35 steps: minutes to hours on a CPU, even for the "
        "tiny model; it says its FLOPs and least time before starting): --height 64 --width 64 --frames 5 "
        "--steps 4 runs in seconds.",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    add_model_arguments(parser)
    add_request_arguments(parser)
    parser.add_argument("--out", required=True, help="output directory")
    add_engine_arguments(parser)
    parser.set_defaults(func=run_generate)


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
    (with ``auto``, a callable model -> PlanRow, its chosen mode, slots and load group) on ``mesh`` (None: the
    world; with ``sp_auto`` the (dp, sp) mesh and shard group the policy chose). Returns ``(offloaded, mesh)``."""
    from dlo_fn.io.load import load_model
    from dlo_fn.runtime.mesh import build_mesh
    from dlo_fn.runtime.offload import offload

    model = load_model(checkpoint, progress=False)
    kw = {}
    if auto is not None:
        import dataclasses

        row = auto(model)
        if row.placed_by is not None:  # under --hbm-budget: the resident set of the row the policy chose
            from dlo_fn.runtime.budget import Placement

            kw["placement"] = Placement.from_policy(row.placed_by)
        chosen = row.candidate
        options = dataclasses.replace(
            options, mode=chosen.mode, num_slots=chosen.num_slots, load_group=chosen.load_group
        )
        if chosen.load_group > 1 and chosen.num_landing:  # allgather at W > 1: the 2G landing buffers it priced
            options = dataclasses.replace(options, num_landing=chosen.num_landing)
        if sp_auto:
            group = "dp" if chosen.shard_group == "dp" else "world"
            options = dataclasses.replace(options, shard_group=group)
            mesh = build_mesh(ctx, sp=chosen.sp) if chosen.sp > 1 or group != "world" else None
    return offload(model, ctx=ctx, options=options, mesh=mesh, **kw), mesh


def load_loras(model, args: argparse.Namespace) -> None:
    """Each ``--lora`` file loaded into the offloaded model under its stem (:func:`dlo_fn.models.lora.load_adapter`:
    the adapter weights on the device, the base weights untouched in the shards)."""
    from dlo_fn.cli.generate_args import lora_names

    if not args.lora:
        return
    from dlo_fn.models.lora import load_adapter

    for file, name in zip(args.lora, lora_names(args)):
        try:
            load_adapter(model, file, name)
        except ValueError as exc:  # e.g. written for another model's config
            raise UsageError(f"generate: --lora {file}: {exc}") from None


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.platform import detect_platform

    options, submissions = check_generate_args(args)
    platform = detect_platform(prefer=args.platform)
    ctx = init_distributed(platform, timeout_s=args.timeout)
    if ctx.is_main:
        from dlo_fn.cli.checks import _stderr
        from dlo_fn.cli.generate_size import default_size_note
        from dlo_fn.models import load_config

        note = default_size_note(args, submissions, load_config(args.checkpoint)[0], platform)
        if note:
            _stderr(f"dlo_fn generate: {note}")
    from dlo_fn.cli.budget import apply_host_budget

    options = apply_host_budget(args, ctx, options)
    writer = _open_writer(args, submissions) if ctx.is_main else None
    built: dict = {}  # the engine, once _serve built it: whether its group may be destroyed
    try:
        with _sigterm_guard(writer):
            code = _serve(args, ctx, options, submissions, writer, built)
    except BaseException as exc:  # every request still without a line gets one, then the error goes on
        if writer is not None and writer.stopped is None:
            why = (
                "interrupted (Ctrl-C)"
                if isinstance(exc, KeyboardInterrupt)
                else (f"the run failed before this request finished: {type(exc).__name__}: {str(exc)[:200]}")
            )
            writer.stop(why)
        raise
    finally:
        engine = built.get("engine")
        if ctx.group is not None and (engine is None or (engine.stopped is None and engine.degraded is None)):
            torch.distributed.destroy_process_group()
    return code


def _open_writer(args: argparse.Namespace, submissions):
    """Rank 0's :class:`~dlo_fn.serve.writer.ResultWriter` on ``--out`` (every rank has passed its checks: the
    process group exists), with the prompts lines rejected before loading already written."""
    from dlo_fn.serve.requests import RequestResult
    from dlo_fn.serve.writer import ResultWriter

    writer = ResultWriter(args.out, existing=args.out_exists, expected=submissions)
    for i, sub in enumerate(submissions):
        if sub.error is not None:
            writer.write(RequestResult(i, sub.request_id, sub.request, False, error=sub.error))
    return writer


def _sigterm_guard(writer):
    import contextlib

    from dlo_fn.cli.checks import _stderr
    from dlo_fn.serve.writer import finish_on_sigterm

    if writer is None:
        return contextlib.nullcontext()
    return finish_on_sigterm(writer, say=lambda text: _stderr(f"dlo_fn generate: {text}"))


def _serve(args: argparse.Namespace, ctx, options, submissions, writer, built: dict) -> int:
    """Load, offload and serve (rank 0 writes each result as it ends, then the tables); the exit code.
    ``built["engine"]``: the engine, as soon as it exists."""
    from dlo_fn.cli.checks import report_failures
    from dlo_fn.plan.trace import to_chrome_trace
    from dlo_fn.serve.batch import Fault
    from dlo_fn.serve.engine import Engine
    from dlo_fn.serve.requests import EngineOptions, result_table, wave_table

    code = 0
    picked = []
    auto = (lambda m: picked.append(choose_auto(args, m, ctx)) or picked[-1]) if is_auto(args) else None
    mesh = mesh_from_args(args, ctx)
    offloaded, mesh = load_offloaded(args.checkpoint, ctx, options, auto, mesh, sp_auto=args.sp == "auto")
    load_loras(offloaded.model, args)
    engine = Engine(
        offloaded.model,
        offloaded,
        ctx,
        EngineOptions(
            requests_per_rank=args.requests_per_rank,
            max_wait_s=args.max_wait_s,
            timeout_s=args.timeout,
            fault=Fault.from_env(),
            progress=None,
            serving=args.serving,
            keep_videos=False,
        ),  # written as they end
        mesh=mesh,
        checkpoint=args.checkpoint,
    )
    built["engine"] = engine
    if ctx.is_main:
        timeline = None
        writer.info = engine.run_info
        try:
            report = engine.serve(submissions, on_result=writer.write)
            if picked:
                log_predicted_vs_measured(report, picked[0])
            if args.trace and engine.stopped is None and engine.degraded is None:
                timeline = engine.gather_timeline((("checkpoint", str(args.checkpoint)),))
        finally:
            engine.close()
        manifest = writer.finish(report)
        print(
            wave_table(report)
            if report.waves or not report.steps
            else f"continuous serving: {len(report.steps)} ring step(s) on {report.dp_size} rank(s)"
            + (f"; {report.degraded}" if report.degraded else "")
        )
        print(result_table(report))
        print(
            f"wrote {sum(r.ok for r in report.results)} output(s), {len(report.results)} manifest line(s): {manifest}"
        )
        if timeline is not None:
            pathlib.Path(args.trace).write_text(json.dumps(to_chrome_trace(timeline)))
            print(f"wrote every rank's measured timeline ({len(timeline.spans)} spans): {args.trace}")
        code = report_failures(report, [s.error for s in submissions if s.error])
    else:
        code = _follow(engine, ctx.rank)
    offloaded.synchronize()
    return code


def _follow(engine, rank: int) -> int:
    """A follower serves until rank 0 says stop (0), or says in one line why it stopped (1): rank 0 died, or this
    rank was left behind (it stalled past --timeout and the others went on). Rank 0 wrote every request's
    outcome that it saw end; a lost group's raw error is no traceback either."""
    import torch.distributed as dist

    from dlo_fn.cli import EXIT_FAILURE, _say

    try:
        engine.follow()
    except dist.DistError as exc:
        engine.stopped = f"lost the process group ({type(exc).__name__}: {exc}): rank 0 died or the others went on"
    if engine.stopped is None:
        return 0
    _say(
        "generate",
        f"rank {rank}: {engine.stopped}; rank 0's --out manifest.jsonl has every request that ended; run the "
        "rest again (a rank that stalls needs a longer --timeout)",
    )
    return EXIT_FAILURE
