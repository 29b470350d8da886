"""`python -m dlo_fn generate` (or under `torchrun`): generate videos with offloaded weights.

Requests are placed statically: request ``j`` runs on rank ``j % W`` in wave ``j // W``. In allgather mode a
rank with no request in a wave serves its shards to the all-gathers without computing (a partial wave), so
the collectives stay in step. Rank 0 gathers every result and writes, under ``--out``:

    request-<j>[-<n>].npy      uint8 video [F, H, W, 3] (one file per output of the prompt)
    request-<j>[-<n>].png      preview: up to 8 evenly spaced frames side by side
    manifest.jsonl             one JSON line per request: settings, seed, shape, sha256, rank, wave, timings
    trace.json (--trace)       every rank's measured three-stream timeline (Chrome / Perfetto)

The same request and seed give the same sha256 in every mode and for any number of ranks.

Building blocks for richer drivers (the DP engine imports them): :func:`add_model_arguments`,
:func:`add_request_arguments`, :func:`options_from_args`, :func:`requests_from_args`, :func:`load_offloaded`,
:func:`run_request`, :func:`save_result`, :func:`gather_to_rank0`, :func:`write_manifest`.
"""

from __future__ import annotations

import argparse

from dlo_fn.cli import HelpFormatter
import json
import logging
import pathlib
import time
from typing import Any, Sequence

log = logging.getLogger(__name__)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory or .safetensors file")
    parser.add_argument("--mode", choices=("allgather", "rank-local", "resident"), default=None,
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


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", default=None,
                        help="a prompt (repeat for several); or give --prompts")
    parser.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                        help="JSON lines, one request per line with any Request fields (+ optional \"id\"); "
                             "served in waves of compatible requests by the DP engine (dlo_fn.serve.engine); "
                             "the flags above are the defaults for fields a line leaves out")
    parser.add_argument("--negative-prompt", default="", help="unconditional-branch prompt")
    parser.add_argument("--seed", type=int, default=0, help="noise seed (every prompt uses it)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: Request's 35)")
    parser.add_argument("--height", type=int, default=None, help="pixel height, a multiple of 16 (default: the Request default, 480)")
    parser.add_argument("--width", type=int, default=None, help="pixel width, a multiple of 16 (default: the Request default, 832)")
    parser.add_argument("--frames", type=int, default=None, help="pixel frames, 1 + 4k (1 = image)")
    parser.add_argument("--guidance", type=float, default=None, help="CFG scale (1 = off)")
    parser.add_argument("--shift", type=float, default=None, help="timestep shift")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate videos with layerwise-offloaded weights (torchrun for several ranks)",
        description=__doc__.split("\n\n")[0] + " Run under torchrun --nproc-per-node N for N ranks; without "
        "torchrun it runs as one process. CPU ranks use gloo.",
        formatter_class=HelpFormatter)
    add_model_arguments(parser)
    add_request_arguments(parser)
    parser.add_argument("--out", required=True, help="output directory")
    from dlo_fn.cli.generate_waves import add_engine_arguments

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


def requests_from_args(args: argparse.Namespace) -> list:
    from dlo_fn.models import Request

    fields = {"negative_prompt": args.negative_prompt, "num_inference_steps": args.steps, "height": args.height,
              "width": args.width, "num_frames": args.frames, "guidance_scale": args.guidance,
              "shift": args.shift}
    fields = {k: v for k, v in fields.items() if v is not None}
    return [Request(prompt=p, seed=args.seed, **fields) for p in args.prompt]


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


def run_request(offloaded, request, compute: bool = True):
    """One request as one run of the ring (``compute=False``: serve the loads only and return None)."""
    import torch

    from dlo_fn.models import generate

    if not compute:
        offloaded.idle(request.num_inference_steps)
        return None
    with torch.no_grad(), offloaded.run(num_steps=request.num_inference_steps):
        return generate(offloaded.model, request)


def preview_strip(video, max_frames: int = 8):
    """[F, H, W, 3] uint8 -> a PIL image of up to ``max_frames`` evenly spaced frames side by side."""
    import numpy as np
    from PIL import Image

    frames = video.shape[0]
    idx = sorted({round(i * (frames - 1) / max(max_frames - 1, 1)) for i in range(min(frames, max_frames))})
    return Image.fromarray(np.concatenate([video[i] for i in idx], axis=1))


