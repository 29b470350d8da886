"""The offloaded step as a CUDA graph: one more lowering of the same schedule.

A run's ops split into *steps*: step ``j`` is every op issued after step ``j-1``'s last compute up to and
including its own last compute (the last step also takes the ops after it, e.g. the next run's prefetch). Slots,
landing buffers and the pinned arena are fixed and a request's shapes are fixed, so a step is a static program:
its H2D copies (pinned arena -> slot / landing buffer), its all-gathers (none at W = 1: the plan lowers a shard
group of one to H2D straight into the slot), the event waits
between the three streams and the block computes. :class:`StepGraphs` captures it once per

    (step signature, input shapes, R)     signature = the step's ops (kind, block, slot, landing, request,
                                          stream) and their dependencies inside the step, relative to its start

and replays it each time the same step comes again. What it needs from outside the step (an earlier step's
loads, the previous run's last use of a buffer) is waited for on the compute stream before the launch; what
later ops wait for is recorded on the compute stream after it (a graph launch is one stream-ordered op), so
eager and graphed steps mix freely in one run and across runs.

At most ``graph_shapes`` input shapes keep their graphs (:class:`ShapeLRU`, ``OffloadOptions.graph_shapes``,
default 4): a new shape beyond drops the graphs and records of the least recently used one.

The model still calls every block through its proxy. The first time a step is seen it runs eager and the
executor records its *wiring*: which of block ``b``'s tensor inputs are the block-0 inputs of the same request
and which are outputs of block ``b-1``. The second time it is captured (on static copies of the inputs) and
launched once block 0 has received all ``R`` requests' inputs; every proxy call returns the step's (static)
outputs, and each later call is checked against the wiring (by identity) instead of running. Outputs are the
graph's static tensors: read them before the next step of the same shape (the model's head does).

**Measured limit (one H200, ``bench.graph_gaps``):** a captured H2D copy runs at a rate the driver sets from
what the process captured before (the first graph's copies at 55 GB/s beside the computes, a later one's at
53 GB/s, whatever the earlier graphs were, and dropping them with :meth:`StepGraphs.clear` does not restore it);
eager copies on the executor's own H2D stream do not vary. A PCIe-bound step can therefore be slower graphed than
eager; :mod:`dlo_fn.runtime.block_graph` (``graph="block"``) keeps the copies out of the graph, capturing each
block's compute instead.

Where capture is not supported (CPU, NPU, a block taking a non-tensor argument, a forward that syncs or whose
dataflow is not a chain of blocks) the step runs eager, logged once per reason. :func:`graph_support` decides
before anything runs, on the CPU: a CUDA device, and a shard group of one (W = 1 lowers to H2D straight into the
slot, no collective) or, at W > 1, NCCL with ``DLO_FN_GRAPH_NCCL=1`` (see below); otherwise eager, logged once.

**The all-gather at W > 1 (designed, not yet run: no multi-GPU machine was lent).** NCCL operations can be
captured since NCCL 2.9, and ``_capture`` already issues each ``AG`` on the all-gather stream inside the capture,
like the copies. What must hold for it to be safe, and why it stays opt-in until run on two GPUs:

* *Every rank replays the same graphs in the same order.* A step's signature (its ops, waits and R) depends only
  on the ring and the loads, the same on every rank of the group, so ranks capture identical collective
  sequences. A rank whose capture fails must not fall back alone (its eager all-gathers would meet the others'
  replayed ones at different points): the ranks have to agree first, a flag all-reduced on the side gloo group
  before the first replay, and all run eager if any failed. Not built yet: the reason it is opt-in.
* *One communicator, inside and outside capture.* Idle ranks of a partial wave (``compute=False``) and the first
  (recorded) step run their all-gathers eagerly on the communicator that other steps replay; sglang hit wrong
  results mixing the two on one communicator (sgl-project/sglang#3709) and moved captured collectives to their
  own communicator: the plan is a second process group over the same ranks for captured steps.
* *No host sync during replay on any rank.* A replayed NCCL kernel waits on its peers; one rank blocked on a host
  sync stalls the others (pytorch/pytorch#196133, captured all_reduce + ``torch.unique``; a capture deadlock on
  two ranks, Motphys/UniLab#978). Our captured step has no host sync (the model's head and the sampler run
  outside it), and capture uses ``capture_error_mode="thread_local"`` so that NCCL's own watchdog thread may
  keep calling CUDA while one thread captures.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from dlo_fn.plan.schedule import AG, C, H2D, ScheduleError
from dlo_fn.runtime.dist import all_gather_pairs
from dlo_fn.runtime.graph_parts import (ShapeLRU, capture_guard, flatten_call, flatten_outputs, rebuild_call,
                                       tensor_specs)

__all__ = ["GRAPH_NCCL_ENV", "StepGraphs", "graph_support"]

log = logging.getLogger(__name__)


GRAPH_NCCL_ENV = "DLO_FN_GRAPH_NCCL"


def graph_support(platform: Any, num_shards: int = 1, backend: str | None = None,
                  env: Mapping[str, str] | None = None) -> str | None:
    """None where steps can be captured, else why not (one line): a CUDA device, and either a shard group of one
    or an NCCL group with ``DLO_FN_GRAPH_NCCL=1`` in ``env`` (default ``os.environ``; see the module doc)."""
    if platform.kind != "cuda":
        return f"CUDA graphs need a CUDA device (platform {platform.kind!r})"
    if num_shards > 1:
        if backend != "nccl":
            return f"the all-gather over {num_shards} ranks runs on {backend!r}, which a CUDA graph cannot capture"
        if (os.environ if env is None else env).get(GRAPH_NCCL_ENV) != "1":
            return (f"capturing the NCCL all-gather (W = {num_shards}) is not validated on a multi-GPU machine yet "
                    f"(set {GRAPH_NCCL_ENV}=1 to try it)")
    return None


@dataclass
class _Step:
    start: int  # first op
    end: int  # one past the last op
    first_compute: int
    computes: tuple[int, ...]
    key: tuple
    ext_waits: tuple[int, ...]  # ops before the step that ops in it depend on
    carry: tuple[str, ...]  # buffers whose previous-run last use the step's first uses wait for
    exported: tuple[int, ...]  # ops of the step that later ops (or the next run) wait for


def split_steps(program: Any) -> tuple[_Step, ...]:
    """The steps of ``program`` (see the module docstring), with what each needs and gives outside itself."""
    sch = program.schedule
    per_step = sch.num_blocks * sch.requests_per_load
    computes = [i for i, op in enumerate(sch.ops) if op.kind == C]
    bounds, start = [], 0
    for j in range(sch.num_steps):
        last = computes[(j + 1) * per_step - 1]
        end = len(sch.ops) if j == sch.num_steps - 1 else last + 1
        bounds.append((start, end, tuple(computes[j * per_step:(j + 1) * per_step])))
        start = end
    needed_later: dict[int, int] = {}  # op -> the last op index that depends on it
    for i, deps in enumerate(sch.deps):
        for d in deps:
            needed_later[d] = max(needed_later.get(d, -1), i)
    last_use = {i for _, i in sch.carried_last_use}  # what the next run waits on
    first_use: dict[int, list[str]] = {}
    for buf, i in sch.first_use:
        first_use.setdefault(i, []).append(buf)
    steps = []
    for s, e, comps in bounds:
        sig = tuple((op.kind, op.block, op.slot, op.landing, op.request,
                     tuple(d - s for d in sch.deps[i] if d >= s)) for i, op in enumerate(sch.ops[s:e], start=s))
        ext = sorted({d for i in range(s, e) for d in sch.deps[i] if d < s})
        carry = tuple(b for i in range(s, e) for b in first_use.get(i, ()))
        exported = tuple(i for i in range(s, e) if needed_later.get(i, -1) >= e or i in last_use)
        steps.append(_Step(s, e, comps[0], comps, (sig, sch.requests_per_load), tuple(ext), carry, exported))
    return tuple(steps)


def _flat(args: tuple, kwargs: dict) -> tuple[list[Any] | None, tuple]:
    """The call's tensors (:func:`flatten_call`; None if it takes anything else) and its structure
    ``(number of args, kwarg names, per-argument structure)``."""
    flattened = flatten_call(args, kwargs)
    if flattened is None:
        return None, (len(args), tuple(kwargs), None)
    return flattened[0], (len(args), tuple(kwargs), flattened[1])


def _rebuild(like: Any, flat: list[Any]) -> Any:
    return flat[0] if isinstance(like, torch.Tensor) else type(like)(flat)


@dataclass
class _Graph:
    graph: Any
    inputs: list[list[torch.Tensor]]  # per request: static inputs of block 0
    outputs: list[Any]  # per request: the last block's output (structure as the model returns it)
    out_flat: list[list[torch.Tensor]]


@dataclass
class _Record:
    """What a step's eager run showed: per request, the input structure and specs, and for each later block
    the source of each input: ("in", j) = block 0's input j, ("out", j) = the previous block's output j."""

    structure: tuple
    specs: list[tuple]
    wiring: dict[tuple[int, int], tuple[tuple[str, int], ...]] = field(default_factory=dict)
    ok: bool = True


@dataclass
class _Live:
    """The step being run: how (``"record"``, ``"replay"``) and its per-request state."""

    step: _Step
    how: str
    key: tuple
    record: _Record | None = None
    graph: _Graph | None = None
    inputs0: dict[int, list[Any]] = field(default_factory=dict)
    prev: dict[int, list[Any]] = field(default_factory=dict)


class StepGraphs:
    """Captured steps of one executor, and the state of the step in flight."""

    def __init__(self, executor: Any) -> None:
        self.ex = executor
        self._steps: dict[int, tuple[_Step, ...]] = {}
        self._sig_ids: dict[tuple, int] = {}
        self._records: dict[tuple, _Record] = {}
        self._graphs: dict[tuple, _Graph] = {}
        self._eager: set[tuple] = set()
        self._logged: set[str] = set()
        self._live: _Live | None = None
        self._shapes = ShapeLRU(getattr(executor, "graph_shapes", 4))  # (structure, spec) -> its keys
        self.captures = self.replays = 0

    def _log_once(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("cuda graph: %s; those steps run eager", reason)

    def steps_of(self, program: Any) -> tuple[_Step, ...]:
        steps = self._steps.get(id(program))
        if steps is None:
            steps = split_steps(program)
            for st in steps:  # a small id per distinct signature: the keys below are hashed once per step
                st.key = self._sig_ids.setdefault(st.key, len(self._sig_ids))
            self._steps[id(program)] = steps
        return steps

    def reset(self) -> None:
        self._live = None

    def clear(self) -> None:
        """Drop every captured graph and recorded wiring (their memory pools go with them); later steps are
        recorded and captured again. The counters stay."""
        self._live = None
        self._records.clear()
        self._graphs.clear()
        self._eager.clear()
        self._shapes.clear()

    @property
    def evictions(self) -> int:
        return self._shapes.evictions

    def _use_shape(self, key: tuple) -> None:
        """Register ``key`` under its input shape; drop the graphs and records of the shapes beyond the limit."""
        for keys in self._shapes.use(key[1:]):
            for k in keys:
                self._graphs.pop(k, None), self._records.pop(k, None), self._eager.discard(k)
            log.info("cuda graph: more than %d input shapes; dropped the graphs of the least recently used one",
                     self._shapes.limit)
        self._shapes.add(key[1:], key)

    # -- the proxy calls -------------------------------------------------------------------------------------
    def compute(self, run: Any, i: int, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """``(handled, output)`` for compute op ``i`` of ``run``; not handled: the executor runs it eager."""
        p = run.program
        op = p.schedule.ops[i]
        live = self._live
        if live is None or not (live.step.start <= i < live.step.end):
            live = self._live = self._begin(run, i, args, kwargs)
        flat, structure = _flat(args, kwargs)
        if live.how == "record":
            self._note(live, op, flat, structure)
            return False, None
        return True, self._replay_call(run, live, i, op, flat)

    def after_eager(self, run: Any, i: int, out: Any) -> None:
        """The eager output of a recorded step's compute ``i`` (for the wiring of the next block)."""
        live = self._live
        if live is None or live.how != "record":
            return
        op, rec = run.program.schedule.ops[i], live.record
        if rec is not None and rec.ok:
            of = flatten_outputs(out)
            if of is None:
                rec.ok = False
                self._log_once("a block returns something other than a tensor or a tuple of tensors")
            else:
                live.prev[op.request] = of
        if i == live.step.computes[-1]:
            if rec is not None and live.key is not None:
                if rec.ok:
                    self._records[live.key] = rec
                else:
                    self._eager.add(live.key)
            self._live = None

    def _begin(self, run: Any, i: int, args: tuple, kwargs: dict) -> _Live:
        steps = self.steps_of(run.program)
        step = next(s for s in steps if s.start <= i < s.end)
        flat, structure = _flat(args, kwargs)
        spec = tensor_specs(flat)
        if spec is None:
            self._log_once("a block takes an argument other than a tensor, a tuple of them or a constant")
            return _Live(step, "record", None)
        if i != step.first_compute or run.cursor != step.start:
            return _Live(step, "record", None)  # joined mid-step (e.g. after an eager fallback): stay eager
        key = (step.key, structure, spec)
        self._use_shape(key)
        if key in self._eager:
            return _Live(step, "record", key)
        graph = self._graphs.get(key)
        if graph is None:
            rec = self._records.get(key)
            if rec is None:
                return _Live(step, "record", key, record=_Record(structure, [spec]))
            graph = self._capture(run, step, key, rec)
            if graph is None:
                return _Live(step, "record", None)
        return _Live(step, "replay", key, record=self._records[key], graph=graph)

    def _note(self, live: _Live, op: Any, flat: list[Any], structure: tuple) -> None:
        rec = live.record
        if rec is None or not rec.ok:
            return
        if flat is None:
            rec.ok = False
            self._log_once("a block takes an argument other than a tensor, a tuple of them or a constant")
            return
        r = op.request
        if op.block == 0:
            spec = tensor_specs(flat)
            if structure != rec.structure or spec is None or (r > 0 and spec != rec.specs[0]):
                rec.ok = False
                self._log_once("the requests of one load differ in input structure or shape")
                return
            live.inputs0[r] = flat
            if r > 0:
                rec.specs.append(spec)
            return
        ins, prev = live.inputs0.get(r, []), live.prev.get(r, [])
        wiring = []
        for t in flat:
            src = next((("out", j) for j, o in enumerate(prev) if o is t), None)
            src = src or next((("in", j) for j, o in enumerate(ins) if o is t), None)
            if src is None:
                rec.ok = False
                self._log_once("a block input is neither a block-0 input nor an output of the block before "
                               "(the model does work between blocks)")
                return
            wiring.append(src)
        rec.wiring[(op.block, r)] = tuple(wiring)

    # -- capture and replay ----------------------------------------------------------------------------------
    def _capture(self, run: Any, step: _Step, key: tuple, rec: _Record) -> _Graph | None:
        ex = self.ex
        p = run.program
        R = p.schedule.requests_per_load
        inputs = [[torch.empty_strided(shape, stride, dtype=dtype, device=dev) for shape, stride, dtype, dev in spec]
                  for spec in rec.specs]
        for ins in inputs:
            for t in ins:
                t.zero_()
        new, set_stream = ex.platform.new_event, ex._set_stream
        h2d, agst = ex.h2d_stream, ex.allgather_stream
        n_args, names, items = rec.structure
        try:
            # the own communicator's watchdog records a marker on the all-gather stream, which is capturing here
            with capture_guard(), ex._nccl.paused() if ex._nccl is not None else contextlib.nullcontext():
                g = torch.cuda.CUDAGraph()
                ex.platform.synchronize()
                # thread_local: NCCL's watchdog thread keeps calling CUDA while this thread captures (module doc).
                mode = "thread_local" if ex._gather_group is not None else "global"
                with torch.cuda.graph(g, capture_error_mode=mode):
                    cs = torch.cuda.current_stream()
                    fork = new()
                    fork.record(cs)
                    h2d.wait_event(fork)
                    agst.wait_event(fork)
                    evs: dict[int, Any] = {}
                    prev: dict[int, list[torch.Tensor]] = {}
                    outs: dict[int, Any] = {}
                    for i in range(step.start, step.end):
                        op = p.schedule.ops[i]
                        stream = p.streams[i] if op.kind != C else cs
                        set_stream(stream)
                        for d in p.waits[i]:
                            if d >= step.start:
                                stream.wait_event(evs[d])
                        if op.kind == H2D:
                            for dst, src in p.args[i]:
                                dst.copy_(src, non_blocking=True)
                        elif op.kind == AG:
                            if p.args[i]:
                                all_gather_pairs(p.args[i], ex._gather_group)
                        else:
                            r = op.request
                            if op.block == 0:
                                flat = inputs[r]
                            else:
                                flat = [prev[r][j] if src == "out" else inputs[r][j]
                                        for src, j in rec.wiring[(op.block, r)]]
                            _, caller = p.args[i]
                            out = caller(*rebuild_call(n_args, names, items, flat))
                            prev[r] = flatten_outputs(out)
                            outs[r] = out
                        evs[i] = new()
                        evs[i].record(stream)
                    set_stream(cs)
                    for side in (h2d, agst):
                        join = new()
                        join.record(side)
                        cs.wait_event(join)
        except Exception as exc:  # a forward that syncs, an uncapturable kernel or collective
            set_stream(run.stream)
            self._eager.add(key)
            self._log_once(f"capture failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
            return None
        set_stream(run.stream)
        graph = _Graph(g, inputs, [outs[r] for r in range(R)], [prev[r] for r in range(R)])
        self._graphs[key] = graph
        self.captures += 1
        return graph

    def _replay_call(self, run: Any, live: _Live, i: int, op: Any, flat: list[Any]) -> Any:
        g, r, R = live.graph, op.request, run.program.schedule.requests_per_load
        if flat is None:
            raise ScheduleError(f"cuda graph: block {op.block} (request {r}) was called with an argument other than "
                                f"a tensor, a tuple of them or a constant, unlike when its step was captured: run "
                                f"this model with graph=False")
        if op.block == 0:
            if r and tensor_specs(flat) != live.record.specs[r]:  # request 0's shapes are in the key; the others here
                raise ScheduleError(f"cuda graph: request {r} of this load has other input shapes than when the "
                                    f"step was captured: give every request of one load the same shapes, or "
                                    f"run with graph=False")
            for dst, src in zip(g.inputs[r], flat):
                dst.copy_(src)
            live.inputs0[r] = flat
            if r == R - 1:
                self._launch(run, live)
        else:
            ins, outs = live.inputs0[r], g.out_flat[r]
            for t, (src, j) in zip(flat, live.record.wiring[(op.block, r)]):
                if t is not (outs[j] if src == "out" else ins[j]):
                    raise ScheduleError(f"cuda graph: block {op.block} (request {r}) was called with inputs wired "
                                        f"differently than when its step was captured: run this model with "
                                        f"graph=False")
        run.cursor = i + 1
        if i == live.step.computes[-1]:
            run.cursor = live.step.end  # the step's trailing ops (the next run's prefetch) were in the graph
            self._live = None
        return g.outputs[r]

    def _launch(self, run: Any, live: _Live) -> None:
        step, ex, events, cs = live.step, self.ex, run.events, run.cstream
        for d in step.ext_waits:
            cs.wait_event(events[d])
        for buf in step.carry:
            ev = ex._carry.get(buf)
            if ev is not None:
                cs.wait_event(ev)
        if run.starts is not None:
            start = ex.platform.new_event(timing=True)
            start.record(cs)
            end = ex.platform.new_event(timing=True)
            live.graph.graph.replay()
            end.record(cs)
            for i in range(step.start, step.end):  # per-step spans: every op of the step spans the launch
                run.starts[i], events[i] = start, end
        else:
            live.graph.graph.replay()
            for i in step.exported:
                events[i].record(cs)
        self.replays += 1
