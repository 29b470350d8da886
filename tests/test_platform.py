"""Platform layer: the CPU implementation the tests run, and the detection / error paths."""

from __future__ import annotations

import time

import pytest
import torch

from dlo_fn.runtime.platform import HostEvent, HostStream, Platform, detect_platform, device_shortfall, platform_for


def test_cpu_platform_handles():
    p = platform_for("cpu")
    assert (p.kind, p.backend, p.device) == ("cpu", "gloo", torch.device("cpu"))
    assert not p.is_accelerator and not p.supports_pinned
    s = p.new_stream("h2d")
    assert isinstance(s, HostStream)
    with p.use_stream(s) as inside:
        assert inside is s
    assert p.memory_allocated() == 0 and p.max_memory_allocated() == 0
    p.synchronize()
    p.reset_peak_memory_stats()
    assert p.describe()["backend"] == "gloo"


def test_host_events_record_host_clock_in_order():
    p = platform_for("cpu")
    a, b = p.new_event(timing=True), p.new_event(timing=True)
    a.record(p.current_stream())
    time.sleep(0.01)
    b.record()
    assert a.elapsed_time(b) >= 9.0  # milliseconds, like torch.Event
    assert a.query() and b.query()


class _Work:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> None:
        self.waited += 1

    def is_completed(self) -> bool:
        return self.waited > 0


def test_host_event_waits_pending_collective_once():
    ev, work = HostEvent(), _Work()
    ev.work = work
    assert not ev.query()
    HostStream().wait_event(ev)
    HostStream().wait_event(ev)  # second waiter: already complete, nothing to wait for
    assert work.waited == 1 and ev.work is None and ev.query()


def test_detect_platform_respects_environment(monkeypatch):
    monkeypatch.setenv("DLO_FN_PLATFORM", "cpu")
    assert detect_platform().kind == "cpu"
    if not torch.cuda.is_available():
        monkeypatch.delenv("DLO_FN_PLATFORM")
        assert detect_platform(0).kind in ("cpu", "npu")


def test_bad_platform_kinds_fail_clearly():
    with pytest.raises(ValueError, match="unknown platform"):
        platform_for("tpu")
    with pytest.raises(ValueError, match="cuda, npu or cpu"):
        Platform("tpu", torch.device("cpu"), "gloo")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="is_available"):
            platform_for("cuda")
    with pytest.raises(RuntimeError, match="torch_npu"):
        platform_for("npu")


def test_more_ranks_than_devices_is_one_line_saying_what_to_do():
    assert device_shortfall("cuda", 0, 1, 1) is None and device_shortfall("cuda", 7, 8, 8) is None
    why = device_shortfall("cuda", 0, 2, 1)
    assert why.startswith("2 ranks on this host but 1 CUDA device:") and "--nproc-per-node 1" in why, why
    assert "\n" not in why and "--platform cpu" in why
    # A rank past the host's count (LOCAL_WORLD_SIZE unset) is short too; every rank of the host says the same.
    assert device_shortfall("npu", 3, 1, 2).startswith("4 ranks on this host but 2 NPU devices")
    assert device_shortfall("cuda", 1, 2, 1) == why


@pytest.mark.cuda
def test_torchrun_with_more_ranks_than_devices_is_one_line(checkpoint, tmp_path):
    import os
    import subprocess
    import sys

    from dlo_fn.runtime.dist import free_port

    n = torch.cuda.device_count() + 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port"]
    cmd += [str(free_port()), "-m", "dlo_fn", "generate", "--platform", "cuda", "--checkpoint", checkpoint]
    cmd += ["--out", str(tmp_path), "--prompt", "x", "--steps", "1", "--height", "32", "--width", "32"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    ours = [line for line in done.stderr.splitlines() if line.startswith("dlo_fn generate: error:")]
    assert done.returncode != 0 and len(ours) == 1, done.stderr[-3000:]
    assert f"{n} ranks on this host but {n - 1} CUDA device" in ours[0] and "dlo_fn/" not in done.stderr


@pytest.mark.cuda
def test_cuda_streams_and_events_order_work():
    p = platform_for("cuda", 0)
    side = p.new_stream("h2d")
    x = torch.ones(1 << 20, device=p.device)
    done = p.new_event(timing=True)
    start = p.new_event(timing=True)
    start.record(p.current_stream())
    with p.use_stream(side):
        side.wait_event(start)
        y = x * 2
        done.record(side)
    p.current_stream().wait_event(done)
    assert float(y.sum()) == 2.0 * (1 << 20)
    p.synchronize()
    assert start.elapsed_time(done) >= 0.0
