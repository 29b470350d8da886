"""Diffusers models as the loader builds them: the class ``config.json`` names, on ``meta``, as
``ModelMixin.from_pretrained`` would hold it, and the block lists of common DiT classes.

``from_pretrained(folder, torch_dtype=D)`` (diffusers 0.42.1) does, and :func:`build_model` does the same:

1. build ``cls.from_config(config)`` with the default dtype set to ``D``, weight init skipped and parameters on
   ``meta`` (``accelerate.init_empty_weights(include_buffers=False)``): buffers are created on the CPU by the
   model's own ``__init__``, so non-persistent ones (Wan's rotary tables) are real and in the dtype that code
   gives them, never cast;
2. load every stored tensor into the dtype of the module that owns it, except that a tensor whose dotted name
   has a component in ``cls._keep_in_fp32_modules`` (Wan: ``time_embedder``, ``scale_shift_table``, ``norm1``,
   ...) is loaded in fp32.

``D`` defaults here to the checkpoint's own dtype (the floating dtype holding most bytes outside the fp32
modules), so a bf16 folder binds zero-copy; from_pretrained's default (``None``: everything in fp32) is
``torch_dtype=torch.float32``.

Block lists come from the class's own declarations: the top-level ``nn.ModuleList`` children whose entries are
all of a class named in ``_repeated_blocks`` (or ``_no_split_modules``), in registration order (the order
diffusers runs them: Flux ``transformer_blocks`` then ``single_transformer_blocks``). Detected for Wan, Flux,
HunyuanVideo, LTX-Video, CogVideoX, SD3 and Qwen-Image in diffusers 0.42.1; other modules fall back to the one
top-level list of identical blocks, or get an error listing the candidates.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

import torch
from torch import nn

from dlo_fn.io.bind import meta_params
from dlo_fn.io.checkpoint import CONFIG_FILE, Checkpoint, CheckpointError

__all__ = [
    "is_diffusers_config",
    "is_diffusers_model",
    "model_class",
    "build_model",
    "keeps_fp32",
    "restore_buffers",
    "cast_buffers",
    "block_paths_for",
]


def is_diffusers_config(config: Mapping | None) -> bool:
    """A diffusers ``config.json`` names its class and the diffusers version that wrote it."""
    return isinstance(config, Mapping) and isinstance(config.get("_class_name"), str) and "_diffusers_version" in config


def is_diffusers_model(obj: object) -> bool:
    """A diffusers ``ModelMixin`` instance or subclass (checked without importing diffusers)."""
    cls = obj if isinstance(obj, type) else type(obj)
    return any(c.__module__.startswith("diffusers.") and c.__name__ == "ModelMixin" for c in cls.__mro__)


def _diffusers(where):
    try:
        import diffusers
    except ImportError:
        raise CheckpointError(
            "this is a diffusers model: install diffusers (pip install diffusers) to load it", file=where
        ) from None
    return diffusers


def model_class(ckpt: Checkpoint) -> type:
    """The diffusers class named by the checkpoint's ``config.json``."""
    where = ckpt.root / CONFIG_FILE
    name = ckpt.config["_class_name"]
    diffusers = _diffusers(where)
    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and is_diffusers_model(cls)):
        raise CheckpointError(
            f"_class_name {name!r} is not a diffusers model class in diffusers {diffusers.__version__} (the folder "
            f"was written by diffusers {ckpt.config.get('_diffusers_version')}): upgrade diffusers, or pass "
            "model_or_factory=",
            file=where,
        )
    return cls


def keeps_fp32(cls: type, name: str) -> bool:
    """Whether from_pretrained keeps tensor ``name`` in fp32 (a component in ``_keep_in_fp32_modules``)."""
    keep = cls._keep_in_fp32_modules or ()
    keep = (keep,) if isinstance(keep, str) else keep
    parts = name.split(".")
    return any(m in parts for m in keep)


def stored_dtype(ckpt: Checkpoint, cls: type) -> torch.dtype:
    """The floating dtype holding most bytes outside the fp32 modules (fp32 when nothing is floating)."""
    from dlo_fn.plan.spec import dtype_from_safetensors

    total: dict[torch.dtype, int] = {}
    for key, entry in ckpt.entries.items():
        dtype = dtype_from_safetensors(entry.dtype)
        if dtype.is_floating_point and not keeps_fp32(cls, key):
            total[dtype] = total.get(dtype, 0) + entry.nbytes
    return max(total, key=total.__getitem__) if total else torch.float32


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _meta_build(cls: type, config: Mapping, dtype: torch.dtype) -> nn.Module:
    from diffusers.models.modeling_utils import no_init_weights

    with _default_dtype(dtype), no_init_weights(), meta_params():
        model = cls.from_config(dict(config))
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for table, kind in ((module._parameters, "param"), (module._buffers, "buffer")):
            for attr, t in table.items():
                if t is None or not t.is_floating_point() or not keeps_fp32(cls, prefix + attr):
                    continue
                if kind == "buffer" and attr in module._non_persistent_buffers_set:
                    continue  # never loaded, so never cast by from_pretrained either
                if t.dtype != torch.float32:
                    meta = t.to("meta", torch.float32)
                    table[attr] = nn.Parameter(meta, requires_grad=t.requires_grad) if kind == "param" else meta
    return model.eval()


