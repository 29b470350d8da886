"""Building blocks shared by the DiT and its text encoder, written for bit-exact reproducibility.

Precision policy (the same in every dtype): linear and embedding weights are stored in the checkpoint dtype
(bf16 or fp32); norm weights are always fp32, so a bf16 block holds tensors of two dtypes (what the runtime
must pack into one flat buffer). Norms, modulation, rotary positions and the residual stream are computed in
fp32; matmuls and attention run in the weight dtype (attention accumulates its softmax in fp32 internally).

Determinism: everything here is a fixed sequence of torch ops whose result depends only on the input values,
not on the thread count or on where the weights live (the runtime runs blocks from views into a flat slot
buffer at arbitrary 256-byte-aligned offsets), nor on how many rows (tokens) come in one call, which is what
lets a sequence-parallel rank compute a slice of the tokens with the single process's bits. The measured
exceptions (short row counts in MKL's fp32 sgemm and in the CPU SDPA query blocks) are worked around in
:func:`linear` and :func:`attention`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "linear",
    "RMSNorm",
    "layer_norm",
    "modulate",
    "gated_residual",
    "apply_rope",
    "rope_angles",
    "timestep_features",
    "attention",
]

# MKL's fp32 sgemm (torch 2.13 CPU) gives thread-count-dependent bits for 5..11 rows (measured: rows 5, 6, 7,
# 9, 10, 11 differ between 1 and 2 threads for K in 16..1024); 16 rows and more, and bf16 (oneDNN), do not.
# Padding short fp32 inputs to 16 rows keeps the result a function of the values only.
_MIN_FP32_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` in the weight's dtype, thread-count independent on CPU (see ``_MIN_FP32_ROWS``)."""
    x = x.to(weight.dtype)
    rows = x.numel() // max(x.shape[-1], 1)
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and 0 < rows < _MIN_FP32_ROWS:
        flat = x.reshape(rows, x.shape[-1])
        padded = torch.cat([flat, flat.new_zeros(_MIN_FP32_ROWS - rows, flat.shape[-1])])
        return F.linear(padded, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` routed through :func:`linear`; ``init_gain`` scales its random init (see init.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, init_gain: float = 1.0, **kw):
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.init_gain = init_gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` in fp32; the weight is always fp32, whatever the checkpoint dtype."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps)


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Affine-free LayerNorm in fp32 (the adaLN shift / scale supply the affine part)."""
    return F.layer_norm(x.float(), (x.shape[-1],), eps=eps)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: ``x * (1 + scale) + shift`` with per-sample [B, D] shift / scale over [B, L, D] tokens (one kernel)."""
    return torch.addcmul(shift[:, None, :], x, 1.0 + scale[:, None, :])


def gated_residual(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``x + gate * out`` for the fp32 residual stream x [B, L, D], per-sample gate [B, D] and a sublayer output
    in the weight dtype, promoted to fp32 inside one kernel (no fp32 copy of ``out``)."""
    return torch.addcmul(x, gate[:, None, :], out)


def rope_inv_freq(rope_dims: tuple[int, int, int], theta: float) -> torch.Tensor:
    """Concatenated per-axis inverse frequencies ``theta^(-2i/d_a)``, i < d_a/2, for axes (t, h, w): [head_dim/2]."""
    parts = [theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) for d in rope_dims]
    return torch.cat(parts).to(torch.float32)


def rope_angles(grid: tuple[int, int, int], rope_dims: tuple[int, int, int], inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotation angles [L, head_dim/2] of a (T, H, W) token grid, tokens in row-major (t, h, w) order:
    angle[l, i] = pos_a(l) * inv_freq[i] where a is the axis channel pair i belongs to."""
    device = inv_freq.device
    t, h, w = (torch.arange(n, device=device, dtype=torch.float32) for n in grid)
    pos = torch.stack(torch.meshgrid(t, h, w, indexing="ij"), dim=-1).reshape(-1, 3)  # [L, 3]
    axis = torch.repeat_interleave(
        torch.arange(3, device=device), torch.tensor([d // 2 for d in rope_dims], device=device)
    )
    return pos[:, axis] * inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of x [B, L, heads, head_dim] by the angles behind cos / sin
    [L, head_dim/2], in fp32: one complex multiply by cos + i sin."""
    pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * torch.complex(cos, sin)[:, None, :]).flatten(-2)


def timestep_features(timestep: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features [B, dim] of timesteps [B] (fp32): (cos(t f_i), sin(t f_i)), f_i = max_period^(-i/(dim/2))."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
    angles = timestep.float()[:, None] * freqs[None, :]
    return torch.cat((torch.cos(angles), torch.sin(angles)), dim=-1)


# CPU SDPA (flash kernel, torch 2.13) cuts the queries into blocks of 32 / 64 / 256 rows; a last block of 1-3
# rows takes another path and gives other bits for the same query (fp32 at every head_dim; bf16 at head_dim 64),
# so a query's result depended on how many queries came with it (measured: 67 queries vs 96, rows 64-66 differ;
# fp32 1-3 queries also differ between 1 and 2 threads). Queries are independent rows: pad their count to a
# multiple of 16 and every block is >= 16 rows, which measured row-count independent (n = 1..1000, keys 30..512).
_QUERY_MULTIPLE = 16


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked softmax attention over [B, L, heads, head_dim] inputs; returns [B, L, heads * head_dim].

    On CPU each query's bits are a function of its values, k and v only, not of the number of queries in the
    call (see ``_QUERY_MULTIPLE``): what lets sequence-parallel ranks attend with a slice of the queries."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    n = q.shape[-2]
    if q.device.type == "cpu" and n % _QUERY_MULTIPLE:
        pad = q.new_zeros(*q.shape[:-2], _QUERY_MULTIPLE - n % _QUERY_MULTIPLE, q.shape[-1])
        out = F.scaled_dot_product_attention(torch.cat([q, pad], dim=-2), k, v)[..., :n, :]
    else:
        out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).flatten(2)
