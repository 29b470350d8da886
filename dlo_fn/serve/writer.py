"""Results written as they finish: each request's files and manifest line reach the disk when the engine has it.

:class:`ResultWriter` is what rank 0 hands the engine as ``on_result`` (:meth:`~dlo_fn.serve.engine.Engine.serve`):
for every :class:`~dlo_fn.serve.requests.RequestResult` the moment it exists (a rejection before dispatch, a
request that finished or failed in a wave or at a ring step):

1. the video is written as ``<stem>.npy`` and its preview as ``<stem>.png``, each to a ``.tmp`` name first and
   then renamed (``os.replace``, atomic on one file system): a file that exists is complete;
2. its manifest line is appended to ``manifest.jsonl`` with one ``write`` on a descriptor opened ``O_APPEND``,
   so it is in the kernel, whole, before the next result: a process killed later (SIGTERM, SIGKILL, a lost
   node's agent) loses nothing already written.

:meth:`ResultWriter.stop` gives every expected submission that has no line yet a line of its own, ``not
completed: <why>`` (what the command does on SIGTERM or Ctrl-C: :func:`finish_on_sigterm`), so every request has
exactly one line. :meth:`ResultWriter.finish`, after a serve, writes what the engine did not hand over (none,
normally), rewrites the manifest in submission order (atomically) and writes ``waves.jsonl`` (strict serving)
or ``steps.jsonl`` (continuous), whichever the run has lines for: never an empty file.
The line format is :mod:`dlo_fn.serve.outputs`'s.

**A reused output folder.** Earlier runs' files beside a fresh manifest would read as this run's, so a folder
that holds any file this writer makes (:data:`OWN_FILES`, ``NNNN-*.npy``/``.png``) is refused (``existing=
"refuse"``, the default: :class:`ExistingOutputError` names the folder and a file) or those files are deleted
first (``existing="clean"``; nothing else in the folder is touched).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import re
import signal
import sys
import threading
from typing import Any, Iterator, Sequence

from dlo_fn.serve.outputs import RunInfo, manifest_row, replace_text, save_video, step_lines, wave_lines
from dlo_fn.serve.requests import RequestResult, ServeReport, Submission

__all__ = [
    "EXISTING",
    "OWN_FILES",
    "ExistingOutputError",
    "ResultWriter",
    "check_out",
    "finish_on_sigterm",
    "own_files",
    "write_outputs",
]

log = logging.getLogger(__name__)

EXISTING = ("refuse", "clean")
OWN_FILES = ("manifest.jsonl", "waves.jsonl", "steps.jsonl", "auto_policy.json")
_OWN = re.compile(r"^\d{4}-.+\.(npy|png)(\.tmp)?$|^(manifest|waves|steps)\.jsonl\.tmp$")


class ExistingOutputError(ValueError):
    """The output folder holds an earlier run's files and ``existing="refuse"``."""


