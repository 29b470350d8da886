"""The stamp every benchmark's JSON carries (UTC date, the command that wrote it, the machine) and its output."""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any

__all__ = ["stamp", "emit"]


def stamp(result: dict, module: str, argv: list[str] | None, platform: Any = None) -> dict:
    """``result`` with ``date`` and ``command`` (``python -m module`` and its arguments) and, given a platform,
    ``machine`` (:func:`benchmarks.bench.step.machine`)."""
    if platform is not None:
        from benchmarks.bench.step import machine

        result["machine"] = machine(platform)
    result["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result["command"] = f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:])
    return result


def emit(result: dict, out: str | None, *, append: bool = False) -> None:
    """Print ``result`` as JSON and write it to ``out`` (``append``: one line added to a JSON-lines file)."""
    text = json.dumps(result, sort_keys=True) if append else json.dumps(result, indent=1, sort_keys=True)
    print(text)
    if out:
        with open(out, "a" if append else "w") as f:
            f.write(text + "\n")
