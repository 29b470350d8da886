"""Shared test settings."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads, and OpenMP spinning on a shared 2-core machine is slow. Tests that
    check thread independence set their own counts."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """The tiny reference DiT (bf16, seed 0) written once for the whole run; tests only read it."""
    from dlo_fn.models import write_checkpoint

    return str(write_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0, progress=False))


@pytest.fixture(scope="session")
def checkpoint(tiny_checkpoint: str) -> str:
    return tiny_checkpoint
