"""What goes into the engine and what comes out: submissions, options, per-request results, per-wave records
(and the two tables the CLIs print from a report).

A :class:`Submission` is one line of work: a request id and either a :class:`~dlo_fn.models.Request` or the
reason there is none (a prompts-file line that did not parse). Every submission ends as exactly one
:class:`RequestResult`: ``ok`` with a video and its SHA-256, or not ok with an ``error`` that says why (rejected
before dispatch, the rank that raised, the wave that failed closed and which rank caused it, or "not
dispatched" after the engine stopped). Results come back in submission order.

Prompts file (``generate --prompts FILE.jsonl``): one JSON object per line with any
:class:`~dlo_fn.models.Request` fields (``prompt`` required) plus an optional ``"id"``; blank lines and lines
starting with ``#`` are skipped; fields not given take the command line's values, then the Request defaults.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from dlo_fn.models.request import Request
from dlo_fn.serve.batch import Fault

__all__ = [
    "to_wire",
    "from_wire",
    "Submission",
    "EngineOptions",
    "RequestResult",
    "ResultBook",
    "WaveRecord",
    "StepRecord",
    "ServeReport",
    "SERVING",
    "read_prompts",
    "as_submissions",
    "wave_table",
    "result_table",
    "not_dispatched",
]

SERVING = ("strict", "continuous")  # strict: waves (today's behaviour); continuous: see dlo_fn.serve.continuous


def to_wire(request: Request | None) -> dict[str, Any] | None:
    """A request as a plain dict for pickling (a Request's read-only ``extra_args`` mapping cannot be pickled)."""
    return None if request is None else request.to_dict()


def from_wire(data: Mapping[str, Any] | None) -> Request | None:
    return None if data is None else Request.from_dict(data)


@dataclass(frozen=True, slots=True)
class Submission:
    request_id: str
    request: Request | None
    error: str | None = None

    def __post_init__(self) -> None:
        if (self.request is None) == (self.error is None):
            raise ValueError(f"submission {self.request_id!r}: give exactly one of request and error")

    def __reduce__(self):
        return (_submission, (self.request_id, to_wire(self.request), self.error))


def _submission(request_id: str, request: dict | None, error: str | None) -> Submission:
    return Submission(request_id, from_wire(request), error)


def as_submissions(items: Iterable[Request | Submission]) -> list[Submission]:
    """Requests get ids ``req0000``, ``req0001``, ... by position; submissions pass through."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, Submission):
            out.append(item)
        elif isinstance(item, Request):
            out.append(Submission(f"req{i:04d}", item))
        else:
            raise TypeError(f"item {i}: expected a Request or Submission, got {type(item).__name__}")
    ids = [s.request_id for s in out]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"duplicate request ids {dup}: every submission needs its own id")
    return out


def rejection(sub: "Submission", config: Any, memory: Any = None, adapters: tuple[str, ...] = ()) -> str | None:
    """Why ``sub`` cannot be dispatched (its own parse error, a field the model's ``config`` refuses, an
    adapter not among the model's ``adapters``, or more memory than a rank has left: ``memory``, a
    :class:`~dlo_fn.serve.admission.MemoryAdmission`), or None: checked on rank 0 before any rank does work
    for it."""
    if sub.error is not None:
        return sub.error
    try:
        sub.request.validate(config)
    except ValueError as exc:
        return f"rejected before dispatch: {exc}"
    if sub.request.lora is not None and sub.request.lora not in adapters:
        return (
            f"rejected before dispatch: lora={sub.request.lora!r} is not loaded (loaded: {list(adapters)}): "
            "name a loaded adapter or pass none"
        )
    return memory.refusal(sub.request) if memory is not None else None


def read_prompts(path: str | pathlib.Path, defaults: Mapping[str, Any] | None = None) -> list[Submission]:
    """Parse a prompts file (see the module docstring). A bad line becomes a submission with an error that
    names the file and line, so it is reported in the results instead of stopping the others."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise IsADirectoryError(
            f"{path} is a directory: give the prompts file in it (JSON lines, one request per line)"
        )
    if not path.is_file():
        raise FileNotFoundError(f"{path}: prompts file not found (JSON lines, one request per line)")
    defaults = dict(defaults or {})
    out: list[Submission] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        rid = f"line{lineno:04d}"
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, got {type(data).__name__}")
            rid = str(data.pop("id", rid))
            out.append(Submission(rid, Request.from_dict({**defaults, **data})))
        except (ValueError, TypeError) as exc:
            out.append(Submission(rid, None, f"{path}:{lineno}: {exc}"))
    return out


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How the engine forms and guards waves.

    ``timeout_s`` bounds every wait: it must equal the process group's timeout (pass the same value to
    :func:`dlo_fn.runtime.dist.init_distributed`) and exceed one denoising step's compute time; a stalled or
    dead rank fails its wave within about ``timeout_s + grace_s``.
    """

    requests_per_rank: int = 1
    max_wait_s: float = 0.0
    timeout_s: float = 300.0
    grace_s: float = 3.0
    fault: Fault | None = None
    trace: bool = False  # record per-rank spans of each wave (Figure 5)
    progress: bool | None = None  # tqdm on rank 0; None: only on a terminal
    serving: str = "continuous"  # or "strict": waves (dlo_fn.serve.continuous says which wins when)
    admission: str = "fifo"  # continuous: "fifo" or "cost" (dlo_fn.cost.dispatch.admit_cost_aware)
    memory_budget_bytes: int | None = None  # cap each rank's room for requests (dlo_fn.serve.admission)
    keep_videos: bool = True  # False: a result handed to serve's on_result is kept without its video (generate)

    def __post_init__(self) -> None:
        if self.serving not in SERVING:
            raise ValueError(f"serving={self.serving!r}: must be one of {', '.join(SERVING)}")
        if self.admission not in ("fifo", "cost"):
            raise ValueError(f"admission={self.admission!r}: must be fifo or cost")
        if not isinstance(self.requests_per_rank, int) or self.requests_per_rank < 1:
            raise ValueError(f"requests_per_rank must be an int >= 1, got {self.requests_per_rank!r}")
        if not self.max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.memory_budget_bytes is not None and not (
            isinstance(self.memory_budget_bytes, int) and self.memory_budget_bytes > 0
        ):
            raise ValueError(f"memory_budget_bytes must be None or an int > 0, got {self.memory_budget_bytes!r}")


@dataclass(frozen=True, slots=True)
class RequestResult:
    """The end of one submission (see the module docstring). ``position``: place in its wave; ``timings``:
    ``queued_s`` (serve start -> dispatch), ``wave_s`` (dispatch -> results at rank 0), ``compute_s``;
    ``degraded``: why it was served by a degraded ring (continuous serving finished it after losing a rank), or
    None (requests that ended before the loss were served normally)."""

    index: int
    request_id: str
    request: Request | None
    ok: bool
    video: torch.Tensor | None = None
    sha256: str | None = None
    error: str | None = None
    rank: int | None = None
    wave_id: int | None = None
    position: int | None = None
    timings: Mapping[str, float] = field(default_factory=dict)
    degraded: str | None = None
    video_shape: tuple[int, ...] | None = None  # the shape of a video already written and dropped

    @property
    def shape(self) -> tuple[int, ...] | None:
        return tuple(self.video.shape) if self.video is not None else self.video_shape

    def __reduce__(self):
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["request"] = to_wire(self.request)
        fields["timings"] = dict(self.timings)
        return (_request_result, tuple(fields.values()))


class ResultBook(dict):
    """Results by submission index that hands each one to ``publish`` as it is recorded (what lets rank 0 write
    a result while the serve goes on: :meth:`dlo_fn.serve.engine.Engine.serve`'s ``on_result``). Without
    ``keep_videos`` it keeps a published result without its video (its shape stays), so a long serve whose
    results are written as they end does not hold every video until the end."""

    def __init__(self, publish: Callable[["RequestResult"], None] | None = None, keep_videos: bool = True) -> None:
        super().__init__()
        self._publish, self._keep_videos = publish, keep_videos

    def __setitem__(self, index: int, result: "RequestResult") -> None:
        if self._publish is not None:
            self._publish(result)
            if not self._keep_videos and result.video is not None:
                result = dataclasses.replace(result, video=None, video_shape=tuple(result.video.shape))
        super().__setitem__(index, result)

    def update(self, other: Mapping[int, "RequestResult"] = (), **kw: Any) -> None:  # type: ignore[override]
        for index, result in dict(other, **kw).items():
            self[index] = result


def _request_result(*fields: Any) -> "RequestResult":
    named = dict(zip((f.name for f in dataclasses.fields(RequestResult)), fields))
    named["request"] = from_wire(named["request"])
    return RequestResult(**named)


def not_dispatched(index: int, sub: Submission, stopped: str | None) -> RequestResult:
    """The result of submission ``index``, which the engine never reached: it stopped earlier (``stopped``)."""
    return RequestResult(
        index, sub.request_id, sub.request, False, error=f"not dispatched: the engine stopped earlier ({stopped})"
    )


@dataclass(frozen=True, slots=True)
class WaveRecord:
    """One dispatched wave: who ran what, how long it took, how it ended (``ok`` / ``partial`` / ``failed``).
    ``trace``: ``(rank, lane, label, start_s, end_s)`` spans relative to the dispatch (with ``trace=True``)."""

    wave_id: int
    key: str
    rank_indices: tuple[tuple[int, ...], ...]
    num_steps: int
    latency_s: float
    status: str
    error: str | None = None
    trace: tuple[tuple[int, str, str, float, float], ...] = ()
    lockstep: bool = True  # False: an independent replica's batch (rank-local / resident)

    @property
    def num_requests(self) -> int:
        return sum(len(i) for i in self.rank_indices)

    @property
    def idle_ranks(self) -> tuple[int, ...]:
        """Ranks that served all-gathers without computing (none outside lockstep: the others just ran
        their own queues)."""
        return tuple(r for r, i in enumerate(self.rank_indices) if not i) if self.lockstep else ()


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One ring step of continuous serving: ``held[r]`` the submission indices rank ``r`` computed (empty:
    gather-only), ``compute_s[r]`` its block-call seconds, ``start_s``/``end_s`` on rank 0 from serve start,
    ``num_queued`` the valid requests still waiting after this boundary's admissions."""

    step: int
    start_s: float
    end_s: float
    held: tuple[tuple[int, ...], ...]
    compute_s: tuple[float, ...]
    num_queued: int


@dataclass(frozen=True, slots=True)
class ServeReport:
    """What :meth:`Engine.serve` returns on rank 0: results in submission order and the waves run."""

    results: tuple[RequestResult, ...]
    waves: tuple[WaveRecord, ...]
    mode: str
    dp_size: int
    requests_per_rank: int
    wall_s: float
    stats: Mapping[str, float] = field(default_factory=dict)  # rank 0's executor counters (cumulative)
    sp_size: int = 1  # ranks per replica (dp_size replicas ran the waves)
    steps: tuple[StepRecord, ...] = ()  # continuous serving: one record per ring step (waves is then empty)
    serving: str = "strict"
    degraded: str | None = None  # continuous serving lost a rank and went on without it (why)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def by_id(self) -> dict[str, RequestResult]:
        return {r.request_id: r for r in self.results}

    def hashes(self) -> dict[str, str | None]:
        return {r.request_id: r.sha256 for r in self.results}


def wave_table(report: ServeReport) -> str:
    """The per-wave table the demo prints: one line per wave, its requests per rank and its end."""
    lines = [f"{'wave':>4}  {'key':<22} {'ranks (request ids)':<40} {'latency':>9}  status"]
    ids = {r.index: r.request_id for r in report.results}
    for w in report.waves:
        if w.lockstep:
            ranks = " | ".join(",".join(ids.get(i, str(i)) for i in idx) or "idle" for idx in w.rank_indices)
        else:
            ranks = " ".join(
                f"rank {r}: " + ",".join(ids.get(i, str(i)) for i in idx) for r, idx in enumerate(w.rank_indices) if idx
            )
        lines.append(
            f"{w.wave_id:>4}  {w.key:<22} {ranks:<40} {w.latency_s:>8.3f}s  {w.status}"
            + (f": {w.error.splitlines()[0][:120]}" if w.error else "")
        )
    return "\n".join(lines)


def result_table(report: ServeReport) -> str:
    lines = [f"{'request':<10} {'wave':>4} {'rank':>4}  {'shape':<20} sha256 / error"]
    for r in report.results:
        shape = "x".join(map(str, r.shape)) if r.shape else "-"
        wave = "-" if r.wave_id is None else str(r.wave_id)
        rank = "-" if r.rank is None else str(r.rank)
        tail = r.sha256 if r.ok else f"ERROR {(r.error or '').splitlines()[0][:150]}"
        lines.append(f"{r.request_id:<10} {wave:>4} {rank:>4}  {shape:<20} {tail}")
    return "\n".join(lines)