def own_files(out: pathlib.Path) -> list[pathlib.Path]:
    """The files in ``out`` that a writer (or ``generate``) makes: what a reuse would mix with the new run's."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if p.is_file() and (p.name in OWN_FILES or _OWN.match(p.name)))


def check_out(out: str | os.PathLike, existing: str = "refuse") -> None:
    """Raise :class:`ExistingOutputError` when ``out`` holds an earlier run's files and ``existing`` is
    ``"refuse"`` (nothing is written or deleted here)."""
    if existing not in EXISTING:
        raise ValueError(f"existing={existing!r}: must be one of {', '.join(EXISTING)}")
    found = own_files(pathlib.Path(out))
    if found and existing == "refuse":
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        raise ExistingOutputError(
            f"{out} holds an earlier run's outputs ({found[0].name}{more}): choose a new folder, or clean it first "
            f"(generate --out-exists clean deletes only these files)"
        )


class ResultWriter:
    """Rank 0's writer of one run under ``out`` (see the module docstring). ``info``: the run's
    :class:`~dlo_fn.serve.outputs.RunInfo` (mode, ranks, serving), set once the engine exists."""

    def __init__(
        self,
        out: str | os.PathLike,
        *,
        existing: str = "refuse",
        previews: bool = True,
        expected: Sequence[Submission] = (),
        info: Any = None,
    ) -> None:
        self.out, self.previews, self.info = pathlib.Path(out), previews, info
        check_out(self.out, existing)
        for path in own_files(self.out):  # existing == "clean": only what a run writes
            path.unlink()
        self.out.mkdir(parents=True, exist_ok=True)
        self.manifest = self.out / "manifest.jsonl"
        self._fd: int | None = os.open(self.manifest, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
        self._rows: dict[int, dict[str, Any]] = {}
        self._expected: dict[int, Submission] = dict(enumerate(expected))
        self._lock = threading.Lock()
        self.stopped: str | None = None

    @property
    def written(self) -> int:
        return len(self._rows)

    def write(self, result: RequestResult) -> None:
        """Write ``result``'s files and append its manifest line (once per submission index). It runs inside
        the serve loop, so a failure to write is this request's, never the serve's: files that cannot be
        written make its line say so; a line that cannot be appended is logged and tried again by
        :meth:`finish`."""
        with self._lock:
            if self.stopped is not None or result.index in self._rows:
                return
            try:
                files = save_video(self.out, result, previews=self.previews)
            except Exception as exc:  # noqa: BLE001 - disk full, a read-only folder, a hash that differs
                log.error("%s: could not write its files: %s: %s", result.request_id, type(exc).__name__, exc)
                for path in self.out.glob("*.tmp"):
                    path.unlink(missing_ok=True)
                files = []
                result = dataclasses.replace(
                    result,
                    ok=False,
                    video=None,
                    error=(f"finished, but writing its files under {self.out} failed: {type(exc).__name__}: {exc}"),
                )
            row = manifest_row(result, self.info, files, self.out)
            try:
                self._append(row)
            except OSError as exc:
                log.error("%s: could not append its manifest line: %s", result.request_id, exc)
                return
            self._rows[result.index] = row

    def stop(self, reason: str) -> int:
        """Every expected submission without a line gets ``not completed: <reason>``; nothing is written after
        this. Returns how many such lines were written."""
        with self._lock:
            if self.stopped is not None:
                return 0
            self.stopped = reason
            if self._fd is None:  # finished: every result has its line already
                return 0
            missing = [i for i in sorted(self._expected) if i not in self._rows]
            for i in missing:
                sub = self._expected[i]
                result = RequestResult(i, sub.request_id, sub.request, False, error=f"not completed: {reason}")
                row = manifest_row(result, self.info, [], self.out)
                self._append(row)
                self._rows[i] = row
            for path in self.out.glob("*.tmp"):  # a file cut short by the stop: its request has no line
                path.unlink(missing_ok=True)
            self._close()
            return len(missing)

    def finish(self, report: ServeReport) -> pathlib.Path:
        """After a serve: the results not handed over yet, the manifest rewritten in submission order, and the
        wave or step records. Returns the manifest's path."""
        for result in report.results:
            self.write(result)
        with self._lock:
            self._close()
            rows = [self._rows[i] for i in sorted(self._rows)]
            replace_text(self.manifest, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        # Strict serving has waves, continuous serving ring steps: each writes its own file, never an empty one.
        for name, text in (("waves.jsonl", wave_lines(report)), ("steps.jsonl", step_lines(report))):
            if text:
                replace_text(self.out / name, text)
        return self.manifest

    def _append(self, row: dict[str, Any]) -> None:
        if self._fd is None:
            raise RuntimeError(f"{self.manifest}: the writer is closed")
        os.write(self._fd, (json.dumps(row, sort_keys=True) + "\n").encode())

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_outputs(
    out_dir: str | pathlib.Path, report: ServeReport, *, previews: bool = True, existing: str = "refuse"
) -> pathlib.Path:
    """Write videos, previews and the manifests of a finished serve (see the module docstring) through a
    :class:`~dlo_fn.serve.writer.ResultWriter` (``existing``: what to do with an earlier run's files there);
    returns the manifest's path."""
    writer = ResultWriter(out_dir, existing=existing, previews=previews, info=RunInfo.of(report))
    return writer.finish(report)


@contextlib.contextmanager
def finish_on_sigterm(writer: ResultWriter, say: Any = None, exit_code: int = 128 + signal.SIGTERM) -> Iterator[None]:
    """While active (main thread only), a SIGTERM makes ``writer`` write a "not completed" line for every
    request still without one, prints ``say(text)`` and ends the process with ``exit_code``.

    The work is done by a thread woken through the signal wakeup fd, not by the Python handler: the main thread
    may be blocked inside a collective (a gloo or NCCL wait) for up to the process group's timeout, where a
    Python handler would only run afterwards, and ``torchrun`` kills the process 30 s after its SIGTERM."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the watcher below acts

    def watch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                lines = writer.stop(
                    "the run was stopped (SIGTERM) before this request finished; under torchrun "
                    "that follows another rank's exit"
                )
                text = (
                    f"stopped by SIGTERM: {writer.written - lines} result(s) were on disk, {lines} request(s) "
                    f"got a 'not completed' line in {writer.manifest}"
                )
                (say or (lambda t: print(t, file=sys.stderr)))(text)
                sys.stderr.flush()
                os._exit(exit_code)

    thread = threading.Thread(target=watch, name="dlo_fn-sigterm", daemon=True)
    thread.start()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)  # the watcher reads end-of-file and returns
        thread.join(timeout=5)
        os.close(read_fd)
