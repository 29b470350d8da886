"""DP engine in one process (no process group): block-major R-request batches, validation, forced waves,
outputs and manifests, in strict (wave) serving. Multi-rank behaviour (lockstep waves, modes, faults) is in
test_engine_ranks.py."""

from __future__ import annotations

import json

import pytest
import torch

from dlo_fn.cost.waves import IncompatibleWaveError
from dlo_fn.models import Request, generate
from dlo_fn.runtime.dist import init_distributed
from dlo_fn.serve.engine import Engine
from dlo_fn.serve.local import open_model
from dlo_fn.serve.outputs import read_manifest, video_sha256
from dlo_fn.serve.requests import EngineOptions, Submission, read_prompts, wave_table
from dlo_fn.serve.writer import write_outputs

SHAPE = dict(height=32, width=32, num_frames=5, num_inference_steps=3)


def _req(prompt="a red fox", seed=0, **kw) -> Request:
    return Request(prompt=prompt, seed=seed, **{**SHAPE, **kw})


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Each request generated alone by the resident model: what every engine run must reproduce bit for bit."""
    torch.set_num_threads(1)
    model, _ = open_model(checkpoint, init_distributed(), "resident")
    return lambda request: generate(model, request)


def _engine(checkpoint, mode="allgather", **options):
    model, off = open_model(checkpoint, init_distributed(), mode)
    return Engine(model, off, off.ctx, EngineOptions(progress=False, serving="strict", **options)), off


@pytest.mark.parametrize("mode, r", [("allgather", 3), ("rank-local", 2), ("resident", 2)])
def test_block_major_batches_are_bit_identical_to_single_runs(checkpoint, reference, mode, r):
    engine, off = _engine(checkpoint, mode, requests_per_rank=r)
    reqs = [
        _req(seed=1),
        _req("a blue bird", seed=2, negative_prompt="blurry"),
        _req(seed=3, guidance_scale=1.0),
        _req("a cat", seed=4),
        _req(seed=5, outputs_per_prompt=2),
    ]
    report = engine.serve(reqs)
    assert [res.request_id for res in report.results] == [f"req{i:04d}" for i in range(5)]  # request order
    for req, res in zip(reqs, report.results):
        ref = reference(req)
        assert res.ok, res.error
        assert torch.equal(res.video, ref.video) and res.sha256 == ref.sha256
    # Keys: {seeds 1, 2, 4 | batched up to R}, {cfg off}, {2 outputs}.
    assert sorted(w.num_requests for w in report.waves) == {3: [1, 1, 3], 2: [1, 1, 1, 2]}[r]
    if off.executor is not None:  # one executor run per batch: R requests share each block load
        assert off.executor.stats.runs == len(report.waves)


def test_bad_requests_rejected_before_dispatch(checkpoint):
    engine, off = _engine(checkpoint)
    subs = [
        Submission("empty", _req("")),
        Submission("steps", _req(num_inference_steps=-1)),
        Submission("patch", _req(height=36)),
        Submission("sampler", _req(sampler="dpm++")),
        Submission("parse", None, "prompts.jsonl:3: Expecting value"),
        Submission("good", _req()),
    ]
    report = engine.serve(subs)
    err = {r.request_id: r.error for r in report.results}
    assert "empty prompts are rejected" in err["empty"]
    assert "num_inference_steps=-1" in err["steps"]
    assert "height=36" in err["patch"] and "multiple of 16" in err["patch"]
    assert "sampler='dpm++'" in err["sampler"]
    assert err["parse"].startswith("prompts.jsonl:3")
    assert err["good"] is None and report.by_id()["good"].ok
    assert all(r.wave_id is None for r in report.results if not r.ok)  # never dispatched
    assert off.executor.stats.runs == 1


def test_forced_mixed_wave_rejected_naming_fields(checkpoint):
    engine, off = _engine(checkpoint, requests_per_rank=2)
    with pytest.raises(IncompatibleWaveError, match="differ in height, num_inference_steps") as info:
        engine.serve_forced([[_req(), _req(height=48, num_inference_steps=2)]])
    assert info.value.fields == ("height", "num_inference_steps")
    assert off.executor.stats.runs == 0  # nothing ran
    report = engine.serve_forced([[_req(seed=1), _req("other", seed=2)]])
    assert report.ok and len(report.waves) == 1 and report.waves[0].num_requests == 2


def test_outputs_and_manifest(checkpoint, tmp_path):
    engine, _ = _engine(checkpoint)
    report = engine.serve([Submission("a/b", _req(seed=7, outputs_per_prompt=2)), Submission("bad", _req(""))])
    manifest = write_outputs(tmp_path, report)
    rows = read_manifest(manifest)
    assert [r["id"] for r in rows] == ["a/b", "bad"]
    good, bad = rows
    assert good["files"] == ["0000-a_b.npy", "0000-a_b.png"] and good["shape"] == [2, 5, 32, 32, 3]
    import numpy as np

    assert video_sha256(np.load(tmp_path / good["files"][0])) == good["sha256"]
    assert good["settings"]["seed"] == 7 and good["seed"] == 7 and good["wave"] == 0 and good["rank"] == 0
    assert set(good["timings"]) == {"queued_s", "wave_s", "compute_s"}
    assert not bad["ok"] and "empty" in bad["error"] and bad["files"] == []
    from PIL import Image

    assert Image.open(tmp_path / good["files"][1]).size == (5 * 32, 2 * 32)  # 5 frames x 2 outputs
    waves = [json.loads(line) for line in (tmp_path / "waves.jsonl").read_text().splitlines()]
    assert waves[0]["ranks"] == [["a/b"]] and waves[0]["status"] == "ok"
    assert "a/b" in wave_table(report)


def test_read_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"id": "x", "prompt": "hi", "seed": 3}\n\n# note\n[1]\n{"prompt": "yo", "colour": 1}\n{"prompt": "ok"}\n'
    )
    subs = read_prompts(path, {"num_inference_steps": 2, "seed": 9})
    assert [s.request_id for s in subs] == ["x", "line0004", "line0005", "line0006"]
    assert subs[0].request.seed == 3 and subs[0].request.num_inference_steps == 2
    assert subs[3].request.seed == 9
    assert f"{path}:4: expected a JSON object" in subs[1].error
    assert "unknown field(s) ['colour']" in subs[2].error
    with pytest.raises(FileNotFoundError, match="prompts file not found"):
        read_prompts(tmp_path / "missing.jsonl")


def test_stream_bounded_wait_fills_waves_then_gives_up(checkpoint, reference):
    import queue
    import threading
    import time

    engine, off = _engine(checkpoint, requests_per_rank=2, max_wait_s=1.0)
    source: queue.Queue = queue.Queue()
    reqs = [_req(seed=i) for i in range(4)] + [_req(height=48)]

    def producer():
        source.put(reqs[0])
        source.put(reqs[4])  # another key: waits alone, then goes out partial
        time.sleep(0.2)
        source.put(reqs[1])  # fills reqs[0]'s wave within the bound
        time.sleep(0.2)
        source.put(Submission("bad", _req("")))
        source.put("not a request")  # a bad item is an error result, not the end of the stream
        source.put(Submission("bad", _req("dup")))  # a duplicate id likewise
        source.put(reqs[2])
        time.sleep(2.5)  # longer than the bound: reqs[2] leaves alone
        source.put(reqs[3])
        source.put(None)

    thread = threading.Thread(target=producer)
    thread.start()
    report = engine.serve_stream(source)
    thread.join()
    ids = [r.request_id for r in report.results]
    assert ids == ["req0000", "req0001", "req0002", "bad", "item0004", "bad#dup5", "req0006", "req0007"]
    # Submission indices per wave: the pair filled within the bound, then the lone other key (due at 1 s),
    # then reqs[2] alone (its bound passed before reqs[3] came), then reqs[3] at close.
    assert [w.rank_indices[0] for w in report.waves] == [(0, 2), (1,), (6,), (7,)]
    assert report.by_id()["bad"].error.startswith("rejected before dispatch")
    assert "is a str" in report.by_id()["item0004"].error
    assert "duplicate request id 'bad'" in report.by_id()["bad#dup5"].error
    arrived = [reqs[0], reqs[4], reqs[1], None, None, None, reqs[2], reqs[3]]
    for res, req in zip(report.results, arrived):
        assert res.ok == (req is not None)
        if req is not None:
            assert res.sha256 == reference(req).sha256


@pytest.mark.parametrize("mode", ["allgather", "rank-local"])
def test_engine_with_an_hbm_budget_is_bit_identical(checkpoint, reference, mode):
    """The ring's minimum plus one block: one block resident, the rest streamed, R = 2 requests per load."""
    _, plain = open_model(checkpoint, init_distributed(), mode)
    budget = plain.device_weight_bytes + max(plain.spec.block_bytes)
    model, off = open_model(checkpoint, init_distributed(), mode, hbm_budget=budget)
    assert len(off.resident_blocks) == 1 and off.device_weight_bytes <= budget
    engine = Engine(model, off, off.ctx, EngineOptions(progress=False, serving="strict", requests_per_rank=2))
    reqs = [_req(seed=1), _req("a cat", seed=4), _req(seed=3, guidance_scale=1.0)]
    for req, res in zip(reqs, engine.serve(reqs).results):
        ref = reference(req)
        assert res.ok, res.error
        assert torch.equal(res.video, ref.video) and res.sha256 == ref.sha256
