"""A host budget: pin as much of each rank's shards as fits, stream the rest from the shared mapping, or refuse.

Notation (bytes; per rank unless stated):

==========  ================================================================================================
``B``       the host budget: what the ``N`` ranks on one host may hold together, page cache not counted
``c``       the process constant (a rank's USS before any weight page is read; measured at start-up)
``f``       the rank's other fixed bytes: on CPU the resident copy ``R`` and the host slots and landing
            buffers (:func:`dlo_fn.cost.rank_memory.rank_terms`); on an accelerator 0 (they are on the device)
``s_b``     the rank's host bytes of block ``b``: its shard (allgather) or the whole block (rank-local)
==========  ================================================================================================

The rank's share is ``B / N``; the bytes it may pin are ``p = B / N - c - f``. Blocks are pinned in forward
order while their shards fit in ``p`` (one exact-size arena of ``sum_{b < k} s_b``), the rest are streamed:
their H2D reads the checkpoint's pages (pageable, shared page cache). Three outcomes::

    fits           sum_b s_b <= p                 every shard pinned
    partly pinned  0 <= p < sum_b s_b             k = max{k : sum_{b<k} s_b <= p} blocks pinned
    refused        p < 0                          even streaming everything does not fit: the bytes needed
                                                  (N (c + f)) and the largest dp n <= N with n (c + f(n)) <= B

Step-time cost of the unpinned part, from measured bandwidths (pinned ``beta_p``, pageable ``beta_q``): the
streamed bytes ``u = sum_{b >= k} s_b`` take ``u / beta_q`` in place of ``u / beta_p`` per pass over the
blocks, so where the pass is H2D-bound it grows by ``u (1 / beta_q - 1 / beta_p)``; where compute hides the
copies, by ``max(0, H2D - compute)``, which this bound over-estimates.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo_fn.cost.rank_memory import rank_terms
from dlo_fn.plan.layout import DEFAULT_ALIGNMENT_BYTES
from dlo_fn.plan.sizes import ModelSizes, _check_positive

__all__ = ["BUDGET_STATUSES", "HostBudget", "host_budget", "pinned_prefix", "streamed_pass_cost_s"]

BUDGET_STATUSES = ("fits", "partly pinned", "refused")


def pinned_prefix(shard_bytes: tuple[int, ...], pinnable_bytes: int) -> int:
    """``k = max{k : sum_{b<k} s_b <= p}``: how many leading blocks' shards fit in ``pinnable_bytes``."""
    total, k = 0, 0
    for s in shard_bytes:
        if total + s > pinnable_bytes:
            break
        total += s
        k += 1
    return k


def streamed_pass_cost_s(streamed_bytes: int, pinned_bytes_per_s: float, pageable_bytes_per_s: float) -> float:
    """``u (1 / beta_q - 1 / beta_p)``: extra H2D seconds per pass over the blocks (module docstring)."""
    if pinned_bytes_per_s <= 0 or pageable_bytes_per_s <= 0:
        raise ValueError("bandwidths must be positive bytes per second")
    return streamed_bytes / pageable_bytes_per_s - streamed_bytes / pinned_bytes_per_s


