"""`python -m dlo_fn policy`: rank every (dp, sp, mode, shard group, slots, R, load group) of a model on a topology.

``--topology`` is a named machine (``--help`` lists them, from :mod:`dlo_fn.cost.topology_file`, every field with
its source) or a JSON file with the same fields
(:func:`dlo_fn.cost.topology_file.topology_from_dict`), or the ``auto_policy.json`` that ``generate`` writes under
``--out`` with ``--mode/--slots/--sp auto`` (the measured topology with its model, workload and sp sizes). Prints
the ranked table (the chosen plan first), the sources
of the topology's fields, and one line saying why the choice won and what came second. ``--hbm-budget`` keeps
in each plan the blocks ``offload`` keeps resident within that many device weight bytes per rank, in place of the
device memory for the weights, and says what a larger budget buys; ``--quantization fp8`` prices FP8 shards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

from dlo_fn.cli import HelpFormatter


class _HelpWithTables(argparse.Action):
    """``-h/--help``: the usage and options, then the named topologies, models and workloads and the fields of a
    topology file, generated from :mod:`dlo_fn.cost.topology_file` when asked (so ``--help`` of the other commands
    stays fast, and a topology added there is listed here)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.epilog = help_tables()
        parser.print_help()
        parser.exit()


def help_tables() -> str:
    """The epilog of ``policy --help``: every named topology (ranks, H2D, HBM), model, workload, and the JSON
    fields of a topology file (required and optional)."""
    from dlo_fn.cost import topology_file as topologies

    lines = ["named topologies (--topology NAME):"]
    for name in topologies.topology_names():
        t = topologies.topology(name)
        lines.append(
            f"  {name:<16} {t.num_ranks} rank(s), H2D {t.h2d_bytes_per_s / 1e9:.1f} GB/s, "
            f"{t.hbm_bytes_per_rank / 1e9:.0f} GB device memory per rank"
        )
    lines += [
        "",
        "models (--model NAME): " + ", ".join(topologies.model_names()) + "; or a named config (plan --help)",
        "",
        "named workloads (--workload NAME; default: the topology's own):",
    ]
    for name, w in topologies.workloads().items():
        lines.append(f"  {name!r}: {w.tokens} tokens x {w.cfg_branches} branch(es), {w.num_steps} step(s)")
    lines += ["", "a topology file (--topology FILE.json) is one JSON object:"]
    for field, required, form in topologies.TOPOLOGY_FILE_FIELDS:
        lines.append(f"  {field:<26} {'required' if required else 'optional'}  {form}")
    lines += [
        "a named one as such a file: python -c 'import json; from dlo_fn.cost import topology_file as t; "
        'print(json.dumps(t.topology_to_dict(t.topology("1xH200"))))\'',
        "--topology also reads the auto_policy.json that generate --out writes with --mode/--slots/--sp auto.",
    ]
    return "\n".join(lines)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "policy",
        help="rank dp x sp, all-gather vs rank-local, slots and R on a topology",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
        add_help=False,
    )
    p.add_argument(
        "-h",
        "--help",
        action=_HelpWithTables,
        help="show this help, the named topologies, models and workloads, and a topology file's fields",
    )
    p.add_argument("--model", default="bench", help="a named model (listed below)")
    p.add_argument("--world", type=int, default=None, help="ranks (default: the topology's)")
    p.add_argument(
        "--topology",
        default="1xH200",
        help="a named topology, FILE.json (fields below), or the "
        "auto_policy.json of a generate --out (its model and workload too)",
    )
    p.add_argument("--workload", default=None, help="a named workload (listed below; default: the topology's own)")
    p.add_argument("--objective", choices=("throughput", "latency"), default="throughput")
    p.add_argument("--slots", default="2,3,4", help="comma list of slot counts")
    p.add_argument("--requests-per-rank", default="1", help="comma list of R")
    p.add_argument("--landing", type=int, default=2, help="landing buffers (1 = the reference's serial H2D->AG)")
    p.add_argument(
        "--load-groups",
        default="1",
        help="comma list of load groups G (G consecutive blocks as one "
        "load; slots a multiple of G and >= 2G, at W > 1 on 2G landing buffers; e.g. 1,2,4 with "
        "--slots 2,4,8)",
    )
    p.add_argument(
        "--hbm-budget",
        default=None,
        metavar="SIZE",
        help="device weight bytes per rank (e.g. 16GB): each plan keeps the blocks that fit resident, the rest "
        "streamed; the chosen plan's next larger budgets and their predicted steps",
    )
    p.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="FP8 shards (a named config's tensors): stored bytes pinned, moved and gathered, dequantised per block",
    )
    p.add_argument("--limit", type=int, default=20, help="rows to print")
    p.set_defaults(func=run)


