"""Write random-initialised checkpoints as real safetensors, streaming one tensor at a time.

Layout of ``out_dir``::

    config.json                     {"model_type": "dlo_fn-video-dit", "dtype": "bf16", "seed": 0, "config": {...}}
    model.safetensors               when the tensors fit in one shard, else
    model-0000k-of-0000n.safetensors + model.safetensors.index.json  {"metadata": {"total_size"}, "weight_map"}

Each safetensors file is ``[u64 LE header size N][N bytes of JSON, space-padded to a multiple of 8][data]``;
the header maps each key to ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the data, tensors
tile the data with no gaps, and larger items come first (fp32 before bf16) so every tensor is aligned to its
item size. Shards take tensors in ``state_dict`` order (text encoder, embeddings, blocks 0..N-1, head) until
``max_shard_bytes`` would be exceeded (a larger tensor gets a shard of its own).

The model is only ever built on the meta device: each tensor is materialised from (seed, name)
(:mod:`dlo_fn.models.init`), written and freed, so peak memory is one tensor, whatever the model size. Files
are written as ``*.partial`` and renamed when complete; ``config.json`` comes last.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import sys
from typing import Sequence

import torch

from dlo_fn.models.config import DiTConfig
from dlo_fn.models.dit import DTYPES, build_model
from dlo_fn.models.init import TensorInit, init_plan, init_tensor
from dlo_fn.plan.header import safetensors_header
from dlo_fn.plan.sizes import parse_bytes

__all__ = [
    "MODEL_TYPE",
    "CONFIG_NAME",
    "SINGLE_FILE",
    "INDEX_FILE",
    "parse_size",
    "shard_tensors",
    "write_checkpoint",
    "ensure_checkpoint",
    "load_config",
]

log = logging.getLogger(__name__)

MODEL_TYPE = "dlo_fn-video-dit"
CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def parse_size(value: str | int | float) -> int:
    """``"2GB"`` -> 2_000_000_000: :func:`dlo_fn.plan.sizes.parse_bytes` (GB = 1e9, GiB = 2^30, ``"2e9"``, ...),
    and at least 1 byte (a shard limit of 0 would hold nothing)."""
    size = parse_bytes(value)
    if size < 1:
        raise ValueError(f"size {value!r}: must be at least 1 byte")
    return size


def shard_tensors(tensors: Sequence[TensorInit], max_shard_bytes: int) -> tuple[tuple[TensorInit, ...], ...]:
    """Greedy split in order: a shard closes when the next tensor would push it past ``max_shard_bytes``."""
    shards: list[list[TensorInit]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return tuple(tuple(s) for s in shards)


def _write_file(path: pathlib.Path, tensors: Sequence[TensorInit], seed: int, bar) -> None:
    for t in tensors:
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {t.name!r}: dtype {t.dtype} cannot be written (use bf16, fp16 or fp32)")
    head, offsets = safetensors_header([(t.name, _ST_DTYPES[t.dtype], t.shape, t.nbytes) for t in tensors])
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(head)
        for spec in sorted(tensors, key=lambda t: offsets[t.name]):
            data = init_tensor(spec, seed).contiguous().reshape(-1).view(torch.uint8).numpy()
            f.write(memoryview(data))
            bar.update(spec.nbytes)
            del data
    os.replace(partial, path)


def _existing(out_dir: pathlib.Path) -> list[pathlib.Path]:
    names = {CONFIG_NAME, SINGLE_FILE, INDEX_FILE}
    return sorted(
        p
        for p in out_dir.iterdir()
        if p.name in names or _SHARD_RE.match(p.name) or p.name.endswith(".safetensors.partial")
    )


def write_checkpoint(
    config: DiTConfig | str,
    out_dir: str | os.PathLike,
    seed: int = 0,
    dtype: torch.dtype | str = torch.bfloat16,
    max_shard_bytes: int | str | float = 2e9,
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> pathlib.Path:
    """Write ``config``'s weights (initialised from ``seed``, as ``build_model(config, "cpu", dtype, seed=seed)``
    would hold them) to ``out_dir``; returns the directory. Refuses to mix with an existing checkpoint unless
    ``overwrite``, which first removes the old checkpoint files (other files are left alone)."""
    from tqdm.auto import tqdm

    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; writing from a big-endian host is not supported")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    dtype_name = {v: k for k, v in DTYPES.items()}.get(dtype)
    if dtype_name is None:
        raise ValueError(f"dtype {dtype}: use one of {', '.join(DTYPES)}")
    max_shard_bytes = parse_size(max_shard_bytes)
    model = build_model(config, device="meta", dtype=dtype)
    config = model.config
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = _existing(out)
    if stale and not overwrite:
        raise FileExistsError(
            f"{out} already holds a checkpoint ({', '.join(p.name for p in stale)}): choose another directory "
            f"or pass overwrite=True (--overwrite)"
        )
    for path in stale:
        path.unlink()

    tensors = init_plan(model)
    total = sum(t.nbytes for t in tensors)
    shards = shard_tensors(tensors, max_shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    log.info(
        "writing %s (%s, seed %d): %d tensors, %.3f GB in %d file(s) to %s",
        config.name,
        dtype_name,
        seed,
        len(tensors),
        total / 1e9,
        len(shards),
        out,
    )
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"write {config.name}", disable=not progress) as bar:
        for name, shard in zip(names, shards):
            _write_file(out / name, shard, seed, bar)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard},
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    meta = {"model_type": MODEL_TYPE, "dtype": dtype_name, "seed": int(seed), "config": config.to_dict()}
    (out / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def ensure_checkpoint(folder: str | os.PathLike, config: DiTConfig | str = "tiny", seed: int = 0) -> pathlib.Path:
    """``<folder>/checkpoint``: the checkpoint already written there, else ``config`` written there from
    ``seed`` (the demo's and the notebooks' checkpoint)."""
    ckpt = pathlib.Path(folder) / "checkpoint"
    if (ckpt / CONFIG_NAME).is_file():
        log.info("using the checkpoint in %s", ckpt)
        return ckpt
    name = config if isinstance(config, str) else config.name
    log.info("writing the %s reference checkpoint to %s", name, ckpt)
    write_checkpoint(config, ckpt, seed=seed, progress=False)
    return ckpt


def load_config(checkpoint: str | os.PathLike) -> tuple[DiTConfig, torch.dtype]:
    """(config, checkpoint dtype) from ``config.json`` in a checkpoint directory (or beside a ``.safetensors``
    file or a ``*.safetensors.index.json`` index, which ``load_model`` takes too; or the ``config.json`` path
    itself)."""
    path = pathlib.Path(checkpoint)
    if path.is_dir():
        path = path / CONFIG_NAME
    elif path.suffix != ".json" or path.name.endswith(".index.json"):
        path = path.parent / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no {CONFIG_NAME}; write a checkpoint with "
            "`python -m dlo_fn make-checkpoint --model tiny --out DIR`"
        )
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); rewrite it with `python -m dlo_fn make-checkpoint`") from exc
    if not isinstance(meta, dict) or meta.get("model_type") != MODEL_TYPE:
        found = meta.get("model_type") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path}: model_type is {found!r}, expected {MODEL_TYPE!r} (not a dlo_fn checkpoint)")
    if meta.get("dtype") not in DTYPES:
        raise ValueError(f"{path}: key 'dtype' is {meta.get('dtype')!r}; expected one of {', '.join(DTYPES)}")
    if not isinstance(meta.get("config"), dict):
        raise ValueError(f"{path}: key 'config' must be an object holding the DiTConfig fields")
    try:
        config = DiTConfig.from_dict(meta["config"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: key 'config': {exc}") from exc
    return config, DTYPES[meta["dtype"]]
