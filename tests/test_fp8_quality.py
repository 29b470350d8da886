"""FP8 quality, measured (benchmarks.bench.fp8_quality.output_error): the metric on constructed
inputs, then the reference DiT offloaded with FP8 shards against its BF16 self (one forward and a whole request),
bit for bit equal to ``fake_quantize`` and within the bound of one e4m3 rounding."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.bench.fp8_quality import output_error
from benchmarks.cli import lab_parser as build_parser

# An e4m3 value has 3 mantissa bits: round to nearest errs by at most 2^-4 of the value in the normal range, where
# the per-channel scale puts a row's values (its amax at 448), so the weights' relative L2 error is below 2^-4
# (measured ~2.5%). An output sums products with many weights whose rounding errors are independent and partly
# cancel, so its relative error is of the weights' order or below (measured 1-2% on the tiny DiT), unless the
# network amplifies it: the bound, one e4m3 rounding, is what "FP8 costs about one FP8 rounding" means, with a
# 3x margin over what was measured.
E4M3_ROUNDING = 2.0**-4


def test_output_error_of_equal_outputs_is_exactly_zero():
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert output_error(x, x.clone()) == output_error(x, x) and output_error(x, x).rel_l2 == 0.0
    err = output_error(x, x)
    assert (err.max_abs, err.cosine, err.num_elements) == (0.0, 1.0, 15)
    zeros = torch.zeros(4)
    assert (output_error(zeros, zeros).rel_l2, output_error(zeros, zeros).cosine) == (0.0, 1.0)
    assert output_error(torch.ones(4), zeros).rel_l2 == math.inf and output_error(torch.ones(4), zeros).cosine == 0.0


def test_output_error_on_constructed_inputs():
    want = torch.tensor([3.0, 4.0, 0.0, 0.0])
    scaled = output_error(1.01 * want, want)  # every element 1% off: rel 0.01, cosine 1, max |0.04|
    assert scaled.rel_l2 == pytest.approx(0.01, rel=1e-6) and scaled.cosine == pytest.approx(1.0, abs=1e-12)
    assert scaled.max_abs == pytest.approx(0.04, rel=1e-6)
    flipped = output_error(-want, want)
    assert (flipped.rel_l2, flipped.max_abs, flipped.cosine) == (2.0, 8.0, -1.0)
    orthogonal = output_error(torch.tensor([0.0, 0.0, 4.0, -3.0]), want)  # ||y - r|| = sqrt(50), ||r|| = 5
    assert orthogonal.rel_l2 == pytest.approx(math.sqrt(2)) and orthogonal.cosine == 0.0
    # float64 on the host: one bf16 ulp at one of 2^16 elements is seen, not rounded away.
    ones = torch.ones(1 << 16, dtype=torch.bfloat16)
    bumped = ones.clone()
    bumped[7] = 1.0078125  # 1 + 2^-7, the next bf16 after 1
    assert output_error(bumped, ones).rel_l2 == pytest.approx(2.0**-7 / 2.0**8, rel=1e-12)
    with pytest.raises(ValueError, match="shapes differ"):
        output_error(torch.zeros(2, 3), torch.zeros(3, 2))


def test_reference_dit_fp8_error_is_measured(tmp_path):
    """The CLI on the tiny reference DiT (CPU): its JSON, every offloaded FP8 output equal to the fake-quantised
    model's bit for bit, and its error against BF16 above zero and below one e4m3 rounding."""
    out = tmp_path / "q.json"
    args = build_parser().parse_args(["bench", "fp8-quality", "--platform", "cpu", "--steps", "3", "--out", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert (
        report["command"].startswith("python -m benchmarks bench fp8-quality")
        and report["machine"]["platform"] == "cpu"
    )
    assert report["request"]["num_inference_steps"] == 3 and report["date"]
    rows = {r["output"]: r for r in report["rows"]}
    assert list(rows) == ["weights", "one forward", "request latents", "request video"]
    assert rows["weights"]["equal_to_fake_quantized"] is None
    for name, r in rows.items():
        assert 0.0 < r["rel_l2"] < E4M3_ROUNDING, (name, r)
        assert 0.99 < r["cosine"] < 1.0 and r["max_abs"] > 0, (name, r)
        if name != "weights":
            assert r["equal_to_fake_quantized"] is True, name
    assert rows["one forward"]["num_elements"] == 2 * 4 * 2 * 4 * 4  # CFG pair x C x T x h x w latents
    assert rows["request video"]["num_elements"] == 5 * 32 * 32 * 3


def test_byte_rows_are_the_plans_and_the_simulated_step_has_a_dq_lane():
    from benchmarks.repro import fp8_tables
    from dlo_fn.models.specs import config_spec
    from dlo_fn.plan.quant import stored_block
    from dlo_fn.plan.sizes import ModelSizes

    spec = config_spec("tiny")
    rows = {r["item"]: r for r in fp8_tables.byte_rows(spec, num_slots=2)}
    sizes = ModelSizes.from_spec(spec, quantization="fp8")
    assert rows["host arena = pinned = H2D per pass"]["FP8"] == sizes.shard_bytes_per_rank(1) == sum(sizes.stored_bytes)
    assert rows["staging buffer per slot"]["FP8"] == sizes.staging_bytes(1)
    assert rows["slot"]["FP8"] == sizes.max_padded_block_bytes(1) == rows["compute block c_0"]["BF16"]
    block = rows["stored block n_0"]["FP8"]
    parts = sum(rows[f"block 0: {k}"]["FP8"] for k in ("2-D weights", "scales", "kept as they are"))
    assert parts <= block < parts + 64 * len(stored_block(spec.blocks[0]).tensors)  # each tensor packed at 64 B
    assert rows["device weight bytes"]["FP8"] == 2 * (sizes.max_padded_block_bytes(1) + sizes.staging_bytes(1))
    passes = fp8_tables.h200_passes()
    assert {s.stream for s in passes["FP8"].spans if s.op.startswith("DQ")} == {"allgather"}
    assert not passes["BF16"].spans_of("allgather")
    assert passes["FP8"].busy_s("h2d") < 0.51 * passes["BF16"].busy_s("h2d")
    sim = {r["weights"]: r for r in fp8_tables.pass_rows(passes)}
    assert abs(float(sim["BF16"]["simulated ms"]) / float(sim["BF16"]["measured ms"]) - 1) < 0.01
