"""Topology policy: enumerate (dp, sp, mode, shard group, slots, R, load group) on a
:class:`~dlo_fn.cost.topology.Topology`, predict each with the planner's own schedule, simulator and memory models,
drop what does not fit, rank; pure.

**Candidates.** ``dp x sp = N``; mode ``rank-local`` (``W = 1``) or ``allgather`` over the shard group ``mesh``
(every rank in lockstep, ``W = dp sp``) or ``dp`` (the reference: SP partners hold identical shards, ``W = dp``);
``S`` slots; ``R`` requests per rank run block-major through each loaded block. An all-gather over a shard group
of one rank (``W = 1``: rank-local mode, or ``allgather`` over ``dp = 1``) is the identity, and the lowering runs
the rank-local op sequence for it (one H2D straight into the slot, no landing buffer, no AG, rank-local host work
per block): such a row is costed and sized as rank-local, and on a tie the rank-local label is chosen. A load
group ``G > 1`` (``load_groups``; :mod:`dlo_fn.plan.lowering`) is offered on ``S`` slots a multiple of ``G`` and
``>= 2G``, on both op sequences; at ``W > 1`` with ``2G`` landing buffers, its host work priced with the allgather
program's own fixed share (:func:`~dlo_fn.cost.host_cost.host_scale`: fitted on one NCCL rank, the NCCL enqueue
per all-gather in it; its cost over several GPUs is measured on no machine yet).

**Per-op durations** (block ``b``, one request; ``L`` tokens per branch, ``g`` branches)::

    H2D   s_b / beta_h            (allgather: the local shard s_b = align_up(ceil(n_b / W), A); rank-local: n_b)
    AG    ((W - 1) / W) W s_b / busbw        (W = 1: none, see above)
    C     c(L, sp) + u + h        host serial (the reference)
          max(c(L, sp) + u, h)    host runs ahead (ours)
          h = h_1 x host_scale(B, S, G)    with load groups (:func:`~dlo_fn.cost.host_cost.host_scale`: the
                                           stream operations per block from the plan, a fixed share for the Python)
          + o(L, g) on block 0 of every step: the per-step work outside the blocks
    u     k g ceil(L / sp) D e ((sp - 1) / sp) / beta_a2a      Ulysses (k all-to-alls per block, e bytes)

Block ``b``'s compute is ``c_b = c(L, sp) F_b / F`` (:func:`~dlo_fn.cost.topology.compute_shape`: blocks of
different sizes compute in proportion to their FLOPs).

One wave of ``min(T, 3)`` steps is simulated (:func:`~dlo_fn.plan.timeline.simulate` of
:func:`~dlo_fn.plan.schedule.build_schedule`); the steady step ``t`` is the period between the ends of the first and
the last step's computes, raised to the busiest shared link's time per pass where the topology has shared links
(:func:`~dlo_fn.cost.links.link_busy_s`: on PCIe machines the all-gather and the H2D cross the same links, which
the simulator's separate streams do not see), and ``wave = t_1 + (T - 1) t + R q`` (``t_1``: the first step, cold
ring; ``q``: the
per-request work outside the ring, noise and text in, latents out, decode and hash, counted serial). Per wave ``dp R``
outputs; ``outputs_per_s = dp R / wave``; the per-output step is ``t / R`` per replica.

**Bound** of a row: the shared link (``pcie``, ``uplink``, ``host-memory``) or the stream busy >= 99.5% of the
steady step (``h2d``, ``allgather``, ``h2d+allgather`` where
one landing buffer serialises the two; ``compute``, or
``host`` where the host term is the larger part of C), else ``exposed``: no stream is saturated, the ring cannot
run ahead across the per-step work (a deeper ring, more slots, hides it).

**Memory** per rank: HBM from :func:`~dlo_fn.cost.hbm.hbm_per_card` (slots, landing buffers, resident, activations
``R g ceil(L/sp) a_tok``, all-to-all buffers ``2 R g ceil(L/sp) D e`` at ``sp > 1``, context); host from
:func:`~dlo_fn.cost.memory.pinned_host_bytes_per_rank` plus the framework bytes. A row fits when both do; the
limiting memory is the one nearer its capacity.

**Under an HBM budget** (``hbm_budget``: device weight bytes per rank) the budget replaces the HBM capacity for
the weights (activations are the caller's). Each candidate keeps the resident blocks of its ring
(:func:`~dlo_fn.cost.hbm_budget.resident_plan`, which is :func:`~dlo_fn.plan.resident.choose_resident` placing by
its blocks' compute ``R c_b`` against the H2D link: the predicted fastest plan within the budget), whole on every
rank; the ring, its loads, the all-gathers and the pinned host bytes are the streamed blocks' only. The plan is
priced with the topology's device copy rate too (``d2d_copy_bytes_per_s``): the dequantise, and where a stored shard
holds less than its block resident (FP8, ``1/W`` shards) the device-stored shards its leftover budget keeps, whose
loads copy at that rate and whose bytes count on the device, not pinned. ``PlanRow.placed_by`` is what it placed by,
so ``offload`` keeps the same blocks and shards (:meth:`~dlo_fn.runtime.budget.Placement.from_policy`).
A resident block's compute stays: it is added to the ring op of the streamed block it follows (the pass's leading
resident blocks to the last streamed block, where the ring wraps), since the next load waits on that slot only::

    C'_j = C_{s_j} + sum_{s_j < b < s_{j+1}, b resident} c_b        s_0 < s_1 < ...  the streamed blocks

A candidate whose ring does not fit the budget with every block streamed is priced that way and dropped (its
``note`` says the minimum); a budget that holds the model runs it resident (compute only). The result lists
what the next larger budgets buy: each frontier plan's device bytes and the chosen candidate's predicted step.

**Choice.** ``objective="throughput"`` scores ``outputs_per_s``, ``"latency"`` scores ``1 / wave``. Among the
fitting rows within ``min_gain`` (relative) of the best score, the cheapest is chosen: smallest R (latency), then
least HBM (slots and landing buffers), then least host work per block, then fewest slots (and one load per
block before groups). So a request, a slot or
a byte is spent only where it buys more than ``min_gain``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dlo_fn.cost.hbm import hbm_per_card
from dlo_fn.cost.hbm_budget import ResidentPlan, format_size, resident_plan
from dlo_fn.cost.host_cost import host_scale
from dlo_fn.cost.links import link_busy_s
from dlo_fn.cost.memory import pinned_host_bytes_per_rank
from dlo_fn.cost.topology import PolicyModel, Topology, compute_shape
from dlo_fn.plan.lowering import default_num_landing, load_group_problem, lowered_mode
from dlo_fn.plan.ops import Op
from dlo_fn.plan.quant import dequant_seconds
from dlo_fn.plan.resident import BudgetError
from dlo_fn.plan.schedule import AG, DEFAULT_NUM_LANDING, DQ, H2D, build_schedule
from dlo_fn.plan.sizes import ModelSizes
from dlo_fn.plan.timeline import simulate
from dlo_fn.plan.workload import Workload

__all__ = [
    "OBJECTIVES",
    "SHARD_GROUPS",
    "Candidate",
    "PlanRow",
    "PolicyResult",
    "candidates",
    "predict",
    "plan",
    "all_to_all_s",
    "op_mode",
]

OBJECTIVES = ("throughput", "latency")
SHARD_GROUPS = ("mesh", "dp")
SATURATED = 0.995


@dataclass(frozen=True, slots=True)
class Candidate:
    dp: int
    sp: int
    mode: str
    shard_group: str  # "mesh" / "dp" (allgather), "-" (rank-local)
    num_slots: int
    requests_per_rank: int
    num_landing: int
    load_group: int = 1  # G consecutive loads as one (allgather at W > 1: on 2G landing buffers)

    @property
    def num_shards(self) -> int:
        if self.mode == "rank-local":
            return 1
        return self.dp * self.sp if self.shard_group == "mesh" else self.dp

    @property
    def label(self) -> str:
        group = f" W{self.num_shards}" if self.mode == "allgather" else ""
        load = f" G{self.load_group}" if self.load_group > 1 else ""
        return f"DP{self.dp}xSP{self.sp} {self.mode}{group} S{self.num_slots} R{self.requests_per_rank}{load}"


@dataclass(frozen=True, slots=True)
class PlanRow:
    candidate: Candidate
    step_s: float  # steady step of one replica (R requests through every block)
    wave_latency_s: float
    outputs_per_wave: int
    bound: str
    exposed_s_per_step: float  # step minus the compute stream's busy time
    hbm_bytes: int
    host_bytes: int
    hbm_capacity_bytes: int  # under an HBM budget: the budget (and hbm_bytes the device weight bytes)
    host_capacity_bytes: int
    resident: tuple[int, ...] = ()  # blocks kept on the device under an HBM budget
    # what they were placed by: (R c_b per block, H2D bytes/s, device copy bytes/s), for offload to keep the same
    # ones (runtime.budget.Placement.from_policy)
    placed_by: tuple[tuple[float, ...], float, float] | None = None
    note: str = ""  # why a row does not fit, where the memory alone does not say it

    @property
    def outputs_per_s(self) -> float:
        return self.outputs_per_wave / self.wave_latency_s

    @property
    def per_output_step_s(self) -> float:
        """Seconds of the device fleet per output per step: ``t / (dp R)``."""
        return self.step_s / self.outputs_per_wave

    @property
    def fits(self) -> bool:
        return self.hbm_bytes <= self.hbm_capacity_bytes and self.host_bytes <= self.host_capacity_bytes

    @property
    def limiting_memory(self) -> str:
        hbm, host = self.hbm_bytes / self.hbm_capacity_bytes, self.host_bytes / self.host_capacity_bytes
        which, used, cap = (
            ("hbm", self.hbm_bytes, self.hbm_capacity_bytes)
            if hbm >= host
            else ("host", self.host_bytes, self.host_capacity_bytes)
        )
        return f"{which} {used / 1e9:.1f}/{cap / 1e9:.0f} GB"

    def as_dict(self) -> dict:
        c = self.candidate
        return {
            "plan": c.label,
            "dp": c.dp,
            "sp": c.sp,
            "mode": c.mode,
            "shard_group": c.shard_group,
            "num_shards": c.num_shards,
            "slots": c.num_slots,
            "R": c.requests_per_rank,
            "step_s": self.step_s,
            "wave_s": self.wave_latency_s,
            "outputs_per_s": self.outputs_per_s,
            "per_output_step_s": self.per_output_step_s,
            "bound": self.bound,
            "exposed_ms_per_step": 1e3 * self.exposed_s_per_step,
            "hbm_gb": self.hbm_bytes / 1e9,
            "host_gb": self.host_bytes / 1e9,
            "limiting_memory": self.limiting_memory,
            "fits": self.fits,
            "resident": len(self.resident),
        }


def op_mode(cand: Candidate) -> str:
    """The op sequence a candidate runs (:func:`~dlo_fn.plan.lowering.lowered_mode`): ``allgather`` over one rank
    lowers to rank-local (module docstring)."""
    return lowered_mode(cand.mode, cand.num_shards)


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def candidates(
    num_ranks: int,
    *,
    slots: tuple[int, ...] = (2, 3, 4),
    requests_per_rank: tuple[int, ...] = (1,),
    modes: tuple[str, ...] = ("allgather", "rank-local"),
    sps: tuple[int, ...] | None = None,
    num_landing: int = DEFAULT_NUM_LANDING,
    load_groups: tuple[int, ...] = (1,),
) -> tuple[Candidate, ...]:
    """Every (dp, sp, mode, shard group, S, R, G) with ``dp sp = N``; shard groups that give the same ``W`` are one.
    A load group ``G > 1`` where ``S`` is a multiple of ``G``, ``>= 2G`` (at ``W > 1``: on ``2G`` landing buffers)."""
    if any(g < 1 for g in load_groups):
        raise ValueError(f"load groups must be >= 1, got {load_groups}")
    out = []
    for sp in sps or _divisors(num_ranks):
        if num_ranks % sp:
            raise ValueError(f"sp {sp} does not divide {num_ranks} ranks")
        dp = num_ranks // sp
        groups = []
        if "allgather" in modes:
            groups += [("allgather", g) for g in SHARD_GROUPS if g == "mesh" or dp != dp * sp]
        if "rank-local" in modes:
            groups.append(("rank-local", "-"))
        for mode, group in groups:
            w = dp * sp if group == "mesh" else dp
            ops = lowered_mode(mode, w)  # the op sequence the row runs (rank-local mode: itself)
            for s in slots:
                for r in requests_per_rank:
                    for g in load_groups:
                        landing = 0  # W = 1: lowered, no landing buffer
                        if mode == "allgather" and w > 1:
                            landing = num_landing if g == 1 else default_num_landing(g)
                        if load_group_problem(g, s, ops, landing or None) is None:
                            out.append(Candidate(dp, sp, mode, group, s, r, landing, g))
    return tuple(out)


def all_to_all_s(model: PolicyModel, topology: Topology, workload: Workload, sp: int) -> float:
    """``u``: Ulysses all-to-all seconds per block per request (module docstring); 0 at ``sp = 1``."""
    if sp == 1:
        return 0.0
    sent = math.ceil(workload.tokens / sp) * model.hidden_dim * model.dtype_bytes * (sp - 1) / sp
    return model.num_all_to_all_per_block * workload.cfg_branches * sent / topology.all_to_all_bytes_per_s


def _fold(values: tuple[float, ...], resident: tuple[int, ...]) -> tuple[float, ...]:
    """Per streamed block, its value plus the resident blocks' up to the next streamed one (the leading resident
    blocks to the last, where the ring wraps): ``C'_j`` of the module docstring."""
    if not resident:
        return values
    keep = set(resident)
    first = next(b for b in range(len(values)) if b not in keep)
    out = []
    for b in range(first, len(values)):
        if b in keep:
            out[-1] += values[b]
        else:
            out.append(values[b])
    out[-1] += sum(values[:first])
    return tuple(out)


