"""Model description as data: tensor, block and model specs.

A :class:`ModelSpec` is everything the planners need to know about a model: for each block (one entry of a
block list such as ``blocks`` or ``transformer_blocks``), the name, shape, dtype and kind of every tensor it
owns; and the *resident* tensors outside the block lists (embeddings, final layer), which stay on the device.

Two sources, neither of which touches tensor data:

* :func:`spec_from_module` walks an ``nn.Module`` (usually on the ``meta`` device) given the dotted path(s) of
  its block list(s); several lists are concatenated in forward order.
* :func:`spec_from_header` reads a parsed safetensors header (``{key: {"dtype", "shape", "data_offsets"}}``).

Only persistent state is described: non-persistent buffers (e.g. rotary tables) are recomputed by the model
and are never stored, offloaded or gathered.

A tensor may also carry ``residue_bytes``: its address modulo :data:`KERNEL_ALIGNMENT_BYTES` in the resident
model (``0`` unless the runtime says otherwise). CPU kernels can round differently for the same values at
different alignments (MKL's one-row fp32 GEMV: a weight at 8 mod 16 and one at 0 mod 16 give different bits),
so the flat layout places each tensor at the same residue the resident model computes with.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

__all__ = [
    "TensorSpec",
    "BlockSpec",
    "ModelSpec",
    "spec_from_module",
    "spec_from_header",
    "dtype_from_safetensors",
    "dtype_to_safetensors",
    "normalize_block_paths",
    "KERNEL_ALIGNMENT_BYTES",
]

# The widest alignment a kernel can branch on: a cache line, one AVX-512 vector, and the alignment of every CPU
# allocation torch makes (so a tensor torch allocated itself has residue 0).
KERNEL_ALIGNMENT_BYTES = 64

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_TO_SAFETENSORS = {v: k for k, v in _SAFETENSORS_DTYPES.items()}

TENSOR_KINDS = ("param", "buffer")


def dtype_from_safetensors(name: str) -> torch.dtype:
    """``"BF16"`` -> ``torch.bfloat16``; a ``ValueError`` names unknown dtypes."""
    try:
        return _SAFETENSORS_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown safetensors dtype {name!r}; known: {', '.join(sorted(_SAFETENSORS_DTYPES))}"
        ) from None


def dtype_to_safetensors(dtype: torch.dtype) -> str:
    try:
        return _TO_SAFETENSORS[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors name") from None


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One stored tensor. ``name`` is relative to its block (``attn.qkv.weight``) for block tensors and the
    full dotted name for resident tensors."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str = "param"
    residue_bytes: int = 0  # address mod KERNEL_ALIGNMENT_BYTES in the resident model (see the module docstring)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TensorSpec.name is empty")
        if not 0 <= self.residue_bytes < KERNEL_ALIGNMENT_BYTES or self.residue_bytes % self.dtype.itemsize:
            raise ValueError(
                f"TensorSpec {self.name!r}: residue_bytes must be a multiple of the itemsize in "
                f"[0, {KERNEL_ALIGNMENT_BYTES}), got {self.residue_bytes}"
            )
        if self.kind not in TENSOR_KINDS:
            raise ValueError(f"TensorSpec {self.name!r}: kind must be one of {TENSOR_KINDS}, got {self.kind!r}")
        if any(int(d) < 0 for d in self.shape):
            raise ValueError(f"TensorSpec {self.name!r}: negative dimension in shape {self.shape}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """One offloaded block: its full dotted prefix (``blocks.3``) and its tensors sorted by name, so a spec
    from a module and one from that module's checkpoint header agree."""

    name: str
    tensors: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"block {self.name!r} lists tensors more than once: {dup}")

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Blocks in forward order plus the resident (never offloaded) tensors."""

    name: str
    blocks: tuple[BlockSpec, ...]
    resident: tuple[TensorSpec, ...] = ()

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError(f"model {self.name!r} has no blocks: check the block list path(s)")

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def block_bytes(self) -> tuple[int, ...]:
        return tuple(b.nbytes for b in self.blocks)

    @property
    def max_block_bytes(self) -> int:
        """The largest block's stored tensor bytes (before packing, sharding or padding; the slot size is
        :attr:`dlo_fn.plan.layout.ModelLayout.max_padded_block_bytes`)."""
        return max(self.block_bytes)

    @property
    def total_block_bytes(self) -> int:
        return sum(self.block_bytes)

    @property
    def resident_bytes(self) -> int:
        return sum(t.nbytes for t in self.resident)

    @property
    def total_bytes(self) -> int:
        return self.total_block_bytes + self.resident_bytes

    @property
    def num_params(self) -> int:
        """Number of stored elements (parameters and persistent buffers)."""
        return sum(b.numel for b in self.blocks) + sum(t.numel for t in self.resident)


def normalize_block_paths(block_paths: str | Sequence[str]) -> tuple[str, ...]:
    paths = (block_paths,) if isinstance(block_paths, str) else tuple(block_paths)
    if not paths or any(not p for p in paths):
        raise ValueError(f"block_paths must name at least one block list, got {block_paths!r}")
    return paths


def _persistent_state(module: nn.Module) -> Iterable[tuple[str, torch.Tensor, str]]:
    """(name, tensor, kind) for every parameter and persistent buffer, in state_dict order, without
    duplicates (tied weights appear once, under their first name)."""
    seen: set[int] = set()
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for name, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield prefix + name, p, "param"
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                yield prefix + name, b, "buffer"


def _get_submodule(module: nn.Module, path: str) -> nn.Module:
    try:
        return module.get_submodule(path)
    except AttributeError:
        raise ValueError(
            f"block list {path!r} not found in {type(module).__name__}; pass the dotted path of the "
            f"nn.ModuleList holding the blocks (e.g. 'blocks' or 'transformer_blocks')"
        ) from None


def spec_from_module(module: nn.Module, block_paths: str | Sequence[str], name: str = "model") -> ModelSpec:
    """Describe ``module`` (any device, typically ``meta``): one :class:`BlockSpec` per entry of each block list
    in ``block_paths`` (concatenated in the given order), the rest as resident tensors."""
    paths = normalize_block_paths(block_paths)
    blocks: list[BlockSpec] = []
    in_blocks: set[str] = set()
    for path in paths:
        block_list = _get_submodule(module, path)
        if not isinstance(block_list, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"{path!r} is a {type(block_list).__name__}, not an nn.ModuleList of blocks")
        for idx, block in enumerate(block_list):
            prefix = f"{path}.{idx}"
            tensors = tuple(
                sorted(
                    (TensorSpec(tname, tuple(t.shape), t.dtype, kind) for tname, t, kind in _persistent_state(block)),
                    key=lambda t: t.name,
                )
            )
            blocks.append(BlockSpec(prefix, tensors))
            in_blocks.update(f"{prefix}.{t.name}" for t in tensors)
    resident = tuple(
        TensorSpec(tname, tuple(t.shape), t.dtype, kind)
        for tname, t, kind in _persistent_state(module)
        if tname not in in_blocks and not any(tname.startswith(p + ".") for p in paths)
    )
    return ModelSpec(name, tuple(blocks), resident)


_BLOCK_KEY = re.compile(r"^(?P<path>.+?)\.(?P<index>\d+)\.(?P<rest>.+)$")


def _detect_block_paths(keys: Iterable[str]) -> tuple[str, ...]:
    """The ``<path>.<int>.`` prefixes with the most indices; ties keep first-seen order."""
    counts: dict[str, set[int]] = {}
    for key in keys:
        m = _BLOCK_KEY.match(key)
        if m:
            counts.setdefault(m["path"], set()).add(int(m["index"]))
    if not counts:
        raise ValueError(
            "no '<path>.<index>.<name>' keys in the checkpoint: name its block lists (plan --block-paths a,b; "
            "Python: block_paths=)"
        )
    best = max(len(v) for v in counts.values())
    # Keep every list at least a third as deep as the deepest (Flux: 19 double + 38 single blocks), but not
    # shallow stacks such as a 2-layer text encoder next to 4 blocks.
    return tuple(p for p, v in counts.items() if len(v) * 3 >= best and (len(v) >= 3 or len(v) == best))


def spec_from_header(
    header: Mapping[str, Mapping],
    block_paths: str | Sequence[str] | None = None,
    name: str = "checkpoint",
) -> ModelSpec:
    """Describe a checkpoint from its safetensors header alone (merged over shards; ``__metadata__`` ignored).

    ``block_paths`` defaults to the detected ``<path>.<int>.`` prefixes. The header cannot tell parameters
    from buffers, so every tensor is a ``"param"`` here; layouts and digests ignore the kind.
    """
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    paths = _detect_block_paths(entries) if block_paths is None else normalize_block_paths(block_paths)
    per_block: dict[tuple[int, int], list[TensorSpec]] = {}
    resident: list[TensorSpec] = []
    for key, entry in entries.items():
        try:
            dtype = dtype_from_safetensors(entry["dtype"])
            shape = tuple(entry["shape"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"header entry {key!r} lacks dtype/shape: {exc}") from None
        for pi, path in enumerate(paths):
            if key.startswith(path + "."):
                head, _, rest = key[len(path) + 1 :].partition(".")
                if not head.isdigit() or not rest:
                    raise ValueError(f"key {key!r} is under block list {path!r} but not '<index>.<name>'")
                per_block.setdefault((pi, int(head)), []).append(TensorSpec(rest, shape, dtype, "param"))
                break
        else:
            resident.append(TensorSpec(key, shape, dtype, "param"))
    for pi, path in enumerate(paths):
        indices = sorted(i for p, i in per_block if p == pi)
        if not indices:
            raise ValueError(f"block list {path!r} has no tensors in the checkpoint")
        if indices != list(range(len(indices))):
            missing = sorted(set(range(indices[-1] + 1)) - set(indices))
            raise ValueError(f"block list {path!r} has gaps in the checkpoint: missing indices {missing}")
    blocks = tuple(
        BlockSpec(f"{paths[pi]}.{i}", tuple(sorted(per_block[(pi, i)], key=lambda t: t.name)))
        for (pi, i) in sorted(per_block)
    )
    return ModelSpec(name, blocks, tuple(resident))
