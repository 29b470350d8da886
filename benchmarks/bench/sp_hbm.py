"""`python -m benchmarks bench sp-hbm`: per-rank device memory of one offloaded SP pass, against the plan.

For each case (a named config cut to a few blocks: weight HBM does not depend on depth), ``sp`` ranks joined
by gloo run one pass of the reference DiT at a video shape (default 720p 10 s: 1280x720, 81 frames, 75600
tokens, one CFG branch, as ``dlo_fn.cost.ceilings.VIDEO_720P_10S``), with the blocks offloaded over the sp
group (``offload(model, "blocks", ctx)``: the shard group is every rank of the run) and Ulysses SP
(:mod:`dlo_fn.models.sp`). Every rank records, from its own allocator:

    weight_bytes             the executor's slots + landing buffers   vs the plan's hbm_weight_bytes (exact)
    resident_bytes           the non-block tensors moved to the device vs the spec's resident bytes
    workload_peak_bytes      peak during the pass - memory before it  vs dlo_fn.cost.sp_memory (SP model)

On CUDA several ranks may share one GPU (``--device cuda``: every rank on ``cuda:0``; gloo's
``all_gather_into_tensor`` and ``all_to_all_single`` take CUDA tensors, through host memory). The wall times
recorded beside the bytes are NOT performance figures: the collectives go through host memory and the ranks
share one device. On CPU (tests) the peak comes from the profiler's memory events.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import time
from dataclasses import dataclass

from dlo_fn.cli import HelpFormatter

DEFAULT_CASES = ("cosmos3-nano:2", "cosmos3-nano@32:4", "cosmos3-super:2", "cosmos3-super:4")
NOT_PERFORMANCE = (
    "wall times: several ranks share one device and every collective goes through host memory "
    "(gloo): not performance figures"
)


@dataclass(frozen=True, slots=True)
class SPCase:
    """``config`` cut to ``num_blocks`` blocks (and given ``num_heads``, when set, at the same widths)."""

    config: str
    sp: int
    num_blocks: int = 2
    num_heads: int | None = None

    @property
    def label(self) -> str:
        return f"{self.config}{f'@{self.num_heads}' if self.num_heads else ''} sp{self.sp}"

    def build_config(self):
        from dlo_fn.models import get_config

        base = get_config(self.config)
        heads = self.num_heads or base.num_heads
        name = f"{base.name}-{self.num_blocks}blocks" + (f"-{heads}heads" if self.num_heads else "")
        return dataclasses.replace(base, name=name, num_blocks=self.num_blocks, num_heads=heads)


def parse_case(text: str, num_blocks: int) -> SPCase:
    """``CONFIG[@HEADS]:SP``, e.g. ``cosmos3-super:4`` or ``cosmos3-nano@32:4`` (Nano's 30 heads do not split
    over 4 ranks: 32 heads of 120 channels keep its widths)."""
    try:
        head, sp = text.rsplit(":", 1)
        config, _, heads = head.partition("@")
        return SPCase(config, int(sp), num_blocks, int(heads) if heads else None)
    except ValueError:
        raise SystemExit(f"--cases: cannot read {text!r}: write CONFIG[@HEADS]:SP, e.g. cosmos3-super:4") from None


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sp-hbm",
        help="per-rank HBM of one offloaded SP pass vs the plan",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma-separated CONFIG[@HEADS]:SP")
    p.add_argument("--blocks", type=int, default=2, help="blocks of each reduced-depth model")
    p.add_argument("--height", type=int, default=720)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--frames", type=int, default=81, help="81 frames = 10 s at 8 fps")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda: every rank on cuda:0")
    p.add_argument(
        "--weights",
        choices=("random", "constant"),
        default="random",
        help="seeded random weights, or every weight 0.01 (same memory, much faster to build)",
    )
    p.add_argument("--threads-per-rank", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=540.0)
    p.add_argument(
        "--out", type=pathlib.Path, default=None, help="JSON path (default: figures/data/sp_hbm_<device>.json)"
    )
    p.add_argument(
        "--explain-peak", action="store_true", help="cuda: record rank 0's allocations and list those alive at its peak"
    )
    p.add_argument(
        "--partial-dir", type=pathlib.Path, default=None, help="also write each record there as soon as it is measured"
    )
    p.set_defaults(func=run)


def _cpu_peak_bytes(prof) -> int:
    """Peak of live bytes above the start, from the profiler's raw allocation (+) and free (-) events in time
    order (the per-op attribution of ``prof.events()`` would net out allocations freed inside one op)."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _peak_allocations(snapshot: dict, top: int = 16) -> list[dict]:
    """The device allocations alive at the peak of a ``torch.cuda.memory._snapshot()`` trace, largest first,
    each with the innermost ``dlo_fn`` frame that made it (what the SP model's terms are checked against)."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for trace in snapshot.get("device_traces", []):
        for ev in trace:
            if ev["action"] == "alloc":
                frames = [f for f in ev.get("frames", []) if "dlo_fn" in f.get("filename", "")]
                f0 = frames[0] if frames else None
                where = f"{f0['filename'].split('dlo_fn/')[-1]}:{f0['line']} {f0['name']}" if f0 else "?"
                live[ev["addr"]] = (ev["size"], where)
                total += ev["size"]
                if total > best:
                    best, at_peak = total, dict(live)
            elif ev["action"] == "free_completed" and ev["addr"] in live:
                total -= live.pop(ev["addr"])[0]
    rows = sorted(at_peak.values(), key=lambda t: -t[0])
    return [{"bytes": n, "where": w} for n, w in rows[:top]] + [
        {"bytes": sum(n for n, _ in rows[top:]), "where": f"{max(0, len(rows) - top)} others"}
    ]


def _build(config, weights: str):
    """The model on the CPU: seeded random weights, or every weight 0.01 (``constant``: device memory does not
    depend on the values, and filling is ~10x faster than drawing, which matters for Super-sized blocks)."""
    import torch
    from torch import nn

    from dlo_fn.models import build_model

    if weights == "random":
        return build_model(config, "cpu", torch.bfloat16, seed=0)
    model = build_model(config, "meta", torch.bfloat16)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = nn.Parameter(torch.full(p.shape, 0.01, dtype=p.dtype), requires_grad=False)
    model.init_buffers("cpu")
    return model


def _measure(
    grp, case: SPCase, device: str, shape: tuple[int, int, int], base_platform, weights: str, explain: bool = False
) -> dict:
    import torch
    import torch.distributed as dist

    from dlo_fn.cost.sp_memory import BlockDims, sp_activations
    from dlo_fn.models import BLOCK_PATHS, SPContext, latent_shape, tokenize, tokens_for
    from dlo_fn.plan.sizes import ModelSizes
    from dlo_fn.plan.summary import plan_summary
    from dlo_fn.runtime.dist import DistContext
    from dlo_fn.runtime.offload import offload
    from dlo_fn.runtime.platform import Platform

    platform = Platform("cuda", torch.device("cuda", 0), "gloo") if device == "cuda" else base_platform
    rank = dist.get_rank(grp)
    ctx = DistContext(rank, case.sp, 0, platform, grp)
    config = case.build_config()
    height, width, frames = shape
    t0 = time.perf_counter()
    model = _build(config, weights)
    platform.synchronize()
    before = platform.memory_allocated()
    off = offload(model, BLOCK_PATHS, ctx, mode="allgather")
    platform.synchronize()
    idle = platform.memory_allocated()
    plan = plan_summary(off.spec, case.sp)
    sizes = ModelSizes.from_spec(off.spec)
    tokens = tokens_for(config, height, width, frames)
    model_sp = sp_activations(BlockDims.from_config(config), tokens, case.sp, batch=1)
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn((1, *latent_shape(config, height, width, frames)), generator=gen).to(platform.device)
    timestep = torch.full((1,), 500.0, device=platform.device)
    text_tokens = tokenize("a red fox in the snow", config.text_len).to(platform.device)
    sp = SPContext(grp, case.sp, rank)
    t1 = time.perf_counter()
    explained = None
    platform.reset_peak_memory_stats()
    with torch.no_grad():
        if device == "cuda":
            if explain and rank == 0:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            with off.run(1):
                out = model(latents, timestep, text_tokens, sp=sp)
            platform.synchronize()
            peak = platform.max_memory_allocated() - idle
            if explain and rank == 0:
                explained = _peak_allocations(torch.cuda.memory._snapshot())
                torch.cuda.memory._record_memory_history(enabled=None)
        else:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                inputs = (latents, timestep, text_tokens)  # counted on CUDA (allocated after idle): add below
                with off.run(1):
                    out = model(*inputs, sp=sp)
            peak = _cpu_peak_bytes(prof) + sum(t.untyped_storage().nbytes() for t in inputs)
    t2 = time.perf_counter()
    result = {
        "case": case.label,
        "config": config.name,
        "base_config": case.config,
        "num_blocks": config.num_blocks,
        "num_heads": config.num_heads,
        "hidden_dim": config.hidden_dim,
        "mlp_dim": config.mlp_dim,
        "sp": case.sp,
        "rank": rank,
        "tokens": tokens,
        "local_tokens": model_sp.local_tokens,
        "batch": 1,
        "weight_bytes": off.executor.measured_device_bytes if device == "cuda" else off.executor.device_weight_bytes,
        "weight_bytes_planned": plan.hbm_weight_bytes,
        "resident_bytes": idle - before - (off.executor.measured_device_bytes if device == "cuda" else 0),
        "resident_bytes_planned": off.spec.resident_bytes,
        "max_block_bytes": sizes.max_block_bytes,
        "pinned_host_bytes": off.store.arena_bytes,
        "pinned_host_bytes_planned": plan.pinned_host_bytes_per_rank,
        "workload_peak_bytes": int(peak),
        "workload_peak_bytes_model": model_sp.peak_bytes,
        "model_peak_phase": model_sp.peak_phase.name,
        "activation_bytes_model": model_sp.activation_bytes,
        "communication_bytes_model": model_sp.communication_bytes,
        "output_shape": list(out.shape),
        "output_finite": bool(torch.isfinite(out).all()),
        "weights": weights,
        "idle_device_bytes": idle - before,
        "setup_s": round(t1 - t0, 2),
        "pass_s": round(t2 - t1, 2),
        **({"peak_allocations": explained} if explained else {}),
    }
    del out, off, model, latents
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def _rank(
    ctx,
    cases: tuple[SPCase, ...],
    device: str,
    shape: tuple[int, int, int],
    weights: str = "random",
    partial_dir: str | None = None,
    explain: bool = False,
) -> list[dict]:
    """Every rank creates every case's group (a collective); the first ``sp`` ranks run the case. A failed case
    is recorded (with its error) and the next one runs; with ``partial_dir`` each record is also written as it
    is made, so a run cut short keeps what it measured."""
    import torch.distributed as dist

    results = []
    for case in cases:
        grp = dist.new_group(list(range(case.sp)))
        if ctx.rank < case.sp:
            try:
                rec = _measure(grp, case, device, shape, ctx.platform, weights, explain)
            except Exception as exc:  # a record of the failure beats losing every other case
                rec = {"case": case.label, "rank": ctx.rank, "error": f"{type(exc).__name__}: {exc}"}
            results.append(rec)
            if partial_dir:
                with open(pathlib.Path(partial_dir, f"partial_rank{ctx.rank}.jsonl"), "a") as f:
                    f.write(json.dumps(rec) + "\n")
        dist.barrier()
    return results


def measure(
    cases: tuple[SPCase, ...],
    device: str = "cuda",
    shape: tuple[int, int, int] = (720, 1280, 81),
    *,
    weights: str = "random",
    threads_per_rank: int = 2,
    timeout_s: float = 540.0,
    partial_dir: str | None = None,
    explain: bool = False,
) -> list[dict]:
    """Run every case on ``max(sp)`` local ranks (gloo); one record per (case, rank), in case order."""
    from dlo_fn.serve.ranks import run_ranks

    world = max(c.sp for c in cases)
    per_rank = run_ranks(
        _rank,
        world,
        cases,
        device,
        shape,
        weights,
        partial_dir,
        explain,
        timeout_s=timeout_s,
        platform="cpu",
        threads_per_rank=threads_per_rank,
    )
    records = [r for rank_results in per_rank for r in rank_results]
    order = {c.label: i for i, c in enumerate(cases)}
    return sorted(records, key=lambda r: (order[r["case"]], r["rank"]))


def run(args: argparse.Namespace) -> int:
    import platform as pyplatform

    import torch

    cases = tuple(parse_case(t, args.blocks) for t in args.cases.split(",") if t)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench sp-hbm: --device cuda but torch.cuda.is_available() is False; use --device cpu")
    records = measure(
        cases,
        args.device,
        (args.height, args.width, args.frames),
        weights=args.weights,
        threads_per_rank=args.threads_per_rank,
        timeout_s=args.timeout_s,
        partial_dir=str(args.partial_dir) if args.partial_dir else None,
        explain=args.explain_peak,
    )
    machine = {
        "host": pyplatform.node(),
        "torch": torch.__version__,
        "device": args.device,
        "backend": "gloo",
        "ranks_share_one_device": args.device == "cuda",
    }
    if args.device == "cuda":
        machine.update(device_name=torch.cuda.get_device_name(0), cuda=str(torch.version.cuda))
    command = (
        f"python -m benchmarks bench sp-hbm --cases {args.cases} --blocks {args.blocks} --height {args.height} "
        f"--width {args.width} --frames {args.frames} --device {args.device} --weights {args.weights} "
        f"--threads-per-rank {args.threads_per_rank}" + (" --explain-peak" if args.explain_peak else "")
    )
    doc = {
        "machine": machine,
        "command": command,
        "date": datetime.date.today().isoformat(),
        "note": NOT_PERFORMANCE,
        "shape": {"height": args.height, "width": args.width, "frames": args.frames},
        "records": records,
    }
    out = args.out or pathlib.Path("figures/data") / f"sp_hbm_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for r in records:
        if "error" in r:
            print(f"{r['case']:24s} rank {r['rank']}: FAILED {r['error']}")
            continue
        print(
            f"{r['case']:24s} rank {r['rank']}: weights {r['weight_bytes']} (plan {r['weight_bytes_planned']}), "
            f"workload peak {r['workload_peak_bytes'] / 1e9:.3f} GB "
            f"(model {r['workload_peak_bytes_model'] / 1e9:.3f})"
        )
    print(f"wrote {out}  ({NOT_PERFORMANCE})")
    return 0
