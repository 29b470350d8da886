"""The executor's own NCCL communicator (dlo_fn.runtime.nccl_raw): its watchdog thread and the choice of path
on every machine; on CUDA (skipped without it; run on the H200, output in the issue 16 note) the W > 1 program
on one NCCL rank, eager and captured, bit-identical to resident, and a stalled all-gather stream ending its
process within the timeout with one line."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from dlo_fn.runtime.nccl_raw import FAULT_EXIT_CODE, RAW_NCCL_ENV, Watchdog, load_nccl, own_communicator

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _until(pred, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_watchdog_reports_the_first_reason_once_and_stops():
    calls, faults = [], []
    answers = iter([None, None, "the stream is stuck", "never asked"])

    def probe():
        calls.append(threading.current_thread().name)
        return next(answers)

    dog = Watchdog(probe, faults.append, poll_s=0.01)
    assert _until(lambda: faults)
    assert _until(lambda: not dog.alive)
    assert faults == ["the stream is stuck"] and dog.fault == "the stream is stuck"
    assert len(calls) == 3 and set(calls) == {"dlo_fn-nccl-watchdog"}  # its own thread, stopped at the fault


def test_watchdog_does_not_probe_while_paused_and_stops_cleanly():
    calls, faults = [], []
    dog = Watchdog(lambda: calls.append(1), faults.append, poll_s=0.01)
    assert _until(lambda: len(calls) >= 2)
    with dog.paused():
        time.sleep(0.02)  # a probe that had begun before the pause finishes first
        n = len(calls)
        time.sleep(0.15)
        assert len(calls) == n
    assert _until(lambda: len(calls) > n)
    dog.stop()
    assert not dog.alive and faults == [] and dog.fault is None


def test_watchdog_reports_a_probe_that_raises():
    faults = []

    def probe():
        raise RuntimeError("cuEventQuery failed")

    dog = Watchdog(probe, faults.append, poll_s=0.01, setup=lambda: None)
    assert _until(lambda: faults)
    assert "probe failed (RuntimeError: cuEventQuery failed)" in faults[0]
    assert _until(lambda: not dog.alive)
    with pytest.raises(ValueError, match="poll_s"):
        Watchdog(lambda: None, faults.append, poll_s=0)


def test_monitor_kills_a_process_whose_beats_stop_and_leaves_a_beating_one(capfd):
    from dlo_fn.runtime.nccl_raw import Monitor

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mon = Monitor(1.0, "rank 3: no beat for {s} s", pid=victim.pid)
        t0 = time.monotonic()
        for _ in range(15):  # beating: 1.5 s, longer than the limit
            mon.beat()
            time.sleep(0.1)
        assert victim.poll() is None
        assert victim.wait(timeout=10) == -9 and time.monotonic() - t0 < 6  # beats stopped: killed
        assert mon.proc.wait(timeout=5) == 0
        (line,) = capfd.readouterr().err.strip().splitlines()
        assert re.fullmatch(r"rank 3: no beat for \d+ s", line), line
    finally:
        victim.kill()
    calm = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mon = Monitor(0.5, "never", pid=calm.pid)
        mon.stop()  # stopped before its limit: exits, kills nothing
        assert mon.proc.returncode == 0 and calm.poll() is None
        mon = Monitor(0.5, "never", pid=calm.pid)
        mon.proc.stdin.close()  # the beating process gone (its pipe closed): exits too
        assert mon.proc.wait(timeout=5) == 0 and calm.poll() is None
        assert "never" not in capfd.readouterr().err
    finally:
        calm.kill()


_ORPHAN = textwrap.dedent("""
    import os, time
    from dlo_fn.runtime.nccl_raw import Monitor

    mon = Monitor(2.0, "killed {s}")
    child = os.fork()
    if child == 0:  # holds the pipe's write end: the monitor sees no EOF when its parent dies
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 1), os.dup2(null, 2)  # not the test's pipes, which it would hold open
        time.sleep(30)
        os._exit(0)
    print(mon.proc.pid, child, flush=True)
    os._exit(0)  # the watched process gone without stopping its monitor
