"""A :class:`~dlo_fn.plan.timeline.Timeline` as Chrome / Perfetto trace JSON, and back.

One complete event (``"ph": "X"``) per span: ``pid`` = rank, ``tid`` = stream (``h2d`` 0, ``allgather`` 1,
``compute`` 2, other streams after them), ``ts``/``dur`` in microseconds; ``thread_name`` / ``process_name``
metadata events name the rows. Each event also carries its exact ``start_s``/``end_s`` in ``args`` so that
``from_chrome_trace(to_chrome_trace(tl)) == tl`` bit for bit; a trace without them (written by another tool)
is read from ``ts``/``dur``. The timeline's ``meta`` goes to ``otherData``. Open the file in
https://ui.perfetto.dev or chrome://tracing.

A run prefetches the first ``S - G`` loads of the next run (``Schedule.prefetch_next``): an ``H2D`` or ``AG`` of
``run<j>`` whose load index ``k`` is past the last load that run computes. Those events are named
``"<op> (prefetch for next run)"`` with the op itself in ``args["op"]``, so the last run's trailing loads of
block 0 are not mistaken for work of that run (the next ``generate`` or serve would start from them).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from dlo_fn.plan.schedule import STREAMS
from dlo_fn.plan.timeline import Span, Timeline

__all__ = ["to_chrome_trace", "from_chrome_trace", "prefetch_spans", "PREFETCH_LABEL"]

_US_PER_S = 1e6
PREFETCH_LABEL = "prefetch for next run"
_RUN_OP = re.compile(r"^run(\d+) (H2D|AG|C) k(\d+) ")


def prefetch_spans(timeline: Timeline) -> frozenset[int]:
    """Indices of the spans that load for the next run: per (rank, run), loads past the run's last compute."""
    last: dict[tuple[int, str], int] = {}
    loads: list[tuple[int, tuple[int, str], int]] = []
    for i, s in enumerate(timeline.spans):
        m = _RUN_OP.match(s.op)
        if m is None:
            continue
        key, kind, k = (s.rank, m.group(1)), m.group(2), int(m.group(3))
        if kind == "C":
            last[key] = max(last.get(key, -1), k)
        else:
            loads.append((i, key, k))
    return frozenset(i for i, key, k in loads if key in last and k > last[key])


def _tids(timeline: Timeline) -> dict[str, int]:
    extra = sorted({s.stream for s in timeline.spans} - set(STREAMS))
    return {name: i for i, name in enumerate(tuple(STREAMS) + tuple(extra))}


def to_chrome_trace(timeline: Timeline) -> dict[str, Any]:
    tids = _tids(timeline)
    used = sorted({(s.rank, s.stream) for s in timeline.spans})
    events: list[dict[str, Any]] = []
    for rank in sorted({r for r, _ in used}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
    for rank, stream in used:
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tids[stream], "args": {"name": stream}})
        events.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": rank,
                "tid": tids[stream],
                "args": {"sort_index": tids[stream]},
            }
        )
    prefetch = prefetch_spans(timeline)
    for i, s in enumerate(timeline.spans):
        args: dict[str, Any] = {"start_s": s.start_s, "end_s": s.end_s}
        name = s.op
        if i in prefetch:
            name, args["op"] = f"{s.op} ({PREFETCH_LABEL})", s.op
        events.append(
            {
                "ph": "X",
                "name": name,
                "cat": s.stream,
                "pid": s.rank,
                "tid": tids[s.stream],
                "ts": s.start_s * _US_PER_S,
                "dur": (s.end_s - s.start_s) * _US_PER_S,
                "args": args,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(timeline.meta)}


def from_chrome_trace(trace: Mapping[str, Any]) -> Timeline:
    """Inverse of :func:`to_chrome_trace`; also reads ``X`` events of other tools (stream = thread name)."""
    try:
        events = trace["traceEvents"]
    except (KeyError, TypeError):
        raise ValueError("not a Chrome trace: expected a JSON object with a 'traceEvents' list") from None
    names: dict[tuple[int, int], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e["tid"])] = str(e["args"]["name"])
    spans = []
    for n, e in enumerate(events):
        if e.get("ph") != "X":
            continue
        try:
            stream = names.get((e["pid"], e["tid"]), str(e.get("cat", e["tid"])))
            args = e.get("args") or {}
            if "start_s" in args and "end_s" in args:
                start, end = float(args["start_s"]), float(args["end_s"])
            else:
                start = float(e["ts"]) / _US_PER_S
                end = start + float(e["dur"]) / _US_PER_S
            spans.append(Span(str(args.get("op", e["name"])), stream, start, end, int(e["pid"])))
        except KeyError as exc:
            raise ValueError(f"trace event {n} lacks field {exc.args[0]!r}: {e!r}") from None
    meta = tuple((str(k), str(v)) for k, v in (trace.get("otherData") or {}).items())
    return Timeline(tuple(spans), meta)
