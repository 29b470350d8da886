"""`bench step --quick` on CPU: every variant runs through the real executor and the report is complete."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench.step_variants import DEFAULT_VARIANTS as VARIANTS
from benchmarks.cli import lab_parser as build_parser
from benchmarks.figures.bench import bench_rows, plot_bench_step


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench_step_cpu_quick.json"
    args = build_parser().parse_args(["bench", "step", "--quick", "--platform", "cpu", "--out", str(out)])
    assert args.func(args) == 0
    return json.loads(out.read_text())


def test_quick_bench_reports_every_variant(quick_report):
    r = quick_report
    assert r["config"] == "tiny" and r["num_blocks"] == 4 and r["command"].startswith("python -m benchmarks bench step")
    assert r["machine"]["platform"] == "cpu" and r["date"]
    assert r["pinned_h2d_peak_bytes_per_s"] > 0 and r["pinned_arena_bytes"] == r["h2d_bytes_per_pass"]
    assert [w["name"] for w in r["workloads"]] == ["video", "image"]
    for w in r["workloads"]:
        ran = [v["variant"] for v in w["variants"]]
        assert set(ran) | set(r["skipped_variants"]) == set(VARIANTS)
        res = next(v for v in w["variants"] if v["variant"] == "resident")
        assert res["ratio_to_resident"] == 1.0 and res["h2d_bytes_per_s"] == 0
        for v in w["variants"]:
            assert len(v["step_s_all"]) == 2 and v["step_s"] > 0 and v["ratio_to_bound"] > 0
            assert v["equal_to_resident"] is True  # every variant's output is byte-identical to resident
            assert v["host_s"] > 0
            if v["variant"].startswith("dlo-"):
                # Weight memory of the executor is exactly its plan: 2 slots (+ 2 landing buffers).
                if v["variant"].endswith("-bgraph"):
                    assert v["weight_buffers"] == "as the eager variant" and v["graph_replays"] == 0  # CPU: eager
                else:
                    assert v["weight_device_bytes"] == v["weight_device_bytes_planned"]
                assert v["proxy_host_us_per_block"] > 0 and v["load_issue_us_per_block"] > 0


def test_quick_bench_measures_dispatch(quick_report):
    d = quick_report["dispatch"]
    assert d["tensors_per_block"] == 15 and d["resident_pass_host_s"] > 0
    assert {"dlo-rank-local", "dlo-allgather", "dlo-rank-local-swap"} <= set(d["variants"])
    for row in d["variants"].values():
        assert row["pass_host_s"] > 0
    assert len(quick_report["pinned_h2d_peaks_bytes_per_s"]) == len(VARIANTS)  # one first, one per offload variant


def test_bench_figure_from_report(quick_report, tmp_path):
    paths = plot_bench_step(quick_report, tmp_path)
    assert [p.name for p in paths] == ["fig_bench_step.png", "fig_bench_step.csv"]
    assert len(bench_rows(quick_report)) == sum(len(w["variants"]) for w in quick_report["workloads"])
