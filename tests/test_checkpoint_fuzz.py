"""Fuzzed checkpoints (seeded, bounded in time): header byte flips, truncations and index flips of real
checkpoints. Every variant either fails with the project's CheckpointError, in the plan (spec_for, which checks
the headers against the model config.json describes) and in the loader alike, or is harmless (a flipped space
in the header padding, a changed __metadata__ string): then the plan is the original's and the loader binds
the original tensors. Nothing else may escape: no SafetensorError, KeyError or AttributeError, no other plan."""

from __future__ import annotations

import dataclasses
import pathlib
import random
import shutil
import time

import pytest
import torch

from dlo_fn.runtime.checkpoint import CheckpointError
from dlo_fn.runtime.load import load_model
from dlo_fn.runtime.sources import spec_for

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


def fuzz(folder: pathlib.Path, variants: list[Case], deadline: float) -> dict:
    """Run every case on ``folder`` (each file restored after its case); returns outcome counts."""
    base_spec = spec_for(folder)
    base_state = _state(load_model(folder, progress=False))
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
                state[k].dtype == v.dtype and torch.equal(state[k], v) for k, v in base_state.items()), case
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
