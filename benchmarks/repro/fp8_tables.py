"""FP8 shards in numbers: the plan's bytes, the quantised schedule simulated on measured H200 inputs, and the
output error measured on the reference DiT (notebook 11, docs/measurements.md).

* :func:`byte_rows` - one model's plan at ``W = 1`` (rank-local, ``S`` slots) in BF16 and with FP8 shards: a block
  as stored (FP8 weights, their scales, what stays as it is) against the block as computed, and what the host,
  the H2D copies and the device hold;
* :func:`h200_passes` - one image step of the bench model (24 blocks of 0.56 GB) simulated in BF16 and with FP8
  shards, from the inputs one H200 run measured (``FP8_STEP_FILE``: its resident step, its pinned H2D peak), the
  dequantise op at the device's copy traffic (:func:`dlo_fn.plan.quant.dequant_seconds`); :func:`pass_rows` sets
  each beside the step that run measured;
* :func:`quality_rows` - ``bench fp8-quality``'s rows (``QUALITY_FILE``): offloaded FP8 against resident BF16.
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.repro.data import DATA_DIR
from dlo_fn.plan.layout import block_layout, model_layout
from dlo_fn.plan.quant import FP8_DTYPE, SCALE_SUFFIX, dequant_seconds, stored_block
from dlo_fn.plan.spec import ModelSpec
from dlo_fn.plan.timeline import Timeline

__all__ = ["QUALITY_FILE", "FP8_STEP_FILE", "byte_rows", "h200_passes", "pass_rows", "quality_rows", "load"]

QUALITY_FILE = "fp8_quality_tiny_cpu.json"
FP8_STEP_FILE = "fp8_torch_dequant_bench_step_nvidia-h200.json"
_STEP_VARIANTS = {"BF16": "dlo-rank-local-swap", "FP8": "dlo-rank-local-swap-fp8"}


def load(name: str) -> dict[str, Any]:
    return json.loads((DATA_DIR / name).read_text())


def _parts(block) -> dict[str, int]:
    """Bytes of a stored block's FP8 weights, their scales and the tensors kept as they are."""
    fp8 = {t.name for t in block.tensors if t.dtype == FP8_DTYPE}
    out = {"fp8": 0, "scales": 0, "kept": 0}
    for t in block.tensors:
        key = "fp8" if t.name in fp8 else "scales" if t.name.removesuffix(SCALE_SUFFIX) in fp8 else "kept"
        out[key] += t.nbytes
    return out


def byte_rows(spec: ModelSpec, num_slots: int = 2) -> list[dict[str, Any]]:
    """Item, formula, BF16 and FP8 bytes of ``spec``'s plan at ``W = 1`` (block 0 for the per-block rows)."""
    plain, q = model_layout(spec, 1), model_layout(spec, 1, quantization="fp8")
    block, parts = spec.blocks[0], _parts(stored_block(spec.blocks[0]))
    kept = parts["kept"]
    rows = [
        ("block 0: 2-D weights", "1 B per element (FP8), 2 B (BF16)", block_layout(block).nbytes - kept, parts["fp8"]),
        ("block 0: scales", "4 B per output channel", 0, parts["scales"]),
        ("block 0: kept as they are", "norms, biases: 1-D", kept, kept),
        ("stored block n_0", "the above, packed at 64 B", plain.shards[0].block.nbytes, q.shards[0].block.nbytes),
        ("compute block c_0", "what a slot holds", plain.compute_block(0).nbytes, q.compute_block(0).nbytes),
        ("host arena = pinned = H2D per pass", "sum_b n_b", plain.shard_bytes_per_rank, q.shard_bytes_per_rank),
        ("slot", "max_b c_b", plain.slot_bytes, q.slot_bytes),
        ("staging buffer per slot", "max_b n_b (FP8 only)", 0, q.max_padded_block_bytes),
        (
            "device weight bytes",
            "S (slot + staging)",
            num_slots * plain.slot_bytes,
            num_slots * (q.slot_bytes + q.max_padded_block_bytes),
        ),
    ]
    return [
        {"item": item, "formula": formula, "BF16": bf16, "FP8": fp8, "FP8 / BF16": f"{fp8 / bf16:.3f}" if bf16 else "-"}
        for item, formula, bf16, fp8 in rows
    ]


