"""The :class:`~dlo_fn.plan.spec.ModelSpec` of a named reference config, built on the meta device (no storage,
instant even for 400 GB): what the planners and the reproduction read when they size a named model."""

from __future__ import annotations

from dlo_fn.models.configs import get_config
from dlo_fn.models.dit import BLOCK_PATHS, build_model
from dlo_fn.plan.spec import ModelSpec, spec_from_module

__all__ = ["config_spec"]


def config_spec(name: str) -> ModelSpec:
    """Spec of ``CONFIGS[name]`` with its block list ``BLOCK_PATHS``; ``ValueError`` lists the known names."""
    return spec_from_module(build_model(get_config(name), device="meta"), BLOCK_PATHS, name=name)
