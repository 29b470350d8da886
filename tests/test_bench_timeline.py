"""`bench timeline` stores a measured run that the figure replays from the file alone."""

from __future__ import annotations

import json

from benchmarks.cli import main
from benchmarks.repro.timeline_tables import measured_vs_predicted
from dlo_fn.plan.compare import check_against_schedule, schedule_from_params


def test_recording_rebuilds_its_schedule_and_replays(tmp_path, capsys):
    out = tmp_path / "measured.json"
    assert main(["bench", "timeline", "--steps", "1", "--mode", "rank-local", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert {"machine", "command", "date", "schedule", "trace"} <= set(record)
    assert record["command"].startswith("python -m benchmarks bench timeline")
    measured, predicted, _ = measured_vs_predicted(out)
    schedule = schedule_from_params(record["schedule"])
    assert check_against_schedule(measured, schedule)
    assert sorted(s.op for s in predicted.spans) == sorted(s.op for s in measured.spans)
    # The replay respects the schedule too, and a recording of another schedule would not.
    assert check_against_schedule(predicted, schedule)
    other = schedule_from_params({**record["schedule"], "num_steps": 2})
    assert not check_against_schedule(measured, other)
