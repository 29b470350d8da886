"""Named PCIe machines for the policy: eight GPUs without NVLink, where the all-gather crosses the H2D's links
(:mod:`dlo_fn.cost.links`). Every field from a published spec or from our H200, each with its source.

==================  ========  ======  ==========  ===============  ===============  =================================
topology            PCIe      HBM     BF16 dense  peer path        GPUs per uplink  host (assumed)
==================  ========  ======  ==========  ===============  ===============  =================================
``8xL40S``          Gen4 x16  48 GB   362 TF/s    P2P over PCIe    2 (switches)     2x Xeon, 16 ch DDR5-4800, 1 TB
``8xRTX4090``       Gen4 x16  24 GB   165 TF/s    host (no P2P)    1                2x EPYC, 16 ch DDR4-3200, 512 GB
``8xH100-PCIe``     Gen5 x16  80 GB   756 TF/s    P2P over PCIe    1                2x Xeon, 16 ch DDR5-4800, 2 TB
``8xL20``           Gen4 x16  48 GB   120 TF/s    P2P over PCIe    1                2x Xeon, 16 ch DDR5-4800, 1 TB
==================  ========  ======  ==========  ===============  ===============  =================================

Rates derived the same way for every machine:

* **Link.** The PCIe rate per direction of an x16 link (Gen4: 16 GT/s x 16 lanes x 128/130 / 8 = 31.5 GB/s;
  Gen5: 63.0 GB/s, the PCI-SIG base specifications) times the fraction our H200 reaches on its Gen5 x16 link
  (pinned H2D 54.7 GB/s, :data:`dlo_fn.cost.ceilings.H200_PINNED_H2D_BYTES_PER_S`): 0.868. A shared uplink is a
  link of the same generation.
* **All-gather and all-to-all** alone: each GPU receives at its link's rate (NCCL's ring over PCIe; through host
  memory without P2P), so the bus rate is the link rate; the shared links then add the H2D's bytes on top.
* **Compute.** The dense BF16 tensor rate of the datasheet times the fraction of the H200's (989.4 TFLOP/s) that our
  measured bench block reaches on the H200 (8.9 ms on 1024^2 with CFG:
  :func:`benchmarks.repro.topologies.h200_flop_fraction`, 0.585).
* **Host memory.** The DRAM peak of the named platform (channels x transfer rate x 8 bytes): an upper bound, so the
  host-memory term it gives is a lower bound.
* **Host work per block** and framework bytes: ours measured on the H200 (as for the B300 topologies).

Sources of the datasheet numbers: NVIDIA L40S datasheet (48 GB GDDR6, PCIe Gen4 x16 64 GB/s bidirectional, BF16
tensor 362.05 TFLOPS dense / 733 with sparsity, no NVLink); NVIDIA Ada GPU architecture whitepaper (GeForce RTX 4090:
24 GB GDDR6X, PCIe Gen4 x16, BF16 tensor with FP32 accumulate 165.2 TFLOPS dense); NVIDIA H100 PCIe product brief
PB-11133-001 and H100 datasheet (80 GB HBM2e, PCIe Gen5 128 GB/s, BF16 tensor 1,513 TFLOPS with sparsity, 756
dense; NVLink only through an optional bridge, left out here); NVIDIA L20 (48 GB GDDR6, PCIe Gen4 x16, BF16 tensor
119.5 TFLOPS dense). GeForce drivers expose no peer-to-peer between RTX 4090s (the patched open kernel modules of
tinygrad/open-gpu-kernel-modules exist to enable it), so NCCL stages their traffic through host memory. The uplink
layout of the L40S machine (a PCIe switch per pair of GPUs, one x16 uplink each) and every host's DRAM and RAM are
assumptions of a typical 8-GPU 4U server, marked as such in ``sources``; pass a JSON topology
(``python -m dlo_fn policy --topology FILE.json``) for a machine that differs.
"""

from __future__ import annotations

from dlo_fn.cost import ceilings
from dlo_fn.cost.calibration import FRAMEWORK_HOST_BYTES_PER_RANK
from dlo_fn.cost.topology import BlockCompute, Topology
from dlo_fn.plan.sizes import GIB

__all__ = ["PCIE_TOPOLOGY_NAMES", "pcie_topology", "link_bytes_per_s", "H200_BF16_PEAK_FLOP_PER_S"]

PCIE_TOPOLOGY_NAMES = ("8xL40S", "8xRTX4090", "8xH100-PCIe", "8xL20")
PCIE_RAW_BYTES_PER_S = {4: 16e9 * 16 * 128 / 130 / 8, 5: 32e9 * 16 * 128 / 130 / 8}  # per direction, x16
H200_BF16_PEAK_FLOP_PER_S = 989.4e12  # NVIDIA H200 datasheet: BF16 tensor 1,979 TFLOPS with sparsity


