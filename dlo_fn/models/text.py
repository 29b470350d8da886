"""Byte-level text encoder: prompts are real inputs, and the encoder ships inside the checkpoint.

Tokens are the prompt's UTF-8 bytes (0..255) after a BOS token (256), padded with PAD (257) to
``config.text_len``. No truncation: a prompt that does not fit is rejected by ``Request.validate``. The
encoder is a small pre-norm transformer (learned positions, no mask: padding is part of the input, as with
zero-padded T5 features in Wan-style DiTs), resident on the device, never offloaded.
"""

from __future__ import annotations

import torch
from torch import nn

from dlo_fn.models.config import DiTConfig
from dlo_fn.models.layers import Linear, RMSNorm, attention

__all__ = ["BOS", "PAD", "VOCAB_SIZE", "tokenize", "max_prompt_bytes", "ByteTextEncoder"]

BOS = 256
PAD = 257
VOCAB_SIZE = 258


def max_prompt_bytes(config: DiTConfig) -> int:
    """Longest prompt (in UTF-8 bytes) the model reads: text_len minus the BOS token."""
    return config.text_len - 1


def tokenize(prompts: str | list[str] | tuple[str, ...], text_len: int) -> torch.Tensor:
    """[B, text_len] int64 tokens on the CPU: BOS, the UTF-8 bytes, then PAD. ``ValueError`` if a prompt is too long."""
    if isinstance(prompts, str):
        prompts = [prompts]
    rows = []
    for i, prompt in enumerate(prompts):
        data = prompt.encode("utf-8")
        if len(data) > text_len - 1:
            raise ValueError(
                f"prompt {i} is {len(data)} UTF-8 bytes; this model reads at most {text_len - 1} "
                f"(text_len {text_len} minus BOS): shorten it"
            )
        rows.append([BOS, *data] + [PAD] * (text_len - 1 - len(data)))
    return torch.tensor(rows, dtype=torch.int64)


class TextLayer(nn.Module):
    """Pre-norm transformer layer: x + attn(norm(x)); x + mlp(norm(x))."""

    def __init__(self, config: DiTConfig, device=None, dtype=None):
        super().__init__()
        dim, kw = config.text_dim, {"device": device, "dtype": dtype}
        self.num_heads = config.text_heads
        self.norm1 = RMSNorm(dim, config.norm_eps, device=device)
        self.qkv = Linear(dim, 3 * dim, bias=False, **kw)
        self.out = Linear(dim, dim, bias=False, **kw)
        self.norm2 = RMSNorm(dim, config.norm_eps, device=device)
        self.fc1 = Linear(dim, config.text_mlp_dim, **kw)
        self.fc2 = Linear(config.text_mlp_dim, dim, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, self.num_heads, -1)).unbind(2)
        x = x + self.out(attention(q, k, v)).float()
        h = self.fc1(self.norm2(x))
        return x + self.fc2(nn.functional.gelu(h, approximate="tanh")).float()


class ByteTextEncoder(nn.Module):
    """tokens [B, text_len] -> text states [B, text_len, text_dim] (fp32)."""

    def __init__(self, config: DiTConfig, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        # An explicit (empty) weight skips nn.Embedding's normal_ init: on meta that first call imports torch's
        # reference decompositions, a start-up cost per process; weights come from dlo_fn.models.init anyway.
        self.token_embed = nn.Embedding(
            VOCAB_SIZE, config.text_dim, _weight=torch.empty(VOCAB_SIZE, config.text_dim, **kw)
        )
        self.pos_embed = nn.Parameter(torch.zeros(config.text_len, config.text_dim, **kw))
        self.layers = nn.ModuleList(TextLayer(config, device, dtype) for _ in range(config.text_layers))
        self.norm = RMSNorm(config.text_dim, config.norm_eps, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[-1] != self.pos_embed.shape[0]:
            raise ValueError(
                f"text tokens have length {tokens.shape[-1]}, the encoder expects {self.pos_embed.shape[0]} "
                f"(use dlo_fn.models.text.tokenize(prompts, config.text_len))"
            )
        x = self.token_embed(tokens).float() + self.pos_embed.float()
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)