DEFAULT_WORKLOAD = {
    "1xH200": "image 1024^2 CFG, 24 steps",
    "4xB300": "t2i 1024^2",
    "8xB300": "minimax t2va 768x1344x124",
    "4xAscend910B3": "nano 832x480x29 CFG",
}  # else the image


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"policy: {flag} must be a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"policy: {flag} needs integers >= 1, got {text!r}")
    return values


def _model(name: str, quantization: str | None = None):
    """A named policy model (calibrated), or any named config ``plan`` and ``make-checkpoint`` know, from its
    spec's exact sizes (activations left out of the HBM check). A config's tensors also give what a resident
    block holds (an HBM budget's unpacked bytes) and, with ``quantization``, the stored sizes."""
    from dlo_fn.cost import topology_file as topologies
    from dlo_fn.cost.topology import PolicyModel
    from dlo_fn.models import CONFIGS
    from dlo_fn.models.specs import config_spec
    from dlo_fn.plan.sizes import ModelSizes

    if name in topologies.model_names() or name not in CONFIGS:
        try:
            model = topologies.model(name)
        except ValueError as exc:
            raise ValueError(f"{exc}; or a named config: {', '.join(CONFIGS)}") from None
    else:
        model = PolicyModel(
            ModelSizes.from_spec(config_spec(name)),
            CONFIGS[name].hidden_dim,
            source=f"dlo_fn.models.specs.config_spec({name!r})",
        )
    if name not in CONFIGS:
        if quantization:
            raise ValueError(f"--quantization {quantization} prices a named config's tensors ({', '.join(CONFIGS)})")
        return model
    spec = config_spec(name)
    sizes = ModelSizes.from_spec(spec, quantization=quantization)
    if sizes.block_bytes != model.sizes.block_bytes and not quantization:  # calibrated sizes of its own: kept
        return model
    return dataclasses.replace(model, sizes=sizes, tensor_block_bytes=spec.block_bytes)


def _topology(text: str):
    """``(topology, probe)``: probe is ``(model, workload, sps)`` when the file is an ``auto_policy.json``."""
    from dlo_fn.cost import topology_file as topologies

    path = pathlib.Path(text)
    if path.is_file() or text.endswith(".json"):  # a file of any name is read; a name is looked up
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise SystemExit(f"policy: --topology {text}: no such file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SystemExit(
                f"policy: --topology {text}: not JSON ({exc}): a topology file is one JSON object (its fields: "
                "policy --help)"
            ) from None
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
    from dlo_fn.cost import topology_file as topologies
    from dlo_fn.cost.policy import plan
    from dlo_fn.plan.summary import text_table

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
            model = _model(args.model, args.quantization)
            workload = topologies.workload(
                args.workload or DEFAULT_WORKLOAD.get(topology.name, "image 1024^2 CFG, 24 steps")
            )
    except ValueError as exc:
        raise SystemExit(f"policy: {exc}") from None
    if sps is not None:  # --world may have changed the ranks the probe's sp sizes divided
        sps = tuple(sp for sp in sps if topology.num_ranks % sp == 0) or None
    budget = None
    if args.hbm_budget is not None:
        from dlo_fn.plan.sizes import parse_bytes

        try:
            budget = parse_bytes(args.hbm_budget)
        except ValueError as exc:
            raise SystemExit(f"policy: --hbm-budget: {exc}") from None
    result = plan(
        model,
        topology,
        workload,
        objective=args.objective,
        slots=_ints("--slots", args.slots),
        requests_per_rank=_ints("--requests-per-rank", args.requests_per_rank),
        num_landing=args.landing,
        sps=sps,
        load_groups=_ints("--load-groups", args.load_groups),
        hbm_budget=budget,
    )
    print(
        f"{model.name} on {topology.name} ({topology.num_ranks} ranks), {workload.name}: {workload.tokens} "
        f"tokens x {workload.cfg_branches}, {workload.num_steps} steps; objective {args.objective}"
    )
    keep = (
        "rank",
        "plan",
        "step_s",
        "wave_s",
        "outputs_per_s",
        "bound",
        "exposed_ms_per_step",
        "hbm_gb",
        "host_gb",
        "limiting_memory",
        *(("resident",) if budget is not None else ()),
    )
    rows = [
        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in keep}
        for r in result.table_rows(args.limit)
    ]
    print(text_table(rows) if rows else "(no plan fits)")
    if result.dropped:
        d = result.dropped[0]
        print(
            f"dropped {len(result.dropped)} plan(s) that do not fit, e.g. {d.candidate.label}: {d.limiting_memory}"
            + (f" ({d.note})" if d.note else "")
        )
    for field, source in topology.sources:
        print(f"  {field}: {source}")
    if not result.rows:
        return 1
    print("chosen:", result.why())
    return 0
