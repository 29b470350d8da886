"""Named topologies and models for the policy (:mod:`dlo_fn.cost.policy`): the published machines and our H200.

Every field of every :class:`~dlo_fn.cost.topology.Topology` here names its source in ``sources``. Constants are
fitted only where the B300 notebook (07) and the wave model (05) already fit them:

===================  ============================================================================================
topology             fields and where they come from
===================  ============================================================================================
``1xH200``           measured here: pinned H2D, device copy (``repro.ceilings``), block compute (the ``bench``
                     config's own measured block, ``models.configs``), per-step work outside the blocks (the
                     engine's step-boundary gap on the compute stream, and its per-request host work, from the
                     serving-path profile ``serve_step_profile_h200.json``), host work per block (docs/performance.md),
                     memory (the run's machine line)
``4xB300``           ``repro.b300``'s three fitted constants (H2D, NVLink all-gather, effective FLOP rate) and its
                     NVLink all-to-all bus rate (not fitted: NCCL's per-link rate x 18 links)
``8xB300``           the same B300 constants, 8 ranks (the MiniMax-H3 node)
``8xL40S`` ...        PCIe machines (the all-gather crosses the H2D's links): :mod:`benchmarks.repro.pcie_topologies`
``4xAscend910B3``    the published Nano DP4 split (``repro.waves_tables.reference_costs``): compute per block
                     ``T_hsdp / B``, HCCL per block, host (stream switching + dispatch) per block, serial with
                     compute; H2D 25 GB/s (assumed, shown not to matter)
===================  ============================================================================================

MiniMax-H3's architecture is not published. Its model here is the Cosmos3-Super architecture (128 blocks,
hidden 5632, the only published DiT of that class in this project) holding MiniMax's weight bytes, and those
bytes are fitted the way ``B300_PINNED_H2D_BYTES_PER_S`` is: the rank-local DP1xSP8 wave copies the whole model
per step on every rank, so ``M = beta_h x wave / steps``. Its per-block compute is fitted the way
``B300_EFFECTIVE_FLOP_PER_S`` is: the rank-local DP8xSP1 wave is one request per GPU, compute bound. Neither
number can then validate anything (:data:`MINIMAX_FITS`).
"""

from __future__ import annotations

import json
import pathlib
import statistics

from benchmarks.repro import b300, minimax, pcie_topologies
from benchmarks.repro.data import DATA_DIR
from benchmarks.repro.published import MODELS, published
from benchmarks.repro.waves_tables import NANO_BLOCKS, SHARD_H2D_BYTES_PER_S, reference_costs
from dlo_fn.cost import ceilings, topology_file
from dlo_fn.cost.calibration import DEVICE_CONTEXT_BYTES, FRAMEWORK_HOST_BYTES_PER_RANK
from dlo_fn.cost.topology import BlockCompute, PolicyModel, Topology, block_flops
from dlo_fn.cost.topology_file import (  # noqa: F401 (the file forms, for the lab's callers)
    TOPOLOGY_FILE_FIELDS,
    probe_from_dict,
    probe_to_dict,
    topology_from_dict,
    topology_to_dict,
)
from dlo_fn.models import CONFIGS, tokens_for
from dlo_fn.models.specs import config_spec
from dlo_fn.plan.sizes import GIB, ModelSizes
from dlo_fn.plan.workload import Workload

__all__ = [
    "TOPOLOGY_NAMES",
    "MODEL_NAMES",
    "topology",
    "model",
    "workload",
    "h200_topology",
    "bench_model",
    "MINIMAX_STEPS",
    "MINIMAX_WORKLOAD",
    "MINIMAX_FITS",
    "minimax_fits",
    "topology_from_dict",
    "H200_IMAGE",
    "H200_VIDEO",
    "NANO_WORKLOAD",
    "topology_to_dict",
    "probe_to_dict",
    "probe_from_dict",
    "workloads",
    "TOPOLOGY_FILE_FIELDS",
]

BENCH = CONFIGS["bench"]
SUPER = CONFIGS["cosmos3-super"]
NANO = CONFIGS["cosmos3-nano"]

# The bench config's block on the H200, CFG: 8.9 / 33.5 ms (its source).
BENCH_BLOCK_S = {"image": 8.9e-3, "video": 33.5e-3}
H200_IMAGE = Workload("image 1024^2 CFG, 24 steps", tokens_for(BENCH, 1024, 1024, 1), 24, 2)
H200_VIDEO = Workload("video 832x480x29 CFG, 24 steps", tokens_for(BENCH, 480, 832, 29), 24, 2)
H200_GPU_BYTES = 150_109_880_320  # gpu_memory_bytes on the R-sweep's machine line
H200_HOST_BYTES = int(125.9 * GIB)  # "125.9 GiB RAM" on the same line
# bench step's measured peak device memory of ours (rank-local) on the image, 2.8 GB (an earlier commit of
# figures/data/bench_step_nvidia-h200.json), minus its 2 slots.
H200_PEAK_IMAGE_BYTES, H200_SLOTS_BYTES = 2.8e9, 1.124e9

