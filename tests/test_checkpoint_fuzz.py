"""Fuzzed checkpoints (seeded, bounded in time): header byte flips, truncations and index flips of real
checkpoints. Every variant either fails with the project's CheckpointError, in the plan (spec_for, which checks
the headers against the model config.json describes) and in the loader alike, or is harmless (a flipped space
in the header padding, a changed __metadata__ string): then the plan is the original's and the loader binds
the original tensors. Nothing else may escape: no SafetensorError, KeyError or AttributeError, no other plan.

What the loader accepts must also run: one harmless variant of each kind (per file kind) is offloaded and runs
a denoising step (a forward for diffusers), bit-identical to the resident model of the same files. So do the
families that a byte flip does not reach: a header whose length is not a multiple of 8 (8k + 1 puts every tensor
at an odd address: load accepted it and offload then crashed, "storage_offset() must be divisible by 2"),
leading spaces in the header, and flipped tensor bytes (NaNs included: compared as bytes)."""

from __future__ import annotations

import dataclasses
import pathlib
import random
import shutil
import time

import pytest
import torch

from dlo_fn.io.checkpoint import CheckpointError
from dlo_fn.io.load import load_model
from dlo_fn.io.sources import spec_for
from dlo_fn.models import BLOCK_PATHS, Request, generate
from dlo_fn.runtime.dist import DistContext
from dlo_fn.runtime.offload import offload
from dlo_fn.runtime.platform import platform_for

SEED = 0
BUDGET_S = 150  # the whole fuzz; pytest-timeout stops a hang


@dataclasses.dataclass(frozen=True)
class Case:
    file: str  # relative to the checkpoint folder
    kind: str  # "flip" | "truncate"
    position: int
    xor: int = 0

    def apply(self, data: bytes) -> bytes:
        if self.kind == "truncate":
            return data[: self.position]
        out = bytearray(data)
        out[self.position] ^= self.xor
        return bytes(out)


