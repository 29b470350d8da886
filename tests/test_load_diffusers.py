"""Diffusers models load as they are (dlo_fn.io.diffusers_load): a save_pretrained folder, a pipeline folder,
a repo id in a local Hugging Face cache, a diffusers class, a meta-built module; each bound zero-copy and equal,
tensor by tensor and output by output, to from_pretrained; block lists detected for the common DiT classes."""

from __future__ import annotations

import pytest
import torch
from test_load_checkpoint import _fake_hf_cache
from test_third_party import flux, flux_inputs, wan, wan_inputs
from torch import nn

from dlo_fn.io.checkpoint import CheckpointError
from dlo_fn.io.load import load_checkpoint, load_model
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.offload import offload
from dlo_fn.runtime.platform import platform_for

diffusers = pytest.importorskip("diffusers")
CTX = DistContext(0, 1, 0, platform_for("cpu"), None)
BUILDERS = {"wan": (wan, wan_inputs), "flux": (flux, flux_inputs)}


def save_folder(name: str, dtype: torch.dtype, folder) -> type:
    """A save_pretrained folder as diffusers writes it in ``dtype`` (bf16: through from_pretrained(torch_dtype),
    so the _keep_in_fp32_modules stay fp32 in the file, as in a published bf16 checkpoint)."""
    model = BUILDERS[name][0]()
    if dtype != torch.float32:
        model.save_pretrained(folder / "fp32")
        model = type(model).from_pretrained(folder / "fp32", torch_dtype=dtype)
    model.save_pretrained(folder)
    return type(model)


def cast_inputs(inputs: dict, dtype: torch.dtype) -> dict:
    return {
        k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() and k != "timestep" else v
        for k, v in inputs.items()
    }


def assert_same_model(got: nn.Module, ref: nn.Module) -> None:
    want = dict(ref.state_dict(keep_vars=True))
    assert sorted(got.state_dict()) == sorted(want)
    for key, t in got.state_dict(keep_vars=True).items():
        assert t.dtype == want[key].dtype and torch.equal(t, want[key]), key
    ref_buffers = dict(ref.named_buffers())
    for key, b in got.named_buffers():  # non-persistent ones too: never cast, never on meta
        assert not b.is_meta and b.dtype == ref_buffers[key].dtype and torch.equal(b, ref_buffers[key]), key


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_folder_loads_as_from_pretrained(tmp_path, name, dtype):
    cls = save_folder(name, dtype, tmp_path)
    ref = cls.from_pretrained(tmp_path, torch_dtype=dtype)
    got, report = load_checkpoint(tmp_path, progress=False)
    assert type(got) is cls and not got.training
    assert_same_model(got, ref)
    assert report.private_copy_bytes == 0 and report.mapped_bytes == sum(
        t.numel() * t.element_size() for t in got.state_dict().values()
    )
    inputs = cast_inputs(BUILDERS[name][1](0), dtype)
    assert torch.equal(got(**inputs)[0], ref(**inputs)[0])


def test_keep_in_fp32_modules_are_cast_up_as_from_pretrained_does(tmp_path):
    """A folder with everything in bf16 (``model.to(bf16).save_pretrained``): from_pretrained(bf16) loads Wan's
    fp32 modules in fp32; so does load_model, reporting those casts as private copies."""
    wan().to(torch.bfloat16).save_pretrained(tmp_path)
    ref = diffusers.WanTransformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    got, report = load_checkpoint(tmp_path, progress=False)
    assert_same_model(got, ref)
    assert got.scale_shift_table.dtype == torch.float32 and got.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert report.cast_tensors and all(
        any(m in name.split(".") for m in got._keep_in_fp32_modules) for name in report.cast_tensors
    )
    assert report.private_copy_bytes == sum(got.get_parameter(n).numel() * 4 for n in report.cast_tensors)


def test_torch_dtype_builds_in_that_dtype(tmp_path):
    save_folder("wan", torch.float32, tmp_path)
    ref = diffusers.WanTransformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    assert_same_model(load_model(tmp_path, torch_dtype=torch.bfloat16, progress=False), ref)


def test_the_class_builds_from_the_checkpoint_config(tmp_path):
    save_folder("wan", torch.float32, tmp_path)
    got = load_model(tmp_path, diffusers.WanTransformer3DModel, progress=False)
    assert len(got.blocks) == 3  # the folder's config, not the class default of 40 layers
    assert_same_model(got, diffusers.WanTransformer3DModel.from_pretrained(tmp_path))


def test_a_meta_built_model_gets_its_unsaved_buffers_back(tmp_path):
    save_folder("wan", torch.float32, tmp_path)
    ref = diffusers.WanTransformer3DModel.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel.from_config(ref.config)
    assert model.rope.freqs_cos.is_meta
    report = load_checkpoint(tmp_path, model, progress=False).report
    assert report.recomputed_buffers == ("rope.freqs_cos", "rope.freqs_sin")
    assert_same_model(model, ref)


