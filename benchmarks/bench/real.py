"""`python -m benchmarks bench real`: users' own models as the benchmark, side by side in one run.

For each model (:mod:`benchmarks.bench.real_models`: FLUX.1-dev, Wan2.1-T2V-14B at 480p and 720p, LTX-Video at their
published configs, seeded random weights made on the device and written once with ``save_pretrained``), one
denoising forward at the workload's shapes, per variant (:mod:`benchmarks.bench.real_variants`, run in that order):

    forward_s          median of the timed forwards (back to back after warm-up, events on the compute stream)
    ratio_to_bound     forward_s / bound_s, bound_s = max(resident forward_s, block bytes / pinned H2D peak),
                       the peak the best measured in this run (a registered buffer and our arena)
    equal_to_resident  torch.equal of the output with resident's (and its SHA-256); FP8: with the fake-quantised
                       resident model's
    rel_error_to_resident  ||out - resident|| / ||resident|| in float64 on the host (0.0 when byte-identical), with
                       max_abs_error_to_resident and cosine_to_resident: what FP8 shards cost in output
    ready_s            folder -> model ready to run (warm page cache); ours: load_model + offload, with the host
                       store's phases, against the host's floor measured in the same run (real_ready)
    memory             peak device bytes (above what was allocated before), host RSS / USS after set-up, pinned
    ranks-W            W gloo ranks sharing the device, allgather: each rank's ready_s against its share's floor
    ours-cold          ready_s after the files' pages were evicted (checked with mincore), and a timed first read
    ours-fp8-prequantized  FP8 shards from the folder `python -m dlo_fn quantize` writes from the model's (once
                       per run, timed as the model's "quantized_checkpoint"): no rank quantises at start-up
    ours-lora(-fp8)    LoRA adapters loaded, switched and removed after offload, against resident-lora (the
                       resident model with the adapter): benchmarks.bench.real_lora

A variant that does not fit (device or host memory) or whose feature has not landed is recorded as skipped with
its reason; an unexpected error as ``error``. ``--budget-s`` skips what would not finish in time (each model gets an
equal share of what is left). The JSON is rewritten after every variant, so a run cut short keeps what finished:
``figures/data/bench_real_<model>_<machine>.json`` (``_quick`` with ``--quick``: tiny configs of the same classes).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import shutil
import tempfile
import time
import traceback

from dlo_fn.cli import HelpFormatter

__all__ = ["register", "run"]

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    from benchmarks.bench.real_models import MODELS
    from benchmarks.bench.real_variants import VARIANTS

    p = subparsers.add_parser(
        "real",
        help="diffusers models at published configs: ours vs resident vs diffusers",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--models", default="flux,wan480", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument(
        "--variants",
        default=",".join(v for v in VARIANTS if v != "pipeline"),
        help=f"comma list, run in the order given, after resident: {', '.join(VARIANTS)}",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per variant (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed forwards first (block graphs: at least 4)")
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="also a full Flux request (FluxPipeline, 28 steps): resident, ours in BF16 and with FP8 shards",
    )
    p.add_argument("--pipeline-repeats", type=int, default=2, help="timed requests per pipeline")
    p.add_argument(
        "--folder",
        default=str(pathlib.Path(tempfile.gettempdir()) / "dlo_fn_bench_real"),
        help="where checkpoints are written, and reused when complete",
    )
    p.add_argument("--keep", action="store_true", help="keep each checkpoint folder (default: deleted when done)")
    p.add_argument("--budget-s", type=float, default=None, help="skip variants that would end past this many s")
    p.add_argument(
        "--touch-host-gb",
        type=float,
        default=0.0,
        help="first write this many GB of fresh host memory once and free it: on a VM that backs guest "
        "memory at first use (a Firecracker microVM), so no variant pays the hypervisor's faults",
    )
    p.add_argument(
        "--block-spans",
        action="store_true",
        help="after timing, each resident, ours and accelerate row's blocks timed unprofiled (events at each "
        "block's entry over back-to-back forwards): forward_profile.spans, each block's span and how far the host "
        "ran ahead there (CUDA only)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="after timing, one more forward of the resident, ours and accelerate rows under torch.profiler: its "
        "summary in the row (forward_profile.trace: where the compute stream waited, per block) and its Chrome trace "
        "(opens in Perfetto) in DIR (CUDA only; the profiler slows the host)",
    )
    p.add_argument("--quick", action="store_true", help="tiny configs of the same classes (CPU test)")
    p.add_argument("--platform", choices=("cuda", "cpu"), default=None, help="default: detect (cpu with --quick)")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path, {model} replaced by the model's name (default figures/data/bench_real_{model}_<machine>.json)",
    )
    p.set_defaults(func=run)


def _names(text: str, known, what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in known]
    if bad:
        raise SystemExit(f"bench real: unknown --{what} {', '.join(bad)}; choose from {', '.join(known)}")
    return names


def _out_path(args, model: str, slug: str) -> pathlib.Path:
    from benchmarks.repro.data import DATA_DIR

    if args.out:
        return pathlib.Path(args.out.replace("{model}", model))
    return DATA_DIR / f"bench_real_{model}_{slug}{'_quick' if args.quick else ''}.json"


def _argv(args: argparse.Namespace, models: list[str], variants: list[str]) -> list[str]:
    """The arguments that reproduce this run (the checkpoint folder and output path aside)."""
    argv = [
        "bench",
        "real",
        "--models",
        ",".join(models),
        "--variants",
        ",".join(v for v in variants if v != "pipeline"),
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
    ]
    argv += ["--pipeline", "--pipeline-repeats", str(args.pipeline_repeats)] if "pipeline" in variants else []
    argv += ["--budget-s", f"{args.budget_s:g}"] if args.budget_s is not None else []
    argv += ["--touch-host-gb", f"{args.touch_host_gb:g}"] if args.touch_host_gb else []
    argv += ["--block-spans"] if args.block_spans else []
    argv += ["--profile", args.profile] if args.profile else []
    argv += ["--quick"] if args.quick else []
    return argv + (["--platform", args.platform] if args.platform else [])


def _finalize(entry: dict) -> None:
    """Ratios against the bound from the best peak measured so far (rewritten with every write)."""
    peaks = [p for p in entry["h2d_peaks_bytes_per_s"].values() if p]
    resident = next((v.get("forward_s") for v in entry["variants"] if v["variant"] == "resident"), None)
    if not resident:
        return
    peak = max(peaks) if peaks else None
    transfer = entry["block_bytes"] / peak if peak else 0.0
    entry.update(
        pinned_h2d_peak_bytes_per_s=peak,
        resident_s=resident,
        transfer_s_at_peak=transfer,
        bound_s=max(resident, transfer),
        bound="PCIe" if transfer > resident else "compute",
    )
    # rows with an adapter: their own resident time is the resident model's with the adapter
    with_adapter = next((v.get("forward_s") for v in entry["variants"] if v["variant"] == "resident-lora"), None)
    for v in entry["variants"]:
        if v.get("forward_s"):
            own = with_adapter if v["variant"].startswith("ours-lora") and with_adapter else resident
            v["ratio_to_bound"] = v["forward_s"] / entry["bound_s"]
            v["ratio_to_resident"] = v["forward_s"] / resident
            if v.get("h2d_bytes_per_forward") and peak:  # its own bytes (FP8 moves fewer)
                v["ratio_to_own_bound"] = v["forward_s"] / max(own, v["h2d_bytes_per_forward"] / peak)
        floor = entry.get("floor", {}).get("floor_s")
        if v.get("ready_s") and floor and v["variant"].startswith("ours-"):
            v["ready_over_floor"] = v["ready_s"] / floor


def _write(report: dict, entry: dict, path: pathlib.Path) -> None:
    _finalize(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(report, model=entry), indent=1, sort_keys=True, default=str) + "\n")
    tmp.replace(path)  # a reader (or a kill) never sees half a file


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()  # the budget counts from here: imports and device start-up included
    import torch

    from benchmarks.bench.real_models import MARKER, MODELS
    from benchmarks.bench.real_run import ModelRun
    from benchmarks.bench.real_variants import QUANTIZED_SUFFIX, VARIANTS
    from benchmarks.bench.report import stamp
    from benchmarks.bench.step import slug
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.platform import detect_platform

    models = _names(args.models, MODELS, "models")
    variants = _names(args.variants, VARIANTS, "variants")
    if args.pipeline and "pipeline" not in variants:
        variants.append("pipeline")
    if len(models) > 1 and args.out and "{model}" not in args.out:
        raise SystemExit("bench real: --out names one file but --models has several: put {model} in the path")
    if args.repeats < 1 or args.warmup < 0 or args.touch_host_gb < 0:
        raise SystemExit("bench real: --repeats must be >= 1, --warmup and --touch-host-gb >= 0")
    platform = detect_platform(prefer=args.platform or ("cpu" if args.quick else None))
    ctx = init_distributed(platform)
    root = pathlib.Path(args.folder)
    touched = None
    if args.touch_host_gb:  # before any checkpoint is written: its page cache must stay
        from benchmarks.bench.real_ready import touch_host

        nbytes = int(args.touch_host_gb * 1e9)
        touched = {"bytes": nbytes, "s": touch_host(nbytes)}
        log.info("bench real: touched %.1f GB of host memory in %.1f s", nbytes / 1e9, touched["s"])
    for i, name in enumerate(models):
        case = MODELS[name]
        report = stamp(
            {
                "quick": args.quick,
                "budget_s": args.budget_s,
                "repeats": args.repeats,
                "warmup": args.warmup,
                "touch_host": touched,
            },
            "benchmarks",
            _argv(args, models, variants),
            platform,
        )
        path = _out_path(args, name, slug(platform))
        left = None if args.budget_s is None else (args.budget_s - (time.perf_counter() - t_start)) / (len(models) - i)
        folder = root / (case.checkpoint + ("-quick" if args.quick else ""))
        mr = ModelRun(
            ctx,
            case,
            folder,
            args,
            deadline=None if left is None else time.perf_counter() + left,
            write=lambda entry, report=report, path=path: _write(report, entry, path),
        )
        try:
            mr.run([v for v in variants if v != "resident"])
        except Exception as exc:  # a model that cannot even start (its checkpoint, its resident run) is recorded
            mr.entry["error"] = f"{type(exc).__name__}: {exc}"
            mr.entry["traceback"] = traceback.format_exc(limit=8)
            log.error("bench real: %s failed: %s", name, exc)
        finally:
            mr.write()
        later = {MODELS[m].checkpoint for m in models[i + 1 :]}
        if not args.keep:  # the quantized copy is this run's (rewritten by the next)
            shutil.rmtree(folder.with_name(folder.name + QUANTIZED_SUFFIX), ignore_errors=True)
        if not args.keep and case.checkpoint not in later and (folder / MARKER).exists():
            shutil.rmtree(folder, ignore_errors=True)  # disk: the next model's checkpoint needs the room
        print(f"bench real: {name} -> {path}")
        del mr
        torch.cuda.empty_cache() if platform.kind == "cuda" else None
    return 0
