"""`python -m benchmarks figures`: regenerate every figure and the measured tables of README.md and docs/ (and
optionally execute every notebook in place, in name order: ``notebooks/01_*.ipynb`` to ``11_*.ipynb``)."""

from __future__ import annotations

import argparse
import logging
import pathlib

from benchmarks.repro.data import FIGURES_DIR

log = logging.getLogger("benchmarks.figures")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "figures",
        help="regenerate figures/ (and execute the notebooks with --execute-notebooks)",
        description=(
            "Regenerate every figure into figures/ (PNG/GIF) and the data behind it into figures/data/, and the "
            "measured tables of README.md and docs/ (benchmarks.repro.doc_tables). Output is byte-stable: running it "
            "twice changes no byte. Figures and tables drawn from measurements read the committed CSV/JSON under "
            "figures/data/; they never re-measure."
        ),
    )
    p.add_argument("--out", type=pathlib.Path, default=FIGURES_DIR, help="output folder (default: figures/)")
    p.add_argument("--only", action="append", default=None, metavar="NAME", help="regenerate only this figure")
    p.add_argument("--list", action="store_true", help="list the figure names and exit")
    p.add_argument(
        "--execute-notebooks",
        action="store_true",
        help="also execute every notebook under notebooks/ in place (outputs stored, no timings)",
    )
    p.set_defaults(func=run)


def execute_notebooks(folder: pathlib.Path, timeout_s: int = 900) -> list[pathlib.Path]:
    """Execute each notebook in place with a fresh kernel, in name order, without timing metadata."""
    import nbclient
    import nbformat

    done = []
    for path in sorted(folder.glob("*.ipynb")):
        log.info("executing %s", path.name)
        nb = nbformat.read(path, as_version=4)
        client = nbclient.NotebookClient(
            nb,
            timeout=timeout_s,
            kernel_name="python3",
            record_timing=False,
            resources={"metadata": {"path": str(folder)}},
        )
        client.execute()
        for cell in nb.cells:
            cell.metadata.pop("execution", None)
            if cell.cell_type == "code":
                cell.outputs = _coalesce_streams(cell.outputs)
        nbformat.write(nb, path)
        done.append(path)
    return done


def _coalesce_streams(outputs: list) -> list:
    """Merge consecutive stream outputs of the same name: how the kernel chunks stdout varies run to run, and
    the committed bytes must not."""
    merged: list = []
    for out in outputs:
        prev = merged[-1] if merged else None
        if (
            out.get("output_type") == "stream"
            and prev is not None
            and prev.get("output_type") == "stream"
            and prev.get("name") == out.get("name")
        ):
            prev["text"] = prev["text"] + out["text"]
        else:
            merged.append(out)
    return merged


def run(args: argparse.Namespace) -> int:
    from benchmarks.figures import all_figures

    figures = all_figures()
    if args.list:
        print("\n".join(sorted(figures)))
        return 0
    names = args.only or sorted(figures)
    unknown = sorted(set(names) - set(figures))
    if unknown:
        raise SystemExit(f"unknown figure(s) {unknown}; `python -m benchmarks figures --list` lists them")
    if args.execute_notebooks:
        execute_notebooks(ROOT / "notebooks")
    for name in names:
        for path in figures[name](args.out):
            log.info("wrote %s", path.relative_to(args.out.parent) if path.is_relative_to(args.out.parent) else path)
    if not args.only and args.out.resolve() == FIGURES_DIR.resolve():
        from benchmarks.repro.doc_tables import refresh
        from benchmarks.repro.topologies import write_named

        log.info("wrote %s", write_named().relative_to(ROOT))  # the named machines the library's policy reads
        for path in refresh(ROOT):
            log.info("refreshed the tables of %s", path.relative_to(ROOT))
    return 0
