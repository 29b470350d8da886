"""The one definition of how block weights reach the device.

======================  =========================================================================================
mode                    what each rank does per block
======================  =========================================================================================
``allgather``           H2D of its 1/W shard into a landing buffer, then an all-gather into a slot (sharded host
                        memory: each rank holds M / W)
``rank-local``          H2D of the whole block from its own host copy into a slot (no collective; host M per
                        rank, or one shared page cache with the ``mmap`` source)
``resident``            no offload: every weight stays on the device (the baseline every mode must equal)
======================  =========================================================================================
"""

from __future__ import annotations

__all__ = ["OFFLOAD_MODES", "MODES", "check_mode"]

OFFLOAD_MODES = ("allgather", "rank-local")
"""Modes that stream blocks through slots (the executor's and the schedule's modes)."""

MODES = OFFLOAD_MODES + ("resident",)
"""Every mode a user can ask for."""


def check_mode(mode: str, allowed: tuple[str, ...] = MODES, what: str = "mode") -> str:
    """``mode`` if it is one of ``allowed``, else a ValueError naming the choices."""
    if mode not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}; got {mode!r}")
    return mode
