"""Resident blocks under an HBM budget: which blocks stay on the device, and what the device then holds.

Streaming every block makes a link-bound model pay ``bytes / link`` per pass even where the card could hold most
of it. With a set ``R`` of blocks kept resident (whole on every rank, in the compute dtype) and the rest streamed
through the ring, a pass takes at least

    max(sum_b compute_b, sum_{b not in R} h2d_b / link)

so a budget buys resident speed once the streamed bytes hide under the compute.

**Where the resident blocks go.** A streamed load into a ring of ``S`` slots starts when the slot's previous
block has computed and must end before its own block computes (loads share one H2D stream), so with ``S = 2`` it
hides under the compute of the blocks between two streamed blocks; the ring cannot bank the slack of one gap for
the next. So every streamed block needs, before it, compute that covers its bytes. Each block ``b`` has a weight
``w_b``: its compute seconds times the link (the bytes its window could move), or, where no compute is known, its
bytes ``n_b`` (compute taken to follow bytes). A streamed fraction ``f`` of the bytes is spread by credit: walking
the blocks in forward order, each adds ``f w_b N / W`` to the credit (``N``, ``W``: the sums of bytes and weights,
so a pass accrues ``f N``), and block ``b`` streams where the credit covers its ``n_b`` bytes (which it then
spends), else stays resident. A streamed block so follows about ``n_b / f`` bytes' worth of weight since the last
one, and the pass opens with resident blocks; weights proportional to bytes give the spread by bytes. Examples
(``f = m / 8``; blocks of bytes ``2 1 1 2 1 1`` at ``f = 1/2``: the large blocks stay resident, their loads would
be the hardest to hide)::

    equal blocks, m = 2   R R R S R R R S
    equal blocks, m = 4   R S R S R S R S
    equal blocks, m = 6   R S S S R S S S
    2 1 1 2 1 1, m = 4    R S S R S S

With compute, FLUX-like blocks (two large blocks of little compute, then small ones of much) stream the small
ones first: bytes ``3 3 1 1 1 1``, compute ``1 1 2 2 2 2``, ``m = 4`` gives ``R R S S S S``.

**Pass time** (:func:`pass_seconds`; what the executor does, host issue time not modelled). Per pass, blocks in
forward order with compute ``c_b``; the streamed ones numbered ``j`` in the ring's order across consecutive passes,
each moving ``h_j`` bytes to this rank at ``link`` bytes/s (allgather: its local shard; the all-gather is taken to
hide behind the H2D stream)::

    load_j    = max(load_{j-1} + h_{j-1} / link, done_{j-S})      start of the H2D (slot free, stream free)
    start_b   = max(done of the block before b, load_j + h_j / link if b is streamed load j)
    done_b    = start_b + c_b

The pass time is the steady state, the mean period over consecutive passes (the ring wraps from the last block to
the first of the next pass); at least ``max(sum c_b, sum h_j / link)``. With :class:`DeviceLoads` (the device's
copy rate, priced where ``device_link`` is given): a device-stored block's load runs at that rate instead, and each
ring block's dequantise (FP8 shards: it reads the stored block and writes the slot, ``(stored + slot) / (2 x
device copy rate)`` alone, :data:`DEQUANT_BESIDE_COMPUTE` times that beside a compute) is done in the ring: a load
lands in one of ``S`` staging buffers (the next load into it waits for the dequantise that read it), the dequantise
waits for its slot, and beside a running compute it delays that compute by its time.

**Device-stored shards** (a third tier, beside resident and streamed from the host). Where a streamed block's
stored shard holds less than the block resident (FP8 shards; a ``1/W`` shard in allgather mode) and blocks are
laid out one by one, :func:`choose_resident` with ``device_link`` spends what a plan leaves of the budget on
keeping streamed blocks' shards on the device: they stay in the ring (slot, all-gather, dequantise) and their loads
copy from device memory. :meth:`_Pricer.filled` picks them (the fastest of the spread's kept sets and the blocks
whose loads most outlast their compute), only where the pass is predicted faster.

**The plan.** :func:`with_resident` moves the resident blocks' tensors into the spec's resident tensors (named
``<block>.<tensor>``), so the layout, the ring, the schedule and the timeline are those of the streamed blocks
only (the ring is shorter; lowering never sees a resident block's load), and ``total_bytes`` is unchanged.

**Device weight bytes** of a plan (what ``Offloaded.device_weight_bytes`` reports; :func:`device_weight_bytes`)::

    S x slot + N x landing + S_q x staging  +  resident bytes (non-block tensors + resident blocks)
                                             +  device-stored shards

with ``S_q = S`` for quantised shards (else 0); every block resident is ``total_bytes`` and no ring at all.
:func:`frontier` lists the plans worth having, device bytes against streamed bytes (with ``compute=`` and ``link=``:
against predicted pass seconds, spread by compute and by bytes, for one or several ``S``); :func:`choose_resident`
takes the one that streams the least (predicted fastest; ties: fewer device bytes) within the budget and, placed
by compute, improves its resident set by local moves while the pass model predicts a faster pass
(:meth:`_Pricer.refined`: the spread places by a smooth credit, and a move can trade one large resident block for
two small ones, or shift a resident block to where a load needs it); then what the budget leaves goes to more
resident blocks that do not slow the pass (:meth:`_Pricer.topped_up`): a plan predicted at the compute hides its
loads with little slack, and what the model leaves out (compute runs slower while a load streams) eats that slack
first. The ring alone with nothing resident is the least a budget may be.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable

from dlo_fn.plan.layout import DEFAULT_ALIGNMENT_BYTES, ModelLayout, cut_layout, layout_load_group, model_layout
from dlo_fn.plan.lowering import default_num_landing, lowered_mode
from dlo_fn.plan.spec import ModelSpec, TensorSpec

__all__ = [
    "spread_resident",
    "compute_weights",
    "pass_ends",
    "pass_seconds",
    "at_speed",
    "with_resident",
    "buffer_bytes",
    "device_weight_bytes",
    "layout_for",
    "ring_num_landing",
    "ResidentChoice",
    "frontier",
    "choose_resident",
    "price_plan",
    "DeviceLoads",
    "BudgetError",
]


class BudgetError(ValueError):
    """An HBM budget below the least a plan can hold (the message names the minimum)."""


def spread_resident(
    block_bytes: tuple[int, ...], streamed: int, steps: int, weights: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """The blocks kept on the device when a fraction ``f = streamed / steps`` of the bytes streams, by credit
    (module docstring). ``weights``: each block's compute times the link, in bytes (:func:`compute_weights`); None:
    its bytes. Integers, so a plan is the same on every rank."""
    if not block_bytes or any(n < 1 for n in block_bytes):
        raise ValueError(f"block_bytes must be positive sizes, one per block, got {block_bytes!r}")
    if not isinstance(steps, int) or steps < 1 or not isinstance(streamed, int) or not 0 <= streamed <= steps:
        raise ValueError(f"the streamed fraction must be m / steps with 0 <= m <= steps, got {streamed!r}/{steps!r}")
    if weights is None:
        weights = block_bytes
    if len(weights) != len(block_bytes) or any(w < 0 for w in weights) or not sum(weights):
        raise ValueError(f"weights must be one int >= 0 per block (not all 0), got {weights!r}")
    total, weight = sum(block_bytes), sum(weights)
    credit, keep = 0, []
    for b, (n, w) in enumerate(zip(block_bytes, weights)):
        credit += streamed * w * total  # in units of 1 / (steps * weight) bytes
        if credit >= steps * n * weight:
            credit -= steps * n * weight
        else:
            keep.append(b)
    return tuple(keep)


def compute_weights(compute_s: tuple[float, ...], link_bytes_per_s: float) -> tuple[int, ...]:
    """Each block's compute seconds times the link, in whole bytes: the credit weights of :func:`spread_resident`."""
    return tuple(round(c * link_bytes_per_s) for c in compute_s)


