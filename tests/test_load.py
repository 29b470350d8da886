"""mmap binding (dlo_fn.io.load): zero-copy views into the file mapping, bit-exact values, key maps,
ties, casts, copy mode, and the memory it really costs (smaps of this process)."""

from __future__ import annotations

import dataclasses
import gc
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from dlo_fn.io.bind import meta_module_from_header, meta_params
from dlo_fn.io.checkpoint import read_header
from dlo_fn.io.load import LoadReport, load_checkpoint, load_model
from dlo_fn.io.mappings import file_mappings, in_mappings


class Net(nn.Module):
    def __init__(self, dim=16, depth=3, dtype=torch.float32):
        super().__init__()
        self.embed = nn.Linear(8, dim, dtype=dtype)
        self.blocks = nn.ModuleList([nn.Linear(dim, dim, dtype=dtype) for _ in range(depth)])
        self.register_buffer("step", torch.arange(4))  # persistent int buffer
        self.register_buffer("freqs", torch.linspace(0, 1, dim, dtype=dtype), persistent=False)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = torch.tanh(block(x)) * self.freqs
        return x


def _write(tmp_path, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    ref = Net(dtype=dtype, **kw)
    with torch.no_grad():
        ref.step.copy_(torch.tensor([3, 1, 4, 1]))
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "model.safetensors"))
    return ref


def _ptrs_in_file(model, path):
    ranges = file_mappings([path])[str(path.resolve())]
    return [in_mappings(ranges, t.data_ptr(), t.numel() * t.element_size()) for t in model.state_dict().values()]


def test_mmap_views_are_inside_the_file_mapping_and_bit_exact(tmp_path):
    ref = _write(tmp_path)
    model, report = load_checkpoint(tmp_path, lambda: Net())
    assert all(_ptrs_in_file(model, tmp_path / "model.safetensors"))
    assert report.verified and report.private_copy_bytes == 0 and report.mode == "mmap"
    assert report.mapped_bytes == sum(t.numel() * t.element_size() for t in ref.state_dict().values())
    assert report.recomputed_buffers == ("freqs",) and report.num_tensors == 9
    x = torch.randn(5, 8)
    assert torch.equal(model(x), ref(x))
    assert all(not p.requires_grad for p in model.parameters())
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.mapped_bytes = 0


def test_meta_module_with_hook_and_load_model(tmp_path):
    ref = _write(tmp_path)
    with meta_params(), torch.device("meta"):
        model = Net()
    assert model.freqs.is_meta
    model.init_non_persistent_buffers = lambda: model.register_buffer(
        "freqs", torch.linspace(0, 1, 16), persistent=False
    )
    out = load_model(tmp_path / "model.safetensors", model)
    assert out is model and torch.equal(model.freqs, ref.freqs)
    assert torch.equal(model.blocks[2].weight, ref.blocks[2].weight)


def test_copy_mode_is_private_and_drops_the_mapping(tmp_path):
    ref = _write(tmp_path)
    model, report = load_checkpoint(tmp_path, Net, mode="copy")
    gc.collect()
    assert report.mapped_bytes == 0 and report.private_copy_bytes > 0
    assert file_mappings([tmp_path / "model.safetensors"])[str((tmp_path / "model.safetensors").resolve())] == []
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)


def test_sharded_key_map_and_ignored_keys(tmp_path):
    ref = _write(tmp_path)
    state = {"transformer." + k: v.contiguous() for k, v in ref.state_dict().items()}
    state["text_encoder.unused"] = torch.zeros(3)
    keys = sorted(state)
    weight_map = {}
    for n, part in enumerate((keys[:4], keys[4:])):
        name = f"model-{n}.safetensors"
        save_file({k: state[k] for k in part}, str(tmp_path / name))
        weight_map.update(dict.fromkeys(part, name))
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    def strip(key):
        return key.removeprefix("transformer.") if key.startswith("transformer.") else None

    model, report = load_checkpoint(tmp_path, Net, key_map=strip)
    assert report.ignored_keys == ("text_encoder.unused",) and len(report.files) == 2
    for name in ("model-0.safetensors", "model-1.safetensors"):
        assert any(_ptrs_in_file(model, tmp_path / name))
    assert all(
        a or b
        for a, b in zip(
            _ptrs_in_file(model, tmp_path / "model-0.safetensors"),
            _ptrs_in_file(model, tmp_path / "model-1.safetensors"),
        )
    )
    x = torch.randn(2, 8)
    assert torch.equal(model(x), ref(x))
    mapping = {k: k.removeprefix("transformer.") for k in state if k.startswith("transformer.")}
    with pytest.raises(ValueError, match="unexpected key.*text_encoder.unused"):
        load_checkpoint(tmp_path, Net, key_map=mapping)


