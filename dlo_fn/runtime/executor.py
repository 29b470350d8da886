"""The executor: device slots and landing buffers, three streams, events; it interprets the schedule it is handed.

State, allocated once: the slots and landing buffers (:mod:`dlo_fn.runtime.slots`), typed weight views per (slot,
block layout), per schedule its compiled program (:mod:`dlo_fn.runtime.program`), a copy stream (H2D) and a
communication stream (all-gather), compute running on the caller's current stream, and the
:class:`~dlo_fn.plan.schedule.Ring` the next run continues.

A *run* is one :class:`~dlo_fn.plan.schedule.Schedule` (``num_steps`` passes over the blocks, ``R`` requests per
load). The executor makes no scheduling decision: a run follows a schedule the caller hands it (which must continue
:attr:`Executor.ring`) or the one the ring gives (``ring.next_schedule(T, R)``, which prefetches the first loads of
the next run, so the ring of loads never stops). Ops are issued through torch streams and events
(:mod:`dlo_fn.runtime.issue`), the one path on every platform; a recorded Timeline shows what ran. A block
proxy's call advances the cursor to the next compute op, issuing the loads in front of it, checks that it is the
expected block and runs it on its slot's views. A proxy called with no run open starts an implicit one (one step,
R = 1), so any ``model(...)`` call works; engines open explicit runs with :meth:`Executor.run`.

**Plug-ins** (opt-in accelerators in :mod:`dlo_fn.runtime.cuda`, which ``offload`` resolves from
:class:`~dlo_fn.runtime.options.OffloadOptions`; the executor never imports them) see one small interface,
:class:`CallPlugin`: ``wrap(caller, block, slot)`` returns the call a compute op makes instead of ``caller``;
``clear()`` drops what they hold when the executor is released; ``name`` goes in the Timeline's metadata.
"""

from __future__ import annotations

import contextlib
import logging
from time import perf_counter as _clock  # the per-block path reads it as one global
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Protocol, Sequence

from torch import nn

from dlo_fn.plan.layout import ModelLayout
from dlo_fn.plan.modes import OFFLOAD_MODES, check_mode
from dlo_fn.plan.ops import C
from dlo_fn.plan.schedule import Ring, Schedule, ScheduleError
from dlo_fn.runtime.blocks import build_callers
from dlo_fn.runtime.dist import all_gather_bytes
from dlo_fn.runtime.host_store import HostStore
from dlo_fn.runtime.issue import Issuer
from dlo_fn.runtime.options import OffloadOptions
from dlo_fn.runtime.platform import Platform
from dlo_fn.runtime.program import ExecutorStats, Program, Programs, RunState, compile_schedule
from dlo_fn.runtime.recorder import RunRecorder
from dlo_fn.runtime.slots import SlotBuffers

if TYPE_CHECKING:
    from dlo_fn.plan.timeline import Timeline

__all__ = ["CallPlugin", "Executor", "ExecutorStats", "ScheduleError"]

log = logging.getLogger(__name__)


class CallPlugin(Protocol):
    """What a plug-in that changes how a block is called provides (see the module doc)."""

    name: str

    def wrap(self, caller: Callable[[tuple, dict], Any], block: int, slot: int) -> Callable[..., Any]: ...

    def clear(self) -> None: ...


