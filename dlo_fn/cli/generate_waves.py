"""`generate --prompts FILE.jsonl`: serve a prompts file with the DP engine (waves of compatible requests).

Under ``torchrun --nproc-per-node N`` every rank loads the checkpoint (mmap) and wraps it for ``--mode``; rank 0
reads the file, rejects bad lines and invalid requests before dispatch, groups the rest into waves of up to
``N x --requests-per-rank`` compatible requests (allgather: lockstep waves; rank-local / resident: one queue
per rank), and writes every video, its preview, ``manifest.jsonl`` and ``waves.jsonl`` under ``--out``
(:mod:`dlo_fn.serve.outputs`). Exit code 0 when every request produced an output, 1 otherwise (each failure is
in the manifest with its reason). ``DLO_FN_FAULT`` injects a fault for tests (:mod:`dlo_fn.serve.batch`).
"""

from __future__ import annotations

import argparse
import logging
import pathlib

log = logging.getLogger(__name__)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("DP engine (with --prompts)")
    group.add_argument("--requests-per-rank", type=int, default=1, metavar="R",
                       help="requests each rank runs block-major per wave (one weight load serves R requests)")
    group.add_argument("--max-wait-s", type=float, default=0.0,
                       help="bounded wait to fill a wave (a closed prompts file never waits)")


def _defaults(args: argparse.Namespace) -> dict:
    fields = {"negative_prompt": args.negative_prompt or None, "num_inference_steps": args.steps,
              "height": args.height, "width": args.width, "num_frames": args.frames,
              "guidance_scale": args.guidance, "shift": args.shift, "seed": args.seed}
    return {k: v for k, v in fields.items() if v is not None}


def run_prompts(args: argparse.Namespace) -> int:
    import torch

    from dlo_fn.cli.generate import load_offloaded, options_from_args
    from dlo_fn.serve.batch import Fault
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.serve.engine import Engine
    from dlo_fn.serve.outputs import write_outputs
    from dlo_fn.runtime.platform import detect_platform
    from dlo_fn.serve.requests import EngineOptions, read_prompts, result_table, wave_table

    options = options_from_args(args)
    platform = detect_platform(prefer=args.platform)
    ctx = init_distributed(platform, timeout_s=args.timeout)
    code = 0
    engine = None
    try:
        offloaded = load_offloaded(args.checkpoint, ctx, options)
        engine = Engine(offloaded.model, offloaded, ctx,
                        EngineOptions(requests_per_rank=args.requests_per_rank, max_wait_s=args.max_wait_s,
                                      timeout_s=args.timeout, fault=Fault.from_env(), progress=None))
        if ctx.is_main:
            try:
                report = engine.serve(read_prompts(args.prompts, _defaults(args)))
            finally:
                engine.close()
            manifest = write_outputs(pathlib.Path(args.out), report)
            print(wave_table(report))
            print(result_table(report))
            print(f"wrote {sum(r.ok for r in report.results)} output(s), {len(report.results)} manifest line(s): "
                  f"{manifest}")
            code = 0 if report.ok else 1
        else:
            engine.follow()
    finally:
        if ctx.group is not None and (engine is None or engine.stopped is None):
            torch.distributed.destroy_process_group()
    return code
