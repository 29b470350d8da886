"""What `generate` checks before it loads anything, and how it reports failures after serving.

Every check raises :class:`~dlo_fn.cli.UsageError` with one line naming the flag, file, key or ``FILE:LINE``
and what to do; :func:`dlo_fn.cli.main` prints it (rank 0 only under torchrun) and exits with 2. They run on
every rank, on the same arguments, so under torchrun every rank stops at the same place without a process
group.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import re
import sys
from typing import Any, Mapping, Sequence

from dlo_fn.cli import UsageError, _rank, _torchrun_error_file

__all__ = [
    "FLAG_OF_FIELD",
    "check_checkpoint",
    "check_engine_args",
    "check_prompts",
    "report_failures",
    "request_from_flags",
]

# Request field -> the generate flag that sets it (what a message about that field should name).
FLAG_OF_FIELD = {
    "prompt": "--prompt",
    "negative_prompt": "--negative-prompt",
    "seed": "--seed",
    "num_inference_steps": "--steps",
    "height": "--height",
    "width": "--width",
    "num_frames": "--frames",
    "guidance_scale": "--guidance",
    "shift": "--shift",
    "lora": "--lora",
    "lora_scale": "--lora-scale",
}
_FIELD = re.compile(r"^(\w+)\b")


def _stderr(line: str) -> None:
    if _rank() == 0:
        print(line, file=sys.stderr)


def check_engine_args(args: argparse.Namespace) -> None:
    """The engine's and the outputs' flags."""
    if args.requests_per_rank < 1:
        raise UsageError(f"generate: --requests-per-rank {args.requests_per_rank}: give >= 1")
    if getattr(args, "graph_shapes", 1) < 1:
        raise UsageError(
            f"generate: --graph-shapes {args.graph_shapes}: give >= 1 (the input shapes whose CUDA graphs are kept)"
        )
    group = getattr(args, "load_group", 1)
    if group != "auto" and group < 1:
        raise UsageError(f"generate: --load-group {group}: give >= 1 (1 = one load per block) or auto")
    slots = getattr(args, "slots", None)
    if group != "auto" and group > 1 and isinstance(slots, int) and (slots % group or slots < 2 * group):
        raise UsageError(
            f"generate: --load-group {group} --slots {slots}: give --slots a multiple of {group} and "
            f">= {2 * group} (two groups in flight), or leave --slots out ({2 * group})"
        )
    landing = getattr(args, "landing", None)
    if landing is not None and landing < 1:
        raise UsageError(f"generate: --landing {landing}: give >= 1 (allgather's landing buffers), or leave it out")
    if group != "auto" and group > 1 and landing is not None and landing % group:
        raise UsageError(
            f"generate: --load-group {group} --landing {landing}: give --landing a multiple of {group} "
            f"(a group's shards land side by side), or leave --landing out ({2 * group})"
        )
    if not args.max_wait_s >= 0:
        raise UsageError(f"generate: --max-wait-s {args.max_wait_s}: give a number of seconds >= 0")
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise UsageError(f"generate: --timeout {args.timeout}: give a finite number of seconds > 0")
    out = pathlib.Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"generate: --out {args.out}: is a file, not a directory: choose a directory")
    from dlo_fn.serve.writer import ExistingOutputError, check_out

    try:  # every rank, before rank 0 writes anything there (it starts once every rank joined the group)
        check_out(out, getattr(args, "out_exists", "refuse"))
    except ExistingOutputError as exc:
        raise UsageError(f"generate: --out {exc}") from None
    if args.trace:
        trace = pathlib.Path(args.trace)
        if trace.is_dir():
            raise UsageError(f"generate: --trace {args.trace}: is a directory: give a file name, e.g. trace.json")
        if not trace.parent.is_dir():
            raise UsageError(f"generate: --trace {args.trace}: directory {trace.parent} does not exist: create it")


def check_checkpoint(path: str) -> Any:
    """The checkpoint's :class:`~dlo_fn.models.DiTConfig`, after reading its config and every header."""
    from dlo_fn.io.checkpoint import open_checkpoint
    from dlo_fn.models import load_config

    if not os.path.exists(path):
        raise UsageError(
            f"generate: --checkpoint {path}: no such directory or file: write one with "
            f"`python -m dlo_fn make-checkpoint --model tiny --out {path}`"
        )
    try:
        open_checkpoint(path)  # every header: a corrupt one names its file and key
        config, _ = load_config(path)
    except (ValueError, OSError) as exc:
        raise UsageError(f"generate: --checkpoint {path}: {exc}") from None
    return config


def request_from_flags(defaults: Mapping[str, Any], prompt: str, config: Any = None) -> Any:
    """One ``--prompt``'s request; a bad value raises naming the flag that set it."""
    from dlo_fn.models import Request

    try:
        return Request.from_dict({**defaults, "prompt": prompt}).validate(config)
    except (ValueError, TypeError) as exc:
        m = _FIELD.match(str(exc))
        flag = FLAG_OF_FIELD.get(m.group(1) if m else "", "--prompt")
        raise UsageError(f"generate: {flag}: {exc}") from None


def _line_numbers(path: str) -> list[int]:
    """The line of each request :func:`~dlo_fn.serve.requests.read_prompts` returns (it skips blanks and #)."""
    lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
    return [n for n, line in enumerate(lines, start=1) if line.strip() and not line.strip().startswith("#")]


def check_prompts(path: str, subs: Sequence[Any], config: Any = None) -> list:
    """Validate every prompts line against ``config`` and make ids unique: a bad line becomes an error
    submission naming ``FILE:LINE`` and is printed as one line now; no good line at all raises."""
    from dlo_fn.serve.requests import Submission

    out, bad, seen = [], [], {}
    for sub, line in zip(subs, _line_numbers(path)):
        if sub.error is None and sub.request_id in seen:
            sub = Submission(
                f"{sub.request_id}#line{line}",
                None,
                f"{path}:{line}: id {sub.request_id!r} is already used on line {seen[sub.request_id]}: "
                f'give every line its own "id"',
            )
        elif sub.error is None:
            seen[sub.request_id] = line
            try:
                sub.request.validate(config)
            except ValueError as exc:
                sub = Submission(sub.request_id, None, f"{path}:{line}: {exc}")
        if sub.error is not None:
            bad.append(sub.error)
        out.append(sub)
    if not out:
        raise UsageError(
            f"generate: --prompts {path}: no requests (one JSON object per line, e.g. "
            f'{{"prompt": "a red fox", "seed": 0}})'
        )
    if len(bad) == len(out):
        raise UsageError("\n".join(f"--prompts {e}" for e in bad))
    for e in bad:
        _stderr(f"dlo_fn generate: skipping {e}")
    return out


def report_failures(report: Any, printed: Sequence[str] = ()) -> int:
    """After the tables: the full reason of every failed request (the table cuts them) not in ``printed``
    (the lines skipped before loading) and the exit code (0: every request produced an output; 1: some did
    not)."""
    failed = [r for r in report.results if not r.ok]
    for r in failed:
        if r.error not in printed:
            _stderr(f"dlo_fn generate: {r.request_id} failed: {r.error}")
    if failed:
        summary = (
            f"dlo_fn generate: {len(failed)} of {len(report.results)} request(s) produced no output "
            f"(reasons above and in manifest.jsonl): exit code 1"
        )
        _stderr(summary)
        _torchrun_error_file(summary)  # torchrun's failure summary names it as the root cause
    return 1 if failed else 0
