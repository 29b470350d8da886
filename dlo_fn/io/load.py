"""Meta-device init + zero-copy mmap binding of safetensors checkpoints (technique 1).

The model is built with its parameters on the ``meta`` device (no storage), then every parameter and
persistent buffer is bound to ``safe_open(file, "pt").get_tensor(key)``: a view into a private (copy-on-write)
``mmap`` of the file. Every process that maps the same file shares one page-cache copy, so N ranks cost

    host memory ~= model + N x constant          (mmap, ``mode="mmap"``)
    host memory ~= N x (model + constant) + model page cache   (``mode="copy"``: the naive private copies)

Binding is all-or-nothing: keys, shapes and dtypes are checked against the headers before any tensor is
touched, and if binding still fails the module gets its original (meta) tensors back.

Dtype policy: a checkpoint dtype that differs from the module's declared dtype is a :class:`CheckpointError`
naming the tensor. ``cast_dtype=True`` casts such tensors to the module's dtype; ``cast_dtype=<dtype>`` casts
every floating-point tensor to that dtype. A cast tensor is a private copy: it is logged and counted in
``LoadReport.private_copy_bytes``.

Alignment: a tensor the file places at an address that is not a multiple of its element size (a header length
that is not a multiple of 8) is copied, bytes unchanged, to an aligned private tensor
(:func:`dlo_fn.io.bind.aligned`): logged once per load with the file, counted in ``private_copy_bytes``
and listed in ``LoadReport.realigned_tensors``. Offload and every kernel then see ordinary tensors.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple

import torch
from torch import nn

from dlo_fn.io.bind import (
    BUFFER_HOOKS,
    BindTarget,
    bind_targets,
    buffer_hook,
    meta_params,
    non_persistent_buffers,
    recompute_buffers,
    rollback,
)
from dlo_fn.io.checkpoint import Checkpoint, CheckpointError, open_checkpoint, quantization_marked
from dlo_fn.io.mappings import file_mappings, in_mappings

__all__ = [
    "LoadReport",
    "LoadResult",
    "load_checkpoint",
    "load_model",
    "build_for_checkpoint",
    "plan_targets",
    "MODES",
    "BUFFER_HOOKS",
    "CheckpointError",
]

log = logging.getLogger(__name__)
MODES = ("mmap", "copy")
KeyMap = Callable[[str], "str | None"] | Mapping[str, str]


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What a load did. ``mapped_bytes`` are zero-copy views inside a file mapping (checked against
    ``/proc/self/maps`` when ``verified``); ``private_copy_bytes`` live in this process's own memory."""

    source: str
    mode: str
    files: tuple[str, ...]
    num_tensors: int
    mapped_bytes: int
    private_copy_bytes: int
    cast_tensors: tuple[str, ...] = ()
    ignored_keys: tuple[str, ...] = ()  # checkpoint keys the key map dropped on purpose
    recomputed_buffers: tuple[str, ...] = ()  # non-persistent buffers: the model's own, never loaded
    verified: bool = False
    realigned_tensors: tuple[str, ...] = ()  # misaligned in the file: copied (same bytes) to aligned memory

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"LoadReport.mode must be one of {MODES}, got {self.mode!r}")
        if min(self.num_tensors, self.mapped_bytes, self.private_copy_bytes) < 0:
            raise ValueError("LoadReport counts must be >= 0")

    @property
    def total_bytes(self) -> int:
        return self.mapped_bytes + self.private_copy_bytes


class LoadResult(NamedTuple):
    model: nn.Module
    report: LoadReport


def load_model(
    checkpoint: str | os.PathLike, model_or_factory: nn.Module | Callable[[], nn.Module] | None = None, **kwargs
) -> nn.Module:
    """:func:`load_checkpoint` returning the model only."""
    return load_checkpoint(checkpoint, model_or_factory, **kwargs).model


