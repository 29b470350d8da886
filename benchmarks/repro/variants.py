"""The benchmark variants, one table per bench: the name a run writes in its JSON, what the tables call it, what the
figures call it, and (``bench real``'s variants of ours) the ``offload()`` keyword arguments it runs.

The benches (:mod:`benchmarks.bench.real_variants`, :mod:`benchmarks.bench.step_variants`), the tables
(:mod:`benchmarks.repro.real_tables`, :mod:`benchmarks.repro.doc_tables`) and the figures
(:mod:`benchmarks.figures.real`, :mod:`benchmarks.figures.bench`) all read these rows; a variant is added here once.
A table leaves out a variant without a ``label``; a figure names one without a ``short`` by its name.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Variant", "REAL", "STEP", "labels", "short_labels"]


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    label: str | None = None  # in the tables (docs/measurements.md, docs/performance.md); None: not tabled
    short: str | None = None  # on a figure's axis; None: the name
    options: dict | None = None  # offload() keyword arguments: a variant of ours
    runs: bool = True  # False: the bench no longer has it; named for the committed data that holds it


# `bench real`, in run order: most important first, so a run cut short keeps what matters; "resident" runs first.
REAL = (
    Variant("resident", "resident", "resident (all on the GPU)"),
    Variant("ours-rank-local", "ours, 2 slots", "ours: 2 slots", dict(mode="rank-local")),
    Variant("ours-fp8", "ours, FP8 shards (2 slots)", None, dict(mode="rank-local", quantization="fp8")),
    Variant("diffusers-block", "diffusers group offloading, block_level + stream", "diffusers group offload, block"),
    # W = 1: the plan lowers it to the rank-local program
    Variant("ours-allgather", "ours, allgather (W = 1)", "ours: allgather, W=1", dict(mode="allgather")),
    Variant("ours-bgraph", "ours, block graphs", "ours: block graphs", dict(mode="rank-local", graph="block")),
    Variant("ours-3-slots", "ours, 3 slots", "ours: 3 slots", dict(mode="rank-local", num_slots=3)),
    # the policy's choice (its first call measures the blocks)
    Variant("ours-auto", "ours, the policy's choice", "ours: policy's choice", dict(mode="auto", num_slots="auto")),
    Variant(
        "ours-fp8-auto",
        "ours, FP8 shards, the policy's choice",
        None,
        dict(mode="auto", num_slots="auto", quantization="fp8"),
    ),
    # from `quantize`'s folder (benchmarks.bench.real_variants.PREQUANTIZED)
    Variant(
        "ours-fp8-prequantized",
        "ours, FP8 shards from a pre-quantised checkpoint (2 slots)",
        None,
        dict(mode="rank-local", quantization="fp8"),
    ),
    Variant("ours-lora", options=dict(mode="rank-local")),  # + adapters loaded after offload (bench real_lora)
    Variant("ours-lora-fp8", options=dict(mode="rank-local", quantization="fp8")),
    Variant("ours-lora-fp8-3-slots", options=dict(mode="rank-local", quantization="fp8", num_slots=3)),
    # HBM budgets that emulate 12 to 24 GB cards (device weight bytes; plan.resident), BF16 and FP8
    *(Variant(f"ours-hbm-{n}GB", options=dict(mode="rank-local", hbm_budget=f"{n}GB")) for n in (12, 16, 18, 20, 24)),
    Variant("ours-hbm-16GB-3-slots", options=dict(mode="rank-local", hbm_budget="16GB", num_slots=3)),
    # the model's fastest point: the least device bytes predicted within 1% of its compute (plan.resident.at_speed)
    Variant("ours-hbm-fastest", options=dict(mode="rank-local", hbm_budget="fastest", num_slots="auto")),
    Variant(
        "ours-fp8-hbm-fastest",
        options=dict(mode="rank-local", quantization="fp8", hbm_budget="fastest", num_slots="auto"),
    ),
    *(
        Variant(f"ours-fp8-hbm-{n}GB", options=dict(mode="rank-local", quantization="fp8", hbm_budget=f"{n}GB"))
        for n in (6, 8, 10, 12)
    ),
    *(  # the same budgets without the device-stored tier (the placement without the device's copy rate)
        Variant(
            f"ours-fp8-hbm-{n}GB-host-only",
            options=dict(mode="rank-local", quantization="fp8", hbm_budget=f"{n}GB", device_tier=False),
        )
        for n in (6, 8)
    ),
    # accelerate's device map at a device budget (the peer users reach for): max_memory of device 0 in the name
    Variant("accelerate-12GiB"),
    Variant("accelerate-16GiB"),
    Variant("ranks-2"),
    Variant("ranks-4"),
    Variant("diffusers-leaf", "diffusers group offloading, leaf_level + stream", "diffusers group offload, leaf"),
    Variant("ours-cold", "ours, cold page cache"),
    Variant("model-offload", "whole-model offload (enable_model_cpu_offload's hook)", "whole-model offload"),
    Variant("pipeline"),
)

# `bench step`, in the order it lists them.
STEP = (
    Variant("resident", "resident (every weight on the GPU)", "resident (no offload)"),
    Variant("dlo-rank-local", "ours, eager, `functional_call` block call", "ours: H2D into 2 slots"),
    Variant("dlo-allgather", "ours, allgather (W = 1)", "ours: allgather W=1 (= H2D into slots)"),
    Variant("dlo-rank-local-swap", "ours, eager (2 slots)", "ours: swap call"),
    Variant("dlo-rank-local-bgraph", "ours, block graphs", "ours: 2 slots, block graphs"),
    Variant("dlo-allgather-bgraph", None, "ours: allgather W=1, block graphs"),
    Variant("diffusers", "diffusers group offloading (block_level, stream)", "diffusers group offload"),
    Variant("diffusers-record-stream", "diffusers group offloading, record_stream", "diffusers, record_stream"),
    Variant("naive-sync", "synchronous copy per block", "naive sync per block"),
    Variant("resident-compile", "resident, compiled blocks", "resident, torch.compile"),
    Variant("dlo-rank-local-compile", "ours, compiled blocks", "ours: 2 slots, torch.compile"),
    Variant("resident-graph"),
    Variant("dlo-rank-local-swap-g2", "ours, load groups of 2 (4 slots)", "ours: load groups of 2 (4 slots)"),
    Variant("dlo-rank-local-swap-g4", "ours, load groups of 4 (8 slots)", "ours: load groups of 4 (8 slots)"),
    Variant("dlo-rank-local-g2", "ours, `functional_call`, load groups of 2", "ours: functional_call, groups of 2"),
    Variant("resident-fp8"),
    Variant("dlo-rank-local-swap-fp8"),
    Variant("dlo-allgather-swap-fp8"),
    # step graphs: measured by earlier runs whose data is still committed; the runtime no longer has them
    Variant("dlo-rank-local-graph", "step graph (not in the runtime)", "ours: 2 slots, CUDA graph", runs=False),
    Variant(
        "dlo-allgather-graph",
        "step graph, allgather (not in the runtime)",
        "ours: allgather W=1, CUDA graph",
        runs=False,
    ),
)


def labels(table: tuple[Variant, ...]) -> dict[str, str]:
    """Name -> table label, for the variants a table shows."""
    return {v.name: v.label for v in table if v.label is not None}


def short_labels(table: tuple[Variant, ...]) -> dict[str, str]:
    """Name -> figure label, for the variants with one (a figure names the others by their name)."""
    return {v.name: v.short for v in table if v.short is not None}