def save_result(out_dir: pathlib.Path, index: int, request, video) -> list[str]:
    """Write each output of one request (``video`` uint8 [N, F, H, W, 3] numpy); returns the file names."""
    import numpy as np

    names = []
    for n in range(video.shape[0]):
        stem = f"request-{index}" + (f"-{n}" if video.shape[0] > 1 else "")
        np.save(out_dir / f"{stem}.npy", video[n])
        preview_strip(video[n]).save(out_dir / f"{stem}.png")
        names += [f"{stem}.npy", f"{stem}.png"]
    return names


def gather_to_rank0(obj: Any, ctx) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (in rank order), None elsewhere; a plain list without a group."""
    if ctx.group is None:
        return [obj]
    import torch.distributed as dist

    out = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=ctx.group)
    return out


def write_manifest(out_dir: pathlib.Path, rows: Sequence[dict]) -> pathlib.Path:
    path = out_dir / "manifest.jsonl"
    with path.open("w") as f:
        for row in sorted(rows, key=lambda r: r["request"]):
            f.write(json.dumps(row, sort_keys=True) + "\n")
    return path


def _request_row(index: int, request, result, rank: int, wave: int, mode: str, seconds: float) -> dict:
    import dataclasses

    settings = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
    settings["extra_args"] = dict(settings["extra_args"])
    return {"request": index, **settings, "shape": list(result.video.shape), "sha256": result.sha256,
            "rank": rank, "wave": wave, "mode": mode, "seconds": round(seconds, 6)}


def run_generate(args: argparse.Namespace) -> int:
    import torch

    if (args.prompt is None) == (args.prompts is None):
        raise SystemExit("generate: give --prompt (one or more) or --prompts FILE.jsonl, not both")
    if args.prompts is not None:
        from dlo_fn.cli.generate_waves import run_prompts

        return run_prompts(args)

    from dlo_fn.plan.trace import to_chrome_trace
    from dlo_fn.plan.timeline import Timeline
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.platform import detect_platform

    options = options_from_args(args)
    requests = requests_from_args(args)
    platform = detect_platform(prefer=args.platform)
    ctx = init_distributed(platform, timeout_s=args.timeout)
    out_dir = pathlib.Path(args.out)
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        offloaded = load_offloaded(args.checkpoint, ctx, options)
        load_s = time.perf_counter() - t0
        mine = []
        num_waves = -(-len(requests) // ctx.world_size)
        for wave in range(num_waves):
            index = wave * ctx.world_size + ctx.rank
            request = requests[index] if index < len(requests) else None
            t1 = time.perf_counter()
            result = run_request(offloaded, request or requests[wave * ctx.world_size], compute=request is not None)
            if result is not None:
                video = result.video.numpy()
                mine.append((_request_row(index, request, result, ctx.rank, wave, options.mode,
                                          time.perf_counter() - t1), video))
        timeline = None
        if options.record_timeline and offloaded.executor is not None:
            timeline = offloaded.executor.take_timeline((("checkpoint", str(args.checkpoint)),))
        everything = gather_to_rank0((mine, timeline, load_s), ctx)
        if ctx.is_main:
            rows, spans, meta = [], [], ()
            for rank_mine, rank_tl, rank_load_s in everything:
                for row, video in rank_mine:
                    row["files"] = save_result(out_dir, row["request"], requests[row["request"]], video)
                    row["load_seconds"] = round(rank_load_s, 6)
                    rows.append(row)
                if rank_tl is not None:
                    spans.extend(rank_tl.spans)
                    meta = rank_tl.meta
            path = write_manifest(out_dir, rows)
            if args.trace:
                trace = to_chrome_trace(Timeline(tuple(spans), meta))
                pathlib.Path(args.trace).write_text(json.dumps(trace))
            for row in sorted(rows, key=lambda r: r["request"]):
                print(f"request {row['request']} (rank {row['rank']}, wave {row['wave']}): {row['sha256']}")
            print(f"wrote {len(rows)} output(s) and {path}")
        offloaded.synchronize()
    finally:
        if ctx.group is not None:
            torch.distributed.destroy_process_group()
    return 0
