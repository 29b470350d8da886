"""Timeline model of the published 4x B300 throughput tables (Cosmos3-Super, bf16): which stream bounds each case.

One denoising step of one rank is simulated with the planner's schedule
(:func:`dlo_fn.plan.schedule.build_schedule`) and the three-stream simulator (:func:`dlo_fn.plan.timeline.simulate`).
The reference implementation runs the H2D of the next shard and its all-gather back to back (DESIGN.md section 2),
which is our schedule with one landing buffer (``num_landing = 1``): the load period is ``h + a`` per block.

==============  ===============================================================================================
symbol          meaning
==============  ===============================================================================================
``W``           GPUs (4); DP size of DLO+AG DP4, SP size of the USP4 strategies
``B, D, M``     Super's blocks (128), hidden (5632), MLP width (23680): the reference config ``cosmos3-super``
``L, L_t``      tokens of one video per CFG branch (:func:`dlo_fn.models.tokens_for`), text tokens (512)
``n``           bytes of one block: ``2 x`` its parameters (bf16); ``N = B n`` (123.7 GB)
``F``           FLOPs of one request per step: ``2 B [L (12 D^2 + 4 D M + 4 D (L + L_t)) + 4 D D_t L_t]``
                (2 CFG branches; per token: self-attn qkv/out ``8 D^2``, cross-attn q/out ``4 D^2``, MLP
                ``4 D M``, scores and values ``4 D L`` (self) and ``4 D L_t`` (cross); text k/v per branch)
``c``           ``F / R_eff``: one request's compute per step on one GPU
``h``           ``N / (W beta_h2d)``: H2D of the local shards per step
``a``           ``((W - 1) / W) N / beta_nv``: the weight all-gather per step (bytes each rank receives)
``u``           Ulysses all-to-all per step: ``4 B x 2 (L / W) D x 2 bytes x (W - 1) / W / beta_a2a`` (q, k, v in
                and the output back, both CFG branches, bf16, each rank's ``L / W`` tokens; NCCL's all-to-all
                bus-bandwidth convention, ``busbw = algbw (W - 1) / W``)
==============  ===============================================================================================

Per step (steady state of the simulation; ``max`` where two streams overlap, ``+`` where they serialise):

=======================  ==============================  ==================================================
strategy                 step                            outputs per wave
=======================  ==============================  ==================================================
HSDP+USP4                ``max(c / W + u, a)``           1 (FSDP gathers each block over NVLink; no H2D)
DLO+AG DP4               ``max(c, h + a)``               W (each GPU its own request, weights shared)
DLO+AG+USP4              ``max(c / W + u, h + a)``       1
DLO no-AG DP4            ``max(c, N / beta_h2d)``        W (every rank copies whole blocks)
=======================  ==============================  ==================================================

Wave latency = steps x step (text encoding and VAE decode are not modelled).
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo_fn.models import CONFIGS, tokens_for
from dlo_fn.models.config import DiTConfig
from dlo_fn.plan.schedule import AG, H2D, C, build_schedule
from dlo_fn.plan.timeline import simulate
from dlo_fn.plan.workload import Workload

__all__ = [
    "B300_BF16_DENSE_FLOP_PER_S",
    "B300_PINNED_H2D_BYTES_PER_S",
    "B300_NVLINK_ALLGATHER_BYTES_PER_S",
    "B300_EFFECTIVE_FLOP_PER_S",
    "B300_NVLINK_ALL_TO_ALL_BYTES_PER_S",
    "B300_CALIBRATIONS",
    "NUM_GPUS",
    "CFG_BRANCHES",
    "STRATEGIES",
    "WORKLOADS",
    "StepCosts",
    "Prediction",
    "block_bytes",
    "step_flops",
    "step_costs",
    "simulate_step_s",
    "predict",
]

NUM_GPUS = 4
CFG_BRANCHES = 2  # the reference sampler batches a conditional and an unconditional branch
SUPER = CONFIGS["cosmos3-super"]

B300_BF16_DENSE_FLOP_PER_S = 2.25e15
"""Datasheet: NVIDIA HGX B300, FP16/BF16 tensor core 36 PFLOPS per 8 GPUs *with sparsity*, i.e. 2.25 PFLOP/s dense
per GPU. Used only to judge :data:`B300_EFFECTIVE_FLOP_PER_S`, never as an input."""

B300_PINNED_H2D_BYTES_PER_S = 54.734e9
"""Fitted to the DLO no-AG DP4 1024^2 T2I wave, 112.96 s over 50 steps (``b300.t2i.dlo_noag_dp4.wave_s``): every
rank copies the whole model per step and nothing else is as long, so ``beta_h2d = N / (112.96 / 50)``. It lands
on the H200's measured pinned H2D, 54.7 GB/s (PCIe Gen5 x16, :mod:`dlo_fn.cost.ceilings`)."""

