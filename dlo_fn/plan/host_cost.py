"""Host work per block from the plan: the eager loop's driver calls per compute, and the policy's host-cost model
for load groups; pure.

:func:`planned_stream_ops` counts, for a schedule, the driver calls per compute the eager loop issues
(``runtime.program.fast_segments``: waits, copies, records; the executor's count equals it, tests/test_executor.py
and notebook 11). :func:`steady_schedule` is the rank-local ring's schedule of a pass after the first.

:func:`host_scale` is the policy's model of how the host work per block changes with load groups: of the host
cost per block measured at one load per block (the probe's ``host_s_per_block``), a share ``HOST_FIXED_SHARE`` is
the loop's Python, which every block pays, and the rest scales with the driver calls per block::

    host(G) = host(1) x (f + (1 - f) x calls(G) / calls(1)),     f = HOST_FIXED_SHARE

``f = 0.30`` is fitted on one H200 (``figures/data/hostcost_ab_nvidia-h200.json``, bench-narrow, 24 blocks,
medians of three processes: 45.7 us per block at G = 1 and 24.3 at G = 4, where the calls go 5 -> 1.67 per
block); it predicts 30.5 us at G = 2, measured 29.8 (tests/test_policy.py checks both against the data). Those runs
prefetched ``S - 1`` loads, splitting a group at each run's end (one copy more per run); a run now prefetches whole
groups (``lowering.prefetch_depth``), 1.625 calls per block at G = 4, which the same share prices at 24.1 us.

The allgather program (``W > 1``: H2D into landing buffers, all-gathers into the slots) is priced the same way
with its own share, and each all-gather call counted as ``HOST_COLLECTIVE_CALLS`` driver calls (the NCCL enqueue:
~11 us a call back to back, ``runtime.nccl_raw``)::

    host(G) = host(1) x (f + (1 - f) x (calls(G) + k coll(G)) / (calls(1) + k coll(1))),
    f = HOST_FIXED_SHARE_ALLGATHER, k = HOST_COLLECTIVE_CALLS

where ``coll(G)`` is one per block on the per-block shard layout and one per group on the grouped one
(:mod:`dlo_fn.plan.layout`, what ``offload`` builds where ``G`` divides the blocks). Both are fitted on the H200's
one NCCL rank with the op sequence kept (``figures/data/allgather_host_nvidia-h200.json``, the own communicator's
rows, means of the two runs: 63.65 us per block at G = 1, 22.95 at G = 4 grouped and 36.95 at G = 4 per-block,
where the calls go 8 -> 2.625 per block and the all-gathers 1 -> 0.25 or 1). It predicts 35.5 us at G = 2
grouped, measured 39.4, and 19.8 at G = 8, measured 23.95 (G = 8 runs on 16 slots: measured no cheaper than G = 4);
the NCCL call's cost over several GPUs is not in it (no multi-GPU machine was lent).
"""

from __future__ import annotations

import functools

from dlo_fn.plan.layout import layout_load_group
from dlo_fn.plan.lowering import default_num_landing
from dlo_fn.plan.schedule import AG, C, H2D, Ring, Schedule

__all__ = ["HOST_FIXED_SHARE", "HOST_FIXED_SHARE_ALLGATHER", "HOST_COLLECTIVE_CALLS", "planned_stream_ops",
           "steady_schedule", "host_scale"]

HOST_FIXED_SHARE = 0.30
HOST_FIXED_SHARE_ALLGATHER = 0.083
HOST_COLLECTIVE_CALLS = 3.75


def planned_stream_ops(schedule: Schedule, grouped_layout: bool = False) -> dict[str, float]:
    """Driver calls per compute of ``schedule`` by kind, as the eager loop issues them
    (:func:`~dlo_fn.runtime.program.fast_segments`): each op waits on its ``deps`` (and a buffer's first use on
    the previous run's last use), runs (an H2D op one copy; a compute is the block's kernels, no driver call of
    ours) and records its event if something waits on it (``Schedule.recorded``). An H2D of a load group that
    waits for nothing in the run, right after another of its group on the next slot with the next block, is the
    same copy (the executor's slots are one allocation, and so are its landing buffers, and the arena holds the
    blocks back to back, so their bytes continue: ``runtime.program._merge_group_loads``, which moves its wait on
    the previous run, if any, to the copy it joins: the same number of waits). ``collectives``: the all-gathers
    (one ``ncclAllGather`` each on the executor's own communicator, a group's in one launch), not in ``total``;
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
        merges = (before is not None and lead[i] is not None and lead[i] == lead[prev] and not schedule.deps[i]
                  and op.block == before.block + 1
                  and (op.slot == before.slot + 1 if op.slot is not None else op.landing == before.landing + 1))
        copies += not merges
        prev = i
    gathers = [i for i, op in enumerate(schedule.ops) if op.kind == AG]
    collectives = len({lead[i] for i in gathers}) if grouped_layout and schedule.load_group > 1 else len(gathers)
    return {"waits": waits / computes, "copies": copies / computes, "records": records / computes,
            "total": (waits + copies + records) / computes, "collectives": collectives / computes}


def steady_schedule(num_blocks: int, num_slots: int = 2, load_group: int = 1, mode: str = "rank-local") -> Schedule:
    """The ring's schedule of one pass after the first (what every later pass repeats): the rank-local op sequence,
    or (``mode="allgather"``) the allgather one over two ranks on ``2G`` landing buffers (its calls do not depend
    on ``W > 1``)."""
    if mode == "rank-local":
        ring = Ring.cold(num_blocks, num_slots=num_slots, mode=mode, load_group=load_group)
    else:
        ring = Ring.cold(num_blocks, num_slots=num_slots, mode=mode, num_shards=2,
                         num_landing=default_num_landing(load_group), load_group=load_group)
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
