"""Where a graphed pass loses time against the H2D bound: the copy engine's idle gaps, traced with CUPTI.

``python -m dlo_fn.bench.graph_gaps --before video`` builds the ``bench step`` set-up (bench config, 24 x 0.56
GB blocks, pinned arena, rank-local), runs ``--before`` workloads first in the same executor (graph mode,
captured and replayed), then the image workload, and traces ``--traced`` passes of it with ``torch.profiler``.
From the trace it reports the H2D copies' busy fraction over the traced passes and every gap between consecutive
copies longer than ``--gap-ms``: when it starts relative to its pass, how long it lasts, and which kernels ran
during it. ``--eager`` traces the eager executor instead. One JSON line per condition (``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

__all__ = ["main"]


def _gaps(trace: dict, gap_ms: float) -> dict:
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    copies = sorted((e for e in ev if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")
                     and e.get("dur", 0) > 1000), key=lambda e: e["ts"])
    kernels = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not copies:
        return {"error": "no H2D copies in the trace", "names": sorted({e.get("cat", "") for e in ev})}
    t0, t1 = copies[0]["ts"], copies[-1]["ts"] + copies[-1]["dur"]
    busy = sum(c["dur"] for c in copies)
    gaps = []
    for a, b in zip(copies, copies[1:]):
        start, end = a["ts"] + a["dur"], b["ts"]
        if end - start > gap_ms * 1e3:
            during = [k for k in kernels if k["ts"] < end and k["ts"] + k["dur"] > start]
            gaps.append({"after_copy_us": round(start - t0), "gap_ms": round((end - start) / 1e3, 3),
                         "kernels_during": len(during),
                         "kernel_busy_ms": round(sum(min(k["ts"] + k["dur"], end) - max(k["ts"], start)
                                                     for k in during) / 1e3, 3)})
    return {"copies": len(copies), "copy_ms_median": sorted(c["dur"] for c in copies)[len(copies) // 2] / 1e3,
            "span_ms": round((t1 - t0) / 1e3, 3), "h2d_busy_fraction": round(busy / (t1 - t0), 4),
            "gaps": gaps, "copy_streams": sorted({str(c.get("tid")) for c in copies}),
            "kernel_streams": sorted({str(k.get("tid")) for k in kernels})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="", help="comma list of workloads run (graphed) before the image")
    p.add_argument("--traced", type=int, default=2, help="image passes traced")
    p.add_argument("--gap-ms", type=float, default=0.5)
    p.add_argument("--eager", action="store_true", help="trace the eager executor instead of graph mode")
    p.add_argument("--before-eager", action="store_true", help="run the --before workloads eager (graphs off)")
    p.add_argument("--dummy-gb", type=float, default=0.0,
                   help="allocate this many GB on the device before the image passes (see --free-dummy)")
    p.add_argument("--free-dummy", action="store_true", help="free the dummy and empty the cache before the image")
    p.add_argument("--empty-cache", action="store_true", help="empty the allocator's cache before the image")
    p.add_argument("--clear-graphs", action="store_true", help="drop the --before workloads' graphs first")
    p.add_argument("--pre-graphs", type=int, default=0,
                   help="capture and replay this many small graphs (a pinned H2D copy beside a matmul) first")
    p.add_argument("--out", default=None, help="append one JSON line here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_gaps: needs a CUDA device", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile

    from dlo_fn.bench import step_variants as sv
    from dlo_fn.bench.report import emit, stamp
    from dlo_fn.bench.step import WORKLOADS
    from dlo_fn.models import BLOCK_PATHS
    from dlo_fn.plan.layout import model_layout
    from dlo_fn.plan.spec import spec_from_module
    from dlo_fn.runtime.blocks import strip_block
    from dlo_fn.runtime.host_store import build_host_store
    from dlo_fn.runtime.platform import platform_for

    platform = platform_for("cuda", 0)
    model = sv.random_model(sv.bench_config("bench"), platform.device)
    before = [w for w in a.before.split(",") if w]
    inputs = {w: sv.block_inputs(model, *WORKLOADS[w], platform.device) for w in before + ["image"]}
    layout = model_layout(spec_from_module(model, BLOCK_PATHS, name="bench"), 1)
    blocks = list(model.blocks)
    with torch.no_grad():
        tensors, aliases = sv.block_states(blocks)
        store = build_host_store(layout, 0, tensors, platform)
        del tensors
        for b in blocks:
            strip_block(b, platform.device)
        sv.release(platform)
        run_pass, ex = sv.executor_pass(platform, layout, store, blocks, aliases, mode="rank-local", group=None,
                                        block_call="functional_call", graph=not a.eager)
        keep = []
        for _ in range(a.pre_graphs):
            host = torch.empty(1 << 24, dtype=torch.uint8).pin_memory()
            dev = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")
            m = torch.randn(2048, 2048, device="cuda")
            side = torch.cuda.Stream()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fork = torch.cuda.Event()
                fork.record()
                side.wait_event(fork)
                with torch.cuda.stream(side):
                    dev.copy_(host, non_blocking=True)
                out = m @ m
                join = torch.cuda.Event()
                join.record(side)
                torch.cuda.current_stream().wait_event(join)
            g.replay()
            keep.append((g, host, dev, m, out))
        torch.cuda.synchronize()
        graphs = ex.graphs
        if a.before_eager:
            ex.graphs = None
        for w in before:
            x, kw, _ = inputs[w]
            for _ in range(5):
                run_pass(x, kw)
        torch.cuda.synchronize()
        ex.graphs = graphs
        if a.clear_graphs and graphs is not None:
            graphs.clear()
            sv.release(platform)
        dummy = torch.empty(int(a.dummy_gb * 1e9), dtype=torch.uint8, device="cuda") if a.dummy_gb else None
        if a.free_dummy:
            del dummy
        if a.empty_cache or a.free_dummy:
            sv.release(platform)
        x, kw, _ = inputs["image"]
        for _ in range(6):
            run_pass(x, kw)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            for _ in range(a.traced):
                run_pass(x, kw)
            end.record()
            torch.cuda.synchronize()
        path = "/tmp/graph_gaps_trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    row = {"before": before, "graph": not a.eager, "before_eager": a.before_eager, "dummy_gb": a.dummy_gb,
           "free_dummy": a.free_dummy, "empty_cache": a.empty_cache, "pre_graphs": a.pre_graphs, "clear_graphs": a.clear_graphs, "traced_passes": a.traced,
           "pass_s": start.elapsed_time(end) / 1e3 / a.traced,
           "graph_replays": ex.graphs.replays if ex.graphs is not None else 0, **_gaps(trace, a.gap_ms)}
    emit(stamp(row, "dlo_fn.bench.graph_gaps", argv), a.out, append=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
