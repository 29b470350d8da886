"""After the host store is filled no rank keeps checkpoint pages mapped (io/release.py): on 2 real gloo ranks
with a 216 MB checkpoint, each rank's USS after offload is at most its arena + the (host) slots and landing
buffers + its resident copies + the per-process constant measured in the same rank before offloading, + 5%, and
the file's mapping is gone; the page cache keeps the file (the OS's)."""

from __future__ import annotations

import mmap

import pytest
import torch

from dlo_fn.io.release import mapped_bytes, release_mapped_tensors, release_ranges, viewed_files
from dlo_fn.serve.ranks import run_ranks


def _rank(ctx, ckpt: str, mode: str, budget_fraction: float | None = None) -> dict:
    from dlo_fn.io.checkpoint import open_checkpoint
    from dlo_fn.io.load import load_checkpoint
    from dlo_fn.io.memstat import mapped_file_memory, process_memory
    from dlo_fn.models import BLOCK_PATHS
    from dlo_fn.plan.layout import model_layout
    from dlo_fn.plan.spec import spec_from_module
    from dlo_fn.runtime.offload import offload

    files = [str(f) for f in open_checkpoint(ckpt).files]
    model, _ = load_checkpoint(ckpt, None, progress=False)
    constant = process_memory().uss_bytes  # torch, gloo, the bound (untouched) model: no weight bytes yet
    mapped_at_load = mapped_bytes(files)
    budget = None
    if budget_fraction is not None:  # a host budget: pin the leading shards that fit, stream the rest
        budget = int(
            budget_fraction
            * model_layout(
                spec_from_module(model, BLOCK_PATHS), ctx.world_size if mode == "allgather" else 1
            ).shard_bytes_per_rank
        )
    o = offload(model, BLOCK_PATHS, ctx, mode=mode, pinned_budget_bytes=budget)
    after = process_memory()
    return {
        "constant": constant,
        "uss": after.uss_bytes,
        "arena": o.store.arena_bytes,
        "host_slots": o.executor.device_weight_bytes,
        "resident": o.spec.resident_bytes,
        "mapped_at_load": mapped_at_load,
        "mapped_after": mapped_bytes(files),
        "file_rss_after": mapped_file_memory(files)["rss_bytes"],
        "closed": o.release.closed,
        "copied": o.release.copied_bytes,
        "streamed": o.store.streamed_bytes,
    }


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allgather", "rank-local"])
def test_no_rank_keeps_checkpoint_pages(ckpt_200mb, mode):
    for r in run_ranks(_rank, 2, ckpt_200mb, mode, timeout_s=240):
        bound = r["constant"] + r["arena"] + r["host_slots"] + r["resident"]
        assert r["uss"] <= 1.05 * bound, r
        assert r["mapped_at_load"] > 2e8 and r["mapped_after"] == 0 and r["file_rss_after"] == 0, r
        assert r["closed"] and r["copied"] == r["resident"], r  # on CPU the resident tensors are private copies


def test_release_copies_views_keeps_ties_and_identity(checkpoint):
    from dlo_fn.io.load import load_model

    model = load_model(checkpoint, progress=False)
    files = viewed_files(model)
    assert files and mapped_bytes(files) > 0
    params = {n: p for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in params.items()}
    report = release_mapped_tensors(model, files)
    assert report.closed and report.copied_tensors > 0 and mapped_bytes(files) == 0
    assert all(model.get_parameter(n) is p and torch.equal(p, before[n]) for n, p in params.items())
    assert viewed_files(model) == ()
    again = release_mapped_tensors(model, files)  # nothing left to copy
    assert again.copied_tensors == 0 and again.closed


def test_release_ranges_drops_touched_file_pages(tmp_path):
    from dlo_fn.io.memstat import mapped_file_memory

    path = tmp_path / "blob.bin"
    n = 64 * mmap.PAGESIZE
    path.write_bytes(bytes(range(256)) * (n // 256))
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), n, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    total = int(t.sum())
    assert mapped_file_memory([path])["rss_bytes"] >= n
    assert release_ranges([(t.data_ptr() + 100, t.data_ptr() + n)]) == n - mmap.PAGESIZE  # partial head page kept
    assert mapped_file_memory([path])["rss_bytes"] <= mmap.PAGESIZE
    assert int(t.sum()) == total  # the bytes come back from the page cache on the next read
    del t
    m.close()


@pytest.mark.slow
def test_partly_pinned_rank_keeps_only_streamed_pages(ckpt_200mb):
    """Half the arena budget: the mapping stays open for the streamed blocks, but the pages copied into the
    arena (and the resident tensors') are dropped from it, so USS obeys the same bound."""
    for r in run_ranks(_rank, 2, ckpt_200mb, "allgather", 0.5, timeout_s=240):
        assert 0 < r["arena"] <= r["streamed"] + 256 * 12, r
        assert r["mapped_after"] > 0 and r["file_rss_after"] <= 0.05 * r["arena"] + 2**20, (
            r
        )  # fault-around and partial pages
        assert r["uss"] <= 1.05 * (r["constant"] + r["arena"] + r["host_slots"] + r["resident"]), r


def test_memory_and_plan_print_the_per_rank_terms(capsys):
    import json

    from dlo_fn.cli import main

    assert main(["memory", "--model-bytes", "10GB", "--num-blocks", "10", "--dp", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["rank_memory"]
    assert doc["terms"]["arena_bytes"] == 5 * 10**9 and [p["phase"] for p in doc["phases"]] == [
        "load",
        "fill",
        "offload",
        "generate",
    ]
    assert doc["phases"][2]["uss_bytes"] == doc["constant_bytes"] + 5 * 10**9  # mapping closed: c + s
    assert main(["plan", "--model", "tiny", "--num-shards", "2"]) == 0
    out = capsys.readouterr().out
    assert "host terms per rank" in out and "arena_bytes" in out and "read_bytes" in out
