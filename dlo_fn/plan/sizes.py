"""Model sizes as the memory models see them, and byte-size parsing (``"124GB"``, ``"33e9"``).

The memory models (:mod:`dlo_fn.cost.memory`, :mod:`dlo_fn.cost.hbm`) need only each block's flat bytes and the
resident bytes: a :class:`ModelSizes` holds exactly that, built from a :class:`~dlo_fn.plan.spec.ModelSpec`
(exact), from a total and a block count (equal blocks), or from a total and the largest block. Shard arithmetic
is the layout planner's (:func:`dlo_fn.plan.layout.equal_shard_bytes`): ``s_b = align_up(ceil(n_b / W), A)``
over ``W = num_shards`` ranks. ``max_block_bytes`` is the largest block unsharded and unpadded;
``max_padded_block_bytes(W)`` the largest block padded to ``W`` equal shards (the slot size).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dlo_fn.plan.layout import DEFAULT_ALIGNMENT_BYTES, equal_shard_bytes, grouped_shard_bytes, layout_load_group

__all__ = ["GB", "GIB", "parse_bytes", "ModelSizes"]

GB = 10**9
GIB = 2**30
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """``"124GB"`` -> 124e9, ``"33e9"`` -> 33e9, ``"1.5TiB"``, ``"512MiB"``, ``"1000"``; GB = 1e9, GiB = 2**30.

    The one byte-size parser of the project (the checkpoint writer's ``parse_size`` is this plus ``>= 1``). An
    int is taken exactly (no float round trip, so sizes above 2^53 bytes stay exact)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size {text!r} must be a finite, non-negative number of bytes")
        return text
    if isinstance(text, float):
        value, unit = text, ""
    else:
        m = _SIZE.match(str(text))
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(
                f"cannot read {text!r} as a size: write a number with an optional unit "
                f"(B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024), e.g. 124GB or 33e9"
            )
        number, unit = m.group(1), m.group(2).upper()
        value = int(number) if number.isdigit() else float(number)  # digits only: exact, whatever the size
    n = value * _UNITS[unit]
    if isinstance(n, int):
        return n
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"size {text!r} must be a finite, non-negative number of bytes")
    return round(n)


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelSizes:
    """The only model facts the memory models need: each block's flat bytes and the resident bytes.

    ``source`` says where the sizes come from (a config, a checkpoint header, or a published description).
    """

    name: str
    block_bytes: tuple[int, ...]
    resident_bytes: int = 0
    source: str = ""
    # Quantised shards (dlo_fn.plan.quant): each block's stored bytes (FP8 and scales: host, H2D, all-gather);
    # ``block_bytes`` stay what a slot holds. Empty: blocks are stored as computed.
    stored_block_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.stored_block_bytes and len(self.stored_block_bytes) != len(self.block_bytes):
            raise ValueError(f"model {self.name!r}: stored_block_bytes needs one entry per block")
        if not self.block_bytes:
            raise ValueError(f"model {self.name!r}: at least one block is needed")
        if any(not isinstance(n, int) or n < 1 for n in self.block_bytes):
            raise ValueError(f"model {self.name!r}: every block needs a positive int byte count")
        if not isinstance(self.resident_bytes, int) or self.resident_bytes < 0:
            raise ValueError(f"model {self.name!r}: resident_bytes must be a non-negative int")

    @classmethod
    def uniform(
        cls, name: str, total_bytes: int, num_blocks: int, resident_bytes: int = 0, source: str = ""
    ) -> "ModelSizes":
        """``num_blocks`` equal blocks (within one byte) holding ``total_bytes - resident_bytes``."""
        _check_positive("num_blocks", num_blocks)
        block_total = total_bytes - resident_bytes
        if block_total < num_blocks:
            raise ValueError(
                f"model {name!r}: {total_bytes} bytes minus {resident_bytes} resident cannot fill {num_blocks} blocks"
            )
        q, r = divmod(block_total, num_blocks)
        return cls(name, (q + 1,) * r + (q,) * (num_blocks - r), resident_bytes, source)

    @classmethod
    def from_max_block(
        cls, name: str, total_bytes: int, max_block_bytes: int, resident_bytes: int = 0, source: str = ""
    ) -> "ModelSizes":
        """As many ``max_block_bytes`` blocks as fit, plus one smaller block for the remainder."""
        _check_positive("max_block_bytes", max_block_bytes)
        block_total = total_bytes - resident_bytes
        if block_total < 1:
            raise ValueError(f"model {name!r}: no block bytes left after {resident_bytes} resident bytes")
        full, rest = divmod(block_total, max_block_bytes)
        return cls(name, (max_block_bytes,) * full + ((rest,) if rest else ()), resident_bytes, source)

    @classmethod
    def from_spec(
        cls,
        spec,
        alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
        source: str = "",
        quantization: str | None = None,
        exclude: tuple[str, ...] = (),
    ) -> "ModelSizes":
        """Exact flat block sizes of a :class:`~dlo_fn.plan.spec.ModelSpec` (tensors packed at ``A``);
        ``quantization="fp8"``: with the stored blocks' sizes too (:mod:`dlo_fn.plan.quant`)."""
        from dlo_fn.plan.layout import block_layout
        from dlo_fn.plan.quant import check_quantization, stored_block

        blocks = tuple(block_layout(b, alignment_bytes).nbytes for b in spec.blocks)
        stored = (
            ()
            if check_quantization(quantization) is None
            else tuple(block_layout(stored_block(b, exclude), alignment_bytes).nbytes for b in spec.blocks)
        )
        return cls(spec.name, blocks, spec.resident_bytes, source or f"ModelSpec {spec.name!r}", stored)

    @property
    def quantized(self) -> bool:
        return bool(self.stored_block_bytes)

    @property
    def stored_bytes(self) -> tuple[int, ...]:
        """Each block's bytes as the host stores and moves them."""
        return self.stored_block_bytes or self.block_bytes

    @property
    def num_blocks(self) -> int:
        return len(self.block_bytes)

    @property
    def total_block_bytes(self) -> int:
        return sum(self.block_bytes)

    @property
    def max_block_bytes(self) -> int:
        """The largest block, unsharded and unpadded."""
        return max(self.block_bytes)

    @property
    def total_bytes(self) -> int:
        return self.total_block_bytes + self.resident_bytes

    def shard_bytes(self, num_shards: int, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> tuple[int, ...]:
        """``s_b = align_up(ceil(n_b / W), A)`` per block (:func:`dlo_fn.plan.layout.equal_shard_bytes`)."""
        _check_positive("num_shards", num_shards)
        return tuple(equal_shard_bytes(n, num_shards, alignment_bytes) for n in self.stored_bytes)

    def shard_bytes_per_rank(
        self, num_shards: int, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES, load_group: int = 1
    ) -> int:
        """A rank's host bytes of shards; ``load_group``: of the layout built for it (where it groups the blocks,
        each group's shards are its largest one's: :func:`dlo_fn.plan.layout.grouped_shard_bytes`)."""
        group = layout_load_group(self.num_blocks, num_shards, load_group)
        return sum(grouped_shard_bytes(self.stored_bytes, num_shards, group, alignment_bytes))

    def max_shard_bytes(self, num_shards: int, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> int:
        """Landing-buffer size: the largest local shard."""
        return max(self.shard_bytes(num_shards, alignment_bytes))

    def max_padded_block_bytes(self, num_shards: int, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> int:
        """Slot size: the largest block padded to ``W`` equal shards (``W = 1``: aligned whole block); quantised,
        the largest block as computed."""
        if self.quantized:
            return self.max_block_bytes
        return num_shards * self.max_shard_bytes(num_shards, alignment_bytes)

    def staging_bytes(self, num_shards: int, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> int:
        """A slot's staging buffer (quantised: the largest stored block gathered; else none)."""
        return num_shards * self.max_shard_bytes(num_shards, alignment_bytes) if self.quantized else 0
