"""Results written as they finish (dlo_fn.serve.writer): a request's files and manifest line are on disk the moment
the engine has its result, a stop gives every other request a "not completed" line, a reused output folder is
refused or cleaned; and under torchrun, a worker that exits (the agent then SIGTERMs rank 0) or a SIGTERM while
rank 0 waits inside a collective loses nothing already finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

from dlo_fn.models import Request
from dlo_fn.serve.outputs import RunInfo, read_manifest, video_sha256
from dlo_fn.serve.requests import RequestResult, ServeReport, Submission
from dlo_fn.serve.writer import ExistingOutputError, ResultWriter, check_out

ENV = dict(os.environ, OMP_NUM_THREADS="1", DLO_FN_PLATFORM="cpu")
SHAPE = dict(height=32, width=32, num_frames=5)


def _video(seed: int) -> torch.Tensor:
    return torch.randint(0, 255, (1, 2, 8, 8, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _subs(n: int) -> list[Submission]:
    return [Submission(f"r{i}", Request(f"p{i}", seed=i)) for i in range(n)]


def _ok(i: int, sub: Submission) -> RequestResult:
    video = _video(i)
    return RequestResult(i, sub.request_id, sub.request, True, video, video_sha256(video), rank=0)


def test_each_result_is_on_disk_when_written_and_a_stop_completes_the_manifest(tmp_path):
    subs = _subs(4)
    writer = ResultWriter(tmp_path / "out", expected=subs, info=RunInfo("allgather", 2, 1, 1, "continuous"))
    writer.write(_ok(2, subs[2]))  # finishes first
    rows = read_manifest(tmp_path / "out" / "manifest.jsonl")  # another process could read it now
    assert [r["id"] for r in rows] == ["r2"] and rows[0]["files"] == ["0002-r2.npy", "0002-r2.png"]
    assert video_sha256(np.load(tmp_path / "out" / "0002-r2.npy")) == rows[0]["sha256"]
    writer.write(RequestResult(0, "r0", subs[0].request, False, error="rejected before dispatch: x"))
    writer.write(_ok(2, subs[2]))  # once per submission
    assert writer.stop("the run was stopped (SIGTERM)") == 2
    writer.write(_ok(1, subs[1]))  # nothing after a stop
    rows = {r["id"]: r for r in read_manifest(tmp_path / "out" / "manifest.jsonl")}
    assert list(rows) == ["r2", "r0", "r1", "r3"]  # the order things ended in
    assert rows["r1"]["error"] == rows["r3"]["error"] == "not completed: the run was stopped (SIGTERM)"
    assert rows["r2"]["mode"] == "allgather" and rows["r2"]["serving"] == "continuous"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["0002-r2.npy", "0002-r2.png", "manifest.jsonl"]


def test_finish_rewrites_the_manifest_in_submission_order(tmp_path):
    subs = _subs(3)
    results = tuple(_ok(i, s) for i, s in enumerate(subs))
    report = ServeReport(results, (), "allgather", 1, 1, 0.0, serving="strict")
    writer = ResultWriter(tmp_path, info=RunInfo.of(report))
    writer.write(results[2])
    assert writer.finish(report) == tmp_path / "manifest.jsonl"
    assert [r["id"] for r in read_manifest(tmp_path / "manifest.jsonl")] == ["r0", "r1", "r2"]
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.jsonl"))[1:]  # no waves, no empty file


def test_a_published_result_is_kept_without_its_video_when_asked():
    """generate writes each video as it ends (keep_videos=False): rank 0 then holds its shape, not its bytes, so a
    long serve does not keep every video until the end; without a publisher nothing is dropped."""
    from dlo_fn.serve.requests import ResultBook

    sub = _subs(1)[0]
    seen = []
    book = ResultBook(seen.append, keep_videos=False)
    book[0] = _ok(0, sub)
    assert seen[0].video is not None and book[0].video is None and book[0].shape == (1, 2, 8, 8, 3)
    assert book[0].sha256 == seen[0].sha256 and book[0].ok
    kept = ResultBook(None, keep_videos=False)
    kept[0] = _ok(0, sub)
    assert kept[0].video is not None


def test_a_reused_folder_is_refused_or_cleaned_of_our_files_only(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    check_out(out)  # a folder without our files is fine
    ResultWriter(out).write(_ok(0, _subs(1)[0]))
    with pytest.raises(ExistingOutputError, match="earlier run's outputs .*--out-exists clean"):
        check_out(out)
    with pytest.raises(ExistingOutputError):
        ResultWriter(out)
    ResultWriter(out, existing="clean")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.jsonl", "notes.txt"]
    assert (out / "manifest.jsonl").read_text() == ""


def test_generate_refuses_a_reused_out_before_loading_or_cleans_it(checkpoint, tmp_path, capsys):
    from dlo_fn.cli import main

    out = tmp_path / "out"
    argv = [
        "generate",
        "--checkpoint",
        checkpoint,
        "--prompt",
        "a fox",
        "--steps",
        "1",
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "5",
        "--out",
        str(out),
    ]
    assert main(argv + ["--prompt", "an owl"]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dlo_fn generate: error: --out {out} holds an earlier run's"), err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing touched
    assert main(argv + ["--out-exists", "clean"]) == 0
    assert [r["id"] for r in read_manifest(out / "manifest.jsonl")] == ["req0000"]
    assert not (out / "0001-req0001.npy").exists()


def test_generate_help_says_what_a_reused_out_gets(capsys):
    from dlo_fn.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--out-exists {refuse,clean}" in text and "is refused before anything loads" in text
    assert "not completed" in text and "ring step" in text  # on SIGTERM; the fault's step in continuous serving


PROMPTS = [  # two ranks, FIFO, R = 1: a | b at ring step 0, c | d at step 1, e at step 2 (d: steps 1-3); e runs
    # long enough (seconds) that a SIGTERM finds it, and f, queued behind it, unfinished
    {"id": "a", "prompt": "a fox", "seed": 1, "num_inference_steps": 1},
    {"id": "b", "prompt": "an owl", "seed": 2, "num_inference_steps": 1},
    {"id": "bad", "prompt": "x", "sampler": "unipc"},
    {"id": "c", "prompt": "a cat", "seed": 3, "num_inference_steps": 1},
    {"id": "d", "prompt": "a dog", "seed": 4, "num_inference_steps": 3},
    {"id": "e", "prompt": "an eel", "seed": 5, "num_inference_steps": 300},
    {"id": "f", "prompt": "a fig", "seed": 6, "num_inference_steps": 2},
]
FINISHED = ("a", "b", "c")  # before ring step 3


@pytest.fixture(scope="module")
def finished_expected(checkpoint):
    from conftest import resident_expected

    runs = resident_expected(
        checkpoint,
        [Request(**{k: v for k, v in p.items() if k != "id"}, **SHAPE) for p in PROMPTS if p["id"] in FINISHED],
    )
    return {rid: runs[f"req{i:04d}"].sha256 for i, rid in enumerate(FINISHED)}


def _torchrun(checkpoint, tmp_path, fault: dict, timeout_s: float = 30.0) -> tuple[list, subprocess.Popen]:
    from dlo_fn.runtime.dist import free_port

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
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
        checkpoint,
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "out"),
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "5",
        "--timeout",
        str(timeout_s),
    ]
    env = dict(ENV, DLO_FN_FAULT=json.dumps(fault))
    return cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _check_lines(out, expected) -> dict:
    """Exactly one line per prompts line; the finished ones with their files and the resident bytes; every other
    one says why it has none."""
    import hashlib

    rows = {r["id"]: r for r in read_manifest(out / "manifest.jsonl")}
    assert sorted(rows) == sorted(p["id"] for p in PROMPTS)
    for rid in FINISHED:
        row = rows[rid]
        assert row["ok"] and row["sha256"] == expected[rid], row
        assert hashlib.sha256(np.load(out / row["files"][0]).tobytes()).hexdigest() == row["sha256"]
    assert "sampler='unipc'" in rows["bad"]["error"]
    assert not list(out.glob("*.tmp"))
    return rows


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_worker_exit_keeps_every_finished_result(checkpoint, tmp_path, finished_expected):
    """The issue's case: rank 1 exits at ring step 3, torchrun's agent SIGTERMs rank 0; --out has every result
    finished before (the rejected line included) and a line for each other request."""
    cmd, proc = _torchrun(checkpoint, tmp_path, {"rank": 1, "kind": "exit", "step": 3})
    log, _ = proc.communicate(timeout=200)
    assert proc.returncode != 0, log[-3000:]
    rows = _check_lines(tmp_path / "out", finished_expected)
    # d was on rank 1; rank 0 goes on degraded until the agent's SIGTERM reaches it (which a loaded machine may
    # delay past e's end: then e is written like any finished request).
    assert rows["d"]["error"].startswith(
        ("not completed: the run was stopped (SIGTERM)", "ring step 3 failed closed: rank 1 dead")
    ), rows["d"]["error"]
    stopped = [rid for rid in ("e", "f") if not rows[rid]["ok"]]
    for rid in stopped:
        assert rows[rid]["error"].startswith("not completed: the run was stopped (SIGTERM)"), rows[rid]["error"]
    for rid in {"e", "f"} - set(stopped):
        assert rows[rid]["degraded"] and (tmp_path / "out" / rows[rid]["files"][0]).is_file()
    assert stopped and "stopped by SIGTERM" in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_while_rank_0_waits_in_a_collective(checkpoint, tmp_path, finished_expected):
    """Rank 1 stalls at ring step 3, so rank 0 waits inside gloo for up to the 120 s timeout; a SIGTERM then
    (what a scheduler or torchrun sends) still writes the 'not completed' lines and ends the run in seconds."""
    cmd, proc = _torchrun(checkpoint, tmp_path, {"rank": 1, "kind": "stall", "step": 3}, timeout_s=120.0)
    manifest = tmp_path / "out" / "manifest.jsonl"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None:
        done = {r["id"] for r in read_manifest(manifest)} if manifest.exists() else set()
        if set(FINISHED) <= done:
            break
        time.sleep(0.2)
    time.sleep(2.0)  # rank 0 is now inside ring step 3's collectives
    rank0 = next(c for c in psutil.Process(proc.pid).children(recursive=True) if c.environ().get("RANK") == "0")
    sent = time.monotonic()
    rank0.send_signal(signal.SIGTERM)  # to rank 0 alone: the stalled peer stays, so nothing unblocks it
    log, _ = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 40, "the SIGTERM waited for the collective's timeout"
    rows = _check_lines(tmp_path / "out", finished_expected)
    for rid in ("d", "e", "f"):
        assert rows[rid]["error"].startswith("not completed: the run was stopped (SIGTERM)"), rows[rid]["error"]


def test_a_result_whose_files_cannot_be_written_says_so_and_the_others_go_on(tmp_path):
    subs = _subs(2)
    writer = ResultWriter(tmp_path / "out", expected=subs)
    bad = _ok(0, subs[0])
    bad = RequestResult(0, bad.request_id, bad.request, True, bad.video, "0" * 64)  # its hash does not match
    writer.write(bad)  # does not raise into the serve
    writer.write(_ok(1, subs[1]))
    rows = {r["id"]: r for r in read_manifest(tmp_path / "out" / "manifest.jsonl")}
    assert not rows["r0"]["ok"] and rows["r0"]["files"] == [] and "writing its files" in rows["r0"]["error"]
    assert rows["r1"]["ok"] and not list((tmp_path / "out").glob("*.tmp"))
