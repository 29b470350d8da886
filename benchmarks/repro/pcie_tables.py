"""Tables for notebook 09's PCIe section: the named PCIe machines (:mod:`benchmarks.repro.pcie_topologies`), what the
policy picks there with the shared links (:mod:`dlo_fn.cost.links`) and what it would pick with the links taken as
independent (the NVLink assumption), and what can be checked on our H200: W gloo ranks sharing its one link
(``figures/data/allgather_host_nvidia-h200.json``, gloo_two_ranks). Every number computed here."""

from __future__ import annotations

import dataclasses
import json
import statistics

from benchmarks.repro import topologies
from benchmarks.repro.data import DATA_DIR
from benchmarks.repro.pcie_topologies import PCIE_TOPOLOGY_NAMES
from dlo_fn.cost import ceilings
from dlo_fn.cost.links import link_busy_s
from dlo_fn.cost.policy import Candidate, plan, predict
from dlo_fn.cost.topology import Topology
from dlo_fn.plan.sizes import ModelSizes

__all__ = ["independent_links", "machine_rows", "choice_rows", "route_rows", "h200_gloo_rows", "link_share_rows"]

ALLGATHER_HOST = DATA_DIR / "allgather_host_nvidia-h200.json"
LINK_SHARE = DATA_DIR / "link_share_nvidia-h200.json"  # python -m benchmarks bench link-share (one H200)


def independent_links(t: Topology) -> Topology:
    """The same machine with the links taken as independent (the model before shared links: NVLink's)."""
    return dataclasses.replace(
        t,
        name=f"{t.name} (independent links)",
        peer_link="nvlink",
        gpus_per_uplink=1,
        uplink_bytes_per_s=None,
        host_memory_bytes_per_s=None,
    )


def machine_rows() -> list[dict]:
    rows = []
    for name in PCIE_TOPOLOGY_NAMES:
        t = topologies.topology(name)
        rows.append(
            {
                "topology": name,
                "link_GB_s": round(t.h2d_bytes_per_s / 1e9, 1),
                "peer": t.peer_link,
                "gpus_per_uplink": t.gpus_per_uplink,
                "host_memory_GB_s": round(t.host_memory_bytes_per_s / 1e9),
                "hbm_GB": t.hbm_bytes_per_rank // 10**9,
                "host_GB_per_rank": round(t.host_bytes_per_rank / 1e9),
                "effective_TFLOP_s": round(t.compute.flop_per_s / 1e12),
            }
        )
    return rows


def choice_rows(model: str = "bench", workload=topologies.H200_IMAGE, objective: str = "throughput") -> list[dict]:
    """Per machine: the policy's choice with shared links; its choice with independent links, and what that plan
    does on the machine (the shared-link prediction of it)."""
    m, rows = topologies.model(model), []
    for name in PCIE_TOPOLOGY_NAMES:
        t = topologies.topology(name)
        kw = dict(slots=(2, 3, 4), sps=(1,) if objective == "throughput" else None, objective=objective)
        new, old = plan(m, t, workload, **kw).chosen, plan(m, independent_links(t), workload, **kw).chosen
        real = predict(m, t, workload, old.candidate)
        rows.append(
            {
                "topology": name,
                "shared_links_choice": new.candidate.label,
                "bound": new.bound,
                "outputs_per_h": round(3600 * new.outputs_per_s, 1),
                "wave_s": round(new.wave_latency_s, 2),
                "independent_links_choice": old.candidate.label,
                "it_predicted_per_h": round(3600 * old.outputs_per_s, 1),
                "it_gets_per_h": round(3600 * real.outputs_per_s, 1),
                "its_wave_s": round(real.wave_latency_s, 2),
                "its_bound": real.bound,
            }
        )
    return rows


ROUTES = ((8, 1, "rank-local"), (8, 1, "allgather"), (1, 8, "rank-local"), (1, 8, "allgather"))


