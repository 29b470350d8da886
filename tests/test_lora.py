"""LoRA adapters loaded after offload (peft 0.21.2 through diffusers 0.42.1's entry points, tiny random Flux and
Wan on CPU): load from a safetensors file, mix with weights, switch, disable/enable and unload on the offloaded
model, each output ``torch.equal`` to the resident model with the same adapters (peft unfused), rank-local and
allgather, FP8 base shards (against ``fake_quantize`` plus the adapters), and on 2 gloo ranks; switching never
writes the host store; fusing into a streamed weight is refused in one line."""

from __future__ import annotations

import copy
import pathlib
import tempfile

import pytest
import torch
from conftest import scenario
from safetensors.torch import save_file

from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.offload import offload
from dlo_fn.runtime.platform import platform_for
from dlo_fn.runtime.quant import fake_quantize

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

CTX = DistContext(0, 1, 0, platform_for("cpu"), None)
# Every attention and MLP linear of the blocks (and the top-level proj_out, which "proj_out" also names).
TARGETS = {
    "flux": (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
        "proj_mlp",
        "proj_out",
    ),
    "wan": ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"),
}


def write_lora(model: torch.nn.Module, targets, path: pathlib.Path, rank: int, seed: int) -> pathlib.Path:
    """A random LoRA of ``rank`` on ``targets`` of ``model``'s architecture, as diffusers saves one (keys
    ``transformer.<module>.lora_A.weight``; A and B both random, so the adapter changes every output)."""
    torch.manual_seed(seed)
    twin = copy.deepcopy(model)
    config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets), init_lora_weights=False)
    peft.inject_adapter_in_model(config, twin, adapter_name="x")
    state = peft.get_peft_model_state_dict(twin, adapter_name="x")
    save_file({f"transformer.{k}": v.contiguous() for k, v in state.items()}, str(path))
    return path


def _cases():
    from test_third_party import CASES

    return CASES


def _steps(name: str, model, files) -> list[tuple[str, torch.Tensor]]:
    """The adapter entry points in turn on ``model`` (resident or offloaded), an output after each (same
    inputs throughout, so outputs compare across steps too)."""
    inputs = _cases()[name][1]
    out = []

    def run(what: str) -> None:
        with torch.no_grad():
            out.append((what, model(**inputs(1))[0]))

    run("none")
    model.load_lora_adapter(str(files[0]), adapter_name="a", low_cpu_mem_usage=True)  # the documented call
    run("a loaded")
    from diffusers.utils import logging as dlogging

    # diffusers counts adapter "a"'s weights as missing while "b" loads: a warning per layer, on every rank
    level = dlogging.get_verbosity()
    dlogging.set_verbosity_error()
    try:
        model.load_lora_adapter(str(files[1]), adapter_name="b")  # peft's default: layers built on the host first
    finally:
        dlogging.set_verbosity(level)
    model.set_adapters(["a", "b"], weights=[0.7, -0.4])
    run("a*0.7 + b*-0.4")
    model.set_adapters("b")
    run("b")
    model.disable_lora()
    run("disabled")
    model.enable_lora()
    run("enabled")
    model.unload_lora()
    run("unloaded")
    return out


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora")
    return {
        name: tuple(write_lora(build(), TARGETS[name], root / f"{name}-{i}.safetensors", 4, i) for i in range(2))
        for name, (build, _, _) in _cases().items()
    }


@pytest.mark.parametrize("name", ["flux", "wan"])
@pytest.mark.parametrize("mode", ["allgather", "rank-local", "fp8", "functional_call"])
def test_adapters_after_offload_equal_resident(name, mode, lora_files):
    build, _, paths = _cases()[name]
    ref = build()
    opts = {
        "fp8": dict(mode="rank-local", quantization="fp8"),
        "functional_call": dict(mode="rank-local", block_call="functional_call"),
    }.get(mode, dict(mode=mode))
    resident = fake_quantize(copy.deepcopy(ref), paths) if mode == "fp8" else copy.deepcopy(ref)
    want = _steps(name, resident, lora_files[name])
    o = offload(copy.deepcopy(ref), paths, CTX, **opts)
    arena = o.store.arena.clone()
    got = _steps(name, o.model, lora_files[name])
    for (what, g), (_, w) in zip(got, want):
        assert torch.equal(g, w), what
    out = dict(got)
    assert not torch.equal(out["a loaded"], out["none"]) and not torch.equal(out["b"], out["a loaded"])
    assert torch.equal(out["disabled"], out["none"]) and torch.equal(out["unloaded"], out["none"])
    assert torch.equal(o.store.arena, arena)  # adapters never write the host store
    assert o.executor.stats.computes == len(got) * o.layout.num_blocks


