"""The plain probe (``dlo_fn.runtime.auto.time_one_call``): one call of the model, each block's compute as the
forward spends it, the blocks' tensors put back. On CUDA each block runs twice (untimed, then timed on the device
behind a spin kernel that covers the host's enqueue), and the per-block times add up to the resident forward."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from dlo_fn.runtime.auto import time_one_call
from dlo_fn.runtime.platform import platform_for

diffusers = pytest.importorskip("diffusers")
from tests.test_third_party import flux, flux_inputs  # noqa: E402  (needs diffusers)


def _platforms():
    return ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else [])


def _blocks(model) -> list:
    return list(model.transformer_blocks) + list(model.single_transformer_blocks)


def _on(kw: dict, device) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in kw.items()}


@pytest.mark.parametrize("platform", _platforms())
@torch.no_grad()
def test_probe_times_each_block_and_puts_its_tensors_back(platform):
    plat = platform_for(platform)
    model = flux()
    blocks = _blocks(model)
    runs = [0] * len(blocks)
    for b, block in enumerate(blocks):  # counts every run, also the probe's untimed one (which skips the hooks)
        block.forward = _counted(block.forward, runs, b)
    times, outside_s, peak = time_one_call(model, blocks, plat, _on(flux_inputs(0), plat.device))
    assert len(times) == len(blocks) and all(t > 0 for t in times) and outside_s >= 0
    assert runs == [2 if plat.kind == "cuda" else 1] * len(blocks)  # CPU: one run, no queue to keep busy
    assert all(p.device.type == "cpu" for b in blocks for p in b.parameters())  # the blocks' tensors put back
    assert model.x_embedder.weight.device.type == plat.device.type  # the rest stays where offload puts it
    assert (peak > 0) == plat.is_accelerator


def _counted(forward, runs: list, b: int):
    def run(*args, **kwargs):
        runs[b] += 1
        return forward(*args, **kwargs)

    return run


@pytest.mark.cuda
def test_block_times_add_up_to_the_resident_forward():
    """FLUX.1-dev's block widths (2 double and 4 single blocks, 4096 image and 512 text tokens, BF16): each block
    computes for longer than the host takes to enqueue it, so a forward runs at the device's pace. Timed from an
    empty queue each block would also pay its launches; timed as the forward runs it, the blocks add up to the
    blocks' span in a plain resident forward (device events at the first block's start and the last one's end),
    and stay below the whole forward (which also embeds the inputs and projects the output). Timed from an empty
    queue the probe would read high, so above the span the bound is tight; below it the blocks alone may run a
    little faster than inside a forward, whose span also holds the glue between blocks."""
    probe_s, span_s, forward_s = probe_vs_forward()
    assert 0.9 <= probe_s / span_s <= 1.05 and probe_s < forward_s, (probe_s, span_s, forward_s)


@torch.no_grad()
def probe_vs_forward() -> tuple[float, float, float]:
    """The probe's block seconds summed, the blocks' span in a resident forward and the forward (medians of 5)."""
    plat = platform_for("cuda")
    with torch.device(plat.device):
        torch.manual_seed(0)
        model = diffusers.FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=2,
            num_single_layers=4,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=512,
            pooled_projection_dim=768,
            axes_dims_rope=[16, 56, 56],
        )
    model = model.to(torch.bfloat16).eval()
    inputs = _flux_1024(plat.device)
    for _ in range(2):
        model(**inputs)
    timed = [_timed(model, inputs, plat) for _ in range(5)]
    times, _, _ = time_one_call(model, _blocks(model), plat, inputs)
    return sum(times), statistics.median(t[0] for t in timed), statistics.median(t[1] for t in timed)


def _flux_1024(device) -> dict:
    g = torch.Generator().manual_seed(0)
    img_ids = torch.zeros(4096, 3)
    img_ids[:, 1], img_ids[:, 2] = torch.arange(4096) // 64, torch.arange(4096) % 64
    bf16 = dict(
        hidden_states=torch.randn(1, 4096, 64, generator=g),
        encoder_hidden_states=torch.randn(1, 512, 512, generator=g),
        pooled_projections=torch.randn(1, 768, generator=g),
    )
    ids = dict(timestep=torch.tensor([0.5]), img_ids=img_ids, txt_ids=torch.zeros(512, 3))
    return {
        **{k: v.to(device, torch.bfloat16) for k, v in bf16.items()},
        **_on(ids, device),
        "return_dict": False,
    }


def _timed(model, inputs, plat) -> tuple[float, float]:
    """One resident forward: the device seconds from the first block's start to the last block's end (events
    recorded as the host reaches them, no syncs in between), and the forward's seconds."""
    blocks = _blocks(model)
    start, end = plat.new_event(timing=True), plat.new_event(timing=True)
    hooks = [
        blocks[0].register_forward_pre_hook(lambda *_: start.record()),
        blocks[-1].register_forward_hook(lambda *_: end.record()),
    ]
    plat.synchronize()
    t0 = time.perf_counter()
    try:
        model(**inputs)
        plat.synchronize()
    finally:
        for h in hooks:
            h.remove()
    return start.elapsed_time(end) / 1e3, time.perf_counter() - t0
