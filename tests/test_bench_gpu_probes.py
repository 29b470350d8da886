"""The GPU probes' CPU parts: the CUPTI trace analysis of bench.graph_gaps, and both probes' refusal off CUDA."""

from __future__ import annotations

import pytest
import torch

from dlo_fn.bench import driver_cost, graph_gaps


def _copy(ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": ts, "dur": dur, "tid": 7}


def _kernel(ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": "gemm", "ts": ts, "dur": dur, "tid": 9}


def test_gaps_busy_fraction_and_gap_with_kernels_during_it():
    trace = {"traceEvents": [_copy(0, 10_000), _copy(10_000, 10_000), _copy(25_000, 10_000),
                             _kernel(19_000, 3_000), _kernel(30_000, 1_000),
                             {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 1, "dur": 50_000}]}
    got = graph_gaps._gaps(trace, gap_ms=1.0)
    assert got["copies"] == 3 and got["span_ms"] == 35.0
    assert got["h2d_busy_fraction"] == round(30_000 / 35_000, 4)
    # One gap (20.0 -> 25.0 ms); the kernel 19-22 ms overlaps 2 ms of it, the one at 30 ms none.
    assert got["gaps"] == [{"after_copy_us": 20_000, "gap_ms": 5.0, "kernels_during": 1, "kernel_busy_ms": 2.0}]
    assert got["copy_ms_median"] == 10.0


def test_gaps_names_what_the_trace_holds_when_it_has_no_copy():
    got = graph_gaps._gaps({"traceEvents": [_kernel(0, 5)]}, gap_ms=0.5)
    assert "no H2D copies" in got["error"] and got["names"] == ["kernel"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("probe", [driver_cost, graph_gaps])
def test_probes_refuse_without_cuda_in_one_line(probe, capsys):
    assert probe.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA device" in err[0]


def test_allgather_host_bench_runs_two_ranks_and_splits_the_collective_off():
    # bench.allgather_host on the CPU: two gloo ranks, each block sharded over both; the torch-event loop and the
    # driver-call path (on the host driver) with load groups, outputs equal to resident on both ranks, and the
    # executor's own time is its host time less the time inside the collective calls.
    from dlo_fn.bench import allgather_host

    out = allgather_host.measure("tiny", ("torch-events", "driver-g2"), quick=True, nccl=torch.cuda.is_available())
    r = out["gloo_two_ranks"]
    assert r["world_size"] == 2 and len(r["by_rank"]) == 2 and ("nccl_one_rank" in out) is torch.cuda.is_available()
    for rows in r["by_rank"]:  # on CUDA the driver variant makes the real driver calls, on a CPU the host's
        assert rows["torch-events"]["driver_calls"] is False and rows["driver-g2"]["driver_calls"] is True
        assert rows["driver-g2"]["host_driver"] is (not torch.cuda.is_available())
        assert rows["driver-g2"]["num_slots"] == 4 and rows["driver-g2"]["num_landing"] == 4  # 2G each
        for row in rows.values():  # the collective calls are timed inside the executor's own timer
            assert row["equal_to_resident"]
            assert 0 < row["collective_call_us_per_block"] < row["proxy_host_us_per_block"]
    if torch.cuda.is_available():  # one NCCL rank, the allgather op sequence kept: a real collective per load
        n = out["nccl_one_rank"]
        assert n["backend"] == "nccl" and n["world_size"] == 1 and all(n["calls"]["gathered_equal"].values())
        assert all(v["equal_to_resident"] and v["collective_call_us_per_block"] > 0 for v in n["variants"].values())
    else:  # the same on a one-rank gloo group (the host driver): a real one-rank all-gather per load group
        from dlo_fn.runtime.dist import run_ranks

        (one,) = run_ranks(allgather_host._rank, 1, "tiny", ("driver", "driver-g2"), True, True, timeout_s=120)
        assert one["backend"] == "gloo" and one["shard_bytes"] > r["shard_bytes"]  # one rank's shard: the block
        for row in one["variants"].values():
            assert row["equal_to_resident"] and row["host_driver"] and row["collective_call_us_per_block"] > 0
    with pytest.raises(SystemExit):
        allgather_host.main(["--variants", "driver,nope"])
