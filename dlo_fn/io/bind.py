"""Building the meta model and installing checkpoint tensors in it (the mechanics behind ``load``).

``meta_params()`` builds a model whose *parameters* are on ``meta`` while buffers and all other tensors are
created on the CPU as usual, so non-persistent buffers (rotary tables, ...) are computed by the model's own
init and persistent ones are small until they are replaced. ``bind_targets`` fetches every tensor first (a
view, a clone, or a cast) and only then installs them, so a failure leaves the module untouched.

A file whose header length is not a multiple of 8 puts its tensors at addresses that are not a multiple of
their element size (safetensors hands out such views: 8k + 1 bytes of header puts every tensor at an odd
address). Kernels and ``view(dtype)`` refuse them, so :func:`aligned` copies each one, byte for byte, into a
private tensor at an aligned address: the bits are the file's, only sharing the page cache is lost (logged, and
counted as private bytes in the load report).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch
from torch import nn

from dlo_fn.io.checkpoint import CONFIG_FILE, Checkpoint, CheckpointError

__all__ = [
    "BindTarget",
    "Bound",
    "aligned",
    "meta_params",
    "bind_targets",
    "rollback",
    "model_from_config",
    "meta_module_from_header",
    "with_address_residues",
    "BUFFER_HOOKS",
    "buffer_hook",
    "non_persistent_buffers",
    "recompute_buffers",
    "stored_weights",
    "drop_stored",
    "STORED_ATTR",
]

STORED_ATTR = "dlo_fn_stored"  # where a loaded quantised checkpoint's stored weights wait (dlo_fn.io.quantized)

DLO_MODEL_TYPE = "dlo_fn-video-dit"


@dataclass(frozen=True, slots=True)
class BindTarget:
    """One module tensor to bind: its dotted name, the checkpoint key it comes from, where it lives and the
    dtype it must have once bound."""

    name: str
    key: str
    module: nn.Module
    attr: str
    kind: str  # "param" | "buffer"
    dtype: torch.dtype
    is_parameter: bool = True


@dataclass(frozen=True, slots=True)
class Bound:
    """One installed tensor and why it is private memory, if it is: ``cast`` to another dtype, or
    ``realigned`` (copied off a misaligned file offset, bits unchanged)."""

    tensor: torch.Tensor
    cast: bool = False
    realigned: bool = False


def aligned(view: torch.Tensor) -> torch.Tensor:
    """``view`` itself when its address is a multiple of its element size, else a private copy at an aligned
    address with the same bytes (copied as bytes, so no value, NaN payload or signed zero can change)."""
    if view.element_size() <= 1 or view.data_ptr() % view.element_size() == 0:
        return view
    out = torch.empty(view.shape, dtype=view.dtype)
    if view.numel():  # a byte view of the source is legal at any offset; a typed view is what failed
        out.reshape(-1).view(torch.uint8).copy_(view.contiguous().reshape(-1).view(torch.uint8))
    return out


@contextlib.contextmanager
def meta_params() -> Iterator[None]:
    """While active, every parameter registered on any module is moved to ``meta`` (with its class and
    ``requires_grad``); buffers stay where they were created. A parameter created with data (``randn``)
    exists on the CPU for an instant, one at a time."""
    original = nn.Module.register_parameter

    def register_meta_parameter(module: nn.Module, name: str, param) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            p = module._parameters[name]
            kwargs = dict(p.__dict__)
            kwargs["requires_grad"] = p.requires_grad
            module._parameters[name] = type(p)(p.to("meta"), **kwargs)

    nn.Module.register_parameter = register_meta_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def bind_targets(
    ckpt: Checkpoint, targets: Sequence[BindTarget], *, copy: bool, progress: bool | None = None
) -> list[Bound]:
    """Fetch then install every target; returns one :class:`Bound` per target, in target order.

    A fetched tensor is ``safe_open(file).get_tensor(key)``: a view into one copy-on-write mmap per file
    (one handle per file, so one mapping). ``copy=True`` clones it into private memory (the naive loader);
    a dtype change casts it (also private); a view at a misaligned address is copied to an aligned one
    (:func:`aligned`). Tied names share one installed tensor."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    by_key: dict[tuple[str, torch.dtype], Bound] = {}
    handles = {}
    total = sum(ckpt.entries[k].nbytes for k in dict.fromkeys(t.key for t in targets))
    try:
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc="bind" if not copy else "copy",
            disable=None if progress is None else not progress,
            leave=False,
        ) as bar:
            for t in targets:
                if (t.key, t.dtype) in by_key:
                    continue
                entry = ckpt.entries[t.key]
                if entry.file not in handles:
                    handles[entry.file] = safe_open(str(entry.file), framework="pt", device="cpu")
                view = handles[entry.file].get_tensor(t.key)
                was_cast = view.dtype != t.dtype
                fixed = aligned(view)
                tensor = fixed.to(t.dtype) if was_cast else (view.clone() if copy and fixed is view else fixed)
                by_key[(t.key, t.dtype)] = Bound(tensor, was_cast, fixed is not view)
                bar.update(entry.nbytes)
    finally:
        handles.clear()  # views keep their mapping alive; copies let it go
    installed: dict[tuple[str, torch.dtype], torch.Tensor] = {}
    out = []
    for t in targets:
        bound = by_key[(t.key, t.dtype)]
        value = installed.get((t.key, t.dtype))
        if value is None:
            value = nn.Parameter(bound.tensor, requires_grad=False) if t.is_parameter else bound.tensor
            installed[(t.key, t.dtype)] = value
        if t.kind == "param":
            t.module._parameters[t.attr] = value
        else:
            t.module._buffers[t.attr] = value
        out.append(Bound(value, bound.cast, bound.realigned))
    return out


