"""`python -m benchmarks <command>`: the lab's commands, behind the library's parser and error boundary
(:func:`dlo_fn.cli.main`)."""

from __future__ import annotations

from dlo_fn.cli import build_parser

COMMANDS = ("bench", "figures")


def lab_parser():
    return build_parser(
        prog="python -m benchmarks",
        modules=tuple(f"benchmarks.cli.{name}" for name in COMMANDS),
        description=(
            "The dlo_fn lab: benchmarks that write figures/data/ (with machine, command and date), and the "
            "regeneration of every figure, measured table and notebook."
        ),
    )


def main(argv: list[str] | None = None) -> int:
    from dlo_fn.cli import main as run

    return run(argv, parser=lab_parser())