def test_pipeline_folder_and_hf_cache_repo_ids(tmp_path, monkeypatch):
    """A pipeline folder resolves to its transformer/; a cached repo id with subfolder= or without (a pipeline
    repo) loads from the cache's snapshot, nothing downloaded."""
    save_folder("flux", torch.float32, tmp_path / "src")
    files = {f"transformer/{p.name}": p.read_bytes() for p in (tmp_path / "src").iterdir() if p.is_file()}
    files["model_index.json"] = b'{"_class_name": "FluxPipeline", "_diffusers_version": "0.42.1"}'
    ref = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "src")
    pipeline = tmp_path / "pipeline"
    (pipeline / "transformer").mkdir(parents=True)
    for name, data in files.items():
        (pipeline / name).write_bytes(data)
    assert_same_model(load_model(pipeline, progress=False), ref)
    cache = tmp_path / "hub"
    _fake_hf_cache(cache, "acme/tiny-flux", files)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert_same_model(load_model("acme/tiny-flux", subfolder="transformer", progress=False), ref)
    assert_same_model(load_model("acme/tiny-flux", progress=False), ref)


@torch.no_grad()
def test_offload_finds_the_block_lists_itself(tmp_path):
    save_folder("flux", torch.float32, tmp_path)
    ref = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path)
    want = ref(**flux_inputs(0))[0]
    for model in (diffusers.FluxTransformer2DModel.from_pretrained(tmp_path), load_model(tmp_path, progress=False)):
        o = offload(model, ctx=CTX)
        assert [s.block.name for s in o.layout.shards][1::2] == ["transformer_blocks.1", "single_transformer_blocks.1"]
        assert torch.equal(o.model(**flux_inputs(0))[0], want)


BLOCKS = {  # diffusers 0.42.1 class defaults, built on meta
    "WanTransformer3DModel": {"blocks": 40},
    "FluxTransformer2DModel": {"transformer_blocks": 19, "single_transformer_blocks": 38},
    "HunyuanVideoTransformer3DModel": {"transformer_blocks": 20, "single_transformer_blocks": 40},
    "LTXVideoTransformer3DModel": {"transformer_blocks": 28},
    "CogVideoXTransformer3DModel": {"transformer_blocks": 30},
    "SD3Transformer2DModel": {"transformer_blocks": 18},
    "QwenImageTransformer2DModel": {"transformer_blocks": 60},
}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_lists_of_common_dits(name):
    from dlo_fn.io.diffusers_load import block_paths_for

    with torch.device("meta"):
        model = getattr(diffusers, name)()
    paths = block_paths_for(model)
    assert {p: len(model.get_submodule(p)) for p in paths} == BLOCKS[name]
    assert paths == tuple(BLOCKS[name])  # forward order


def test_undecidable_block_lists_name_the_candidates():
    from dlo_fn.io.diffusers_load import block_paths_for

    model = nn.Module()
    model.encoder = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    model.decoder = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    with pytest.raises(ValueError, match=r"encoder \(3 x Linear\), decoder \(4 x Linear\).*block_paths="):
        block_paths_for(model)
    del model.encoder
    assert block_paths_for(model) == ("decoder",)


def test_unknown_class_name_is_a_checkpoint_error(tmp_path):
    save_folder("wan", torch.float32, tmp_path)
    config = (tmp_path / "config.json").read_text().replace("WanTransformer3DModel", "WanTransformer9DModel")
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match="'WanTransformer9DModel' is not a diffusers model class") as info:
        load_model(tmp_path, progress=False)
    assert info.value.file == str(tmp_path / "config.json")


def test_a_config_that_does_not_fit_the_weights_fails_before_binding(tmp_path):
    save_folder("wan", torch.float32, tmp_path)
    (tmp_path / "config.json").write_text(
        (tmp_path / "config.json").read_text().replace('"num_layers": 3', '"num_layers": 4')
    )
    with pytest.raises(CheckpointError, match=r"missing key: \d+ module tensor.*blocks\.3\."):
        load_model(tmp_path, progress=False)


def test_a_model_whose_buffers_were_cast_gets_a_warning(tmp_path, caplog):
    save_folder("wan", torch.bfloat16, tmp_path)
    ref = diffusers.WanTransformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    model = diffusers.WanTransformer3DModel.from_config(ref.config).to(torch.bfloat16)  # the obvious way
    assert model.rope.freqs_cos.dtype == torch.bfloat16 != ref.rope.freqs_cos.dtype
    with caplog.at_level("WARNING", logger="dlo_fn.io.load"):
        load_checkpoint(tmp_path, model, cast_dtype=True, progress=False)
    assert "rope.freqs_cos, rope.freqs_sin are not in the dtype from_pretrained gives them" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="dlo_fn.io.load"):
        load_checkpoint(tmp_path, progress=False)
    assert "from_pretrained gives them" not in caplog.text
