"""Latents -> uint8 video: a fixed, exactly reproducible stand-in for a VAE decoder.

For latents z [N, C, T, h, w] (fp32, CPU) and a fixed projection P [C, 3]::

    rgb[n, t, y, x, :] = sum_c z[n, c, t, y, x] P[c, :]            (summed in channel order, fp32)
    pixel              = round(255 (clamp(rgb, -1, 1) + 1) / 2)    (uint8)

then nearest-neighbour upsampling by ``vae_spatial`` in height and width, and the causal temporal layout of
the Wan / Cosmos VAEs: pixel frame 0 comes from latent frame 0, frames 1 + 4 (t - 1) .. 4 t from latent frame t
(F = 1 + 4 (T - 1) for vae_temporal 4). Only IEEE elementwise ops and indexing, no reductions whose order
depends on threads or vector width, so the bytes are the same on every machine for the same latents.
"""

from __future__ import annotations

import torch

from dlo_fn.models.config import DiTConfig

__all__ = ["rgb_projection", "decode_latents", "num_pixel_frames"]

_PROJECTION_SEED = 20260730


def rgb_projection(latent_channels: int) -> torch.Tensor:
    """P [C, 3] fp32, a function of C only: N(0, 1) / (2 sqrt(C)) from a fixed CPU generator."""
    generator = torch.Generator(device="cpu").manual_seed(_PROJECTION_SEED)
    return torch.randn(latent_channels, 3, generator=generator, dtype=torch.float32) / (2.0 * latent_channels**0.5)


def num_pixel_frames(config: DiTConfig, latent_frames: int) -> int:
    return 1 + config.vae_temporal * (latent_frames - 1)


def decode_latents(latents: torch.Tensor, config: DiTConfig) -> torch.Tensor:
    """[N, C, T, h, w] fp32 latents -> [N, F, h * s, w * s, 3] uint8 frames (s = vae_spatial), on the CPU."""
    if latents.dim() != 5 or latents.shape[1] != config.latent_channels:
        raise ValueError(f"latents of shape {tuple(latents.shape)}: expected [N, {config.latent_channels}, T, h, w]")
    z = latents.detach().to(device="cpu", dtype=torch.float32)
    proj = rgb_projection(config.latent_channels)
    rgb = torch.zeros(*z.shape[:1], *z.shape[2:], 3, dtype=torch.float32)
    for c in range(config.latent_channels):
        rgb = rgb + z[:, c, ..., None] * proj[c]
    pixels = ((rgb.clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8)  # [N, T, h, w, 3]
    frames = num_pixel_frames(config, z.shape[2])
    source = torch.tensor([(f + config.vae_temporal - 1) // config.vae_temporal for f in range(frames)])
    pixels = pixels.index_select(1, source)
    s = config.vae_spatial
    return pixels.repeat_interleave(s, dim=2).repeat_interleave(s, dim=3).contiguous()