MINIMAX_STEPS = 50  # requested steps (49 scheduler updates), as B300's waves count 50
# 124 video frames; the Super VAE takes 1 + 4k frames, so 125.
MINIMAX_WORKLOAD = Workload("minimax t2va 768x1344x124", tokens_for(SUPER, 768, 1344, 125), MINIMAX_STEPS, 2)
NANO_WORKLOAD = Workload("nano 832x480x29 CFG", tokens_for(NANO, 480, 832, 29), 1, 2)


def bench_model() -> PolicyModel:
    sizes = ModelSizes.from_spec(config_spec("bench"))
    act = (H200_PEAK_IMAGE_BYTES - H200_SLOTS_BYTES - sizes.resident_bytes) / H200_IMAGE.step_tokens
    return PolicyModel(
        sizes,
        BENCH.hidden_dim,
        2,
        int(act),
        source="models.specs.config_spec('bench') (24 blocks of 0.56 GB); activations per token: "
        "bench step's measured peak (image, rank-local) - 2 slots - resident, / step tokens",
    )


SERVE_PROFILE = DATA_DIR / "serve_step_profile_h200.json"


def h200_engine_overheads() -> tuple[float, float]:
    """``(o, q)`` of the engine on the H200 image (the 2-slot rank-local wave of the serving-path profile): the
    median step-boundary gap on the compute stream (head, sampler, embed between block 23 and block 0), and the
    per-request host work (``init_state`` + decode and hash)."""
    run = json.loads(SERVE_PROFILE.read_text())["image"]["rank-local S2"]
    gap_s = statistics.median(run["timeline"]["step_boundary_compute_gap_ms"]) / 1e3
    return gap_s, run["phases"]["init"] + run["phases"]["finish_host"]


def h200_topology() -> Topology:
    m = bench_model()
    overhead, per_request = h200_engine_overheads()
    return Topology(
        "1xH200",
        1,
        ceilings.H200_PINNED_H2D_BYTES_PER_S,
        ceilings.H200_D2D_COPY_BYTES_PER_S,
        ceilings.H200_D2D_COPY_BYTES_PER_S,
        ceilings.H200_D2D_COPY_BYTES_PER_S,
        BlockCompute(
            table=((H200_IMAGE.tokens, 2, BENCH_BLOCK_S["image"]), (H200_VIDEO.tokens, 2, BENCH_BLOCK_S["video"]))
        ),
        H200_GPU_BYTES,
        H200_HOST_BYTES,
        (("allgather", 176e-6), ("rank-local", 48e-6)),
        False,
        ((H200_IMAGE.tokens, 2, overhead),),
        0,
        0,
        (
            ("h2d_bytes_per_s", "repro.ceilings: pinned H2D 54.4-55.0 GB/s (DESIGN.md 6)"),
            ("allgather_bus_bytes_per_s", "one rank: no collective; set to the device copy"),
            ("all_to_all_bytes_per_s", "one rank: no SP; set to the device copy"),
            ("d2d_copy_bytes_per_s", "repro.ceilings: 4.2 TB/s read+write / 2"),
            ("compute", "models.configs 'bench' source: one block 8.9 ms (1024^2) / 33.5 ms (832x480x29), CFG"),
            ("hbm_bytes_per_rank", "gpu_memory_bytes, figures/data/waves_r_sweep_h200_steps24.csv"),
            ("host_bytes_per_rank", "125.9 GiB RAM, the same machine line"),
            (
                "host_s_per_block",
                "docs/performance.md: executor host work 176 us (allgather) / 48 us (rank-local) per block",
            ),
            (
                "step_overhead",
                f"{SERVE_PROFILE.name}: the engine's step-boundary gap, median of 23, "
                f"{1e3 * overhead:.2f} ms (1024^2, 2 slots)",
            ),
            ("request_overhead", f"{SERVE_PROFILE.name}: init_state + decode and hash, {1e3 * per_request:.1f} ms"),
            ("model", m.source),
        ),
        ((H200_IMAGE.tokens, per_request),),
    )


def h200_flop_fraction() -> float:
    """The fraction of the H200's dense BF16 peak our bench block reaches (1024^2 with CFG, measured 8.9 ms)."""
    m, w = bench_model(), H200_IMAGE
    return block_flops(m, w.tokens, w.cfg_branches) / BENCH_BLOCK_S["image"] / pcie_topologies.H200_BF16_PEAK_FLOP_PER_S


