"""The executor: device slots and landing buffers, three streams, events; it interprets the schedule it is handed.

State (all allocated once, in ``__init__``):

* ``num_slots`` slots of ``ModelLayout.max_padded_block_bytes`` (a gathered block; one allocation, slot ``s`` at
  ``s x`` the slot size, so a load group's copies into consecutive slots can be one; a grouped layout places a
  group's blocks at its own stride from the group's first slot, :meth:`Executor.slot_span`) and, in allgather mode,
  ``num_landing`` landing buffers of ``max_shard_bytes`` (a local shard; one allocation too): device weight bytes are
  ``S x max_padded_block + N x max_shard``, whatever the depth;
* typed weight views per (slot, block layout), and per (op kind, block, buffer) byte views, built per
  schedule when it is first compiled and reused every time that schedule runs;
* a copy stream (H2D), a communication stream (all-gather); compute runs on the caller's current stream;
* the :class:`~dlo_fn.plan.schedule.Ring` the next run continues (a frozen plan value: slot and landing
  offsets, whether the last run prefetched), replaced after every run.

A *run* is one :class:`~dlo_fn.plan.schedule.Schedule` (``num_steps`` passes over the blocks, ``R`` requests
per load). The executor makes no scheduling decision: a run follows either a schedule the caller hands it (which
must continue :attr:`Executor.ring`; checked in full when first compiled) or the one the ring gives
(``ring.next_schedule(T, R)``, which prefetches the first loads of the next run, so the ring of loads never
stops: block 0 of the next step or request is loaded during the last block). The executor compiles each
schedule once, caches it, and walks its ops in issue order: each op waits on the events of its ``deps`` (and,
for a buffer's first use in the run, on the previous run's last use of it), is launched on its stream and
records its event if a later op or the next run waits on it. There is no host synchronisation in the steady
state.

A block proxy's call advances the cursor to the next compute op, issuing the loads in front of it (the
schedule puts the loads of block k+1 before the compute of block k), checks that it is the expected block,
and runs the block on its slot's views. Runs start implicitly (one step, R = 1) when a proxy is called with no
run open, which makes any ``model(...)`` call work; engines open explicit runs with :meth:`Executor.run`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from time import perf_counter as _clock  # the per-block path reads it as one global
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dlo_fn.plan.layout import ModelLayout
from dlo_fn.plan.modes import OFFLOAD_MODES, check_mode
from dlo_fn.plan.schedule import Ring, Schedule, ScheduleError
from dlo_fn.plan.timeline import Timeline
from dlo_fn.runtime.block_graph import BlockGraphs
from dlo_fn.runtime.blocks import layout_key, make_caller, make_views
from dlo_fn.runtime.cuda_raw import RawStream, raw_cuda, stream_handle
from dlo_fn.runtime.dist import all_gather_bytes, bound_all_gather
from dlo_fn.runtime.graph import StepGraphs, graph_support
from dlo_fn.runtime.host_store import HostStore
from dlo_fn.runtime.issue import flush_record, issue_until, wait_for
from dlo_fn.runtime.platform import Platform
from dlo_fn.runtime.program import _C, ExecutorStats, Program, Programs, RunState, compile_schedule, fast_segments
from dlo_fn.runtime.recorder import RunRecorder

__all__ = ["Executor", "ExecutorStats", "GRAPH_SCOPES", "ScheduleError"]

GRAPH_SCOPES = (False, True, "step", "block")  # graph=: none, the step (True = "step"), each block's compute

log = logging.getLogger(__name__)


class Executor:
    """Runs offloaded blocks from a :class:`HostStore` through device slots, interpreting the schedules it is
    handed (or that its :class:`~dlo_fn.plan.schedule.Ring` gives).

    ``blocks[b]`` is block ``b``'s module with meta weights (see :func:`~dlo_fn.runtime.blocks.strip_block`),
    ``aliases[b]`` its tied-weight names. ``group`` is the shard group (None: a single process, the
    "all-gather" of one rank is a copy). ``async_collectives`` (CPU/gloo) issues all-gathers with
    ``async_op=True`` and waits for them at their dependents, overlapping communication with compute on CPU.
    ``collective_timeout_s`` bounds the own NCCL communicator's all-gathers (:mod:`dlo_fn.runtime.nccl_raw`;
    default: the process group's timeout).
    """

    def __init__(self, platform: Platform, layout: ModelLayout, store: HostStore, blocks: Sequence[nn.Module],
                 aliases: Sequence[Mapping[str, tuple[str, ...]]] | None = None, *, group: Any = None,
                 mode: str = "allgather", num_slots: int = 2, num_landing: int | None = None,
                 block_call: str = "swap", async_collectives: bool = False,
                 record_timeline: bool = False, rank: int = 0, graph: bool | str = False,
                 graph_shapes: int = 4, load_group: int = 1, gather_one_rank: bool = False,
                 collective_timeout_s: float | None = None) -> None:
        check_mode(mode, OFFLOAD_MODES, "executor mode")
        if graph not in GRAPH_SCOPES:
            raise ValueError(f"graph must be one of False, True, 'step', 'block'; got {graph!r}")
        if graph_shapes < 1:
            raise ValueError(f"graph_shapes must be >= 1, got {graph_shapes}")
        self.graph_shapes = graph_shapes
        if len(blocks) != layout.num_blocks:
            raise ValueError(f"{len(blocks)} block modules for a layout of {layout.num_blocks} blocks")
        if mode == "rank-local" and layout.num_shards != 1:
            raise ValueError("rank-local mode streams whole blocks: build its layout with num_shards=1")
        if group is None and layout.num_shards != 1:
            raise ValueError(f"a layout sharded over {layout.num_shards} ranks needs a process group")
        self.platform, self.layout, self.store, self.group = platform, layout, store, group
        # gather_one_rank (benchmarks): a group of one rank keeps the allgather op sequence, its all-gather a real
        # one-rank collective, so that the W > 1 path's host cost is measured on one GPU (bench.allgather_host).
        one_rank = gather_one_rank and group is not None and mode == "allgather" and layout.num_shards == 1
        self._gather_group = group if layout.num_shards > 1 or one_rank else None
        self.mode, self.rank, self.block_call = mode, rank, block_call
        # The ring checks slots and landing buffers; rank-local has none, whatever num_landing says (one
        # OffloadOptions carries it for both modes). An all-gather over one rank is the identity: the plan lowers
        # it to the rank-local ring (H2D straight into the slot, no landing buffer, no AG op), so the ring's mode
        # is the program's (what the timeline records) and ``mode`` the one asked for.
        self.ring = Ring.cold(layout.num_blocks, num_slots=num_slots, mode=mode,
                              num_landing=num_landing if mode == "allgather" else None,
                              num_shards=None if one_rank else layout.num_shards, load_group=load_group)
        self.load_group = load_group
        if layout.load_group > 1 and layout.load_group != load_group:
            raise ValueError(f"the layout groups its blocks {layout.load_group} at a time (one all-gather per group), "
                             f"the executor was asked for load_group = {load_group}: pass load_group = "
                             f"{layout.load_group}, or build the layout with load_group = {load_group}")
        self.num_slots, self.num_landing = self.ring.num_slots, self.ring.num_landing
        self.async_collectives = async_collectives and not platform.is_accelerator
        self.record_timeline = record_timeline
        self.blocks = tuple(blocks)
        self.aliases = tuple(aliases) if aliases is not None else tuple({} for _ in blocks)
        dev = platform.device
        before = platform.memory_allocated()
        slot_bytes = layout.max_padded_block_bytes
        self._ring_buffer = torch.empty(num_slots * slot_bytes, dtype=torch.uint8, device=dev)
        self.slots = tuple(self._ring_buffer[s * slot_bytes : (s + 1) * slot_bytes] for s in range(num_slots))
        landing_bytes = layout.max_shard_bytes  # one allocation too: a load group's shards land side by side
        self._landing_buffer = torch.empty(self.num_landing * landing_bytes, dtype=torch.uint8, device=dev)
        self.landing = tuple(self._landing_buffer[n * landing_bytes : (n + 1) * landing_bytes]
                             for n in range(self.num_landing))
        self.measured_device_bytes = platform.memory_allocated() - before
        self._set_stream = platform.stream_setter()
        self.h2d_stream = platform.new_stream("h2d")
        self.allgather_stream = platform.new_stream("allgather")
        # Views: one dict per (slot, distinct block layout); one caller per (block, slot).
        self.block_graphs = None
        if graph == "block":  # the collectives stay eager: only the device matters
            why = graph_support(platform)
            if why:
                log.warning("cuda graph (per block): %s; running eager", why)
            else:
                self.block_graphs = BlockGraphs(graph_shapes)
        shared: dict[tuple, dict[str, torch.Tensor]] = {}
        self._callers: list[tuple[Any, ...]] = []
        for b, shard in enumerate(layout.shards):
            key = layout_key(shard.block, dict(self.aliases[b]))
            views = []
            for s in range(num_slots):
                span = self.slot_span(b, s)
                at = (key, span.data_ptr())  # a grouped layout places a block at its group's stride in the slots
                if at not in shared:
                    shared[at] = make_views(span, shard.block, dict(self.aliases[b]))
                views.append(shared[at])
            callers = [make_caller(block_call, self.blocks[b], views[s]) for s in range(num_slots)]
            if self.block_graphs is not None:
                callers = [self.block_graphs.wrap(c, b, s) for s, c in enumerate(callers)]
            self._callers.append(tuple(callers))
        self.num_view_sets = len(shared)
        # Driver calls for the eager loop's copies and events (pinned arena, no recorder); an all-gather (W > 1) is
        # bound ncclAllGather calls on the executor's own communicator between them (runtime.nccl_raw), or one
        # bound call of its process group, on the all-gather stream (_bind_gather).
        self._raw = (raw_cuda(platform) if store.arena is not None and not record_timeline
                     and not self.async_collectives else None)
        # On the driver-call path a compute's event record is issued with the next block's driver calls instead
        # of right after its block call: a driver call made just after a block's Python costs ~4 us more than
        # one made after another call (cold caches; bench.driver_cost), so the pass pays that once per block, not
        # twice. The record then also covers the kernels the model launched between the two blocks, which only
        # frees the slot a little later; it is still issued before any wait on it (the next load's wait is in
        # the next segment). The last compute of a run records at once. ``DLO_FN_DEFER_RECORD=0`` turns it off.
        self._defer_record = os.environ.get("DLO_FN_DEFER_RECORD", "1") != "0"
        self._programs = Programs(self._compile)
        self._carry: dict[str, Any] = {}
        self._run: RunState | None = None
        self._recorder = RunRecorder(platform, rank) if record_timeline else None
        self._run_count = 0
        self.stats = ExecutorStats()
        self._nccl = None
        if self._gather_group is not None and mode == "allgather":
            self._warm_up_collective()
            self._nccl = self._own_communicator(collective_timeout_s)
        self.graphs = None
        if graph in (True, "step"):
            backend = dist.get_backend(self._gather_group) if self._gather_group is not None else None
            why = graph_support(platform, layout.num_shards, backend) or (
                store.arena is None and "the rank-local mmap source is pageable memory, which a CUDA graph cannot "
                                        "copy from")
            if why:
                log.warning("cuda graph: %s; running eager", why)
            else:
                self.graphs = StepGraphs(self)

    # -- memory --------------------------------------------------------------------------------------------
    @property
    def device_weight_bytes(self) -> int:
        """Bytes of the slots and landing buffers (their storages): the executor's whole weight footprint."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.slots + self.landing}
        return sum(storages.values())

    def slot_span(self, block: int, slot: int) -> torch.Tensor:
        """The bytes of ``slot`` that ``block`` occupies there: in a grouped layout (:mod:`dlo_fn.plan.layout`)
        member ``g`` of a group's ``G`` consecutive slots lies ``g`` times the group's stride from the first of them
        (where one all-gather of the group writes it); with ``G = 1``, at the slot's start."""
        return self._span(self._ring_buffer, self.layout.max_padded_block_bytes, slot,
                          self.layout.shards[block].padded_bytes)

    def landing_span(self, block: int, landing: int) -> torch.Tensor:
        """The bytes of landing buffer ``landing`` that ``block``'s shard lands in (grouped layout: at the
        group's piece size from the group's first landing buffer; see :meth:`slot_span`)."""
        return self._span(self._landing_buffer, self.layout.max_shard_bytes, landing,
                          self.layout.shards[block].shard_bytes)

    def _span(self, buffer: torch.Tensor, unit: int, index: int, size: int) -> torch.Tensor:
        """``size`` bytes of buffer ``index`` (of ``unit`` bytes each, one allocation), member ``index % G`` of its
        load group placed at ``size`` apart from the group's first buffer."""
        g = self.layout.load_group
        start = (index - index % g) * unit + (index % g) * size
        return buffer[start : start + size]

    @property
    def planned_device_weight_bytes(self) -> int:
        return self.num_slots * self.layout.max_padded_block_bytes + self.num_landing * self.layout.max_shard_bytes

    # -- schedules ------------------------------------------------------------------------------------------
    def _warm_up_collective(self) -> None:
        """Create the communicator now (NCCL/HCCL do it lazily on the first collective, with allocations)."""
        with self.platform.use_stream(self.allgather_stream):
            all_gather_bytes(*self._first_gather(), self.group)
        self.platform.synchronize()

    def _first_gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, input)`` of block 0's all-gather into slot 0 from landing buffer 0 (the warm-ups)."""
        n = self.layout.shards[0].shard_bytes
        return self.slots[0][: n * self.layout.num_shards], self.landing[0][:n]

    def _own_communicator(self, timeout_s: float | None) -> Any:
        """The driver-call path's NCCL communicator (:mod:`dlo_fn.runtime.nccl_raw`), warmed up and watched, or
        None (c10d's calls; why is logged once). Every rank of the shard group calls it (it agrees first)."""
        if self.platform.kind != "cuda":
            return None
        from dlo_fn.runtime.dist import DEFAULT_TIMEOUT_S
        from dlo_fn.runtime.nccl_raw import RAW_NCCL_ENV, group_timeout_s, own_communicator

        off = os.environ.get(RAW_NCCL_ENV, "1") == "0"
        why = (f"{RAW_NCCL_ENV}=0" if off else
               "the driver-call path is off (no pinned arena, a recorded timeline, or DLO_FN_RAW_CUDA=0)")
        group, dev = self._gather_group, self.platform.device
        if timeout_s is None:
            timeout_s = group_timeout_s(group, dev, DEFAULT_TIMEOUT_S)
        comm, why = own_communicator(group, dev, self._raw is not None and not off, why, timeout_s)
        if comm is None:
            log.info("all-gathers through torch.distributed's calls: %s", why)
            return None
        handle = stream_handle(self.allgather_stream)
        comm.all_gather((self._first_gather(),), handle)
        self.platform.synchronize()
        comm.watch(self._raw, handle, timeout_s)
        weakref.finalize(self, comm.close)
        log.info("all-gathers on the executor's own NCCL communicator (NCCL %d, %d ranks, timeout %.0f s)",
                 comm.nccl.version, comm.world, timeout_s)
        return comm

    def _bind_gather(self, pairs: tuple, restore: Any) -> tuple[tuple[Any, tuple], ...]:
        """The driver-call segment's calls ``(fn, args)`` that issue the all-gather of ``pairs`` (one collective)
        on the all-gather stream, ordered after the waits issued on its handle just before: the bound
        ``ncclAllGather`` calls of the executor's own communicator (:meth:`NcclComm.bind
        <dlo_fn.runtime.nccl_raw.NcclComm.bind>`), or else one ``fn()`` that makes the all-gather stream current,
        calls :func:`~dlo_fn.runtime.dist.bound_all_gather`, makes ``restore`` (the compute stream) current
        again and returns 0 (a driver call's success)."""
        if self._nccl is not None:
            return self._nccl.bind(pairs, stream_handle(self.allgather_stream))
        call, set_stream, stream = bound_all_gather(pairs, self._gather_group), self._set_stream, self.allgather_stream

        def gather() -> int:
            set_stream(stream)
            try:
                call()
            finally:
                set_stream(restore)
            return 0

        return ((gather, ()),)

    def _gather_now(self, pairs: tuple, restore: Any) -> None:
        """The all-gather of ``pairs`` now (the driver-call issue loop outside the segments: ``end_run``)."""
        for fn, args in self._bind_gather(pairs, restore):
            if code := fn(*args):
                raise RuntimeError(_failed_call(fn, code, self._nccl))

    def next_schedule(self, num_steps: int = 1, requests_per_load: int = 1) -> Schedule:
        """The schedule the ring gives for the next run (cold for the first run or after an error)."""
        return self.ring.next_schedule(num_steps, requests_per_load)

    def _compile(self, sch: Schedule) -> Program:
        raw = self._raw
        return compile_schedule(sch, self.layout, self.store, self.slot_span, self.landing_span, self._callers,
                                (self.h2d_stream, self.allgather_stream),
                                raw.new_event if raw is not None else self.platform.new_event,
                                stream_handle if raw is not None else None)

    # -- runs -----------------------------------------------------------------------------------------------
    @property
    def in_run(self) -> bool:
        return self._run is not None

    def begin_run(self, num_steps: int | None = None, requests_per_load: int | None = None, *,
                  schedule: Schedule | None = None, compute: bool = True, _implicit: bool = False) -> Schedule:
        """Open a run of ``num_steps`` passes over the blocks (default 1) with ``requests_per_load`` computes per
        loaded block (block-major, default 1), following the ring's next schedule, or ``schedule`` if handed
        (it must start from :attr:`ring`). ``compute=False``: take part in every load and all-gather, compute
        nothing (an idle rank of a partial wave); the ops are issued by :meth:`end_run`."""
        if self._run is not None:
            raise ScheduleError("a run is already open: end it (end_run / leave the `with run()` block) first")
        if not self.slots:
            raise ScheduleError("this executor was released (its device buffers are gone): build a new one")
        program = self._programs.get(self.ring, num_steps, requests_per_load, schedule)
        if self.graphs is not None:
            self.graphs.reset()
        if self._recorder is not None:
            events, starts = self._recorder.run_events(len(program.kinds))
        else:
            events, starts = program.events, None
        stream = self.platform.current_stream()
        cstream, fast = stream, None
        if self._raw is not None:
            cstream = RawStream(self._raw, stream_handle(stream))
            carry = {buf: ev.handle for buf, ev in self._carry.items() if ev is not None}
            fast = fast_segments(program, self._raw, cstream.handle, carry,
                                 lambda pairs: self._bind_gather(pairs, stream))
        first = fast[program.next_compute[0]] if fast is not None and compute and self.graphs is None else None
        self._run = RunState(program, events, starts, compute, _implicit, stream, index=self._run_count,
                             cstream=cstream, fast=fast, next=first)
        self._run_count += 1
        self.stats.runs += 1
        return program.schedule

    def end_run(self) -> None:
        """Issue what is left (all of it for ``compute=False``) and hand the buffers to the next run."""
        run = self._run
        if run is None:
            raise ScheduleError("no run is open")
        n = len(run.program.kinds)
        if run.compute and run.program.next_compute[run.cursor] < n:
            left = sum(1 for k in run.program.kinds[run.cursor:] if k == _C)
            self.abort()
            raise ScheduleError(f"run ended with {left} block computes not done: the model called fewer blocks "
                                f"than the schedule's {run.program.schedule.num_steps} step(s) x "
                                f"{run.program.schedule.num_blocks} blocks x {run.program.schedule.requests_per_load}")
        issue_until(self, run, n)
        self._carry = {buf: run.events[i] for buf, i in run.program.last_use}
        self.ring = self.ring.after(run.program.schedule)
        if self._recorder is not None:
            self._recorder.add_run(run.index, run.program.schedule, run.starts, run.events)
        self._run = None

    @contextlib.contextmanager
    def run(self, num_steps: int | None = None, requests_per_load: int | None = None, *,
            schedule: Schedule | None = None, compute: bool = True) -> Iterator[Schedule]:
        """``with executor.run(T, R): ...`` (or ``run(schedule=s)``) around the model calls of one run (see
        :meth:`begin_run`)."""
        schedule = self.begin_run(num_steps, requests_per_load, schedule=schedule, compute=compute)
        try:
            yield schedule
        except BaseException:
            self.abort()
            raise
        self.end_run()

    def idle(self, num_steps: int = 1) -> None:
        """A run with no compute: this rank serves its shards to the all-gathers and nothing else."""
        with self.run(num_steps, 1, compute=False):
            pass

    def drain(self) -> None:
        """End the open run without computing what is left: its remaining loads and all-gathers are issued, so
        the other ranks' collectives complete (use after a compute failed mid-run; the ring stays intact)."""
        if self._run is None:
            raise ScheduleError("no run is open to drain")
        self._run.compute = False
        self._run.next = None
        self.end_run()

    def abort(self) -> None:
        """Drop the open run after an error: wait for the device, restart the ring (the next run starts cold).

        The previous run's prefetched all-gathers (held in the carried events) are waited for too: on CPU they
        may still be writing a slot that the next, cold run reuses. The state is reset even if a wait raises."""
        try:
            self.synchronize()
        finally:
            self._run = None
            self.ring, self._carry = self.ring.restart(), {}
            if self.graphs is not None:
                self.graphs.reset()

    def release(self) -> None:
        """Give back the device buffers: abort any run, then drop the slots, the landing buffers and everything
        that points into them (the views in the block callers, the compiled programs, the graphs), so another
        executor can take their memory. This executor cannot run again."""
        try:
            self.abort()
        except Exception:  # noqa: BLE001 - a broken run (a dead peer) may fail its wait; the buffers go anyway
            pass
        self.slots, self.landing, self._callers = (), (), []
        self._ring_buffer = self._landing_buffer = None
        self._programs, self._carry = Programs(self._compile), {}
        self.graphs = self.block_graphs = None
        if self._nccl is not None:
            self._nccl.close()
            self._nccl = None

    def synchronize(self) -> None:
        """Wait for everything issued so far (tests, timing, shutdown); never called in the steady state."""
        if self._run is not None:
            for ev in self._run.events:
                if hasattr(ev, "work") and ev.work is not None:
                    ev.wait()
        for ev in self._carry.values():
            if hasattr(ev, "work") and ev.work is not None:
                ev.wait()
        self.platform.synchronize()

    # -- issuing: runtime/issue.py ---------------------------------------------------------------------------
    def compute(self, block_index: int, args: tuple, kwargs: dict) -> Any:
        """Run block ``block_index`` for the next compute op of the open (or an implicit) run."""
        t0 = _clock()
        run = self._run
        if run is not None:  # the driver-call path, its segments in order: one bound segment per block
            seg = run.next
            if seg is not None and seg[5] == block_index:
                return self._compute_fast(run, seg, args, kwargs, t0)
        if run is None:
            self.begin_run(1, 1, _implicit=True)
            run = self._run
        elif not run.compute:
            raise ScheduleError("block called during a compute=False run: this rank must not run the model")
        p = run.program
        i = p.next_compute[run.cursor]
        if i >= len(p.kinds):
            self.abort()
            raise ScheduleError(f"block {block_index} called but the run's {p.schedule.num_blocks} x "
                                f"{p.schedule.num_steps} x {p.schedule.requests_per_load} computes are all done: "
                                f"open a run with more steps or requests")
        expected, caller = p.args[i]
        if expected != block_index:
            op = p.schedule.ops[i]
            self.abort()
            raise ScheduleError(f"block {block_index} ({self.layout.shards[block_index].block.name}) called, but "
                                f"the schedule expects block {expected} ({self.layout.shards[expected].block.name}) "
                                f"next ({op}): the model must call every block of the block list(s) once per "
                                f"pass, in order (and, for R requests, each block R times in a row)")
        graphs = self.graphs
        if graphs is not None:
            handled, out = graphs.compute(run, i, args, kwargs)
            if handled:
                if run.implicit and p.next_compute[run.cursor] >= len(p.kinds):
                    self.end_run()
                self.stats.computes += 1
                self.stats.issue_s += _clock() - t0
                return out
        seg = run.fast[i] if run.fast is not None else None
        if seg is not None and seg[0] == run.cursor:  # graph mode's eager (recorded) steps
            return self._compute_fast(run, seg, args, kwargs, t0)
        issue_until(self, run, i)
        stream, events = run.cstream, run.events
        wait_for(stream, p, i, events, self._carry)
        if run.starts is not None:
            run.starts[i].record(stream)
        t1 = _clock()
        out = caller(args, kwargs)
        t2 = _clock()
        if run.starts is not None or i in p.recorded:  # an event nothing waits on is not recorded (Program)
            events[i].record(stream)
        if graphs is not None:
            graphs.after_eager(run, i, out)
        run.cursor = i + 1
        if run.implicit and p.next_compute[run.cursor] >= len(p.kinds):
            self.end_run()
        st = self.stats
        st.computes += 1
        st.call_s += t2 - t1
        st.issue_s += (t1 - t0) + (_clock() - t2)
        return out

    def _compute_fast(self, run: RunState, seg: tuple, args: tuple, kwargs: dict, t0: float) -> Any:
        """:meth:`compute` on the driver-call path: the segment's bound calls (its loads, then this compute's
        waits), the block, its record (see :func:`~dlo_fn.runtime.program.fast_segments`)."""
        _, calls, record, rargs, loads, _, caller, i, last, nxt = seg
        run.cursor = i
        if run.pending is not None:
            flush_record(self, run)
        for fn, a in calls:
            if code := fn(*a):
                self._driver_failed(run, fn, code, i)
        t1 = _clock()
        out = caller(args, kwargs)
        t2 = _clock()
        graphs = self.graphs
        if record is None:  # nothing waits on this compute (fast_segments)
            pass
        elif self._defer_record and not last and graphs is None:
            run.pending = (record, rargs, i)  # issued first thing at the next driver call (see __init__)
        elif code := record(*rargs):
            self._driver_failed(run, record, code, i)
        if graphs is not None:  # an eager step of graph mode: its wiring is recorded for the capture
            graphs.after_eager(run, i, out)
        run.cursor = i + 1
        if run.next is not None:  # on the in-order path (see begin_run): the next compute's segment
            run.next = nxt
        if last and run.implicit:
            self.end_run()
        st = self.stats
        st.computes += 1
        st.loads += loads
        st.call_s += t2 - t1
        st.issue_s += (t1 - t0) + (_clock() - t2)
        return out

    def _driver_failed(self, run: RunState, fn: Any, code: int, i: int) -> None:
        op = run.program.schedule.ops[i]
        self.abort()
        raise RuntimeError(f"{_failed_call(fn, code, self._nccl)} while issuing up to {op}; the run was aborted "
                           "(the next one starts cold)")

    # -- measured timeline ----------------------------------------------------------------------------------
    @property
    def timeline_origin_s(self) -> float | None:
        """Host-clock time (``time.perf_counter`` seconds) of the timeline's zero on CPU; None on devices
        (their spans are on the device clock) or before the first recorded run."""
        return self._recorder.origin_s if self._recorder is not None else None

    def take_timeline(self, meta: Sequence[tuple[str, str]] = ()) -> Timeline:
        """The ops of every run since the last call, with measured start/end (seconds from the first run's
        start; device events on CUDA/NPU, host clocks on CPU). Synchronises. Needs ``record_timeline``."""
        if not self.record_timeline:
            raise ValueError("construct the executor with record_timeline=True to measure a timeline")
        self.synchronize()
        base = (("source", "measured"), ("platform", self.platform.kind), ("mode", self.ring.mode),
                ("num_blocks", str(self.layout.num_blocks)), ("num_slots", str(self.num_slots)),
                # "world_size": the key the committed measured timelines (figures/data) carry for num_shards.
                ("num_landing", str(self.num_landing)), ("world_size", str(self.layout.num_shards)))
        return self._recorder.take(base + tuple(meta))


def _failed_call(fn: Any, code: int, nccl: Any) -> str:
    """One line for a driver or NCCL call that returned ``code``."""
    name = getattr(fn, "__name__", str(fn))
    if name.startswith("nccl") and nccl is not None:
        return f"NCCL call {name} failed: {nccl.nccl.error(code)} (ncclResult_t {code})"
    return f"CUDA driver call {name} failed with CUresult {code}"
