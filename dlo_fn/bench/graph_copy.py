"""Two diagnostics on CUDA (``python -m dlo_fn.bench.graph_copy``), JSON on stdout:

* ``copy_gb_per_s``: H2D bandwidth of 8 block-sized copies (0.56 GB, the bench config's block) from one
  ``cudaHostRegister``-pinned arena into two device slots, issued eagerly, as one CUDA graph with one memcpy node
  per copy, and as graphs with each copy split into chunks: whether a captured copy runs at the eager rate.
* ``queued_gb_per_s``: the same graph of copies (and one with a chain of matmuls beside the copies, each copy
  waiting for the matmul two before it, like the ring) issued eagerly, replayed 6 times with a synchronize before
  each replay, and 6 times back to back: each pass's rate from events around it. Whether copies and computes in
  one graph run slower than eager (``--queued``).
* ``in_loop_us``: host microseconds per driver call of each kind *inside* the eager loop of the bench-narrow
  model (``bench step``'s dispatch model), timed by wrapping the bound calls, and the executor's cost per block.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict

import torch

from dlo_fn.runtime.host_store import alloc_host
from dlo_fn.runtime.platform import platform_for

BLOCK_BYTES = 562_000_000


def copy_rates(num_copies: int = 8, chunks: tuple[int, ...] = (0, 256 << 20, 64 << 20, 16 << 20)) -> dict:
    plat = platform_for("cuda", 0)
    arena, how, fin = alloc_host(num_copies * BLOCK_BYTES, plat, pin=True)
    slots = [torch.empty(BLOCK_BYTES, dtype=torch.uint8, device="cuda") for _ in range(2)]
    stream = torch.cuda.Stream()

    def issue(chunk: int) -> None:
        for k in range(num_copies):
            src, dst = arena[k * BLOCK_BYTES:(k + 1) * BLOCK_BYTES], slots[k % 2]
            step = chunk or BLOCK_BYTES
            for a in range(0, BLOCK_BYTES, step):
                dst[a:a + step].copy_(src[a:a + step], non_blocking=True)

    def timed(fn) -> float:
        out = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return num_copies * BLOCK_BYTES / statistics.median(out[1:]) / 1e9

    rates = {"how": how}
    with torch.cuda.stream(stream):
        rates["eager"] = timed(lambda: issue(0))
        rates["eager_chunk_64MB"] = timed(lambda: issue(64 << 20))
    for chunk in chunks:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            issue(chunk)
        rates[f"graph_chunk_{chunk >> 20}MB" if chunk else "graph_whole"] = timed(g.replay)
        del g
    del slots
    fin()
    return rates


def queued_rates(num_copies: int = 8, replays: int = 6) -> dict:
    arena, how, fin = alloc_host(num_copies * BLOCK_BYTES, platform_for("cuda", 0), pin=True)
    slots = [torch.empty(BLOCK_BYTES, dtype=torch.uint8, device="cuda") for _ in range(2)]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def copies_only() -> None:
        for k in range(num_copies):
            slots[k % 2].copy_(arena[k * BLOCK_BYTES:(k + 1) * BLOCK_BYTES], non_blocking=True)

    def with_compute() -> None:  # copy k on a side stream after matmul k-2; matmul k after copy k (the ring)
        main = torch.cuda.current_stream()
        fork = torch.cuda.Event()
        fork.record(main)
        side.wait_event(fork)
        done_copy, done_mm = [], []
        for k in range(num_copies):
            with torch.cuda.stream(side):
                if k >= 2:
                    side.wait_event(done_mm[k - 2])
                slots[k % 2].copy_(arena[k * BLOCK_BYTES:(k + 1) * BLOCK_BYTES], non_blocking=True)
                done_copy.append(torch.cuda.Event())
                done_copy[-1].record(side)
            main.wait_event(done_copy[k])
            for _ in range(5):  # ~8 ms of 8192^3 bf16 matmuls per ~10 ms copy: copy-bound, as the image pass
                torch.mm(a, a)
            done_mm.append(torch.cuda.Event())
            done_mm[-1].record(main)
        join = torch.cuda.Event()
        join.record(side)
        main.wait_event(join)

    torch.mm(a, a)  # cuBLAS's handle is made outside the capture
    out = {"how": how}
    for name, issue in (("copies_only", copies_only), ("copies_and_matmuls", with_compute)):
        times = []
        for _ in range(replays):  # eager, for comparison
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            issue()
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        out[f"{name}_eager_gb_per_s"] = [num_copies * BLOCK_BYTES / (s.elapsed_time(e) / 1e3) / 1e9 for s, e in times]
    for name, issue in (("copies_only", copies_only), ("copies_and_matmuls", with_compute)):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            issue()
        g.replay()
        torch.cuda.synchronize()
        for mode in ("synced", "queued"):
            evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
            for start, end in evs:
                if mode == "synced":
                    torch.cuda.synchronize()
                start.record()
                g.replay()
                end.record()
            torch.cuda.synchronize()
            out[f"{name}_{mode}_gb_per_s"] = [num_copies * BLOCK_BYTES / (s.elapsed_time(e) / 1e3) / 1e9
                                              for s, e in evs]
        del g
    del slots
    fin()
    return out


def in_loop_costs(passes: int = 30) -> dict:
    from dlo_fn.bench import step_variants as sv
    from dlo_fn.bench.step_dispatch import DISPATCH_SIZE
    from dlo_fn.bench.step_variants import block_inputs
    from dlo_fn.models import BLOCK_PATHS
    from dlo_fn.plan.layout import model_layout
    from dlo_fn.plan.spec import spec_from_module
    from dlo_fn.runtime.blocks import strip_block
    from dlo_fn.runtime.host_store import build_host_store

    plat = platform_for("cuda", 0)
    model = sv.random_model(sv.narrow_config("bench"), plat.device)
    x, kwargs, _ = block_inputs(model, *DISPATCH_SIZE, plat.device)
    blocks = list(model.blocks)
    layout = model_layout(spec_from_module(model, BLOCK_PATHS), 1)
    with torch.no_grad():
        tensors, aliases = sv.block_states(blocks)
        store = build_host_store(layout, 0, tensors, plat)
        for b in blocks:
            strip_block(b, plat.device)
        run_pass, ex = sv.executor_pass(plat, layout, store, blocks, aliases, group=None, mode="rank-local",
                                        block_call="functional_call")
        spent: dict[str, list[float]] = defaultdict(list)
        clock = time.perf_counter
        for name, fn in list(ex._raw._fast.items()):
            def timed(*a, _fn=fn, _acc=spent[name]):
                t0 = clock()
                code = _fn(*a)
                _acc.append(clock() - t0)
                return code
            ex._raw._fast[name] = timed
        ex._programs = type(ex._programs)(ex._compile)
        for _ in range(3):
            run_pass(x, kwargs)
        torch.cuda.synchronize()
        for v in spent.values():
            v.clear()
        ex.stats.reset()
        for _ in range(passes):
            run_pass(x, kwargs)
        torch.cuda.synchronize()
    per_block = {k: len(v) / ex.stats.computes for k, v in spent.items()}
    return {"executor_us_per_block_with_timers": ex.stats.issue_us_per_compute,
            "call_us_median": {k: 1e6 * statistics.median(v) for k, v in spent.items() if v},
            "call_us_mean": {k: 1e6 * statistics.fmean(v) for k, v in spent.items() if v},
            "calls_per_block": per_block, "num_blocks": layout.num_blocks, "passes": passes}


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--queued"]:
        print(json.dumps({"queued_gb_per_s": queued_rates()}, indent=1))
    else:
        print(json.dumps({"in_loop_us": in_loop_costs(), "copy_gb_per_s": copy_rates()}, indent=1))
