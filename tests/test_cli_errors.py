"""Ordinary mistakes give one line naming the argument, file, key or line and what to do, exit code 2, before any
model is loaded (issue 11: items 3, 4, 7); a closed stdout, torchrun ranks and partly bad prompt files too.

Most cases run in-process through :func:`dlo_fn.cli.main`; a few run the real command for the exit code and
stderr an interpreter gives (no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dlo_fn.cli import UsageError, main
from dlo_fn.cli.make_checkpoint import SIZES_BF16_BYTES, config_names

SMALL = ["--steps", "2", "--height", "32", "--width", "32", "--frames", "5"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", DLO_FN_PLATFORM="cpu")


def _one_line(capsys, argv, code=2) -> str:
    """Run ``main(argv)``; assert the exit code and exactly one stderr line; return it."""
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "nano2"], ["--model nano2", "neither a named config"]),
        (["--model", "tiny", "--shard-world", "0"], ["--shard-world 0", ">= 1"]),
        (["--model", "tiny", "--num-shards", "-2"], ["--num-shards -2", ">= 1"]),
        (["--model", "tiny", "--alignment", "100"], ["--alignment 100", "power of two"]),
        (["--model", "tiny", "--landing", "0"], ["--landing 0"]),
    ],
)
def test_plan_mistakes(capsys, argv, words):
    line = _one_line(capsys, ["plan", *argv])
    assert line.startswith("dlo_fn plan: error: ") and all(w in line for w in words), line


def test_plan_missing_checkpoint_names_the_path(capsys, tmp_path):
    line = _one_line(capsys, ["plan", "--model", str(tmp_path / "nothere")])
    assert str(tmp_path / "nothere") in line and "config.json" not in line


def test_plan_and_generate_agree_on_one_slot(capsys):
    assert main(["plan", "--model", "tiny", "--slots", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # W = 1: the all-gather lowers to the rank-local program (H2D straight into the slot, no landing buffer),
    # so one slot holds the only block on the device.
    assert plan["num_slots"] == 1 and plan["hbm_weight_bytes"] == plan["max_padded_block_bytes"]
    assert "--slots 0" in _one_line(capsys, ["plan", "--model", "tiny", "--slots", "0"])


def test_generate_accepts_one_slot_as_plan_does(checkpoint, tmp_path):
    from dlo_fn.cli import build_parser
    from dlo_fn.cli.generate import check_generate_args

    args = build_parser().parse_args(_generate(checkpoint, tmp_path, "--prompt", "x", "--slots", "1"))
    options, subs = check_generate_args(args)
    assert options.num_slots == 1 and [s.request_id for s in subs] == ["req0000"]


def test_generate_load_group_slots_and_shard_group(checkpoint, tmp_path, monkeypatch):
    from dlo_fn.cli import build_parser
    from dlo_fn.cli.generate import check_generate_args

    def parse(*extra):
        return build_parser().parse_args(_generate(checkpoint, tmp_path, "--prompt", "x", *extra))

    options, _ = check_generate_args(parse("--load-group", "3"))
    assert (options.load_group, options.num_slots) == (3, 6)  # two groups in flight by default
    assert check_generate_args(parse())[0].num_slots == 2
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: allgather shards each block over both ranks
    options, _ = check_generate_args(parse("--load-group", "2"))  # one collective per group of 2
    assert (options.mode, options.load_group, options.num_slots, options.num_landing) == ("allgather", 2, 4, None)
    with pytest.raises(UsageError, match=r"--load-group 2 --landing 3: give --landing a multiple of 2"):
        check_generate_args(parse("--load-group", "2", "--landing", "3"))
    with pytest.raises(UsageError, match=r"--landing 0: give >= 1"):
        check_generate_args(parse("--landing", "0"))
    assert check_generate_args(parse("--load-group", "2", "--no-allgather"))[0].mode == "rank-local"
    assert check_generate_args(parse("--load-group", "2", "--sp", "2", "--shard-group", "sp"))[0].load_group == 2
    # auto: the policy chooses G (and the slots, unless given) once probed, over 2 ranks too (on 2G landing
    # buffers), so no refusal here
    options, _ = check_generate_args(parse("--load-group", "auto"))
    assert (options.load_group, options.num_slots) == (1, 2)  # placeholders until the probe
    assert check_generate_args(parse("--load-group", "2", "--slots", "auto", "--no-allgather"))[0].load_group == 2


def _generate(checkpoint, tmp_path, *extra):
    return ["generate", "--checkpoint", checkpoint, "--out", str(tmp_path / "out"), *SMALL, *extra]


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--prompt", "x", "--height", "33"], ["--height", "height=33", "multiple of 16"]),
        (["--prompt", "x", "--frames", "4"], ["--frames", "num_frames=4", "1 + a multiple of"]),
        (["--prompt", "x", "--steps", "0"], ["--steps", "num_inference_steps=0", ">= 1"]),
        (["--prompt", "x", "--guidance=-1"], ["--guidance", "guidance_scale=-1.0", ">= 1"]),
        (["--prompt", ""], ["--prompt", "non-empty"]),
        (["--prompt", "x", "--slots", "0"], ["--slots 0", ">= 1"]),
        (["--prompt", "x", "--requests-per-rank", "0"], ["--requests-per-rank 0"]),
        (["--prompt", "x", "--cuda-graph", "block", "--graph-shapes", "0"], ["--graph-shapes 0", ">= 1"]),
        (["--prompt", "x", "--timeout", "0"], ["--timeout 0"]),
        (["--prompt", "x", "--load-group", "0"], ["--load-group 0", ">= 1", "auto"]),
        (["--prompt", "x", "--load-group", "2", "--slots", "3"], ["--load-group 2 --slots 3", "multiple of 2", ">= 4"]),
        (["--prompt", "x", "--resident", "--no-allgather"], ["conflicting modes"]),
        ([], ["--prompt", "--prompts"]),
    ],
)
def test_generate_flag_mistakes(capsys, checkpoint, tmp_path, extra, words):
    line = _one_line(capsys, _generate(checkpoint, tmp_path, *extra))
    assert line.startswith("dlo_fn generate: error: ") and all(w in line for w in words), line
    assert not (tmp_path / "out" / "manifest.jsonl").exists()


def test_generate_missing_checkpoint_names_it(capsys, tmp_path):
    missing = str(tmp_path / "ckpt" / "nothere")
    line = _one_line(capsys, _generate(missing, tmp_path, "--prompt", "x"))
    assert f"--checkpoint {missing}: no such directory" in line and "make-checkpoint" in line


def test_generate_corrupt_header_is_one_line(capsys, checkpoint, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:8] + b"{not json" + data[17:])
    line = _one_line(capsys, _generate(str(bad), tmp_path, "--prompt", "x"))
    assert f"--checkpoint {bad}" in line and "model.safetensors" in line


def test_generate_prompts_file_mistakes(capsys, checkpoint, tmp_path):
    line = _one_line(capsys, _generate(checkpoint, tmp_path, "--prompts", str(tmp_path / "none.jsonl")))
    assert "--prompts" in line and "not found" in line
    empty = tmp_path / "empty.jsonl"
    empty.write_text("# nothing\n\n")
    assert "no requests" in _one_line(capsys, _generate(checkpoint, tmp_path, "--prompts", str(empty)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('not json\n{"prompt": "x", "height": 33}\n')
    assert main(_generate(checkpoint, tmp_path, "--prompts", str(bad))) == 2
    err = capsys.readouterr().err.strip().splitlines()  # one line per bad line, each naming FILE:LINE
    assert [e.split(": ")[2] for e in err] == [f"--prompts {bad}:1", f"--prompts {bad}:2"]
    assert "height=33" in err[1]


def test_messages_point_to_what_was_typed_and_what_to_do(capsys, checkpoint, tmp_path):
    line = _one_line(capsys, _generate(checkpoint, tmp_path, "--prompts", str(tmp_path)))
    assert f"--prompts {tmp_path}: {tmp_path} is a directory: give the prompts file in it" in line
    no_prompt = tmp_path / "seed_only.jsonl"
    no_prompt.write_text('# a request\n{"seed": 1}\n')
    line = _one_line(capsys, _generate(checkpoint, tmp_path, "--prompts", str(no_prompt)))
    assert f'{no_prompt}:2: no "prompt" field: every request needs one' in line and "__init__" not in line
    text = tmp_path / "afile.txt"
    text.write_text("1xH200\n")
    line = _one_line(capsys, ["policy", "--topology", str(text)])
    assert f"--topology {text}: not JSON" in line and "unknown topology" not in line
    line = _one_line(capsys, ["plan", "--model", f"{checkpoint}/config.json"])
    assert f"pass the folder that holds the checkpoint, {checkpoint}" in line
    assert main(["policy", "--model", "tiny", "--topology", "1xH200", "--limit", "1"]) == 0
    capsys.readouterr()
    # A checkpoint the CLI cannot build: it says what the CLI takes, and the Python call for the rest.
    import shutil

    other = tmp_path / "llama"
    shutil.copytree(checkpoint, other)
    (other / "config.json").write_text('{"model_type": "llama"}')
    line = _one_line(capsys, ["quantize", str(other), str(tmp_path / "q"), "--no-progress"])
    assert "the command line takes those only; from Python pass model_or_factory=" in line
    # plan plans it from its headers, and says on stderr that generate cannot run it, as generate then says.
    assert main(["plan", "--model", str(other)]) == 0
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert note.startswith(f"dlo_fn plan: note: generate cannot run --model {other} (") and "llama" in note
    assert "model_type is 'llama'" in _one_line(capsys, _generate(str(other), tmp_path, "--prompt", "x"))


def test_plan_without_block_lists_names_the_flag(capsys, tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "flat").mkdir()
    save_file({"a.weight": torch.zeros(4, 4)}, str(tmp_path / "flat" / "model.safetensors"))
    line = _one_line(capsys, ["plan", "--model", str(tmp_path / "flat")])
    assert "name its block lists (plan --block-paths a,b; Python: block_paths=)" in line


def test_make_checkpoint_mistakes(capsys, tmp_path):
    line = _one_line(capsys, ["make-checkpoint", "--model", "tiny", "--out", "/proc/nope", "--no-progress"])
    assert "--out /proc/nope" in line and "writable" in line
    line = _one_line(capsys, ["make-checkpoint", "--model", "tiny", "--out", str(tmp_path), "--max-shard-size", "lots"])
    assert "--max-shard-size lots" in line


def test_generate_help_says_what_the_hash_is_and_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    assert "not of a file" in text and "file_sha256" in text and "exit codes: 0" in text and "noise" in text


def test_make_checkpoint_help_lists_every_size():
    """The --help table is measured: each size equals the built model's tensor bytes in bf16."""
    from dlo_fn.cli.make_checkpoint import _config
    from dlo_fn.models import build_model
    from dlo_fn.models.init import init_plan

    for name in config_names():
        model = build_model(_config(name), device="meta")
        assert sum(t.nbytes for t in init_plan(model)) == SIZES_BF16_BYTES[name], name
    assert 0.9e9 < SIZES_BF16_BYTES["load-1gb"] < 1.1e9


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model-bytes", "10GB", "--dp", "2", "--num-blocks", "0"], ["--num-blocks 0"]),
        (["--model-bytes", "10GB", "--dp", "2", "--max-block-bytes", "20GB"], ["--max-block-bytes 20GB", "at most"]),
        (["--model-bytes=-5GB", "--dp", "2"], ["--model-bytes -5GB", "negative"]),
        (["--model-bytes", "-5GB", "--dp", "2"], ["--model-bytes -5GB", "negative"]),  # not "expected one argument"
        (["--model-bytes", "10XB", "--dp", "2"], ["--model-bytes 10XB", "cannot read"]),
        (["--model", "nano2", "--dp", "2"], ["--model nano2"]),
    ],
)
def test_memory_mistakes(capsys, argv, words):
    line = _one_line(capsys, ["memory", *argv])
    assert all(w in line for w in words), line