def test_adapter_weights_live_on_the_device_in_the_block_dtype(lora_files):
    build, _, paths = _cases()["flux"]
    o = offload(build().to(torch.bfloat16), paths, CTX)
    o.model.load_lora_adapter(str(lora_files["flux"][0]), adapter_name="a")
    to_q = o.model.transformer_blocks[0].attn.to_q
    assert isinstance(to_q, peft.tuners.lora.Linear)
    a = to_q.lora_A["a"].weight
    assert a.device.type == "cpu" and a.dtype == torch.bfloat16 and a.untyped_storage().nbytes() == a.nbytes
    # the adapter saves with the model (peft's get_peft_model_state_dict reads it from state_dict)
    assert torch.equal(o.model.state_dict()["transformer_blocks.0.attn.to_q.lora_A.a.weight"], a)


def test_the_documented_load_builds_no_layer_on_the_host(lora_files):
    """README and design.md load with ``low_cpu_mem_usage=True``: peft builds the layers on meta and assigns the
    file's tensors, where its default initialises every new layer on the host first (the slow path on a GPU)."""
    from test_models_lora import RandomInits

    build, _, paths = _cases()["flux"]
    counts = []
    for fast in (True, False):
        o = offload(build(), paths, CTX)
        with RandomInits() as inits:
            o.model.load_lora_adapter(str(lora_files["flux"][0]), adapter_name="a", low_cpu_mem_usage=fast)
        counts.append(inits.count)
    assert counts[0] == 0 < counts[1]


def test_fuse_is_refused_in_one_line_and_the_model_still_runs(lora_files):
    build, inputs, paths = _cases()["flux"]
    ref = build()
    o = offload(copy.deepcopy(ref), paths, CTX)
    o.model.load_lora_adapter(str(lora_files["flux"][0]), adapter_name="a")
    with pytest.raises(ValueError, match=r"^cannot write a weight of an offloaded block .* fuse it before offload\(\)"):
        o.model.fuse_lora()
    ref.load_lora_adapter(str(lora_files["flux"][0]), adapter_name="a")
    with torch.no_grad():
        assert torch.equal(o.model(**inputs(0))[0], ref(**inputs(0))[0])


def test_pipeline_load_lora_weights_after_offload(lora_files):
    build, inputs, paths = _cases()["flux"]
    ref = build()
    o = offload(copy.deepcopy(ref), paths, CTX)
    pipes = [
        diffusers.FluxPipeline(None, None, None, None, None, None, t, image_encoder=None, feature_extractor=None)
        for t in (ref, o.model)
    ]
    with torch.no_grad():
        base = ref(**inputs(1))[0]
    outs = []
    for pipe in pipes:
        pipe.load_lora_weights(str(lora_files["flux"][0]), adapter_name="a", low_cpu_mem_usage=True)
        pipe.load_lora_weights(str(lora_files["flux"][1]), adapter_name="b")
        pipe.set_adapters(["a", "b"], adapter_weights=[0.5, 1.0])
        with torch.no_grad():
            outs.append(pipe.transformer(**inputs(1))[0])
        pipe.unload_lora_weights()
        with torch.no_grad():
            outs.append(pipe.transformer(**inputs(2))[0])
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    assert not torch.equal(outs[0], base)  # the adapters were loaded, not left at peft's no-op init


def lora_rank(ctx) -> dict:
    """On W gloo ranks (allgather over the world): each rank writes the same two adapters, loads them after
    offload, runs the entry points on its own inputs and compares with its resident model."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (build, _, paths) in _cases().items():
            files = [
                write_lora(build(), TARGETS[name], pathlib.Path(tmp) / f"{name}-{i}.safetensors", 4, i)
                for i in range(2)
            ]
            ref = build()
            want = _steps(name, copy.deepcopy(ref), files)
            o = offload(copy.deepcopy(ref), paths, ctx, mode="allgather")
            got = _steps(name, o.model, files)
            out[name] = [what for (what, g), (_, w) in zip(got, want) if not torch.equal(g, w)]
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_adapters_on_two_gloo_ranks_allgather(request):
    for rank, res in enumerate(scenario(request, 2, "lora")):
        assert res == {"flux": [], "wan": []}, f"rank {rank}: {res}"
