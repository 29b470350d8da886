"""Where the eager loop's host time per block goes on CUDA: each driver call timed inside the real pass.

``python -m dlo_fn.bench.driver_cost`` builds the ``bench step`` dispatch set-up (bench-narrow: the bench
model's blocks at hidden 256, 2 x 64 tokens, rank-local, pinned arena) and times every bound driver call of the
executor's fast segments while the pass runs (``in_pass_us``: mean host microseconds per call, by entry point).
It then times the same kinds of call two ways outside the executor, one call at a time:

* ``tight``: back to back (what ``bench.hostloop --cuda`` reports);
* ``after_block``: each call right after one block forward of the narrow model (its Python and kernel
  launches run in between, as in the pass: caches are cold and the device is busy).

The copies are timed at the pass's block size from the store's registered arena (``cudaHostRegister``) and from
``pin_memory`` (``cudaHostAlloc``), and at 256 bytes, through ``cuMemcpyHtoDAsync`` and the unified
``cuMemcpyAsync``. Stream memory operations, the candidates for replacing an event record and wait (a 64-bit
write, a satisfied wait), are timed beside them: ``cuStreamWriteValue64_v2``, ``cuStreamWaitValue64_v2`` and
``cuStreamBatchMemOp`` (v1, and ``_v2`` with one and two ops; v1 returned ``CUDA_ERROR_NOT_SUPPORTED`` on the
H200). The in-pass timing runs twice, side by side: with the executor's default (each compute's record issued
with the next block's driver calls) and with each record right after its block call (``DLO_FN_DEFER_RECORD=0``).
Writes JSON (``--out``) with the machine, command and date.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch

__all__ = ["main"]

_WAIT_VALUE_64, _WRITE_VALUE_64 = 4, 5  # CUstreamBatchMemOpType
_WAIT_GEQ = 0


class _MemOp(ctypes.Structure):
    """One ``CUstreamBatchMemOpParams`` (a 48-byte union) as its wait/write member: operation, address, value,
    flags, alias."""

    _fields_ = [("operation", ctypes.c_uint32), ("_pad0", ctypes.c_uint32), ("address", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("_pad1", ctypes.c_uint32),
                ("alias", ctypes.c_uint64), ("_pad2", ctypes.c_uint64)]


def _symbol(lib: ctypes.CDLL, name: str) -> Any:
    try:
        return lib[name]
    except AttributeError:
        return None


def _timed(fn: Any, name: str, acc: dict, counts: dict) -> Any:
    clock = time.perf_counter

    def call(*args):
        t0 = clock()
        code = fn(*args)
        acc[name] += clock() - t0
        counts[name] += 1
        return code

    return call


def in_pass(passes: int, defer_record: bool = True) -> tuple[dict, tuple]:
    """The dispatch executor's pass with each fast-segment driver call timed where it runs; also returns the
    set-up (model, resident blocks, inputs, store, layout) for :func:`outside`. ``defer_record``: the executor's
    compute records go with the next block's calls (its default) or right after each block call."""
    from dlo_fn.bench import step_variants as sv
    from dlo_fn.bench.step_dispatch import DISPATCH_SIZE
    from dlo_fn.models import BLOCK_PATHS
    from dlo_fn.plan.layout import model_layout
    from dlo_fn.plan.spec import spec_from_module
    from dlo_fn.runtime.blocks import strip_block
    from dlo_fn.runtime.host_store import build_host_store
    from dlo_fn.runtime.platform import platform_for

    platform = platform_for("cuda", 0)
    model = sv.random_model(sv.narrow_config("bench"), platform.device)
    x, kwargs, _ = sv.block_inputs(model, *DISPATCH_SIZE, platform.device)
    blocks = list(model.blocks)
    layout = model_layout(spec_from_module(model, BLOCK_PATHS), 1)
    ref = [copy.deepcopy(b) for b in blocks]
    with torch.no_grad():
        want = x
        for b in ref:
            want = b(want, **kwargs)
        tensors, aliases = sv.block_states(blocks)
        store = build_host_store(layout, 0, tensors, platform)
        del tensors
        for b in blocks:
            strip_block(b, platform.device)
        run_pass, ex = sv.executor_pass(platform, layout, store, blocks, aliases, mode="rank-local", group=None,
                                        block_call="functional_call")
        if ex._raw is None:
            raise SystemExit("driver_cost needs the driver-call loop (CUDA, libcuda, a pinned arena)")
        ex._defer_record = defer_record  # what DLO_FN_DEFER_RECORD sets when the executor is built
        acc: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for name in list(ex._raw._fast):
            ex._raw._fast[name] = _timed(ex._raw._fast[name], name, acc, counts)
        for _ in range(3):
            run_pass(x, kwargs)
        torch.cuda.synchronize()
        acc.clear(), counts.clear(), ex.stats.reset()
        for _ in range(passes):
            got = run_pass(x, kwargs)
        torch.cuda.synchronize()
        equal = bool(torch.equal(got, want))
    computes = max(ex.stats.computes, 1)
    out = {"in_pass_us": {k: 1e6 * acc[k] / counts[k] for k in sorted(acc)},
           "calls_per_block": {k: counts[k] / computes for k in sorted(counts)},
           "driver_us_per_block": 1e6 * sum(acc.values()) / computes,
           "proxy_host_us_per_block": ex.stats.issue_us_per_compute,
           "copies_per_block": len(store.sources[0]),
           "passes": passes, "equal_to_resident": equal}
    return out, (model, ref, x, kwargs, store, layout)


