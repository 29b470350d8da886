"""Slot schedule: golden schedules (string lists), op-string round trip, and properties over generated cases.

The property tests check every schedule two ways: with :func:`check_schedule` (vector clocks over the
dependencies) and with an independent replay in time: simulate it with random positive durations and check,
from the spans alone, that no buffer is written while an op still reads it and that every read sees its load.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import build_case, grouped_cases, schedule_cases

from dlo_fn.plan.schedule import (
    AG,
    H2D,
    C,
    Op,
    Ring,
    Schedule,
    add_dependencies,
    build_schedule,
    compute_order,
    lowered_mode,
    next_landing_offset,
    next_schedule,
    next_slot_offset,
)
from dlo_fn.plan.schedule_check import ScheduleError, check_schedule
from dlo_fn.plan.timeline import simulate


def _lines(schedule: Schedule) -> list[str]:
    return [str(op) + (" <- " + ",".join(map(str, d)) if d else "") for op, d in zip(schedule.ops, schedule.deps)]


def _assert_golden(schedule: Schedule, golden: list[str]) -> None:
    got = _lines(schedule) if any("<-" in g for g in golden) else list(schedule.to_strs())
    for i, (g, w) in enumerate(zip(got, golden)):
        assert g == w, f"op {i}: got {g!r}, expected {w!r}\nwhole schedule:\n{schedule.describe()}"
    assert len(got) == len(golden), f"{len(got)} ops, expected {len(golden)}\nwhole schedule:\n{schedule.describe()}"
    check_schedule(schedule)


def test_golden_allgather_two_slots_with_waits():
    # Two blocks, two steps: the ring wraps from block 1 of step 0 to block 0 of step 1 (load k2) with no stall.
    _assert_golden(
        build_schedule(2, 2),
        [
            "H2D k0 b0>l0",
            "AG k0 b0 l0>s0 <- 0",
            "H2D k1 b1>l1",
            "AG k1 b1 l1>s1 <- 2",
            "C k0 b0@s0 r0 <- 1",
            "H2D k2 b0>l0 <- 1",  # landing l0 is free once AG k0 has read it
            "AG k2 b0 l0>s0 <- 4,5",  # slot s0 is free once C k0 is done
            "C k1 b1@s1 r0 <- 3",
            "H2D k3 b1>l1 <- 3",
            "AG k3 b1 l1>s1 <- 7,8",
            "C k2 b0@s0 r0 <- 6",
            "C k3 b1@s1 r0 <- 9",
        ],
    )


def test_golden_rank_local():
    # No landing buffers: each H2D writes the whole block straight into its slot, once the slot is free.
    _assert_golden(
        build_schedule(3, 1, mode="rank-local"),
        [
            "H2D k0 b0>s0",
            "H2D k1 b1>s1",
            "C k0 b0@s0 r0 <- 0",
            "H2D k2 b2>s0 <- 2",
            "C k1 b1@s1 r0 <- 1",
            "C k2 b2@s0 r0 <- 3",
        ],
    )


def test_golden_allgather_over_one_rank_is_the_rank_local_program():
    # W = 1: the all-gather is the identity and the only shard is the whole padded block, so the lowering gives
    # the rank-local ops (H2D straight into the slot, no landing buffer, no AG), waits included.
    assert lowered_mode("allgather", 1) == "rank-local" and lowered_mode("allgather", 2) == "allgather"
    assert lowered_mode("allgather", None) == "allgather" and lowered_mode("rank-local", 1) == "rank-local"
    one = build_schedule(3, 1, mode="allgather", num_landing=2, num_shards=1)
    # The same ops, waits and slots as test_golden_rank_local's list, op for op.
    assert one.mode == "rank-local" and one.num_landing == 0 and one == build_schedule(3, 1, mode="rank-local")
    ring = Ring.cold(3, mode="allgather", num_landing=2, num_shards=1)
    assert ring == Ring.cold(3, mode="rank-local") and ring.num_landing == 0
    assert [op.kind for op in ring.next_schedule(2).ops].count("AG") == 0
    two = build_schedule(3, 1, num_shards=2)  # W > 1 keeps the landing buffers and the all-gathers
    assert two == build_schedule(3, 1) and two.to_strs()[:2] == ("H2D k0 b0>l0", "AG k0 b0 l0>s0")
    with pytest.raises(ValueError, match="num_shards must be an int >= 1"):
        build_schedule(3, 1, num_shards=0)


def test_golden_three_slots():
    _assert_golden(
        build_schedule(3, 1, num_slots=3),
        [
            "H2D k0 b0>l0",
            "AG k0 b0 l0>s0",
            "H2D k1 b1>l1",
            "AG k1 b1 l1>s1",
            "H2D k2 b2>l0",
            "AG k2 b2 l0>s2",
            "C k0 b0@s0 r0",
            "C k1 b1@s1 r0",
            "C k2 b2@s2 r0",
        ],
    )


def test_golden_two_requests_per_load():
    # Block-major: each loaded block serves r0 then r1; the slot is refilled after the last of them (r1).
    _assert_golden(
        build_schedule(3, 1, requests_per_load=2),
        [
            "H2D k0 b0>l0",
            "AG k0 b0 l0>s0 <- 0",
            "H2D k1 b1>l1",
            "AG k1 b1 l1>s1 <- 2",
            "C k0 b0@s0 r0 <- 1",
            "C k0 b0@s0 r1",  # no wait of its own: r0 waited for the load, and one stream runs in order
            "H2D k2 b2>l0 <- 1",
            "AG k2 b2 l0>s0 <- 5,6",
            "C k1 b1@s1 r0 <- 3",
            "C k1 b1@s1 r1",
            "C k2 b2@s0 r0 <- 7",
            "C k2 b2@s0 r1",
        ],
    )


def test_golden_prefetch_next_then_warm_start():
    # Run A ends by loading block 0 of the next run (k2) into the slot its last compute does not use; run B
    # starts warm from it on the continued ring (slot offset 0, landing offset 0) and never reloads block 0.
    a = build_schedule(2, 1, prefetch_next=True)
    _assert_golden(
        a,
        [
            "H2D k0 b0>l0",
            "AG k0 b0 l0>s0",
            "H2D k1 b1>l1",
            "AG k1 b1 l1>s1",
            "C k0 b0@s0 r0",
            "H2D k2 b0>l0",
            "AG k2 b0 l0>s0",
            "C k1 b1@s1 r0",
        ],
    )
    assert (next_slot_offset(a), next_landing_offset(a)) == (0, 0)
    b = next_schedule(a, 1, prefetch_next=False)
    _assert_golden(b, ["H2D k1 b1>l1", "AG k1 b1 l1>s1", "C k0 b0@s0 r0", "C k1 b1@s1 r0"])
    # Cross-run waits: B's first use of each buffer waits for A's last use of it.
    assert a.last_use == (("l0", 6), ("l1", 3), ("s0", 6), ("s1", 7))
    assert b.first_use == (("l1", 0), ("s0", 2), ("s1", 1))
    check_schedule(b, prev=a)


def test_golden_chain_with_odd_length_continues_the_ring():
    a = build_schedule(3, 1, prefetch_next=True)  # loads k0..k2, prefetch k3 -> slot (0 + 3) % 2 = 1
    b = next_schedule(a, 1)
    assert (b.slot_offset, b.landing_offset, b.warm_start) == (1, 1, True)
    _assert_golden(
        b,
        [
            "H2D k1 b1>l0",
            "AG k1 b1 l0>s0",
            "C k0 b0@s1 r0",
            "H2D k2 b2>l1",
            "AG k2 b2 l1>s1",
            "C k1 b1@s0 r0",
            "H2D k3 b0>l0",
            "AG k3 b0 l0>s0",
            "C k2 b2@s1 r0",
        ],
    )
    check_schedule(b, prev=a)


def test_golden_ring_carries_offsets_and_prefetch_across_runs():
    # The Ring is what one run leaves to the next: 3 blocks on 2 slots and 2 landing buffers.
    ring = Ring.cold(3)
    assert ring == Ring(3, 2, 2, "allgather", slot_offset=0, landing_offset=0, warm=False)
    a = ring.next_schedule(1)  # prefetches by default: the ring never stops
    _assert_golden(
        a,
        [
            "H2D k0 b0>l0",
            "AG k0 b0 l0>s0",
            "H2D k1 b1>l1",
            "AG k1 b1 l1>s1",
            "C k0 b0@s0 r0",
            "H2D k2 b2>l0",
            "AG k2 b2 l0>s0",
            "C k1 b1@s1 r0",
            "H2D k3 b0>l1",
            "AG k3 b0 l1>s1",
            "C k2 b2@s0 r0",
        ],
    )
    assert a == build_schedule(3, 1, prefetch_next=True)
    ring = ring.after(a)  # 3 loads later: slot 1, landing 1, block 0 already in s1
    assert ring == Ring(3, 2, 2, "allgather", slot_offset=1, landing_offset=1, warm=True)
    b = ring.next_schedule(1, prefetch_next=False)
    _assert_golden(
        b,
        [
            "H2D k1 b1>l0",
            "AG k1 b1 l0>s0",
            "C k0 b0@s1 r0",
            "H2D k2 b2>l1",
            "AG k2 b2 l1>s1",
            "C k1 b1@s0 r0",
            "C k2 b2@s1 r0",
        ],
    )
    check_schedule(b, prev=a)
    assert b == next_schedule(a, 1, prefetch_next=False) and Ring.of(b) == ring
    assert ring.after(b) == Ring(3, 2, 2, "allgather", slot_offset=0, landing_offset=0, warm=False)
    assert ring.after(b).next_schedule(1, prefetch_next=False) == build_schedule(3, 1)  # cold again: offset 0
    assert ring.restart() == Ring.cold(3)


def test_golden_ring_rank_local_has_no_landing_buffers():
    ring = Ring.cold(3, mode="rank-local", num_slots=2)
    assert ring.num_landing == 0
    a = ring.next_schedule(1)
    _assert_golden(
        a,
        [
            "H2D k0 b0>s0",
            "H2D k1 b1>s1",
            "C k0 b0@s0 r0",
            "H2D k2 b2>s0",
            "C k1 b1@s1 r0",
            "H2D k3 b0>s1",
            "C k2 b2@s0 r0",
        ],
    )
    assert ring.after(a) == Ring(3, 2, 0, "rank-local", slot_offset=1, landing_offset=0, warm=True)
    _assert_golden(
        ring.after(a).next_schedule(1, prefetch_next=False),
        ["H2D k1 b1>s0", "C k0 b0@s1 r0", "H2D k2 b2>s1", "C k1 b1@s0 r0", "C k2 b2@s1 r0"],
    )


def test_ring_refuses_a_schedule_it_does_not_continue():
    ring = Ring.cold(3).after(build_schedule(3, 1, prefetch_next=True))
    with pytest.raises(ScheduleError, match=r"slot_offset = 0 \(the ring has 1\).*warm_start = False"):
        ring.check(build_schedule(3, 1))
    with pytest.raises(ScheduleError, match=r"num_slots = 3 \(the ring has 2\)"):
        ring.after(build_schedule(3, 1, num_slots=3, slot_offset=1, landing_offset=1, warm_start=True))
    assert issubclass(ScheduleError, ValueError) and issubclass(ScheduleError, RuntimeError)
    with pytest.raises(ValueError, match="num_slots"):
        Ring.cold(3, num_slots=0)
    with pytest.raises(ValueError, match="mode"):
        Ring.cold(3, mode="ring")
    with pytest.raises(ValueError, match="num_landing"):
        Ring.cold(3, mode="rank-local", num_landing=2)


def test_compute_order_wraps_steps_block_major():
    order = compute_order(2, 2, requests_per_load=2)
    assert [(i.load, i.block, i.step, i.request) for i in order] == [
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (1, 1, 0, 0),
        (1, 1, 0, 1),
        (2, 0, 1, 0),
        (2, 0, 1, 1),
        (3, 1, 1, 0),
        (3, 1, 1, 1),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "H2D k0 b0>l0",
        "H2D k12 b3>s1",
        "AG k5 b3 l1>s1",
        "C k5 b3@s1 r0",
        "C k100 b99@s3 r2",
    ],
)
def test_op_string_round_trip(text):
    op = Op.from_str(text)
    assert str(op) == text and Op.from_str(str(op)) == op


@pytest.mark.parametrize(
    "text",
    [
        "",
        "H2D k0 b0",
        "H2D k0 b0>x1",
        "AG k0 b0 >s1",
        "C k0 b0@s1",
        "C k0 b0@s1 r0 ",
        "C k-1 b0@s1 r0",
        "X k0 b0@s1 r0",
        "H2D  k0 b0>l0",
        "C k05 b0@s1 r0",
        "AG k1 b1 l+1>s0",
        "C k1 b1@s\u0661 r0",
    ],
)
def test_op_from_str_rejects_malformed(text):
    with pytest.raises(ValueError, match="grammar"):
        Op.from_str(text)


def test_op_rejects_inconsistent_fields():
    with pytest.raises(ValueError, match="grammar"):
        Op(C, 0, 0, slot=0)  # compute without request
    with pytest.raises(ValueError, match="grammar"):
        Op(H2D, 0, 0, slot=0, landing=1)  # H2D to both
    with pytest.raises(ValueError, match="non-negative"):
        Op(AG, -1, 0, slot=0, landing=0)


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="num_slots"):
        build_schedule(4, 1, num_slots=0)
    with pytest.raises(ValueError, match="num_landing"):
        build_schedule(4, 1, mode="rank-local", num_landing=2)
    with pytest.raises(ValueError, match="num_landing"):
        build_schedule(4, 1, num_landing=0)
    with pytest.raises(ValueError, match="mode"):
        build_schedule(4, 1, mode="ring")
    with pytest.raises(ValueError, match="slot_offset"):
        build_schedule(4, 1, slot_offset=2)
    with pytest.raises(ValueError, match="num_steps"):
        build_schedule(4, 0)


# --- the checker must catch broken schedules -------------------------------------------------------------------


def _with_deps(s: Schedule, i: int, deps: tuple[int, ...]) -> Schedule:
    return dataclasses.replace(s, deps=s.deps[:i] + (deps,) + s.deps[i + 1 :])


def test_checker_catches_refill_before_compute_done():
    s = build_schedule(2, 2)
    i = s.to_strs().index("AG k2 b0 l0>s0")
    with pytest.raises(ScheduleError, match="overwrite s0 while op 4"):
        check_schedule(_with_deps(s, i, (5,)))


def test_checker_catches_landing_reuse_before_gather():
    s = build_schedule(2, 2)
    i = s.to_strs().index("H2D k2 b0>l0")
    with pytest.raises(ScheduleError, match="overwrite l0 while op 1"):
        check_schedule(_with_deps(s, i, ()))


def test_checker_catches_compute_before_load():
    s = build_schedule(2, 2, requests_per_load=2)
    i = s.to_strs().index("C k0 b0@s0 r0")
    with pytest.raises(ScheduleError, match="before op 1 has written"):
        check_schedule(_with_deps(s, i, ()))


def test_checker_catches_wrong_slot_and_late_prefetch_and_bad_waits():
    s = build_schedule(3, 1)
    ops = list(s.ops)
    ops[s.to_strs().index("C k1 b1@s1 r0")] = Op(C, 1, 1, slot=0, request=0)
    with pytest.raises(ScheduleError, match="compute-only order"):
        check_schedule(dataclasses.replace(s, ops=tuple(ops)))
    # Issue the loads of k2 after compute k1: prefetch depth lost.
    ops = list(s.ops)
    j = s.to_strs().index("H2D k2 b2>l0")
    moved = ops[j : j + 2]
    del ops[j : j + 2]
    ops[len(ops) - 1 : len(ops) - 1] = moved
    late = dataclasses.replace(s, ops=tuple(ops), deps=add_dependencies(tuple(ops)))
    with pytest.raises(ScheduleError, match="prefetch depth"):
        check_schedule(late)
    with pytest.raises(ScheduleError, match="earlier ops"):
        check_schedule(_with_deps(s, 1, (1,)))
    with pytest.raises(ScheduleError, match="first_use"):
        check_schedule(dataclasses.replace(s, first_use=s.first_use[1:]))


def test_checker_catches_broken_chain():
    a = build_schedule(3, 1, prefetch_next=True)
    with pytest.raises(ScheduleError, match="slot_offset"):
        check_schedule(build_schedule(3, 1, warm_start=True), prev=a)
    with pytest.raises(ScheduleError, match="warm_start"):
        check_schedule(build_schedule(3, 1, slot_offset=1, landing_offset=1), prev=a)
    with pytest.raises(ScheduleError, match="num_slots"):
        check_schedule(build_schedule(3, 1, num_slots=3, warm_start=True, slot_offset=1, landing_offset=1), prev=a)


# --- properties ----------------------------------------------------------------------------------------------

cases = schedule_cases


_build = build_case


def _replay_in_time(s: Schedule, seed: int) -> None:
    """Independent oracle: random positive durations, then check buffer contents from the spans alone."""
    rng = random.Random(seed)
    cost = {}
    tl = simulate(s, lambda op: cost.setdefault(str(op), float(rng.randint(1, 9))))
    spans = tl.spans
    writes: dict[str, list[tuple[float, float, int]]] = {}
    for op, span in zip(s.ops, spans):
        for buf in op.writes:
            writes.setdefault(buf, []).append((span.start_s, span.end_s, op.load))
    initial = {f"s{(s.slot_offset + j) % s.num_slots}": j for j in range(s.num_slots - 1)} if s.warm_start else {}
    for buf, ws in writes.items():
        ws.sort()
        for (a0, b0, _), (a1, _, _) in zip(ws, ws[1:]):
            assert b0 <= a1, f"two writes of {buf} overlap in time\n{s.describe()}"
    for op, span in zip(s.ops, spans):
        for buf in op.reads:
            for a, b, load in writes.get(buf, []):
                assert b <= span.start_s or a >= span.end_s, f"{op} reads {buf} while it is written\n{s.describe()}"
            done = [(b, load) for a, b, load in writes.get(buf, []) if b <= span.start_s]
            seen = max(done)[1] if done else initial.get(buf)
            assert seen == op.load, f"{op} reads {buf} holding load {seen}\n{s.describe()}"


@settings(max_examples=150, deadline=None)
@given(cases, st.integers(0, 2**31))
def test_every_generated_schedule_is_valid_and_hazard_free(case, seed):
    s = _build(case)
    check_schedule(s)
    _replay_in_time(s, seed)
    # Topological issue order; every compute preceded by the load of its block into its slot.
    loaded: dict[int, int] = {}
    for i, (op, deps) in enumerate(zip(s.ops, s.deps)):
        assert all(d < i for d in deps)
        if op.kind != C and (op.kind == AG or s.mode == "rank-local"):
            loaded[op.load] = op.slot
        if op.kind == C and not (s.warm_start and op.load < s.num_slots - 1):
            assert loaded.get(op.load) == op.slot, s.describe()
    # Round trip of every op string.
    assert all(Op.from_str(text) == op for text, op in zip(s.to_strs(), s.ops))


@settings(max_examples=90, deadline=None)
@given(st.one_of(cases, grouped_cases), st.data())  # with load groups too: each group's shared waits are needed
def test_every_wait_is_needed(case, data):
    s = _build(case)
    waits = [(i, d) for i, deps in enumerate(s.deps) for d in deps]
    if not waits:
        return
    i, d = data.draw(st.sampled_from(waits))
    with pytest.raises(ScheduleError):
        check_schedule(_with_deps(s, i, tuple(x for x in s.deps[i] if x != d)))


@settings(max_examples=60, deadline=None)
@given(cases, st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(0, 2**31))
def test_chained_runs_stay_valid(case, steps, seed):
    prev = _build(dict(case, prefetch_next=True))
    for num_steps in steps:
        nxt = next_schedule(prev, num_steps, prefetch_next=True)
        check_schedule(nxt, prev=prev)
        _replay_in_time(nxt, seed)
        prev = nxt


@settings(max_examples=60, deadline=None)
@given(cases, st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3), st.booleans()), min_size=1, max_size=4))
def test_a_ring_chains_any_runs_like_next_schedule(case, runs):
    first = _build(case)
    ring = Ring.of(first).after(first)
    prev = first
    for num_steps, requests, prefetch in runs:
        nxt = ring.next_schedule(num_steps, requests, prefetch_next=prefetch)
        assert nxt == next_schedule(prev, num_steps, requests_per_load=requests, prefetch_next=prefetch)
        check_schedule(nxt, prev=prev)
        ring, prev = ring.after(nxt), nxt


# --- load groups (dlo_fn.plan.lowering, "Load groups") ----------------------------------------------------------


def test_golden_load_groups_of_two_on_four_slots():
    # Each group of two loads is issued as one, when its last load's slot is free; its first H2D waits on the
    # last compute of the slots' previous occupants, the second waits on nothing; the first compute of a group waits
    # on the group's last H2D, the second on nothing.
    s = build_schedule(6, 1, num_slots=4, mode="rank-local", load_group=2)
    _assert_golden(
        s,
        [
            "H2D k0 b0>s0",
            "H2D k1 b1>s1",
            "H2D k2 b2>s2",
            "H2D k3 b3>s3",
            "C k0 b0@s0 r0 <- 1",
            "C k1 b1@s1 r0",
            "H2D k4 b4>s0 <- 5",
            "H2D k5 b5>s1",
            "C k2 b2@s2 r0 <- 3",
            "C k3 b3@s3 r0",
            "C k4 b4@s0 r0 <- 7",
            "C k5 b5@s1 r0",
        ],
    )
    assert s.load_group == 2 and Ring.of(s).load_group == 2


def test_golden_allgather_load_groups_of_two_on_four_slots_and_two_landing_buffers():
    # A group's H2Ds, then its AGs (one collective in the executor): the first H2D waits on the last AG that read
    # the group's landing buffers, the first AG on the group's last H2D and on the slots' previous occupants, the
    # others on nothing; a group's first compute waits on its last AG. Only the last of each kind records.
    s = build_schedule(6, 1, num_slots=4, mode="allgather", num_landing=2, load_group=2)
    _assert_golden(
        s,
        [
            "H2D k0 b0>l0",
            "H2D k1 b1>l1",
            "AG k0 b0 l0>s0 <- 1",
            "AG k1 b1 l1>s1",
            "H2D k2 b2>l0 <- 3",
            "H2D k3 b3>l1",
            "AG k2 b2 l0>s2 <- 5",
            "AG k3 b3 l1>s3",
            "C k0 b0@s0 r0 <- 3",
            "C k1 b1@s1 r0",
            "H2D k4 b4>l0 <- 7",
            "H2D k5 b5>l1",
            "AG k4 b4 l0>s0 <- 9,11",
            "AG k5 b5 l1>s1",
            "C k2 b2@s2 r0 <- 7",
            "C k3 b3@s3 r0",
            "C k4 b4@s0 r0 <- 13",
            "C k5 b5@s1 r0",
        ],
    )
    waited = {d for deps in s.deps for d in deps}
    assert waited == {1, 3, 5, 7, 9, 11, 13}


def test_load_group_one_is_the_published_schedule():
    for kw in (dict(num_slots=2), dict(num_slots=4, requests_per_load=2, prefetch_next=True)):
        a = build_schedule(7, 2, mode="rank-local", **kw)
        b = build_schedule(7, 2, mode="rank-local", load_group=1, **kw)
        assert a == b and a.ops == b.ops and a.deps == b.deps


def test_load_group_arguments_are_named():
    with pytest.raises(
        ValueError,
        match="load_group = 2 in allgather mode needs num_landing a multiple of it.*got "
        "num_landing = 3: pass num_landing = 4",
    ):
        build_schedule(4, 1, num_slots=4, mode="allgather", num_landing=3, load_group=2)
    assert build_schedule(4, 1, num_slots=4, mode="allgather", load_group=2).num_landing == 4  # default 2G
    with pytest.raises(ValueError, match="num_slots a multiple of it and >= 4.*pass num_slots = 4"):
        build_schedule(4, 1, num_slots=2, mode="rank-local", load_group=2)
    with pytest.raises(ValueError, match="multiple"):
        build_schedule(4, 1, num_slots=5, mode="rank-local", load_group=2)
    with pytest.raises(ValueError, match="load_group must be an int >= 1"):
        build_schedule(4, 1, num_slots=4, mode="rank-local", load_group=0)
    # allgather over one rank is the rank-local sequence, so it takes load groups
    s = build_schedule(4, 1, num_slots=4, mode="allgather", num_shards=1, load_group=2)
    assert s.mode == "rank-local" and s.load_group == 2
    a = build_schedule(4, 1, num_slots=4, mode="rank-local", load_group=2, prefetch_next=True)
    other = Ring.of(a).after(a)
    assert other.load_group == 2 and other.restart().load_group == 2
    with pytest.raises(ScheduleError, match=r"load_group = 2 \(the ring has 1\)"):
        dataclasses.replace(other, load_group=1).check(next_schedule(a, 1))


def _group_structure(s: Schedule) -> None:
    """Per group: its H2Ds back to back (allgather: then its AGs, back to back), waits only on the first of each
    kind; a compute waits, if at all, on its group's last load op (rank-local: H2D, allgather: AG), and only the
    first compute of each group that this run loads waits."""
    g, o = s.load_group, s.slot_offset
    groups: dict[tuple[str, int], list[int]] = {}
    for i, op in enumerate(s.ops):
        if op.kind != C:
            groups.setdefault((op.kind, (o + op.load) // g), []).append(i)
    for (kind, n), idx in groups.items():
        assert idx == list(range(idx[0], idx[0] + len(idx))), s.describe()
        assert all(not s.deps[i] for i in idx[1:]), s.describe()
        if kind == AG:  # right after the group's H2Ds
            assert groups[H2D, n][-1] + 1 == idx[0], s.describe()
    last = AG if s.mode == "allgather" else H2D
    last_of = {s.ops[i].load: idx[-1] for (kind, _), idx in groups.items() if kind == last for i in idx}
    groups = {key: idx for key, idx in groups.items() if key[0] == last}
    for i, op in enumerate(s.ops):
        if op.kind == C and s.deps[i]:
            assert s.deps[i] == (last_of[op.load],), s.describe()
    waiting = sum(1 for i, op in enumerate(s.ops) if op.kind == C and s.deps[i])
    assert waiting <= len(groups), s.describe()


@settings(max_examples=150, deadline=None)
@given(grouped_cases, st.integers(0, 2**31))
def test_every_grouped_schedule_is_valid_hazard_free_and_grouped(case, seed):
    s = _build(case)
    check_schedule(s)
    _replay_in_time(s, seed)
    _group_structure(s)


@settings(max_examples=60, deadline=None)
@given(
    grouped_cases,
    st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3), st.booleans()), min_size=1, max_size=4),
    st.integers(0, 2**31),
)
def test_grouped_runs_chain_on_the_ring(case, runs, seed):
    prev = _build(dict(case, prefetch_next=True))
    ring = Ring.of(prev).after(prev)
    for num_steps, requests, prefetch in runs:
        nxt = ring.next_schedule(num_steps, requests, prefetch_next=prefetch)
        check_schedule(nxt, prev=prev)
        _replay_in_time(nxt, seed)
        _group_structure(nxt)
        ring, prev = ring.after(nxt), nxt


def test_load_groups_keep_the_steady_load_period():
    # H2D-bound blocks (h = 3 > c = 1), the plan's own timeline on the schedule's waits: a group of G loads starts
    # computing G H2Ds in (not 1), the load period per block is unchanged, and the run ends G - 1 computes later
    # (the last group's computes all wait for its last H2D).
    def timeline(g: int, steps: int):
        s = build_schedule(8, steps, num_slots=2 * g, mode="rank-local", load_group=g)
        return simulate(s, lambda op: 3.0 if op.kind == H2D else 1.0)

    def first_compute_s(g: int) -> float:
        return min(sp.start_s for sp in timeline(g, 1).spans if sp.op.startswith("C "))

    for g in (2, 4):
        assert timeline(g, 3).makespan_s - timeline(g, 2).makespan_s == 8 * 3.0
        assert timeline(1, 3).makespan_s - timeline(1, 2).makespan_s == 8 * 3.0
        assert timeline(g, 1).makespan_s == timeline(1, 1).makespan_s + (g - 1) * 1.0
        assert first_compute_s(g) == g * 3.0 and first_compute_s(1) == 3.0
