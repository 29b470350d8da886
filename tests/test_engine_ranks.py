"""The DP engine on real CPU ranks (spawned processes, gloo, one thread each, small timeouts).

One spawn runs every phase that leaves the group whole, in sequence (allgather R = 1 and 2 with a partial wave,
rank-local, resident, a forced mixed wave, a traced wave, a stream that pauses past the timeout, then a rank that
raises): every output is byte-identical to a single-process resident run; each test checks its own phase's
report. Then one spawn per fault that breaks the group: a rank that stalls or dies; each request ends with an
output or an error that says why, the culprit rank is named, and nothing hangs (the whole test has a hard
timeout)."""

from __future__ import annotations

import pytest
import torch
from conftest import engine_options, resident_expected

from dlo_fn.models import Request
from dlo_fn.serve.batch import FAULT_EXIT_CODE, Fault
from dlo_fn.serve.local import Phase, serve_local
from dlo_fn.serve.requests import EngineOptions, as_submissions

pytestmark = pytest.mark.slow

SHAPE = dict(height=32, width=32, num_frames=5, num_inference_steps=3)
TIMEOUT_S = 4.0


def _req(prompt, seed, **kw) -> Request:
    return Request(prompt=prompt, seed=seed, **{**SHAPE, **kw})


REQUESTS = (
    _req("a red fox", 1),
    _req("a blue bird", 2),
    _req("a tall tree", 3, height=48),
    _req("a cat", 4),
    _req("", 5),
    _req("a boat", 6),
)
SUBS = tuple(as_submissions(REQUESTS))


@pytest.fixture(scope="module")
def expected(checkpoint):
    return resident_expected(checkpoint, REQUESTS)


def _options(**kw) -> EngineOptions:
    return engine_options(**{"timeout_s": TIMEOUT_S, "serving": "strict", **kw})


def _check_bytes(report, expected):
    for res in report.results:
        if res.request_id == "req0004":
            assert not res.ok and "empty prompts are rejected" in res.error and res.wave_id is None
            continue
        assert res.ok, res.error
        assert torch.equal(res.video, expected[res.request_id].video), res.request_id
        assert res.sha256 == expected[res.request_id].sha256


STREAM_SUBS = (SUBS[0], SUBS[1], SUBS[3])


@pytest.fixture(scope="module")
def whole(checkpoint):
    """The phases that keep the group whole, on one spawn of 2 ranks: the raise last (nothing after it to lose)."""
    phases = [
        Phase("allgather", SUBS, _options()),
        Phase("allgather", SUBS, _options(requests_per_rank=2)),
        Phase("rank-local", SUBS, _options()),
        Phase("resident", SUBS, _options(requests_per_rank=2)),
        Phase("allgather", SUBS, _options(), forced=((0, 2),)),
        Phase("allgather", SUBS[:2], _options(trace=True)),
        # A 2 x TIMEOUT_S pause with no request: the followers wait in the wave broadcast the whole time and would
        # time out without rank 0's keep-alive messages.
        Phase("allgather", STREAM_SUBS, _options(max_wait_s=0.5), stream_gaps_s=(0.0, 2 * TIMEOUT_S, 0.0)),
        Phase("allgather", SUBS, _options(fault=Fault(rank=1, wave=0, kind="raise", step=1))),
    ]
    return serve_local(
        checkpoint, phases, 2, start_method="forkserver", join_timeout_s=200, grace_s=30
    )  # a clean exit may take long on a loaded 2-core machine


@pytest.mark.timeout(240)
def test_modes_and_waves_on_two_ranks(whole, expected):
    run = whole
    assert run.exitcodes == (0, 0) and len(run.reports) == 8
    r1, r2, local, resident, forced, traced = run.reports[:6]
    for report in (r1, r2, local, resident, traced):
        assert [r.request_id for r in report.results] == [s.request_id for s in SUBS[: len(report.results)]]
        _check_bytes(report, expected)
    # R = 1: fox|bird, tree|idle (another shape), cat|boat; the idle rank served its shards only.
    assert [(w.rank_indices, w.status) for w in r1.waves] == [
        (((0,), (1,)), "ok"),
        (((2,), ()), "ok"),
        (((3,), (5,)), "ok"),
    ]
    assert r1.waves[1].idle_ranks == (1,)
    assert {r.request_id: (r.rank, r.wave_id) for r in r1.results if r.ok} == {
        "req0000": (0, 0),
        "req0001": (1, 0),
        "req0002": (0, 1),
        "req0003": (0, 2),
        "req0005": (1, 2),
    }
    # R = 2: the four compatible requests in one wave, two per rank, block-major.
    assert [w.rank_indices for w in r2.waves] == [((0, 3), (1, 5)), ((2,), ())]
    # Independent replicas: batches dealt round-robin to the ranks' own queues.
    assert all(not w.lockstep for w in local.waves) and {r.rank for r in local.results if r.ok} == {0, 1}
    assert isinstance(forced, str) and forced.startswith("IncompatibleWaveError")
    assert "differ in height" in forced and "height = 48 (request 0: 32)" in forced
    # The recorded wave: one broadcast, each rank computes its own request, both ranks all-gather every block.
    spans = traced.waves[0].trace
    lanes = {(rank, lane) for rank, lane, *_ in spans}
    assert {(0, "control"), (0, "compute"), (1, "compute"), (0, "allgather"), (1, "allgather")} <= lanes
    computes = {
        rank: {label.split()[0] for r2_, lane, label, *_ in spans if lane == "compute" and r2_ == rank}
        for rank in (0, 1)
    }
    assert computes == {0: {"p0"}, 1: {"p1"}}
    ag = [label for rank, lane, label, *_ in spans if lane == "allgather" and rank == 1]
    assert len(ag) >= 3 * 4  # every block of every step


