"""One rank's share of a wave: ``R`` compatible requests, block-major, plus the fault-injection test hook.

For requests ``0 .. R-1`` of one key (same shape and steps), each denoising step runs::

    t_r = model.encode_text(state_r.text_tokens)               once per request (the prompt does not change)
    e_r = model.embed(*model_inputs(state_r), t_r)             for every r, every step
    for block b in model.blocks:                               one load (H2D + all-gather) of block b ...
        x_r = b(x_r, **e_r.block_kwargs)                       ... serves all R requests in turn
    state_r = update(state_r, model.head(x_r, e_r))            for every r

inside one executor run of ``T = num_inference_steps`` passes with ``requests_per_load = R`` (the planner's
block-major compute order). Every request keeps the exact tensors and kernels of a single
:func:`dlo_fn.models.generate` call, so its output is bit-identical. A rank with no request in the wave runs
:meth:`~dlo_fn.runtime.offload.Offloaded.idle`: it serves its shards to every all-gather and computes nothing.

**A rank that raises** (a bug, a bad input that slipped through, or the injected fault) must not leave the
others waiting in an all-gather. Its requests get an error result, and the open run is *drained*: the rest of
its loads and all-gathers are issued without compute, exactly as an idle rank would, so the wave completes for
the other ranks. If draining fails too (the exception came from a collective: a peer died or timed out) the
wave cannot complete anywhere and :class:`WaveAborted` propagates: the engine fails the wave closed.

**Fault injection** (tests and the demo's documented hook, never on by default): a :class:`Fault` names a rank,
a wave, a step and a kind; when that rank reaches block 0 of that step of that wave it (in continuous serving,
which has no waves, at block 0 of ring step ``step``: ``wave`` must be 0 there, :meth:`Fault.check_serving`)

=========  ==================================================================================
``raise``  raises :class:`InjectedFault` (a real exception in the real process)
``stall``  sleeps ``stall_s`` (default 3600 s): a live process that stops answering collectives
``exit``   ``os._exit(FAULT_EXIT_CODE)``: the process dies without cleanup, as on a crash
=========  ==================================================================================

It comes from ``EngineOptions(fault=...)`` or the environment variable ``DLO_FN_FAULT`` holding JSON such as
``{"rank": 1, "wave": 0, "kind": "stall", "step": 1}`` (``wave`` and ``step`` default to 0).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from dlo_fn.models.lora import block_chooser
from dlo_fn.models.request import Request
from dlo_fn.models.sampler import finish, init_state, model_inputs, update

__all__ = [
    "Fault",
    "InjectedFault",
    "WaveAborted",
    "Outcome",
    "run_batch",
    "collective_failure",
    "FAULT_ENV",
    "FAULT_EXIT_CODE",
]

log = logging.getLogger(__name__)
FAULT_ENV = "DLO_FN_FAULT"
FAULT_EXIT_CODE = 17
FAULT_KINDS = ("raise", "stall", "exit")


class InjectedFault(RuntimeError):
    """Raised by a :class:`Fault` of kind ``raise``."""


class WaveAborted(RuntimeError):
    """This rank could not finish its part of the wave's collectives; ``cause`` is the first error."""

    def __init__(self, message: str, cause: BaseException) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True, slots=True)
