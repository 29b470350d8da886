"""Admission: whether a request may be queued at all (memory), and which queued requests start where (placement).

**Memory** (:class:`MemoryAdmission`, strict and continuous serving alike, every rank layout): before a request
is queued rank 0 sets its bytes on a rank, the plan's terms for its shape, CFG and outputs with ``R`` held per
rank and ``sp`` ranks per replica (:mod:`dlo_fn.cost.request_memory`), against what every rank has left once the
model is offloaded (:mod:`dlo_fn.serve.memory_room`: free device memory, available host memory, cgroup and
``ulimit -v``, split between the ranks that share them). One that cannot fit gets its own result saying its
bytes, the budget and the largest size of its aspect that fits; nothing is allocated for it, and the others run.

**Placement** (continuous serving). Before every ring step rank 0's
:class:`~dlo_fn.serve.continuous.ContinuousDriver` hands the queue (FIFO) and what each replica still holds to
:func:`admit`, the planner's live rule: :func:`~dlo_fn.cost.dispatch.admit_continuous` (the head goes to the
first empty replica, else to the replica of its key with the fewest held, ``< R``; no overtaking), or with
``EngineOptions(admission="cost")`` :func:`~dlo_fn.cost.dispatch.admit_cost_aware` on the relative costs of
:func:`admission_cost`. Requests of one :func:`admission_key` may share a replica.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from dlo_fn.cost.dispatch import PassCosts, QueuedRequest, admit_continuous, admit_cost_aware
from dlo_fn.models.config import tokens_for
from dlo_fn.models.request import Request
from dlo_fn.serve.memory_room import Share

__all__ = ["admission_key", "admission_cost", "queued_request", "admit", "MemoryAdmission", "request_shape"]


def admission_key(request: Request) -> tuple:
    """Requests of one key may share a replica (``R > 1``): one shape, one batch."""
    return (request.height, request.width, request.num_frames, request.cfg, request.outputs_per_prompt)


def admission_cost(config: Any, request: Request) -> float:
    """Relative compute per block pass: tokens x rows (what :class:`QueuedRequest` carries; only compared)."""
    tokens = tokens_for(config, request.height, request.width, request.num_frames) if config is not None else 1
    return float(tokens * request.batch_size)


def queued_request(config: Any, index: int, request: Request) -> QueuedRequest:
    """Submission ``index`` as the planner queues it (id: the index; arrival and per-block cost unused)."""
    return QueuedRequest(
        str(index), 0.0, request.num_inference_steps, admission_key(request), admission_cost(config, request)
    )


def admit(
    admission: str, queued: list[QueuedRequest], held: Sequence[Sequence[QueuedRequest]], R: int
) -> tuple[tuple[str, int], ...]:
    """``(request_id, replica)`` placements of ``queued`` given what each replica ``held``, by ``admission``."""
    if admission == "cost":  # relative costs, no load term: only the compute maxima compare
        return admit_cost_aware(queued, held, R, PassCosts.uniform(1, 0.0))
    return admit_continuous(queued, held, R)


class MemoryAdmission:
    """Admission against memory: a request whose bytes on a rank (:mod:`dlo_fn.cost.request_memory`, for its
    shape, CFG and outputs, ``R`` held per rank, ``sp`` ranks per replica) exceed what a rank has left
    (``shares``: :func:`dlo_fn.serve.memory_room.rank_shares`, each capped at ``cap_bytes`` when given) is refused
    before it is queued, with its bytes, the budget and the largest size of its aspect that fits. Any replica
    may get any request, so every rank must hold it."""

    def __init__(
        self,
        config: Any,
        weight_itemsize: int,
        shares: Mapping[int, Share],
        *,
        requests_per_rank: int,
        sp: int = 1,
        cap_bytes: int | None = None,
    ) -> None:
        from dlo_fn.cost.sp_memory import BlockDims

        self.config, self.dims = config, BlockDims.from_config(config, weight_itemsize)
        self.requests_per_rank, self.sp = requests_per_rank, sp
        self.shares = {r: s.capped(cap_bytes) for r, s in shares.items()} if cap_bytes is not None else dict(shares)

    def memory(self, request: Request, height: int | None = None, width: int | None = None):
        """``request``'s :class:`~dlo_fn.cost.request_memory.RequestMemory` (at another size if given)."""
        from dlo_fn.cost.request_memory import request_memory

        return request_memory(
            self.dims,
            request_shape(self.config, request, height, width),
            sp=self.sp,
            requests_per_rank=self.requests_per_rank,
        )

    def _short(
        self, request: Request, height: int | None = None, width: int | None = None
    ) -> tuple[int, int, int, str, str] | None:
        """The first rank that cannot hold ``request`` (at ``height x width``): ``(rank, needed, budget, what,
        where the budget comes from)``; None when every rank can."""
        m = self.memory(request, height, width)
        for rank, share in sorted(self.shares.items()):
            if share.device_bytes is None:  # a CPU rank: device and host are one pool
                checks = ((m.pool_bytes, share.host_bytes, "host (CPU) memory", share.host_why),)
            else:
                checks = (
                    (m.device_bytes, share.device_bytes, "device memory", share.device_why),
                    (m.host_bytes, share.host_bytes, "host memory for the decoded video", share.host_why),
                )
            for needed, budget, what, source in checks:
                if needed > budget:
                    return rank, needed, budget, what, source
        return None

    def refusal(self, request: Request) -> str | None:
        """Why ``request`` cannot be admitted (one line), or None."""
        from dlo_fn.cost.request_memory import largest_fitting
        from dlo_fn.io.memstat import format_bytes

        short = self._short(request)
        if short is None:
            return None
        rank, needed, budget, what, source = short
        m = self.memory(request)
        _, p_h, p_w = self.config.patch_size
        unit = math.lcm(self.config.vae_spatial * p_h, self.config.vae_spatial * p_w)
        best = largest_fitting(request.height, request.width, unit, lambda h, w: self._short(request, h, w) is None)
        held = f", {self.requests_per_rank} held per rank" if self.requests_per_rank > 1 else ""
        fits = (
            f"the largest size of this aspect that fits ({request.num_frames} frame(s), "
            f"{'CFG' if request.cfg else 'no CFG'}, {request.outputs_per_prompt} output(s){held}): "
            f"height {best[0]}, width {best[1]}"
            if best
            else "no size of this aspect fits: lower the frames or outputs, or serve on more memory"
        )
        return (
            f"rejected before dispatch: needs {format_bytes(needed)} of {what} per rank (compute "
            f"{format_bytes(m.device_bytes)}, its block's '{m.peak_phase}' phase {format_bytes(m.call_bytes)}; "
            f"the decoded video and its copies {format_bytes(m.host_bytes)}) but rank {rank} has "
            f"{format_bytes(budget)} ({source}); {fits}"
        )


def request_shape(config: Any, request: Request, height: int | None = None, width: int | None = None):
    """``request``'s :class:`~dlo_fn.cost.request_memory.RequestShape` (at another ``height x width`` if given)."""
    from dlo_fn.cost.request_memory import RequestShape
    from dlo_fn.models.config import latent_shape
    from dlo_fn.models.decode import num_pixel_frames

    h, w = height or request.height, width or request.width
    latent = latent_shape(config, h, w, request.num_frames)
    tokens = tokens_for(config, h, w, request.num_frames)
    n = request.outputs_per_prompt
    frames = num_pixel_frames(config, latent[1])
    video = n * frames * (latent[2] * config.vae_spatial) * (latent[3] * config.vae_spatial) * 3
    return RequestShape(tokens, n, request.batch_size, math.prod(latent), video)
