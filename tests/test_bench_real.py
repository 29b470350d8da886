"""`bench real --quick` on CPU: tiny configs of the real classes, every variant through the public API, real
safetensors, real gloo ranks; the report's structure, every variant of ours equal to resident, the JSON on disk
after every variant (and readable after a kill), the budget, and the published configs' sizes on meta."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from benchmarks.cli import lab_parser as build_parser

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("accelerate")

VARIANTS = (
    "ours-rank-local,ours-fp8,ours-fp8-prequantized,diffusers-block,ours-allgather,ours-bgraph,ours-3-slots,"
    "ranks-2,diffusers-leaf,ours-cold,model-offload"
)


def _args(tmp, *extra: str):
    return build_parser().parse_args(
        [
            "bench",
            "real",
            "--quick",
            "--platform",
            "cpu",
            "--repeats",
            "2",
            "--folder",
            str(tmp / "ckpt"),
            "--out",
            str(tmp / "real_{model}.json"),
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real")
    args = _args(
        tmp, "--models", "flux", "--variants", VARIANTS, "--pipeline", "--touch-host-gb", "0.05", "--block-spans"
    )
    assert args.func(args) == 0
    assert not (tmp / "ckpt" / "flux1-dev-quick").exists()  # deleted when done (no --keep)
    return json.loads((tmp / "real_flux.json").read_text())


@pytest.mark.slow
def test_report_structure(report):
    assert report["command"].startswith("python -m benchmarks bench real") and report["date"] and report["quick"]
    assert report["machine"]["platform"] == "cpu" and report["machine"]["diffusers"] == diffusers.__version__
    assert "--touch-host-gb 0.05" in report["command"] and report["touch_host"]["bytes"] == 50_000_000
    assert report["touch_host"]["s"] > 0
    # --block-spans: the resident row and every timed row of ours is asked for its spans (none on the CPU)
    assert "--block-spans" in report["command"]
    timed = [
        v
        for v in report["model"]["variants"]
        if "forward_s" in v and (v["variant"] == "resident" or v["variant"].startswith("ours-"))
    ]
    assert timed and all(v["forward_profile"] == {"spans": None} for v in timed)
    m = report["model"]
    assert m["name"] == "flux" and m["class"] == "FluxTransformer2DModel" and m["source"].startswith("https://")
    assert m["num_blocks"] == 5 and m["block_bytes"] > 0 and m["checkpoint"]["reused"] is False
    assert [v["variant"] for v in m["variants"]] == ["resident", *VARIANTS.split(","), "pipeline"]
    assert m["bound_s"] == m["resident_s"] > 0 and m["floor"]["floor_s"] > 0 and m["floor"]["copy_bytes"] > 0
    for v in m["variants"]:
        assert v["status"] in ("ok", "skipped"), v
        if v.get("forward_s"):
            assert len(v["forward_s_all"]) == 2 and v["ratio_to_bound"] > 0 and v["finite"]
            assert v["host_rss_bytes"] > 0 and v["peak_device_bytes"] >= 0 and len(v["sha256"]) == 64


@pytest.mark.slow
def test_every_variant_equals_resident(report):
    rows = {v["variant"]: v for v in report["model"]["variants"]}
    want = rows["resident"]["sha256"]
    for name, v in rows.items():
        if name.startswith(("ours-", "diffusers-", "model-")) and v.get("forward_s"):
            assert v["equal_to_resident"] is True, name  # FP8: equal to the fake-quantised resident model
            assert (v["sha256"] == want) is not name.startswith("ours-fp8"), name
    fp8, pre = rows["ours-fp8"], rows["ours-fp8-prequantized"]
    assert pre["sha256"] == fp8["sha256"] and pre["pinned_bytes"] == fp8["pinned_bytes"]  # the quantize command's
    q = report["model"]["quantized_checkpoint"]
    assert q["written_bytes"] < q["source_bytes"] and q["quantize_s"] > 0 and "quantize" in q["command"]
    assert fp8["status"] == "ok" or "quantization" in fp8["reason"]  # runs as soon as the option lands
    for name in ("ours-rank-local", "ours-allgather", "ours-bgraph", "ours-3-slots"):
        assert rows[name]["store"]["copy_s"] > 0 and rows[name]["ready_over_floor"] > 0
    assert rows["ours-3-slots"]["num_slots"] == 3 and rows["diffusers-block"]["use_stream"] is False  # CPU
    whole = rows["model-offload"]  # each forward (warm-up, then 2 timed) split in the move there + forward, and back
    assert len(whole["to_device_and_forward_s_all"]) == len(whole["back_to_host_s_all"]) == 3
    assert all(t > 0 for t in whole["to_device_and_forward_s_all"] + whole["back_to_host_s_all"])
    ranks = rows["ranks-2"]
    assert ranks["equal_to_resident"] and [r["num_shards"] for r in ranks["ranks"]] == [2, 2]
    assert all(r["sha256"] == want for r in ranks["ranks"])
    assert sum(r["arena_bytes"] for r in ranks["ranks"]) >= report["model"]["block_bytes"]
    assert ranks["ready_from"].startswith("the call to load_model") and ranks["phases_s"]["offload.store_s"] > 0
    for r in ranks["ranks"]:  # ready is timed from load_model; what came before it, and each phase, beside it
        assert r["start_s"] > 0 and r["import_s"] >= 0 and r["first_forward_s"] > 0
        assert r["offload"]["total_s"] <= r["offload_s"] and r["store"]["threads"] >= 1
    cold = rows["ours-cold"]
    assert cold["evicted"] == (cold["resident_fraction_after_evict"] < 0.01) and cold["ready_s"] > 0
    assert cold["first_read"]["bytes"] == report["model"]["checkpoint"]["bytes"]
    pipe = rows["pipeline"]
    assert pipe["ours-rank-local"]["equal_to_resident"] is True
    assert pipe["ours-rank-local"]["sha256"] == pipe["resident"]["sha256"]


# The bound of tests/test_fp8_quality.py, one e4m3 rounding of a value. Measured on the quick configs (random
# weights): one forward 4.7% (Flux) and 2.5% (Wan), the Flux pipeline request's images 1.6%.
E4M3_ROUNDING = 2.0**-4


@pytest.mark.slow
def test_every_row_measures_its_error_to_resident(report):
    """Each row's output against resident's, on the host in float64: 0.0 exactly where the bytes are resident's,
    FP8 above 0 and below one e4m3 rounding, for one forward and for the whole pipeline request."""
    rows = {v["variant"]: v for v in report["model"]["variants"]}
    want = rows["resident"]["sha256"]
    assert (rows["resident"]["rel_error_to_resident"], rows["resident"]["cosine_to_resident"]) == (0.0, 1.0)
    for name, v in rows.items():
        if v.get("forward_s"):
            assert (v["rel_error_to_resident"] == 0.0) is (v["sha256"] == want), name
            assert (v["max_abs_error_to_resident"] == 0.0) is (v["sha256"] == want), name
    fp8 = rows["ours-fp8"]
    assert 0.0 < fp8["rel_error_to_resident"] < E4M3_ROUNDING and 0.99 < fp8["cosine_to_resident"] < 1.0, fp8
    assert rows["ranks-2"]["rel_error_to_resident"] == 0.0 and "rel_error_to_resident" not in rows["ours-cold"]
    pipe = rows["pipeline"]
    assert pipe["ours-rank-local"]["rel_error_to_resident"] == 0.0 and "rel_error_to_resident" not in pipe["resident"]
    request = pipe["ours-fp8"]
    assert request["equal_to_resident"] is False and request["finite"] and request["ratio_to_resident"] > 0
    assert 0.0 < request["rel_error_to_resident"] < E4M3_ROUNDING and request["cosine_to_resident"] > 0.99, request


@pytest.mark.slow
def test_the_file_holds_every_finished_variant_and_survives_a_kill(tmp_path):
    """Killed (SIGKILL) once two variants are on disk: the file is whole JSON and holds them."""
    out = tmp_path / "real_{model}.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "bench",
        "real",
        "--quick",
        "--platform",
        "cpu",
        "--models",
        "wan480",
        "--repeats",
        "2",
        "--variants",
        "ours-rank-local,ours-allgather,ours-3-slots,diffusers-block,ranks-2",
        "--folder",
        str(tmp_path / "ckpt"),
        "--out",
        str(out),
    ]
    path = tmp_path / "real_wan480.json"
    seen: list[list[str]] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists():
                names = [v["variant"] for v in json.loads(path.read_text())["model"]["variants"]]
                if not seen or seen[-1] != names:
                    seen.append(names)
                if len(names) >= 3:
                    break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    names = [v["variant"] for v in json.loads(path.read_text())["model"]["variants"]]
    assert names[:3] == ["resident", "ours-rank-local", "ours-allgather"]
    # Each write added one variant: the file went through every prefix (those that lived long enough to be seen).
    assert all(s == names[: len(s)] for s in seen)


@pytest.mark.slow
def test_the_budget_skips_what_would_not_finish(tmp_path):
    """A budget too small for a model's checkpoint skips the model; once a model runs, a variant that would end past
    the deadline is skipped (recorded with the reason), and the file says so."""
    from benchmarks.bench.real import _write
    from benchmarks.bench.real_models import MODELS
    from benchmarks.bench.real_run import ModelRun
    from dlo_fn.runtime.dist import init_distributed
    from dlo_fn.runtime.platform import platform_for

    args = _args(tmp_path, "--models", "ltx", "--variants", "ours-rank-local", "--budget-s", "0.001")
    assert args.func(args) == 0
    model = json.loads((tmp_path / "real_ltx.json").read_text())["model"]
    assert model["skipped"].startswith("budget") and model["variants"] == []

    path = tmp_path / "run.json"
    mr = ModelRun(
        init_distributed(platform_for("cpu")),
        MODELS["ltx"],
        tmp_path / "ckpt" / "ltx",
        args,
        deadline=None,
        write=lambda entry: _write({"quick": True}, entry, path),
    )
    mr.prepare(["ours-rank-local", "diffusers-block"])
    mr.deadline = time.perf_counter() + 0.5 * mr.estimate("ours-rank-local")
    mr.one("ours-rank-local")
    mr.one("diffusers-block")
    rows = json.loads(path.read_text())["model"]["variants"]
    assert [(v["variant"], v["status"]) for v in rows] == [
        ("resident", "ok"),
        ("ours-rank-local", "skipped"),
        ("diffusers-block", "skipped"),
    ]
    assert all(v["reason"].startswith("budget: needs ~") for v in rows[1:])


def test_bad_arguments_are_one_line(tmp_path):
    with pytest.raises(SystemExit, match="unknown --models"):
        _args(tmp_path, "--models", "flux,sdxl").func(_args(tmp_path, "--models", "flux,sdxl"))
    args = build_parser().parse_args(["bench", "real", "--quick", "--models", "flux,ltx", "--out", "x.json"])
    with pytest.raises(SystemExit, match=r"put \{model\} in the path"):
        args.func(args)


PUBLISHED = {  # blocks, block bytes (bf16; fp32 where the class keeps it), latent tokens per batch row
    "flux": (57, 23_674_566_656, 4096),
    "wan480": (40, 28_114_821_120, 14040),
    "wan720": (40, 28_114_821_120, 32400),
    "ltx": (28, 3_760_734_208, 7392),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_on_meta(name):
    from benchmarks.bench.real_models import MODELS, forward_inputs, tokens_per_row
    from dlo_fn.io.diffusers_load import _meta_build, block_paths_for
    from dlo_fn.plan.spec import spec_from_module

    case = MODELS[name]
    model = _meta_build(getattr(diffusers, case.cls), case.config, torch.bfloat16)
    spec = spec_from_module(model, block_paths_for(model), name=case.cls)
    assert (spec.num_blocks, spec.total_block_bytes, tokens_per_row(case, False)) == PUBLISHED[name]
    x = forward_inputs(case, False, torch.device("meta"))["hidden_states"]
    per_row = x.shape[1] if x.dim() == 3 else x[0, 0].numel() // 4  # Wan: patches of 1x2x2
    assert x.shape[0] == case.workload["batch"] and per_row == PUBLISHED[name][2]


def test_flux_pipeline_component_configs_on_meta():
    transformers = pytest.importorskip("transformers")
    from benchmarks.bench.real_pipeline import CLIP_L, FLUX_VAE, T5_XXL

    with torch.device("meta"):
        clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(**CLIP_L))
        t5 = transformers.T5EncoderModel(transformers.T5Config(**T5_XXL))
        vae = diffusers.AutoencoderKL(**FLUX_VAE)
    count = [sum(p.numel() for p in m.parameters()) for m in (clip, t5, vae)]
    assert count == [123_060_480, 4_762_310_656, 83_819_683]


@pytest.mark.slow
def test_figure_from_the_report_is_deterministic(report, tmp_path):
    from benchmarks.figures.real import find_real_reports, plot_bench_real, real_rows

    data = tmp_path / "data"
    data.mkdir()
    report = dict(report, machine=dict(report["machine"], device_name="NVIDIA H200"))
    for name in (
        "bench_real_flux_nvidia-h200.json",
        "bench_real_flux_nvidia-h200_quick.json",
        "bench_real_flux_cpu.json",
        "bench_real_ltx_nvidia-h200.json",
    ):
        model = dict(report["model"], name=name.split("_")[2])
        (data / name).write_text(json.dumps(dict(report, model=model)))
    # A row measured in a run of its own joins its model's, without that run's resident row.
    extra = [
        dict(v, variant="model-offload") if v["variant"] == "ours-rank-local" else v
        for v in report["model"]["variants"]
        if v["variant"] in ("resident", "ours-rank-local")
    ]
    (data / "bench_real_flux_model_offload_nvidia-h200.json").write_text(
        json.dumps(dict(report, model=dict(report["model"], name="flux", variants=extra)))
    )
    found = find_real_reports(data)  # the machine with the most models, in model order; quick runs ignored
    assert [r["model"]["name"] for r in found] == ["flux", "ltx"]
    flux = [v["variant"] for v in found[0]["model"]["variants"]]
    assert flux == [v["variant"] for v in report["model"]["variants"]] + ["model-offload"]
    first = plot_bench_real(found, tmp_path / "a")
    second = plot_bench_real(found, tmp_path / "b")
    assert [p.name for p in first] == ["fig_bench_real.png", "fig_bench_real.csv"]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(first, second))
    timed = [v for v in report["model"]["variants"] if v.get("forward_s") and not v["variant"].startswith("ours-fp8")]
    assert len(real_rows(found)) == 2 * len(timed) + 1


def test_adapter_rows(tmp_path):
    """ours-lora(-fp8): adapters loaded, switched and removed after offload; the forward with the adapter equals
    the resident model's with it (resident-lora), which differs from the resident model's without."""
    args = _args(tmp_path, "--models", "flux", "--variants", "ours-lora,ours-lora-fp8")
    assert args.func(args) == 0
    rows = {v["variant"]: v for v in json.loads((tmp_path / "real_flux.json").read_text())["model"]["variants"]}
    assert list(rows) == ["resident", "resident-lora", "ours-lora", "ours-lora-fp8"]
    assert rows["resident-lora"]["sha256"] != rows["resident"]["sha256"]
    assert rows["ours-lora"]["sha256"] == rows["resident-lora"]["sha256"]
    for name in ("ours-lora", "ours-lora-fp8"):
        v = rows[name]
        assert v["status"] == "ok" and v["equal_to_resident"] is True and v["adapter_rank"] == 4, v
        assert len(v["adapter_load_s_all"]) == 2 and len(v["adapter_switch_s_all"]) == 4 and v["adapter_unload_s"] > 0
        assert v["pinned_bytes_after_adapters"] == v["pinned_bytes_before_adapters"] and v["ratio_to_bound"] > 0
        assert len(v["forward_s_all_without_adapter"]) == 2 and v["profile"] == {  # the profile is CUDA's
            "without_adapter": None,
            "with_adapter": None,
        }


@pytest.mark.slow
def test_budget_variants_equal_resident(tmp_path):
    """The HBM-budget rows (BF16 and FP8) and accelerate's device map: on the quick configs every budget holds
    the whole model, so ours runs resident (nothing pinned) and equals resident (FP8: the fake-quantised one)."""
    names = "ours-hbm-12GB,ours-fp8-hbm-6GB,ours-hbm-fastest,ours-fp8-hbm-fastest,accelerate-16GiB"
    args = _args(tmp_path, "--models", "flux", "--variants", names)
    assert args.func(args) == 0
    rows = {v["variant"]: v for v in json.loads((tmp_path / "real_flux.json").read_text())["model"]["variants"]}
    for name in names.split(","):
        assert rows[name]["status"] == "ok" and rows[name]["equal_to_resident"] is True, rows[name]
    for name in ("ours-hbm-12GB", "ours-fp8-hbm-6GB"):
        row = rows[name]
        assert row["resident_blocks"] == row["num_blocks"] == 5 and row["pinned_bytes"] == 0 and row["num_slots"] == 0
    for name in ("ours-hbm-12GB", "ours-fp8-hbm-6GB", "ours-hbm-fastest", "ours-fp8-hbm-fastest"):
        row = rows[name]  # placed by the measured compute, with the plan's predicted pass beside the measured one
        assert row["placed_by"].startswith("measured compute") and len(row["block_compute_s"]) == 5, row
        assert row["predicted_pass_s"] >= row["blocks_compute_s"] > 0 and row["predicted_to_compute"] >= 1
    for name in ("ours-hbm-fastest", "ours-fp8-hbm-fastest"):  # the fastest point's plan is predicted at speed
        assert rows[name]["predicted_to_compute"] <= 1.01 and rows[name]["plan_num_slots"] in (2, 3, 4)
    assert rows["ours-hbm-12GB"]["sha256"] == rows["resident"]["sha256"] != rows["ours-fp8-hbm-6GB"]["sha256"]
    assert rows["accelerate-16GiB"]["weight_device_bytes"] > 0


def test_a_profiled_forward_is_summarised_per_stream_and_block(tmp_path):
    """benchmarks.bench.trace.summarize_trace on a Chrome trace as torch.profiler writes it: two blocks on the
    compute stream (each from its attention kernel), two H2D copies on a copy stream, one dequantise kernel."""
    from benchmarks.bench.trace import summarize_trace

    def ev(cat, name, stream, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    trace = tmp_path / "trace.json"
    events = [
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 0, 400),  # the load of block 0 ...
        ev("kernel", "dequant_rows", 21, 400, 50),
        ev("kernel", "flash_fprop", 7, 450, 100),  # block 0: attention, then a matmul
        ev("kernel", "gemm", 7, 550, 200),
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 400, 600),  # ... of block 1, longer than compute
        ev("kernel", "flash_fprop", 7, 1000, 100),  # block 1 waited 250 us on its load
        ev("kernel", "gemm", 7, 1100, 100),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},  # host ops are not device time
    ]
    trace.write_text(json.dumps({"traceEvents": events}))
    s = summarize_trace(trace)
    roles = {k: v["role"] for k, v in s["streams"].items()}
    assert roles == {"20": "h2d", "21": "allgather", "7": "compute"}
    assert s["span_s"] == pytest.approx(1200e-6) and s["compute_busy_s"] == pytest.approx(500e-6)
    # compute idle: 0-450 (the first load, then the dequantise) and 750-1000 (the second load)
    assert s["compute_idle_s"] == pytest.approx(700e-6) and s["compute_idle_transfer_busy_s"] == pytest.approx(700e-6)
    assert s["block_compute_s"] == pytest.approx([300e-6, 200e-6]) and s["h2d_s"] == pytest.approx([400e-6, 600e-6])
