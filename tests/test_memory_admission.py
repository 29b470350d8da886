"""Admission against memory (dlo_fn.serve.admission.MemoryAdmission): a request that cannot fit what a rank has left
is refused before it is queued, with its bytes, the budget and the largest size that fits, and the others run
byte-identical to resident; strict and continuous serving, dp 2 (allgather, rank-local) and dp 1 x sp 2 on real
gloo ranks; and the case of the issue, a 100000 x 100000 request, under ``ulimit -v`` so that a failure of
admission cannot take the machine down."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import engine_options, resident_expected

from dlo_fn.models import CONFIGS, Request
from dlo_fn.serve.admission import MemoryAdmission
from dlo_fn.serve.local import Phase, serve_local
from dlo_fn.serve.memory_room import RESERVE_FRACTION, Room, Share, rank_shares
from dlo_fn.serve.requests import as_submissions

SMALL = dict(height=32, width=32, num_frames=5, num_inference_steps=2)
REQUESTS = (
    Request("a red fox", seed=1, **SMALL),
    Request("a big owl", seed=2, **{**SMALL, "height": 512, "width": 512, "num_frames": 17}),  # ~63 MB
    Request("a cat", seed=3, **SMALL, guidance_scale=1.0),
)
SUBS = tuple(as_submissions(REQUESTS))
CAP = 30_000_000  # per rank: the small ones need a few MB, the owl more than twice this


def test_shares_split_a_host_and_a_device_and_keep_a_reserve():
    rooms = [
        Room(0, "a", "cuda:0", 100, 1000, "available host memory"),
        Room(1, "a", "cuda:0", 100, 1000, "x"),
        Room(2, "a", "cuda:1", 100, 500, "x"),
        Room(3, "b", "cpu", 80, None, "the cgroup's limit"),
    ]
    shares = rank_shares(rooms)
    keep = 1 - RESERVE_FRACTION
    assert shares[0].host_bytes == int(100 * keep) // 3 and shares[0].device_bytes == int(1000 * keep) // 2
    assert shares[2].device_bytes == int(500 * keep) and "shared by 3 ranks on its host" in shares[2].host_why
    assert (shares[3].host_bytes, shares[3].device_bytes) == (int(80 * keep), None)
    assert shares[3].host_why == "the cgroup's limit, after a 10% reserve"
    capped = shares[0].capped(10)
    assert capped.host_bytes == 10 and capped.device_bytes == 10 and "memory_budget_bytes" in capped.device_why


def test_refusal_names_bytes_budget_and_the_largest_size_that_fits():
    admission = MemoryAdmission(
        CONFIGS["tiny"], 2, {0: Share(10**12, None, "x"), 1: Share(CAP, None, "y")}, requests_per_rank=1
    )
    assert admission.refusal(REQUESTS[0]) is None
    why = admission.refusal(REQUESTS[1])
    m = re.match(
        r"rejected before dispatch: needs ([\d.]+) MB of host \(CPU\) memory per rank .* but rank 1 has "
        r"30.00 MB \(y\); the largest size of this aspect that fits .*: height (\d+), width (\d+)$",
        why,
    )
    assert m, why
    h, w = int(m.group(2)), int(m.group(3))
    assert h == w and admission.refusal(Request("x", height=h, width=w, num_frames=17)) is None
    assert admission.refusal(Request("x", height=h + 16, width=w + 16, num_frames=17)) is not None
    # On an accelerator the device and the host are checked apart.
    gpu = MemoryAdmission(CONFIGS["tiny"], 2, {0: Share(10**12, 1_000_000, "x")}, requests_per_rank=1)
    assert "of device memory per rank" in gpu.refusal(REQUESTS[1])


def _check(report, expected):
    res = report.by_id()
    assert [r.request_id for r in report.results] == [s.request_id for s in SUBS]
    assert not res["req0001"].ok and res["req0001"].error.startswith("rejected before dispatch: needs "), res[
        "req0001"
    ].error
    assert "EngineOptions.memory_budget_bytes" in res["req0001"].error and "height" in res["req0001"].error
    for rid in ("req0000", "req0002"):
        assert res[rid].ok and torch.equal(res[rid].video, expected[rid].video), (rid, res[rid].error)


@pytest.fixture(scope="module")
def expected(checkpoint):
    return resident_expected(checkpoint, (REQUESTS[0], REQUESTS[0], REQUESTS[2]))  # req0001 is never run


@pytest.mark.slow
def test_dp2_strict_and_continuous_allgather_and_rank_local(checkpoint, expected):
    cap = dict(memory_budget_bytes=CAP)
    phases = [
        Phase("allgather", SUBS, engine_options(serving="continuous", **cap)),
        Phase("allgather", SUBS, engine_options(serving="strict", **cap)),
        Phase("rank-local", SUBS, engine_options(**cap)),
    ]
    run = serve_local(checkpoint, phases, 2, start_method="forkserver", join_timeout_s=200)
    for report in run.reports:
        _check(report, expected)
    assert [r.serving for r in run.reports] == ["continuous", "strict", "strict"]


@pytest.mark.slow
def test_sp2_replica_admits_on_its_per_rank_terms(checkpoint, expected):
    run = serve_local(
        checkpoint,
        [Phase("allgather", SUBS, engine_options(memory_budget_bytes=CAP))],
        1,
        sp_size=2,
        start_method="forkserver",
        join_timeout_s=200,
    )
    (report,) = run.reports
    assert report.sp_size == 2
    _check(report, expected)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_huge_request_is_refused_under_ulimit_and_the_others_run(checkpoint, tmp_path, resident_rows):
    """The issue's case: 100000 x 100000 passed validation and its activations took the host down (OOM kill,
    no manifest). Under ``ulimit -v`` (so a failure cannot take this machine down) it is refused before
    dispatch with its bytes, the budget (the address space the limit leaves) and the largest size that fits."""
    lines = [
        {"id": "fox", "prompt": "a fox"},
        {"id": "huge", "prompt": "a huge fox", "height": 100000, "width": 100000},
        {"id": "owl", "prompt": "an owl"},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    cmd = (
        f"ulimit -v {6 * 2**20}; exec {sys.executable} -m dlo_fn generate --checkpoint {checkpoint} "
        f"--prompts {prompts} --out {out} --seed 3 --steps 2 --height 32 --width 32 --frames 5"
    )
    done = subprocess.run(
        ["bash", "-c", cmd],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, OMP_NUM_THREADS="1", DLO_FN_PLATFORM="cpu"),
    )
    assert done.returncode == 1, done.stderr[-3000:]
    rows = {r["id"]: r for r in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}
    assert rows["fox"]["ok"] and rows["owl"]["ok"]
    assert rows["fox"]["sha256"] == resident_rows[0]["sha256"]  # the fox of GENERATE_ARGS: same prompt and seed
    error = rows["huge"]["error"]
    assert re.match(
        r"rejected before dispatch: needs [\d.]+ GB of host \(CPU\) memory per rank .* but rank 0 has "
        r"[\d.]+ GB \(the address space ulimit -v leaves .*\); the largest size of this aspect that "
        r"fits .*: height \d+, width \d+$",
        error,
    ), error
    assert f"huge failed: {error}" in done.stderr


@pytest.mark.cuda
def test_on_cuda_a_huge_request_is_refused_on_device_memory(checkpoint, tmp_path):
    lines = [
        {"id": "fox", "prompt": "a fox"},
        {"id": "huge", "prompt": "a huge fox", "height": 100000, "width": 100000},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cmd = [
        sys.executable,
        "-m",
        "dlo_fn",
        "generate",
        "--checkpoint",
        checkpoint,
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "out"),
        "--steps",
        "2",
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "5",
        "--platform",
        "cuda",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 1, done.stderr[-3000:]
    rows = {r["id"]: r for r in map(json.loads, (tmp_path / "out" / "manifest.jsonl").read_text().splitlines())}
    assert rows["fox"]["ok"], rows["fox"]["error"]
    assert re.match(
        r"rejected before dispatch: needs [\d.]+ GB of device memory per rank .* but rank 0 has "
        r"[\d.]+ GB \(free device memory, after a 10% reserve\); the largest size of this aspect that "
        r"fits .*: height \d+, width \d+$",
        rows["huge"]["error"],
    ), rows["huge"]["error"]
