"""Local ranks: run a function in W fresh processes joined by a real process group (gloo on CPU; a device
backend on GPUs), for tests, notebooks, benchmarks and ``demo``. :func:`run_ranks` kills its processes and raises
``TimeoutError`` when they do not finish, and gathers every rank's result or traceback. :func:`rank_context`
says how a rank process starts (for :func:`run_ranks` and :func:`dlo_fn.serve.local.serve_local`).
"""

from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from dlo_fn.runtime.dist import init_distributed
from dlo_fn.runtime.platform import platform_for

__all__ = ["START_METHODS", "rank_context", "run_ranks"]

START_METHODS = ("spawn", "forkserver")
# Most of what a rank imports before it runs anything (torch with them): a fork server imports it once for all
# the ranks it forks. The rank entries themselves (this module, serve.local) import little more.
_FORKSERVER_PRELOAD = ("dlo_fn.runtime.dist", "dlo_fn.runtime.mesh", "dlo_fn.serve.engine")


def rank_context(start_method: str = "spawn") -> Any:
    """The multiprocessing context that starts local ranks. ``"spawn"``: each rank is a fresh interpreter that
    imports torch and dlo_fn itself. ``"forkserver"``: each rank is forked from one server process (per calling
    process, started on first use) that imported them once, so a rank starts without that import. A forked
    rank has the environment, working directory and niceness the caller had when the server started, and
    shares the server's imported pages (so a rank's private memory counts less than under spawn: measure
    memory under spawn). Raises ``ValueError`` for another method."""
    import torch.multiprocessing as mp

    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r}: must be one of {', '.join(START_METHODS)}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(_FORKSERVER_PRELOAD))  # no effect once the server runs
    return ctx


def _rank_main(
    rank: int,
    fn: Callable,
    world_size: int,
    init_file: str,
    kind: str,
    timeout_s: float,
    threads: int,
    results: Any,
    args: Sequence[Any],
) -> None:
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        ctx = init_distributed(
            platform_for(kind, rank),
            timeout_s=timeout_s,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
        )
        try:
            out = fn(ctx, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException as exc:  # report to the parent, which raises with every rank's story
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    platform: str = "cpu",
    threads_per_rank: int = 1,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(ctx: DistContext, *args)`` in ``world_size`` fresh processes (started by ``start_method``, see
    :func:`rank_context`) joined by a file:// rendezvous; return the results in rank order. ``fn`` must be
    importable (module level) and its result picklable. Raises ``RuntimeError`` with the failing ranks'
    tracebacks, or ``TimeoutError`` after ``timeout_s`` (the processes, which this call started, are then
    killed)."""
    mpctx = rank_context(start_method)
    results = mpctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dlo_fn_ranks_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            mpctx.Process(
                target=_rank_main,
                daemon=True,
                args=(r, fn, world_size, init_file, platform, timeout_s, threads_per_rank, results, tuple(args)),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(got) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"run_ranks: ranks {sorted(set(range(world_size)) - set(got))} did not finish within "
                        f"{timeout_s:.0f} s; finished: {sorted(got)}"
                    )
                try:
                    rank, ok, value = results.get(timeout=min(left, 0.5))
                    got[rank] = (ok, value)
                    continue
                except queue_mod.Empty:
                    pass
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    time.sleep(0.5)  # let a dying rank's report arrive
                    while True:
                        try:
                            rank, ok, value = results.get_nowait()
                            got[rank] = (ok, value)
                        except queue_mod.Empty:
                            break
                    if any(r not in got for r in dead):
                        raise RuntimeError(
                            f"run_ranks: ranks {[r for r in dead if r not in got]} died "
                            f"(exit codes {[procs[r].exitcode for r in dead]}) without a report"
                        )
                    if not any(ok is False for ok, _ in got.values()):
                        continue
                if any(ok is False for ok, _ in got.values()):
                    break
        finally:
            for p in procs:
                p.join(timeout=5 if len(got) == world_size else 0.1)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        failures = {r: v for r, (ok, v) in got.items() if not ok}
        if failures:
            text = "\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(failures.items()))
            raise RuntimeError(f"run_ranks: {len(failures)} rank(s) failed:\n{text}")
        return [got[r][1] for r in range(world_size)]