def _image(report: dict) -> dict:
    workload = next(w for w in report["workloads"] if w["name"] == "image")
    return {r["variant"]: r for r in workload["variants"]}


def h200_passes(num_slots: int = 2) -> dict[str, Timeline]:
    """The bench model's image step (one pass, rank-local, warm: as a denoising loop runs it), BF16 and FP8,
    simulated from ``FP8_STEP_FILE``'s measured inputs: compute per block = its resident step / blocks, H2D at its
    pinned peak, the dequantise op reading the stored block and writing the slot at the H200's device copy traffic."""
    from dlo_fn.cost.ceilings import H200_D2D_COPY_BYTES_PER_S, H200_D2D_TRAFFIC_BYTES_PER_S
    from dlo_fn.models.specs import config_spec
    from dlo_fn.plan.schedule import Ring
    from dlo_fn.plan.sizes import ModelSizes
    from dlo_fn.plan.timeline import bandwidth_durations, simulate

    report = load(FP8_STEP_FILE)
    sizes = ModelSizes.from_spec(config_spec(report["config"]), quantization="fp8")
    n = sizes.num_blocks
    compute_s = _image(report)["resident"]["step_s"] / n
    out = {}
    for name, moved in (("BF16", sizes.block_bytes), ("FP8", sizes.stored_block_bytes)):
        quantized = name == "FP8"
        ring = Ring.cold(n, num_slots=num_slots, mode="rank-local", quantized=quantized)
        schedule = ring.after(ring.next_schedule(1)).next_schedule(1)  # a warm step: the step before prefetched
        dequant = [dequant_seconds(s, c, H200_D2D_TRAFFIC_BYTES_PER_S) for s, c in zip(moved, sizes.block_bytes)]
        durations = bandwidth_durations(
            n,
            h2d_bytes=moved,
            allgather_bytes=0.0,
            compute_s=compute_s,
            h2d_bytes_per_s=report["pinned_h2d_peak_bytes_per_s"],
            allgather_bytes_per_s=H200_D2D_COPY_BYTES_PER_S,
            dequant_s=dequant if quantized else None,
        )
        out[name] = simulate(
            schedule, durations, meta=(("model", report["config"]), ("workload", "image"), ("weights", name))
        )
    return out


def pass_rows(passes: dict[str, Timeline]) -> list[dict[str, str]]:
    """Per pass: simulated step, its lanes' busy time, and the step measured in the same H200 run."""
    measured = _image(load(FP8_STEP_FILE))
    return [
        {
            "weights": name,
            "simulated ms": f"{1e3 * tl.makespan_s:.1f}",
            "H2D busy ms": f"{1e3 * tl.busy_s('h2d'):.1f}",
            "DQ busy ms": f"{1e3 * tl.busy_s('allgather'):.1f}",
            "compute busy ms": f"{1e3 * tl.busy_s('compute'):.1f}",
            "measured ms": f"{1e3 * measured[_STEP_VARIANTS[name]]['step_s']:.1f}",
        }
        for name, tl in passes.items()
    ]


def quality_rows(name_or_rows: str | list[dict] = QUALITY_FILE) -> list[dict[str, str]]:
    """``bench fp8-quality``'s rows (a committed file, or the row dicts of a run): each output's error against
    BF16 and its equality with fake_quantize."""
    rows = load(name_or_rows)["rows"] if isinstance(name_or_rows, str) else name_or_rows
    return [
        {
            "output": r["output"],
            "elements": f"{r['num_elements']:,d}",
            "rel L2": f"{r['rel_l2']:.4f}",
            "max abs": f"{r['max_abs']:.4g}",
            "cosine": f"{r['cosine']:.6f}",
            "equal to fake_quantize": "-" if (eq := r["equal_to_fake_quantized"]) is None else str(eq),
        }
        for r in rows
    ]