# A dequantise beside a block's compute takes about this many times its time alone (its bytes at the device's copy
# rate): fitted to the FP8 budget rows measured on the H200 (docs/measurements.md, figures/data).
DEQUANT_BESIDE_COMPUTE = 2.5
PASSES = 6  # consecutive passes the pass time is averaged over (the first, from cold slots, excluded)


def pass_ends(
    compute_s: tuple[float, ...],
    h2d_bytes: tuple[int, ...],
    num_slots: int,
    link_bytes_per_s: float,
    passes: int,
    *,
    device: "DeviceLoads | None" = None,
) -> tuple[float, ...]:
    """When each of ``passes`` consecutive passes ends (its last compute), from idle streams and empty slots at 0,
    by the recurrence of the module docstring. ``h2d_bytes[b]``: the bytes block ``b``'s load moves to this rank,
    0 for a resident block. ``device``: the blocks loaded from device memory and each block's dequantise."""
    if len(compute_s) != len(h2d_bytes) or num_slots < 1 or link_bytes_per_s <= 0:
        raise ValueError("pass_ends needs one compute and one h2d entry per block, num_slots >= 1 and link > 0")
    rate, dq, staged = (link_bytes_per_s,) * len(h2d_bytes), (0.0,) * len(h2d_bytes), False
    if device is not None:
        rate = tuple(device.bytes_per_s if b in device.stored else link_bytes_per_s for b in range(len(h2d_bytes)))
        dq, staged = device.dequant_s, device.staged
    done: list[float] = []  # the compute end of each streamed load so far
    read: list[float] = []  # staged: when each load's dequantise ended (its staging buffer free again)
    h2d_free = t = 0.0
    ends = []
    for _ in range(passes):
        for c, h, r, d in zip(compute_s, h2d_bytes, rate, dq):
            if h:
                j = len(done)
                if staged:  # H2D into the staging buffer, then the dequantise into the slot
                    start = max(h2d_free, read[j - num_slots] if j >= num_slots else 0.0)
                    h2d_free = start + h / r
                    dq_start = max(h2d_free, done[j - num_slots] if j >= num_slots else 0.0)
                    read.append(dq_start + d)
                    t = max(t + (d if dq_start < t else 0.0), read[-1])  # beside a compute it takes its time
                else:
                    start = max(h2d_free, done[j - num_slots] if j >= num_slots else 0.0)
                    h2d_free = start + h / r
                    t = max(t, h2d_free) + d
            t += c
            if h:
                done.append(t)
        ends.append(t)
    return tuple(ends)


