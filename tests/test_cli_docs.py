"""docs/cli.md against the command line: every example command parses, every command and bench subcommand it
names exists, and every flag it mentions (in a command's section or table row) is that command's, with each value
it lists (``--flag a|b|c``) accepted. Placeholders (``S``, ``BYTES``, ``FILE``) are not values."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from benchmarks.cli import lab_parser
from dlo_fn.cli import build_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def _subparsers(parser: argparse.ArgumentParser) -> dict:
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


LAB = _subparsers(lab_parser())  # python -m benchmarks COMMAND
COMMANDS = {**_subparsers(build_parser()), **LAB}


def _examples() -> list[tuple[str, list[str]]]:
    """The bash block's commands: ``(program, the words after it)`` for ``dlo_fn`` and ``benchmarks`` (continuation
    lines joined, comments and other lines left)."""
    block = re.search(r"```bash\n(.*?)```", DOC.read_text(), re.S).group(1)
    joined = re.sub(r"\\\n", " ", block)
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        for program in ("dlo_fn", "benchmarks"):
            if program in words and words[0] in ("python", "torchrun"):
                commands.append((program, words[words.index(program) + 1 :]))
    return commands


@pytest.mark.parametrize("program, argv", _examples(), ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_every_example_parses(program, argv):
    parser = build_parser() if program == "dlo_fn" else lab_parser()
    parser.parse_args(argv)  # argparse's mistakes exit: a failure here names the command


def test_the_lab_commands_are_said_to_be_the_labs():
    text = DOC.read_text()
    assert "`python -m benchmarks COMMAND`" in text and all(f"`{name}" in text for name in LAB)
    assert all(program == "benchmarks" for program, argv in _examples() if argv[0] in LAB)


def _mentions() -> list[tuple[str, str, str | None]]:
    """``(command, flag, listed value or None)`` for each flag in backticks under a command's section, or in the
    commands table's row of that command; a span that starts with a command's name is that command's."""
    out = []
    command = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            name = line[3:].strip()
            command = name if name in COMMANDS else None
        row = re.match(r"\| `([^`\s]+)", line)
        where = row.group(1) if row and row.group(1) in COMMANDS else command
        if where is None:
            continue
        for span in re.findall(r"`([^`]*--[^`]*)`", line):
            words = span.replace("[", " ").replace("]", " ").split()
            named = words[0] if words[0] in COMMANDS else where  # `policy --topology` in generate's section
            for i, word in enumerate(words):
                for flag in (f for f in word.split("/") if f.startswith("-")):
                    value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("-") else None
                    out.append((named, flag, value if "/" not in word else None))
    return out


def _is_placeholder(value: str) -> bool:
    return value == "..." or value.upper() == value


def test_the_doc_mentions_flags_of_generate_and_quantize():
    commands = {c for c, _, _ in _mentions()}
    assert {"generate", "quantize", "memory", "figures"} <= commands, commands


@pytest.mark.parametrize("command, flag, value", _mentions(), ids=lambda x: str(x))
def test_every_flag_and_listed_value_is_accepted(command, flag, value):
    parser = COMMANDS[command]
    actions = {s: a for a in parser._actions for s in a.option_strings}
    assert flag in actions, f"docs/cli.md: {command} {flag}: not a flag of {command} ({sorted(actions)})"
    action = actions[flag]
    for choice in (value or "").split("|"):
        if not choice or _is_placeholder(choice):
            continue
        assert action.nargs != 0, f"docs/cli.md: {command} {flag} takes no value, the doc gives {choice!r}"
        if action.choices is not None:
            assert choice in action.choices, f"docs/cli.md: {command} {flag} {choice}: not in {action.choices}"
        elif action.type is not None:
            action.type(choice)


def test_bench_subcommands_in_the_table_exist():
    listed = re.search(r"`bench \{([^}]*)\}`", DOC.read_text()).group(1).split(",")
    assert set(listed) == set(_subparsers(LAB["bench"])), listed
