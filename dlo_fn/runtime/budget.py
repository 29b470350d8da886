"""``offload(..., hbm_budget=...)``: the resident blocks for a budget, chosen by the plan, and the resident blocks'
FP8 weights made what the streamed ones compute with.

The plan (:mod:`dlo_fn.plan.resident`) chooses the blocks and prices the device bytes with the layout the runtime
builds (same shard group, alignment, load group, quantisation), so ``Offloaded.device_weight_bytes`` is the
planned figure, to the byte. A resident block stays an ordinary module on the device: the executor, the ring and
the host store see the streamed blocks only.
"""

from __future__ import annotations

import torch
from torch import nn

from dlo_fn.io.bind import stored_weights
from dlo_fn.plan.quant import quantized_tensors
from dlo_fn.plan.resident import choose_resident, layout_for, ring_num_landing, with_resident
from dlo_fn.plan.spec import ModelSpec
from dlo_fn.runtime.options import OffloadOptions
from dlo_fn.runtime.quant import dequantize_into, quantize_rows

__all__ = ["resident_blocks", "quantize_resident"]


def resident_blocks(
    model: nn.Module,
    spec: ModelSpec,
    options: OffloadOptions,
    num_shards: int,
    exclude: tuple[str, ...],
    placed_by: tuple[tuple[float, ...], float] | None = None,
) -> tuple[tuple[int, ...], ModelSpec | None]:
    """The blocks kept resident within ``options.hbm_budget`` (:func:`dlo_fn.plan.resident.choose_resident`, priced
    with the layout and the ring ``offload`` builds) and the spec of the streamed ones (None: every block fits).
    ``placed_by``: ``(compute seconds per block, link bytes/s)`` to place by, the policy's where ``mode="auto"``
    chose under the budget (``PlanRow.placed_by``: the same call, so the chosen row's resident set); None: by bytes."""
    if stored_weights(model) is not None:
        raise ValueError(
            f"hbm_budget with {type(model).__name__} from a quantised checkpoint: resident blocks need their "
            "compute-dtype weights; load the source checkpoint with quantization='fp8' instead"
        )
    o = options
    choice = choose_resident(
        spec,
        o.hbm_budget,
        lambda s: layout_for(s, num_shards, o.alignment_bytes, o.load_group, o.quantization, exclude),
        o.num_slots,
        ring_num_landing(o.mode, num_shards, o.num_landing, o.load_group),
        **({} if placed_by is None else {"compute": placed_by[0], "link": placed_by[1]}),
    )
    if len(choice.resident) == spec.num_blocks:
        return choice.resident, None
    return choice.resident, with_resident(spec, choice.resident)


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
