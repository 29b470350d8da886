"""`python -m dlo_fn plan`: the shard layout and memory plan of a model, without loading any weights."""

from __future__ import annotations

import argparse
import json

from dlo_fn.cli import HelpFormatter, UsageError
from dlo_fn.cost.mesh import DEFAULT_SHARD_GROUP, SHARD_GROUPS
from dlo_fn.plan.lowering import default_num_landing, load_group_problem
from dlo_fn.plan.modes import OFFLOAD_MODES
from dlo_fn.plan.schedule import DEFAULT_NUM_LANDING

FIELD_HELP = """\
fields:
  num_blocks                  offloaded blocks (entries of the block list(s), in forward order)
  num_params                  stored elements (parameters + persistent buffers)
  total_bytes                 bytes the checkpoint stores (blocks + resident tensors)
  resident_bytes              tensors outside the block lists: kept on every device
  num_shards                  ranks in the shard group (W; --num-shards)
  max_padded_block_bytes      the largest block after packing and padding to W equal shards = one slot
  num_landing                 landing buffers (allgather at W > 1; default 2, 2G with --load-group G)
  load_group                  the shard layout's load group: G with --load-group G at W > 1 where G divides
                              the blocks (one all-gather per group of G blocks), else 1 (per-block shards)
  shard_bytes_per_rank        host bytes of one rank's shards: sum over blocks of align_up(ceil(n/W), A)
                              (allgather; a grouped layout pads each group's to its largest); 0 in rank-local
                              mode (no sharding)
  pinned_host_bytes_per_rank  the rank's exact-size pinned arena: its shards (allgather), or every block
                              unsharded (rank-local with a private pinned copy)
  hbm_weight_bytes            device bytes held for weights: slots x max_padded_block_bytes + landing
                              buffers x the largest shard (allgather); slots x max_padded_block_bytes
                              (rank-local).
                              Independent of the number of blocks.
  layout_digest               SHA-256 of the layout; ranks compare it at start-up
  hbm_budget (--hbm-budget)   the blocks kept resident (spread through the forward), device_weight_bytes =
                              ring buffers + resident tensors + resident blocks (what Offloaded reports),
                              h2d_bytes_per_pass = the streamed shards of one rank

mesh (--dp D --sp S): N = D x S ranks, row-major (rank = d x S + s); --shard-group picks the W ranks that
share one set of shards: world (W = N, default), dp (W = D: the sp partners hold identical shards, as the
reference), sp (W = S). Per rank: shard / pinned bytes sum_b align_up(ceil(n_b / W), A); HBM slots, landing
buffers, resident tensors; and, for a named config, the Ulysses SP activations and all-to-all buffers of the
block's peak phase at --tokens (dlo_fn.cost.sp_memory: ~ 46 B ceil(L / S) D bytes at sp > 1). A rank table
gives each rank's coordinate, tokens, heads, shard group and shard index.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="print the shard layout and memory plan of a model (no weights loaded)",
        description=(
            "Plan a model for Distributed Layerwise Offload: pack each block into one flat buffer, cut it "
            "into W equal shards, and size the host arena and the device slots. MODEL is a named config "
            "(built on the meta device) or a checkpoint directory / .safetensors file (header only)."
        ),
        epilog=FIELD_HELP,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="NAME_OR_CHECKPOINT",
        help="named config (tiny, cosmos3-nano, cosmos3-super, 400gb, bench) or checkpoint path",
    )
    p.add_argument(
        "--num-shards",
        "--shard-world",
        dest="num_shards",
        type=int,
        default=1,
        action=_SaysItsSpelling,
        metavar="W",
        help="ranks in the shard group (every rank that runs in lockstep); default 1",
    )
    p.add_argument(
        "--mode",
        choices=OFFLOAD_MODES,
        default="allgather",
        help="allgather: shard over W ranks and gather each block; rank-local: whole blocks per rank",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=2,
        help="device slots (2 = the published double buffer; 1 = load, then compute, no overlap)",
    )
    p.add_argument(
        "--landing",
        type=int,
        default=None,
        help=f"landing buffers for the local shard (allgather; default {DEFAULT_NUM_LANDING}, 2G with --load-group G)",
    )
    p.add_argument(
        "--load-group",
        type=int,
        default=1,
        metavar="G",
        help="G consecutive blocks loaded as one (needs --slots a multiple of G and >= 2G): at W > 1 the "
        "shards are laid out per group where G divides the blocks (one all-gather per group; its "
        "own digest; unequal blocks pad to their group's largest). Default 1",
    )
    p.add_argument("--alignment", type=int, default=256, help="per-tensor alignment in bytes (power of two)")
    p.add_argument(
        "--block-paths",
        default=None,
        help="comma-separated dotted paths of the block list(s) (checkpoints: auto-detected)",
    )
    p.add_argument("--dp", type=int, default=None, help="DP replicas of a (dp, sp) mesh (with --sp)")
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel ranks per replica (Ulysses)")
    p.add_argument(
        "--shard-group",
        choices=SHARD_GROUPS,
        default=DEFAULT_SHARD_GROUP,
        help="mesh ranks that share one set of shards (with --dp/--sp)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=75600,
        help="tokens of one sequence for the SP terms (75600 = 720p 10 s: 1280x720, 81 frames)",
    )
    p.add_argument("--batch", type=int, default=1, help="sequences per pass for the SP terms (2 with CFG)")
    p.add_argument(
        "--hbm-budget",
        default=None,
        metavar="BYTES",
        help="device weight bytes per rank (e.g. 16GB): the blocks offload keeps resident within it, the device "
        "weight bytes and the bytes a pass streams (dlo_fn.plan.resident)",
    )
    p.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="price --hbm-budget with FP8 shards (stored blocks streamed, resident blocks in the compute dtype)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _ranks(group: list[int]) -> str:
    """``0-7`` for a run of consecutive ranks, else ``0,2``."""
    if len(group) > 2 and group == list(range(group[0], group[-1] + 1)):
        return f"{group[0]}-{group[-1]}"
    return ",".join(map(str, group))


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n:,} B ({n / scale:.3f} {unit})"
    return f"{n:,} B"


def _say_if_generate_refuses(model: str) -> None:
    """``plan`` plans any safetensors checkpoint (from its headers when no config describes it); ``generate``
    runs dlo_fn checkpoints only. One line on stderr says so, so the two never disagree silently."""
    from dlo_fn.cli.checks import _stderr
    from dlo_fn.models import CONFIGS, load_config

    if model in CONFIGS:
        return
    try:
        load_config(model)
    except (ValueError, OSError) as exc:
        _stderr(
            f"dlo_fn plan: note: generate cannot run --model {model} ({exc}); this plan is for "
            "dlo_fn.runtime.offload.offload(model, block_paths) from Python"
        )


class _SaysItsSpelling(argparse.Action):
    """Stores the value and the spelling given (``--num-shards`` or ``--shard-world``), for messages that name the
    flag the user typed."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_flag", option_string)


