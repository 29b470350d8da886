"""Flat block layouts and shard layouts.

**Flat block layout.** All stored tensors of a block (parameters and persistent buffers; mixed dtypes allowed,
e.g. bf16 weights with fp32 norms) are packed, in the block spec's order, into one byte buffer. Tensor ``i``
starts at ``offset_i = align_up(end_{i-1}, A)`` with alignment ``A`` (default 256 bytes: a multiple of every
itemsize, and of the 128-byte transaction size of GPU copies). Each tensor is contiguous, so a weight is a
view ``buffer[offset : offset + nbytes].view(dtype).view(shape)`` of the slot it was gathered into.

A tensor with a non-zero ``residue_bytes`` ``r`` (its address mod ``K = KERNEL_ALIGNMENT_BYTES = 64`` in the
resident model, :mod:`dlo_fn.plan.spec`) goes at ``offset_i = r + align_up(end_{i-1} - r, max(A, K))`` instead,
so ``offset_i = r (mod K)``: slots are ``K``-aligned, so a kernel sees the weight at the residue the resident
model computes with (at most ``max(A, K)`` bytes more per such tensor).

**Shard layout.** For a shard group of ``W = num_shards`` ranks, a block of ``n`` bytes is cut into ``W`` equal
shards of

    s = align_up(ceil(n / W), A)

bytes (``all_gather_into_tensor`` needs equal sizes; :func:`equal_shard_bytes`, in integers so it stays exact
above 2^53 bytes); rank ``r`` owns bytes ``[r*s, (r+1)*s)`` of the padded
buffer of ``W*s`` bytes, whose tail ``W*s - n < W*A`` is zero padding. Each rank copies only the tensor bytes
that fall in its range, as a list of :class:`Piece` (tensor source slice -> shard destination slice).

Example: a block with ``q.weight`` (bf16, 64 x 16 = 2048 bytes) and ``norm.weight`` (fp32, 64 = 256 bytes),
``A = 256``, ``W = 3``: ``n = 2304``, ``s = align_up(768, 256) = 768``, padded ``2304``, padding ``0``.

    ====  ===========  ==========================================
    rank  range        tensors (source bytes -> shard bytes)
    ====  ===========  ==========================================
    0     [0, 768)     q.weight[0:768] -> [0:768]
    1     [768, 1536)  q.weight[768:1536] -> [0:768]
    2     [1536, 2304) q.weight[1536:2048] -> [0:512];
                       norm.weight[0:256] -> [512:768]
    ====  ===========  ==========================================

**Grouped shard layout** (``load_group = G > 1``; :func:`model_layout`, ``B`` a multiple of ``G``). Blocks
``G i .. G i + G - 1`` form group ``i``: a load group of the ring (:mod:`dlo_fn.plan.lowering`), whose ``G``
loads land side by side in ``G`` consecutive landing buffers and are gathered into ``G`` consecutive slots. With
per-block shards that is ``G`` all-gathers (each a collective launch of its own, with its host work, grouped
or not); the grouped layout makes it ONE. The group's blocks are concatenated at a stride of
``P_i = W q_i`` bytes, ``q_i = max_b s_b`` over the group (so block ``g`` of the group starts at ``g P_i``), and
rank ``r`` owns bytes ``[r G q_i, (r + 1) G q_i)`` of that concatenation: one all-gather of ``G q_i`` bytes from
each rank then writes the ``G`` blocks at their stride, in place. Block ``g``'s :class:`ShardLayout` describes
rank ``r``'s ``g``-th piece of ``q_i`` bytes of its chunk (``shard_bytes = q_i``, ``padded_bytes = P_i``): its
:class:`Piece` s may come from any block of the group (``Piece.block``). A group of equal blocks pads nothing
more than per-block shards do (``q_i = s_b``); unequal blocks pad to the group's largest. ``G = 1`` is the
per-block layout above, byte for byte.

A :class:`ModelLayout` holds the shard layout of every block and a digest that ranks compare at start-up: two
ranks that disagree on any offset, shape, dtype, shard size or number of shards get different digests.

Sizes, named apart: ``BlockLayout.nbytes`` is a packed block (``n``); ``ShardLayout.padded_bytes`` is that block
padded to ``W`` equal shards (``W*s``, what a slot holds); ``ModelLayout.max_padded_block_bytes`` is the slot size
and ``max_shard_bytes`` the landing-buffer size. (``ModelSpec.max_block_bytes`` is the largest block's stored
tensor bytes, before packing and padding.)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace

import torch

from dlo_fn.plan.quant import Quantization, check_quantization, stored_block
from dlo_fn.plan.spec import KERNEL_ALIGNMENT_BYTES, BlockSpec, ModelSpec

__all__ = [
    "DEFAULT_ALIGNMENT_BYTES",
    "TensorPlacement",
    "BlockLayout",
    "Piece",
    "ShardLayout",
    "ModelLayout",
    "align_up",
    "equal_shard_bytes",
    "grouped_shard_bytes",
    "grouped_layout_problem",
    "layout_load_group",
    "block_layout",
    "cut_layout",
    "shard_layout",
    "grouped_shard_layouts",
    "model_layout",
]

DEFAULT_ALIGNMENT_BYTES = 256


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def equal_shard_bytes(nbytes: int, num_shards: int, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> int:
    """``s = align_up(ceil(n / W), A)``: the size of each of ``W`` equal aligned shards of ``n`` bytes.

    Integer arithmetic throughout (a float ``ceil(n / W)`` rounds wrongly above 2^53 bytes)."""
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    return align_up(-(-nbytes // num_shards), alignment_bytes)


def grouped_layout_problem(num_blocks: int, load_group: int) -> str | None:
    """Why blocks cannot be grouped ``load_group`` at a time for one all-gather per group, or None: the groups
    must be the same blocks in every pass of the ring, so ``load_group`` must divide the number of blocks."""
    if not isinstance(load_group, int) or isinstance(load_group, bool) or load_group < 1:
        return f"load_group must be an int >= 1, got {load_group!r}"
    if num_blocks % load_group:
        return (
            f"load_group = {load_group} does not divide the {num_blocks} blocks, so a load group is not the "
            f"same blocks in every pass"
        )
    return None


def layout_load_group(num_blocks: int, num_shards: int, load_group: int) -> int:
    """The load group a shard layout is built for: ``load_group`` over ``W > 1`` ranks where it divides the
    blocks (one all-gather per group), else 1 (no all-gather to save, or a group that is not the same blocks in
    every pass: per-block shards, the group's all-gathers in one launch)."""
    if num_shards == 1 or load_group == 1 or grouped_layout_problem(num_blocks, load_group) is not None:
        return 1
    return load_group


def grouped_shard_bytes(
    block_bytes: tuple[int, ...], num_shards: int, load_group: int = 1, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES
) -> tuple[int, ...]:
    """Per block, its shard size ``s_b`` (``load_group = 1``), or in a grouped layout ``q_i``, the largest ``s_b``
    of its group (see the module docstring); their sum is a rank's host bytes."""
    shards = [equal_shard_bytes(n, num_shards, alignment_bytes) for n in block_bytes]
    if load_group == 1:
        return tuple(shards)
    problem = grouped_layout_problem(len(shards), load_group)
    if problem:
        raise ValueError(problem)
    out: list[int] = []
    for i in range(0, len(shards), load_group):
        out += [max(shards[i : i + load_group])] * load_group
    return tuple(out)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def _check_alignment(alignment_bytes: int) -> None:
    if alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
        raise ValueError(f"alignment_bytes must be a power of two, got {alignment_bytes}")
    if alignment_bytes < 8:
        raise ValueError(f"alignment_bytes must be >= 8 (the largest itemsize), got {alignment_bytes}")


@dataclass(frozen=True, slots=True)
class TensorPlacement:
    """Where one tensor lives inside its block's flat buffer."""

    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    offset_bytes: int
    nbytes: int
    residue_bytes: int = 0  # offset_bytes = residue_bytes (mod KERNEL_ALIGNMENT_BYTES); see the module docstring

    def __post_init__(self) -> None:
        if self.offset_bytes % self.dtype.itemsize:
            raise ValueError(f"{self.name}: offset {self.offset_bytes} not a multiple of itemsize")

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.nbytes


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """All tensors of one block packed into ``nbytes`` bytes (the last tensor's end; no tail padding)."""

    name: str
    placements: tuple[TensorPlacement, ...]
    nbytes: int
    alignment_bytes: int

    def __post_init__(self) -> None:
        _check_alignment(self.alignment_bytes)
        end = 0
        for p in self.placements:
            step = self.alignment_bytes if not p.residue_bytes else max(self.alignment_bytes, KERNEL_ALIGNMENT_BYTES)
            if p.offset_bytes < end or (p.offset_bytes - p.residue_bytes) % step:
                raise ValueError(f"block {self.name}: tensor {p.name} overlaps or is misaligned")
            end = p.end_bytes
        if end != self.nbytes:
            raise ValueError(f"block {self.name}: nbytes {self.nbytes} != end of last tensor {end}")

    def placement(self, name: str) -> TensorPlacement:
        for p in self.placements:
            if p.name == name:
                return p
        raise KeyError(f"block {self.name} has no tensor {name!r}")


def block_layout(block: BlockSpec, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> BlockLayout:
    """Pack ``block``'s tensors in order, each at the next multiple of ``alignment_bytes`` (plus its residue, when
    it has one: see the module docstring)."""
    _check_alignment(alignment_bytes)
    if block.nbytes == 0:
        raise ValueError(
            f"block {block.name!r} stores no bytes: nothing to offload; leave it out of the block list "
            f"or keep it resident"
        )
    placements, offset = [], 0
    for t in block.tensors:
        r = t.residue_bytes
        offset = (
            r + align_up(offset - r, max(alignment_bytes, KERNEL_ALIGNMENT_BYTES))
            if r
            else align_up(offset, alignment_bytes)
        )
        placements.append(TensorPlacement(t.name, t.shape, _contiguous_stride(t.shape), t.dtype, offset, t.nbytes, r))
        offset += t.nbytes
    return BlockLayout(block.name, tuple(placements), offset, alignment_bytes)


@dataclass(frozen=True, slots=True)
class Piece:
    """Copy ``tensor``'s bytes ``[src_start, src_stop)`` into the rank's shard at ``[dst_start, dst_stop)``;
    ``block`` is the tensor's block where it is not the shard's own (a grouped layout; None: the shard's block)."""

    tensor: str
    src_start: int
    src_stop: int
    dst_start: int
    dst_stop: int
    block: int | None = None

    def __post_init__(self) -> None:
        if not (
            0 <= self.src_start < self.src_stop and self.src_stop - self.src_start == self.dst_stop - self.dst_start
        ):
            raise ValueError(f"bad piece {self}")

    @property
    def nbytes(self) -> int:
        return self.src_stop - self.src_start


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """A block cut into ``num_shards`` equal shards of ``shard_bytes``; ``pieces[r]`` fills rank r's shard.

    In a grouped layout (``group_size > 1``) the block is member ``member`` of a group of ``group_size`` blocks
    and ``pieces[r]`` fill rank ``r``'s ``member``-th piece of its chunk of the group (module docstring)."""

    block: BlockLayout
    num_shards: int
    shard_bytes: int
    pieces: tuple[tuple[Piece, ...], ...]
    group_size: int = 1
    member: int = 0

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if len(self.pieces) != self.num_shards:
            raise ValueError("one piece list per rank is required")
        if self.padded_bytes < self.block.nbytes or self.shard_bytes % self.block.alignment_bytes:
            raise ValueError(f"shard_bytes {self.shard_bytes} does not cover block {self.block.name}")

    @property
    def padded_bytes(self) -> int:
        """The block padded to ``W`` equal shards: what a slot holds after the all-gather."""
        return self.num_shards * self.shard_bytes

    @property
    def padding_bytes(self) -> int:
        return self.padded_bytes - self.block.nbytes

    def rank_range(self, rank: int) -> tuple[int, int]:
        """Bytes of the padded block that ``rank``'s shard holds; in a grouped layout, bytes of the group's
        concatenation (blocks at a stride of ``padded_bytes``) that its piece holds."""
        if not 0 <= rank < self.num_shards:
            raise ValueError(f"rank {rank} outside [0, {self.num_shards})")
        start = (rank * self.group_size + self.member) * self.shard_bytes
        return start, start + self.shard_bytes

    def table(self) -> str:
        """The rank | range | tensors table of the module docstring, for this block."""
        lines = ["rank  range                 tensors"]
        for r in range(self.num_shards):
            a, b = self.rank_range(r)
            parts = "; ".join(
                f"{'' if p.block is None else f'b{p.block}.'}{p.tensor}[{p.src_start}:{p.src_stop}] -> "
                f"[{p.dst_start}:{p.dst_stop}]"
                for p in self.pieces[r]
            )
            lines.append(f"{r:<5} [{a}, {b})".ljust(28) + (parts or "(padding only)"))
        return "\n".join(lines)


def _range_pieces(
    blocks: tuple[BlockLayout, ...], stride: int, lo: int, hi: int, first: int | None
) -> tuple[Piece, ...]:
    """The tensor bytes of ``blocks`` laid end to end at ``stride`` that fall in ``[lo, hi)``, as pieces of a
    shard starting at ``lo``; ``first``: the index of ``blocks[0]``, named in each piece (None: one block, its
    own shard)."""
    out = []
    for g, layout in enumerate(blocks):
        base = g * stride
        for p in layout.placements:
            start, stop = max(lo, base + p.offset_bytes), min(hi, base + p.end_bytes)
            if start < stop:
                out.append(
                    Piece(
                        p.name,
                        start - base - p.offset_bytes,
                        stop - base - p.offset_bytes,
                        start - lo,
                        stop - lo,
                        None if first is None else first + g,
                    )
                )
    return tuple(out)


def shard_layout(layout: BlockLayout, num_shards: int) -> ShardLayout:
    """Cut ``layout`` into ``num_shards`` equal, aligned shards (see the module docstring)."""
    shard = equal_shard_bytes(layout.nbytes, num_shards, layout.alignment_bytes)
    pieces = tuple(_range_pieces((layout,), 0, r * shard, (r + 1) * shard, None) for r in range(num_shards))
    return ShardLayout(layout, num_shards, shard, pieces)


def grouped_shard_layouts(group: tuple[BlockLayout, ...], num_shards: int, first: int) -> tuple[ShardLayout, ...]:
    """The shard layouts of one load group's blocks (``first`` the index of its first block) for one all-gather
    per group (see "Grouped shard layout" in the module docstring)."""
    q, n = max(equal_shard_bytes(b.nbytes, num_shards, b.alignment_bytes) for b in group), len(group)
    # rank r's g-th piece of its chunk: bytes [(r G + g) q, +q) of the blocks laid end to end at W q
    return tuple(
        ShardLayout(
            b,
            num_shards,
            q,
            tuple(
                _range_pieces(group, num_shards * q, (r * n + g) * q, (r * n + g + 1) * q, first)
                for r in range(num_shards)
            ),
            n,
            g,
        )
        for g, b in enumerate(group)
    )


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """Shard layouts of every block of a model for one shard group of ``num_shards`` ranks. ``num_shards == 1``
    is the rank-local layout (whole blocks)."""

    name: str
    shards: tuple[ShardLayout, ...]
    num_shards: int
    alignment_bytes: int
    load_group: int = 1  # > 1: the grouped layout (one all-gather per group of this many blocks)
    # Quantised shards (dlo_fn.plan.quant): ``shards`` lay out the stored blocks (FP8 and scales: the host arena,
    # the H2D, the all-gather) and ``compute`` each block as its slot holds it; empty: a block is stored as computed.
    compute: tuple[BlockLayout, ...] = ()

    def __post_init__(self) -> None:
        if any(s.num_shards != self.num_shards for s in self.shards):
            raise ValueError("every block must be sharded over the same num_shards")
        if self.compute and (len(self.compute) != len(self.shards) or self.load_group != 1):
            raise ValueError(
                f"model {self.name!r}: quantised shards move one block per load (load_group = 1), "
                "with one compute layout per block"
            )
        if any(s.group_size != self.load_group or s.member != b % self.load_group for b, s in enumerate(self.shards)):
            raise ValueError(f"every block must be member b % {self.load_group} of a group of {self.load_group}")

    @property
    def num_blocks(self) -> int:
        return len(self.shards)

    @property
    def quantized(self) -> bool:
        return bool(self.compute)

    def compute_block(self, b: int) -> BlockLayout:
        """Block ``b`` as its slot holds it (the stored block unless quantised)."""
        return self.compute[b] if self.compute else self.shards[b].block

    @property
    def max_padded_block_bytes(self) -> int:
        """The largest block padded to ``W`` equal shards (gathered): the slot size, or with quantised shards the
        staging buffer's."""
        return max(s.padded_bytes for s in self.shards)

    @property
    def slot_bytes(self) -> int:
        """Slot size: the largest gathered block, or with quantised shards the largest compute block."""
        return max(c.nbytes for c in self.compute) if self.compute else self.max_padded_block_bytes

    @property
    def max_shard_bytes(self) -> int:
        """Landing-buffer size: the largest local shard."""
        return max(s.shard_bytes for s in self.shards)

    @property
    def shard_bytes_per_rank(self) -> int:
        """Host bytes of one rank's shards (every rank holds the same amount)."""
        return sum(s.shard_bytes for s in self.shards)

    @property
    def total_block_bytes(self) -> int:
        return sum(s.block.nbytes for s in self.shards)

    @property
    def shard_offsets(self) -> tuple[int, ...]:
        """Offset of each block's local shard in a rank's packed host arena."""
        offsets, acc = [], 0
        for s in self.shards:
            offsets.append(acc)
            acc += s.shard_bytes
        return tuple(offsets)

    @property
    def digest(self) -> str:
        """SHA-256 of everything that must agree across ranks (names, shapes, dtypes, offsets, sizes)."""
        doc: dict = {
            "world_size": self.num_shards,  # the digest's original key: renaming it would change every digest
            "alignment_bytes": self.alignment_bytes,
            "blocks": [
                [
                    s.block.name,
                    s.block.nbytes,
                    s.shard_bytes,
                    [[p.name, list(p.shape), str(p.dtype), p.offset_bytes] for p in s.block.placements],
                ]
                for s in self.shards
            ],
        }
        if self.load_group > 1:  # only then: the per-block layouts keep their digests
            doc["load_group"] = self.load_group
        if self.compute:
            doc["compute"] = [
                [[p.name, list(p.shape), str(p.dtype), p.offset_bytes] for p in c.placements] for c in self.compute
            ]
        return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()


def cut_layout(layout: ModelLayout, keep) -> ModelLayout:
    """The layout of blocks ``keep`` (indices, in order) alone: the same as laying them out afresh wherever blocks
    are laid out one by one (load group 1)."""
    return replace(
        layout,
        shards=tuple(layout.shards[b] for b in keep),
        compute=tuple(layout.compute[b] for b in keep) if layout.compute else (),
    )


def model_layout(
    spec: ModelSpec,
    num_shards: int,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    load_group: int = 1,
    quantization: str | Quantization | None = None,
    exclude: tuple[str, ...] = (),
) -> ModelLayout:
    """Flat layout of every block of ``spec``, sharded over ``num_shards`` ranks; ``load_group > 1`` (it must
    divide the number of blocks): the grouped layout, one all-gather per group of that many blocks.
    ``quantization="fp8"`` (or a :class:`~dlo_fn.plan.quant.Quantization`): the shards lay out the stored blocks
    and ``compute`` the blocks of ``spec`` (:mod:`dlo_fn.plan.quant`; ``exclude``: modules kept as they are)."""
    if check_quantization(quantization) is not None:  # ModelLayout refuses load groups
        stored = tuple(block_layout(stored_block(b, exclude), alignment_bytes) for b in spec.blocks)
        return ModelLayout(
            spec.name,
            tuple(shard_layout(b, num_shards) for b in stored),
            num_shards,
            alignment_bytes,
            load_group,
            tuple(block_layout(b, alignment_bytes) for b in spec.blocks),
        )
    blocks = tuple(block_layout(b, alignment_bytes) for b in spec.blocks)
    if load_group == 1:
        return ModelLayout(spec.name, tuple(shard_layout(b, num_shards) for b in blocks), num_shards, alignment_bytes)
    problem = grouped_layout_problem(len(blocks), load_group)
    if problem:
        raise ValueError(f"model {spec.name!r}: {problem}; build the per-block layout (load_group=1)")
    shards = tuple(
        s
        for i in range(0, len(blocks), load_group)
        for s in grouped_shard_layouts(blocks[i : i + load_group], num_shards, i)
    )
    return ModelLayout(spec.name, shards, num_shards, alignment_bytes, load_group)