def _device_s(model: PolicyModel, topology: Topology, workload: Workload, cand: Candidate) -> tuple[float, ...]:
    """Each block's device compute of one request: ``c_b + u``."""
    a2a = all_to_all_s(model, topology, workload, cand.sp)
    c = topology.compute.seconds(model, workload.tokens, workload.cfg_branches, cand.sp)
    return tuple(c * f + a2a for f in compute_shape(model, workload.tokens, workload.cfg_branches))


def _durations(
    model: PolicyModel,
    topology: Topology,
    workload: Workload,
    cand: Candidate,
    step_overhead_s: float,
    sizes: ModelSizes,
    resident: tuple[int, ...] = (),
    stored: frozenset[int] = frozenset(),
):
    """Per-op durations of the ring over ``sizes`` (the streamed blocks), ``resident`` folded into the computes;
    ``stored`` (ring blocks whose shards are on the device) load at the device's copy rate."""
    w = cand.num_shards
    mode = op_mode(cand)
    if mode == "rank-local":
        h2d = sizes.shard_bytes(1)
        ag = (0.0,) * sizes.num_blocks
    else:
        h2d = sizes.shard_bytes(w)
        ag = tuple((w - 1) * s / topology.allgather_bus_bytes_per_s for s in h2d)
    rate = (topology.h2d_bytes_per_s, topology.d2d_copy_bytes_per_s)
    h2d_s = tuple(n / rate[j in stored] for j, n in enumerate(h2d))
    device = _fold(_device_s(model, topology, workload, cand), resident)
    host = topology.host_s(mode) * host_scale(sizes.num_blocks, cand.num_slots, cand.load_group, mode)
    comp = tuple(d + host if topology.host_serial else max(d, host) for d in device)

    def duration(op: Op) -> float:
        if op.kind == H2D:
            return h2d_s[op.block]
        if op.kind == AG:
            return ag[op.block]
        if op.kind == DQ:  # read the stored block, write the slot (plan.quant)
            return dequant_seconds(
                sizes.stored_bytes[op.block], sizes.block_bytes[op.block], topology.d2d_copy_bytes_per_s
            )
        return comp[op.block] + (step_overhead_s if op.block == 0 else 0.0)

    return duration, h2d_s, ag, max(device), host, comp