def check_layout_args(args: argparse.Namespace, command: str = "plan") -> None:
    """The layout flags ``plan`` and ``generate`` share, checked before anything is built or loaded."""
    if getattr(args, "num_shards", 1) < 1:
        flag = getattr(args, "num_shards_flag", "--num-shards")
        raise UsageError(f"{command}: {flag} {args.num_shards}: give the number of ranks, >= 1")
    if isinstance(args.slots, int) and args.slots < 1:
        raise UsageError(f"{command}: --slots {args.slots}: give >= 1 device slots (2 = double buffer)")
    if args.landing is not None and args.landing < 1:
        raise UsageError(f"{command}: --landing {args.landing}: give >= 1 landing buffers (default 2)")
    alignment = getattr(args, "alignment", 256)
    if alignment < 1 or alignment & (alignment - 1):
        raise UsageError(f"{command}: --alignment {alignment}: must be a power of two (bytes), e.g. 256")


def _mesh(args: argparse.Namespace):
    """The MeshPlan of --dp/--sp (None without them); SystemExit with one line for sizes that do not fit."""
    from dlo_fn.cost.mesh import MeshPlan

    if args.dp is None and args.sp is None:
        return None
    try:
        mesh = MeshPlan(1 if args.dp is None else args.dp, 1 if args.sp is None else args.sp, args.shard_group)
    except ValueError as exc:
        raise UsageError(f"plan: --dp/--sp/--shard-group: {exc}") from None
    if args.num_shards not in (1, mesh.num_shards):
        raise UsageError(
            f"plan: --num-shards {args.num_shards} disagrees with the mesh's {args.shard_group!r} "
            f"shard group of {mesh.num_shards} ranks: leave --num-shards out with --dp/--sp"
        )
    return mesh


