"""`generate --host-budget BYTES`: turn a host budget into this rank's pinned budget, or refuse at start-up.

The budget is what the ranks on this host may hold together (page cache not counted); the process constant
``c`` is this rank's USS now, before any weight page is read (:mod:`dlo_fn.cost.host_budget`)."""

from __future__ import annotations

import dataclasses
import logging
import os

log = logging.getLogger(__name__)


def apply_host_budget(args, ctx, options):
    """``options`` with ``pinned_budget_bytes`` set from ``args.host_budget``; SystemExit (one line) if the
    budget cannot hold the ranks of this host even with every block streamed."""
    if getattr(args, "host_budget", None) is None:
        return options
    from dlo_fn.cost.host_budget import host_budget
    from dlo_fn.io.memstat import process_memory
    from dlo_fn.io.sources import spec_for
    from dlo_fn.plan.sizes import ModelSizes, parse_bytes

    try:
        budget = parse_bytes(args.host_budget)
    except ValueError as exc:
        raise SystemExit(f"generate: --host-budget: {exc}") from None
    if options.mode not in ("allgather", "rank-local") or (
        options.mode == "rank-local" and options.rank_local_source == "mmap"
    ):
        raise SystemExit("generate: --host-budget pins shards: use it with --mode allgather or rank-local (pinned)")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    sizes = ModelSizes.from_spec(spec_for(args.checkpoint), options.alignment_bytes)
    plan = host_budget(
        sizes,
        local_ranks,
        budget,
        options.mode,
        "cpu" if ctx.platform.kind == "cpu" else "cuda",
        constant_bytes=_largest_over_ranks(process_memory().uss_bytes, ctx),
        num_slots=options.num_slots,
        num_landing=options.num_landing or 2,
        alignment_bytes=options.alignment_bytes,
    )
    if plan.status == "refused":
        raise SystemExit(f"generate: {plan.message()}")
    if ctx.is_main:
        log.warning("%s%s", plan.message(), step_cost_note(plan))
    return dataclasses.replace(options, pinned_budget_bytes=plan.pinnable_bytes)


def _largest_over_ranks(value: int, ctx) -> int:
    """The largest ``value`` over the ranks, so every rank takes the same decision (none refuses alone)."""
    if ctx.group is None:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=ctx.platform.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return int(t.item())


def step_cost_note(plan) -> str:
    """The planner's step-time cost of the streamed part, from the H200 ceilings measured here (pinned and
    pageable H2D, dlo_fn.cost.ceilings): an upper bound where the pass is H2D-bound."""
    if not plan.streamed_bytes or plan.status == "refused":
        return ""
    from dlo_fn.cost.ceilings import H200_PAGEABLE_H2D_RANGE_BYTES_PER_S, H200_PINNED_H2D_BYTES_PER_S

    lo, hi = (
        plan.extra_pass_s(H200_PINNED_H2D_BYTES_PER_S, bw) for bw in reversed(H200_PAGEABLE_H2D_RANGE_BYTES_PER_S)
    )
    return (
        f"; streaming costs up to {lo * 1e3:.1f}-{hi * 1e3:.1f} ms more H2D per pass over the blocks (H200: "
        f"pinned {H200_PINNED_H2D_BYTES_PER_S / 1e9:.1f} GB/s, pageable "
        f"{H200_PAGEABLE_H2D_RANGE_BYTES_PER_S[0] / 1e9:.1f}-{H200_PAGEABLE_H2D_RANGE_BYTES_PER_S[1] / 1e9:.1f} GB/s)"
    )
