"""Timeline model of a DP wave: why W concurrent requests give 3.3x over HSDP on 4 cards, not 4x (pure).

In a DLO+AllGather wave every one of the ``W`` ranks computes its own request through all ``B`` blocks, and the
block weights arrive by H2D of a shard plus an all-gather that all ranks share. One denoising step is simulated
with the planner's own schedule (:func:`dlo_fn.plan.schedule.build_schedule`) and the three-stream simulator
(:func:`dlo_fn.plan.timeline.simulate`), with per-op durations

==========  =========================================================================================
op          duration
==========  =========================================================================================
``C``       ``c + h``: one request's compute of one block, plus the host work that the reference puts on
            the compute stream's critical path per block (stream switches, Python dispatch)
``AG``      ``a``: the collective itself
``H2D``     ``d``: the local shard's host-to-device copy
==========  =========================================================================================

=================  ==============================================================================================
symbol             meaning
=================  ==============================================================================================
``B``              blocks per step (Cosmos3-Nano: 72)
``W``              DP size = requests per wave (``R = 1`` per rank)
``T_hsdp``         the baseline's step: one request on ``W`` cards (HSDP + sequence parallel)
``c``              compute per block of one request on one card; the model takes ``B c = T_hsdp`` (a DLO rank
                   computes a whole request in the time HSDP+SP needs per step; the published DLO step minus
                   the published AllGather overhead says exactly that: 1020 - 150 = 870 ms)
``T_dlo``          the simulated steady-state step (makespan per step over a few steps, ring warm)
``speedup``        ``W R T_hsdp / T_dlo``: outputs per second of a full wave over one HSDP request
``fraction``       ``speedup / W`` (1 = ideal: every rank computing all the time, with ``B c = T_hsdp``)
=================  ==============================================================================================

So ``fraction = B c / T_dlo``: whatever the schedule cannot hide behind compute (``h`` entirely, since the host
serialises it with compute; ``a`` and ``d`` only when they exceed ``c``) is lost from the ideal ``W``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo_fn.plan.schedule import AG, H2D, C, Op, build_schedule
from dlo_fn.plan.timeline import Timeline, simulate

__all__ = ["WaveCosts", "WavePrediction", "simulate_wave_steps", "predict_wave", "host_for_fraction"]


@dataclass(frozen=True, slots=True)
class WaveCosts:
    """Per-block costs (seconds) of one rank in a DLO+AllGather wave."""

    num_blocks: int
    dp_size: int
    compute_s: float
    host_s: float = 0.0
    allgather_s: float = 0.0
    h2d_s: float = 0.0
    requests_per_rank: int = 1

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.dp_size < 1 or self.requests_per_rank < 1:
            raise ValueError(f"num_blocks, dp_size and requests_per_rank must be >= 1: {self}")
        if min(self.compute_s, self.host_s, self.allgather_s, self.h2d_s) < 0:
            raise ValueError(f"per-block costs must be >= 0 seconds: {self}")

    def duration_s(self, op: Op) -> float:
        if op.kind == C:
            return self.compute_s + self.host_s
        if op.kind == AG:
            return self.allgather_s
        assert op.kind == H2D
        return self.h2d_s


def simulate_wave_steps(costs: WaveCosts, num_steps: int = 3) -> Timeline:
    """``num_steps`` denoising steps of one rank (the ring wraps from the last block to block 0)."""
    schedule = build_schedule(costs.num_blocks, num_steps, requests_per_load=costs.requests_per_rank)
    return simulate(schedule, costs.duration_s, meta=(("model", "dp_wave"), ("dp_size", str(costs.dp_size))))


@dataclass(frozen=True, slots=True)
class WavePrediction:
    step_s: float  # steady-state step of the wave (every rank)
    baseline_step_s: float  # T_hsdp
    dp_size: int
    requests_per_rank: int
    exposed_s_per_step: float  # step_s - B R c: the part of the step that is not compute

    @property
    def outputs_per_wave(self) -> int:
        return self.dp_size * self.requests_per_rank

    @property
    def speedup(self) -> float:
        """Outputs per second of a full wave over one baseline request: ``W R T_hsdp / T_dlo``."""
        return self.outputs_per_wave * self.baseline_step_s / self.step_s

    @property
    def fraction_of_ideal(self) -> float:
        """``speedup / W``: the ideal is every rank computing all the time (``R`` requests on one rank run one
        after another, so ``R`` adds outputs per wave but not to the ideal rate)."""
        return self.speedup / self.dp_size


def predict_wave(costs: WaveCosts, baseline_step_s: float, num_steps: int = 3) -> WavePrediction:
    """Simulate ``num_steps`` steps and take the steady state: the period between the ends of the first and
    the last step's computes, per step (the first step also pays the cold start of block 0's load)."""
    if num_steps < 2:
        raise ValueError("num_steps must be >= 2 to measure a steady-state step")
    timeline = simulate_wave_steps(costs, num_steps)
    per_step = costs.num_blocks * costs.requests_per_rank
    ends = sorted(s.end_s for s in timeline.spans if s.stream == "compute")
    step_s = (ends[-1] - ends[per_step - 1]) / (num_steps - 1)
    compute = costs.num_blocks * costs.requests_per_rank * costs.compute_s
    return WavePrediction(step_s, baseline_step_s, costs.dp_size, costs.requests_per_rank, step_s - compute)


def host_for_fraction(fraction: float, compute_s: float) -> float:
    """Host seconds per block that leave ``fraction`` of the ideal when transfers are hidden:
    ``c / (c + h) = fraction``, so ``h = c (1 - fraction) / fraction``."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return compute_s * (1 - fraction) / fraction
