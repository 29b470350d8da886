"""Waves of compatible requests: the compatibility key, wave formation and wave validation (pure).

**Why waves.** In allgather mode every rank of the shard group rebuilds block ``k`` with the same
all-gather at the same moment, whatever request it is computing, so ``W`` ranks can each run a different
request and stay in lockstep on weights. A *wave* is the set of up to ``W x R`` requests dispatched together:
rank ``r`` runs the requests at wave positions ``r, r + W, r + 2W, ...`` (at most ``R`` of them, block-major:
each loaded block serves all of the rank's requests in turn). Positions are dealt round-robin so that a
partial wave of ``n <= W`` requests gives each of the first ``n`` ranks one request instead of stacking them
on rank 0; ranks with no request are *idle*: they serve their shards to every all-gather and skip compute.

==========  ====================================================================================
symbol      meaning
==========  ====================================================================================
``W``       DP size (ranks in lockstep on weights)
``R``       requests per rank per wave (``--requests-per-rank``)
``C``       wave capacity ``W * R``
``p``       position of a request in its wave (first-come order); rank ``p mod W``, slot ``p div W``
==========  ====================================================================================

**Compatibility key.** Requests may share a wave only if their ranks issue the same sequence of collectives
and take about the same time between them. The collectives per wave are ``steps x passes x num_blocks``
all-gathers, where the passes per step depend on classifier-free guidance and on the outputs per prompt; the
time between them depends on the shape. So the key is every field of the request *except* the per-request
ones (:data:`PER_REQUEST_FIELDS`): height, width, num_frames, fps, num_inference_steps, guidance_scale (and
with it whether the unconditional branch runs), sampler and its shift, LoRA identity and scale, outputs per
prompt, quality mode and ``extra_args`` (compared as canonical JSON: sorted keys, no whitespace). The key is
closed by default: a field added to the request later joins the key unless it is listed as per-request.

*Negative-prompt policy.* The negative prompt is per-request, like the prompt: it is tokenised to the same
fixed text length as the prompt, and the unconditional branch runs (or not) according to ``guidance_scale``
alone, so a different (or absent) negative prompt changes neither shapes nor the collective sequence.

**Formation** (:func:`form_waves`): waiting requests are grouped by key; within a key they keep first-come
order and are cut into chunks of ``C``. Full chunks are ready at once; the last, partial chunk of a key is
ready when its oldest request has waited ``max_wait_s`` (the bounded wait to fill a wave) or when the input is
closed (``now_s = inf``). Ready waves are ordered by the arrival of their oldest request. Invariants (property
tested): every request is in exactly one wave or still waiting; waves are homogeneous in key; order is
preserved within a key; ``1 <= len(wave) <= C``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = [
    "PER_REQUEST_FIELDS",
    "CompatKey",
    "IncompatibleWaveError",
    "Pending",
    "WavePlan",
    "WaveSchedule",
    "compat_key",
    "form_waves",
    "validate_wave",
    "assign_positions",
]

# Fields that may differ inside a wave. Everything else a request carries is part of the key.
PER_REQUEST_FIELDS = frozenset({"prompt", "negative_prompt", "seed", "request_id"})


def _canonical(value: Any) -> Any:
    """A hashable, order-independent form: ints stay ints, other numbers become floats (5 == 5.0), mappings
    and sequences become canonical JSON text."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return float(value)
    if isinstance(value, (Mapping, list, tuple)):
        return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), default=repr, allow_nan=True)
    return repr(value)


