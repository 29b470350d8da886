"""Record one offloaded run of a reference DiT as a measured :class:`~dlo_fn.plan.timeline.Timeline`.

:func:`record_run` builds a named config on the CPU (or a given platform), offloads it (``record_timeline=True``),
runs a short warm-up request (first calls pay one-off costs: allocator, kernel selection), then one CFG request of
``steps`` denoising steps inside one explicit executor run, and returns the schedule that run followed with the
executor's measured spans of it (device events on CUDA/NPU, host clocks on CPU). Allgather mode uses
a real process group: the current one when this process already joined one of world size 1, else a 1-rank group
(gloo on CPU) that is created here and destroyed afterwards, so the all-gather path is measured as it runs on
several ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dlo_fn.plan.compare import single_run
from dlo_fn.plan.modes import OFFLOAD_MODES
from dlo_fn.plan.schedule import Schedule
from dlo_fn.plan.timeline import Timeline
from dlo_fn.runtime.dist import init_distributed
from dlo_fn.runtime.platform import Platform, platform_for

__all__ = ["MEASURE_SHAPE", "record_run"]

# A small video (2 latent frames of 8x8 for the tiny config): every block runs, and a CPU run takes well under a
# second.
MEASURE_SHAPE = {"height": 64, "width": 64, "num_frames": 5}


def record_run(
    config: str = "tiny",
    steps: int = 2,
    mode: str = "allgather",
    *,
    warmup_steps: int = 1,
    seed: int = 0,
    num_slots: int = 2,
    platform: Platform | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[Schedule, Timeline]:
    """``(schedule, measured)`` of one run of ``steps`` steps (``measured`` without run prefixes, times from the
    first warm-up op). After a warm-up (``warmup_steps >= 1``) the run starts warm: block 0 was prefetched by the
    warm-up run (``schedule.warm_start``); ``warmup_steps=0`` measures the cold first run.

    ``mode`` is ``"allgather"`` or ``"rank-local"`` (``"resident"`` runs no schedule and is refused);
    ``platform`` defaults to the CPU (pass ``detect_platform(0)`` to measure an accelerator).
    """
    from dlo_fn.models import BLOCK_PATHS, Request, build_model, generate
    from dlo_fn.runtime.offload import offload

    if mode not in OFFLOAD_MODES:
        raise ValueError(
            f"record_run measures an offloaded schedule: mode must be one of "
            f"{', '.join(OFFLOAD_MODES)}, got {mode!r} (resident mode has no schedule to record)"
        )
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    platform = platform or platform_for("cpu")
    created = mode == "allgather" and not (dist.is_available() and dist.is_initialized())
    if created:
        ctx = init_distributed(platform, single_process_group=True)
    elif mode == "allgather":
        ctx = init_distributed(platform)
    else:
        from dlo_fn.runtime.dist import DistContext

        ctx = DistContext(0, 1, 0, platform, None)
    try:
        if ctx.world_size != 1:
            raise ValueError(
                f"record_run measures one process, but this one is in a group of {ctx.world_size} "
                f"ranks: call it outside that group (or destroy it first)"
            )
        model = build_model(config, device=platform.device, dtype=dtype, seed=seed)
        off = offload(model, BLOCK_PATHS, ctx, mode=mode, num_slots=num_slots, record_timeline=True)
        if warmup_steps:
            with off.run(num_steps=warmup_steps):
                generate(off.model, Request("warm-up", seed=seed, num_inference_steps=warmup_steps, **MEASURE_SHAPE))
        request = Request("a red fox in snow", seed=seed, num_inference_steps=steps, **MEASURE_SHAPE)
        with off.run(num_steps=steps) as schedule:
            generate(off.model, request)
        name = config if isinstance(config, str) else config.name
        measured = off.executor.take_timeline((("config", name), ("num_steps", str(steps))))
    finally:
        if created:
            dist.destroy_process_group()
    return schedule, single_run(measured, 1 if warmup_steps else 0)
