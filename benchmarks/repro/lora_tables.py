"""The LoRA tables of ``docs/measurements.md``, from the committed H200 run of ``bench real``'s adapter rows.

* :func:`lora_rows` - per variant: the forward with the adapter, the same model's forward without one, the ratio
  to its own bound, and the adapter's load, switch and delete times;
* :func:`lora_block_rows` - the profiled forwards of the same run, per streamed block kind (FLUX.1-dev's double
  blocks come first, then the single blocks): mean compute-stream time per block against the mean H2D load of
  that kind, and the forward's span against the link's and the compute stream's busy time.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from benchmarks.repro.data import DATA_DIR

__all__ = ["LORA_FILE", "LORA_BLOCKS_FILE", "lora_rows", "lora_block_rows"]

LORA_FILE = "lora_bench_real_flux_nvidia-h200.json"
LORA_BLOCKS_FILE = "lora_blocks_flux_nvidia-h200.json"
ORDER = (
    "resident",
    "resident-lora",
    "ours-rank-local",
    "ours-lora",
    "ours-fp8",
    "ours-lora-fp8",
    "ours-lora-fp8-3-slots",
)


def _json(name: str) -> dict[str, Any]:
    return json.loads((DATA_DIR / name).read_text())


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def lora_rows() -> list[dict[str, str]]:
    rows = {v["variant"]: v for v in _json(LORA_FILE)["model"]["variants"]}
    out = []
    for name in (n for n in ORDER if n in rows):
        v = rows[name]
        loads = v.get("adapter_load_s_all")
        out.append(
            {
                "variant": f"`{name}`",
                "forward ms": _ms(v.get("forward_s")),
                "same model, no adapter ms": _ms(v.get("forward_s_without_adapter")),
                "/ own bound": "-" if v.get("ratio_to_own_bound") is None else f"{v['ratio_to_own_bound']:.3f}",
                "load s (two adapters)": "-" if not loads else " / ".join(f"{x:.2f}" for x in loads),
                "switch ms": _ms(v.get("adapter_switch_s")),
                "delete ms": _ms(v.get("adapter_unload_s")),
                "equal": "-" if v.get("equal_to_resident") is None else str(v["equal_to_resident"]),
            }
        )
    return out


def _kinds(summary: dict) -> tuple[int, list[float], list[float]]:
    """(number of large blocks, mean compute per block of each kind, mean load of each kind). The loads are in
    issue order, one per block; the large ones (over 1.5x the smallest) are the double blocks, first in the forward."""
    loads, compute = summary["h2d_s"], summary["block_compute_s"]
    big = [x for x in loads if x > 1.5 * min(loads)]
    small = [x for x in loads if x <= 1.5 * min(loads)]
    n = len(big)
    return (
        n,
        [statistics.mean(compute[:n]), statistics.mean(compute[n:])],
        [statistics.mean(big), statistics.mean(small)],
    )


def lora_block_rows() -> list[dict[str, str]]:
    traces = _json(LORA_BLOCKS_FILE)["traces"]
    out = []
    for name, s in sorted(traces.items()):
        n, compute, loads = _kinds(s)
        link = next(v["busy_s"] for v in s["streams"].values() if v["role"] == "h2d")
        out.append(
            {
                "profiled forward": f"`{name.removeprefix('trace_').removesuffix('.json')}`",
                f"compute / load per double block ms ({n})": f"{compute[0] * 1e3:.2f} / {loads[0] * 1e3:.2f}",
                f"per single block ms ({len(s['h2d_s']) - n})": f"{compute[1] * 1e3:.2f} / {loads[1] * 1e3:.2f}",
                "compute busy ms": _ms(s["compute_busy_s"]),
                "link busy ms": _ms(link),
                "span ms": _ms(s["span_s"]),
                "compute waits on a transfer ms": _ms(s["compute_idle_transfer_busy_s"]),
            }
        )
    return out
