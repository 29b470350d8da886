"""Process-group helpers: start-up, the one all-gather call, cross-rank agreement checks, local test ranks.

Everything multi-rank has a timeout: ``init_process_group(timeout=...)`` bounds every collective (gloo
enforces it per call; NCCL/HCCL through their watchdogs), and :func:`run_ranks` kills its processes and
raises ``TimeoutError`` when they do not finish.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from dlo_fn.runtime.platform import Platform, detect_platform, platform_for

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistContext",
    "init_distributed",
    "all_gather_bytes",
    "all_gather_pairs",
    "bound_all_gather",
    "check_same_across_ranks",
    "exit_now",
    "free_port",
    "run_ranks",
]

DEFAULT_TIMEOUT_S = 300.0
_DIGEST_BYTES = 64  # a hex SHA-256


@dataclass(frozen=True, slots=True)
class DistContext:
    """Who this process is. ``group`` is None when there is a single process and no process group."""

    rank: int
    world_size: int
    local_rank: int
    platform: Platform
    group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(platform: Platform | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                     init_method: str | None = None, rank: int | None = None,
                     world_size: int | None = None, single_process_group: bool = False) -> DistContext:
    """Join (or create) the default process group.

    Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) or with an explicit ``init_method`` the
    group is created with the platform's backend (nccl / hccl / gloo). A plain single process gets no group
    (the executor then copies its landing buffer into the slot in place of a 1-rank all-gather) unless
    ``single_process_group`` asks for a real 1-rank group on a free local port (benchmarks use it so the
    all-gather path is measured as it runs on several ranks).
    """
    env_world = os.environ.get("WORLD_SIZE")
    if world_size is None:
        world_size = int(env_world) if env_world else 1
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank if env_world is None else 0)))
    if platform is None:
        platform = detect_platform(local_rank)
    if dist.is_available() and dist.is_initialized():
        return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, platform, dist.group.WORLD)
    if world_size == 1 and init_method is None and env_world is None and not single_process_group:
        return DistContext(0, 1, local_rank, platform, None)
    if init_method is None and env_world is None:
        init_method = f"tcp://127.0.0.1:{free_port()}"
    kwargs: dict[str, Any] = {"backend": platform.backend, "timeout": datetime.timedelta(seconds=timeout_s)}
    if init_method is not None:
        kwargs.update(init_method=init_method, rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, platform, dist.group.WORLD)


def all_gather_bytes(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """``output[r*n:(r+1)*n] = input of rank r`` for every rank of ``group``.

    torch 2.13 deprecates ``all_gather_into_tensor`` in favour of ``all_gather_single``, which torch 2.11 (the
    GPU image) lacks: use whichever exists. Both are called on uint8 byte views, which every backend supports
    (gloo has no float8) and which makes a mixed-dtype block one collective.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def _coalesces(pg: Any, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether ``pairs`` go to ``pg`` as one coalesced collective: several pairs, on a device backend. gloo gathers
    them one by one: its coalesced all-gather of CUDA tensors crashes the process (torch 2.11, seen on the H200),
    and on the host a coalesced call saves nothing."""
    return len(pairs) > 1 and dist.get_backend(pg) != "gloo"


def _group(group: Any) -> Any:
    return group if group is not None else dist.distributed_c10d._get_default_group()


def all_gather_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], group: Any, async_op: bool = False) -> Any:
    """:func:`all_gather_bytes` for each ``(output, input)`` pair, issued as one call: one pair is one all-gather,
    several are one coalesced collective (NCCL: one group launch; a load group's blocks, ``runtime.program``; gloo:
    one after the other, the last one's work returned with ``async_op``, every one before it done). The torch-event
    loop calls it per all-gather op: one pair goes straight to :func:`all_gather_bytes`, nothing built per call."""
    if len(pairs) == 1:
        return all_gather_bytes(*pairs[0], group, async_op)
    if not async_op:
        return bound_all_gather(pairs, group)()
    pg = _group(group)
    if not _coalesces(pg, pairs):
        for out, inp in pairs[:-1]:
            all_gather_bytes(out, inp, group)
        return all_gather_bytes(*pairs[-1], group, async_op=True)
    opts = dist.distributed_c10d.AllgatherOptions()
    opts.asyncOp = True
    return pg.allgather_into_tensor_coalesced([o for o, _ in pairs], [i for _, i in pairs], opts)


def bound_all_gather(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], group: Any) -> Callable[[], None]:
    """``call()`` doing :func:`all_gather_pairs` synchronously (on a device: issued on the current stream, which
    then waits for it) with everything resolved once: the group, the options, the tensor lists. The executor's
    driver-call path calls it once per all-gather op: ``torch.distributed``'s wrapper (argument checks, the default
    group, the coalescing state) costs several microseconds a call that this skips. The collective is the group's
    own (``ProcessGroup._allgather_base``, what the wrapper calls), or the wrapper where a group lacks it."""
    pg = _group(group)
    opts = dist.distributed_c10d.AllgatherOptions()
    opts.asyncOp = False
    pairs = tuple(pairs)
    if _coalesces(pg, pairs):
        outs, ins = [o for o, _ in pairs], [i for _, i in pairs]
        gather, args = pg.allgather_into_tensor_coalesced, ((outs, ins, opts),)
    elif hasattr(pg, "_allgather_base"):
        gather, args = pg._allgather_base, tuple((out, inp, opts) for out, inp in pairs)  # gloo: one by one
    else:
        gather, args = (lambda out, inp, _: all_gather_bytes(out, inp, group)), tuple((o, i, opts) for o, i in pairs)

    def call() -> None:
        for a in args:
            work = gather(*a)
            if work is not None:
                work.wait()
    return call


def check_same_across_ranks(value: str, group: Any, platform: Platform, what: str) -> None:
    """All-gather a short ASCII string (e.g. a layout digest) and raise ``RuntimeError`` on every rank if
    any rank disagrees, naming the ranks and both values."""
    if group is None:
        return
    raw = value.encode("ascii")
    if len(raw) > _DIGEST_BYTES:
        raise ValueError(f"{what}: value longer than {_DIGEST_BYTES} bytes")
    world = dist.get_world_size(group)
    mine = torch.zeros(_DIGEST_BYTES, dtype=torch.uint8, device=platform.device)
    mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(platform.device)
    every = torch.empty(world * _DIGEST_BYTES, dtype=torch.uint8, device=platform.device)
    all_gather_bytes(every, mine, group)
    rows = every.cpu().view(world, _DIGEST_BYTES)
    values = [bytes(r.tolist()).rstrip(b"\0").decode("ascii", "replace") for r in rows]
    if len(set(values)) > 1:
        ref = values[0]
        bad = [r for r, v in enumerate(values) if v != ref]
        raise RuntimeError(
            f"{what} differs across ranks: rank 0 has {ref!r}, ranks {bad} have "
            f"{sorted({values[r] for r in bad})}. Every rank must load the same checkpoint with the same block "
            f"paths, dtype, alignment and world size."
        )


def exit_now(code: int) -> None:
    """End this process with ``code`` without the interpreter's teardown: logging and stdio flushed, then
    ``os._exit``. For a rank whose work is done or must stop at once: the destructors left at exit (gloo's threads,
    a communicator a peer abandoned) can block or abort ("terminate called without an active exception", exit -6,
    seen on a loaded 2-core machine after every request had its answer)."""
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, fn: Callable, world_size: int, init_file: str, kind: str, timeout_s: float,
               threads: int, results: Any, args: Sequence[Any]) -> None:
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        ctx = init_distributed(platform_for(kind, rank), timeout_s=timeout_s, init_method=f"file://{init_file}",
                               rank=rank, world_size=world_size)
        try:
            out = fn(ctx, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException as exc:  # report to the parent, which raises with every rank's story
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
              platform: str = "cpu", threads_per_rank: int = 1) -> list[Any]:
    """Run ``fn(ctx: DistContext, *args)`` in ``world_size`` fresh processes (spawn) joined by a file://
    rendezvous; return the results in rank order. ``fn`` must be importable (module level) and its result
    picklable. Raises ``RuntimeError`` with the failing ranks' tracebacks, or ``TimeoutError`` after
    ``timeout_s`` (the processes, which this call started, are then killed)."""
    import torch.multiprocessing as mp

    mpctx = mp.get_context("spawn")
    results = mpctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dlo_fn_ranks_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            mpctx.Process(target=_rank_main, daemon=True,
                          args=(r, fn, world_size, init_file, platform, timeout_s, threads_per_rank, results,
                                tuple(args)))
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
                        f"{timeout_s:.0f} s; finished: {sorted(got)}")
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
                        raise RuntimeError(f"run_ranks: ranks {[r for r in dead if r not in got]} died "
                                           f"(exit codes {[procs[r].exitcode for r in dead]}) without a report")
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
