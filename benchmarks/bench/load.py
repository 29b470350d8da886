"""`python -m benchmarks bench load`: host memory of N real processes loading one checkpoint, mmap vs copy.

Each worker is a fresh ``python -m benchmarks.bench.load_worker`` process: it builds the model on ``meta``,
loads the checkpoint (``mode="mmap"``: zero-copy views of one shared page cache; ``"copy"``: the naive private
copies), reads every weight (a float64 sum over every tensor: all pages resident), reports, then blocks on
stdin. Once every worker has reported (a barrier), the driver reads their ``/proc/PID/smaps_rollup`` and the
cgroup counters, then releases them. The framework constant ``c`` is the PSS of a worker that imports torch
and builds the meta model but binds nothing, measured alone first. Expected, for a model of ``M`` bytes::

    sum of PSS over the N workers ~= M + N c        (mmap: one page-cache copy, shared)
                                  ~= N (M + c)      (copy: N private copies; the page cache is unmapped)
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
from dataclasses import dataclass

from benchmarks.bench.load_worker import WorkerSample, run_group
from dlo_fn.io.memstat import CgroupMemory, ProcessMemory, cgroup_memory, format_bytes, host_description

__all__ = [
    "LoadBenchResult",
    "register",
    "run_load_bench",
    "measure_baseline",
    "make_checkpoint",
    "SWEEP_FIELDS",
    "LOAD_CONFIGS",
]

from dlo_fn.models.configs import LOAD_CONFIGS, load_config  # noqa: E402,F401 (the bench's own sizes)


def make_checkpoint(name: str, out_dir: str | os.PathLike, progress: bool = False) -> pathlib.Path:
    """Write the ``name`` checkpoint (bf16, seed 0) to ``out_dir`` unless it is already there."""
    out = pathlib.Path(out_dir)
    if (out / "config.json").is_file():
        from dlo_fn.io.checkpoint import open_checkpoint

        found = (open_checkpoint(out).config or {}).get("config", {}).get("name")
        if found != name:
            raise ValueError(f"{out} already holds checkpoint {found!r}, not {name!r}: choose another directory")
        return out
    from dlo_fn.models import write_checkpoint

    return write_checkpoint(load_config(name), out, seed=0, dtype="bf16", progress=progress)


@dataclass(frozen=True, slots=True)
class LoadBenchResult:
    mode: str
    ranks: int
    model_bytes: int
    baseline: WorkerSample  # the framework constant: torch + meta model, no weights, measured alone
    workers: tuple[WorkerSample, ...]
    driver: ProcessMemory
    cgroup: CgroupMemory | None  # at the barrier
    cgroup_before: CgroupMemory | None

    def __post_init__(self) -> None:
        if len(self.workers) != self.ranks:
            raise ValueError(f"{len(self.workers)} worker samples for ranks={self.ranks}")
        sums = {w.checksum for w in self.workers}
        if len(sums) > 1:
            raise ValueError(f"workers read different weights: checksums {sorted(sums)}")

    @property
    def constant_bytes(self) -> int:
        return self.baseline.memory.pss_bytes

    @property
    def sum_pss_bytes(self) -> int:
        return sum(w.memory.pss_bytes for w in self.workers)

    @property
    def predicted_pss_bytes(self) -> int:
        """``M + N c`` (mmap) or ``N (M + c)`` (copy)."""
        if self.mode == "mmap":
            return self.model_bytes + self.ranks * self.constant_bytes
        return self.ranks * (self.model_bytes + self.constant_bytes)

    def row(self) -> dict[str, object]:
        ws = [w.memory for w in self.workers]
        cg = self.cgroup
        return {
            "mode": self.mode,
            "ranks": self.ranks,
            "model_bytes": self.model_bytes,
            "constant_pss_bytes": self.constant_bytes,
            "constant_uss_bytes": self.baseline.memory.uss_bytes,
            "constant_rss_bytes": self.baseline.memory.rss_bytes,
            "sum_pss_bytes": self.sum_pss_bytes,
            "predicted_pss_bytes": self.predicted_pss_bytes,
            "rel_error": self.sum_pss_bytes / self.predicted_pss_bytes - 1.0,
            "tree_pss_bytes": self.sum_pss_bytes + self.driver.pss_bytes,
            "sum_uss_bytes": sum(m.uss_bytes for m in ws),
            "sum_rss_bytes": sum(m.rss_bytes for m in ws),
            "sum_pss_anon_bytes": sum(m.pss_anon_bytes for m in ws),
            "sum_weights_pss_bytes": sum(w.weights_pss_bytes for w in self.workers),
            "max_hwm_bytes": max(m.hwm_bytes for m in ws),
            "cgroup_version": cg.version if cg else "",
            "cgroup_current_bytes": cg.current_bytes if cg else "",
            "cgroup_file_bytes": cg.file_bytes if cg else "",
            "cgroup_anon_bytes": cg.anon_bytes if cg else "",
            "max_load_s": max(w.load_s for w in self.workers),
            "max_touch_s": max(w.touch_s for w in self.workers),
        }


SWEEP_FIELDS = (
    "machine",
    "checkpoint",
    "command",
    "date",
    "mode",
    "ranks",
    "model_bytes",
    "constant_pss_bytes",
    "constant_uss_bytes",
    "constant_rss_bytes",
    "sum_pss_bytes",
    "predicted_pss_bytes",
    "rel_error",
    "tree_pss_bytes",
    "sum_uss_bytes",
    "sum_rss_bytes",
    "sum_pss_anon_bytes",
    "sum_weights_pss_bytes",
    "max_hwm_bytes",
    "cgroup_version",
    "cgroup_current_bytes",
    "cgroup_file_bytes",
    "cgroup_anon_bytes",
    "max_load_s",
    "max_touch_s",
)
PROCESS_FIELDS = (
    "date",
    "mode",
    "ranks",
    "rank",
    "rss_bytes",
    "pss_bytes",
    "uss_bytes",
    "pss_anon_bytes",
    "pss_file_bytes",
    "weights_pss_bytes",
    "hwm_bytes",
)


def measure_baseline(checkpoint: str | os.PathLike, timeout_s: float = 600.0) -> WorkerSample:
    """The framework constant: one worker that imports torch and builds the meta model, alone."""
    from dlo_fn.io.checkpoint import open_checkpoint

    files = [str(f) for f in open_checkpoint(checkpoint).files]
    return run_group(os.fspath(checkpoint), ["none"], files, timeout_s)[0][0]


def run_load_bench(
    checkpoint: str | os.PathLike,
    ranks: int,
    mode: str = "mmap",
    *,
    timeout_s: float = 600.0,
    baseline: WorkerSample | None = None,
) -> LoadBenchResult:
    """N = ``ranks`` workers load ``checkpoint`` in ``mode``; see the module docstring."""
    from dlo_fn.io.checkpoint import open_checkpoint

    if mode not in ("mmap", "copy") or ranks < 1:
        raise ValueError(f"mode must be mmap or copy and ranks >= 1, got {mode!r}, {ranks}")
    ckpt = open_checkpoint(checkpoint)  # header errors surface here, before any process starts
    files = [str(f) for f in ckpt.files]
    if baseline is None:
        baseline = measure_baseline(checkpoint, timeout_s)
    before = cgroup_memory()
    samples, driver, cgroup = run_group(os.fspath(checkpoint), [mode] * ranks, files, timeout_s)
    return LoadBenchResult(mode, ranks, ckpt.total_bytes, baseline, tuple(samples), driver, cgroup, before)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "load",
        help="host memory of N processes loading one checkpoint (mmap vs private copies)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint directory, .safetensors file or cached repo id")
    p.add_argument(
        "--make",
        choices=tuple(LOAD_CONFIGS),
        help="first write this reference-DiT checkpoint (bf16, seed 0) to --checkpoint, unless it is already there",
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[2], metavar="N", help="process counts (default 2)")
    p.add_argument("--mode", nargs="+", choices=("mmap", "copy"), default=["mmap"], help="loaders to compare")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--out", type=pathlib.Path, help="write one CSV row per (mode, N) here")
    p.add_argument("--timeout-s", type=float, default=600.0, help="limit per group of processes")
    p.add_argument(
        "--phases",
        action="store_true",
        help="instead: N real gloo ranks load, offload and generate; "
        "each rank's RSS/USS/PSS/VmHWM after load, fill, offload and generate vs the plan "
        "(dlo_fn.cost.rank_memory; see benchmarks.bench.load_phases)",
    )
    p.add_argument(
        "--offload-mode",
        nargs="+",
        choices=("allgather", "rank-local", "rank-local-mmap"),
        default=["allgather", "rank-local", "rank-local-mmap"],
        help="with --phases: modes to sweep",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="with --phases: cuda puts every rank on GPU 0, over gloo (memory only)",
    )
    p.set_defaults(func=_main)


def _main(args) -> int:
    from dlo_fn.io.checkpoint import open_checkpoint

    if args.make:
        make_checkpoint(args.make, args.checkpoint, progress=True)
    ckpt = open_checkpoint(args.checkpoint)
    if args.phases:
        return _phases(args, ckpt)
    baseline = measure_baseline(args.checkpoint, args.timeout_s)
    results = [
        run_load_bench(args.checkpoint, n, m, timeout_s=args.timeout_s, baseline=baseline)
        for m in args.mode
        for n in args.ranks
    ]
    command = (
        "python -m benchmarks bench load "
        + (f"--make {args.make} " if args.make else "")
        + f"--checkpoint {args.checkpoint} --ranks "
        + " ".join(map(str, args.ranks))
        + " --mode "
        + " ".join(args.mode)
        + (f" --out {args.out}" if args.out else "")
    )
    meta = {
        "machine": host_description(),
        "checkpoint": _describe(ckpt),
        "command": command,
        "date": datetime.date.today().isoformat(),
    }
    rows = [{**meta, **r.row()} for r in results]
    if args.out:
        from benchmarks.figures.style import write_csv

        write_csv(args.out, rows, SWEEP_FIELDS)
        per_process = [
            {
                "date": meta["date"],
                "mode": r.mode,
                "ranks": r.ranks,
                "rank": i,
                "rss_bytes": w.memory.rss_bytes,
                **{
                    f: getattr(w.memory, f)
                    for f in ("pss_bytes", "uss_bytes", "pss_anon_bytes", "pss_file_bytes", "hwm_bytes")
                },
                "weights_pss_bytes": w.weights_pss_bytes,
            }
            for r in results
            for i, w in enumerate(r.workers)
        ]
        write_csv(args.out.with_name(args.out.stem + "_processes.csv"), per_process, PROCESS_FIELDS)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(
            f"{meta['checkpoint']}; framework constant c = {format_bytes(baseline.memory.pss_bytes)} PSS "
            f"({format_bytes(baseline.memory.uss_bytes)} USS); {meta['machine']}"
        )
        print(
            f"{'mode':5} {'N':>2} {'sum PSS':>10} {'predicted':>10} {'err':>6} {'sum USS':>10} "
            f"{'cgroup':>10} {'cg file':>10} {'cg anon':>10}"
        )
        for r in rows:
            cg = [
                format_bytes(r[k]) if r[k] != "" else "-"
                for k in ("cgroup_current_bytes", "cgroup_file_bytes", "cgroup_anon_bytes")
            ]
            print(
                f"{r['mode']:5} {r['ranks']:>2} {format_bytes(r['sum_pss_bytes']):>10} "
                f"{format_bytes(r['predicted_pss_bytes']):>10} {r['rel_error']:>+6.1%} "
                f"{format_bytes(r['sum_uss_bytes']):>10} {cg[0]:>10} {cg[1]:>10} {cg[2]:>10}"
            )
    return 0


def _phases(args, ckpt) -> int:
    from benchmarks.bench.load_phases import PHASE_FIELDS, print_rows, sweep

    command = (
        "python -m benchmarks bench load --phases "
        + (f"--make {args.make} " if args.make else "")
        + f"--checkpoint {args.checkpoint} --ranks "
        + " ".join(map(str, args.ranks))
        + " --offload-mode "
        + " ".join(args.offload_mode)
        + f" --device {args.device}"
        + (f" --out {args.out}" if args.out else "")
    )
    rows = sweep(
        str(args.checkpoint), args.ranks, args.offload_mode, args.device, command, _describe(ckpt), args.timeout_s
    )
    if args.out:
        from benchmarks.figures.style import write_csv

        write_csv(args.out, rows, PHASE_FIELDS)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_rows(rows)
    return 0


def _describe(ckpt) -> str:
    cfg = ckpt.config if isinstance(ckpt.config, dict) else {}
    name = cfg.get("config", {}).get("name") if isinstance(cfg.get("config"), dict) else None
    what = f"{cfg.get('model_type')} {name} {cfg.get('dtype', '')}".strip() if cfg else "safetensors"
    return f"{what}, {format_bytes(ckpt.total_bytes)} in {len(ckpt.files)} file(s)"