def link_bytes_per_s(gen: int) -> float:
    """An x16 link's pinned H2D rate: the raw rate times the fraction our H200 reaches on Gen5 (module doc)."""
    return PCIE_RAW_BYTES_PER_S[gen] * ceilings.H200_PINNED_H2D_BYTES_PER_S / PCIE_RAW_BYTES_PER_S[5]


def _ddr_bytes_per_s(channels: int, mega_transfers: int) -> float:
    return channels * mega_transfers * 1e6 * 8


# name: (PCIe gen, HBM GB, dense BF16 TFLOP/s, peer link, GPUs per uplink, DRAM (channels, MT/s), host RAM GB, what)
_SPECS = {
    "8xL40S": (4, 48, 362.05, "pcie", 2, (16, 4800), 1024, "NVIDIA L40S datasheet"),
    "8xRTX4090": (4, 24, 165.2, "host", 1, (16, 3200), 512, "NVIDIA Ada architecture whitepaper (RTX 4090)"),
    "8xH100-PCIe": (5, 80, 756.0, "pcie", 1, (16, 4800), 2048, "NVIDIA H100 PCIe product brief / datasheet"),
    "8xL20": (4, 48, 119.5, "pcie", 1, (16, 4800), 1024, "NVIDIA L20 specifications"),
}


def pcie_topology(name: str, flop_fraction: float) -> Topology:
    """The named machine (module docstring); ``flop_fraction``: of a datasheet rate, what a block reaches
    (:func:`benchmarks.repro.topologies.h200_flop_fraction`)."""
    if name not in _SPECS:
        raise ValueError(f"unknown PCIe topology {name!r}; named: {', '.join(PCIE_TOPOLOGY_NAMES)}")
    gen, hbm_gb, tflops, peer, per_uplink, (channels, mts), host_gb, sheet = _SPECS[name]
    link = link_bytes_per_s(gen)
    frac = flop_fraction
    dram = _ddr_bytes_per_s(channels, mts)
    link_src = (
        f"PCIe Gen{gen} x16: {PCIE_RAW_BYTES_PER_S[gen] / 1e9:.1f} GB/s per direction x "
        f"{link / PCIE_RAW_BYTES_PER_S[gen]:.3f} (the H200's measured pinned H2D over its Gen5 x16 rate)"
    )
    peer_src = {
        "pcie": "peer-to-peer over PCIe (no NVLink on this card)",
        "host": "no peer-to-peer on GeForce drivers: NCCL stages it through host memory",
    }[peer]
    return Topology(
        name,
        8,
        link,
        link,
        link,
        link,
        BlockCompute(flop_per_s=tflops * 1e12 * frac),
        hbm_gb * 10**9,
        host_gb * GIB // 8,
        (("allgather", 176e-6), ("rank-local", 48e-6)),
        False,
        (),
        0,
        FRAMEWORK_HOST_BYTES_PER_RANK,
        (
            ("h2d_bytes_per_s", link_src),
            ("allgather_bus_bytes_per_s", "each GPU receives at its link's rate (module docstring)"),
            ("all_to_all_bytes_per_s", "the link rate, as the all-gather"),
            ("d2d_copy_bytes_per_s", "unused at W > 1; the link rate"),
            (
                "compute",
                f"{sheet}: BF16 dense {tflops:g} TFLOPS x {frac:.3f} (our bench block's fraction of the "
                f"H200's 989.4 on the H200)",
            ),
            ("hbm_bytes_per_rank", f"{sheet}: {hbm_gb} GB"),
            ("host_bytes_per_rank", f"assumed {host_gb} GiB host RAM / 8"),
            ("host_s_per_block", "README H200 measurement of our executor"),
            ("framework_host_bytes", "repro.calibration.FRAMEWORK_HOST_BYTES_PER_RANK"),
            ("peer_link", peer_src),
            (
                "gpus_per_uplink",
                "assumed: a PCIe switch per pair of GPUs, one x16 uplink each"
                if per_uplink > 1
                else "assumed: every GPU on its own root port (x16 each)",
            ),
            ("uplink_bytes_per_s", link_src if per_uplink > 1 else "no shared uplink"),
            (
                "host_memory_bytes_per_s",
                f"assumed 2 sockets, {channels} channels of DDR at {mts} MT/s: {dram / 1e9:.0f} GB/s peak",
            ),
            ("ranks_per_host", "one host"),
        ),
        (),
        peer,
        per_uplink,
        link if per_uplink > 1 else None,
        dram,
        8,
    )