def build_model(ckpt: Checkpoint, cls: type | None = None, torch_dtype: torch.dtype | None = None) -> nn.Module:
    """``cls`` (default: the config's ``_class_name``) from the checkpoint's ``config.json`` on ``meta``, in
    ``torch_dtype`` (default: the checkpoint's own) with ``_keep_in_fp32_modules`` in fp32 (module docstring)."""
    if not is_diffusers_config(ckpt.config):
        raise CheckpointError(
            "no diffusers config.json (with _class_name) beside the weights: pass the model "
            "folder (for a pipeline, its transformer/ folder) or model_or_factory=",
            file=ckpt.root / CONFIG_FILE,
        )
    from dlo_fn.io.quantized import stored_format

    cls = cls or model_class(ckpt)
    fmt = stored_format(ckpt)  # a quantised folder: the dtype its FP8 tensors dequantise into
    dtype = torch_dtype or (fmt.torch_dtype if fmt is not None else stored_dtype(ckpt, cls))
    if not dtype.is_floating_point:
        raise ValueError(f"torch_dtype must be a floating dtype, got {dtype}")
    try:
        return _meta_build(cls, ckpt.config, dtype)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{cls.__name__}.from_config failed ({exc}): the config does not fit the class; write the folder again",
            file=ckpt.root / CONFIG_FILE,
        ) from None


def _main_dtype(model: nn.Module) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for name, p in model.named_parameters():
        if p.is_floating_point() and not keeps_fp32(type(model), name):
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.get_default_dtype()


def restore_buffers(model: nn.Module) -> None:
    """Non-persistent buffers left on ``meta`` (a model built under ``torch.device("meta")``) recomputed as
    from_pretrained has them: taken from a fresh build of the same class and config (parameters on meta,
    default dtype = the model's main dtype), never cast."""
    wanted = [
        (mod, attr, f"{name}.{attr}" if name else attr)
        for name, mod in model.named_modules()
        for attr in sorted(mod._non_persistent_buffers_set)
        if mod._buffers.get(attr) is not None and mod._buffers[attr].is_meta
    ]
    if not wanted:
        return
    fresh = _meta_build(type(model), model.config, _main_dtype(model))
    for mod, attr, name in wanted:
        mod._buffers[attr] = fresh.get_buffer(name)


def cast_buffers(model: nn.Module) -> tuple[str, ...]:
    """Non-persistent buffers whose dtype differs from a fresh build's (``from_config(cfg).to(bf16)`` casts
    Wan's fp32 rotary tables; from_pretrained never does): the loader warns about them."""
    real = {
        f"{name}.{attr}" if name else attr: mod._buffers[attr]
        for name, mod in model.named_modules()
        for attr in sorted(mod._non_persistent_buffers_set)
        if mod._buffers.get(attr) is not None and not mod._buffers[attr].is_meta
    }
    if not real:
        return ()
    fresh = dict(_meta_build(type(model), model.config, _main_dtype(model)).named_buffers())
    return tuple(n for n, b in real.items() if n in fresh and fresh[n].dtype != b.dtype)


def _lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    return [
        (name, child) for name, child in model.named_children() if isinstance(child, nn.ModuleList) and len(child) > 0
    ]


def block_paths_for(model: nn.Module) -> tuple[str, ...]:
    """The dotted paths of ``model``'s block lists, in forward order (module docstring); a ``ValueError``
    lists the candidates when they cannot be told apart."""
    declared = set()
    for attr in ("_repeated_blocks", "_no_split_modules"):
        declared.update(getattr(type(model), attr, None) or ())
    lists = _lists(model)
    if declared:
        paths = tuple(name for name, lst in lists if all(type(b).__name__ in declared for b in lst))
        if paths:
            return paths
    uniform = [
        (name, lst)
        for name, lst in lists
        if len(lst) > 1 and len({type(b) for b in lst}) == 1 and any(True for _ in lst[0].parameters())
    ]
    if len(uniform) == 1:
        return (uniform[0][0],)
    candidates = ", ".join(f"{name} ({len(lst)} x {type(lst[0]).__name__})" for name, lst in lists) or "none"
    raise ValueError(
        f"cannot tell the block lists of {type(model).__name__} (top-level ModuleLists: {candidates}): pass "
        "block_paths=, e.g. ('transformer_blocks', 'single_transformer_blocks'), in the order forward runs them"
    )