def _b300(num_ranks: int, name: str, compute: BlockCompute, host_per_rank: int) -> Topology:
    nv, a2a = b300.B300_NVLINK_ALLGATHER_BYTES_PER_S, b300.B300_NVLINK_ALL_TO_ALL_BYTES_PER_S
    return Topology(
        name,
        num_ranks,
        b300.B300_PINNED_H2D_BYTES_PER_S,
        nv,
        a2a,
        ceilings.H200_D2D_COPY_BYTES_PER_S,
        compute,
        288 * 10**9,
        host_per_rank,
        (("allgather", 176e-6), ("rank-local", 48e-6)),
        True,
        (),
        0,
        FRAMEWORK_HOST_BYTES_PER_RANK,
        (
            ("h2d_bytes_per_s", "repro.b300.B300_PINNED_H2D_BYTES_PER_S (fitted: b300.t2i.dlo_noag_dp4.wave_s)"),
            ("allgather_bus_bytes_per_s", "repro.b300.B300_NVLINK_ALLGATHER_BYTES_PER_S (fitted: b300.t2i.hsdp_usp4)"),
            (
                "all_to_all_bytes_per_s",
                "repro.b300.B300_NVLINK_ALL_TO_ALL_BYTES_PER_S (not fitted: NCCL's NVLink 5 "
                "bus rate, 18 links x 40.1 GB/s, SM100_NVLINK_BW in nccl src/graph/topo.h)",
            ),
            ("d2d_copy_bytes_per_s", "H200's measured device copy (only used at W = 1)"),
            ("compute", "see the model: B300_EFFECTIVE_FLOP_PER_S through repro.b300.step_costs, or the MiniMax fit"),
            ("hbm_bytes_per_rank", "NVIDIA B300 datasheet: 288 GB HBM3e"),
            ("host_bytes_per_rank", "assumed 2 TB host RAM / ranks (the published PSS of 532 GiB fits)"),
            (
                "host_s_per_block",
                "the H200 measurement of our executor (no B300 measurement); serial with "
                "compute as the reference's host work is on Ascend (enforce_eager)",
            ),
            ("framework_host_bytes", "repro.calibration.FRAMEWORK_HOST_BYTES_PER_RANK"),
        ),
    )


def _super_compute() -> BlockCompute:
    """Per-block compute of Super at each published workload: ``repro.b300.step_costs`` (fitted FLOP rate)."""
    rows = {(w.tokens, 2, b300.step_costs(w.tokens).compute_s / SUPER.num_blocks) for w in b300.WORKLOADS.values()}
    return BlockCompute(table=tuple(sorted(rows)))


def super_model() -> PolicyModel:
    blocks = ModelSizes.uniform("cosmos3-super", SUPER.num_blocks * b300.block_bytes(SUPER), SUPER.num_blocks)
    return PolicyModel(blocks, SUPER.hidden_dim, source="repro.b300.block_bytes(cosmos3-super) x 128")


def nano_model() -> PolicyModel:
    p = MODELS["cosmos3-nano"]
    return PolicyModel(
        ModelSizes.uniform("cosmos3-nano", p.checkpoint_bytes, p.num_blocks), NANO.hidden_dim, source=p.source
    )


def minimax_fits() -> dict[str, tuple[float, str]]:
    """name -> (value, the published number it was fitted to): MiniMax-H3's bytes and per-block compute."""
    cases = minimax.load_cases()
    rl18 = minimax.route(cases, "t2va", "ranklocal", 1, 8, pool_soak=False).p50_s
    rl81 = minimax.route(cases, "t2va", "ranklocal", 8, 1, pool_soak=False).p50_s
    weight = b300.B300_PINNED_H2D_BYTES_PER_S * rl18 / MINIMAX_STEPS
    return {
        "MINIMAX_WEIGHT_BYTES": (weight, "rank-local DP1xSP8 T2VA wave P50 (every rank copies M per step)"),
        "MINIMAX_BLOCK_COMPUTE_S": (
            rl81 / MINIMAX_STEPS / SUPER.num_blocks,
            "rank-local DP8xSP1 T2VA wave P50 (one request per GPU, compute bound)",
        ),
    }


MINIMAX_FITS = ("MINIMAX_WEIGHT_BYTES", "MINIMAX_BLOCK_COMPUTE_S")


def minimax_model() -> PolicyModel:
    weight = minimax_fits()["MINIMAX_WEIGHT_BYTES"][0]
    return PolicyModel(
        ModelSizes.uniform("minimax-h3", int(weight), SUPER.num_blocks),
        SUPER.hidden_dim,
        source="Cosmos3-Super architecture holding MiniMax's fitted weight bytes",
    )


