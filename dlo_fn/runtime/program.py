"""A schedule compiled against an executor's buffers, the state of an open run, and the executor's counters.

The schedule is the planner's (:mod:`dlo_fn.plan.schedule`), handed to the executor as is: compiling resolves
buffers and streams, never reorders, adds or drops an op.

With driver calls (CUDA, :mod:`dlo_fn.runtime.cuda_raw`) each compute op also gets its *segment*: every driver
call from the op after the previous compute up to this compute's own waits, flattened into one tuple of
``(function, args)`` with the pointers and event handles bound (:func:`fast_segments`), and the record after it.
The eager hot loop then is one loop of bare driver calls per block, with no per-op lookup, branch or wrapper.

Compiling resolves every op once (at the first run that uses the schedule) into what the hot loop needs: its
kind, stream, the indices of the events it waits on, the buffers whose previous-run last use it waits on, and
its arguments as ready-made byte views (``H2D``: (destination, source) pairs; ``AG``: (slot bytes, landing
bytes) pairs, one collective; ``C``: (block index, caller bound to the slot's weight views)).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from dlo_fn.plan.layout import ModelLayout
from dlo_fn.plan.schedule_check import check_schedule
from dlo_fn.plan.schedule import AG, H2D, Ring, Schedule, ScheduleError
from dlo_fn.runtime.host_store import HostStore

__all__ = ["ExecutorStats", "Program", "Programs", "RunState", "compile_schedule", "fast_segments"]

_H2D, _AG, _C = 0, 1, 2


@dataclass(slots=True)
class ExecutorStats:
    """Host-side counters (seconds, from ``time.perf_counter``). ``issue_s`` is the host time the executor
    spends outside the blocks' own calls (issuing loads, waits, records, bookkeeping), of which
    ``load_issue_s`` issuing the H2D and all-gather ops; ``call_s`` is the time inside the block calls."""

    computes: int = 0
    loads: int = 0
    runs: int = 0
    issue_s: float = 0.0
    load_issue_s: float = 0.0
    call_s: float = 0.0

    def reset(self) -> None:
        self.computes = self.loads = self.runs = 0
        self.issue_s = self.load_issue_s = self.call_s = 0.0

    @property
    def issue_us_per_compute(self) -> float:
        return 1e6 * self.issue_s / max(self.computes, 1)


@dataclass
class Program:
    """A schedule compiled against this executor's buffers; events are reused each time it runs."""

    schedule: Schedule
    kinds: tuple[int, ...]
    streams: tuple[Any, ...]
    waits: tuple[tuple[int, ...], ...]
    carry: tuple[tuple[str, ...], ...]  # buffers whose previous-run last use this op must wait for
    args: tuple[Any, ...]  # H2D: ((dst, src), ...); AG: ((out, inp), ...), one collective; C: (block, caller)
    next_compute: tuple[int, ...]  # for each cursor position, the index of the next compute op (or len)
    events: list[Any]
    last_use: tuple[tuple[str, int], ...] = ()  # Schedule.carried_last_use: what the next run waits on
    # With driver calls (dlo_fn.runtime.cuda_raw): per op, (stream handle, ((dst ptr, src ptr, bytes, device
    # source), ...)), an all-gather's copies none (its collective is bound by fast_segments); compute ops: None
    # (they run on the caller's stream).
    raw: tuple[Any, ...] | None = None
    # The driver-call fast path, per (compute stream handle, carried event handles) (see fast_segments).
    fast: dict[tuple, tuple[Any, ...]] = field(default_factory=dict)
    # Schedule.recorded, once (the hot loops test it per op): the others record nothing, unless a timeline is
    # being recorded (every op's end then is a measurement).
    recorded: frozenset[int] = frozenset()


class Programs:
    """The programs one executor has compiled, each once: the ring's next schedules by ``(ring, T, R)`` (so a
    steady ring builds no schedule per run), handed schedules by the schedule itself."""

    def __init__(self, compile: Callable[[Schedule], Program]) -> None:
        self._compile = compile
        self._cache: dict[tuple | Schedule, Program] = {}

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, ring: Ring, num_steps: int | None, requests_per_load: int | None,
            schedule: Schedule | None) -> Program:
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
                raise ScheduleError(f"{name}={value}, but the schedule handed has {name}="
                                    f"{getattr(schedule, name)}: pass the schedule alone")
        ring.check(schedule, "the executor's ring")
        program = self._cache.get(schedule)
        if program is None:
            check_schedule(schedule)  # a hand-made schedule may break any invariant: say which before it runs
            program = self._cache[schedule] = self._compile(schedule)
        return program


