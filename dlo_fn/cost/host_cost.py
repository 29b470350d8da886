"""Host work per block from the plan: the stream operations per compute the issue loop makes, and the policy's
host-cost model for load groups; pure.

:func:`planned_stream_ops` counts, for a schedule, the stream operations per compute the executor issues
(``runtime.issue``: waits, copies, records; the executor counts the same in ``ExecutorStats``, tests/test_executor.py,
tests/test_executor_dist.py and notebook 05). :func:`steady_schedule` is the ring's schedule of a pass after the
first.

:func:`host_scale` is the policy's model of how the host work per block changes with load groups: of the host
cost per block measured at one load per block (the probe's ``host_s_per_block``), a share ``HOST_FIXED_SHARE`` is
the loop's Python, which every block pays, and the rest scales with the stream operations per block::

    host(G) = host(1) x (f + (1 - f) x ops(G) / ops(1)),     f = HOST_FIXED_SHARE

``HOST_FIXED_SHARE`` is fitted on G = 4 of one H200 run of the issue loop (``figures/data/bench_step_nvidia-h200.json``,
``bench step``'s dispatch rows, bench-narrow, 24 blocks) and predicts G = 2 of the same run (tests/test_policy.py
checks both; the rows: ``docs/performance.md``, "Host work per block").

The allgather program (``W > 1``: H2D into landing buffers, all-gathers into the slots) is priced the same way
with its own share, each all-gather call counted as ``HOST_COLLECTIVE_CALLS`` stream operations (the collective's
enqueue)::

    host(G) = host(1) x (f + (1 - f) x (ops(G) + k coll(G)) / (ops(1) + k coll(1))),
    f = HOST_FIXED_SHARE_ALLGATHER, k = HOST_COLLECTIVE_CALLS

where ``coll(G)`` is one per block on the per-block shard layout and one per group on the grouped one
(:mod:`dlo_fn.plan.layout`, what ``offload`` builds where ``G`` divides the blocks). These two constants were fitted
on one NCCL rank that kept the W > 1 op sequence, under an issue path the runtime no longer has
(``figures/data/allgather_host_nvidia-h200.json``, G = 1 and G = 4 grouped); the issue
loop's own rows come from ``python -m benchmarks.bench.allgather_host`` on a GPU (two ranks sharing it, and the
NCCL call's host cost), which has not run on one yet.
"""

from __future__ import annotations

import functools

from dlo_fn.plan.layout import layout_load_group
from dlo_fn.plan.lowering import default_num_landing
from dlo_fn.plan.schedule import AG, H2D, C, Ring, Schedule

__all__ = [
    "HOST_FIXED_SHARE",
    "HOST_FIXED_SHARE_ALLGATHER",
    "HOST_COLLECTIVE_CALLS",
    "planned_stream_ops",
    "steady_schedule",
    "host_scale",
]

HOST_FIXED_SHARE = 0.14
HOST_FIXED_SHARE_ALLGATHER = 0.083
HOST_COLLECTIVE_CALLS = 3.75


def planned_stream_ops(schedule: Schedule, grouped_layout: bool = False) -> dict[str, float]:
    """Stream operations per compute of ``schedule`` by kind, as the issue loop makes them
    (:mod:`dlo_fn.runtime.issue`): each op waits on its ``deps`` (and a buffer's first use on
    the previous run's last use), runs (an H2D op one copy; a compute is the block's kernels, no stream operation of
    ours) and records its event if something waits on it (``Schedule.recorded``). An H2D of a load group that
    waits for nothing in the run, right after another of its group on the next slot with the next block, is the
    same copy (the executor's slots are one allocation, and so are its landing buffers, and the arena holds the
    blocks back to back, so their bytes continue: ``runtime.program._merge_group_loads``, which moves its wait on
    the previous run, if any, to the copy it joins: the same number of waits). ``collectives``: the all-gathers
    (one collective call each, a group's in one coalesced launch), not in ``total``;
    ``grouped_layout`` (the shards laid out per load group, :mod:`dlo_fn.plan.layout`): one per group."""
    computes = sum(1 for op in schedule.ops if op.kind == C) or 1
    lead = schedule.load_group_last
    waits = sum(len(d) for d in schedule.deps) + len(schedule.first_use)
    records = len(schedule.recorded)
    copies, prev = 0, None
    for i, op in enumerate(schedule.ops):
        if op.kind != H2D:
            prev = None
            continue
        before = schedule.ops[prev] if prev is not None else None
        merges = (
            before is not None
            and lead[i] is not None
            and lead[i] == lead[prev]
            and not schedule.deps[i]
            and op.block == before.block + 1
            and (op.slot == before.slot + 1 if op.slot is not None else op.landing == before.landing + 1)
        )
        copies += not merges
        prev = i
    gathers = [i for i, op in enumerate(schedule.ops) if op.kind == AG]
    collectives = len({lead[i] for i in gathers}) if grouped_layout and schedule.load_group > 1 else len(gathers)
    return {
        "waits": waits / computes,
        "copies": copies / computes,
        "records": records / computes,
        "total": (waits + copies + records) / computes,
        "collectives": collectives / computes,
    }


def steady_schedule(num_blocks: int, num_slots: int = 2, load_group: int = 1, mode: str = "rank-local") -> Schedule:
    """The ring's schedule of one pass after the first (what every later pass repeats): the rank-local op sequence,
    or (``mode="allgather"``) the allgather one over two ranks on ``2G`` landing buffers (its calls do not depend
    on ``W > 1``)."""
    if mode == "rank-local":
        ring = Ring.cold(num_blocks, num_slots=num_slots, mode=mode, load_group=load_group)
    else:
        ring = Ring.cold(
            num_blocks,
            num_slots=num_slots,
            mode=mode,
            num_shards=2,
            num_landing=default_num_landing(load_group),
            load_group=load_group,
        )
    first = ring.next_schedule(1)
    return ring.after(first).next_schedule(1)


@functools.lru_cache(maxsize=256)
def host_scale(num_blocks: int, num_slots: int, load_group: int, mode: str = "rank-local") -> float:
    """Host work per block with load groups of ``load_group`` on ``num_slots`` slots, relative to one load per block
    on as many slots, on the op sequence ``mode`` (``rank-local``, or ``allgather`` at ``W > 1``, on the shard
    layout ``offload`` builds for it; module docstring); exactly 1 at ``load_group = 1``."""
    if load_group == 1:
        return 1.0
    grouped = mode == "allgather" and layout_load_group(num_blocks, 2, load_group) > 1

    def cost(g: int) -> float:
        calls = planned_stream_ops(steady_schedule(num_blocks, num_slots, g, mode), grouped and g > 1)
        return calls["total"] + HOST_COLLECTIVE_CALLS * calls["collectives"]

    fixed = HOST_FIXED_SHARE if mode == "rank-local" else HOST_FIXED_SHARE_ALLGATHER
    return fixed + (1 - fixed) * cost(load_group) / cost(1)
