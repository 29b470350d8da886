"""`bench real`'s adapter rows: a LoRA on every attention and MLP linear of the blocks, loaded after offload.

``resident-lora``   the resident model with adapter ``a`` loaded (peft, unfused): the reference of the rows below
                    and their own bound (max(its forward, block bytes / pinned peak))
``ours-lora``       ``load_model`` + ``offload`` (rank-local), then, once ready: adapters ``a`` and ``b`` loaded
                    from disk (``load_lora_adapter``), ``set_adapters`` to ``b`` and back to ``a``, ``b`` deleted;
                    the forwards run with ``a``; pinned bytes before and after, device bytes the adapters took
``ours-lora-fp8``   the same on FP8 shards (reference: the fake-quantised resident model with ``a``)
``ours-lora-fp8-3-slots``  the same on three slots (a load two blocks ahead)

Each adapter row first times the same offloaded model without an adapter (``forward_s_without_adapter``), so the
adapter's cost is read within one model, and profiles one forward without and one with the adapter
(``torch.profiler`` on CUDA, :func:`profile_forward`: each stream's busy time and its heaviest kernels), which
says whether the forward waits on the link or on compute.

The adapters are random (:func:`dlo_fn.models.lora.write_adapter`), rank :data:`RANK` (4 with ``--quick``), in the
model's dtype, written once per run beside the checkpoint.
"""

from __future__ import annotations

import bisect
import json
import os
import pathlib
import statistics
import tempfile
import time

__all__ = ["RANK", "TARGETS", "VARIANTS", "write_adapters", "load", "adapter_work", "profile_forward"]

RANK = 64
VARIANTS = ("ours-lora", "ours-lora-fp8", "ours-lora-fp8-3-slots")
# Adapter names: diffusers' load reports another adapter's weights as missing keys when the new name is a
# substring of their keys (a name "b" is in "transformer_blocks"), so none is a single letter.
NAMES = ("lora-a", "lora-b")
TRACE_DIR = "BENCH_LORA_TRACE_DIR"  # if set: each profiled forward's Chrome trace is kept there
_BLOCK = r"(single_)?transformer_blocks\.\d+\."
TARGETS = {  # every attention and MLP linear of the blocks, by family (real_models.ModelCase.family)
    "flux": _BLOCK + r"(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
    r"|ff(_context)?\.net\.(0\.proj|2)|proj_mlp|proj_out)",
    "wan": r"blocks\.\d+\.((attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|ffn\.net\.(0\.proj|2))",
}


def write_adapters(model, folder: pathlib.Path, family: str, quick: bool) -> tuple[str, str]:
    """Adapters ``a`` and ``b`` for ``model``'s layers, written beside the checkpoint folder."""
    from dlo_fn.models.lora import write_adapter

    if family not in TARGETS:
        raise ValueError(f"no adapter targets for the {family!r} family")
    rank = 4 if quick else RANK
    out = folder.with_name(folder.name + "-lora")
    out.mkdir(parents=True, exist_ok=True)
    return tuple(
        str(write_adapter(model, out / f"{n}.safetensors", rank, seed=i + 1, targets=TARGETS[family]))
        for i, n in enumerate("ab")
    )


def load(model, path: str, name: str) -> None:
    """The documented call (README, docs/design.md): peft builds the layers on meta and takes the file's tensors."""
    model.load_lora_adapter(path, adapter_name=name, prefix=None, low_cpu_mem_usage=True)


def adapter_work(o, files: tuple[str, str], platform, forward, time_forwards, label: str) -> dict:
    """On a ready offloaded model: its forward timed (``time_forwards()``: the seconds of each) and profiled
    without an adapter; both adapters loaded, ``b`` switched to and back, ``b`` deleted, each timed; one forward
    with ``a`` profiled."""

    def timed(fn) -> float:
        platform.synchronize()
        t = time.perf_counter()
        fn()
        platform.synchronize()
        return time.perf_counter() - t

    without = time_forwards()
    profiles = {"without_adapter": profile_forward(platform, forward, f"{label}-without")}
    pinned, device = o.pinned_host_bytes, platform.memory_allocated()
    a, b = NAMES
    loads = [timed(lambda p=p, n=n: load(o.model, p, n)) for p, n in zip(files, NAMES)]
    adapters_device = platform.memory_allocated() - device
    switches = [timed(lambda n=n: o.model.set_adapters(n)) for n in (b, a, b, a)]
    unload = timed(lambda: o.model.delete_adapters(b))
    profiles["with_adapter"] = profile_forward(platform, forward, f"{label}-with")
    return {
        "forward_s_without_adapter": statistics.median(without),
        "forward_s_all_without_adapter": without,
        "profile": profiles,
        "adapter_rank": int(open_rank(files[0])),
        "adapter_load_s_all": loads,
        "adapter_load_s": max(loads),
        "adapter_switch_s_all": switches,
        "adapter_switch_s": statistics.median(switches),
        "adapter_unload_s": unload,
        "adapter_device_bytes": adapters_device // 2,
        "adapter_file_bytes": pathlib.Path(files[0]).stat().st_size,
        "pinned_bytes_before_adapters": pinned,
        "pinned_bytes_after_adapters": o.pinned_host_bytes,
    }


def open_rank(path: str) -> str:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return (f.metadata() or {}).get("rank", "0")


def profile_forward(platform, forward, label: str) -> dict | None:
    """One forward under ``torch.profiler`` (CUDA only; None elsewhere): its span on the device (first kernel or
    copy to last) and, per stream, the union of its kernels and copies (busy), their sum, and the five kernels
    with the most time. The stream that runs the blocks' matmuls is the compute stream; the copy and dequantise
    streams show whether compute waited on them."""
    if platform.kind != "cuda":
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    platform.synchronize()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward()
        platform.synchronize()
    keep = os.environ.get(TRACE_DIR)
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
    attention kernel) the compute stream's kernel time and each H2D copy's time."""
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
    loads = [e["dur"] / 1e6 for e in sorted(events, key=lambda e: e["ts"]) if e["cat"] == "gpu_memcpy"]
    return {
        "span_s": (t1 - t0) / 1e6,
        "compute_busy_s": timeline.busy_s("compute"),
        "compute_idle_s": idle,
        "compute_idle_transfer_busy_s": exposed,  # waiting on a copy or a dequantise
        "compute_idle_nothing_busy_s": idle - exposed,  # no stream ran: the host was late
        "streams": out,
        "block_compute_s": per_block,
        "h2d_s": loads,  # in issue order: the first is the load ahead of the forward's first block
    }


if __name__ == "__main__":  # summaries of kept traces (BENCH_LORA_TRACE_DIR): python -m benchmarks.bench.real_lora T..
    import sys

    print(json.dumps({pathlib.Path(t).name: summarize_trace(pathlib.Path(t)) for t in sys.argv[1:]}, indent=1))
