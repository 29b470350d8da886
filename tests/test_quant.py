"""FP8 shards (dlo_fn.plan.quant, dlo_fn.runtime.quant): which tensors are stored as FP8, the bits of quantise /
dequantise, the plan's stored vs compute bytes, and the offloaded model against ``fake_quantize`` of the resident
one (bit for bit: every mode, W = 1, 2 and 3 on gloo ranks, R requests, the reference DiT and diffusers' DiTs)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import scenario

from dlo_fn.plan.layout import model_layout
from dlo_fn.plan.quant import FP8_DTYPE, compute_block, stored_block, stored_spec
from dlo_fn.plan.schedule import Ring
from dlo_fn.plan.schedule_check import check_schedule
from dlo_fn.plan.sizes import ModelSizes
from dlo_fn.plan.spec import spec_from_module
from dlo_fn.plan.timeline import bandwidth_durations, simulate
from dlo_fn.runtime.offload import OffloadOptions, offload
from dlo_fn.runtime.quant import StoredBlock, dequantize_into, fake_quantize, needed_ranges, quantize_rows
from tests.test_executor import CTX, toy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantise_is_the_formula_in_every_dtype(dtype):
    # One float32 multiply rounded once into the dtype; zero rows get scale 1; values span 9 decades.
    w = (torch.randn(257, 3, 43) * torch.logspace(-6, 3, 257)[:, None, None]).to(dtype)
    w[5] = 0
    q, scale = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.shape == (257,) and scale[5] == 1
    out = torch.empty_like(w)
    dequantize_into(out, q, scale)
    assert torch.equal(out, (q.float() * scale[:, None, None]).to(dtype))
    assert out.isfinite().all() and (out.float() - w.float()).norm() / w.float().norm() < 0.05


def test_which_tensors_are_stored_as_fp8():
    model = toy(2)
    spec = spec_from_module(model, "blocks")
    block = spec.blocks[0]
    stored = stored_block(block, exclude=("down",))
    kinds = {t.name: t.dtype for t in stored.tensors}
    assert kinds["up.weight"] == FP8_DTYPE and kinds["up.weight_scale"] == torch.float32
    assert kinds["gate.weight"] == FP8_DTYPE  # a bf16 weight too
    assert kinds["down.weight"] == torch.float32 and "down.weight_scale" not in kinds  # excluded module
    assert kinds["norm.weight"] == kinds["up.bias"] == kinds["scale"] == torch.float32  # 1-D stays
    assert stored_block(stored) == stored  # already stored
    back = {t.name: t.dtype for t in compute_block(stored, torch.bfloat16).tensors}
    assert set(back) == {t.name for t in block.tensors} and back["up.weight"] == torch.bfloat16


def test_plan_prices_stored_and_compute_bytes():
    model = toy(4, d=256).to(torch.bfloat16)
    spec = spec_from_module(model, "blocks")
    plain, q = ModelSizes.from_spec(spec), ModelSizes.from_spec(spec, quantization="fp8")
    layout = model_layout(spec, 2, quantization="fp8")
    assert q.shard_bytes_per_rank(2) == layout.shard_bytes_per_rank < 0.6 * plain.shard_bytes_per_rank(2)
    assert q.max_padded_block_bytes(2) == layout.slot_bytes == max(c.nbytes for c in layout.compute)
    assert q.staging_bytes(2) == layout.max_padded_block_bytes and plain.staging_bytes(2) == 0
    assert sum(b.nbytes for b in stored_spec(spec).blocks) < 0.6 * sum(b.nbytes for b in spec.blocks)


@pytest.mark.parametrize("mode,shards", [("rank-local", None), ("allgather", 2), ("allgather", 3)])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_quantised_schedules_pass_every_check_and_simulate(mode, shards, slots):
    ring = Ring.cold(5, num_slots=slots, mode=mode, num_shards=shards, quantized=True)
    first = ring.next_schedule(2, requests_per_load=2)
    second = ring.after(first).next_schedule(3)
    check_schedule(first), check_schedule(second, first)
    dq = [op for op in first.ops if op.kind == "DQ"]
    assert len(dq) == len([op for op in first.ops if op.kind == "H2D"]) and all(op.staging == op.slot for op in dq)
    durations = bandwidth_durations(
        5,
        h2d_bytes=1.0,
        allgather_bytes=1.0,
        compute_s=1.0,
        h2d_bytes_per_s=1.0,
        allgather_bytes_per_s=1.0,
        dequant_s=0.25,
    )
    tl = simulate(first, durations)
    assert {s.stream for s in tl.spans if s.op.startswith("DQ")} == {"allgather"}
    with pytest.raises(ValueError, match="quantised loads"):
        Ring.cold(4, num_slots=4, mode=mode, num_shards=shards, quantized=True, load_group=2)


def test_stored_block_quantises_only_the_rows_its_pieces_read():
    # A rank's pieces read rows 0..k of a weight: rows beyond are NaN in the source and never read.
    model = toy(1, d=64)
    spec = spec_from_module(model, "blocks")
    layout = model_layout(spec, 3, quantization="fp8")
    tensors = {n: t.detach().clone() for n, t in model.blocks[0].named_parameters()}
    tensors.update({n: t.clone() for n, t in model.blocks[0].named_buffers() if n == "scale"})
    pieces = layout.shards[0].pieces[0]
    needed = needed_ranges(pieces)
    rows = {}
    for name, ranges in needed.items():
        if name.endswith("_scale") or name not in tensors or tensors[name].dim() < 2:
            continue
        row_bytes = tensors[name][0].numel()  # FP8: one byte per element
        rows[name] = max(-(-hi // row_bytes) for _, hi in ranges)
        tensors[name][rows[name] :] = float("nan")
    block = StoredBlock(tensors, layout.shards[0].block, needed)
    for p in pieces:
        got = block[p.tensor].reshape(-1).view(torch.uint8)[p.src_start : p.src_stop]
        src = model.blocks[0].get_parameter(p.tensor.removesuffix("_scale")) if p.tensor.endswith("_scale") else None
        if p.tensor in rows:
            q, _ = quantize_rows(model.blocks[0].get_parameter(p.tensor))
            assert torch.equal(got, q.reshape(-1).view(torch.uint8)[p.src_start : p.src_stop])
        elif src is not None:
            _, s = quantize_rows(src)
            assert torch.equal(got, s.view(torch.uint8)[p.src_start : p.src_stop])


@pytest.mark.parametrize(
    "mode,opts",
    [
        ("rank-local", {}),
        ("allgather", {}),
        ("rank-local", {"num_slots": 1}),
        ("rank-local", {"num_slots": 3, "block_call": "functional_call"}),
    ],
)
@torch.no_grad()
def test_offloaded_fp8_equals_fake_quantised_resident(mode, opts):
    ref = toy(5, d=32)
    want = fake_quantize(copy.deepcopy(ref), "blocks")
    o = offload(copy.deepcopy(ref), "blocks", CTX, mode=mode, quantization="fp8", **opts)
    for seed in range(3):
        x = torch.randn(3, 32, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(o.model(x), want(x))
    assert o.store.arena_bytes == o.layout.shard_bytes_per_rank
    assert o.executor.device_weight_bytes == o.executor.planned_device_weight_bytes
    plain = offload(copy.deepcopy(ref), "blocks", CTX, mode=mode)
    assert o.store.arena_bytes < 0.6 * plain.store.arena_bytes


@torch.no_grad()
def test_fp8_runs_r_requests_and_records_the_dequantise_ops():
    ref = toy(4, d=32)
    want = fake_quantize(copy.deepcopy(ref), "blocks")
    o = offload(copy.deepcopy(ref), "blocks", CTX, mode="rank-local", quantization="fp8", record_timeline=True)
    xs = [torch.randn(2, 32, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    with o.run(num_steps=2, requests_per_load=2):
        for _ in range(2):
            hs = [(o.model.embed(x), x) for x in xs]
            for block in o.model.blocks:
                hs = [block(h, ctx=c) for h, c in hs]
            outs = [o.model.head(h + c) for h, c in hs]
    assert all(torch.equal(out, want(x)) for out, x in zip(outs, xs))  # each step is one pass of the toy
    tl = o.executor.take_timeline()
    dq = [s for s in tl.spans if " DQ " in f" {s.op.split(' ', 1)[1]} "]
    assert dq and {s.stream for s in dq} == {"allgather"} and dict(tl.meta)["quantization"] == "fp8"


def test_options_are_checked():
    with pytest.raises(ValueError, match="quantization must be None or 'fp8'"):
        OffloadOptions(quantization="int4")
    with pytest.raises(ValueError, match="dequant must be"):
        OffloadOptions(quantization="fp8", dequant="triton")
    if not torch.cuda.is_available():  # the kernel plug-in needs CUDA; auto falls back to torch ops
        with pytest.raises(ValueError, match="dequant='kernel' needs a CUDA device"):
            offload(toy(2), "blocks", CTX, mode="rank-local", quantization="fp8", dequant="kernel")
        assert (
            offload(toy(2), "blocks", CTX, mode="rank-local", quantization="fp8").executor.dequantizer.name == "torch"
        )
    with pytest.raises(ValueError, match="quantised loads"):
        OffloadOptions(quantization="fp8", load_group=2, num_slots=4)
    with pytest.raises(ValueError, match="need the pinned source"):
        OffloadOptions(mode="rank-local", quantization="fp8", rank_local_source="mmap")


def test_quantization_is_one_option_value():
    """``quantization="fp8"`` is ``Quantization("fp8")``, which carries the modules it keeps; records say "fp8"."""
    from dlo_fn.plan.quant import Quantization

    assert OffloadOptions(quantization="fp8").quantization == Quantization("fp8", exclude=())
    q = OffloadOptions(quantization=Quantization("fp8", exclude=["proj_out"])).quantization
    assert q.exclude == ("proj_out",) and str(q) == "fp8" and OffloadOptions().quantization is None
    assert dict(OffloadOptions(quantization=q).describe())["quantization"] == "fp8"
    with pytest.raises(ValueError, match="quantization must be None, 'fp8' or a Quantization"):
        OffloadOptions(quantization=8)
    with pytest.raises(ValueError, match="exclude must be a tuple of module names"):
        Quantization("fp8", exclude="proj_out")
    # Quantised on the fly, the FP8 tensors are the layout's: the excluded module's weights are not among them.
    o = offload(toy(2), "blocks", CTX, mode="rank-local", quantization=Quantization("fp8", exclude=("0",)))
    fp8 = {(sh.block.name, p.name) for sh in o.layout.shards for p in sh.block.placements if p.dtype == FP8_DTYPE}
    assert fp8 and all(name != "blocks.0" for name, _ in fp8)


@pytest.mark.parametrize("name", ["wan", "flux"])
@pytest.mark.parametrize("mode", ["rank-local", "allgather"])
@torch.no_grad()
def test_diffusers_dits_fp8_equal_fake_quantised(name, mode):
    pytest.importorskip("diffusers")
    from tests.test_third_party import CASES

    build, inputs, paths = CASES[name]
    ref = build()
    want = fake_quantize(copy.deepcopy(ref), paths)
    o = offload(copy.deepcopy(ref), paths, CTX, mode=mode, quantization="fp8")
    for s in range(2):
        assert torch.equal(o.model(**inputs(s))[0], want(**inputs(s))[0])


def quant_rank(ctx, ckpt: str) -> dict:
    """On W gloo ranks: the reference DiT and a diffusers Flux offloaded with FP8 shards, allgather and
    rank-local, against the fake-quantised resident model; each rank's arena is its share of the stored bytes."""
    from test_hbm_budget_cost import runtime_matches_cost

    from dlo_fn.io.load import load_model
    from dlo_fn.models import BLOCK_PATHS, Request, generate
    from dlo_fn.plan.spec import spec_from_module
    from tests.test_third_party import CASES

    out = {}
    request = Request("a fox", seed=ctx.rank, height=32, width=32, num_frames=5, num_inference_steps=3)
    ref = fake_quantize(load_model(ckpt), BLOCK_PATHS)
    want = generate(ref, request).sha256
    del ref
    for mode in ("allgather", "rank-local"):
        o = offload(load_model(ckpt), BLOCK_PATHS, ctx, mode=mode, quantization="fp8")
        out[f"dit_exact[{mode}]"] = generate(o.model, request).sha256 == want
        out[f"arena_is_planned[{mode}]"] = o.store.arena_bytes == o.layout.shard_bytes_per_rank
        out[f"shards[{mode}]"] = o.layout.num_shards
    # An HBM budget over the ranks: one slot (FP8's staging leaves two no room below the whole model), the ring's
    # minimum plus one block: block 0 resident (dequantised once), the rest streamed as FP8
    minimum = offload(load_model(ckpt), BLOCK_PATHS, ctx, quantization="fp8", num_slots=1).device_weight_bytes
    budget = minimum + max(spec_from_module(load_model(ckpt), BLOCK_PATHS).block_bytes)
    o = offload(load_model(ckpt), BLOCK_PATHS, ctx, quantization="fp8", num_slots=1, hbm_budget=budget)
    out["budget_exact"] = generate(o.model, request).sha256 == want
    out["budget_one_resident"] = o.resident_blocks == (0,)
    for k, v in runtime_matches_cost(o, budget, "fp8", o.shards.size).items():
        out[f"budget_cost_{k}"] = v
    build, inputs, paths = CASES["flux"]
    fq = fake_quantize(build(), paths)
    o = offload(build(), paths, ctx, mode="allgather", quantization="fp8")
    with torch.no_grad():
        out["flux_exact"] = all(
            torch.equal(o.model(**inputs(10 * ctx.rank + s))[0], fq(**inputs(10 * ctx.rank + s))[0]) for s in range(2)
        )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_fp8_on_gloo_ranks(request, world):
    for res in scenario(request, world, "quant"):
        assert all(v for k, v in res.items() if not k.startswith("shards")), res
        assert res["shards[allgather]"] == world and res["shards[rank-local]"] == 1


