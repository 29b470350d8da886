"""The per-rank host model (cost/rank_memory.py) against the committed sweeps: recomputed from each run's
measured constant and the config's exact sizes it gives the committed prediction byte for byte, and on CPU
every phase's RSS / USS / PSS / VmHWM / sum-PSS is within 5% of the measurement (N = 1..4, three modes);
on the H200 the load/offload rows are, and the pinned arena equals the plan to the byte."""

from __future__ import annotations

import csv
import pathlib

import pytest
import torch

from dlo_fn.cost.rank_memory import ProcessConstant, gloo_cuda_staging_bytes, rank_memory, rank_terms
from dlo_fn.plan.sizes import ModelSizes

DATA = pathlib.Path(__file__).resolve().parents[1] / "figures" / "data"
KEYS = ("rss", "uss", "pss", "hwm", "sum_pss")


def _sizes(name: str) -> ModelSizes:
    from benchmarks.bench.load import load_config
    from dlo_fn.models import BLOCK_PATHS, build_model
    from dlo_fn.plan.spec import spec_from_module

    model = build_model(load_config(name), device="meta", dtype=torch.bfloat16)
    return ModelSizes.from_spec(spec_from_module(model, BLOCK_PATHS, name=name))


def _rows(name: str):
    return list(csv.DictReader((DATA / name).open()))


def test_cpu_sweep_within_5_percent_and_reproduced():
    sizes = _sizes("load-1gb")
    rows = _rows("load_phases.csv")
    assert {(r["mode"], int(r["ranks"])) for r in rows} == {
        (m, n) for m in ("allgather", "rank-local", "rank-local-mmap") for n in (1, 2, 3, 4)
    }
    loads = {(r["mode"], r["ranks"]): r for r in rows if r["phase"] == "load"}
    for r in rows:
        c = loads[(r["mode"], r["ranks"])]
        plan = rank_memory(
            sizes,
            int(r["ranks"]),
            r["mode"],
            "cpu",
            process_group=True,
            constant=ProcessConstant(int(c["rss_bytes"]), int(c["uss_bytes"]), int(c["pss_bytes"])),
        ).phase(r["phase"])
        for k in KEYS:
            predicted, measured = getattr(plan, f"{k}_bytes"), int(r[f"{k}_bytes"])
            assert predicted == int(r[f"predicted_{k}_bytes"]), (r["mode"], r["ranks"], r["phase"], k)
            assert abs(predicted / measured - 1) <= 0.05, (r["mode"], r["ranks"], r["phase"], k, predicted, measured)
        if r["phase"] in ("offload", "generate") and r["mode"] != "rank-local-mmap":
            assert int(r["file_rss_bytes"]) < 0.02 * sizes.total_bytes, r  # the mapping is closed


def _h200_plan(rows):
    """The plan's phase for each H200 row, from its run's measured constant (gloo's host staging x for the
    allgather at N > 1: its ranks share the GPU over gloo)."""
    sizes = _sizes("load-200mb")
    loads = {(r["mode"], r["ranks"]): r for r in rows if r["phase"] == "load"}
    for r in rows:
        c, n = loads[(r["mode"], r["ranks"])], int(r["ranks"])
        x = gloo_cuda_staging_bytes(sizes, n) if r["mode"] == "allgather" and n > 1 else 0
        yield rank_memory(
            sizes,
            n,
            r["mode"],
            "cuda",
            staging_bytes=x,
            process_group=True,
            constant=ProcessConstant(int(c["rss_bytes"]), int(c["uss_bytes"]), int(c["pss_bytes"])),
        ).phase(r["phase"])


def test_h200_pinned_exact_fill_and_offload_within_5_percent_and_reproduced():
    """Fill and offload within 5%; the first step (generate) adds CUDA's kernel modules, not modelled."""
    rows = _rows("load_phases_h200.csv")
    assert rows and all(r["pinned_bytes"] == r["planned_arena_bytes"] == r["arena_bytes"] for r in rows)
    assert {(r["mode"], r["ranks"], r["phase"]) for r in rows} == {
        (m, str(n), p)
        for m in ("allgather", "rank-local")
        for n in (1, 2)
        for p in ("load", "fill", "offload", "generate")
    }
    for r, plan in zip(rows, _h200_plan(rows)):
        for k in KEYS:
            assert getattr(plan, f"{k}_bytes") == int(r[f"predicted_{k}_bytes"]), (r["mode"], r["ranks"], k)
        if r["phase"] in ("fill", "offload"):
            assert int(r["file_rss_bytes"]) == 0
            for k in ("rss", "uss", "pss", "hwm", "sum_pss"):
                assert abs(int(r[f"predicted_{k}_bytes"]) / int(r[f"{k}_bytes"]) - 1) <= 0.05, (r["mode"], k)


def test_terms():
    sizes = ModelSizes.uniform("m", 10_000, 10, resident_bytes=0)
    ag = rank_terms(sizes, 2, "allgather", "cpu")
    assert ag.arena_bytes == sizes.shard_bytes_per_rank(2) and ag.readers == 1 and ag.warm_bytes > 0
    rl = rank_terms(sizes, 4, "rank-local", "cuda")
    assert rl.readers == 4 and rl.slot_bytes == rl.warm_bytes == rl.resident_copy_bytes == 0
    mm = rank_terms(sizes, 2, "rank-local-mmap", "cpu")
    assert mm.arena_bytes == 0 and mm.streamed_bytes == sizes.total_block_bytes
    assert gloo_cuda_staging_bytes(sizes, 2) == 512 + 1024  # shard 500 -> 512 (aligned 512), slot 1024
    with pytest.raises(ValueError):
        rank_terms(sizes, 2, "bogus")
