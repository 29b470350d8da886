"""Third-party DiTs (diffusers 0.42.1, tiny random configs): the executor wraps any nn.Module given its block
list path(s). Wan has one list; Flux has two (``transformer_blocks`` then ``single_transformer_blocks``) whose
blocks take keyword arguments and return tuples. On W = 2 and 3 gloo ranks, Wan and Flux folders in fp32 and
bf16 (weights at 8 mod 16 in the file) loaded with load_model and offloaded equal the plain from_pretrained
model, allgather and rank-local."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import scenario

from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.offload import offload
from dlo_fn.runtime.platform import platform_for

diffusers = pytest.importorskip("diffusers")
CTX = DistContext(0, 1, 0, platform_for("cpu"), None)
FLUX_BLOCKS = ("transformer_blocks", "single_transformer_blocks")


def wan(seed: int = 0):
    torch.manual_seed(seed)
    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=3,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()


def wan_inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g),
        timestep=torch.tensor([100 * seed + 7]),
        encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
        return_dict=False,
    )


def flux(seed: int = 0):
    torch.manual_seed(seed)
    return diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    ).eval()


def flux_inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    img_ids = torch.zeros(16, 3)
    img_ids[:, 1], img_ids[:, 2] = torch.arange(16) // 4, torch.arange(16) % 4
    return dict(
        hidden_states=torch.randn(1, 16, 4, generator=g),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g),
        timestep=torch.tensor([0.1 + 0.2 * seed]),
        img_ids=img_ids,
        txt_ids=torch.zeros(8, 3),
        return_dict=False,
    )


CASES = {"wan": (wan, wan_inputs, "blocks"), "flux": (flux, flux_inputs, FLUX_BLOCKS)}


@functools.lru_cache(maxsize=None)
def _reference(name: str):
    build, inputs, _ = CASES[name]
    ref = build()
    with torch.no_grad():
        return ref, tuple(ref(**inputs(s))[0] for s in range(3))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mode", ["allgather", "rank-local", "resident", "rank-local-g2"])
@torch.no_grad()
def test_third_party_bit_exact(name, mode):
    _, inputs, paths = CASES[name]
    ref, want = _reference(name)
    # -g2: load groups of 2 on 4 slots (Flux's two block lists have two sizes: a group may straddle them)
    opts = dict(mode="rank-local", load_group=2, num_slots=4) if mode.endswith("-g2") else dict(mode=mode)
    o = offload(copy.deepcopy(ref), paths, CTX, **opts)
    for s, w in enumerate(want):  # three passes: the ring wraps across forwards
        assert torch.equal(o.model(**inputs(s))[0], w)
    if mode != "resident":
        expected_blocks = 3 if name == "wan" else 4
        assert o.layout.num_blocks == expected_blocks
        assert o.executor.stats.computes == 3 * expected_blocks
        assert o.executor.device_weight_bytes == o.executor.planned_device_weight_bytes


def test_flux_two_lists_keep_forward_order_and_layouts():
    o = offload(flux(), FLUX_BLOCKS, CTX)
    names = [s.block.name for s in o.layout.shards]
    assert names == [
        "transformer_blocks.0",
        "transformer_blocks.1",
        "single_transformer_blocks.0",
        "single_transformer_blocks.1",
    ]
    # Two block kinds: one view set per (slot, distinct layout).
    assert o.executor.num_view_sets == 2 * 2
    # A proxy still answers attribute reads of the block it replaced (diffusers walks its processors).
    assert hasattr(o.model.transformer_blocks[0], "attn")


# (folder name, builder, inputs, dtype, a tensor put at 8 mod 16 in the file)
FOLDERS = (
    ("wan-fp32", "wan", torch.float32, "blocks.0.attn1.to_q.weight"),
    ("wan-bf16", "wan", torch.bfloat16, "blocks.0.attn1.to_q.weight"),
    ("flux-fp32", "flux", torch.float32, "transformer_blocks.0.norm1.linear.weight"),
    ("flux-bf16", "flux", torch.bfloat16, "transformer_blocks.0.norm1.linear.weight"),
)


def _cast(inputs: dict, dtype) -> dict:
    return {
        k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() and k != "timestep" else v
        for k, v in inputs.items()
    }


@torch.no_grad()
def check_folders_rank(ctx: DistContext, root: str) -> dict:
    """Each rank: the plain from_pretrained model's outputs on this rank's inputs, then the same folder through
    load_model + offload in both modes (block lists detected), two passes each."""
    import pathlib

    from dlo_fn.io.load import load_model

    out = {}
    for folder, name, dtype, _ in FOLDERS:
        path = pathlib.Path(root) / folder
        build, inputs, _ = CASES[name]
        cls = type(build())
        ref = cls.from_pretrained(path, torch_dtype=dtype)
        seeds = (10 * ctx.rank, 10 * ctx.rank + 1)
        want = [ref(**_cast(inputs(s), dtype))[0] for s in seeds]
        for mode in ("allgather", "rank-local"):
            o = offload(load_model(path, progress=False), ctx=ctx, mode=mode)
            got = [o.model(**_cast(inputs(s), dtype))[0] for s in seeds]
            out[f"{folder}[{mode}]"] = all(torch.equal(g, w) for g, w in zip(got, want))
    return out


def write_folders(root) -> str:
    """The :data:`FOLDERS` under ``root`` (conftest's session fixture ``third_party_folders``)."""
    from test_load_alignment import save_at_residue

    for folder, name, dtype, key in FOLDERS:
        model = CASES[name][0]()
        if dtype != torch.float32:  # as a published bf16 folder: the fp32 modules stay fp32
            model.save_pretrained(root / "src" / folder)
            model = type(model).from_pretrained(root / "src" / folder, torch_dtype=dtype)
        save_at_residue(model, root / folder, key)
    return str(root)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_folders_offloaded_on_gloo_ranks_equal_from_pretrained(request, world):
    results = scenario(request, world, "third_party")  # check_folders_rank(ctx, third_party_folders)
    for rank, res in enumerate(results):
        assert len(res) == 8 and all(res.values()), f"rank {rank}: {res}"
