"""Shared links on PCIe machines (plan.links, pure): the bytes each link carries, the step they bound, and what the
policy picks on the named PCIe topologies (repro.pcie_topologies)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.repro import pcie_topologies, topologies
from dlo_fn.cost.links import link_busy_s, link_bytes
from dlo_fn.cost.policy import Candidate, plan, predict
from dlo_fn.cost.topology import BlockCompute, PolicyModel, Topology
from dlo_fn.plan.sizes import ModelSizes
from dlo_fn.plan.workload import Workload

MB = 2**20  # shards of whole pages: no padding
GB = 1000 * MB
SIZES = ModelSizes.uniform("toy", 800 * MB, 8)  # 8 blocks of 100 MB: 25 MB shards at W = 4
MODEL = PolicyModel(SIZES, hidden_dim=64)
WL = Workload("toy", tokens=100, num_steps=4, cfg_branches=1)


def pcie(peer="pcie", k=1, up=None, mem=None, block_s=0.01, ranks=8, host=10**13):
    """1 GB/s links, 100 MB blocks: a whole block's H2D is 0.1 s, its compute 10 ms: transfer bound."""
    return Topology(
        "pcie-toy",
        ranks,
        GB,
        GB,
        GB,
        GB,
        BlockCompute(table=((100, 1, block_s),)),
        10**11,
        host,
        peer_link=peer,
        gpus_per_uplink=k,
        uplink_bytes_per_s=up,
        host_memory_bytes_per_s=mem,
    )


def test_link_bytes_golden_table():
    """The module docstring's table, per pass over 8 blocks of 100 MB (n = 800 MB, s = 200 MB at W = 4), k = 2
    GPUs per uplink, N = 8 ranks on the host."""
    t = pcie(k=2, up=GB, mem=10 * GB)
    gb = lambda d: {k: v / GB for k, v in d.items()}  # noqa: E731
    assert gb(link_bytes(SIZES, t, "rank-local", 1)) == {"uplink": 1.6, "host-memory": 6.4}
    assert gb(link_bytes(SIZES, dataclasses.replace(t, peer_link="nvlink"), "allgather", 4)) == {
        "uplink": 0.4,
        "host-memory": 1.6,
    }
    # P2P: the GPU link carries the whole block again; the ring enters each switch once (W = 4 > k = 2)
    assert gb(link_bytes(SIZES, t, "allgather", 4)) == {"pcie": 0.8, "uplink": 0.4 + 0.6, "host-memory": 1.6}
    assert gb(link_bytes(SIZES, t, "allgather", 2)) == {"pcie": 0.8, "uplink": 0.8, "host-memory": 3.2}
    # Through host memory: the uplink as rank-local, DRAM 2W - 1 times the sharded H2D
    assert gb(link_bytes(SIZES, dataclasses.replace(t, peer_link="host"), "allgather", 4)) == {
        "pcie": 0.8,
        "uplink": 1.6,
        "host-memory": 11.2,
    }  # 8 x 7 x 0.2
    assert link_busy_s(
        SIZES, dataclasses.replace(t, uplink_bytes_per_s=None, host_memory_bytes_per_s=None), "allgather", 4
    ) == (("pcie", 0.8),)


def test_nvlink_topologies_have_no_shared_link_term():
    """The published machines (independent NVLink / HCCS links, no shared port or DRAM limit given) get no link
    term: their rows are the simulator's, as before (tests/test_policy.py and notebook 09 hold their numbers)."""
    for name in ("1xH200", "4xB300", "8xB300", "4xAscend910B3"):
        t = topologies.topology(name)
        assert t.peer_link == "nvlink"
        assert link_busy_s(SIZES, t, "allgather", t.num_ranks) == () == link_busy_s(SIZES, t, "rank-local", 1)


def test_on_direct_attached_pcie_the_all_gather_saves_no_link_time():
    """k = 1: every GPU's link carries each whole block in both modes, so a transfer-bound all-gather row is no
    faster than rank-local (and bound by the PCIe link); with NVLink (of 100 GB/s) it would be 4x faster."""
    t = pcie(ranks=4)
    ag, rl = Candidate(4, 1, "allgather", "mesh", 2, 1, 2), Candidate(4, 1, "rank-local", "-", 2, 1, 0)
    a, r = predict(MODEL, t, WL, ag), predict(MODEL, t, WL, rl)
    assert a.bound == "pcie" and a.step_s == pytest.approx(0.8) and r.step_s == pytest.approx(0.8)
    nv = predict(MODEL, dataclasses.replace(t, peer_link="nvlink", allgather_bus_bytes_per_s=100 * GB), WL, ag)
    assert nv.step_s == pytest.approx(0.2) and nv.bound == "h2d"
    chosen = plan(MODEL, t, WL, slots=(2,), sps=(1,)).chosen.candidate
    assert chosen.mode == "rank-local"  # a tie on the link: the cheaper plan (no landing buffers)


