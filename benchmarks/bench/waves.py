"""`python -m benchmarks bench waves`: DP wave throughput vs dp and vs R on CPU ranks (gloo), and Figure 5's wave.

For each ``dp`` it spawns ``dp`` CPU ranks (one thread each, :func:`dlo_fn.serve.local.serve_local`) on one
checkpoint (``tiny`` by default, written under ``runs/`` if absent) and measures, over ``--waves`` timed waves
after one warm-up wave of the same kind:

=================  ==================================================================================
kind               what runs
=================  ==================================================================================
``resident``       dp = 1 only, weights resident, one request per wave: the compute-only baseline
``host``           dp = 1 only, in this process without a process group (the 1-rank "all-gather" is a copy):
                   ``issue_wait_us_per_block`` is then pure host dispatch per block
``single``         allgather, one request per wave (forced), the other ranks idle (serve shards only)
``full``           allgather, waves of ``dp x R`` compatible requests, ``R`` per rank block-major
=================  ==================================================================================

Per point (the median over the timed waves; with ``--repeats N`` the whole sweep runs N times and each point
keeps its fastest median, which discounts other processes competing for the same cores)::

    wave_latency_s    dispatch -> every result back at rank 0
    outputs_per_s     outputs per wave / wave_latency_s
    frames_per_s      num_frames x outputs per wave / wave_latency_s      (the seed's "generated frames/s")
    ideal_outputs_per_s   dp x the resident baseline's outputs_per_s   (each rank computing all the time)
    efficiency        outputs_per_s / ideal_outputs_per_s
    issue_wait_us_per_block   rank 0 executor time outside block calls per block compute: host dispatch plus, on
                      CPU (synchronous gloo), the wait inside each all-gather for the slowest rank

Rows go to ``--out`` (default ``figures/data/waves_cpu.csv``), each with the machine, command and date.
``--trace-out`` (default ``figures/data/waves_fig5_trace.csv``) records one full and one partial wave at dp 2
span by span (broadcast, each rank's block computes, both ranks' H2D and all-gathers) for Figure 5.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import pathlib
import statistics

from dlo_fn.cli import HelpFormatter

log = logging.getLogger(__name__)

FIELDS = (
    "dp",
    "requests_per_rank",
    "kind",
    "mode",
    "outputs_per_wave",
    "timed_waves",
    "num_frames",
    "tokens",
    "steps",
    "wave_latency_s",
    "outputs_per_s",
    "frames_per_s",
    "ideal_outputs_per_s",
    "efficiency",
    "issue_wait_us_per_block",
    "machine",
    "command",
    "date",
)
TRACE_FIELDS = ("wave", "kind", "rank", "lane", "label", "start_s", "end_s")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "waves",
        help="DP wave throughput vs dp and R on CPU ranks; Figure 5's recorded wave",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--checkpoint", default=None, help="default: the tiny reference DiT under runs/bench_waves/")
    p.add_argument("--dp", default="1,2", help="comma list of DP sizes (CPU ranks)")
    p.add_argument("--requests-per-rank", default="1,2,4", help="comma list of R for full waves")
    p.add_argument("--waves", type=int, default=4, help="timed waves per point (after one warm-up wave)")
    p.add_argument("--repeats", type=int, default=3, help="sweeps; each point keeps its fastest median")
    p.add_argument("--height", type=int, default=None, help="default 128 (CPU sweep), 1024 (--r-sweep)")
    p.add_argument("--width", type=int, default=None, help="default 128 (CPU sweep), 1024 (--r-sweep)")
    p.add_argument("--frames", type=int, default=None, help="default 17 (CPU sweep), 1 (--r-sweep)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument(
        "--r-sweep",
        action="store_true",
        help="per-output time vs R on one device against its bound (benchmarks.bench.waves_r)",
    )
    p.add_argument("--config", default="bench", help="--r-sweep: reference DiT config (random weights)")
    p.add_argument("--platform", choices=("cuda", "npu", "cpu"), default=None, help="--r-sweep: default detect")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--out", default="figures/data/waves_cpu.csv")
    p.add_argument("--trace-out", default="figures/data/waves_fig5_trace.csv", help="'' to skip the trace")
    p.set_defaults(func=run)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _command(args: argparse.Namespace) -> str:
    return (
        f"python -m benchmarks bench waves --dp {args.dp} --requests-per-rank {args.requests_per_rank} "
        f"--waves {args.waves} --height {args.height} --width {args.width} --frames {args.frames} "
        f"--steps {args.steps} --repeats {args.repeats}"
        + (f" --checkpoint {args.checkpoint}" if args.checkpoint else "")
    )


def _requests(n: int, args: argparse.Namespace, start: int = 0):
    from dlo_fn.models import Request
    from dlo_fn.serve.requests import Submission

    return tuple(
        Submission(
            f"b{start + i:04d}",
            Request(
                prompt=f"bench prompt {start + i}",
                seed=start + i,
                height=args.height,
                width=args.width,
                num_frames=args.frames,
                num_inference_steps=args.steps,
            ),
        )
        for i in range(n)
    )


def _median_latency(report, skip: int = 1) -> float:
    timed = [w.latency_s for w in report.waves[skip:]]
    if not timed or any(w.status != "ok" for w in report.waves):
        raise RuntimeError(f"bench waves: a wave failed: {[(w.wave_id, w.status, w.error) for w in report.waves]}")
    return statistics.median(timed)


def _issue_us(report) -> float | str:
    st = report.stats
    return round(1e6 * st["issue_s"] / st["computes"], 2) if st.get("computes") else ""


def host_point(args: argparse.Namespace, checkpoint: pathlib.Path, n: int) -> dict:
    """One rank, no process group, one thread: the executor's own host time per block (no collective waits)."""
    import torch

    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.serve.engine import Engine
    from dlo_fn.serve.local import open_model
    from dlo_fn.serve.requests import EngineOptions

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, off = open_model(checkpoint, init_distributed(), "allgather")
        engine = Engine(model, off, off.ctx, EngineOptions(progress=False, serving="strict"))
        engine.serve(_requests(1, args, 4000))  # warm-up
        off.executor.stats.reset()
        report = engine.serve(_requests(n - 1, args, 4001))
    finally:
        torch.set_num_threads(threads)
    latency = statistics.median(w.latency_s for w in report.waves)
    return {
        "dp": 1,
        "requests_per_rank": 1,
        "kind": "host",
        "mode": "allgather (no group)",
        "outputs_per_wave": 1,
        "timed_waves": len(report.waves),
        "wave_latency_s": latency,
        "outputs_per_s": 1 / latency,
        "frames_per_s": args.frames / latency,
        "issue_wait_us_per_block": _issue_us(report),
    }


