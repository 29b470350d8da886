"""The named machines the library's ``policy`` reads (``dlo_fn/cost/named.json``) are what the lab builds from the
published numbers and measurements (``benchmarks.repro.topologies``), field for field."""

from __future__ import annotations

from benchmarks.repro import topologies as lab
from dlo_fn.cost import topology_file as library


def test_the_committed_file_is_what_the_lab_writes(tmp_path):
    written = lab.write_named(tmp_path / "named.json")
    assert written.read_text() == library.NAMED_FILE.read_text(), "run `python -m benchmarks figures`"


def test_every_named_topology_model_and_workload_reads_back_equal():
    assert library.topology_names() == lab.TOPOLOGY_NAMES and library.model_names() == lab.MODEL_NAMES
    for name in lab.TOPOLOGY_NAMES:
        assert library.topology(name) == lab.topology(name), name
    for name in lab.MODEL_NAMES:
        assert library.model(name) == lab.model(name), name
    assert library.workloads() == lab.workloads()
