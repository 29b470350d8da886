"""One CUDA graph per block compute, the copies and events staying eager: ``graph="block"``.

The step graph (:mod:`dlo_fn.runtime.graph`) captures a whole step, copies included, and on the H200 a captured
H2D copy can run 4-5% slower than an eager one (that module's doc), which costs a PCIe-bound step as much. Here
only the block's kernels are captured: each compute op replays the graph of

    (block, slot, request, input shapes)     the slot fixes the weight views' addresses, the request keeps
                                             one request's outputs alive while the next request runs the block

and the executor issues its H2D copies, waits and records eagerly around it on its own streams, exactly as in the
eager loop (a replay is one stream-ordered op on the compute stream, like the kernels it stands for). What it
saves is the block call's host work: its Python and a launch per kernel become one copy per input and one launch.

A key is run eager the first time it is seen (lazy initialisation, cuBLAS handles), captured the second time, then
replayed. What a graph reads:

* an input that is another block graph's static output (the block chain: ``x = block(x)``) is read in place, no
  copy; at replay the same tensor must come again, else the call runs eager (correct, logged once);
* any other input (the first block's input, the conditioning passed to every block) is copied into a static
  buffer per (request, argument position, shape) shared by every block's graph: at the pass's first block, and
  at a later block only when it changed (another tensor, or the same one modified in place: its version
  counter), so the conditioning is copied once per step, not once per block.

A replay returns the graph's static outputs, overwritten by the next replay of the same key, i.e. by the same
block at the next step: read a step's outputs before the next step (every DiT's block chain does). Device memory:
the outputs of every (block, slot, request) key are held, ``blocks x R`` activations, plus the shared inputs; all
graphs share one memory pool for their temporaries (they replay one after another on one stream). A block whose
forward cannot be captured (a host sync, a non-tensor argument) runs eager, logged once.

At W > 1 the all-gathers stay eager on the executor's communication stream, so block graphs run on any backend
(NCCL, HCCL's CUDA-free path aside, and gloo with CUDA tensors, whose worker thread calls CUDA while a block is
captured: captures are ``thread_local``). Tested with 2 gloo ranks sharing one GPU (``tests/test_graph_cuda.py``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from dlo_fn.runtime.graph import capture_guard

__all__ = ["BlockGraphs"]

log = logging.getLogger(__name__)


def _spec(flat: list[Any]) -> tuple | None:
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in flat):
        return None
    return tuple((tuple(t.shape), t.stride(), t.dtype) for t in flat)


class _Captured:
    __slots__ = ("graph", "direct", "copied", "output")

    def __init__(self, graph: Any, direct: tuple, copied: tuple, output: Any) -> None:
        # direct: (position, tensor read in place); copied: (position, shared static buffer)
        self.graph, self.direct, self.copied, self.output = graph, direct, copied, output


class BlockGraphs:
    """The block graphs of one executor; :meth:`wrap` turns a block caller into one that replays them."""

    def __init__(self) -> None:
        self._seen: set[tuple] = set()
        self._graphs: dict[tuple, _Captured] = {}
        self._eager: set[tuple] = set()
        self._logged: set[str] = set()
        self._pool: Any = None
        self._static_out: dict[int, torch.Tensor] = {}  # id -> every captured graph's output tensors
        # (request, position, spec) -> [buffer, last source, its version]
        self._shared: dict[tuple, list[Any]] = {}
        self._shared_of: dict[int, list[list[Any]]] = {}  # request -> its shared entries
        self.captures = self.replays = self.input_copies = 0

    def clear(self) -> None:
        """Drop every graph, its outputs and the shared inputs (their memory with them); keys start over."""
        self._seen.clear(), self._graphs.clear(), self._eager.clear(), self._static_out.clear()
        self._shared.clear(), self._shared_of.clear()
        self._pool = None

    def _log_once(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("cuda graph (per block): %s; those blocks run eager", reason)

    def wrap(self, caller: Callable[[tuple, dict], Any], block: int, slot: int) -> Callable[..., Any]:
        """``call(args, kwargs, request)``: ``caller`` replayed from a graph once its key was seen (see the module
        doc)."""

        def call(args: tuple, kwargs: dict, request: int = 0) -> Any:
            flat = list(args) + list(kwargs.values())
            spec = _spec(flat)
            if spec is None:
                self._log_once("a block takes a non-tensor (or non-CUDA) argument")
                return caller(args, kwargs)
            if block == 0:  # a new pass: copy every shared input again at least once (see _copy_in)
                for entry in self._shared_of.get(request, ()):
                    entry[1] = None
            key = (block, slot, request, len(args), tuple(kwargs), spec)
            got = self._graphs.get(key)
            if got is not None:
                if any(flat[j] is not t for j, t in got.direct):
                    self._log_once("a block's input is not the previous block graph's output it was at capture "
                                   "(the model changed it between blocks)")
                    return caller(args, kwargs)
                for j, entry in got.copied:
                    self._copy_in(entry, flat[j])
                got.graph.replay()
                self.replays += 1
                return got.output
            if key in self._eager or key not in self._seen:
                self._seen.add(key)
                return caller(args, kwargs)
            return self._capture(key, caller, args, kwargs, flat, request, spec)

        call.per_request = True  # compile_schedule binds each compute op's request
        return call

    def _copy_in(self, entry: list[Any], src: torch.Tensor) -> None:
        """Copy ``src`` into a shared input unless it is the tensor copied last in this pass, unmodified since
        (same object, same version counter; every pass starts by copying). A tensor rewritten without a version
        bump (a CUDA graph's output) within one pass would be missed: none is passed between blocks."""
        if entry[1] is not src or entry[2] != src._version:
            entry[0].copy_(src)
            entry[1], entry[2] = src, src._version
            self.input_copies += 1

    def _capture(self, key: tuple, caller: Callable, args: tuple, kwargs: dict, flat: list[torch.Tensor],
                 request: int, spec: tuple) -> Any:
        direct, copied, inputs = [], [], []
        for j, t in enumerate(flat):
            if self._static_out.get(id(t)) is t:
                direct.append((j, t))
                inputs.append(t)
            else:
                entry = self._shared.get((request, j, spec[j]))
                if entry is None:  # outside the graphs' pool: it outlives every capture
                    entry = self._shared[(request, j, spec[j])] = [torch.empty_strided(
                        t.shape, t.stride(), dtype=t.dtype, device=t.device), None, -1]
                    self._shared_of.setdefault(request, []).append(entry)
                self._copy_in(entry, t)
                copied.append((j, entry))
                inputs.append(entry[0])
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        try:
            # thread_local: the all-gathers stay eager and other threads keep calling CUDA during a capture
            # (NCCL's watchdog; gloo's worker copies a CUDA tensor to the host and synchronises its stream).
            with capture_guard(), torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                output = caller(tuple(inputs[:len(args)]), dict(zip(kwargs, inputs[len(args):])))
        except Exception as exc:  # a forward that syncs or launches something uncapturable
            self._eager.add(key)
            self._log_once(f"capture failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
            return caller(args, kwargs)
        outs = [output] if isinstance(output, torch.Tensor) else list(output) if isinstance(output, (tuple, list)) \
            else None
        if outs is None or not all(isinstance(t, torch.Tensor) for t in outs):
            self._eager.add(key)
            self._log_once("a block returns something other than a tensor or a tuple of tensors")
            return caller(args, kwargs)
        for t in outs:
            self._static_out[id(t)] = t
        self._graphs[key] = _Captured(g, tuple(direct), tuple(copied), output)
        self.captures += 1
        g.replay()  # the capture ran nothing: this call is the first replay (its inputs are in place)
        self.replays += 1
        return output