def run_points(args: argparse.Namespace, checkpoint: pathlib.Path) -> list[dict]:
    from dlo_fn.models import get_config, tokens_for
    from dlo_fn.serve.local import Phase, serve_local
    from dlo_fn.serve.requests import EngineOptions

    n = args.waves + 1
    opts = dict(timeout_s=args.timeout_s, progress=False, serving="strict")  # waves are what it measures
    config = get_config("tiny") if args.checkpoint is None else None
    tokens = tokens_for(config, args.height, args.width, args.frames) if config is not None else ""
    rows: list[dict] = []
    if 1 in _ints(args.dp):
        rows.append(dict(host_point(args, checkpoint, n), num_frames=args.frames, tokens=tokens, steps=args.steps))
    for dp in _ints(args.dp):
        phases, kinds = [], []
        if dp == 1:
            phases.append(Phase("resident", _requests(n, args), EngineOptions(**opts)))
            kinds.append(("resident", "resident", 1))
        singles = _requests(n, args, 1000)
        phases.append(Phase("allgather", singles, EngineOptions(**opts), forced=tuple((i,) for i in range(n))))
        kinds.append(("single", "allgather", 1))
        for r in _ints(args.requests_per_rank):
            phases.append(
                Phase("allgather", _requests(n * dp * r, args, 2000), EngineOptions(requests_per_rank=r, **opts))
            )
            kinds.append(("full", "allgather", r))
        log.info("bench waves: dp %d, %d phases", dp, len(phases))
        run = serve_local(checkpoint, phases, dp, join_timeout_s=max(600.0, 4 * args.timeout_s))
        for (kind, mode, r), report in zip(kinds, run.reports):
            if isinstance(report, str):
                raise RuntimeError(f"bench waves: dp {dp} {kind} R {r}: {report}")
            per_wave = report.waves[0].num_requests
            latency = _median_latency(report)
            ops = per_wave / latency
            rows.append(
                {
                    "dp": dp,
                    "requests_per_rank": r,
                    "kind": kind,
                    "mode": mode,
                    "outputs_per_wave": per_wave,
                    "timed_waves": len(report.waves) - 1,
                    "num_frames": args.frames,
                    "tokens": tokens,
                    "steps": args.steps,
                    "wave_latency_s": latency,
                    "outputs_per_s": ops,
                    "frames_per_s": args.frames * per_wave / latency,
                    "issue_wait_us_per_block": _issue_us(report),
                }
            )
            log.info("dp %d %s R %d: %.3f s/wave, %.2f outputs/s", dp, kind, r, latency, ops)
    return rows


