"""Pre-quantised checkpoints (dlo_fn.runtime.quantize, dlo_fn.io.quantized, ``python -m dlo_fn quantize``): the
files written (FP8 and scales where the on-the-fly path stores them, the rest byte for byte), the model loaded
from them offloaded bit for bit as the source offloaded with FP8 shards and as the fake-quantised resident model
(rank-local, allgather, 2 gloo ranks, diffusers folders), its host store filled from the stored bytes, flat
memory while writing, and one-line mistakes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import scenario
from safetensors import safe_open

from dlo_fn.cli import main
from dlo_fn.io.checkpoint import open_checkpoint, read_header
from dlo_fn.io.load import load_checkpoint, load_model
from dlo_fn.io.quantized import META_QUANTIZATION, stored_weights
from dlo_fn.models import BLOCK_PATHS, Request, generate
from dlo_fn.plan.quant import FP8_DTYPE, Quantization, quantized
from dlo_fn.plan.spec import spec_from_module
from dlo_fn.runtime.offload import offload
from dlo_fn.runtime.quant import fake_quantize, quantize_rows
from dlo_fn.runtime.quantize import quantize_checkpoint
from tests.test_executor import CTX

REQUEST = Request("a fox", seed=0, height=32, width=32, num_frames=5, num_inference_steps=2)


def _tensors(folder) -> dict[str, torch.Tensor]:
    ckpt = open_checkpoint(folder)
    out = {}
    for file, keys in ckpt.keys_by_file().items():
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in keys})
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_written_files_hold_fp8_where_offload_stores_it_and_the_rest_byte_for_byte(tiny_checkpoint, tmp_path):
    from dlo_fn.models import write_checkpoint

    src = write_checkpoint("tiny", tmp_path / "src", max_shard_bytes=200_000, progress=False)  # 4 files + index
    report = quantize_checkpoint(src, tmp_path / "dst", progress=False)
    model = load_model(src)
    spec = spec_from_module(model, BLOCK_PATHS)
    want = {f"{b.name}.{t.name}" for b in spec.blocks for t in b.tensors if quantized(t, b.name)}
    before, after = _tensors(src), _tensors(tmp_path / "dst")
    assert report.num_quantized == len(want) > 0 and report.written_bytes < 0.6 * report.source_bytes
    assert set(after) == set(before) | {k + "_scale" for k in want}
    for key, t in before.items():
        if key in want:
            q, scale = quantize_rows(t)
            assert after[key].dtype == FP8_DTYPE and torch.equal(_bytes(after[key]), _bytes(q))
            assert after[key + "_scale"].dtype == torch.float32 and torch.equal(after[key + "_scale"], scale)
        else:
            assert after[key].dtype == t.dtype and torch.equal(_bytes(after[key]), _bytes(t)), key
    index = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == report.written_bytes and set(index["weight_map"]) == set(after)
    assert (tmp_path / "dst" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    for file in open_checkpoint(tmp_path / "dst").files:
        meta = read_header(file)["__metadata__"]
        assert meta[META_QUANTIZATION] == "fp8" and meta["format"] == "pt"  # the source's metadata kept
    loaded, load = load_checkpoint(tmp_path / "dst", progress=False)
    assert load.private_copy_bytes == 0 and not load.realigned_tensors  # every tensor aligned: zero-copy
    assert set(stored_weights(loaded).tensors) == want


@pytest.fixture(scope="module")
def references(quantized_tiny):
    src, _ = quantized_tiny
    return generate(fake_quantize(load_model(src)), REQUEST).sha256


@pytest.mark.parametrize("mode", ["rank-local", "allgather"])
@torch.no_grad()
def test_offloaded_from_fp8_checkpoint_equals_source_fp8_and_fake_quantised(quantized_tiny, references, mode):
    src, dst = quantized_tiny
    o = offload(load_model(dst), ctx=CTX, mode=mode, quantization="fp8")
    assert generate(o.model, REQUEST).sha256 == references
    from_src = offload(load_model(src), ctx=CTX, mode=mode, quantization="fp8")
    assert generate(from_src.model, REQUEST).sha256 == references
    assert o.store.arena_bytes == o.layout.shard_bytes_per_rank
    assert o.release.closed and stored_weights(o.model) is None  # the file's mapping let go once copied


@torch.no_grad()
def test_resident_reference_is_the_fake_quantised_source(quantized_tiny, references):
    src, dst = quantized_tiny
    got, want = fake_quantize(load_model(dst)), fake_quantize(load_model(src))
    assert all(
        torch.equal(t, want.state_dict()[k]) and t.dtype == want.state_dict()[k].dtype
        for k, t in got.state_dict().items()
    )
    assert generate(got, REQUEST).sha256 == references


@torch.no_grad()
def test_host_store_holds_the_stored_bytes_nothing_quantised(quantized_tiny, tmp_path):
    # The arena is the stored layout, filled with the file's FP8 and scale bytes as they are: an FP8 byte changed
    # on disk shows in the arena and in the outputs, which equal the fake-quantised model of the changed file.
    import shutil

    _, dst = quantized_tiny
    changed = shutil.copytree(dst, tmp_path / "changed")
    key = next(k for k in stored_weights(load_model(changed)).tensors if k.startswith("blocks.1."))
    entry = open_checkpoint(changed).entries[key]
    with open(entry.file, "r+b") as f:
        f.seek(entry.offset_bytes)
        f.write(bytes([0x38]) * 16)  # 1.0 in e4m3
    o = offload(load_model(changed), ctx=CTX, mode="rank-local", quantization="fp8")
    shard = o.layout.shards[1]
    files = _tensors(changed)
    for p in shard.block.placements:
        got = o.store.arena[o.layout.shard_offsets[1] + p.offset_bytes :][: p.nbytes]
        assert torch.equal(got, _bytes(files[f"{shard.block.name}.{p.name}"])), p.name
    want = fake_quantize(load_model(changed))
    w = want.get_parameter(key)
    assert torch.equal(w.reshape(-1)[:16], files[key + "_scale"][0].to(w.dtype).expand(16))
    assert generate(o.model, REQUEST).sha256 == generate(want, REQUEST).sha256


def quantize_rank(ctx, paths) -> dict:
    """On 2 gloo ranks: the FP8 checkpoint offloaded allgather and rank-local against the fake-quantised source."""
    src, dst = paths
    want = generate(fake_quantize(load_model(src)), REQUEST).sha256
    out = {}
    for mode in ("allgather", "rank-local"):
        o = offload(load_model(dst), ctx=ctx, mode=mode, quantization="fp8")
        out[mode] = (
            generate(o.model, REQUEST).sha256 == want,
            o.layout.num_shards,
            o.store.arena_bytes == o.layout.shard_bytes_per_rank,
        )
    return out


@pytest.mark.slow
def test_fp8_checkpoint_on_two_gloo_ranks(request):
    for res in scenario(request, 2, "quantize"):
        assert res == {"allgather": (True, 2, True), "rank-local": (True, 1, True)}, res


@pytest.mark.parametrize(
    "name, dtype, shard",
    [("flux", torch.bfloat16, "30KB"), ("wan", torch.bfloat16, None), ("flux", torch.float32, None)],
)
@torch.no_grad()
def test_diffusers_folder_quantised_and_reloaded(tmp_path, name, dtype, shard):
    pytest.importorskip("diffusers")
    from test_load_diffusers import BUILDERS, cast_inputs

    model = BUILDERS[name][0]()
    if dtype != torch.float32:  # as a published bf16 folder: the fp32 modules stay fp32
        model.save_pretrained(tmp_path / "fp32")
        model = type(model).from_pretrained(tmp_path / "fp32", torch_dtype=dtype)
    model.save_pretrained(tmp_path / "src", **({"max_shard_size": shard} if shard else {}))
    quantize_checkpoint(tmp_path / "src", tmp_path / "dst", progress=False)
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == sorted(p.name for p in (tmp_path / "src").iterdir())
    ref, dequantised = fake_quantize(load_model(tmp_path / "src")), fake_quantize(load_model(tmp_path / "dst"))
    assert all(
        torch.equal(t, ref.state_dict()[k]) and t.dtype == ref.state_dict()[k].dtype
        for k, t in dequantised.state_dict().items()
    )
    for mode in ("rank-local", "allgather"):
        o = offload(load_model(tmp_path / "dst"), ctx=CTX, mode=mode, quantization="fp8")
        for s in range(2):
            x = cast_inputs(BUILDERS[name][1](s), dtype)
            got = o.model(**x)[0]
            assert torch.equal(got, dequantised(**x)[0])
            # The source's resident tensors sit at other file offsets: MKL's one-row fp32 GEMV rounds by alignment
            # (dlo_fn.plan.spec.KERNEL_ALIGNMENT_BYTES), so only bf16 folders equal the source's outputs too.
            assert torch.equal(got, ref(**x)[0]) or dtype == torch.float32


def test_offloading_it_otherwise_and_other_excludes_are_one_clear_error(quantized_tiny, tmp_path):
    src, dst = quantized_tiny
    for kw in ({}, {"mode": "resident", "quantization": "fp8"}):
        with pytest.raises(ValueError, match="quantised checkpoint .* offload it with quantization='fp8'"):
            offload(load_model(dst), ctx=CTX, **{"mode": "rank-local", **kw})
    with pytest.raises(ValueError, match=r"quantised with exclude \[\]"):
        offload(load_model(dst), ctx=CTX, mode="rank-local", quantization=Quantization("fp8", exclude=("mlp",)))
    quantize_checkpoint(src, tmp_path / "kept", exclude=("attn",), progress=False)  # its exclude comes with it
    o = offload(load_model(tmp_path / "kept"), ctx=CTX, mode="rank-local", quantization="fp8")
    names = {p.name for sh in o.layout.shards for p in sh.block.placements if p.dtype == FP8_DTYPE}
    assert names and not any("attn" in n.split(".") for n in names)
    want = fake_quantize(load_model(src), exclude=("attn",))
    assert generate(o.model, REQUEST).sha256 == generate(want, REQUEST).sha256


def test_running_it_without_offload_refuses_instead_of_nan(quantized_tiny):
    # Its block weights are on meta until offload stores them: generate would run and return NaN.
    _, dst = quantized_tiny
    with pytest.raises(ValueError, match=r"VideoDiT's blocks\.0\..* is not loaded .* runs only offloaded"):
        generate(load_model(dst), REQUEST)


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_cli_writes_it_and_mistakes_are_one_line(capsys, quantized_tiny, tmp_path):
    src, dst = quantized_tiny
    assert main(["quantize", src, str(tmp_path / "out"), "--no-progress"]) == 0
    assert "block tensor(s) as FP8" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    for argv, words in [
        ([str(tmp_path / "nothere"), str(tmp_path / "x")], ["SRC", "no such folder or file"]),
        ([src, str(tmp_path / "out")], ["already holds a checkpoint", "--force"]),
        ([dst, str(tmp_path / "y")], ["already quantised"]),
        ([str(tmp_path / "empty"), str(tmp_path / "z")], ["no model.safetensors"]),
        ([src, src], ["the source's own folder"]),
        ([src, str(tmp_path / "w"), "--exclude", "blocks"], ["no block tensor", "exclude"]),
    ]:
        line = _one_line(capsys, ["quantize", *argv])
        assert line.startswith("dlo_fn quantize: error: ") and all(w in line for w in words), line
    assert main(["quantize", src, str(tmp_path / "out"), "--force", "--no-progress"]) == 0


def test_generate_runs_the_fp8_checkpoint_bit_exact(capsys, quantized_tiny, references, tmp_path):
    src, dst = quantized_tiny
    args = [
        "--prompt",
        "a fox",
        "--seed",
        "0",
        "--steps",
        "2",
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "5",
        "--platform",
        "cpu",
    ]  # the reference below computes on the host
    assert main(["generate", "--checkpoint", dst, "--quantization", "fp8", *args, "--out", str(tmp_path / "a")]) == 0
    row = json.loads((tmp_path / "a" / "manifest.jsonl").read_text().splitlines()[0])
    want = generate(fake_quantize(load_model(src)), Request.from_dict(row["settings"])).sha256
    assert row["ok"] and row["sha256"] == want
    capsys.readouterr()
    line = _one_line(capsys, ["generate", "--checkpoint", dst, *args, "--out", str(tmp_path / "b")])
    assert "--quantization fp8" in line


BIG = """
import json, pathlib, sys, torch
from torch import nn
from dlo_fn.io.memstat import process_memory
from dlo_fn.runtime.quantize import quantize_checkpoint
class Big(nn.Module):
    def __init__(self, d=4096, n=2, vocab=16384):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, dtype=torch.bfloat16)  # resident: copied
        self.blocks = nn.ModuleList(nn.Linear(d, d, bias=False, dtype=torch.bfloat16) for _ in range(n))
