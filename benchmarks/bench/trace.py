"""Where a forward's time goes, per block.

:func:`block_spans` (unprofiled): device events recorded as each block is entered, over back-to-back forwards, give
each block's span on the compute stream and how far the host ran ahead of the device there (a lead near zero: the
host was late). :func:`profile_forward`: one forward under ``torch.profiler``, summarised (where the compute stream
ran, waited on a transfer, or on the host; per block its kernel time and span; each H2D copy's time); the
profiler's own host work slows the host, so its "host late" share is an upper bound, which the unprofiled lead
settles. Used by `bench real --profile` and its adapter rows; ``python -m benchmarks.bench.trace TRACE...``
summarises kept traces."""

from __future__ import annotations

import bisect
import json
import pathlib
import tempfile
import time

__all__ = ["block_spans", "profile_forward", "summarize_trace"]

SPAN_FORWARDS = 4  # back-to-back forwards block_spans records; the last one's blocks are reported


def block_spans(platform, model, forward) -> dict | None:
    """Per block of the last of :data:`SPAN_FORWARDS` back-to-back forwards (after one untimed), unprofiled (CUDA
    only; None elsewhere): ``block_span_s`` from one block's entry to the next's on the compute stream (one fewer
    than the blocks) and ``host_lead_s``, at each block's entry how far the device was behind the host. The blocks
    are the entries of ``model``'s top-level module lists, in attribute order (diffusers' DiTs: forward order)."""
    if platform.kind != "cuda":
        return None
    import torch
    from torch import nn

    entries = [e for child in model.children() if isinstance(child, nn.ModuleList) for e in child]
    marks: list = []

    def enter(module, args, kwargs) -> None:
        event = platform.new_event(timing=True)
        event.record(platform.current_stream())
        marks.append((time.perf_counter(), event))

    hooks = [e.register_forward_pre_hook(enter, with_kwargs=True) for e in entries]
    try:
        with torch.no_grad():
            forward()
            platform.synchronize()
            marks.clear()
            start = platform.new_event(timing=True)
            start.record(platform.current_stream())
            t0 = time.perf_counter()
            for _ in range(SPAN_FORWARDS):
                forward()
            platform.synchronize()
    finally:
        for h in hooks:
            h.remove()
    n = len(entries)
    last = marks[-n:] if n and len(marks) == n * SPAN_FORWARDS else []
    device = [start.elapsed_time(e) / 1e3 for _, e in last]
    return {
        "block_span_s": [b - a for a, b in zip(device, device[1:])],
        "host_lead_s": [d - (t - t0) for d, (t, _) in zip(device, last)],
    }


def profile_forward(platform, forward, label: str, keep: str | None = None) -> dict | None:
    """One forward under ``torch.profiler`` (CUDA only; None elsewhere): its span on the device (first kernel or
    copy to last) and, per stream, the union of its kernels and copies (busy), their sum, and the five kernels
    with the most time. The stream that runs the blocks' matmuls is the compute stream; the copy and dequantise
    streams show whether compute waited on them. ``keep``: a folder the Chrome trace (``trace_<label>.json``, opens
    in Perfetto) is written to and kept (default: summarised, then deleted)."""
    if platform.kind != "cuda":
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    platform.synchronize()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward()
        platform.synchronize()
    folder = pathlib.Path(keep) if keep else pathlib.Path(tempfile.mkdtemp())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"trace_{label}.json"
    prof.export_chrome_trace(str(path))
    del prof
    torch.cuda.synchronize()
    try:
        return summarize_trace(path)
    finally:
        if not keep:
            path.unlink()


def summarize_trace(path: pathlib.Path) -> dict:
    """A Chrome trace of one forward (:func:`profile_forward`) summarised: the span, each stream's busy time, the
    compute stream's idle time split by what else ran, and per block (in forward order, the block marked by its
    attention kernel) the compute stream's kernel time and span (to the next block's attention kernel; the span's
    excess over the kernel time is where the compute stream waited), and each H2D copy's time."""
    events = [
        e
        for e in json.loads(pathlib.Path(path).read_text()).get("traceEvents", [])
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    ]
    if not events:
        return {"span_s": 0.0, "streams": {}}
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    streams: dict[str, dict] = {}
    for e in events:
        streams.setdefault(str(e.get("args", {}).get("stream", e.get("tid"))), []).append(e)
    out = {}
    for sid, evs in streams.items():
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs)
        busy, end = 0.0, None
        for a, b in spans:  # union of the intervals
            if end is None or a > end:
                busy, end = busy + (b - a), b
            elif b > end:
                busy, end = busy + (b - end), b
        by_name: dict[str, float] = {}
        for e in evs:
            by_name[e["name"][:80]] = by_name.get(e["name"][:80], 0.0) + e["dur"]
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
        out[sid] = {
            "busy_s": busy / 1e6,
            "sum_s": sum(e["dur"] for e in evs) / 1e6,
            "num_events": len(evs),
            "copy_s": sum(e["dur"] for e in evs if e["cat"] == "gpu_memcpy") / 1e6,
            "top_kernels_s": {k: v / 1e6 for k, v in top},
        }
    # The three streams as the Timeline names them: compute (the most kernel time), h2d (mostly copies), the
    # rest allgather (the dequantise kernels): compute's idle time, and how much of it a transfer stream was busy.
    from dlo_fn.plan.timeline import Timeline

    compute = max(out, key=lambda k: out[k]["sum_s"] - out[k]["copy_s"])
    role = {
        k: "compute" if k == compute else "h2d" if v["copy_s"] > v["sum_s"] / 2 else "allgather" for k, v in out.items()
    }
    for k, v in out.items():
        v["role"] = role[k]
    timeline = Timeline.from_records(
        (e["name"][:40], role[sid], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        for sid, evs in streams.items()
        for e in evs
    )
    idle, exposed = timeline.compute_idle_s(), timeline.exposed_transfer_s()
    # per block: compute-stream kernel time from one attention kernel's start to the next's
    marks = sorted(e["ts"] for e in streams[compute] if any(k in e["name"] for k in ("sdpa", "flash", "attention")))
    per_block = [0.0] * len(marks)
    for e in streams[compute]:
        i = bisect.bisect_right(marks, e["ts"]) - 1
        if i >= 0:
            per_block[i] += e["dur"] / 1e6
    spans = [b - a for a, b in zip(marks, marks[1:])]
    loads = [e["dur"] / 1e6 for e in sorted(events, key=lambda e: e["ts"]) if e["cat"] == "gpu_memcpy"]
    return {
        "span_s": (t1 - t0) / 1e6,
        "compute_busy_s": timeline.busy_s("compute"),
        "compute_idle_s": idle,
        "compute_idle_transfer_busy_s": exposed,  # waiting on a copy or a dequantise
        "compute_idle_nothing_busy_s": idle - exposed,  # no stream ran: the host was late
        "streams": out,
        "block_compute_s": per_block,
        "block_span_s": [s / 1e6 for s in spans],  # one fewer than the blocks: the last block's end is not marked
        "h2d_s": loads,  # in issue order: the first is the load ahead of the forward's first block
    }


if __name__ == "__main__":  # summaries of kept traces: python -m benchmarks.bench.trace TRACE...
    import sys

    print(json.dumps({pathlib.Path(t).name: summarize_trace(pathlib.Path(t)) for t in sys.argv[1:]}, indent=1))