def pass_seconds(
    compute_s: tuple[float, ...],
    h2d_bytes: tuple[int, ...],
    num_slots: int,
    link_bytes_per_s: float,
    *,
    device: "DeviceLoads | None" = None,
) -> float:
    """The steady-state seconds of one pass (module docstring): the mean period of :data:`PASSES` consecutive
    passes after the first."""
    ends = pass_ends(compute_s, h2d_bytes, num_slots, link_bytes_per_s, PASSES, device=device)
    return max((ends[-1] - ends[0]) / (PASSES - 1), sum(compute_s))  # the mean period rounds, the bound does not


@dataclass(frozen=True, slots=True)
class DeviceLoads:
    """What the pass model needs beyond the H2D link: the device's copy rate (bytes/s), the blocks whose stored
    shards are on the device (their loads copy at that rate), and each block's dequantise seconds (0 unless the
    shards are quantised), added to a ring block's compute."""

    bytes_per_s: float
    stored: frozenset[int]
    dequant_s: tuple[float, ...]
    staged: bool = False  # quantised: loads land in S staging buffers, the dequantise writes the slot


def with_resident(spec: ModelSpec, resident: tuple[int, ...]) -> ModelSpec:
    """``spec`` with blocks ``resident`` moved into its resident tensors: the spec of the streamed blocks."""
    keep = set(resident)
    if not keep <= set(range(spec.num_blocks)):
        raise ValueError(f"resident blocks {sorted(keep)} outside [0, {spec.num_blocks})")
    if len(keep) == spec.num_blocks:
        raise ValueError("every block resident leaves nothing to stream: run the model resident")
    moved = tuple(
        TensorSpec(f"{b.name}.{t.name}", t.shape, t.dtype, t.kind)
        for i, b in enumerate(spec.blocks)
        if i in keep
        for t in b.tensors
    )
    blocks = tuple(b for i, b in enumerate(spec.blocks) if i not in keep)
    return replace(spec, blocks=blocks, resident=spec.resident + moved)


def buffer_bytes(layout: ModelLayout, num_slots: int, num_landing: int) -> int:
    """The ring's device buffers: ``S x slot + N x landing (+ S x staging for quantised shards)``."""
    staging = num_slots * layout.max_padded_block_bytes if layout.quantized else 0
    return num_slots * layout.slot_bytes + num_landing * layout.max_shard_bytes + staging


def device_weight_bytes(spec: ModelSpec, layout: ModelLayout | None, num_slots: int, num_landing: int) -> int:
    """Weights on the device: the ring's buffers for ``layout`` (of ``spec``'s streamed blocks; None: no ring,
    every block resident) plus ``spec``'s resident tensors (its non-block tensors and its resident blocks)."""
    if layout is None:
        return spec.total_bytes
    return buffer_bytes(layout, num_slots, num_landing) + spec.resident_bytes


