"""What a block graph capture needs (:mod:`dlo_fn.runtime.cuda.block_graph`): the capture guard, a block call
flattened to its tensors and back, and the least-recently-used set of input shapes whose graphs are kept."""

from __future__ import annotations

import contextlib
import gc
import operator
from collections import OrderedDict
from typing import Any, Callable

import torch

__all__ = ["ShapeLRU", "capture_guard", "flatten_call", "flatten_outputs", "rebuild_call", "tensor_specs"]


@contextlib.contextmanager
def capture_guard() -> Any:
    """Around a CUDA graph capture:

    * no garbage collection inside it: a finalizer run by a collection during the capture (a freed host store's
      ``cudaHostUnregister``) is a call that global capture mode forbids, and it invalidates the capture (seen on
      the H200: one test's leftovers broke the next test's capture, then its host registrations);
      ``torch.cuda.graph`` collects just before it starts capturing;
    * if the capture raises, the CUDA default generators get back their states of before it: torch leaves them
      marked as capturing, and their next random op raises "Offset increment outside graph capture" (the
      capture drew no number outside the graph)."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        saved = [(g, g.clone_state()) for g in torch.cuda.default_generators]
    except (AttributeError, RuntimeError):  # a torch without graph-safe generator states
        saved = []
    try:
        yield
    except BaseException:
        for gen, state in saved:
            gen.graphsafe_set_state(state)
        raise
    finally:
        if gc_was_enabled:
            gc.enable()


_CONSTANT = (type(None), bool, int, float, str)


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], tuple] | None:
    """``(tensors, structure)`` of a block call: each argument a tensor, a tuple / list of tensors (diffusers'
    rotary embeddings) or a constant (None, a number, a string: part of the key, baked into the graph); None for
    anything else (the call runs eager)."""
    tensors: list[Any] = []
    structure = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            structure.append(None)
        elif isinstance(v, (tuple, list)) and v and all(isinstance(t, torch.Tensor) for t in v):
            tensors.extend(v)
            structure.append((type(v), len(v)))
        elif isinstance(v, _CONSTANT):
            structure.append(("const", type(v), v))  # the type too: True == 1 would share a key
        else:
            return None
    return tensors, tuple(structure)


def rebuild_call(num_args: int, names: tuple, structure: tuple, tensors: list[Any]) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` of :func:`flatten_call`'s structure with ``tensors`` in place."""
    values, i = [], 0
    for item in structure:
        if item is None:
            values.append(tensors[i])
            i += 1
        elif item[0] == "const":
            values.append(item[2])
        else:
            values.append(item[0](tensors[i : i + item[1]]))
            i += item[1]
    return tuple(values[:num_args]), dict(zip(names, values[num_args:]))


class ShapeLRU:
    """The input shapes whose graphs are kept (at most ``limit``), least recently used first; each
    shape owns the keys registered under it. :meth:`use` returns the key sets of the shapes it pushes out."""

    def __init__(self, limit: int) -> None:
        self.limit, self.evictions = limit, 0
        self._keys: OrderedDict[Any, set] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def use(self, shape: Any) -> list[set]:
        if shape in self._keys:
            self._keys.move_to_end(shape)
            return []
        self._keys[shape] = set()
        dropped = []
        while len(self._keys) > self.limit:
            dropped.append(self._keys.popitem(last=False)[1])
            self.evictions += 1
        return dropped

    def add(self, shape: Any, key: Any) -> None:
        self._keys.setdefault(shape, set()).add(key)

    def clear(self) -> None:
        self._keys.clear()


def tensor_specs(flat: list[Any] | None, device_type: str | None = None) -> tuple | None:
    """``(shape, stride, dtype, device)`` of each tensor of ``flat``, what a graph's key holds; None if ``flat`` is
    None or holds anything else (or a tensor on another device type than ``device_type``). Called per block
    call: the device type is checked through ``Tensor.is_cuda`` / ``is_cpu`` where torch has one
    (``device.type`` builds a string per tensor)."""
    if flat is None:
        return None
    on = None
    if device_type is not None:
        on = _ON_DEVICE.get(device_type)
        if on is None:
            on = _ON_DEVICE[device_type] = (
                operator.attrgetter(f"is_{device_type}")
                if hasattr(torch.Tensor, f"is_{device_type}")
                else (lambda t: t.device.type == device_type)
            )
    specs = []
    for t in flat:  # one loop, no generators: this runs per block call
        if not isinstance(t, torch.Tensor) or (on is not None and not on(t)):
            return None
        specs.append((t.shape, t.stride(), t.dtype, t.device))
    return tuple(specs)


_ON_DEVICE: dict[str, Callable[[torch.Tensor], bool]] = {}


def flatten_outputs(out: Any) -> list[torch.Tensor] | None:
    """A block's outputs as a list (a tensor, or a tuple / list of tensors); None for anything else."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return list(out)
    return None
