"""The reference video DiT: embed -> N blocks -> head, in plain torch.

Shapes (B = batch, including both CFG branches; L = tokens; D = hidden_dim; D_t = text_dim)::

    latents [B, C, T, H, W] --patchify--> [B, L, C p_t p_h p_w] --patch_embed--> x [B, L, D]  (fp32)
    timestep [B]  --sinusoid, MLP, SiLU--> cond [B, D_c]                                       (fp32)
    text_tokens [B, text_len] --ByteTextEncoder--> text [B, text_len, D_t]                   (fp32)
    x = block(x, cond=cond, text=text, rope_cos=cos, rope_sin=sin)   for block in self.blocks
    head: adaLN final norm, linear to C p_t p_h p_w, unpatchify -> velocity [B, C, T, H, W]   (fp32)

Contract with the offload runtime (``dlo_fn.runtime``):

* ``forward`` calls ``for block in self.blocks: x = block(x, **kwargs)`` with tensor-only arguments, so each
  entry of ``self.blocks`` may be swapped for a proxy that runs
  ``torch.func.functional_call(block, weight_views, (x,), kwargs)``. A block reads nothing but its own
  parameters and its arguments (rotary tables arrive as ``rope_cos`` / ``rope_sin``).
* Staged API for block-major engines: ``state = model.embed(...)``; ``x = model.blocks[i](x, **state.block_kwargs)``;
  ``out = model.head(x, state)``. ``forward`` is literally that sequence, so both agree bit for bit.
* The only non-persistent buffer, ``rope_inv_freq``, lives outside the blocks and is recomputed by
  :meth:`VideoDiT.init_buffers` (call it after binding weights to a meta-built model; ``to_empty`` calls it).

Sequence parallelism (Ulysses, :mod:`dlo_fn.models.sp`): ``forward`` / ``embed`` take ``sp=SPContext(...)``;
``state.x`` then holds this rank's L_loc tokens, ``state.block_kwargs`` gains ``sp`` (a :class:`TokenShard`,
the one non-tensor argument, passed through by the runtime's block calls), and ``head`` all-gathers the tokens
so every sp rank returns the whole [B, C, T, H, W] velocity, equal bit for bit to the single process's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dlo_fn.models.config import DiTConfig
from dlo_fn.models.init import init_weights
from dlo_fn.models.layers import (
    Linear,
    RMSNorm,
    apply_rope,
    attention,
    gated_residual,
    layer_norm,
    modulate,
    rope_angles,
    rope_inv_freq,
    timestep_features,
)
from dlo_fn.models.sp import SPContext, TokenShard, check_sp_heads
from dlo_fn.models.text import ByteTextEncoder

__all__ = ["BLOCK_PATHS", "DiTBlock", "EmbedState", "VideoDiT", "build_model", "DTYPES"]

BLOCK_PATHS = ("blocks",)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


class Modulation(nn.Module):
    """cond [B, D_c] -> n_out adaLN values: full rank (``proj``) or low rank (``down`` then ``up``)."""

    def __init__(self, cond_dim: int, rank: int, n_out: int, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        if rank:
            self.down = Linear(cond_dim, rank, bias=False, **kw)
            self.up = Linear(rank, n_out, bias=False, init_gain=0.5, **kw)
        else:
            self.proj = Linear(cond_dim, n_out, init_gain=0.5, **kw)

    def forward(self, cond: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "proj"):
            return self.proj(cond).float()
        return self.up(self.down(cond)).float()


class SelfAttention(nn.Module):
    def __init__(self, config: DiTConfig, device=None, dtype=None):
        super().__init__()
        d, kw = config.hidden_dim, {"device": device, "dtype": dtype}
        self.num_heads = config.num_heads
        self.qkv = Linear(d, 3 * d, bias=False, **kw)
        self.out = Linear(d, d, bias=False, **kw)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps, device=device)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps, device=device)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sp: TokenShard | None = None
    ) -> torch.Tensor:
        # [B, L, heads, head_dim] views: the norms and rotations run on rows of contiguous head_dim channels.
        q, k, v = self.qkv(h).unflatten(-1, (3, self.num_heads, -1)).unbind(2)
        q = apply_rope(self.q_norm(q), cos, sin).to(v.dtype)
        k = apply_rope(self.k_norm(k), cos, sin).to(v.dtype)
        if sp is None:
            return self.out(attention(q, k, v))
        # Ulysses: norms and rotary ran on this rank's tokens; attend over every token with 1/S of the heads.
        q, k, v = sp.tokens_to_heads(torch.stack([q, k, v])).unbind(0)
        return self.out(sp.heads_to_tokens(attention(q, k, v)))


class CrossAttention(nn.Module):
    def __init__(self, config: DiTConfig, device=None, dtype=None):
        super().__init__()
        d, kw = config.hidden_dim, {"device": device, "dtype": dtype}
        self.num_heads = config.num_heads
        self.q = Linear(d, d, bias=False, **kw)
        self.kv = Linear(config.text_dim, 2 * d, bias=False, **kw)
        self.out = Linear(d, d, bias=False, **kw)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps, device=device)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps, device=device)

    def forward(self, h: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        k, v = self.kv(text).unflatten(-1, (2, self.num_heads, -1)).unbind(2)
        q = self.q_norm(self.q(h).unflatten(-1, (self.num_heads, -1))).to(v.dtype)
        return self.out(attention(q, self.k_norm(k).to(v.dtype), v))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, device=None, dtype=None):
        super().__init__()
        self.fc1 = Linear(dim, hidden, device=device, dtype=dtype)
        self.fc2 = Linear(hidden, dim, device=device, dtype=dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


class DiTBlock(nn.Module):
    """adaLN block: x += g1 attn(mod(norm x)); x += g2 xattn(mod(norm x), text); x += g3 mlp(mod(norm x)),
    where (shift, scale, gate) x 3 = modulation(cond). All inputs and the residual stream are fp32; sublayers
    return the weight dtype and are added in fp32 (``gated_residual``)."""

    def __init__(self, config: DiTConfig, device=None, dtype=None):
        super().__init__()
        self.eps = config.norm_eps
        self.modulation = Modulation(config.cond_dim, config.adaln_rank, 9 * config.hidden_dim, device, dtype)
        self.self_attn = SelfAttention(config, device, dtype)
        self.cross_attn = CrossAttention(config, device, dtype)
        self.mlp = MLP(config.hidden_dim, config.mlp_dim, device, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cond: torch.Tensor,
        text: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        sp: TokenShard | None = None,
    ) -> torch.Tensor:
        """x [B, L, D] (with ``sp``: this rank's [B, L_loc, D] and rotary rows); text is never split."""
        m = self.modulation(cond).chunk(9, dim=-1)
        h = modulate(layer_norm(x, self.eps), m[0], m[1])
        x = gated_residual(x, m[2], self.self_attn(h, rope_cos, rope_sin, sp))
        x = gated_residual(x, m[5], self.cross_attn(modulate(layer_norm(x, self.eps), m[3], m[4]), text))
        return gated_residual(x, m[8], self.mlp(modulate(layer_norm(x, self.eps), m[6], m[7])))


@dataclass(frozen=True, slots=True)
class EmbedState:
    """What :meth:`VideoDiT.embed` produces: the first hidden states and everything the blocks and the head read."""

    x: torch.Tensor  # [B, L, D] fp32 ([B, L_loc, D] with sp)
    cond: torch.Tensor  # [B, D_c] fp32, already SiLU-activated
    text: torch.Tensor  # [B, text_len, D_t] fp32
    rope_cos: torch.Tensor  # [L, head_dim / 2] fp32 ([L_loc, head_dim / 2] with sp)
    rope_sin: torch.Tensor
    grid: tuple[int, int, int]  # token grid (T / p_t, H / p_h, W / p_w)
    sp: TokenShard | None = None  # this rank's tokens under sequence parallelism

    @property
    def block_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "cond": self.cond,
            "text": self.text,
            "rope_cos": self.rope_cos,
            "rope_sin": self.rope_sin,
        }
        if self.sp is not None:
            kwargs["sp"] = self.sp
        return kwargs


