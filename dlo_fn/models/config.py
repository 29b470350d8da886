"""Model shape as data: :class:`DiTConfig` and the pixel -> latent -> token arithmetic.

Notation (one request, before classifier-free guidance doubles the batch)::

    pixels   F x H x W x 3            F = num_frames, H = height, W = width
    latents  C x T x h x w            T = 1 + (F - 1) / vae_temporal, h = H / vae_spatial, w = W / vae_spatial
    tokens   L = (T / p_t) * (h / p_h) * (w / p_w)          (p_t, p_h, p_w) = patch_size

The "VAE" factors describe the latent space the DiT works in (8x spatial, 4x causal temporal compression, as
in the Wan / Cosmos video VAEs); the reference sampler decodes with a fixed linear stand-in, not a real VAE.
With the defaults (C = 16, 8x / 4x, patch 1 x 2 x 2):

    1024 x 1024 image        T = 1,  h x w = 128 x 128  ->  L = 64 * 64        =  4096
    832 x 480, 29 frames     T = 8,  h x w = 60 x 104   ->  L = 8 * 30 * 52    = 12480
    1280 x 720, 81 frames    T = 21, h x w = 90 x 160   ->  L = 21 * 45 * 80   = 75600

(81 frames is "10 s" at 8 fps; the published 241-frame 720p runs are L = 61 * 3600 = 219600.)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["DiTConfig", "latent_shape", "tokens_for", "check_video_shape", "check_known_fields"]


@dataclass(frozen=True, slots=True)
class DiTConfig:
    """Every size of the reference video DiT (:mod:`dlo_fn.models.dit`).

    Per block, with D = hidden_dim, M = mlp_dim, D_t = text_dim, r = adaln_rank, D_c = cond_dim::

        adaLN modulation   D_c * r + r * 9D          (r = 0: full adaLN, D_c * 9D)
        self-attention     4 D^2                     (fused qkv + out, no bias) + 2 head_dim fp32 qk-norm
        cross-attention    2 D^2 + 2 D D_t           (q, out from D; k, v from the text) + 2 head_dim fp32
        MLP                2 D M + M + D             (GELU, with biases)

    so a block is ~ (6 + 2 M / D) D^2 parameters; ``source`` says where each size comes from.
    """

    name: str
    num_blocks: int
    hidden_dim: int
    num_heads: int
    mlp_dim: int
    cond_dim: int  # width of the timestep embedding that drives adaLN
    adaln_rank: int  # 0 = full-rank modulation; > 0 = adaLN-LoRA (Cosmos-Predict style)
    text_dim: int
    text_heads: int
    text_layers: int
    text_mlp_dim: int
    text_len: int  # byte tokens per prompt, BOS included
    latent_channels: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    vae_spatial: int = 8
    vae_temporal: int = 4
    freq_dim: int = 256  # sinusoidal timestep features
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        positive = (
            "num_blocks",
            "hidden_dim",
            "num_heads",
            "mlp_dim",
            "cond_dim",
            "text_dim",
            "text_heads",
            "text_layers",
            "text_mlp_dim",
            "text_len",
            "latent_channels",
            "vae_spatial",
            "vae_temporal",
            "freq_dim",
        )
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DiTConfig {self.name!r}: {field} must be a positive int, got {value!r}")
        if self.adaln_rank < 0:
            raise ValueError(f"DiTConfig {self.name!r}: adaln_rank must be >= 0, got {self.adaln_rank}")
        if len(self.patch_size) != 3 or min(self.patch_size) <= 0:
            raise ValueError(f"DiTConfig {self.name!r}: patch_size must be 3 positive ints, got {self.patch_size}")
        if self.hidden_dim % self.num_heads:
            raise ValueError(
                f"DiTConfig {self.name!r}: hidden_dim {self.hidden_dim} is not divisible by num_heads {self.num_heads}"
            )
        if self.text_dim % self.text_heads:
            raise ValueError(
                f"DiTConfig {self.name!r}: text_dim {self.text_dim} is not divisible by text_heads {self.text_heads}"
            )
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(
                f"DiTConfig {self.name!r}: head_dim {self.head_dim} must be even and >= 6 (3D rotary positions)"
            )
        if self.freq_dim % 2:
            raise ValueError(f"DiTConfig {self.name!r}: freq_dim must be even, got {self.freq_dim}")
        if self.text_len < 2:
            raise ValueError(f"DiTConfig {self.name!r}: text_len must be >= 2 (BOS + one byte)")
        if not (self.rope_theta > 1.0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"DiTConfig {self.name!r}: rope_theta must be a finite number > 1")
        if not (0.0 < self.norm_eps < 1.0):
            raise ValueError(f"DiTConfig {self.name!r}: norm_eps must be in (0, 1)")

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """Rotary channels per axis (t, h, w), each even, summing to head_dim: h and w get 2 * (head_dim // 6)
        each, time the rest (head_dim 128 -> 44 / 42 / 42)."""
        hw = 2 * (self.head_dim // 6)
        return (self.head_dim - 2 * hw, hw, hw)

    @property
    def patch_dim(self) -> int:
        """Latent values per token: C * p_t * p_h * p_w."""
        return self.latent_channels * math.prod(self.patch_size)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples become lists); :meth:`from_dict` inverts it."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["patch_size"] = list(self.patch_size)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DiTConfig":
        check_known_fields(cls, data)
        missing = sorted(
            f.name for f in dataclasses.fields(cls) if f.name not in data and f.default is dataclasses.MISSING
        )
        if missing:
            raise ValueError(f"DiTConfig.from_dict: missing field(s) {missing}")
        kwargs = dict(data)
        if "patch_size" in kwargs:
            kwargs["patch_size"] = tuple(kwargs["patch_size"])
        return cls(**kwargs)


def check_known_fields(cls: type, data: Mapping[str, Any]) -> None:
    """``ValueError`` naming every key of ``data`` that is not a field of dataclass ``cls``."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{cls.__name__}.from_dict: unknown field(s) {unknown}; known: {sorted(known)}")


