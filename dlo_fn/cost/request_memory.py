"""What one request needs on one rank, device and host, as a function of its shape: what admission checks.

Notation (bytes; per rank): ``f = 4`` (fp32), ``e`` the weight itemsize; for a request of ``N`` outputs per
prompt, ``B`` rows per forward (``N``, or ``2N`` with CFG), ``L`` tokens per sequence (``l = ceil(L / sp)`` on
this rank), ``E`` latent elements per output (``C T h w``), ``V`` its video bytes (``N F H W 3``, uint8), ``D``
the hidden width, ``d_h`` the head width, ``T_t, D_t`` the text length and width, ``u = B l D``::

    term           bytes                             what
    state          f E (N + B)                       the latents, and their CFG pair for the step's forward
    held           f B T_t D_t + 2 f u + f L d_h     text states, the embedding x0 and the running stream x,
                                                     the rotary tables: what a request keeps between block calls
    call           peak phase of one block call      :func:`dlo_fn.cost.sp_memory.sp_activations` (its own x0, x,
                                                     text and rotary terms included)
    output         3 V (+ f N E for the decode)      the decoded video, its serialised copy on the way to rank 0
                                                     (or the byte copy its hash reads), and the wire buffer

A rank holds up to ``R`` requests of one shape (continuous serving admits only one key per replica, a strict
wave gives each rank ``R`` of one key) and runs them block-major, so while one computes a block the others keep
their state and held terms. The decode runs on the host after the blocks::

    device (compute)   (R - 1) (state + held) + state + call
    host (decode)      f N E + 3 V
    one pool (CPU)     device + host                    compute and decode run one after the other, but the
                                                         heap keeps what the blocks freed (glibc returns little
                                                         of it), so the decode's bytes come on top

A model, not a measurement: allocator caching and fragmentation, Python objects and the kernels' own scratch (tens
of MB on the CPU: MKL's GEMM buffers) are not in it; admission keeps a reserve for them.
``tests/test_request_memory.py`` checks it against the peak RSS a real request adds on the CPU (within that scratch
below, and at most twice the measured above). :func:`largest_fitting` finds the largest size of a request's aspect
that a budget holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dlo_fn.cost.sp_memory import FP32_BYTES, BlockDims, sp_activations
from dlo_fn.plan.sizes import _check_positive

__all__ = ["RequestShape", "RequestMemory", "request_memory", "largest_fitting"]


@dataclass(frozen=True, slots=True)
class RequestShape:
    """One request's sizes (a model config and the request give them: ``dlo_fn.serve.admission``)."""

    tokens: int  # L
    outputs: int  # N
    rows: int  # B
    latent_elements: int  # E, per output
    video_bytes: int  # V, all outputs

    def __post_init__(self) -> None:
        for name in ("tokens", "outputs", "rows", "latent_elements", "video_bytes"):
            _check_positive(f"RequestShape.{name}", getattr(self, name))


@dataclass(frozen=True, slots=True)
class RequestMemory:
    """The terms of the module docstring for one request on one rank, and their sums for ``R`` held."""

    state_bytes: int
    held_bytes: int
    call_bytes: int
    decode_bytes: int  # f N E + 3 V
    requests_per_rank: int
    peak_phase: str

    @property
    def device_bytes(self) -> int:
        """Compute: ``(R - 1) (state + held) + state + call``."""
        r = self.requests_per_rank
        return (r - 1) * (self.state_bytes + self.held_bytes) + self.state_bytes + self.call_bytes

    @property
    def host_bytes(self) -> int:
        """Decode: ``f N E + 3 V``."""
        return self.decode_bytes

    @property
    def pool_bytes(self) -> int:
        """A CPU rank, where device and host are one pool: compute and decode together."""
        return self.device_bytes + self.host_bytes


def request_memory(dims: BlockDims, shape: RequestShape, *, sp: int = 1, requests_per_rank: int = 1) -> RequestMemory:
    """The module docstring's terms for ``shape`` on a rank of an ``sp``-rank replica holding
    ``requests_per_rank`` such requests."""
    if not isinstance(requests_per_rank, int) or requests_per_rank < 1:
        raise ValueError(f"requests_per_rank must be an int >= 1, got {requests_per_rank!r}")
    f = FP32_BYTES
    work = sp_activations(dims, shape.tokens, sp, shape.rows)
    u = shape.rows * work.local_tokens * dims.hidden_dim
    return RequestMemory(
        state_bytes=f * shape.latent_elements * (shape.outputs + shape.rows),
        held_bytes=f * shape.rows * dims.text_len * dims.text_dim + 2 * f * u + f * shape.tokens * dims.head_dim,
        call_bytes=work.peak_bytes,
        decode_bytes=f * shape.outputs * shape.latent_elements + 3 * shape.video_bytes,
        requests_per_rank=requests_per_rank,
        peak_phase=work.peak_phase.name,
    )


def largest_fitting(height: int, width: int, unit: int, fits: Callable[[int, int], bool]) -> tuple[int, int] | None:
    """The largest ``(h, w)`` of the aspect ``height : width``, both multiples of ``unit`` and at most the given
    size, for which ``fits(h, w)``; None when not even ``(unit, unit)``-ish fits. ``fits`` must be monotone (a
    smaller size of one shape never needs more)."""

    def size(k: int) -> tuple[int, int]:  # k units along the longer side, the other side in proportion
        if height >= width:
            return k * unit, max(unit, (k * width // height) * unit)
        return max(unit, (k * height // width) * unit), k * unit

    lo, hi = 0, max(height, width) // unit  # fits(size(lo)) holds (lo = 0: nothing yet), size(hi) is the request
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(*size(mid)):
            lo = mid
        else:
            hi = mid - 1
    return size(lo) if lo > 0 else None
