"""Host work per block from the plan: the eager loop's driver calls per compute, and the policy's host-cost model
for load groups; pure.

:func:`planned_driver_calls` counts, for a schedule, the driver calls per compute the eager loop issues
(``runtime.program.fast_segments``: waits, copies, records; the executor's count equals it, tests/test_executor.py
and notebook 11). :func:`steady_schedule` is the rank-local ring's schedule of a pass after the first.

:func:`host_scale` is the policy's model of how the host work per block changes with load groups: of the host
cost per block measured at one load per block (the probe's ``host_s_per_block``), a share ``HOST_FIXED_SHARE`` is
the loop's Python, which every block pays, and the rest scales with the driver calls per block::

    host(G) = host(1) x (f + (1 - f) x calls(G) / calls(1)),     f = HOST_FIXED_SHARE

``f = 0.30`` is fitted on one H200 (``figures/data/hostcost_ab_nvidia-h200.json``, bench-narrow, 24 blocks,
medians of three processes: 45.7 us per block at G = 1 and 24.3 at G = 4, where the calls go 5 -> 1.67 per
block); it predicts 31.3 us at G = 2, measured 29.8 (tests/test_policy.py checks both against the data).
"""

from __future__ import annotations

import functools

from dlo_fn.plan.schedule import C, H2D, Ring, Schedule

__all__ = ["HOST_FIXED_SHARE", "planned_driver_calls", "steady_schedule", "host_scale"]

HOST_FIXED_SHARE = 0.30


def planned_driver_calls(schedule: Schedule) -> dict[str, float]:
    """Driver calls per compute of ``schedule`` by kind, as the eager loop issues them
    (:func:`~dlo_fn.runtime.program.fast_segments`): each op waits on its ``deps`` (and a buffer's first use on
    the previous run's last use), runs (an H2D op one copy; a compute is the block's kernels, no driver call of
    ours) and records its event if something waits on it (``Schedule.recorded``). An H2D of a load group that
    waits for nothing in the run, right after another of its group on the next slot with the next block, is the
    same copy (the executor's slots are one allocation and the arena holds the blocks back to back, so their
    bytes continue: ``runtime.program._merge_group_loads``, which moves its wait on the previous run, if any, to
    the copy it joins: the same number of waits)."""
    computes = sum(1 for op in schedule.ops if op.kind == C) or 1
    lead = schedule.load_group_last
    waits = sum(len(d) for d in schedule.deps) + len(schedule.first_use)
    records = len(schedule.recorded)
    copies, prev = 0, None
    for i, op in enumerate(schedule.ops):
        if op.kind != H2D:
            prev = None
            continue
        merges = (prev is not None and lead[i] is not None and lead[i] == lead[prev] and not schedule.deps[i]
                  and op.slot == schedule.ops[prev].slot + 1 and op.block == schedule.ops[prev].block + 1)
        copies += not merges
        prev = i
    return {"waits": waits / computes, "copies": copies / computes, "records": records / computes,
            "total": (waits + copies + records) / computes}


def steady_schedule(num_blocks: int, num_slots: int = 2, load_group: int = 1) -> Schedule:
    """The rank-local ring's schedule of one pass after the first (what every later pass repeats)."""
    ring = Ring.cold(num_blocks, num_slots=num_slots, mode="rank-local", load_group=load_group)
    first = ring.next_schedule(1)
    return ring.after(first).next_schedule(1)


@functools.lru_cache(maxsize=256)
def host_scale(num_blocks: int, num_slots: int, load_group: int) -> float:
    """Host work per block with load groups of ``load_group`` on ``num_slots`` slots, relative to one load per block
    on as many slots (module docstring); exactly 1 at ``load_group = 1``."""
    if load_group == 1:
        return 1.0
    calls = planned_driver_calls(steady_schedule(num_blocks, num_slots, load_group))["total"]
    one = planned_driver_calls(steady_schedule(num_blocks, num_slots, 1))["total"]
    return HOST_FIXED_SHARE + (1 - HOST_FIXED_SHARE) * calls / one
