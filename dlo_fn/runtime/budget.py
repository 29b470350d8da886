"""``offload(..., hbm_budget=...)``: the resident blocks for a budget, chosen by the plan, and the resident blocks'
FP8 weights made what the streamed ones compute with.

The plan (:mod:`dlo_fn.plan.resident`) chooses the blocks and prices the device bytes with the layout the runtime
builds (same shard group, alignment, load group, quantisation), so ``Offloaded.device_weight_bytes`` is the
planned figure, to the byte. A resident block stays an ordinary module on the device: the executor, the ring and
the host store see the streamed blocks only.

**Placed by compute.** With ``example=`` (one call's inputs, timed through the plain probe of
:func:`dlo_fn.runtime.auto.time_one_call`) or ``workload=`` (a :class:`~dlo_fn.plan.workload.Workload`: the policy's
FLOP model of each block at a measured matmul rate), :func:`block_compute` gives the plan each block's compute, the
H2D link (block 0's pinned copy beside compute: :func:`~dlo_fn.runtime.probe.busy_h2d_rate`) and the device's copy
rate, rank 0's on every rank, and the plan places by compute, predicts the pass (dequantising included) and, with
``num_slots="auto"``, chooses the slots. Without either: placed by bytes.

**Device-stored shards.** Where a streamed block's stored shard holds less than the block resident (FP8 shards; a
``1/W`` shard in allgather mode), the budget a plan leaves may keep shards on the device: the host store puts
them in one device buffer (:func:`~dlo_fn.runtime.host_store.with_device_blocks`), their loads copy from there at
the device's rate, through the same ring (the slot, the all-gather, the dequantise), and nothing else changes. The
plan keeps them only where it predicts a faster pass, so placed by bytes there are none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from dlo_fn.io.bind import stored_weights
from dlo_fn.plan.quant import quantized_tensors
from dlo_fn.plan.resident import ResidentChoice, choose_resident, layout_for, ring_num_landing, with_resident
from dlo_fn.plan.spec import ModelSpec
from dlo_fn.runtime.options import OffloadOptions
from dlo_fn.runtime.quant import dequantize_into, quantize_rows

__all__ = ["Placement", "block_compute", "resident_blocks", "describe_choice", "quantize_resident"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Placement:
    """What the plan places resident blocks by: each block's compute seconds (block order), the H2D link, where
    the seconds came from, and the device's copy rate (prices dequantising and the device-stored tier; None: not
    priced)."""

    compute_s: tuple[float, ...]
    link_bytes_per_s: float
    source: str
    device_bytes_per_s: float | None = None

    @classmethod
    def from_policy(cls, placed_by: tuple) -> "Placement":
        """What a policy row placed its resident blocks by (``PlanRow.placed_by``: compute, H2D link, device copy
        rate), for ``offload`` to keep the same ones."""
        compute, link, device = placed_by
        return cls(tuple(compute), link, "the policy's compute (auto)", device)

    def plan_inputs(self) -> dict:
        """The keywords :func:`~dlo_fn.plan.resident.choose_resident` takes from it."""
        by = {"compute": self.compute_s, "link": self.link_bytes_per_s}
        return by | ({"device_link": self.device_bytes_per_s} if self.device_bytes_per_s else {})


def block_compute(model: nn.Module, blocks: list, spec: ModelSpec, ctx, workload, example) -> Placement:
    """Each block's compute seconds and the H2D link for the plan (module docstring), rank 0's on every rank."""
    from dlo_fn.plan.workload import Workload
    from dlo_fn.runtime.auto import flop_per_s, time_one_call
    from dlo_fn.runtime.probe import busy_h2d_rate, device_copy_rate, flat_block

    workload = getattr(workload, "workload", workload)  # a start-up probe's workload
    if workload is not None and not isinstance(workload, Workload):
        raise TypeError(
            "offload(hbm_budget=..., workload=...) takes a dlo_fn.plan.workload.Workload, got "
            f"{type(workload).__name__}"
        )
    dtype = next(iter(blocks[0].state_dict().values())).dtype
    flat = flat_block(blocks[0])
    link, device = busy_h2d_rate(flat, ctx.platform), device_copy_rate(flat, ctx.platform)
    if workload is not None:
        from dlo_fn.cost.auto import hidden_dim
        from dlo_fn.cost.topology import PolicyModel, block_flops
        from dlo_fn.plan.sizes import ModelSizes

        sizes = ModelSizes.from_spec(spec, source="the model's spec")
        pmodel = PolicyModel(sizes, hidden_dim(blocks[0]), dtype.itemsize, source="the model's spec")
        rate = flop_per_s(ctx.platform, dtype)
        flops = (
            block_flops(pmodel, workload.tokens, workload.cfg_branches, n / dtype.itemsize) for n in spec.block_bytes
        )
        picked = [tuple(f / rate for f in flops), link, "the workload's FLOPs", device]
    else:
        picked = [
            time_one_call(model, blocks, ctx.platform, example)[0],
            link,
            "measured compute (example call)",
            device,
        ]
    if ctx.group is not None and ctx.world_size > 1:
        torch.distributed.broadcast_object_list(picked, src=0, group=ctx.group)
    return Placement(tuple(picked[0]), *picked[1:])


def resident_blocks(
    model: nn.Module,
    spec: ModelSpec,
    options: OffloadOptions,
    num_shards: int,
    exclude: tuple[str, ...],
    placement: Placement | None = None,
    is_main: bool = True,
    num_slots: int | str | None = None,
) -> tuple[ResidentChoice, ModelSpec | None]:
    """The plan within ``options.hbm_budget`` (:func:`dlo_fn.plan.resident.choose_resident`, priced with the layout
    and the ring ``offload`` builds; placed by ``placement`` where given, and with ``num_slots="auto"`` its slots
    chosen; None: ``options.num_slots``) and the spec of the streamed blocks (None: every block fits); logged in
    one line."""
    if stored_weights(model) is not None:
        raise ValueError(
            f"hbm_budget with {type(model).__name__} from a quantised checkpoint: resident blocks need their "
            "compute-dtype weights; load the source checkpoint with quantization='fp8' instead"
        )
    o = options
    by = {} if placement is None else placement.plan_inputs()
    choice = choose_resident(
        spec,
        o.hbm_budget,
        lambda s: layout_for(s, num_shards, o.alignment_bytes, o.load_group, o.quantization, exclude),
        o.num_slots if num_slots is None else num_slots,
        ring_num_landing(o.mode, num_shards, o.num_landing, o.load_group),
        **by,
    )
    if is_main:
        log.info("hbm_budget: %s", describe_choice(choice, spec, placement))
    if len(choice.resident) == spec.num_blocks:
        return choice, None
    return choice, with_resident(spec, choice.resident)


def describe_choice(choice: ResidentChoice, spec: ModelSpec, placement: Placement | None) -> str:
    """One line: what is resident, the device weights, and how it was placed (with the predicted pass)."""
    text = (
        f"{len(choice.resident)} of {spec.num_blocks} blocks resident, {choice.device_weight_bytes} bytes of device "
        f"weights, {choice.num_slots} slots"
    )
    if choice.device_stored:
        text += f", {len(choice.device_stored)} streamed blocks' stored shards kept on the device"
    if placement is None:
        return text + "; placed by bytes (pass example= or workload= to place by compute and predict the pass)"
    return (
        f"{text}; placed by {placement.source}, predicted pass {choice.pass_s:.4g} s (blocks' compute "
        f"{sum(placement.compute_s):.4g} s, link {placement.link_bytes_per_s:.3g} B/s)"
    )


@torch.no_grad()
def quantize_resident(
    model: nn.Module, spec: ModelSpec, resident: tuple[int, ...], exclude: tuple[str, ...], options: OffloadOptions
) -> tuple[int, ...]:
    """With FP8 shards, in place on their device: the resident blocks' weights that the shards store become
    ``dequantise(quantise(w))``, as the streamed blocks' slots hold them (and as ``fake_quantize`` makes them).
    Returns ``resident``."""
    if options.quantization is None:
        return resident
    prefixes = tuple(spec.blocks[b].name + "." for b in resident)
    for name, t in quantized_tensors(spec, exclude).items():
        if name.startswith(prefixes):
            w = model.get_parameter(name) if t.kind == "param" else model.get_buffer(name)
            dequantize_into(w, *quantize_rows(w))
    return resident