def test_verbose_after_the_command_and_tiny_units(capsys):
    assert main(["plan", "--model", "tiny", "-v"]) == 0
    out = capsys.readouterr().out
    assert "0.000 GB" not in out and "KB)" in out
    assert main(["plan", "--model", "tiny", "--alignment", "100", "-v"]) == 2  # -v after: the traceback too
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("dlo_fn plan: error: --alignment 100")


def test_closed_stdout_is_quiet():
    """``plan --json | head``: the reader leaves before we write; no BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlo_fn", "plan", "--model", "cosmos3-super", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and err == "", err


def test_real_command_exit_code_and_rank_0_only(tmp_path):
    """The interpreter's exit code is 2 and stderr one line; with RANK=1 (a torchrun follower) nothing."""
    argv = [sys.executable, "-m", "dlo_fn", "plan", "--model", "tiny", "--alignment", "100"]
    done = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--alignment 100" in done.stderr
    follower = subprocess.run(argv, capture_output=True, text=True, env=dict(ENV, RANK="1"), timeout=120)
    assert follower.returncode == 2 and follower.stderr == ""


def test_partly_bad_prompts_file_runs_the_rest(checkpoint, tmp_path):
    """Bad lines are named before loading, the good ones run, exit code 1; the
    trace merges the ranks, says where it went and labels the prefetch; the manifest hashes each file."""
    import hashlib

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"prompt": "a fox"}\n{"prompt": "an owl", "id": "x"}\n{"prompt": "a cat", "id": "x"}\n'
        '{"prompt": "a dog", "frames": 5}\n'
    )
    trace, out = tmp_path / "trace.json", tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "dlo_fn",
        "generate",
        "--checkpoint",
        checkpoint,
        "--out",
        str(out),
        *SMALL,
        "--prompts",
        str(prompts),
        "--trace",
        str(trace),
        "--serving",
        "strict",
    ]  # its log: a line per wave
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=240)
    assert done.returncode == 1, done.stderr[-3000:]
    err = done.stderr
    assert "Traceback" not in err
    skipped = [line for line in err.splitlines() if line.startswith("dlo_fn generate: skipping")]
    assert [line.split(": ")[1].split()[1] for line in skipped] == [f"{prompts}:3", f"{prompts}:4"]
    assert err.index("skipping") < err.index("loaded ")  # named before the model was loaded
    assert "id 'x' is already used on line 2" in skipped[0] and "'frames'" in skipped[1]
    assert "2 of 4 request(s) produced no output" in err.splitlines()[-1]
    assert "wave 0 (2 in this dispatch): 1 request(s) [line0001], 2 step(s)" in err  # a line per wave
    assert "wave 0 line0001" not in err and "2/2" not in err  # no step bar: stderr is a log, not a terminal
    assert "timeline" in done.stdout and str(trace) in done.stdout
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    tail = [e for e in events if e["name"].endswith("(prefetch for next run)")]
    assert tail and all(e["args"]["op"].split()[1] in ("H2D", "AG") for e in tail)
    rows = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [r["ok"] for r in rows] == [True, True, False, False]
    for row in rows:
        assert set(row["file_sha256"]) == set(row["files"])
        for name, digest in row["file_sha256"].items():
            assert hashlib.sha256((out / name).read_bytes()).digest().hex() == digest