@pytest.mark.cuda
@pytest.mark.parametrize(
    "mode,graph,dequant",
    [
        ("rank-local", False, "torch"),
        ("rank-local", False, "kernel"),
        ("allgather", False, "kernel"),
        ("rank-local", "block", "kernel"),
    ],
)
@torch.no_grad()
def test_fp8_on_cuda_streams_bit_exact(mode, graph, dequant):
    """FP8 shards on real copy / all-gather / compute streams: the dequantise op runs on the all-gather stream
    between the copy into the staging buffer and the block's compute; blocks large enough that a missing wait
    would let a compute read a slot still being written; eager and with block graphs; the DQ op as torch ops and
    as the one-launch kernel (runtime.cuda.dequant), both against the GPU fake-quantised model, whose weights were
    quantised on the GPU (the offload quantises on the host)."""
    from dlo_fn.runtime.dist import DistContext
    from dlo_fn.runtime.platform import platform_for

    ctx = DistContext(0, 1, 0, platform_for("cuda", 0), None)
    want = fake_quantize(toy(8, d=1024).to("cuda"), "blocks")
    o = offload(toy(8, d=1024), "blocks", ctx, mode=mode, quantization="fp8", graph=graph, dequant=dequant)
    assert o.executor.dequantizer.name == dequant
    xs = [torch.randn(64, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(s)) for s in range(6)]
    expected = [want(x).clone() for x in xs]
    got = [o.model(x).clone() for x in xs]  # back to back, no host synchronisation
    torch.cuda.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(got, expected))
    assert o.store.arena.is_pinned() and o.store.arena_bytes == o.layout.shard_bytes_per_rank
    assert o.executor.measured_device_bytes >= o.executor.planned_device_weight_bytes


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@torch.no_grad()
def test_kernel_dequant_equals_torch_ops_on_every_row_length(dtype):
    """The one-launch kernel against the torch ops, byte for byte over the whole slot: rows whose largest
    power-of-two divisor is 16, 48's, 3072's and beyond the kernel's tile (several launches), 1-D tensors copied,
    and a model with many tensors (the program-to-tensor table)."""
    from dlo_fn.runtime.cuda.dequant import KernelDequant
    from dlo_fn.runtime.quant import TorchDequant

    torch.manual_seed(0)
    shapes = [(16, 16), (7, 48), (5, 3072), (3, 12288), (9, 80), (2, 2, 3, 3), (33,), (24576, 16)]
    block = torch.nn.Module()
    for i, shape in enumerate(shapes * 3):
        block.register_buffer(f"t{i}", torch.randn(shape, dtype=dtype) * (i + 1))
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([block])
    spec = spec_from_module(model, "blocks")
    layout = model_layout(spec, 1, quantization="fp8")
    stored, compute = layout.shards[0].block, layout.compute_block(0)
    staging = torch.zeros(stored.nbytes, dtype=torch.uint8, device="cuda")
    for p in stored.placements:  # the stored bytes, quantised as a rank does
        w = block.get_buffer(p.name.removesuffix("_scale"))
        if p.name.endswith("_scale"):
            t = quantize_rows(w)[1]
        else:
            t = quantize_rows(w)[0] if p.dtype == FP8_DTYPE else w
        staging[p.offset_bytes : p.offset_bytes + p.nbytes] = t.reshape(-1).view(torch.uint8).cuda()
    slots = [torch.full((compute.nbytes,), 0xAB, dtype=torch.uint8, device="cuda") for _ in range(2)]
    for d, slot in zip((TorchDequant(), KernelDequant()), slots):
        d.prepare(staging, slot, stored, compute)()
    torch.cuda.synchronize()
    assert torch.equal(slots[0], slots[1])
