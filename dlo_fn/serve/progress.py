"""Rank 0's progress bar in continuous serving: requests done of those arrived, how many wait, the ring step.

A bar is for a person at a terminal: with ``EngineOptions(progress=None)`` (what ``generate`` passes) tqdm shows
it only when stderr is a terminal, so logs and pipes get the log lines alone. While it is shown, log lines print
above it (``logging_redirect_tqdm``), not through it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["RingProgress", "ring_progress"]


class RingProgress:
    """``done / arrived`` requests, with ``queued`` and the ``ring step`` beside them."""

    def __init__(self, enabled: bool | None) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=0, unit="request", desc="serving", leave=True, disable=None if enabled is None else not enabled
        )

    def show(self, done: int, arrived: int, queued: int, step: int) -> None:
        if self.bar.disable:
            return
        self.bar.total = arrived
        self.bar.n = done
        self.bar.set_postfix_str(f"queued {queued}, ring step {step}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


@contextlib.contextmanager
def ring_progress(enabled: bool | None) -> Iterator[RingProgress]:
    from tqdm.contrib.logging import logging_redirect_tqdm

    progress = RingProgress(enabled)
    try:
        with logging_redirect_tqdm():
            yield progress
    finally:
        progress.close()