def header_end(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def cases(folder: pathlib.Path, rng: random.Random, flips: int, truncations: int, index_flips: int) -> list[Case]:
    out = []
    weights = sorted(p for p in folder.glob("*.safetensors"))
    for _ in range(flips):  # the 8-byte length and the JSON header: everything a plan reads
        f = rng.choice(weights)
        out.append(Case(f.name, "flip", rng.randrange(header_end(f.read_bytes())), rng.randrange(1, 256)))
    for _ in range(truncations):
        f = rng.choice(weights)
        out.append(Case(f.name, "truncate", rng.randrange(f.stat().st_size)))
    for index in folder.glob("*.index.json"):
        size = index.stat().st_size
        out += [Case(index.name, "flip", rng.randrange(size), rng.randrange(1, 256)) for _ in range(index_flips)]
    return out


def _state(model) -> dict:
    return {k: v for k, v in model.state_dict().items()}


CTX = DistContext(0, 1, 0, platform_for("cpu"), None)
STEP = Request("a red fox", seed=1, height=32, width=32, num_frames=5, num_inference_steps=1)


@torch.no_grad()
def one_step(folder: pathlib.Path, mode: str) -> str:
    """``folder`` loaded (and offloaded in ``mode``) running one denoising step (dlo_fn checkpoints) or one
    forward (diffusers folders); the SHA-256 of the output's bytes (NaN-safe, unlike torch.equal)."""
    import hashlib

    model = load_model(folder, progress=False).eval()
    if getattr(model, "blocks", None) is not None and hasattr(model, "encode_text"):
        if mode != "resident":
            offload(model, BLOCK_PATHS, CTX, mode=mode)
        return generate(model, STEP).sha256
    from test_third_party import wan_inputs

    if mode != "resident":
        offload(model, ctx=CTX, mode=mode)
    out = model(**wan_inputs(1))[0]
    return hashlib.sha256(out.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def runs_like_resident(folder: pathlib.Path) -> str:
    """Offloaded (allgather over one rank, and rank-local) output == the resident output of the same files;
    returns that output's hash."""
    want = one_step(folder, "resident")
    for mode in ("allgather", "rank-local"):
        assert one_step(folder, mode) == want, f"{folder}: {mode} differs from resident"
    return want


def fuzz(folder: pathlib.Path, variants: list[Case], deadline: float) -> dict:
    """Run every case on ``folder`` (each file restored after its case); returns outcome counts. The first
    harmless case of each kind (per file kind) is also offloaded and stepped (:func:`runs_like_resident`)."""
    base_spec = spec_for(folder)
    base_state = _state(load_model(folder, progress=False))
    base_step = one_step(folder, "resident")
    stepped: set[tuple[str, str]] = set()
    counts = {"error": 0, "harmless": 0}
    for case in variants:
        assert time.monotonic() < deadline, f"fuzz over its time budget at {case}"
        path = folder / case.file
        original = path.read_bytes()
        path.write_bytes(case.apply(original))
        try:
            try:
                spec = spec_for(folder)
            except CheckpointError:
                with pytest.raises(CheckpointError):  # the loader refuses it too
                    load_model(folder, progress=False)
                counts["error"] += 1
                continue
            assert spec == base_spec, f"{case}: the plan changed without an error"
            state = _state(load_model(folder, progress=False))
            assert state.keys() == base_state.keys() and all(
                state[k].dtype == v.dtype and torch.equal(state[k], v) for k, v in base_state.items()
            ), case
            family = (case.kind, "index" if case.file.endswith(".json") else "weights")
            if family not in stepped:
                stepped.add(family)
                assert runs_like_resident(folder) == base_step, case
            counts["harmless"] += 1
        except (AssertionError, pytest.fail.Exception):
            raise
        except Exception as exc:  # noqa: BLE001 - the point: nothing but CheckpointError may escape
            raise AssertionError(f"{case}: {type(exc).__name__}: {exc}") from exc
        finally:
            path.write_bytes(original)
    return counts


@pytest.fixture(scope="module")
def deadline() -> float:
    return time.monotonic() + BUDGET_S


@pytest.mark.timeout(BUDGET_S + 60)
def test_fuzzed_single_file_checkpoint(tiny_checkpoint, tmp_path, deadline):
    folder = pathlib.Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    variants = cases(folder, random.Random(SEED), flips=220, truncations=60, index_flips=0)
    counts = fuzz(folder, variants, deadline)
    assert counts["error"] + counts["harmless"] == 280 and counts["error"] > 250


@pytest.mark.timeout(BUDGET_S + 60)
def test_fuzzed_sharded_checkpoint(tmp_path, deadline):
    from dlo_fn.models import write_checkpoint

    folder = write_checkpoint("tiny", tmp_path / "sharded", seed=0, max_shard_bytes=200_000, progress=False)
    assert len(list(folder.glob("*.safetensors"))) > 2
    variants = cases(folder, random.Random(SEED + 1), flips=40, truncations=20, index_flips=60)
    counts = fuzz(folder, variants, deadline)
    assert counts["error"] + counts["harmless"] == 120 and counts["error"] > 80


@pytest.mark.timeout(BUDGET_S + 60)
def test_fuzzed_diffusers_folder(tmp_path, deadline):
    pytest.importorskip("diffusers")
    from test_third_party import wan

    wan().save_pretrained(tmp_path / "wan")
    variants = cases(tmp_path / "wan", random.Random(SEED + 2), flips=40, truncations=10, index_flips=0)
    counts = fuzz(tmp_path / "wan", variants, deadline)
    assert counts["error"] + counts["harmless"] == 50 and counts["error"] > 35


def _with_header(data: bytes, header: bytes) -> bytes:
    return len(header).to_bytes(8, "little") + header + data[header_end(data) :]


def header_length(residue: int):
    """The header padded (spaces, as JSON allows) to a length of 8k + ``residue``: every tensor then starts at
    ``residue`` mod 8 in the file and so in its mapping."""

    def apply(data: bytes) -> bytes:
        header = data[8 : header_end(data)].rstrip(b" ")
        return _with_header(data, header + b" " * ((residue - len(header)) % 8))

    return apply


def leading_spaces(data: bytes) -> bytes:
    header = b"   " + data[8 : header_end(data)].rstrip(b" ")
    return _with_header(data, header + b" " * (-len(header) % 8))


def flipped_data(data: bytes) -> bytes:
    """Tensor bytes set to 0xff (NaNs in bf16 and fp32): no checksum guards them, so the loader takes them."""
    out = bytearray(data)
    start = header_end(data) + 100
    out[start : start + 64] = b"\xff" * 64
    return bytes(out)


# name -> (how the weights file changes, whether the tensors keep the original bits)
FAMILIES = {
    **{f"header length 8k+{r}": (header_length(r), True) for r in range(1, 8)},
    "leading spaces in the header": (leading_spaces, True),
    "flipped tensor bytes": (flipped_data, False),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_accepted_family_offloads_and_steps(tiny_checkpoint, tmp_path, family):
    """Each family the loader accepts runs offloaded, bit-identical to resident on the same files; those that
    keep the bits give the original checkpoint's output."""
    change, same_bits = FAMILIES[family]
    folder = pathlib.Path(shutil.copytree(tiny_checkpoint, tmp_path / pathlib.Path(tiny_checkpoint).name))
    weights = folder / "model.safetensors"
    weights.write_bytes(change(weights.read_bytes()))
    assert spec_for(folder) == spec_for(tiny_checkpoint)  # accepted, and planned as the original
    got = runs_like_resident(folder)
    assert (got == one_step(pathlib.Path(tiny_checkpoint), "resident")) == same_bits, family


def test_misaligned_tensors_are_copied_with_their_bits(tiny_checkpoint, tmp_path):
    """8k + 1 bytes of header: every tensor is at an odd address; each is copied to an aligned private tensor
    (counted and named in the report) with exactly the file's bytes."""
    from dlo_fn.io.load import load_checkpoint

    folder = pathlib.Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    weights = folder / "model.safetensors"
    weights.write_bytes(header_length(1)(weights.read_bytes()))
    model, report = load_checkpoint(folder, progress=False)
    original = load_model(tiny_checkpoint, progress=False).state_dict()
    state = model.state_dict()
    assert len(report.realigned_tensors) == len(original) and report.mapped_bytes == 0
    assert report.private_copy_bytes == sum(t.numel() * t.element_size() for t in original.values())
    for k, v in original.items():
        assert state[k].data_ptr() % state[k].element_size() == 0, k
        assert state[k].dtype == v.dtype and torch.equal(
            state[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
        ), k
