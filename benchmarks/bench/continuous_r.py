"""`python -m benchmarks bench continuous --r-sweep`: continuous serving on one device (dp = 1), R requests per load.

One process, one device, random weights of ``--config`` (``bench``: 24 blocks of 0.6 GB bf16). A mixed list of
image requests (two sizes in groups of 4, CFG on, step counts 2 and 4 alternating; ``--requests`` of them) is served
continuously with
``requests_per_rank = R`` for each R of ``--requests-per-rank``: at every step boundary the replica takes queued
requests up to R of one shape (:func:`dlo_fn.serve.continuous.admission_key`), so R requests of one size share
each loaded block and a request of the other size waits for its turn. Per R:

    per_output_step_s = serve wall time / sum of the requests' steps
    bound_s           = sum over ring steps k of max(sum_{q held at k} resident_step(q), weights / pinned peak)
                        / the same sum of steps

``resident_step(q)``: one request of q's size served alone by the resident model, wall / steps (the same random
weights on the device); the peak: best H2D of the arena's shards, in this run. ``identical``: every output's
SHA-256 equals the resident model's for the same request served alone. ``--quick``: the tiny config on
whatever device there is (a CPU smoke test of the same code path). Rows go to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import time

log = logging.getLogger(__name__)

FIELDS = (
    "requests_per_rank",
    "requests",
    "output_steps",
    "wall_s",
    "per_output_step_s",
    "bound_s",
    "ratio_to_bound",
    "ring_steps",
    "max_held",
    "identical_to_resident",
    "config",
    "workloads",
    "weight_bytes",
    "pinned_peak_bytes_per_s",
    "machine",
    "command",
    "date",
)


def requests(n: int, sizes, steps):
    from dlo_fn.models import Request
    from dlo_fn.serve.requests import Submission

    """Groups of 4 of one size (alternating sizes), step counts alternating inside a group."""
    return [
        Submission(
            f"r{i:02d}",
            Request(
                prompt=f"an image {i}",
                seed=i,
                height=sizes[(i // 4) % len(sizes)],
                width=sizes[(i // 4) % len(sizes)],
                num_frames=1,
                num_inference_steps=steps[i % len(steps)],
                guidance_scale=5.0,
            ),
        )
        for i in range(n)
    ]


def r_sweep(args: argparse.Namespace) -> list[dict]:
    import torch

    from benchmarks.bench import step_variants as sv
    from benchmarks.bench.step import machine
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.offload import offload
    from dlo_fn.runtime.platform import detect_platform
    from dlo_fn.serve.engine import Engine
    from dlo_fn.serve.requests import EngineOptions

    config = "tiny" if args.quick else args.config
    sizes = (32, 64) if args.quick else (1024, 768)
    steps = (2, 4)
    rs = [int(x) for x in args.requests_per_rank.split(",")]
    platform = detect_platform(prefer=None if args.quick else "cuda")
    ctx = init_distributed(platform)
    model = sv.random_model(config, platform.device)
    subs = requests(args.requests, sizes, steps)
    opts = EngineOptions(timeout_s=300.0, progress=False, serving="continuous")
    with torch.no_grad():
        resident = Engine(model, offload(model, "blocks", ctx, mode="resident"), ctx, opts)
        resident.serve(subs[:1])  # warm-up
        reference = resident.serve(subs)  # one at a time (R = 1): each request served alone
        step_s = {}
        for s in sorted(sizes):
            one = [x for x in subs if x.request.height == s][:1]
            times = []
            for _ in range(2):  # the second: warm
                t0 = time.perf_counter()
                resident.serve(one)
                platform.synchronize()
                times.append((time.perf_counter() - t0) / one[0].request.num_inference_steps)
            step_s[s] = times[-1]
        off = offload(model, "blocks", ctx, mode="allgather")
        peak = sv.pinned_peak_bytes_per_s(platform, off.store, off.layout)
        weight_bytes = off.layout.shard_bytes_per_rank
        transfer_s = weight_bytes / peak if peak else 0.0
        rows = []
        for r in rs:
            engine = Engine(model, off, ctx, dataclasses.replace(opts, requests_per_rank=r))
            engine.serve(subs[: min(r, len(subs))])  # warm-up: this R's schedule
            t0 = time.perf_counter()
            report = engine.serve(subs)
            platform.synchronize()
            wall = time.perf_counter() - t0
            total_steps = sum(x.request.num_inference_steps for x in subs)
            bound = sum(
                max(sum(step_s[report.results[i].request.height] for i in s.held[0]), transfer_s) for s in report.steps
            )
            same = all(a.sha256 == b.sha256 and a.ok for a, b in zip(report.results, reference.results))
            rows.append(
                {
                    "requests_per_rank": r,
                    "requests": len(subs),
                    "output_steps": total_steps,
                    "wall_s": wall,
                    "per_output_step_s": wall / total_steps,
                    "bound_s": bound / total_steps,
                    "ratio_to_bound": wall / bound,
                    "ring_steps": len(report.steps),
                    "max_held": max(len(s.held[0]) for s in report.steps),
                    "identical_to_resident": same,
                    "config": config,
                    "workloads": " + ".join(f"{s}x{s}x1 cfg" for s in sizes),
                    "weight_bytes": weight_bytes,
                    "pinned_peak_bytes_per_s": peak,
                }
            )
            log.info(
                "R %d: %.4f s per output-step, bound %.4f (%.3fx), identical %s",
                r,
                wall / total_steps,
                bound / total_steps,
                wall / bound,
                same,
            )
    desc = machine(platform)
    meta = {
        "machine": ", ".join(f"{k} {v}" for k, v in desc.items()),
        "command": (
            f"python -m benchmarks bench continuous --r-sweep --config {args.config} --requests "
            f"{args.requests} --requests-per-rank {args.requests_per_rank}" + (" --quick" if args.quick else "")
        ),
        "date": datetime.date.today().isoformat(),
    }
    return [dict(row, **meta) for row in rows]
