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
