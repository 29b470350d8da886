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

from dlo_fn.plan.layout import ModelLayout, layout_load_group, model_layout
from dlo_fn.plan.lowering import default_num_landing, lowered_mode
from dlo_fn.plan.quant import quantized_tensors
from dlo_fn.plan.resident import choose_resident
from dlo_fn.plan.spec import ModelSpec
from dlo_fn.runtime.options import OffloadOptions
from dlo_fn.runtime.quant import dequantize_into, quantize_rows

__all__ = ["ring_num_landing", "streamed_layout", "resident_for_budget", "quantize_resident"]


def ring_num_landing(options: OffloadOptions, num_shards: int) -> int:
    """The landing buffers the executor's ring will hold (0 where the mode lowers to rank-local)."""
    if lowered_mode(options.mode, num_shards) == "rank-local":
        return 0
    return options.num_landing if options.num_landing is not None else default_num_landing(options.load_group)


def streamed_layout(spec: ModelSpec, options: OffloadOptions, num_shards: int, exclude: tuple[str, ...]) -> ModelLayout:
    """The layout ``offload`` builds for ``spec``'s blocks on a shard group of ``num_shards``."""
    group = layout_load_group(spec.num_blocks, num_shards, options.load_group)
    return model_layout(spec, num_shards, options.alignment_bytes, group, options.quantization, exclude)


def resident_for_budget(
    spec: ModelSpec, options: OffloadOptions, num_shards: int, exclude: tuple[str, ...]
) -> tuple[int, ...]:
    """The blocks kept resident within ``options.hbm_budget`` (:func:`dlo_fn.plan.resident.choose_resident`)."""
    choice = choose_resident(
        spec,
        options.hbm_budget,
        lambda s: streamed_layout(s, options, num_shards, exclude),
        options.num_slots,
        ring_num_landing(options, num_shards),
    )
    return choice.resident


@torch.no_grad()
def quantize_resident(model: nn.Module, spec: ModelSpec, resident: tuple[int, ...], exclude: tuple[str, ...]) -> None:
    """In place, on their device: the resident blocks' weights that FP8 shards store become
    ``dequantise(quantise(w))``, as the streamed blocks' slots hold them (and as ``fake_quantize`` makes them)."""
    prefixes = tuple(spec.blocks[b].name + "." for b in resident)
    for name, t in quantized_tensors(spec, exclude).items():
        if name.startswith(prefixes):
            w = model.get_parameter(name) if t.kind == "param" else model.get_buffer(name)
            dequantize_into(w, *quantize_rows(w))
