"""Time to ready, on real gloo ranks: offload's phases (``Offloaded.timings``, the warm-up all-gather among them),
each rank's share of the fill threads, outputs equal to resident."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import scenario

from dlo_fn.runtime.cuda.host_fill import ParallelFill, fill_threads
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.platform import platform_for

PHASES = ("describe_s", "digest_s", "store_s", "warm_up_s", "executor_s", "to_device_s", "release_s")


def _offloaded(ctx: DistContext, ckpt: str):
    from test_executor_dist import load_reference

    from dlo_fn.models import BLOCK_PATHS
    from dlo_fn.runtime.offload import offload

    # the start-up fill plug-in (on CPU too): each rank takes its share of the cores
    return offload(load_reference(ckpt), BLOCK_PATHS, ctx, mode="allgather", host_fill="parallel")


@torch.no_grad()
def _rank(ctx: DistContext, ckpt: str) -> dict:
    from test_executor_dist import load_reference

    from dlo_fn.models import Request, generate

    torch.set_num_threads(1)
    request = Request("a fox", seed=ctx.rank, height=32, width=32, num_frames=5, num_inference_steps=2)
    want = generate(load_reference(ckpt), request).sha256
    o = _offloaded(ctx, ckpt)
    got = generate(o.model, request).sha256
    return {
        "equal": got == want,
        "timings": o.timings,
        "threads": o.store.timings["threads"],
        "arena_bytes": o.store.arena_bytes,
        "warm_up_s": o.executor.warm_up_s,
        "local_ranks": os.environ.get("LOCAL_WORLD_SIZE"),
    }


def _check_timings(t: dict) -> None:
    assert set(t) == {*PHASES, "total_s"} and all(t[k] >= 0 for k in PHASES), t
    assert sum(t[k] for k in PHASES) == pytest.approx(t["total_s"], abs=1e-6)


def test_two_ranks_phases_and_exact(request):
    for r in scenario(request, 2, "offload_ready"):  # the shared spawn of 2 ranks (conftest.SCENARIOS)
        assert r["equal"]
        _check_timings(r["timings"])
        assert r["timings"]["warm_up_s"] == r["warm_up_s"] > 0
        assert r["threads"] == fill_threads(r["arena_bytes"], 2) and r["local_ranks"] is None


def test_one_rank_has_no_warm_up(tiny_checkpoint):
    o = _offloaded(DistContext(0, 1, 0, platform_for("cpu"), None), tiny_checkpoint)
    _check_timings(o.timings)
    assert o.timings["warm_up_s"] == 0.0 and o.executor.warm_up_s == 0.0


def test_fill_threads_share_the_cores():
    cpus = len(os.sched_getaffinity(0))
    assert fill_threads(1 << 20, 4) == 1  # small arenas: one thread
    assert fill_threads(1 << 30) == min(16, cpus)
    assert fill_threads(1 << 30, 2) == max(1, min(16, cpus // 2)) and fill_threads(1 << 30, 10 * cpus) == 1
    with pytest.raises(ValueError, match="local_ranks must be >= 1"):
        fill_threads(1 << 30, 0)
    with pytest.raises(ValueError, match="local_ranks must be >= 1"):
        ParallelFill(local_ranks=0)