def layout_for(
    spec: ModelSpec,
    num_shards: int,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    load_group: int = 1,
    quantization: str | None = None,
    exclude: tuple[str, ...] = (),
) -> ModelLayout:
    """The layout ``offload`` builds for ``spec``'s blocks on a shard group of ``num_shards`` ranks."""
    group = layout_load_group(spec.num_blocks, num_shards, load_group)
    return model_layout(spec, num_shards, alignment_bytes, group, quantization, exclude)


def ring_num_landing(mode: str, num_shards: int, num_landing: int | None, load_group: int = 1) -> int:
    """The landing buffers the ring holds: none where ``mode`` lowers to rank-local, else ``num_landing`` (None:
    the default, two per load group)."""
    if lowered_mode(mode, num_shards) == "rank-local":
        return 0
    return num_landing if num_landing is not None else default_num_landing(load_group)


@dataclass(frozen=True, slots=True)
class ResidentChoice:
    """The blocks kept resident for a budget, the device weight bytes of that plan, the bytes one pass moves to
    each rank over the H2D link (its streamed shards; FP8: as stored), the ring's slots, the predicted pass seconds
    (None: no compute given), and the streamed blocks whose stored shards this rank keeps on the device (loaded
    from there; empty without a device tier)."""

    resident: tuple[int, ...]
    device_weight_bytes: int
    h2d_bytes_per_pass: int
    num_slots: int = 2
    pass_s: float | None = None
    device_stored: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {
            "resident_blocks": list(self.resident),
            "num_resident": len(self.resident),
            "device_stored_blocks": list(self.device_stored),
            "device_weight_bytes": self.device_weight_bytes,
            "h2d_bytes_per_pass": self.h2d_bytes_per_pass,
            "num_slots": self.num_slots,
            "predicted_pass_s": self.pass_s,
        }


