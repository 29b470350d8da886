"""`generate` end to end: torchrun with 2 gloo ranks (allgather, rank-local) and one process (resident) write
the same bytes; each output's file hashes to the manifest's SHA-256; the trace holds both ranks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import run_generate

from dlo_fn.cli import UsageError, build_parser
from dlo_fn.cli.generate import mode_from_args, options_from_args


def _generate(ckpt, out, *extra, nproc=1):
    return run_generate(ckpt, out, *extra, nproc=nproc)[1]


@pytest.mark.slow
def test_all_modes_write_the_same_hashes(checkpoint, resident_rows, tmp_path):
    allgather = _generate(checkpoint, tmp_path / "ag", "--trace", str(tmp_path / "trace.json"), nproc=2)
    rank_local = _generate(checkpoint, tmp_path / "rl", "--no-allgather", nproc=2)
    resident = resident_rows
    hashes = [[r["sha256"] for r in rows] for rows in (allgather, rank_local, resident)]
    assert hashes[0] == hashes[1] == hashes[2] and len(set(hashes[0])) == 3
    # Continuous (the default): fox | owl, then the third takes rank 0 at the fox's end.
    assert [r["rank"] for r in allgather] == [0, 1, 0] and {r["serving"] for r in allgather} == {"continuous"}
    steps = [json.loads(line) for line in (tmp_path / "ag" / "steps.jsonl").read_text().splitlines()]
    assert not (tmp_path / "ag" / "waves.jsonl").exists()  # continuous serving has ring steps, no waves
    held = [ids for k in steps for ids in k["ranks"]]
    assert (
        {i for ids in held for i in ids} == {r["id"] for r in allgather}
        and [k["step"] for k in steps] == sorted(k["step"] for k in steps)
        and all(len(k["ranks"]) == 2 for k in steps)
    )
    assert {r["mode"] for r in rank_local} == {"rank-local"}
    trace = json.loads((tmp_path / "trace.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert pids == {0, 1}
    ag = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["cat"] == "allgather"]
    # Both ranks ran every all-gather, rank 1 also in the ring steps where it computed nothing.
    assert len([e for e in ag if e["pid"] == 0]) == len([e for e in ag if e["pid"] == 1]) > 0


def test_mode_flags_and_options():
    parser = build_parser()
    base = ["generate", "--checkpoint", "c", "--prompt", "p", "--out", "o"]
    assert mode_from_args(parser.parse_args(base)) == "allgather"
    assert mode_from_args(parser.parse_args(base + ["--no-allgather"])) == "rank-local"
    assert mode_from_args(parser.parse_args(base + ["--mode", "resident", "--resident"])) == "resident"
    with pytest.raises(UsageError, match="conflicting modes"):
        mode_from_args(parser.parse_args(base + ["--resident", "--no-allgather"]))
    opts = options_from_args(parser.parse_args(base + ["--slots", "3", "--trace", "t.json"]))
    assert opts.num_slots == 3 and opts.record_timeline and opts.mode == "allgather"
    assert options_from_args(parser.parse_args(base + ["--shard-group", "dp"])).shard_group == "dp"
    assert options_from_args(parser.parse_args(base + ["--hbm-budget", "12GiB"])).hbm_budget == 12 * 2**30
    assert options_from_args(parser.parse_args(base)).hbm_budget is None
    with pytest.raises(UsageError, match="^generate: --hbm-budget: cannot read 'much'"):
        options_from_args(parser.parse_args(base + ["--hbm-budget", "much"]))


@pytest.mark.slow
def test_sp_under_torchrun_writes_the_resident_hashes(checkpoint, resident_rows, tmp_path):
    """torchrun --nproc-per-node 2 generate --sp 2 --serving strict: one replica of 2 sp ranks runs every wave (dp =
    1)."""
    sp = _generate(
        checkpoint, tmp_path / "sp", "--sp", "2", "--serving", "strict", nproc=2
    )  # waves; continuous: test_continuous_mesh
    assert [r["sha256"] for r in sp] == [r["sha256"] for r in resident_rows]
    assert [(r["rank"], r["wave"], r["dp_size"], r["sp_size"]) for r in sp] == [(0, w, 1, 2) for w in range(3)]


def test_sp_that_does_not_divide_the_ranks_is_one_line(checkpoint, tmp_path, capsys):
    """In this process (one rank, no torchrun): a usage error before anything loads."""
    from dlo_fn.cli import main

    argv = ["generate", "--checkpoint", checkpoint, "--out", str(tmp_path), "--prompt", "a fox", "--sp", "2"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "dlo_fn generate: error: --sp 2 does not divide the 1 rank(s) (torchrun --nproc-per-node): use --sp in [1]"
    ]


def test_load_groups_write_the_resident_hashes(checkpoint, resident_rows, tmp_path):
    # One process: allgather over one rank is the rank-local sequence, so --load-group applies (4 slots by default).
    rows = _generate(checkpoint, tmp_path / "g2", "--load-group", "2")
    assert [r["sha256"] for r in rows] == [r["sha256"] for r in resident_rows]


def test_load_group_auto_is_chosen_from_the_probe_and_writes_the_resident_hashes(checkpoint, resident_rows, tmp_path):
    # --load-group auto: the start-up probe prices the host work per block, the policy chooses G with the slots
    # (each G on slots that are a multiple of it, >= 2G), the choice is logged, and the bytes are resident's.
    out = tmp_path / "auto"
    log, rows = run_generate(checkpoint, out, "--load-group", "auto", "--no-allgather")
    assert [r["sha256"] for r in rows] == [r["sha256"] for r in resident_rows]
    chosen = re.search(r"auto: DP1xSP1 rank-local S(\d+) R1( G(\d))?:", log)
    assert chosen, log[-3000:]
    slots, group = int(chosen.group(1)), int(chosen.group(3) or 1)
    assert group in (1, 2, 4) and slots % group == 0 and slots >= 2 * group
    table = json.loads((out / "auto_policy.json").read_text())
    assert "topology" in table


@pytest.mark.slow
def test_generate_takes_an_index_file_as_load_model_does(resident_rows, tmp_path):
    """``--checkpoint DIR/model.safetensors.index.json`` (what load_model and plan take) writes the same bytes as
    the folder: the config is the one beside the index."""
    from dlo_fn.models import write_checkpoint

    folder = write_checkpoint("tiny", tmp_path / "sharded", seed=0, max_shard_bytes=200_000, progress=False)
    index = next(folder.glob("*.index.json"))
    rows = _generate(str(index), tmp_path / "out", "--resident")
    assert [r["sha256"] for r in rows] == [r["sha256"] for r in resident_rows]


def _on_a_terminal(argv: list[str]) -> str:
    """Run ``argv`` with stderr on a pseudo-terminal of 120 columns; what it wrote there."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    env = dict(os.environ, OMP_NUM_THREADS="1", DLO_FN_PLATFORM="cpu")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        try:
            data = os.read(master, 65536) if ready else b""
        except OSError:  # the child closed the terminal
            break
        if data:
            chunks.append(data)
        elif proc.poll() is not None:
            break
    assert proc.wait(timeout=120) == 0, b"".join(chunks)[-3000:]
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_continuous_serving_shows_a_bar_on_a_terminal_and_none_in_a_log(checkpoint, tmp_path):
    """Rank 0's bar of continuous serving (requests done of those arrived, queued, ring step) on a terminal; a
    log (stderr not a terminal) gets the log lines only."""
    argv = [
        sys.executable,
        "-m",
        "dlo_fn",
        "generate",
        "--checkpoint",
        checkpoint,
        "--steps",
        "1",
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "5",
        "--prompt",
        "a fox",
        "--prompt",
        "an owl",
        "--prompt",
        "a cat",
    ]
    shown = _on_a_terminal(argv + ["--out", str(tmp_path / "tty")])
    assert re.search(r"serving: 100%.*3/3 .*queued 0, ring step \d", shown), shown[-2000:]
    logged = subprocess.run(
        argv + ["--out", str(tmp_path / "log")],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1", DLO_FN_PLATFORM="cpu"),
    )
    assert logged.returncode == 0 and "ring step 0: req0000 starts" in logged.stderr
    assert "serving:" not in logged.stderr and "request/s" not in logged.stderr, logged.stderr[-2000:]
    # Log lines in words and units: no raw dicts of float seconds or bare byte counts.
    assert "{'" not in logged.stderr and "_s'" not in logged.stderr, logged.stderr[-2000:]
    assert re.search(r"host store: rank 0, [\d.]+ kB \(pageable\), .* filled in [\d.]+ ms", logged.stderr)
    assert re.search(r"offload VideoDiT: allgather, 4 blocks, .* device weights [\d.]+ kB on cpu", logged.stderr)