src, out = sys.argv[1], pathlib.Path(sys.argv[2])
# on the host (a GPU quantises chunks of DEVICE_CHUNK_BYTES, as large as this model's block tensors)
quantize_checkpoint(src + "/small.safetensors", out / "warm", model_or_factory=lambda: Big(64, 2, 64), progress=False,
                    device="cpu")
try:
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # the peak RSS restarts from here
except OSError:
    pass
before = process_memory()
quantize_checkpoint(src + "/big.safetensors", out / "big", model_or_factory=Big, progress=False, device="cpu")
after = process_memory()
print(json.dumps({"rss_bytes": before.rss_bytes, "hwm_bytes": after.hwm_bytes}))
"""


@pytest.mark.slow
def test_writing_streams_in_flat_memory(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    for name, d, vocab in (("big", 4096, 16384), ("small", 64, 64)):
        save_file(
            {
                "embed.weight": torch.ones(vocab, d, dtype=torch.bfloat16),
                **{f"blocks.{i}.weight": torch.randn(d, d, generator=g).to(torch.bfloat16) for i in range(2)},
            },
            str(tmp_path / f"{name}.safetensors"),
        )
    model_bytes = (tmp_path / "big.safetensors").stat().st_size  # 192 MB: 64 MB quantised, 128 MB copied
    proc = subprocess.run(
        [sys.executable, "-c", BIG, str(tmp_path), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    mem = json.loads(proc.stdout.strip().splitlines()[-1])
    grew = mem["hwm_bytes"] - mem["rss_bytes"]
    assert grew < 48 << 20 and grew < model_bytes / 4, (grew, model_bytes)
    got = _tensors(tmp_path / "big")
    with safe_open(str(tmp_path / "big.safetensors"), "pt") as f:
        w = f.get_tensor("blocks.1.weight")
        assert torch.equal(_bytes(got["blocks.1.weight"]), _bytes(quantize_rows(w)[0]))
        assert torch.equal(got["embed.weight"], f.get_tensor("embed.weight"))


@pytest.mark.cuda
def test_quantizing_on_a_gpu_writes_the_same_bytes(tmp_path):
    from dlo_fn.models import write_checkpoint

    src = write_checkpoint("tiny", tmp_path / "src", max_shard_bytes=200_000, progress=False)
    for device in ("cpu", "cuda"):
        quantize_checkpoint(src, tmp_path / device, progress=False, device=device)
    files = sorted(p.name for p in (tmp_path / "cpu").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "cuda").iterdir())
    assert all((tmp_path / "cpu" / f).read_bytes() == (tmp_path / "cuda" / f).read_bytes() for f in files)
