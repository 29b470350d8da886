"""Ulysses sequence parallelism (SP) for the reference DiT: tokens split for per-token work, heads for attention.

Notation: S = sp size, s = this rank's sp index, L = tokens of one sequence, H = heads, B = batch (CFG pair)::

    L_loc = ceil(L / S),  L_pad = S L_loc        rank s holds tokens [s L_loc, (s + 1) L_loc) of the sequence
                                                  zero-padded at its end to L_pad (only the last ranks hold pads)
    per-token work (norms, adaLN, linears, MLP, cross-attention queries, rotary): x [B, L_loc, D] on each rank
    self-attention:   q, k, v [B, L_loc, H, hd] --all_to_all--> [B, L_pad, H / S, hd] --drop pads--> [B, L, H / S, hd]
                      attention over the whole real sequence on local heads, pad back, --all_to_all--> [B, L_loc, H, hd]
    head:             out [B, L_loc, P] --all_gather--> [B, L_pad, P] --drop pads--> [B, L, P] on every sp rank

Padding, not rejection: any video shape runs at any S, for at most S - 1 extra rows of per-token work. The
padded tokens are masked by construction: the only operation that mixes tokens is self-attention, and it sees
the L real tokens only (the pads are sliced off, not masked with -inf, so SDPA runs its unmasked kernel on
exactly the single-process operands); a pad row's own outputs are dropped by the head. Text states and the
adaLN conditioning are per sample and replicated on every sp rank. Heads must divide by S (rejected otherwise).

Bit-exactness with the single process rests on every per-token kernel giving a row the same bits whatever rows
come with it: :func:`dlo_fn.models.layers.linear` and :func:`dlo_fn.models.layers.attention` pad short CPU
GEMMs and query blocks to make it so (measured, see there); norms run row by row; elementwise ops see rows of
D channels, D a multiple of the vector width in every named config. The self-attention sees the single
process's L queries and keys, only with H / S of the heads, each of which SDPA computes on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["SPContext", "TokenShard", "check_sp_heads", "sp_of"]


@dataclass(frozen=True, slots=True)
class SPContext:
    """This rank's place in its sp group: the ``group`` (a ``torch.distributed`` process group holding the
    ``size`` ranks that run one request together; None only when size is 1) and its ``rank`` within it."""

    group: Any
    size: int
    rank: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"SPContext: need size >= 1 and 0 <= rank < size, got size={self.size} rank={self.rank}")
        if self.group is None and self.size > 1:
            raise ValueError(f"SPContext: sp size {self.size} needs a process group")

    @classmethod
    def from_group(cls, group: Any) -> "SPContext":
        """The context of the calling rank in ``group`` (e.g. ``mesh.get_group("sp")``)."""
        return cls(group, dist.get_world_size(group), dist.get_rank(group))


def sp_of(mesh: Any) -> SPContext | None:
    """What the model's ``sp=`` argument takes on a rank of ``mesh`` (a :class:`dlo_fn.runtime.mesh.Mesh`: its
    ``sp_group``, ``sp_size`` and ``sp_rank``); None when sp is 1 (the single-process path)."""
    return SPContext(mesh.sp_group, mesh.sp_size, mesh.sp_rank) if mesh.sp_size > 1 else None


def check_sp_heads(num_heads: int, sp_size: int) -> None:
    """``ValueError`` unless ``num_heads`` divides by ``sp_size`` (each sp rank attends with H / S heads)."""
    if num_heads % sp_size:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"num_heads {num_heads} is not divisible by sp {sp_size}: Ulysses SP gives each sp rank "
            f"num_heads / sp heads; use sp in {divisors}"
        )


@dataclass(frozen=True, slots=True)
class TokenShard:
    """This rank's slice of one sequence of ``num_tokens`` tokens (see the module docstring for the math)."""

    context: SPContext
    num_tokens: int

    @property
    def local_tokens(self) -> int:
        return -(-self.num_tokens // self.context.size)

    @property
    def padded_tokens(self) -> int:
        return self.local_tokens * self.context.size

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a full sequence along ``dim`` (zero rows past the end), contiguous."""
        start = self.context.rank * self.local_tokens
        part = x.narrow(dim, min(start, x.shape[dim]), max(0, min(self.local_tokens, x.shape[dim] - start)))
        missing = self.local_tokens - part.shape[dim]
        if missing:
            shape = list(x.shape)
            shape[dim] = missing
            part = torch.cat([part, x.new_zeros(shape)], dim=dim)
        return part.contiguous()

    def _all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """``send`` [S, ...]: chunk j goes to sp rank j; returns [S, ...] whose chunk i came from sp rank i."""
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.context.group)
        return recv

    def tokens_to_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """[n, B, L_loc, H, hd] (n stacked tensors, e.g. q, k, v) -> [n, B, L, H / S, hd]: every real token of
        this rank's head group."""
        n, b, loc, heads, hd = qkv.shape
        size = self.context.size
        send = qkv.unflatten(3, (size, heads // size)).permute(3, 0, 1, 2, 4, 5).contiguous()
        recv = self._all_to_all(send)  # [S (token chunk), n, B, L_loc, H / S, hd]
        full = recv.permute(1, 2, 0, 3, 4, 5).reshape(n, b, size * loc, heads // size, hd)
        return full[:, :, : self.num_tokens]

    def heads_to_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """[B, L, H / S * hd] attention output of this rank's heads -> [B, L_loc, H * hd] of its tokens."""
        size, loc = self.context.size, self.local_tokens
        b, _, width = out.shape
        out = F.pad(out, (0, 0, 0, self.padded_tokens - self.num_tokens))
        send = out.reshape(b, size, loc, width).permute(1, 0, 2, 3).contiguous()
        recv = self._all_to_all(send)  # [S (head group), B, L_loc, H / S * hd]
        return recv.permute(1, 2, 0, 3).reshape(b, loc, size * width)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L_loc, ...] on each sp rank -> the whole real sequence [B, L, ...] on every sp rank."""
        size = self.context.size
        x = x.contiguous()
        every = x.new_empty((size * x.shape[0], *x.shape[1:]))
        # torch 2.13 deprecates all_gather_into_tensor for all_gather_single, which torch 2.11 lacks.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(every, x, group=self.context.group)
        every = every.unflatten(0, (size, x.shape[0])).transpose(0, 1).flatten(1, 2)
        return every[:, : self.num_tokens]
