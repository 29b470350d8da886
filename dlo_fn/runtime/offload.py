"""Wrap any ``nn.Module`` for layerwise offload, given the dotted path(s) of its block list(s).

``offload(model, block_paths, ctx, mode=...)`` does, in order:

1. describe the model (:func:`~dlo_fn.plan.spec.spec_from_module`) and lay it out for the shard group
   (``W = num_shards``: in allgather mode the size of ``options.shard_group`` on ``mesh``, by default the
   whole world, see :mod:`dlo_fn.runtime.mesh`; 1 in rank-local mode); compare the layout digest across every
   rank (a rank started with another shard group or checkpoint fails here, not in a collective);
2. fill this rank's :class:`~dlo_fn.runtime.host_store.HostStore` from the block tensors (mmap views when the
   model came from :func:`dlo_fn.io.load.load_model`): each rank copies only its pieces;
3. strip the blocks to meta (dropping those views) and put a :class:`~dlo_fn.runtime.blocks.BlockProxy` in
   each block list entry; move everything else (resident tensors) to the device once, then close the checkpoint
   mapping (:mod:`dlo_fn.io.release`: on CPU the resident tensors get small private copies), so no page
   this rank read stays charged to it;
4. build the :class:`~dlo_fn.runtime.executor.Executor` (slots and landing buffers allocated once); it interprets
   the schedules it is handed, or its ring's next one (at W > 1 after one warm-up all-gather, which makes the
   backend create its communicator now rather than in the first step).

``Offloaded.timings`` holds the seconds of each phase, from the call: ``describe_s`` (spec and layout),
``digest_s`` (the digest compared across ranks: it waits for the slowest rank to get there), ``store_s``
(``store.timings`` splits it), ``warm_up_s`` (the warm-up all-gather), ``executor_s`` (the rest of the executor),
``to_device_s`` (the resident tensors), ``release_s`` (the mapping closed) and ``total_s``.

``mode="resident"`` is the no-offload baseline: the whole model moves to the device, nothing else happens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from torch import nn

from dlo_fn.io.bind import drop_stored, stored_weights, with_address_residues
from dlo_fn.io.release import ReleaseReport, release_copied_pages, release_mapped_tensors, viewed_files
from dlo_fn.plan.layout import ModelLayout, grouped_layout_problem, layout_load_group, model_layout
from dlo_fn.plan.modes import MODES
from dlo_fn.plan.schedule import Schedule
from dlo_fn.plan.spec import ModelSpec, normalize_block_paths, spec_from_module
from dlo_fn.runtime.blocks import BlockProxy, block_state, strip_block
from dlo_fn.runtime.dist import DistContext, check_same_across_ranks, local_ranks
from dlo_fn.runtime.executor import Executor
from dlo_fn.runtime.host_store import HostStore, build_host_store
from dlo_fn.runtime.mesh import Mesh, ShardGroup, shard_group
from dlo_fn.runtime.options import OffloadOptions

__all__ = ["MODES", "OffloadOptions", "Offloaded", "offload"]

log = logging.getLogger(__name__)


@dataclass
class Offloaded:
    """The wrapped model and its runtime pieces (``executor``/``store``/``layout`` are None when resident)."""

    model: nn.Module
    ctx: DistContext
    options: OffloadOptions
    spec: ModelSpec
    layout: ModelLayout | None
    store: HostStore | None
    executor: Executor | None
    shards: ShardGroup | None = None  # the ranks that split the block weights (None when resident)
    release: ReleaseReport | None = None  # how the checkpoint mapping was let go (None: resident, or kept)
    # Where options were "auto": the policy's choice (dlo_fn.cost.auto.AutoChoice: the chosen and runner-up rows with
    # their predicted step times, the fields chosen and where the inputs came from); None when none was.
    auto: Any = None
    timings: dict | None = None  # seconds of each phase of offload (module docstring); None when resident
    resident_blocks: tuple[int, ...] = ()  # blocks kept on the device under options.hbm_budget (plan.resident)
    # Under options.hbm_budget: the plan (plan.resident.ResidentChoice; its predicted pass where placed by compute)
    # and what it was placed by (runtime.budget.Placement; None: by bytes).
    budget: Any = None
    placement: Any = None

    @property
    def mode(self) -> str:
        return self.options.mode

    @contextlib.contextmanager
    def run(
        self,
        num_steps: int | None = None,
        requests_per_load: int | None = None,
        *,
        schedule: Schedule | None = None,
        compute: bool = True,
    ) -> Iterator[Any]:
        """An explicit run (see :meth:`Executor.run`: ``T`` x ``R`` on the executor's ring, default 1 x 1, or a
        handed ``schedule``); a no-op context when resident."""
        if self.executor is None:
            yield None
            return
        with self.executor.run(num_steps, requests_per_load, schedule=schedule, compute=compute) as followed:
            yield followed

    def idle(self, num_steps: int = 1) -> None:
        """Serve this rank's shards for a run without computing (partial waves); nothing when resident or
        rank-local (no collectives to keep in step)."""
        if self.executor is not None and self.executor.mode == "allgather":
            self.executor.idle(num_steps)

    def synchronize(self) -> None:
        if self.executor is not None:
            self.executor.synchronize()
        else:
            self.ctx.platform.synchronize()

    @property
    def device_weight_bytes(self) -> int:
        """Device bytes held for weights (``hbm_budget`` bounds them): the ring's buffers, the non-block tensors,
        the resident blocks, the device-stored shards; the whole model when resident."""
        if self.executor is None:
            return self.spec.total_bytes
        kept = sum(self.spec.blocks[b].nbytes for b in self.resident_blocks)
        return self.executor.device_weight_bytes + self.spec.resident_bytes + kept + self.store.device_bytes

    @property
    def pinned_host_bytes(self) -> int:
        return self.store.arena_bytes if self.store is not None and self.store.pinned else 0

    def describe(self) -> str:
        """What ``offload`` set up and, for ``auto`` fields, why (chosen and runner-up with their predicted step
        times), in words: ``print(offloaded)`` shows it, no logging set-up needed."""
        from dlo_fn.io.memstat import format_bytes

        name = self.spec.name
        if self.executor is None:
            return (
                f"{name}: resident, {self.spec.num_blocks} blocks ({format_bytes(self.spec.total_block_bytes)}) "
                f"on {self.ctx.platform.device}"
            )
        ex = self.executor
        if self.mode == "allgather":
            where = f"each block split over {self.shards.size} rank(s) ({self.shards.name}) and all-gathered"
            landing = f", {ex.num_landing} landing buffers" if ex.num_landing else ""
        else:
            where, landing = "whole blocks copied from this rank's host store", ""
        text = (
            f"{name}: {self.mode}, {self.spec.num_blocks} blocks, {where}; {ex.num_slots} device slots{landing}, "
            f"load group {self.options.load_group}; host store {format_bytes(self.store.arena_bytes)} "
            f"({self.store.how}), device weights {format_bytes(self.device_weight_bytes)} on "
            f"{self.ctx.platform.device}"
        )
        text += f"; {len(self.resident_blocks)} blocks resident (hbm_budget)" if self.resident_blocks else ""
        stored = len(self.store.device_blocks)
        text += f"; {stored} blocks' stored shards on the device (hbm_budget)" if stored else ""
        text += f", predicted pass {self.budget.pass_s:.4g} s" if getattr(self.budget, "pass_s", None) else ""
        how = f"auto: {self.auto.why()}" if self.auto is not None else "set by the caller (no auto field)"
        return f"{text}\n{how}"

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        return f"Offloaded({self.describe()})"


def _block_lists(model: nn.Module, paths: Sequence[str]) -> list[tuple[nn.Module, int]]:
    out = []
    for path in paths:
        lst = model.get_submodule(path)
        out.extend((lst, i) for i in range(len(lst)))
    return out


def _plugins(options: OffloadOptions, platform: Any) -> dict[str, Any]:
    """The executor's plug-ins that ``options`` asks for (the one place the plug-in package is imported)."""
    if not options.graph and options.quantization is None:
        return {}
    from dlo_fn.runtime.cuda import dequantizer_for, plugins_for

    return {"plugin": plugins_for(options, platform), "dequantizer": dequantizer_for(options, platform)}


