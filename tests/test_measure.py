"""Measured timelines of the tiny reference DiT (CPU, real 1-rank gloo group) against their schedule; duration
fitting and simulation of the same schedule; Chrome trace round trip (benchmarks/measure.py, plan/compare.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

import pytest
import torch
import torch.distributed as dist

from benchmarks.measure import record_run
from dlo_fn.plan.compare import KindDurations, check_against_schedule, fit_durations, single_run
from dlo_fn.plan.ops import Op
from dlo_fn.plan.schedule import build_schedule
from dlo_fn.plan.timeline import Span, Timeline, simulate
from dlo_fn.plan.trace import from_chrome_trace, to_chrome_trace


# (mode, warm-up steps): a warm run after a warm-up request, and a cold first run.
@pytest.fixture(scope="module", params=[("allgather", 1), ("rank-local", 0)], ids=["allgather-warm", "rank-local-cold"])
def recorded(request):
    torch.set_num_threads(1)
    mode, warmup_steps = request.param
    schedule, measured = record_run("tiny", steps=2, mode=mode, warmup_steps=warmup_steps)
    assert schedule.warm_start == bool(warmup_steps) and schedule.num_steps == 2
    return schedule, measured


def test_measured_run_has_every_op_in_stream_order(recorded):
    schedule, measured = recorded
    assert not (dist.is_available() and dist.is_initialized())  # the 1-rank group was torn down
    assert sorted(s.op for s in measured.spans) == sorted(schedule.to_strs())
    assert dict(measured.meta)["source"] == "measured" and dict(measured.meta)["mode"] == schedule.mode
    for stream in ("h2d", "allgather", "compute"):
        got = [s.op for s in sorted(measured.spans_of(stream), key=lambda s: s.start_s)]
        assert got == [str(op) for op in schedule.ops if op.stream == stream], stream


def test_each_measured_op_starts_after_its_deps_end(recorded):
    schedule, measured = recorded
    span = {s.op: s for s in measured.spans}
    ops = schedule.to_strs()
    for i, deps in enumerate(schedule.deps):
        for d in deps:
            assert span[ops[i]].start_s >= span[ops[d]].end_s, (ops[i], ops[d])
    agreement = check_against_schedule(measured, schedule)
    assert agreement and agreement.num_ops == len(ops) and agreement.problems == ()


def test_check_catches_an_op_run_before_its_wait(recorded):
    schedule, measured = recorded
    i = next(i for i, deps in enumerate(schedule.deps) if deps and schedule.ops[i].kind == "C")
    d = schedule.deps[i][0]
    name, dep = str(schedule.ops[i]), str(schedule.ops[d])
    dep_span = next(s for s in measured.spans if s.op == dep)
    early = dep_span.end_s - 1e-3  # the compute starts 1 ms before its load has landed
    spans = tuple(
        dataclasses.replace(s, start_s=early, end_s=early + s.duration_s) if s.op == name else s for s in measured.spans
    )
    agreement = check_against_schedule(Timeline(spans, measured.meta), schedule)
    assert not agreement.deps_respected and not agreement
    assert any(name in p and dep in p for p in agreement.problems)


def test_check_catches_missing_and_reordered_ops(recorded):
    schedule, measured = recorded
    short = Timeline(measured.spans[:-1], measured.meta)
    result = check_against_schedule(short, schedule)
    assert not result.same_order and f"{measured.spans[-1].op} not measured" in result.problems
    computes = sorted(measured.spans_of("compute"), key=lambda s: s.start_s)
    a, b = computes[0], computes[1]
    swapped = {a.op: dataclasses.replace(a, op=b.op), b.op: dataclasses.replace(b, op=a.op)}
    reordered = Timeline(tuple(swapped.get(s.op, s) for s in measured.spans), measured.meta)
    assert not check_against_schedule(reordered, schedule).same_order


def test_fit_is_the_median_per_kind_and_simulates_the_same_schedule(recorded):
    schedule, measured = recorded
    fit = fit_durations(measured)
    for kind, value in (("H2D", fit.h2d_s), ("AG", fit.allgather_s), ("C", fit.compute_s)):
        durations = [s.duration_s for s in measured.spans if s.op.split(" ", 1)[0] == kind]
        assert value == (statistics.median(durations) if durations else None), kind
    predicted = simulate(schedule, fit)
    assert [s.op for s in predicted.spans] == list(schedule.to_strs())
    assert check_against_schedule(predicted, schedule)
    # end - start of a simulated span is the fitted duration up to the rounding of start + duration.
    assert all(math.isclose(s.duration_s, fit(Op.from_str(s.op)), rel_tol=1e-9, abs_tol=1e-15) for s in predicted.spans)


def test_measured_trace_round_trips(recorded, tmp_path):
    _, measured = recorded
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(to_chrome_trace(measured)))
    assert from_chrome_trace(json.loads(path.read_text())) == measured


def test_plot_overlay_draws_both(recorded):
    import matplotlib.pyplot as plt

    from benchmarks.figures.timeline import plot_overlay

    schedule, measured = recorded
    fig = plot_overlay(measured, simulate(schedule, fit_durations(measured)))
    try:
        assert len(fig.axes[0].patches) == 2 * len(measured.spans)
    finally:
        plt.close(fig)


def test_plot_beside_draws_each_timeline_on_its_own_axes_from_zero(recorded):
    import matplotlib.pyplot as plt

    from benchmarks.figures.timeline import plot_beside

    schedule, measured = recorded
    predicted = simulate(schedule, fit_durations(measured))
    fig = plot_beside(measured, predicted)
    try:
        top, bottom = fig.axes
        assert len(top.patches) == len(measured.spans) and len(bottom.patches) == len(predicted.spans)
        assert min(p.get_x() for p in top.patches) == 0.0  # the measured run starts at its first op
    finally:
        plt.close(fig)


def test_fit_on_known_spans_and_missing_kind():
    tl = Timeline.from_records(
        [
            ("H2D k0 b0>s0", "h2d", 0.0, 1.0),
            ("H2D k1 b1>s1", "h2d", 1.0, 4.0),
            ("H2D k2 b0>s0", "h2d", 4.0, 6.0),
            ("C k0 b0@s0 r0", "compute", 1.0, 1.5),
            ("host work", "compute", 0.0, 9.0),
        ]
    )
    fit = fit_durations(tl)
    assert fit == KindDurations(2.0, None, 0.5)
    with pytest.raises(ValueError, match="no measured AG"):
        fit(Op.from_str("AG k0 b0 l0>s0"))
    with pytest.raises(ValueError, match="no schedule ops"):
        fit_durations(Timeline((Span("host work", "compute", 0.0, 1.0),)))


def test_single_run_picks_one_run_and_strips_its_prefix():
    sch = build_schedule(2, 1, mode="rank-local")
    one = simulate(sch, lambda op: 1.0)
    both = Timeline(tuple(dataclasses.replace(s, op=f"run{j} {s.op}") for j in (0, 1) for s in one.spans))
    with pytest.raises(ValueError, match="pass run="):
        single_run(both)
    with pytest.raises(ValueError, match="not run 5"):
        single_run(both, 5)
    assert [s.op for s in single_run(both, 1).spans] == list(sch.to_strs())
    with pytest.raises(ValueError, match="run prefix"):
        check_against_schedule(both, sch)
    assert single_run(one) is one


def test_record_run_refuses_resident_and_bad_steps():
    with pytest.raises(ValueError, match="resident"):
        record_run("tiny", steps=1, mode="resident")
    with pytest.raises(ValueError, match="steps"):
        record_run("tiny", steps=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        record_run("tiny", warmup_steps=-1)
