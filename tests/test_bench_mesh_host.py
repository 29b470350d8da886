"""`bench mesh-host` on 2 real CPU ranks (dp 1 x sp 2): each shard group's real host arena equals the plan's
per-rank pinned bytes, and the process's anonymous memory grows by that arena (to the page)."""

from __future__ import annotations

import pytest

from benchmarks.bench.mesh_host import measure


@pytest.mark.slow
def test_arena_per_rank_matches_the_mesh_plan():
    doc = measure(dp=1, sp=2)
    got = [(r["shard_group"], r["rank"], r["num_shards"], r["shard_index"]) for r in doc["records"]]
    assert got == [
        ("world", 0, 2, 0),
        ("world", 1, 2, 1),
        ("dp", 0, 1, 0),
        ("dp", 1, 1, 0),
        ("sp", 0, 2, 0),
        ("sp", 1, 2, 1),
    ]
    for r in doc["records"]:
        assert r["arena_bytes"] == r["planned_bytes"] > 0
        assert r["arena_bytes"] <= r["anon_delta_bytes"] <= r["arena_bytes"] + 64 * 1024, r
    by_group = {r["shard_group"]: r["planned_bytes"] for r in doc["records"]}
    assert by_group["dp"] > 1.9 * by_group["world"]  # W = 1: every rank holds the whole model
