"""A schedule compiled against an executor's buffers, the state of an open run, and the executor's counters.

The schedule is the planner's (:mod:`dlo_fn.plan.schedule`), handed to the executor as is: compiling resolves
buffers and streams, never reorders, adds or drops an op. Each op becomes a :class:`CompiledOp` holding what the
issue loop (:mod:`dlo_fn.runtime.issue`) needs: its kind (:mod:`dlo_fn.plan.ops`), stream, the ops of the run whose
events it waits on, the buffers whose previous-run last use it waits on, and its arguments as ready-made byte
views (``H2D``: (destination, source) pairs; ``AG``: (slot bytes, landing bytes) pairs, one collective; ``C``: the
block caller bound to the slot's weight views).

A load group's copies whose bytes continue are joined into one copy here, and its all-gathers into one collective
(:func:`_merge_group_loads`), so a group costs the stream operations of one load.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from dlo_fn.plan.layout import ModelLayout
from dlo_fn.plan.ops import AG, DQ, H2D, C
from dlo_fn.plan.schedule import Ring, Schedule, ScheduleError
from dlo_fn.runtime.host_store import HostStore

__all__ = ["CompiledOp", "ExecutorStats", "Program", "Programs", "RunState", "compile_schedule"]

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class ExecutorStats:
    """Counters of what the executor issued, and host time (seconds, ``time.perf_counter``). ``waits``,
    ``copies`` and ``records`` are the stream operations of the loads and computes (a load group's joined copies
    count once), ``collectives`` the all-gather calls; ``issue_s`` is the host time outside the blocks' own calls
    (of which ``load_issue_s`` issuing loads, and of that ``collective_s`` inside the all-gather calls), ``call_s``
    the time inside the blocks' calls."""

    computes: int = 0
    loads: int = 0
    runs: int = 0
    waits: int = 0
    copies: int = 0
    records: int = 0
    collectives: int = 0
    issue_s: float = 0.0
    load_issue_s: float = 0.0
    collective_s: float = 0.0
    call_s: float = 0.0

    def reset(self) -> None:
        for name in self.__slots__:
            setattr(self, name, type(getattr(self, name))())

    @property
    def issue_us_per_compute(self) -> float:
        return 1e6 * self.issue_s / max(self.computes, 1)

    @property
    def stream_ops(self) -> int:
        """Waits, copies and records issued: what the plan counts (:func:`dlo_fn.cost.host_cost.planned_stream_ops`)."""
        return self.waits + self.copies + self.records


@dataclass(frozen=True, slots=True)
class CompiledOp:
    """One op of a schedule resolved against the executor's buffers (see the module doc)."""

    kind: str  # H2D, AG or C (dlo_fn.plan.ops)
    block: int
    stream: Any  # the H2D or all-gather stream; None for a compute (it runs on the caller's current stream)
    waits: tuple[int, ...]  # ops of this run whose events it waits on
    carry: tuple[str, ...]  # buffers it uses first in the run: it waits on the previous run's last use of each
    pairs: tuple[Pair, ...] = ()  # H2D: (dst, src) copies; AG: (out, in) pairs, one collective; () when joined
    caller: Any = None  # C: the block's call on its slot's views; DQ: the dequantise call (staging -> slot)
    recorded: bool = False  # a later op (or the next run) waits on its event


@dataclass(frozen=True, slots=True)
class Program:
    """A schedule compiled against one executor's buffers; its events are reused each time it runs."""

    schedule: Schedule
    ops: tuple[CompiledOp, ...]
    next_compute: tuple[int, ...]  # for each cursor position, the index of the next compute op (or len(ops))
    events: tuple[Any, ...]
    last_use: tuple[tuple[str, int], ...]  # Schedule.carried_last_use: what the next run waits on