def load_checkpoint(
    checkpoint: str | os.PathLike | Checkpoint,
    model_or_factory: nn.Module | Callable[[], nn.Module] | None = None,
    *,
    mode: str = "mmap",
    key_map: KeyMap | None = None,
    cast_dtype: torch.dtype | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    subfolder: str | None = None,
    torch_dtype: torch.dtype | None = None,
    progress: bool | None = None,
) -> LoadResult:
    """Load ``checkpoint`` (directory, ``.safetensors`` file, index file, or cached HF repo id) into a model.

    ``model_or_factory``: a module whose parameters are usually on ``meta``; or a zero-argument factory,
    called with parameters created on ``meta`` and buffers on the CPU (so non-persistent buffers are computed
    by the model's own init); or ``None`` to build the model ``config.json`` describes: the reference DiT (a
    dlo_fn config) or the diffusers class it names, as ``from_pretrained(torch_dtype=...)`` builds it
    (:mod:`dlo_fn.io.diffusers_load`: ``torch_dtype`` defaults to the checkpoint's own, fp32 modules stay
    fp32, stored tensors are cast to their module's dtype as diffusers casts them). A diffusers model class
    builds from the checkpoint's config too. After binding, the model's buffer hook (:data:`BUFFER_HOOKS`:
    ``init_non_persistent_buffers()`` or ``init_buffers()``, as ``dlo_fn.models.VideoDiT`` has; for a diffusers
    model, a fresh build of its class) recomputes non-persistent buffers left on meta; without a hook they must
    already be real. ``key_map`` maps a checkpoint key to the module's name (a callable returning
    ``None`` drops the key on purpose). ``mode="copy"`` is the naive loader (private clones) for comparison.
    ``progress``: a tqdm bar on stderr (``None``: only on a terminal). A quantised checkpoint
    (:mod:`dlo_fn.io.quantized`) keeps its FP8 block tensors aside, their module entries on meta.

    Returns ``(model, LoadReport)``. Raises :class:`CheckpointError` (a ``ValueError`` naming file and key) for
    bad input, before any tensor is bound; a failure while binding restores the module's original tensors.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    ckpt = (
        checkpoint
        if isinstance(checkpoint, Checkpoint)
        else open_checkpoint(checkpoint, cache_dir=cache_dir, revision=revision, subfolder=subfolder)
    )
    model, built_by_diffusers = build_for_checkpoint(ckpt, model_or_factory, torch_dtype)
    if built_by_diffusers and cast_dtype is None:
        cast_dtype = True  # from_pretrained casts every stored tensor to its module's dtype
    elif isinstance(model_or_factory, nn.Module):
        _warn_cast_buffers(model)
    fmt = None
    if quantization_marked(ckpt):  # a quantised checkpoint: its FP8 tensors mapped aside (dlo_fn.io.quantized)
        from dlo_fn.io.quantized import bind_stored, stored_format

        fmt = stored_format(ckpt)
    targets, ignored = plan_targets(ckpt, model, key_map, cast_dtype, fmt.keys if fmt is not None else ())
    recomputed, _ = non_persistent_buffers(model, _buffer_hook(model))
    saved = [(t.module, t.attr, t.kind, getattr(t.module, t.attr)) for t in targets]
    try:
        bound = bind_targets(ckpt, targets, copy=(mode == "copy"), progress=progress)
        recompute_buffers(model, recomputed, _buffer_hook(model))
        if fmt is not None:
            bind_stored(ckpt, model, fmt)
        report = _report(ckpt, mode, targets, bound, ignored, recomputed)
    except BaseException:
        rollback(saved)
        raise
    if report.cast_tensors:
        log.warning(
            "cast %d tensor(s) to another dtype; they are private copies (%d bytes), not shared page cache: %s",
            len(report.cast_tensors),
            report.private_copy_bytes,
            ", ".join(report.cast_tensors[:5]) + (" ..." if len(report.cast_tensors) > 5 else ""),
        )
    if report.realigned_tensors:
        files = sorted({str(ckpt.entries[t.key].file) for t, b in zip(targets, bound) if b.realigned})
        log.warning(
            "%d tensor(s) sit at misaligned offsets of %s (a header length that is not a multiple of 8): "
            "copied, bytes unchanged, to aligned private memory (%d bytes private in all); write the "
            "checkpoint again (safetensors' save_file pads the header) to map it zero-copy",
            len(report.realigned_tensors),
            ", ".join(files),
            report.private_copy_bytes,
        )
    log.info(
        "loaded %s (%s): %d tensors, %d bytes mapped, %d bytes private",
        ckpt.source,
        mode,
        report.num_tensors,
        report.mapped_bytes,
        report.private_copy_bytes,
    )
    return LoadResult(model, report)


def build_for_checkpoint(
    ckpt: Checkpoint, model_or_factory=None, torch_dtype: torch.dtype | None = None
) -> tuple[nn.Module, bool]:
    """``(model, built from a diffusers config)``: the module :func:`load_checkpoint` binds (see there), with
    no tensor read. A given module is returned as it is."""
    from dlo_fn.io import diffusers_load

    if isinstance(model_or_factory, nn.Module):
        return model_or_factory, False
    if model_or_factory is None:
        if diffusers_load.is_diffusers_config(ckpt.config):
            return diffusers_load.build_model(ckpt, torch_dtype=torch_dtype), True
        from dlo_fn.io.bind import model_from_config

        return model_from_config(ckpt), False
    if diffusers_load.is_diffusers_model(model_or_factory) and isinstance(model_or_factory, type):
        return diffusers_load.build_model(ckpt, cls=model_or_factory, torch_dtype=torch_dtype), True
    if not callable(model_or_factory):
        raise TypeError(f"model_or_factory must be an nn.Module, a factory or None, got {type(model_or_factory)}")
    with meta_params():
        model = model_or_factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    return model, False


def _map_key(key_map: KeyMap | None, key: str) -> str | None:
    if key_map is None:
        return key
    if isinstance(key_map, Mapping):
        return key_map.get(key, key)
    return key_map(key)


def plan_targets(
    ckpt: Checkpoint,
    model: nn.Module,
    key_map: KeyMap | None = None,
    cast_dtype: torch.dtype | bool | None = None,
    stored: tuple[str, ...] = (),
) -> tuple[tuple[BindTarget, ...], tuple[str, ...]]:
    """``(targets, ignored keys)``: module tensors matched to checkpoint entries, names, shapes and dtypes
    checked from the headers alone (no tensor read); the :class:`CheckpointError` of every mismatch. ``stored``:
    a quantised checkpoint's FP8 tensors (:class:`dlo_fn.io.quantized.StoredFormat`'s ``keys``), left out with
    their scales (their module entries stay on meta)."""
    from dlo_fn.plan.quant import SCALE_SUFFIX
    from dlo_fn.plan.spec import dtype_from_safetensors

    wanted: dict[str, tuple[nn.Module, str, str, torch.Tensor]] = {}
    aliases: dict[int, list[str]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for attr, t in module._parameters.items():
            if t is not None:
                wanted[prefix + attr] = (module, attr, "param", t)
                aliases.setdefault(id(t), []).append(prefix + attr)
        for attr, t in module._buffers.items():
            if t is not None and attr not in module._non_persistent_buffers_set:
                wanted[prefix + attr] = (module, attr, "buffer", t)
                aliases.setdefault(id(t), []).append(prefix + attr)
    names: dict[str, str] = {}  # module name -> checkpoint key
    ignored = []
    skipped = set(stored) | {k + SCALE_SUFFIX for k in stored}
    for key in ckpt.entries:
        if key in skipped:
            continue
        name = _map_key(key_map, key)
        if name is None:
            ignored.append(key)
            continue
        if name in names:
            raise CheckpointError(
                f"the key map sends this key and {names[name]!r} to the same module tensor {name!r}: fix the key map",
                file=ckpt.entries[key].file,
                key=key,
            )
        names[name] = key
    unexpected = sorted(names[n] for n in names if n not in wanted)
    if unexpected:
        key = unexpected[0]
        raise CheckpointError(
            f"unexpected key: {len(unexpected)} checkpoint tensor(s) match no parameter or persistent buffer of "
            f"the module ({', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}): a damaged header or "
            "another model's checkpoint; build the matching model, or pass key_map= to rename them (None skips)",
            file=ckpt.entries[key].file,
            key=key,
        )
    # A tied tensor (one object under several names) needs one of its names in the checkpoint.
    missing = [
        n
        for n in wanted
        if n not in names and n not in skipped and not any(a in names for a in aliases[id(wanted[n][3])])
    ]
    if missing:
        raise CheckpointError(
            f"missing key: {len(missing)} module tensor(s) have no checkpoint entry ({', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}); check the checkpoint matches the model, or pass key_map=",
            file=ckpt.files[0] if len(ckpt.files) == 1 else ckpt.root,
            key=missing[0],
        )
    targets = []
    for name, (module, attr, kind, t) in wanted.items():
        if name in skipped and name not in names:
            continue
        key = names.get(name) or next(names[a] for a in aliases[id(t)] if a in names)
        entry = ckpt.entries[key]
        if tuple(t.shape) != entry.shape:
            raise CheckpointError(
                f"shape mismatch: checkpoint {list(entry.shape)} vs module {name!r} "
                f"{list(t.shape)}; build the model with the checkpoint's config",
                file=entry.file,
                key=key,
            )
        stored = dtype_from_safetensors(entry.dtype)
        target = t.dtype
        if cast_dtype is not None and cast_dtype is not False and stored.is_floating_point:
            target = t.dtype if cast_dtype is True else cast_dtype
        if stored != target and (cast_dtype is None or cast_dtype is False or not stored.is_floating_point):
            raise CheckpointError(
                f"dtype mismatch: checkpoint {stored} vs module {name!r} {t.dtype}; build the model in "
                f"{stored}, or pass cast_dtype=True (cast to the module's dtype: a private copy, not shared)",
                file=entry.file,
                key=key,
            )
        targets.append(BindTarget(name, key, module, attr, kind, target, isinstance(t, nn.Parameter)))
    return tuple(targets), tuple(ignored)


def _warn_cast_buffers(model: nn.Module) -> None:
    from dlo_fn.io import diffusers_load

    if diffusers_load.is_diffusers_model(model) and hasattr(model, "config"):
        cast = diffusers_load.cast_buffers(model)
        if cast:
            log.warning(
                "%s: buffer(s) %s are not in the dtype from_pretrained gives them (model.to(dtype) casts "
                "buffers too); load the folder without a model (load_model(folder, torch_dtype=...)) to "
                "get them as diffusers has them",
                type(model).__name__,
                ", ".join(cast[:5]),
            )


def _buffer_hook(model: nn.Module):
    """The model's :data:`BUFFER_HOOKS` method, else for a diffusers model a fresh build of its class."""
    hook = buffer_hook(model)
    if hook is None:
        from dlo_fn.io import diffusers_load

        if diffusers_load.is_diffusers_model(model) and hasattr(model, "config"):
            hook = functools.partial(diffusers_load.restore_buffers, model)
    return hook


