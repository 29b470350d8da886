"""The processes behind `python -m benchmarks bench load`: workers, the barrier, and the measurement at it.

A worker is ``python -m benchmarks.bench.load_worker --mode {mmap,copy,none}``: it builds the model on ``meta``,
loads (or, for ``none``, does not), reads every weight, prints one JSON line and blocks on stdin. The driver
waits (bounded) until every worker of a group has printed, reads each one's smaps and the cgroup while all are
alive, then releases them; on a timeout or a crash it kills them and reports their stderr.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from dlo_fn.io.memstat import ProcessMemory, cgroup_memory, mapped_file_memory, process_memory

__all__ = ["WorkerSample", "run_group", "WORKER_MODES"]

WORKER_MODES = ("mmap", "copy", "none")


@dataclass(frozen=True, slots=True)
class WorkerSample:
    memory: ProcessMemory
    weights_pss_bytes: int  # PSS of the checkpoint files' own mappings
    load_s: float
    touch_s: float
    checksum: float | None


def _spawn(checkpoint: str, mode: str, stderr) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench.load_worker", "--checkpoint", checkpoint, "--mode", mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )


def run_group(checkpoint: str, modes: list[str], files: list[str], timeout_s: float):
    """Start one worker per mode, wait until all report (the barrier), measure, release. Every wait is
    bounded; on any failure the workers are killed and the error carries their stderr."""
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="dlo_fn_bench_load_") as tmp:
        logs = [open(pathlib.Path(tmp) / f"worker{i}.err", "w+") for i in range(len(modes))]
        procs = [_spawn(checkpoint, m, log) for m, log in zip(modes, logs)]
        lines: list[str | None] = [None] * len(procs)
        readers = [
            threading.Thread(target=lambda i=i: lines.__setitem__(i, procs[i].stdout.readline()), daemon=True)
            for i in range(len(procs))
        ]
        try:
            for r in readers:
                r.start()
            for r in readers:
                r.join(max(0.0, deadline - time.monotonic()))
            bad = [i for i, line in enumerate(lines) if not line]
            if bad:
                why = "timed out" if time.monotonic() >= deadline else "exited"
                raise RuntimeError(f"load worker(s) {bad} {why} before reporting:\n" + _tails(logs, bad))
            reports = [json.loads(line) for line in lines]
            samples = []
            for proc, rep in zip(procs, reports):  # all alive, weights touched: measure now
                mem = process_memory(proc.pid)
                weights = mapped_file_memory(files, proc.pid)["pss_bytes"]
                samples.append(WorkerSample(mem, weights, rep["load_s"], rep["touch_s"], rep["checksum"]))
            driver, cgroup = process_memory(), cgroup_memory()
        finally:
            for p in procs:
                try:
                    p.stdin.write("\n")
                    p.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
            for p in procs:
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)
            for log in logs:
                log.close()
    return samples, driver, cgroup


def _tails(logs, which) -> str:
    out = []
    for i in which:
        logs[i].flush()
        logs[i].seek(0)
        out.append(f"--- worker {i} stderr ---\n" + "".join(logs[i].readlines()[-15:]))
    return "\n".join(out)


def _worker(checkpoint: str, mode: str) -> None:
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(1)
    import safetensors  # noqa: F401  - imported by every mode, so the constant includes it
    import tqdm.auto  # noqa: F401

    from dlo_fn.io.bind import meta_module_from_header, model_from_config
    from dlo_fn.io.checkpoint import open_checkpoint
    from dlo_fn.io.load import load_checkpoint

    ckpt = open_checkpoint(checkpoint)
    dlo = isinstance(ckpt.config, dict) and ckpt.config.get("model_type") == "dlo_fn-video-dit"
    model = model_from_config(ckpt) if dlo else meta_module_from_header(ckpt.header)
    checksum, t1 = None, time.perf_counter()
    if mode != "none":
        model, _ = load_checkpoint(ckpt, model, mode=mode, progress=False)
        t1 = time.perf_counter()
        checksum = _touch(model)
    t2 = time.perf_counter()
    print(json.dumps({"pid": os.getpid(), "load_s": t1 - t0, "touch_s": t2 - t1, "checksum": checksum}), flush=True)
    sys.stdin.readline()  # hold everything alive until the driver has measured


def _touch(model) -> float:
    """Read every byte of every weight: a float64 sum in 64K-element chunks (no model-sized temporary, and
    a 512 KB one that the allocator gives back)."""
    import torch

    total = 0.0
    for t in {id(t): t for t in model.state_dict().values()}.values():
        for chunk in t.reshape(-1).split(1 << 16):
            total += float(torch.sum(chunk, dtype=torch.float64))
    return total


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="load-bench worker (started by `python -m benchmarks bench load`)")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--mode", choices=WORKER_MODES, required=True)
    a = parser.parse_args()
    _worker(a.checkpoint, a.mode)
