"""The numbers `python -m dlo_fn plan` prints, computed from a :class:`~dlo_fn.plan.layout.ModelLayout`.

For a shard group of ``W = num_shards`` ranks, ``S`` slots and ``L`` landing buffers:

==============================  ===============================================================
field                           formula
==============================  ===============================================================
num_blocks                      number of offloaded blocks
total_bytes                     block bytes + resident bytes (what the checkpoint stores)
max_padded_block_bytes          largest gathered block, padded to ``W`` equal shards (= slot size)
shard_bytes_per_rank            ``sum_b align_up(ceil(n_b / W), A)`` (allgather); 0 (rank-local); a grouped
                                layout (``load_group``): each group's blocks at its largest one's
pinned_host_bytes_per_rank      allgather: ``shard_bytes_per_rank`` (one exact-size arena);
                                rank-local: every block, unsharded (a private pinned copy per rank)
hbm_weight_bytes                ``S * max_padded_block_bytes + L * max_shard_bytes`` (rank-local: ``L = 0``)
resident_bytes                  tensors outside the block lists, kept on every device
==============================  ===============================================================
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dlo_fn.plan.layout import DEFAULT_ALIGNMENT_BYTES, layout_load_group, model_layout
from dlo_fn.plan.lowering import lowered_mode
from dlo_fn.plan.modes import OFFLOAD_MODES, check_mode
from dlo_fn.plan.schedule import DEFAULT_NUM_LANDING
from dlo_fn.plan.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class PlanSummary:
    model: str
    mode: str
    num_shards: int
    num_slots: int
    num_landing: int
    load_group: int  # the shard layout's (plan.layout.layout_load_group): 1 = per-block shards
    alignment_bytes: int
    num_blocks: int
    num_params: int
    total_bytes: int
    resident_bytes: int
    max_padded_block_bytes: int
    shard_bytes_per_rank: int
    pinned_host_bytes_per_rank: int
    hbm_weight_bytes: int
    layout_digest: str

    def to_dict(self) -> dict:
        return asdict(self)


def plan_summary(
    spec: ModelSpec,
    num_shards: int,
    mode: str = "allgather",
    num_slots: int = 2,
    num_landing: int = DEFAULT_NUM_LANDING,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    load_group: int = 1,
) -> PlanSummary:
    """The plan of ``spec`` on a shard group of ``num_shards`` ranks; ``load_group`` (the ring's): the shard
    layout ``offload`` builds for it (grouped where it divides the blocks at ``W > 1``, :mod:`dlo_fn.plan.layout`),
    whose host bytes and digest these are."""
    check_mode(mode, OFFLOAD_MODES)
    if num_slots < 1:  # as the schedule: 1 slot serialises load and compute, 2 is the double buffer
        raise ValueError(f"num_slots must be >= 1 (2 = double buffer), got {num_slots}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if mode == "allgather":
        if num_landing < 1:
            raise ValueError(f"allgather mode needs num_landing >= 1, got {num_landing}")
        layout = model_layout(
            spec, num_shards, alignment_bytes, layout_load_group(spec.num_blocks, num_shards, load_group)
        )
        shard_per_rank = layout.shard_bytes_per_rank
        pinned = shard_per_rank
        if lowered_mode(mode, num_shards) != mode:  # one rank: H2D straight into the slot (plan.lowering)
            num_landing = 0
        hbm = num_slots * layout.max_padded_block_bytes + num_landing * layout.max_shard_bytes
    else:
        layout = model_layout(spec, 1, alignment_bytes)
        num_landing = 0
        shard_per_rank = 0
        pinned = layout.shard_bytes_per_rank
        hbm = num_slots * layout.max_padded_block_bytes
    return PlanSummary(
        model=spec.name,
        mode=mode,
        num_shards=num_shards,
        num_slots=num_slots,
        num_landing=num_landing,
        load_group=layout.load_group,
        alignment_bytes=alignment_bytes,
        num_blocks=spec.num_blocks,
        num_params=spec.num_params,
        total_bytes=spec.total_bytes,
        resident_bytes=spec.resident_bytes,
        max_padded_block_bytes=layout.max_padded_block_bytes,
        shard_bytes_per_rank=shard_per_rank,
        pinned_host_bytes_per_rank=pinned,
        hbm_weight_bytes=hbm,
        layout_digest=layout.digest,
    )


def text_table(rows: list[dict]) -> str:
    """Rows of equal keys as an aligned text table (for notebooks: stable, diffable output)."""
    keys = list(rows[0])
    cells = [keys] + [[str(r[k]) for k in keys] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(line, widths))) for line in cells]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])
