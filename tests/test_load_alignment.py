"""Offloaded kernels see every weight at the alignment the resident model computes with.

MKL's one-row fp32 GEMV gives different bits for the same weight at 8 mod 16 (where a safetensors file may put
it, and so the mmap'd resident model) and at 0 mod 16 (a slot at 256): Flux's adaLN linears run on one row. The
layout places each tensor at its resident address residue mod 64 (TensorSpec.residue_bytes, set by offload from
the CPU model), and the slots are 64-aligned."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import save_file

import dlo_fn.runtime.offload as offload_mod
from dlo_fn.io.checkpoint import read_header
from dlo_fn.io.load import load_model
from dlo_fn.plan.layout import block_layout
from dlo_fn.plan.spec import KERNEL_ALIGNMENT_BYTES, BlockSpec, TensorSpec
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.platform import platform_for

CTX = DistContext(0, 1, 0, platform_for("cpu"), None)
GEMV_KEY = "transformer_blocks.0.norm1.linear.weight"  # Flux adaLN: a linear on the one-row time embedding


def save_at_residue(model, folder: pathlib.Path, key: str, residue: int = 8, modulus: int = 16) -> None:
    """``model`` as a diffusers folder whose tensor ``key`` starts at ``residue`` mod ``modulus`` in the file
    (and so in its page-aligned mmap): the header is padded through ``__metadata__``."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    path = folder / "diffusion_pytorch_model.safetensors"
    for pad in range(2 * modulus):
        save_file(state, str(path), metadata={"format": "pt", "pad": "x" * pad})
        n = int.from_bytes(path.read_bytes()[:8], "little")
        if (8 + n + read_header(path)[key]["data_offsets"][0]) % modulus == residue:
            break
    else:
        raise AssertionError(f"no padding puts {key} at {residue} mod {modulus}")
    model.save_config(folder)


def gemv_is_alignment_sensitive() -> bool:
    """This machine's fp32 GEMV rounds differently at 8 mod 16 than at 0 mod 16 (the minimal example)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 32, generator=g), torch.randn(1, 32, generator=g)
    buf = torch.empty(w.numel() * 4 + 64, dtype=torch.uint8)
    w8 = buf[8 : 8 + w.numel() * 4].view(torch.float32).view(64, 32)
    w8.copy_(w)
    return not torch.equal(x @ w.T, x @ w8.T)


def test_layout_places_tensors_at_their_residue():
    specs = (
        TensorSpec("a", (3,), torch.float32, residue_bytes=8),
        TensorSpec("b", (5,), torch.bfloat16),
        TensorSpec("c", (7,), torch.float32, residue_bytes=60),
    )
    layout = block_layout(BlockSpec("blocks.0", specs), 256)
    offsets = [p.offset_bytes for p in layout.placements]
    assert offsets == [8, 256, 316]  # 8 mod 64; the next multiple of 256; 60 mod 64 after b ends at 266
    assert [o % KERNEL_ALIGNMENT_BYTES for o in offsets] == [8, 0, 60]
    plain = block_layout(BlockSpec("blocks.0", tuple(TensorSpec(t.name, t.shape, t.dtype) for t in specs)), 256)
    assert [p.offset_bytes for p in plain.placements] == [0, 256, 512]
    with pytest.raises(ValueError, match="residue_bytes must be a multiple of the itemsize"):
        TensorSpec("d", (2,), torch.float32, residue_bytes=6)
    with pytest.raises(ValueError, match="residue_bytes"):
        TensorSpec("d", (2,), torch.float32, residue_bytes=64)


@pytest.fixture(scope="module")
def misaligned_flux(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("diffusers")
    from test_third_party import flux

    folder = tmp_path_factory.mktemp("flux") / "fp32"
    save_at_residue(flux(), folder, GEMV_KEY)
    return folder


def _run(folder: pathlib.Path, mode: str) -> list[torch.Tensor]:
    from test_third_party import flux_inputs

    model = load_model(folder, progress=False)
    assert model.get_parameter(GEMV_KEY).data_ptr() % 16 == 8  # the resident weight really is misaligned
    o = offload_mod.offload(model, ctx=CTX, mode=mode)
    with torch.no_grad():
        return [o.model(**flux_inputs(s))[0] for s in range(2)]


def test_offloaded_flux_fp32_equals_the_mmapped_model(misaligned_flux):
    want = _run(misaligned_flux, "resident")
    for mode in ("allgather", "rank-local"):
        got = _run(misaligned_flux, mode)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), mode


def test_without_residues_the_same_run_differs(misaligned_flux, monkeypatch):
    """The control: slots at 0 mod 16 give other bits here, so the test above can fail."""
    if not gemv_is_alignment_sensitive():
        pytest.skip("this CPU's fp32 GEMV gives the same bits at every alignment")
    want = _run(misaligned_flux, "resident")
    monkeypatch.setattr(offload_mod, "with_address_residues", lambda spec, model: spec)
    got = _run(misaligned_flux, "allgather")
    assert not all(torch.equal(g, w) for g, w in zip(got, want))


def test_header_padding_helper_really_moves_the_tensor(misaligned_flux):
    path = misaligned_flux / "diffusion_pytorch_model.safetensors"
    n = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + n])
    assert (8 + n + header[GEMV_KEY]["data_offsets"][0]) % 16 == 8