def _mesh_doc(args, spec, mesh) -> tuple[dict, list[str]]:
    from dlo_fn.cli.memory import block_dims, mesh_rows
    from dlo_fn.models import CONFIGS
    from dlo_fn.plan.sizes import ModelSizes

    sizes = ModelSizes.from_spec(spec, args.alignment)
    dims = block_dims(args.model)
    try:
        rows = mesh_rows(args, sizes, mesh, dims)
        heads = CONFIGS[args.model].num_heads if dims else None
        ranks = mesh.rank_table(sizes, args.tokens, heads, args.alignment) if heads else ()
    except ValueError as exc:
        raise UsageError(f"plan: {exc}") from None
    notes = [] if dims else ["SP activation terms need the block widths: give a named config as --model"]
    doc = {
        "dp": mesh.dp,
        "sp": mesh.sp,
        "shard_group": mesh.shard_group,
        "num_shards": mesh.num_shards,
        "world_size": mesh.world_size,
        "tokens": args.tokens if dims else None,
        "batch": args.batch,
        "rows": [r.to_dict() for r in rows],
        "ranks": [
            {
                "rank": r.rank,
                "dp_rank": r.dp_rank,
                "sp_rank": r.sp_rank,
                "tokens": list(r.token_range),
                "pad_tokens": r.pad_tokens,
                "heads": list(r.head_range),
                "shard_group": list(r.shard_group),
                "shard_index": r.shard_index,
                "pinned_bytes": r.pinned_bytes,
            }
            for r in ranks
        ],
    }
    return doc, notes


def _budget(args: argparse.Namespace, spec, num_shards: int) -> dict | None:
    """What ``offload(..., hbm_budget=...)`` keeps resident and holds on the device (None without the flag)."""
    from dlo_fn.plan.resident import choose_resident, frontier, layout_for, ring_num_landing
    from dlo_fn.plan.sizes import parse_bytes

    if args.hbm_budget is None:
        return None
    try:
        budget = parse_bytes(args.hbm_budget)
    except ValueError as exc:
        raise UsageError(f"plan: --hbm-budget: {exc}") from None
    layout_of = lambda s: layout_for(s, num_shards, args.alignment, args.load_group, args.quantization)  # noqa: E731
    ring = (args.slots, ring_num_landing(args.mode, num_shards, args.landing, args.load_group))
    try:
        choice = choose_resident(spec, budget, layout_of, *ring, owner="--hbm-budget")
    except ValueError as exc:
        raise UsageError(f"plan: {exc}") from None
    larger = [p for p in frontier(spec, layout_of, *ring) if p.h2d_bytes_per_pass < choice.h2d_bytes_per_pass]
    # what a larger budget buys: the next plans of the frontier, each streaming less per pass
    picks = larger[:3] + larger[-1:] if len(larger) > 4 else larger
    buys = [{"device_weight_bytes": p.device_weight_bytes, "h2d_bytes_per_pass": p.h2d_bytes_per_pass} for p in picks]
    return {"budget_bytes": budget, **choice.to_dict(), "larger_budgets": buys}


