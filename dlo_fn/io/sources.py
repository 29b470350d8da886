"""Where a :class:`~dlo_fn.plan.spec.ModelSpec` comes from: a named config (built on the meta device) or a
checkpoint (its safetensors headers, checked against the model its ``config.json`` describes). Reads files,
so it lives in the runtime, not in the planners."""

from __future__ import annotations

import os
from typing import Sequence

import torch

from dlo_fn.plan.spec import ModelSpec, spec_from_header, spec_from_module

__all__ = ["spec_for"]


def spec_for(
    model_or_checkpoint: str | os.PathLike,
    block_paths: Sequence[str] | None = None,
    *,
    validate: bool = True,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    subfolder: str | None = None,
    torch_dtype: torch.dtype | None = None,
) -> ModelSpec:
    """Spec of a named reference-DiT config, or of a checkpoint directory / file / index / cached HF repo id.

    Named configs are built on ``meta`` (no storage, instant even for 400 GB). A checkpoint whose
    ``config.json`` describes a model (dlo_fn or diffusers) is checked, with ``validate`` (the default), against
    that model built on ``meta`` exactly as :func:`dlo_fn.io.load.load_checkpoint` checks it (every name,
    shape and dtype, from the headers alone), so a plan fails where a load would, with the same
    :class:`~dlo_fn.io.checkpoint.CheckpointError`; the spec is then that model's, as ``offload`` sees it.
    Without such a config (or with ``validate=False``) it comes from the headers alone. ``block_paths``
    defaults to the model's block lists (dlo_fn: ``blocks``; diffusers: detected), or for headers alone to the
    detected ``<path>.<index>.`` lists. Every bad input is a ``CheckpointError``."""
    from dlo_fn.io.checkpoint import CheckpointError, open_checkpoint
    from dlo_fn.models import BLOCK_PATHS, CONFIGS, build_model

    name = os.fspath(model_or_checkpoint)
    if name in CONFIGS:
        model = build_model(CONFIGS[name], device="meta")
        return spec_from_module(model, block_paths or BLOCK_PATHS, name=name)
    if not os.path.lexists(name) and "/" not in name:
        raise CheckpointError(
            f"{name!r} is neither a named config ({', '.join(CONFIGS)}) nor a checkpoint path or repo id",
            file=name,
        )
    ckpt = open_checkpoint(name, cache_dir=cache_dir, revision=revision, subfolder=subfolder)
    label = str(ckpt.root.name or name)
    config_file = ckpt.root / "config.json"
    if validate and _describes_a_model(ckpt.config):
        from dlo_fn.io.diffusers_load import block_paths_for
        from dlo_fn.io.load import build_for_checkpoint, plan_targets
        from dlo_fn.io.quantized import stored_format

        model, by_diffusers = build_for_checkpoint(ckpt, None, torch_dtype)
        stored = getattr(stored_format(ckpt), "keys", ())  # a quantised checkpoint's FP8 tensors
        plan_targets(ckpt, model, cast_dtype=True if by_diffusers else None, stored=stored)
        try:
            paths = block_paths or (block_paths_for(model) if by_diffusers else BLOCK_PATHS)
            return spec_from_module(model, paths, name=label)
        except ValueError as exc:
            raise CheckpointError(f"{exc}", file=config_file) from None
    try:
        return spec_from_header(ckpt.header, block_paths, name=label)
    except ValueError as exc:
        raise CheckpointError(f"cannot plan from the headers alone: {exc}", file=ckpt.root) from None


def _describes_a_model(config) -> bool:
    from dlo_fn.io.bind import DLO_MODEL_TYPE
    from dlo_fn.io.diffusers_load import is_diffusers_config

    return isinstance(config, dict) and (config.get("model_type") == DLO_MODEL_TYPE or is_diffusers_config(config))
