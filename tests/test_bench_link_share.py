"""`bench link-share --quick` on CPU: real gloo ranks load blocks as the allgather program does, the gathered bytes
are every rank's shard, and the report has its schema (CPU timings are not checked); the predictions are
plan.links' sums for W ranks behind one link, by hand; the notebook's table reads the report."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench.link_share import predict, topology
from benchmarks.cli import lab_parser as build_parser
from benchmarks.repro.pcie_tables import link_share_rows

MB = 10**6


def test_predictions_by_hand():
    """W = 2 ranks behind a 50 GB/s link, host memory 100 GB/s, 4 blocks of 200 MB (shards of 100 MB): the shards'
    H2D put one block through the link (k s = 200 MB: 4 ms); the load through host memory puts k W s = 400 MB on
    it (8 ms) and N (2W - 1) s = 600 MB through DRAM (6 ms); links of their own would charge s / rate = 2 ms."""
    p = predict(2, 200 * MB, 4, 50e9, 100e9)
    assert p["predicted_h2d_s"] == pytest.approx(4e-3) and p["independent_s"] == pytest.approx(2e-3)
    assert p["links_s"] == pytest.approx({"pcie": 4e-3, "uplink": 8e-3, "host-memory": 6e-3})
    assert p["predicted_load_link"] == "uplink" and p["predicted_load_s"] == pytest.approx(8e-3)
    one = predict(1, 200 * MB, 4, 50e9, None)  # one rank: the block once over the link, no collective term
    assert one["predicted_load_s"] == pytest.approx(4e-3) == one["predicted_h2d_s"]
    t = topology(4, 50e9, None)
    assert (t.peer_link, t.gpus_per_uplink, t.ranks_per_host, t.uplink_bytes_per_s) == ("host", 4, 4, 50e9)


def test_quick_run_schema_and_table(tmp_path):
    out = tmp_path / "link_share.json"
    args = build_parser().parse_args(["bench", "link-share", "--quick", "--ranks", "1,2", "--out", str(out)])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    assert (
        r["command"].startswith("python -m benchmarks bench link-share")
        and r["date"]
        and r["machine"]["platform"] == "cpu"
    )
    assert r["link_bytes_per_s"] > 0 and r["host_memory_bytes_per_s"] > 0
    assert [row["world_size"] for row in r["rows"]] == [1, 2]
    for row in r["rows"]:
        assert row["exact"] and len(row["ranks"]) == row["world_size"]
        assert row["block_bytes"] == row["world_size"] * row["shard_bytes"] == r["rows"][0]["block_bytes"]
        for k in ("h2d_s", "allgather_s", "load_s", "predicted_h2d_s", "predicted_load_s", "independent_s"):
            assert row[k] > 0, k
    table = link_share_rows(out)
    assert [t["W"] for t in table] == [1, 2] and all(t["exact"] for t in table)


def test_missing_data_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="bench link-share"):
        link_share_rows(tmp_path / "link_share_nvidia-h200.json")
    with pytest.raises(SystemExit, match="must include 1"):
        args = build_parser().parse_args(["bench", "link-share", "--quick", "--ranks", "2,4"])
        args.func(args)