class VideoDiT(nn.Module):
    def __init__(self, config: DiTConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        d, kw = config.hidden_dim, {"device": device, "dtype": dtype}
        self.text_encoder = ByteTextEncoder(config, device, dtype)
        self.patch_embed = Linear(config.patch_dim, d, **kw)
        self.time_fc1 = Linear(config.freq_dim, config.cond_dim, **kw)
        self.time_fc2 = Linear(config.cond_dim, config.cond_dim, **kw)
        self.blocks = nn.ModuleList(DiTBlock(config, device, dtype) for _ in range(config.num_blocks))
        self.final_modulation = Modulation(config.cond_dim, 0, 2 * d, device, dtype)
        self.final_linear = Linear(d, config.patch_dim, **kw)
        inv_freq = torch.empty(config.head_dim // 2, device=device, dtype=torch.float32)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.patch_embed.weight.device

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the non-persistent rotary table (never stored in checkpoints) on ``device``
        (default: where the weights are)."""
        device = self.device if device is None else torch.device(device)
        self.rope_inv_freq = rope_inv_freq(self.config.rope_dims, self.config.rope_theta).to(device)

    def to_empty(self, *, device, recurse: bool = True) -> "VideoDiT":
        """``nn.Module.to_empty``, then the derived rotary table is recomputed rather than left uninitialised."""
        super().to_empty(device=device, recurse=recurse)
        self.init_buffers(device)
        return self

    def patchify(self, latents: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        b, c, t, h, w = latents.shape
        pt, ph, pw = self.config.patch_size
        if c != self.config.latent_channels or t % pt or h % ph or w % pw:
            raise ValueError(
                f"latents of shape {tuple(latents.shape)}: expected [B, {self.config.latent_channels}, T, H, W] "
                f"with T, H, W divisible by patch {self.config.patch_size}"
            )
        grid = (t // pt, h // ph, w // pw)
        x = latents.reshape(b, c, grid[0], pt, grid[1], ph, grid[2], pw)
        return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, -1, self.config.patch_dim), grid

    def unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        b, c = x.shape[0], self.config.latent_channels
        pt, ph, pw = self.config.patch_size
        x = x.reshape(b, *grid, c, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(b, c, grid[0] * pt, grid[1] * ph, grid[2] * pw)

    def encode_text(self, text_tokens: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(text_tokens)

    def embed(self, latents, timestep, text_tokens, text_states=None, *, sp: SPContext | None = None) -> EmbedState:
        """Everything before the blocks (the arguments of :meth:`forward`). ``text_states`` (from
        :meth:`encode_text`) skips re-encoding. With ``sp`` (size > 1) the tokens and rotary rows are cut to this
        rank's share before the patch embedding."""
        if self.rope_inv_freq.is_meta and not latents.is_meta:
            raise RuntimeError(
                "VideoDiT.rope_inv_freq is a non-persistent buffer still on the meta device: call "
                "model.init_buffers(device) after binding the weights"
            )
        tokens, grid = self.patchify(latents)
        angles = rope_angles(grid, self.config.rope_dims, self.rope_inv_freq)
        cos, sin, shard = torch.cos(angles), torch.sin(angles), None
        if sp is not None and sp.size > 1:
            check_sp_heads(self.config.num_heads, sp.size)
            shard = TokenShard(sp, tokens.shape[1])
            # The small rotary tables are computed whole and then cut, so no vectorised-loop tail can differ.
            tokens, cos, sin = shard.local(tokens, dim=1), shard.local(cos, dim=0), shard.local(sin, dim=0)
        x = self.patch_embed(tokens).float()
        cond = F.silu(self.time_fc2(F.silu(self.time_fc1(timestep_features(timestep, self.config.freq_dim)))).float())
        text = self.encode_text(text_tokens) if text_states is None else text_states
        return EmbedState(x, cond, text.float(), cos, sin, grid, shard)

    def head(self, x: torch.Tensor, state: EmbedState) -> torch.Tensor:
        """Everything after the blocks: final adaLN norm, projection, unpatchify -> [B, C, T, H, W] fp32 (with
        sp: the tokens of every sp rank gathered, the same whole output on each)."""
        shift, scale = self.final_modulation(state.cond).chunk(2, dim=-1)
        out = self.final_linear(modulate(layer_norm(x, self.config.norm_eps), shift, scale)).float()
        if state.sp is not None:
            out = state.sp.gather(out)
        return self.unpatchify(out, state.grid)

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text_tokens: torch.Tensor,
        text_states: torch.Tensor | None = None,
        *,
        sp: SPContext | None = None,
    ) -> torch.Tensor:
        state = self.embed(latents, timestep, text_tokens, text_states, sp=sp)
        x, kwargs = state.x, state.block_kwargs
        for block in self.blocks:
            x = block(x, **kwargs)
        return self.head(x, state)


def build_model(
    config: DiTConfig | str,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.bfloat16,
    *,
    seed: int = 0,
) -> VideoDiT:
    """A :class:`VideoDiT` for ``config`` (or a name in ``CONFIGS``) in eval mode.

    ``device="meta"``: no storage, instant for any size (the loader binds checkpoint views later, then calls
    :meth:`VideoDiT.init_buffers`). Any other device: weights initialised from ``seed`` exactly as
    ``write_checkpoint(config, ..., seed=seed, dtype=dtype)`` writes them.
    """
    if isinstance(config, str):
        from dlo_fn.models.configs import get_config

        config = get_config(config)
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype {dtype} not supported; use one of {sorted(DTYPES)} ({list(DTYPES.values())})")
    device = torch.device(device)
    with torch.device("meta"):
        model = VideoDiT(config, dtype=dtype)
    model.eval().requires_grad_(False)
    if device.type != "meta":
        # Fresh storage tensor by tensor: nn.Module.to_empty would give the same, but its meta empty_like
        # imports sympy on first use, a start-up cost every test rank would pay.
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    empty = torch.empty(p.shape, dtype=p.dtype, device=device)
                    module._parameters[name] = nn.Parameter(empty, requires_grad=False)
        init_weights(model, seed)
        model.init_buffers(device)
    return model