class _Pricer:
    """Prices plans (device bytes, streamed bytes, pass time). ``layout_of`` of every streamed spec is the exact
    price; searching hundreds of sets uses the layout of every block cut to the streamed ones, which is the same
    wherever blocks are laid out one by one (load group 1; with load groups every set is laid out afresh), and the
    plan :func:`choose_resident` returns is priced again exactly.
    ``device_link`` (bytes/s of a device copy) prices dequantising and, where the layout allows it
    (:meth:`tiered`), the device-stored tier."""

    def __init__(self, spec, layout_of, num_landing, compute, link, device_link=None) -> None:
        self.spec, self.layout_of, self.num_landing, self.compute, self.link = (
            spec,
            layout_of,
            num_landing,
            compute,
            link,
        )
        self.device_link = device_link
        self.whole = layout_of(spec)
        self.block_bytes = spec.block_bytes
        self.layouts: dict[tuple[tuple[int, ...], bool], tuple[ModelLayout, int]] = {}
        self.priced: dict[tuple, ResidentChoice] = {}

    @property
    def tiered(self) -> bool:
        """Whether a streamed block's stored shard is worth keeping on the device: it holds less than the block
        resident (quantised, or a 1/W shard) and the layout loads block by block."""
        w = self.whole
        return self.device_link is not None and (w.quantized or w.num_shards > 1) and w.load_group == 1

    def _layout(self, resident: tuple[int, ...], exact: bool) -> tuple[ModelLayout, int]:
        """The streamed blocks' layout and the resident bytes beside it."""
        exact = exact or self.whole.load_group != 1
        if (resident, exact) not in self.layouts:
            if exact:
                streamed = with_resident(self.spec, resident)
                self.layouts[resident, exact] = self.layout_of(streamed), streamed.resident_bytes
            else:
                keep = [b for b in range(self.spec.num_blocks) if b not in set(resident)]
                cut = cut_layout(self.whole, keep)
                kept = sum(self.block_bytes[b] for b in resident)
                self.layouts[resident, exact] = cut, self.spec.resident_bytes + kept
        return self.layouts[resident, exact]

    def __call__(
        self, resident: tuple[int, ...], num_slots: int, exact: bool = False, stored: tuple[int, ...] = ()
    ) -> ResidentChoice:
        key = (resident, num_slots, exact or self.whole.load_group != 1, stored)
        if key not in self.priced:
            self.priced[key] = self._price(resident, num_slots, exact, stored)
        return self.priced[key]

    def _price(self, resident: tuple[int, ...], num_slots: int, exact: bool, stored: tuple[int, ...]) -> ResidentChoice:
        spec, compute = self.spec, self.compute
        if len(resident) == spec.num_blocks:
            return ResidentChoice(resident, spec.total_bytes, 0, num_slots, None if compute is None else sum(compute))
        layout, resident_bytes = self._layout(resident, exact)
        streamed = [b for b in range(spec.num_blocks) if b not in set(resident)]
        shard = dict(zip(streamed, (s.shard_bytes for s in layout.shards)))
        on_device = sum(shard[b] for b in stored)
        pass_s = None
        if compute is not None:
            h2d = tuple(shard.get(b, 0) for b in range(spec.num_blocks))
            device = None
            if self.device_link is not None:
                dq = [0.0] * spec.num_blocks
                if layout.quantized:  # reads the stored block, writes the slot's: both through device memory
                    for j, b in enumerate(streamed):
                        moved = layout.shards[j].padded_bytes + layout.compute_block(j).nbytes
                        dq[b] = DEQUANT_BESIDE_COMPUTE * moved / (2 * self.device_link)
                device = DeviceLoads(self.device_link, frozenset(stored), tuple(dq), layout.quantized)
            pass_s = pass_seconds(compute, h2d, num_slots, self.link, device=device)
        dev = buffer_bytes(layout, num_slots, self.num_landing) + resident_bytes + on_device
        return ResidentChoice(resident, dev, layout.shard_bytes_per_rank - on_device, num_slots, pass_s, stored)

    def exactly(self, plan: ResidentChoice) -> ResidentChoice:
        return self(plan.resident, plan.num_slots, exact=True, stored=plan.device_stored)

    def filled(self, plan: ResidentChoice, budget_bytes: int) -> ResidentChoice:
        """``plan`` with the budget it leaves spent on device-stored shards, as many of its streamed blocks as fit,
        where that is predicted faster: the fastest of the sets the spread keeps (by compute: the loads hardest to
        hide; by bytes) and the blocks taken greedily by how far their load outlasts their compute."""
        left = budget_bytes - plan.device_weight_bytes
        layout, _ = self._layout(plan.resident, False)
        shard = tuple(s.shard_bytes for s in layout.shards)
        if not shard or left < min(shard):
            return plan
        streamed = [b for b in range(self.spec.num_blocks) if b not in set(plan.resident)]
        steps = 4 * len(streamed)

        def spread(weights) -> tuple[int, ...]:  # the least streamed fraction whose kept shards fit (bisection)
            lo, hi = 0, steps
            while lo < hi:
                mid = (lo + hi) // 2
                if sum(shard[i] for i in spread_resident(shard, mid, steps, weights)) <= left:
                    hi = mid
                else:
                    lo = mid + 1
            kept = spread_resident(shard, lo, steps, weights)
            return kept if sum(shard[i] for i in kept) <= left else ()

        compute = tuple(self.compute[b] for b in streamed)
        weights = compute_weights(compute, self.link)
        greedy, room = [], left
        for i in sorted(range(len(shard)), key=lambda i: compute[i] - shard[i] / self.link):
            if shard[i] <= room:
                greedy.append(i)
                room -= shard[i]
        sets = {spread(weights if sum(weights) else None), spread(None), tuple(sorted(greedy))} - {()}
        plans = [self(plan.resident, plan.num_slots, stored=tuple(streamed[i] for i in k)) for k in sets]
        return min([plan, *plans], key=_fastest)  # kept only where it is predicted faster

    def refined(self, plan: ResidentChoice, budget_bytes: int) -> ResidentChoice:
        """``plan`` improved by local moves of its resident set while the pass model predicts a faster pass within
        ``budget_bytes``: keep one more streamed block resident, swap a resident block for a streamed one, or trade
        a resident block for two streamed ones whose bytes fit in its bytes and what the budget leaves. Moves are
        tried in that order (blocks in forward order) and the first faster one (by :data:`REFINE_GAIN`) is taken,
        until none is or :data:`REFINE_PRICINGS` plans are priced; device-stored blocks stay streamed. The same plan
        on every rank: the moves' order is fixed and the pass model is deterministic."""
        best, priced, n = plan, 0, self.spec.block_bytes
        while priced < REFINE_PRICINGS:
            keep = set(best.resident)
            resident = sorted(keep)
            streamed = [b for b in range(self.spec.num_blocks) if b not in keep and b not in best.device_stored]
            left = budget_bytes - best.device_weight_bytes
            moves = itertools.chain(
                ((s,) for s in streamed),
                ((r, s) for r in resident for s in streamed),
                (
                    (r, s, t)
                    for r in resident
                    for i, s in enumerate(streamed)
                    for t in streamed[i + 1 :]
                    if n[s] + n[t] <= n[r] + left
                ),
            )
            for move in moves:
                if priced >= REFINE_PRICINGS:
                    break
                taken = keep - {move[0]} | set(move[1:]) if len(move) > 1 else keep | set(move)
                p = self(tuple(sorted(taken)), best.num_slots, stored=best.device_stored)
                priced += 1
                if p.device_weight_bytes <= budget_bytes and p.pass_s < best.pass_s * (1 - REFINE_GAIN):
                    best = p
                    break
            else:
                break
        return best

    def topped_up(self, plan: ResidentChoice, budget_bytes: int) -> ResidentChoice:
        """``plan`` with what ``budget_bytes`` leaves spent on more resident blocks, one at a time, while one fits and
        the pass is not predicted slower than ``plan``'s (by :data:`REFINE_GAIN`): a plan at the compute keeps its
        loads' slack, which copies slower than the measured link, or compute slowed beside them, then eat before the
        compute waits. Each step takes the block (streamed, or device-stored) whose plan is fastest with the link
        :data:`FILL_MARGIN` slower, then streams the fewest bytes, then comes first; without compute, the one
        streaming the fewest bytes."""
        best, slow = plan, None
        if self.compute is not None:
            slow = _Pricer(self.spec, self.layout_of, self.num_landing, self.compute, self.link / (1 + FILL_MARGIN))
            slow.device_link, slow.layouts = self.device_link, self.layouts
        while len(best.resident) < self.spec.num_blocks - 1:
            keep = set(best.resident)
            options = []
            for b in range(self.spec.num_blocks):
                if b in keep:
                    continue
                resident, stored = tuple(sorted(keep | {b})), tuple(s for s in best.device_stored if s != b)
                p = self(resident, best.num_slots, stored=stored)
                if p.device_weight_bytes > budget_bytes:
                    continue
                if slow is None:
                    options.append(((p.h2d_bytes_per_pass, b), p))
                elif p.pass_s <= plan.pass_s * (1 + REFINE_GAIN):  # never more than that slower than ``plan``
                    options.append(((slow(resident, best.num_slots, stored=stored).pass_s, p.h2d_bytes_per_pass, b), p))
            if not options:
                break
            best = min(options, key=lambda o: o[0])[1]
        return best


