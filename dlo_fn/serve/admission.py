"""Continuous serving's admission: which queued requests start on which replica at a ring step boundary.

Before every ring step rank 0's :class:`~dlo_fn.serve.continuous.ContinuousDriver` hands the queue (FIFO) and
what each replica still holds to :func:`admit`, the planner's live rule: :func:`~dlo_fn.plan.dispatch.admit_continuous`
(the head goes to the first empty replica, else to the replica of its key with the fewest held, ``< R``; no
overtaking), or with ``EngineOptions(admission="cost")`` :func:`~dlo_fn.plan.dispatch.admit_cost_aware` on the
relative costs of :func:`admission_cost`. Requests of one :func:`admission_key` may share a replica.
"""

from __future__ import annotations

from typing import Any, Sequence

from dlo_fn.models.config import tokens_for
from dlo_fn.models.request import Request
from dlo_fn.plan.dispatch import PassCosts, QueuedRequest, admit_continuous, admit_cost_aware

__all__ = ["admission_key", "admission_cost", "queued_request", "admit"]


def admission_key(request: Request) -> tuple:
    """Requests of one key may share a replica (``R > 1``): one shape, one batch."""
    return (request.height, request.width, request.num_frames, request.cfg, request.outputs_per_prompt)


def admission_cost(config: Any, request: Request) -> float:
    """Relative compute per block pass: tokens x rows (what :class:`QueuedRequest` carries; only compared)."""
    tokens = tokens_for(config, request.height, request.width, request.num_frames) if config is not None else 1
    return float(tokens * request.batch_size)


def queued_request(config: Any, index: int, request: Request) -> QueuedRequest:
    """Submission ``index`` as the planner queues it (id: the index; arrival and per-block cost unused)."""
    return QueuedRequest(str(index), 0.0, request.num_inference_steps, admission_key(request),
                         admission_cost(config, request))


def admit(admission: str, queued: list[QueuedRequest], held: Sequence[Sequence[QueuedRequest]],
          R: int) -> tuple[tuple[str, int], ...]:
    """``(request_id, replica)`` placements of ``queued`` given what each replica ``held``, by ``admission``."""
    if admission == "cost":  # relative costs, no load term: only the compute maxima compare
        return admit_cost_aware(queued, held, R, PassCosts.uniform(1, 0.0))
    return admit_continuous(queued, held, R)