""")


def test_monitor_of_a_dead_parent_exits_without_killing():
    import os

    out = subprocess.run([sys.executable, "-c", _ORPHAN], capture_output=True, text=True, timeout=60)
    monitor, child = (int(x) for x in out.stdout.split())
    try:
        def gone(pid):  # exited: no such process, or a zombie its new parent has not reaped (a container's init)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except FileNotFoundError:
                return True

        assert _until(lambda: gone(monitor), 10)
        time.sleep(2.5)  # past the limit: the forked child (another pid) was never the target, and lives
        assert not gone(child) and "killed" not in out.stderr
    finally:
        try:
            os.kill(child, 9)
        except ProcessLookupError:
            pass


def test_load_nccl_says_why_not():
    lib, why = load_nccl()
    if lib is None:  # a CPU machine: no library, and the reason names it
        assert "libnccl.so.2" in why
    else:
        assert why == "" and lib.version >= 20000 and "invalid" in lib.error(4).lower()


def _gloo_choice(ctx):
    comm, why = own_communicator(ctx.group, torch.device("cpu"), True)
    return comm is None, why


def test_a_gloo_group_keeps_c10d_calls_on_every_rank():
    from dlo_fn.runtime.dist import run_ranks

    for none, why in run_ranks(_gloo_choice, 2, timeout_s=120):
        assert none and "backend is 'gloo', not NCCL" in why


def _timeout_of_group(ctx):
    from dlo_fn.runtime.nccl_raw import group_timeout_s

    return group_timeout_s(ctx.group, torch.device("cpu"), -1.0), group_timeout_s(object(), torch.device("cpu"), -1.0)


def test_the_watchdog_timeout_defaults_to_the_process_groups():
    from dlo_fn.runtime.dist import run_ranks

    # the group's own timeout (what init_process_group was given), and the default where a group hides it
    assert run_ranks(_timeout_of_group, 1, timeout_s=77) == [(77.0, -1.0)]


def test_failed_calls_are_named():
    from dlo_fn.runtime.executor import _failed_call

    def cuMemcpyHtoDAsync_v2():  # noqa: N802 - a driver call's name
        pass

    assert _failed_call(cuMemcpyHtoDAsync_v2, 1, None) == "CUDA driver call cuMemcpyHtoDAsync_v2 failed with CUresult 1"


# -- CUDA ------------------------------------------------------------------------------------------------------

def _nccl_rank(ctx, scope, load_group: int, own: bool, grouped: bool = True) -> dict:
    import os

    os.environ[RAW_NCCL_ENV] = "1" if own else "0"
    from tests.test_graph_cuda import _nccl_one_rank

    return _nccl_one_rank(ctx, scope, load_group, timeout_s=1.0 if own else None, grouped=grouped)


@cuda
@pytest.mark.parametrize("scope", [False, True, "block"])
@pytest.mark.parametrize("load_group", [1, 2, 4, "4-perblock"])
def test_own_communicator_program_bit_exact_eager_and_captured(scope, load_group):
    """The W > 1 program on one NCCL rank with its all-gathers on the executor's own communicator (bound
    ncclAllGather calls: one per load group on the grouped shard layout, one group launch of G on the per-block
    one): bit-identical to resident, eager, with step graphs
    (their eager steps on the own communicator, the captured ones c10d's) and with block graphs (captured on the
    compute stream while the watchdog thread records its marker on the all-gather stream), and the watchdog, with
    a timeout of one second, does not fire on a busy healthy stream. DLO_FN_RAW_NCCL=0 keeps c10d's calls."""
    from dlo_fn.runtime.dist import run_ranks

    grouped = load_group != "4-perblock"  # the grouped shard layout: one all-gather (one pair) per group
    g = int(str(load_group)[0])
    for own in (True, False):
        (r,) = run_ranks(_nccl_rank, 1, scope, g, own, grouped, platform="cuda", timeout_s=300)
        assert r["equal"] and r["gathers"] and r["driver_calls"] and r["own_nccl"] is own, r
        assert r["layout_load_group"] == (g if grouped else 1) and r["pairs_per_gather"] == [1 if grouped else g], r
        if own:
            assert r["busy_s"] > 1.5 and r["watchdog_alive"] and r["nccl_calls"] > 0, r
        if scope:
            assert r["captures"] >= 1 and r["replays"] > 0, r


_STALL = textwrap.dedent("""
    import sys, time, torch
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.platform import platform_for
    from tests.test_graph_cuda import nccl_one_rank_executor

    ctx = init_distributed(platform_for("cuda", 0), single_process_group=True)
    ex, proxies, run, xs = nccl_one_rank_executor(ctx, False, 1, timeout_s=2.0)
    assert ex._nccl is not None
    with torch.no_grad():
        run(proxies, xs[0])
        torch.cuda.synchronize()
        print("warm", flush=True)
        torch.cuda._sleep(60 * 2_000_000_000)  # ~60 s of the compute stream: block 2's all-gather waits behind it
        out = run(proxies, xs[1])
        if sys.argv[1] == "copy":
            out.cpu()  # a synchronous copy: the driver blocks the watchdog thread's CUDA calls meanwhile
        else:
            torch.cuda.synchronize()
    print("not stopped", flush=True)
""")


@cuda
@pytest.mark.parametrize("wait, code, says", [("sync", FAULT_EXIT_CODE, "made no progress for"),
                                              ("copy", -9, "watchdog has been blocked for")])
def test_a_stalled_all_gather_stream_ends_the_process_within_the_timeout(wait, code, says):
    """A real stall on the device: the all-gather of block 2 waits for block 0's compute (its slot), which a
    60 s sleep kernel holds. With a 2 s timeout the process ends long before the sleep does, with one line on
    stderr: the watchdog thread aborts the communicator and exits with FAULT_EXIT_CODE while the main thread
    waits in ``torch.cuda.synchronize()``; while it waits in a synchronous copy, which blocks the thread's CUDA
    calls, the monitor process kills it."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _STALL, wait], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr[-2000:])
    assert "warm" in p.stdout and "not stopped" not in p.stdout
    lines = [ln for ln in p.stderr.splitlines() if "restart the job" in ln]
    assert len(lines) == 1 and says in lines[0] and "rank 0" in lines[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert took < 45, took