B300_NVLINK_ALLGATHER_BYTES_PER_S = 305.27e9
"""Bytes a rank receives per second in the weight all-gather. Fitted to the HSDP+USP4 1024^2 T2I wave, 15.19 s over
50 steps (``b300.t2i.hsdp_usp4.wave_s``), which the model says is all-gather bound (``a > c / W + u``):
``beta_nv = (3 / 4) N / (15.19 / 50)``. A third of NVLink 5's 900 GB/s per direction: the gathers run in 0.97 GB
pieces while compute kernels hold the SMs."""

B300_EFFECTIVE_FLOP_PER_S = 11.5447e15
"""``F / c`` for the reference config's FLOPs. Fitted to the DLO+AG DP4 480p 241-frame wave, 226.70 s over 35 steps
(``b300.workloads.480p_241f.dlo_wave_s``: one GPU, one whole request, compute bound): ``R_eff = F(95160) / 6.477 s``.
It is 5.1x the datasheet's dense rate: the reference config's token count (8x VAE, 2x2 patches, full attention)
has more FLOPs than Cosmos3-Super really runs, so only ratios of ``F`` are meaningful (see notebook 07)."""

B300_NVLINK_LINKS = 18
B300_NCCL_NVLINK_BYTES_PER_S_PER_LINK = 40.1e9
B300_NVLINK_ALL_TO_ALL_BYTES_PER_S = B300_NVLINK_LINKS * B300_NCCL_NVLINK_BYTES_PER_S_PER_LINK
"""Bus bandwidth of an NVLink all-to-all (each rank sends ``(W - 1) / W`` of its buffer and receives as much, full
duplex): 18 NVLink 5 links x 40.1 GB/s = 721.8 GB/s. Not fitted. 40.1 GB/s is NCCL's effective per-link rate for
Blackwell (``SM100_NVLINK_BW`` in NCCL's ``src/graph/topo.h``; its maxBw of 721.8 is quoted in NVIDIA/nccl#1807),
the 50 GB/s line rate of a link (HGX B300: 1.8 TB/s bidirectional per GPU = 18 x 50 GB/s x 2) less the protocol
overhead NCCL's maintainers put at ~20% (NVIDIA/nccl-tests#212: 370 of 450 GB/s on H100, whose
``SM90_NVLINK_BW`` is 20.6 x 18 = 370.8). ``busbw = algbw (n - 1) / n`` for all-to-all (NVIDIA/nccl-tests#130).
Until this constant the all-to-all was priced at :data:`B300_NVLINK_ALLGATHER_BYTES_PER_S`, the FSDP all-gather's
rate fitted with compute holding the SMs: 2.4x too slow for an exchange that sits alone on the critical path."""

B300_CALIBRATIONS = {
    "B300_PINNED_H2D_BYTES_PER_S": (B300_PINNED_H2D_BYTES_PER_S, "b300.t2i.dlo_noag_dp4.wave_s"),
    "B300_NVLINK_ALLGATHER_BYTES_PER_S": (B300_NVLINK_ALLGATHER_BYTES_PER_S, "b300.t2i.hsdp_usp4.wave_s"),
    "B300_EFFECTIVE_FLOP_PER_S": (B300_EFFECTIVE_FLOP_PER_S, "b300.workloads.480p_241f.dlo_wave_s"),
}
"""name -> (value, the one published key it was fitted to)."""

STRATEGIES = ("HSDP+USP4", "DLO+AG DP4", "DLO+AG+USP4", "DLO no-AG DP4")


def _video(name: str, height: int, width: int, num_frames: int, num_steps: int) -> Workload:
    return Workload(name, tokens_for(SUPER, height, width, num_frames), num_steps, CFG_BRANCHES)


WORKLOADS = {
    w.name: w
    for w in (
        _video("t2i 1024^2", 1024, 1024, 1, 50),
        _video("480p 29f", 480, 832, 29, 35),
        _video("480p 121f", 480, 832, 121, 35),
        _video("480p 125f", 480, 832, 125, 35),  # HSDP's run of the "~5 s" row
        _video("480p 241f", 480, 832, 241, 35),
        _video("480p 245f", 480, 832, 245, 35),  # HSDP's run of the "~10 s" row
        _video("720p 121f", 720, 1280, 121, 35),
        _video("720p 241f", 720, 1280, 241, 35),
    )
}
"""The published workloads (height, width, frames, steps) as Super's tokens per CFG branch."""


def block_bytes(config: DiTConfig = SUPER) -> int:
    """bf16 bytes of one block: adaLN-LoRA ``D_c r + 9 D r``, attention ``6 D^2 + 2 D D_t``, MLP ``2 D M + M + D``."""
    d, m = config.hidden_dim, config.mlp_dim
    params = (
        config.cond_dim * config.adaln_rank
        + config.adaln_rank * 9 * d
        + 6 * d * d
        + 2 * d * config.text_dim
        + 2 * d * m
        + m
        + d
    )
    return 2 * params


