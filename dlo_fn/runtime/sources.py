"""Where a :class:`~dlo_fn.plan.spec.ModelSpec` comes from: a named config (built on the meta device) or a
checkpoint (its safetensors headers only). Reads files, so it lives in the runtime, not in the planners."""

from __future__ import annotations

import os
from typing import Sequence

from dlo_fn.plan.spec import ModelSpec, spec_from_header, spec_from_module


def spec_for(model_or_checkpoint: str | os.PathLike, block_paths: Sequence[str] | None = None) -> ModelSpec:
    """Spec of a named reference-DiT config, or of a checkpoint directory / file / cached HF repo id.

    Named configs are built on ``meta`` (no storage, instant even for 400 GB). Checkpoints are described from
    their headers; ``block_paths`` defaults to the auto-detected ``<path>.<index>.`` lists."""
    from dlo_fn.models import BLOCK_PATHS, CONFIGS, build_model

    name = os.fspath(model_or_checkpoint)
    if name in CONFIGS:
        model = build_model(CONFIGS[name], device="meta")
        return spec_from_module(model, block_paths or BLOCK_PATHS, name=name)
    from dlo_fn.runtime.checkpoint import CheckpointError, open_checkpoint

    if not os.path.exists(name) and "/" not in name:
        raise CheckpointError(
            f"{name!r} is neither a named config ({', '.join(CONFIGS)}) nor a checkpoint path or repo id",
            file=name,
        )
    ckpt = open_checkpoint(name)
    if block_paths is None and (ckpt.config or {}).get("model_type") == "dlo_fn-video-dit":
        block_paths = BLOCK_PATHS
    return spec_from_header(ckpt.header, block_paths, name=str(ckpt.root.name or name))
