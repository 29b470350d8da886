"""Per-rank memory of a ``dp x sp`` mesh, term by term: what ``plan --dp --sp`` and ``memory --sp`` print.

For a :class:`~dlo_fn.cost.mesh.MeshPlan` (``N = dp sp`` ranks, weights sharded over ``W = num_shards`` of them)
and, when the block widths are known, the Ulysses SP workload of :mod:`dlo_fn.cost.sp_memory`::

    shard per rank     sum_b s_b,  s_b = align_up(ceil(n_b / W), A)       (the pinned host arena; ~ M / W)
    pinned, all ranks  N sum_b s_b                                          (= (N / W) x M: one model per group)
    slots              S max_b (W s_b)            landing   L max_b s_b
    resident           R                          context   c_dev (an input; 0 = the allocator's view)
    activations        a(L, sp, D, M, B): the peak phase's activations, l = ceil(L / sp) tokens per rank
    communication      k(L, sp, D, B): that phase's all-to-all send + receive buffers (0 at sp = 1)
    peak               slots + landing + resident + context + a + k
"""

from __future__ import annotations

from dlo_fn.cost.accounting import AccountingRow
from dlo_fn.cost.hbm import HbmPerCard, hbm_per_card
from dlo_fn.cost.mesh import MeshPlan
from dlo_fn.cost.sp_memory import BlockDims, SPActivations, sp_activations
from dlo_fn.plan.layout import DEFAULT_ALIGNMENT_BYTES
from dlo_fn.plan.schedule import DEFAULT_NUM_LANDING
from dlo_fn.plan.sizes import ModelSizes

__all__ = ["SECTION", "mesh_hbm", "mesh_memory_rows"]

SECTION = "mesh: per rank"


def mesh_hbm(
    sizes: ModelSizes,
    mesh: MeshPlan,
    workload: SPActivations | None = None,
    *,
    num_slots: int = 2,
    num_landing: int = DEFAULT_NUM_LANDING,
    context_bytes: int = 0,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> HbmPerCard:
    """HBM of one rank of ``mesh`` (every rank holds the same), with the SP workload terms when given."""
    if workload is not None and workload.sp != mesh.sp:
        raise ValueError(f"the workload is for sp {workload.sp}, the mesh has sp {mesh.sp}")
    return hbm_per_card(
        sizes,
        mesh.num_shards,
        "allgather",
        num_slots=num_slots,
        num_landing=num_landing,
        activation_bytes=workload.activation_bytes if workload else 0,
        communication_bytes=workload.communication_bytes if workload else 0,
        context_bytes=context_bytes,
        alignment_bytes=alignment_bytes,
    )


def mesh_memory_rows(
    sizes: ModelSizes,
    mesh: MeshPlan,
    dims: BlockDims | None = None,
    tokens: int | None = None,
    *,
    batch: int = 1,
    num_slots: int = 2,
    num_landing: int = DEFAULT_NUM_LANDING,
    context_bytes: int = 0,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> tuple[AccountingRow, ...]:
    """The module docstring's table; the SP rows need ``dims`` and ``tokens``."""
    workload = sp_activations(dims, tokens, mesh.sp, batch) if dims is not None and tokens is not None else None
    h = mesh_hbm(
        sizes,
        mesh,
        workload,
        num_slots=num_slots,
        num_landing=num_landing,
        context_bytes=context_bytes,
        alignment_bytes=alignment_bytes,
    )
    w, n = mesh.num_shards, mesh.world_size
    shard = mesh.pinned_bytes_per_rank(sizes, alignment_bytes)
    s = SECTION
    rows = [
        AccountingRow(
            s, "shard / pinned per rank", f"sum_b align_up(ceil(n_b / W), A), W = {w} ({mesh.shard_group})", shard
        ),
        AccountingRow(s, "pinned, all ranks", f"N x shard = {n // w} model cop{'y' if n == w else 'ies'}", n * shard),
        AccountingRow(s, "slots", f"S x max_b (W s_b), S = {num_slots}", h.slot_bytes),
        AccountingRow(s, "landing buffers", f"L x max_b s_b, L = {num_landing}", h.landing_bytes),
        AccountingRow(s, "resident tensors", "R", h.resident_bytes),
        AccountingRow(s, "device context", "c_dev (input)", h.context_bytes),
    ]
    if workload is not None:
        loc, phase = workload.local_tokens, workload.peak_phase.name
        rows += [
            AccountingRow(
                s,
                "activations",
                f"'{phase}' at l = ceil({tokens} / {mesh.sp}) = {loc}, B = {batch}",
                h.activation_bytes,
            ),
            AccountingRow(
                s, "communication", "its all-to-all send + recv" if mesh.sp > 1 else "0 (sp = 1)", h.communication_bytes
            ),
        ]
    rows.append(
        AccountingRow(
            s, "hbm peak", "slots + landing + resident + context" + (" + a + k" if workload else ""), h.peak_bytes
        )
    )
    return tuple(rows)
