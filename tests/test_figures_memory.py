"""The memory CLI, the memory and MiniMax figures (byte-stable), and the MiniMax numbers recomputed from CSV."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.figures import memory as memory_figures
from benchmarks.figures import minimax as minimax_figures
from benchmarks.repro import memory_tables as memory_data
from benchmarks.repro import minimax
from benchmarks.repro.published import PUBLISHED, published
from dlo_fn.cli import main

FIGS = {**memory_figures.FIGURES, **minimax_figures.FIGURES}


def _json(capsys, *argv):
    assert main(["memory", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _values(doc):
    return {(r["section"], r["item"]): r["value_bytes"] for r in doc["rows"]}


def test_cli_json_super_dp4_ascend(capsys):
    doc = _json(
        capsys,
        "--model-bytes",
        "124GB",
        "--dp",
        "4",
        "--num-blocks",
        "128",
        "--platform",
        "ascend",
        "--activation-bytes",
        "1e9",
        "--framework-bytes-per-rank",
        "3.5GB",
        "--host-ram-bytes",
        "2TB",
    )
    v = _values(doc)
    assert doc["dp"] == 4 and doc["num_blocks"] == 128 and doc["fits_host_ram"] is True
    assert v[("host: cold start", "cgroup peak")] == 124 * 10**9 + 4 * 3_500_000_000
    assert v[("host: steady state", "pinned per rank")] == 128 * 242_187_520  # align_up(968_750_000 / 4, 256)
    assert v[("host: steady state", "cgroup-invisible")] == 4 * 128 * 242_187_520
    assert v[("hbm per card", "slots")] == 2 * 4 * 242_187_520
    assert v[("hbm per card", "peak")] == v[("hbm per card", "idle")] + 10**9


def test_cli_private_copy_rank_local_cuda(capsys):
    v = _values(
        _json(
            capsys,
            "--model-bytes",
            "33e9",
            "--dp",
            "4",
            "--max-block-bytes",
            "1GB",
            "--loading",
            "private-copy",
            "--mode",
            "rank-local",
            "--framework-bytes-per-rank",
            "0",
        )
    )
    assert v[("host: cold start", "cgroup peak")] == 5 * 33 * 10**9
    assert v[("host: steady state", "cgroup-invisible")] == 0
    assert v[("host: steady state", "cgroup-visible")] == v[("host: steady state", "physical RAM")]
    assert v[("hbm per card", "landing buffers")] == 0 and v[("hbm per card", "slots")] == 2 * 10**9


def test_cli_named_model_uses_exact_block_sizes(capsys):
    from dlo_fn.io.sources import spec_for
    from dlo_fn.plan.summary import plan_summary

    v = _values(_json(capsys, "--model", "tiny", "--dp", "2"))
    summary = plan_summary(spec_for("tiny"), 2)
    assert v[("host: steady state", "pinned per rank")] == summary.pinned_host_bytes_per_rank
    assert v[("hbm per card", "slots")] + v[("hbm per card", "landing buffers")] == summary.hbm_weight_bytes
    assert main(["memory", "--model", "tiny", "--dp", "2", "--num-blocks", "3"]) == 2
    assert "exact block sizes" in capsys.readouterr().err


def test_cli_without_block_sizes_omits_hbm(capsys):
    doc = _json(capsys, "--model-bytes", "400GB", "--dp", "8")
    assert doc["notes"] and not any(r["section"] == "hbm per card" for r in doc["rows"])


def test_cli_table_and_help(capsys):
    assert main(["memory", "--model-bytes", "124GB", "--dp", "2", "--num-blocks", "128"]) == 0
    out = capsys.readouterr().out
    assert "physical RAM" in out and "S x max_b (W x s_b)" in out and "GB" in out
    with pytest.raises(SystemExit) as exc:
        main(["memory", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for term in (
        "page cache",
        "private copies",
        "framework",
        "pinned per rank",
        "cgroup-invisible",
        "physical RAM",
        "slots",
        "landing buffers",
        "device context",
        "124GB",
    ):
        assert term in help_text, term


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model-bytes", "12XB", "--dp", "2"], "cannot read '12XB'"),
        (["--model-bytes", "1GB", "--dp", "0"], "--dp 0: give >= 1"),
        (["--model-bytes", "1GB", "--dp", "2", "--num-blocks", "4", "--resident-bytes", "2GB"], "resident"),
    ],
)
def test_cli_bad_input(argv, message, capsys):
    assert main(["memory", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIGS))
def test_figures_regenerate_byte_identically(name, tmp_path):
    first = FIGS[name](tmp_path / "a")
    second = FIGS[name](tmp_path / "b")
    assert [p.relative_to(tmp_path / "a") for p in first] == [p.relative_to(tmp_path / "b") for p in second]
    assert any(p.suffix == ".png" for p in first) and any(p.suffix == ".csv" for p in first)
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_minimax_deltas_match_published_within_rounding():
    cases = minimax.load_cases()
    for d in minimax.paired_deltas(cases):
        key = f"minimax.delta.dp{d.dp}sp{d.sp}"
        assert round(d.throughput_pct, 1) == published(f"{key}.throughput_pct").value
        if f"{key}.p50_pct" in PUBLISHED:
            assert round(d.p50_pct, 1) == published(f"{key}.p50_pct").value
    d8 = minimax.paired_delta(cases, 8, 1)
    assert (d8.ranklocal_peak_gib, d8.allgather_peak_gib) == pytest.approx((20.03, 94.03), abs=0.005)


def test_minimax_objective_table_recomputed_from_csv():
    rows = minimax.frontier_comparisons(minimax.load_cases())
    assert len(rows) == 15 + 5 + 2
    for row in rows:
        assert round(row.predicted, 2) == pytest.approx(row.published, abs=0.051 if row.unit == "%" else 0.0051), (
            row.key
        )


def test_minimax_selected_routes_keep_their_ordering_for_every_task():
    frontiers = minimax.task_frontiers(minimax.load_cases())
    assert set(frontiers) == set(minimax.TASKS)
    for routes in frontiers.values():
        assert [r.p50_s for r in routes] == sorted(r.p50_s for r in routes)
        assert [r.videos_per_hour for r in routes] == sorted(r.videos_per_hour for r in routes)
        assert minimax.frontier_ordered(routes) and not minimax.frontier_ordered(routes[::-1])


def test_minimax_missing_waves_are_reported(tmp_path):
    shutil.copy(minimax.DATA_DIR / "industrial_results.csv", tmp_path)
    (tmp_path / "wave_samples.csv").write_text("case,sample_index,wave_s\n")
    with pytest.raises(ValueError, match="no waves for case"):
        minimax.load_cases(tmp_path)


def test_measured_hbm_records_are_read_from_bench_json(tmp_path):
    assert memory_data.measured_hbm_records(tmp_path) == []
    variants = [
        {"variant": "resident", "weight_device_bytes": 5000, "weight_device_bytes_planned": 5000},
        {
            "variant": "dlo-allgather",
            "weight_device_bytes": 1010,
            "weight_device_bytes_planned": 1000,
            "peak_device_bytes": 2000,
        },
    ]
    doc = {
        "machine": {"device_name": "NVIDIA H200", "platform": "cuda"},
        "workloads": [{"name": "video", "variants": variants}, {"name": "image", "variants": variants}],
    }
    (tmp_path / "bench_step_h200.json").write_text(json.dumps(doc))
    (tmp_path / "other.json").write_text(json.dumps(doc))  # only bench_step_*.json files are read
    (rec,) = memory_data.measured_hbm_records(tmp_path)
    assert rec == {
        "file": "bench_step_h200.json",
        "machine": "NVIDIA H200",
        "variant": "dlo-allgather",
        "workload": "video",
        "metric": "weight_device_bytes",
        "measured_bytes": 1010,
        "planned_bytes": 1000,
        "peak_device_bytes": 2000,
    }


def test_every_memory_comparison_names_a_published_number():
    rows = memory_data.host_comparisons() + memory_data.hbm_comparisons() + memory_data.capacity_comparisons()
    keys = [r.key for r in rows]
    assert len(keys) == len(set(keys))
    assert all(k in PUBLISHED or "(" in k for k in keys)  # derived differences are named by their formula
    assert all(abs(r.rel_error) < 1.0 for r in rows)


def test_model_sizes_come_from_the_reference_configs_when_available():
    nano = memory_data.model_sizes("cosmos3-nano")
    assert nano.num_blocks == 72 and abs(nano.total_bytes / 33e9 - 1) < 0.01
    assert nano.source  # sizes are inputs: their source is always stated
