"""`python -m benchmarks bench waves --r-sweep`: per-output time vs R on one device, against its bound.

One process, one device, the DP engine with ``dp = 1``: waves of ``R`` compatible requests, each rank running its
``R`` requests block-major, so one H2D of a block serves ``R`` requests. For the transfer-bound workload (1024^2
image with CFG on the ``bench`` config: 24 blocks of 0.6 GB bf16) the per-output step should approach

    bound_s(R) = max(one request's resident step, weight bytes per step / (R x pinned H2D peak))

measured in the same run (resident: the same random weights on the device; peak: best H2D of the host arena's
shards). Reports, per R: the wave latency, per-output seconds per step, the bound, their ratio (target <= 1.05),
and whether a request served inside a wave of R is byte-identical to the resident model's output. ``--quick`` runs
the tiny config on
whatever device there is (a CPU smoke test of the same code path).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import statistics

log = logging.getLogger(__name__)

FIELDS = (
    "requests_per_rank",
    "wave_latency_s",
    "per_output_step_s",
    "resident_step_s",
    "transfer_step_s",
    "bound_s",
    "ratio_to_bound",
    "identical_to_resident",
    "config",
    "workload",
    "steps",
    "weight_bytes",
    "pinned_peak_bytes_per_s",
    "machine",
    "command",
    "date",
)


def _requests(n: int, args: argparse.Namespace, start: int):
    from dlo_fn.models import Request

    return [
        Request(
            prompt=f"an image {start + i}",
            seed=start + i,
            height=args.height,
            width=args.width,
            num_frames=args.frames,
            num_inference_steps=args.steps,
            guidance_scale=5.0,
        )
        for i in range(n)
    ]


def _serve(engine, requests, waves: int, r: int):
    """``waves`` timed waves of ``r`` requests after one warm-up wave; returns (median latency, report)."""
    import dataclasses

    engine.options = dataclasses.replace(engine.options, requests_per_rank=r)
    engine.serve(requests[:r])  # warm-up: compiles this R's schedule, warms the allocator
    report = engine.serve(requests[r : r * (waves + 1)])
    if not report.ok or any(w.num_requests != r for w in report.waves):
        raise RuntimeError(f"r-sweep: R {r}: {[(w.wave_id, w.num_requests, w.status) for w in report.waves]}")
    return statistics.median(w.latency_s for w in report.waves), report


def r_sweep(args: argparse.Namespace) -> list[dict]:
    import torch

    from benchmarks.bench import step_variants as sv
    from benchmarks.bench.step import machine
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.offload import offload
    from dlo_fn.runtime.platform import detect_platform
    from dlo_fn.serve.engine import Engine
    from dlo_fn.serve.requests import EngineOptions

    rs = [int(x) for x in args.requests_per_rank.split(",")]
    platform = detect_platform(prefer=args.platform)
    ctx = init_distributed(platform)
    model = sv.random_model(args.config, platform.device)
    need = max(rs) * (args.waves + 1)
    reqs = _requests(need, args, 0)
    opts = EngineOptions(timeout_s=args.timeout_s, progress=False, serving="strict")  # waves of R
    with torch.no_grad():
        resident = Engine(model, offload(model, "blocks", ctx, mode="resident"), ctx, opts)
        res_latency, res_report = _serve(resident, reqs, args.waves, 1)
        reference = res_report.results[0].sha256  # reqs[1], served alone by the resident model
        off = offload(model, "blocks", ctx, mode="allgather")  # blocks -> the pinned arena; device: 2 slots
        engine = Engine(model, off, ctx, opts)
        peak = sv.pinned_peak_bytes_per_s(platform, off.store, off.layout)
        weight_bytes = off.layout.shard_bytes_per_rank
        rows = []
        for r in rs:
            latency, _ = _serve(engine, reqs, args.waves, r)
            # reqs[1] again, now inside a wave of R requests: the same bytes as resident and alone.
            again = engine.serve(reqs[1 : 1 + r]).results[0].sha256
            per_output = latency / r / args.steps
            resident_step = res_latency / args.steps
            transfer = weight_bytes / (r * peak) if peak else 0.0
            bound = max(resident_step, transfer)
            rows.append(
                {
                    "requests_per_rank": r,
                    "wave_latency_s": latency,
                    "per_output_step_s": per_output,
                    "resident_step_s": resident_step,
                    "transfer_step_s": transfer,
                    "bound_s": bound,
                    "ratio_to_bound": per_output / bound,
                    "identical_to_resident": again == reference,
                    "config": args.config,
                    "workload": f"{args.width}x{args.height}x{args.frames} cfg",
                    "steps": args.steps,
                    "weight_bytes": weight_bytes,
                    "pinned_peak_bytes_per_s": peak,
                }
            )
            log.info("R %d: %.4f s per output-step, bound %.4f s (%.3fx)", r, per_output, bound, per_output / bound)
    desc = machine(platform)
    meta = {
        "machine": ", ".join(f"{k} {v}" for k, v in desc.items()),
        "command": _command(args),
        "date": datetime.date.today().isoformat(),
    }
    return [dict(row, **meta) for row in rows]


def _command(args: argparse.Namespace) -> str:
    return (
        f"python -m benchmarks bench waves --r-sweep --config {args.config} --requests-per-rank "
        f"{args.requests_per_rank} --height {args.height} --width {args.width} --frames {args.frames} "
        f"--steps {args.steps} --waves {args.waves}" + (f" --platform {args.platform}" if args.platform else "")
    )
