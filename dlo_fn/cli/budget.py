"""`generate --host-budget BYTES`: turn a host budget into this rank's pinned budget, or refuse at start-up.

The budget is what the ranks on this host may hold together (page cache not counted); the process constant
``c`` is this rank's USS now, before any weight page is read (:mod:`dlo_fn.plan.host_budget`)."""

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
    from dlo_fn.plan.host_budget import host_budget
    from dlo_fn.plan.sizes import ModelSizes, parse_bytes
    from dlo_fn.runtime.memstat import process_memory
    from dlo_fn.runtime.sources import spec_for

    try:
        budget = parse_bytes(args.host_budget)
    except ValueError as exc:
        raise SystemExit(f"generate: --host-budget: {exc}") from None
    if options.mode not in ("allgather", "rank-local") or (options.mode == "rank-local"
                                                            and options.rank_local_source == "mmap"):
        raise SystemExit("generate: --host-budget pins shards: use it with --mode allgather or rank-local (pinned)")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    sizes = ModelSizes.from_spec(spec_for(args.checkpoint), options.alignment_bytes)
    plan = host_budget(sizes, local_ranks, budget, options.mode, "cpu" if ctx.platform.kind == "cpu" else "cuda",
                       constant_bytes=_largest_over_ranks(process_memory().uss_bytes, ctx), num_slots=options.num_slots,
                       num_landing=options.num_landing or 2, alignment_bytes=options.alignment_bytes)
    if plan.status == "refused":
        raise SystemExit(f"generate: {plan.message()}")
    if ctx.is_main:
        log.warning("%s", plan.message())
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
