"""The (dp, sp) mesh as a plan: who runs which request, holds which tokens and heads, and shards which weights.

Ranks fill the mesh row-major (torch's ``init_device_mesh``, :mod:`dlo_fn.runtime.mesh`): rank
``r = d * sp + s`` has coordinate ``(d, s)``. The ``sp`` ranks of one DP replica ``d`` run one request together
(Ulysses: rank ``s`` holds tokens ``[s l, (s + 1) l)``, ``l = ceil(L / sp)``, and attends with heads
``[s H / sp, (s + 1) H / sp)``); the ``dp`` replicas run different requests.

**Shard groups.** Every rank passes over the blocks in the same order, so the weights may be sharded over any
set of ranks that runs in lockstep:

==============  =========================================  ==================  ==========================
shard group     groups (ranks sharing one set of shards)   ``W = num_shards``  this rank's shard index
==============  =========================================  ==================  ==========================
``world``       one: every rank                            ``dp * sp``         ``r``
``dp``          one per sp index ``s``: ``{d * sp + s}``   ``dp``              ``d``
``sp``          one per replica ``d``: ``{d * sp + s}``    ``sp``              ``s``
==============  =========================================  ==================  ==========================

``dp`` is the reference's choice (SP partners hold identical shards); ``world`` is the default. Rank ``r``
holds, of block ``b``, bytes ``[i s_b, (i + 1) s_b)`` of the padded flat block, ``i`` its shard index and
``s_b = align_up(ceil(n_b / W), A)``: pinned host bytes per rank ``sum_b s_b``, which for ``world`` is ``M / (dp
sp)`` rounded up to the alignment per block. Example, ``dp = 2, sp = 2``::

    rank  (d, s)  tokens of L=10   heads of H=4   world: shard i / W   dp: i / W   sp: i / W
    0     (0, 0)  [0, 5)           [0, 2)         0 / 4                0 / 2       0 / 2
    1     (0, 1)  [5, 10)          [2, 4)         1 / 4                0 / 2       1 / 2
    2     (1, 0)  [0, 5)           [0, 2)         2 / 4                1 / 2       0 / 2
    3     (1, 1)  [5, 10)          [2, 4)         3 / 4                1 / 2       1 / 2
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo_fn.plan.layout import DEFAULT_ALIGNMENT_BYTES, ModelLayout
from dlo_fn.plan.sizes import ModelSizes

__all__ = ["SHARD_GROUPS", "DEFAULT_SHARD_GROUP", "MeshPlan", "RankPlan", "rank_shard_ranges"]

SHARD_GROUPS = ("world", "dp", "sp")
DEFAULT_SHARD_GROUP = "world"


def _check_size(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive int")


@dataclass(frozen=True, slots=True)
class RankPlan:
    """One row of the rank table: a rank's coordinate, tokens, heads and shard."""

    rank: int
    dp_rank: int
    sp_rank: int
    token_range: tuple[int, int]  # real tokens [start, stop) of its replica's sequence (stop may equal start)
    pad_tokens: int  # zero rows it carries past the end of the sequence
    head_range: tuple[int, int]
    shard_group: tuple[int, ...]  # the ranks that gather each block together
    shard_index: int
    num_shards: int
    pinned_bytes: int


