"""Host and HBM accounting as one table (item, formula, value): what ``python -m dlo_fn memory`` prints.

Each row is a term of :mod:`dlo_fn.cost.memory` or :mod:`dlo_fn.cost.hbm` with the formula that produced it,
so a reader can size a server by hand and check the tool. Bytes everywhere; the CLI adds GB.

Under an HBM budget (``budget``, :mod:`dlo_fn.cost.hbm_budget`) the steady state and the HBM rows are those of the
streamed blocks: the host pins their shards only, the ring is sized by them, and the resident blocks sit whole on
every card in the compute dtype (in allgather mode too); the cold start still loads the whole checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from dlo_fn.cost.hbm import HbmPerCard, hbm_per_card
from dlo_fn.cost.hbm_budget import ResidentPlan, format_size
from dlo_fn.cost.memory import ModelSizes, cold_start, host_steady_state, pinned_host_bytes_per_rank
from dlo_fn.plan.layout import DEFAULT_ALIGNMENT_BYTES
from dlo_fn.plan.schedule import DEFAULT_NUM_LANDING

__all__ = ["AccountingRow", "memory_accounting"]


@dataclass(frozen=True, slots=True)
class AccountingRow:
    section: str  # "host: cold start", "host: steady state", "hbm per card"
    item: str
    formula: str
    value_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def memory_accounting(
    sizes: ModelSizes,
    num_ranks: int,
    *,
    platform: str = "cuda",
    mode: str = "allgather",
    loading: str = "mmap",
    num_slots: int = 2,
    num_landing: int = DEFAULT_NUM_LANDING,
    activation_bytes: int = 0,
    communication_bytes: int = 0,
    transient_bytes: int = 0,
    framework_bytes_per_rank: int,
    context_bytes: int,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    num_shards: int | None = None,
    with_hbm: bool = True,
    budget: ResidentPlan | None = None,
) -> tuple[AccountingRow, ...]:
    """Rows of the host (cold start, steady state) and HBM accounting for ``num_ranks`` ranks sharding over
    ``num_shards`` of them (default all: ``W = N``; a (dp, sp) mesh may shard over its dp or sp groups).
    ``with_hbm=False`` leaves out the HBM rows (no block sizes known).

    The two deployment constants are inputs: ``framework_bytes_per_rank`` (``c``, host bytes of a process
    without weights) and ``context_bytes`` (``c_dev``, device bytes besides weights and workload). ``budget``: the
    resident blocks of an HBM budget (module docstring)."""
    n, fw = num_ranks, framework_bytes_per_rank
    w = n if num_shards is None else num_shards
    start = cold_start(
        sizes,
        n,
        loading,
        mode,
        framework_bytes_per_rank=fw,
        transient_bytes=transient_bytes,
        num_shards=w,
        alignment_bytes=alignment_bytes,
    )
    steady = host_steady_state(
        sizes, n, platform, mode, num_shards=w, framework_bytes_per_rank=fw, alignment_bytes=alignment_bytes
    )
    streamed = sizes if budget is None else budget.streamed  # None: every block resident, nothing streams
    if budget is not None:
        pinned = 0 if streamed is None else pinned_host_bytes_per_rank(streamed, w, mode, alignment_bytes)
        steady = replace(steady, pinned_bytes_per_rank=pinned)
    cs, ss = "host: cold start", "host: steady state"
    pinned_formula = (
        "0 (every block resident)"
        if budget is not None and streamed is None
        else {
            "allgather": "sum_b align_up(ceil(n_b / W), A), " + ("W = N" if w == n else f"W = {w}"),
            "rank-local": "sum_b align_up(n_b, A) (a private pinned copy per rank)",
            "rank-local-mmap": "0 (blocks stream from the shared page cache)",
        }[mode]
        + (f", streamed blocks only ({budget.num_blocks - len(budget.resident)})" if budget is not None else "")
    )
    touched = "M" if loading == "private-copy" or mode != "allgather" else "own shards + R"
    invisible = "N x pinned (driver DMA memory, not charged)" if platform == "ascend" else "0 (CUDA charges pinned)"
    rows = [
        AccountingRow(cs, "model bytes M", "blocks + resident tensors (the checkpoint)", sizes.total_bytes),
        AccountingRow(cs, "page cache", "M (one copy, shared by every rank)", start.page_cache_bytes),
        AccountingRow(
            cs, "private copies", "N x M" if loading == "private-copy" else "0 (mmap views)", start.private_copy_bytes
        ),
        AccountingRow(cs, "framework", f"N x c, c = {fw / 1e9:g} GB", start.framework_bytes),
        AccountingRow(cs, "transient", "t (input)", start.transient_bytes),
        AccountingRow(
            cs, "cgroup peak", "page cache + private copies + framework + transient", start.cgroup_peak_bytes
        ),
        AccountingRow(cs, "per-rank high-water mark", f"touched ({touched}) + c", start.hwm_bytes_per_rank),
        AccountingRow(ss, "pinned per rank", pinned_formula, steady.pinned_bytes_per_rank),
        AccountingRow(ss, "pinned, all ranks", "N x pinned per rank", steady.pinned_bytes),
        AccountingRow(ss, "page cache", "M (until reclaimed)", steady.page_cache_bytes),
        AccountingRow(ss, "framework", "N x c", steady.framework_bytes),
        AccountingRow(ss, "cgroup-invisible", invisible, steady.cgroup_invisible_bytes),
        AccountingRow(ss, "cgroup-visible", "page cache + framework + pinned - invisible", steady.cgroup_bytes),
        AccountingRow(ss, "physical RAM", "page cache + framework + pinned", steady.physical_bytes),
    ]
    if not with_hbm:
        return tuple(rows)
    hbm_mode = "allgather" if mode == "allgather" else "rank-local"
    workload = dict(
        activation_bytes=activation_bytes, communication_bytes=communication_bytes, context_bytes=context_bytes
    )
    if streamed is None:  # the budget holds the model: no ring
        h = HbmPerCard(0, 0, budget.choice.device_weight_bytes, **workload)
    else:
        h = hbm_per_card(
            streamed,
            w,
            hbm_mode,
            num_slots=num_slots,
            num_landing=num_landing,
            alignment_bytes=alignment_bytes,
            **workload,
        )
    hs = "hbm per card"
    kept = 0 if budget is None else budget.resident_block_bytes
    slot = "S x max_b (W x s_b)" if hbm_mode == "allgather" else "S x max_b align_up(n_b, A)"
    rows += [
        AccountingRow(hs, "slots", f"{slot}, S = {num_slots}", h.slot_bytes),
        AccountingRow(
            hs,
            "landing buffers",
            f"L x max_b s_b, L = {num_landing}" if hbm_mode == "allgather" else "0 (rank-local: no shards)",
            h.landing_bytes,
        ),
        AccountingRow(hs, "resident tensors", "R", h.resident_bytes - kept),
    ]
    if budget is not None:
        b, k = budget.num_blocks, len(budget.resident)
        rows += [
            AccountingRow(hs, "resident blocks", f"{k} of {b}, whole on every card, compute dtype (hbm budget)", kept),
            AccountingRow(
                hs,
                "device weights",
                f"slots + landing + resident, <= budget {format_size(budget.budget_bytes)}",
                h.weight_bytes + h.resident_bytes,
            ),
        ]
    rows += [
        AccountingRow(hs, "device context", "c_dev (calibrated)", h.context_bytes),
        AccountingRow(hs, "idle", "slots + landing + resident + context", h.idle_bytes),
        AccountingRow(hs, "activations", "a (input)", h.activation_bytes),
        AccountingRow(hs, "communication", "k (input)", h.communication_bytes),
        AccountingRow(hs, "peak", "idle + activations + communication", h.peak_bytes),
    ]
    return tuple(rows)
