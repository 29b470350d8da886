"""Pre-quantised checkpoints (``python -m dlo_fn quantize SRC DST``): :func:`quantize_checkpoint` writes a
checkpoint's FP8 shards once, so no rank quantises at start-up.

DST is SRC in :mod:`dlo_fn.io.quantized`'s format (its index's weight map gains the scales, ``total_size`` the new
bytes; SRC's ``__metadata__`` entries stay): each tensor :func:`dlo_fn.plan.quant.quantized_tensors` selects is
quantised by :func:`~dlo_fn.runtime.quant.quantize_rows` from the tensor cast to its module's dtype (as
``load_model`` casts it), the on-the-fly path's bits; the rest is copied byte for byte.

Memory stays flat: positioned reads (a mapping would keep every page read charged to this process), rows quantised
in chunks of :data:`CHUNK_BYTES` of float32 (on a GPU ``DEVICE_CHUNK_BYTES``), each written at its offset in DST as
it is done. Larger item sizes come first within a file (as safetensors orders them), so every tensor is aligned and
maps zero-copy.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dlo_fn.io.checkpoint import (
    CONFIG_FILE,
    Checkpoint,
    CheckpointError,
    open_checkpoint,
    read_header,
    resolve_checkpoint,
)
from dlo_fn.io.quantized import FP8_NAME, META_DTYPE, META_EXCLUDE, META_QUANTIZATION, stored_format
from dlo_fn.plan.header import safetensors_header
from dlo_fn.plan.quant import SCALE_SUFFIX, quantized_tensors
from dlo_fn.plan.spec import dtype_from_safetensors, normalize_block_paths, spec_from_module
from dlo_fn.runtime.quant import fp32_modules, quantize_rows

__all__ = ["QuantizeReport", "quantize_checkpoint", "CHUNK_BYTES"]

CHUNK_BYTES = 4 << 20  # float32 bytes of rows quantised at once on the host (and bytes copied at once)
DEVICE_CHUNK_BYTES = 64 << 20  # on a GPU, where the quantise is ~free and the host's reads and writes are the cost


@dataclass(frozen=True, slots=True)
class QuantizeReport:
    """What :func:`quantize_checkpoint` wrote: ``num_quantized`` tensors as FP8 (plus scales), SRC's and DST's bytes."""

    out: pathlib.Path
    files: tuple[str, ...]
    block_paths: tuple[str, ...]
    num_quantized: int
    source_bytes: int
    written_bytes: int


def _read(f, offset: int, nbytes: int) -> torch.Tensor:
    buf = bytearray(nbytes)
    f.seek(offset)
    if f.readinto(buf) != nbytes:
        raise CheckpointError(f"short read at byte {offset}: the file is damaged", file=f.name)
    return torch.frombuffer(buf, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)


def _write_file(
    src: pathlib.Path,
    dst: pathlib.Path,
    ckpt: Checkpoint,
    selected: dict[str, torch.dtype],
    marks: dict[str, str],
    update: Callable[[int], None],
    device: torch.device,
) -> int:
    header = read_header(src)
    items = []  # DST's tensors: each selected one as FP8 plus its scales, the others as they are
    for key, e in header.items():
        if key in selected:
            items += [
                (key, FP8_NAME, e["shape"], math.prod(e["shape"])),
                (key + SCALE_SUFFIX, "F32", e["shape"][:1], 4 * e["shape"][0]),
            ]
        elif key != "__metadata__":
            items.append((key, e["dtype"], e["shape"], e["data_offsets"][1] - e["data_offsets"][0]))
    head, offsets = safetensors_header(items, {**(header.get("__metadata__") or {}), **marks})
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
            dtype, rows, row_numel = dtype_from_safetensors(e.dtype), e.shape[0], math.prod(e.shape[1:])
            chunk = CHUNK_BYTES if device.type == "cpu" else DEVICE_CHUNK_BYTES
            step, row_bytes = max(1, chunk // max(1, 4 * row_numel)), row_numel * dtype.itemsize
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                raw = _read(fin, e.offset_bytes + r0 * row_bytes, (r1 - r0) * row_bytes)
                w = raw.view(dtype).view(r1 - r0, *e.shape[1:]).to(selected[key])  # as load_model casts it
                q, scale = quantize_rows(w.to(device))  # the same bits on the host and a GPU (runtime.quant)
                fout.seek(offsets[key] + r0 * row_numel)
                fout.write(q.cpu().reshape(-1).view(torch.uint8).numpy())
                fout.seek(offsets[key + SCALE_SUFFIX] + 4 * r0)
                fout.write(scale.cpu().view(torch.uint8).numpy())
                update(raw.numel())
    os.replace(partial, dst)
    return sum(it[3] for it in items)


def _prepare_out(out: pathlib.Path, root: pathlib.Path, overwrite: bool) -> None:
    if out.resolve() == root.resolve():
        raise ValueError(f"{out} is the source's own folder: write the quantised checkpoint to a new folder")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file: give a new folder")
    old = (
        [
            p
            for p in out.iterdir()
            if p.name == CONFIG_FILE or p.name.endswith((".safetensors", ".index.json", ".partial"))
        ]
        if out.exists()
        else []
    )
    if old and not overwrite:
        raise FileExistsError(
            f"{out} already holds a checkpoint ({', '.join(sorted(p.name for p in old)[:3])}): "
            "choose a new folder, or pass overwrite=True (--force) to replace it"
        )
    for p in old:
        p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def quantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    exclude: Sequence[str] = (),
    block_paths: str | Sequence[str] | None = None,
    model_or_factory=None,
    overwrite: bool = False,
    progress: bool | None = None,
    device: str | torch.device | None = None,
) -> QuantizeReport:
    """Write ``src`` (a checkpoint ``load_model`` reads: a dlo_fn folder, file or index, a diffusers model folder)
    to the new folder ``dst`` with FP8 block weights (module doc). ``block_paths``: the block lists (default: the
    model's own, as ``offload`` finds them); ``model_or_factory`` as ``load_model`` takes it; ``exclude``: modules
    kept as they are, besides the model's fp32 ones; ``progress``: a tqdm bar (None: only on a terminal);
    ``device``: where rows are quantised (None: a CUDA device where there is one). Refuses an already quantised
    ``src``, and a ``dst`` holding a checkpoint unless ``overwrite``, with an error saying what to do."""
    from tqdm.auto import tqdm

    from dlo_fn.io.diffusers_load import block_paths_for
    from dlo_fn.io.load import build_for_checkpoint, plan_targets

    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    ckpt = open_checkpoint(src)
    if stored_format(ckpt) is not None:
        raise CheckpointError(
            "already quantised (fp8): load it as it is, or quantize its source checkpoint", file=ckpt.files[0]
        )
    model, by_diffusers = build_for_checkpoint(ckpt, model_or_factory)
    plan_targets(ckpt, model, cast_dtype=True if by_diffusers else None)  # the load would succeed
    paths = normalize_block_paths(block_paths) if block_paths is not None else block_paths_for(model)
    exclude = tuple(exclude)
    # Checkpoint key -> the dtype its module computes in, for every tensor stored as FP8.
    spec = spec_from_module(model, paths)
    selected = {k: t.dtype for k, t in quantized_tensors(spec, exclude + fp32_modules(model)).items()}
    if not selected:
        raise ValueError(
            f"no block tensor of {ckpt.source} is stored as FP8 (block lists {', '.join(paths)}, "
            f"exclude {list(exclude)}): check the block paths and the excluded modules"
        )
    tied = next((k for k in selected if k not in ckpt.entries), None)
    if tied is not None:
        raise CheckpointError(
            "a tied block tensor is stored under another name: quantize cannot pair it; pass exclude= its module",
            file=ckpt.root,
            key=tied,
        )
    nbytes = {
        d: sum(ckpt.entries[k].nbytes for k, v in selected.items() if v == d) for d in dict.fromkeys(selected.values())
    }
    marks = {
        META_QUANTIZATION: "fp8",
        META_EXCLUDE: json.dumps(list(exclude)),  # the dtype of most FP8 bytes:
        META_DTYPE: str(max(nbytes, key=nbytes.__getitem__)).removeprefix("torch."),
    }
    out = pathlib.Path(dst)
    _, _, index = resolve_checkpoint(src)
    _prepare_out(out, ckpt.root, overwrite)
    with tqdm(
        total=ckpt.total_bytes,
        unit="B",
        unit_scale=True,
        desc="quantize",
        disable=None if progress is None else not progress,
        leave=False,
    ) as bar:
        written = sum(_write_file(f, out / f.name, ckpt, selected, marks, bar.update, device) for f in ckpt.files)
    if index is not None:
        doc = json.loads(index.read_text())
        doc["weight_map"] = {
            k: name
            for key, name in doc["weight_map"].items()
            for k in ((key, key + SCALE_SUFFIX) if key in selected else (key,))
        }
        doc["metadata"] = {**(doc.get("metadata") or {}), "total_size": written}
        (out / index.name).write_text(json.dumps(doc, indent=2) + "\n")
    if (ckpt.root / CONFIG_FILE).is_file():
        (out / CONFIG_FILE).write_bytes((ckpt.root / CONFIG_FILE).read_bytes())
    return QuantizeReport(out, tuple(f.name for f in ckpt.files), paths, len(selected), ckpt.total_bytes, written)
