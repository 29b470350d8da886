"""`generate` without size flags (dlo_fn.cli.generate_size): the line that names the default workload, its FLOPs
and least time on this machine, and the flags of a quick run; --help says the same."""

from __future__ import annotations

import re

import pytest

from dlo_fn.cli import build_parser, main
from dlo_fn.cli.generate_args import check_generate_args
from dlo_fn.cli.generate_size import QUICK_FLAGS, default_size_note, forward_flops
from dlo_fn.models import CONFIGS, Request
from dlo_fn.runtime.platform import platform_for
from dlo_fn.serve.admission import request_shape


def _note(checkpoint, *extra):
    args = build_parser().parse_args(["generate", "--checkpoint", checkpoint, "--out", "unused", *extra])
    _, submissions = check_generate_args(args)
    return default_size_note(args, submissions, CONFIGS["tiny"], platform_for("cpu"))


def test_no_size_flags_names_the_workload_its_flops_and_the_quick_flags(checkpoint):
    note = _note(checkpoint, "--prompt", "a red fox")
    shape = request_shape(CONFIGS["tiny"], Request("a red fox"))  # the defaults: CFG on, 2 rows
    m = re.match(
        r"no --height/--width/--frames/--steps given: each prompt runs the default 832x480, 29 frames, 35 steps "
        r"with CFG \(70 forwards of (\d+) tokens, ([\d.]+) TFLOP in the blocks\): at least ([\d.]+ (s|min|h)) per "
        r"prompt at this CPU's measured matmul rate; (.*) runs in seconds$",
        note,
    )
    assert m, note
    assert int(m.group(1)) == shape.tokens and m.group(5) == QUICK_FLAGS
    assert float(m.group(2)) == pytest.approx(70 * forward_flops(CONFIGS["tiny"], shape.tokens) / 1e12, abs=0.05)
    # The quick flags are valid, and any size flag or a prompts file (which sets its own sizes) says nothing.
    assert _note(checkpoint, "--prompt", "x", *QUICK_FLAGS.split()) is None
    assert _note(checkpoint, "--prompt", "x", "--steps", "2") is None


def test_help_says_what_no_size_flags_runs(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Without --height/--width/--frames/--steps each prompt runs the published size" in text
    assert QUICK_FLAGS in text
