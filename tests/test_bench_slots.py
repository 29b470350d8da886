"""`bench slots` on the CPU: every row byte-identical to resident, the row's latency the median of its waves."""

from __future__ import annotations

import csv
import json
import statistics

from benchmarks.cli import main


def test_bench_slots_rows_are_medians_of_their_waves(tmp_path):
    out = tmp_path / "slots.csv"
    assert (
        main(
            [
                "bench",
                "slots",
                "--config",
                "tiny",
                "--platform",
                "cpu",
                "--workloads",
                "image",
                "--height",
                "32",
                "--width",
                "32",
                "--steps",
                "2",
                "--repeats",
                "3",
                "--modes",
                "rank-local",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = list(csv.DictReader(out.open()))
    side = json.loads(out.with_suffix(".json").read_text())
    waves = side["workloads"]["image"]["waves"]
    assert rows and all(r["identical_to_resident"] == "True" for r in rows)
    assert "--repeats 3" in side["command"]
    for r in rows:
        every = waves[f"{r['mode']} S{r['slots']}"]
        # The CSV holds 6 significant digits (bench slots writes floats as %.6g).
        assert len(every) == 3 and r["wave_latency_s"] == f"{statistics.median(every):.6g}"
