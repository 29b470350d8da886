"""`generate --mode auto / --slots auto / --sp auto / --load-group auto` (issues 14, 16): probe at start-up, let the
policy choose, log why.

:func:`choose_auto` probes this machine for the first request (:mod:`dlo_fn.serve.probe`) and decides as
``offload(..., mode="auto")`` does (:func:`dlo_fn.runtime.auto.decide`: rank 0's choice goes to every rank, logged
with its runner-up), and ``<out>/auto_policy.json`` keeps the measured topology; after the serve
:func:`log_predicted_vs_measured` sets the predicted step beside the measured one.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib

from dlo_fn.cli.generate_args import mode_from_args, slots_from_args, submissions_from_args

# Logged under the command's module name, as before this module was split out of it (not a literal: a module
# name in a string reads as an import to tests/test_layering.py, and generate imports this module).
log = logging.getLogger(f"{__package__}.generate")


def is_auto(args: argparse.Namespace) -> bool:
    return (
        args.mode == "auto"
        or args.sp == "auto"
        or ("auto" in (args.slots, args.load_group) and mode_from_args(args) != "resident")
    )


def auto_sps(args: argparse.Namespace, world_size: int, num_heads: int | None) -> tuple[int, ...]:
    """The sp sizes the policy may choose: ``--sp`` itself, or (``auto``) the divisors of the ranks that the
    heads allow (an sp > 1 mesh is served as ``--serving`` says: continuous per replica, or strict waves)."""
    from dlo_fn.cost.auto import sp_choices

    return (args.sp,) if args.sp != "auto" else sp_choices(world_size, num_heads)


def choose_auto(args: argparse.Namespace, model, ctx):
    """Probe this machine for the first request, ask the policy (rank 0 decides for every rank), log the choice
    with the runner-up and the predicted step; returns the chosen :class:`~dlo_fn.cost.policy.PlanRow`."""
    import types

    from dlo_fn.plan.sizes import parse_bytes
    from dlo_fn.runtime.auto import decide
    from dlo_fn.serve.probe import probe

    request = next(s.request for s in submissions_from_args(args) if s.request is not None)
    found = probe(model, ctx, request)
    fields = tuple(
        f
        for f, given in (("mode", args.mode), ("num_slots", args.slots), ("load_group", args.load_group))
        if given == "auto"
    )
    fixed = types.SimpleNamespace(
        mode=mode_from_args(args) if args.mode != "auto" else None,
        num_slots=slots_from_args(args, None),
        load_group=args.load_group,
        shard_group="world",
        hbm_budget=parse_bytes(args.hbm_budget) if getattr(args, "hbm_budget", None) else None,  # checked by then
    )
    sps = auto_sps(args, ctx.world_size, getattr(model.config, "num_heads", None))
    choice = decide(
        found.topology,
        found.model,
        found.workload,
        fields,
        fixed,
        ctx,
        sps=sps,
        requests_per_rank=args.requests_per_rank,
    )
    if ctx.is_main:
        _write_probe(args, found, sps)
    return choice.chosen


def _write_probe(args: argparse.Namespace, found, sps) -> None:
    """``<out>/auto_policy.json``: the measured topology, model and workload, so ``python -m dlo_fn policy
    --topology`` that file prints the table this choice was made from."""
    from dlo_fn.cost.topology_file import probe_to_dict

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "auto_policy.json"
    path.write_text(json.dumps(probe_to_dict(found.topology, found.model, found.workload, sps), indent=1))
    from dlo_fn.cost.auto import AUTO_LOAD_GROUPS, auto_slots

    groups = AUTO_LOAD_GROUPS if args.load_group == "auto" else (args.load_group,)
    slots, groups = ",".join(map(str, auto_slots(groups))), ",".join(map(str, groups))
    log.info(
        "auto: measured topology in %s (python -m dlo_fn policy --topology %s --slots %s --load-groups %s "
        "prints its table)",
        path,
        path,
        slots,
        groups,
    )


def log_predicted_vs_measured(report, chosen) -> None:
    rows = [(f"wave {w.wave_id}", w.latency_s / w.num_steps) for w in report.waves[:2] if w.num_steps]
    rows = rows or [(f"ring step {s.step}", s.end_s - s.start_s) for s in report.steps[1:3]]  # continuous
    for what, measured in rows:
        log.info(
            "auto: %s: measured %.1f ms per step, predicted %.1f ms (%+.1f%%)",
            what,
            1e3 * measured,
            1e3 * chosen.step_s,
            100 * (measured / chosen.step_s - 1),
        )
