"""Slot schedule: one run's ops on three streams, and the :class:`Ring` that chains runs.

A :class:`Schedule` is built by the pure lowering passes of :mod:`dlo_fn.plan.lowering` (compute-only order ->
place computes -> add loads -> add dependencies; the math of each is there) and is what the executor
interprets, op by op. Load ``k`` of a run is block ``k % B`` of step ``k // B`` (``L = T*B`` loads) on slot
``(o + k) % S`` and, in allgather mode, landing buffer ``(lo + k) % N``. An all-gather over one rank is lowered to
the rank-local sequence (``Ring.cold(..., num_shards=1)``; :func:`~dlo_fn.plan.lowering.lowered_mode`).

**Landing buffers** (``N = num_landing``, default 2). With ``N = 1`` the H2D of load ``k+1`` must wait for the AG
of load ``k`` to drain the landing buffer, so H2D and AG serialise and the load period is ``h + a`` per block;
with ``N = 2`` it is ``max(h, a)`` (the cycle ``H2D k -> AG k -> H2D k+2`` spans two loads). More buffers only
absorb jitter, at ``max_shard_bytes`` of HBM each, so 2 is the default.

**Runs chain into one ring.** Global load ``g`` is block ``g % B`` on slot ``g % S`` and landing ``g % N``; every
run starts at a multiple of ``B``. A run with ``prefetch_next`` also loads ``k = L .. L+S-G-1`` (blocks
``0 .. S-G-1`` of the next run, ``G`` the load group: whole groups; ``lowering.prefetch_depth``) into the slots
its last computes do not use; the next run starts ``warm_start``
from them, at the offsets the :class:`Ring` carries (``ring.after(run).next_schedule(...)``, or
:func:`next_schedule`), and computes without reloading block 0. Across runs the executor keeps, per buffer, the
event of the previous run's ``last_use`` and makes this run's ``first_use`` op of that buffer wait on it;
nothing else crosses a run boundary.

Example (``B = 2``, ``T = 2``, ``S = 2``, ``N = 2``, allgather)::

    H2D k0 b0>l0   AG k0 b0 l0>s0   H2D k1 b1>l1   AG k1 b1 l1>s1   C k0 b0@s0 r0
    H2D k2 b0>l0   AG k2 b0 l0>s0   C k1 b1@s1 r0  H2D k3 b1>l1     AG k3 b1 l1>s1
    C k2 b0@s0 r0  C k3 b1@s1 r0
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dlo_fn.plan.lowering import (
    ComputeItem,
    add_dependencies,
    add_loads,
    buffer_uses,
    check_load_group,
    compute_order,
    default_num_landing,
    load_groups,
    lowered_mode,
    place_computes,
)
from dlo_fn.plan.modes import OFFLOAD_MODES, check_mode
from dlo_fn.plan.ops import AG, DQ, H2D, KINDS, STREAM_OF_KIND, STREAMS, C, Op

__all__ = [
    "H2D",
    "AG",
    "DQ",
    "C",
    "KINDS",
    "STREAMS",
    "STREAM_OF_KIND",
    "DEFAULT_NUM_LANDING",
    "Op",
    "ComputeItem",
    "Schedule",
    "Ring",
    "ScheduleError",
    "compute_order",
    "lowered_mode",
    "place_computes",
    "add_loads",
    "add_dependencies",
    "buffer_uses",
    "build_schedule",
    "next_slot_offset",
    "next_landing_offset",
    "next_schedule",
]

# Two landing buffers let the H2D of load k+1 overlap the all-gather of load k (see "Landing buffers" above); with
# load groups, two per block of the group (lowering.default_num_landing).
DEFAULT_NUM_LANDING = default_num_landing(1)


class ScheduleError(ValueError, RuntimeError):
    """A schedule breaks an invariant or does not continue the ring it runs on, or the model called blocks in an
    order the schedule does not have. The message names the op or the field.

    Also a ``RuntimeError``: the executor's call-order errors were one before the two error classes merged, and
    callers that catch either keep working."""


def _check_ring_fields(owner: str, ring: Ring | Schedule) -> None:
    """The invariants a :class:`Ring` and a :class:`Schedule` share (``owner`` prefixes the field names)."""
    num_blocks, num_slots, num_landing, mode = ring.num_blocks, ring.num_slots, ring.num_landing, ring.mode
    slot_offset, landing_offset, load_group = ring.slot_offset, ring.landing_offset, ring.load_group
    check_mode(mode, OFFLOAD_MODES, f"{owner}mode")
    if not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"{owner}num_blocks must be an int >= 1, got {num_blocks!r}")
    if not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"{owner}num_slots must be an int >= 1 (2 = the published double buffer), got {num_slots!r}")
    if mode == "allgather" and num_landing < 1:
        raise ValueError(f"allgather mode needs {owner}num_landing >= 1, got {num_landing}")
    if mode == "rank-local" and num_landing != 0:
        raise ValueError(f"rank-local mode has no landing buffers: {owner}num_landing must be 0, got {num_landing}")
    if not 0 <= slot_offset < num_slots:
        raise ValueError(f"{owner}slot_offset must be in [0, {num_slots}), got {slot_offset}")
    if not 0 <= landing_offset < max(num_landing, 1):
        raise ValueError(f"{owner}landing_offset must be in [0, {num_landing}), got {landing_offset}")
    check_load_group(load_group, num_slots, mode, owner, num_landing, ring.quantized)


@dataclass(frozen=True, slots=True)
class Schedule:
    """Ops in host issue order with their event waits; what the executor interprets, op by op.

    The executor walks ``ops`` in order: it makes ``op.stream`` wait on the events of ``deps[i]`` (and, for the
    ops named in ``first_use``, on the previous run's ``last_use`` event of that buffer), launches the op and
    records its event. No other ordering is assumed besides each stream running in issue order.
    """

    ops: tuple[Op, ...]
    deps: tuple[tuple[int, ...], ...]
    num_blocks: int
    num_steps: int
    requests_per_load: int
    num_slots: int
    num_landing: int
    mode: str
    slot_offset: int = 0
    landing_offset: int = 0
    warm_start: bool = False
    prefetch_next: bool = False
    first_use: tuple[tuple[str, int], ...] = ()
    last_use: tuple[tuple[str, int], ...] = ()
    load_group: int = 1  # loads that move as one (see "Load groups" in dlo_fn.plan.lowering)
    quantized: bool = False  # loads land in staging buffers and a DQ op writes the slot ("Quantised loads")

    def __post_init__(self) -> None:
        _check_ring_fields("Schedule.", self)
        for name in ("num_steps", "requests_per_load"):
            if getattr(self, name) < 1:
                raise ValueError(f"Schedule.{name} must be >= 1, got {getattr(self, name)}")
        if len(self.deps) != len(self.ops):
            raise ValueError(f"Schedule has {len(self.ops)} ops but {len(self.deps)} dependency tuples")

    @property
    def num_loads(self) -> int:
        """Loads this run computes, ``L = num_steps * num_blocks`` (prefetched ones for the next run excluded)."""
        return self.num_steps * self.num_blocks

    @property
    def load_group_last(self) -> tuple[int | None, ...]:
        """Per op, the index of the last op of its kind (H2D, AG) in its load group (None: a compute, or no load
        groups)."""
        return load_groups(self.ops, self.load_group, self.slot_offset)

    @property
    def carried_last_use(self) -> tuple[tuple[str, int], ...]:
        """Per buffer, the op whose event the next run's first use of it waits on: its last use, or for a
        grouped load the last op of its kind in its group (the same stream, issued later: the wait covers the
        whole group, and the group's other loads need no event)."""
        lead = self.load_group_last
        return tuple((buf, lead[i] if lead[i] is not None else i) for buf, i in self.last_use)

    @property
    def recorded(self) -> frozenset[int]:
        """The ops whose event something waits on, a later op of the run or the next run: the executor records
        no other (unless it records a timeline)."""
        return frozenset(d for deps in self.deps for d in deps) | {i for _, i in self.carried_last_use}

    def step_of(self, op: Op) -> int:
        """Denoising step of an op; ``num_steps`` for a load prefetched for the next run."""
        return op.load // self.num_blocks

    def to_strs(self) -> tuple[str, ...]:
        return tuple(str(op) for op in self.ops)

    def __str__(self) -> str:
        return "\n".join(self.to_strs())

    def describe(self) -> str:
        """One line per op: index, op, the indices it waits on."""
        lines = []
        for i, (op, deps) in enumerate(zip(self.ops, self.deps)):
            wait = " <- " + ",".join(map(str, deps)) if deps else ""
            lines.append(f"{i:4d}  {str(op):18s}{wait}".rstrip())
        return "\n".join(lines)


_SCHEDULE_FIELD = {"warm": "warm_start"}  # Ring field -> the Schedule field that holds it


@dataclass(frozen=True, slots=True)
class Ring:
    """What carries from one run to the next on one set of slots and landing buffers; pure.

    A run that starts at global load ``g0`` (a multiple of ``B``) has ``slot_offset = g0 % S`` and
    ``landing_offset = g0 % N``; ``warm`` says the previous run prefetched this run's loads ``0 .. S-G-1`` into the
    slots (``prefetch_next``). After a run of ``L`` loads the ring is at ``g0 + L``:
    ``slot_offset' = (slot_offset + L) % S``, ``landing_offset' = (landing_offset + L) % N`` (0 when
    ``N = 0``), ``warm' = prefetch_next`` of that run. Runs of any length and ``R`` chain this way.

    ========================  ========================================================
    call                      gives
    ========================  ========================================================
    ``Ring.cold(B, ...)``     a ring with nothing in its buffers (the first run)
    ``ring.next_schedule``    the schedule of the next run (prefetching by default)
    ``ring.after(s)``         the ring once ``s`` has run (``s`` must start from it)
    ``ring.check(s)``         ScheduleError unless ``s`` starts from this ring
    ``ring.restart()``        the same buffers, cold (after an aborted run)
    ``Ring.of(s)``            the ring ``s`` starts from
    ========================  ========================================================
    """

    num_blocks: int
    num_slots: int
    num_landing: int
    mode: str
    slot_offset: int = 0
    landing_offset: int = 0
    warm: bool = False
    load_group: int = 1
    quantized: bool = False

    def __post_init__(self) -> None:
        _check_ring_fields("", self)

    @classmethod
    def cold(
        cls,
        num_blocks: int,
        *,
        num_slots: int = 2,
        num_landing: int | None = None,
        mode: str = "allgather",
        num_shards: int | None = None,
        load_group: int = 1,
        quantized: bool = False,
    ) -> "Ring":
        """``num_landing`` defaults to :data:`DEFAULT_NUM_LANDING` per load group in allgather mode, 0 in
        rank-local mode. ``num_shards`` (the shard group's size, if known): ``allgather`` over one rank is lowered
        to the rank-local ring (:func:`~dlo_fn.plan.lowering.lowered_mode`; its ``num_landing`` is then ignored).
        ``load_group``: loads that move as one ("Load groups" in :mod:`dlo_fn.plan.lowering`); ``quantized``: each
        load lands in its slot's staging buffer and a dequantise op writes the slot ("Quantised loads" there)."""
        if lowered_mode(mode, num_shards) != mode:
            mode, num_landing = lowered_mode(mode, num_shards), None
        if num_landing is None:
            num_landing = default_num_landing(load_group) if mode == "allgather" else 0
        return cls(num_blocks, num_slots, num_landing, mode, load_group=load_group, quantized=quantized)

    @classmethod
    def of(cls, schedule: Schedule) -> "Ring":
        return cls(
            schedule.num_blocks,
            schedule.num_slots,
            schedule.num_landing,
            schedule.mode,
            schedule.slot_offset,
            schedule.landing_offset,
            schedule.warm_start,
            schedule.load_group,
            schedule.quantized,
        )

    def next_schedule(self, num_steps: int, requests_per_load: int = 1, *, prefetch_next: bool = True) -> Schedule:
        """Compute order -> place computes -> add loads -> add dependencies, from this ring's state.

        ``prefetch_next`` (default: the ring never stops) also loads blocks ``0 .. S-G-1`` of the next run."""
        order = compute_order(self.num_blocks, num_steps, requests_per_load)
        computes = place_computes(order, self.num_slots, self.slot_offset)
        ops = add_loads(
            computes,
            num_blocks=self.num_blocks,
            num_slots=self.num_slots,
            num_landing=self.num_landing,
            mode=self.mode,
            slot_offset=self.slot_offset,
            landing_offset=self.landing_offset,
            warm_start=self.warm,
            prefetch_next=prefetch_next,
            load_group=self.load_group,
            quantized=self.quantized,
        )
        first_use, last_use = buffer_uses(ops)
        deps = add_dependencies(ops, load_groups(ops, self.load_group, self.slot_offset))
        return Schedule(
            ops,
            deps,
            self.num_blocks,
            num_steps,
            requests_per_load,
            self.num_slots,
            self.num_landing,
            self.mode,
            self.slot_offset,
            self.landing_offset,
            self.warm,
            prefetch_next,
            first_use,
            last_use,
            self.load_group,
            self.quantized,
        )

    def check(self, schedule: Schedule, what: str = "the ring") -> None:
        """Raise :class:`ScheduleError` naming every field in which ``schedule`` does not start from this ring."""
        here = Ring.of(schedule)
        bad = [
            f"{_SCHEDULE_FIELD.get(f.name, f.name)} = {getattr(here, f.name)!r} (the ring has "
            f"{getattr(self, f.name)!r})"
            for f in fields(self)
            if getattr(here, f.name) != getattr(self, f.name)
        ]
        if bad:
            raise ScheduleError(
                f"the schedule does not continue {what}: {', '.join(bad)}; ask the ring for the "
                f"next schedule (ring.next_schedule)"
            )

    def after(self, schedule: Schedule) -> "Ring":
        """The ring once ``schedule`` (which must start from this ring) has run."""
        self.check(schedule)
        n = schedule.num_loads
        return Ring(
            self.num_blocks,
            self.num_slots,
            self.num_landing,
            self.mode,
            (self.slot_offset + n) % self.num_slots,
            (self.landing_offset + n) % self.num_landing if self.num_landing else 0,
            schedule.prefetch_next,
            self.load_group,
            self.quantized,
        )

    def restart(self) -> "Ring":
        """The same buffers with nothing known in them: the next run starts cold at offset 0."""
        return Ring.cold(
            self.num_blocks,
            num_slots=self.num_slots,
            num_landing=self.num_landing,
            mode=self.mode,
            load_group=self.load_group,
            quantized=self.quantized,
        )


def build_schedule(
    num_blocks: int,
    num_steps: int,
    *,
    requests_per_load: int = 1,
    num_slots: int = 2,
    num_landing: int | None = None,
    mode: str = "allgather",
    slot_offset: int = 0,
    landing_offset: int = 0,
    warm_start: bool = False,
    prefetch_next: bool = False,
    num_shards: int | None = None,
    load_group: int = 1,
    quantized: bool = False,
) -> Schedule:
    """One run from any ring state (see :meth:`Ring.next_schedule`); by default a cold run that prefetches nothing.

    ``num_landing`` defaults to 2 in allgather mode and must be 0 (or None) in rank-local mode. ``num_slots = 1``
    is allowed as the no-overlap baseline (every load waits for the previous block's computes). ``num_shards = 1``
    lowers ``allgather`` to the rank-local schedule (:func:`~dlo_fn.plan.lowering.lowered_mode`). ``load_group``:
    loads that move as one ("Load groups" in :mod:`dlo_fn.plan.lowering`).
    """
    check_mode(mode, OFFLOAD_MODES)
    if lowered_mode(mode, num_shards) != mode:
        mode, num_landing = lowered_mode(mode, num_shards), None
    if num_landing is None:
        num_landing = default_num_landing(load_group) if mode == "allgather" else 0
    compute_order(num_blocks, num_steps, requests_per_load)  # names a bad count before the ring's fields
    ring = Ring(
        num_blocks, num_slots, num_landing, mode, slot_offset, landing_offset, warm_start, load_group, quantized
    )
    return ring.next_schedule(num_steps, requests_per_load, prefetch_next=prefetch_next)


def next_slot_offset(prev: Schedule) -> int:
    """Slot of the next run's load 0: the ring continues, ``(o + L) % S``."""
    return Ring.of(prev).after(prev).slot_offset


def next_landing_offset(prev: Schedule) -> int:
    """Landing buffer of the next run's load 0, ``(lo + L) % N`` (0 in rank-local mode)."""
    return Ring.of(prev).after(prev).landing_offset


def next_schedule(
    prev: Schedule, num_steps: int, *, requests_per_load: int | None = None, prefetch_next: bool = True
) -> Schedule:
    """The run after ``prev`` on the same ring: warm if ``prev`` prefetched, offsets continued."""
    return (
        Ring.of(prev)
        .after(prev)
        .next_schedule(num_steps, requests_per_load or prev.requests_per_load, prefetch_next=prefetch_next)
    )
