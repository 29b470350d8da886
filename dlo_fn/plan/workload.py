"""What one request asks of every block: a workload, described by its sequence and its passes.

=================  ==============================================================================
field              meaning
=================  ==============================================================================
``tokens``         sequence length ``L`` of one CFG branch (the models' ``tokens_for(config, H, W, F)``)
``cfg_branches``   branches batched per step: 2 with classifier-free guidance, 1 without
``num_steps``      denoising steps, i.e. passes over the blocks per request
=================  ==============================================================================

A block computes over ``L x cfg_branches`` tokens per step (:attr:`Workload.step_tokens`); how long that
takes is a property of the machine, not of the workload, so measured compute lives beside the machine's other
ceilings (``dlo_fn.cost.ceilings``), keyed by the workload's name.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Workload"]


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    tokens: int
    num_steps: int = 1
    cfg_branches: int = 2

    def __post_init__(self) -> None:
        for field in ("tokens", "num_steps", "cfg_branches"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload {self.name!r}: {field} must be an int >= 1, got {value!r}")

    @property
    def step_tokens(self) -> int:
        """Tokens each block computes per step: ``L x cfg_branches``."""
        return self.tokens * self.cfg_branches
