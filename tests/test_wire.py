"""The engine's host message channel: on a device backend it opens a gloo side group with the same members."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from conftest import scenario

from dlo_fn.serve.wire import Channel


def _channel_rank(ctx):
    # Pretend the device group is NCCL's: the channel must open its own gloo group over the same ranks.
    channel = Channel(ctx.group or dist.group.WORLD, "nccl", timeout_s=30)
    assert channel.group is not dist.group.WORLD
    members = dist.get_process_group_ranks(channel.group)
    got = channel.broadcast({"from": ctx.rank, "payload": list(range(5))})
    return members, got


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_side_group_has_the_device_groups_members_and_broadcasts(request):
    results = scenario(request, 2, "wire")  # the shared spawn of 2 ranks (conftest.SCENARIOS)
    for members, got in results:
        assert members == [0, 1]
        assert got == {"from": 0, "payload": [0, 1, 2, 3, 4]}
