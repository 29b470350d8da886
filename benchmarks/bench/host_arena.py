"""The host arena measured in this process: what each rank's real host store allocates for a model, to set
beside the planned pinned bytes per rank (:func:`dlo_fn.cost.memory.pinned_host_bytes_per_rank`; notebook 04)."""

from __future__ import annotations

__all__ = ["measured_host_arena_bytes"]


def measured_host_arena_bytes(config: str = "tiny", world_size: int = 2) -> tuple[int, ...]:
    """Build ``config`` on the CPU and each rank's real host store (the exact-size shard arena of
    :mod:`dlo_fn.runtime.host_store`) in this process; return the bytes each rank allocated."""
    from dlo_fn.models import BLOCK_PATHS, build_model
    from dlo_fn.plan.layout import model_layout
    from dlo_fn.plan.spec import spec_from_module
    from dlo_fn.runtime.host_store import build_host_store
    from dlo_fn.runtime.platform import platform_for

    model = build_model(config, device="cpu")
    spec = spec_from_module(model, BLOCK_PATHS, name=config)
    layout = model_layout(spec, world_size)
    blocks = [dict(model.get_submodule(b.name).state_dict()) for b in spec.blocks]
    platform = platform_for("cpu")
    stores = [build_host_store(layout, r, blocks, platform) for r in range(world_size)]
    return tuple(s.arena_bytes for s in stores)