def _report(ckpt: Checkpoint, mode: str, targets, bound, ignored, recomputed) -> LoadReport:
    files = tuple(str(f) for f in ckpt.files)
    try:
        ranges = file_mappings(files)
        verified = True
    except OSError:  # no /proc: trust the construction
        ranges, verified = {}, False
    mapped = private = 0
    cast, realigned = [], []
    seen = set()
    for target, b in zip(targets, bound):
        tensor = b.tensor
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if b.cast:
            cast.append(target.name)
        if b.realigned:
            realigned.append(target.name)
        own = b.cast or b.realigned  # private by construction
        nbytes = tensor.numel() * tensor.element_size()
        file = str(pathlib.Path(ckpt.entries[target.key].file).resolve())
        inside = in_mappings(ranges.get(file, []), tensor.data_ptr(), nbytes) if verified else not own
        if mode == "mmap" and not own and not inside and nbytes:
            raise RuntimeError(
                f"{target.name}: the safetensors view is not inside a mapping of {file}; "
                "this safetensors build copies on load, so mmap sharing is lost"
            )
        if inside or (not verified and mode == "mmap" and not own):
            mapped += nbytes
        else:
            private += nbytes
    return LoadReport(
        ckpt.source,
        mode,
        files,
        len(seen),
        mapped,
        private,
        tuple(cast),
        ignored,
        recomputed,
        verified,
        tuple(realigned),
    )
