"""`python -m benchmarks bench slots`: ``--slots auto`` against two slots, both modes, side by side in one run.

One process, one device, the DP engine with ``dp = 1``, ``R = 1``, one request per wave (the R-sweep's machinery,
:mod:`benchmarks.bench.waves_r`). Per workload (``--workloads image,video``: 1024^2 and 832x480x29, both CFG, on the
``bench`` config's random weights): the resident model's step; the start-up probe
(:func:`dlo_fn.serve.probe.probe`) and the policy's slot choice per mode (:func:`dlo_fn.serve.probe.choose`);
then, for each mode and each of ``{--slots} + {auto}`` slot counts, one warm-up wave (a 2-step request of the same
shape) and
``--repeats`` timed waves of ``--steps`` steps (the row's latency is their median; every wave's is in the ``.json``).
Each row: per-output step time, the bound ``max(resident step, weight bytes /
pinned peak)`` measured in the same run, their ratio, the policy's predicted step for that plan, and whether the
output is byte-identical to the resident model's, with the probe's numbers (block compute, the engine's per-step
work outside the blocks, the per-request host work, pinned H2D). Rows are appended to ``--out`` as they finish;
the probes, the choices and the run's machine, command and date go to the ``.json`` beside it.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import logging
import pathlib

from dlo_fn.cli import HelpFormatter

log = logging.getLogger(__name__)

FIELDS = (
    "workload",
    "mode",
    "slots",
    "slots_choice",
    "wave_latency_s",
    "per_output_step_s",
    "resident_step_s",
    "transfer_step_s",
    "bound_s",
    "ratio_to_bound",
    "predicted_step_s",
    "predicted_bound",
    "identical_to_resident",
    "probe_s",
    "probe_block_s",
    "probe_step_overhead_s",
    "probe_request_s",
    "probe_h2d_bytes_per_s",
    "config",
    "steps",
    "weight_bytes",
    "pinned_peak_bytes_per_s",
    "machine",
    "command",
    "date",
)
SHAPES = {"image": (1024, 1024, 1), "video": (480, 832, 29)}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "slots",
        help="--slots auto vs two slots, both modes, one device",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--config", default="bench", help="reference DiT config (random weights)")
    p.add_argument("--workloads", default="image,video", help="comma list of image, video")
    p.add_argument("--modes", default="rank-local,allgather")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--slots", default="2", help="comma list of fixed slot counts measured beside auto")
    p.add_argument("--repeats", type=int, default=1, help="timed waves per row (the row takes their median)")
    p.add_argument("--height", type=int, default=None, help="override both workloads' height (smoke tests)")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--platform", choices=("cuda", "npu", "cpu"), default=None)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--out", default="figures/data/slots_auto_h200.csv")
    p.set_defaults(func=run)


def _request(shape, steps: int, seed: int):
    from dlo_fn.models import Request

    h, w, f = shape
    return Request(
        prompt=f"slots {seed}",
        seed=seed,
        height=h,
        width=w,
        num_frames=f,
        num_inference_steps=steps,
        guidance_scale=5.0,
    )


def _timed(engine, shape, steps: int, repeats: int = 1):
    """(median wave latency, every wave's latency, the output's SHA-256: the same in every repeat or an error)."""
    import statistics

    engine.serve([_request(shape, 2, 99)])  # warm-up: allocator, kernels, the ring
    latencies, hashes = [], set()
    for _ in range(max(1, repeats)):
        report = engine.serve([_request(shape, steps, 1)])
        if not report.ok:
            raise RuntimeError(f"bench slots: wave failed: {[w.status for w in report.waves]}")
        latencies.append(report.waves[0].latency_s)
        hashes.add(report.results[0].sha256)
    if len(hashes) != 1:
        raise RuntimeError(f"bench slots: one request gave {len(hashes)} different outputs over {repeats} waves")
    return statistics.median(latencies), latencies, hashes.pop()


def _workload_rows(args, name: str, shape, modes, platform, ctx, meta) -> dict:
    import gc

    import torch

    from benchmarks.bench import step_variants as sv
    from dlo_fn.runtime.offload import offload
    from dlo_fn.serve.engine import Engine
    from dlo_fn.serve.probe import choose, probe
    from dlo_fn.serve.requests import EngineOptions

    opts = EngineOptions(timeout_s=args.timeout_s, progress=False, serving="strict")  # one wave timed
    model = sv.random_model(args.config, platform.device)
    found = probe(model, ctx, _request(shape, args.steps, 1))
    res_latency, res_all, reference = _timed(
        Engine(model, offload(model, "blocks", ctx, mode="resident"), ctx, opts), shape, args.steps, args.repeats
    )
    del model
    resident_step = res_latency / args.steps
    topo = found.topology
    probed = {
        "probe_block_s": topo.compute.table[0][2],
        "probe_step_overhead_s": topo.step_overhead[0][2],
        "probe_request_s": topo.request_overhead[0][1],
        "probe_h2d_bytes_per_s": topo.h2d_bytes_per_s,
    }
    summary = {
        "probe": {**probed, "probe_s": found.seconds, "host_s_per_block": dict(topo.host_s_per_block)},
        "resident_step_s": resident_step,
        "resident_wave_latencies_s": res_all,
        "auto": {},
        "waves": {},
    }
    for mode in modes:
        auto = choose(found, mode=mode)
        summary["auto"][mode] = {"slots": auto.chosen.candidate.num_slots, "why": auto.why()}
        log.info("%s %s: auto chooses %d slots (%s)", name, mode, auto.chosen.candidate.num_slots, auto.why())
        fixed = {int(x) for x in args.slots.split(",") if x}
        for slots in sorted(fixed | {auto.chosen.candidate.num_slots}):
            gc.collect()
            torch.cuda.empty_cache() if platform.kind == "cuda" else None
            model = sv.random_model(args.config, platform.device)
            off = offload(model, "blocks", ctx, mode=mode, num_slots=slots)
            peak = sv.pinned_peak_bytes_per_s(platform, off.store, off.layout)
            weight_bytes = off.layout.total_block_bytes
            latency, every, sha = _timed(Engine(model, off, ctx, opts), shape, args.steps, args.repeats)
            summary["waves"][f"{mode} S{slots}"] = every
            predicted = choose(found, mode=mode, num_slots=slots).chosen
            transfer = weight_bytes / peak if peak else 0.0
            bound = max(resident_step, transfer)
            per_output = latency / args.steps
            row = {
                "workload": f"{name} {shape[1]}x{shape[0]}x{shape[2]} cfg",
                "mode": mode,
                "slots": slots,
                "slots_choice": "auto" if slots == auto.chosen.candidate.num_slots else "fixed",
                "wave_latency_s": latency,
                "per_output_step_s": per_output,
                "resident_step_s": resident_step,
                "transfer_step_s": transfer,
                "bound_s": bound,
                "ratio_to_bound": per_output / bound,
                "predicted_step_s": predicted.step_s,
                "predicted_bound": predicted.bound,
                "identical_to_resident": sha == reference,
                "probe_s": found.seconds,
                **probed,
                "config": args.config,
                "steps": args.steps,
                "weight_bytes": weight_bytes,
                "pinned_peak_bytes_per_s": peak,
                **meta,
            }
            log.info(
                "%s %s S%d: %.4f s per step, bound %.4f (%.3fx), predicted %.4f",
                name,
                mode,
                slots,
                per_output,
                bound,
                per_output / bound,
                predicted.step_s,
            )
            _append(args.out, row)
            del off, model
    return summary


def _append(path: str, row: dict) -> None:
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists()
    with out.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def run(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.bench.step import machine
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.platform import detect_platform

    platform = detect_platform(prefer=args.platform)
    ctx = init_distributed(platform)
    desc = machine(platform)
    meta = {
        "machine": ", ".join(f"{k} {v}" for k, v in desc.items()),
        "command": (
            f"python -m benchmarks bench slots --config {args.config} --workloads {args.workloads} "
            f"--modes {args.modes} --steps {args.steps} --slots {args.slots} --repeats {args.repeats}"
        ),
        "date": datetime.date.today().isoformat(),
    }
    modes = [m for m in args.modes.split(",") if m]
    summaries = {}
    with torch.no_grad():
        for name in [w for w in args.workloads.split(",") if w]:
            if name not in SHAPES:
                raise SystemExit(f"bench slots: --workloads: unknown {name!r}; choose from {', '.join(SHAPES)}")
            h, w, f = SHAPES[name]
            shape = (args.height or h, args.width or w, args.frames or f)
            summaries[name] = _workload_rows(args, name, shape, modes, platform, ctx, meta)
    side = pathlib.Path(args.out).with_suffix(".json")
    side.write_text(json.dumps({**meta, "machine": desc, "workloads": summaries}, indent=1, default=str))
    print(f"wrote {args.out} and {side}")
    return 0