def record_trace(args: argparse.Namespace, checkpoint: pathlib.Path) -> list[dict]:
    """One full wave (2 requests on 2 ranks) and one partial wave (1 request, rank 1 idle), 2 steps each."""
    from dlo_fn.serve.local import Phase, serve_local
    from dlo_fn.serve.requests import EngineOptions

    subs = _requests(3, argparse.Namespace(**{**vars(args), "steps": 2}), 3000)
    run = serve_local(
        checkpoint,
        [
            Phase(
                "allgather", subs, EngineOptions(timeout_s=args.timeout_s, trace=True, progress=False, serving="strict")
            )
        ],
        2,
    )
    (report,) = run.reports
    rows = []
    for w in report.waves:
        kind = "partial" if w.idle_ranks else "full"
        for rank, lane, label, s, e in sorted(w.trace, key=lambda t: (t[0], t[3], t[1])):
            rows.append(
                {
                    "wave": w.wave_id,
                    "kind": kind,
                    "rank": rank,
                    "lane": lane,
                    "label": label,
                    "start_s": round(s, 6),
                    "end_s": round(e, 6),
                }
            )
    return rows


def _fastest(points: list[dict]) -> dict:
    """The repeat of one point with the lowest wave latency."""
    return min(points, key=lambda r: r["wave_latency_s"])


def _with_efficiency(rows: list[dict]) -> list[dict]:
    """ideal = dp x the resident single-request rate; efficiency = outputs/s / ideal."""
    base = next((r["outputs_per_s"] for r in rows if r["kind"] == "resident"), None)
    out = []
    for r in rows:
        ideal = r["dp"] * base if base else None
        out.append(dict(r, ideal_outputs_per_s=ideal or "", efficiency=r["outputs_per_s"] / ideal if ideal else ""))
    return out


def run(args: argparse.Namespace) -> int:
    from benchmarks.figures.style import write_csv
    from dlo_fn.io.memstat import host_description
    from dlo_fn.models import write_checkpoint

    if args.r_sweep:
        return _run_r_sweep(args)
    args.height, args.width, args.frames = args.height or 128, args.width or 128, args.frames or 17

    checkpoint = pathlib.Path(args.checkpoint or "runs/bench_waves/checkpoint")
    if args.checkpoint is None and not (checkpoint / "config.json").is_file():
        write_checkpoint("tiny", checkpoint, seed=0, progress=False)
    meta = {
        "machine": f"{host_description()}; torch gloo CPU ranks, 1 thread each",
        "command": _command(args),
        "date": datetime.date.today().isoformat(),
    }
    sweeps = [run_points(args, checkpoint) for _ in range(max(args.repeats, 1))]
    rows = [
        dict(r, **meta) for r in _with_efficiency([_fastest([s[i] for s in sweeps]) for i in range(len(sweeps[0]))])
    ]
    path = write_csv(pathlib.Path(args.out), rows, FIELDS)
    print(f"wrote {path}")
    for r in rows:
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] != "" else "-"
        print(
            f"dp {r['dp']} {r['kind']:<8} R {r['requests_per_rank']}: {r['wave_latency_s']:.3f} s/wave, "
            f"{r['outputs_per_s']:.2f} outputs/s, {r['frames_per_s']:.1f} frames/s, efficiency {eff}, "
            f"issue+wait {r['issue_wait_us_per_block']} us/block"
        )
    if args.trace_out:
        trace = record_trace(args, checkpoint)
        print(f"wrote {write_csv(pathlib.Path(args.trace_out), trace, TRACE_FIELDS)} ({len(trace)} spans)")
    return 0


def _run_r_sweep(args: argparse.Namespace) -> int:
    from benchmarks.bench.waves_r import FIELDS as R_FIELDS
    from benchmarks.bench.waves_r import r_sweep
    from benchmarks.figures.style import write_csv

    args.height, args.width, args.frames = args.height or 1024, args.width or 1024, args.frames or 1
    if args.out == "figures/data/waves_cpu.csv":
        args.out = "figures/data/waves_r_sweep.csv"
    rows = r_sweep(args)
    print(f"wrote {write_csv(pathlib.Path(args.out), rows, R_FIELDS)}")
    for r in rows:
        print(
            f"R {r['requests_per_rank']}: {r['per_output_step_s']:.4f} s per output-step, bound "
            f"{r['bound_s']:.4f} s (resident {r['resident_step_s']:.4f}, transfer {r['transfer_step_s']:.4f}): "
            f"{r['ratio_to_bound']:.3f}x; identical bytes {r['identical_to_resident']}"
        )
    return 0