def rollback(saved: Sequence[tuple[nn.Module, str, str, torch.Tensor]]) -> None:
    """Put the original tensors back (``saved`` as ``(module, attr, kind, tensor)``)."""
    for module, attr, kind, tensor in saved:
        (module._parameters if kind == "param" else module._buffers)[attr] = tensor


def model_from_config(ckpt: Checkpoint) -> nn.Module:
    """The reference DiT described by the checkpoint's dlo_fn ``config.json``, built on ``meta``
    (``dlo_fn.models.build_model``); the loader then binds it and calls its ``init_buffers()``."""
    where = ckpt.root / CONFIG_FILE
    if ckpt.config is None:
        raise CheckpointError(
            "no config.json next to the weights, so the model is unknown: the command line takes dlo_fn and "
            "diffusers checkpoints only; from Python pass model_or_factory= (a module, a factory or a diffusers "
            "class)",
            file=where,
        )
    kind = ckpt.config.get("model_type") if isinstance(ckpt.config, dict) else None
    if kind != DLO_MODEL_TYPE:
        raise CheckpointError(
            f"config.json is neither a dlo_fn config (model_type {kind!r}, not {DLO_MODEL_TYPE!r}) "
            "nor a diffusers one (_class_name): the command line takes those only; from Python pass "
            "model_or_factory= to build the model yourself",
            file=where,
        )
    from dlo_fn import models

    try:
        config, dtype = models.load_config(where)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"bad dlo_fn config ({exc}): write the checkpoint again", file=where) from None
    return models.build_model(config, device="meta", dtype=dtype)


def meta_module_from_header(header: Mapping[str, Mapping]) -> nn.Module:
    """A module tree with one meta parameter per header key (``a.b.w`` -> ``model.a.b.w``): a stand-in model
    for checkpoints with no model class (benchmarks, inspection)."""
    from dlo_fn.plan.spec import dtype_from_safetensors

    root = nn.Module()
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        *path, attr = key.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        dtype = dtype_from_safetensors(entry["dtype"])
        module.register_parameter(
            attr, nn.Parameter(torch.empty(entry["shape"], dtype=dtype, device="meta"), requires_grad=False)
        )
    return root


