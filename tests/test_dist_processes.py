"""Local ranks start from a process server (dlo_fn.runtime.dist.fresh_processes) but still see their caller's
environment, niceness and sys.path, whenever the caller set them."""

from __future__ import annotations

import concurrent.futures
import os
import sys

import pytest

from dlo_fn.runtime.dist import fresh_processes, run_ranks


def _probe(ctx) -> tuple:
    return os.nice(0), os.environ.get("DLO_FN_TEST_PROBE"), sys.path[-1]


def test_a_rank_adopts_its_callers_state(monkeypatch, tmp_path):
    monkeypatch.setenv("DLO_FN_TEST_PROBE", "set late")  # after the session started the process server
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "path", sys.path + [str(tmp_path / "last")])
    (here,) = run_ranks(_probe, 1, timeout_s=60)
    assert here == (os.nice(0), "set late", str(tmp_path / "last"))
    with concurrent.futures.ThreadPoolExecutor(1, initializer=os.nice, initargs=(5,)) as pool:
        (niced,) = pool.submit(run_ranks, _probe, 1, timeout_s=60).result()
    assert niced[0] == os.nice(0) + 5 and niced[1] == "set late"


def test_start_method_choice(monkeypatch):
    monkeypatch.setenv("DLO_FN_START_METHOD", "spawn")
    assert fresh_processes().get_start_method() == "spawn"
    monkeypatch.setenv("DLO_FN_START_METHOD", "fork")
    with pytest.raises(ValueError, match="DLO_FN_START_METHOD='fork': give 'forkserver' or 'spawn'"):
        fresh_processes()
