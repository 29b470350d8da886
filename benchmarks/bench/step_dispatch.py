"""Host dispatch per block, measured where nothing but the host can be the bottleneck.

On the full-size model the device runs far behind the host (a pass is ~0.2-0.8 s of GPU work), so the CUDA
launch queue fills and every host timer also counts waits for queue space. Here the blocks keep their structure
(the same modules and tensors per block, so the same host work per block) at hidden 256, with 2 x 64 tokens:
H2D and compute per block take microseconds and the device keeps up. Reported per variant:

    dispatch_us_per_block = median over pairs of (host time of a pass - that of a resident pass) / num_blocks,
                            the two passes of a pair timed back to back (host speed drifts by more than the
                            differences measured here over a run)
    proxy_host_us_per_block = the executor's own timer: proxy time outside the block call, per block

The first is everything the offload adds on the host (op issue, waits/records, re-parametrisation); the second
excludes the block call, so their difference is the cost of running a block on views instead of its own params.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from benchmarks.bench import step_variants as sv

DISPATCH_SIZE = (128, 128, 1)  # height, width, frames: 64 tokens per CFG branch


def measure_dispatch(config: str, platform, group: Any, variants: list[str], quick: bool) -> dict:
    from benchmarks.bench.step_variants import block_inputs
    from dlo_fn.models import BLOCK_PATHS
    from dlo_fn.plan.layout import model_layout
    from dlo_fn.plan.spec import spec_from_module
    from dlo_fn.runtime.blocks import strip_block
    from dlo_fn.runtime.host_store import build_host_store

    cfg = sv.narrow_config(config) if not quick else config
    model = sv.random_model(cfg, platform.device)
    x, kwargs, tokens = block_inputs(model, *((32, 32, 1) if quick else DISPATCH_SIZE), platform.device)
    blocks = list(model.blocks)
    layout = model_layout(spec_from_module(model, BLOCK_PATHS), 1)
    reps = dict(warmup=2, repeats=3) if quick else dict(warmup=5, repeats=31)

    resident_blocks = [copy.deepcopy(b) for b in blocks]  # the reference keeps its own weights on the device

    def resident_pass(x, kw):
        for block in resident_blocks:
            x = block(x, **kw)
        return x

    with torch.no_grad():
        resident, _ = sv.host_pass_delta_s(platform, resident_pass, resident_pass, x, kwargs, **reps)
        tensors, aliases = sv.block_states(blocks)
        store = build_host_store(layout, 0, tensors, platform)
        cpu = {v: sv.cpu_blocks(blocks) for v in variants if v.startswith("diffusers")}  # one set per variant
        del tensors
        for block in blocks:
            strip_block(block, platform.device)
        out: dict[str, dict] = {}
        for variant in variants:
            row: dict[str, float] = {}
            if variant.startswith("dlo-") and not variant.endswith("-compile"):
                run_pass, ex = sv.executor_pass(
                    platform, layout, store, blocks, aliases, group=group, **sv.variant_options(variant)
                )
                rp = dict(reps, warmup=max(reps["warmup"], sv.GRAPH_WARMUP))
                host, delta = sv.host_pass_delta_s(
                    platform, run_pass, resident_pass, x, kwargs, reset=ex.stats.reset, **rp
                )
                if ex.plugin is not None:
                    row["graph_replays"] = ex.plugin.replays
                row["proxy_host_us_per_block"] = ex.stats.issue_us_per_compute
                row["load_issue_us_per_block"] = 1e6 * ex.stats.load_issue_s / max(ex.stats.computes, 1)
                ex.synchronize()
            elif variant.startswith("diffusers"):
                try:
                    run = sv.diffusers_pass(platform, cpu.pop(variant), variant.endswith("-record-stream"))
                    host, delta = sv.host_pass_delta_s(platform, run, resident_pass, x, kwargs, **reps)
                except ImportError:
                    continue
            else:
                continue  # resident is the reference; naive-sync waits for every copy by design
            row["pass_host_s"] = host
            row["dispatch_us_per_block"] = 1e6 * delta / layout.num_blocks
            out[variant] = row
    return {
        "config": getattr(cfg, "name", cfg),
        "num_blocks": layout.num_blocks,
        "tensors_per_block": len(layout.shards[0].block.placements),
        "tokens_per_sample": tokens,
        "resident_pass_host_s": resident,
        "variants": out,
    }