def step_flops(tokens: int, config: DiTConfig = SUPER, branches: int = CFG_BRANCHES) -> float:
    """``F``: one request, one step, all blocks (module docstring)."""
    d, m, lt = config.hidden_dim, config.mlp_dim, config.text_len
    per_seq = tokens * (12 * d * d + 4 * d * m + 4 * d * (tokens + lt)) + 4 * d * config.text_dim * lt
    return float(branches * config.num_blocks * per_seq)


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Per-step seconds of one rank: ``c``, ``h``, ``a``, ``u`` of the module docstring."""

    compute_s: float
    h2d_shard_s: float
    h2d_full_s: float
    allgather_s: float
    all_to_all_s: float

    def __post_init__(self) -> None:
        if min(self.compute_s, self.h2d_shard_s, self.h2d_full_s, self.allgather_s, self.all_to_all_s) < 0:
            raise ValueError(f"step costs must be >= 0 seconds: {self}")


def step_costs(tokens: int, config: DiTConfig = SUPER, num_gpus: int = NUM_GPUS) -> StepCosts:
    total = config.num_blocks * block_bytes(config)
    frac = (num_gpus - 1) / num_gpus
    a2a_bytes = 4 * config.num_blocks * CFG_BRANCHES * (tokens / num_gpus) * config.hidden_dim * 2 * frac
    return StepCosts(
        step_flops(tokens, config) / B300_EFFECTIVE_FLOP_PER_S,
        total / num_gpus / B300_PINNED_H2D_BYTES_PER_S,
        total / B300_PINNED_H2D_BYTES_PER_S,
        frac * total / B300_NVLINK_ALLGATHER_BYTES_PER_S,
        a2a_bytes / B300_NVLINK_ALL_TO_ALL_BYTES_PER_S,
    )


def _per_block(costs: StepCosts, strategy: str, num_gpus: int) -> tuple[float, float, float, str]:
    """(compute, H2D, all-gather) seconds per block and the schedule mode for one strategy."""
    usp = costs.compute_s / num_gpus + costs.all_to_all_s
    if strategy == "HSDP+USP4":
        return usp, 0.0, costs.allgather_s, "allgather"
    if strategy == "DLO+AG DP4":
        return costs.compute_s, costs.h2d_shard_s, costs.allgather_s, "allgather"
    if strategy == "DLO+AG+USP4":
        return usp, costs.h2d_shard_s, costs.allgather_s, "allgather"
    if strategy == "DLO no-AG DP4":
        return costs.compute_s, costs.h2d_full_s, 0.0, "rank-local"
    raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")


def simulate_step_s(
    costs: StepCosts,
    strategy: str,
    *,
    num_blocks: int = SUPER.num_blocks,
    num_gpus: int = NUM_GPUS,
    num_landing: int = 1,
    num_steps: int = 3,
) -> tuple[float, str]:
    """Steady-state step (s) and its bounding stream: ``compute`` when compute never waits, else the transfer
    stream that is busiest per step (``allgather`` or ``h2d``). ``num_landing = 1``: the reference's serial
    H2D -> all-gather; 2: ours (the two overlap)."""
    comp, h2d, ag, mode = (x / num_blocks if isinstance(x, float) else x for x in _per_block(costs, strategy, num_gpus))
    durations = {C: comp, H2D: h2d, AG: ag}
    schedule = build_schedule(
        num_blocks, num_steps, num_landing=num_landing if mode == "allgather" else None, mode=mode
    )
    timeline = simulate(schedule, lambda op: durations[op.kind])
    ends = sorted(s.end_s for s in timeline.spans if s.stream == "compute")
    step_s = (ends[-1] - ends[num_blocks - 1]) / (num_steps - 1)
    if step_s <= num_blocks * comp * (1 + 1e-9):
        return step_s, "compute"
    serial = num_landing == 1 and mode == "allgather"
    bound = "h2d+allgather" if serial and h2d > 0 else ("allgather" if ag >= h2d else "h2d")
    return step_s, bound


@dataclass(frozen=True, slots=True)
class Prediction:
    workload: str
    strategy: str
    step_s: float
    wave_s: float
    outputs_per_wave: int
    bound: str

    @property
    def outputs_per_s(self) -> float:
        return self.outputs_per_wave / self.wave_s


def predict(workload: Workload | str, strategy: str, *, num_landing: int = 1) -> Prediction:
    w = WORKLOADS[workload] if isinstance(workload, str) else workload
    step_s, bound = simulate_step_s(step_costs(w.tokens), strategy, num_landing=num_landing)
    outputs = NUM_GPUS if strategy.endswith("DP4") else 1
    return Prediction(w.name, strategy, step_s, w.num_steps * step_s, outputs, bound)