def _filler(options: OffloadOptions, ctx: DistContext) -> Any:
    """The host store's fill plug-in ``options.host_fill`` asks for on this platform, or None (the core's)."""
    if options.host_fill == "plain" or (options.host_fill == "auto" and ctx.platform.kind != "cuda"):
        return None
    from dlo_fn.runtime.cuda.host_fill import ParallelFill

    return ParallelFill(local_ranks=local_ranks(ctx))


def offload(
    model: nn.Module,
    block_paths: str | Sequence[str] | None = None,
    ctx: DistContext | None = None,
    options: OffloadOptions | None = None,
    *,
    mesh: Mesh | None = None,
    **overrides: Any,
) -> Offloaded:
    """Prepare ``model`` (in place) for offloaded execution on ``ctx``'s device; see the module docstring.
    ``mesh`` (:func:`dlo_fn.runtime.mesh.build_mesh`) is needed for the "dp" / "sp" shard groups; without one
    the world is a (world, 1) mesh.

    ``options`` fields may also be given as keyword arguments (``offload(m, "blocks", ctx, mode="rank-local")``).
    ``block_paths=None``: the model's own block lists (:func:`dlo_fn.io.diffusers_load.block_paths_for`:
    the common diffusers DiTs, or the one top-level list of identical blocks): ``offload(transformer, ctx=ctx)``.
    ``mode`` / ``num_slots`` / ``load_group`` = ``"auto"``: the policy chooses them first, for ``workload=`` (a
    Workload) or from one call of the model on ``example=`` (a dict of keyword arguments or a tuple of positional
    ones) timed through a plain probe (:func:`dlo_fn.runtime.auto.resolve`); ``offload`` then builds from the
    concrete options, and ``Offloaded.auto`` holds the choice and the runner-up. With ``hbm_budget=``, ``example=``
    or ``workload=`` give the plan each block's compute: it places the resident blocks by compute and predicts the
    pass (``Offloaded.budget``; with FP8 or ``1/W`` shards it may also keep streamed blocks' shards on the device),
    and ``num_slots="auto"`` lets it choose the slots (:mod:`dlo_fn.runtime.budget`);
    ``placement=`` (a :class:`~dlo_fn.runtime.budget.Placement`) gives that compute directly, as ``generate --mode
    auto`` does with the policy's row.
    """
    t0 = time.perf_counter()
    if ctx is None:
        raise TypeError("offload() needs ctx= (dlo_fn.runtime.dist.init_distributed())")
    if block_paths is None:
        from dlo_fn.io.diffusers_load import block_paths_for

        block_paths = block_paths_for(model)
    options = options or OffloadOptions()
    fields = [f for f in ("mode", "num_slots", "load_group") if overrides.get(f) == "auto"]
    workload, example = overrides.pop("workload", None), overrides.pop("example", None)
    given = overrides.pop("placement", None)  # a runtime.budget.Placement the caller's policy placed by
    if overrides:
        options = dataclasses.replace(options, **{k: v for k, v in overrides.items() if k not in fields})
    told = workload is not None or example is not None
    slots = None
    if options.hbm_budget is not None and told and fields == ["num_slots"]:  # the budget's plan chooses the slots
        fields.remove("num_slots")
        slots = "auto"
    if told and not fields and options.hbm_budget is None:
        raise ValueError(
            "offload(workload=... / example=...) describe the requests for the policy: pass them with mode, "
            "num_slots or load_group = 'auto', or with hbm_budget= (to place the resident blocks by compute)"
        )
    _check_stored(model, options)
    paths = normalize_block_paths(block_paths)
    spec = spec_from_module(model, paths, name=type(model).__name__)
    if ctx.platform.device.type == "cpu":  # the resident model computes from these very tensors: keep their alignment
        spec = with_address_residues(spec, model)
    choice = None
    if fields:  # the policy chooses them first (dlo_fn.runtime.auto); the build sees concrete options only
        from dlo_fn.runtime.auto import resolve

        options, choice = resolve(
            model, _block_lists(model, paths), spec, ctx, options, fields, workload, mesh, example
        )
    placement = given
    placed = getattr(getattr(choice, "chosen", None), "placed_by", None)
    if placement is not None:
        pass
    elif placed is not None:  # the policy chose under the budget: its compute places the blocks, its row's set
        from dlo_fn.runtime.budget import Placement

        placement = Placement.from_policy(placed)
    elif options.hbm_budget is not None and told:  # each block's compute, for the budget's plan (runtime.budget)
        from dlo_fn.runtime.budget import block_compute

        blocks = [lst[i] for lst, i in _block_lists(model, paths)]
        placement = block_compute(model, blocks, spec, ctx, workload, example)
    return _build(model, paths, spec, ctx, options, mesh, t0, choice, placement, slots)


