"""Continuous serving (dlo_fn.serve.continuous): one process (W = 1), then real gloo ranks (spawned, one thread
each): every output byte-identical to the request run alone on the resident model whoever its neighbours were,
two prompts in one step give different outputs, a bad request gets its own error, a rank that raises fails only
what it held, and when a follower dies rank 0 goes on alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import engine_options, mixed_request, mixed_requests

from dlo_fn.runtime.dist import init_distributed
from dlo_fn.runtime.platform import platform_for
from dlo_fn.serve.batch import FAULT_EXIT_CODE, Fault
from dlo_fn.serve.engine import Engine
from dlo_fn.serve.local import Phase, open_model, serve_local
from dlo_fn.serve.requests import EngineOptions, Submission, as_submissions

TIMEOUT_S = 4.0


_req = mixed_request


# Mixed: two shapes, three step counts, CFG on and off, guidance, one empty prompt (rejected).
REQUESTS = mixed_requests()
SUBS = tuple(as_submissions(REQUESTS))


def _options(**kw) -> EngineOptions:
    return engine_options(**{"timeout_s": TIMEOUT_S, "serving": "continuous", **kw})


def _check_bytes(report, mixed_expected, skip=()):
    for res in report.results:
        if res.request_id == "req0004":
            assert not res.ok and "empty prompts are rejected" in res.error
            continue
        if res.request_id in skip:
            continue
        assert res.ok, (res.request_id, res.error)
        assert torch.equal(res.video, mixed_expected[res.request_id].video), res.request_id
        assert res.sha256 == mixed_expected[res.request_id].sha256


@pytest.mark.parametrize("mode, r", [("allgather", 1), ("allgather", 3), ("resident", 2)])
def test_one_rank_continuous_is_bit_identical(checkpoint, mixed_expected, mode, r):
    model, off = open_model(checkpoint, init_distributed(platform_for("cpu")), mode)
    report = Engine(model, off, off.ctx, _options(requests_per_rank=r)).serve(SUBS)
    assert report.serving == "continuous" and report.waves == ()
    _check_bytes(report, mixed_expected)
    # One run per ring step; each step holds at most R requests of one shape.
    if off.executor is not None:
        assert off.executor.stats.runs == len(report.steps)
    assert all(len(s.held[0]) <= r for s in report.steps)
    if r == 1:  # one at a time, FIFO: the ring steps are the requests' steps back to back
        assert len(report.steps) == sum(q.num_inference_steps for q in REQUESTS if q.prompt)
    else:  # fox and bird share each load; the tree (another shape) waits for the bird to end, nothing overtakes it
        assert report.steps[0].held == ((0, 1),) and report.steps[3].held == ((1,),) and report.steps[5].held == ((2,),)


def test_bad_serving_option_is_one_line():
    with pytest.raises(ValueError, match="serving='fast': must be one of strict, continuous"):
        EngineOptions(serving="fast")


@pytest.fixture(scope="module")
def whole(checkpoint):
    """The phases that keep the group whole, on one spawn of 2 ranks; the raise last (nothing after it to lose).
    A clean exit is required; a loaded shared machine may take a while to get there."""
    phases = [
        Phase("allgather", SUBS, _options()),
        Phase("allgather", SUBS, _options(requests_per_rank=2)),
        Phase("allgather", SUBS, _options(), stream_gaps_s=(0.0, 0.3, 0.0, 0.5, 0.0, 0.0, 0.2)),
        Phase(
            "allgather", (Submission("a", _req("a red fox", 1)), Submission("b", _req("a blue bird", 1))), _options()
        ),
        # Ring step 1: rank 1 holds the bird (5 steps); rank 0 the fox.
        Phase("allgather", SUBS, _options(fault=Fault(rank=1, wave=0, kind="raise", step=1))),
    ]
    return serve_local(checkpoint, phases, 2, start_method="forkserver", join_timeout_s=200, grace_s=30)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_continuous(whole, mixed_expected):
    run = whole
    assert run.exitcodes == (0, 0) and len(run.reports) == 5
    one, two, stream, pair = run.reports[:4]
    for report in (one, two, stream):
        assert [r.request_id for r in report.results] == [s.request_id for s in SUBS]
        _check_bytes(report, mixed_expected)
        assert {r.rank for r in report.results if r.ok} == {0, 1}
    # R = 1: fox and bird start together; at fox's end (step 3) the tree takes rank 0 while bird goes on.
    assert one.steps[0].held == ((0,), (1,))
    assert one.steps[3].held == ((2,), (1,))
    # Two different prompts in one step: different outputs (same seed).
    a, b = pair.results
    assert a.ok and b.ok and a.sha256 != b.sha256
    assert pair.steps[0].held == ((0,), (1,))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rank_that_raises_fails_only_what_it_held(whole, mixed_expected):
    run = whole
    report = run.reports[4]
    assert run.exitcodes == (0, 0)
    bird = report.by_id()["req0001"]
    assert not bird.ok and bird.rank == 1 and "rank 1: InjectedFault" in bird.error
    _check_bytes(report, mixed_expected, skip=("req0001",))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dead_follower_leaves_rank_zero_serving_alone(checkpoint, mixed_expected):
    # Step 4: rank 0 holds the tree (steps 3-5), rank 1 the bird (steps 0-4); the fox ended at step 2. The bird
    # is lost with rank 1; rank 0 redoes step 4 of the tree as a rank-local replica, then serves the queue and,
    # as a stream, the two requests that arrive 2 s later. (3 ranks, stalls, raises: test_continuous_recovery.)
    phase = Phase(
        "allgather",
        SUBS,
        _options(fault=Fault(rank=1, wave=0, kind="exit", step=4)),
        stream_gaps_s=(0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0),
    )
    run = serve_local(checkpoint, [phase], 2, start_method="forkserver", join_timeout_s=90, grace_s=30)
    (report,) = run.reports
    bird = report.by_id()["req0001"]
    assert not bird.ok and bird.error.startswith("ring step 4 failed closed: rank 1 dead")
    _check_bytes(report, mixed_expected, skip=("req0001",))
    assert {r.rank for r in report.results if r.ok and r.index > 1} == {0}
    assert report.degraded.startswith("degraded since ring step 4: ranks [0]")
    assert run.exitcodes == (0, FAULT_EXIT_CODE)
    assert run.wall_s < 60


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_a_checkpoint_a_dead_follower_fails_the_step_closed(checkpoint, mixed_expected):
    phase = Phase("allgather", SUBS, _options(fault=Fault(rank=1, wave=0, kind="exit", step=4)), recovery=False)
    run = serve_local(checkpoint, [phase], 2, start_method="forkserver", join_timeout_s=90, grace_s=5)
    (report,) = run.reports
    res = report.by_id()
    assert res["req0000"].ok and res["req0000"].sha256 == mixed_expected["req0000"].sha256  # ended at step 2
    assert res["req0001"].error.startswith("ring step 4 failed closed: rank 1 dead")
    assert res["req0002"].error.startswith("not completed: held by rank 0") and "rank 1 dead" in res["req0002"].error
    for rid in ("req0003", "req0005", "req0006"):
        assert not res[rid].ok and res[rid].error.startswith("not dispatched"), res[rid].error
    assert report.degraded is None and run.exitcodes[1] == FAULT_EXIT_CODE
    assert run.wall_s < 60


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_generate_cli_serves_continuously_on_two_ranks(checkpoint, mixed_expected, tmp_path):
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
        "--serving",
        "continuous",
        "--out",
        str(tmp_path / "out"),
        "--timeout",
        "30",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", DLO_FN_PLATFORM="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # the empty prompt is an error
    assert "continuous serving:" in proc.stdout
    rows = {r["id"]: r for r in map(json.loads, (tmp_path / "out" / "manifest.jsonl").read_text().splitlines())}
    assert "empty prompts are rejected" in rows.pop("req0004")["error"]
    assert {i: r["sha256"] for i, r in rows.items()} == {i: e.sha256 for i, e in mixed_expected.items()}
    assert {r["serving"] for r in rows.values()} == {"continuous"} and {r["rank"] for r in rows.values()} == {0, 1}


def _two_plain_processes(checkpoint, out, fault: dict) -> list:
    """``generate`` on 2 ranks started as plain processes (env:// rendezvous, as two nodes' agents would start
    them; torchrun on one node would SIGTERM the follower when rank 0 exits): each rank's (exit code, stderr)."""
    from dlo_fn.runtime.dist import free_port

    port = str(free_port())
    cmd = [sys.executable, "-m", "dlo_fn", "generate", "--checkpoint", checkpoint, "--out", str(out), "--timeout", "3"]
    cmd += ["--steps", "3", "--height", "32", "--width", "32", "--frames", "5", "--prompt", "a", "--prompt", "b"]
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="1")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DLO_FN_FAULT=json.dumps(fault), DLO_FN_PLATFORM="cpu")
        env.update(OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env))
    return [(p.wait(timeout=150), p.stderr.read()) for p in procs]


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "fault",
    [{"rank": 0, "kind": "exit", "step": 1}, {"rank": 1, "kind": "stall", "step": 1, "stall_s": 20}],
    ids=["rank-0-dies", "follower-wakes-late"],
)
def test_a_follower_that_loses_rank_zero_says_so_in_one_line(checkpoint, tmp_path, fault):
    (_, _), (code, err) = _two_plain_processes(checkpoint, tmp_path / "out", fault)
    ours = [line for line in err.splitlines() if line.startswith("dlo_fn generate: error:")]
    assert code == 1 and len(ours) == 1 and "Traceback" not in err, err[-3000:]
    assert ours[0].startswith("dlo_fn generate: error: rank 1: lost rank 0 (no recovery plan from it within "), ours
    assert "rank 0 died, or it went on and ended without this rank, which stalled past --timeout" in ours[0]
