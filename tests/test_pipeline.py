"""A diffusers pipeline end to end: a tiny random WanPipeline (UMT5 text encoder, Wan VAE and transformer from
tiny configs, a WordLevel tokenizer built here: nothing downloaded) saved with save_pretrained; under 2 gloo
ranks each rank loads the pipeline folder's transformer with load_model (no factory, no block paths), offloads
it and runs pipe(...) with its own prompt: the frames equal the plain pipeline's (from_pretrained) exactly, in
allgather and rank-local mode."""

from __future__ import annotations

import pytest
import torch
from conftest import scenario

from dlo_fn.runtime.dist import DistContext

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = "a red fox an owl in the snow at night blur low quality".split()


def tiny_tokenizer():
    """A word-level tokenizer over WORDS (T5's pad/eos/unk names), built in memory."""
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(dict.fromkeys(WORDS))}}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_wan_pipeline(seed: int = 0):
    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    text_encoder = transformers.UMT5EncoderModel(
        transformers.UMT5Config(
            vocab_size=len(tokenizer),
            d_model=16,
            d_kv=8,
            d_ff=32,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
        )
    ).eval()
    vae = diffusers.AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=3,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()
    return diffusers.WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
    )


def call_args(rank: int) -> dict:
    prompt = ("a red fox in the snow", "an owl at night")[rank % 2]
    return dict(
        prompt=prompt,
        negative_prompt="blur low quality",
        height=16,
        width=16,
        num_frames=9,
        num_inference_steps=2,
        guidance_scale=6.0,
        max_sequence_length=16,
        output_type="pt",
        generator=torch.Generator().manual_seed(rank),
    )


@torch.no_grad()
def check_rank(ctx: DistContext, folder: str) -> dict:
    from diffusers.utils import logging as dlogging

    from dlo_fn.io.load import load_model
    from dlo_fn.runtime.offload import offload

    dlogging.disable_progress_bar()
    plain = diffusers.WanPipeline.from_pretrained(folder)
    want = plain(**call_args(ctx.rank)).frames
    out = {}
    for mode in ("allgather", "rank-local"):
        transformer = load_model(folder, progress=False)  # the pipeline folder's transformer/, zero-copy
        o = offload(transformer, ctx=ctx, mode=mode)
        pipe = diffusers.WanPipeline.from_pretrained(folder, transformer=transformer)  # as the README shows
        got = pipe(**call_args(ctx.rank)).frames
        out[mode] = (torch.equal(got, want), o.executor.stats.computes, o.spec.blocks[0].name)
    out["frames_shape"] = tuple(want.shape)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_offloaded_pipeline_equals_plain_pipeline_on_two_gloo_ranks(request):
    # check_rank(ctx, folder) on the shared spawn of 2 ranks (conftest.SCENARIOS); the folder is
    # tiny_wan_pipeline() saved with save_pretrained (conftest's wan_pipeline_folder).
    results = scenario(request, 2, "pipeline")
    for rank, res in enumerate(results):
        assert res["frames_shape"] == (1, 9, 3, 16, 16)
        for mode in ("allgather", "rank-local"):
            exact, computes, first = res[mode]
            assert exact, f"rank {rank} {mode}: frames differ from the plain pipeline"
            # 2 steps x (cond + uncond) x 3 blocks, every call through the executor
            assert computes == 2 * 2 * 3 and first == "blocks.0"
