"""Slot schedule: a compute-only order lowered by pure passes into ops on three streams.

**Compute-only order.** One *run* (a wave) computes ``T`` denoising steps over ``B`` blocks. Its block loads are
numbered ``k = 0 .. L-1`` with ``L = T*B``: load ``k`` brings block ``k % B`` for step ``k // B``, so the ring
wraps from the last block of a step to block 0 of the next. With ``R`` requests per load (block-major) every
loaded block is computed for requests ``0 .. R-1`` in turn, so one weight load serves ``R`` requests
(``R = 1`` is the published design).

**Lowering.** :func:`place_computes` puts compute ``k`` on slot ``(o + k) % S``; :func:`add_loads` inserts the
loads, H2D of the local shard into landing buffer ``(lo + k) % N`` then AG into slot ``(o + k) % S`` (rank-local
mode: one H2D of the whole block straight into the slot); :func:`add_dependencies` derives the event waits from
buffer hazards. The ops and their strings are in :mod:`dlo_fn.plan.ops`.

Dependencies (each an event wait): AG after its H2D; C after its AG (rank-local: its H2D); a slot is refilled
only after every compute of its previous occupant; a landing buffer is reused only after its AG. Waits already
implied by "one stream runs in issue order" or by another wait are dropped: an AG waits on the *last* compute of
the slot's previous occupant (after all ``R`` of them), and computes ``r > 0`` of a load wait on nothing.

**Issue order.** The ops of load ``k + S - 1`` are issued before the first compute of load ``k``: that load's
slot was freed by the computes of load ``k - 1``, so with ``S = 2`` the next block starts loading the moment the
current one starts computing, and the H2D stream runs up to ``N`` loads ahead of the all-gathers.

**Landing buffers** (``N = num_landing``, default 2). With ``N = 1`` the H2D of load ``k+1`` must wait for the AG
of load ``k`` to drain the landing buffer, so H2D and AG serialise and the load period is ``h + a`` per block;
with ``N = 2`` it is ``max(h, a)`` (the cycle ``H2D k -> AG k -> H2D k+2`` spans two loads). More buffers only
absorb jitter, at ``max_shard_bytes`` of HBM each, so 2 is the default.

**Runs chain into one ring.** Global load ``g`` is block ``g % B`` on slot ``g % S`` and landing ``g % N``; every
run starts at a multiple of ``B``. A run with ``prefetch_next`` also loads ``k = L .. L+S-2`` (blocks
``0 .. S-2`` of the next run) into the slots its last computes do not use; the next run, built with
``warm_start`` and the offsets from :func:`next_slot_offset` / :func:`next_landing_offset` (or simply
:func:`next_schedule`), computes from them without reloading block 0. Across runs the executor keeps, per
buffer, the event of the previous run's ``last_use`` and makes this run's ``first_use`` op of that buffer wait
on it; nothing else crosses a run boundary.

Example (``B = 2``, ``T = 2``, ``S = 2``, ``N = 2``, allgather)::

    H2D k0 b0>l0   AG k0 b0 l0>s0   H2D k1 b1>l1   AG k1 b1 l1>s1   C k0 b0@s0 r0
    H2D k2 b0>l0   AG k2 b0 l0>s0   C k1 b1@s1 r0  H2D k3 b1>l1     AG k3 b1 l1>s1
    C k2 b0@s0 r0  C k3 b1@s1 r0
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo_fn.plan.ops import AG, C, H2D, KINDS, MODES, STREAM_OF_KIND, STREAMS, HappensBefore, Op

__all__ = [
    "H2D", "AG", "C", "KINDS", "STREAMS", "MODES", "STREAM_OF_KIND", "DEFAULT_NUM_LANDING",
    "Op", "ComputeItem", "Schedule",
    "compute_order", "place_computes", "add_loads", "add_dependencies", "buffer_uses",
    "build_schedule", "next_slot_offset", "next_landing_offset", "next_schedule", "check_schedule",
]

# Two landing buffers let the H2D of load k+1 overlap the all-gather of load k (see "Landing buffers" above).
DEFAULT_NUM_LANDING = 2


@dataclass(frozen=True, slots=True)
class ComputeItem:
    """One entry of the compute-only order: load ``load`` (block ``block`` of step ``step``) for ``request``."""

    load: int
    block: int
    step: int
    request: int


def compute_order(num_blocks: int, num_steps: int, requests_per_load: int = 1) -> tuple[ComputeItem, ...]:
    """Blocks x steps, block-major over requests: ``(k, r)`` for ``k < T*B``, ``r < R``; block ``k % B``."""
    for name, value in (("num_blocks", num_blocks), ("num_steps", num_steps),
                        ("requests_per_load", requests_per_load)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return tuple(ComputeItem(k, k % num_blocks, k // num_blocks, r)
                 for k in range(num_blocks * num_steps) for r in range(requests_per_load))


def place_computes(order: tuple[ComputeItem, ...], num_slots: int, slot_offset: int = 0) -> tuple[Op, ...]:
    """Pass 1: compute ``k`` reads slot ``(slot_offset + k) % num_slots``."""
    return tuple(Op(C, it.load, it.block, slot=(slot_offset + it.load) % num_slots, request=it.request)
                 for it in order)


def _load_ops(k: int, num_blocks: int, num_slots: int, num_landing: int, mode: str,
              slot_offset: int, landing_offset: int) -> tuple[Op, ...]:
    block, slot = k % num_blocks, (slot_offset + k) % num_slots
    if mode == "rank-local":
        return (Op(H2D, k, block, slot=slot),)
    landing = (landing_offset + k) % num_landing
    return Op(H2D, k, block, landing=landing), Op(AG, k, block, slot=slot, landing=landing)


def add_loads(computes: tuple[Op, ...], *, num_blocks: int, num_slots: int, num_landing: int, mode: str,
              slot_offset: int = 0, landing_offset: int = 0, warm_start: bool = False,
              prefetch_next: bool = False) -> tuple[Op, ...]:
    """Pass 2: insert the loads into the compute ops, giving the host issue order.

    Loads ``first .. end-1`` are issued, ``first = S-1`` if ``warm_start`` (the previous run left loads
    ``0 .. S-2`` in the slots) else 0, and ``end = L + S-1`` if ``prefetch_next`` else ``L``. The ops of load
    ``j`` are issued before the first compute of load ``j - S + 1``, the earliest point where its slot's previous
    occupant (load ``j - S``) has all its computes issued.
    """
    num_loads = 1 + max((op.load for op in computes), default=-1)
    first = num_slots - 1 if warm_start else 0
    end = num_loads + (num_slots - 1 if prefetch_next else 0)
    ops: list[Op] = []
    next_load = first
    for op in computes:
        if op.request == 0:
            while next_load < end and next_load <= op.load + num_slots - 1:
                ops.extend(_load_ops(next_load, num_blocks, num_slots, num_landing, mode, slot_offset,
                                     landing_offset))
                next_load += 1
        ops.append(op)
    for k in range(next_load, end):
        ops.extend(_load_ops(k, num_blocks, num_slots, num_landing, mode, slot_offset, landing_offset))
    return tuple(ops)


def add_dependencies(ops: tuple[Op, ...]) -> tuple[tuple[int, ...], ...]:
    """Pass 3: the event waits of each op, from the buffer hazards in issue order.

    Read-after-write waits on the buffer's last writer; write-after-read on every reader since that write (or
    the last writer if none). Then only the waits not already implied are kept: implied by issue order on the
    op's own stream (e.g. compute ``r1`` of a load needs no wait of its own: compute ``r0`` waited for the load)
    or by another kept wait. Every remaining wait is necessary (``tests/test_schedule.py`` checks it).
    """
    last_write: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    clocks = HappensBefore()
    deps: list[tuple[int, ...]] = []
    for i, op in enumerate(ops):
        needed: set[int] = set()
        for buf in op.reads:
            if buf in last_write:
                needed.add(last_write[buf])
        for buf in op.writes:
            needed.update(readers.get(buf) or ([last_write[buf]] if buf in last_write else []))
        base = clocks.base(op.stream)
        candidates = sorted((d for d in needed if not clocks.covers(base, d)), reverse=True)
        kept: list[int] = []
        for n, d in enumerate(candidates):  # drop d if the others still kept imply it
            others = base
            for e in kept + candidates[n + 1:]:
                others = clocks.merge(others, e)
            if not clocks.covers(others, d):
                kept.append(d)
        kept.sort()
        clocks.push(op.stream, tuple(kept))
        deps.append(tuple(kept))
        for buf in op.reads:
            readers.setdefault(buf, []).append(i)
        for buf in op.writes:
            last_write[buf] = i
            readers[buf] = []
    return tuple(deps)


def buffer_uses(ops: tuple[Op, ...]) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]:
    """``(first_use, last_use)``: per buffer (sorted by name), the index of the first and the last op using it."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, op in enumerate(ops):
        for buf in op.reads + op.writes:
            first.setdefault(buf, i)
            last[buf] = i
    return tuple(sorted(first.items())), tuple(sorted(last.items()))


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

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Schedule.mode must be one of {MODES}, got {self.mode!r}")
        for name in ("num_blocks", "num_steps", "requests_per_load", "num_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"Schedule.{name} must be >= 1, got {getattr(self, name)}")
        if self.mode == "allgather" and self.num_landing < 1:
            raise ValueError(f"allgather mode needs num_landing >= 1, got {self.num_landing}")
        if self.mode == "rank-local" and self.num_landing != 0:
            raise ValueError(f"rank-local mode has no landing buffers: num_landing must be 0, got "
                             f"{self.num_landing}")
        if not 0 <= self.slot_offset < self.num_slots:
            raise ValueError(f"slot_offset must be in [0, {self.num_slots}), got {self.slot_offset}")
        if not 0 <= self.landing_offset < max(self.num_landing, 1):
            raise ValueError(f"landing_offset must be in [0, {self.num_landing}), got {self.landing_offset}")
        if len(self.deps) != len(self.ops):
            raise ValueError(f"Schedule has {len(self.ops)} ops but {len(self.deps)} dependency tuples")

    @property
    def num_loads(self) -> int:
        """Loads this run computes, ``L = num_steps * num_blocks`` (prefetched ones for the next run excluded)."""
        return self.num_steps * self.num_blocks

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

    def validate(self, prev: "Schedule | None" = None) -> "Schedule":
        """Check every invariant (see :func:`check_schedule`); return self."""
        check_schedule(self, prev)
        return self


def build_schedule(num_blocks: int, num_steps: int, *, requests_per_load: int = 1, num_slots: int = 2,
                   num_landing: int | None = None, mode: str = "allgather", slot_offset: int = 0,
                   landing_offset: int = 0, warm_start: bool = False, prefetch_next: bool = False) -> Schedule:
    """Compute order -> place computes -> add loads -> add dependencies.

    ``num_landing`` defaults to 2 in allgather mode and must be 0 (or None) in rank-local mode. ``num_slots = 1``
    is allowed as the no-overlap baseline (every load waits for the previous block's computes).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if num_landing is None:
        num_landing = DEFAULT_NUM_LANDING if mode == "allgather" else 0
    if not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots must be an int >= 1 (2 = the published double buffer), got {num_slots!r}")
    order = compute_order(num_blocks, num_steps, requests_per_load)
    computes = place_computes(order, num_slots, slot_offset)
    # Schedule.__post_init__ checks the remaining parameters before any op is built on them.
    Schedule((), (), num_blocks, num_steps, requests_per_load, num_slots, num_landing, mode, slot_offset,
             landing_offset, warm_start, prefetch_next)
    ops = add_loads(computes, num_blocks=num_blocks, num_slots=num_slots, num_landing=num_landing, mode=mode,
                    slot_offset=slot_offset, landing_offset=landing_offset, warm_start=warm_start,
                    prefetch_next=prefetch_next)
    first_use, last_use = buffer_uses(ops)
    return Schedule(ops, add_dependencies(ops), num_blocks, num_steps, requests_per_load, num_slots, num_landing,
                    mode, slot_offset, landing_offset, warm_start, prefetch_next, first_use, last_use)


def next_slot_offset(prev: Schedule) -> int:
    """Slot of the next run's load 0: the ring continues, ``(o + L) % S``."""
    return (prev.slot_offset + prev.num_loads) % prev.num_slots


def next_landing_offset(prev: Schedule) -> int:
    """Landing buffer of the next run's load 0, ``(lo + L) % N`` (0 in rank-local mode)."""
    return (prev.landing_offset + prev.num_loads) % prev.num_landing if prev.num_landing else 0


def next_schedule(prev: Schedule, num_steps: int, *, requests_per_load: int | None = None,
                  prefetch_next: bool = True) -> Schedule:
    """The run after ``prev`` on the same ring: warm if ``prev`` prefetched, offsets continued."""
    return build_schedule(
        prev.num_blocks, num_steps, requests_per_load=requests_per_load or prev.requests_per_load,
        num_slots=prev.num_slots, num_landing=prev.num_landing, mode=prev.mode,
        slot_offset=next_slot_offset(prev), landing_offset=next_landing_offset(prev),
        warm_start=prev.prefetch_next, prefetch_next=prefetch_next)


def check_schedule(schedule: Schedule, prev: Schedule | None = None) -> None:
    """Raise ``ValueError`` naming the first broken invariant (see :mod:`dlo_fn.plan.schedule_check`)."""
    from dlo_fn.plan.schedule_check import check_schedule as _check

    _check(schedule, prev)
