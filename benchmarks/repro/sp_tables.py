"""The tables of notebook 08 (sequence parallelism on a dp x sp mesh): the rank table, the per-rank memory table,
the committed per-rank host and HBM measurements against the plan, and Figure 4's DLO+SP rows.

Models and workload, stated once: Nano and Super are the reference configs (``cosmos3-nano`` / ``cosmos3-super``);
720p 10 s is 1280x720, 81 frames = 75600 tokens, one sequence per pass (``ceilings.VIDEO_720P_10S``). Nano's 30
heads do not split over 4 sp ranks, so its sp-4 rows use 32 heads of 120 channels at the same widths (``@32``;
block bytes differ by the qk-norm weights, 128 B per block). Measured files (``figures/data/``):
``sp_hbm_nvidia-h200.json`` (``bench sp-hbm``: sp ranks sharing one H200 over gloo; their wall times are not
performance figures) and ``mesh_host_cpu.json`` (``bench mesh-host``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from benchmarks.repro.data import DATA_DIR
from benchmarks.repro.published import published
from dlo_fn.cost.calibration import DEVICE_CONTEXT_BYTES
from dlo_fn.cost.ceilings import VIDEO_720P_10S
from dlo_fn.cost.memory import GB
from dlo_fn.cost.mesh import MeshPlan
from dlo_fn.cost.mesh_memory import mesh_hbm, mesh_memory_rows
from dlo_fn.cost.sp_memory import BlockDims, sp_activations
from dlo_fn.models import get_config
from dlo_fn.models.specs import config_spec
from dlo_fn.plan.sizes import ModelSizes

__all__ = [
    "TOKENS",
    "SP_HBM_FILE",
    "MESH_HOST_FILE",
    "rank_rows",
    "group_rows",
    "memory_rows",
    "host_rows",
    "phase_rows",
    "hbm_rows",
    "fig4_sp_rows",
    "load",
]

TOKENS = VIDEO_720P_10S.tokens
SP_HBM_FILE = "sp_hbm_nvidia-h200.json"
MESH_HOST_FILE = "mesh_host_cpu.json"


def _gb(n: float) -> float:
    return round(n / GB, 3)


def load(name: str, data_dir: pathlib.Path = DATA_DIR) -> dict:
    return json.loads(pathlib.Path(data_dir, name).read_text())


def _sizes(name: str) -> ModelSizes:
    return ModelSizes.from_spec(config_spec(name))


def _dims(name: str, num_heads: int | None = None) -> BlockDims:
    config = get_config(name)
    return BlockDims.from_config(dataclasses.replace(config, num_heads=num_heads) if num_heads else config)


def rank_rows(mesh: MeshPlan, name: str = "cosmos3-super", tokens: int = TOKENS) -> list[dict]:
    """Who holds which tokens, heads and weight bytes: one row per rank."""
    rows = []
    for r in mesh.rank_table(_sizes(name), tokens, get_config(name).num_heads):
        rows.append(
            {
                "rank": r.rank,
                "(dp, sp)": f"({r.dp_rank}, {r.sp_rank})",
                "tokens": f"[{r.token_range[0]}, {r.token_range[1]})",
                "heads": f"[{r.head_range[0]}, {r.head_range[1]})",
                "shard group": ",".join(map(str, r.shard_group)),
                "shard": f"{r.shard_index} / {r.num_shards}",
                "weight GB": _gb(r.pinned_bytes),
            }
        )
    return rows


def group_rows(dp: int, sp: int, name: str = "cosmos3-super") -> list[dict]:
    """Pinned weight bytes per rank and in total for each shard group of a ``dp x sp`` mesh."""
    sizes, rows = _sizes(name), []
    for group in ("world", "dp", "sp"):
        mesh = MeshPlan(dp, sp, group)
        per = mesh.pinned_bytes_per_rank(sizes)
        rows.append(
            {
                "shard group": group,
                "W": mesh.num_shards,
                "groups": len(mesh.shard_groups),
                "per rank GB": _gb(per),
                "all ranks GB": _gb(mesh.world_size * per),
                "model copies": round(mesh.world_size * per / sizes.total_block_bytes, 3),
            }
        )
    return rows


def memory_rows(
    mesh: MeshPlan, name: str = "cosmos3-super", tokens: int = TOKENS, num_heads: int | None = None
) -> list[dict]:
    """The per-rank memory table (item, formula, GB) of :func:`dlo_fn.cost.mesh_memory.mesh_memory_rows`."""
    rows = mesh_memory_rows(_sizes(name), mesh, _dims(name, num_heads), tokens)
    return [{"item": r.item, "formula": r.formula, "GB": _gb(r.value_bytes)} for r in rows]


def phase_rows(
    name: str = "cosmos3-super", sp: int = 4, tokens: int = TOKENS, num_heads: int | None = None
) -> list[dict]:
    """Each phase of the SP model: activations, communication, total (GB)."""
    a = sp_activations(_dims(name, num_heads), tokens, sp)
    return [
        {
            "phase": p.name,
            "activations GB": _gb(p.activation_bytes),
            "communication GB": _gb(p.communication_bytes),
            "total GB": _gb(p.total_bytes),
            "peak": "<-" if p is a.peak_phase else "",
        }
        for p in a.phases
    ]


def host_rows(doc: dict) -> list[dict]:
    """``bench mesh-host``: each rank's arena against the plan, per shard group."""
    return [
        {
            "group": r["shard_group"],
            "rank": r["rank"],
            "W": r["num_shards"],
            "shard": r["shard_index"],
            "planned MB": r["planned_bytes"] / 1e6,
            "arena MB": r["arena_bytes"] / 1e6,
            "anon +MB": round(r["anon_delta_bytes"] / 1e6, 3),
            "exact": r["arena_bytes"] == r["planned_bytes"],
        }
        for r in doc["records"]
    ]


