"""`bench sp-hbm` on CPU (tiny config, 2 gloo ranks): weights and pinned host bytes equal the plan, SP lowers the
per-rank workload peak, and the measured peak is at least the SP model's (its tensors are provably alive at once:
the CPU's SDPA adds scratch buffers on top)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench.sp_hbm import SPCase, _peak_allocations, parse_case
from benchmarks.cli import main


@pytest.mark.slow
def test_tiny_sp_pass_on_cpu_matches_the_plan(tmp_path):
    out = tmp_path / "sp.json"
    assert (
        main(
            [
                "bench",
                "sp-hbm",
                "--device",
                "cpu",
                "--cases",
                "tiny:1,tiny:2",
                "--height",
                "256",
                "--width",
                "256",
                "--frames",
                "9",
                "--threads-per-rank",
                "1",
                "--weights",
                "constant",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert {"machine", "command", "date", "note", "records"} <= set(doc) and "not performance" in doc["note"]
    records = doc["records"]
    assert [(r["case"], r["rank"]) for r in records] == [("tiny sp1", 0), ("tiny sp2", 0), ("tiny sp2", 1)]
    for r in records:
        assert "error" not in r, r
        assert r["weight_bytes"] == r["weight_bytes_planned"]
        assert r["pinned_host_bytes"] == r["pinned_host_bytes_planned"]
        assert r["workload_peak_bytes"] >= r["workload_peak_bytes_model"] and r["output_finite"]
    one, two = records[0], records[1]
    assert two["local_tokens"] * 2 == one["tokens"] == 768
    assert two["workload_peak_bytes"] < one["workload_peak_bytes"]
    assert two["model_peak_phase"] == "tokens -> heads" and two["communication_bytes_model"] > 0


def test_case_parsing_and_peak_replay():
    assert parse_case("cosmos3-nano@32:4", 2) == SPCase("cosmos3-nano", 4, 2, 32)
    assert SPCase("cosmos3-nano", 4, 2, 32).build_config().head_dim == 120
    with pytest.raises(SystemExit, match="CONFIG\\[@HEADS\\]:SP"):
        parse_case("cosmos3-nano", 2)
    trace = [
        {
            "action": "alloc",
            "addr": 1,
            "size": 10,
            "frames": [{"filename": "/r/dlo_fn/models/sp.py", "line": 3, "name": "f"}],
        },
        {"action": "alloc", "addr": 2, "size": 5, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 10},
        {"action": "alloc", "addr": 3, "size": 7, "frames": []},
    ]
    assert _peak_allocations({"device_traces": [trace]}, top=1) == [
        {"bytes": 10, "where": "models/sp.py:3 f"},
        {"bytes": 5, "where": "1 others"},
    ]