def _plain(value: Any) -> Any:
    """Mappings (e.g. a read-only ``MappingProxyType``) -> dicts and tuples -> lists, recursively, for JSON."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _request_items(request: Any) -> tuple[tuple[str, Any], ...]:
    if dataclasses.is_dataclass(request) and not isinstance(request, type):
        names = [f.name for f in dataclasses.fields(request)]
        return tuple((n, getattr(request, n)) for n in names)
    if isinstance(request, Mapping):
        return tuple(request.items())
    raise TypeError(f"compat_key needs a dataclass request or a mapping, got {type(request).__name__}")


@dataclass(frozen=True, slots=True)
class CompatKey:
    """``items``: ``(field, canonical value)`` for every key field, in the request's field order."""

    items: tuple[tuple[str, Any], ...]

    def __post_init__(self) -> None:
        names = [n for n, _ in self.items]
        if len(set(names)) != len(names):
            raise ValueError(f"CompatKey: duplicate fields in {names}")
        if PER_REQUEST_FIELDS & set(names):
            raise ValueError(f"CompatKey: per-request fields {sorted(PER_REQUEST_FIELDS & set(names))} in key")

    def as_dict(self) -> dict[str, Any]:
        return dict(self.items)

    def differing(self, other: "CompatKey") -> tuple[str, ...]:
        """Names of the fields whose values differ (a field present in only one key differs too)."""
        a, b = self.as_dict(), other.as_dict()
        order = [n for n, _ in self.items] + [n for n, _ in other.items if n not in a]
        return tuple(n for n in order if a.get(n, _MISSING) != b.get(n, _MISSING))

    def short(self) -> str:
        """A compact label for tables: ``HxWxF steps cfg``."""
        d = self.as_dict()
        parts = []
        if {"height", "width", "num_frames"} <= d.keys():
            parts.append(f"{d['width']}x{d['height']}x{d['num_frames']}f")
        if "num_inference_steps" in d:
            parts.append(f"{d['num_inference_steps']}st")
        if "guidance_scale" in d:  # 1 (int or float) turns CFG off (Request.cfg)
            g = d["guidance_scale"]
            parts.append(("nocfg" if g <= 1 else f"cfg{g:g}") if isinstance(g, (int, float)) else "cfg")
        return " ".join(parts) or "key"


_MISSING = object()


def compat_key(request: Any) -> CompatKey:
    """The compatibility key of one request (a frozen dataclass such as ``dlo_fn.models.Request``, or a
    mapping of its fields): every field except :data:`PER_REQUEST_FIELDS`, canonicalised."""
    return CompatKey(tuple((n, _canonical(v)) for n, v in _request_items(request) if n not in PER_REQUEST_FIELDS))


class IncompatibleWaveError(ValueError):
    """A forced wave whose requests disagree on key fields; ``fields`` names them, ``positions`` the requests
    that differ from the first one."""

    def __init__(self, fields: tuple[str, ...], positions: tuple[int, ...], detail: str) -> None:
        self.fields = fields
        self.positions = positions
        super().__init__(detail)


def validate_wave(requests: Sequence[Any], dp_size: int, requests_per_rank: int = 1) -> CompatKey:
    """Check a caller-formed wave before dispatch; return its key.

    Raises ``ValueError`` for an empty or oversized wave and :class:`IncompatibleWaveError` naming every field
    on which some request differs from the first (with both values), so nothing mixed reaches the ranks.
    """
    _check_sizes(dp_size, requests_per_rank)
    if not requests:
        raise ValueError("empty wave: a wave needs at least one request")
    capacity = dp_size * requests_per_rank
    if len(requests) > capacity:
        raise ValueError(
            f"wave of {len(requests)} requests exceeds its capacity dp_size x requests_per_rank = "
            f"{dp_size} x {requests_per_rank} = {capacity}: split it or raise --requests-per-rank"
        )
    keys = [compat_key(r) for r in requests]
    first = keys[0]
    fields: list[str] = []
    positions: list[int] = []
    lines: list[str] = []
    for pos, key in enumerate(keys[1:], start=1):
        diff = first.differing(key)
        if diff:
            positions.append(pos)
            a, b = first.as_dict(), key.as_dict()
            for f in diff:
                if f not in fields:
                    fields.append(f)
                lines.append(f"  request {pos}: {f} = {b.get(f, '<absent>')!r} (request 0: {a.get(f, '<absent>')!r})")
    if fields:
        raise IncompatibleWaveError(
            tuple(fields),
            tuple(positions),
            f"incompatible wave rejected before dispatch: requests differ in {', '.join(fields)}\n"
            + "\n".join(lines)
            + "\nsubmit them without forcing a wave and the scheduler splits them by key",
        )
    return first


def _check_sizes(dp_size: int, requests_per_rank: int) -> None:
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be a positive int, got {dp_size!r}")
    if not isinstance(requests_per_rank, int) or requests_per_rank < 1:
        raise ValueError(f"requests_per_rank must be a positive int, got {requests_per_rank!r}")