# Model methods that (re)compute non-persistent buffers after binding, first found wins:
# dlo_fn.models.VideoDiT.init_buffers(device=None), or a generic init_non_persistent_buffers().
BUFFER_HOOKS = ("init_non_persistent_buffers", "init_buffers")


def buffer_hook(model: nn.Module):
    """The model's own method of :data:`BUFFER_HOOKS`, or None."""
    for name in BUFFER_HOOKS:
        hook = getattr(model, name, None)
        if callable(hook):
            return hook
    return None


def non_persistent_buffers(model: nn.Module, hook) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(names of all non-persistent buffers, those on meta)``; fails (before any binding) when some are on
    meta and there is no ``hook`` (:data:`BUFFER_HOOKS`, or the loader's own for diffusers models) to
    recompute them."""
    names, on_meta = [], []
    for mod_name, module in model.named_modules():
        for attr in sorted(module._non_persistent_buffers_set):
            t = module._buffers.get(attr)
            if t is not None:
                name = f"{mod_name}.{attr}" if mod_name else attr
                names.append(name)
                if t.is_meta:
                    on_meta.append(name)
    if on_meta and hook is None:
        raise CheckpointError(
            f"non-persistent buffer(s) {', '.join(on_meta[:5])} are on the meta device and checkpoints do not store "
            "them: pass a factory instead of a meta module (buffers are then built on the CPU), or give the model "
            "an init_non_persistent_buffers() method",
            key=on_meta[0],
        )
    return tuple(names), tuple(on_meta)


def recompute_buffers(model: nn.Module, names: tuple[str, ...], hook) -> None:
    """Run ``hook`` (when the model has non-persistent buffers); none may stay on meta."""
    if not names or hook is None:
        return
    hook()
    still = [n for n in names if model.get_buffer(n).is_meta]
    if still:
        what = getattr(hook, "__name__", "restore_buffers")
        raise CheckpointError(f"{what}() left {', '.join(still[:5])} on meta", key=still[0])


def with_address_residues(spec, model: nn.Module):
    """``spec`` with every block tensor's ``residue_bytes`` set to where ``model`` holds it now: its address mod
    ``KERNEL_ALIGNMENT_BYTES`` (:mod:`dlo_fn.plan.spec`).

    For a CPU model these tensors are the resident ones (a file's mmap views sit at the file's offsets mod 64,
    e.g. 8 mod 16 in diffusers files; a tensor torch allocated sits at 0 mod 64), and placing each weight in the
    slots at the same residue lets the offloaded kernels see the alignment the resident model computes with. A
    residue that is not a multiple of the itemsize (no kernel sees such a tensor aligned) or a tensor on meta
    keeps residue 0."""
    import dataclasses

    from dlo_fn.plan.spec import KERNEL_ALIGNMENT_BYTES

    blocks = []
    for block in spec.blocks:
        module = model.get_submodule(block.name)
        tensors = []
        for t in block.tensors:
            path, _, attr = t.name.rpartition(".")
            owner = module.get_submodule(path) if path else module
            value = owner._parameters.get(attr)
            value = owner._buffers.get(attr) if value is None else value
            r = 0 if value is None or value.is_meta else value.data_ptr() % KERNEL_ALIGNMENT_BYTES
            tensors.append(dataclasses.replace(t, residue_bytes=r if r % t.dtype.itemsize == 0 else 0))
        blocks.append(dataclasses.replace(block, tensors=tuple(tensors)))
    return dataclasses.replace(spec, blocks=tuple(blocks))


def stored_weights(model: nn.Module):
    """The :class:`~dlo_fn.io.quantized.StoredWeights` a quantised checkpoint's load left on ``model`` (None: none);
    here, not in :mod:`dlo_fn.io.quantized`, so that asking costs no FP8 module."""
    return getattr(model, STORED_ATTR, None)


def drop_stored(model: nn.Module) -> None:
    """Forget ``model``'s stored views (once a host store or the dequantised weights hold their bits)."""
    vars(model).pop(STORED_ATTR, None)
