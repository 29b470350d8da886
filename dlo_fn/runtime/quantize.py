"""Pre-quantised checkpoints: :func:`quantize_checkpoint` writes a checkpoint's FP8 shards once, so no rank
quantises at start-up (``python -m dlo_fn quantize SRC DST``).

DST has SRC's layout: the same file names, the index (its weight map gains the scales, its ``total_size`` the new
bytes) and ``config.json``. Every block tensor that ``offload(..., quantization="fp8")`` would store as FP8
(:func:`dlo_fn.plan.quant.quantized` over the model's block lists, its fp32 modules and ``exclude`` kept) is
written as ``F8_E4M3`` under its own name plus its float32 scales under ``<name>_scale``, computed by
:func:`~dlo_fn.runtime.quant.quantize_rows` from the tensor the loader would bind (cast to its module's dtype,
as ``load_model`` casts it): the bits the on-the-fly path computes. Every other tensor is copied byte for byte,
and each file's ``__metadata__`` keeps SRC's entries and gains the marks of :mod:`dlo_fn.io.quantized`.

Memory stays flat: tensors are read with positioned reads (not the mapping, which would keep every page read
charged to this process until it closed) and quantised in chunks of rows of at most :data:`CHUNK_BYTES` of
float32, each written at its offset in DST as it is done; peak host memory is a few chunks, whatever the size.
Within a file, larger item sizes come first (as safetensors' own writer orders them), so every tensor of DST is
aligned to its item size and maps zero-copy.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from dlo_fn.io.checkpoint import CONFIG_FILE, Checkpoint, CheckpointError, open_checkpoint, read_header, \
    resolve_checkpoint
from dlo_fn.io.quantized import FP8_NAME, META_DTYPE, META_EXCLUDE, META_QUANTIZATION, stored_format
from dlo_fn.plan.quant import SCALE_SUFFIX, quantized
from dlo_fn.plan.spec import dtype_from_safetensors, normalize_block_paths, spec_from_module
from dlo_fn.runtime.quant import fp32_modules, quantize_rows

__all__ = ["QuantizeReport", "quantize_checkpoint", "CHUNK_BYTES"]

log = logging.getLogger(__name__)
CHUNK_BYTES = 4 << 20  # float32 bytes of rows quantised at once on the host (and bytes copied at once)
DEVICE_CHUNK_BYTES = 64 << 20  # on a GPU, where the quantise is ~free and the host's reads and writes are the cost


@dataclass(frozen=True, slots=True)
class QuantizeReport:
    """What :func:`quantize_checkpoint` wrote: ``num_quantized`` tensors as FP8 (plus their scales), the tensor
    bytes of SRC and of DST."""

    source: str
    out: pathlib.Path
    files: tuple[str, ...]
    block_paths: tuple[str, ...]
    exclude: tuple[str, ...]
    num_quantized: int
    source_bytes: int
    written_bytes: int


def _selected(ckpt: Checkpoint, model: nn.Module, paths: tuple[str, ...], exclude: tuple[str, ...]
              ) -> dict[str, torch.dtype]:
    """Checkpoint key -> the dtype its module computes in, for every tensor stored as FP8."""
    spec = spec_from_module(model, paths)
    keep = exclude + fp32_modules(model)
    out = {f"{b.name}.{t.name}": t.dtype for b in spec.blocks for t in b.tensors if quantized(t, b.name, keep)}
    for key in out:
        if key not in ckpt.entries:
            raise CheckpointError("a tied block tensor is stored under another name: quantize cannot pair it; "
                                  "pass exclude= its module", file=ckpt.root, key=key)
    return out


def _header(src: dict, selected: dict[str, torch.dtype], meta: dict[str, str]) -> tuple[bytes, dict[str, int], int]:
    """DST's ``[u64 N][JSON]``, each key's absolute offset and the data bytes; larger item sizes first (stable)."""
    items = []
    for key, e in src.items():
        if key == "__metadata__":
            continue
        if key in selected:
            items += [(key, FP8_NAME, e["shape"]), (key + SCALE_SUFFIX, "F32", e["shape"][:1])]
        else:
            items.append((key, e["dtype"], e["shape"], e["data_offsets"][1] - e["data_offsets"][0]))
    items.sort(key=lambda it: -dtype_from_safetensors(it[1]).itemsize)
    header: dict[str, object] = {"__metadata__": meta}
    offset = 0
    for key, dtype, shape, *nbytes in items:
        n = nbytes[0] if nbytes else _numel(shape) * dtype_from_safetensors(dtype).itemsize
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    offsets = {k: start + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    return struct.pack("<Q", len(text)) + text, offsets, offset


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _read(f, offset: int, nbytes: int) -> torch.Tensor:
    buf = bytearray(nbytes)
    f.seek(offset)
    if f.readinto(buf) != nbytes:
        raise CheckpointError(f"short read at byte {offset}: the file is damaged", file=f.name)
    return torch.frombuffer(buf, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)


def _write_file(src: pathlib.Path, dst: pathlib.Path, ckpt: Checkpoint, selected: dict[str, torch.dtype],
                meta: dict[str, str], update: Callable[[int], None], device: torch.device) -> int:
    header = read_header(src)
    head, offsets, data_bytes = _header(header, {k: v for k, v in selected.items() if k in header}, meta)
    partial = dst.with_name(dst.name + ".partial")
    keys = sorted((k for k in header if k != "__metadata__"), key=lambda k: ckpt.entries[k].offset_bytes)
    with open(src, "rb") as fin, open(partial, "wb") as fout:
        fout.write(head)
        for key in keys:
            e = ckpt.entries[key]
            if key not in selected:
                for lo in range(0, e.nbytes, CHUNK_BYTES):
                    fout.seek(offsets[key] + lo)
                    fout.write(_read(fin, e.offset_bytes + lo, min(CHUNK_BYTES, e.nbytes - lo)).numpy())
                update(e.nbytes)
                continue
            dtype = dtype_from_safetensors(e.dtype)
            rows, row_numel = e.shape[0], _numel(e.shape[1:])
            chunk = CHUNK_BYTES if device.type == "cpu" else DEVICE_CHUNK_BYTES
            step, row_bytes = max(1, chunk // max(1, 4 * row_numel)), row_numel * dtype.itemsize
            scales = torch.empty(rows, dtype=torch.float32)
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                raw = _read(fin, e.offset_bytes + r0 * row_bytes, (r1 - r0) * row_bytes)
                w = raw.view(dtype).view(r1 - r0, *e.shape[1:]).to(selected[key])  # as load_model casts it
                q, scale = quantize_rows(w.to(device))  # the same bits on the host and a GPU (runtime.quant)
                q, scales[r0:r1] = q.cpu(), scale.cpu()
                fout.seek(offsets[key] + r0 * row_numel)
                fout.write(q.reshape(-1).view(torch.uint8).numpy())
                update(raw.numel())
            fout.seek(offsets[key + SCALE_SUFFIX])
            fout.write(scales.view(torch.uint8).numpy())
    os.replace(partial, dst)
    return data_bytes


def _prepare_out(out: pathlib.Path, root: pathlib.Path, overwrite: bool) -> None:
    if out.resolve() == root.resolve():
        raise ValueError(f"{out} is the source's own folder: write the quantised checkpoint to a new folder")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file: give a new folder")
    old = [p for p in out.iterdir() if p.name == CONFIG_FILE or p.name.endswith((".safetensors", ".index.json",
                                                                                ".partial"))] if out.exists() else []
    if old and not overwrite:
        raise FileExistsError(f"{out} already holds a checkpoint ({', '.join(sorted(p.name for p in old)[:3])}): "
                              "choose a new folder, or pass overwrite=True (--force) to replace it")
    for p in old:
        p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def quantize_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, exclude: Sequence[str] = (),
                        block_paths: str | Sequence[str] | None = None, model_or_factory=None,
                        overwrite: bool = False, progress: bool | None = None,
                        device: str | torch.device | None = None) -> QuantizeReport:
    """Write ``src`` (a checkpoint ``load_model`` reads: a dlo_fn folder, file or index, a diffusers model
    folder) to the new folder ``dst`` with FP8 block weights (module docstring). ``block_paths``: the block
    lists (default: the model's own, as ``offload`` finds them); ``model_or_factory`` as ``load_model`` takes it;
    ``exclude``: modules to keep as they are, besides the model's fp32 ones; ``progress``: a tqdm bar (None:
    only on a terminal); ``device``: where the rows are quantised (None: a CUDA device where there is one). Refuses an already quantised ``src`` and a ``dst`` that holds a checkpoint (unless
    ``overwrite``) with a ``ValueError`` / ``FileExistsError`` saying what to do."""
    from tqdm.auto import tqdm

    from dlo_fn.io.diffusers_load import block_paths_for
    from dlo_fn.io.load import build_for_checkpoint, plan_targets

    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    ckpt = open_checkpoint(src)
    if stored_format(ckpt) is not None:
        raise CheckpointError("already quantised (fp8): load it as it is, or quantize its source checkpoint",
                              file=ckpt.files[0])
    model, by_diffusers = build_for_checkpoint(ckpt, model_or_factory)
    plan_targets(ckpt, model, cast_dtype=True if by_diffusers else None)  # the load would succeed
    paths = normalize_block_paths(block_paths) if block_paths is not None else block_paths_for(model)
    exclude = tuple(exclude)
    selected = _selected(ckpt, model, paths, exclude)
    if not selected:
        raise ValueError(f"no block tensor of {ckpt.source} is stored as FP8 (block lists {', '.join(paths)}, "
                         f"exclude {list(exclude)}): check the block paths and the excluded modules")
    dtypes: dict[torch.dtype, int] = {}
    for key, dtype in selected.items():
        dtypes[dtype] = dtypes.get(dtype, 0) + ckpt.entries[key].nbytes
    out = pathlib.Path(dst)
    _, _, index = resolve_checkpoint(src)
    _prepare_out(out, ckpt.root, overwrite)
    written = 0
    with tqdm(total=ckpt.total_bytes, unit="B", unit_scale=True, desc="quantize",
              disable=None if progress is None else not progress, leave=False) as bar:
        for file in ckpt.files:
            meta = dict(read_header(file).get("__metadata__") or {})
            meta.update({META_QUANTIZATION: "fp8", META_EXCLUDE: json.dumps(list(exclude)),
                         META_DTYPE: str(max(dtypes, key=dtypes.__getitem__)).removeprefix("torch.")})
            written += _write_file(file, out / file.name, ckpt, selected, meta, bar.update, device)
    if index is not None:
        doc = json.loads(index.read_text())
        weight_map = {}
        for key, name in doc["weight_map"].items():
            weight_map[key] = name
            if key in selected:
                weight_map[key + SCALE_SUFFIX] = name
        doc["weight_map"] = weight_map
        doc["metadata"] = {**(doc.get("metadata") or {}), "total_size": written}
        (out / index.name).write_text(json.dumps(doc, indent=2) + "\n")
    if (ckpt.root / CONFIG_FILE).is_file():
        (out / CONFIG_FILE).write_bytes((ckpt.root / CONFIG_FILE).read_bytes())
    log.info("quantized %s to %s: %d tensors as FP8, %d -> %d bytes", ckpt.source, out, len(selected),
             ckpt.total_bytes, written)
    return QuantizeReport(ckpt.source, out, tuple(f.name for f in ckpt.files), paths, exclude, len(selected),
                          ckpt.total_bytes, written)
