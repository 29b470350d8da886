"""The eager loop's own Python cost per block, on a CPU: the driver-call path with the driver emulated on the host.

``python -m dlo_fn.bench.hostloop`` builds the executor of a small model on the CPU and gives it
:class:`HostDriver` in place of ``libcuda``: an H2D copy is a real ``memmove`` of the bytes (so the output is
still ``torch.equal`` to resident), and an event record or wait is a no-op (everything is synchronous on the
host). What it measures per block is the executor's host time outside the block call (``ExecutorStats``, the same
counter ``bench step`` reports as ``proxy_host_us_per_block``) and the number of driver calls it made: on a GPU
host each real call adds its own cost (the H200 rows of ``bench step``) to the Python cost measured here.
The blocks are called through ``swap`` with a trivial module so that the block call itself is cheap.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from typing import Any

import torch
from torch import nn

__all__ = ["HostDriver", "host_executor", "measure"]


class _Event:
    __slots__ = ("driver", "handle", "__weakref__")

    def __init__(self, driver: "HostDriver", handle: int) -> None:
        self.driver, self.handle = driver, handle

    def record(self, stream: Any) -> None:
        self.driver._record(self.handle, 0)


class HostDriver:
    """The :class:`~dlo_fn.runtime.cuda_raw.RawCuda` interface on the host: copies are ``memmove``, events are
    no-ops; ``calls`` counts every driver call made through it, ``copies`` the copies among them."""

    def __init__(self, strict: bool = False) -> None:
        self.calls = self.copies = 0
        self._next = 1
        # strict: every wait of a fast segment (bind_wait: the waits on the run's own ops) must come after that
        # event's record in the same run (new_run starts one), or the device would wait on the previous run's
        # record: raises RuntimeError naming the event. The generic loop's waits (the previous run's last uses)
        # go through the unchecked ``_wait``.
        self.strict, self.recorded = strict, set()

        def wait(stream: int, event: int, flags: int) -> int:
            self.calls += 1
            return 0

        def checked_wait(stream: int, event: int, flags: int) -> int:
            if event not in self.recorded:
                raise RuntimeError(f"stream {stream} waits on event {event} before its record in this run")
            return wait(stream, event, flags)

        def record(event: int, stream: int) -> int:
            self.calls += 1
            if self.strict:
                self.recorded.add(event)
            return 0

        def copy(dst: int, src: int, nbytes: int, stream: int) -> int:
            self.calls += 1
            self.copies += 1
            ctypes.memmove(dst, src, nbytes)
            return 0

        self._wait, self._record, self._h2d, self._d2d = wait, record, copy, copy
        self._fast_wait = checked_wait if strict else wait

    def new_run(self) -> None:
        self.recorded.clear()

    @staticmethod
    def check(code: int, what: str) -> None:
        if code:
            raise RuntimeError(f"{what} failed with {code}")

    def new_event(self) -> _Event:
        self._next += 1
        return _Event(self, self._next)

    def copy(self, dst: int, src: int, nbytes: int, stream: int, device_src: bool) -> None:
        self._h2d(dst, src, nbytes, stream)

    def bind_wait(self, stream: int, event: int) -> tuple[Any, tuple]:
        return self._fast_wait, (stream, event, 0)

    def bind_carry_wait(self, stream: int, event: int) -> tuple[Any, tuple]:
        return self._wait, (stream, event, 0)  # the previous run's record: not in this run's set

    def bind_record(self, event: int, stream: int) -> tuple[Any, tuple]:
        return self._record, (event, stream)

    def bind_copy(self, dst: int, src: int, nbytes: int, stream: int, device_src: bool) -> tuple[Any, tuple]:
        return self._h2d, (dst, src, nbytes, stream)


class _Tiny(nn.Module):
    def __init__(self, width: int, num_tensors: int) -> None:
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(width)) for _ in range(num_tensors))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w[0]


def host_executor(model: nn.Module, mode: str = "rank-local", *, block_call: str = "swap", monkeypatch: Any = None,
                  strict: bool = False, paths: Any = "blocks", ctx: Any = None, **options: Any):
    """``(offloaded, driver)``: ``model`` offloaded on the CPU with its executor on :class:`HostDriver` (the
    driver-call path of CUDA). ``monkeypatch`` (pytest's) sets ``stream_handle`` for host streams; without it the
    module attribute is set directly and left set (a benchmark process). ``strict``: the driver checks that no
    wait comes before its event's record in a run (:class:`HostDriver`). ``paths``: the block lists (as
    :func:`~dlo_fn.runtime.offload.offload` takes them). ``ctx``: the rank's
    :class:`~dlo_fn.runtime.dist.DistContext` (default: one process, no group); with a group of W > 1 ranks the
    all-gathers are the group's real collectives, called between the emulated driver calls."""
    import dlo_fn.runtime.executor as executor_mod
    from dlo_fn.runtime.dist import DistContext
    from dlo_fn.runtime.offload import offload
    from dlo_fn.runtime.platform import platform_for
    from dlo_fn.runtime.program import Programs

    ctx = ctx if ctx is not None else DistContext(0, 1, 0, platform_for("cpu"), None)
    off = offload(model, paths, ctx, mode=mode, block_call=block_call, **options)
    ex = off.executor
    driver = HostDriver(strict)
    if monkeypatch is not None:
        monkeypatch.setattr(executor_mod, "stream_handle", id)
    else:
        executor_mod.stream_handle = id
    ex._raw, ex._programs = driver, Programs(ex._compile)
    if strict:
        begin = ex.begin_run

        def begin_run(*args: Any, **kwargs: Any) -> Any:
            driver.new_run()
            return begin(*args, **kwargs)

        ex.begin_run = begin_run
    return off, driver


