"""`python -m benchmarks bench {load,step,waves,timeline,continuous,real,link-share,...}`: each benchmark lives in
:mod:`benchmarks.bench`."""

from __future__ import annotations

import importlib

BENCHES = (
    "load",
    "step",
    "waves",
    "timeline",
    "slots",
    "sp_hbm",
    "mesh_host",
    "continuous",
    "real",
    "fp8_quality",
    "link_share",
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks that write JSON/CSV under figures/data/",
        description=(
            "Benchmarks. Each writes its results (with machine, command and date) as JSON/CSV, by default "
            "under figures/data/. Performance is measured here, never asserted in timed tests."
        ),
    )
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in BENCHES:
        importlib.import_module(f"benchmarks.bench.{name}").register(sub)
