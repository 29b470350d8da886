"""Ops on three streams, their compact string grammar, and the happens-before order of an op sequence.

==========  ===============  =============================  ==================================================
kind        stream           string                         meaning
==========  ===============  =============================  ==================================================
``H2D``     ``h2d``          ``H2D k5 b3>l1``               local shard of block 3 (load 5): host -> landing 1
                             ``H2D k5 b3>s1``               rank-local: the whole block straight into slot 1
                             ``H2D k5 b3>q1``               rank-local, quantised: the stored block -> staging 1
``AG``      ``allgather``    ``AG k5 b3 l1>s1``             all-gather landing 1 of every rank into slot 1
                             ``AG k5 b3 l1>q1``             quantised: ... into staging buffer 1
``DQ``      ``allgather``    ``DQ k5 b3 q1>s1``             dequantise staging 1 into slot 1 (compute dtype)
``C``       ``compute``      ``C k5 b3@s1 r0``              block 3 on slot 1 for request 0
==========  ===============  =============================  ==================================================

``k`` is the position of the block load in its run; every field of an op is in its string, so
``Op.from_str(str(op)) == op``. Buffers are named ``s<i>`` (slot), ``l<i>`` (landing buffer) and ``q<i>`` (the
staging buffer of slot ``i``, where a quantised block is assembled before its dequantise op writes the slot;
:mod:`dlo_fn.plan.quant`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["H2D", "AG", "DQ", "C", "KINDS", "STREAMS", "STREAM_OF_KIND", "GRAMMAR", "Op", "HappensBefore"]

H2D, AG, DQ, C = "H2D", "AG", "DQ", "C"
KINDS = (H2D, AG, DQ, C)
STREAMS = ("h2d", "allgather", "compute")
STREAM_OF_KIND = {H2D: "h2d", AG: "allgather", DQ: "allgather", C: "compute"}

# The whole grammar: one pattern per kind, matched in full; numbers in canonical form (no sign, no leading 0).
_N = r"(?:0|[1-9][0-9]*)"
_PATTERNS = {
    H2D: re.compile(rf"H2D k(?P<load>{_N}) b(?P<block>{_N})>(?:l(?P<landing>{_N})|s(?P<slot>{_N})|q(?P<staging>{_N}))"),
    AG: re.compile(rf"AG k(?P<load>{_N}) b(?P<block>{_N}) l(?P<landing>{_N})>(?:s(?P<slot>{_N})|q(?P<staging>{_N}))"),
    DQ: re.compile(rf"DQ k(?P<load>{_N}) b(?P<block>{_N}) q(?P<staging>{_N})>s(?P<slot>{_N})"),
    C: re.compile(rf"C k(?P<load>{_N}) b(?P<block>{_N})@s(?P<slot>{_N}) r(?P<request>{_N})"),
}
GRAMMAR = (
    "'H2D k<load> b<block>>{l<landing>|s<slot>|q<staging>}' | 'AG k<load> b<block> l<landing>>{s<slot>|"
    "q<staging>}' | 'DQ k<load> b<block> q<staging>>s<slot>' | 'C k<load> b<block>@s<slot> r<request>'"
)


@dataclass(frozen=True, slots=True)
class Op:
    """One action on one stream. ``load`` is the position of the block load in the run (see module doc)."""

    kind: str
    load: int
    block: int
    slot: int | None = None
    landing: int | None = None
    request: int | None = None
    staging: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Op.kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("load", "block", "slot", "landing", "request", "staging"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"Op.{name} must be a non-negative int, got {value!r}")
        has = (self.slot is not None, self.landing is not None, self.request is not None, self.staging is not None)
        allowed = {
            H2D: ((1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 0, 1)),
            AG: ((1, 1, 0, 0), (0, 1, 0, 1)),
            DQ: ((1, 0, 0, 1),),
            C: ((1, 0, 1, 0),),
        }[self.kind]
        if tuple(map(int, has)) not in allowed:
            raise ValueError(
                f"{self.kind} op has fields slot/landing/request/staging = {has}; the grammar is {GRAMMAR}"
            )

    @property
    def _target(self) -> str:
        """The buffer a load op writes."""
        return f"s{self.slot}" if self.slot is not None else f"q{self.staging}"

    def __str__(self) -> str:
        if self.kind == H2D:
            return f"H2D k{self.load} b{self.block}>" + (
                f"l{self.landing}" if self.landing is not None else self._target
            )
        if self.kind == AG:
            return f"AG k{self.load} b{self.block} l{self.landing}>{self._target}"
        if self.kind == DQ:
            return f"DQ k{self.load} b{self.block} q{self.staging}>s{self.slot}"
        return f"C k{self.load} b{self.block}@s{self.slot} r{self.request}"

    @staticmethod
    def from_str(text: str) -> "Op":
        """Inverse of ``str``: ``Op.from_str(str(op)) == op`` for every op."""
        kind = text.split(" ", 1)[0]
        match = _PATTERNS[kind].fullmatch(text) if kind in _PATTERNS else None
        if match is None:
            raise ValueError(f"not an op string: {text!r}; the grammar is {GRAMMAR}")
        fields = {k: int(v) for k, v in match.groupdict().items() if v is not None}
        return Op(kind, **fields)

    @property
    def stream(self) -> str:
        return STREAM_OF_KIND[self.kind]

    @property
    def reads(self) -> tuple[str, ...]:
        """Device buffers this op reads ("s1" = slot 1, "l0" = landing buffer 0, "q1" = staging buffer 1); host
        memory is not tracked."""
        if self.kind == AG:
            return (f"l{self.landing}",)
        if self.kind == DQ:
            return (f"q{self.staging}",)
        return (f"s{self.slot}",) if self.kind == C else ()

    @property
    def writes(self) -> tuple[str, ...]:
        if self.kind == H2D:
            return (f"l{self.landing}",) if self.landing is not None else (self._target,)
        if self.kind == DQ:
            return (f"s{self.slot}",)
        return (self._target,) if self.kind == AG else ()


class HappensBefore:
    """Vector clocks of the happens-before order generated by waits + per-stream issue order.

    Ops are pushed in issue order. ``vc[i][t]`` = the highest position on stream ``t`` known complete when op
    ``i`` starts; op ``a`` happens before op ``b`` iff ``pos[a] <= vc[b][stream(a)]``. With three streams this
    is exact and costs O(3) per op (no transitive closure).
    """

    def __init__(self) -> None:
        self.pos: list[int] = []
        self.vc: list[tuple[int, ...]] = []
        self.stream: list[int] = []
        self._last = [-1] * len(STREAMS)
        self._count = [0] * len(STREAMS)

    def base(self, stream: str) -> list[int]:
        """Clock of the next op on ``stream`` before its own waits: what stream order alone implies."""
        t = STREAMS.index(stream)
        last = self._last[t]
        clock = list(self.vc[last]) if last >= 0 else [-1] * len(STREAMS)
        clock[t] = self._count[t] - 1
        return clock

    def merge(self, clock: list[int], dep: int) -> list[int]:
        """``clock`` after also waiting for op ``dep``."""
        clock = [max(a, b) for a, b in zip(clock, self.vc[dep])]
        clock[self.stream[dep]] = max(clock[self.stream[dep]], self.pos[dep])
        return clock

    def covers(self, clock: list[int], dep: int) -> bool:
        """Whether an op with ``clock`` starts after op ``dep`` is complete."""
        return self.pos[dep] <= clock[self.stream[dep]]

    def push(self, stream: str, deps: tuple[int, ...]) -> None:
        clock = self.base(stream)
        for d in deps:
            clock = self.merge(clock, d)
        t = STREAMS.index(stream)
        self.pos.append(self._count[t])
        self.vc.append(tuple(clock))
        self.stream.append(t)
        self._last[t] = len(self.pos) - 1
        self._count[t] += 1

    def before(self, a: int, b: int) -> bool:
        """Op ``a`` is complete before op ``b`` starts."""
        return self.covers(list(self.vc[b]), a)