def _serve_with_fault(checkpoint, mode, fault):
    # grace_s: how long a rank still running after rank 0's answer may take to leave; only a stalled rank is
    # still there (the dead one is gone, rank 0's exit code is not checked), and it is to be killed anyway.
    phases = [Phase(mode, SUBS, _options(fault=fault))]
    return serve_local(checkpoint, phases, 2, start_method="forkserver", join_timeout_s=90, grace_s=1)


@pytest.mark.timeout(240)
def test_rank_that_raises_fails_only_its_requests(whole, expected):
    run = whole
    report = run.reports[7]
    assert run.exitcodes == (0, 0)
    bird = report.by_id()["req0001"]
    assert not bird.ok and bird.rank == 1 and "rank 1: InjectedFault" in bird.error
    assert report.waves[0].status == "partial"
    # Rank 1 kept serving its shards, so rank 0's request in the same wave and every later wave completed.
    rest = [r for r in report.results if r.request_id != "req0001"]
    _check_bytes(type(report)(tuple(rest), report.waves, report.mode, 2, 1, report.wall_s), expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["stall", "exit"])
def test_stalled_or_dead_rank_fails_the_wave_closed(checkpoint, expected, kind):
    run = _serve_with_fault(checkpoint, "allgather", Fault(rank=1, wave=2, kind=kind, step=1))
    (report,) = run.reports
    verdict = {"stall": "rank 1 stalled", "exit": "rank 1 dead"}[kind]
    res = report.by_id()
    for rid in ("req0000", "req0001", "req0002"):  # waves 0 and 1 completed before the fault
        assert res[rid].ok and res[rid].sha256 == expected[rid].sha256
    for rid in ("req0003", "req0005"):  # wave 2 failed closed, naming the culprit
        assert not res[rid].ok and res[rid].wave_id == 2
        assert res[rid].error.startswith(f"wave 2 failed closed: {verdict}"), res[rid].error
    assert "at step 1" in res["req0003"].error
    assert report.waves[-1].status == "failed"
    assert run.exitcodes[1] == (FAULT_EXIT_CODE if kind == "exit" else -9)  # the stalled rank was killed
    assert run.wall_s < 60


@pytest.mark.timeout(120)
def test_rank_local_replica_death_keeps_the_other_replicas_results(checkpoint, expected):
    run = _serve_with_fault(checkpoint, "rank-local", Fault(rank=1, wave=1, kind="exit", step=0))
    (report,) = run.reports
    res = report.by_id()
    lost = {r.request_id for r in report.results if r.rank == 1}
    assert lost and all(not res[i].ok and "rank 1 dead" in res[i].error for i in lost)
    kept = [r for r in report.results if r.rank == 0]
    assert kept and all(r.ok and r.sha256 == expected[r.request_id].sha256 for r in kept)
    assert not res["req0004"].ok and "empty" in res["req0004"].error


@pytest.mark.timeout(240)
def test_stream_keeps_idle_followers_alive_past_the_timeout(whole, expected):
    run = whole
    report = run.reports[6]
    assert [r.request_id for r in report.results] == [s.request_id for s in STREAM_SUBS]
    assert run.exitcodes == (0, 0)
    assert [w.rank_indices for w in report.waves] == [((0,), ()), ((1,), (2,))]
    assert all(r.ok and r.sha256 == expected[r.request_id].sha256 for r in report.results)


def test_an_unknown_start_method_is_one_line(checkpoint):
    from dlo_fn.serve.ranks import run_ranks

    with pytest.raises(ValueError, match="start_method='fork': must be one of spawn, forkserver"):
        serve_local(checkpoint, [], 1, start_method="fork")
    with pytest.raises(ValueError, match="start_method='fork': must be one of spawn, forkserver"):
        run_ranks(print, 2, start_method="fork")