def _spread_sets(spec: ModelSpec, weights: tuple[int, ...] | None) -> list[tuple[int, ...]]:
    """The distinct resident sets of the spread, from every block streamed to one block streamed."""
    steps, seen, out, block_bytes = 4 * spec.num_blocks, set(), [], spec.block_bytes
    for m in range(steps, 0, -1):
        resident = spread_resident(block_bytes, m, steps, weights)
        if len(resident) < spec.num_blocks and resident not in seen:
            seen.add(resident)
            out.append(resident)
    return out


def _check_compute(spec: ModelSpec, compute, link, num_slots, device_link=None) -> None:
    if (compute is None) != (link is None):
        raise ValueError("compute= and link= come together (seconds per block, in block order; bytes/s)")
    if compute is not None and (len(compute) != spec.num_blocks or any(c < 0 for c in compute) or link <= 0):
        raise ValueError(
            f"compute= needs {spec.num_blocks} block seconds >= 0 (in block order) and link= bytes/s > 0, got "
            f"{len(compute)} and {link!r}"
        )
    if num_slots == "auto" and compute is None:
        raise ValueError("num_slots='auto' with a budget compares predicted passes: pass compute= and link=")
    if device_link is not None and (compute is None or device_link <= 0):
        raise ValueError("device_link= (bytes/s of a device copy, > 0) prices passes: pass it with compute= and link=")


def _priced(spec, layout_of, num_slots, num_landing, compute, link, device_link):
    """The frontier's plans without a device tier, and the pricer that priced them."""
    _check_compute(spec, compute, link, num_slots, device_link)
    if compute is None:
        return _frontier_by_bytes(spec, layout_of, num_slots, num_landing), None
    weights = compute_weights(compute, link)
    sets = [()] + (_spread_sets(spec, weights) if sum(weights) else []) + _spread_sets(spec, None)
    price = _Pricer(spec, layout_of, num_landing, compute, link, device_link)
    plans = [price(r, s) for s in _slot_counts(num_slots) for r in dict.fromkeys(sets)]
    full = price(tuple(range(spec.num_blocks)), _slot_counts(num_slots)[0])
    return tuple(_fastest_for_bytes(plans, full)) + (full,), price


