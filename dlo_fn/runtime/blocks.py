"""Blocks as stateless functions of their weights: state extraction, stripping, views, proxies, calls.

A block module keeps its code and loses its storage: every parameter and persistent buffer becomes a
:class:`StandIn` (ties kept; not ``meta``: peft places a LoRA on its base weight's device and dtype), and
non-persistent buffers (recomputed tables) move to the device. The executor then runs the block as a function
of ``views``, typed views into the slot the block was gathered into, built once per (slot, block layout) at
start-up (by default ``"swap"``: the views are put in the block's parameter and buffer tables for the call, as
``torch.func.functional_call(block, views, args, kwargs)`` does, with the tables resolved once instead of per
call; see :func:`make_caller`):

    views[name] = slot[offset : offset + nbytes].view(dtype).view(shape)

Each entry of the model's block list is replaced by a :class:`BlockProxy` whose ``forward`` hands its
arguments to the executor. The proxy shares the block's submodules, so every path stays in the module tree
(``transformer_blocks.0.attn.to_q``): peft and diffusers wrap the block's layers after offload, and ``"swap"``,
holding each layer's own parameter table, feeds the views to a wrapped layer's ``base_layer`` unchanged."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from dlo_fn.plan.layout import BlockLayout, ModelLayout

__all__ = [
    "block_state",
    "StandIn",
    "strip_block",
    "make_views",
    "BlockProxy",
    "layout_key",
    "CALLS",
    "make_caller",
    "build_callers",
]

CALLS = ("functional_call", "swap", "compile")


def block_state(block: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, ...]]]:
    """``(tensors, aliases)``: every parameter and persistent buffer under its first name (the order and
    naming of :func:`dlo_fn.plan.spec.spec_from_module`), and for tied tensors the other names they go by."""
    first: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, list[str]] = {}
    for mod_name, mod in block.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        items = [(n, t) for n, t in mod._parameters.items() if t is not None]
        items += [(n, t) for n, t in mod._buffers.items() if t is not None and n not in mod._non_persistent_buffers_set]
        for n, t in items:
            if id(t) in first:
                aliases.setdefault(first[id(t)], []).append(prefix + n)
            else:
                first[id(t)] = prefix + n
                tensors[prefix + n] = t
    return tensors, {k: tuple(v) for k, v in aliases.items()}


class StandIn(nn.Parameter):
    """A streamed block's parameter outside its calls: shape, dtype and device of the weight, no values (a
    zero-stride view of one element). Reads work (diffusers reads ``.data`` for shapes); writing the base
    weight in place (peft's ``merge``, behind ``fuse_lora``) raises, since the weight lives in host shards."""

    def __new__(cls, like: torch.Tensor, one: torch.Tensor) -> "StandIn":
        return super().__new__(cls, one.expand(like.shape), requires_grad=False)

    def __deepcopy__(self, memo: dict) -> "StandIn":  # a copy of nothing: no full-size clone
        return StandIn(self, torch.empty((), dtype=self.dtype, device=self.device))

    def _refuse(self, *args: Any) -> Any:
        raise ValueError(
            f"cannot write a weight of an offloaded block (shape {tuple(self.shape)}): its values live in host "
            "shards, streamed per call, so an adapter cannot be fused into it; run the adapter unfused (peft's "
            "default; set_adapters/disable_lora/unload_lora_weights work), or fuse it before offload()"
        )

    data = property(lambda self: self, _refuse)
    __iadd__ = __isub__ = __imul__ = copy_ = add_ = sub_ = mul_ = _refuse


def _stand_in(t: torch.Tensor) -> bool:
    return t.numel() > 1 and not any(t.stride())


def strip_block(block: nn.Module, device: torch.device) -> None:
    """In place: parameters and persistent buffers -> stand-ins on ``device`` (ties kept, ``requires_grad``
    off, so the mmap views or host copies they held are released); non-persistent buffers -> ``device``."""
    memo: dict[int, torch.Tensor] = {}
    ones: dict[torch.dtype, torch.Tensor] = {}  # one element per dtype backs every stand-in of the block

    def stand_in(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        one = ones.setdefault(t.dtype, torch.empty((), dtype=t.dtype, device=device))
        return StandIn(t, one) if parameter else one.expand(t.shape)

    for mod in block.modules():
        for n, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = stand_in(p, True)
                mod._parameters[n] = memo[id(p)]
        for n, b in list(mod._buffers.items()):
            if b is not None:
                if id(b) not in memo:
                    persistent = n not in mod._non_persistent_buffers_set
                    memo[id(b)] = stand_in(b, False) if persistent else b.to(device)
                mod._buffers[n] = memo[id(b)]


def layout_key(layout: BlockLayout, aliases: dict[str, tuple[str, ...]]) -> tuple:
    """Blocks with equal keys share their views in a slot (e.g. every block of a uniform DiT)."""
    return (
        tuple((p.name, p.shape, p.dtype, p.offset_bytes) for p in layout.placements),
        tuple(sorted(aliases.items())),
    )


def make_views(slot: torch.Tensor, layout: BlockLayout, aliases: dict[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """Typed views of every tensor of ``layout`` inside ``slot`` (a flat uint8 buffer), tied names included."""
    views: dict[str, torch.Tensor] = {}
    for p in layout.placements:
        v = slot[p.offset_bytes : p.offset_bytes + p.nbytes].view(p.dtype).view(p.shape)
        views[p.name] = v
        for other in aliases.get(p.name, ()):
            views[other] = v
    return views


def make_caller(kind: str, block: nn.Module, views: dict[str, torch.Tensor]) -> Callable[[tuple, dict], Any]:
    """A function ``(args, kwargs) -> block output`` computing ``block`` with ``views`` as its weights.

    ``"functional_call"``: :func:`torch.func.functional_call` (resolves every name per call). ``"swap"``: the same
    re-parametrisation with the (dict, key) pairs resolved once here: assign the views, call, put the meta tensors
    back (what each costs the host: ``docs/performance.md``). ``"compile"``: ``functional_call`` of
    the block compiled with ``torch.compile`` (``nn.Module.compile``, once per block): the views are the
    compiled graph's weight inputs, so every block of one class and every slot share one compiled graph.
    """
    if kind == "compile":
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile()
        kind = "functional_call"
    if kind == "functional_call":
        from torch.func import functional_call

        def call(args: tuple, kwargs: dict) -> Any:
            return functional_call(block, _unwrapped(block, views), args, kwargs, tie_weights=False, strict=False)

        return call
    if kind != "swap":
        raise ValueError(f"block call must be one of {CALLS}, got {kind!r}")
    entries = []
    for name, view in views.items():
        mod_path, _, attr = name.rpartition(".")
        mod = block.get_submodule(mod_path) if mod_path else block
        table = mod._parameters if attr in mod._parameters else mod._buffers
        entries.append((table, attr, view, table[attr]))
    swap_in = tuple((t, k, v) for t, k, v, _ in entries)
    swap_out = tuple((t, k, o) for t, k, _, o in entries)

    def call(args: tuple, kwargs: dict) -> Any:
        for table, key, value in swap_in:
            table[key] = value
        try:
            return block(*args, **kwargs)
        finally:
            for table, key, value in swap_out:
                table[key] = value

    return call


def _unwrapped(block: nn.Module, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``views`` renamed, per call, for layers wrapped since (peft: ``to_q.weight`` -> ``to_q.base_layer.weight``)."""
    out = {}
    for name, view in views.items():
        path, _, attr = name.rpartition(".")
        mod = block.get_submodule(path) if path else block
        while attr not in mod._parameters and attr not in mod._buffers and "base_layer" in mod._modules:
            mod, path = mod._modules["base_layer"], f"{path}.base_layer"
        out[f"{path}.{attr}" if path else attr] = view
    return out


def build_callers(
    layout: ModelLayout,
    blocks: Sequence[nn.Module],
    aliases: Sequence[Mapping[str, tuple[str, ...]]],
    num_slots: int,
    slot_span: Callable[[int, int], torch.Tensor],
    kind: str,
    plugin: Any = None,
) -> tuple[list[tuple[Any, ...]], int]:
    """``(callers, view sets)``: one call per (block, slot) on the typed views of the bytes ``slot_span(block,
    slot)``, the views shared by blocks of one layout at one address (every block of a uniform DiT), each call
    wrapped by ``plugin`` (:class:`~dlo_fn.runtime.executor.CallPlugin`) if there is one."""
    shared: dict[tuple, dict[str, torch.Tensor]] = {}
    callers = []
    for b in range(layout.num_blocks):
        names, block = dict(aliases[b]), layout.compute_block(b)
        key = layout_key(block, names)
        row = []
        for s in range(num_slots):
            span = slot_span(b, s)
            at = (key, span.data_ptr())  # a grouped layout places a block at its group's stride in the slots
            if at not in shared:
                shared[at] = make_views(span, block, names)
            call = make_caller(kind, blocks[b], shared[at])
            row.append(plugin.wrap(call, b, s) if plugin is not None else call)
        callers.append(tuple(row))
    return callers, len(shared)


class BlockProxy(nn.Module):
    """Stands in a block list for block ``block_index``; ``forward`` asks the executor to advance the
    schedule to this block's compute and run it. It shares the block's submodule table, so the block's layers
    keep their paths in the model (peft and diffusers wrap them; ``state_dict`` lists their stand-ins, which hold
    no values: save the checkpoint, not an offloaded model). ``to`` moves what was added since (adapter weights),
    never the stand-ins. Unknown attributes are read from the block."""

    def __init__(self, compute: Callable[[int, tuple, dict], Any], block_index: int, block: nn.Module) -> None:
        super().__init__()
        self.__dict__["_dlo_compute"] = compute
        self.__dict__["_dlo_block"] = block
        self.__dict__["_modules"] = block._modules
        self.block_index = block_index

    @property
    def block(self) -> nn.Module:
        return self.__dict__["_dlo_block"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._dlo_compute(self.block_index, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_dlo_block"], name)

    def _apply(self, fn: Callable, recurse: bool = True) -> "BlockProxy":
        for mod in self.block.modules():  # each module alone, its stand-ins (zero strides) held out as None
            tables = (mod._parameters, mod._buffers)
            held = [(table, k, t) for table in tables for k, t in table.items() if t is not None and _stand_in(t)]
            for table, k, _ in held:
                table[k] = None
            try:
                mod._apply(fn, recurse=False)
            finally:
                for table, k, t in held:
                    table[k] = t
        return self

    def extra_repr(self) -> str:
        return f"block_index={self.block_index}, offloaded {type(self.block).__name__}"