@dataclass(frozen=True, slots=True)
class MeshPlan:
    """A ``dp x sp`` mesh and the shard group of its weights (module docstring)."""

    dp: int
    sp: int
    shard_group: str = DEFAULT_SHARD_GROUP

    def __post_init__(self) -> None:
        _check_size("dp", self.dp)
        _check_size("sp", self.sp)
        if self.shard_group not in SHARD_GROUPS:
            raise ValueError(f"shard_group={self.shard_group!r}: use one of {', '.join(SHARD_GROUPS)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.sp

    @property
    def num_shards(self) -> int:
        """``W``: ranks that each hold one shard of every block."""
        return {"world": self.world_size, "dp": self.dp, "sp": self.sp}[self.shard_group]

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} outside the mesh of {self.world_size} ranks (dp {self.dp} x sp {self.sp})")

    def coordinate(self, rank: int) -> tuple[int, int]:
        """``(d, s) = divmod(r, sp)`` (row-major, as ``init_device_mesh``)."""
        self._check_rank(rank)
        return divmod(rank, self.sp)

    def rank_of(self, dp_rank: int, sp_rank: int) -> int:
        if not (0 <= dp_rank < self.dp and 0 <= sp_rank < self.sp):
            raise ValueError(f"coordinate ({dp_rank}, {sp_rank}) outside the mesh (dp {self.dp}, sp {self.sp})")
        return dp_rank * self.sp + sp_rank

    @property
    def sp_groups(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each DP replica (they run one request together)."""
        return tuple(tuple(self.rank_of(d, s) for s in range(self.sp)) for d in range(self.dp))

    @property
    def dp_groups(self) -> tuple[tuple[int, ...], ...]:
        """The ranks with the same sp index, one per replica."""
        return tuple(tuple(self.rank_of(d, s) for d in range(self.dp)) for s in range(self.sp))

    @property
    def shard_groups(self) -> tuple[tuple[int, ...], ...]:
        """The shard groups, each in shard-index order."""
        if self.shard_group == "world":
            return (tuple(range(self.world_size)),)
        return self.dp_groups if self.shard_group == "dp" else self.sp_groups

    def shard_group_of(self, rank: int) -> tuple[int, ...]:
        d, s = self.coordinate(rank)
        if self.shard_group == "world":
            return self.shard_groups[0]
        return self.shard_groups[s if self.shard_group == "dp" else d]

    def shard_index(self, rank: int) -> int:
        """This rank's position in its shard group: which shard of every block it holds."""
        return self.shard_group_of(rank).index(rank)

    def local_tokens(self, num_tokens: int) -> int:
        """``l = ceil(L / sp)`` (what :class:`dlo_fn.models.sp.TokenShard` computes)."""
        _check_size("num_tokens", num_tokens)
        return -(-num_tokens // self.sp)

    def token_range(self, rank: int, num_tokens: int) -> tuple[int, int]:
        """Real tokens ``[min(s l, L), min((s + 1) l, L))`` of the replica's sequence that this rank holds."""
        _, s = self.coordinate(rank)
        loc = self.local_tokens(num_tokens)
        return min(s * loc, num_tokens), min((s + 1) * loc, num_tokens)

    def head_range(self, rank: int, num_heads: int) -> tuple[int, int]:
        """Heads ``[s H / sp, (s + 1) H / sp)`` this rank attends with; ``ValueError`` unless sp divides H."""
        _check_size("num_heads", num_heads)
        if num_heads % self.sp:
            raise ValueError(
                f"num_heads {num_heads} is not divisible by sp {self.sp}: Ulysses SP gives each sp "
                f"rank num_heads / sp heads"
            )
        _, s = self.coordinate(rank)
        per = num_heads // self.sp
        return s * per, (s + 1) * per

    def pinned_bytes_per_rank(self, sizes: ModelSizes, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> int:
        """``sum_b align_up(ceil(n_b / W), A)``: the same on every rank."""
        return sizes.shard_bytes_per_rank(self.num_shards, alignment_bytes)

    def rank_table(
        self, sizes: ModelSizes, num_tokens: int, num_heads: int, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES
    ) -> tuple[RankPlan, ...]:
        """One :class:`RankPlan` per rank (the module docstring's example table)."""
        pinned = self.pinned_bytes_per_rank(sizes, alignment_bytes)
        rows = []
        for r in range(self.world_size):
            d, s = self.coordinate(r)
            lo, hi = self.token_range(r, num_tokens)
            rows.append(
                RankPlan(
                    r,
                    d,
                    s,
                    (lo, hi),
                    self.local_tokens(num_tokens) - (hi - lo),
                    self.head_range(r, num_heads),
                    self.shard_group_of(r),
                    self.shard_index(r),
                    self.num_shards,
                    pinned,
                )
            )
        return tuple(rows)


def rank_shard_ranges(mesh: MeshPlan, layout: ModelLayout, rank: int) -> tuple[tuple[int, int], ...]:
    """Byte range ``[i s_b, (i + 1) s_b)`` of each padded flat block that ``rank`` holds (``i`` its shard
    index); ``layout`` must be sharded over the mesh's ``num_shards``."""
    if layout.num_shards != mesh.num_shards:
        raise ValueError(
            f"layout is sharded over {layout.num_shards} ranks, the mesh's {mesh.shard_group!r} shard "
            f"group has {mesh.num_shards}: build it with model_layout(spec, mesh.num_shards)"
        )
    i = mesh.shard_index(rank)
    return tuple(s.rank_range(i) for s in layout.shards)
