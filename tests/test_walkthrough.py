"""benchmarks.walkthrough (notebook 03's per-rank function): on 2 gloo ranks, per mode, the buffers and host
bytes the runtime built, the schedule it followed and its measured Timeline, and an output equal to resident."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.slow
def test_offload_and_run_on_two_ranks(tmp_path):
    from benchmarks.walkthrough import offload_and_run
    from dlo_fn.io.load import load_model
    from dlo_fn.models import Request, generate
    from dlo_fn.models.checkpoint import ensure_checkpoint
    from dlo_fn.plan.compare import check_against_schedule
    from dlo_fn.serve.ranks import run_ranks

    ckpt = ensure_checkpoint(tmp_path)
    shape = dict(height=32, width=32, num_frames=5, num_inference_steps=1)
    per_rank = run_ranks(offload_and_run, 2, str(ckpt), ["a", "b"], shape, start_method="forkserver")
    for rank, runs in enumerate(per_rank):
        assert [r.mode for r in runs] == ["allgather", "rank-local"]
        resident = generate(load_model(ckpt), Request(["a", "b"][rank], seed=rank, **shape)).video
        for run in runs:
            assert run.rank == rank and run.files == ("model.safetensors",) and run.plugin == "none"
            assert run.device_weight_bytes == run.planned_device_weight_bytes
            assert len(run.landing_bytes) == (2 if run.mode == "allgather" else 0)
            assert run.num_shards == (2 if run.mode == "allgather" else 1)
            assert check_against_schedule(run.measured, run.schedule)
            assert torch.equal(torch.from_numpy(run.video), resident)
    ag, rl = per_rank[0]
    assert 2 * ag.host_store_bytes <= rl.host_store_bytes  # each rank holds half of each (padded) block
