"""Lowering passes: a compute-only order of one run, turned into ops on three streams with their event waits.

**Compute-only order.** One *run* (a wave) computes ``T`` denoising steps over ``B`` blocks. Its block loads are
numbered ``k = 0 .. L-1`` with ``L = T*B``: load ``k`` brings block ``k % B`` for step ``k // B``, so the ring
wraps from the last block of a step to block 0 of the next. With ``R`` requests per load (block-major) every
loaded block is computed for requests ``0 .. R-1`` in turn, so one weight load serves ``R`` requests
(``R = 1`` is the published design).

**Lowering.** :func:`place_computes` puts compute ``k`` on slot ``(o + k) % S``; :func:`add_loads` inserts the
loads, H2D of the local shard into landing buffer ``(lo + k) % N`` then AG into slot ``(o + k) % S`` (rank-local
mode: one H2D of the whole block straight into the slot); :func:`add_dependencies` derives the event waits from
buffer hazards. The ops and their strings are in :mod:`dlo_fn.plan.ops`; the offsets ``o``, ``lo`` come from the
:class:`~dlo_fn.plan.schedule.Ring`, which runs these passes.

**A shard group of one.** The all-gather over ``W = 1`` rank is the identity and the rank's only shard is the
whole padded block, so :func:`lowered_mode` lowers ``allgather`` at ``W = 1`` to the rank-local op sequence: one
H2D straight into the slot, no landing buffer (``N = 0``), no ``AG`` op. The executor, the CUDA graph and the
recorded timeline all run that one program; the HBM plan counts no landing bytes for it.

Dependencies (each an event wait): AG after its H2D; C after its AG (rank-local: its H2D); a slot is refilled
only after every compute of its previous occupant; a landing buffer is reused only after its AG. Waits already
implied by "one stream runs in issue order" or by another wait are dropped: an AG waits on the *last* compute of
the slot's previous occupant (after all ``R`` of them), and computes ``r > 0`` of a load wait on nothing.

**Issue order.** The ops of load ``k + S - 1`` are issued before the first compute of load ``k``: that load's
slot was freed by the computes of load ``k - 1``, so with ``S = 2`` the next block starts loading the moment the
current one starts computing, and the H2D stream runs up to ``N`` loads ahead of the all-gathers.

**Load groups** (``G = load_group``, ``S`` a multiple of ``G`` and ``>= 2G``; allgather: ``N`` a multiple of ``G``,
default ``2G``). For blocks so
small that the host's stream operations per block are the bound (five per block: the H2D, its wait for the slot and
its record, the compute's wait and record; :mod:`dlo_fn.cost.host_cost`), ``G`` consecutive loads on ``G``
consecutive slots
move as one unit. Load ``k`` is in group ``(o + k) // G`` (slots ``G*j .. G*j+G-1`` for some ``j``), and:

* a group is issued as one, at the point its *last* load would be (:func:`group_last`);
* its first H2D waits for everything any of its loads must wait for, so the others wait for nothing (stream
  order);
* a compute waits for the H2D of the *last* load of its group, so the other computes of the group need no wait and
  the other H2Ds no record.

That leaves per group one wait, ``G`` copies (one, where the slots and the arena are contiguous: the executor
merges them), one record on the H2D stream, and one wait and one record on the compute stream: ``4 + G`` calls
for ``G`` blocks instead of ``5 G``, and ``5`` with merged copies. The price: ``S = 2G`` slots, and the first compute
of a group starts only when the whole group has landed: a run's first compute starts ``G - 1`` H2D times
later and, when the H2D is the bound, its last group ends ``G - 1`` computes later; the load period per block is
unchanged (``tests/test_schedule.py``, on the plan's timeline). ``G = 1`` is the published design, op for op.

In allgather mode (``W > 1``) a group is its ``G`` H2Ds into ``G`` consecutive landing buffers, then its ``G``
AGs into its ``G`` slots, grouped the same way: the first AG waits for the last H2D and for the slots' previous
occupants, the others wait for nothing, a compute waits for the last AG, and only the last H2D and the last AG
record. The executor issues a group's AGs as one coalesced collective (NCCL: one group launch) and its H2Ds as one
copy where the bytes continue: per group one wait, one copy and one record on each of the H2D and the all-gather
streams, one collective, and one wait and one record on the compute stream, for ``G`` blocks instead of one.

**Quantised loads** (``quantized``: blocks stored as FP8, :mod:`dlo_fn.plan.quant`). Load ``k`` on slot ``j`` lands in
``j``'s staging buffer ``q<j>`` (rank-local: its H2D; allgather: its AG, after the H2D of the shard into a landing
buffer), and a dequantise op ``DQ k b q<j>>s<j>`` on the all-gather stream writes the slot in the compute dtype.
The staging buffer turns with its slot, so the ring carries nothing new; the dependencies follow from the buffers
as for every op (the DQ waits for its load and for the slot's previous occupant; the next load into ``q<j>`` for
the DQ that read it). One block per load (no load groups).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from dlo_fn.plan.ops import AG, DQ, H2D, C, HappensBefore, Op

__all__ = [
    "ComputeItem",
    "lowered_mode",
    "compute_order",
    "place_computes",
    "add_loads",
    "add_dependencies",
    "buffer_uses",
    "check_load_group",
    "default_num_landing",
    "load_group_problem",
    "group_last",
    "prefetch_depth",
    "load_groups",
]


@dataclass(frozen=True, slots=True)
class ComputeItem:
    """One entry of the compute-only order: load ``load`` (block ``block`` of step ``step``) for ``request``."""

    load: int
    block: int
    step: int
    request: int


def lowered_mode(mode: str, num_shards: int | None) -> str:
    """The op sequence ``mode`` lowers to on a shard group of ``num_shards`` ranks (None: unknown, unchanged):
    ``allgather`` over one rank is the rank-local sequence (see the module doc), every other case itself."""
    if num_shards is not None and (not isinstance(num_shards, int) or num_shards < 1):
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    return "rank-local" if mode == "allgather" and num_shards == 1 else mode


def load_group_problem(
    load_group: int, num_slots: int, mode: str, num_landing: int | None = None, quantized: bool = False
) -> str | None:
    """Why ``load_group`` does not fit a ring of ``num_slots`` slots (and, in allgather mode, ``num_landing``
    landing buffers; None: not known yet) running ``mode``'s op sequence (see "Load groups" in the module doc), or
    None where it fits: the one rule the ring, the options and the policy apply."""
    if not isinstance(load_group, int) or isinstance(load_group, bool) or load_group < 1:
        return f"load_group must be an int >= 1 (1 = one load per block), got {load_group!r}"
    if load_group == 1:
        return None
    if quantized:
        return f"load_group = {load_group}: quantised loads (a dequantise op per block) move one block at a time"
    if num_slots % load_group or num_slots < 2 * load_group:
        return (
            f"load_group = {load_group} needs num_slots a multiple of it and >= {2 * load_group} (two groups in "
            f"flight), got num_slots = {num_slots}: pass num_slots = {2 * load_group}"
        )
    if mode == "allgather" and num_landing is not None and num_landing % load_group:
        return (
            f"load_group = {load_group} in allgather mode needs num_landing a multiple of it (a group's shards "
            f"land side by side), got num_landing = {num_landing}: pass num_landing = {2 * load_group}, or "
            f"leave it out"
        )
    return None


def default_num_landing(load_group: int = 1) -> int:
    """Landing buffers of an allgather ring when none are asked for: two loads (two groups) in flight."""
    return 2 * load_group


def check_load_group(
    load_group: int, num_slots: int, mode: str, owner: str = "", num_landing: int | None = None, quantized: bool = False
) -> None:
    """ValueError naming the field (after ``owner``) unless ``load_group`` fits (:func:`load_group_problem`)."""
    problem = load_group_problem(load_group, num_slots, mode, num_landing, quantized)
    if problem is not None:
        raise ValueError(owner + problem)


def prefetch_depth(num_slots: int, load_group: int = 1) -> int:
    """Loads of the next run a run prefetches (and the next run starts warm from): ``S - G``, the whole groups
    whose slots the run's last computes do not use (``S - 1`` with one load per block). A group is never split
    across two runs, so its loads always move as one (one all-gather in a grouped layout)."""
    return num_slots - load_group


def group_last(k: int, load_group: int, slot_offset: int, end: int) -> int:
    """The last load issued (``< end``) of load ``k``'s group ``(slot_offset + k) // load_group``."""
    return min(((slot_offset + k) // load_group + 1) * load_group - 1 - slot_offset, end - 1)


def load_groups(ops: tuple[Op, ...], load_group: int, slot_offset: int) -> tuple[int | None, ...]:
    """Per load op, the index of the last op of its kind (H2D, AG) in its group (``load_group > 1``; a group's
    H2Ds are issued back to back, then its AGs); None for computes and for every op when ``load_group == 1``."""
    if load_group == 1:
        return (None,) * len(ops)
    out: list[int | None] = [None] * len(ops)
    members: dict[tuple[str, int], list[int]] = {}
    for i, op in enumerate(ops):
        if op.kind != C:
            members.setdefault((op.kind, (slot_offset + op.load) // load_group), []).append(i)
    for idx in members.values():
        for i in idx:
            out[i] = idx[-1]
    return tuple(out)


def compute_order(num_blocks: int, num_steps: int, requests_per_load: int = 1) -> tuple[ComputeItem, ...]:
    """Blocks x steps, block-major over requests: ``(k, r)`` for ``k < T*B``, ``r < R``; block ``k % B``."""
    for name, value in (("num_blocks", num_blocks), ("num_steps", num_steps), ("requests_per_load", requests_per_load)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return tuple(
        ComputeItem(k, k % num_blocks, k // num_blocks, r)
        for k in range(num_blocks * num_steps)
        for r in range(requests_per_load)
    )


def place_computes(order: tuple[ComputeItem, ...], num_slots: int, slot_offset: int = 0) -> tuple[Op, ...]:
    """Pass 1: compute ``k`` reads slot ``(slot_offset + k) % num_slots``."""
    return tuple(Op(C, it.load, it.block, slot=(slot_offset + it.load) % num_slots, request=it.request) for it in order)


def _load_ops(
    loads: range,
    num_blocks: int,
    num_slots: int,
    num_landing: int,
    mode: str,
    slot_offset: int,
    landing_offset: int,
    load_group: int,
    quantized: bool = False,
) -> list[Op]:
    """The ops of ``loads`` in issue order: per load its H2D (then its AG); with load groups, per group its H2Ds,
    then its AGs (so that a group's all-gathers can be one collective call). ``quantized``: the load lands in its
    slot's staging buffer and a dequantise op writes the slot (see "Quantised loads" in the module doc)."""
    out: list[Op] = []
    for _, group in itertools.groupby(loads, key=lambda k: (slot_offset + k) // load_group):
        ks = [(k, k % num_blocks, (slot_offset + k) % num_slots) for k in group]
        to = "staging" if quantized else "slot"
        if mode == "rank-local":
            out += [Op(H2D, k, block, **{to: slot}) for k, block, slot in ks]
        else:
            out += [Op(H2D, k, block, landing=(landing_offset + k) % num_landing) for k, block, _ in ks]
            out += [Op(AG, k, block, landing=(landing_offset + k) % num_landing, **{to: slot}) for k, block, slot in ks]
        if quantized:
            out += [Op(DQ, k, block, slot=slot, staging=slot) for k, block, slot in ks]
    return out


def add_loads(
    computes: tuple[Op, ...],
    *,
    num_blocks: int,
    num_slots: int,
    num_landing: int,
    mode: str,
    slot_offset: int = 0,
    landing_offset: int = 0,
    warm_start: bool = False,
    prefetch_next: bool = False,
    load_group: int = 1,
    quantized: bool = False,
) -> tuple[Op, ...]:
    """Pass 2: insert the loads into the compute ops, giving the host issue order.

    Loads ``first .. end-1`` are issued, ``first = P`` if ``warm_start`` (the previous run left loads
    ``0 .. P-1`` in the slots; ``P = prefetch_depth(S, G)``) else 0, and ``end = L + P`` if ``prefetch_next``
    else ``L``. The ops of load
    ``j`` are issued before the first compute of load ``j - S + 1``, the earliest point where its slot's previous
    occupant (load ``j - S``) has all its computes issued; with load groups, at the point of the group's last load
    (:func:`group_last`), so a group's loads are issued back to back.
    """
    num_loads = 1 + max((op.load for op in computes), default=-1)
    depth = prefetch_depth(num_slots, load_group)
    first = depth if warm_start else 0
    end = num_loads + (depth if prefetch_next else 0)
    ops: list[Op] = []
    next_load = first
    shape = (num_blocks, num_slots, num_landing, mode, slot_offset, landing_offset, load_group, quantized)
    for op in computes:
        if op.request == 0:
            start = next_load
            while next_load < end and group_last(next_load, load_group, slot_offset, end) <= op.load + num_slots - 1:
                next_load += 1
            ops.extend(_load_ops(range(start, next_load), *shape))
        ops.append(op)
    ops.extend(_load_ops(range(next_load, end), *shape))
    return tuple(ops)


def add_dependencies(ops: tuple[Op, ...], groups: tuple[int | None, ...] | None = None) -> tuple[tuple[int, ...], ...]:
    """Pass 3: the event waits of each op, from the buffer hazards in issue order.

    Read-after-write waits on the buffer's last writer; write-after-read on every reader since that write (or
    the last writer if none). Then only the waits not already implied are kept: implied by issue order on the
    op's own stream (e.g. compute ``r1`` of a load needs no wait of its own: compute ``r0`` waited for the load)
    or by another kept wait. Every remaining wait is necessary (``tests/test_schedule.py`` checks it).

    ``groups`` (:func:`load_groups`): a group's first load takes the write hazards of all its loads, and a read
    of a slot that a grouped load wrote waits for the group's last load (see "Load groups" in the module doc).
    """
    groups = groups if groups is not None else (None,) * len(ops)
    last_write: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    clocks = HappensBefore()
    deps: list[tuple[int, ...]] = []
    for i, op in enumerate(ops):
        needed: set[int] = set()
        for buf in op.reads:
            if buf in last_write:
                w = last_write[buf]
                needed.add(groups[w] if groups[w] is not None else w)
        first_of_group = groups[i] is not None and (i == 0 or groups[i - 1] != groups[i])
        for member in ops[i : groups[i] + 1] if first_of_group else (op,):
            for buf in member.writes:
                needed.update(readers.get(buf) or ([last_write[buf]] if buf in last_write else []))
        base = clocks.base(op.stream)
        candidates = sorted((d for d in needed if not clocks.covers(base, d)), reverse=True)
        kept: list[int] = []
        for n, d in enumerate(candidates):  # drop d if the others still kept imply it
            others = base
            for e in kept + candidates[n + 1 :]:
                others = clocks.merge(others, e)
            if not clocks.covers(others, d):
                kept.append(d)
        kept.sort()
        clocks.push(op.stream, tuple(kept))
        deps.append(tuple(kept))
        for buf in op.reads:
            readers.setdefault(buf, []).append(i)
        for buf in op.writes:
            last_write[buf] = i
            readers[buf] = []
    return tuple(deps)


def buffer_uses(ops: tuple[Op, ...]) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]:
    """``(first_use, last_use)``: per buffer (sorted by name), the index of the first and the last op using it."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, op in enumerate(ops):
        for buf in op.reads + op.writes:
            first.setdefault(buf, i)
            last[buf] = i
    return tuple(sorted(first.items())), tuple(sorted(last.items()))
