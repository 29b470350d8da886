"""`python -m dlo_fn demo`: the embedded end-to-end run behind `make reproduce` (2 CPU ranks, gloo, < 1 minute).

1. writes the ``tiny`` reference DiT to ``<out>/checkpoint`` as safetensors, unless a checkpoint is there;
2. spawns ``--dp`` CPU ranks (gloo, one thread each); every rank maps the checkpoint zero-copy (mmap), shards
   its blocks into a host arena and runs them through the double-buffered all-gather executor;
3. rank 0 serves a small mixed set: compatible requests (one full wave, one partial wave whose idle rank only
   serves its shards), a request of another shape (its own wave), and an empty prompt (rejected before
   dispatch); then it tries to force the incompatible pair into one wave, which is rejected before dispatch
   with the differing fields named;
4. serves the same set again rank-local and resident, and checks that every output's SHA-256 matches the
   resident run (exit code 1 on any mismatch or missing output);
5. writes the allgather run's videos, previews and manifests under ``<out>/outputs``.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import time

from dlo_fn.cli import HelpFormatter

log = logging.getLogger(__name__)

DEFAULT_OUT = "runs/demo"
SHAPE = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 4}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="end-to-end demo: 2 CPU ranks, mmap load, sharded all-gather, DP waves, hash check",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder for the checkpoint and the outputs")
    parser.add_argument("--dp", type=int, default=2, help="DP replicas (CPU ranks to spawn: dp x sp)")
    parser.add_argument("--sp", type=int, default=1, help="sequence-parallel ranks per replica (Ulysses)")
    parser.add_argument("--requests-per-rank", type=int, default=1, help="R: requests per rank per wave")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="process-group / wave timeout")
    parser.set_defaults(func=run_demo)


def demo_requests() -> list:
    """The mixed set: 3 compatible requests (a full and a partial wave), one of another shape, one empty."""
    from dlo_fn.models import Request
    from dlo_fn.serve.requests import Submission

    def req(prompt: str, seed: int, **kw) -> Request:
        return Request(prompt=prompt, seed=seed, **{**SHAPE, **kw})

    return [
        Submission("fox", req("a red fox in the snow", 1)),
        Submission("bird", req("a blue bird on a wire", 2)),
        Submission("tree", req("a tall tree at dusk", 3, height=48)),  # another shape: its own wave
        Submission("cat", req("a cat asleep in the sun", 4)),
        Submission("empty", req("", 5)),  # rejected before dispatch
    ]


def run_demo(args: argparse.Namespace) -> int:
    from dlo_fn.models.checkpoint import ensure_checkpoint
    from dlo_fn.plan.modes import MODES
    from dlo_fn.serve.local import Phase, serve_local
    from dlo_fn.serve.requests import EngineOptions, result_table, wave_table
    from dlo_fn.serve.writer import write_outputs

    t0 = time.perf_counter()
    out = pathlib.Path(args.out)
    ckpt = ensure_checkpoint(out)
    subs = tuple(demo_requests())
    by_id = {s.request_id: i for i, s in enumerate(subs)}
    options = EngineOptions(
        requests_per_rank=args.requests_per_rank, timeout_s=args.timeout_s, progress=False, serving="strict"
    )  # the demo shows the waves
    others = tuple(m for m in MODES if m != "allgather")  # each must reproduce the allgather run's bytes
    phases = [
        Phase("allgather", subs, options),
        Phase("allgather", subs, options, forced=((by_id["fox"], by_id["tree"]),)),
        *(Phase(mode, subs, options) for mode in others),
    ]
    if args.dp < 1 or args.sp < 1:
        raise SystemExit(f"demo: --dp {args.dp} and --sp {args.sp} must be >= 1")
    print(
        f"demo: {args.dp * args.sp} CPU ranks (gloo; dp {args.dp} x sp {args.sp}), checkpoint {ckpt}, "
        f"{len(subs)} requests, R = {args.requests_per_rank} per rank"
    )
    run = serve_local(ckpt, phases, args.dp, sp_size=args.sp, join_timeout_s=max(120.0, 4 * args.timeout_s))
    main, forced, *compared = (list(run.reports) + [None] * len(phases))[: len(phases)]
    if not hasattr(main, "results"):
        print(f"demo FAILED: the allgather run did not complete: {main}")
        return 1
    print(
        "\nallgather waves (rank 0 broadcasts each wave; every rank runs its own request; idle ranks only "
        "serve their shards):"
    )
    print(wave_table(main))
    print("\nresults:")
    print(result_table(main))
    print(f"\nforcing the incompatible pair (fox, tree) into one wave:\n  {forced}")
    manifest = write_outputs(out / "outputs", main, existing="clean")  # the demo owns this folder: rerun in place
    ok = True
    print("\nsame request and seed -> same bytes (SHA-256) in every mode:")
    for name, rep in zip(others, compared):
        if not hasattr(rep, "results"):
            print(f"  {name}: run failed: {rep}")
            ok = False
            continue
        expected = rep.hashes()
        for r in main.results:
            if r.request_id == "empty":
                continue
            same = r.ok and r.sha256 == expected.get(r.request_id)
            ok &= same
            print(f"  {r.request_id:<5} allgather == {name:<10} {'ok' if same else 'MISMATCH'}")
    empty = main.by_id()["empty"]
    if empty.ok or "empty" not in (empty.error or ""):
        print("  the empty prompt was not rejected")
        ok = False
    if "IncompatibleWaveError" not in str(forced) or "height" not in str(forced):
        print("  the forced mixed wave was not rejected")
        ok = False
    print(
        f"\noutputs: {manifest.parent} ({sum(r.ok for r in main.results)} videos + previews, manifest.jsonl, "
        f"waves.jsonl); rank exit codes {list(run.exitcodes)}; {time.perf_counter() - t0:.1f} s"
    )
    print("demo OK" if ok else "demo FAILED")
    return 0 if ok else 1
