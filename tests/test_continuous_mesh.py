"""Continuous serving on a dp 2 x sp 2 mesh (dlo_fn.serve.continuous), real gloo ranks, one spawn of 4 ranks:
the unit of admission is a replica (its 2 sp ranks run one request together), replicas hold different requests
(shapes, steps, CFG on/off) side by side, every output is byte-identical to the request alone on the resident
model (shard groups world, dp and sp; R = 2 on one replica), a raise on one sp rank fails only its replica's request,
and a dead rank
fails closed within the timeout: its replica's requests name it, the other replica's get "not completed", the
queue "not dispatched" (no recovery on an sp mesh), every request exactly one result. Then ``generate --sp 2
--serving continuous`` under torchrun (dp 1 x sp 2) writes the resident hashes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import engine_options, resident_expected

from dlo_fn.models import Request
from dlo_fn.serve.batch import FAULT_EXIT_CODE, Fault
from dlo_fn.serve.local import Phase, serve_local
from dlo_fn.serve.requests import as_submissions

pytestmark = pytest.mark.slow

SHAPE = dict(height=32, width=32, num_frames=5)
# Two shapes, two step counts, CFG on (guidance 5) and off (guidance 1).
REQUESTS = (
    Request(prompt="a red fox", seed=1, num_inference_steps=3, **SHAPE),
    Request(prompt="a blue bird", seed=2, num_inference_steps=2, guidance_scale=1.0, **{**SHAPE, "height": 48}),
    Request(prompt="a tall tree", seed=3, num_inference_steps=2, guidance_scale=1.0, **SHAPE),
    Request(prompt="a boat", seed=4, num_inference_steps=3, **{**SHAPE, "height": 48}),
    Request(prompt="a cat", seed=5, num_inference_steps=2, **SHAPE),  # the fox's shape and CFG: R = 2 with it
)
SUBS = tuple(as_submissions(REQUESTS))
TIMEOUT_S = 10.0  # 4 ranks on a shared 2-core machine


@pytest.fixture(scope="module")
def expected(checkpoint):
    return resident_expected(checkpoint, REQUESTS)


@pytest.fixture(scope="module")
def run(checkpoint):
    opts = dict(timeout_s=TIMEOUT_S, serving="continuous")
    phases = [
        Phase("allgather", SUBS, engine_options(**opts)),
        Phase(
            "allgather",
            SUBS,
            engine_options(**opts, fault=Fault(rank=1, wave=0, kind="raise", step=1)),
            shard_group="dp",
        ),
        # R = 2, weights sharded over each replica's sp ranks: the cat joins the fox on replica 0.
        Phase("allgather", (SUBS[0], SUBS[1], SUBS[4]), engine_options(**opts, requests_per_rank=2), shard_group="sp"),
        # Last (rank 3 dies): at ring step 1 replica 0 holds the fox, replica 1 (ranks 2, 3) the bird.
        Phase("allgather", SUBS, engine_options(**opts, fault=Fault(rank=3, wave=0, kind="exit", step=1))),
    ]
    return serve_local(checkpoint, phases, 2, sp_size=2, start_method="forkserver", join_timeout_s=200, grace_s=10)


def _check(report, expected, skip=(), subs=SUBS):
    assert [r.request_id for r in report.results] == [s.request_id for s in subs]
    for res in report.results:
        if res.request_id in skip:
            continue
        assert res.ok, (res.request_id, res.error)
        assert torch.equal(res.video, expected[res.request_id].video), res.request_id
        assert res.sha256 == expected[res.request_id].sha256


def test_replicas_serve_different_requests_side_by_side_bit_identical(run, expected):
    report = run.reports[0]
    assert report.serving == "continuous" and (report.dp_size, report.sp_size) == (2, 2) and report.waves == ()
    _check(report, expected)
    assert {r.rank for r in report.results} == {0, 2}  # the replicas' leaders
    for s in report.steps:  # the sp ranks of a replica hold the same requests at every ring step
        assert s.held[0] == s.held[1] and s.held[2] == s.held[3], s
    # FIFO: fox | bird (another shape, no CFG); at the bird's end the tree takes replica 1 beside the fox.
    assert report.steps[0].held == ((0,), (0,), (1,), (1,))
    assert report.steps[2].held == ((0,), (0,), (2,), (2,))
    assert any(s.held[0] and s.held[2] and s.held[0] != s.held[2] for s in report.steps)


def test_raise_on_one_sp_rank_fails_only_its_replicas_request(run, expected):
    report = run.reports[1]
    fox = report.by_id()["req0000"]
    assert not fox.ok and fox.rank == 1 and "rank 1: InjectedFault" in fox.error
    _check(report, expected, skip=("req0000",))
    assert report.steps[0].held == ((0,), (0,), (1,), (1,))
    # The fox left replica 0 at ring step 1 (rank 0 dropped it at the next boundary): the tree took it.
    assert report.steps[2].held[:2] == ((2,), (2,))


def test_two_requests_per_sp_replica_with_sp_sharded_weights(run, expected):
    report = run.reports[2]
    _check(report, expected, subs=(SUBS[0], SUBS[1], SUBS[4]))
    assert report.steps[0].held == ((0, 2), (0, 2), (1,), (1,))  # positions in this phase: fox, bird, cat


def test_dead_rank_fails_its_replica_closed_the_rest_get_one_result_each(run):
    report = run.reports[3]
    assert run.exitcodes[3] == FAULT_EXIT_CODE and run.exitcodes[0] == 0
    res = report.by_id()
    assert len(report.results) == len(SUBS) and not any(r.ok for r in report.results)
    assert res["req0001"].error.startswith("ring step 1 failed closed: rank 3 dead"), res["req0001"].error
    assert res["req0000"].error.startswith("not completed: held by rank 0") and "rank 3 dead" in res["req0000"].error
    for rid in ("req0002", "req0003", "req0004"):
        assert res[rid].error.startswith("not dispatched"), res[rid].error
    assert report.degraded is None
    assert run.wall_s < 150


def test_generate_cli_sp2_continuous_writes_resident_hashes(checkpoint, expected, tmp_path):
    from dlo_fn.runtime.dist import free_port

    lines = [dict(id=f"req{i:04d}", **r.to_dict()) for i, r in enumerate(REQUESTS)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
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
        str(tmp_path / "p.jsonl"),
        "--sp",
        "2",
        "--serving",
        "continuous",
        "--out",
        str(tmp_path / "out"),
        "--timeout",
        "30",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", DLO_FN_PLATFORM="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["id"]: r for r in map(json.loads, (tmp_path / "out" / "manifest.jsonl").read_text().splitlines())}
    assert {i: r["sha256"] for i, r in rows.items()} == {i: e.sha256 for i, e in expected.items()}
    assert {(r["serving"], r["rank"], r["dp_size"], r["sp_size"]) for r in rows.values()} == {("continuous", 0, 1, 2)}


def test_stall_on_an_sp_rank_names_it_and_not_its_partner(checkpoint):
    """Rank 3 stalls at ring step 1; its sp partner (rank 2) waits for it inside an all-to-all, gives up when the
    collective times out and says so on the board, so the reason names rank 3 alone."""
    subs = SUBS[:3]
    phase = Phase(
        "allgather",
        subs,
        engine_options(timeout_s=6.0, serving="continuous", fault=Fault(rank=3, wave=0, kind="stall", step=1)),
    )
    run = serve_local(checkpoint, [phase], 2, sp_size=2, start_method="forkserver", join_timeout_s=200, grace_s=5)
    report = run.reports[0]
    reason = report.by_id()["req0001"].error  # replica 1 (ranks 2, 3) held it
    assert reason.startswith("ring step 1 failed closed: rank 3 stalled"), reason
    assert "rank 2" not in reason, reason
    assert len(report.results) == len(subs) and not any(r.ok for r in report.results)
    assert run.exitcodes[2] == 0  # the partner returned on its own; only the stalled rank was killed