class Executor:
    """Runs offloaded blocks from a :class:`HostStore` through device slots, interpreting the schedules it is
    handed (or that its :class:`~dlo_fn.plan.schedule.Ring` gives).

    ``blocks[b]`` is block ``b``'s module with meta weights (see :func:`~dlo_fn.runtime.blocks.strip_block`),
    ``aliases[b]`` its tied-weight names. ``options`` gives the mode, slots, landing buffers, load group, block
    call, async collectives (CPU/gloo: all-gathers with ``async_op=True``, waited for at their dependents) and
    whether to record a timeline. ``group`` is the shard group (None: a single process). ``plugin``: see
    :class:`CallPlugin`; ``dequantizer``: the DQ op of quantised shards (default torch ops).
    """

    def __init__(
        self,
        platform: Platform,
        layout: ModelLayout,
        store: HostStore,
        blocks: Sequence[nn.Module],
        aliases: Sequence[Mapping[str, tuple[str, ...]]] | None = None,
        options: OffloadOptions | None = None,
        *,
        group: Any = None,
        rank: int = 0,
        plugin: CallPlugin | None = None,
        dequantizer: Any = None,
    ) -> None:
        options = options or OffloadOptions()
        mode = check_mode(options.mode, OFFLOAD_MODES, "executor mode")
        if len(blocks) != layout.num_blocks:
            raise ValueError(f"{len(blocks)} block modules for a layout of {layout.num_blocks} blocks")
        if mode == "rank-local" and layout.num_shards != 1:
            raise ValueError("rank-local mode streams whole blocks: build its layout with num_shards=1")
        if group is None and layout.num_shards != 1:
            raise ValueError(f"a layout sharded over {layout.num_shards} ranks needs a process group")
        if layout.load_group > 1 and layout.load_group != options.load_group:
            raise ValueError(
                f"the layout groups its blocks {layout.load_group} at a time (one all-gather per group), "
                f"the executor was asked for load_group = {options.load_group}: pass load_group = "
                f"{layout.load_group}, or build the layout with load_group = {options.load_group}"
            )
        self.platform, self.layout, self.store, self.options = platform, layout, store, options
        self.mode, self.rank, self.plugin = mode, rank, plugin
        if dequantizer is None and layout.quantized:
            from dlo_fn.runtime.quant import TorchDequant  # the core's DQ op, loaded with quantised shards only

            dequantizer = TorchDequant()
        self.dequantizer = dequantizer
        # An all-gather over one rank is the identity: the plan lowers it to the rank-local ring, so the ring's
        # mode is the program's (what the timeline records) and ``mode`` the one asked for.
        self.ring = Ring.cold(
            layout.num_blocks,
            num_slots=options.num_slots,
            mode=mode,
            num_landing=options.num_landing if mode == "allgather" else None,
            num_shards=layout.num_shards,
            load_group=options.load_group,
            quantized=layout.quantized,
        )
        self.num_slots, self.num_landing = self.ring.num_slots, self.ring.num_landing
        self.blocks = tuple(blocks)
        self.aliases = tuple(aliases) if aliases is not None else tuple({} for _ in blocks)
        self.buffers = SlotBuffers(platform, layout, self.num_slots, self.num_landing)
        self.slot_span, self.landing_span = self.buffers.slot_span, self.buffers.landing_span
        self.measured_device_bytes = self.buffers.measured_device_bytes
        self.planned_device_weight_bytes = self.buffers.planned_device_bytes
        self.h2d_stream = platform.new_stream("h2d")
        # High priority, as FSDP's all-gather stream: a gather's or a dequantise op's kernels take free
        # multiprocessors before the compute's queued thread blocks, so a load ends during the block before it.
        self.allgather_stream = platform.new_stream("allgather", priority=-1)
        self._callers, self.num_view_sets = build_callers(
            layout, self.blocks, self.aliases, self.num_slots, self.slot_span, options.block_call, plugin
        )
        self.stats = ExecutorStats()
        self._issuer = Issuer(
            platform.stream_setter(),
            group if layout.num_shards > 1 else None,
            options.async_collectives and not platform.is_accelerator,
            self.stats,
        )
        self._programs = Programs(self._compile)
        self._carry: dict[str, Any] = {}
        self._run: RunState | None = None
        self._recorder = RunRecorder(platform, rank) if options.record_timeline else None
        self._run_count = 0
        self.warm_up_s = 0.0  # seconds of the warm-up all-gather (Offloaded.timings)
        if self._issuer.group is not None:
            self._warm_up_collective()

    slots = property(lambda self: self.buffers.slots)
    landing = property(lambda self: self.buffers.landing)
    device_weight_bytes = property(lambda self: self.buffers.device_bytes)  # the slots' and landing buffers' storages

    def _warm_up_collective(self) -> None:
        """NCCL/HCCL make the communicator on the first collective: a byte per rank; CPU: slot 0 touched (w)."""
        n, t0 = 1 if self.platform.is_accelerator else self.layout.shards[0].shard_bytes, _clock()
        with self.platform.use_stream(self.allgather_stream):
            all_gather_bytes(self.slots[0][: n * self.layout.num_shards], self.landing[0][:n], self._issuer.group)
        self.platform.synchronize()
        self.warm_up_s = _clock() - t0

    # -- runs -----------------------------------------------------------------------------------------------
    def next_schedule(self, num_steps: int = 1, requests_per_load: int = 1) -> Schedule:
        return self.ring.next_schedule(num_steps, requests_per_load)  # cold for the first run or after an error

    def _compile(self, sch: Schedule) -> Program:
        return compile_schedule(
            sch,
            self.layout,
            self.store,
            self.buffers,
            self._callers,
            (self.h2d_stream, self.allgather_stream),
            self.platform.new_event,
            self.dequantizer,
        )

    in_run = property(lambda self: self._run is not None)

    def begin_run(
        self,
        num_steps: int | None = None,
        requests_per_load: int | None = None,
        *,
        schedule: Schedule | None = None,
        compute: bool = True,
        _implicit: bool = False,
    ) -> Schedule:
        """Open a run of ``num_steps`` passes over the blocks (default 1) with ``requests_per_load`` computes per
        loaded block (block-major, default 1), following the ring's next schedule, or ``schedule`` if handed
        (it must start from :attr:`ring`). ``compute=False``: take part in every load and all-gather, compute
        nothing (an idle rank of a partial wave); the ops are issued by :meth:`end_run`."""
        if self._run is not None:
            raise ScheduleError("a run is already open: end it (end_run / leave the `with run()` block) first")
        if not self.slots:
            raise ScheduleError("this executor was released (its device buffers are gone): build a new one")
        program = self._programs.get(self.ring, num_steps, requests_per_load, schedule)
        recorder = self._recorder
        events, starts = (program.events, None) if recorder is None else recorder.run_events(len(program.ops))
        self._run = RunState(
            program,
            events,
            starts,
            self._carry,
            compute,
            _implicit,
            self.platform.current_stream(),
            index=self._run_count,
        )
        self._run_count += 1
        self.stats.runs += 1
        return program.schedule

    def end_run(self) -> None:
        """Issue what is left (all of it for ``compute=False``) and hand the buffers to the next run."""
        run = self._run
        if run is None:
            raise ScheduleError("no run is open")
        p = run.program
        if run.compute and p.next_compute[run.cursor] < len(p.ops):
            left = sum(1 for op in p.ops[run.cursor :] if op.kind == C)
            self.abort()
            raise ScheduleError(
                f"run ended with {left} block computes not done: the model called fewer blocks "
                f"than the schedule's {p.schedule.num_steps} step(s) x {p.schedule.num_blocks} "
                f"blocks x {p.schedule.requests_per_load}"
            )
        self._issuer.issue_until(run, len(p.ops))
        self._carry = {buf: run.events[i] for buf, i in p.last_use}
        self.ring = self.ring.after(p.schedule)
        if self._recorder is not None:
            self._recorder.add_run(run.index, p.schedule, run.starts, run.events)
        self._run = None

    @contextlib.contextmanager
    def run(self, *args, **kwargs) -> Iterator[Schedule]:
        """``with executor.run(T, R): ...`` (or ``run(schedule=s)``) around the model calls of one run; the
        arguments are :meth:`begin_run`'s."""
        schedule = self.begin_run(*args, **kwargs)
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
        self.end_run()

    def abort(self) -> None:
        """Drop the open run after an error: wait for the device (the carried all-gathers too: on CPU they may
        still write a slot the next, cold run reuses), restart the ring. Reset even if a wait raises."""
        try:
            self.synchronize()
        finally:
            self._run = None
            self.ring, self._carry = self.ring.restart(), {}

    def release(self) -> None:
        """Give back the device buffers and everything pointing into them (views, programs, the plug-in's state),
        so another executor can take their memory. This executor cannot run again."""
        try:
            self.abort()
        except Exception:  # noqa: BLE001 - a broken run (a dead peer) may fail its wait; the buffers go anyway
            pass
        self.buffers.release()
        self._callers = []
        self._programs, self._carry = Programs(self._compile), {}
        if self.plugin is not None:
            self.plugin.clear()

    def synchronize(self) -> None:
        """Wait for everything issued so far (tests, timing, shutdown); never called in the steady state."""
        for ev in [*(self._run.events if self._run is not None else ()), *self._carry.values()]:
            if getattr(ev, "work", None) is not None:  # a CPU event holding an async collective
                ev.wait()
        self.platform.synchronize()

    # -- the per-block path -----------------------------------------------------------------------------------
    def compute(self, block_index: int, args: tuple, kwargs: dict) -> Any:
        """Run block ``block_index`` for the next compute op of the open (or an implicit) run."""
        t0 = _clock()
        run = self._run
        if run is None:
            self.begin_run(1, 1, _implicit=True)
            run = self._run
        elif not run.compute:
            raise ScheduleError("block called during a compute=False run: this rank must not run the model")
        p = run.program
        i = p.next_compute[run.cursor]
        if i >= len(p.ops):
            self.abort()
            raise ScheduleError(
                f"block {block_index} called but the run's {p.schedule.num_blocks} x "
                f"{p.schedule.num_steps} x {p.schedule.requests_per_load} computes are all done: "
                f"open a run with more steps or requests"
            )
        op = p.ops[i]
        if op.block != block_index:
            self.abort()
            raise ScheduleError(
                f"block {block_index} ({self.layout.shards[block_index].block.name}) called, but "
                f"the schedule expects block {op.block} ({self.layout.shards[op.block].block.name}) "
                f"next ({p.schedule.ops[i]}): the model must call every block of the block list(s) "
                f"once per pass, in order (and, for R requests, each block R times in a row)"
            )
        issuer, stream = self._issuer, run.stream
        issuer.issue_until(run, i)
        issuer.wait_for(stream, op, run)
        if run.starts is not None:
            run.starts[i].record(stream)
        t1 = _clock()
        out = op.caller(args, kwargs)
        t2 = _clock()
        st = self.stats
        if run.starts is not None or op.recorded:  # an event nothing waits on is not recorded (Program)
            run.events[i].record(stream)
            st.records += op.recorded
        run.cursor = i + 1
        if run.implicit and p.next_compute[run.cursor] >= len(p.ops):
            self.end_run()
        st.computes += 1
        st.call_s += t2 - t1
        st.issue_s += (t1 - t0) + (_clock() - t2)
        return out

    # -- measured timeline ----------------------------------------------------------------------------------
    @property
    def timeline_origin_s(self) -> float | None:
        """Host-clock time (``time.perf_counter`` seconds) of the timeline's zero on CPU; None on devices
        (their spans are on the device clock) or before the first recorded run."""
        return self._recorder.origin_s if self._recorder is not None else None

    def take_timeline(self, meta: Sequence[tuple[str, str]] = ()) -> Timeline:
        """The ops of every run since the last call, with measured start/end (seconds from the first run's
        start; device events on CUDA/NPU, host clocks on CPU). Synchronises. Needs ``record_timeline``."""
        if self._recorder is None:
            raise ValueError("construct the executor with record_timeline=True to measure a timeline")
        self.synchronize()
        ring, plugin = self.ring, self.plugin.name if self.plugin is not None else "none"
        return self._recorder.take(
            (  # "world_size": the key the committed measured timelines carry for num_shards
                ("source", "measured"),
                ("platform", self.platform.kind),
                ("mode", ring.mode),
                ("num_blocks", str(ring.num_blocks)),
                ("num_slots", str(ring.num_slots)),
                ("num_landing", str(ring.num_landing)),
                ("world_size", str(self.layout.num_shards)),
                ("plugin", plugin),
                ("dequant", getattr(self.dequantizer, "name", "none")),
                *self.options.describe(),
                *meta,
            )
        )