@dataclass(frozen=True, slots=True)
class HostBudget:
    """The outcome of :func:`host_budget` for one rank (every rank of a uniform host gets the same)."""

    budget_bytes: int  # B, the whole host
    num_ranks: int
    constant_bytes: int  # c
    fixed_bytes: int  # f
    shard_bytes: tuple[int, ...]  # s_b
    num_pinned_blocks: int  # k
    largest_dp: int  # the largest n <= N that runs within B (0: none)

    @property
    def share_bytes(self) -> int:
        return self.budget_bytes // self.num_ranks

    @property
    def pinnable_bytes(self) -> int:
        return self.share_bytes - self.constant_bytes - self.fixed_bytes

    @property
    def pinned_bytes(self) -> int:
        return sum(self.shard_bytes[: self.num_pinned_blocks])

    @property
    def streamed_bytes(self) -> int:
        return sum(self.shard_bytes[self.num_pinned_blocks :])

    @property
    def status(self) -> str:
        if self.pinnable_bytes < 0:
            return "refused"
        return "fits" if self.num_pinned_blocks == len(self.shard_bytes) else "partly pinned"

    @property
    def minimum_host_bytes(self) -> int:
        """``N (c + f)``: the host bytes to run at all (every block streamed)."""
        return self.num_ranks * (self.constant_bytes + self.fixed_bytes)

    @property
    def full_pin_host_bytes(self) -> int:
        """``N (c + f + sum_b s_b)``: the host bytes to pin every shard."""
        return self.num_ranks * (self.constant_bytes + self.fixed_bytes + sum(self.shard_bytes))

    def extra_pass_s(self, pinned_bytes_per_s: float, pageable_bytes_per_s: float) -> float:
        return streamed_pass_cost_s(self.streamed_bytes, pinned_bytes_per_s, pageable_bytes_per_s)

    def message(self) -> str:
        """One line for the user."""
        gb = 1e9
        if self.status == "refused":
            dp = f"the largest dp that fits is {self.largest_dp}" if self.largest_dp else "no dp fits on this host"
            return (
                f"--host-budget {self.budget_bytes / gb:.3f} GB is too small for {self.num_ranks} rank(s): "
                f"running at all needs {self.minimum_host_bytes / gb:.3f} GB ({self.num_ranks} x "
                f"({self.constant_bytes / gb:.3f} GB per process + {self.fixed_bytes / gb:.3f} GB fixed)), "
                f"pinning every shard {self.full_pin_host_bytes / gb:.3f} GB; {dp}: raise the budget or "
                f"run fewer ranks per host"
            )
        return (
            f"host budget {self.budget_bytes / gb:.3f} GB: {self.status}, {self.num_pinned_blocks}/"
            f"{len(self.shard_bytes)} blocks pinned ({self.pinned_bytes / gb:.3f} GB per rank), "
            f"{self.streamed_bytes / gb:.3f} GB per rank streamed from the mapping"
        )


def host_budget(
    sizes: ModelSizes,
    num_ranks: int,
    budget_bytes: int,
    mode: str = "allgather",
    device: str = "cuda",
    *,
    constant_bytes: int,
    num_slots: int = 2,
    num_landing: int = 2,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> HostBudget:
    """See the module docstring. ``mode`` is ``allgather`` (shards over the ``num_ranks``) or ``rank-local``;
    ``constant_bytes`` is ``c``, measured (a rank's USS at start-up)."""
    _check_positive("num_ranks", num_ranks)
    if mode not in ("allgather", "rank-local"):
        raise ValueError(f"a host budget pins shards: mode must be allgather or rank-local, got {mode!r}")
    if budget_bytes < 0 or constant_bytes < 0:
        raise ValueError("budget_bytes and constant_bytes must be >= 0")

    def fixed(n: int) -> int:
        t = rank_terms(
            sizes, n, mode, device, num_slots=num_slots, num_landing=num_landing, alignment_bytes=alignment_bytes
        )
        return t.resident_copy_bytes + t.slot_bytes + t.landing_bytes + t.staging_bytes

    w = num_ranks if mode == "allgather" else 1
    shards = sizes.shard_bytes(w, alignment_bytes)
    f = fixed(num_ranks)
    pinnable = budget_bytes // num_ranks - constant_bytes - f
    largest = max((n for n in range(1, num_ranks + 1) if n * (constant_bytes + fixed(n)) <= budget_bytes), default=0)
    return HostBudget(
        budget_bytes,
        num_ranks,
        constant_bytes,
        f,
        shards,
        pinned_prefix(shards, pinnable) if pinnable >= 0 else 0,
        largest,
    )
