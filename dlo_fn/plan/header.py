"""The JSON header of a safetensors file, parsed and checked as data (no file is opened here).

A safetensors file is ``[8 bytes: N, little-endian u64][N bytes: JSON header][D data bytes]``; the header maps
each key to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data bytes) plus an optional
``"__metadata__"`` object of strings. :func:`parse_header` refuses every header safetensors 0.8 refuses, so a
header that passes here never fails later inside safetensors, and adds what the loader relies on:

* JSON (UTF-8) whose top level is an object; every number an unsigned integer (no ``-0``, no ``1.0``, no
  ``true`` for ``1``); no key twice (safetensors keeps the last one silently: refused here, it is ambiguous);
* ``__metadata__`` absent, ``null`` or an object whose values are strings;
* each entry: a dtype name torch knows, ``shape`` a list of sizes with ``prod(shape) x itemsize x 8 < 2^64``
  (safetensors multiplies in 64 bits), ``data_offsets`` ``[begin, end]`` with ``begin <= end`` and
  ``prod(shape) x itemsize = end - begin``;
* the spans tile the data exactly: sorted by ``begin`` they start at 0, each begins where the previous ends and
  the last ends at ``D`` (a shorter file is a truncated download, a longer one is corrupted).
"""

from __future__ import annotations

import json
import struct
from typing import Mapping, Sequence

from dlo_fn.plan.spec import dtype_from_safetensors

__all__ = ["HeaderError", "parse_header", "check_header"]


class HeaderError(ValueError):
    """A header safetensors would refuse (or one whose tensors do not tile the data); ``key`` names the entry
    when one is to blame."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {dup!r} appears twice")
    return out


def _unsigned(text: str) -> int:
    # safetensors reads every number as an unsigned integer: "-0" and "-1" are as invalid as "1.5"
    if text.startswith("-"):
        raise ValueError(f"negative number {text}")
    return int(text)


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_header(raw: bytes, data_bytes: int) -> dict:
    """The header of ``raw`` (the ``N`` header bytes) checked against ``data_bytes`` (``D``); raises
    :class:`HeaderError` (see the module docstring)."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_int=_unsigned)
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError, as are the hooks' errors
        raise HeaderError(f"corrupted header: not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"corrupted header: JSON is a {type(header).__name__}, not an object")
    check_header(header, data_bytes)
    return header


def check_header(header: Mapping, data_bytes: int) -> None:
    """Every entry of a parsed header well formed and the entries tiling ``data_bytes`` exactly."""
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise HeaderError("corrupted header: __metadata__ is not an object of strings", key="__metadata__")
    spans: list[tuple[int, int, str]] = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise HeaderError("corrupted header: entry lacks dtype/shape/data_offsets", key=key)
        shape, offsets, dtype = entry["shape"], entry["data_offsets"], entry["dtype"]
        if not (isinstance(shape, list) and all(_is_size(d) for d in shape)):
            raise HeaderError(f"corrupted header: shape {shape!r} is not a list of sizes", key=key)
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_size(o) for o in offsets)
            and offsets[0] <= offsets[1]
        ):
            raise HeaderError(f"corrupted header: data_offsets {offsets!r} are not [begin, end]", key=key)
        if not isinstance(dtype, str):
            raise HeaderError(f"corrupted header: dtype {dtype!r} is not a name", key=key)
        try:
            itemsize = dtype_from_safetensors(dtype).itemsize
        except ValueError as exc:
            raise HeaderError(f"{exc}; convert the checkpoint to a supported dtype", key=key) from None
        numel = 1
        for d in shape:  # safetensors multiplies in 64 bits and refuses an overflow, even one before a zero
            numel *= d
            if numel * itemsize * 8 >= 2**64:
                raise HeaderError(f"corrupted header: shape {shape} overflows 64 bits", key=key)
        if numel * itemsize != offsets[1] - offsets[0]:
            raise HeaderError(
                f"corrupted header: shape {shape} x {itemsize} bytes != byte span {offsets[1] - offsets[0]}", key=key
            )
        spans.append((offsets[0], offsets[1], key))
    spans.sort()
    end = 0
    for begin, stop, key in spans:
        if begin != end:
            what = "overlaps the previous tensor" if begin < end else f"leaves a gap of {begin - end} bytes"
            raise HeaderError(f"corrupted header: data_offsets [{begin}, {stop}] {what}", key=key)
        end = stop
    if end > data_bytes:
        raise HeaderError(
            f"truncated: tensors end at data byte {end} but the file holds only {data_bytes} data "
            "bytes (an incomplete download or copy?)",
            key=spans[-1][2],
        )
    if end < data_bytes:
        raise HeaderError(f"corrupted: {data_bytes - end} bytes after the last tensor")


def safetensors_header(
    items: Sequence[tuple[str, str, Sequence[int], int]], meta: dict | None = None
) -> tuple[bytes, dict[str, int]]:
    """(``[u64 N][JSON header]`` bytes, each key's offset in the file) of ``(key, safetensors dtype, shape, nbytes)``
    items. Larger item sizes first (stable: keeps the items' order) keeps every tensor aligned: the data starts at a
    multiple of 8 and each group's total is a multiple of the next item size."""
    header, offset = {"__metadata__": meta or {"format": "pt"}}, 0
    for key, dtype, shape, nbytes in sorted(items, key=lambda it: -dtype_from_safetensors(it[1]).itemsize):
        assert offset % dtype_from_safetensors(dtype).itemsize == 0, (key, offset)
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    offsets = {k: 8 + len(text) + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    return struct.pack("<Q", len(text)) + text, offsets