def _memory(
    model: PolicyModel,
    topology: Topology,
    workload: Workload,
    cand: Candidate,
    sizes: ModelSizes | None,
    budgeted: bool = False,
    stored_bytes: int = 0,
) -> tuple[int, int]:
    """HBM and host bytes per rank of the ring over ``sizes`` (None: every block resident, nothing pinned): the
    peak of :func:`~dlo_fn.cost.hbm.hbm_per_card` (``budgeted``: the device weight bytes only) and the pinned
    shards plus the framework; ``stored_bytes`` of the shards are on the device, not pinned."""
    if sizes is None:
        held = sum(model.tensor_block_bytes or model.sizes.block_bytes) + model.sizes.resident_bytes
        return held, topology.framework_host_bytes
    local_tokens = math.ceil(workload.tokens / cand.sp) * workload.cfg_branches * cand.requests_per_rank
    comm = 2 * local_tokens * model.hidden_dim * model.dtype_bytes if cand.sp > 1 else 0
    hbm = hbm_per_card(
        sizes,
        cand.num_shards,
        op_mode(cand),
        num_slots=cand.num_slots,
        num_landing=max(cand.num_landing, 1),
        activation_bytes=local_tokens * model.activation_bytes_per_token,
        communication_bytes=comm,
        context_bytes=topology.context_bytes,
    )
    host = (
        pinned_host_bytes_per_rank(sizes, cand.num_shards, op_mode(cand), load_group=cand.load_group)
        - stored_bytes
        + topology.framework_host_bytes
    )
    return (hbm.weight_bytes + hbm.resident_bytes if budgeted else hbm.peak_bytes) + stored_bytes, host


