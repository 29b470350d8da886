"""The (dp, sp) device mesh: ``torch.distributed.device_mesh.init_device_mesh`` with axes named dp and sp.

Ranks fill the mesh row-major (torch's layout), so the sp partners of a DP replica are consecutive ranks (one
host's fast links carry the all-to-alls)::

    world 4, (dp, sp) = (2, 2)      rank   0  1  2  3          sp groups {0, 1} {2, 3}
                                    dp     0  0  1  1          dp groups {0, 2} {1, 3}
                                    sp     0  1  0  1

The sp ranks of one replica run one request together (Ulysses, :mod:`dlo_fn.models.sp`); the dp replicas run
different requests. Every rank still passes over the blocks in the same order, so the weight shard group can
stay the whole world. Group creation, coordinates and sub-groups are torch's: this module only checks the
sizes, names the axes and hands out what callers need.

**Shard groups** (:func:`shard_group`, ``OffloadOptions.shard_group``): which ranks split one block's weights
between them (each holds ceil(M / size) of the block bytes M, its rank in the group picks its piece)::

    name    members of rank (d, s)                       size      the (2, 2) mesh above
    world   every rank of the mesh                       dp x sp   {0, 1, 2, 3}
    dp      the ranks (., s): same sp index, every replica  dp     {0, 2} {1, 3}   (the reference's choice)
    sp      the ranks (d, .): the sp ranks of replica d     sp     {0, 1} {2, 3}

Every rank runs every block in the same order whatever the group, so any of them is a valid lockstep group;
"world" holds the least per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import init_device_mesh

from dlo_fn.runtime.dist import DistContext

__all__ = ["AXES", "SHARD_GROUPS", "Mesh", "ShardGroup", "build_mesh", "check_shard_group", "shard_group"]

AXES = ("dp", "sp")
SHARD_GROUPS = ("world", "dp", "sp")


@dataclass(frozen=True, slots=True)
class Mesh:
    """This rank's view of the mesh. ``device_mesh`` and the groups are None for a single process without a
    process group (dp = sp = 1)."""

    device_mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    dp_size: int
    sp_size: int
    dp_rank: int
    sp_rank: int
    dp_group: Any
    sp_group: Any

    @property
    def coordinate(self) -> tuple[int, int]:
        """(dp_rank, sp_rank)."""
        return (self.dp_rank, self.sp_rank)

    @property
    def replica_ranks(self) -> tuple[tuple[int, ...], ...]:
        """The global ranks of each replica, in sp order: row d of the mesh (``((0,),)`` without groups)."""
        if self.device_mesh is None:
            return ((0,),)
        return tuple(tuple(int(r) for r in row) for row in self.device_mesh.mesh.tolist())


def build_mesh(ctx: DistContext, sp: int = 1, dp: int | None = None) -> Mesh:
    """The (dp, sp) mesh over every rank of ``ctx`` (dp defaults to world / sp). Every rank must call it with
    the same sizes (it creates process groups, a collective); ``ValueError`` for sizes that do not fit."""
    world = ctx.world_size
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        raise ValueError(f"sp={sp!r}: must be a positive int")
    if world % sp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"sp={sp} does not divide the world size {world}: use sp in {divisors} (dp = world / sp)")
    if dp is None:
        dp = world // sp
    if dp * sp != world:
        raise ValueError(f"dp={dp} x sp={sp} = {dp * sp} ranks, but the world has {world}: use dp = {world // sp}")
    if ctx.group is None:  # a plain single process: nothing to split, no group to build
        return Mesh(None, 1, 1, 0, 0, None, None)
    device_mesh = init_device_mesh(ctx.platform.device.type, (dp, sp), mesh_dim_names=AXES)
    dp_rank, sp_rank = device_mesh.get_coordinate()
    return Mesh(device_mesh, dp, sp, dp_rank, sp_rank, device_mesh.get_group("dp"), device_mesh.get_group("sp"))


@dataclass(frozen=True, slots=True)
class ShardGroup:
    """The ranks that split each block's weights: ``group`` (None when ``size`` is 1: nothing to gather),
    ``size`` (the layout's num_shards) and this rank's ``rank`` in it (which shard it holds)."""

    name: str
    group: Any
    size: int
    rank: int


def check_shard_group(name: str) -> str:
    if name not in SHARD_GROUPS:
        raise ValueError(f"shard_group={name!r}: must be one of {', '.join(SHARD_GROUPS)} (see dlo_fn.runtime.mesh)")
    return name


def shard_group(ctx: DistContext, mesh: Mesh | None, name: str = "world") -> ShardGroup:
    """This rank's shard group ``name`` (module docstring) on ``mesh``; no mesh means (dp, sp) = (world, 1)."""
    check_shard_group(name)
    if name == "world" or (mesh is None and name == "dp"):
        return ShardGroup(name, ctx.group if ctx.world_size > 1 else None, ctx.world_size, ctx.rank)
    if mesh is None:  # "sp" of a (world, 1) mesh: every rank alone
        return ShardGroup(name, None, 1, 0)
    if mesh.dp_size * mesh.sp_size != ctx.world_size:
        raise ValueError(f"a ({mesh.dp_size}, {mesh.sp_size}) mesh does not cover the world of {ctx.world_size}")
    size, rank, group = (
        (mesh.dp_size, mesh.dp_rank, mesh.dp_group) if name == "dp" else (mesh.sp_size, mesh.sp_rank, mesh.sp_group)
    )
    return ShardGroup(name, group if size > 1 else None, size, rank)
