"""Checkpoint writer: real safetensors (single and sharded), index, config.json, and the CLI."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from dlo_fn.cli import main as cli_main
from dlo_fn.models import (
    CONFIGS,
    MODEL_TYPE,
    Request,
    build_model,
    generate,
    load_config,
    parse_size,
    write_checkpoint,
)
from dlo_fn.models.checkpoint import INDEX_FILE, SINGLE_FILE, shard_tensors
from dlo_fn.models.init import TensorInit, init_plan

REQ = Request(prompt="a paper boat", seed=5, height=32, width=32, num_frames=5, num_inference_steps=3)


def _read_all(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
    return tensors


def _header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("max_shard", ["2GB", "60KB"])
def test_round_trip_reproduces_generate(tmp_path, dtype, max_shard):
    out = write_checkpoint("tiny", tmp_path / "ck", seed=3, dtype=dtype, max_shard_bytes=max_shard, progress=False)
    config, torch_dtype = load_config(out)
    assert config == CONFIGS["tiny"]
    meta = json.loads((out / "config.json").read_text())
    assert meta["model_type"] == MODEL_TYPE and meta["dtype"] == dtype and meta["seed"] == 3

    tensors = _read_all(out)
    model = build_model(config, "meta", torch_dtype).to_empty(device="cpu")
    model.load_state_dict(tensors, strict=True)
    model.init_buffers()
    reference = build_model("tiny", "cpu", torch_dtype, seed=3)
    assert generate(model, REQ).sha256 == generate(reference, REQ).sha256
    if dtype == "bf16":
        assert {t.dtype for t in tensors.values()} == {torch.bfloat16, torch.float32}


def test_single_file_below_the_shard_size(tmp_path):
    out = write_checkpoint("tiny", tmp_path, progress=False)
    assert sorted(os.listdir(out)) == ["config.json", SINGLE_FILE]


def test_sharded_index_is_valid(tmp_path):
    out = write_checkpoint("tiny", tmp_path, max_shard_bytes="60KB", progress=False)
    index = json.loads((out / INDEX_FILE).read_text())
    plan = init_plan(build_model("tiny"))
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in plan)
    assert set(index["weight_map"]) == {t.name for t in plan}
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files == sorted(p for p in os.listdir(out) if p.endswith(".safetensors"))
    for name in files:
        n, header = _header(out / name)
        assert n % 8 == 0
        keys = [k for k in header if k != "__metadata__"]
        assert all(index["weight_map"][k] == name for k in keys)
        spans = sorted(tuple(header[k]["data_offsets"]) for k in keys)
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert os.path.getsize(out / name) == 8 + n + spans[-1][1]
        for k in keys:  # every tensor aligned to its item size in the file
            assert (8 + n + header[k]["data_offsets"][0]) % (4 if header[k]["dtype"] == "F32" else 2) == 0


def test_refuses_to_mix_with_an_existing_checkpoint(tmp_path):
    write_checkpoint("tiny", tmp_path, max_shard_bytes="60KB", progress=False)
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite"):
        write_checkpoint("tiny", tmp_path, progress=False)
    write_checkpoint("tiny", tmp_path, overwrite=True, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["config.json", SINGLE_FILE, "notes.txt"]


def test_load_config_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="make-checkpoint"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "flux"}))
    with pytest.raises(ValueError, match="model_type"):
        load_config(tmp_path / "model.safetensors")
    good = {"model_type": MODEL_TYPE, "dtype": "bf16", "seed": 0, "config": CONFIGS["tiny"].to_dict()}
    (tmp_path / "config.json").write_text(json.dumps({**good, "dtype": "int4"}))
    with pytest.raises(ValueError, match="'dtype'"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**good, "config": {**good["config"], "hidden_dim": 0}}))
    with pytest.raises(ValueError, match="hidden_dim"):
        load_config(tmp_path)


def test_parse_size():
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size("1GiB") == 2**30
    assert parse_size("100kb") == 100_000
    assert parse_size("2e9") == 2_000_000_000
    assert parse_size(512) == 512
    for bad in ("", "2XB", "-1GB", "0"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=30), limit=st.integers(1, 3000))
def test_shards_cover_in_order_and_respect_the_limit(sizes, limit):
    tensors = [TensorInit(f"t{i}", (n,), torch.uint8, 0.0, 1.0) for i, n in enumerate(sizes)]
    shards = shard_tensors(tensors, limit)
    assert [t for s in shards for t in s] == tensors
    for shard in shards:
        assert shard and (len(shard) == 1 or sum(t.nbytes for t in shard) <= limit)


def test_cli_help_and_run(tmp_path, capsys):
    done = subprocess.run(
        [sys.executable, "-m", "dlo_fn", "make-checkpoint", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "--max-shard-size" in done.stdout and "cosmos3-nano" in done.stdout
    out = tmp_path / "ck"
    argv = [
        "make-checkpoint",
        "--model",
        "tiny",
        "--out",
        str(out),
        "--seed",
        "4",
        "--dtype",
        "fp32",
        "--max-shard-size",
        "100KB",
        "--no-progress",
    ]
    assert cli_main(argv) == 0
    assert "wrote tiny" in capsys.readouterr().out
    assert load_config(out) == (CONFIGS["tiny"], torch.float32)
    reference = build_model("tiny", "cpu", torch.float32, seed=4).state_dict()
    tensors = _read_all(out)
    assert tensors.keys() == reference.keys()
    assert all(torch.equal(tensors[k], reference[k]) for k in reference)
    assert cli_main(argv) == 2
    assert "already holds" in capsys.readouterr().err
