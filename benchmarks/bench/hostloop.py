"""The executor's own Python cost per block, on a CPU: the issue loop with host streams and events.

``python -m benchmarks.bench.hostloop`` offloads a small model on the CPU and times, per block, the executor's host time
outside the block call (``ExecutorStats``, the same counter ``bench step`` reports as ``proxy_host_us_per_block``)
and counts the stream operations it issued (waits, copies, records). On the CPU the streams and events are the
host's (:class:`~dlo_fn.runtime.platform.HostStream`): what is measured is the loop's Python and the copies; on a
GPU each stream operation adds the driver's cost (the H200 rows of ``bench step``). The blocks are called through
``swap`` with a trivial module so that the block call itself is cheap. ``--block-graphs`` times the block-graph
plug-in's wrapper per replayed call, the replay a no-op.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
from torch import nn

__all__ = ["measure", "block_graph_call_us"]


class _Tiny(nn.Module):
    def __init__(self, width: int, num_tensors: int) -> None:
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(width)) for _ in range(num_tensors))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w[0]


def measure(num_blocks: int = 24, num_tensors: int = 15, passes: int = 200, load_group: int = 1) -> dict:
    """Median over passes of the executor's host time per block (us) and stream operations per block (one
    implicit run per pass; ``load_group`` G on 2G slots)."""
    from dlo_fn.runtime.dist import DistContext
    from dlo_fn.runtime.offload import offload
    from dlo_fn.runtime.platform import platform_for

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
    ctx = DistContext(0, 1, 0, platform_for("cpu"), None)
    off = offload(copy.deepcopy(ref), "blocks", ctx, mode="rank-local", num_slots=2 * load_group, load_group=load_group)
    ex = off.executor
    per_block, ops = [], []
    with torch.no_grad():
        for _ in range(passes):
            ex.stats.reset()
            got = off.model(x)
            per_block.append(ex.stats.issue_us_per_compute)
            ops.append(ex.stats.stream_ops / num_blocks)
    if not torch.equal(got, want):
        raise RuntimeError("the offloaded pass differs from resident")
    return {
        "executor_host_us_per_block": statistics.median(per_block[passes // 4 :]),
        "stream_ops_per_block": statistics.median(ops),
        "num_blocks": num_blocks,
        "load_group": load_group,
        "tensors_per_block": num_tensors,
        "passes": passes,
        "equal_to_resident": True,
    }


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
    :class:`~dlo_fn.runtime.cuda.block_graph.BlockGraphs` (a diffusers-like call: the hidden states and a context from
    the previous block, a shared embedding, a rotary tuple and a constant), the replay itself a no-op."""
    from dlo_fn.runtime.cuda.block_graph import BlockGraphs

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
    return {
        "block_graph_call_us": statistics.median(rounds),
        "block_graph_replays": bg.replays,
        "block_graph_captures": bg.captures,
    }


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
    p.add_argument(
        "--block-graphs",
        action="store_true",
        help="also time the block-graph wrapper's host work per replayed block call (replay a no-op)",
    )
    p.add_argument(
        "--load-groups",
        type=_groups,
        default=(1,),
        metavar="G,...",
        help="load groups of G on 2G slots; several: measured in turn, 3 rounds, medians per G",
    )
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    groups = a.load_groups
    if len(groups) == 1:
        result = measure(a.blocks, passes=a.passes, load_group=groups[0])
    else:
        rounds = [[measure(a.blocks, passes=a.passes, load_group=g) for g in groups] for _ in range(3)]
        result = {
            "num_blocks": a.blocks,
            "passes": a.passes,
            "by_load_group": {
                str(g): {
                    "executor_host_us_per_block": statistics.median(r[i]["executor_host_us_per_block"] for r in rounds),
                    "stream_ops_per_block": rounds[0][i]["stream_ops_per_block"],
                    "equal_to_resident": all(r[i]["equal_to_resident"] for r in rounds),
                }
                for i, g in enumerate(groups)
            },
        }
    if a.block_graphs:
        result.update(block_graph_call_us(a.blocks))
    from benchmarks.bench.report import emit, stamp
    from dlo_fn.runtime.platform import platform_for

    emit(stamp(result, "benchmarks.bench.hostloop", argv, platform_for("cpu")), a.out)
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
