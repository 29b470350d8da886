"""FP8 shards on every diffusers DiT family whose block lists ``load_model`` / ``offload`` detect beyond Wan and
Flux (``tests/test_quant.py``): LTX-Video, CogVideoX, SD3, HunyuanVideo and Qwen-Image at tiny random configs
(diffusers 0.42.1), rank-local and allgather on the CPU, each output equal bit for bit to ``fake_quantize`` of the
resident model, and BF16 offloading of the same model equal to the resident one."""

from __future__ import annotations

import copy

import pytest
import torch

from dlo_fn.io.diffusers_load import block_paths_for
from dlo_fn.runtime.offload import offload
from dlo_fn.runtime.quant import fake_quantize
from tests.test_executor import CTX

diffusers = pytest.importorskip("diffusers")


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def ltx():
    return diffusers.LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=2,
        caption_channels=16,
    )


def ltx_inputs(g: torch.Generator) -> dict:
    return dict(
        hidden_states=_randn(g, 1, 2 * 4 * 4, 8),
        encoder_hidden_states=_randn(g, 1, 6, 16),
        timestep=torch.tensor([300]),
        encoder_attention_mask=torch.ones(1, 6),
        num_frames=2,
        height=4,
        width=4,
        return_dict=False,
    )


def cogvideox():
    return diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        time_embed_dim=8,
        text_embed_dim=16,
        num_layers=2,
        sample_width=8,
        sample_height=8,
        sample_frames=5,
        max_text_seq_length=6,
    )


def cogvideox_inputs(g: torch.Generator) -> dict:
    return dict(
        hidden_states=_randn(g, 1, 2, 4, 8, 8),
        encoder_hidden_states=_randn(g, 1, 6, 16),
        timestep=torch.tensor([300]),
        return_dict=False,
    )


def sd3():
    return diffusers.SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=8,
    )


def sd3_inputs(g: torch.Generator) -> dict:
    return dict(
        hidden_states=_randn(g, 1, 4, 8, 8),
        encoder_hidden_states=_randn(g, 1, 6, 16),
        pooled_projections=_randn(g, 1, 16),
        timestep=torch.tensor([300]),
        return_dict=False,
    )


def hunyuan():
    return diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=2,
        num_refiner_layers=1,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 2, 4),
    )


def hunyuan_inputs(g: torch.Generator) -> dict:
    return dict(
        hidden_states=_randn(g, 1, 4, 1, 8, 8),
        timestep=torch.tensor([300]),
        encoder_hidden_states=_randn(g, 1, 6, 16),
        encoder_attention_mask=torch.ones(1, 6),
        pooled_projections=_randn(g, 1, 8),
        guidance=torch.tensor([3500.0]),
        return_dict=False,
    )


def qwen():
    return diffusers.QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(2, 2, 4),
    )


def qwen_inputs(g: torch.Generator) -> dict:
    return dict(
        hidden_states=_randn(g, 1, 16, 16),
        encoder_hidden_states=_randn(g, 1, 6, 16),
        encoder_hidden_states_mask=torch.ones(1, 6),
        timestep=torch.tensor([0.3]),
        img_shapes=[(1, 4, 4)],
        return_dict=False,
    )


FAMILIES = {
    "ltx": (ltx, ltx_inputs),
    "cogvideox": (cogvideox, cogvideox_inputs),
    "sd3": (sd3, sd3_inputs),
    "hunyuan": (hunyuan, hunyuan_inputs),
    "qwen": (qwen, qwen_inputs),
}


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_fp8_shards_of_every_family_equal_fake_quantised(family):
    build, inputs = FAMILIES[family]
    torch.manual_seed(0)
    ref = build().eval().to(torch.bfloat16)
    paths = block_paths_for(ref)
    want_fp8 = fake_quantize(copy.deepcopy(ref), paths)
    xs = [
        {
            k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in inputs(torch.Generator().manual_seed(s)).items()
        }
        for s in range(2)
    ]
    bf16 = offload(copy.deepcopy(ref), paths, CTX, mode="rank-local")
    for x in xs:
        assert torch.equal(bf16.model(**x)[0], ref(**x)[0])
    for mode in ("rank-local", "allgather"):
        o = offload(copy.deepcopy(ref), paths, CTX, mode=mode, quantization="fp8")
        assert o.layout.quantized and o.store.arena_bytes < bf16.store.arena_bytes
        for x in xs:
            got, want = o.model(**x)[0], want_fp8(**x)[0]
            assert torch.isfinite(got).all() and torch.equal(got, want), (family, mode)
