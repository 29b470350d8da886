"""Checkpoint resolution and header reading (dlo_fn.io.checkpoint): real files, no tensor data read."""

from __future__ import annotations

import hashlib
import json
import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from dlo_fn.io.checkpoint import CheckpointError, open_checkpoint, read_header, resolve_checkpoint
from dlo_fn.io.load import load_checkpoint
from dlo_fn.plan.spec import spec_from_header


def _tensors(num_blocks=2, dim=8):
    torch.manual_seed(0)
    out = {"embed.weight": torch.randn(16, dim)}
    for i in range(num_blocks):
        out[f"blocks.{i}.w"] = torch.randn(dim, dim).to(torch.bfloat16)
        out[f"blocks.{i}.b"] = torch.randn(dim)
    return out


def _write_sharded(root, tensors, per_shard=2):
    root.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    groups = [keys[i : i + per_shard] for i in range(0, len(keys), per_shard)]
    weight_map = {}
    for n, group in enumerate(groups):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in group}, str(root / name))
        weight_map.update({k: name for k in group})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def test_read_header_matches_safetensors(tmp_path):
    tensors = _tensors()
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    header = read_header(path)
    assert header["__metadata__"] == {"format": "pt"}
    with safe_open(str(path), "pt") as f:
        assert sorted(k for k in header if k != "__metadata__") == sorted(f.keys())
        for key in f.keys():
            t = f.get_tensor(key)
            assert header[key]["shape"] == list(t.shape)
            begin, end = header[key]["data_offsets"]
            assert end - begin == t.numel() * t.element_size()


def test_header_alone_gives_the_plan(tmp_path):
    tensors = _tensors(num_blocks=3)
    ckpt = open_checkpoint(_write_sharded(tmp_path / "ck", tensors))
    spec = spec_from_header(ckpt.header)
    assert spec.num_blocks == 3
    assert spec.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values()) == ckpt.total_bytes


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]),
            st.lists(st.integers(0, 5), max_size=3),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_read_header_property(tmp_path_factory, specs):
    path = tmp_path_factory.mktemp("h") / "x.safetensors"
    gen = torch.Generator().manual_seed(len(specs))
    tensors = {f"t{i}": torch.randint(0, 100, shape, generator=gen).to(dtype) for i, (dtype, shape) in enumerate(specs)}
    save_file(tensors, str(path))
    header = read_header(path)
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    ckpt = open_checkpoint(path)
    raw = path.read_bytes()
    for key, t in tensors.items():
        e = ckpt.entries[key]
        assert raw[e.offset_bytes : e.offset_bytes + e.nbytes] == t.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_resolve_directory_file_and_index(tmp_path):
    tensors = _tensors()
    single = tmp_path / "single"
    single.mkdir()
    save_file(tensors, str(single / "model.safetensors"))
    assert resolve_checkpoint(single) == (single, (single / "model.safetensors",), None)
    assert resolve_checkpoint(single / "model.safetensors")[1] == (single / "model.safetensors",)
    sharded = _write_sharded(tmp_path / "sharded", tensors)
    root, files, index = resolve_checkpoint(sharded)
    assert index == sharded / "model.safetensors.index.json" and len(files) == 3
    assert resolve_checkpoint(index)[1] == files
    diffusers = tmp_path / "diffusers" / "transformer"
    diffusers.mkdir(parents=True)
    save_file(tensors, str(diffusers / "diffusion_pytorch_model.safetensors"))
    assert resolve_checkpoint(tmp_path / "diffusers", subfolder="transformer")[1] == (
        diffusers / "diffusion_pytorch_model.safetensors",
    )


def _fake_hf_cache(cache, repo_id, files: dict[str, bytes], commit="0123456789abcdef0123456789abcdef01234567"):
    """The real huggingface_hub cache layout: blobs by hash, a snapshot of relative symlinks, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / digest).write_bytes(data)
        (snap / name).parent.mkdir(parents=True, exist_ok=True)  # "transformer/config.json" nests
        os.symlink(os.path.relpath(repo / "blobs" / digest, (snap / name).parent), snap / name)
    return snap


def test_repo_id_from_local_hf_cache(tmp_path, monkeypatch):
    tensors = _tensors()
    src = tmp_path / "src.safetensors"
    save_file(tensors, str(src))
    cache = tmp_path / "hub"
    snap = _fake_hf_cache(cache, "acme/tiny-dit", {"model.safetensors": src.read_bytes(), "config.json": b"{}"})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # "acme/tiny-dit" is not a local path here
    root, files, _ = resolve_checkpoint("acme/tiny-dit")
    assert root == snap and files == (snap / "model.safetensors",)
    from dlo_fn.io.bind import meta_module_from_header

    model, report = load_checkpoint("acme/tiny-dit", meta_module_from_header(read_header(src)))
    assert report.mapped_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    for key, t in tensors.items():
        assert torch.equal(model.get_parameter(key), t)


def test_repo_id_not_in_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"acme/absent.*Hugging Face cache.*download it first") as info:
        resolve_checkpoint("acme/absent", cache_dir=cache)
    assert info.value.file == str(cache)


def test_header_size_field_is_read_little_endian(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(3)}, str(path))
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert json.loads(path.read_bytes()[8 : 8 + n])["a"]["shape"] == [3]
    assert read_header(path)["a"]["dtype"] == "F32"
