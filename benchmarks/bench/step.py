"""`python -m benchmarks bench step`: one pass over the blocks (one denoising step), every offload variant side by side.

The reference DiT at realistic size (config ``bench``: 24 blocks of ~0.56 GB bf16, random weights made on the
device, no checkpoint) runs two workloads, both with CFG (batch 2): ``video`` 832x480x29 (2 x 12480 tokens,
compute-bound on an H200) and ``image`` 1024^2 (2 x 4096 tokens, PCIe-bound). For each variant
(:mod:`benchmarks.bench.step_variants`) it reports, per workload:

    step_s             median device time of one pass, passes back to back (steady state of a denoising loop)
    ratio_to_resident  step_s / resident step_s
    bound_s            max(resident step_s, H2D bytes per pass / pinned peak), the peak measured in this run
    ratio_to_bound     step_s / bound_s (the target is <= 1.02)
    h2d_bytes_per_s    H2D bytes per pass / step_s (and as a fraction of the pinned peak)
    proxy_host_us_per_block   host time the executor spends per block outside the block's own call (issuing
                       the H2D / all-gather ops, event waits and records, schedule bookkeeping), measured inside
                       the proxy; ``block_call_us_per_block`` is the time inside the call (re-parametrisation
                       + the block's kernel launches, which may block when the launch queue is full)
    pass_host_delta_us_per_block  (host time of a pass - that of a resident pass) / blocks, each pass started
                       on an idle device; confounded by launch-queue back-pressure once the GPU falls behind
    peak_device_bytes  torch.cuda.max_memory_allocated during the variant, and the planned weight bytes

Results go to ``figures/data/bench_step_<machine>.json`` with the machine, command and date. ``--quick`` runs
the tiny config with tiny workloads (a CPU smoke test for CI; written to ``..._quick.json`` unless ``--out``).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import pathlib
import re
import statistics
import subprocess

from dlo_fn.cli import HelpFormatter

log = logging.getLogger(__name__)

WORKLOADS = {"video": (480, 832, 29), "image": (1024, 1024, 1)}  # height, width, frames; CFG on
QUICK_WORKLOADS = {"video": (32, 32, 5), "image": (64, 64, 1)}


def register(subparsers) -> None:
    from benchmarks.bench.step_variants import DEFAULT_VARIANTS, VARIANTS

    p = subparsers.add_parser(
        "step",
        help="one denoising pass: resident vs our offload vs diffusers vs naive",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--config", default="bench", help="reference DiT config")
    p.add_argument("--workloads", default="video,image", help=f"comma list of {sorted(WORKLOADS)}")
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma list of {', '.join(VARIANTS)}. dlo-MODE is ours with the torch.func "
        f"functional_call block call; suffixes: -swap the swap call (the product default), -graph "
        f"one CUDA graph per step, -bgraph one per block compute (copies eager), -compile "
        f"torch.compile'd blocks, -g2 / -g4 load groups of 2 / 4 blocks on 2G slots; diffusers: its "
        f"group offloading; naive-sync: a synchronous copy per block",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed passes per variant and workload")
    p.add_argument("--repeats", type=int, default=7, help="timed passes (median reported)")
    p.add_argument("--host-repeats", type=int, default=3, help="passes timed on the host from an idle device")
    p.add_argument("--quick", action="store_true", help="tiny config and workloads, 1 warmup, 2 repeats (CPU smoke)")
    p.add_argument("--no-dispatch", action="store_true", help="skip the host dispatch measurement (bench-narrow)")
    p.add_argument(
        "--fresh-graphs",
        action="store_true",
        help="graph variants: drop the captured graphs of one workload before the next is measured",
    )
    p.add_argument("--platform", choices=("cuda", "npu", "cpu"), default=None, help="default: detect")
    p.add_argument("--out", default=None, help="JSON path (default figures/data/bench_step_<machine>.json)")
    p.set_defaults(func=run)


def apply_quick(args: argparse.Namespace) -> argparse.Namespace:
    """``--quick``: 1 warm-up, 2 timed passes and 1 host-timed pass (tiny config and workloads elsewhere)."""
    if args.quick:
        args.warmup, args.repeats, args.host_repeats = 1, 2, 1
    return args


def _command(args: argparse.Namespace) -> str:
    parts = [
        "python -m benchmarks bench step",
        f"--config {args.config}",
        f"--workloads {args.workloads}",
        f"--variants {args.variants}",
        f"--warmup {args.warmup}",
        f"--repeats {args.repeats}",
        f"--host-repeats {args.host_repeats}",
    ]
    parts += ["--no-dispatch"] if getattr(args, "no_dispatch", False) else []
    parts += ["--fresh-graphs"] if getattr(args, "fresh_graphs", False) else []
    return " ".join(
        parts + (["--quick"] if args.quick else []) + ([f"--platform {args.platform}"] if args.platform else [])
    )


def machine(platform) -> dict:
    import torch

    from dlo_fn.io.memstat import host_description

    out = dict(platform.describe(), cpu=host_description())
    if platform.kind == "cuda":
        try:
            out["driver"] = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=20,
                )
                .stdout.strip()
                .splitlines()[0]
            )
        except (OSError, IndexError, subprocess.SubprocessError):
            out["driver"] = "unknown"
        out["gpu_memory_bytes"] = torch.cuda.get_device_properties(platform.device).total_memory
    try:
        import diffusers

        out["diffusers"] = diffusers.__version__
    except ImportError:
        out["diffusers"] = "not installed"
    return out


def slug(platform) -> str:
    name = platform.describe().get("device_name", platform.kind)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def run_step_bench(args: argparse.Namespace) -> dict:
    import torch

    from benchmarks.bench import step_variants as sv
    from dlo_fn.models import BLOCK_PATHS
    from dlo_fn.plan.layout import model_layout
    from dlo_fn.plan.spec import spec_from_module
    from dlo_fn.runtime.blocks import strip_block
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.host_store import build_host_store
    from dlo_fn.runtime.platform import detect_platform

    apply_quick(args)
    config = "tiny" if args.quick else args.config
    table = QUICK_WORKLOADS if args.quick else WORKLOADS
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name, known in (("workload", table), ("variant", sv.VARIANTS)):
        bad = [x for x in (workloads if name == "workload" else variants) if x not in known]
        if bad:
            raise SystemExit(f"bench step: unknown {name}(s) {bad}; known: {sorted(known)}")
    platform = detect_platform(prefer=args.platform)
    ctx = init_distributed(platform, single_process_group=any(v.startswith("dlo-allgather") for v in variants))
    own_group = ctx.group is not None
    model = sv.random_model(sv.bench_config(config), platform.device)
    inputs = {w: sv.block_inputs(model, *table[w], platform.device) for w in workloads}
    spec = spec_from_module(model, BLOCK_PATHS, name=config)
    layout = model_layout(spec, 1)
    blocks = list(model.blocks)
    results: dict[str, dict[str, sv.PassResult]] = {w: {} for w in workloads}
    skipped: dict[str, str] = {}
    kw = dict(warmup=args.warmup, repeats=args.repeats, host_repeats=args.host_repeats)

    want: dict[tuple[str, str], torch.Tensor] = {}  # the resident output of each workload, for the byte-identity check

    def measure(variant: str, run_pass, reset=None, extra=None, warmup=None, graphs=None) -> None:
        for w in workloads:
            if graphs is not None and getattr(args, "fresh_graphs", False):
                graphs.clear()  # the previous workload's graphs and their pools go before this one is captured
                sv.release(platform)
            x, kwargs, _ = inputs[w]  # noqa: F821 (a closure; the name is deleted after its last call)
            platform.reset_peak_memory_stats()
            r = sv.time_passes(
                platform, run_pass, x, kwargs, reset=reset, **dict(kw, warmup=max(kw["warmup"], warmup or 0))
            )
            r.extra.update(extra() if callable(extra) else (extra or {}))
            with torch.no_grad():
                out = run_pass(x, kwargs)
            ref = next((r for r in ("resident-compile", "resident-fp8") if variant.endswith(r[8:])), "resident")
            if variant == ref:
                want[(ref, w)] = out.clone()  # noqa: F821 (a closure; the name is deleted after its last call)
            r.extra["equal_to_resident"] = bool(torch.equal(out, want[(ref, w)])) if (ref, w) in want else None  # noqa: F821 (a closure; the name is deleted after its last call)
            del out
            results[w][variant] = r
            log.info("%s %s: %.4f s", w, variant, statistics.median(r.step_s))

    def resident_pass(x, kwargs):
        for block in blocks:  # noqa: F821 (a closure; the name is deleted after its last call)
            x = block(x, **kwargs)
        return x

    measure(
        "resident",
        resident_pass,
        extra={
            "weight_device_bytes": layout.total_block_bytes,
            "weight_device_bytes_planned": layout.total_block_bytes,
        },
    )
    if "resident-graph" in variants:  # the resident pass as one CUDA graph: the blocks' compute time in a graph
        graphs: dict[int, tuple] = {}

        def resident_graph_pass(x, kwargs):
            g = graphs.get(id(x))  # one capture per workload (its inputs are fixed tensors, read in place)
            if g is None:
                resident_pass(x, kwargs)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = resident_pass(x, kwargs)
                g = graphs[id(x)] = (g, out)
            g[0].replay()
            return g[1]

        measure("resident-graph", resident_graph_pass)
        del graphs, resident_graph_pass
        sv.release(platform)
    if "resident-compile" in variants:  # compiled copies, so no other variant runs compiled code
        compiled = [copy.deepcopy(b) for b in blocks]
        for block in compiled:
            block.compile()

        def compiled_pass(x, kwargs):
            for block in compiled:
                x = block(x, **kwargs)
            return x

        measure("resident-compile", compiled_pass, warmup=3)
        del compiled, compiled_pass
        sv.release(platform)
    if "resident-fp8" in variants:  # the reference of the -fp8 variants: the blocks fake-quantised, resident
        fq = sv.fake_quantized(blocks)

        def fp8_pass(x, kwargs):
            for block in fq:
                x = block(x, **kwargs)
            return x

        measure("resident-fp8", fp8_pass)
        del fq, fp8_pass
        sv.release(platform)
    tensors, aliases = sv.block_states(blocks)
    stores = {None: (layout, build_host_store(layout, 0, tensors, platform, progress=not args.quick))}
    if any(v.endswith("-fp8") and v.startswith("dlo-") for v in variants):
        stores["fp8"] = sv.fp8_store(spec, tensors, platform)
    store = stores[None][1]
    del tensors
    peaks = [sv.pinned_peak_bytes_per_s(platform, store, layout)]
    cpu = {v: sv.cpu_blocks(blocks) for v in variants if v.startswith("diffusers")}  # one set per variant
    for block in blocks:
        strip_block(block, platform.device)
    sv.release(platform)
    for variant in variants:
        if variant != "resident":  # PCIe varies over a run: measure the peak next to each variant
            peaks.append(sv.pinned_peak_bytes_per_s(platform, store, layout))
        if variant.startswith("dlo-"):
            opts = sv.variant_options(variant)
            own = [copy.deepcopy(b) for b in blocks] if opts["block_call"] == "compile" else blocks  # meta: cheap
            lay, st = stores[opts["quantization"]]
            run_pass, ex = sv.executor_pass(platform, lay, st, own, aliases, group=ctx.group, **opts)
            measure(
                variant,
                run_pass,
                reset=ex.stats.reset,
                graphs=ex.plugin,
                warmup=sv.GRAPH_WARMUP if opts["graph"] or opts["block_call"] == "compile" else 0,
                extra=lambda ex=ex: {
                    "graph_replays": getattr(ex.plugin, "replays", 0),
                    "stream_ops_per_block": ex.stats.stream_ops / max(ex.stats.computes, 1),
                    "proxy_host_us_per_block": ex.stats.issue_us_per_compute,
                    "load_issue_us_per_block": 1e6 * ex.stats.load_issue_s / max(ex.stats.computes, 1),
                    "block_call_us_per_block": 1e6 * ex.stats.call_s / max(ex.stats.computes, 1),
                    # Graph / compile variants hold the same executor buffers as their eager variant: reported once.
                    **(
                        {"weight_buffers": "as the eager variant"}
                        if opts["graph"] or opts["block_call"] == "compile"
                        else {
                            "weight_device_bytes": ex.measured_device_bytes or ex.device_weight_bytes,
                            "weight_device_bytes_planned": ex.planned_device_weight_bytes,
                        }
                    ),
                },
            )
            ex.synchronize()
            del run_pass, ex
        elif variant.startswith("diffusers"):
            try:
                run_pass = sv.diffusers_pass(
                    platform, cpu.pop(variant), record_stream=variant.endswith("-record-stream")
                )
            except ImportError as exc:
                skipped[variant] = str(exc)
                log.warning("bench step: skipping %s: %s", variant, exc)
                continue
            measure(variant, run_pass)
            del run_pass
        elif variant == "naive-sync":
            measure(
                variant,
                sv.naive_pass(platform, layout, store, blocks, aliases),
                extra={"weight_device_bytes_planned": layout.max_padded_block_bytes},
            )
        sv.release(platform)
    report = _report(args, platform, layout, store, peaks, inputs, results, stores.get("fp8", (None,))[0])
    del store, stores, cpu, model, blocks, inputs, want
    sv.release(platform)
    from benchmarks.bench.step_dispatch import measure_dispatch

    if not getattr(args, "no_dispatch", False):
        report["dispatch"] = measure_dispatch(
            config.removesuffix("-small40"), platform, ctx.group, variants, args.quick
        )
    report["skipped_variants"] = skipped
    report["pinning_overhead"] = sv.pinning_overhead(platform)
    if own_group:
        torch.distributed.destroy_process_group()
    return report


def _report(args, platform, layout, store, peaks, inputs, results, fp8_layout=None) -> dict:
    h2d_bytes = sum(s.shard_bytes for s in layout.shards)  # per pass, every variant that offloads (W = 1)
    fp8_bytes = sum(s.shard_bytes for s in fp8_layout.shards) if fp8_layout is not None else 0
    peak = statistics.median(peaks)  # the bound's peak; each measurement is kept in the report
    out = {
        "machine": machine(platform),
        "command": _command(args),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": "tiny" if args.quick else args.config,
        "num_blocks": layout.num_blocks,
        # The committed reports' key for the slot size (W = 1: the largest block, aligned).
        "max_block_bytes": layout.max_padded_block_bytes,
        "total_block_bytes": layout.total_block_bytes,
        "h2d_bytes_per_pass": h2d_bytes,
        "pinned_arena_bytes": store.arena_bytes,
        "pinning": store.how,
        "pinned_h2d_peak_bytes_per_s": peak,
        "pinned_h2d_peaks_bytes_per_s": peaks,
        "workloads": [],
    }
    for w, res in results.items():
        x, _, tokens = inputs[w]
        resident = res["resident"]
        res_s, res_host = statistics.median(resident.step_s), statistics.median(resident.host_s)
        bound = max(res_s, h2d_bytes / peak) if peak else res_s
        # FP8 variants: their own bound, max(the fake-quantised resident pass, the stored bytes / peak)
        fp8 = res.get("resident-fp8")
        fp8_s = statistics.median(fp8.step_s) if fp8 is not None else res_s
        fp8_bound = max(fp8_s, fp8_bytes / peak) if peak else fp8_s
        rows = []
        for name, r in res.items():
            step = statistics.median(r.step_s)
            quantized = name.endswith("-fp8")
            moved = 0 if name.startswith("resident") else fp8_bytes if quantized else h2d_bytes
            rows.append(
                {
                    "variant": name,
                    "step_s": step,
                    "step_s_all": r.step_s,
                    "host_s_all": r.host_s,
                    "host_s": statistics.median(r.host_s),
                    "h2d_bytes_per_pass": moved,
                    "ratio_to_resident": step / (fp8_s if quantized else res_s),
                    "ratio_to_bound": step / (fp8_bound if quantized else bound),
                    "h2d_bytes_per_s": moved / step,
                    "h2d_fraction_of_peak": (moved / step / peak) if peak else 0,
                    "pass_host_delta_us_per_block": 1e6 * (statistics.median(r.host_s) - res_host) / layout.num_blocks,
                    "peak_device_bytes": r.peak_device_bytes,
                    **r.extra,
                }
            )
        height, width, frames = (QUICK_WORKLOADS if args.quick else WORKLOADS)[w]
        out["workloads"].append(
            {
                "name": w,
                "height": height,
                "width": width,
                "frames": frames,
                "cfg": True,
                "tokens_per_sample": tokens,
                "batch": int(x.shape[0]),
                "resident_s": res_s,
                "transfer_s_at_peak": h2d_bytes / peak if peak else 0.0,
                "bound_s": bound,
                "fp8_bound_s": fp8_bound,
                "variants": rows,
            }
        )
    return out


def format_report(report: dict) -> str:
    lines = [
        f"{report['machine'].get('device_name', report['machine']['platform'])}: {report['num_blocks']} blocks, "
        f"{report['total_block_bytes'] / 1e9:.2f} GB; pinned H2D peak "
        f"{report['pinned_h2d_peak_bytes_per_s'] / 1e9:.1f} GB/s ({report['pinning']})"
    ]
    for w in report["workloads"]:
        lines.append(
            f"\n{w['name']} {w['width']}x{w['height']}x{w['frames']} CFG: resident {w['resident_s']:.4f} s, "
            f"bound {w['bound_s']:.4f} s"
        )
        lines.append(
            f"{'variant':22s} {'step s':>9s} {'/resident':>9s} {'/bound':>7s} {'H2D GB/s':>9s} "
            f"{'proxy us/blk':>12s} {'call us/blk':>11s} {'peak GB':>8s}"
        )
        for r in w["variants"]:
            lines.append(
                f"{r['variant']:22s} {r['step_s']:9.4f} {r['ratio_to_resident']:9.3f} {r['ratio_to_bound']:7.3f} "
                f"{r['h2d_bytes_per_s'] / 1e9:9.2f} {r.get('proxy_host_us_per_block', float('nan')):12.1f} "
                f"{r.get('block_call_us_per_block', float('nan')):11.1f} {r['peak_device_bytes'] / 1e9:8.2f}"
            )
    d = report.get("dispatch")
    if d:
        lines.append(
            f"\nhost dispatch ({d['config']}: same {d['tensors_per_block']} tensors per block, "
            f"{d['tokens_per_sample']} tokens; resident pass {d['resident_pass_host_s'] * 1e3:.2f} ms)"
        )
        for name, r in d["variants"].items():
            lines.append(
                f"{name:22s} +{r['dispatch_us_per_block']:7.1f} us/block over resident"
                + (f"; executor {r['proxy_host_us_per_block']:.1f} us/block" if "proxy_host_us_per_block" in r else "")
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from dlo_fn.runtime.platform import detect_platform

    report = run_step_bench(args)
    if args.out:
        path = pathlib.Path(args.out)
    else:
        name = slug(detect_platform(prefer=args.platform)) + ("_quick" if args.quick else "")
        path = pathlib.Path("figures") / "data" / f"bench_step_{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(format_report(report))
    print(f"\nwrote {path}")
    return 0