def _slot_counts(num_slots: int | str) -> tuple[int, ...]:
    return (2, 3, 4) if num_slots == "auto" else (num_slots,)


REFINE_PRICINGS = 4_000  # at most this many plans priced by :meth:`_Pricer.refined` for one budget
# a move is taken where it predicts a pass at least this fraction faster: not for the rounding of a few bytes (the
# planners' sizes and the runtime's tensors may differ by alignment padding) but for what a move really gains
REFINE_GAIN = 1e-4
# :meth:`_Pricer.topped_up` ranks the blocks a budget's leftover keeps resident by the pass with the link this much
# slower: the load hardest to hide goes first
FILL_MARGIN = 0.1
FILLED = 8  # the frontier's tier: the plans holding the most that a budget's leftover is spent on


def _within(plans, price, budget_bytes: int, num_slots, most: int | None = None) -> list[ResidentChoice]:
    """The plans that fit ``budget_bytes``; with a device tier also each of them (``most``: only that many, those
    holding the most) and the ring alone (which leaves the most to the tier) with what the budget leaves spent on
    device-stored shards."""
    fits = [p for p in plans if p.device_weight_bytes <= budget_bytes]
    if price is None or not price.tiered:
        return fits
    rings = [price((), s) for s in _slot_counts(num_slots)]
    fill = fits[-most:] if most else fits  # fits: by device bytes
    fill += [r for r in rings if r.device_weight_bytes <= budget_bytes]
    return fits + [price.filled(p, budget_bytes) for p in dict.fromkeys(fill)]


TIER_POINTS = 48  # budgets between the ring alone and the whole model the tiered frontier is priced at