@dataclass(slots=True)  # slots: the per-block path reads and writes its fields (fewer cache lines per access)
class RunState:
    program: Program
    events: list[Any]
    starts: list[Any] | None
    compute: bool
    implicit: bool
    stream: Any
    cursor: int = 0
    index: int = 0
    cstream: Any = None  # what compute ops wait and record on: ``stream``, or its RawStream
    fast: tuple[Any, ...] | None = None  # driver calls: fast_segments(program, cu, compute stream handle)
    # A compute's event record held back to the next driver call of the run: (record fn, args, op index).
    pending: tuple[Any, tuple, int] | None = None
    # The driver-call path's segment for the next compute (an entry of ``fast``) while every compute of the run
    # takes that path in order (no graphs, computing, nothing issued out of turn); None otherwise.
    next: tuple[Any, ...] | None = None


def compile_schedule(sch: Schedule, layout: ModelLayout, store: HostStore,
                     slot_span: Callable[[int, int], torch.Tensor], landing_span: Callable[[int, int], torch.Tensor],
                     callers: Sequence[Sequence[Any]], streams: tuple[Any, Any],
                     new_event: Callable[[], Any], raw_stream: Callable[[Any], int] | None = None) -> Program:
    """Resolve every op of ``sch`` against the buffers (``slot_span(block, slot)`` / ``landing_span(block,
    landing)``: the bytes a block occupies there; ``streams`` = (H2D stream, all-gather stream)); ``raw_stream``
    (a stream's handle): also resolve the copies to pointers for the driver-call loop."""
    kinds, op_streams, args = [], [], []
    for op in sch.ops:
        shard = layout.shards[op.block]
        if op.kind == H2D:
            kinds.append(_H2D)
            op_streams.append(streams[0])
            dst = slot_span(op.block, op.slot) if op.slot is not None else landing_span(op.block, op.landing)
            args.append(tuple((dst[s.dst_start : s.dst_start + s.src.numel()], s.src)
                              for s in store.sources[op.block]))
        elif op.kind == AG:
            kinds.append(_AG)
            op_streams.append(streams[1])
            n = shard.shard_bytes
            args.append(((slot_span(op.block, op.slot)[: n * layout.num_shards],
                          landing_span(op.block, op.landing)[:n]),))
        else:
            kinds.append(_C)
            op_streams.append(None)
            caller = callers[op.block][op.slot]
            if getattr(caller, "per_request", False):  # a block graph's caller: one graph per request
                caller = functools.partial(caller, request=op.request)
            args.append((op.block, caller))
    carry: list[list[str]] = [[] for _ in sch.ops]
    for buf, i in sch.first_use:
        carry[i].append(buf)
    _merge_group_loads(kinds, args, sch.load_group_last, sch.deps, carry, layout.load_group > 1)
    if layout.load_group > 1:
        _check_group_gathers(sch, layout, kinds, args)
    nxt, upcoming = [0] * (len(sch.ops) + 1), len(sch.ops)
    for i in range(len(sch.ops), -1, -1):
        if i < len(sch.ops) and kinds[i] == _C:
            upcoming = i
        nxt[i] = upcoming
    events = [new_event() for _ in sch.ops]
    raw = None
    if raw_stream is not None:
        # Driver calls issue the copies and events; an all-gather's collective is bound by fast_segments (its
        # stream handle here, its copies none).
        raw = tuple(None if k == _C else (raw_stream(s), () if k == _AG else tuple(
            (dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), src.device.type != "cpu")
            for dst, src in a))
            for k, s, a in zip(kinds, op_streams, args))
    return Program(sch, tuple(kinds), tuple(op_streams), sch.deps, tuple(tuple(c) for c in carry), tuple(args),
                   tuple(nxt), events, sch.carried_last_use, raw, recorded=sch.recorded)


def _merge_group_loads(kinds: Sequence[int], args: list[Any], lead: tuple[int | None, ...],
                       deps: Sequence[tuple[int, ...]], carry: Sequence[list[str]], spans: bool = False) -> None:
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
    for i in range(len(args)):
        if lead[i] is None:
            into = None
            continue
        if into is None or lead[into] != lead[i] or deps[i] or not args[i] or not args[into]:
            into = i
            continue
        if kinds[i] == _AG and not spans:
            args[into], args[i] = (*args[into], *args[i]), ()
        else:
            (d0, s0), (d1, s1) = args[into][-1], args[i][0]
            if not (_continues(d0, d1) and _continues(s0, s1)):
                into = i
                continue
            joined = (_byte_view(d0, d0.numel() + d1.numel()), _byte_view(s0, s0.numel() + s1.numel()))
            args[into] = (*args[into][:-1], joined, *args[i][1:])
            args[i] = ()
        carry[into].extend(buf for buf in carry[i] if buf not in carry[into])
        carry[i].clear()


