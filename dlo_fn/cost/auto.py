"""``"auto"`` options: which plans the policy may choose, the inputs it chooses from, and the option values of its
choice; pure. The runtime measures (:mod:`dlo_fn.runtime.auto`, :mod:`dlo_fn.runtime.probe`), every rank follows
rank 0's choice, and ``offload`` builds once with concrete :class:`~dlo_fn.runtime.options.OffloadOptions`.

==================  ===================================================================================================
what                where it comes from
==================  ===================================================================================================
links               :class:`LinkRates`, measured on block 0's bytes at ``offload``: pinned H2D, the all-gather over
                    the shard group (``W > 1``, else a device copy), the all-to-all (``W > 1``), host work per block
compute             a :class:`~dlo_fn.plan.workload.Workload` given: the block FLOPs ``F(L)``
                    (:func:`~dlo_fn.cost.topology.block_flops`) at a measured matmul rate; none given: every block's
                    compute time measured on the first call (:func:`measured_inputs`)
outside the blocks  measured on the first call (the forward's time minus its loads and blocks); 0 with a workload
memory              the device's memory; the host's RAM over the local ranks; activations from the allocator's peak
                    on the first call (accelerators); under ``hbm_budget`` the budget, in place of the device's memory
                    for the weights: each candidate keeps the blocks ``offload`` keeps resident
                    (:mod:`dlo_fn.cost.hbm_budget`), and the choice says what a larger budget buys
==================  ===================================================================================================

Measured on the first call, the workload is one forward of one request (``tokens = 1`` stands for whatever
sequence the call had: every term is then the measured one, and :data:`MEASURED_STEPS` steps weigh the cold first
step against the steady ones).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from dlo_fn.cost.policy import PlanRow, PolicyResult, plan
from dlo_fn.cost.topology import BlockCompute, PolicyModel, Topology, compute_shape
from dlo_fn.plan.modes import OFFLOAD_MODES
from dlo_fn.plan.sizes import ModelSizes
from dlo_fn.plan.workload import Workload

__all__ = [
    "AUTO",
    "AUTO_FIELDS",
    "AUTO_SLOTS",
    "AUTO_LOAD_GROUPS",
    "MEASURED_STEPS",
    "LinkRates",
    "AutoChoice",
    "auto_slots",
    "sp_choices",
    "choose",
    "option_values",
    "hidden_dim",
    "topology_from",
    "measured_inputs",
]

AUTO = "auto"
AUTO_FIELDS = ("mode", "num_slots", "load_group")
AUTO_SLOTS = (2, 3, 4, 5, 6)
AUTO_LOAD_GROUPS = (1, 2, 4)
MEASURED_STEPS = 20


@dataclass(frozen=True, slots=True)
class LinkRates:
    """What the start-up probe measures of the machine (seconds and bytes/s; ``all_to_all`` None on one rank)."""

    h2d_bytes_per_s: float
    allgather_bus_bytes_per_s: float
    d2d_copy_bytes_per_s: float
    host_s_per_block: tuple[tuple[str, float], ...]
    hbm_bytes: int
    host_bytes: int
    all_to_all_bytes_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class AutoChoice:
    """The policy's choice for ``auto`` fields: the chosen and runner-up rows (predicted step times), where its
    inputs came from (``"workload"``, ``"first call"``, ``"probe"``), and the ranked result."""

    chosen: PlanRow
    runner_up: PlanRow | None
    fields: tuple[str, ...]
    source: str
    result: PolicyResult

    def why(self) -> str:
        text = f"{self.chosen.candidate.label}: predicted step {1e3 * self.chosen.step_s:.2f} ms ({self.chosen.bound})"
        if self.runner_up is not None:
            text += (
                f"; runner-up {self.runner_up.candidate.label}: {1e3 * self.runner_up.step_s:.2f} ms "
                f"({self.runner_up.bound})"
            )
        return f"{text}; chose {', '.join(self.fields)} from the {self.source}{self.result.budget_note()}"


def auto_slots(load_groups: tuple[int, ...]) -> tuple[int, ...]:
    """The slot counts ``--slots auto`` offers: ``AUTO_SLOTS``, and two groups' worth for each load group."""
    return tuple(sorted(set(AUTO_SLOTS) | {2 * g for g in load_groups}))


def sp_choices(world_size: int, num_heads: int | None) -> tuple[int, ...]:
    """The sp sizes ``--sp auto`` may take: divisors of the world that divide the model's heads (Ulysses)."""
    return tuple(
        d for d in range(1, world_size + 1) if world_size % d == 0 and (num_heads is None or num_heads % d == 0)
    )


