"""`generate --mode auto --slots auto`: the start-up probe runs on every rank (a real gloo all-gather), rank 0's
choice is broadcast, the choice is logged with its runner-up and predicted step, then predicted vs measured; the
outputs are the resident model's bytes."""

from __future__ import annotations

import re

import pytest
from conftest import run_generate

from dlo_fn.cli import build_parser
from dlo_fn.cli.generate import is_auto, options_from_args


def _generate(ckpt, out, *extra, log):
    """2 gloo ranks under torchrun; the log (stdout + stderr) is written to ``log``."""
    text, rows = run_generate(ckpt, out, *extra, nproc=2)
    log.write_text(text)
    return rows


def test_auto_arguments_parse():
    args = build_parser().parse_args(
        ["generate", "--checkpoint", "c", "--out", "o", "--prompt", "x", "--mode", "auto", "--slots", "auto"]
    )
    assert is_auto(args) and options_from_args(args).num_slots == 2
    fixed = build_parser().parse_args(
        ["generate", "--checkpoint", "c", "--out", "o", "--prompt", "x", "--resident", "--slots", "auto"]
    )
    assert not is_auto(fixed)  # resident has no slots to choose
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--checkpoint", "c", "--out", "o", "--slots", "many"])


@pytest.mark.slow
def test_auto_on_two_gloo_ranks_gives_the_resident_bytes(checkpoint, resident_rows, tmp_path):
    """... within an HBM budget below the tiny model's 0.65 MB: the policy keeps each plan's resident blocks."""
    auto = _generate(
        checkpoint,
        tmp_path / "auto",
        *("--mode", "auto", "--slots", "auto", "--hbm-budget", "0.6MB"),
        log=tmp_path / "log.txt",
    )
    assert [r["sha256"] for r in auto] == [r["sha256"] for r in resident_rows]
    log = (tmp_path / "log.txt").read_text()
    assert "dlo_fn.serve.probe: probe (" in log
    assert "auto: DP2xSP1 " in log and "runner-up" in log and "predicted step" in log
    planned = re.search(r"hbm budget 600.00 kB: (\d) blocks resident, device weights", log)
    built = re.search(r"hbm_budget: (\d) of \d+ blocks resident, .* placed by the policy's compute \(auto\)", log)
    assert planned and built and planned[1] == built[1], log[-3000:]  # offload built the chosen row's set
    # Waves (strict, or rank-local replicas) or ring steps (continuous, the default in allgather mode).
    assert re.search(r"auto: (wave|ring step) \d+: measured [\d.]+ ms per step, predicted", log), log[-3000:]


def test_sp_takes_an_int_or_auto(capsys):
    with pytest.raises(SystemExit) as exc:  # argparse's own: its usage, then one error line
        build_parser().parse_args(["generate", "--checkpoint", "c", "--out", "o", "--prompt", "x", "--sp", "two"])
    assert exc.value.code == 2
    assert "--sp takes an int >= 1 or 'auto', got 'two'" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--sp", "auto", "--resident"], ["--sp auto", "--resident"]),
        (["--sp", "auto", "--shard-group", "dp"], ["--sp auto", "--shard-group dp"]),
    ],
)
def test_sp_auto_mistakes_are_one_line(checkpoint, tmp_path, capsys, extra, words):
    from dlo_fn.cli import main

    code = main(["generate", "--checkpoint", checkpoint, "--out", str(tmp_path), "--prompt", "x", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and all(w in err[0] for w in words), err


def test_sp_auto_is_explained_in_help(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "auto: the policy chooses dp x sp" in text and "all-to-all" in text


@pytest.mark.slow
def test_sp_auto_on_two_gloo_ranks_matches_the_policy_table(checkpoint, resident_rows, tmp_path, capsys):
    """``--sp auto --mode auto --slots auto`` on 2 gloo ranks: a real all-to-all probe, the resident bytes, and a
    logged choice that is the first row of ``policy --topology <out>/auto_policy.json`` (the same measurement)."""
    import re

    from dlo_fn.cli import main

    auto = _generate(
        checkpoint, tmp_path / "auto", "--sp", "auto", "--mode", "auto", "--slots", "auto", log=tmp_path / "log.txt"
    )
    assert [r["sha256"] for r in auto] == [r["sha256"] for r in resident_rows]
    log = (tmp_path / "log.txt").read_text()
    assert re.search(r"all-to-all \d+\.\d MB/s", log), log[-2000:]
    chosen = re.search(r"auto: (DP\d+xSP\d+ [a-z-]+(?: W\d+)? S\d+ R\d+): .*runner-up DP", log)
    assert chosen is not None and "predicted step" in log, log[-2000:]
    assert main(["policy", "--topology", str(tmp_path / "auto" / "auto_policy.json"), "--slots", "2,3,4,5,6"]) == 0
    table = capsys.readouterr().out
    assert f"chosen: {chosen.group(1)}:" in table, table
    assert {"DP2xSP1", "DP1xSP2"} <= set(re.findall(r"DP\dxSP\d", table))
