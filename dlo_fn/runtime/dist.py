"""Process-group helpers: start-up, the one all-gather call, cross-rank agreement checks.

Everything multi-rank has a timeout: ``init_process_group(timeout=...)`` bounds every collective (gloo
enforces it per call; NCCL/HCCL through their watchdogs). Local test ranks: :mod:`dlo_fn.serve.ranks`.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from dlo_fn.runtime.platform import Platform, detect_platform

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistContext",
    "init_distributed",
    "all_gather_bytes",
    "all_gather_pairs",
    "check_same_across_ranks",
    "exit_now",
    "free_port",
    "local_ranks",
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


def init_distributed(
    platform: Platform | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    single_process_group: bool = False,
) -> DistContext:
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


def all_gather_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], group: Any, async_op: bool = False) -> Any:
    """:func:`all_gather_bytes` for each ``(output, input)`` pair, issued as one call: one pair is one all-gather;
    several (a load group's blocks on the per-block layout, ``runtime.program``) are one coalesced collective on
    a device backend (NCCL: one group launch), and one after the other on gloo, whose coalesced all-gather of CUDA
    tensors crashed the process (torch 2.11, on the H200) and saves nothing on the host. Returns the (last) work
    with ``async_op``, every call before it done."""
    if len(pairs) == 1:
        return all_gather_bytes(*pairs[0], group, async_op)
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if dist.get_backend(pg) == "gloo":
        for out, inp in pairs[:-1]:
            all_gather_bytes(out, inp, group)
        return all_gather_bytes(*pairs[-1], group, async_op)
    opts = dist.distributed_c10d.AllgatherOptions()
    opts.asyncOp = async_op
    work = pg.allgather_into_tensor_coalesced([o for o, _ in pairs], [i for _, i in pairs], opts)
    if async_op or work is None:  # NCCL returns no work for a synchronous coalesced call (torch 2.11)
        return work
    work.wait()  # on a device: the current stream waits for the collective, the host does not
    return None


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


def local_ranks(ctx: DistContext) -> int:
    """Ranks of ``ctx``'s job on this host, sharing its cores: torchrun's ``LOCAL_WORLD_SIZE``, else the world
    (:func:`dlo_fn.serve.ranks.run_ranks` starts every rank on this host)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