def _ascend() -> Topology:
    costs = reference_costs()
    shard = MODELS["cosmos3-nano"].checkpoint_bytes / NANO_BLOCKS / 4
    bus = 3 * shard / costs.allgather_s  # ((W - 1) / W) W s / busbw = a  =>  busbw = (W - 1) s / a
    dispatch = published("perf.nano.allgather_overhead.python_dispatch").value / 1e3 / NANO_BLOCKS
    return Topology(
        "4xAscend910B3",
        4,
        SHARD_H2D_BYTES_PER_S,
        bus,
        bus,
        bus,
        BlockCompute(table=((NANO_WORKLOAD.tokens, 2, costs.compute_s),)),
        64 * 10**9,
        2 * 10**12 // 4,
        (("allgather", costs.host_s), ("rank-local", dispatch)),
        True,
        (),
        DEVICE_CONTEXT_BYTES,
        FRAMEWORK_HOST_BYTES_PER_RANK,
        (
            ("h2d_bytes_per_s", "assumed 25 GB/s (repro.waves_tables.SHARD_H2D_BYTES_PER_S; hidden for > 10 GB/s)"),
            ("allgather_bus_bytes_per_s", "perf.nano.allgather_overhead.hccl: 10 ms per step over 72 blocks"),
            ("all_to_all_bytes_per_s", "HCCS, taken equal to the all-gather rate (no published a2a)"),
            ("d2d_copy_bytes_per_s", "unused (W = 4)"),
            ("compute", "perf.nano.hsdp_sp.ms_per_step / 72 (repro.wave_model: B c = T_hsdp)"),
            ("hbm_bytes_per_rank", "Ascend 910B3: 64 GB HBM"),
            ("host_bytes_per_rank", "2 TB host / 4 (plan.memory.host_capacity's default host)"),
            (
                "host_s_per_block",
                "allgather: (stream switching + Python dispatch) / 72, perf.nano.allgather_overhead; "
                "rank-local: the Python dispatch part only (assumed: no collective to switch to)",
            ),
            ("context_bytes", "repro.calibration.DEVICE_CONTEXT_BYTES (fitted: hbm.nano_dp4.idle)"),
            ("framework_host_bytes", "repro.calibration.FRAMEWORK_HOST_BYTES_PER_RANK"),
        ),
    )


def topology(name: str) -> Topology:
    if name == "1xH200":
        return h200_topology()
    if name == "4xB300":
        return _b300(4, "4xB300", _super_compute(), 2 * 10**12 // 4)
    if name == "8xB300":
        fit = minimax_fits()["MINIMAX_BLOCK_COMPUTE_S"][0]
        return _b300(8, "8xB300", BlockCompute(table=((MINIMAX_WORKLOAD.tokens, 2, fit),)), 2 * 10**12 // 8)
    if name == "4xAscend910B3":
        return _ascend()
    if name in pcie_topologies.PCIE_TOPOLOGY_NAMES:
        return pcie_topologies.pcie_topology(name, h200_flop_fraction())
    raise ValueError(f"unknown topology {name!r}; named: {', '.join(TOPOLOGY_NAMES)} (or a FILE.json)")


def model(name: str) -> PolicyModel:
    makers = {
        "bench": bench_model,
        "cosmos3-super": super_model,
        "cosmos3-nano": nano_model,
        "minimax-h3": minimax_model,
    }
    if name not in makers:
        raise ValueError(f"unknown policy model {name!r}; known: {', '.join(makers)}")
    return makers[name]()


def workloads() -> dict[str, Workload]:
    """Every named workload, by name (``policy --workload NAME``)."""
    return {w.name: w for w in (H200_IMAGE, H200_VIDEO, MINIMAX_WORKLOAD, NANO_WORKLOAD, *b300.WORKLOADS.values())}


def workload(name: str) -> Workload:
    known = workloads()
    if name not in known:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(known)}")
    return known[name]


TOPOLOGY_NAMES = ("1xH200", "4xB300", "8xB300", "4xAscend910B3", *pcie_topologies.PCIE_TOPOLOGY_NAMES)
MODEL_NAMES = ("bench", "cosmos3-super", "cosmos3-nano", "minimax-h3")


def write_named(path=None) -> pathlib.Path:
    """Write the named topologies, models and workloads that the library's ``policy`` reads
    (``dlo_fn/cost/named.json``) from the builders above; byte-stable."""
    path = pathlib.Path(path or topology_file.NAMED_FILE)
    text = topology_file.named_to_json(
        {n: topology(n) for n in TOPOLOGY_NAMES}, {n: model(n) for n in MODEL_NAMES}, workloads()
    )
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path
