"""Continuous serving goes on without a follower that stalled or died: the survivors agree on a degraded plan
through the store, rebuild as rank-local replicas and resume their requests (see :mod:`dlo_fn.serve.continuous`).

**Why rank-local, not a re-shard over the W - 1 survivors.** The dead rank took its weight shards with it, and
the all-gather group cannot be rebuilt from the old one (its pairs with the culprit are closed, and a stalled
culprit could wake up inside it). Re-sharding would need every survivor to read a new ``1/(W-1)`` of every
block and a new gather group, and one more death would mean doing it again. Instead every survivor streams
whole blocks from the checkpoint mapping (the file is on every host; :mod:`dlo_fn.runtime.host_store`'s
``"mmap"`` source: no copy, one shared page cache per host, pageable H2D): each becomes an independent
rank-local replica, whose step needs no collective at all, and a second failure costs only that rank's
requests. Device memory is the same slots without the landing buffers, so the rebuilt executor fits where
the old one was. What it costs: host H2D from pageable memory (a fraction of the pinned rate:
``docs/performance.md``), so a degraded replica runs slower where the loads were hidden behind compute only just.

**Agreement** (keys under the status board's prefix, in the process group's store: a FileStore, a TCPStore
hosted by rank 0, or torchrun's agent store; all outlive a follower):

1. rank 0, after a failed ring step ``k`` and the board's verdict, rebuilds its own replica and posts
   ``recover/<e>/plan`` (:class:`RecoveryPlan`: the survivors, rank 0 first; none when it cannot recover);
2. every follower whose step or message failed waits (bounded) for that plan; one not in it stops following;
   a survivor rebuilds its replica and posts ``recover/<e>/here/<rank>``;
3. when every survivor is there, they build a fresh gloo group on ``PrefixStore(recover/<e>/pg/)``
   (:class:`~dlo_fn.serve.wire.GroupChannel`) and each follower sends rank 0 its report: the requests it holds
   with the steps they completed, and the outcomes of step ``k`` if its step ``k`` completed.

Rank 0's own death is out of scope: it is the client's process (its queue, its results); the followers then
give up after their bound.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

from torch import nn

from dlo_fn.plan.layout import model_layout
from dlo_fn.runtime.blocks import BlockProxy, block_state
from dlo_fn.runtime.executor import Executor
from dlo_fn.runtime.host_store import build_host_store
from dlo_fn.runtime.mesh import ShardGroup
from dlo_fn.runtime.offload import Offloaded
from dlo_fn.serve.wire import POLL_S, GroupChannel, StatusBoard

__all__ = ["RecoveryPlan", "Reload", "reloader", "post_plan", "wait_plan", "rank_local_replica", "rejoin"]

log = logging.getLogger(__name__)

Reload = Callable[[], nn.Module]
"""A zero-argument callable returning the model freshly loaded (meta + mmap) from the checkpoint."""


@dataclass(frozen=True, slots=True)
class RecoveryPlan:
    """What rank 0 decided after ring step ``step`` failed: ``survivors`` (global ranks, rank 0 first) go on
    as rank-local replicas; empty: no recovery, everyone stops (``reason`` says why)."""

    epoch: int
    step: int
    survivors: tuple[int, ...]
    reason: str


def reloader(source: str | os.PathLike | Reload | None) -> Reload | None:
    """A checkpoint path (loaded as :func:`dlo_fn.io.load.load_model` builds it from its config.json), a
    callable, or None (no recovery)."""
    if source is None or callable(source):
        return source
    path = os.fspath(source)

    def load() -> nn.Module:
        from dlo_fn.io.load import load_model

        return load_model(path, progress=False).eval()

    return load


def post_plan(board: StatusBoard, plan: RecoveryPlan) -> None:
    if board.store is not None:
        board.store.set(f"{board.prefix}recover/{plan.epoch}/plan", json.dumps(dataclasses.asdict(plan)))


def wait_plan(board: StatusBoard, epoch: int, bound_s: float) -> RecoveryPlan | None:
    """Rank 0's plan for recovery ``epoch``, or None when none came within ``bound_s`` or the store is gone (rank 0
    is gone: under torchrun without an agent store, rank 0 hosts the store, and its death resets the connection)."""
    if board.store is None:
        return None
    key = f"{board.prefix}recover/{epoch}/plan"
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            if board.store.check([key]):
                data = json.loads(board.store.get(key).decode())
                return RecoveryPlan(data["epoch"], data["step"], tuple(data["survivors"]), data["reason"])
        except RuntimeError as exc:  # torch's DistNetworkError / DistStoreError
            log.debug("recovery %d: the store is gone: %s: %s", epoch, type(exc).__name__, exc)
            return None
        time.sleep(POLL_S)
    return None


def rejoin(board: StatusBoard, plan: RecoveryPlan, rank: int, timeout_s: float, bound_s: float) -> GroupChannel:
    """Post ``here``, wait (bounded) until every survivor did, then build the survivors' gloo group; raises
    ``TimeoutError`` when one never came."""
    prefix = f"{board.prefix}recover/{plan.epoch}/"
    board.store.set(f"{prefix}here/{rank}", "1")
    keys = [f"{prefix}here/{r}" for r in plan.survivors]
    deadline = time.monotonic() + bound_s
    while not board.store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, k in zip(plan.survivors, keys) if not board.store.check([k])]
            raise TimeoutError(f"recovery {plan.epoch}: ranks {missing} did not rejoin within {bound_s:.0f} s")
        time.sleep(POLL_S)
    return GroupChannel.build(board.store, f"{prefix}pg/", plan.survivors.index(rank), len(plan.survivors), timeout_s)


def rank_local_replica(offloaded: Offloaded, reload: Reload) -> None:
    """In place: ``offloaded`` (allgather) becomes a rank-local replica streaming whole blocks from a fresh
    mapping of the checkpoint (the ``"mmap"`` source). In place, because the engine, its runners and the
    caller all hold this object; the block proxies are pointed at the new executor and the old one's slots,
    landing buffers and views are dropped first (the new slots take their device memory). Raises
    ``ValueError`` when the reloaded model does not match the layout (another checkpoint, another dtype)."""
    old = offloaded.executor
    if old is None or old.mode != "allgather":
        return  # resident or rank-local already: nothing shared was lost
    fresh = reload()
    layout = model_layout(offloaded.spec, 1, offloaded.options.alignment_bytes)  # same residues: same bits
    tensors = [block_state(fresh.get_submodule(b.name))[0] for b in offloaded.spec.blocks]
    store = build_host_store(layout, 0, tensors, offloaded.ctx.platform, source="mmap")
    del fresh, tensors  # the store holds the block views it streams from; the rest of the mapping goes
    blocks, aliases = old.blocks, old.aliases
    old.release()  # before the new slots are allocated: they take the old ones' device memory
    options = dataclasses.replace(
        offloaded.options, mode="rank-local", rank_local_source="mmap", graph=False, num_slots=old.num_slots
    )
    executor = Executor(offloaded.ctx.platform, layout, store, blocks, aliases, options, rank=old.rank)
    for module in offloaded.model.modules():
        if isinstance(module, BlockProxy) and module.block is blocks[module.block_index]:
            module.__dict__["_dlo_compute"] = executor.compute
    offloaded.options = options
    offloaded.layout, offloaded.store, offloaded.executor = layout, store, executor
    offloaded.shards = ShardGroup("none", None, 1, 0)
    log.warning(
        "rank %d: now a rank-local replica streaming %d blocks from the checkpoint mapping", old.rank, layout.num_blocks
    )
