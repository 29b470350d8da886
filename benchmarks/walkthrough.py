"""One rank's pass through the runtime, returned as plain data: what notebook 03 shows from each of its ranks
(local ranks, :mod:`dlo_fn.serve.ranks`, run it; it sits above the runtime core, whose modules it only reads).

:func:`offload_and_run` is the function :func:`dlo_fn.serve.ranks.run_ranks` runs on every rank (it must be
importable, and what it returns picklable): for each mode it maps the checkpoint (:func:`~dlo_fn.io.load.
load_model`: meta init, every weight a zero-copy view of the file), offloads the model
(:func:`~dlo_fn.runtime.offload.offload`, recording a Timeline), runs this rank's request in one explicit run, and
returns a :class:`RankRun`: the device buffers the executor allocated, the host store it filled, the schedule the
run followed, the measured Timeline of it and the output. Nothing here decides anything; it only reads what the
runtime built, so the notebook can set it beside the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dlo_fn.plan.schedule import Schedule
from dlo_fn.plan.timeline import Timeline

__all__ = ["RankRun", "offload_and_run"]


@dataclass(frozen=True, slots=True)
class RankRun:
    """What one rank built and ran in one mode (bytes as the runtime measured them)."""

    mode: str
    rank: int
    num_shards: int  # W: the ranks each block is sharded over (1 in rank-local mode)
    files: tuple[str, ...]  # the checkpoint files whose mappings backed the model after load_model (base names)
    slot_bytes: tuple[int, ...]  # one entry per slot: its size (the largest padded block)
    landing_bytes: tuple[int, ...]  # one entry per landing buffer: its size (the largest shard)
    device_weight_bytes: int  # the slots' and landing buffers' storages
    planned_device_weight_bytes: int  # S x slot + L x landing, from the layout
    host_store_bytes: int  # this rank's arena of shards (or whole blocks in rank-local mode)
    host_store_pinned: bool  # False on CPU, which has no pinned memory
    schedule: Schedule  # the schedule the run followed
    measured: Timeline  # what the executor ran, with measured times (host clocks on CPU)
    plugin: str  # the executor's plug-in, from the Timeline's metadata ("none": the core alone)
    video: np.ndarray  # uint8 [N, F, H, W, 3]; numpy, since a tensor would cross to the parent by shared memory
    sha256: str


def offload_and_run(
    ctx: Any, checkpoint: str, prompts: Sequence[str], request: dict, modes: Sequence[str] = ("allgather", "rank-local")
) -> list[RankRun]:
    """On rank ``ctx.rank``: per mode, load ``checkpoint`` (mmap), offload its blocks over the world and run the
    request ``Request(prompts[rank], seed=rank, **request)`` in one run of its steps; see the module doc."""
    import pathlib

    from dlo_fn.io.load import load_model
    from dlo_fn.io.release import viewed_files
    from dlo_fn.models import BLOCK_PATHS, Request, generate
    from dlo_fn.plan.compare import single_run
    from dlo_fn.runtime.offload import offload

    req = Request(prompts[ctx.rank], seed=ctx.rank, **request)
    runs = []
    for mode in modes:
        model = load_model(checkpoint)
        files = tuple(sorted(pathlib.Path(f).name for f in viewed_files(model)))
        off = offload(model, BLOCK_PATHS, ctx, mode=mode, record_timeline=True)
        ex, store = off.executor, off.store
        with off.run(num_steps=req.num_inference_steps) as schedule:
            result = generate(off.model, req)
        measured = single_run(ex.take_timeline(), 0)
        runs.append(
            RankRun(
                mode=mode,
                rank=ctx.rank,
                num_shards=off.layout.num_shards,
                files=files,
                slot_bytes=tuple(s.numel() for s in ex.slots),
                landing_bytes=tuple(t.numel() for t in ex.landing),
                device_weight_bytes=ex.device_weight_bytes,
                planned_device_weight_bytes=ex.planned_device_weight_bytes,
                host_store_bytes=store.arena_bytes,
                host_store_pinned=store.pinned,
                schedule=schedule,
                measured=measured,
                plugin=dict(measured.meta).get("plugin", "none"),
                video=result.video.numpy(),
                sha256=result.sha256,
            )
        )
        ex.release()
    return runs