def _rank0(doc: dict) -> list[dict]:
    return [r for r in doc["records"] if r.get("rank") == 0 and "error" not in r]


def _model(r: dict):
    """The SP model of a measured case, recomputed from the plan (the file's ``*_model`` fields are what the
    model said when the run was made, before ``--explain-peak`` found the embedding output and rotary terms)."""
    heads = r["num_heads"] if r["num_heads"] != get_config(r["base_config"]).num_heads else None
    return sp_activations(_dims(r["base_config"], heads), r["tokens"], r["sp"], r["batch"])


def hbm_rows(doc: dict) -> list[dict]:
    """``bench sp-hbm`` rank 0 of each case: weights (plan vs allocator), workload (SP model vs allocator peak)."""
    rows = []
    for r in _rank0(doc):
        model = _model(r)
        rows.append(
            {
                "case": r["case"],
                "tokens/rank": r["local_tokens"],
                "weights plan GB": _gb(r["weight_bytes_planned"]),
                "weights meas GB": _gb(r["weight_bytes"]),
                "weights +bytes": r["weight_bytes"] - r["weight_bytes_planned"],
                "workload model GB": _gb(model.peak_bytes),
                "workload meas GB": _gb(r["workload_peak_bytes"]),
                "workload err %": round(100 * (r["workload_peak_bytes"] / model.peak_bytes - 1), 2),
                "phase": model.peak_phase.name,
            }
        )
    return rows


def fig4_sp_rows(doc: dict) -> list[dict]:
    """Figure 4's DLO+SP bars (4 cards, sp 4, 720p 10 s): published per-card HBM, our plan for that deployment
    (weights + resident + SP workload + the calibrated Ascend context ``c_dev``) and our measurement (the H200
    allocator's peak of the same pass plus the same ``c_dev``, which no allocator sees)."""
    measured = {r["base_config"]: r for r in _rank0(doc) if r["sp"] == 4}
    rows = []
    for name, short, heads in (("cosmos3-nano", "nano", 32), ("cosmos3-super", "super", None)):
        mesh = MeshPlan(1, 4)
        work = sp_activations(_dims(name, heads), TOKENS, 4)
        h = mesh_hbm(_sizes(name), mesh, work, context_bytes=DEVICE_CONTEXT_BYTES)
        m = measured.get(name)
        meas_peak = m["idle_device_bytes"] + m["workload_peak_bytes"] + DEVICE_CONTEXT_BYTES if m else None
        for bar, pub, plan_bytes, meas_bytes in (
            (
                "idle",
                published(f"fig4.{short}.idle").value,
                h.idle_bytes,
                m["idle_device_bytes"] + DEVICE_CONTEXT_BYTES if m else None,
            ),
            ("peak", published(f"fig4.{short}.peak").value, h.peak_bytes, meas_peak),
        ):
            rows.append(
                {
                    "bar": f"{short.capitalize()} DLO+SP {bar}",
                    "published GB": pub,
                    "predicted GB": _gb(plan_bytes),
                    "measured GB": _gb(meas_bytes) if meas_bytes else "",
                    "pred vs pub %": round(100 * (plan_bytes / GB / pub - 1), 1),
                }
            )
    return rows
