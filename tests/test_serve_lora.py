"""Per-request adapters in serving: ``Request.lora`` / ``lora_scale`` name an adapter the engine's model has loaded
(dlo_fn.models.lora); requests with different adapters and none run at once (on one rank sharing each load, and
on 2 gloo ranks), continuous and strict, each output byte-identical to the request run alone on the resident
model with its adapter; a request naming an unknown adapter gets one line and the others run."""

from __future__ import annotations

import pathlib
import tempfile

import pytest
from conftest import engine_options, mixed_request, scenario

from dlo_fn.models import generate
from dlo_fn.models.lora import load_adapter, write_adapter
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.platform import platform_for
from dlo_fn.serve.engine import Engine
from dlo_fn.serve.local import open_model
from dlo_fn.serve.requests import as_submissions

pytest.importorskip("peft")
CTX = DistContext(0, 1, 0, platform_for("cpu"), None)
r = mixed_request
REQUESTS = (
    r("a red fox", 1, lora="a"),
    r("a blue bird", 2),
    r("a cat", 3, lora="b", lora_scale=0.5),
    r("a boat", 4, lora="style-z"),  # not loaded: rejected
    r("a red fox", 1),
    r("a tall tree", 5, lora="a", lora_scale=-0.3),
)
UNKNOWN = "req0003"


def with_adapters(checkpoint: str, ctx, mode: str, root: pathlib.Path):
    """The tiny model opened in ``mode`` with adapters ``a`` and ``b`` (written under ``root``) loaded."""
    model, off = open_model(checkpoint, ctx, mode)
    for i, name in enumerate("ab"):
        path = root / f"{name}.safetensors"
        if not path.exists():
            write_adapter(model, path, rank=4, seed=i)
        load_adapter(model, path, name)
    return model, off


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def expected(checkpoint, adapter_dir) -> dict:
    model, _ = with_adapters(checkpoint, CTX, "resident", adapter_dir)
    return {f"req{i:04d}": generate(model, q).sha256 for i, q in enumerate(REQUESTS) if f"req{i:04d}" != UNKNOWN}


def check(results, expected) -> None:
    assert len(results) == len(REQUESTS)
    for res in results:
        if res.request_id == UNKNOWN:
            assert not res.ok and "lora='style-z' is not loaded (loaded: ['a', 'b'])" in res.error
            assert "\n" not in res.error
        else:
            assert res.ok and res.sha256 == expected[res.request_id], (res.request_id, res.error)


def test_expected_outputs_differ_by_adapter(expected):
    assert len({expected[k] for k in ("req0000", "req0002", "req0004", "req0005")}) == 4


@pytest.mark.parametrize("serving, r_", [("continuous", 1), ("continuous", 3), ("strict", 1)])
def test_one_rank_serves_each_request_with_its_adapter(checkpoint, adapter_dir, expected, serving, r_):
    model, off = with_adapters(checkpoint, CTX, "allgather", adapter_dir)
    engine = Engine(model, off, CTX, engine_options(serving=serving, requests_per_rank=r_, timeout_s=30.0))
    report = engine.serve(as_submissions(REQUESTS))
    check(report.results, expected)


def serve_rank(ctx, checkpoint: str) -> list:
    """On W gloo ranks (allgather): every rank loads the same adapters; rank 0 serves :data:`REQUESTS`
    continuous then strict and returns ``(request_id, ok, sha256, error)`` per result of each."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for serving in ("continuous", "strict"):
            model, off = with_adapters(checkpoint, ctx, "allgather", pathlib.Path(tmp))
            engine = Engine(model, off, ctx, engine_options(serving=serving, timeout_s=60.0), session=serving)
            if ctx.rank == 0:
                try:
                    report = engine.serve(as_submissions(REQUESTS))
                finally:
                    engine.close()
                out.append([(x.request_id, x.ok, x.sha256, x.error) for x in report.results])
            else:
                engine.follow()
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_gloo_ranks_serve_each_request_with_its_adapter(request, expected):
    from types import SimpleNamespace

    reports = scenario(request, 2, "serve_lora")[0]
    assert len(reports) == 2
    for rows in reports:
        check([SimpleNamespace(request_id=i, ok=ok, sha256=h, error=e) for i, ok, h, e in rows], expected)
