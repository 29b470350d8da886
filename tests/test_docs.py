"""The measured tables of README.md and docs/ are rendered from the committed data (benchmarks.repro.doc_tables), and
docs/measurements.md names every file under figures/data/."""

from __future__ import annotations

import pathlib

from benchmarks.repro import doc_tables

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_table_block_is_what_its_data_renders():
    assert doc_tables.stale(ROOT) == [], "run `python -m benchmarks figures` and commit the refreshed docs"


def test_every_table_block_names_a_table_and_every_table_is_used():
    used = set()
    for f in doc_tables.DOC_FILES:
        text = (ROOT / f).read_text()
        names = [m.group("name") for m in doc_tables._BLOCK.finditer(text)]
        assert text.count("<!-- table: ") == len(names), f"{f}: a table block without its end marker"
        used.update(names)
    assert used == set(doc_tables.TABLES), set(doc_tables.TABLES) ^ used


def test_render_fills_a_block_and_links_from_the_files_folder():
    text = "a\n<!-- table: r-sweep -->\nold\n<!-- /table -->\nb\n"
    rendered = doc_tables.render(text, "../")
    assert rendered.startswith("a\n<!-- table: r-sweep -->\n| R |") and rendered.endswith("<!-- /table -->\nb\n")
    assert "](../figures/data/waves_r_sweep_h200.csv)" in rendered
    assert doc_tables.render(rendered, "../") == rendered


def test_measurements_name_every_data_file():
    text = (ROOT / "docs" / "measurements.md").read_text()
    files = [p for p in sorted((ROOT / "figures" / "data").iterdir()) if not p.stem.endswith("_quick")]  # CPU smoke
    missing = [p.name for p in files if f"`{p.name}" not in text]
    assert not missing, f"docs/measurements.md does not name: {missing}"


def test_the_headline_caption_quotes_the_data_its_figure_draws():
    """The README's alt text names every model the headline figure draws, and each range its caption quotes is
    the min-max of that variant's rows in the figure's data (figures/data/fig_bench_real.csv)."""
    import csv

    readme = (ROOT / "README.md").read_text()
    alt, caption = readme.split("<!-- table: headline -->\n")[1].split("\n<!-- /table -->")[0].split("\n")
    rows = list(csv.DictReader((ROOT / "figures" / "data" / "fig_bench_real.csv").open()))
    titles = {"flux": "FLUX.1-dev", "wan480": "Wan2.1-T2V-14B 832x480", "wan720": "Wan2.1-T2V-14B 1280x720"}
    for model in {r["model"] for r in rows}:
        assert titles.get(model, "LTX-Video") in alt, f"the alt text leaves out {model}"
    for variant, text in (("ours-rank-local", "at {}x of the bound"), ("diffusers-block", "takes {}x at block")):
        ratios = [float(r["ratio_to_bound"]) for r in rows if r["variant"] == variant]
        span = f"{min(ratios):.3f}-{max(ratios):.3f}"
        assert text.format(span) in caption, f"{variant}: the caption does not quote {span}"
