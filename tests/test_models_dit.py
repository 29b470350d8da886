"""The DiT's runtime contract: staged == forward, blocks run from flat-buffer views, bit-exact on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.func import functional_call

from dlo_fn.models import CONFIGS, Request, build_model, init_state, model_inputs

TINY = CONFIGS["tiny"]
FULL_ADALN = dataclasses.replace(TINY, name="tiny-full-adaln", adaln_rank=0)


def _inputs(model, cfg_scale=4.0, height=32, width=48, frames=5):
    req = Request(
        prompt="a lighthouse at dusk",
        seed=7,
        height=height,
        width=width,
        num_frames=frames,
        num_inference_steps=2,
        guidance_scale=cfg_scale,
    )
    return model_inputs(init_state(model, req))


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def model(request):
    return build_model(TINY, "cpu", request.param)


def test_forward_equals_staged(model):
    inputs = _inputs(model)
    out = model(*inputs)
    state = model.embed(*inputs)
    x = state.x
    for i in range(len(model.blocks)):
        x = model.blocks[i](x, **state.block_kwargs)
    assert torch.equal(model.head(x, state), out)
    assert torch.isfinite(out).all() and out.abs().max() > 0 and out.dtype == torch.float32


def test_full_rank_adaln_variant():
    model = build_model(FULL_ADALN, "cpu", torch.bfloat16)
    assert hasattr(model.blocks[0].modulation, "proj")
    inputs = _inputs(model)
    state = model.embed(*inputs)
    x = state.x
    for block in model.blocks:
        x = block(x, **state.block_kwargs)
    assert torch.equal(model.head(x, state), model(*inputs))


def test_block_major_requests_match_one_at_a_time(model):
    """An engine may run block k for request 0, then request 1, ...: same bits as whole forwards."""
    inputs = [_inputs(model), _inputs(model, cfg_scale=1.0, height=16, width=16, frames=1)]
    states = [model.embed(*i) for i in inputs]
    xs = [s.x for s in states]
    for block in model.blocks:
        xs = [block(x, **s.block_kwargs) for x, s in zip(xs, states)]
    for x, s, i in zip(xs, states, inputs):
        assert torch.equal(model.head(x, s), model(*i))


def _flat_views(block: nn.Module, alignment: int, skew: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Pack the block's tensors into one uint8 buffer (as the runtime's slots do) and return views of it."""
    named = dict(block.named_parameters())
    flat = torch.zeros(sum(t.nbytes + alignment for t in named.values()) + alignment + skew, dtype=torch.uint8)
    views, offset = {}, 0
    for name, t in named.items():
        offset = -(-offset // alignment) * alignment
        view = flat[skew + offset : skew + offset + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        views[name] = view
        offset += t.nbytes
    return flat, views


class _Proxy(nn.Module):
    """What an offload runtime puts in ``model.blocks``: the block run on weight views."""

    def __init__(self, block: nn.Module, views: dict[str, torch.Tensor]):
        super().__init__()
        self.block, self.views = block, views

    def forward(self, x, **kwargs):
        return functional_call(self.block, self.views, (x,), kwargs)


@pytest.mark.parametrize("alignment, skew", [(256, 0), (256, 4), (64, 8)])
def test_blocks_swapped_for_view_proxies_are_bit_exact(model, alignment, skew):
    inputs = _inputs(model)
    expected = model(*inputs)
    originals = list(model.blocks)
    keep = []
    try:
        for i, block in enumerate(originals):
            flat, views = _flat_views(block, alignment, skew)
            keep.append(flat)
            model.blocks[i] = _Proxy(block, views)
        assert torch.equal(model(*inputs), expected)
    finally:
        for i, block in enumerate(originals):
            model.blocks[i] = block


def test_bit_exact_across_thread_counts(model):
    before = torch.get_num_threads()
    try:
        for shape in [(32, 48, 5), (16, 48, 1), (16, 16, 1)]:  # 30, 3 and 1 tokens: short fp32 MKL paths
            inputs = _inputs(model, height=shape[0], width=shape[1], frames=shape[2])
            torch.set_num_threads(1)
            one = model(*inputs)
            torch.set_num_threads(2)
            assert torch.equal(model(*inputs), one), shape
    finally:
        torch.set_num_threads(before)


def test_every_block_matters(model):
    inputs = _inputs(model)
    expected = model(*inputs)
    last = model.blocks[-1].mlp.fc2.weight
    saved = last.clone()
    with torch.no_grad():
        last.mul_(-1)
    try:
        assert not torch.equal(model(*inputs), expected)
    finally:
        with torch.no_grad():
            last.copy_(saved)


def test_meta_model_needs_buffers_before_running():
    materialised = build_model(TINY, "cpu", torch.float32)
    inputs = _inputs(materialised)
    model = build_model(TINY, "meta", torch.float32)
    model.load_state_dict(materialised.state_dict(), assign=True)  # binds parameters, as the loader does
    assert model.rope_inv_freq.is_meta
    with pytest.raises(RuntimeError, match="init_buffers"):
        model(*inputs)
    model.init_buffers()
    assert torch.equal(model(*inputs), materialised(*inputs))
    empty = build_model(TINY, "meta", torch.float32).to_empty(device="cpu")  # recomputes the table itself
    assert torch.equal(empty.rope_inv_freq, materialised.rope_inv_freq)


def test_same_seed_same_weights_other_seed_differs():
    a, b = build_model(TINY, "cpu", seed=1), build_model(TINY, "cpu", seed=1)
    c = build_model(TINY, "cpu", seed=2)
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(x, y), name
        assert not torch.equal(x, z), name


def test_bad_inputs_are_named():
    model = build_model(TINY, "cpu", torch.float32)
    inputs = _inputs(model)
    with pytest.raises(ValueError, match="latents of shape"):
        model(inputs.latents[:, :3], inputs.timestep, inputs.text_tokens)
    with pytest.raises(ValueError, match="text tokens have length"):
        model(inputs.latents, inputs.timestep, inputs.text_tokens[:, :10])
    with pytest.raises(ValueError, match="dtype"):
        build_model(TINY, "cpu", torch.int8)
