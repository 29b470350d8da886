"""Topologies, policy models and workloads as JSON: the files ``policy --topology FILE`` reads and ``generate
--mode/--slots/--sp auto`` writes (``auto_policy.json``), and the named machines of ``policy --topology NAME``,
stored as data in ``named.json`` beside this module (written by the lab from the published numbers and
measurements it reproduces: ``benchmarks.repro.topologies.write_named``)."""

from __future__ import annotations

import functools
import json
import pathlib

from dlo_fn.cost.topology import BlockCompute, PolicyModel, Topology
from dlo_fn.plan.sizes import ModelSizes
from dlo_fn.plan.workload import Workload

NAMED_FILE = pathlib.Path(__file__).with_name("named.json")

_LINK_FIELDS = ("peer_link", "gpus_per_uplink", "uplink_bytes_per_s", "host_memory_bytes_per_s", "ranks_per_host")
_FIELDS = (
    "name",
    "num_ranks",
    "h2d_bytes_per_s",
    "allgather_bus_bytes_per_s",
    "all_to_all_bytes_per_s",
    "d2d_copy_bytes_per_s",
    "hbm_bytes_per_rank",
    "host_bytes_per_rank",
)
# A topology file's fields beyond _FIELDS: (field, required, JSON form). ``policy --help`` prints this table.
_MORE_FIELDS = (
    ("compute", True, '{"flop_per_s": x} or {"table": [[tokens, cfg_branches, seconds], ...]}'),
    ("host_s_per_block", False, '{"allgather": seconds, "rank-local": seconds} (default 0)'),
    ("host_serial", False, "true: host work on the compute stream's critical path (default false)"),
    ("step_overhead", False, "[[tokens, cfg_branches, seconds], ...]"),
    ("request_overhead", False, "[[tokens, seconds], ...]"),
    ("context_bytes", False, "int (default 0)"),
    ("framework_host_bytes", False, "int (default 0)"),
    ("sources", False, '{field: "where the number comes from"}'),
    (
        "peer_link",
        False,
        '"nvlink" (default: the all-gather on links of its own), "pcie" (P2P over the H2D\'s PCIe '
        'links) or "host" (no P2P: staged through host memory)',
    ),
    ("gpus_per_uplink", False, "int: GPUs sharing one switch uplink (default 1)"),
    ("uplink_bytes_per_s", False, "number or null: the switch uplink's rate (default null: no shared uplink)"),
    ("host_memory_bytes_per_s", False, "number or null: host memory bandwidth (default null: no limit)"),
    ("ranks_per_host", False, "int or null (default null: every rank on one host)"),
)
TOPOLOGY_FILE_FIELDS = (*((f, True, "string" if f == "name" else "number") for f in _FIELDS), *_MORE_FIELDS)


def topology_from_dict(data: dict, where: str = "topology") -> Topology:
    """A Topology from JSON-like data: the scalar fields, ``compute`` as ``{"flop_per_s": x}`` or
    ``{"table": [[tokens, cfg, s], ...]}``, optional ``host_s_per_block`` ({mode: s}), ``host_serial``,
    ``step_overhead`` ([[tokens, cfg, s], ...]), ``context_bytes``, ``framework_host_bytes``, ``sources``."""
    missing = [f for f, required, _ in TOPOLOGY_FILE_FIELDS if required and f not in data]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    unknown = set(data) - {f for f, _, _ in TOPOLOGY_FILE_FIELDS}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    comp = data["compute"]
    compute = BlockCompute(table=tuple(tuple(r) for r in comp.get("table", ())), flop_per_s=comp.get("flop_per_s"))
    host = data.get("host_s_per_block", {"allgather": 0.0, "rank-local": 0.0})
    ints = {f: int(data[f]) for f in ("num_ranks", "hbm_bytes_per_rank", "host_bytes_per_rank")}
    return Topology(
        str(data["name"]),
        ints["num_ranks"],
        float(data["h2d_bytes_per_s"]),
        float(data["allgather_bus_bytes_per_s"]),
        float(data["all_to_all_bytes_per_s"]),
        float(data["d2d_copy_bytes_per_s"]),
        compute,
        ints["hbm_bytes_per_rank"],
        ints["host_bytes_per_rank"],
        tuple(sorted(host.items())),
        bool(data.get("host_serial", False)),
        tuple(tuple(r) for r in data.get("step_overhead", ())),
        int(data.get("context_bytes", 0)),
        int(data.get("framework_host_bytes", 0)),
        tuple(data.get("sources", {}).items()),  # in the order given (a named machine: its builder's)
        tuple(tuple(r) for r in data.get("request_overhead", ())),
        str(data.get("peer_link", "nvlink")),
        int(data.get("gpus_per_uplink", 1)),
        _opt(data, "uplink_bytes_per_s", float),
        _opt(data, "host_memory_bytes_per_s", float),
        _opt(data, "ranks_per_host", int),
    )


def _opt(data: dict, key: str, kind):
    return None if data.get(key) is None else kind(data[key])


