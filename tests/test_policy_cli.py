"""`python -m dlo_fn policy`: the ranked table for a named topology and a JSON file; bad input in one line."""

from __future__ import annotations

import json
import re

import pytest

from dlo_fn.cli import main


def test_named_topology_prints_the_ranked_table_and_sources(capsys):
    assert main(["policy", "--model", "cosmos3-nano", "--topology", "4xAscend910B3", "--slots", "2"]) == 0
    out = capsys.readouterr().out
    assert "cosmos3-nano on 4xAscend910B3 (4 ranks)" in out
    assert "1     DP4xSP1 allgather W4 S2 R1" in out
    assert "host_s_per_block: allgather: (stream switching + Python dispatch) / 72" in out
    assert out.strip().splitlines()[-1].startswith("chosen: DP4xSP1 allgather W4 S2 R1")


def test_json_topology(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps(
            {
                "name": "two",
                "num_ranks": 2,
                "h2d_bytes_per_s": 50e9,
                "allgather_bus_bytes_per_s": 100e9,
                "all_to_all_bytes_per_s": 100e9,
                "d2d_copy_bytes_per_s": 2e12,
                "hbm_bytes_per_rank": 80e9,
                "host_bytes_per_rank": 500e9,
                "compute": {"table": [[4096, 2, 0.009]]},
                "sources": {"h2d_bytes_per_s": "a guess"},
            }
        )
    )
    assert main(["policy", "--model", "bench", "--topology", str(path), "--slots", "2"]) == 0
    out = capsys.readouterr().out
    assert "bench on two (2 ranks)" in out and "h2d_bytes_per_s: a guess" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--topology", "9xTPU"], "policy: --topology: unknown topology '9xTPU'; named: 1xH200"),
        (["--topology", "missing.json"], "policy: --topology missing.json: no such file"),
        (["--slots", "two"], "policy: --slots must be a comma list of integers"),
        (["--model", "gpt"], "policy: unknown policy model 'gpt'"),
    ],
)
def test_bad_input_is_one_line(argv, message, capsys):
    assert main(["policy", *argv]) == 2  # a usage error: one line on stderr, no traceback
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message.removeprefix("policy: ") in err, err


def test_json_missing_field(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"name": "x"}))
    assert main(["policy", "--topology", str(path)]) == 2
    assert re.search(r"--topology .*bad.json: missing field\(s\) num_ranks", capsys.readouterr().err)


def test_help_names_every_topology_workload_and_the_file_schema(capsys):
    from benchmarks.repro import topologies

    with pytest.raises(SystemExit):
        main(["policy", "--help"])
    out = capsys.readouterr().out
    for name in topologies.TOPOLOGY_NAMES:
        assert f"  {name} " in out, name
    for name in topologies.workloads():
        assert f"  {name!r}:" in out, name
    t = topologies.topology_to_dict(topologies.topology("8xL40S"))
    for field in t:  # every field a topology file can hold
        assert f"  {field} " in out, field


@pytest.mark.parametrize("name", ["8xL40S", "8xRTX4090", "8xH100-PCIe", "8xL20"])
def test_pcie_topologies_list(name, capsys):
    assert main(["policy", "--topology", name, "--slots", "2", "--limit", "3"]) == 0
    out = capsys.readouterr().out
    assert f"bench on {name} (8 ranks)" in out and "peer_link: " in out and "host_memory_bytes_per_s: " in out