def assign_positions(num_requests: int, dp_size: int) -> tuple[tuple[int, ...], ...]:
    """Wave positions per rank, round-robin: rank ``r`` gets ``(r, r + W, ...)``.

    ==========  =========================
    W=2, n=3    rank 0: (0, 2); rank 1: (1,)
    W=4, n=2    ranks 0, 1: (0,), (1,); ranks 2, 3 idle: ()
    ==========  =========================
    """
    return tuple(tuple(range(r, num_requests, dp_size)) for r in range(dp_size))


@dataclass(frozen=True, slots=True)
class Pending:
    """A waiting request as the planner sees it: its index in submission order, key and arrival time."""

    index: int
    key: CompatKey
    arrival_s: float = 0.0


@dataclass(frozen=True, slots=True)
class WavePlan:
    """One wave: request ``indices`` (first-come order) of one ``key`` over ``dp_size`` ranks."""

    wave_id: int
    key: CompatKey
    indices: tuple[int, ...]
    dp_size: int
    requests_per_rank: int = 1

    def __post_init__(self) -> None:
        _check_sizes(self.dp_size, self.requests_per_rank)
        object.__setattr__(self, "indices", tuple(self.indices))
        if not self.indices:
            raise ValueError(f"wave {self.wave_id}: no requests")
        if len(self.indices) > self.capacity:
            raise ValueError(f"wave {self.wave_id}: {len(self.indices)} requests > capacity {self.capacity}")
        if len(set(self.indices)) != len(self.indices):
            raise ValueError(f"wave {self.wave_id}: duplicate request indices {self.indices}")

    @property
    def capacity(self) -> int:
        return self.dp_size * self.requests_per_rank

    @property
    def is_partial(self) -> bool:
        return len(self.indices) < self.capacity

    @property
    def rank_indices(self) -> tuple[tuple[int, ...], ...]:
        """Request indices each rank runs, in the order it runs them."""
        return tuple(tuple(self.indices[p] for p in pos) for pos in assign_positions(len(self.indices), self.dp_size))

    @property
    def idle_ranks(self) -> tuple[int, ...]:
        return tuple(r for r, idx in enumerate(self.rank_indices) if not idx)


@dataclass(frozen=True, slots=True)
class WaveSchedule:
    """The result of :func:`form_waves`: ready ``waves`` in dispatch order and the ``waiting`` indices."""

    waves: tuple[WavePlan, ...]
    waiting: tuple[int, ...]


def form_waves(
    pending: Sequence[Pending],
    dp_size: int,
    requests_per_rank: int = 1,
    *,
    now_s: float = math.inf,
    max_wait_s: float = 0.0,
    first_wave_id: int = 0,
) -> WaveSchedule:
    """Group ``pending`` (in submission order) into ready waves; see the module docstring for the rules.

    ``now_s = inf`` means the input is closed: every partial chunk is ready. Otherwise a partial chunk whose
    oldest request arrived at ``a`` is ready iff ``now_s - a >= max_wait_s``.
    """
    _check_sizes(dp_size, requests_per_rank)
    if max_wait_s < 0:
        raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
    seen: set[int] = set()
    for p in pending:
        if p.index in seen:
            raise ValueError(f"request index {p.index} is pending twice")
        seen.add(p.index)
    capacity = dp_size * requests_per_rank
    groups: dict[CompatKey, list[Pending]] = {}
    for p in pending:
        groups.setdefault(p.key, []).append(p)
    ready: list[tuple[float, int, CompatKey, tuple[int, ...]]] = []
    waiting: list[int] = []
    for key, members in groups.items():
        for start in range(0, len(members), capacity):
            chunk = members[start : start + capacity]
            oldest = chunk[0]
            if len(chunk) == capacity or now_s - oldest.arrival_s >= max_wait_s:
                ready.append((oldest.arrival_s, oldest.index, key, tuple(m.index for m in chunk)))
            else:
                waiting.extend(m.index for m in chunk)
    ready.sort(key=lambda t: (t[0], t[1]))
    waves = tuple(
        WavePlan(first_wave_id + i, key, idx, dp_size, requests_per_rank) for i, (_, _, key, idx) in enumerate(ready)
    )
    return WaveSchedule(waves, tuple(sorted(waiting)))