def choose(
    topology: Topology,
    model: PolicyModel,
    workload: Workload,
    *,
    mode: str | None = None,
    num_slots: int | None = None,
    load_group: int | None = 1,
    requests_per_rank: int = 1,
    objective: str = "throughput",
    sps: tuple[int, ...] = (1,),
    hbm_budget: int | None = None,
) -> PolicyResult:
    """The planner with ``mode`` / ``num_slots`` / ``load_group`` fixed, or (None) chosen: slots from
    :func:`auto_slots`, load groups from ``AUTO_LOAD_GROUPS``; ``sps`` the sp sizes to consider; ``hbm_budget``
    the device weight bytes per rank (the resident blocks of each candidate within it)."""
    groups = AUTO_LOAD_GROUPS if load_group is None else (load_group,)
    return plan(
        model,
        topology,
        workload,
        objective=objective,
        slots=auto_slots(groups) if num_slots is None else (num_slots,),
        requests_per_rank=(requests_per_rank,),
        modes=OFFLOAD_MODES if mode is None else (mode,),
        sps=tuple(sps),
        load_groups=groups,
        hbm_budget=hbm_budget,
    )


def option_values(row: PlanRow) -> dict:
    """The :class:`~dlo_fn.runtime.options.OffloadOptions` fields of a chosen row (``dataclasses.replace``): mode,
    slots, load group, the ``2G`` landing buffers it priced (allgather at ``W > 1``) and the shard group."""
    c = row.candidate
    values = {
        "mode": c.mode,
        "num_slots": c.num_slots,
        "load_group": c.load_group,
        "shard_group": "dp" if c.shard_group == "dp" else "world",
    }
    if c.load_group > 1 and c.num_landing:
        values["num_landing"] = c.num_landing
    return values


def hidden_dim(block) -> int:
    """A block's residual width: the input features of its first linear layer (1 if it has none)."""
    return next((m.in_features for m in block.modules() if type(m).__name__ == "Linear"), 1)


def topology_from(
    name: str,
    num_ranks: int,
    links: LinkRates,
    compute: BlockCompute,
    step_overhead: tuple[tuple[int, int, float], ...] = (),
    source: str = "probe",
) -> Topology:
    """A :class:`Topology` of measured links and a compute model (every field's source: ``source``)."""
    a2a = links.all_to_all_bytes_per_s or links.allgather_bus_bytes_per_s
    fields = (
        "h2d_bytes_per_s",
        "allgather_bus_bytes_per_s",
        "all_to_all_bytes_per_s",
        "d2d_copy_bytes_per_s",
        "compute",
        "host_s_per_block",
        "hbm_bytes_per_rank",
        "host_bytes_per_rank",
        "step_overhead",
    )
    return Topology(
        name,
        num_ranks,
        links.h2d_bytes_per_s,
        links.allgather_bus_bytes_per_s,
        a2a,
        links.d2d_copy_bytes_per_s,
        compute,
        links.hbm_bytes,
        links.host_bytes,
        links.host_s_per_block,
        False,
        step_overhead,
        sources=tuple((f, source) for f in fields),
    )


def measured_inputs(
    sizes: ModelSizes,
    hidden_dim: int,
    dtype_bytes: int,
    block_s: tuple[float, ...],
    outside_s: float,
    activation_bytes: int,
    links: LinkRates,
    num_ranks: int,
    tensor_block_bytes: tuple[int, ...] = (),
) -> tuple[Topology, PolicyModel, Workload]:
    """The policy's inputs from a first call: every block's compute ``block_s``, the time outside the blocks and
    the allocator's activation peak. The mean block compute is ``median_b(t_b / f_b)`` with ``f_b`` the block's
    FLOP share (:func:`~dlo_fn.cost.topology.compute_shape`): robust to one slow block (a first call's lazy set-up)."""
    if len(block_s) != sizes.num_blocks:
        raise ValueError(f"{len(block_s)} block times for {sizes.num_blocks} blocks")
    model = PolicyModel(
        sizes,
        hidden_dim,
        dtype_bytes,
        activation_bytes,
        0,
        source="the model's spec; activations from the first call's allocator peak",
        tensor_block_bytes=tensor_block_bytes,
    )
    workload = Workload("measured on the first call", 1, MEASURED_STEPS, 1)
    shape = compute_shape(model, 1, 1)
    mean_s = statistics.median(t / f for t, f in zip(block_s, shape))
    compute = BlockCompute(table=((1, 1, max(mean_s, 1e-9)),))
    return (
        topology_from(
            "measured on the first call",
            num_ranks,
            links,
            compute,
            ((1, 1, max(outside_s, 0.0)),),
            "probe at offload and the first call",
        ),
        model,
        workload,
    )