def check_video_shape(config: DiTConfig, height: int, width: int, num_frames: int) -> None:
    """Raise ``ValueError`` naming the field (height, width or num_frames) the model cannot patchify."""
    _, p_h, p_w = config.patch_size
    for field, value, patch in (("height", height, p_h), ("width", width, p_w)):
        step = config.vae_spatial * patch
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % step:
            raise ValueError(
                f"{field}={value!r}: must be a positive multiple of {step} "
                f"(vae_spatial {config.vae_spatial} x patch {patch}) for model {config.name!r}"
            )
    if not isinstance(num_frames, int) or isinstance(num_frames, bool) or num_frames <= 0:
        raise ValueError(f"num_frames={num_frames!r}: must be a positive int")
    if (num_frames - 1) % config.vae_temporal:
        raise ValueError(
            f"num_frames={num_frames}: must be 1 + a multiple of vae_temporal {config.vae_temporal} "
            f"(e.g. 1, {1 + config.vae_temporal}, {1 + 4 * config.vae_temporal}) for model {config.name!r}"
        )
    latent_frames = 1 + (num_frames - 1) // config.vae_temporal
    if latent_frames % config.patch_size[0]:
        raise ValueError(
            f"num_frames={num_frames}: {latent_frames} latent frames are not divisible by the temporal patch "
            f"{config.patch_size[0]}"
        )


def latent_shape(config: DiTConfig, height: int, width: int, num_frames: int) -> tuple[int, int, int, int]:
    """(C, T, h, w) of one video's latents; raises ``ValueError`` for shapes the model cannot patchify."""
    check_video_shape(config, height, width, num_frames)
    return (
        config.latent_channels,
        1 + (num_frames - 1) // config.vae_temporal,
        height // config.vae_spatial,
        width // config.vae_spatial,
    )


def token_grid(config: DiTConfig, latent: tuple[int, int, int, int]) -> tuple[int, int, int]:
    """(T / p_t, h / p_h, w / p_w): the token grid of a (C, T, h, w) latent."""
    _, t, h, w = latent
    p_t, p_h, p_w = config.patch_size
    return (t // p_t, h // p_h, w // p_w)


def tokens_for(config: DiTConfig, height: int, width: int, num_frames: int) -> int:
    """Sequence length L of one video (one CFG branch): see the module docstring for worked examples."""
    return math.prod(token_grid(config, latent_shape(config, height, width, num_frames)))
