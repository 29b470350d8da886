"""The load benchmark on real processes: the two scaling laws (mmap: M + N c; copies: N (M + c)), the CLI's
JSON/CSV output, and bounded waits (no orphans after a timeout)."""

from __future__ import annotations

import csv
import json

import psutil
import pytest

from benchmarks.bench.load import run_load_bench
from benchmarks.cli import main


@pytest.mark.slow
def test_mmap_shares_one_copy_and_copies_scale_with_n(ckpt_200mb):
    n = 3
    mmap = run_load_bench(ckpt_200mb, n, "mmap", timeout_s=240)
    copy = run_load_bench(ckpt_200mb, n, "copy", timeout_s=240, baseline=mmap.baseline)
    m, c = mmap.model_bytes, mmap.constant_bytes
    assert 2.0e8 < m < 2.3e8
    report = f"M={m} c={c} mmap={mmap.row()} copy={copy.row()}"
    assert mmap.sum_pss_bytes <= 1.15 * (m + n * c), report
    assert copy.sum_pss_bytes >= n * m, report
    # Where the bytes are: with mmap the file pages are shared (each worker's file-mapping PSS ~ M / N) and
    # nothing model-sized is private; with copies each worker holds M of anonymous memory, no mapping.
    assert abs(sum(w.weights_pss_bytes for w in mmap.workers) - m) < 0.02 * m, report
    assert all(w.memory.pss_anon_bytes < mmap.baseline.memory.pss_anon_bytes + 0.1 * m for w in mmap.workers), report
    assert all(w.weights_pss_bytes == 0 and w.memory.pss_anon_bytes > m for w in copy.workers), report
    assert mmap.workers[0].checksum == copy.workers[0].checksum  # the same bytes were read


@pytest.mark.slow
def test_cli_json_and_csv(tmp_path, capsys):
    from dlo_fn.models import write_checkpoint

    write_checkpoint("tiny", tmp_path / "ck", progress=False)
    out = tmp_path / "sweep.csv"
    assert (
        main(
            [
                "bench",
                "load",
                "--checkpoint",
                str(tmp_path / "ck"),
                "--ranks",
                "1",
                "--mode",
                "mmap",
                "copy",
                "--json",
                "--out",
                str(out),
                "--timeout-s",
                "240",
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    rows = list(csv.DictReader(out.open()))
    assert [(r["mode"], r["ranks"]) for r in rows] == [("mmap", "1"), ("copy", "1")]
    assert [(r["mode"], r["ranks"]) for r in printed] == [("mmap", 1), ("copy", 1)]
    assert all(r["command"].startswith("python -m benchmarks bench load") and r["machine"] and r["date"] for r in rows)
    assert all(int(r["model_bytes"]) == printed[0]["model_bytes"] > 0 for r in rows)
    assert all(r["sum_pss_bytes"] > r["model_bytes"] for r in printed)
    procs = list(csv.DictReader(out.with_name("sweep_processes.csv").open()))
    assert len(procs) == 2 and all(int(p["pss_bytes"]) > 0 for p in procs)


def test_timeout_kills_every_worker(tmp_path, capsys):
    from dlo_fn.models import write_checkpoint

    write_checkpoint("tiny", tmp_path, progress=False)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RuntimeError, match="timed out before reporting"):
        run_load_bench(tmp_path, 2, "mmap", timeout_s=0.2)
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not left, f"orphan workers {left}"


def test_bad_checkpoint_fails_before_starting_processes(tmp_path):
    with pytest.raises(ValueError, match="no such checkpoint"):
        run_load_bench(tmp_path / "absent", 2, "mmap")
    with pytest.raises(ValueError, match="mode must be mmap or copy"):
        run_load_bench(tmp_path, 2, "lazy")
