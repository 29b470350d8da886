"""The allgather host-cost bench (benchmarks.bench.allgather_host) on the CPU: two real gloo ranks."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.cuda(cpu=True)
def test_allgather_host_bench_runs_two_ranks_and_splits_the_collective_off():
    # Two gloo ranks, each block sharded over both, at load groups 1 and 2 (the grouped layout): outputs equal to
    # resident on both ranks, the executor's own time its host time less the time inside the collective calls,
    # one collective per block or per group, and the stream operations the plan counts.
    from benchmarks.bench import allgather_host

    out = allgather_host.measure("tiny", (1, 2), quick=True, nccl=torch.cuda.is_available())
    r = out["gloo_two_ranks"]
    assert r["world_size"] == 2 and len(r["by_rank"]) == 2 and ("nccl_calls" in out) is torch.cuda.is_available()
    for rows in r["by_rank"]:
        assert rows["g2"]["num_slots"] == 4 and rows["g2"]["num_landing"] == 4  # 2G each
        assert rows["g2"]["layout_load_group"] == 2  # the tiny model's 4 blocks: two groups of 2
        for row in rows.values():  # the collective calls are timed inside the executor's own timer
            assert row["equal_to_resident"]
            assert 0 < row["collective_call_us_per_block"] < row["proxy_host_us_per_block"]
        assert rows["g1"]["collectives_per_block"] == 1 and rows["g2"]["collectives_per_block"] == 0.5
        assert rows["g2"]["stream_ops_per_block"] < rows["g1"]["stream_ops_per_block"]
    if torch.cuda.is_available():
        assert all(out["nccl_calls"]["gathered_equal"].values())
    with pytest.raises(SystemExit):
        allgather_host.main(["--load-groups", "1,x"])


@pytest.mark.cuda
def test_block_spans_time_each_block_entry_with_the_host_ahead():
    # Three blocks of unequal work in one module list: a span per block boundary, the longer block's span the
    # longer, and a lead per block (the host enqueues ahead of the device here: the blocks are kernel-bound)
    from torch import nn

    from benchmarks.bench.trace import SPAN_FORWARDS, block_spans
    from dlo_fn.runtime.platform import detect_platform

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(2048, 2048) for _ in range(3)).cuda()

        def forward(self, x):
            for i, block in enumerate(self.blocks):
                for _ in range(1 + 8 * (i == 1)):  # block 1 runs 9 matmuls, the others one
                    x = block(x)
            return x

    platform, model = detect_platform(prefer="cuda"), Model()
    x = torch.randn(4096, 2048, device="cuda")
    out = block_spans(platform, model, lambda: model(x))
    assert SPAN_FORWARDS >= 2 and len(out["block_span_s"]) == 2 and len(out["host_lead_s"]) == 3
    assert out["block_span_s"][1] > 4 * out["block_span_s"][0] > 0
    assert block_spans(detect_platform(prefer="cpu"), model, lambda: model(x)) is None