def _streamed_indices(spec: ModelSpec, resident: tuple[int, ...], blocks: tuple[int, ...]) -> frozenset[int]:
    """Blocks ``blocks`` of ``spec`` numbered among its streamed ones (those not in ``resident``)."""
    streamed = [b for b in range(spec.num_blocks) if b not in set(resident)]
    return frozenset(streamed.index(b) for b in blocks)


class _Laps:
    """Seconds between marks, by name (``Offloaded.timings``)."""

    def __init__(self, t0: float | None) -> None:
        self.t0 = self.last = time.perf_counter() if t0 is None else t0
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now

    def done(self, **extra: float) -> dict:
        return {**self.seconds, **extra, "total_s": self.last - self.t0}


def _check_stored(model: nn.Module, options: OffloadOptions) -> None:
    """A model loaded from a quantised checkpoint (:mod:`dlo_fn.io.quantized`) holds FP8 block weights only:
    it offloads with ``quantization="fp8"`` and the exclude list it was written with, never resident."""
    fmt = getattr(stored_weights(model), "format", None)
    if fmt is None:
        return
    q = options.quantization
    if q is None or q.format != fmt.quantization or options.mode == "resident":
        raise ValueError(
            f"{type(model).__name__} comes from a quantised checkpoint (FP8 block weights, no "
            f"{fmt.torch_dtype} ones): offload it with quantization={fmt.quantization!r} (CLI: "
            f"--quantization {fmt.quantization}) in an offloaded mode, or dequantise it first "
            "(dlo_fn.runtime.quant.fake_quantize(model)) to run it resident"
        )
    if q.exclude not in ((), fmt.exclude):
        raise ValueError(
            f"quantization exclude {list(q.exclude)}: the checkpoint was quantised with "
            f"exclude {list(fmt.exclude)}; pass that (or nothing), or quantize the source again"
        )


