"""Serve requests on W local CPU ranks (gloo) that this call spawns: the demo's, the tests' and the bench's way in.

:func:`serve_local` starts W = dp x sp fresh processes (``spawn`` unless ``start_method`` says otherwise,
:func:`dlo_fn.serve.ranks.rank_context`; ``torch.set_num_threads(threads_per_rank)`` in each; with
``sp_size > 1`` they form a (dp, sp) mesh, :func:`dlo_fn.runtime.mesh.build_mesh`, and the sp ranks of each
replica run its requests together) joined by a ``file://`` rendezvous whose process-group timeout is the
engine's ``timeout_s``. Each rank runs one or more :class:`Phase` in order; per phase it maps the checkpoint
(mmap, zero-copy), wraps the model for the phase's mode (and shard group), builds an
:class:`~dlo_fn.serve.engine.Engine` and serves (rank 0) or follows. Rank 0 sends the reports back pickled;
then the followers get ``grace_s`` to exit and anything still running (a stalled rank) is killed. Every rank's
exit code is returned, so a test can see the rank that died.

Under ``torchrun`` each rank runs the same :class:`~dlo_fn.serve.engine.Engine` (see :mod:`dlo_fn.cli.generate`,
which wraps the model with the command line's offload options).
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dlo_fn.serve.requests import EngineOptions, ServeReport, Submission

__all__ = ["Phase", "LocalRun", "serve_local", "open_model", "thread_lock_for_bars"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Phase:
    """One engine run: ``mode`` (allgather / rank-local / resident), what to serve, how.
    ``forced``: caller-formed waves (indices into ``submissions``) for :meth:`Engine.serve_forced`;
    ``stream_gaps_s``: feed the submissions one by one to :meth:`Engine.serve_stream` with these pauses."""

    mode: str
    submissions: tuple[Submission, ...]
    options: EngineOptions = field(default_factory=EngineOptions)
    forced: tuple[tuple[int, ...], ...] | None = None
    stream_gaps_s: tuple[float, ...] | None = None  # serve as a stream: sleep gaps[i] before submission i
    shard_group: str = "world"  # allgather: which ranks split the block weights (dlo_fn.runtime.mesh)
    recovery: bool = True  # continuous: a lost rank's peers go on from the checkpoint (dlo_fn.serve.recover)


@dataclass(frozen=True, slots=True)
class LocalRun:
    """``reports[k]`` is phase k's report, or the text of the exception rank 0 raised (e.g. a rejected forced
    wave); ``exitcodes[r]`` is rank r's exit code (negative: killed by that signal; -9 = killed by us)."""

    reports: tuple[ServeReport | str, ...]
    exitcodes: tuple[int | None, ...]
    wall_s: float


def open_model(
    checkpoint: str | os.PathLike,
    ctx: Any,
    mode: str,
    *,
    record_timeline: bool = False,
    progress: bool = False,
    mesh: Any = None,
    shard_group: str = "world",
    quantization: str | None = None,
    hbm_budget: int | str | None = None,
) -> tuple[Any, Any]:
    """``(model, offloaded)``: the reference DiT mapped zero-copy from ``checkpoint`` and wrapped for ``mode``
    (its weights sharded over ``shard_group`` of ``mesh``; ``quantization="fp8"``: FP8 shards; ``hbm_budget``:
    the blocks that fit stay resident)."""
    from dlo_fn.io.load import load_model
    from dlo_fn.models import BLOCK_PATHS, build_model, load_config
    from dlo_fn.runtime.offload import offload

    config, dtype = load_config(checkpoint)
    model = load_model(checkpoint, lambda: build_model(config, "meta", dtype), progress=progress)
    model.eval()
    model.init_buffers("cpu")
    offloaded = offload(
        model,
        BLOCK_PATHS,
        ctx,
        mode=mode,
        record_timeline=record_timeline,
        mesh=mesh,
        shard_group=shard_group,
        quantization=quantization,
        hbm_budget=hbm_budget,
    )
    model.init_buffers(ctx.platform.device)
    return model, offloaded


def _reopen(checkpoint: str) -> Any:
    """The model as :func:`open_model` maps it, for a recovery's rank-local replica (dlo_fn.serve.recover)."""
    from dlo_fn.io.load import load_model
    from dlo_fn.models import build_model, load_config

    config, dtype = load_config(checkpoint)
    return load_model(checkpoint, lambda: build_model(config, "meta", dtype), progress=False).eval()


def _feed(submissions: Sequence[Submission], gaps_s: Sequence[float]) -> Any:
    """A queue that a thread fills with ``submissions``, sleeping ``gaps_s[i]`` before each, then ``None``."""
    import queue
    import threading

    source: queue.Queue = queue.Queue()

    def produce() -> None:
        for sub, gap in zip(submissions, gaps_s):
            time.sleep(gap)
            source.put(sub)
        source.put(None)

    threading.Thread(target=produce, daemon=True).start()
    return source