def _kept(
    model: PolicyModel,
    topology: Topology,
    workload: Workload,
    cand: Candidate,
    hbm_budget: int,
    larger: bool = False,
) -> ResidentPlan:
    """The resident blocks of this candidate within ``hbm_budget``, placed by its blocks' compute (``R c_b``: the
    requests through each load) against the H2D link and the device's copy rate (which prices the dequantise and
    device-stored shards; :class:`~dlo_fn.plan.resident.BudgetError` where its ring does not fit with every block
    streamed)."""
    return resident_plan(
        model.sizes,
        hbm_budget,
        num_shards=cand.num_shards,
        mode=op_mode(cand),
        num_slots=cand.num_slots,
        num_landing=cand.num_landing or None,
        load_group=cand.load_group,
        tensor_block_bytes=model.tensor_block_bytes,
        larger=larger,
        compute=_placement(model, topology, workload, cand),
        link=topology.h2d_bytes_per_s,
        device_link=topology.d2d_copy_bytes_per_s,
    )


def _placement(model: PolicyModel, topology: Topology, workload: Workload, cand: Candidate) -> tuple[float, ...]:
    """The compute a candidate places its resident blocks by: ``R c_b``, the requests through each loaded block."""
    return tuple(cand.requests_per_rank * c for c in _device_s(model, topology, workload, cand))


