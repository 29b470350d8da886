"""LoRA adapters on the reference DiT, through peft: write a random one, load one, choose one per request.

An adapter file is a safetensors file of peft's state dict (``blocks.3.self_attn.qkv.lora_A.weight``, ...) with
the rank in its metadata. :func:`load_adapter` injects it into a model, resident or offloaded alike (after
``offload`` the blocks' layers stay in the module tree, :mod:`dlo_fn.runtime.blocks`), and loads its weights
onto the device of the model's resident part; :func:`use_adapter` makes one adapter (or none) active, at a
scale, which is what a request's ``lora`` / ``lora_scale`` ask for. Every step leaves the base weights alone.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
import warnings

import torch
from torch import nn

__all__ = ["TARGETS", "write_adapter", "load_adapter", "use_adapter", "adapter_names", "block_chooser"]

# Every attention and MLP linear of every block (peft matches the regex against full module names).
TARGETS = r"blocks\.\d+\.(self_attn\.(qkv|out)|cross_attn\.(q|kv|out)|mlp\.(fc1|fc2))"


def _config(rank: int, layers: list[str]):  # alpha = rank: the update is B A x, times the request's scale
    import peft

    # exactly the layers the file holds (peft full-matches a string against each module's name)
    targets = "|".join(re.escape(n) for n in layers)
    return peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False)


def write_adapter(
    model: nn.Module, path: str | os.PathLike, rank: int = 4, seed: int = 0, targets: str = TARGETS
) -> pathlib.Path:
    """A random rank-``rank`` adapter on the linears of ``model`` whose names match ``targets`` (only their
    names and shapes are read: a meta, resident or offloaded model will do; a diffusers model loads the file
    with ``load_lora_adapter(path, prefix=None)``), written to ``path`` in the layers' dtype. A and B are both
    random (A ~ N(0, 1/in), B ~ N(0, 1/rank)), so the adapter changes every output."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, mod in model.named_modules():
        name = name.replace(".base_layer", "")  # a layer peft already wraps
        if isinstance(mod, nn.Linear) and re.fullmatch(targets, name):
            dtype = mod.weight.dtype
            a = torch.randn(rank, mod.in_features, generator=g) / mod.in_features**0.5
            b = torch.randn(mod.out_features, rank, generator=g) / rank**0.5
            state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"] = a.to(dtype), b.to(dtype)
    if not state:
        raise ValueError(f"{type(model).__name__} has no linears matching {targets!r}: no adapter to write")
    path = pathlib.Path(path)
    save_file(state, str(path), metadata={"rank": str(rank)})
    return path


def load_adapter(model: nn.Module, path: str | os.PathLike, name: str) -> None:
    """Adapter ``path`` (:func:`write_adapter`'s format) added to ``model`` as ``name``, on the device and in
    the dtype of the layers it wraps; it becomes active at scale 1 only through :func:`use_adapter`."""
    import peft
    from safetensors import safe_open

    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"adapter file {str(path)!r} does not exist: write one with dlo_fn.models.lora.write_adapter")
    with safe_open(str(path), "pt") as f:
        rank = int((f.metadata() or {}).get("rank", 0))
        state = {k: f.get_tensor(k).clone() for k in f.keys()}  # peft keeps these tensors: not views of the file
    if rank <= 0:
        raise ValueError(f"adapter file {str(path)!r} has no 'rank' in its metadata: write it with write_adapter")
    if name in adapter_names(model):
        raise ValueError(f"adapter name {name!r} is already loaded: pick another name")
    layers = sorted({k.rsplit(".lora_", 1)[0] for k in state})
    linears = {n.replace(".base_layer", ""): m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for key, t in state.items():  # checked before peft touches the model: a misfit leaves it as it was
        layer, _, which = key.rpartition(".lora_")
        mod = linears.get(layer)
        want = None if mod is None else (rank, mod.in_features) if which == "A.weight" else (mod.out_features, rank)
        if tuple(t.shape) != want:
            raise ValueError(
                f"adapter file {str(path)!r} does not fit this model ({key!r}: {tuple(t.shape)}, layer wants "
                f"{want}): write it for this model's config"
            )
    with warnings.catch_warnings():  # "Already found a peft_config": several adapters are what this is for
        warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
        # low_cpu_mem_usage: the layers are built on meta and take the file's tensors (then move to their base
        # layer's device and dtype); peft's default builds and initialises them on the host first, then copies.
        peft.inject_adapter_in_model(_config(rank, layers), model, adapter_name=name, low_cpu_mem_usage=True)
    peft.set_peft_model_state_dict(model, state, adapter_name=name, low_cpu_mem_usage=True)
    for layer in _layers(model):  # peft's injection may have changed what is active: choose afresh
        layer.__dict__.pop("_dlo_choice", None)
    use_adapter(model, None)


def _layers(model: nn.Module):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def adapter_names(model: nn.Module) -> tuple[str, ...]:
    """The adapters loaded into ``model``, in load order (none without peft imported: nothing loaded one)."""
    if "peft" not in sys.modules:
        return ()
    return tuple(dict.fromkeys(n for layer in _layers(model) for n in layer.lora_A))


def use_adapter(model: nn.Module, name: str | None, scale: float = 1.0) -> None:
    """Make adapter ``name`` the only active one, its update multiplied by ``scale``; ``None``: no adapter."""
    if name is not None and name not in adapter_names(model):
        raise ValueError(f"lora={name!r} is not loaded (loaded: {list(adapter_names(model))}): load it first")
    for layer in _layers(model):
        _choose(layer, name, scale)


def _choose(layer: nn.Module, name: str | None, scale: float) -> None:
    if layer.__dict__.get("_dlo_choice") == (name, scale):
        return  # peft's set_adapter walks every adapter's parameters: skip what is already chosen
    layer.enable_adapters(name is not None)
    if name is not None:
        layer.set_adapter(name)
        layer.set_scale(name, scale)
    layer.__dict__["_dlo_choice"] = (name, scale)


def block_chooser(model: nn.Module):
    """For serving, where each request of a rank runs its own adapter: a function ``(block, request)`` that
    makes ``request.lora`` at ``request.lora_scale`` active in ``block`` (one of ``model.blocks``) before the
    request's call of it; None when ``model`` has no adapters (nothing to switch)."""
    if not adapter_names(model):
        return None
    layers = {id(b): _layers(b) for b in model.blocks}

    def choose(block: nn.Module, request) -> None:
        for layer in layers[id(block)]:
            _choose(layer, request.lora, request.lora_scale)

    return choose