def _stored(model: nn.Module, options: OffloadOptions, platform: Any) -> Any:
    """What a quantised host store reads its blocks from, one interface either way: a quantised checkpoint's stored
    weights (:class:`dlo_fn.io.quantized.StoredWeights`, checked against the options by :func:`_check_stored`), or
    the model quantised as it is offloaded (:class:`dlo_fn.runtime.quant.QuantizeOnLoad`); None: not quantised."""
    stored = stored_weights(model)
    if stored is None and options.quantization is not None:
        from dlo_fn.runtime.quant import QuantizeOnLoad

        device = platform.device if platform.is_accelerator else None  # quantise where the rows go: the same bits
        stored = QuantizeOnLoad(options.quantization.exclude, device)
    return stored


def _build(
    model: nn.Module,
    paths: tuple[str, ...],
    spec: ModelSpec,
    ctx: DistContext,
    options: OffloadOptions,
    mesh: Mesh | None,
    started_s: float | None = None,
    auto: Any = None,
    placement: Any = None,
    slots: str | None = None,
) -> Offloaded:
    platform = ctx.platform
    lap = _Laps(started_s)
    if options.mode == "resident":
        model.to(platform.device)
        return Offloaded(model, ctx, options, spec, None, None, None, auto=auto)
    shards = (
        shard_group(ctx, mesh, options.shard_group) if options.mode == "allgather" else ShardGroup("none", None, 1, 0)
    )
    num_shards = shards.size
    stored, exclude = _stored(model, options, platform), ()
    if stored is not None:  # the FP8 modules load only here
        from dlo_fn.plan.quant import quantized_tensors
        from dlo_fn.runtime.quant import fp32_modules

        exclude = stored.exclude + fp32_modules(model)
    full, resident, chosen = spec, (), None
    if options.hbm_budget is not None:  # the plan keeps what fits resident, the rest streams (runtime.budget)
        from dlo_fn.runtime import budget

        chosen, streamed = budget.resident_blocks(
            model, spec, options, num_shards, exclude, placement, ctx.is_main, slots
        )
        resident, options = chosen.resident, dataclasses.replace(options, num_slots=chosen.num_slots)
        if streamed is None:  # the whole model fits: nothing streams, nothing is pinned
            out = _build(model, paths, full, ctx, dataclasses.replace(options, mode="resident"), mesh, started_s, auto)
            out.resident_blocks = budget.quantize_resident(model, full, resident, exclude, options)
            out.budget, out.placement = chosen, placement
            return out
        spec = streamed
    group = layout_load_group(spec.num_blocks, num_shards, options.load_group)
    if group != options.load_group and num_shards > 1 and ctx.is_main:
        log.info(
            "per-block shard layout: %s; the group's %d all-gathers go in one launch",
            grouped_layout_problem(spec.num_blocks, options.load_group),
            options.load_group,
        )
    if stored is not None:
        stored.check(set(quantized_tensors(spec, exclude)), paths)  # what the layout stores as FP8
    # options.quantization is set exactly where stored is (a quantised checkpoint needs it: _check_stored)
    layout = model_layout(spec, num_shards, options.alignment_bytes, group, options.quantization, exclude)
    lap("describe_s")
    what = f"shard layout digest ({options.mode}" + (f", shard group {shards.name})" if num_shards > 1 else ")")
    check_same_across_ranks(layout.digest, ctx.group, platform, what)
    lap("digest_s")
    # Before the blocks drop their views: which checkpoint files back this model.
    files = tuple(sorted(set(viewed_files(model)) | set(stored.files if stored is not None else ())))
    entries = [e for b, e in enumerate(_block_lists(model, paths)) if b not in resident]
    states = [block_state(lst[i]) for lst, i in entries]
    source = options.rank_local_source if options.mode == "rank-local" else "pinned"
    pinned, on_device = None, _streamed_indices(full, resident, getattr(chosen, "device_stored", ()))
    if options.pinned_budget_bytes is not None and source == "pinned":
        from dlo_fn.cost.host_budget import pinned_prefix  # the host-budget model, only when a budget is set

        host = tuple(sh.shard_bytes for b, sh in enumerate(layout.shards) if b not in on_device)
        pinned = pinned_prefix(host, options.pinned_budget_bytes)
    tensors = [t for t, _ in states]
    if stored is not None:  # the pieces are read from the stored weights (FP8 and scales), this rank's only
        rank = shards.rank if num_shards > 1 else 0
        tensors = [stored.block(sh.block, t, sh.pieces[rank]) for t, sh in zip(tensors, layout.shards)]
    store = build_host_store(
        layout,
        shards.rank,
        tensors,
        platform,
        source=source,
        progress=options.progress and ctx.is_main,
        pinned_blocks=pinned,
        fill=_filler(options, ctx),
        device_blocks=on_device,
    )
    lap("store_s")
    aliases = [a for _, a in states]
    del states, tensors, stored  # the mmap views stay referenced (by the store) only for the "mmap" source
    drop_stored(model)
    blocks = []
    for lst, i in entries:
        block = lst[i]
        strip_block(block, platform.device)
        blocks.append(block)
    executor = Executor(
        platform,
        layout,
        store,
        blocks,
        aliases,
        options,
        group=shards.group,
        rank=ctx.rank,
        **_plugins(options, platform),
    )
    for b, (lst, i) in enumerate(entries):
        lst[i] = BlockProxy(executor.compute, b, blocks[b])
    lap("executor_s")
    model.to(platform.device)
    if resident:
        budget.quantize_resident(model, full, resident, exclude, options)
    lap("to_device_s")
    # The store holds its copies now; a mapping still open would keep every page this rank read charged to it.
    streams = bool(store.pageable)
    release = None if source == "mmap" else release_mapped_tensors(model, files, warn=not streams)
    if release is not None and streams:
        # Partly pinned: the mapping stays for the streamed blocks; drop the pages already copied out.
        release_copied_pages(store.copied_ranges + release.source_ranges, files)
    lap("release_s")
    timings = lap.done(warm_up_s=executor.warm_up_s)
    timings["executor_s"] -= executor.warm_up_s
    log.debug("offload phases: %s", timings)
    done = Offloaded(
        model, ctx, options, full, layout, store, executor, shards, release, auto, timings, resident, chosen, placement
    )
    extras = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in options.describe() if k != "load_group")
    log.info("offload %s; %s; ready in %.2f s", done.describe().splitlines()[0], extras, timings["total_s"])
    return done