def test_tied_weights_bind_once(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.inp.weight

    torch.manual_seed(0)
    ref = Tied()
    save_file({"inp.weight": ref.inp.weight.detach().contiguous()}, str(tmp_path / "model.safetensors"))
    model, report = load_checkpoint(tmp_path, Tied)
    assert model.out.weight is model.inp.weight and torch.equal(model.out.weight, ref.inp.weight)
    assert report.num_tensors == 1 and report.mapped_bytes == 160


def test_cast_to_a_compute_dtype(tmp_path):
    ref = _write(tmp_path, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype mismatch"):
        load_checkpoint(tmp_path, Net)
    model, report = load_checkpoint(tmp_path, Net, cast_dtype=torch.float32)
    assert model.embed.weight.dtype == torch.float32 and model.step.dtype == torch.int64
    assert torch.equal(model.embed.weight, ref.embed.weight.float())
    assert set(report.cast_tensors) == {n for n, _ in ref.named_parameters()}
    assert report.mapped_bytes == 4 * 8  # the int64 buffer stays a shared view
    assert report.private_copy_bytes == 4 * sum(p.numel() for p in ref.parameters())


def test_meta_module_from_header_loads_any_checkpoint(tmp_path):
    ref = _write(tmp_path)
    model, report = load_checkpoint(tmp_path, meta_module_from_header(read_header(tmp_path / "model.safetensors")))
    assert torch.equal(model.get_parameter("blocks.1.bias"), ref.blocks[1].bias)


def test_load_report_invariants():
    with pytest.raises(ValueError, match="mode"):
        LoadReport("x", "lazy", (), 0, 0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        LoadReport("x", "mmap", (), 1, -1, 0)


@pytest.mark.slow
def test_mmap_costs_page_cache_and_copy_costs_private_memory(tmp_path):
    """In a fresh process (whose heap holds no pages an earlier test freed, which a copy could reuse and add
    nothing): touching mmap-bound weights adds file-backed PSS, no anonymous memory; the copy loader adds
    anonymous memory of the model's size."""
    torch.manual_seed(0)
    big = {f"blocks.{i}.w": torch.randn(1024, 1024) for i in range(16)}  # 64 MiB
    save_file(big, str(tmp_path / "model.safetensors"))
    model_bytes = 16 * 4 * 1024 * 1024
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120, check=True
    )
    results = json.loads(out.stdout.splitlines()[-1])
    assert results["checksum"] == pytest.approx(sum(float(t.sum()) for t in big.values()))
    anon, file = results["mmap"]
    assert anon < 0.1 * model_bytes and file > 0.9 * model_bytes, results
    anon, _ = results["copy"]
    assert anon > 0.95 * model_bytes, results


_MEMORY_CHILD = """
import gc, json, pathlib, sys
from dlo_fn.io.bind import meta_module_from_header
from dlo_fn.io.checkpoint import read_header
from dlo_fn.io.load import load_checkpoint
from dlo_fn.io.memstat import process_memory
folder = pathlib.Path(sys.argv[1])
header = read_header(folder / "model.safetensors")
results = {}
for mode in ("mmap", "copy"):
    gc.collect()
    before = process_memory()
    model, _ = load_checkpoint(folder, meta_module_from_header(header), mode=mode)
    results["checksum"] = sum(float(p.sum()) for p in model.parameters())
    after = process_memory()
    results[mode] = (after.pss_anon_bytes - before.pss_anon_bytes, after.pss_file_bytes - before.pss_file_bytes)
    del model
print(json.dumps(results))
"""


def test_reference_dit_from_config_generates_bit_exact(tmp_path):
    """A written dlo_fn checkpoint loads with no model argument (built from config.json on meta), every
    tensor a view into the file, and generates the same video as the model built directly on the CPU."""
    from dlo_fn.models import Request, build_model, generate, write_checkpoint

    write_checkpoint("tiny", tmp_path, seed=3, dtype="bf16", progress=False)
    model, report = load_checkpoint(tmp_path)
    assert report.private_copy_bytes == 0 and report.recomputed_buffers == ("rope_inv_freq",)
    assert all(_ptrs_in_file(model, tmp_path / "model.safetensors"))
    reference = build_model("tiny", device="cpu", dtype=torch.bfloat16, seed=3)
    request = Request("a red fox in snow", seed=7, height=64, width=64, num_frames=5, num_inference_steps=2)
    assert generate(model, request).sha256 == generate(reference, request).sha256
    assert torch.equal(model.rope_inv_freq, reference.rope_inv_freq)
