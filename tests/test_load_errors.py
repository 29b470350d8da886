"""Every bad checkpoint input fails with a CheckpointError naming the file and key, and leaves the module as
it was (still on meta): no partially loaded model."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from dlo_fn.io.bind import meta_params
from dlo_fn.io.checkpoint import CheckpointError
from dlo_fn.io.load import load_checkpoint


class Small(nn.Module):
    def __init__(self, dim=8, dtype=torch.float32, extra=False):
        super().__init__()
        self.embed = nn.Linear(4, dim, dtype=dtype)
        self.blocks = nn.ModuleList([nn.Linear(dim, dim, dtype=dtype) for _ in range(2)])
        if extra:
            self.head = nn.Linear(dim, 2, dtype=dtype)


def _state(**kw):
    torch.manual_seed(0)
    return {k: v.contiguous() for k, v in Small(**kw).state_dict().items()}


def _meta(**kw):
    with meta_params():
        return Small(**kw)


def _all_meta(model):
    return all(t.is_meta for t in model.state_dict().values())


@pytest.fixture
def ckpt(tmp_path):
    save_file(_state(), str(tmp_path / "model.safetensors"))
    return tmp_path


def _fails(checkpoint, model, match, key=None, file=None, **kw):
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(checkpoint, model, **kw)
    if key is not None:
        assert info.value.key == key
    if file is not None:
        assert info.value.file == str(file)
    assert _all_meta(model), "the module was left half bound"
    return info.value


def test_good_checkpoint_loads(ckpt):
    model, report = load_checkpoint(ckpt, _meta())
    assert report.num_tensors == 6 and report.private_copy_bytes == 0
    for key, t in _state().items():
        assert torch.equal(model.get_parameter(key), t)


def test_missing_directory(tmp_path):
    _fails(tmp_path / "absent", _meta(), "no such checkpoint directory or file", file=tmp_path / "absent")


def test_missing_file(tmp_path):
    _fails(tmp_path / "absent.safetensors", _meta(), "no such checkpoint", file=tmp_path / "absent.safetensors")


def test_directory_without_weights(tmp_path):
    _fails(tmp_path, _meta(), "holds no .safetensors file", file=tmp_path)


def test_truncated_file(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    err = _fails(ckpt, _meta(), "truncated.*download or write it again", file=path)
    assert err.key is not None  # the last tensor, whose bytes are cut off


def test_truncated_inside_header(ckpt):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:20])
    _fails(ckpt, _meta(), "truncated: header size", file=path)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda h: b"{not json" + h[9:], "not valid JSON"),
        (lambda h: h.replace(b'"F32"', b'"Q99"', 1), "unknown safetensors dtype"),
        (lambda h: h.replace(b'"shape":[8,4]', b'"shape":[8,5]', 1), r"byte span"),
    ],
)
def test_corrupted_header(ckpt, mutate, match):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = mutate(data[8 : 8 + n])
    assert len(header) == n
    path.write_bytes(data[:8] + header + data[8 + n :])
    _fails(ckpt, _meta(), "corrupted header|" + match, file=path)


def test_insane_header_size(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**62) + data[8:])
    _fails(ckpt, _meta(), "header size .* is not sane", file=path)


def test_overlapping_offsets(tmp_path):
    path = tmp_path / "model.safetensors"
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(12))
    with pytest.raises(CheckpointError, match="overlaps the previous tensor") as info:
        load_checkpoint(path, _meta())
    assert info.value.key == "b"


def test_missing_key(ckpt):
    _fails(
        ckpt,
        _meta(extra=True),
        "missing key: 2 module tensor.*head.weight",
        key="head.weight",
        file=ckpt / "model.safetensors",
    )


def test_unexpected_key(tmp_path):
    save_file(_state(extra=True), str(tmp_path / "model.safetensors"))
    _fails(
        tmp_path,
        _meta(),
        "unexpected key: 2 checkpoint tensor.*key_map",
        key="head.bias",
        file=tmp_path / "model.safetensors",
    )


def test_shape_mismatch(ckpt):
    _fails(
        ckpt,
        _meta(dim=16),
        r"shape mismatch: checkpoint \[8, 4\] vs module 'embed.weight' \[16, 4\]",
        key="embed.weight",
        file=ckpt / "model.safetensors",
    )


def test_dtype_mismatch_and_explicit_cast(ckpt):
    model = _meta(dtype=torch.bfloat16)
    _fails(
        ckpt,
        model,
        r"dtype mismatch: checkpoint torch.float32 vs module 'embed.weight' torch.bfloat16.*"
        "cast_dtype=True",
        key="embed.weight",
        file=ckpt / "model.safetensors",
    )
    model, report = load_checkpoint(ckpt, model, cast_dtype=True)
    assert model.embed.weight.dtype == torch.bfloat16
    assert len(report.cast_tensors) == 6 and report.mapped_bytes == 0
    assert report.private_copy_bytes == sum(p.numel() * 2 for p in model.parameters())
    assert torch.equal(model.embed.weight, _state()["embed.weight"].to(torch.bfloat16))


def test_index_names_missing_shard(tmp_path):
    state = _state()
    keys = sorted(state)
    save_file({k: state[k] for k in keys[:3]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in keys[:3]}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in keys[3:]})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _fails(
        tmp_path,
        _meta(),
        "names shard model-00002-of-00002.safetensors, which is missing",
        key=keys[3],
        file=tmp_path / "model-00002-of-00002.safetensors",
    )


def test_index_disagrees_with_shard(tmp_path):
    state = _state()
    save_file(state, str(tmp_path / "a.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {**{k: "a.safetensors" for k in state}, "ghost.weight": "a.safetensors"}})
    )
    _fails(tmp_path, _meta(), "the index and shards disagree", key="ghost.weight")


def test_repo_id_not_in_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    _fails("acme/not-cached", _meta(), "neither a local path nor a repo in the Hugging Face cache", file=tmp_path)


def test_meta_non_persistent_buffer_without_hook(ckpt):
    model = _meta()
    model.register_buffer("rope", torch.empty(3, device="meta"), persistent=False)
    _fails(ckpt, model, "non-persistent buffer.*rope.*pass a factory", key="rope")


def test_failure_during_binding_rolls_back(ckpt, monkeypatch):
    model = _meta()
    model.init_non_persistent_buffers = lambda: (_ for _ in ()).throw(RuntimeError("boom"))
    model.register_buffer("rope", torch.empty(3, device="meta"), persistent=False)
    with pytest.raises(RuntimeError, match="boom"):
        load_checkpoint(ckpt, model)
    assert _all_meta(model)


# -- the reported cases (issue 11, items 4 and 8): each is the loader's CheckpointError, naming the right path --


def test_non_string_metadata_value_is_refused_before_safetensors_sees_it(tmp_path):
    path = tmp_path / "model.safetensors"
    header = {"__metadata__": {"format": 1}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(CheckpointError, match="__metadata__ is not an object of strings") as info:
        load_checkpoint(tmp_path, _meta())
    assert info.value.file == str(path) and info.value.key == "__metadata__"


def test_a_key_stored_twice_is_refused(tmp_path):
    path = tmp_path / "x.safetensors"  # safetensors keeps the last entry silently
    raw = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(CheckpointError, match="key 'a' appears twice"):
        load_checkpoint(path, _meta())


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"a":{"dtype":"F32","shape":[true, 2],"data_offsets":[0,8]}}', "is not a list of sizes"),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[-0,8]}}', "negative number -0"),
        (
            '{"a":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]},'
            '"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
            "overflows 64 bits",
        ),
        ('{"a":{"dtype":["F32"],"shape":[2],"data_offsets":[0,8]}}', "is not a name"),
    ],
)
def test_headers_safetensors_refuses_are_refused_here(tmp_path, text, match):
    from safetensors import safe_open

    path = tmp_path / "x.safetensors"
    raw = text.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path, _meta())
    with pytest.raises(Exception):  # what we mirror: safetensors itself refuses these
        with safe_open(str(path), "pt") as f:
            [f.get_tensor(k) for k in f.keys()]


def test_weights_name_that_is_a_directory_or_a_broken_symlink(tmp_path):
    (tmp_path / "d" / "model.safetensors").mkdir(parents=True)
    _fails(
        tmp_path / "d",
        _meta(),
        "model.safetensors is a directory, not a file",
        file=tmp_path / "d" / "model.safetensors",
    )
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    _fails(
        tmp_path / "s",
        _meta(),
        r"is a broken symlink \(to .*gone.safetensors\)",
        file=tmp_path / "s" / "model.safetensors",
    )


def test_a_shard_that_is_a_directory(tmp_path):
    state = _state()
    save_file(state, str(tmp_path / "a.safetensors"))
    (tmp_path / "b.safetensors").mkdir()
    weight_map = {k: "a.safetensors" for k in state} | {"extra.weight": "b.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _fails(tmp_path, _meta(), "names shard b.safetensors, which is a directory", key="extra.weight")


@pytest.mark.parametrize("name", ["../elsewhere.safetensors", "/abs.safetensors", ""])
def test_index_shard_names_outside_the_folder(tmp_path, name):
    save_file(_state(), str(tmp_path / "a.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"embed.weight": name}}))
    _fails(tmp_path, _meta(), "not a file name beside the index", key="embed.weight")


def test_a_path_under_an_existing_folder_is_a_path_not_a_repo_id(ckpt, monkeypatch):
    monkeypatch.chdir(ckpt.parent)
    _fails(f"{ckpt.name}/nothere", _meta(), "no such checkpoint directory or file", file=f"{ckpt.name}/nothere")
    _fails(f"{ckpt.name}/model.safetensorz", _meta(), "no such checkpoint", file=f"{ckpt.name}/model.safetensorz")


def test_missing_weights_file_of_a_dlo_checkpoint_names_that_file(tiny_checkpoint, tmp_path):
    from dlo_fn.io.load import load_model

    target = tmp_path / "ckpt" / "model.safetensors"
    target.parent.mkdir()
    with pytest.raises(CheckpointError, match="no such checkpoint directory or file") as info:
        load_model(target)
    assert info.value.file == str(target)


def test_index_path_of_a_dlo_checkpoint_loads_and_plans(tiny_checkpoint, tmp_path):
    import pathlib
    import shutil

    from dlo_fn.io.checkpoint import read_header
    from dlo_fn.io.load import load_model
    from dlo_fn.io.sources import spec_for

    folder = pathlib.Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    keys = [k for k in read_header(folder / "model.safetensors") if k != "__metadata__"]
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {k: "model.safetensors" for k in keys}}))
    assert type(load_model(index, progress=False)).__name__ == "VideoDiT"
    assert spec_for(index) == spec_for(folder)


def test_plan_checks_the_header_against_the_config_model(tiny_checkpoint, tmp_path):
    """One flipped byte (blocks.2.mlp -> blocus.2.mlp) changed the header-only plan; now the plan fails as the
    loader does."""
    import pathlib
    import shutil

    from dlo_fn.io.load import load_model
    from dlo_fn.io.sources import spec_for

    folder = pathlib.Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    at = data.index(b"blocks.2.mlp.fc2.weight")
    data[at + 4] ^= ord("k") ^ ord("u")
    path.write_bytes(bytes(data))
    for call in (lambda: spec_for(folder), lambda: load_model(folder, progress=False)):
        with pytest.raises(CheckpointError, match="unexpected key: 1 checkpoint tensor.*blocus.2.mlp.fc2.weight"):
            call()
    spec_for(folder, validate=False)  # headers alone: a plan, of another model


def test_header_only_plan_errors_are_checkpoint_errors(tmp_path):
    from dlo_fn.io.sources import spec_for

    save_file({"a": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="cannot plan from the headers alone: no '<path>.<index>.<name>' keys"):
        spec_for(tmp_path)