class Fault:
    """A documented test hook: make ``rank`` misbehave at block 0 of ``step`` in ``wave`` (see module doc)."""

    rank: int
    wave: int
    kind: str
    step: int = 0
    stall_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"Fault.kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.rank < 0 or self.wave < 0 or self.step < 0 or self.stall_s <= 0:
            raise ValueError(f"Fault fields must be >= 0 (stall_s > 0): {self}")

    @staticmethod
    def parse(text: str | None) -> "Fault | None":
        """From JSON (the ``DLO_FN_FAULT`` format; ``wave`` and ``step`` default to 0); None or '' gives None."""
        if not text:
            return None
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError(f"expected a JSON object, got {type(data).__name__}")
            return Fault(**{"wave": 0, **data})
        except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError; so is a bad field
            raise ValueError(
                f"{FAULT_ENV}={text!r}: expected JSON like "
                '{"rank": 1, "wave": 0, "kind": "raise|stall|exit", "step": 0} '
                f"({exc})"
            ) from exc

    @staticmethod
    def from_env() -> "Fault | None":
        return Fault.parse(os.environ.get(FAULT_ENV))

    def check_serving(self, continuous: bool) -> "Fault":
        """Continuous serving runs ring steps, not waves: a ``wave`` other than 0 would be ignored there, so it is
        refused (``ValueError`` naming what to give instead)."""
        if continuous and self.wave:
            raise ValueError(
                f'{FAULT_ENV}: "wave": {self.wave} applies to strict serving (waves); continuous '
                f'serving fires the fault at ring step "step" (now {self.step}): give the ring step '
                f'as "step" and leave "wave" out, or serve with --serving strict'
            )
        return self

    def fire(self) -> None:
        where = f"rank {self.rank}, wave {self.wave}, step {self.step}"
        log.warning("fault injection: %s at %s", self.kind, where)
        if self.kind == "raise":
            raise InjectedFault(f"injected fault: {where} raised")
        if self.kind == "stall":
            time.sleep(self.stall_s)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(FAULT_EXIT_CODE)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's result on the rank that ran it. ``position`` is its place in the wave."""

    position: int
    ok: bool
    video: torch.Tensor | None = None
    sha256: str | None = None
    error: str | None = None
    compute_s: float = 0.0


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# What the backends put in the errors of a collective that a peer broke (gloo raises plain RuntimeErrors
# naming its own source files; NCCL and HCCL name themselves; a closed socket or a timeout says so).
_COLLECTIVE_MARKS = (
    "gloo",
    "NCCL",
    "HCCL",
    "Timed out",
    "timed out",
    "Connection closed by peer",
    "Connection reset by peer",
)


def collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a collective (a peer died, stalled, or the group broke) rather than from this
    rank's own work. Such a step cannot complete anywhere: draining it, or running a shadow of it on an sp
    replica, would only wait for the timeout once more per collective, during which the status board shows this
    healthy rank as stalled beside the real culprit. So the rank gives up at once and says so."""
    if isinstance(exc, WaveAborted):
        return True
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COLLECTIVE_MARKS)


def abort_run(executor: Any, rank: int, cause: BaseException) -> WaveAborted:
    """Drop the open run after a collective failed (see :func:`collective_failure`); the error to raise."""
    try:
        executor.abort()
    except Exception:  # noqa: BLE001 - already failing; the first error is what matters
        pass
    return WaveAborted(f"rank {rank}: a collective failed: {_describe(cause)}", cause)


@torch.no_grad()
def run_batch(
    model: Any,
    offloaded: Any,
    requests: Sequence[Request],
    positions: Sequence[int],
    *,
    num_steps: int,
    rank: int = 0,
    fault: Fault | None = None,
    on_step: Callable[[int], None] | None = None,
    on_block: Callable[[str, int, int, float, float], None] | None = None,
    sp: Any = None,
) -> list[Outcome]:
    """Run ``requests`` (this rank's share, at wave ``positions``) block-major; see the module docstring.

    ``offloaded`` is a :class:`~dlo_fn.runtime.offload.Offloaded` (its executor is None when resident).
    ``on_step(step)`` is called after every denoising step (the status board); ``on_block(label, step, block,
    start_s, end_s)`` records compute spans (``time.perf_counter`` seconds) for a wave trace. ``sp``: this
    rank's :class:`~dlo_fn.models.sp.SPContext` when the sp ranks of a replica run the same share together
    (Ulysses; each computes its tokens, all-to-alls inside the blocks keep them in step).
    Returns one :class:`Outcome` per request; raises :class:`WaveAborted` when the collectives could not be
    completed.
    """
    if len(requests) != len(positions):
        raise ValueError(f"{len(requests)} requests for {len(positions)} positions")
    executor = getattr(offloaded, "executor", None)
    if not requests:
        try:
            offloaded.idle(num_steps)
        except Exception as exc:
            raise WaveAborted(f"idle rank {rank} could not serve its all-gathers: {_describe(exc)}", exc) from exc
        return []
    t0 = time.perf_counter()
    sp_kwargs = {"sp": sp} if sp is not None else {}
    states: list[Any] = []
    opened = False
    try:
        states = [init_state(model, r) for r in requests]
        steps = {s.num_steps for s in states}
        if steps != {num_steps}:
            raise ValueError(f"requests of one wave have steps {sorted(steps)}, the wave runs {num_steps}")
        if executor is not None:
            executor.begin_run(num_steps, len(requests))
            opened = True
        blocks = model.blocks
        choose = block_chooser(model)  # each request's adapter (Request.lora) in a block before its call
        # The text states depend on the prompt only: encode them once per request, not at every step (the
        # same kernels on the same tokens, so the same bits). Re-encoding is work outside the blocks that the
        # ring must run ahead across at every step boundary.
        texts = [model.encode_text(s.text_tokens) for s in states]
        for step in range(num_steps):
            embeds = [model.embed(*model_inputs(s), t, **sp_kwargs) for s, t in zip(states, texts)]
            xs = [e.x for e in embeds]
            for b, block in enumerate(blocks):
                for r, e in enumerate(embeds):
                    if choose is not None:
                        choose(block, requests[r])
                    c0 = time.perf_counter()
                    xs[r] = block(xs[r], **e.block_kwargs)
                    if on_block is not None:
                        on_block(f"p{positions[r]}", step, b, c0, time.perf_counter())
                if fault is not None and b == 0 and step == fault.step:
                    fault.fire()
            states = [update(s, model.head(x, e)) for s, x, e in zip(states, xs, embeds)]
            if on_step is not None:
                on_step(step)
        if opened:
            executor.end_run()
            opened = False
    except Exception as exc:
        text = f"rank {rank}: {_describe(exc)}"
        log.error("%s\n%s", text, traceback.format_exc())
        if opened and collective_failure(exc):
            raise abort_run(executor, rank, exc) from exc
        if opened:
            _drain(executor, rank, exc)
        elif executor is not None:  # failed before the run opened: still serve this wave's all-gathers
            try:
                offloaded.idle(num_steps)
            except Exception as idle_exc:
                raise WaveAborted(
                    f"{text}; then serving the all-gathers failed: {_describe(idle_exc)}", exc
                ) from idle_exc
        dt = time.perf_counter() - t0
        return [Outcome(p, False, error=text, compute_s=dt) for p in positions]
    finished = []
    for p, s in zip(positions, states):
        try:
            finished.append((p, finish(s), None))
        except Exception as exc:  # decoding one request must not lose the others
            finished.append((p, None, f"rank {rank}: {_describe(exc)}"))
    # After finish(): the latents came back to the host, so on an accelerator the device work is included.
    compute_s = time.perf_counter() - t0
    return [
        Outcome(p, True, res.video, res.sha256, compute_s=compute_s)
        if res is not None
        else Outcome(p, False, error=err, compute_s=compute_s)
        for p, res, err in finished
    ]


def _drain(executor: Any, rank: int, cause: BaseException) -> None:
    """Finish the open run without compute, so the other ranks' all-gathers complete (see module doc)."""
    if not executor.in_run:
        raise WaveAborted(
            f"rank {rank}: the run was dropped after {_describe(cause)}; the wave cannot complete", cause
        ) from cause
    try:
        executor.drain()
    except Exception as exc:
        try:
            executor.abort()
        except Exception:  # noqa: BLE001 - already failing; the first error is what matters
            pass
        raise WaveAborted(
            f"rank {rank}: {_describe(cause)}; then serving the remaining all-gathers failed: {_describe(exc)}",
            cause,
        ) from exc
