"""`python -m dlo_fn demo` and `generate --prompts` as users run them: real subprocesses, real ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ENV = dict(os.environ, OMP_NUM_THREADS="1", DLO_FN_PLATFORM="cpu")


@pytest.mark.timeout(200)
def test_demo_runs_end_to_end_and_checks_hashes(tmp_path):
    cmd = [sys.executable, "-m", "dlo_fn", "demo", "--out", str(tmp_path / "demo")]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ENV)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    out = first.stdout
    assert "demo OK" in out and "MISMATCH" not in out
    assert "leaked semaphore" not in first.stderr, first.stderr[-2000:]  # the ranks leave by os._exit
    assert "tree | idle" in out  # the partial wave: rank 1 only served its shards
    assert "IncompatibleWaveError" in out and "differ in height" in out
    assert "rejected before dispatch: prompt=''" in out
    assert out.count("allgather == resident   ok") == 4 and out.count("allgather == rank-local ok") == 4
    rows = [json.loads(line) for line in (tmp_path / "demo" / "outputs" / "manifest.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["fox", "bird", "tree", "cat", "empty"]
    hashes = {r["id"]: r["sha256"] for r in rows if r["ok"]}
    for rid, sha in hashes.items():
        assert sha in out
    # A second run reuses the checkpoint and reproduces every byte.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ENV)
    assert again.returncode == 0 and "using the checkpoint" in again.stderr
    rows2 = [json.loads(line) for line in (tmp_path / "demo" / "outputs" / "manifest.jsonl").read_text().splitlines()]
    assert {r["id"]: r["sha256"] for r in rows2 if r["ok"]} == hashes


@pytest.mark.timeout(200)
def test_generate_prompts_file_under_torchrun(tmp_path):
    from dlo_fn.models import write_checkpoint
    from dlo_fn.runtime.dist import free_port

    ckpt = write_checkpoint("tiny", tmp_path / "ckpt", seed=0, progress=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            [
                '{"id": "fox", "prompt": "a red fox", "seed": 1}',
                '{"id": "owl", "prompt": "an owl", "seed": 2}',
                '{"id": "big", "prompt": "a big owl", "seed": 2, "height": 48}',
                '{"id": "empty", "prompt": ""}',
                '{"id": "bad", "prompt": "x", "sampler": "unipc"}',
                "{not json",
                '{"id": "cat", "prompt": "a cat", "seed": 4}',
            ]
        )
        + "\n"
    )
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "dlo_fn",
        "generate",
        "--checkpoint",
        str(ckpt),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--steps",
        "2",
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "5",
        "--requests-per-rank",
        "2",
        "--timeout",
        "30",
        "--serving",
        "strict",
    ]  # the waves it checks
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ENV)
    assert proc.returncode != 0, "bad lines must make the exit code non-zero"
    rows = {r["id"]: r for r in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}
    assert list(rows) == ["fox", "owl", "big", "empty", "bad", "line0006", "cat"]
    assert all(rows[i]["ok"] for i in ("fox", "owl", "big", "cat"))
    assert rows["fox"]["wave"] == rows["owl"]["wave"] == rows["cat"]["wave"] == 0  # 2 ranks x R 2
    assert rows["big"]["wave"] == 1
    assert "empty prompts" in rows["empty"]["error"] and "sampler='unipc'" in rows["bad"]["error"]
    assert rows["line0006"]["error"].startswith(f"{prompts}:6:")
    waves = [json.loads(line) for line in (out / "waves.jsonl").read_text().splitlines()]
    assert waves[0]["ranks"] == [["fox", "cat"], ["owl"]] and waves[1]["idle_ranks"] == [1]