def thread_lock_for_bars() -> None:
    """Give tqdm a thread lock. Its default also takes a multiprocessing lock, a named semaphore that the
    resource tracker records; a rank leaves through ``os._exit`` (:func:`~dlo_fn.runtime.dist.exit_now`),
    which never unlinks it, so every run ended with "resource_tracker: There appear to be N leaked semaphore
    objects". No bar here is shared between processes, so a thread lock is all they need."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def _rank_main(
    rank: int,
    world: int,
    init_file: str,
    checkpoint: str,
    phases: Sequence[Phase],
    threads: int,
    out: Any,
    log_level: int,
    sp_size: int = 1,
) -> None:
    thread_lock_for_bars()
    torch.set_num_threads(threads)
    logging.basicConfig(level=log_level, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.mesh import build_mesh
    from dlo_fn.runtime.platform import platform_for
    from dlo_fn.serve.engine import Engine

    timeout_s = max((p.options.timeout_s for p in phases), default=60.0)
    code, broken = 0, False
    try:
        ctx = init_distributed(
            platform_for("cpu"), timeout_s=timeout_s, init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        mesh = build_mesh(ctx, sp=sp_size) if sp_size > 1 else None
        reports: list[Any] = []
        for k, phase in enumerate(phases):
            model, off = open_model(
                checkpoint,
                ctx,
                phase.mode,
                record_timeline=phase.options.trace,
                mesh=mesh,
                shard_group=phase.shard_group,
            )
            engine = Engine(
                model,
                off,
                ctx,
                phase.options,
                session=f"phase{k}",
                mesh=mesh,
                checkpoint=(lambda: _reopen(checkpoint)) if phase.recovery else None,
            )
            if rank == 0:
                try:
                    if phase.forced is not None:
                        waves = [[phase.submissions[i].request for i in w] for w in phase.forced]
                        reports.append(engine.serve_forced(waves))
                    elif phase.stream_gaps_s is not None:
                        reports.append(engine.serve_stream(_feed(phase.submissions, phase.stream_gaps_s)))
                    else:
                        reports.append(engine.serve(phase.submissions))
                except Exception as exc:  # noqa: BLE001 - e.g. a forced mixed wave: reported, then carry on
                    reports.append(f"{type(exc).__name__}: {exc}")
                finally:
                    engine.close()
            else:
                engine.follow()
            if engine.stopped is not None or engine.degraded is not None:  # the world group is broken
                broken = True
                break
        out.send((rank, "ok", pickle.dumps(reports) if rank == 0 else None))
        if not broken and ctx.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - report to the parent, which raises with the traceback
        out.send((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        code = 1
    out.close()
    # Leave without the interpreter's teardown, also on a clean run: the report is sent (a pipe write is
    # synchronous) and the process group destroyed, and what is left is destructors. A failed engine leaves gloo
    # pairs broken that they could block on (runtime.dist.exit_now).
    from dlo_fn.runtime.dist import exit_now

    exit_now(code)


def serve_local(
    checkpoint: str | os.PathLike,
    phases: Sequence[Phase],
    dp_size: int,
    *,
    sp_size: int = 1,
    threads_per_rank: int = 1,
    join_timeout_s: float = 300.0,
    grace_s: float = 10.0,
    log_level: int = logging.WARNING,
    start_method: str = "spawn",
) -> LocalRun:
    """Run ``phases`` on ``dp_size x sp_size`` spawned CPU ranks; see the module docstring. Raises
    ``RuntimeError`` with rank 0's traceback if it failed outside the engine, ``TimeoutError`` if it gave no
    answer within ``join_timeout_s`` (every process is then killed)."""
    from dlo_fn.serve.ranks import rank_context

    if dp_size < 1 or sp_size < 1:
        raise ValueError(f"dp_size and sp_size must be >= 1, got {dp_size} and {sp_size}")
    world = dp_size * sp_size
    ctx = rank_context(start_method)
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]  # pipes, not queues: no semaphores to leak
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlo_fn_serve_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_rank_main,
                daemon=True,
                args=(
                    r,
                    world,
                    init_file,
                    str(checkpoint),
                    tuple(phases),
                    threads_per_rank,
                    pipes[r][1],
                    log_level,
                    sp_size,
                ),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for _, w in pipes:
            w.close()  # the children hold the write ends
        answer = None
        errors: dict[int, str] = {}
        deadline = time.monotonic() + join_timeout_s
        try:
            while answer is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"serve_local: rank 0 gave no answer within {join_timeout_s:.0f} s")
                for r, (conn, _) in enumerate(pipes):
                    if r in errors or not conn.poll(0.1 if r == 0 else 0):
                        continue
                    try:
                        rank, status, payload = conn.recv()
                    except EOFError:  # the rank exited without a word (a crash, os._exit, a kill)
                        errors[r] = "exited without a report"
                        if r == 0:
                            raise RuntimeError(f"serve_local: rank 0 {errors[0]}") from None
                        continue
                    if status == "error":
                        errors[rank] = payload
                        if rank == 0:
                            raise RuntimeError(f"serve_local: rank 0 failed:\n{payload}")
                    elif rank == 0:
                        answer = pickle.loads(payload)
                    else:
                        errors[rank] = ""  # reported fine; stop polling it
            end = time.monotonic() + grace_s
            for p in procs:
                p.join(timeout=max(0.0, end - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            for conn, _ in pipes:
                conn.close()
        for r, text in errors.items():
            if text:
                log.warning("rank %d (exit code %s): %s", r, procs[r].exitcode, text)
        return LocalRun(tuple(answer), tuple(p.exitcode for p in procs), time.perf_counter() - t0)
