"""`python -m dlo_fn memory`: host and HBM accounting for any model size and DP degree (size a server)."""

from __future__ import annotations

import argparse
import json

from dlo_fn.cli import HelpFormatter, UsageError
from dlo_fn.cost.mesh import DEFAULT_SHARD_GROUP, SHARD_GROUPS
from dlo_fn.plan.schedule import DEFAULT_NUM_LANDING

TERMS_HELP = """\
terms (N = --dp x --sp ranks, W = the shard group's ranks (N by default); M = --model-bytes; n_b = block bytes;
A = --alignment):
  host: cold start     what the cgroup sees while N ranks load one checkpoint
    page cache           M: the file, read once and shared by every rank (mmap) or read by each copy
    private copies       N x M with --loading private-copy (param.data.copy_), 0 with mmap views
    framework            N x c: Python + torch + comm library per rank (c calibrated: 3.5 GB, Figure 6)
    transient            --transient-bytes (load-time scratch; 0 by default)
    cgroup peak          the sum of the four terms above
    per-rank HWM         the weight bytes a rank touches (its shards with mmap + allgather, else M) + c
  host: steady state   once every rank holds its weight arena
    pinned per rank      allgather: sum_b align_up(ceil(n_b / W), A) (~ M / W); rank-local: every block
                         (a private pinned copy); rank-local-mmap: 0 (pageable, from the page cache)
    cgroup-invisible     ascend: all pinned bytes (pinned through the driver, /dev/davinci_manager, in kernel
                         DMA memory the memory cgroup does not charge); cuda: 0
    cgroup-visible       page cache + framework + pinned - invisible
    physical RAM         page cache + framework + pinned: what the server must really hold
  hbm per card
    slots                S x the largest block padded to W equal shards (independent of depth)
    landing buffers      L x the largest shard (allgather only)
    resident tensors     --resident-bytes: tensors outside the block lists, kept on every card
    resident blocks      --hbm-budget: the blocks offload keeps resident within the budget, whole on every
                         card in the compute dtype (allgather mode too); slots, landing buffers and the pinned
                         host shards are then the streamed blocks' only (dlo_fn.cost.hbm_budget)
    device weights       slots + landing + resident tensors + resident blocks (Offloaded.device_weight_bytes)
    device context       runtime context + comm buffers + other modules (calibrated: Nano DP4 idle HBM)
    idle / peak          idle = slots + landing + resident + context; peak adds --activation-bytes and
                         --communication-bytes, which depend on the workload: measure them once

  mesh: per rank (with --sp > 1, --shard-group dp|sp, or --tokens): shard / pinned per rank, HBM slots,
    landing, resident, context, and with --model NAME --tokens L the Ulysses SP activations and all-to-all
    buffers of the block's peak phase (dlo_fn.cost.sp_memory; ~ 46 B ceil(L / S) D bytes at sp > 1)
  host per rank        the rank's terms (dlo_fn.cost.rank_memory) and its RSS / USS / PSS / VmHWM after load,
                       while filling, after offload and while generating; c = --framework-bytes-per-rank
                       (measure yours: python -m benchmarks bench load --phases)

sizes accept units: 124GB, 33e9, 1.5TiB, 512MiB (GB = 1e9 bytes, GiB = 2^30).
examples:
  python -m dlo_fn memory --model-bytes 124GB --dp 4 --num-blocks 128 --platform ascend
  python -m dlo_fn memory --model cosmos3-nano --dp 2 --activation-bytes 11.6GB --json
  python -m dlo_fn memory --model cosmos3-super --dp 1 --sp 4 --tokens 75600
  python -m dlo_fn memory --model bench --dp 1 --mode rank-local --hbm-budget 8GB --quantization fp8
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "memory",
        help="host and HBM accounting for any model size and DP degree",
        description=(
            "Host memory (cold start, pinned weights, cgroup-visible vs physical RAM per platform) and HBM per "
            "card for Distributed Layerwise Offload, term by term, with the formula of each term. Give the "
            "model as --model-bytes plus its block size (--num-blocks or --max-block-bytes), or as --model "
            "(a named config or a checkpoint path, read from headers only)."
        ),
        epilog=TERMS_HELP,
        formatter_class=HelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-bytes", metavar="SIZE", help="checkpoint bytes M (blocks + resident), e.g. 124GB")
    src.add_argument(
        "--model",
        metavar="NAME_OR_CHECKPOINT",
        help="named config (e.g. cosmos3-super) or checkpoint path: exact block sizes",
    )
    p.add_argument(
        "--dp",
        type=int,
        required=True,
        metavar="N",
        help="DP ranks (replicas) on the host; with --sp S the host runs N x S ranks",
    )
    p.add_argument("--sp", type=int, default=1, metavar="S", help="sequence-parallel ranks per replica (Ulysses)")
    p.add_argument(
        "--shard-group",
        choices=SHARD_GROUPS,
        default=DEFAULT_SHARD_GROUP,
        help="ranks that share one set of shards: world (all dp x sp), dp, or sp",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="with --model (a named config): add the per-rank SP activation and all-to-all terms at "
        "this many tokens per sequence (75600 = 720p 10 s)",
    )
    p.add_argument("--batch", type=int, default=1, help="sequences per pass for the SP terms (2 with CFG)")
    p.add_argument(
        "--platform",
        choices=("cuda", "ascend"),
        default="cuda",
        help="cuda: pinned memory is charged to the cgroup; ascend: it is not (default cuda)",
    )
    blocks = p.add_mutually_exclusive_group()
    blocks.add_argument("--num-blocks", type=int, metavar="K", help="K equal blocks (with --model-bytes)")
    blocks.add_argument("--max-block-bytes", metavar="SIZE", help="largest block (with --model-bytes)")
    p.add_argument(
        "--resident-bytes",
        default="0",
        metavar="SIZE",
        help="bytes outside the blocks, kept on every card (with --model-bytes; default 0)",
    )
    p.add_argument(
        "--mode",
        choices=("allgather", "rank-local", "rank-local-mmap"),
        default="allgather",
        help="host weights: shards + AllGather, a full pinned copy per rank, or shared mmap",
    )
    p.add_argument(
        "--loading",
        choices=("mmap", "private-copy"),
        default="mmap",
        help="cold start: meta init + mmap views, or a private copy per rank",
    )
    p.add_argument("--slots", type=int, default=2, help="device slots (2 = the published double buffer)")
    p.add_argument(
        "--landing", type=int, default=DEFAULT_NUM_LANDING, help="landing buffers for the local shard (allgather)"
    )
    p.add_argument("--activation-bytes", default="0", metavar="SIZE", help="activations per card (workload)")
    p.add_argument(
        "--communication-bytes", default="0", metavar="SIZE", help="communication buffers per card (workload)"
    )
    p.add_argument("--transient-bytes", default="0", metavar="SIZE", help="load-time transient host bytes")
    p.add_argument(
        "--framework-bytes-per-rank",
        default=None,
        metavar="SIZE",
        help="host bytes per rank without weights (default: the calibrated 3.5 GB)",
    )
    p.add_argument(
        "--device-context-bytes",
        default=None,
        metavar="SIZE",
        help="device bytes besides weights and workload (default: the calibrated Ascend value)",
    )
    p.add_argument("--host-ram-bytes", default=None, metavar="SIZE", help="say whether physical RAM fits")
    p.add_argument(
        "--host-budget",
        default=None,
        metavar="SIZE",
        help="host bytes the --dp ranks may hold together: how many shards fit pinned, the rest streamed "
        "(dlo_fn.cost.host_budget), or the bytes needed and the largest dp that fits",
    )
    p.add_argument("--hbm-bytes", default=None, metavar="SIZE", help="say whether the HBM peak fits")
    p.add_argument(
        "--hbm-budget",
        default=None,
        metavar="SIZE",
        help="device weight bytes per card (e.g. 16GB): the blocks kept resident within it, the rest streamed; "
        "what a larger budget buys",
    )
    p.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="FP8 shards (with --model): stored bytes pinned and streamed, staging buffers on the card",
    )
    p.add_argument("--alignment", type=int, default=256, help="per-tensor alignment in bytes (power of two)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


# The rank model's device for each --platform: on Ascend the pinned arena is driver memory, in no process's RSS.
DEVICE_OF_PLATFORM = {"cuda": "cuda", "ascend": "npu"}


def one_high_water_mark(rows: tuple, per_rank: dict) -> tuple:
    """The cold-start row "per-rank high-water mark" with the value of the per-rank model printed below it
    (:mod:`dlo_fn.cost.rank_memory`, the largest VmHWM of its phases), so the command states one number. The
    cold-start model (:func:`dlo_fn.cost.memory.cold_start`, the published paper's) counts the pages a rank
    touches once; the rank model also holds the filled arena beside the file pages it was copied from (and, on
    Ascend, leaves the driver's pinned pages out), as measured (``bench load --phases``)."""
    import dataclasses

    hwm = max(p["hwm_bytes"] for p in per_rank["phases"])
    return tuple(
        dataclasses.replace(r, formula="max VmHWM of the phases in 'host per rank' below", value_bytes=hwm)
        if r.item == "per-rank high-water mark"
        else r
        for r in rows
    )


def _sizes(args: argparse.Namespace, parse_bytes):
    from dlo_fn.cost.memory import ModelSizes

    if args.model:
        if args.num_blocks is not None or args.max_block_bytes or parse_bytes(args.resident_bytes):
            raise UsageError(
                "--model gives exact block sizes: leave out --num-blocks/--max-block-bytes/--resident-bytes"
            )
        from dlo_fn.io.sources import spec_for

        try:
            spec = spec_for(args.model)
        except (ValueError, OSError) as exc:
            raise UsageError(f"--model {args.model}: {exc}") from None
        args.tensor_block_bytes = spec.block_bytes  # what a resident block holds (unpacked)
        return ModelSizes.from_spec(spec, args.alignment, quantization=args.quantization), True
    if args.quantization:
        raise UsageError("--quantization fp8 prices the stored tensors: give the model as --model NAME_OR_CHECKPOINT")
    total, resident = parse_bytes(args.model_bytes), parse_bytes(args.resident_bytes)
    name = f"{args.model_bytes} model"
    if resident >= total:
        raise UsageError(
            f"--resident-bytes {args.resident_bytes} is not below --model-bytes {args.model_bytes}: "
            f"the blocks need the rest"
        )
    if args.num_blocks is not None:
        if args.num_blocks < 1:
            raise UsageError(f"--num-blocks {args.num_blocks}: give >= 1 blocks")
        return ModelSizes.uniform(name, total, args.num_blocks, resident, "--num-blocks"), True
    if args.max_block_bytes:
        block = parse_bytes(args.max_block_bytes)
        if not 0 < block <= total - resident:
            raise UsageError(
                f"--max-block-bytes {args.max_block_bytes}: must be > 0 and at most the block bytes "
                f"(--model-bytes minus --resident-bytes = {total - resident:,} B)"
            )
        return ModelSizes.from_max_block(name, total, block, resident, "--max-block-bytes"), True
    # No block size: host terms treat the blocks as one buffer (shards = ceil(M / W)); HBM needs blocks.
    return ModelSizes(name, (total - resident,), resident, "no block size given"), False


def block_dims(name: str):
    """Block widths of a named config (None for a checkpoint: the SP terms are then left out)."""
    from dlo_fn.cost.sp_memory import BlockDims
    from dlo_fn.models import CONFIGS

    return BlockDims.from_config(CONFIGS[name]) if name in CONFIGS else None


def mesh_rows(args: argparse.Namespace, sizes, mesh, dims, context_bytes: int = 0) -> tuple:
    """The mesh rows (:func:`dlo_fn.cost.mesh_memory.mesh_memory_rows`) for the flags ``memory`` and ``plan``
    share (``--tokens``, ``--batch``, ``--slots``, ``--landing``, ``--alignment``)."""
    from dlo_fn.cost.mesh_memory import mesh_memory_rows

    return mesh_memory_rows(
        sizes,
        mesh,
        dims,
        args.tokens if dims else None,
        batch=args.batch,
        num_slots=args.slots,
        num_landing=args.landing,
        context_bytes=context_bytes,
        alignment_bytes=args.alignment,
    )


def _budget(args: argparse.Namespace, sizes, num_shards: int, with_hbm: bool, parse_bytes):
    """The resident blocks for ``--hbm-budget`` (None without it), as ``offload(hbm_budget=...)`` keeps them."""
    if args.hbm_budget is None:
        return None
    if not with_hbm:
        raise UsageError("--hbm-budget keeps whole blocks resident: give the block sizes (--num-blocks, ...)")
    from dlo_fn.cost.hbm_budget import resident_plan

    return resident_plan(
        sizes,
        parse_bytes(args.hbm_budget),
        num_shards=num_shards,
        mode="allgather" if args.mode == "allgather" else "rank-local",
        num_slots=args.slots,
        num_landing=args.landing,
        alignment_bytes=args.alignment,
        tensor_block_bytes=getattr(args, "tensor_block_bytes", ()),
        owner="--hbm-budget",
    )


def print_budget(budget, unit: str, scale: float) -> None:
    """The resident set of ``--hbm-budget`` and what the next larger budgets buy (bytes streamed per pass)."""
    c = budget.choice
    print(
        f"\nhbm budget {budget.budget_bytes / scale:.3f} {unit}: {len(c.resident)} of {budget.num_blocks} blocks "
        f"resident {list(c.resident)}, whole on every card in the compute dtype; device weights "
        f"{c.device_weight_bytes / scale:.3f} {unit}, {c.h2d_bytes_per_pass / scale:.3f} {unit} streamed per pass"
    )
    picks = budget.larger[:3] + budget.larger[-1:] if len(budget.larger) > 4 else budget.larger
    for p in picks:
        print(
            f"  a budget of {p.device_weight_bytes / scale:.3f} {unit} keeps {len(p.resident)} resident, streams "
            f"{p.h2d_bytes_per_pass / scale:.3f} {unit} per pass"
        )


def run(args: argparse.Namespace) -> int:
    from dlo_fn.cost import calibration
    from dlo_fn.cost.accounting import memory_accounting
    from dlo_fn.cost.memory import parse_bytes as parse
    from dlo_fn.cost.mesh import MeshPlan

    def parse_bytes(text):  # a size the user wrote: an unreadable one names its flag
        try:
            return parse(text)
        except ValueError as exc:
            flag = next((k for k, v in vars(args).items() if v == text and k.endswith("bytes")), "size")
            raise UsageError(f"--{flag.replace('_', '-')} {text}: {exc}") from None

    if args.dp < 1:
        raise UsageError(f"--dp {args.dp}: give >= 1 ranks")
    if args.slots < 1 or args.landing < 1:
        raise UsageError(f"--slots {args.slots} --landing {args.landing}: give >= 1 of each")
    if args.alignment < 1 or args.alignment & (args.alignment - 1):
        raise UsageError(f"--alignment {args.alignment}: must be a power of two (bytes), e.g. 256")
    for flag in (
        "model_bytes",
        "resident_bytes",
        "max_block_bytes",
        "activation_bytes",
        "communication_bytes",
        "transient_bytes",
        "framework_bytes_per_rank",
        "device_context_bytes",
        "host_ram_bytes",
        "hbm_bytes",
        "hbm_budget",
    ):
        text = getattr(args, flag)
        if text is not None and str(text).strip().startswith("-"):
            raise UsageError(f"--{flag.replace('_', '-')} {text}: a size cannot be negative")
    try:
        mesh = MeshPlan(args.dp, args.sp, args.shard_group)
        sizes, with_hbm = _sizes(args, parse_bytes)
        budget = _budget(args, sizes, mesh.num_shards, with_hbm, parse_bytes)
        dims = block_dims(args.model)
        # The two deployment constants: what the user measured, else the published deployment's calibration.
        framework = (
            calibration.FRAMEWORK_HOST_BYTES_PER_RANK
            if args.framework_bytes_per_rank is None
            else parse_bytes(args.framework_bytes_per_rank)
        )
        context = (
            calibration.DEVICE_CONTEXT_BYTES
            if args.device_context_bytes is None
            else parse_bytes(args.device_context_bytes)
        )
        rows = memory_accounting(
            sizes,
            mesh.world_size,
            num_shards=mesh.num_shards,
            platform=args.platform,
            mode=args.mode,
            loading=args.loading,
            num_slots=args.slots,
            num_landing=args.landing,
            activation_bytes=parse_bytes(args.activation_bytes),
            communication_bytes=parse_bytes(args.communication_bytes),
            transient_bytes=parse_bytes(args.transient_bytes),
            alignment_bytes=args.alignment,
            framework_bytes_per_rank=framework,
            context_bytes=context,
            with_hbm=with_hbm,
            budget=budget,
        )
        if with_hbm and (mesh.sp > 1 or mesh.shard_group != DEFAULT_SHARD_GROUP or args.tokens):
            rows += mesh_rows(args, sizes, mesh, dims, context)
    except UsageError:
        raise
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    verdicts = {}
    totals = {(r.section, r.item): r.value_bytes for r in rows}
    if args.host_ram_bytes:
        verdicts["fits_host_ram"] = totals[("host: steady state", "physical RAM")] <= parse_bytes(args.host_ram_bytes)
    if args.hbm_bytes and with_hbm:
        verdicts["fits_hbm"] = totals[("hbm per card", "peak")] <= parse_bytes(args.hbm_bytes)
    notes = [] if with_hbm else ["no block size given: HBM needs --num-blocks or --max-block-bytes"]
    if args.tokens and dims is None:
        notes.append("--tokens: the SP terms need the block widths of a named config (--model NAME)")
    from dlo_fn.cli.rank_rows import print_rank_memory, rank_memory_doc

    host_plan = None
    device = DEVICE_OF_PLATFORM[args.platform]
    # The host holds the streamed blocks only (every block resident: the per-rank rows of the whole model).
    held = sizes if budget is None or budget.streamed is None else budget.streamed
    if args.host_budget and args.mode != "rank-local-mmap":
        from dlo_fn.cost.host_budget import host_budget

        host_plan = host_budget(
            held,
            args.dp,
            parse_bytes(args.host_budget),
            args.mode,
            device,
            constant_bytes=framework,
            num_slots=args.slots,
            num_landing=args.landing,
            alignment_bytes=args.alignment,
        )
        verdicts["host_budget"] = host_plan.status
    per_rank = rank_memory_doc(
        held,
        args.dp,
        args.mode,
        device,
        framework,
        num_slots=args.slots,
        num_landing=args.landing,
        alignment_bytes=args.alignment,
    )
    rows = one_high_water_mark(rows, per_rank)
    if args.json:
        doc = {
            "model": sizes.name,
            "source": sizes.source,
            "num_blocks": sizes.num_blocks if with_hbm else None,
            "dp": args.dp,
            "sp": args.sp,
            "shard_group": args.shard_group,
            "num_shards": mesh.num_shards,
            "platform": args.platform,
            "mode": args.mode,
            "loading": args.loading,
            "constants": {"framework_bytes_per_rank": framework, "device_context_bytes": context},
            "rows": [r.to_dict() for r in rows],
            "rank_memory": per_rank,
            **({"hbm_budget": budget.to_dict()} if budget is not None else {}),
            **verdicts,
            "notes": notes,
        }
        print(json.dumps(doc, indent=2))
        return 0
    # One unit for the whole table, from the model's size (tiny's terms would all read 0.000 GB).
    unit, scale = next(
        (u, f) for u, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1)) if sizes.total_bytes >= f or f == 1
    )
    print(
        f"{sizes.name}: {sizes.total_bytes / scale:.3f} {unit}"
        + (f" in {sizes.num_blocks} blocks (max {sizes.max_block_bytes / scale:.3f} {unit})" if with_hbm else "")
        + f", dp {args.dp} x sp {args.sp} (W = {mesh.num_shards}, {args.shard_group}), {args.platform}, {args.mode},"
        f" {args.loading} loading"
    )
    section = None
    for r in rows:
        if r.section != section:
            section = r.section
            print(f"\n{section}\n  {'item':26s} {'formula':58s} {'value':>12s}")
        print(f"  {r.item:26s} {r.formula:58s} {r.value_bytes / scale:9.3f} {unit}")
    print_rank_memory(per_rank)
    if budget is not None:
        print_budget(budget, unit, scale)
    if host_plan is not None:
        from dlo_fn.cli.budget import step_cost_note

        print(f"\n{host_plan.message()}{step_cost_note(host_plan)}")
    if verdicts or notes:
        print()
    for k, v in verdicts.items():
        print(f"{k}: {v}")
    for note in notes:
        print(f"note: {note}")
    return 0
