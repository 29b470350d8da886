"""Find and read safetensors checkpoints without touching tensor data.

A checkpoint is a directory holding ``model.safetensors`` or a sharded ``model.safetensors.index.json`` plus
its shards (the diffusers names ``diffusion_pytorch_model.safetensors[.index.json]`` are accepted too), a
single ``.safetensors`` file, or a Hugging Face repo id resolved from the local Hugging Face cache only.

A safetensors file is::

    [8 bytes: N, little-endian u64][N bytes: JSON header][data buffer]

and the header maps each key to ``{"dtype", "shape", "data_offsets": [begin, end]}`` with offsets relative to
the data buffer. :func:`read_header` reads the first ``8 + N`` bytes only and checks ``8 + N <= file size``,
``N`` below safetensors' own 100 MB limit, and then everything :func:`dlo_fn.plan.header.parse_header` checks
(what safetensors itself checks, and that the tensors tile the data buffer exactly), so a plan
(``dlo_fn.plan.spec.spec_from_header``) and every bad-input error can come from headers alone, before a byte of
weights is mapped.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import struct
import types
from dataclasses import dataclass
from typing import Mapping

from dlo_fn.plan.header import HeaderError, parse_header

__all__ = [
    "CheckpointError",
    "TensorEntry",
    "Checkpoint",
    "read_header",
    "resolve_checkpoint",
    "open_checkpoint",
    "CONFIG_FILE",
    "META_QUANTIZATION",
    "quantization_marked",
]
META_QUANTIZATION = "dlo_fn.quantization"  # the mark a quantised checkpoint's files carry (dlo_fn.io.quantized)

# (single file, index) pairs, in the order a directory is searched.
WEIGHT_NAMES = (
    ("model.safetensors", "model.safetensors.index.json"),
    ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json"),
)
CONFIG_FILE = "config.json"
PIPELINE_INDEX, PIPELINE_TRANSFORMER = "model_index.json", "transformer"  # a diffusers pipeline folder
MAX_HEADER_BYTES = 100_000_000  # safetensors refuses larger headers too
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CheckpointError(ValueError):
    """Bad checkpoint input. ``file`` and ``key`` name what is wrong (either may be None); the message says
    what to do."""

    def __init__(self, message: str, *, file: str | os.PathLike | None = None, key: str | None = None):
        self.file = None if file is None else str(file)
        self.key = key
        where = ", ".join(p for p in (self.file and f"file {self.file}", key and f"key {key!r}") if p)
        super().__init__(f"{where}: {message}" if where else message)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One stored tensor: where its bytes are (absolute offsets into ``file``) and what they are."""

    key: str
    file: pathlib.Path
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    offset_bytes: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A resolved checkpoint: its files in order, every tensor entry, and the ``config.json`` if any."""

    source: str  # what the caller passed
    root: pathlib.Path  # directory holding the files
    files: tuple[pathlib.Path, ...]
    entries: Mapping[str, TensorEntry]
    config: Mapping | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", types.MappingProxyType(dict(self.entries)))

    @property
    def header(self) -> dict[str, dict]:
        """The headers of all files merged (no ``__metadata__``): the input of ``spec_from_header``."""
        return {
            k: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.offset_bytes, e.offset_bytes + e.nbytes]}
            for k, e in self.entries.items()
        }

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def keys_by_file(self) -> dict[pathlib.Path, tuple[str, ...]]:
        out: dict[pathlib.Path, list[str]] = {f: [] for f in self.files}
        for key, entry in self.entries.items():
            out[entry.file].append(key)
        return {f: tuple(keys) for f, keys in out.items()}


def read_header(path: str | os.PathLike) -> dict:
    """The validated JSON header of one safetensors file (``__metadata__`` included when present).

    Reads only the first ``8 + N`` bytes. Raises :class:`CheckpointError` naming the file (and key) for a
    missing, truncated or corrupted file."""
    return _read_header(pathlib.Path(path))[0]


def _read_header(path: pathlib.Path) -> tuple[dict, int]:
    """``(header, absolute offset of the data buffer)``."""
    if not path.is_file():
        raise CheckpointError("no such file: check the path or write the checkpoint first", file=path)
    file_bytes = path.stat().st_size
    fix = "the file is damaged: download or write it again"
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"file has {file_bytes} bytes, fewer than the 8-byte header size; {fix}", file=path)
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes == 0 or header_bytes > MAX_HEADER_BYTES:
            raise CheckpointError(f"corrupted header: header size {header_bytes} is not sane; {fix}", file=path)
        if 8 + header_bytes > file_bytes:
            raise CheckpointError(
                f"truncated: header size {header_bytes} runs past the end of the {file_bytes}-byte file; {fix}",
                file=path,
            )
        raw = f.read(header_bytes)
    try:
        header = parse_header(raw, data_bytes=file_bytes - 8 - header_bytes)
    except HeaderError as exc:
        raise CheckpointError(f"{exc}; {fix}", file=path, key=exc.key) from None
    return header, 8 + header_bytes


def resolve_checkpoint(
    checkpoint: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    subfolder: str | None = None,
) -> tuple[pathlib.Path, tuple[pathlib.Path, ...], pathlib.Path | None]:
    """``(root, weight files, index file or None)`` for a directory, a file, or a cached Hugging Face repo id.

    A repo id is looked up with ``huggingface_hub.snapshot_download(local_files_only=True)`` in ``cache_dir``,
    else ``$HF_HUB_CACHE`` (read now, not at import), else huggingface_hub's default. Nothing is downloaded.
    ``owner/name`` is a repo id only when no such local path exists and ``owner`` is not a local directory. A
    diffusers pipeline folder (``model_index.json``, no weights of its own) resolves to its ``transformer``."""
    text = os.fspath(checkpoint)
    path = pathlib.Path(text).expanduser()
    if _is_repo_id(text, path):
        path = _from_hf_cache(text, cache_dir=cache_dir, revision=revision)
    if subfolder:
        path = path / subfolder
    if path.is_file():
        if path.suffix == ".json":
            return path.parent, _index_files(path), path
        return path.parent, (path,), None
    if not path.is_dir():
        raise CheckpointError(
            f"no such checkpoint {_what_is_there(path)}: pass a directory with model.safetensors (or an index), a "
            ".safetensors file, or a Hugging Face repo id that is in the local cache",
            file=path,
        )
    for single, index in WEIGHT_NAMES:
        for name in (index, single):
            if (path / name).is_file():
                return (path, _index_files(path / name), path / name) if name == index else (path, (path / name,), None)
            if os.path.lexists(path / name):
                raise CheckpointError(
                    f"{name} is {_what_is_there(path / name)}, not a file: write or download the checkpoint again",
                    file=path / name,
                )
    found = sorted(p.name for p in path.glob("*.safetensors") if p.is_file())
    if len(found) == 1:
        return path, (path / found[0],), None
    if not found and (path / PIPELINE_INDEX).is_file() and (path / PIPELINE_TRANSFORMER).is_dir():
        return resolve_checkpoint(path / PIPELINE_TRANSFORMER)
    hint = f"found {found}: add a model.safetensors.index.json" if found else "it holds no .safetensors file"
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json here ({hint})", file=path)


def _is_repo_id(text: str, path: pathlib.Path) -> bool:
    if os.path.lexists(path) or not _REPO_ID.match(text) or text.startswith((".", "/", "~")):
        return False
    owner = path.parts[0]
    return not os.path.isdir(owner) and not text.endswith((".safetensors", ".json"))


def _what_is_there(path: pathlib.Path) -> str:
    """``directory or file`` when nothing is at ``path``; else what is there instead of a file."""
    if path.is_symlink() and not path.exists():
        return f"a broken symlink (to {os.readlink(path)})"
    if path.is_dir():
        return "a directory"
    if path.exists():
        return "not a regular file"
    return "directory or file"


def _from_hf_cache(repo_id: str, *, cache_dir, revision) -> pathlib.Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if cache_dir is None:
        cache_dir = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        where = cache_dir or constants.HF_HUB_CACHE
        raise CheckpointError(
            f"{repo_id!r} is neither a local path nor a repo in the Hugging Face cache at {where} "
            f"(revision {revision or 'main'}); download it first (`hf download {repo_id}`) or pass a local directory",
            file=where,
        ) from None
    return pathlib.Path(folder)


def _index_files(index: pathlib.Path) -> tuple[pathlib.Path, ...]:
    weight_map = _read_index(index)
    return tuple(dict.fromkeys(index.parent / name for name in weight_map.values()))


def _read_index(index: pathlib.Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"unreadable index ({exc}): write or download it again", file=index) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if weight_map is None and isinstance(data, dict) and not index.name.endswith(".index.json"):
        raise CheckpointError(
            f"a JSON file without a weight_map is no checkpoint index (a model's config?): pass the folder "
            f"that holds the checkpoint, {index.parent}",
            file=index,
        )
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            "index has no weight_map of key -> shard file name: write it again (or pass the checkpoint directory)",
            file=index,
        )
    for key, name in weight_map.items():
        if not name or pathlib.PurePath(name).name != name:
            raise CheckpointError(
                f"the index names shard {name!r}, which is not a file name beside the index: "
                "write or download the index again",
                file=index,
                key=key,
            )
    return weight_map


def open_checkpoint(
    checkpoint: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    subfolder: str | None = None,
) -> Checkpoint:
    """Resolve ``checkpoint`` and read every header (no tensor data). An index must name existing shards, and
    every key it maps must be in that shard's header; a key in two files is an error."""
    root, files, index = resolve_checkpoint(checkpoint, cache_dir=cache_dir, revision=revision, subfolder=subfolder)
    weight_map = _read_index(index) if index is not None else None
    entries: dict[str, TensorEntry] = {}
    for file in files:
        if index is not None and not file.is_file():
            key = next(k for k, v in weight_map.items() if root / v == file)
            what = "missing" if _what_is_there(file) == "directory or file" else _what_is_there(file)
            raise CheckpointError(
                f"the index {index.name} names shard {file.name}, which is {what}: download or copy the shard",
                file=file,
                key=key,
            )
        header, data_start = _read_header(file)
        for key, e in header.items():
            if key == "__metadata__":
                continue
            if key in entries:
                raise CheckpointError(
                    f"key also stored in {entries[key].file}: remove the duplicate", file=file, key=key
                )
            begin, end = e["data_offsets"]
            entries[key] = TensorEntry(key, file, e["dtype"], tuple(e["shape"]), data_start + begin, end - begin)
    if weight_map is not None:
        for key, name in weight_map.items():
            entry = entries.get(key)
            if entry is None or entry.file != root / name:
                raise CheckpointError(
                    f"the index maps this key to {name}, whose header does not hold it: the index and shards "
                    "disagree; write or download them again",
                    file=root / name,
                    key=key,
                )
    if not entries:
        raise CheckpointError(
            "the checkpoint holds no tensors: write or download it again", file=index or (files[0] if files else root)
        )
    config = None
    if (root / CONFIG_FILE).is_file():
        try:
            config = json.loads((root / CONFIG_FILE).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"unreadable config ({exc}): write it again", file=root / CONFIG_FILE) from None
        if not isinstance(config, dict):
            raise CheckpointError(
                f"config is a JSON {type(config).__name__}, not an object: write it again", file=root / CONFIG_FILE
            )
    return Checkpoint(os.fspath(checkpoint), root, tuple(files), entries, config)


def quantization_marked(ckpt: Checkpoint) -> bool:
    """Whether any file of ``ckpt`` carries the quantised checkpoint's mark (:mod:`dlo_fn.io.quantized` reads the
    rest); the loader asks first, so plain checkpoints never load the FP8 modules."""
    return any(META_QUANTIZATION in (read_header(f).get("__metadata__") or {}) for f in ckpt.files)
