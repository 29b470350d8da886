"""`python -m benchmarks bench continuous`: continuous vs strict DP serving of a mixed trace on 2 CPU ranks (gloo).

The trace (``--requests``, default 16; fixed by ``--seed``): three sizes (32², 64², 128² pixels x 5 / 5 / 9
frames), two step counts (3, 6), CFG on and off, arriving over time (exponential gaps of mean ``--gap-s``).
One spawn of 2 ranks serves, each phase on a fresh engine:

=================  =========================================================================================
phase              what runs
=================  =========================================================================================
``warm-up``        6 requests (one per size x CFG, other seeds), continuous
``continuous``     the trace as a stream, ``serving="continuous"`` (FIFO admission), R = 1; it also calibrates
                   the planner: each request kind's block compute per pass ``c`` (median over the steps where a
                   rank held one request of that kind of its block-call seconds / B) and the per-step time
                   outside the slowest rank's block calls ``H`` (median of wall - max_r x_r)
``continuous-cost`` the same with ``admission="cost"`` (:func:`dlo_fn.cost.dispatch.admit_cost_aware`)
``strict``         the same stream in strict waves (``max_wait_s = 0``)
=================  =========================================================================================

then ``independent``: two single-rank rank-local processes at once, each serving every other request of the
trace with its own arrival times (no collectives, each rank holds the whole model).

Per policy: throughput = requests / makespan and nearest-rank p50 / p95 latency (finish - arrival, arrival =
the trace's nominal time from serve start), next to the planner's prediction
(:func:`dlo_fn.cost.dispatch.plan_continuous` / ``plan_strict`` on the nominal trace with the calibrated
``c`` and ``PassCosts.uniform(B, 0, H / B)``; the costs come from the continuous run itself, since on a
shared 2-core machine a separate calibration run measures other loads: on CPU the all-gathers are synchronous and do
not hide behind
compute). **Lockstep loss per block pass** (continuous phase): for each step and each computing rank,
``(step wall - x_r) / B``; its lockstep part ``(max_r x_r - x_r) / B`` is the time a rank waits for a slower
neighbour, measured and as the planner predicts it. Two ranks share 2 cores here: these are not performance
figures of any accelerator, only the policies' relative behaviour.

Writes ``--out`` (CSV, one row per policy) and ``--json`` (everything, with the measured and planned step
timelines of the continuous phase), each with machine, command and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import pathlib
import random
import statistics

from dlo_fn.cli import HelpFormatter

log = logging.getLogger(__name__)

SIZES = ((32, 32, 5), (64, 64, 5), (128, 128, 9))
STEPS = (3, 6)
FIELDS = (
    "policy",
    "requests",
    "makespan_s",
    "throughput_requests_per_s",
    "p50_latency_s",
    "p95_latency_s",
    "mean_latency_s",
    "planned_makespan_s",
    "planned_p50_latency_s",
    "planned_p95_latency_s",
    "all_ok",
    "machine",
    "command",
    "date",
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "continuous",
        help="continuous vs strict DP serving of a mixed trace on 2 CPU ranks",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--checkpoint", default=None, help="default: the tiny reference DiT under runs/bench_continuous/")
    p.add_argument("--requests", type=int, default=16, help="requests in the trace (>= 16 for the README run)")
    p.add_argument("--gap-s", type=float, default=0.15, help="mean seconds between arrivals")
    p.add_argument("--seed", type=int, default=0, help="fixes the trace")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument(
        "--out",
        default=None,
        help="default figures/data/continuous_cpu.csv (--r-sweep: figures/data/continuous_r_sweep.csv)",
    )
    p.add_argument("--json", default="figures/data/continuous_cpu.json")
    p.add_argument(
        "--r-sweep",
        action="store_true",
        help="one device, dp = 1: per-output time vs R against its bound (benchmarks.bench.continuous_r)",
    )
    p.add_argument("--config", default="bench", help="--r-sweep: reference DiT config (random weights)")
    p.add_argument("--requests-per-rank", default="1,2,4", help="--r-sweep: comma list of R")
    p.add_argument("--quick", action="store_true", help="--r-sweep: tiny config on any device (smoke test)")
    p.set_defaults(func=run)


def trace(n: int, gap_s: float, seed: int, prefix: str = "t"):
    """``(submissions, nominal arrival seconds, gaps)``: every size x steps x CFG combination in turn, shuffled."""
    from dlo_fn.models import Request
    from dlo_fn.serve.requests import Submission

    rng = random.Random(seed)
    kinds = [(s, k, g) for s in SIZES for k in STEPS for g in (5.0, 1.0)]
    rng.shuffle(kinds)
    subs, gaps = [], []
    for i in range(n):
        (h, w, f), steps, g = kinds[i % len(kinds)]
        subs.append(
            Submission(
                f"{prefix}{i:02d}",
                Request(
                    prompt=f"trace prompt {i}",
                    seed=100 + i,
                    height=h,
                    width=w,
                    num_frames=f,
                    num_inference_steps=steps,
                    guidance_scale=g,
                ),
            )
        )
        gaps.append(0.0 if i == 0 else round(rng.expovariate(1.0 / gap_s), 3))
    arrivals, t = [], 0.0
    for g in gaps:
        t += g
        arrivals.append(round(t, 6))
    return tuple(subs), tuple(arrivals), tuple(gaps)


def calibration_requests():
    """One 3-step request per size x CFG (other seeds than the trace's)."""
    from dlo_fn.models import Request
    from dlo_fn.serve.requests import Submission

    return tuple(
        Submission(
            f"c{i:02d}",
            Request(
                prompt=f"calibration {i}",
                seed=900 + i,
                height=h,
                width=w,
                num_frames=f,
                num_inference_steps=3,
                guidance_scale=g,
            ),
        )
        for i, ((h, w, f), g) in enumerate((s, g) for s in SIZES for g in (5.0, 1.0))
    )


def _kind(request) -> tuple:
    return (request.height, request.width, request.num_frames, request.cfg)


def finish_s(res) -> float:
    """Seconds from serve start to the result at rank 0."""
    t = res.timings
    if "latency_s" in t:
        return t["arrival_s"] + t["latency_s"]
    return t["queued_s"] + t["wave_s"]


def scores(results, arrivals) -> dict:
    from dlo_fn.cost.dispatch import nearest_rank

    lat = [finish_s(r) - a for r, a in zip(results, arrivals)]
    makespan = max(finish_s(r) for r in results)
    return {
        "requests": len(results),
        "makespan_s": makespan,
        "throughput_requests_per_s": len(results) / makespan,
        "p50_latency_s": nearest_rank(lat, 50),
        "p95_latency_s": nearest_rank(lat, 95),
        "mean_latency_s": sum(lat) / len(lat),
        "all_ok": all(r.ok for r in results),
    }


def calibrate(report, num_blocks: int) -> tuple[dict, float]:
    """Per request kind the median block compute per pass, and the median per-step time outside the slowest
    rank's block calls (see module doc)."""
    per_kind: dict[tuple, list[float]] = {}
    outside = []
    for s in report.steps:
        for held, x in zip(s.held, s.compute_s):
            if len(held) == 1:
                per_kind.setdefault(_kind(report.results[held[0]].request), []).append(x / num_blocks)
        outside.append((s.end_s - s.start_s) - max(s.compute_s))
    return {k: statistics.median(v) for k, v in per_kind.items()}, statistics.median(outside)


def planned(subs, arrivals, costs: dict, host_s: float, num_blocks: int, policy: str):
    from dlo_fn.cost.dispatch import PassCosts, QueuedRequest, Replicas, plan_continuous, plan_strict
    from dlo_fn.serve.continuous import admission_key

    reqs = [
        QueuedRequest(
            str(i),
            a,
            s.request.num_inference_steps,
            admission_key(s.request) if policy != "strict" else _kind(s.request) + (s.request.guidance_scale,),
            costs[_kind(s.request)],
        )
        for i, (s, a) in enumerate(zip(subs, arrivals))
    ]
    pc = PassCosts.uniform(num_blocks, 0.0, host_s / num_blocks)
    if policy == "strict":
        return plan_strict(reqs, pc, Replicas(2))
    return plan_continuous(reqs, pc, Replicas(2), admission="cost" if policy == "continuous-cost" else "fifo")


def lockstep_loss(steps, num_blocks: int) -> dict:
    """Mean over (step, computing rank) of the loss per pass and of its lockstep part (module doc)."""
    total, lock = [], []
    for wall, xs, busy in steps:
        for x, b in zip(xs, busy):
            if b:
                total.append((wall - x) / num_blocks)
                lock.append((max(xs) - x) / num_blocks)
    return {
        "loss_per_pass_s": statistics.fmean(total) if total else 0.0,
        "lockstep_part_per_pass_s": statistics.fmean(lock) if lock else 0.0,
        "samples": len(total),
    }


def run(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.figures.style import write_csv
    from dlo_fn.io.memstat import host_description
    from dlo_fn.models import get_config, write_checkpoint
    from dlo_fn.serve.local import Phase, serve_local
    from dlo_fn.serve.requests import EngineOptions

    if args.r_sweep:
        from benchmarks.bench.continuous_r import FIELDS as R_FIELDS
        from benchmarks.bench.continuous_r import r_sweep

        rows = r_sweep(args)
        path = write_csv(pathlib.Path(args.out or "figures/data/continuous_r_sweep.csv"), rows, R_FIELDS)
        print(f"wrote {path}")
        for r in rows:
            print(
                f"R {r['requests_per_rank']}: {r['per_output_step_s']:.4f} s per output-step, bound "
                f"{r['bound_s']:.4f} s: {r['ratio_to_bound']:.3f}x; max held {r['max_held']}; identical "
                f"{r['identical_to_resident']}"
            )
        return 0
    args.out = args.out or "figures/data/continuous_cpu.csv"
    checkpoint = pathlib.Path(args.checkpoint or "runs/bench_continuous/checkpoint")
    if args.checkpoint is None and not (checkpoint / "config.json").is_file():
        write_checkpoint("tiny", checkpoint, seed=0, progress=False)
    num_blocks = (
        get_config("tiny").num_blocks
        if args.checkpoint is None
        else json.loads((checkpoint / "config.json").read_text())["num_blocks"]
    )
    subs, arrivals, gaps = trace(args.requests, args.gap_s, args.seed)
    cal_subs = calibration_requests()
    opts = dict(timeout_s=args.timeout_s, progress=False)
    phases = [
        Phase("allgather", cal_subs, EngineOptions(serving="continuous", **opts)),  # warm-up
        Phase("allgather", subs, EngineOptions(serving="continuous", **opts), stream_gaps_s=gaps),
        Phase("allgather", subs, EngineOptions(serving="continuous", admission="cost", **opts), stream_gaps_s=gaps),
        Phase("allgather", subs, EngineOptions(serving="strict", **opts), stream_gaps_s=gaps),
    ]
    run2 = serve_local(checkpoint, phases, 2, join_timeout_s=900)
    for rep in run2.reports:
        if isinstance(rep, str):
            raise RuntimeError(f"bench continuous: {rep}")
    _, cont, cost, strict = run2.reports
    halves = [tuple(range(r, len(subs), 2)) for r in (0, 1)]

    def independent(idx):
        mine = [subs[i] for i in idx]
        own = [arrivals[i] for i in idx]
        own_gaps = tuple(b - a for a, b in zip([0.0] + own[:-1], own))
        phase = Phase("rank-local", tuple(mine), EngineOptions(serving="continuous", **opts), stream_gaps_s=own_gaps)
        return serve_local(checkpoint, [phase], 1, join_timeout_s=900).reports[0]

    with ThreadPoolExecutor(2) as pool:
        solo = list(pool.map(independent, halves))
    costs, host_s = calibrate(cont, num_blocks)
    rows, plans = [], {}
    for name, rep in (("continuous", cont), ("continuous-cost", cost), ("strict", strict)):
        plan = planned(subs, arrivals, costs, host_s, num_blocks, name)
        plans[name] = plan
        rows.append(
            {
                "policy": name,
                **scores(rep.results, arrivals),
                "planned_makespan_s": plan.makespan_s,
                "planned_p50_latency_s": plan.p50_latency_s,
                "planned_p95_latency_s": plan.p95_latency_s,
            }
        )
    merged = [None] * len(subs)
    for idx, rep in zip(halves, solo):
        for i, res in zip(idx, rep.results):
            merged[i] = res
    rows.append({"policy": "independent rank-local", **scores(merged, arrivals)})
    measured_steps = [(s.end_s - s.start_s, s.compute_s, [bool(h) for h in s.held]) for s in cont.steps]
    plan = plans["continuous"]
    by_id = {q.request_id: q for q in plan.requests}
    planned_steps = []
    for s in plan.steps:
        if any(s.replicas):
            xs = [sum(by_id[i].block_compute_s for i, _ in h) * num_blocks for h in s.replicas]
            planned_steps.append((s.step_s, xs, [bool(h) for h in s.replicas]))
    loss = {"measured": lockstep_loss(measured_steps, num_blocks), "planned": lockstep_loss(planned_steps, num_blocks)}
    meta = {
        "machine": f"{host_description()}; 2 torch gloo CPU ranks, 1 thread each (sharing the cores: not "
        f"a performance figure)",
        "command": _command(args),
        "date": datetime.date.today().isoformat(),
    }
    path = write_csv(pathlib.Path(args.out), [dict(_round(r), **meta) for r in rows], FIELDS)
    detail = {
        **meta,
        "num_blocks": num_blocks,
        "host_s_per_step": host_s,
        "block_compute_s": {"x".join(map(str, k)): v for k, v in sorted(costs.items())},
        "trace": [
            {
                "id": s.request_id,
                "arrival_s": a,
                **{
                    k: getattr(s.request, k)
                    for k in ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")
                },
            }
            for s, a in zip(subs, arrivals)
        ],
        "lockstep_loss": loss,
        "rows": [_round(r) for r in rows],
        "measured_steps": [
            {
                "step": s.step,
                "start_s": s.start_s,
                "end_s": s.end_s,
                "held": [[subs[i].request_id for i in h] for h in s.held],
                "compute_s": list(s.compute_s),
            }
            for s in cont.steps
        ],
        "planned_steps": [
            {
                "first_step": s.first_step,
                "num_steps": s.num_steps,
                "start_s": s.start_s,
                "end_s": s.end_s,
                "held": [[subs[int(i)].request_id for i, _ in h] for h in s.replicas],
            }
            for s in plan.steps
        ],
    }
    pathlib.Path(args.json).write_text(json.dumps(_round(detail), indent=1, sort_keys=True) + "\n")
    print(f"wrote {path} and {args.json}")
    for r in rows:
        print(
            f"{r['policy']:<24} {r['throughput_requests_per_s']:.3f} req/s  p50 {r['p50_latency_s']:.2f} s  "
            f"p95 {r['p95_latency_s']:.2f} s  (planned p50 {r.get('planned_p50_latency_s', float('nan')):.2f})"
        )
    print(f"lockstep loss per block pass: measured {loss['measured']}, planned {loss['planned']}")
    return 0


def _command(args: argparse.Namespace) -> str:
    return (
        f"python -m benchmarks bench continuous --requests {args.requests} --gap-s {args.gap_s} --seed {args.seed}"
        + (f" --checkpoint {args.checkpoint}" if args.checkpoint else "")
    )


def _round(obj):
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: _round(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_round(v) for v in obj]
    return obj
