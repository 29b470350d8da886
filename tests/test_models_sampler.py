"""Flow-matching Euler + CFG: determinism, the stepping API, and the decoder."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from dlo_fn.models import (
    CONFIGS,
    Request,
    build_model,
    decode_latents,
    finish,
    finished,
    generate,
    init_state,
    model_inputs,
    sigmas,
    update,
)

TINY = CONFIGS["tiny"]
REQ = Request(
    prompt="a red fox in the snow",
    seed=11,
    height=32,
    width=48,
    num_frames=5,
    num_inference_steps=4,
    guidance_scale=4.0,
    shift=3.0,
)


@pytest.fixture(scope="module")
def model():
    return build_model(TINY, "cpu", torch.bfloat16)


@pytest.fixture(scope="module")
def result(model):
    return generate(model, REQ)


def test_output_shape_hash_and_sanity(result):
    assert result.video.dtype == torch.uint8 and result.video.shape == (1, 5, 32, 48, 3)
    assert result.latents.shape == (1, 4, 2, 4, 6) and torch.isfinite(result.latents).all()
    assert result.sha256 == hashlib.sha256(result.video.numpy().tobytes()).hexdigest()
    assert result.video.float().std() > 10  # not a flat image


def test_deterministic_and_sensitive_to_every_input(model, result):
    assert generate(model, REQ).sha256 == result.sha256
    variants = {
        "seed": {"seed": 12},
        "prompt": {"prompt": "a red fox in the rain"},
        "negative_prompt": {"negative_prompt": "blurry"},
        "steps": {"num_inference_steps": 3},
        "guidance": {"guidance_scale": 5.0},
        "shift": {"shift": 1.0},
    }
    hashes = {result.sha256}
    for name, change in variants.items():
        h = generate(model, dataclasses.replace(REQ, **change)).sha256
        assert h not in hashes, name
        hashes.add(h)


def test_weights_seed_changes_output(result):
    other = build_model(TINY, "cpu", torch.bfloat16, seed=1)
    assert generate(other, REQ).sha256 != result.sha256


def test_stepping_api_matches_generate(model, result):
    state = init_state(model, REQ)
    assert state.sigmas[0] == 1.0 and state.sigmas[-1] == 0.0
    while not finished(state):
        inputs = model_inputs(state)
        assert inputs.latents.shape[0] == 2  # the CFG pair is one batch-2 forward
        state = update(state, model(*inputs))
    assert finish(state).sha256 == result.sha256


def test_interleaved_requests_match_separate_runs(model, result):
    other = dataclasses.replace(REQ, prompt="tide pools", seed=3, guidance_scale=1.0, height=16, width=16, num_frames=1)
    states = [init_state(model, REQ), init_state(model, other)]
    while not all(finished(s) for s in states):
        states = [s if finished(s) else update(s, model(*model_inputs(s))) for s in states]
    assert finish(states[0]).sha256 == result.sha256
    assert finish(states[1]).sha256 == generate(model, other).sha256


def test_no_cfg_runs_batch_one(model):
    state = init_state(model, dataclasses.replace(REQ, guidance_scale=1.0))
    assert model_inputs(state).latents.shape[0] == 1


def test_outputs_per_prompt_share_one_generator(model, result):
    two = generate(model, dataclasses.replace(REQ, outputs_per_prompt=2))
    assert two.video.shape[0] == 2
    assert torch.equal(two.video[0], result.video[0])  # the first draw is the single-output noise
    assert not torch.equal(two.video[1], two.video[0])


def test_noise_comes_from_a_cpu_generator_whatever_the_model(model):
    a = init_state(model, REQ)
    b = init_state(TINY, REQ)  # from the config alone, no model
    assert torch.equal(a.latents, b.latents)
    expected = torch.randn((4, 2, 4, 6), generator=torch.Generator().manual_seed(REQ.seed))
    assert torch.equal(a.latents[0], expected)


def test_state_machine_errors(model):
    state = init_state(model, dataclasses.replace(REQ, num_inference_steps=1))
    with pytest.raises(ValueError, match="keep stepping"):
        finish(state)
    with pytest.raises(ValueError, match="expected"):
        update(state, torch.zeros(1, 4, 2, 4, 6))
    state = update(state, model(*model_inputs(state)))
    with pytest.raises(ValueError, match="finished"):
        model_inputs(state)
    with pytest.raises(ValueError, match="meta"):
        init_state(build_model(TINY), REQ)
    with pytest.raises(ValueError, match="height"):
        init_state(model, dataclasses.replace(REQ, height=30))


def test_sigmas_shift():
    assert sigmas(2, 1.0) == (1.0, 0.5, 0.0)
    assert sigmas(2, 3.0) == (1.0, 0.75, 0.0)  # 3 * 0.5 / (1 + 2 * 0.5)


def test_decode_layout():
    latents = torch.zeros(1, 4, 3, 2, 2)
    latents[0, :, 2] = 5.0  # saturates whatever the projection
    video = decode_latents(latents, TINY)
    assert video.shape == (1, 9, 16, 16, 3)
    assert (video[0, :5] == 128).all()  # frame 0 from latent 0, frames 1-4 from latent 1 (both zero)
    assert (video[0, 5:] != 128).any() and torch.equal(video[0, 5], video[0, 8])
    assert torch.equal(video[0, 5, :8, :8], video[0, 5, :1, :1].expand(8, 8, 3))  # nearest upsampling
