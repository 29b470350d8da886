"""What the topology policy (:mod:`dlo_fn.cost.policy`) knows about a machine and a model: frozen values, pure.

A :class:`Topology` is ``N`` ranks with their rates and capacities; a :class:`PolicyModel` is the model's block
layout (:class:`~dlo_fn.plan.sizes.ModelSizes`) plus the two widths the time model needs. Every field of a
named topology states its source (``sources``: field -> where the number comes from).

=============================  ======================================================================================
field                          meaning
=============================  ======================================================================================
``num_ranks``                  ``N``: devices, ``dp x sp = N``
``h2d_bytes_per_s``            pinned host-to-device bytes/s of one rank while the others copy too (``beta_h``)
``allgather_bus_bytes_per_s``  all-gather bus bandwidth of the shard group (NCCL convention: ``n`` output bytes
                               over ``W`` ranks take ``((W - 1) / W) n / busbw``)
``all_to_all_bytes_per_s``     all-to-all bus bandwidth of the SP group (NCCL convention: a rank's buffer of ``n``
                               bytes over ``sp`` ranks takes ``((sp - 1) / sp) n / busbw``; full duplex)
``d2d_copy_bytes_per_s``       device copy rate: the all-gather of a shard group of one rank is a copy
``compute``                    per-block compute of one request (:class:`BlockCompute`: a measured table or a
                               FLOP rate)
``hbm_bytes_per_rank``         device memory per rank; ``context_bytes`` of it is the runtime's own
``host_bytes_per_rank``        host RAM per rank (the host's RAM / ranks per host)
``host_s_per_block``           host work per block, by mode (``(("allgather", s), ("rank-local", s))``)
``host_serial``                True: the host work sits on the compute stream's critical path (the reference's
                               stream switches and dispatch); False: the host runs ahead (ours), and only bounds
                               a block when it exceeds the block's device time
``step_overhead``              per step, compute-stream work outside the blocks of one request (embed, head,
                               sampler update): ``(tokens, cfg branches, seconds)`` measured; the entry nearest the
                               workload, scaled by the token ratio ``L g / (L0 g0)``. The ring must run ahead
                               across it
``request_overhead``           per request, host work outside the ring (noise and text tokens in, latents out,
                               decode, hash): ``(tokens, seconds)`` measured; the nearest entry scaled by ``L / L0``
``peer_link``                  how the all-gather's bytes travel between GPUs (:data:`PEER_LINKS`): ``"nvlink"``
                               (their own links, independent of H2D), ``"pcie"`` (peer-to-peer over PCIe: the same
                               link into each GPU as its H2D), ``"host"`` (no peer-to-peer: staged through host
                               memory, written by the sender and read by the receiver)
``gpus_per_uplink``            GPUs whose H2D share one upstream port to the host (a PCIe switch's uplink; ranks
                               sharing one GPU share its link): 1 = each GPU on its own root port
``uplink_bytes_per_s``         that port's rate (``None``: no shared port)
``host_memory_bytes_per_s``    host DRAM bandwidth the DMA traffic of ``ranks_per_host`` GPUs shares (``None``: not
                               a limit)
``ranks_per_host``             GPUs (ranks) on one host (``None``: all ``N``)
=============================  ======================================================================================

The last five describe the **shared links** (:mod:`dlo_fn.cost.links`): on machines without NVLink the all-gather
crosses the links the H2D uses, so its bytes and the H2D's are summed on each link it shares with them.

**Block compute.** One request's compute of one block on one rank at ``sp``, for a sequence of ``L`` tokens per
CFG branch and ``g`` branches, from the FLOPs of a block (``P`` parameters, hidden ``D``)::

    F(L) = g (2 P L + 4 D L^2)           linear layers + attention scores and values
    c(L, sp) = F(L) / sp / rate          (FLOP rate)
    c(L, sp) = t(L0) F(L) / F(L0) / sp   (measured table: the entry L0 nearest L, scaled by the FLOP ratio;
                                          exact at a measured L)
    c_b = c(L, sp) F_b(L) / F(L)         (block b of P_b = n_b / e parameters: :func:`compute_shape`)

Ulysses splits tokens for per-token work and heads for attention, so both terms divide by ``sp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo_fn.plan.modes import OFFLOAD_MODES
from dlo_fn.plan.sizes import ModelSizes

__all__ = ["BlockCompute", "PEER_LINKS", "PolicyModel", "Topology", "block_flops", "compute_shape"]

PEER_LINKS = ("nvlink", "pcie", "host")


@dataclass(frozen=True, slots=True)
class PolicyModel:
    """A model as the policy sees it: its block bytes, hidden width, and bytes per element.

    ``activation_bytes_per_token``: device bytes a block's forward holds per token of one branch (a measured or
    derived input, 0 to leave activations out of the HBM check); ``num_all_to_all_per_block``: Ulysses
    exchanges per block (q, k, v in and the output back: 4)."""

    sizes: ModelSizes
    hidden_dim: int
    dtype_bytes: int = 2
    activation_bytes_per_token: int = 0
    num_all_to_all_per_block: int = 4
    source: str = ""
    # Each block's tensor bytes unpacked (ModelSpec.block_bytes): what a block kept resident under an HBM budget
    # holds on the device (dlo_fn.cost.hbm_budget); empty: its packed bytes.
    tensor_block_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("hidden_dim", "dtype_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"PolicyModel.{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.tensor_block_bytes and len(self.tensor_block_bytes) != self.sizes.num_blocks:
            raise ValueError("PolicyModel.tensor_block_bytes needs one entry per block (or none)")
        if self.activation_bytes_per_token < 0 or self.num_all_to_all_per_block < 0:
            raise ValueError("PolicyModel.activation_bytes_per_token and num_all_to_all_per_block must be >= 0")

    @property
    def name(self) -> str:
        return self.sizes.name

    @property
    def block_params(self) -> float:
        """Mean parameters of a block: ``mean block bytes / dtype bytes``."""
        return self.sizes.total_block_bytes / self.sizes.num_blocks / self.dtype_bytes


def block_flops(model: PolicyModel, tokens: int, cfg_branches: int = 1, params: float | None = None) -> float:
    """``F(L) = g (2 P L + 4 D L^2)`` (module docstring); ``P`` the mean block's unless ``params`` is given."""
    p = model.block_params if params is None else params
    return cfg_branches * (2 * p * tokens + 4 * model.hidden_dim * tokens * tokens)


