"""`bench real`'s adapter rows: a LoRA on every attention and MLP linear of the blocks, loaded after offload.

``resident-lora``   the resident model with adapter ``a`` loaded (peft, unfused): the reference of the rows below
                    and their own bound (max(its forward, block bytes / pinned peak))
``ours-lora``       ``load_model`` + ``offload`` (rank-local), then, once ready: adapters ``a`` and ``b`` loaded
                    from disk (``load_lora_adapter``), ``set_adapters`` to ``b`` and back to ``a``, ``b`` deleted;
                    the forwards run with ``a``; pinned bytes before and after, device bytes the adapters took
``ours-lora-fp8``   the same on FP8 shards (reference: the fake-quantised resident model with ``a``)
``ours-lora-fp8-3-slots``  the same on three slots (a load two blocks ahead)

Each adapter row first times the same offloaded model without an adapter (``forward_s_without_adapter``), so the
adapter's cost is read within one model, and profiles one forward without and one with the adapter
(``torch.profiler`` on CUDA, :func:`benchmarks.bench.trace.profile_forward`: each stream's busy time and its
heaviest kernels), which says whether the forward waits on the link or on compute.

The adapters are random (:func:`dlo_fn.models.lora.write_adapter`), rank :data:`RANK` (4 with ``--quick``), in the
model's dtype, written once per run beside the checkpoint.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import time

from benchmarks.bench.trace import profile_forward

__all__ = ["RANK", "TARGETS", "VARIANTS", "write_adapters", "load", "adapter_work"]

RANK = 64
VARIANTS = ("ours-lora", "ours-lora-fp8", "ours-lora-fp8-3-slots")
# Adapter names: diffusers' load reports another adapter's weights as missing keys when the new name is a
# substring of their keys (a name "b" is in "transformer_blocks"), so none is a single letter.
NAMES = ("lora-a", "lora-b")
TRACE_DIR = "BENCH_LORA_TRACE_DIR"  # if set: each profiled forward's Chrome trace is kept there
_BLOCK = r"(single_)?transformer_blocks\.\d+\."
TARGETS = {  # every attention and MLP linear of the blocks, by family (real_models.ModelCase.family)
    "flux": _BLOCK + r"(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
    r"|ff(_context)?\.net\.(0\.proj|2)|proj_mlp|proj_out)",
    "wan": r"blocks\.\d+\.((attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|ffn\.net\.(0\.proj|2))",
}


def write_adapters(model, folder: pathlib.Path, family: str, quick: bool) -> tuple[str, str]:
    """Adapters ``a`` and ``b`` for ``model``'s layers, written beside the checkpoint folder."""
    from dlo_fn.models.lora import write_adapter

    if family not in TARGETS:
        raise ValueError(f"no adapter targets for the {family!r} family")
    rank = 4 if quick else RANK
    out = folder.with_name(folder.name + "-lora")
    out.mkdir(parents=True, exist_ok=True)
    return tuple(
        str(write_adapter(model, out / f"{n}.safetensors", rank, seed=i + 1, targets=TARGETS[family]))
        for i, n in enumerate("ab")
    )


def load(model, path: str, name: str) -> None:
    """The documented call (README, docs/design.md): peft builds the layers on meta and takes the file's tensors."""
    model.load_lora_adapter(path, adapter_name=name, prefix=None, low_cpu_mem_usage=True)


def adapter_work(o, files: tuple[str, str], platform, forward, time_forwards, label: str) -> dict:
    """On a ready offloaded model: its forward timed (``time_forwards()``: the seconds of each) and profiled
    without an adapter; both adapters loaded, ``b`` switched to and back, ``b`` deleted, each timed; one forward
    with ``a`` profiled."""

    def timed(fn) -> float:
        platform.synchronize()
        t = time.perf_counter()
        fn()
        platform.synchronize()
        return time.perf_counter() - t

    without = time_forwards()
    profiles = {"without_adapter": profile_forward(platform, forward, f"{label}-without", os.environ.get(TRACE_DIR))}
    pinned, device = o.pinned_host_bytes, platform.memory_allocated()
    a, b = NAMES
    loads = [timed(lambda p=p, n=n: load(o.model, p, n)) for p, n in zip(files, NAMES)]
    adapters_device = platform.memory_allocated() - device
    switches = [timed(lambda n=n: o.model.set_adapters(n)) for n in (b, a, b, a)]
    unload = timed(lambda: o.model.delete_adapters(b))
    profiles["with_adapter"] = profile_forward(platform, forward, f"{label}-with", os.environ.get(TRACE_DIR))
    return {
        "forward_s_without_adapter": statistics.median(without),
        "forward_s_all_without_adapter": without,
        "profile": profiles,
        "adapter_rank": int(open_rank(files[0])),
        "adapter_load_s_all": loads,
        "adapter_load_s": max(loads),
        "adapter_switch_s_all": switches,
        "adapter_switch_s": statistics.median(switches),
        "adapter_unload_s": unload,
        "adapter_device_bytes": adapters_device // 2,
        "adapter_file_bytes": pathlib.Path(files[0]).stat().st_size,
        "pinned_bytes_before_adapters": pinned,
        "pinned_bytes_after_adapters": o.pinned_host_bytes,
    }


def open_rank(path: str) -> str:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return (f.metadata() or {}).get("rank", "0")
