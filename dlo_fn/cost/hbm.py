"""Device memory (HBM) per card, term by term, and the four approaches of the published Figure 1.

DLO holds a fixed double buffer of whole blocks plus landing buffers for the local shard::

    HBM = S * max_b(W * s_b)            slots: the largest block, padded to W equal shards
        + L * max_b s_b                 landing buffers (allgather at W > 1; rank-local, and allgather over
                                        one rank, which lowers to the rank-local ops: L = 0, W = 1)
        + R                             resident (non-block) tensors, kept on every card
        + a + k                         activations and communication buffers (workload inputs)
        + c_dev                         device context (an input: measured on one deployment)

with ``s_b = align_up(ceil(n_b / W), A)``. Only the first two terms depend on the blocks, and only through the
*largest* block: HBM is independent of depth. ``idle`` excludes ``a + k``; ``peak`` includes them.

The approaches of Figure 1 on ``N`` cards, same notation (``M`` model bytes)::

    approach          HBM per card                           host weights per rank
    hsdp              c_dev + M/N + 2 * max_b n_b + a + k    0          (FSDP2 gathers 2 blocks ahead)
    layerwise-dp      c_dev + R + S * max_b n_b + a + k      M          (a pinned full copy per rank)
    tp                c_dev + M/N + a + k                    0
    dlo               c_dev + R + S*max(W s_b) + L*max s_b   sum_b s_b  (~ M/N)
                      + a + k
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dlo_fn.cost.memory import ModelSizes, pinned_host_bytes_per_rank
from dlo_fn.plan.layout import DEFAULT_ALIGNMENT_BYTES
from dlo_fn.plan.lowering import lowered_mode
from dlo_fn.plan.schedule import DEFAULT_NUM_LANDING

__all__ = [
    "HBM_MODES",
    "APPROACHES",
    "HbmPerCard",
    "hbm_per_card",
    "scale_activation_bytes",
    "ApproachMemory",
    "approach_memory",
]

HBM_MODES = ("allgather", "rank-local")
APPROACHES = ("hsdp", "layerwise-dp", "tp", "dlo")


@dataclass(frozen=True, slots=True)
class HbmPerCard:
    """Device bytes per card by term; ``weight_bytes`` is what ``python -m dlo_fn plan`` calls
    ``hbm_weight_bytes``."""

    slot_bytes: int
    landing_bytes: int
    resident_bytes: int
    activation_bytes: int
    communication_bytes: int
    context_bytes: int

    def __post_init__(self) -> None:
        for name in (
            "slot_bytes",
            "landing_bytes",
            "resident_bytes",
            "activation_bytes",
            "communication_bytes",
            "context_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int of bytes, got {value!r}")

    @property
    def weight_bytes(self) -> int:
        return self.slot_bytes + self.landing_bytes

    @property
    def idle_bytes(self) -> int:
        return self.weight_bytes + self.resident_bytes + self.context_bytes

    @property
    def peak_bytes(self) -> int:
        return self.idle_bytes + self.activation_bytes + self.communication_bytes


def hbm_per_card(
    sizes: ModelSizes,
    num_shards: int,
    mode: str = "allgather",
    *,
    num_slots: int = 2,
    num_landing: int = DEFAULT_NUM_LANDING,
    activation_bytes: int = 0,
    communication_bytes: int = 0,
    context_bytes: int,
    include_resident: bool = True,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> HbmPerCard:
    """DLO's HBM per card (module docstring). ``num_landing`` is ignored in rank-local mode (no shards).

    ``context_bytes`` is ``c_dev``, a property of the device and its runtime: pass a measured value (0 for the
    weight terms alone; the published Ascend deployment's is ``dlo_fn.cost.calibration.DEVICE_CONTEXT_BYTES``).
    """
    if mode not in HBM_MODES:
        raise ValueError(f"mode must be one of {HBM_MODES}, got {mode!r}")
    if num_slots < 1:  # as the schedule: 1 slot serialises load and compute, 2 is the double buffer
        raise ValueError(f"num_slots must be >= 1 (2 = double buffer), got {num_slots}")
    if mode == "allgather" and num_landing < 1:
        raise ValueError(f"allgather mode needs num_landing >= 1, got {num_landing}")
    w = num_shards if mode == "allgather" else 1
    gathered = lowered_mode(mode, w) == "allgather"  # one rank: no landing buffer (plan.lowering)
    return HbmPerCard(
        slot_bytes=num_slots
        * (
            sizes.max_padded_block_bytes(w, alignment_bytes)  # a quantised slot's staging too
            + sizes.staging_bytes(w, alignment_bytes)
        ),
        landing_bytes=num_landing * sizes.max_shard_bytes(w, alignment_bytes) if gathered else 0,
        resident_bytes=sizes.resident_bytes if include_resident else 0,
        activation_bytes=int(activation_bytes),
        communication_bytes=int(communication_bytes),
        context_bytes=int(context_bytes),
    )


def scale_activation_bytes(activation_bytes: int, from_sizes: ModelSizes, to_sizes: ModelSizes) -> int:
    """Carry a workload's activation bytes from one model to another of the same block architecture.

    At a fixed token count the activations are ``tokens x hidden width d`` times a constant, and a block holds
    ``~ k d^2`` parameters, so ``d`` scales as ``sqrt(max block bytes)``::

        a_to = a_from * sqrt(max_block_to / max_block_from)

    An assumption, stated where it is used: it holds for models that differ only in width.
    """
    ratio = to_sizes.max_block_bytes / from_sizes.max_block_bytes
    return round(activation_bytes * math.sqrt(ratio))


@dataclass(frozen=True, slots=True)
class ApproachMemory:
    """HBM per card and host weight bytes per rank of one approach (Figure 1)."""

    approach: str
    num_devices: int
    hbm: HbmPerCard
    host_weight_bytes_per_rank: int

    @property
    def host_weight_bytes_total(self) -> int:
        return self.num_devices * self.host_weight_bytes_per_rank


def approach_memory(
    sizes: ModelSizes,
    num_devices: int,
    approach: str,
    *,
    activation_bytes: int = 0,
    communication_bytes: int = 0,
    context_bytes: int,
    num_slots: int = 2,
    num_landing: int = DEFAULT_NUM_LANDING,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> ApproachMemory:
    """One column of Figure 1; the table in the module docstring gives each term.

    In ``hsdp`` and ``tp`` the sharded weights (``M / N``, resident tensors included) sit in ``resident_bytes``;
    FSDP2's two gathered blocks (the one computing and the one prefetched) are all-gather outputs, allocated
    during the forward only: they are added to ``communication_bytes``.
    """
    if approach not in APPROACHES:
        raise ValueError(f"approach must be one of {APPROACHES}, got {approach!r}")
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    workload = dict(
        activation_bytes=activation_bytes,
        communication_bytes=communication_bytes,
        context_bytes=context_bytes,
        num_slots=num_slots,
        alignment_bytes=alignment_bytes,
    )
    if approach == "dlo":
        hbm = hbm_per_card(sizes, num_devices, "allgather", num_landing=num_landing, **workload)
        host = pinned_host_bytes_per_rank(sizes, num_devices, "allgather", alignment_bytes)
    elif approach == "layerwise-dp":
        hbm = hbm_per_card(sizes, 1, "rank-local", **workload)
        host = pinned_host_bytes_per_rank(sizes, 1, "rank-local", alignment_bytes)
    else:
        sharded = -(-sizes.total_bytes // num_devices)
        gathered = 2 * sizes.max_block_bytes if approach == "hsdp" else 0
        hbm = HbmPerCard(0, 0, sharded, int(activation_bytes), int(communication_bytes) + gathered, int(context_bytes))
        host = 0
    return ApproachMemory(approach, num_devices, hbm, host)
