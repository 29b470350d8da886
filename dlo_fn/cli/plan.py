"""`python -m dlo_fn plan`: the shard layout and memory plan of a model, without loading any weights."""

from __future__ import annotations

import argparse
import json

from dlo_fn.cli import HelpFormatter, UsageError
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
  shard_bytes_per_rank        host bytes of one rank's shards: sum over blocks of align_up(ceil(n/W), A)
                              (allgather); 0 in rank-local mode (no sharding)
  pinned_host_bytes_per_rank  the rank's exact-size pinned arena: its shards (allgather), or every block
                              unsharded (rank-local with a private pinned copy)
  hbm_weight_bytes            device bytes held for weights: slots x max_padded_block_bytes + landing
                              buffers x the largest shard (allgather); slots x max_padded_block_bytes
                              (rank-local).
                              Independent of the number of blocks.
  layout_digest               SHA-256 of the layout; ranks compare it at start-up
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
    p.add_argument("--model", required=True, metavar="NAME_OR_CHECKPOINT",
                   help="named config (tiny, cosmos3-nano, cosmos3-super, 400gb, bench) or checkpoint path")
    p.add_argument("--num-shards", "--shard-world", dest="num_shards", type=int, default=1, metavar="W",
                   help="ranks in the shard group (every rank that runs in lockstep); default 1")
    p.add_argument("--mode", choices=OFFLOAD_MODES, default="allgather",
                   help="allgather: shard over W ranks and gather each block; rank-local: whole blocks per rank")
    p.add_argument("--slots", type=int, default=2,
                   help="device slots (2 = the published double buffer; 1 = load, then compute, no overlap)")
    p.add_argument("--landing", type=int, default=DEFAULT_NUM_LANDING,
                   help="landing buffers for the local shard (allgather)")
    p.add_argument("--alignment", type=int, default=256, help="per-tensor alignment in bytes (power of two)")
    p.add_argument("--block-paths", default=None,
                   help="comma-separated dotted paths of the block list(s) (checkpoints: auto-detected)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n:,} B ({n / scale:.3f} {unit})"
    return f"{n:,} B"


def check_layout_args(args: argparse.Namespace, command: str = "plan") -> None:
    """The layout flags ``plan`` and ``generate`` share, checked before anything is built or loaded."""
    if getattr(args, "num_shards", 1) < 1:
        raise UsageError(f"{command}: --shard-world {args.num_shards}: give the number of ranks, >= 1")
    if args.slots != "auto" and args.slots < 1:
        raise UsageError(f"{command}: --slots {args.slots}: give >= 1 device slots (2 = double buffer)")
    if args.landing is not None and args.landing < 1:
        raise UsageError(f"{command}: --landing {args.landing}: give >= 1 landing buffers (default 2)")
    alignment = getattr(args, "alignment", 256)
    if alignment < 1 or alignment & (alignment - 1):
        raise UsageError(f"{command}: --alignment {alignment}: must be a power of two (bytes), e.g. 256")


def run(args: argparse.Namespace) -> int:
    from dlo_fn.plan.summary import plan_summary
    from dlo_fn.runtime.sources import spec_for

    check_layout_args(args)
    block_paths = tuple(args.block_paths.split(",")) if args.block_paths else None
    try:
        spec = spec_for(args.model, block_paths)
    except (ValueError, OSError) as exc:
        raise UsageError(f"plan: --model {args.model}: {exc}") from exc
    summary = plan_summary(spec, args.num_shards, args.mode, args.slots, args.landing, args.alignment)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
        return 0
    for key, value in summary.to_dict().items():
        text = _fmt_bytes(value) if "_bytes" in key and key != "alignment_bytes" else str(value)
        print(f"{key:28s} {text}")
    return 0
