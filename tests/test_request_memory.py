"""A request's bytes on a rank (dlo_fn.cost.request_memory): the terms, their scaling with sp and R, the largest
size a budget holds, and the model against the peak RSS a real request adds on the CPU (fresh processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dlo_fn.cost.request_memory import RequestShape, largest_fitting, request_memory
from dlo_fn.cost.sp_memory import BlockDims, sp_activations
from dlo_fn.models import CONFIGS, Request
from dlo_fn.serve.admission import request_shape

TINY = CONFIGS["tiny"]
DIMS = BlockDims.from_config(TINY, 2)


def test_terms_of_one_request():
    r = Request("a fox", height=256, width=512, num_frames=9, outputs_per_prompt=2)  # CFG: B = 4
    shape = request_shape(TINY, r)
    # latents (4, 3, 32, 64); tokens 3 x 16 x 32; video 2 x 9 x 256 x 512 x 3
    assert shape == RequestShape(3 * 16 * 32, 2, 4, 4 * 3 * 32 * 64, 2 * 9 * 256 * 512 * 3)
    m = request_memory(DIMS, shape)
    u = 4 * shape.tokens * TINY.hidden_dim
    assert m.state_bytes == 4 * shape.latent_elements * (2 + 4)
    assert m.held_bytes == 4 * 4 * TINY.text_len * TINY.text_dim + 2 * 4 * u + 4 * shape.tokens * DIMS.head_dim
    assert m.call_bytes == sp_activations(DIMS, shape.tokens, 1, 4).peak_bytes
    assert m.decode_bytes == 4 * 2 * shape.latent_elements + 3 * shape.video_bytes
    assert m.device_bytes == m.state_bytes + m.call_bytes and m.pool_bytes == m.device_bytes + m.decode_bytes


def test_sp_divides_the_activations_and_r_adds_held_requests():
    shape = request_shape(TINY, Request("a fox", height=512, width=512, num_frames=17))
    one, two = request_memory(DIMS, shape), request_memory(DIMS, shape, sp=2)
    assert two.call_bytes < one.call_bytes and two.state_bytes == one.state_bytes  # full latents on each sp rank
    three = request_memory(DIMS, shape, requests_per_rank=3)
    assert three.device_bytes - one.device_bytes == 2 * (one.state_bytes + one.held_bytes)
    assert three.host_bytes == one.host_bytes  # one decode at a time
    with pytest.raises(ValueError, match="requests_per_rank"):
        request_memory(DIMS, shape, requests_per_rank=0)


def test_largest_fitting_keeps_the_aspect_and_is_the_boundary():
    def need(h, w):
        return request_memory(DIMS, request_shape(TINY, Request("x", height=h, width=w, num_frames=5))).pool_bytes

    budget = 50_000_000
    h, w = largest_fitting(4096, 2048, 16, lambda h, w: need(h, w) <= budget)
    assert (h, w) == (2 * w, w) or abs(h / w - 2) < 0.1
    assert need(h, w) <= budget < need(h + 16, (h + 16) // 2 // 16 * 16)
    assert largest_fitting(4096, 2048, 16, lambda h, w: False) is None
    assert largest_fitting(64, 64, 16, lambda h, w: True) == (64, 64)


MEASURE = r"""
import json, pathlib, sys, torch
torch.set_num_threads(1)
from dlo_fn.models import Request, generate
from dlo_fn.cost.request_memory import request_memory
from dlo_fn.cost.sp_memory import BlockDims
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.platform import platform_for
from dlo_fn.serve.admission import request_shape
from dlo_fn.serve.local import open_model

def status(key):
    line = next(l for l in pathlib.Path("/proc/self/status").read_text().splitlines() if l.startswith(key))
    return int(line.split()[1]) * 1024

checkpoint, mode, fields = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
# On the CPU even where CUDA is present: the pool model is the CPU's, where compute and decode share the RSS.
model, _ = open_model(checkpoint, DistContext(0, 1, 0, platform_for("cpu"), None), mode)
generate(model, Request("warm", height=32, width=32, num_frames=5, num_inference_steps=1))  # kernels loaded
request = Request("a red fox", **fields)
before = status("VmRSS:")
pathlib.Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
generate(model, request)
planned = request_memory(BlockDims.from_config(model.config, 2), request_shape(model.config, request)).pool_bytes
print(json.dumps({"measured": status("VmHWM:") - before, "planned": planned}))
"""
SCRATCH_BYTES = 32_000_000  # kernel scratch and heap granularity: in admission's reserve, not in the model


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, fields",
    [
        ("resident", dict(height=640, width=640, num_frames=17, num_inference_steps=1)),
        ("resident", dict(height=640, width=1024, num_frames=9, num_inference_steps=1, guidance_scale=1.0)),
        ("allgather", dict(height=384, width=384, num_frames=33, num_inference_steps=1, outputs_per_prompt=2)),
    ],
)
def test_the_model_bounds_the_peak_a_request_adds(checkpoint, mode, fields):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, checkpoint, mode, json.dumps(fields)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["measured"] > 40_000_000, got  # large enough for the terms to dominate
    assert got["measured"] - SCRATCH_BYTES <= got["planned"] <= 2 * got["measured"] + SCRATCH_BYTES, got


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["resident", "rank-local"])
def test_the_device_terms_bound_the_cuda_peak(checkpoint, mode):
    """On CUDA the compute terms (latents, held state, the block's peak phase) against the allocator's peak over
    what the model already held; the decode runs on the host."""
    import torch

    from dlo_fn.models import generate
    from dlo_fn.runtime.dist import DistContext
    from dlo_fn.runtime.platform import platform_for
    from dlo_fn.serve.local import open_model

    model, _ = open_model(checkpoint, DistContext(0, 1, 0, platform_for("cuda", 0), None), mode)
    generate(model, Request("warm", height=32, width=32, num_frames=5, num_inference_steps=1))
    rows = []
    for fields in (
        dict(height=1024, width=1024, num_frames=33),
        dict(height=768, width=1280, num_frames=17),
        dict(height=2048, width=2048, num_frames=9, guidance_scale=1.0),
    ):
        request = Request("a red fox", num_inference_steps=1, **fields)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        generate(model, request)
        measured = torch.cuda.max_memory_allocated() - base
        planned = request_memory(DIMS, request_shape(model.config, request)).device_bytes
        rows.append((fields, measured, planned))
    print(mode, "measured vs planned device bytes:", rows)
    for fields, measured, planned in rows:
        assert measured - SCRATCH_BYTES <= planned <= 2 * measured + SCRATCH_BYTES, rows