def predict(
    model: PolicyModel,
    topology: Topology,
    workload: Workload,
    cand: Candidate,
    *,
    step_overhead_s: float | None = None,
    hbm_budget: int | None = None,
) -> PlanRow:
    """One candidate's row (module docstring). ``step_overhead_s`` defaults to the topology's
    :meth:`~dlo_fn.cost.topology.Topology.step_overhead_s` for the workload; ``hbm_budget``: device weight bytes
    per rank, the blocks it holds kept resident."""
    if cand.dp * cand.sp != topology.num_ranks:
        raise ValueError(f"{cand.label}: dp x sp must equal the topology's {topology.num_ranks} ranks")
    overhead = (
        topology.step_overhead_s(workload.tokens, workload.cfg_branches) if step_overhead_s is None else step_overhead_s
    )
    sizes, resident, note, placed_by, stored, stored_bytes = model.sizes, (), "", None, frozenset(), 0
    if hbm_budget is not None:
        placed_by = (
            _placement(model, topology, workload, cand),
            topology.h2d_bytes_per_s,
            topology.d2d_copy_bytes_per_s,
        )
        try:
            kept = _kept(model, topology, workload, cand, hbm_budget)
            sizes, resident, stored, stored_bytes = kept.streamed, kept.resident, kept.stored, kept.stored_bytes
        except BudgetError as exc:  # priced with every block streamed, and dropped: its memory exceeds the budget
            note = str(exc)
    r = cand.requests_per_rank
    hbm, host_bytes = _memory(model, topology, workload, cand, sizes, hbm_budget is not None, stored_bytes)
    capacity = topology.hbm_bytes_per_rank if hbm_budget is None else hbm_budget
    if sizes is None:  # the budget holds the model: it runs resident, compute only
        step = r * sum(_device_s(model, topology, workload, cand)) + r * overhead
        wave = workload.num_steps * step + r * topology.request_overhead_s(workload.tokens)
        row = (step, wave, cand.dp * r, "compute", 0.0, hbm, host_bytes, capacity, topology.host_bytes_per_rank)
        return PlanRow(cand, *row, resident=resident, placed_by=placed_by)
    duration, h2d_s, ag, device, host, comp = _durations(
        model, topology, workload, cand, overhead, sizes, resident, stored
    )
    b, mode = sizes.num_blocks, op_mode(cand)
    steps = min(workload.num_steps, 3)
    schedule = build_schedule(
        b,
        steps,
        requests_per_load=r,
        num_slots=cand.num_slots,
        num_landing=cand.num_landing if mode == "allgather" else None,
        mode=mode,
        load_group=cand.load_group,
        quantized=sizes.quantized,
    )
    ends = sorted(s.end_s for s in simulate(schedule, duration).spans if s.stream == "compute")
    first = ends[b * r - 1]
    if steps == 1:
        step = first
    else:
        step = (ends[-1] - first) / (steps - 1)
    links = link_busy_s(sizes, topology, mode, cand.num_shards)  # shared links: at least their busy time
    link, link_s = links[0] if links else ("", 0.0)
    if stored_bytes:  # the host links carry the shards that are not on the device: the plan's H2D bytes
        link_s *= kept.choice.h2d_bytes_per_pass / (kept.choice.h2d_bytes_per_pass + stored_bytes)
    step, first = max(step, link_s), max(first, link_s)
    wave = first + (workload.num_steps - 1) * step + r * topology.request_overhead_s(workload.tokens)
    busy = {"h2d": sum(h2d_s), "allgather": sum(ag), "compute": r * sum(comp) + r * overhead}
    serial = mode == "allgather" and cand.num_landing == 1
    if link_s >= SATURATED * step and link_s >= max(busy.values()):
        bound = link
    elif serial and busy["h2d"] + busy["allgather"] >= SATURATED * step > max(busy["h2d"], busy["allgather"]):
        bound = "h2d+allgather"
    elif busy["h2d"] >= SATURATED * step or busy["allgather"] >= SATURATED * step:
        bound = "h2d" if busy["h2d"] >= busy["allgather"] else "allgather"
    elif busy["compute"] >= SATURATED * step:
        bound = "host" if (host > device and not topology.host_serial) else "compute"
    else:
        bound = "exposed"
    return PlanRow(
        cand,
        step,
        wave,
        cand.dp * r,
        bound,
        max(0.0, step - busy["compute"]),
        hbm,
        host_bytes,
        capacity,
        topology.host_bytes_per_rank,
        resident=resident,
        placed_by=placed_by,
        note=note,
    )


