"""`python -m dlo_fn plan`: published sizes for Nano/Super, per-rank shard = total / W rounded up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dlo_fn.cli import main
from dlo_fn.io.sources import spec_for
from dlo_fn.plan.layout import model_layout


def _plan(capsys, *args) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name,blocks,gb", [("cosmos3-nano", 72, 33.0), ("cosmos3-super", 128, 124.0)])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_published_sizes(capsys, name, blocks, gb, world):
    plan = _plan(capsys, "--model", name, "--shard-world", str(world))
    assert plan["num_blocks"] == blocks
    assert abs(plan["total_bytes"] / 1e9 - gb) / gb < 0.02
    block_total = plan["total_bytes"] - plan["resident_bytes"]
    # Each block rounds up to W equal aligned shards: at most W * 256 bytes of padding per block.
    assert block_total / world <= plan["shard_bytes_per_rank"] <= block_total / world + blocks * 256
    assert plan["pinned_host_bytes_per_rank"] == plan["shard_bytes_per_rank"]
    layout = model_layout(spec_for(name), world)
    landing = 2 if world > 1 else 0  # an all-gather over one rank lowers to H2D straight into the slot
    assert plan["hbm_weight_bytes"] == 2 * layout.max_padded_block_bytes + landing * layout.max_shard_bytes
    assert plan["num_landing"] == landing
    assert plan["layout_digest"] == layout.digest


def test_num_shards_flag_and_its_old_name_agree(capsys):
    new = _plan(capsys, "--model", "tiny", "--num-shards", "3")
    assert new == _plan(capsys, "--model", "tiny", "--shard-world", "3") and new["num_shards"] == 3


def test_rank_local_holds_whole_blocks(capsys):
    plan = _plan(capsys, "--model", "cosmos3-nano", "--shard-world", "4", "--mode", "rank-local", "--slots", "3")
    whole = model_layout(spec_for("cosmos3-nano"), 1)
    assert plan["num_landing"] == 0 and plan["shard_bytes_per_rank"] == 0
    assert plan["pinned_host_bytes_per_rank"] == whole.shard_bytes_per_rank
    assert plan["hbm_weight_bytes"] == 3 * whole.max_padded_block_bytes


def test_checkpoint_header_gives_the_same_plan_as_the_config(capsys, tmp_path):
    from dlo_fn.models import write_checkpoint

    write_checkpoint("tiny", tmp_path / "ckpt", seed=0)
    from_ckpt = _plan(capsys, "--model", str(tmp_path / "ckpt"), "--shard-world", "3")
    from_config = _plan(capsys, "--model", "tiny", "--shard-world", "3")
    for key in (
        "num_blocks",
        "total_bytes",
        "max_padded_block_bytes",
        "shard_bytes_per_rank",
        "hbm_weight_bytes",
        "layout_digest",
    ):
        assert from_ckpt[key] == from_config[key], key


def test_table_output_and_help():
    out = subprocess.run(
        [sys.executable, "-m", "dlo_fn", "plan", "--model", "tiny"], capture_output=True, text=True, check=True
    ).stdout
    line = out.split("shard_bytes_per_rank")[1].splitlines()[0]
    assert "KB)" in line and "0.000" not in out  # tiny's sizes in a unit that shows them
    helptext = subprocess.run(
        [sys.executable, "-m", "dlo_fn", "plan", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for field in ("max_padded_block_bytes", "pinned_host_bytes_per_rank", "hbm_weight_bytes", "layout_digest"):
        assert field in helptext


def test_unknown_model_is_named():
    from dlo_fn.io.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="nano2"):
        spec_for("nano2")


def test_load_group_plans_the_grouped_layout(capsys):
    # W > 1 with G dividing the blocks: the grouped layout offload builds (its digest, host bytes, 2G landing
    # buffers); G = 5 does not divide Nano's 72 blocks, and W = 1 gathers nothing: per-block shards
    spec = spec_for("cosmos3-nano")
    plan = _plan(capsys, "--model", "cosmos3-nano", "--num-shards", "4", "--load-group", "4", "--slots", "8")
    grouped = model_layout(spec, 4, load_group=4)
    assert (plan["load_group"], plan["num_landing"], plan["layout_digest"]) == (4, 8, grouped.digest)
    assert plan["shard_bytes_per_rank"] == grouped.shard_bytes_per_rank
    assert plan["hbm_weight_bytes"] == 8 * grouped.max_padded_block_bytes + 8 * grouped.max_shard_bytes
    assert plan["rank_terms"]["arena_bytes"] == grouped.shard_bytes_per_rank
    per_block = _plan(capsys, "--model", "cosmos3-nano", "--num-shards", "4", "--load-group", "5", "--slots", "10")
    assert (per_block["load_group"], per_block["layout_digest"]) == (1, model_layout(spec, 4).digest)
    one = _plan(capsys, "--model", "cosmos3-nano", "--load-group", "4", "--slots", "8")
    assert (one["load_group"], one["layout_digest"]) == (1, model_layout(spec, 1).digest)


def test_load_group_needs_its_slots(capsys):
    assert main(["plan", "--model", "tiny", "--num-shards", "2", "--load-group", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--load-group 2: load_group = 2 needs num_slots a multiple of it" in err[0], err


@pytest.mark.parametrize("mode", ["rank-local", "allgather"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_hbm_budget_is_priced_to_the_byte_against_the_runtime(capsys, tiny_checkpoint, mode, quantization):
    """`plan --hbm-budget` keeps the blocks offload keeps; the plan of the spec offload describes gives its device
    weight bytes to the byte. (On CPU offload lays weights out at the resident model's address residues, up to
    64 bytes more per tensor in a slot than the header's plan; on an accelerator the two specs are one.)"""
    from test_executor_dist import load_reference

    from dlo_fn.models import BLOCK_PATHS
    from dlo_fn.plan.resident import choose_resident, layout_for, ring_num_landing
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.offload import offload

    fp8 = ("--quantization", quantization) if quantization else ()
    kept = []
    for budget in ("0.55MB", "0.64MB", "0.7MB"):  # the tiny model: 0.65 MB
        plan = _plan(capsys, "--model", tiny_checkpoint, "--mode", mode, "--hbm-budget", budget, *fp8)["hbm_budget"]
        ctx = init_distributed()
        o = offload(
            load_reference(tiny_checkpoint), BLOCK_PATHS, ctx, mode=mode, hbm_budget=budget, quantization=quantization
        )
        assert plan["resident_blocks"] == list(o.resident_blocks)
        again = choose_resident(
            o.spec,
            plan["budget_bytes"],
            lambda s: layout_for(s, 1, quantization=quantization),
            2,
            ring_num_landing(mode, 1, None),
        )
        assert again.resident == o.resident_blocks and again.device_weight_bytes == o.device_weight_bytes
        assert again.h2d_bytes_per_pass == (o.store.arena_bytes if o.store else 0)
        assert o.device_weight_bytes <= plan["budget_bytes"]
        tensors = max(len(b.tensors) for b in o.spec.blocks)
        assert 0 <= o.device_weight_bytes - plan["device_weight_bytes"] <= 2 * 2 * 64 * tensors
        kept.append(plan["num_resident"])
    assert kept[-1] == 4 and (quantization or 0 < kept[1] < 4)  # FP8's staging leaves no room between here


def test_hbm_budget_below_the_ring_is_one_line(capsys):
    assert main(["plan", "--model", "tiny", "--hbm-budget", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pass at least" in err[0] and "Traceback" not in err[0]
