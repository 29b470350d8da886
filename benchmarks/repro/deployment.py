"""The published deployment's memory models: the plan's host and HBM models (:mod:`dlo_fn.cost.memory`,
:mod:`dlo_fn.cost.hbm`) with its two calibrated constants bound (:mod:`dlo_fn.cost.calibration`)::

    c      framework host bytes per rank   FRAMEWORK_HOST_BYTES_PER_RANK (3.5 GB, Figure 6)
    c_dev  device context bytes per card   DEVICE_CONTEXT_BYTES (Nano DP4 idle HBM minus its weight terms)

Every prediction of a published memory number goes through these five functions, so the constants enter in
one place; the plan functions themselves take them as inputs.
"""

from __future__ import annotations

from dlo_fn.cost import hbm, memory
from dlo_fn.cost.calibration import DEVICE_CONTEXT_BYTES, FRAMEWORK_HOST_BYTES_PER_RANK
from dlo_fn.plan.sizes import ModelSizes

__all__ = ["cold_start", "host_steady_state", "host_capacity", "hbm_per_card", "approach_memory"]


def cold_start(sizes: ModelSizes, num_ranks: int, loading: str = "mmap", mode: str = "allgather") -> memory.ColdStart:
    return memory.cold_start(sizes, num_ranks, loading, mode, framework_bytes_per_rank=FRAMEWORK_HOST_BYTES_PER_RANK)


def host_steady_state(
    sizes: ModelSizes, num_ranks: int, platform: str = "cuda", mode: str = "allgather"
) -> memory.HostSteadyState:
    return memory.host_steady_state(
        sizes, num_ranks, platform, mode, framework_bytes_per_rank=FRAMEWORK_HOST_BYTES_PER_RANK
    )


def host_capacity(sizes: ModelSizes, num_ranks: int, platform: str = "ascend") -> memory.HostCapacity:
    return memory.host_capacity(sizes, num_ranks, platform, framework_bytes_per_rank=FRAMEWORK_HOST_BYTES_PER_RANK)


def hbm_per_card(
    sizes: ModelSizes, num_shards: int, mode: str = "allgather", *, activation_bytes: int = 0
) -> hbm.HbmPerCard:
    return hbm.hbm_per_card(
        sizes, num_shards, mode, activation_bytes=activation_bytes, context_bytes=DEVICE_CONTEXT_BYTES
    )


def approach_memory(
    sizes: ModelSizes, num_devices: int, approach: str, *, activation_bytes: int = 0
) -> hbm.ApproachMemory:
    return hbm.approach_memory(
        sizes, num_devices, approach, activation_bytes=activation_bytes, context_bytes=DEVICE_CONTEXT_BYTES
    )