@dataclass(frozen=True, slots=True)
class PolicyResult:
    objective: str
    model: str
    topology: str
    workload: Workload
    rows: tuple[PlanRow, ...]  # fitting rows, chosen first, then by score
    dropped: tuple[PlanRow, ...]  # rows that do not fit
    min_gain: float
    hbm_budget: int | None = None
    # what a larger budget buys the chosen candidate: (device weight bytes, predicted step s) of the next plans
    larger_budgets: tuple[tuple[int, float], ...] = ()

    @property
    def chosen(self) -> PlanRow:
        if not self.rows:
            d = self.dropped[0]
            raise ValueError(
                f"no plan of {self.model} fits {self.topology}: {len(self.dropped)} dropped, e.g. "
                f"{d.candidate.label} needs {d.limiting_memory}" + (f" ({d.note})" if d.note else "")
            )
        return self.rows[0]

    @property
    def runner_up(self) -> PlanRow | None:
        return self.rows[1] if len(self.rows) > 1 else None

    def why(self) -> str:
        c, n = self.chosen, self.runner_up
        text = (
            f"{c.candidate.label}: {c.outputs_per_s * 3600:.1f} outputs/h, wave {c.wave_latency_s:.2f} s, "
            f"step {1e3 * c.step_s:.1f} ms bound by {c.bound}, {c.limiting_memory}"
        )
        if n is not None:
            text += (
                f"; runner-up {n.candidate.label}: {n.outputs_per_s * 3600:.1f} outputs/h, wave "
                f"{n.wave_latency_s:.2f} s, bound by {n.bound}"
            )
        return text + self.budget_note()

    def budget_note(self) -> str:
        """Under an HBM budget: the chosen plan's resident blocks and what the next larger budgets buy."""
        if self.hbm_budget is None or not self.rows:
            return ""
        c = self.chosen
        buys = ", ".join(f"{format_size(n)} -> step {1e3 * t:.1f} ms" for n, t in self.larger_budgets)
        return (
            f"; hbm budget {format_size(self.hbm_budget)}: {len(c.resident)} blocks resident, device weights "
            f"{format_size(c.hbm_bytes)}" + (f"; a larger budget buys {buys}" if buys else "")
        )

    def table_rows(self, limit: int | None = None) -> list[dict]:
        return [dict(rank=i + 1, **row.as_dict()) for i, row in enumerate(self.rows[:limit])]


