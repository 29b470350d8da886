"""Calibrated constants of the memory models: each named, fitted once to one stated published number.

The memory models are sums of terms. Most terms follow from the model's bytes and the plan (slots, shards,
ranks); the few that do not (what a framework process costs, what a device context costs, what one workload's
activations cost) are constants measured on one deployment. Each constant below is a literal, fitted once; its
docstring names the published number(s) it was fitted to and the arithmetic, and ``tests/test_memory.py``
re-derives it from :mod:`benchmarks.repro.published` so the literal cannot drift from its source. Comparisons
against the very number a constant was fitted to are flagged ``calibrated`` (agreement by construction).

Fitting uses the *published* model sizes (Cosmos3-Nano: 33 GB in 72 blocks, resident bytes unknown so 0):
those are the models the published numbers were measured on.
"""

from __future__ import annotations

__all__ = [
    "FRAMEWORK_HOST_BYTES_PER_RANK",
    "DEVICE_CONTEXT_BYTES",
    "ACTIVATION_COMM_BYTES_NANO_720P_10S_SP",
    "ACTIVATION_COMM_BYTES_NANO_480P_29F_DP4",
    "CALIBRATIONS",
]

FRAMEWORK_HOST_BYTES_PER_RANK = 3_500_000_000
"""Host bytes of one worker process without weights (Python, torch, the comm library, the pipeline's other
modules). Source: the published Figure 6 component table, "framework (Python/torch/HCCL) ~3.5 GB x dp"
(``fig6.framework_per_rank``). The host-memory table agrees for three of its four rows (RSS 14 GB at DP4,
7 GB at DP2, 14 GB at DP4); Figure 6's own RSS (18 GB at DP2) does not (see notebook 04)."""

DEVICE_CONTEXT_BYTES = 8_254_164_480
"""Device bytes that are neither offloaded weights nor workload buffers (runtime/CANN context, HCCL buffers,
the pipeline's resident modules: text encoder, VAE, non-block DiT tensors) on an Ascend 910B3 card serving
Cosmos3. Source: the NPU HBM table, Nano DP4 idle 9.4 GB (``hbm.nano_dp4.idle``), minus the predicted weight
bytes of published Nano (33 GB / 72 equal blocks, W = 4, 2 slots + 2 landing buffers, A = 256):
``9.4e9 - (2 * 458_334_208 + 2 * 114_583_552) = 8_254_164_480``."""

ACTIVATION_COMM_BYTES_NANO_720P_10S_SP = 11_600_000_000
"""Workload bytes per card (activations + communication buffers; the source does not split them) of Nano at
720p 10 s under dist_offload+SP. Source: Figure 4, Nano peak 23.1 GB minus Nano idle 11.5 GB (``fig4.nano.peak``
- ``fig4.nano.idle``): peak minus idle removes every term that is held while idle."""

ACTIVATION_COMM_BYTES_NANO_480P_29F_DP4 = 3_000_000_000
"""Workload bytes per card of Nano at 832x480, 29 frames, DLO+AG DP4 (one request per rank). Source: the
Ascend performance table, DLO+AG DP4 HBM 12.4 GB (``perf.nano.dlo_ag_dp4.hbm_per_card``), minus the HBM table's
Nano DP4 idle 9.4 GB (``hbm.nano_dp4.idle``), the same deployment before any request."""

CALIBRATIONS = {
    "FRAMEWORK_HOST_BYTES_PER_RANK": (FRAMEWORK_HOST_BYTES_PER_RANK, ("fig6.framework_per_rank",)),
    "DEVICE_CONTEXT_BYTES": (DEVICE_CONTEXT_BYTES, ("hbm.nano_dp4.idle",)),
    "ACTIVATION_COMM_BYTES_NANO_720P_10S_SP": (
        ACTIVATION_COMM_BYTES_NANO_720P_10S_SP,
        ("fig4.nano.peak", "fig4.nano.idle"),
    ),
    "ACTIVATION_COMM_BYTES_NANO_480P_29F_DP4": (
        ACTIVATION_COMM_BYTES_NANO_480P_29F_DP4,
        ("perf.nano.dlo_ag_dp4.hbm_per_card", "hbm.nano_dp4.idle"),
    ),
}
"""name -> (value in bytes, the published keys it was fitted to)."""