def compute_shape(model: PolicyModel, tokens: int, cfg_branches: int = 1) -> tuple[float, ...]:
    """Each block's compute over the mean block's, ``F_b(L) / F(L)`` with ``P_b = n_b / e`` (blocks of different
    sizes, as Flux's two lists, compute in proportion to their FLOPs; all 1 for equal blocks)."""
    mean = block_flops(model, tokens, cfg_branches)
    return tuple(
        block_flops(model, tokens, cfg_branches, n / model.dtype_bytes) / mean for n in model.sizes.block_bytes
    )


@dataclass(frozen=True, slots=True)
class BlockCompute:
    """Per-block compute of one request: ``table`` of ``(tokens per branch, cfg branches, seconds)`` measured on
    one rank, or ``flop_per_s``. Exactly one of the two."""

    table: tuple[tuple[int, int, float], ...] = ()
    flop_per_s: float | None = None

    def __post_init__(self) -> None:
        if bool(self.table) == (self.flop_per_s is not None):
            raise ValueError("BlockCompute needs exactly one of table (measured) or flop_per_s")
        if self.flop_per_s is not None and not self.flop_per_s > 0:
            raise ValueError(f"BlockCompute.flop_per_s must be > 0, got {self.flop_per_s}")
        for row in self.table:
            if len(row) != 3 or row[0] < 1 or row[1] < 1 or not row[2] > 0:
                raise ValueError(f"BlockCompute.table rows are (tokens >= 1, cfg_branches >= 1, seconds > 0): {row}")

    def seconds(self, model: PolicyModel, tokens: int, cfg_branches: int, sp: int = 1) -> float:
        """``c(L, sp)`` of the module docstring."""
        flops = block_flops(model, tokens, cfg_branches)
        if self.flop_per_s is not None:
            return flops / sp / self.flop_per_s
        l0, g0, t0 = min(self.table, key=lambda r: (abs(r[0] - tokens), abs(r[1] - cfg_branches)))
        return t0 * flops / block_flops(model, l0, g0) / sp


