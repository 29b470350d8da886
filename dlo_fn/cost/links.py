"""Shared links: the bytes each link a load crosses carries per pass over the blocks, and the time that takes; pure.

The three-stream simulator (:mod:`dlo_fn.plan.timeline`) runs the H2D and the all-gather streams side by side, as
if each had a link of its own. With NVLink they do. Without it (PCIe machines: L20, L40S, RTX 4090/5090, PCIe
H100) the all-gather's bytes come in through the same PCIe link as the H2D, directly from the peer GPU
(``peer_link="pcie"``) or staged through host memory (``"host"``: peer-to-peer off, as on GeForce cards); several
GPUs may share one upstream port to the host (a PCIe switch's uplink, or one GPU shared by several ranks); and
every byte that comes from or goes through host memory is a DRAM read or write. A link is a resource of its own:
the steady step is at least the time each link is busy per pass (:func:`link_busy_s`), whatever the streams'
overlap (:func:`~dlo_fn.cost.policy.predict` takes the larger).

Bytes per pass over ``B`` blocks, block ``b`` of ``n_b`` bytes, local shard ``s_b`` at shard group ``W``
(``W s_b >= n_b``: padding), ``k`` GPUs per uplink, ``N`` ranks on the host; sums over the blocks:

=============  ===================  ============================  ==========================  ======================
link           rank-local (W = 1)   allgather, ``nvlink``         allgather, ``pcie``         allgather, ``host``
=============  ===================  ============================  ==========================  ======================
GPU link       (the H2D stream)     (the H2D stream)              ``W s``                     ``W s``
uplink         ``k n``              ``k s``                       ``k s + [W > k](W - 1) s``  ``k W s``
host memory    ``N n``              ``N s``                       ``N s``                     ``N (2W - 1) s``
=============  ===================  ============================  ==========================  ======================

So into each GPU, the all-gather over PCIe brings what its shard's H2D left out: the GPU link carries the whole
block whatever ``W`` (no link time saved there, and the collective's own cost added). Sharding saves link time
only where a port is shared: on an uplink, ``k`` GPUs each copying a whole block (``k n``) against one block's
shards and, when the shard group spans several switches, the peer bytes entering the switch once on the ring
(``(W - 1) s``). Through host memory (no peer-to-peer) the uplink carries ``k W s``, as much as rank-local, and
DRAM ``2W - 1`` times the sharded H2D: the all-gather can only save host *capacity* there (``M / W`` per rank).
Each direction of a PCIe link is its own: only host-to-device bytes are summed (the all-gather's sends go the
other way). A link's rate: the GPU link's is ``h2d_bytes_per_s`` (one rank's pinned H2D), the others are fields
of the :class:`~dlo_fn.cost.topology.Topology`; a link whose rate is not given is not a limit.
"""

from __future__ import annotations

from dlo_fn.cost.topology import Topology
from dlo_fn.plan.sizes import ModelSizes

__all__ = ["LINKS", "link_bytes", "link_busy_s"]

LINKS = ("pcie", "uplink", "host-memory")


def link_bytes(sizes: ModelSizes, topology: Topology, mode: str, num_shards: int) -> dict[str, int]:
    """Bytes per pass each shared link carries (module docstring's table), for the op sequence ``mode``
    (``"rank-local"``, or ``"allgather"`` over ``num_shards > 1``); the GPU link only where the all-gather shares
    it (``pcie`` / ``host``)."""
    n_ranks = topology.num_ranks
    k = min(topology.gpus_per_uplink, n_ranks)
    per_host = min(topology.ranks_per_host or n_ranks, n_ranks)
    if mode == "rank-local" or num_shards == 1:
        n = sum(sizes.shard_bytes(1))
        return {"uplink": k * n, "host-memory": per_host * n}
    w, s = num_shards, sum(sizes.shard_bytes(num_shards))
    if topology.peer_link == "nvlink":
        return {"uplink": k * s, "host-memory": per_host * s}
    if topology.peer_link == "pcie":
        return {"pcie": w * s, "uplink": k * s + (w - 1) * s * (w > k), "host-memory": per_host * s}
    return {"pcie": w * s, "uplink": k * w * s, "host-memory": per_host * (2 * w - 1) * s}


def link_busy_s(sizes: ModelSizes, topology: Topology, mode: str, num_shards: int) -> tuple[tuple[str, float], ...]:
    """``(link, seconds)`` per pass for every link with a rate (module docstring), busiest first."""
    rates = {
        "pcie": topology.h2d_bytes_per_s,
        "uplink": topology.uplink_bytes_per_s,
        "host-memory": topology.host_memory_bytes_per_s,
    }
    busy = [
        (name, n / rates[name])
        for name, n in link_bytes(sizes, topology, mode, num_shards).items()
        if rates[name] is not None
    ]
    return tuple(sorted(busy, key=lambda x: -x[1]))
