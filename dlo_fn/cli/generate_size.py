"""`generate` without size flags runs the :class:`~dlo_fn.models.Request` default (the published video size, 35
steps): minutes to hours on a CPU even for the tiny model. Before anything loads, rank 0 says so in one line: the
workload, its FLOPs and the least time they take at this device's measured matmul rate, and the flags that make it
a run of seconds.

The blocks' FLOPs per forward of ``L`` tokens, with ``D`` the hidden width, ``M`` the MLP width and ``D_t, T_t``
the text width and length (the weight matmuls of :class:`~dlo_fn.models.DiTConfig`'s block, then attention)::

    F(L) = N_blocks (2 (6 D^2 + 2 D D_t + 2 D M) L + 4 D L^2 + 4 D L T_t)

and a request runs ``rows x steps`` such forwards (``rows``: 2 with CFG).
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["SIZE_FLAGS", "QUICK_FLAGS", "forward_flops", "default_size_note"]

SIZE_FLAGS = ("height", "width", "frames", "steps")
QUICK_FLAGS = "--height 64 --width 64 --frames 5 --steps 4"


def forward_flops(config: Any, tokens: int) -> float:
    """``F(L)`` of the module docstring for one row of ``tokens`` tokens."""
    d, m, dt = config.hidden_dim, config.mlp_dim, config.text_dim
    per_block = 2 * (6 * d * d + 2 * d * dt + 2 * d * m) * tokens + 4 * d * tokens**2 + 4 * d * tokens * config.text_len
    return config.num_blocks * per_block


def default_size_note(args: argparse.Namespace, submissions, config: Any, platform: Any) -> str | None:
    """The one line for a ``--prompt`` run without size flags (None otherwise: a prompts file states its own)."""
    if args.prompts is not None or any(getattr(args, f) is not None for f in SIZE_FLAGS):
        return None
    request = next((s.request for s in submissions if s.request is not None), None)
    if request is None:
        return None
    import torch

    from dlo_fn.runtime.auto import flop_per_s
    from dlo_fn.serve.admission import request_shape

    shape = request_shape(config, request)
    forwards = shape.rows * request.num_inference_steps
    flops = forward_flops(config, shape.tokens) * forwards
    least_s = flops / flop_per_s(platform, torch.bfloat16)
    cfg = " with CFG" if request.cfg else ""
    return (
        f"no --height/--width/--frames/--steps given: each prompt runs the default {request.width}x{request.height}, "
        f"{request.num_frames} frames, {request.num_inference_steps} steps{cfg} ({forwards} forwards of "
        f"{shape.tokens} tokens, {flops / 1e12:.1f} TFLOP in the blocks): at least {_duration(least_s)} per prompt "
        f"at this {platform.kind.upper()}'s measured matmul rate; {QUICK_FLAGS} runs in seconds"
    )


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