def topology_to_dict(t: Topology) -> dict:
    """The JSON form :func:`topology_from_dict` reads back (the same Topology)."""
    compute = (
        {"flop_per_s": t.compute.flop_per_s}
        if t.compute.flop_per_s is not None
        else {"table": [list(r) for r in t.compute.table]}
    )
    return {
        **{f: getattr(t, f) for f in _FIELDS},
        "compute": compute,
        "host_s_per_block": dict(t.host_s_per_block),
        "host_serial": t.host_serial,
        "step_overhead": [list(r) for r in t.step_overhead],
        "context_bytes": t.context_bytes,
        "framework_host_bytes": t.framework_host_bytes,
        "sources": dict(t.sources),
        "request_overhead": [list(r) for r in t.request_overhead],
        **{f: getattr(t, f) for f in _LINK_FIELDS},
    }


def probe_to_dict(t: Topology, m: PolicyModel, w: Workload, sps: tuple[int, ...]) -> dict:
    """What a start-up probe measured (``generate --mode/--slots/--sp auto`` writes it): the topology, the model
    as the policy sees it, the workload and the sp sizes considered; ``policy --topology FILE`` reads it."""
    return {
        "topology": topology_to_dict(t),
        "model": model_to_dict(m),
        "workload": workload_to_dict(w),
        "sps": list(sps),
    }


def model_to_dict(m: PolicyModel) -> dict:
    return {
        "name": m.sizes.name,
        "block_bytes": list(m.sizes.block_bytes),
        "resident_bytes": m.sizes.resident_bytes,
        "sizes_source": m.sizes.source,
        "stored_block_bytes": list(m.sizes.stored_block_bytes),
        "hidden_dim": m.hidden_dim,
        "dtype_bytes": m.dtype_bytes,
        "activation_bytes_per_token": m.activation_bytes_per_token,
        "num_all_to_all_per_block": m.num_all_to_all_per_block,
        "source": m.source,
        **({"tensor_block_bytes": list(m.tensor_block_bytes)} if m.tensor_block_bytes else {}),
    }


def model_from_dict(data: dict) -> PolicyModel:
    m = dict(data)
    sizes = ModelSizes(
        str(m.pop("name")),
        tuple(int(b) for b in m.pop("block_bytes")),
        int(m.pop("resident_bytes")),
        str(m.pop("sizes_source", "")),
        stored_block_bytes=tuple(int(b) for b in m.pop("stored_block_bytes", ())),
    )
    m["tensor_block_bytes"] = tuple(int(b) for b in m.get("tensor_block_bytes", ()))
    return PolicyModel(sizes, **m)


def workload_to_dict(w: Workload) -> dict:
    return {"name": w.name, "tokens": w.tokens, "num_steps": w.num_steps, "cfg_branches": w.cfg_branches}


def workload_from_dict(w: dict) -> Workload:
    return Workload(str(w["name"]), int(w["tokens"]), int(w["num_steps"]), int(w["cfg_branches"]))


def probe_from_dict(data: dict, where: str = "probe") -> tuple[Topology, PolicyModel, Workload, tuple[int, ...]]:
    """The inverse of :func:`probe_to_dict`."""
    missing = [k for k in ("topology", "model", "workload") if k not in data]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    model, workload = model_from_dict(data["model"]), workload_from_dict(data["workload"])
    sps = tuple(int(x) for x in data.get("sps", ())) or None
    return topology_from_dict(data["topology"], where=f"{where}: topology"), model, workload, sps


@functools.cache
def _named() -> dict:
    return json.loads(NAMED_FILE.read_text())


def topology_names() -> tuple[str, ...]:
    return tuple(_named()["topologies"])


def model_names() -> tuple[str, ...]:
    return tuple(_named()["models"])


def topology(name: str) -> Topology:
    """A named machine (``policy --topology NAME``)."""
    known = _named()["topologies"]
    if name not in known:
        raise ValueError(f"unknown topology {name!r}; named: {', '.join(known)} (or a FILE.json)")
    return topology_from_dict(known[name], where=f"{NAMED_FILE.name}: {name}")


def model(name: str) -> PolicyModel:
    """A named model as the policy sees it (``policy --model NAME``)."""
    known = _named()["models"]
    if name not in known:
        raise ValueError(f"unknown policy model {name!r}; known: {', '.join(known)}")
    return model_from_dict(known[name])


def workloads() -> dict[str, Workload]:
    """Every named workload, by name (``policy --workload NAME``)."""
    return {name: workload_from_dict(w) for name, w in _named()["workloads"].items()}


def workload(name: str) -> Workload:
    known = workloads()
    if name not in known:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(known)}")
    return known[name]


def named_to_json(topologies: dict, models: dict, workloads: dict) -> str:
    """The text of ``named.json`` (what :func:`topology`, :func:`model` and :func:`workload` read back)."""
    data = {
        "topologies": {n: topology_to_dict(t) for n, t in topologies.items()},
        "models": {n: model_to_dict(m) for n, m in models.items()},
        "workloads": {n: workload_to_dict(w) for n, w in workloads.items()},
    }
    return json.dumps(data, indent=1) + "\n"
