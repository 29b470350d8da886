"""One rank's share of a wave: what rank 0 (:mod:`dlo_fn.serve.driver`) and every follower
(:mod:`dlo_fn.serve.follower`) run when a wave reaches them.

A share is the wave's ``(position, request as a dict)`` pairs that :func:`dlo_fn.cost.waves.assign_positions`
gave this rank's replica (empty for an idle one; the sp ranks of a replica run the same share, each its
tokens). :class:`ShareRunner` runs it block-major with
:func:`dlo_fn.serve.batch.run_batch`, posts ``running`` with the step on the status board after every denoising
step (what a diagnosis reads after a failure), and fires the injected fault when it names this rank and wave.
With ``trace=True`` it also returns the spans it measured, ``(rank, lane, label, start_s, end_s)`` on the host
clock (``time.perf_counter``): the executor's own timeline, compute ops relabelled ``p<position> s<step>
b<block>``; without an executor (resident) the block calls timed around each compute.
:func:`own_timeline` is the other way to look: everything the executor recorded, on its own clock
(:func:`gather_timelines`: every rank's, at rank 0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from torch import nn

from dlo_fn.models.sp import SPContext
from dlo_fn.plan.timeline import Timeline
from dlo_fn.runtime.offload import Offloaded
from dlo_fn.serve.batch import Fault, Outcome, run_batch
from dlo_fn.serve.requests import EngineOptions, from_wire
from dlo_fn.serve.wire import Channel, StatusBoard

__all__ = ["ProtocolEnd", "ShareRun", "ShareRunner", "TraceSpan", "gather_timelines", "own_timeline"]

TraceSpan = tuple[int, str, str, float, float]
"""``(rank, lane, label, start_s, end_s)``: one measured span of a wave trace."""

_COMPUTE_OP = re.compile(r"C k(\d+) b(\d+)@s\d+ r(\d+)")


@dataclass(frozen=True, slots=True)
class ShareRun:
    """What one share produced: an outcome per request (in share order) and, when traced, its spans."""

    outcomes: tuple[Outcome, ...]
    spans: tuple[TraceSpan, ...] = ()


class ShareRunner:
    """Runs this rank's shares of waves on ``model`` (wrapped by ``offloaded``), reporting on ``board``."""

    def __init__(
        self,
        model: nn.Module,
        offloaded: Offloaded,
        rank: int,
        board: StatusBoard,
        fault: Fault | None = None,
        sp: SPContext | None = None,
    ) -> None:
        self.model, self.offloaded, self.rank, self.board, self.sp = model, offloaded, rank, board, sp
        self.fault = fault if fault is not None and fault.rank == rank else None

    def run(
        self,
        wave_id: int,
        num_steps: int,
        share: Sequence[tuple[int, dict]],
        *,
        trace: bool = False,
        on_step: Callable[[], None] | None = None,
    ) -> ShareRun:
        """Run ``share`` of wave ``wave_id`` (``num_steps`` denoising steps); ``on_step()`` after every step
        (rank 0's progress bar). Raises :class:`~dlo_fn.serve.batch.WaveAborted` when the collectives could
        not be completed."""
        fault = self.fault if self.fault is not None and self.fault.wave == wave_id else None
        self.board.post("running", wave=wave_id, step=0)
        block_spans: list[TraceSpan] = []
        on_block = None
        if trace:

            def on_block(label: str, step: int, block: int, s: float, e: float) -> None:
                block_spans.append((self.rank, "compute", f"{label} s{step} b{block}", s, e))

        def step_done(step: int) -> None:
            self.board.post("running", wave=wave_id, step=step + 1)
            if on_step is not None:
                on_step()

        positions = [p for p, _ in share]
        outcomes = run_batch(
            self.model,
            self.offloaded,
            [from_wire(r) for _, r in share],
            positions,
            num_steps=num_steps,
            rank=self.rank,
            fault=fault,
            on_block=on_block,
            on_step=step_done,
            sp=self.sp,
        )
        if not trace:
            return ShareRun(tuple(outcomes))
        measured = self._executor_spans(positions)
        # The executor's compute spans start after the block's weights arrived; the runner's own spans
        # (``on_block``) include that wait, so they are used only when there is no executor (resident).
        has_compute = any(lane == "compute" for _, lane, *_ in measured)
        return ShareRun(tuple(outcomes), tuple(measured if has_compute else block_spans + measured))

    def _executor_spans(self, positions: Sequence[int]) -> list[TraceSpan]:
        """The executor's measured spans of the last run(s), on the host clock; compute ops relabelled
        ``p<wave position> s<step> b<block>``."""
        ex = self.offloaded.executor
        if ex is None or not ex.options.record_timeline:
            return []
        timeline = ex.take_timeline()
        base = ex.timeline_origin_s
        if base is None:
            return []  # device events: no host-clock origin to align with
        num_blocks = ex.layout.num_blocks
        out = []
        for sp in timeline.spans:
            label = sp.op
            if sp.stream == "compute":
                m = _COMPUTE_OP.search(sp.op)
                if m is None or int(m.group(3)) >= len(positions):
                    continue
                k, b, r = (int(g) for g in m.groups())
                label = f"p{positions[r]} s{k // num_blocks} b{b}"
            out.append((self.rank, sp.stream, label, base + sp.start_s, base + sp.end_s))
        return out


class ProtocolEnd(NamedTuple):
    """One rank's end of the engine's protocol, what the driver (rank 0) and a follower both hold: the channel
    and status board it talks over, the runner of its shares, and the engine options."""

    channel: Channel
    board: StatusBoard
    runner: ShareRunner
    options: EngineOptions


def own_timeline(offloaded: Offloaded, meta: Sequence[tuple[str, str]] = ()) -> Timeline | None:
    """This rank's executor timeline since the last take (device clock on CUDA/NPU), with ``meta`` added;
    None when nothing records one (resident, or ``record_timeline`` off)."""
    ex = offloaded.executor
    return ex.take_timeline(tuple(meta)) if ex is not None and ex.options.record_timeline else None


def gather_timelines(
    channel: Channel, offloaded: Offloaded, world_size: int, meta: Sequence[tuple[str, str]] = ()
) -> Timeline:
    """Rank 0: every rank's :func:`own_timeline` (each follower sends its own when asked with a ``timeline``
    message), in rank order, as one Timeline with the meta of the last rank that recorded one."""
    timelines = [own_timeline(offloaded, meta)]
    if world_size > 1:
        channel.broadcast({"kind": "timeline", "meta": tuple(meta)})
        timelines += [channel.recv(r) for r in range(1, world_size)]
    spans, out_meta = [], ()
    for timeline in timelines:
        if timeline is not None:
            spans.extend(timeline.spans)
            out_meta = timeline.meta
    return Timeline(tuple(spans), out_meta)
