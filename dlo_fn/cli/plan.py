"""`python -m dlo_fn plan`: the shard layout and memory plan of a model, without loading any weights."""

from __future__ import annotations

import argparse
import json

from dlo_fn.cli import HelpFormatter
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
    p.add_argument("--slots", type=int, default=2, help="device slots (2 = the published double buffer)")
    p.add_argument("--landing", type=int, default=DEFAULT_NUM_LANDING,
                   help="landing buffers for the local shard (allgather)")
    p.add_argument("--alignment", type=int, default=256, help="per-tensor alignment in bytes (power of two)")
    p.add_argument("--block-paths", default=None,
                   help="comma-separated dotted paths of the block list(s) (checkpoints: auto-detected)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _fmt_bytes(n: int) -> str:
    return f"{n:,} B ({n / 1e9:.3f} GB)"


def run(args: argparse.Namespace) -> int:
    from dlo_fn.plan.summary import plan_summary
    from dlo_fn.runtime.sources import spec_for

    block_paths = tuple(args.block_paths.split(",")) if args.block_paths else None
    spec = spec_for(args.model, block_paths)
    summary = plan_summary(spec, args.num_shards, args.mode, args.slots, args.landing, args.alignment)
    from dlo_fn.cli.rank_rows import TERM_FORMULAS
    from dlo_fn.plan.rank_memory import rank_terms
    from dlo_fn.plan.sizes import ModelSizes

    terms = dict(rank_terms(ModelSizes.from_spec(spec, args.alignment), args.num_shards, args.mode, "cuda",
                            num_slots=args.slots, num_landing=args.landing, alignment_bytes=args.alignment).items())
    if args.json:
        print(json.dumps({**summary.to_dict(), "rank_terms": terms}, indent=2))
        return 0
    for key, value in summary.to_dict().items():
        text = _fmt_bytes(value) if "_bytes" in key and key != "alignment_bytes" else str(value)
        print(f"{key:28s} {text}")
    print(f"\nhost terms per rank (W = {args.num_shards} ranks on one host, accelerator; dlo_fn.plan.rank_memory):")
    for key, value in terms.items():
        print(f"  {key:22s} {TERM_FORMULAS[key]:66s} {value if key == 'readers' else _fmt_bytes(value)}")
    return 0