def frontier(
    spec: ModelSpec,
    layout_of: Callable[[ModelSpec], ModelLayout],
    num_slots: int | str,
    num_landing: int,
    *,
    compute: tuple[float, ...] | None = None,
    link: float | None = None,
    device_link: float | None = None,
) -> tuple[ResidentChoice, ...]:
    """Every plan :func:`choose_resident` can pick, from the ring alone to the whole model resident, each holding
    more than the one before. Without ``compute``: spread by bytes, each streaming less than the one before (with
    a link, the bound ``max(compute, h2d_bytes_per_pass / link)``). With ``compute`` (seconds per block, in block
    order) and ``link`` (bytes/s): the sets spread by compute and by bytes, priced by :func:`pass_seconds`, each
    predicted faster than the one before; ``num_slots="auto"``: for S in 2..4. With ``device_link`` (bytes/s of a
    device copy): dequantising priced, and where stored shards are smaller than resident blocks, the device-stored
    tier's plans at :data:`TIER_POINTS` budgets (each filling the :data:`FILLED` plans that hold the most)."""
    plans, price = _priced(spec, layout_of, num_slots, num_landing, compute, link, device_link)
    if price is None or not price.tiered:
        return plans
    lo, hi = plans[0].device_weight_bytes, plans[-1].device_weight_bytes
    budgets = [lo + (hi - lo) * i // TIER_POINTS for i in range(TIER_POINTS)]
    best = [min(_within(plans, price, b, num_slots, FILLED), key=_fastest) for b in budgets]
    return tuple(_fastest_for_bytes(list(dict.fromkeys([*plans[:-1], *best])), plans[-1])) + (plans[-1],)


def _fastest(p: ResidentChoice) -> tuple:
    return (p.pass_s, p.device_weight_bytes)


def _fastest_for_bytes(plans: list[ResidentChoice], full: ResidentChoice) -> list[ResidentChoice]:
    """The plans below the whole model each predicted faster than every plan holding less."""
    kept: list[ResidentChoice] = []
    for p in sorted(plans, key=lambda p: (p.device_weight_bytes, p.pass_s, p.num_slots, p.resident)):
        if p.device_weight_bytes < full.device_weight_bytes and (not kept or p.pass_s < kept[-1].pass_s):
            kept.append(p)
    return kept


def _frontier_by_bytes(spec, layout_of, num_slots, num_landing) -> tuple[ResidentChoice, ...]:
    price = _Pricer(spec, layout_of, num_landing, None, None)
    full = ResidentChoice(tuple(range(spec.num_blocks)), spec.total_bytes, 0, num_slots)
    plans = [price(r, num_slots) for r in [()] + _spread_sets(spec, None)]
    return tuple(_least_streamed_for_bytes(plans, full)) + (full,)


def _least_streamed_for_bytes(plans: list[ResidentChoice], full: ResidentChoice) -> list[ResidentChoice]:
    """In spread order, the plans each streaming less than the one before, then those below the whole model each
    holding more than the one before (a plan that holds as much as one streaming less is no choice)."""
    out: list[ResidentChoice] = []
    for choice in plans:
        if not out or choice.h2d_bytes_per_pass < out[-1].h2d_bytes_per_pass:
            out.append(choice)
    kept = [full]
    for choice in reversed(out):
        if choice.device_weight_bytes < kept[-1].device_weight_bytes:
            kept.append(choice)
    return list(reversed(kept[1:]))


def choose_resident(
    spec: ModelSpec,
    budget_bytes: int,
    layout_of: Callable[[ModelSpec], ModelLayout],
    num_slots: int | str,
    num_landing: int,
    owner: str = "hbm_budget",
    *,
    compute: tuple[float, ...] | None = None,
    link: float | None = None,
    device_link: float | None = None,
) -> ResidentChoice:
    """The plan of the :func:`frontier` within ``budget_bytes`` of device weight bytes (``layout_of`` lays out a
    streamed spec as the runtime will) that streams the least, or with ``compute`` and ``link`` is predicted
    fastest (ties: fewer device bytes), then improved by local moves (:meth:`_Pricer.refined`); with
    ``device_link``, the budget a plan leaves goes to device-stored shards where they are smaller than resident
    blocks; what is still left, to more resident blocks (:meth:`_Pricer.topped_up`). Everything resident where
    the whole model fits; :class:`BudgetError` naming the minimum (nothing resident, the ring alone) below it."""
    _check_compute(spec, compute, link, num_slots, device_link)
    slots = 2 if num_slots == "auto" else num_slots
    if budget_bytes >= spec.total_bytes:
        return ResidentChoice(
            tuple(range(spec.num_blocks)), spec.total_bytes, 0, slots, None if compute is None else sum(compute)
        )
    plans, price = _priced(spec, layout_of, num_slots, num_landing, compute, link, device_link)
    fits = _within(plans, price, budget_bytes, num_slots)
    if not fits:
        need = min(p.device_weight_bytes for p in plans)
        raise BudgetError(
            f"{owner} = {budget_bytes} bytes is below the {need} bytes of device weights the ring of {slots} "
            f"slots needs with every block streamed (and the non-block weights resident): pass at least {need}"
        )
    if compute is None:
        best = min(fits, key=lambda p: p.h2d_bytes_per_pass)
        price = _Pricer(spec, layout_of, num_landing, None, None)
    else:
        best = min(fits, key=_fastest)
        if len(best.resident) < spec.num_blocks and best.pass_s > sum(compute) * (1 + REFINE_GAIN):  # else at compute
            best = min(best, price.refined(best, budget_bytes), key=_fastest)
    best = price.topped_up(price.exactly(best), budget_bytes)
    return best if len(best.resident) == spec.num_blocks else price.exactly(best)


def price_plan(
    spec: ModelSpec,
    plan: ResidentChoice,
    layout_of: Callable[[ModelSpec], ModelLayout],
    num_landing: int,
    *,
    compute: tuple[float, ...],
    link: float,
    device_link: float | None = None,
) -> ResidentChoice:
    """``plan`` (its resident set, slots and device-stored blocks) priced again with ``compute``, ``link`` and
    ``device_link``: what another measurement of the same model predicts for it."""
    _check_compute(spec, compute, link, plan.num_slots, device_link)
    price = _Pricer(spec, layout_of, num_landing, compute, link, device_link)
    return price(plan.resident, plan.num_slots, exact=True, stored=plan.device_stored)


def at_speed(plans: tuple[ResidentChoice, ...], within: float = 0.01) -> ResidentChoice:
    """The plan of a priced :func:`frontier` with the least device bytes whose predicted pass is within
    ``within`` of the compute (the whole model resident, the frontier's last plan): the model's fastest point."""
    if plans[-1].pass_s is None:
        raise ValueError("at_speed needs a frontier priced with compute= and link=")
    return next(p for p in plans if p.pass_s <= (1 + within) * plans[-1].pass_s)
