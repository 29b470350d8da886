"""What an :class:`~dlo_fn.serve.engine.Engine` is made of on one rank, built once when it is constructed.

:func:`build_parts` checks what the engine was given before any message (the mode; the mesh's replicas, which
must cover the ranks with rank 0 leading one; the model's heads against ``sp``), opens the control channel and
the status board (:mod:`dlo_fn.serve.wire`) and wires the collaborators to them: the
:class:`~dlo_fn.serve.driver.Driver` (rank 0's waves), the :class:`~dlo_fn.serve.follower.Follower` (the other
ranks) and, for continuous serving, rank 0's :class:`~dlo_fn.serve.continuous.ContinuousDriver` with the
checkpoint its survivors reload from (:mod:`dlo_fn.serve.recover`). The engine keeps what lives across serves
(wave numbering, the stop state) and handles the requests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch import nn

from dlo_fn.models.sp import check_sp_heads
from dlo_fn.plan.modes import MODES, check_mode
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.mesh import Mesh
from dlo_fn.runtime.offload import Offloaded
from dlo_fn.serve.continuous import ContinuousDriver, ContinuousRank
from dlo_fn.serve.driver import Driver
from dlo_fn.serve.follower import Follower
from dlo_fn.serve.recover import Reload, reloader
from dlo_fn.serve.requests import EngineOptions
from dlo_fn.serve.share import ShareRunner
from dlo_fn.serve.wire import Channel, StatusBoard, default_store

__all__ = ["EngineParts", "build_parts", "replicas_of"]


@dataclass(frozen=True, slots=True)
class EngineParts:
    """One rank's engine: its ``mode``, the global ranks of each replica (``replicas``, sp order) and its own
    (``replica``), whether the ranks run in ``lockstep`` (allgather, W > 1) and serve ``continuous``ly, and the
    collaborators; ``ring`` is rank 0's continuous driver (None on the other ranks and in strict serving)."""

    mode: str
    replicas: tuple[tuple[int, ...], ...]
    replica: int
    config: Any
    lockstep: bool
    continuous: bool
    channel: Channel
    board: StatusBoard
    driver: Driver
    follower: Follower
    ring: ContinuousDriver | None


def build_parts(model: nn.Module, offloaded: Offloaded, ctx: DistContext, options: EngineOptions, *,
                session: str, mesh: Mesh | None,
                checkpoint: str | os.PathLike | Reload | None) -> EngineParts:
    """Check, connect and wire one rank's engine (see module doc); raises ``ValueError`` before any message
    when the mode, the mesh or the heads do not fit."""
    mode = check_mode(offloaded.mode, MODES, "engine mode")
    rank, world_size = ctx.rank, ctx.world_size
    replicas = replicas_of(mesh, world_size)
    sp_size = len(replicas[0])
    replica = next(d for d, ranks in enumerate(replicas) if rank in ranks)
    config = getattr(model, "config", None)
    if sp_size > 1 and getattr(config, "num_heads", None) is not None:
        check_sp_heads(config.num_heads, sp_size)  # on every rank, before any message
    lockstep = mode == "allgather" and world_size > 1
    channel = Channel(ctx.group, ctx.platform.backend, options.timeout_s)
    board = StatusBoard(default_store(), rank, world_size, session)
    runner = ShareRunner(model, offloaded, rank, board, options.fault, sp=mesh.sp if mesh is not None else None)
    driver = Driver(channel, board, runner, options, mode=mode, world_size=world_size, lockstep=lockstep,
                    replicas=replicas)
    follower = Follower(channel, board, runner, options, rank=rank, replica=replica,
                        leader=rank == replicas[replica][0])
    # Continuous serving (dlo_fn.serve.continuous): lockstep ranks (replicas of sp ranks on a mesh), or one
    # rank in any mode. No recovery on an sp mesh (a lost rank breaks its replica's SP group).
    continuous = options.serving == "continuous" and (lockstep or world_size == 1)
    if options.fault is not None:
        options.fault.check_serving(continuous)  # on every rank, before any message
    reload = reloader(checkpoint) if continuous and sp_size == 1 else None
    follower.reload = reload
    own = ContinuousRank(model, offloaded, rank, options.fault, runner.sp)
    ring = None if not continuous or rank else ContinuousDriver(
        channel, board, own, options, world_size=world_size, config=config, reload=reload, replicas=replicas)
    return EngineParts(mode, replicas, replica, config, lockstep, continuous, channel, board, driver, follower,
                       ring)


def replicas_of(mesh: Mesh | None, world_size: int) -> tuple[tuple[int, ...], ...]:
    """Global ranks of each replica (sp order); without a mesh every rank is a replica of one."""
    if mesh is None or mesh.device_mesh is None:
        return tuple((r,) for r in range(world_size))
    replicas = mesh.replica_ranks
    if sum(len(r) for r in replicas) != world_size or replicas[0][0] != 0:
        raise ValueError(f"the mesh's replicas {replicas} must cover the {world_size} ranks, rank 0 leading one")
    return replicas