def outside(setup: tuple, calls: int) -> dict:
    """Single calls timed back to back and right after one block forward (see the module doc)."""
    from dlo_fn.runtime.cuda_raw import raw_cuda, stream_handle
    from dlo_fn.runtime.platform import platform_for

    _, ref, x, kwargs, store, layout = setup
    cu = raw_cuda(platform_for("cuda", 0))
    lib = ctypes.CDLL("libcuda.so.1")
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    hs, ms = stream_handle(side), stream_handle(main)
    ev = cu.new_event()
    reg_src = store.sources[0][0].src
    nbytes = reg_src.numel()
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    small = torch.empty(256, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flag = torch.zeros(2, dtype=torch.int64, device="cuda")

    def memops(name: str, n: int) -> tuple:
        ops = (_MemOp * n)()
        ops[0].operation, ops[0].address, ops[0].value = _WRITE_VALUE_64, flag.data_ptr(), 1
        if n > 1:
            ops[1].operation, ops[1].address, ops[1].value, ops[1].flags = _WAIT_VALUE_64, flag.data_ptr() + 8, 0, _WAIT_GEQ
        return _symbol(lib, name), (ctypes.c_void_p(ms), ctypes.c_uint(n), ops, ctypes.c_uint(0))

    def value_op(name: str, stream: int, value: int) -> tuple:
        return _symbol(lib, name), (ctypes.c_void_p(stream), ctypes.c_uint64(flag.data_ptr()), ctypes.c_uint64(value),
                           ctypes.c_uint(0))

    def unified_copy(dst: int, src: int, n: int, stream: int) -> tuple:
        return _symbol(lib, "cuMemcpyAsync"), (ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(n),
                                      ctypes.c_void_p(stream))

    bound = {
        "cuEventRecord": cu.bind_record(ev.handle, ms),
        "cuStreamWaitEvent": cu.bind_wait(hs, ev.handle),
        "cuMemcpyHtoDAsync registered block": cu.bind_copy(dev.data_ptr(), reg_src.data_ptr(), nbytes, hs, False),
        "cuMemcpyHtoDAsync pin_memory block": cu.bind_copy(dev.data_ptr(), pinned.data_ptr(), nbytes, hs, False),
        "cuMemcpyHtoDAsync 256 B": cu.bind_copy(dev.data_ptr(), small.data_ptr(), 256, hs, False),
        "cuMemcpyAsync registered block": unified_copy(dev.data_ptr(), reg_src.data_ptr(), nbytes, hs),
        "cuMemcpyAsync 256 B": unified_copy(dev.data_ptr(), small.data_ptr(), 256, hs),
        "cuStreamBatchMemOp 1 op": memops("cuStreamBatchMemOp", 1),
        "cuStreamBatchMemOp_v2 1 op": memops("cuStreamBatchMemOp_v2", 1),
        "cuStreamBatchMemOp_v2 2 ops": memops("cuStreamBatchMemOp_v2", 2),
        "cuStreamWriteValue64_v2": value_op("cuStreamWriteValue64_v2", ms, 1),
        "cuStreamWaitValue64_v2": value_op("cuStreamWaitValue64_v2", hs, 0),  # satisfied (GEQ 0)
    }
    block = ref[0]
    clock = time.perf_counter
    res: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for name, (fn, args) in bound.items():
            if fn is None:
                res[name] = {"error": "not exported by libcuda"}
                continue
            if code := fn(*args):  # e.g. 801, CUDA_ERROR_NOT_SUPPORTED
                res[name] = {"error": float(code)}
                continue
            torch.cuda.synchronize()
            t0 = clock()
            for _ in range(calls):
                fn(*args)
            tight = 1e6 * (clock() - t0) / calls
            torch.cuda.synchronize()
            samples = []
            for i in range(max(calls // 20, 50)):
                block(x, **kwargs)
                t0 = clock()
                fn(*args)
                samples.append(clock() - t0)
                if i % 16 == 15:
                    torch.cuda.synchronize()  # the device keeps up: no launch-queue back-pressure in the samples
            torch.cuda.synchronize()
            res[name] = {"tight_us": tight, "after_block_us_median": 1e6 * statistics.median(samples),
                         "after_block_us_mean": 1e6 * statistics.fmean(samples)}
    return {"outside": res, "block_bytes": nbytes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passes", type=int, default=200, help="timed passes of the in-pass measurement")
    p.add_argument("--calls", type=int, default=4000, help="calls per kind, outside the executor")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("driver_cost: needs a CUDA device", file=sys.stderr)
        return 2
    from dlo_fn.bench.report import emit, stamp
    from dlo_fn.runtime.platform import platform_for

    # The executor's default (a compute's record issued with the next block's calls) and, side by side, each
    # record right after its block call.
    result, setup = in_pass(a.passes, defer_record=True)
    result["record_after_block_call"] = in_pass(a.passes, defer_record=False)[0]
    result.update(outside(setup, a.calls))
    emit(stamp(result, "dlo_fn.bench.driver_cost", argv, platform_for("cuda", 0)), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
