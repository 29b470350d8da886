"""What an :class:`~dlo_fn.serve.engine.Engine` is made of on one rank, built once when it is constructed.

:func:`build_parts` checks what the engine was given before any message (the mode; the mesh's replicas, which must
cover the ranks with rank 0 leading one; the model's heads against ``sp``), opens the control channel and the status
board (:mod:`dlo_fn.serve.wire`) and wires the collaborators to them: the :class:`~dlo_fn.serve.driver.Driver` (rank
0's waves), the :class:`~dlo_fn.serve.follower.Follower` (the other ranks) and, for continuous serving, rank 0's
:class:`~dlo_fn.serve.continuous.ContinuousDriver` with the checkpoint its survivors reload from
(:mod:`dlo_fn.serve.recover`); and it measures what this rank's memory has left for requests and posts it for rank
0's admission (:mod:`dlo_fn.serve.memory_room`). The engine keeps what lives across serves (wave numbering, the stop
state) and handles the requests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch import nn

from dlo_fn.models.sp import check_sp_heads, sp_of
from dlo_fn.plan.modes import MODES, check_mode
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.mesh import Mesh
from dlo_fn.runtime.offload import Offloaded
from dlo_fn.serve.admission import MemoryAdmission
from dlo_fn.serve.continuous import ContinuousDriver, ContinuousRank
from dlo_fn.serve.driver import Driver
from dlo_fn.serve.follower import Follower
from dlo_fn.serve.memory_room import Room, gather_rooms, measure_room, post_room, rank_shares
from dlo_fn.serve.recover import Reload, reloader
from dlo_fn.serve.requests import EngineOptions
from dlo_fn.serve.share import ProtocolEnd, ShareRunner
from dlo_fn.serve.wire import Channel, StatusBoard, default_store

__all__ = ["EngineParts", "build_parts", "replicas_of", "memory_admission", "executor_stats"]


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
    room: Room  # this rank's free memory once offloaded (posted for rank 0's admission)


def build_parts(
    model: nn.Module,
    offloaded: Offloaded,
    ctx: DistContext,
    options: EngineOptions,
    *,
    session: str,
    mesh: Mesh | None,
    checkpoint: str | os.PathLike | Reload | None,
) -> EngineParts:
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
    runner = ShareRunner(model, offloaded, rank, board, options.fault, sp=sp_of(mesh) if mesh is not None else None)
    end = ProtocolEnd(channel, board, runner, options)
    driver = Driver(end, mode=mode, world_size=world_size, lockstep=lockstep, replicas=replicas)
    follower = Follower(end, rank=rank, replica=replica, leader=rank == replicas[replica][0])
    # Continuous serving (dlo_fn.serve.continuous): lockstep ranks (replicas of sp ranks on a mesh), or one
    # rank in any mode. No recovery on an sp mesh (a lost rank breaks its replica's SP group).
    continuous = options.serving == "continuous" and (lockstep or world_size == 1)
    if options.fault is not None:
        options.fault.check_serving(continuous)  # on every rank, before any message
    reload = reloader(checkpoint) if continuous and sp_size == 1 else None
    follower.reload = reload
    own = ContinuousRank(model, offloaded, rank, options.fault, runner.sp)
    ring = (
        None
        if not continuous or rank
        else ContinuousDriver(
            channel, board, own, options, world_size=world_size, config=config, reload=reload, replicas=replicas
        )
    )
    room = measure_room(rank, offloaded, ctx.platform.device)
    post_room(board.store, board.prefix, room)
    return EngineParts(
        mode, replicas, replica, config, lockstep, continuous, channel, board, driver, follower, ring, room
    )


def replicas_of(mesh: Mesh | None, world_size: int) -> tuple[tuple[int, ...], ...]:
    """Global ranks of each replica (sp order); without a mesh every rank is a replica of one."""
    if mesh is None or mesh.device_mesh is None:
        return tuple((r,) for r in range(world_size))
    replicas = mesh.replica_ranks
    if sum(len(r) for r in replicas) != world_size or replicas[0][0] != 0:
        raise ValueError(f"the mesh's replicas {replicas} must cover the {world_size} ranks, rank 0 leading one")
    return replicas


def memory_admission(
    model: nn.Module, board: StatusBoard, room: Room, options: EngineOptions, world_size: int, sp_size: int
) -> MemoryAdmission | None:
    """Rank 0's admission against memory over every rank's posted room; None for a model without a DiT config
    to size (its requests are checked by validation alone)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "patch_size"):
        return None
    rooms = gather_rooms(board.store, board.prefix, world_size, room, options.timeout_s)
    itemsize = next((p.dtype.itemsize for p in model.parameters() if p.dtype.is_floating_point), 2)
    return MemoryAdmission(
        config,
        itemsize,
        rank_shares(rooms),
        requests_per_rank=options.requests_per_rank,
        sp=sp_size,
        cap_bytes=options.memory_budget_bytes,
    )


def executor_stats(offloaded: Offloaded) -> dict[str, float]:
    """The executor's counters so far: block computes, loads, host issue and block-call seconds."""
    ex = offloaded.executor
    if ex is None:
        return {}
    st = ex.stats
    return {
        "computes": float(st.computes),
        "loads": float(st.loads),
        "runs": float(st.runs),
        "issue_s": st.issue_s,
        "call_s": st.call_s,
    }
