"""`python -m dlo_fn <command>`: one module per command under :mod:`dlo_fn.cli`.

Each command module defines ``register(subparsers)`` (adds its parser and sets ``func``) and keeps its heavy
imports inside the function it runs, so ``--help`` stays fast.

:func:`main` is the one error boundary of every command. A mistake in the command line or in a file it names
(:class:`UsageError`, any ``ValueError`` such as :class:`~dlo_fn.io.checkpoint.CheckpointError`, a missing
or existing file) prints one line ``dlo_fn <command>: error: ...`` on stderr and exits with 2; an ``OSError``
while working exits with 1; Ctrl-C exits with 130; a closed stdout (``--json | head``) exits with 1 quietly.
Under ``torchrun`` (``RANK`` set) usage errors, which every rank detects the same way before any model is
loaded, are printed by rank 0 only; a runtime failure is printed by the rank that had it, prefixed with its
rank. ``-v`` (before or after the command) shows the traceback as well. Other exceptions are bugs: they
propagate with their traceback. argparse's own mistakes (an unknown flag, a bad choice, a missing argument) are
one line too (:class:`ArgumentParser`), exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
import traceback
from typing import NoReturn

# Command modules, in the order `--help` lists them.
COMMANDS = (
    "plan",
    "memory",
    "policy",
    "make_checkpoint",
    "quantize",
    "generate",
    "demo",
)


class UsageError(ValueError):
    """A mistake in the command line or in a file it names: :func:`main` prints the message as is (one line
    per mistake, each naming the argument, file, key or line and what to do) and exits with 2."""


EXIT_USAGE = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130


class ArgumentParser(argparse.ArgumentParser):
    """argparse's own mistakes as one line, like every other: ``dlo_fn <command>: error: <message> (see
    <command> --help)`` on stderr (rank 0 only under torchrun), then ``SystemExit(2)``. Every subcommand's parser
    is one of these (``add_subparsers`` makes its parsers of the parent's class).

    argparse reads a value that starts with ``-`` as a flag unless it is a plain negative number, so
    ``--model-bytes -5GB`` said "expected one argument" instead of what is wrong with -5GB: any token that starts
    with a minus and a digit is a value here (no flag of ours looks like one), which each command then checks."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d[\w.+-]*$")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:  # argparse reports these from the top parser: name the (sub)command they were given to
            self._innermost(parsed).error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def _innermost(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(chosen, ArgumentParser):
                    return chosen._innermost(parsed)
        return self

    def error(self, message: str) -> NoReturn:
        tool, _, command = self.prog.removeprefix("python -m ").partition(" ")
        if _rank() == 0:
            _say(command, f"{message} (see {self.prog} --help)", tool=tool)
        raise SystemExit(_usage_exit())


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows an option's default only when it says something (not None or False) and the help text does not
    already state it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            default not in (None, False, argparse.SUPPRESS)
            and "default" not in text
            and action.option_strings
            and action.nargs != 0
        ):
            text += " (default: %(default)s)"
        return text


DESCRIPTION = (
    "Distributed Layerwise Offload (DLO) for diffusion transformers: plan shard layouts and slot schedules, size "
    "host and HBM memory, write checkpoints, generate with offloaded weights. Benchmarks and figures: "
    "python -m benchmarks --help (the lab, in the repository)."
)


def build_parser(
    prog: str = "python -m dlo_fn",
    modules: tuple[str, ...] = tuple(f"dlo_fn.cli.{name}" for name in COMMANDS),
    description: str = DESCRIPTION,
) -> argparse.ArgumentParser:
    """The parser of ``prog``: one subcommand per module in ``modules`` (each has ``register(subparsers)``);
    the lab's ``python -m benchmarks`` builds its own from its command modules."""
    parser = ArgumentParser(prog=prog, description=description)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in modules:
        importlib.import_module(name).register(sub)
    _verbose_everywhere(sub)
    return parser


def _verbose_everywhere(sub: argparse._SubParsersAction) -> None:
    """``-v`` also after the command (``generate -v``, ``bench load -v``); SUPPRESS keeps the top-level one."""
    for p in set(sub.choices.values()):
        if not any("-v" in a.option_strings for a in p._actions):
            p.add_argument(
                "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging and tracebacks"
            )
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                _verbose_everywhere(action)


def _rank() -> int:
    """This process's rank under torchrun (0 without)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _say(command: str, message: str, *, rank_prefix: bool = False, tool: str = "dlo_fn") -> None:
    where = f"rank {_rank()}: " if rank_prefix else ""
    name = f"{tool} {command}".strip()
    lines = []
    for line in str(message).strip().splitlines() or [type(message).__name__]:
        for prefix in (f"{name}: ", f"{command}: "):  # messages that already name the command
            line = line[len(prefix) :] if command and line.startswith(prefix) else line
        lines.append(f"{name}: error: {where}{line}")
        print(lines[-1], file=sys.stderr)
    _torchrun_error_file("\n".join(lines))


USAGE_WAIT_S = 10.0


def _usage_exit() -> int:
    """Exit code 2. Under torchrun a rank other than 0 first waits (bounded): every rank finds a usage error at
    once, but only rank 0 says it, and torchrun stops every worker as soon as one exits, which could stop rank 0
    before its line is out. Rank 0 exits at once, and torchrun then stops the waiting ranks."""
    if _rank() != 0 and os.environ.get("TORCHELASTIC_RUN_ID"):
        import time

        time.sleep(USAGE_WAIT_S)
    return EXIT_USAGE


def _torchrun_error_file(text: str) -> None:
    """Under torchrun, hand the message to its error file: its ChildFailedError summary then shows it as the
    root cause's traceback instead of a pointer to its documentation."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    try:
        with open(path, "w") as f:
            json.dump(
                {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}},
                f,
            )
    except OSError:
        pass


def _quiet_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def entry(parser: argparse.ArgumentParser | None = None) -> None:
    """``python -m dlo_fn`` and the ``dlo-fn`` script: :func:`main`, then exit with its code. A torchrun rank
    (``WORLD_SIZE`` > 1) leaves without the interpreter's teardown, its outputs written and its process group
    destroyed (:func:`~dlo_fn.runtime.dist.exit_now`: a follower's gloo threads aborted it at exit), as
    ``serve_local``'s ranks do."""
    code = main(parser=parser)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from dlo_fn.runtime.dist import exit_now

        exit_now(code)
    raise SystemExit(code)


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or build_parser()
    tool = parser.prog.removeprefix("python -m ")
    args = parser.parse_args(argv)  # argparse's own errors: one line, exit 2 (ArgumentParser.error)
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    command = args.command
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the boundary: a closed pipe surfaces here, not at exit
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_FAILURE
    except KeyboardInterrupt:
        if _rank() == 0:
            _say(command, "interrupted", tool=tool)
        return EXIT_INTERRUPTED
    except SystemExit as exc:  # raise SystemExit("message") from a command: a usage error
        if exc.code is None or isinstance(exc.code, int):
            raise
        if _rank() == 0:
            _say(command, exc.code, tool=tool)
        return _usage_exit()
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError) as exc:
        if verbose:
            traceback.print_exc()
        if _rank() == 0:
            _say(command, str(exc) or type(exc).__name__, tool=tool)
        return _usage_exit()
    except OSError as exc:
        if verbose:
            traceback.print_exc()
        _say(command, f"{type(exc).__name__}: {exc}", rank_prefix="RANK" in os.environ, tool=tool)
        return EXIT_FAILURE
