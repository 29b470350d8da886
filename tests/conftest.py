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


def resident_expected(checkpoint: str, requests) -> dict:
    """Every request with a prompt run alone on the resident model, by the id ``as_submissions`` gives it
    (``req0000``, ...): the bytes every served output must equal."""
    from dlo_fn.models import generate
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.serve.local import open_model

    torch.set_num_threads(1)
    model, _ = open_model(checkpoint, init_distributed(), "resident")
    return {f"req{i:04d}": generate(model, r) for i, r in enumerate(requests) if r.prompt}


MIXED_SHAPE = dict(height=32, width=32, num_frames=5, num_inference_steps=3)


def mixed_request(prompt: str, seed: int, **kw):
    """A tiny request of :data:`MIXED_SHAPE`, fields overridden by ``kw``."""
    from dlo_fn.models.request import Request

    return Request(prompt=prompt, seed=seed, **{**MIXED_SHAPE, **kw})


def mixed_requests() -> tuple:
    """The continuous-serving trace: two heights, three step counts, CFG on and off, another guidance, one
    empty prompt (rejected), and one image (``num_frames=1``)."""
    r = mixed_request
    return (r("a red fox", 1), r("a blue bird", 2, num_inference_steps=5), r("a tall tree", 3, height=48),
            r("a cat", 4, guidance_scale=1.0), r("", 5), r("a boat", 6, num_inference_steps=2),
            r("a red fox", 7, guidance_scale=3.0, num_frames=1))


def engine_options(**kw):
    """Engine options for multi-rank tests: small timeouts, no progress bar (the serving mode is the default
    unless given)."""
    from dlo_fn.serve.requests import EngineOptions

    return EngineOptions(**{"timeout_s": 4.0, "grace_s": 1.0, "progress": False, **kw})