class Programs:
    """The programs one executor has compiled, each once: the ring's next schedules by ``(ring, T, R)`` (so a
    steady ring builds no schedule per run), handed schedules by the schedule itself."""

    def __init__(self, compile: Callable[[Schedule], Program]) -> None:
        self._compile = compile
        self._cache: dict[tuple | Schedule, Program] = {}

    def __len__(self) -> int:
        return len(self._cache)

    def compiled(self) -> tuple[Program, ...]:
        return tuple(self._cache.values())

    def get(
        self, ring: Ring, num_steps: int | None, requests_per_load: int | None, schedule: Schedule | None
    ) -> Program:
        """The program of the next run on ``ring``: ``schedule`` if handed (it must start from ``ring``; checked
        in full before its first run), else the ring's next schedule for ``num_steps`` x ``requests_per_load``
        (default 1 x 1)."""
        if schedule is None:
            key: tuple | Schedule = (ring, num_steps or 1, requests_per_load or 1)
            program = self._cache.get(key)
            if program is None:
                program = self._cache[key] = self._compile(ring.next_schedule(key[1], key[2]))
            return program
        for name, value in (("num_steps", num_steps), ("requests_per_load", requests_per_load)):
            if value is not None and value != getattr(schedule, name):
                raise ScheduleError(
                    f"{name}={value}, but the schedule handed has {name}="
                    f"{getattr(schedule, name)}: pass the schedule alone"
                )
        ring.check(schedule, "the executor's ring")
        program = self._cache.get(schedule)
        if program is None:
            from dlo_fn.plan.schedule_check import check_schedule  # the hazard checker, once per new schedule

            check_schedule(schedule)  # a hand-made schedule may break any invariant: say which before it runs
            program = self._cache[schedule] = self._compile(schedule)
        return program


@dataclass(slots=True)  # slots: the per-block path reads and writes its fields
class RunState:
    """An open run: its program and events, the previous run's last uses it waits on (``carry``: buffer ->
    event), whether this rank computes, and the cursor (the next op to issue)."""

    program: Program
    events: Sequence[Any]
    starts: Sequence[Any] | None  # a recorded timeline's start events (None: not recording)
    carry: dict[str, Any]
    compute: bool
    implicit: bool
    stream: Any  # the compute stream: the caller's current stream when the run opened
    index: int = 0
    cursor: int = 0


def compile_schedule(
    sch: Schedule,
    layout: ModelLayout,
    store: HostStore,
    buffers: Any,
    callers: Sequence[Sequence[Any]],
    streams: tuple[Any, Any],
    new_event: Callable[[], Any],
    dequantizer: Any = None,
) -> Program:
    """Resolve every op of ``sch`` against the ``buffers`` (:class:`~dlo_fn.runtime.slots.SlotBuffers`: the bytes
    a block occupies in a slot, a landing or a staging buffer), ``callers[block][slot]`` the block's bound call,
    ``streams`` the (H2D stream, all-gather stream); a DQ op's call comes from ``dequantizer``
    (:class:`~dlo_fn.runtime.quant.TorchDequant` or a plug-in's)."""

    def target(op: Any) -> torch.Tensor:  # what a load writes: its slot, or its slot's staging buffer
        return (
            buffers.slot_span(op.block, op.slot) if op.slot is not None else buffers.staging_span(op.block, op.staging)
        )

    pairs: list[tuple[Pair, ...]] = []
    for op in sch.ops:
        if op.kind == H2D:
            dst = buffers.landing_span(op.block, op.landing) if op.landing is not None else target(op)
            pairs.append(
                tuple((dst[s.dst_start : s.dst_start + s.src.numel()], s.src) for s in store.sources[op.block])
            )
        elif op.kind == AG:
            n = layout.shards[op.block].shard_bytes
            pairs.append(((target(op)[: n * layout.num_shards], buffers.landing_span(op.block, op.landing)[:n]),))
        else:
            pairs.append(())
    carry: list[list[str]] = [[] for _ in sch.ops]
    for buf, i in sch.first_use:
        carry[i].append(buf)
    kinds = [op.kind for op in sch.ops]
    _merge_group_loads(kinds, pairs, sch.load_group_last, sch.deps, carry, layout.load_group > 1)
    if layout.load_group > 1:
        _check_group_gathers(sch, layout, kinds, pairs)
    stream_of = {H2D: streams[0], AG: streams[1], DQ: streams[1], C: None}
    recorded = sch.recorded
    ops = []
    for i, op in enumerate(sch.ops):
        caller = None
        if op.kind == DQ:  # the stored block in the slot's staging buffer -> the slot, in the compute dtype
            caller = dequantizer.prepare(
                buffers.staging_span(op.block, op.slot),
                buffers.slot_span(op.block, op.slot),
                layout.shards[op.block].block,
                layout.compute_block(op.block),
            )
        if op.kind == C:
            caller = callers[op.block][op.slot]
            if getattr(caller, "per_request", False):  # a plug-in's caller that keys on the request
                caller = functools.partial(caller, request=op.request)
        ops.append(
            CompiledOp(
                op.kind, op.block, stream_of[op.kind], sch.deps[i], tuple(carry[i]), pairs[i], caller, i in recorded
            )
        )
    nxt, upcoming = [0] * (len(ops) + 1), len(ops)
    for i in range(len(ops), -1, -1):
        if i < len(ops) and ops[i].kind == C:
            upcoming = i
        nxt[i] = upcoming
    return Program(sch, tuple(ops), tuple(nxt), tuple(new_event() for _ in ops), sch.carried_last_use)


