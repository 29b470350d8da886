"""LoRA on the reference DiT (dlo_fn.models.lora, peft): a random adapter file written for the tiny checkpoint,
loaded after offload and chosen per request (name and scale), each generation equal to the resident model's with
the same adapter; rank-local, allgather, FP8 shards (against fake_quantize plus the adapter), and 2 gloo ranks.
The command line: ``make-checkpoint --lora`` writes an adapter beside the checkpoint, ``generate --lora`` runs it."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tempfile

import pytest
import torch
from conftest import scenario
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from dlo_fn.models import Request, generate
from dlo_fn.models.lora import adapter_names, load_adapter, use_adapter, write_adapter
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.platform import platform_for
from dlo_fn.serve.local import open_model

pytest.importorskip("peft")
CTX = DistContext(0, 1, 0, platform_for("cpu"), None)
REQUEST = Request(prompt="a red fox", seed=3, height=32, width=32, num_frames=5, num_inference_steps=2)
CHOICES = ((None, 1.0), ("a", 1.0), ("b", 0.5), ("a", -0.3), (None, 1.0))


def adapters(model, root: pathlib.Path) -> tuple[pathlib.Path, ...]:
    return tuple(write_adapter(model, root / f"{n}.safetensors", rank=4, seed=i) for i, n in enumerate("ab"))


def run_choices(model, files) -> list[str]:
    """Both adapters loaded, then one generation per (adapter, scale) of :data:`CHOICES`: the output hashes."""
    for name, path in zip("ab", files):
        load_adapter(model, path, name)
    # generate makes each request's adapter active (Request.lora / lora_scale)
    return [generate(model, dataclasses.replace(REQUEST, lora=n, lora_scale=s)).sha256 for n, s in CHOICES]


@pytest.fixture(scope="module")
def files(tiny_checkpoint, tmp_path_factory):
    model, _ = open_model(tiny_checkpoint, CTX, "resident")
    return adapters(model, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def want(tiny_checkpoint, files):
    model, _ = open_model(tiny_checkpoint, CTX, "resident")
    return run_choices(model, files)


def test_adapters_change_the_output_and_none_is_the_base(want):
    assert len(set(want[:4])) == 4 and want[0] == want[-1]


@pytest.mark.parametrize("mode", ["rank-local", "allgather"])
def test_adapters_after_offload_equal_resident(tiny_checkpoint, files, want, mode):
    model, o = open_model(tiny_checkpoint, CTX, mode)
    arena = o.store.arena.clone()
    assert run_choices(model, files) == want
    assert torch.equal(o.store.arena, arena)
    assert adapter_names(model) == ("a", "b")


def test_fp8_base_with_adapters_equals_fake_quantize_plus_adapters(tiny_checkpoint, files):
    from dlo_fn.models import BLOCK_PATHS
    from dlo_fn.runtime.quant import fake_quantize

    ref, _ = open_model(tiny_checkpoint, CTX, "resident")
    fake_quantize(ref, BLOCK_PATHS)
    model, _ = open_model(tiny_checkpoint, CTX, "rank-local", quantization="fp8")
    assert run_choices(model, files) == run_choices(ref, files)


def test_bad_adapter_input_gets_one_line(tiny_checkpoint, files, tmp_path):
    model, _ = open_model(tiny_checkpoint, CTX, "rank-local")
    with pytest.raises(ValueError, match=r"^adapter file '.*nope.safetensors' does not exist"):
        load_adapter(model, tmp_path / "nope.safetensors", "a")
    load_adapter(model, files[0], "a")
    with pytest.raises(ValueError, match=r"^adapter name 'a' is already loaded"):
        load_adapter(model, files[1], "a")
    with pytest.raises(ValueError, match=r"^lora='c' is not loaded \(loaded: \['a'\]\)"):
        use_adapter(model, "c")


class RandomInits(TorchDispatchMode):
    """Counts random initialisations of real (not ``meta``) tensors run inside it: what peft's default adapter
    load does to every new layer, and its ``low_cpu_mem_usage`` path (layers on meta, the file's tensors assigned)
    never does."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket in (torch.ops.aten.uniform_, torch.ops.aten.normal_) and args[0].device.type != "meta":
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_load_adapter_builds_no_layer_on_the_host(tiny_checkpoint, files):
    model, _ = open_model(tiny_checkpoint, CTX, "rank-local")
    with RandomInits() as inits:
        load_adapter(model, files[0], "a")
    assert inits.count == 0 and adapter_names(model) == ("a",)


def test_an_adapter_for_another_model_gets_one_line_and_changes_nothing(tiny_checkpoint, tmp_path):
    model, _ = open_model(tiny_checkpoint, CTX, "rank-local")
    bad = tmp_path / "bad.safetensors"
    save_file({"blocks.0.mlp.fc1.lora_A.weight": torch.zeros(4, 3)}, str(bad), metadata={"rank": "4"})
    with pytest.raises(ValueError, match=r"^adapter file '.*bad.safetensors' does not fit this model \('blocks"):
        load_adapter(model, bad, "a")
    assert adapter_names(model) == ()


def lora_rank(ctx, checkpoint: str) -> list[bool]:
    """On W gloo ranks, allgather: every rank writes the same adapters, and its generations per choice equal its
    resident model's."""
    with tempfile.TemporaryDirectory() as tmp:
        ref, _ = open_model(checkpoint, ctx, "resident")
        files = adapters(ref, pathlib.Path(tmp))
        want = run_choices(ref, files)
        model, _ = open_model(checkpoint, ctx, "allgather")
        return [g == w for g, w in zip(run_choices(model, files), want)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_adapters_on_two_gloo_ranks(request):
    for rank, res in enumerate(scenario(request, 2, "models_lora")):
        assert res == [True] * len(CHOICES), f"rank {rank}: {res}"


def test_make_checkpoint_writes_an_adapter_and_generate_runs_it(tmp_path, capsys):
    """In this process (one rank): the adapter ``make-checkpoint --lora`` writes, run by ``generate --lora`` at a
    scale for every request but the prompts line that asks for none, each equal to the resident model's run."""
    from dlo_fn.cli import main

    ckpt, lora = tmp_path / "tiny", tmp_path / "style.safetensors"
    make = ["make-checkpoint", "--model", "tiny", "--out", str(ckpt), "--no-progress"]
    assert main([*make, "--lora", str(lora), "--lora-rank", "8"]) == 0
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a fox"}\n{"prompt": "an owl", "lora": null}\n')
    shape = ["--height", "32", "--width", "32", "--frames", "5", "--steps", "2", "--seed", "3"]
    run = ["generate", "--checkpoint", str(ckpt), "--prompts", str(prompts), *shape, "--out", str(tmp_path / "out")]
    run += ["--platform", "cpu"]  # where the resident reference runs (CTX), also on a CUDA machine
    assert main([*run, "--lora", str(lora), "--lora-scale", "0.5"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()]
    model, _ = open_model(str(ckpt), CTX, "resident")
    load_adapter(model, lora, "style")
    base = dataclasses.replace(REQUEST, seed=3, num_inference_steps=2)
    want = [
        generate(model, dataclasses.replace(base, prompt="a fox", lora="style", lora_scale=0.5)).sha256,
        generate(model, dataclasses.replace(base, prompt="an owl")).sha256,
    ]
    assert [r["sha256"] for r in rows] == want and [r["settings"]["lora"] for r in rows] == ["style", None]
    capsys.readouterr()
    assert main([*make, "--overwrite", "--lora", str(tmp_path / "x.safetensors"), "--lora-targets", "nope"]) == 2
    assert main([*run, "--out-exists", "clean", "--lora", str(tmp_path / "none.safetensors")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "dlo_fn make-checkpoint: error: --lora-targets 'nope': matches none of the model's linears (e.g. "
        "'text_encoder.layers.0.qkv')",
        f"dlo_fn generate: error: --lora {tmp_path}/none.safetensors: no such file: write one with make-checkpoint "
        f"--lora {tmp_path}/none.safetensors",
    ]
