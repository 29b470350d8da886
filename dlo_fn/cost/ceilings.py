"""Measured ceilings of one NVIDIA H200 SXM and the reference workloads, as named constants.

Source of every number: ``DESIGN.md`` section 6 (one H200 SXM, PCIe Gen5 x16, torch 2.11.0+cu130). These are
inputs of the timeline simulator (:func:`h200_durations`); :data:`H200_PASS` holds the measured 24-block pass
that a simulation is compared against, never an input.

The reference block (hidden 4096, 32 heads, MLP x4, adaLN) has ``18 D^2 + 15 D = 302,051,328`` parameters
(qkv + out ``4 D^2``, MLP ``8 D^2``, adaLN modulation ``6 D^2``, their biases ``15 D``): 604.1e6 bytes in bf16,
the "576 MB" of DESIGN.md read as MiB. Its H2D takes ``604.1e6 / 54.7e9 = 11.0 ms`` (DESIGN.md's "10.5 ms"
divides 576e6 by 55e9); 24 of them take 0.265 s, which is the measured image ideal bound below.

An all-gather over ``W > 1`` ranks has no measured ceiling here (one GPU), so :func:`h200_durations` needs its
bus bandwidth passed explicitly; at ``W = 1`` it is a device-to-device copy at the measured rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo_fn.plan.timeline import BandwidthDurations, bandwidth_durations
from dlo_fn.plan.workload import Workload

__all__ = [
    "H200_PINNED_H2D_BYTES_PER_S",
    "H200_PINNED_H2D_RANGE_BYTES_PER_S",
    "H200_PAGEABLE_H2D_RANGE_BYTES_PER_S",
    "H200_D2D_TRAFFIC_BYTES_PER_S",
    "H200_D2D_COPY_BYTES_PER_S",
    "H200_BF16_MATMUL_FLOP_PER_S",
    "H200_HOST_SECONDS_PER_BLOCK",
    "REF_BLOCK_HIDDEN",
    "REF_BLOCK_PARAMS",
    "REF_BLOCK_BYTES",
    "REF_PASS_NUM_BLOCKS",
    "IMAGE_1024_CFG",
    "VIDEO_832X480X29_CFG",
    "VIDEO_720P_10S",
    "WORKLOADS",
    "H200_BLOCK_COMPUTE_S",
    "MeasuredPass",
    "H200_PASS",
    "h200_durations",
    "dit_block_params",
]

_SRC = "DESIGN.md section 6 (one H200 SXM, PCIe Gen5 x16, torch 2.11.0+cu130)"

# Pinned H2D (and D2H), 64 MB to 1 GB: 54.4-55.0 GB/s; the simulator uses the midpoint.
H200_PINNED_H2D_RANGE_BYTES_PER_S = (54.4e9, 55.0e9)
H200_PINNED_H2D_BYTES_PER_S = 54.7e9
# Pageable H2D: 5.5-7.6 GB/s (pinning is worth ~9x).
H200_PAGEABLE_H2D_RANGE_BYTES_PER_S = (5.5e9, 7.6e9)
# Device-to-device copy, counting read + write traffic: 4.2 TB/s, so copying n bytes takes 2 n / 4.2e12 s.
H200_D2D_TRAFFIC_BYTES_PER_S = 4.2e12
H200_D2D_COPY_BYTES_PER_S = H200_D2D_TRAFFIC_BYTES_PER_S / 2
# bf16 matmul 8192^3.
H200_BF16_MATMUL_FLOP_PER_S = 745e12
# Host (Python) cost of copy + event record + wait, per block. Hidden while the host runs ahead of the device,
# which is what the simulator assumes; it bounds the step time only if it exceeds the device time per block.
H200_HOST_SECONDS_PER_BLOCK = 41e-6


def dit_block_params(hidden: int, mlp_ratio: int = 4, adaln_chunks: int = 6) -> int:
    """Parameters of the reference DiT block: attention ``4 D^2``, MLP ``2 m D^2``, adaLN ``c D^2``, biases."""
    d = hidden
    return (4 + 2 * mlp_ratio + adaln_chunks) * d * d + (4 + mlp_ratio + 1 + adaln_chunks) * d


REF_BLOCK_HIDDEN = 4096
REF_BLOCK_PARAMS = dit_block_params(REF_BLOCK_HIDDEN)  # 302,051,328: "302M params"
REF_BLOCK_BYTES = 2 * REF_BLOCK_PARAMS  # bf16: 604,102,656 bytes = 576.1 MiB
REF_PASS_NUM_BLOCKS = 24  # the measured pass: 24 reference blocks


# The measured workloads: one step (one pass over the blocks), CFG branches batched where the name says so.
IMAGE_1024_CFG = Workload("image 1024^2 CFG", 4096, num_steps=1, cfg_branches=2)
VIDEO_832X480X29_CFG = Workload("video 832x480x29 CFG", 12480, num_steps=1, cfg_branches=2)
VIDEO_720P_10S = Workload("video 720p 10 s", 75600, num_steps=1, cfg_branches=1)
WORKLOADS = {w.name: w for w in (IMAGE_1024_CFG, VIDEO_832X480X29_CFG, VIDEO_720P_10S)}

# Measured compute of one reference block per step, by workload name (the DiT block row of DESIGN.md section 6).
H200_BLOCK_COMPUTE_S = {IMAGE_1024_CFG.name: 6.1e-3, VIDEO_832X480X29_CFG.name: 26.4e-3, VIDEO_720P_10S.name: 222e-3}


@dataclass(frozen=True, slots=True)
class MeasuredPass:
    """One pass over 24 reference blocks, median of 3-5: ``seconds`` measured, or ``ratio`` to the ideal bound
    ``max(resident compute, weight bytes / pinned peak measured in that run)``."""

    workload: str
    variant: str
    seconds: float | None = None
    ratio_to_ideal: float | None = None
    source: str = _SRC


H200_PASS = {
    (p.workload, p.variant): p
    for p in (
        MeasuredPass(IMAGE_1024_CFG.name, "resident", seconds=0.159),
        MeasuredPass(VIDEO_832X480X29_CFG.name, "resident", seconds=0.640),
        MeasuredPass(IMAGE_1024_CFG.name, "ideal", seconds=0.265),
        MeasuredPass(VIDEO_832X480X29_CFG.name, "ideal", seconds=0.640),
        MeasuredPass(IMAGE_1024_CFG.name, "double buffer", ratio_to_ideal=1.018),
        MeasuredPass(VIDEO_832X480X29_CFG.name, "double buffer", ratio_to_ideal=1.011),
        MeasuredPass(IMAGE_1024_CFG.name, "synchronous", ratio_to_ideal=1.58),
        MeasuredPass(VIDEO_832X480X29_CFG.name, "synchronous", ratio_to_ideal=1.32),
    )
}


def h200_durations(
    num_blocks: int,
    workload: Workload,
    *,
    world_size: int = 1,
    mode: str = "allgather",
    block_bytes: float | tuple[float, ...] = REF_BLOCK_BYTES,
    allgather_bus_bytes_per_s: float | None = None,
    launch_latency_s: float = 0.0,
) -> BandwidthDurations:
    """Op durations on H200s: H2D at the pinned ceiling, compute as measured (:data:`H200_BLOCK_COMPUTE_S`),
    all-gather as below.

    H2D moves the local shard ``ceil(n / W)`` (allgather) or the whole block ``n`` (rank-local). The all-gather
    of ``n`` output bytes takes ``((W - 1) / W) n / busbw`` (NCCL's bus-bandwidth convention; ``busbw`` must be
    given for ``W > 1``), and at ``W = 1`` it is a device copy, ``n / 2.1e12``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if workload.name not in H200_BLOCK_COMPUTE_S:
        raise ValueError(
            f"no measured H200 block compute for workload {workload.name!r}; measured: "
            f"{', '.join(H200_BLOCK_COMPUTE_S)}"
        )
    sizes = (float(block_bytes),) * num_blocks if isinstance(block_bytes, (int, float)) else tuple(block_bytes)
    if len(sizes) != num_blocks:
        raise ValueError(f"block_bytes has {len(sizes)} entries, expected num_blocks = {num_blocks}")
    if mode == "rank-local":
        h2d, gathered, rate = sizes, (0.0,) * num_blocks, H200_D2D_COPY_BYTES_PER_S
    elif world_size == 1:
        h2d, gathered, rate = sizes, sizes, H200_D2D_COPY_BYTES_PER_S
    else:
        if allgather_bus_bytes_per_s is None:
            raise ValueError("no all-gather ceiling was measured for W > 1: pass allgather_bus_bytes_per_s")
        h2d = tuple(-(-n // world_size) for n in sizes)
        gathered = tuple((world_size - 1) / world_size * n for n in sizes)
        rate = allgather_bus_bytes_per_s
    return bandwidth_durations(
        num_blocks,
        h2d_bytes=h2d,
        allgather_bytes=gathered,
        compute_s=H200_BLOCK_COMPUTE_S[workload.name],
        h2d_bytes_per_s=H200_PINNED_H2D_BYTES_PER_S,
        allgather_bytes_per_s=rate,
        launch_latency_s=launch_latency_s,
    )
