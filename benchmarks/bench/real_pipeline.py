"""The full request of `bench real --pipeline`: ``diffusers.FluxPipeline`` at FLUX.1-dev's published component
configs with random weights, text encoders and VAE resident on the device, the transformer offloaded (ours,
rank-local, in BF16 and with FP8 shards) beside the same pipeline with the transformer resident: wall time per request,
whether the images are byte-identical, and how far each is from the resident images (``rel_error_to_resident``: FP8's
cost over a whole request, every denoising step and the VAE). Nothing is downloaded: the tokenizers are word-level
tokenizers built here with the special
tokens (and ids) the pipeline and encoders rely on.

Component configs (``text_encoder/``, ``text_encoder_2/``, ``vae/``, ``scheduler/`` of
https://huggingface.co/black-forest-labs/FLUX.1-dev): CLIP-L text encoder, T5-v1.1-XXL encoder, the 16-channel
``AutoencoderKL``, ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting. CLIP's config keeps the legacy
``eos_token_id=2``, with which the encoder pools at the largest id (the end token, 49407).
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.repro.variants import REAL

__all__ = ["CLIP_L", "T5_XXL", "FLUX_VAE", "FLUX_SCHEDULER", "TRANSFORMERS", "build_pipeline_parts", "run_pipeline"]

CLIP_L = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    projection_dim=768,
    layer_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=1,
)
T5_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
)
FLUX_VAE = dict(
    act_fn="silu",
    block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4,
    force_upcast=True,
    in_channels=3,
    latent_channels=16,
    latents_mean=None,
    latents_std=None,
    layers_per_block=2,
    mid_block_add_attention=True,
    norm_num_groups=32,
    out_channels=3,
    sample_size=1024,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    up_block_types=["UpDecoderBlock2D"] * 4,
    use_post_quant_conv=False,
    use_quant_conv=False,
)
FLUX_SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
)
REQUEST = dict(height=1024, width=1024, num_inference_steps=28, guidance_scale=3.5, max_sequence_length=512)

# The quick transformer (real_models.FLUX_QUICK) takes CLIP's pooled width and T5's width: 32 and 32.
QUICK_CLIP = dict(
    CLIP_L,
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    projection_dim=32,
)
QUICK_T5 = dict(T5_XXL, vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2)
QUICK_VAE = dict(FLUX_VAE, block_out_channels=[8, 8, 8, 8], latent_channels=4, layers_per_block=1, norm_num_groups=4)
QUICK_REQUEST = dict(height=64, width=64, num_inference_steps=2, guidance_scale=3.5, max_sequence_length=8)
PROMPT = "a photo of a red fox in the snow at night"
# The transformer of each request: None resident, else offload() keyword arguments (bench real's variants).
TRANSFORMERS = {v.name: v.options for v in REAL if v.name in ("resident", "ours-rank-local", "ours-fp8")}


def _word_tokenizer(vocab_size: int, specials: dict[str, int], template: str, max_length: int, **names):
    """A word-level ``PreTrainedTokenizerFast`` over the prompt's words (ids from 3), ``specials`` at their ids."""
    import tokenizers
    import transformers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.processors import TemplateProcessing

    words = {w: 3 + i for i, w in enumerate(dict.fromkeys(PROMPT.split()))}
    vocab = {**words, **specials}
    assert max(vocab.values()) < vocab_size
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token=names["unk_token"]))
    tok.pre_tokenizer = Whitespace()
    tok.post_processor = TemplateProcessing(
        single=template, special_tokens=[(t, i) for t, i in specials.items() if t in template]
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length, **names)


def build_pipeline_parts(device: torch.device, quick: bool, seed: int = 1) -> dict:
    """Everything of the pipeline but the transformer: encoders and VAE with random weights on ``device`` (bf16),
    tokenizers, scheduler."""
    import diffusers
    import transformers

    from benchmarks.bench.real_models import materialize
    from dlo_fn.io.bind import meta_params
    from dlo_fn.io.diffusers_load import _meta_build

    clip, t5, vae = (QUICK_CLIP, QUICK_T5, QUICK_VAE) if quick else (CLIP_L, T5_XXL, FLUX_VAE)
    request = QUICK_REQUEST if quick else REQUEST
    with meta_params():
        text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(**clip))
        text_encoder_2 = transformers.T5EncoderModel(transformers.T5Config(**t5))
    v = clip["vocab_size"]
    tokenizer = _word_tokenizer(
        v,
        {"<|startoftext|>": v - 2, "<|endoftext|>": v - 1},
        "<|startoftext|> $A <|endoftext|>",
        77,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    tokenizer_2 = _word_tokenizer(
        t5["vocab_size"],
        {"<pad>": 0, "</s>": 1, "<unk>": 2},
        "$A </s>",
        request["max_sequence_length"],
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    return {
        "text_encoder": materialize(text_encoder, device, seed, torch.bfloat16),
        "text_encoder_2": materialize(text_encoder_2, device, seed + 1, torch.bfloat16),
        "vae": materialize(_meta_build(diffusers.AutoencoderKL, vae, torch.bfloat16), device, seed + 2),
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
        "request": request,
    }


def _requests(platform, pipe, request: dict, repeats: int) -> tuple[list[float], torch.Tensor]:
    times, images = [], None
    for _ in range(1 + repeats):  # the first request warms up
        platform.synchronize()
        t0 = time.perf_counter()
        images = pipe(
            prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(0), output_type="pt", **request
        ).images
        platform.synchronize()
        times.append(time.perf_counter() - t0)
    return times[1:], images


@torch.no_grad()
def run_pipeline(ctx, folder: str, quick: bool, repeats: int) -> dict:
    """The request with the transformer resident, then offloaded (:data:`TRANSFORMERS`), on the same encoders and
    VAE; each offloaded request's images against the resident ones (kept on the host)."""
    import diffusers

    from benchmarks.bench.real_variants import digest, error_to_resident, release
    from dlo_fn.io.load import load_model
    from dlo_fn.runtime.offload import offload

    platform = ctx.platform
    parts = build_pipeline_parts(platform.device, quick)
    request = parts.pop("request")
    out: dict = {"request": dict(request, prompt=PROMPT), "repeats": repeats}
    want = None
    for name, kwargs in TRANSFORMERS.items():
        release(platform)
        t0 = time.perf_counter()
        transformer = load_model(folder, progress=False)
        o = None
        if kwargs is None:
            transformer.to(platform.device)
        else:
            o = offload(transformer, ctx=ctx, **kwargs)
        platform.synchronize()
        ready_s = time.perf_counter() - t0
        pipe = diffusers.FluxPipeline(transformer=transformer, **parts)
        pipe.set_progress_bar_config(disable=True)
        times, images = _requests(platform, pipe, request, repeats)
        out[name] = {
            "ready_s": ready_s,
            "request_s": statistics.median(times),
            "request_s_all": times,
            "sha256": digest(images),
            "finite": bool(torch.isfinite(images).all()),
        }
        if want is None:
            want = images.cpu()
        else:
            out[name]["equal_to_resident"] = bool(torch.equal(images.cpu(), want))
            out[name].update(
                error_to_resident(images, want), ratio_to_resident=out[name]["request_s"] / out["resident"]["request_s"]
            )
            o.synchronize()
            o.store.close()
        del pipe, transformer, o, images
    out["ratio_to_resident"] = out["ours-rank-local"]["request_s"] / out["resident"]["request_s"]
    return out