@pytest.mark.slow
def test_torchrun_prints_a_usage_error_once(checkpoint, tmp_path):
    from dlo_fn.runtime.dist import free_port

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
        "--out",
        str(tmp_path),
        *SMALL,
        "--prompt",
        "x",
        "--height",
        "33",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=240)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("dlo_fn generate: error:")]
    assert len(ours) == 1 and "--height" in ours[0], done.stderr[-3000:]
    # torchrun's launcher still raises its ChildFailedError, but no rank printed a traceback of ours, and the
    # summary's root cause is our line (from torchrun's error file), not a pointer to its documentation.
    assert "dlo_fn/" not in done.stderr.replace(str(tmp_path), "")
    assert "traceback : dlo_fn generate: error: --height" in done.stderr


@pytest.mark.parametrize(
    "fault, words",
    [
        ('{"rank": 0, "wave": 1, "kind": "raise"}', ["DLO_FN_FAULT", '"wave": 1', "ring step", '"step"']),
        ('{"rank": 0, "kind": "nap"}', ["DLO_FN_FAULT", "kind"]),
    ],
)
def test_generate_fault_that_continuous_serving_would_ignore_is_one_line(
    capsys, checkpoint, tmp_path, monkeypatch, fault, words
):
    """Continuous serving has ring steps, not waves: a fault naming wave 1 used to be ignored (it fired at ring step
    0); now it is refused before loading, with what to give instead."""
    monkeypatch.setenv("DLO_FN_FAULT", fault)
    line = _one_line(capsys, _generate(checkpoint, tmp_path, "--prompt", "x"))
    assert all(w in line for w in words), line
    assert not (tmp_path / "out").exists()