def run(args: argparse.Namespace) -> int:
    from dlo_fn.io.sources import spec_for
    from dlo_fn.plan.summary import plan_summary

    check_layout_args(args)
    if args.landing is None:
        args.landing = default_num_landing(args.load_group)
    problem = load_group_problem(args.load_group, args.slots, args.mode, args.landing)
    if problem:
        raise UsageError(f"plan: --load-group {args.load_group}: {problem}")
    mesh = _mesh(args)
    block_paths = tuple(args.block_paths.split(",")) if args.block_paths else None
    try:
        spec = spec_for(args.model, block_paths)
    except (ValueError, OSError) as exc:
        raise UsageError(f"plan: --model {args.model}: {exc}") from exc
    _say_if_generate_refuses(args.model)
    num_shards = mesh.num_shards if mesh else args.num_shards
    summary = plan_summary(spec, num_shards, args.mode, args.slots, args.landing, args.alignment, args.load_group)
    mesh_doc, notes = _mesh_doc(args, spec, mesh) if mesh else (None, [])
    budget = _budget(args, spec, num_shards)
    from dlo_fn.cli.rank_rows import TERM_FORMULAS
    from dlo_fn.cost.rank_memory import rank_terms
    from dlo_fn.plan.sizes import ModelSizes

    terms = dict(
        rank_terms(
            ModelSizes.from_spec(spec, args.alignment),
            num_shards,
            args.mode,
            "cuda",
            num_slots=args.slots,
            num_landing=args.landing,
            alignment_bytes=args.alignment,
            load_group=args.load_group,
        ).items()
    )
    if args.json:
        print(
            json.dumps(
                {
                    **summary.to_dict(),
                    "rank_terms": terms,
                    **({"hbm_budget": budget} if budget else {}),
                    **({"mesh": mesh_doc, "notes": notes} if mesh else {}),
                },
                indent=2,
            )
        )
        return 0
    for key, value in summary.to_dict().items():
        text = _fmt_bytes(value) if "_bytes" in key and key != "alignment_bytes" else str(value)
        print(f"{key:28s} {text}")
    if budget:
        print(f"\nHBM budget {_fmt_bytes(budget['budget_bytes'])} (dlo_fn.plan.resident):")
        print(f"  resident blocks        {budget['num_resident']} of {spec.num_blocks}: {budget['resident_blocks']}")
        for key in ("device_weight_bytes", "h2d_bytes_per_pass"):
            print(f"  {key:22s} {_fmt_bytes(budget[key])}")
        for p in budget["larger_budgets"]:
            print(
                f"  a budget of {_fmt_bytes(p['device_weight_bytes'])} streams {_fmt_bytes(p['h2d_bytes_per_pass'])}"
                " per pass"
            )
    print(f"\nhost terms per rank (W = {num_shards} ranks on one host, accelerator; dlo_fn.cost.rank_memory):")
    for key, value in terms.items():
        print(f"  {key:22s} {TERM_FORMULAS[key]:66s} {value if key == 'readers' else _fmt_bytes(value)}")
    if mesh is None:
        return 0
    print(
        f"\nmesh dp {mesh.dp} x sp {mesh.sp} = {mesh.world_size} ranks, shard group {mesh.shard_group} "
        f"(W = {mesh.num_shards})" + (f", {args.tokens} tokens x {args.batch}" if mesh_doc["tokens"] else "")
    )
    for r in mesh_doc["rows"]:
        print(f"  {r['item']:24s} {r['formula']:66s} {r['value_bytes'] / 1e9:9.3f} GB")
    if mesh_doc["ranks"]:
        print(f"\n  {'rank':>4s} {'(d, s)':8s} {'tokens':16s} {'heads':10s} {'shard group':18s} shard")
        for r in mesh_doc["ranks"][:16]:
            print(
                f"  {r['rank']:4d} ({r['dp_rank']}, {r['sp_rank']})".ljust(16)
                + f"[{r['tokens'][0]}, {r['tokens'][1]})".ljust(17)
                + f"[{r['heads'][0]}, {r['heads'][1]})".ljust(11)
                + _ranks(r["shard_group"]).ljust(19)
                + f"{r['shard_index']} / {mesh.num_shards}"
            )
        if len(mesh_doc["ranks"]) > 16:
            print(f"  ... {len(mesh_doc['ranks']) - 16} more ranks (--json lists all)")
    for note in notes:
        print(f"note: {note}")
    return 0