def route_rows(model: str = "bench", workload=topologies.H200_IMAGE) -> list[dict]:
    """DP8 and DP1xSP8, rank-local and the all-gather over all 8 GPUs: the step each machine gives, with the
    links independent and shared, and the bound."""
    m, rows = topologies.model(model), []
    for name in PCIE_TOPOLOGY_NAMES:
        t = topologies.topology(name)
        for dp, sp, mode in ROUTES:
            c = (
                Candidate(dp, sp, "rank-local", "-", 2, 1, 0)
                if mode == "rank-local"
                else Candidate(dp, sp, "allgather", "mesh", 2, 1, 2)
            )
            shared, alone = predict(m, t, workload, c), predict(m, independent_links(t), workload, c)
            rows.append(
                {
                    "topology": name,
                    "plan": c.label,
                    "independent_step_ms": round(1e3 * alone.step_s, 1),
                    "independent_bound": alone.bound,
                    "shared_step_ms": round(1e3 * shared.step_s, 1),
                    "shared_bound": shared.bound,
                }
            )
    return rows


def h200_gloo_rows() -> list[dict]:
    """Two gloo ranks sharing the H200 (bench-narrow, 24 blocks, shards of 2 MB): each all-gather crosses host
    memory and the one PCIe link the ranks' H2D use. Per block, the measured collective (every run, both ranks,
    median) beside the time its bytes hold the shared link (the ``host`` path: ``k W s`` at the H200's pinned rate,
    ``k = W = 2`` ranks behind one link)."""
    data = json.loads(ALLGATHER_HOST.read_text())
    gloo = [r["gloo_two_ranks"] for r in data["runs"]]
    g0 = gloo[0]
    w, shard, blocks = g0["world_size"], g0["shard_bytes"], g0["num_blocks"]
    sizes = ModelSizes("bench-narrow", (w * shard,) * blocks, 0)
    t = Topology(
        "H200 shared by 2 gloo ranks",
        w,
        ceilings.H200_PINNED_H2D_BYTES_PER_S,
        1.0,
        1.0,
        1.0,
        topologies.h200_topology().compute,
        10**11,
        10**11,
        peer_link="host",
        gpus_per_uplink=w,
        uplink_bytes_per_s=ceilings.H200_PINNED_H2D_BYTES_PER_S,
    )
    link = dict(link_busy_s(sizes, t, "allgather", w))["uplink"] / blocks
    rows = []
    for variant in ("torch-events", "driver"):
        measured = statistics.median(b[variant]["collective_call_us_per_block"] for g in gloo for b in g["by_rank"])
        rows.append(
            {
                "variant": variant,
                "shard_MB": round(shard / 1e6, 2),
                "measured_collective_us_per_block": round(measured),
                "shared_link_us_per_block": round(1e6 * link),
                "collective_over_link": round(measured / (1e6 * link), 1),
                "exchange_GB_s": round((w - 1) * shard / measured / 1e3, 2),
            }
        )
    return rows


def link_share_rows(path=LINK_SHARE) -> list[dict]:
    """W gloo ranks sharing one device, each loading B-byte blocks as the allgather program does
    (:mod:`benchmarks.bench.link_share`): per block, the measured H2D of the shards and the whole load (H2D then
    gloo's all-gather) beside what :mod:`dlo_fn.cost.links` predicts for them (the shared link, and the busiest
    link of the ``host`` path)."""
    import pathlib

    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is not there yet: run `python -m benchmarks bench link-share --out {path.name}` "
            "on the machine (one GPU) and commit it"
        )
    data = json.loads(path.read_text())
    ms = lambda x: round(1e3 * x, 2)  # noqa: E731
    return [
        {
            "W": r["world_size"],
            "shard_MB": round(r["shard_bytes"] / 1e6, 1),
            "h2d_ms": ms(r["h2d_s"]),
            "predicted_h2d_ms": ms(r["predicted_h2d_s"]),
            "independent_h2d_ms": ms(r["independent_s"]),
            "h2d_over_predicted": round(r["h2d_over_predicted"], 2),
            "load_ms": ms(r["load_s"]),
            "predicted_load_ms": ms(r["predicted_load_s"]),
            "busiest_link": r["predicted_load_link"],
            "load_over_predicted": round(r["load_over_predicted"], 2),
            "exact": r["exact"],
        }
        for r in data["rows"]
    ]
