"""The host budget: the planner's three outcomes ('fits', 'partly pinned', 'refused', with the bytes needed and
the largest dp that fits), its step-time cost from pinned and pageable bandwidths, a partly pinned store on 2
real gloo ranks (bit-exact against the resident model, exact-size arena, the pinned pages dropped from the
mapping), and `generate --host-budget` refusing in one line or running."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dlo_fn.cost.host_budget import host_budget, pinned_prefix, streamed_pass_cost_s
from dlo_fn.plan.sizes import GB, ModelSizes

SIZES = ModelSizes.uniform("m", 10 * GB, 10, resident_bytes=0)  # ten 1 GB blocks


def test_pinned_prefix():
    assert pinned_prefix((3, 3, 3), 8) == 2
    assert pinned_prefix((3, 3, 3), 9) == 3
    assert pinned_prefix((3, 3, 3), 2) == 0


def test_fits_partly_refused():
    c = 2 * GB
    fits = host_budget(SIZES, 2, 2 * (c + 5 * GB) + 4096, "allgather", "cuda", constant_bytes=c)
    assert fits.status == "fits" and fits.streamed_bytes == 0 and fits.pinned_bytes == SIZES.shard_bytes_per_rank(2)
    part = host_budget(SIZES, 2, 2 * (c + 2 * GB), "allgather", "cuda", constant_bytes=c)
    assert part.status == "partly pinned" and part.num_pinned_blocks == 4  # 0.5 GB shards in 2 GB
    assert part.pinned_bytes + part.streamed_bytes == SIZES.shard_bytes_per_rank(2)
    refused = host_budget(SIZES, 4, 6 * GB, "allgather", "cuda", constant_bytes=c)
    assert refused.status == "refused" and refused.largest_dp == 3 and refused.num_pinned_blocks == 0
    msg = refused.message()
    assert "8.000 GB" in msg and "largest dp that fits is 3" in msg and "\n" not in msg
    none = host_budget(SIZES, 1, 1 * GB, "rank-local", "cuda", constant_bytes=c)
    assert none.status == "refused" and none.largest_dp == 0 and "no dp fits" in none.message()
    # On CPU the slots, landing buffers and resident copy are host memory: fixed bytes grow.
    cpu = host_budget(SIZES, 2, 2 * (c + 2 * GB), "allgather", "cpu", constant_bytes=c)
    assert cpu.fixed_bytes == 2 * SIZES.max_padded_block_bytes(2) + 2 * SIZES.max_shard_bytes(2)
    assert cpu.num_pinned_blocks < part.num_pinned_blocks


def test_step_cost_from_bandwidths():
    part = host_budget(SIZES, 2, 2 * (2 * GB + 2 * GB), "allgather", "cuda", constant_bytes=2 * GB)
    u = part.streamed_bytes
    assert part.extra_pass_s(55e9, 6.5e9) == pytest.approx(u / 6.5e9 - u / 55e9)
    assert streamed_pass_cost_s(0, 55e9, 6.5e9) == 0
    with pytest.raises(ValueError):
        streamed_pass_cost_s(1, 0, 1)


def _budget_rank(ctx, ckpt: str, mode: str) -> dict:
    from dlo_fn.io.load import load_model
    from dlo_fn.models import BLOCK_PATHS, Request, generate
    from dlo_fn.runtime.offload import offload

    req = Request(prompt="a fox", seed=ctx.rank, num_inference_steps=2, height=32, width=32, num_frames=5)
    with torch.no_grad():
        expected = generate(load_model(ckpt, progress=False), req)
        full = offload(load_model(ckpt, progress=False), BLOCK_PATHS, ctx, mode=mode)
        shards = [s.shard_bytes for s in full.layout.shards]
        budget = sum(shards[:2]) + 1  # two blocks fit, not three
        o = offload(load_model(ckpt, progress=False), BLOCK_PATHS, ctx, mode=mode, pinned_budget_bytes=budget)
        got = generate(o.model, req)
    return {
        "exact": torch.equal(got.latents, expected.latents),
        "pinned": o.store.num_pinned_blocks,
        "arena": o.store.arena_bytes,
        "two": sum(shards[:2]),
        "streamed": o.store.streamed_bytes,
        "rest": sum(shards[2:]),
        "num_blocks": len(shards),
        "open": o.release.mapped_bytes_after > 0,
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["allgather", "rank-local"])
def test_partly_pinned_store_is_exact(request, mode):
    from conftest import scenario

    for r in scenario(request, 2, f"host_budget[{mode}]"):  # _budget_rank(ctx, tiny_checkpoint, mode): conftest
        assert r["exact"] and r["pinned"] == 2 < r["num_blocks"], r
        assert r["arena"] == r["two"], r  # one exact-size arena of the pinned shards
        assert 0.5 * r["rest"] < r["streamed"] <= r["rest"], r  # the pieces, without alignment gaps and padding
        assert r["open"], r  # the streamed blocks still read the mapping


def _cli(ckpt, out, budget):
    cmd = [
        sys.executable,
        "-m",
        "dlo_fn",
        "generate",
        "--checkpoint",
        ckpt,
        "--out",
        str(out),
        "--steps",
        "1",
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "5",
        "--prompt",
        "a fox",
        "--host-budget",
        budget,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", DLO_FN_PLATFORM="cpu")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.slow
def test_generate_host_budget_refuses_or_runs(checkpoint, tmp_path):
    refused = _cli(checkpoint, tmp_path / "a", "1MB")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert "--host-budget 0.001 GB is too small" in line and "no dp fits" in line
    ran = _cli(checkpoint, tmp_path / "b", "100GB")
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "fits, " in ran.stderr and (tmp_path / "b" / "manifest.jsonl").is_file()


@pytest.mark.parametrize("budget,status", [("200GB", "fits"), ("100GB", "partly pinned"), ("10GB", "refused")])
def test_memory_cli_host_budget(capsys, budget, status):
    import json

    from dlo_fn.cli import main

    args = ["memory", "--model", "cosmos3-super", "--dp", "4", "--host-budget", budget]
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["host_budget"] == status
    assert main(args) == 0
    out = capsys.readouterr().out
    assert (
        ("host budget 100.000 GB: partly pinned" in out and "ms more H2D per pass" in out)
        if status == "partly pinned"
        else True
    )
    assert ("largest dp that fits is 2" in out and "ms more" not in out) if status == "refused" else True


@pytest.mark.parametrize("platform, device", [("cuda", "cuda"), ("ascend", "npu")])
def test_memory_per_rank_rows_follow_the_platform_and_state_one_high_water_mark(capsys, platform, device):
    """``memory --platform ascend``: the per-rank rows and the host budget are the NPU's (the pinned arena is
    driver memory, in no process's RSS: a rank holds c after offload), and the cold-start high-water mark is the
    per-rank model's, not a second number."""
    import json

    from dlo_fn.cli import main

    args = [
        "memory",
        "--model-bytes",
        "124GB",
        "--dp",
        "4",
        "--num-blocks",
        "128",
        "--platform",
        platform,
        "--host-budget",
        "256GB",
        "--framework-bytes-per-rank",
        "3.5GB",
        "--json",
    ]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    ranks = doc["rank_memory"]
    assert ranks["device"] == device and doc["host_budget"] == "fits"
    offload = next(p for p in ranks["phases"] if p["phase"] == "offload")
    arena = ranks["terms"]["arena_bytes"]
    assert 31e9 <= arena < 31.01e9 and offload["rss_bytes"] == 3_500_000_000 + (arena if device == "cuda" else 0)
    hwm = [r["value_bytes"] for r in doc["rows"] if r["item"] == "per-rank high-water mark"]
    assert hwm == [max(p["hwm_bytes"] for p in ranks["phases"])]
