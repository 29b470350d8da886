"""`python -m dlo_fn policy`: rank every (dp, sp, mode, shard group, slots, R, load group) of a model on a topology.

``--topology`` is a named machine (see below: every field with its source, :mod:`dlo_fn.repro.topologies` and
:mod:`dlo_fn.repro.pcie_topologies`) or a JSON file with the same fields
(:func:`dlo_fn.repro.topologies.topology_from_dict`), or the ``auto_policy.json`` that ``generate`` writes under
``--out`` with ``--mode/--slots/--sp auto`` (the measured topology with its model, workload and sp sizes). Prints
the ranked table (the chosen plan first), the sources
of the topology's fields, and one line saying why the choice won and what came second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

from dlo_fn.cli import HelpFormatter


# Names and schema as --help prints them (tests/test_policy_cli.py checks them against repro.topologies).
TOPOLOGIES = (
    ("1xH200", "one H200 SXM, measured here (PCIe Gen5 x16)"),
    ("4xB300", "4 B300 SXM6, NVLink 5 (fitted to the published Super rows)"),
    ("8xB300", "8 B300 SXM6, NVLink 5 (the MiniMax-H3 node)"),
    ("4xAscend910B3", "4 Ascend 910B3, HCCS (the published Nano DP4 split)"),
    ("8xL40S", "PCIe Gen4, P2P over PCIe, a switch uplink per GPU pair"),
    ("8xRTX4090", "PCIe Gen4, no P2P: the all-gather goes through host memory"),
    ("8xH100-PCIe", "PCIe Gen5, P2P over PCIe, no NVLink bridge"),
    ("8xL20", "PCIe Gen4, P2P over PCIe"),
)
WORKLOADS = ("image 1024^2 CFG, 24 steps", "video 832x480x29 CFG, 24 steps", "minimax t2va 768x1344x124",
             "nano 832x480x29 CFG", "t2i 1024^2", "480p 29f", "480p 121f", "480p 125f", "480p 241f", "480p 245f",
             "720p 121f", "720p 241f")
JSON_SCHEMA = """\
a topology file (JSON; bytes and seconds; optional fields default as shown):
  {"name": str, "num_ranks": int, "h2d_bytes_per_s": float (one rank's pinned H2D, its GPU link),
   "allgather_bus_bytes_per_s": float, "all_to_all_bytes_per_s": float, "d2d_copy_bytes_per_s": float,
   "hbm_bytes_per_rank": int, "host_bytes_per_rank": int,
   "compute": {"flop_per_s": float} or {"table": [[tokens, cfg_branches, s_per_block], ...]},
   "host_s_per_block": {"allgather": s, "rank-local": s} (0), "host_serial": bool (false),
   "step_overhead": [[tokens, cfg_branches, s], ...] ([]), "request_overhead": [[tokens, s], ...] ([]),
   "context_bytes": int (0), "framework_host_bytes": int (0), "sources": {field: str} ({}),
   "peer_link": "nvlink" | "pcie" | "host" ("nvlink": the all-gather on links of its own; "pcie": P2P over
                the H2D's PCIe links; "host": no P2P, staged through host memory),
   "gpus_per_uplink": int (1), "uplink_bytes_per_s": float or null (null: no shared uplink),
   "host_memory_bytes_per_s": float or null (null: no limit), "ranks_per_host": int or null (all)}
or the auto_policy.json a generate --out holds: {"topology": {...}, "model": {...}, "workload": {...}, "sps": [...]}"""


def _epilog() -> str:
    width = max(len(n) for n, _ in TOPOLOGIES)
    tops = "\n".join(f"  {n:<{width}}  {what}" for n, what in TOPOLOGIES)
    return (f"named topologies:\n{tops}\n\nnamed workloads (--workload):\n"
            + "\n".join(f"  {w}" for w in WORKLOADS) + f"\n\n{JSON_SCHEMA}")


def register(subparsers) -> None:
    p = subparsers.add_parser("policy", help="rank dp x sp, all-gather vs rank-local, slots and R on a topology",
                              description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
                              epilog=_epilog())
    p.add_argument("--model", default="bench", help="bench, cosmos3-super, cosmos3-nano, minimax-h3")
    p.add_argument("--world", type=int, default=None, help="ranks (default: the topology's)")
    p.add_argument("--topology", default="1xH200", help="a named topology (below), FILE.json (schema below), or the "
                   "auto_policy.json of a generate --out (its model and workload too)")
    p.add_argument("--workload", default=None, help="a named workload (default: the topology's own)")
    p.add_argument("--objective", choices=("throughput", "latency"), default="throughput")
    p.add_argument("--slots", default="2,3,4", help="comma list of slot counts")
    p.add_argument("--requests-per-rank", default="1", help="comma list of R")
    p.add_argument("--landing", type=int, default=2, help="landing buffers (1 = the reference's serial H2D->AG)")
    p.add_argument("--load-groups", default="1", help="comma list of load groups G (G consecutive blocks as one "
                   "load; slots a multiple of G and >= 2G, at W > 1 on 2G landing buffers; e.g. 1,2,4 with "
                   "--slots 2,4,8)")
    p.add_argument("--limit", type=int, default=20, help="rows to print")
    p.set_defaults(func=run)


DEFAULT_WORKLOAD = {"1xH200": "image 1024^2 CFG, 24 steps", "4xB300": "t2i 1024^2",
                    "8xB300": "minimax t2va 768x1344x124", "4xAscend910B3": "nano 832x480x29 CFG"}  # else the image


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"policy: {flag} must be a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"policy: {flag} needs integers >= 1, got {text!r}")
    return values


def _topology(text: str):
    """``(topology, probe)``: probe is ``(model, workload, sps)`` when the file is an ``auto_policy.json``."""
    from dlo_fn.repro import topologies

    if text.endswith(".json"):
        path = pathlib.Path(text)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise SystemExit(f"policy: --topology {text}: no such file") from None
        except json.JSONDecodeError as exc:
            raise SystemExit(f"policy: --topology {text}: not JSON ({exc})") from None
        try:
            if isinstance(data, dict) and "topology" in data:
                t, *probe = topologies.probe_from_dict(data, where=f"--topology {text}")
                return t, tuple(probe)
            return topologies.topology_from_dict(data, where=f"--topology {text}"), None
        except (ValueError, TypeError, KeyError) as exc:
            raise SystemExit(f"policy: {exc}") from None
    try:
        return topologies.topology(text), None
    except ValueError as exc:
        raise SystemExit(f"policy: --topology: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from dlo_fn.plan.policy import plan
    from dlo_fn.repro import topologies
    from dlo_fn.repro.tables import text_table

    topology, probe = _topology(args.topology)
    if args.world is not None:
        if args.world < 1:
            raise SystemExit(f"policy: --world must be >= 1, got {args.world}")
        topology = dataclasses.replace(topology, num_ranks=args.world)
    try:
        if probe is not None:  # a probe's own model and workload
            model, workload, sps = probe
        else:
            sps = None
            model = topologies.model(args.model)
            workload = topologies.workload(args.workload or DEFAULT_WORKLOAD.get(topology.name,
                                                                                 "image 1024^2 CFG, 24 steps"))
    except ValueError as exc:
        raise SystemExit(f"policy: {exc}") from None
    if sps is not None:  # --world may have changed the ranks the probe's sp sizes divided
        sps = tuple(sp for sp in sps if topology.num_ranks % sp == 0) or None
    result = plan(model, topology, workload, objective=args.objective, slots=_ints("--slots", args.slots),
                  requests_per_rank=_ints("--requests-per-rank", args.requests_per_rank),
                  num_landing=args.landing, sps=sps, load_groups=_ints("--load-groups", args.load_groups))
    print(f"{model.name} on {topology.name} ({topology.num_ranks} ranks), {workload.name}: {workload.tokens} "
          f"tokens x {workload.cfg_branches}, {workload.num_steps} steps; objective {args.objective}")
    keep = ("rank", "plan", "step_s", "wave_s", "outputs_per_s", "bound", "exposed_ms_per_step", "hbm_gb",
            "host_gb", "limiting_memory")
    rows = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in keep}
            for r in result.table_rows(args.limit)]
    print(text_table(rows) if rows else "(no plan fits)")
    if result.dropped:
        print(f"dropped {len(result.dropped)} plan(s) that do not fit, e.g. {result.dropped[0].candidate.label}: "
              f"{result.dropped[0].limiting_memory}")
    for field, source in topology.sources:
        print(f"  {field}: {source}")
    if not result.rows:
        return 1
    print("chosen:", result.why())
    return 0