def _check_group_gathers(sch: Schedule, layout: ModelLayout, kinds: Sequence[int], args: Sequence[Any]) -> None:
    """ScheduleError unless every all-gather of a grouped layout is one whole group's (one pair of ``G`` pieces):
    a part of a group gathers rank-major pieces that are no block (a schedule whose load groups are not the
    layout's, or a run that splits a group)."""
    g = layout.load_group
    for i, kind in enumerate(kinds):
        if kind != _AG or not args[i]:
            continue
        op = sch.ops[i]
        want = g * layout.shards[op.block].shard_bytes
        if len(args[i]) != 1 or args[i][0][1].numel() != want or layout.shards[op.block].member:
            raise ScheduleError(
                f"op {i} ({op}): the layout gathers blocks {g} at a time (one all-gather per group), but this "
                f"schedule's all-gather there is not one whole group's (load_group = {sch.load_group}, slot_offset "
                f"= {sch.slot_offset}, landing_offset = {sch.landing_offset}): run the ring's schedules "
                f"(load_group = {g}) on it")


def _continues(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b``'s bytes start where ``a``'s end, in the same storage (both flat uint8 views)."""
    return (a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.data_ptr() + a.numel() == b.data_ptr())


def _byte_view(t: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` bytes of ``t``'s storage from ``t``'s first byte."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), t.storage_offset(), (n,))


def fast_segments(p: Program, cu: Any, compute_handle: int, carry: Mapping[str, int] | None = None,
                  bind_gather: Callable[[tuple], tuple[tuple[Any, tuple], ...]] | None = None) -> tuple[Any, ...]:
    """Per op index: for a compute op, its segment (the ops since the previous compute, then its own waits) as
    ``(start, calls, record_fn, record_args, num_loads, block, caller, index, last, next)``: ``start`` the cursor
    the segment begins at, ``calls`` the driver calls ``(fn, args)`` in issue order, ``record_fn(*record_args)``
    records the compute's event (``record_fn`` None: nothing waits on it), ``block`` / ``caller`` the compute's
    block index and bound call, ``index`` its op index, ``last`` whether it is the run's last compute and
    ``next`` the next compute's segment (which starts right after it); None elsewhere (the ops after the last
    compute, the next run's prefetch, are issued by ``end_run`` through :func:`~dlo_fn.runtime.issue.issue_until`).

    Events are the program's own (driver calls run only without a recorder), so every handle is fixed at compile
    time but those of the previous run: ``carry`` (buffer -> event handle of the previous run's last use) binds
    the waits of the buffers' first uses, and is part of the cache key (a steady ring runs after the same
    program, so it binds once). An all-gather op is its waits, the calls ``bind_gather(pairs)`` (the executor's
    bound collective on the all-gather stream: ``ncclAllGather`` calls on its own communicator, or one call that
    returns to the compute stream after c10d's) and its record. Only the events something waits on are recorded
    (``Program.recorded``); with load groups (:mod:`dlo_fn.plan.lowering`) that drops the records of all but a
    group's last H2D (and AG) and of all but the computes a load waits on, and a group's copies and all-gathers were
    joined at compile time (copies where their bytes continue)."""
    carry = carry or {}
    key = (compute_handle, tuple(sorted(carry.items())))
    cached = p.fast.get(key)
    if cached is not None:
        return cached
    handles = [ev.handle for ev in p.events]
    out: list[Any] = [None] * (len(p.kinds) + 1)  # indexed by next_compute, which is len(kinds) past the last
    start, calls, loads = 0, [], 0
    for i, kind in enumerate(p.kinds):
        h = compute_handle if kind == _C else p.raw[i][0]
        calls.extend(cu.bind_wait(h, handles[d]) for d in p.waits[i])
        calls.extend(cu.bind_carry_wait(h, carry[buf]) for buf in p.carry[i] if buf in carry)
        if kind == _C:
            record = cu.bind_record(handles[i], h) if i in p.recorded else (None, ())
            out[i] = (start, tuple(calls), *record, loads, *p.args[i], i)
            start, calls, loads = i + 1, [], 0
            continue
        calls.extend(cu.bind_copy(dst, src, n, h, dev) for dst, src, n, dev in p.raw[i][1])
        if kind == _AG and p.args[i]:
            if bind_gather is None:
                raise ValueError("a program with all-gathers needs bind_gather for its driver-call segments")
            calls.extend(bind_gather(p.args[i]))
        if i in p.recorded:
            calls.append(cu.bind_record(handles[i], h))
        loads += 1
    nxt = None  # link each compute's segment to the next one's, from the last compute back
    for i in reversed(range(len(p.kinds))):
        if out[i] is not None:
            out[i] = nxt = (*out[i], nxt is None, nxt)
    p.fast[key] = result = tuple(out)
    return result
