"""Pre-quantised checkpoints (``python -m dlo_fn quantize``): how they are marked, and what loading one binds.

A quantised checkpoint is an ordinary safetensors one (its source's files, index and ``config.json``) whose block
tensors selected by :func:`dlo_fn.plan.quant.quantized` are stored as ``F8_E4M3`` under their own names, each
followed by its float32 scales ``<name>_scale``; every file's ``__metadata__`` says so::

    "dlo_fn.quantization": "fp8"
    "dlo_fn.quantize_exclude": '["proj_out"]'      the modules the writer was told to keep (JSON list)
    "dlo_fn.torch_dtype": "bfloat16"               the dtype the FP8 tensors dequantise into

:func:`~dlo_fn.io.load.load_checkpoint` binds the rest as usual (mmap views) and leaves each stored tensor's module
entry on ``meta`` in its compute dtype, so the model describes itself (``spec_from_module``) as the source did. The
FP8 and scale views go in a :class:`StoredWeights` on the model (:func:`stored_weights`): ``offload(...,
quantization="fp8")`` fills its host store from them (no quantise step), ``fake_quantize`` dequantises them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from dlo_fn.io.bind import STORED_ATTR, drop_stored, stored_weights
from dlo_fn.io.checkpoint import META_QUANTIZATION, Checkpoint, CheckpointError, read_header
from dlo_fn.plan.layout import BlockLayout
from dlo_fn.plan.quant import SCALE_SUFFIX, check_quantization

__all__ = [
    "META_QUANTIZATION",
    "META_EXCLUDE",
    "META_DTYPE",
    "StoredFormat",
    "StoredWeights",
    "stored_format",
    "bind_stored",
    "stored_weights",
    "drop_stored",
]

META_EXCLUDE, META_DTYPE = "dlo_fn.quantize_exclude", "dlo_fn.torch_dtype"
FP8_NAME = "F8_E4M3"


@dataclass(frozen=True, slots=True)
class StoredFormat:
    """What a quantised checkpoint's ``__metadata__`` records (the same in every file), and its FP8 tensors
    (``keys``, each with its ``<key>_scale``)."""

    quantization: str
    exclude: tuple[str, ...]
    torch_dtype: torch.dtype
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StoredWeights:
    """A loaded quantised checkpoint's stored block tensors: dotted module name -> ``(FP8 view, float32 scale
    view)``, both views of the file's mapping, and the files they view. What ``offload`` fills a quantised host
    store from; quantising on the fly gives it the same interface (:class:`dlo_fn.runtime.quant.QuantizeOnLoad`:
    ``exclude``, ``files``, ``check``, ``block``)."""

    format: StoredFormat
    tensors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    files: tuple[str, ...]

    @property
    def exclude(self) -> tuple[str, ...]:
        """The modules the writer kept as they were."""
        return self.format.exclude

    def check(self, fp8: set[str], paths: tuple[str, ...]) -> None:
        """The FP8 tensors the layout of block lists ``paths`` stores (``fp8``, dotted names) are those stored."""
        if fp8 != set(self.tensors):
            raise ValueError(
                f"the checkpoint's FP8 tensors are not those FP8 shards of block lists {list(paths)} "
                f"store (e.g. {sorted(fp8 ^ set(self.tensors))[0]!r}): offload the block lists it "
                "was quantised for, or quantize the source again"
            )

    def block(
        self, stored: BlockLayout, tensors: Mapping[str, torch.Tensor], pieces: object = None
    ) -> dict[str, torch.Tensor]:
        """Block ``stored``'s tensors as the host store reads them: ``tensors`` (the module's, by relative name)
        with each stored one replaced by its FP8 view and its scales added under ``<name>_scale`` (``pieces``, the
        rank's, change nothing: the file holds every row)."""
        out, prefix = dict(tensors), stored.name + "."
        for name, (q, scale) in self.tensors.items():
            if name.startswith(prefix):
                out[name.removeprefix(prefix)], out[name.removeprefix(prefix) + SCALE_SUFFIX] = q, scale
        return out


def stored_format(ckpt: Checkpoint) -> StoredFormat | None:
    """The quantisation ``ckpt``'s files record (None: not quantised); files that disagree, or an FP8 tensor without
    its scales, are an error."""
    kinds: dict[tuple, object] = {}  # each file's marks -> the first file with them
    for file in ckpt.files:
        meta = read_header(file).get("__metadata__") or {}
        kinds.setdefault((meta.get(META_QUANTIZATION), meta.get(META_EXCLUDE, "[]"), meta.get(META_DTYPE)), file)
    if len(kinds) > 1:
        raise CheckpointError(
            f"this file's {META_QUANTIZATION} metadata differs from {ckpt.files[0].name}'s: the "
            "files come from different checkpoints; quantize the source again",
            file=list(kinds.values())[1],
        )
    ((quantization, exclude, dtype),) = kinds
    if quantization is None:
        return None
    try:
        check_quantization(quantization)
        names = json.loads(exclude)
        torch_dtype = getattr(torch, dtype or "", None)
        if not (
            isinstance(names, list)
            and all(isinstance(n, str) for n in names)
            and isinstance(torch_dtype, torch.dtype)
            and torch_dtype.is_floating_point
        ):
            raise ValueError(f"{META_EXCLUDE} {exclude!r} or {META_DTYPE} {dtype!r} is not what dlo_fn writes")
    except (ValueError, TypeError) as exc:
        raise CheckpointError(
            f"bad quantisation metadata ({exc}): quantize the source again", file=ckpt.files[0]
        ) from None
    keys = tuple(k for k, e in ckpt.entries.items() if e.dtype == FP8_NAME)
    for key in keys:
        entry, scale = ckpt.entries[key], ckpt.entries.get(key + SCALE_SUFFIX)
        if scale is None or scale.dtype != "F32" or scale.shape != entry.shape[:1] or len(entry.shape) < 2:
            raise CheckpointError(
                f"an FP8 tensor needs float32 scales {key + SCALE_SUFFIX!r} of shape "
                f"{list(entry.shape[:1])}: quantize the source again",
                file=entry.file,
                key=key,
            )
    return StoredFormat(quantization, tuple(names), torch_dtype, keys)


def bind_stored(ckpt: Checkpoint, model: nn.Module, fmt: StoredFormat) -> None:
    """Map the FP8 tensors ``fmt.keys`` (and their scales) of ``ckpt`` for ``model``, whose entries under those names
    stay on ``meta`` (their compute dtype and shape, checked here), and attach them to it."""
    from safetensors import safe_open

    handles = {f: safe_open(str(f), framework="pt", device="cpu") for f in {ckpt.entries[k].file for k in fmt.keys}}
    tensors = {}
    for key in fmt.keys:
        entry = ckpt.entries[key]
        path, _, attr = key.rpartition(".")
        declared = getattr(model.get_submodule(path), attr)
        if tuple(declared.shape) != entry.shape or not declared.is_floating_point():
            raise CheckpointError(
                f"FP8 tensor of shape {list(entry.shape)} for the module's {declared.dtype} "
                f"{list(declared.shape)}: build the model with the checkpoint's config",
                file=entry.file,
                key=key,
            )
        tensors[key] = (handles[entry.file].get_tensor(key), handles[entry.file].get_tensor(key + SCALE_SUFFIX))
    setattr(model, STORED_ATTR, StoredWeights(fmt, tensors, tuple(str(f.resolve()) for f in ckpt.files)))