def measure(num_blocks: int = 24, num_tensors: int = 15, passes: int = 200, load_group: int = 1) -> dict:
    """Median over passes of the executor's host time per block (us) and driver calls per block (one implicit run
    per pass; ``load_group`` G on 2G slots)."""

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(_Tiny(64, num_tensors) for _ in range(num_blocks))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    ref = Stack()
    x = torch.randn(64)
    want = ref(x)
    import copy

    off, driver = host_executor(copy.deepcopy(ref), num_slots=2 * load_group, load_group=load_group)
    ex = off.executor
    per_block, calls = [], []
    with torch.no_grad():
        for _ in range(passes):
            ex.stats.reset()
            c0 = driver.calls
            got = off.model(x)
            per_block.append(ex.stats.issue_us_per_compute)
            calls.append((driver.calls - c0) / num_blocks)
    assert torch.equal(got, want), "the offloaded pass differs from resident"
    return {"executor_host_us_per_block": statistics.median(per_block[passes // 4:]),
            "driver_calls_per_block": statistics.median(calls), "num_blocks": num_blocks, "load_group": load_group,
            "tensors_per_block": num_tensors, "passes": passes, "equal_to_resident": True}


def driver_call_us(calls: int = 20000) -> dict:
    """On CUDA: host microseconds per bound driver call of the executor's fast segments (an event record, a stream
    wait on it, a 256-byte pinned H2D copy), the floor under the eager loop's cost per block."""
    from dlo_fn.runtime.cuda_raw import raw_cuda, stream_handle
    from dlo_fn.runtime.platform import platform_for

    cu = raw_cuda(platform_for("cuda", 0))
    if cu is None:
        raise SystemExit("driver_call_us needs CUDA and libcuda")
    side, main_stream = torch.cuda.Stream(), torch.cuda.current_stream()
    ev = cu.new_event()
    host = torch.empty(256, dtype=torch.uint8).pin_memory()
    dev = torch.empty(256, dtype=torch.uint8, device="cuda")
    bound = {"cuEventRecord": cu.bind_record(ev.handle, stream_handle(main_stream)),
             "cuStreamWaitEvent": cu.bind_wait(stream_handle(side), ev.handle),
             "cuMemcpyHtoDAsync": cu.bind_copy(dev.data_ptr(), host.data_ptr(), 256, stream_handle(side), False)}
    out = {}
    for name, (fn, args) in bound.items():
        for _ in range(1000):
            fn(*args)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        out[name] = 1e6 * (time.perf_counter() - t0) / calls
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        time.perf_counter()
    out["time.perf_counter"] = 1e6 * (time.perf_counter() - t0) / calls
    return {"driver_call_us": out, "calls": calls}


class _NoReplay:
    def replay(self) -> None:
        pass


class _NoCapture:
    """A block-graph capture whose replays do nothing: what is left of a replayed block call is the wrapper's own
    host work (flattening the call, its key, the chain-buffer checks, the input copies)."""

    device = "cpu"

    def reset(self) -> None:
        pass

    def capture(self, work: Any) -> tuple[Any, Any]:
        return _NoReplay(), work()


def block_graph_call_us(num_blocks: int = 24, passes: int = 3000) -> dict:
    """Median over 5 rounds of the host microseconds per replayed block call of
    :class:`~dlo_fn.runtime.block_graph.BlockGraphs` (a diffusers-like call: the hidden states and a context from
    the previous block, a shared embedding, a rotary tuple and a constant), the replay itself a no-op."""
    from dlo_fn.runtime.block_graph import BlockGraphs

    bg = BlockGraphs(4, capture=_NoCapture())

    def caller(args: tuple, kwargs: dict) -> Any:
        return args[0] + 1, kwargs["ctx"] * 1

    calls = [bg.wrap(caller, b, b % 2) for b in range(num_blocks)]
    x0, c0, temb = torch.randn(2, 16), torch.randn(2, 16), torch.randn(2, 16)

    def one_pass() -> None:
        x, c = x0, c0
        for call in calls:
            x, c = call((x,), {"ctx": c, "temb": temb, "rope": (temb, temb), "flag": None})

    for _ in range(5):  # eager, captured, replayed
        one_pass()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(passes // 5):
            one_pass()
        rounds.append(1e6 * (time.perf_counter() - t0) / (passes // 5) / num_blocks)
    return {"block_graph_call_us": statistics.median(rounds), "block_graph_replays": bg.replays,
            "block_graph_captures": bg.captures}


def _groups(text: str) -> tuple[int, ...]:
    try:
        groups = tuple(int(g) for g in text.split(",") if g.strip())
    except ValueError:
        groups = ()
    if not groups or min(groups) < 1:
        raise argparse.ArgumentTypeError(f"a comma list of integers >= 1, got {text!r}")
    return groups


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=24)
    p.add_argument("--passes", type=int, default=200)
    p.add_argument("--cuda", action="store_true", help="also time the bound driver calls on the GPU")
    p.add_argument("--block-graphs", action="store_true",
                   help="also time the block-graph wrapper's host work per replayed block call (replay a no-op)")
    p.add_argument("--load-groups", type=_groups, default=(1,), metavar="G,...",
                   help="load groups of G on 2G slots; several: measured in turn, 3 rounds, medians per G")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    groups = a.load_groups
    if len(groups) == 1:
        result = measure(a.blocks, passes=a.passes, load_group=groups[0])
    else:
        rounds = [[measure(a.blocks, passes=a.passes, load_group=g) for g in groups] for _ in range(3)]
        result = {"num_blocks": a.blocks, "passes": a.passes, "by_load_group": {str(g): {
            "executor_host_us_per_block": statistics.median(r[i]["executor_host_us_per_block"] for r in rounds),
            "driver_calls_per_block": rounds[0][i]["driver_calls_per_block"],
            "equal_to_resident": all(r[i]["equal_to_resident"] for r in rounds)} for i, g in enumerate(groups)}}
    if a.block_graphs:
        result.update(block_graph_call_us(a.blocks))
    if a.cuda:
        result.update(driver_call_us())
    from dlo_fn.bench.report import emit, stamp
    from dlo_fn.runtime.platform import platform_for

    emit(stamp(result, "dlo_fn.bench.hostloop", argv, platform_for("cuda", 0) if a.cuda else platform_for("cpu")),
         a.out)
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