@dataclass(frozen=True, slots=True)
class Topology:
    name: str
    num_ranks: int
    h2d_bytes_per_s: float
    allgather_bus_bytes_per_s: float
    all_to_all_bytes_per_s: float
    d2d_copy_bytes_per_s: float
    compute: BlockCompute
    hbm_bytes_per_rank: int
    host_bytes_per_rank: int
    host_s_per_block: tuple[tuple[str, float], ...] = (("allgather", 0.0), ("rank-local", 0.0))
    host_serial: bool = False
    step_overhead: tuple[tuple[int, int, float], ...] = ()
    context_bytes: int = 0
    framework_host_bytes: int = 0
    sources: tuple[tuple[str, str], ...] = ()
    request_overhead: tuple[tuple[int, float], ...] = ()
    peer_link: str = "nvlink"
    gpus_per_uplink: int = 1
    uplink_bytes_per_s: float | None = None
    host_memory_bytes_per_s: float | None = None
    ranks_per_host: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_ranks, int) or self.num_ranks < 1:
            raise ValueError(f"Topology {self.name!r}: num_ranks must be an int >= 1, got {self.num_ranks!r}")
        if self.peer_link not in PEER_LINKS:
            raise ValueError(
                f"Topology {self.name!r}: peer_link must be one of {', '.join(PEER_LINKS)}; got {self.peer_link!r}"
            )
        for f in ("gpus_per_uplink", "ranks_per_host"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"Topology {self.name!r}: {f} must be an int >= 1, got {v!r}")
        for f in ("uplink_bytes_per_s", "host_memory_bytes_per_s"):
            v = getattr(self, f)
            if v is not None and not v > 0:
                raise ValueError(f"Topology {self.name!r}: {f} must be > 0 (or None: not a limit), got {v!r}")
        for f in ("h2d_bytes_per_s", "allgather_bus_bytes_per_s", "all_to_all_bytes_per_s", "d2d_copy_bytes_per_s"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Topology {self.name!r}: {f} must be > 0, got {getattr(self, f)!r}")
        for f in ("hbm_bytes_per_rank", "host_bytes_per_rank"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"Topology {self.name!r}: {f} must be an int >= 1 of bytes, got {getattr(self, f)!r}")
        if self.context_bytes < 0 or self.framework_host_bytes < 0:
            raise ValueError(f"Topology {self.name!r}: context_bytes and framework_host_bytes must be >= 0")
        for row in self.step_overhead:
            if len(row) != 3 or row[0] < 1 or row[1] < 1 or row[2] < 0:
                raise ValueError(f"Topology {self.name!r}: step_overhead rows are (tokens, cfg_branches, s >= 0)")
        for row in self.request_overhead:
            if len(row) != 2 or row[0] < 1 or row[1] < 0:
                raise ValueError(f"Topology {self.name!r}: request_overhead rows are (tokens >= 1, s >= 0)")
        host = dict(self.host_s_per_block)
        if set(host) != set(OFFLOAD_MODES) or min(host.values()) < 0:
            raise ValueError(
                f"Topology {self.name!r}: host_s_per_block needs one value >= 0 per mode "
                f"{OFFLOAD_MODES}, got {self.host_s_per_block!r}"
            )

    def step_overhead_s(self, tokens: int, cfg_branches: int) -> float:
        """Per-step work outside the blocks of one request (0 when none was measured)."""
        if not self.step_overhead:
            return 0.0
        l0, g0, t0 = min(self.step_overhead, key=lambda r: (abs(r[0] - tokens), abs(r[1] - cfg_branches)))
        return t0 * tokens * cfg_branches / (l0 * g0)

    def request_overhead_s(self, tokens: int) -> float:
        """Per-request host work outside the ring (0 when none was measured)."""
        if not self.request_overhead:
            return 0.0
        l0, t0 = min(self.request_overhead, key=lambda r: abs(r[0] - tokens))
        return t0 * tokens / l0

    def host_s(self, mode: str) -> float:
        return dict(self.host_s_per_block)[mode]

    def source(self, field: str) -> str:
        return dict(self.sources).get(field, "")