def _merge_group_loads(
    kinds: Sequence[str],
    pairs: list[tuple[Pair, ...]],
    lead: tuple[int | None, ...],
    deps: Sequence[tuple[int, ...]],
    carry: Sequence[list[str]],
    spans: bool = False,
) -> None:
    """In place: the copies of a load group's H2D that continue the previous H2D's last copy in both its source
    and its destination (one storage each: the slots and the landing buffers are one allocation each, the arena
    holds the blocks back to back) join that copy, and the later H2D is left with none; a load group's AG joins
    the previous AG's collective (one call for the group: ``runtime.dist.all_gather_pairs``) and is left with
    none. Only a load that waits for nothing in the run joins the one before it (the plan gives a group's first
    load every wait of the group: ``lowering.add_dependencies``), so every copy and collective still runs after
    the waits it needs; a joining load's waits on the previous run's last uses (``carry``, the buffers' first
    uses in this run) move to the load it joins: those events were all recorded before this run began, so waiting
    for them a few ops earlier on the same stream only holds the group until its buffers are free.

    ``spans`` (a grouped layout, :mod:`dlo_fn.plan.layout`): a group's AGs join like its copies, into one
    all-gather of the group's landing bytes into its slot bytes (their bytes continue), which is the only
    all-gather of that layout that gathers whole blocks (:func:`_check_group_gathers`)."""
    into = None  # the load of this group (and kind: ``lead`` is per kind) that the next one may join
    for i in range(len(pairs)):
        if lead[i] is None:
            into = None
            continue
        if into is None or lead[into] != lead[i] or deps[i] or not pairs[i] or not pairs[into]:
            into = i
            continue
        if kinds[i] == AG and not spans:
            pairs[into], pairs[i] = (*pairs[into], *pairs[i]), ()
        else:
            (d0, s0), (d1, s1) = pairs[into][-1], pairs[i][0]
            if not (_continues(d0, d1) and _continues(s0, s1)):
                into = i
                continue
            joined = (_byte_view(d0, d0.numel() + d1.numel()), _byte_view(s0, s0.numel() + s1.numel()))
            pairs[into] = (*pairs[into][:-1], joined, *pairs[i][1:])
            pairs[i] = ()
        carry[into].extend(buf for buf in carry[i] if buf not in carry[into])
        carry[i].clear()


def _check_group_gathers(
    sch: Schedule, layout: ModelLayout, kinds: Sequence[str], pairs: Sequence[tuple[Pair, ...]]
) -> None:
    """ScheduleError unless every all-gather of a grouped layout is one whole group's (one pair of ``G`` pieces):
    a part of a group gathers rank-major pieces that are no block (a schedule whose load groups are not the
    layout's, or a run that splits a group)."""
    g = layout.load_group
    for i, kind in enumerate(kinds):
        if kind != AG or not pairs[i]:
            continue
        op = sch.ops[i]
        want = g * layout.shards[op.block].shard_bytes
        if len(pairs[i]) != 1 or pairs[i][0][1].numel() != want or layout.shards[op.block].member:
            raise ScheduleError(
                f"op {i} ({op}): the layout gathers blocks {g} at a time (one all-gather per group), but this "
                f"schedule's all-gather there is not one whole group's (load_group = {sch.load_group}, slot_offset "
                f"= {sch.slot_offset}, landing_offset = {sch.landing_offset}): run the ring's schedules "
                f"(load_group = {g}) on it"
            )


def _continues(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b``'s bytes start where ``a``'s end, in the same storage (both flat uint8 views)."""
    return (
        a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.data_ptr() + a.numel() == b.data_ptr()
    )


def _byte_view(t: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` bytes of ``t``'s storage from ``t``'s first byte."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), t.storage_offset(), (n,))