def _score(row: PlanRow, objective: str) -> float:
    return row.outputs_per_s if objective == "throughput" else 1.0 / row.wave_latency_s


def plan(
    model: PolicyModel,
    topology: Topology,
    workload: Workload,
    *,
    objective: str = "throughput",
    slots: tuple[int, ...] = (2, 3, 4),
    requests_per_rank: tuple[int, ...] = (1,),
    modes: tuple[str, ...] = ("allgather", "rank-local"),
    sps: tuple[int, ...] | None = None,
    num_landing: int = DEFAULT_NUM_LANDING,
    min_gain: float = 0.005,
    load_groups: tuple[int, ...] = (1,),
    hbm_budget: int | None = None,
) -> PolicyResult:
    """Rank every candidate (module docstring); the chosen plan is ``result.rows[0]``. ``hbm_budget``: device
    weight bytes per rank, in place of the HBM capacity for the weights (module docstring)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}")
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
    if model.sizes.quantized:  # quantised loads move one block each (plan.lowering)
        load_groups = (1,)
    rows = [
        predict(model, topology, workload, c, hbm_budget=hbm_budget)
        for c in candidates(
            topology.num_ranks,
            slots=slots,
            requests_per_rank=requests_per_rank,
            modes=modes,
            sps=sps,
            num_landing=num_landing,
            load_groups=load_groups,
        )
    ]
    fitting = [r for r in rows if r.fits]
    dropped = tuple(r for r in rows if not r.fits)

    def cheap(r):
        return (
            r.candidate.requests_per_rank,
            r.hbm_bytes,
            topology.host_s(op_mode(r.candidate)),
            r.candidate.num_slots,
            r.candidate.load_group,
            r.candidate.mode != op_mode(r.candidate),
            r.candidate.label,
        )

    ordered = sorted(fitting, key=lambda r: (-_score(r, objective),) + cheap(r))
    if ordered:
        best = _score(ordered[0], objective)
        near = [r for r in ordered if _score(r, objective) >= best * (1 - min_gain)]
        chosen = min(near, key=cheap)
        ordered.remove(chosen)
        ordered.insert(0, chosen)
    larger = ()
    if hbm_budget is not None and ordered:
        c = ordered[0].candidate
        plans = _kept(model, topology, workload, c, hbm_budget, larger=True).larger
        picks = plans[:3] + plans[-1:] if len(plans) > 4 else plans  # the next plans, and the whole model
        larger = tuple(
            (p.device_weight_bytes, predict(model, topology, workload, c, hbm_budget=p.device_weight_bytes).step_s)
            for p in picks
        )
    return PolicyResult(
        objective, model.name, topology.name, workload, tuple(ordered), dropped, min_gain, hbm_budget, larger
    )


def with_bandwidth(topology: Topology, factor: float) -> Topology:
    """The same topology with every transfer rate times ``factor`` (the monotonicity property's input)."""
    scaled = {
        f: getattr(topology, f) * factor
        for f in (
            "h2d_bytes_per_s",
            "allgather_bus_bytes_per_s",
            "all_to_all_bytes_per_s",
            "d2d_copy_bytes_per_s",
            "uplink_bytes_per_s",
            "host_memory_bytes_per_s",
        )
        if getattr(topology, f) is not None
    }
    return replace(topology, **scaled)