def test_a_shared_uplink_is_where_sharding_pays():
    """Two GPUs per uplink of 1 GB/s: rank-local pushes two whole blocks through it (1.6 s per pass), the all-gather
    over 8 GPUs its shards and the ring's peer bytes (0.2 + 0.7 = 0.9 s)."""
    t = pcie(k=2, up=GB)
    r = plan(MODEL, t, WL, slots=(2,), sps=(1,))
    assert r.chosen.candidate.label == "DP8xSP1 allgather W8 S2 R1" and r.chosen.bound == "uplink"
    assert r.chosen.step_s == pytest.approx(0.9)
    rl = next(row for row in r.rows if row.candidate.mode == "rank-local")
    assert rl.bound == "uplink" and rl.step_s == pytest.approx(1.6)


def test_through_host_memory_the_all_gather_only_buys_capacity():
    """No P2P: the all-gather moves as many bytes into each GPU as rank-local and 2W - 1 times its shards through
    DRAM. It is chosen only when rank-local's whole model per rank does not fit the host."""
    t = pcie(peer="host", mem=8 * GB)
    r = plan(MODEL, t, WL, slots=(2,), sps=(1,))
    assert r.chosen.candidate.mode == "rank-local"
    ag = next(row for row in r.rows if row.candidate.num_shards == 8)
    assert ag.bound == "host-memory" and ag.step_s == pytest.approx(8 * 15 * 0.1 / 8)  # N (2W - 1) s / 8 GB/s
    small = plan(MODEL, dataclasses.replace(t, host_bytes_per_rank=300 * MB), WL, slots=(2,), sps=(1,))
    assert small.chosen.candidate.num_shards == 8 and all(d.limiting_memory.startswith("host") for d in small.dropped)


@settings(max_examples=30, deadline=None)
@given(
    peer=st.sampled_from(("pcie", "host")),
    k=st.sampled_from((1, 2, 4)),
    w=st.sampled_from((2, 4, 8)),
    up=st.sampled_from((None, GB, 3 * GB)),
    mem=st.sampled_from((None, 5 * GB, 50 * GB)),
)
def test_the_gpu_link_carries_the_whole_block_whatever_w(peer, k, w, up, mem):
    t = pcie(peer, k, up, mem)
    ag = link_bytes(SIZES, t, "allgather", w)
    assert ag["pcie"] >= sum(SIZES.shard_bytes(1))
    rl = link_bytes(SIZES, t, "rank-local", 1)
    if peer == "host":  # nothing saved on the uplink; DRAM pays (2W - 1) / W times rank-local's bytes
        assert ag["uplink"] >= rl["uplink"] and ag["host-memory"] > rl["host-memory"]
    # and the predicted step is never below the busiest link's time
    row = predict(
        MODEL,
        t,
        WL,
        Candidate(8 // w, w, "allgather", "mesh", 2, 1, 2) if w < 8 else Candidate(1, 8, "allgather", "mesh", 2, 1, 2),
    )
    assert row.step_s >= max(s for _, s in link_busy_s(SIZES, t, "allgather", 8)) * (1 - 1e-12)


def test_named_pcie_topologies_have_sources_and_round_trip_through_json():
    assert set(pcie_topologies.PCIE_TOPOLOGY_NAMES) <= set(topologies.TOPOLOGY_NAMES)
    assert pcie_topologies.link_bytes_per_s(4) == pytest.approx(27.3e9, rel=0.01)  # 31.5 GB/s x 0.868
    for name in pcie_topologies.PCIE_TOPOLOGY_NAMES:
        t = topologies.topology(name)
        assert t.peer_link in ("pcie", "host") and t.host_memory_bytes_per_s is not None
        for field in (
            "h2d_bytes_per_s",
            "compute",
            "hbm_bytes_per_rank",
            "peer_link",
            "gpus_per_uplink",
            "host_memory_bytes_per_s",
        ):
            assert t.source(field), (name, field)
        back = topologies.topology_from_dict(topologies.topology_to_dict(t))
        assert back == t  # a file keeps the sources in their order
    with pytest.raises(ValueError, match="peer_link must be one of nvlink, pcie, host"):
        pcie(peer="ethernet")
    with pytest.raises(ValueError, match="uplink_bytes_per_s must be > 0"):
        pcie(up=0.0)


def test_what_the_policy_picks_on_the_pcie_machines():
    """Notebook 09's section 6 in short: on the L40S box (GPU pairs behind one uplink) the all-gather wins the bench
    image by saving uplink time; on the direct-attached H100 PCIe and L20 and on the RTX 4090s (no P2P) rank-local
    wins where the host holds it; on the 4090s Cosmos3-Super (124 GB) fits only sharded."""
    image = topologies.H200_IMAGE
    picks = {
        (m, t): plan(topologies.model(m), topologies.topology(t), image, slots=(2, 3, 4), sps=(1,)).chosen
        for m in ("bench", "cosmos3-super")
        for t in pcie_topologies.PCIE_TOPOLOGY_NAMES
    }
    assert picks[("bench", "8xL40S")].candidate.label == "DP8xSP1 allgather W8 S2 R1"
    for t in ("8xH100-PCIe", "8xL20", "8xRTX4090"):
        assert picks[("bench", t)].candidate.mode == "rank-local", t
    assert picks[("cosmos3-super", "8xRTX4090")].candidate.num_shards == 8
