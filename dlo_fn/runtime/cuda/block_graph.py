"""One CUDA graph per block compute, the copies and events staying eager: ``graph="block"``, a plug-in of the
executor (:class:`~dlo_fn.runtime.executor.CallPlugin`: it wraps each (block, slot) call).

Only the block's kernels are captured: each compute op replays the graph of

    (block, slot, request, input shapes)     the slot fixes the weight views' addresses

and the executor issues its H2D copies, waits and records eagerly around it on its own streams, exactly as
without graphs (a replay is one stream-ordered op on the compute stream, like the kernels it stands for), so no
copy is ever a graph node. What it saves is the block call's host work: its Python and a launch per kernel become
one copy per input and one launch.

A key is run eager the first time it is seen (lazy initialisation, cuBLAS handles), captured the second time, then
replayed. What a graph reads:

* an input that is a chain buffer (below, the previous block's output: ``x = block(x)``) is read in place, no
  copy; at replay the same buffer must come again, else the call runs eager (correct, logged once);
* arguments may be tensors, tuples of tensors (diffusers' rotary embeddings) or constants (None, numbers,
  strings: part of the key, so a changed constant is another graph);
* any other input (the first block's input, the conditioning passed to every block) is copied into a static
  buffer per (request, argument position, shape) shared by every block's graph: at the pass's first block, and
  at a later block only when it changed (another tensor, or the same one modified in place: its version
  counter), so the conditioning is copied once per step, not once per block.

What a graph writes: its last kernel copies the block's outputs into *chain buffers*, two per (request, output
position, shape), block ``b`` writing the one of parity ``b % 2``; so block ``b`` reads what block ``b - 1`` wrote
and never the buffer it writes. The outputs the block's own kernels allocate are graph temporaries like any
other: they are dropped after the capture, and every graph shares one memory pool (they replay one after another
on one stream, and nothing in the pool outlives a replay). Device memory is then ``2 x R`` activations plus the
shared inputs and the largest block's temporaries, whatever the depth, for one device copy of the outputs per
block (what it costs: ``docs/performance.md``, "The numbers behind the code's choices"). A replay returns the
chain buffers, which the block two further on overwrites: a model that keeps a block's output longer (a long skip
connection, a list of hidden states) still holds a reference to the buffer, or a view of it, and a buffer held
outside the graphs is never written: that call runs eager instead (correct, logged once). A block whose forward
cannot be captured (a host sync, a non-tensor argument) runs eager, logged once.

A request's shape is that of its block-0 call; the graphs and buffers of at most ``graph_shapes`` shapes are kept
(``OffloadOptions.graph_shapes``, default 4): a new shape beyond pushes out the least recently used one, whose
graphs, chain buffers and shared inputs are freed, so a server that sees many resolutions stays bounded.

At W > 1 the all-gathers stay eager on the executor's communication stream, so block graphs run on any backend
(NCCL, and gloo with CUDA tensors, whose worker thread calls CUDA while a block is captured: captures are
``thread_local``). Tested with 2 gloo ranks sharing one GPU (``tests/test_graph_cuda.py``).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import torch

from dlo_fn.runtime.cuda.capture import (
    ShapeLRU,
    capture_guard,
    flatten_call,
    flatten_outputs,
    rebuild_call,
    tensor_specs,
)

__all__ = ["BlockGraphs", "CudaCapture", "holders"]

log = logging.getLogger(__name__)


class CudaCapture:
    """How :class:`BlockGraphs` capture: ``capture(work)`` runs ``work()`` under a CUDA graph capture (every graph in
    one pool; ``thread_local``: the all-gathers stay eager and other threads keep calling CUDA meanwhile, NCCL's
    watchdog, gloo's worker that copies a CUDA tensor to the host and synchronises its stream) and returns
    ``(graph, work's result)``; ``graph.replay()`` runs the captured kernels again."""

    device = "cuda"

    def __init__(self) -> None:
        self._pool: Any = None

    def reset(self) -> None:
        self._pool = None

    def capture(self, work: Callable[[], Any]) -> tuple[Any, Any]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with capture_guard(), torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
            result = work()
        return g, result


def holders(t: torch.Tensor) -> tuple[int, int]:
    """``(Python references, tensors on its storage)`` of ``t``, plus this call's own: a reference kept anywhere
    (a list of hidden states) raises the first, a view of it (``t[:, :n]``, ``t.view(...)``) the second."""
    return sys.getrefcount(t), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _Captured:
    __slots__ = ("graph", "direct", "copied", "writes", "single")

    def __init__(self, graph: Any, direct: tuple, copied: tuple, writes: tuple, single: bool) -> None:
        # direct: (position, key of the chain buffer read in place); copied: (position, shared static buffer);
        # writes: the chain buffers' keys it writes (see BlockGraphs._bufs); single: the block returns one tensor
        self.graph, self.direct, self.copied, self.writes, self.single = graph, direct, copied, writes, single


class BlockGraphs:
    """The block graphs of one executor; :meth:`wrap` turns a block caller into one that replays them."""

    name = "block-graphs"

    def __init__(self, max_shapes: int = 4, capture: Any = None) -> None:
        self._capturer = capture if capture is not None else CudaCapture()
        self._device = self._capturer.device
        # A request's shape is that of its block-0 call; every key seen for the request until its next block 0
        # belongs to it. Beyond max_shapes the least recently used shape's graphs and buffers are dropped.
        self._shapes = ShapeLRU(max_shapes)
        self._shape_of: dict[int, tuple] = {}  # request -> its current shape
        self._seen: dict[tuple, tuple | None] = {}  # key -> its eager call's output specs (None: not tensors)
        self._graphs: dict[tuple, _Captured] = {}
        self._eager: set[tuple] = set()
        self._logged: set[str] = set()
        # Chain buffers: (request, output position, spec, parity) -> tensor (the one reference this object
        # keeps: every other place holds the key), its holders() then, and id -> key. Outside the graphs' pool.
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._base: dict[tuple, tuple[int, int]] = {}
        self._chain: dict[int, tuple] = {}
        # (request, position, spec) -> [buffer, last source, its version]
        self._shared: dict[tuple, list[Any]] = {}
        self._shared_of: dict[int, list[list[Any]]] = {}  # request -> its shared entries
        self.captures = self.replays = self.input_copies = self.held_eager = 0

    def clear(self) -> None:
        """Drop every graph, the chain buffers and the shared inputs (their memory with them); keys start over."""
        self._seen.clear(), self._graphs.clear(), self._eager.clear(), self._bufs.clear(), self._base.clear()
        self._chain.clear(), self._shared.clear(), self._shared_of.clear()
        self._shapes.clear(), self._shape_of.clear()
        self._capturer.reset()

    @property
    def evictions(self) -> int:
        return self._shapes.evictions

    def _new_pass(self, request: int, shape: tuple) -> None:
        """Block 0 of ``request``: its shared inputs are copied again at least once (see _copy_in), and its shape
        becomes the most recently used, pushing out (and freeing) the least recently used beyond the limit."""
        for entry in self._shared_of.get(request, ()):
            entry[1] = None
        self._shape_of[request] = shape
        dropped = self._shapes.use(shape)
        for keys in dropped:
            for k in keys:
                self._graphs.pop(k, None), self._seen.pop(k, None), self._eager.discard(k)
        if dropped:
            self._prune()
            log.info(
                "cuda graph (per block): more than %d input shapes; dropped the graphs of the least recently used one",
                self._shapes.limit,
            )

    def _prune(self) -> None:
        """Free the chain buffers and shared inputs no remaining graph reads or writes."""
        chain = {k for c in self._graphs.values() for k in (*c.writes, *(k for _, k in c.direct))}
        for k in [k for k in self._bufs if k not in chain]:
            del self._chain[id(self._bufs[k])], self._bufs[k], self._base[k]
        shared = {id(e) for c in self._graphs.values() for _, e in c.copied}
        self._shared = {k: e for k, e in self._shared.items() if id(e) in shared}
        self._shared_of = {r: [e for e in es if id(e) in shared] for r, es in self._shared_of.items()}

    def _key_seen(self, key: tuple, request: int) -> None:
        self._shapes.add(self._shape_of.get(request, (request,)), key)

    @property
    def chain_bytes(self) -> int:
        """Device bytes of the chain buffers (the blocks' outputs)."""
        return sum(t.untyped_storage().nbytes() for t in self._bufs.values())

    def _log_once(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("cuda graph (per block): %s; those blocks run eager", reason)

    def wrap(self, caller: Callable[[tuple, dict], Any], block: int, slot: int) -> Callable[..., Any]:
        """``call(args, kwargs, request)``: ``caller`` replayed from a graph once its key was seen (see the module
        doc)."""

        def call(args: tuple, kwargs: dict, request: int = 0) -> Any:
            flattened = flatten_call(args, kwargs)
            spec = tensor_specs(flattened[0], self._device) if flattened is not None else None
            if spec is None:
                self._log_once("a block takes an argument other than a CUDA tensor, a tuple of them or a constant")
                return caller(args, kwargs)
            flat, structure = flattened
            shape = (request, len(args), tuple(kwargs), structure, spec)  # a request's shape is its block 0's
            if block == 0:
                self._new_pass(request, shape)
            key = (block, slot, *shape)
            got = self._graphs.get(key)
            if got is not None:
                bufs = self._bufs
                for j, k in got.direct:  # loops, not generators: this is the replay's host work per block
                    if flat[j] is not bufs[k]:
                        self._log_once(
                            "a block's input is not the chain buffer it was at capture (the model "
                            "changed it between blocks)"
                        )
                        return caller(args, kwargs)
                if self._held(got.writes):
                    return caller(args, kwargs)
                for j, entry in got.copied:
                    self._copy_in(entry, flat[j])
                got.graph.replay()
                self.replays += 1
                return bufs[got.writes[0]] if got.single else tuple([bufs[k] for k in got.writes])
            if key in self._eager or key not in self._seen:
                out = caller(args, kwargs)
                if key not in self._seen:
                    self._key_seen(key, request)
                outs = flatten_outputs(out)
                self._seen[key] = None if outs is None else tensor_specs(outs, self._device)
                return out
            return self._capture(key, caller, args, kwargs, flat, block, request, spec)

        call.per_request = True  # compile_schedule binds each compute op's request
        return call

    def _held(self, writes: tuple) -> bool:
        """Whether a chain buffer this graph would write is still referenced (or viewed) outside the graphs: the
        model kept an earlier block's output. The call then runs eager (logged once)."""
        bufs, base = self._bufs, self._base
        for k in writes:
            if holders(bufs[k]) != base[k]:
                self.held_eager += 1
                self._log_once(
                    "the model keeps a block's output past the next block (a reference to it or a view "
                    "of it is alive when the block two further on would overwrite it)"
                )
                return True
        return False

    def _copy_in(self, entry: list[Any], src: torch.Tensor) -> None:
        """Copy ``src`` into a shared input unless it is the tensor copied last in this pass, unmodified since
        (same object, same version counter; every pass starts by copying). A graph's replay rewrites a chain
        buffer without bumping its version, so a chain buffer in a copied position (its key was captured while
        the block before ran eager) is copied every time."""
        if id(src) in self._chain:  # copied every time, and not remembered: that reference would hold it
            entry[0].copy_(src)
            entry[1] = None
            self.input_copies += 1
        elif entry[1] is not src or entry[2] != src._version:
            entry[0].copy_(src)
            entry[1], entry[2] = src, src._version
            self.input_copies += 1

    def _chain_keys(self, out_specs: tuple, block: int, request: int, device: torch.device) -> tuple:
        """The chain buffers block ``block`` writes for outputs of ``out_specs``, allocated once (outside the
        graphs' pool)."""
        keys = []
        for j, spec in enumerate(out_specs):
            k = (request, j, spec, block % 2)
            shape, stride, dtype, _ = spec
            if k not in self._bufs:
                self._bufs[k] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
                self._chain[id(self._bufs[k])] = k
                self._base[k] = holders(self._bufs[k])
            keys.append(k)
        return tuple(keys)

    def _capture(
        self,
        key: tuple,
        caller: Callable,
        args: tuple,
        kwargs: dict,
        flat: list[torch.Tensor],
        block: int,
        request: int,
        spec: tuple,
    ) -> Any:
        # What the graph reads, by position: a chain buffer (by key: nothing here holds it) or a shared input.
        direct, copied, sources = [], [], []
        for j, t in enumerate(flat):
            k = self._chain.get(id(t))
            if k is not None and self._bufs[k] is t:
                direct.append((j, k))
                sources.append((k, None))
            else:
                entry = self._shared.get((request, j, spec[j]))
                if entry is None:  # outside the graphs' pool: it outlives every capture
                    entry = self._shared[(request, j, spec[j])] = [
                        torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device),
                        None,
                        -1,
                    ]
                    self._shared_of.setdefault(request, []).append(entry)
                self._copy_in(entry, t)
                copied.append((j, entry))
                sources.append((None, entry))
        device = flat[0].device
        del flat
        out_specs = self._seen[key]
        if out_specs is None:
            self._eager.add(key)
            self._log_once("a block returns something other than a tensor or a tuple of tensors")
            return caller(args, kwargs)
        writes = self._chain_keys(out_specs, block, request, device)
        if self._held(writes):  # its first replay would overwrite an output the model keeps: eager, capture later
            return caller(args, kwargs)
        bufs, num_args, names, structure = self._bufs, len(args), key[4], key[5]

        def work() -> Any:
            inputs = [bufs[k] if k is not None else entry[0] for k, entry in sources]
            output = caller(*rebuild_call(num_args, names, structure, inputs))
            outs = flatten_outputs(output)
            if outs is None or tensor_specs(outs, self._device) != out_specs:
                raise ValueError(
                    "the block's outputs differ from those of its eager call (count, shape, strides or dtype)"
                )
            for t, k in zip(outs, writes):
                bufs[k].copy_(t)
            return output

        try:
            g, output = self._capturer.capture(work)
        except Exception as exc:  # a forward that syncs or launches something uncapturable
            self._eager.add(key)
            self._log_once(f"capture failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
            return caller(args, kwargs)
        single = isinstance(output, torch.Tensor)
        del output  # the block's own outputs are graph temporaries: the pool reuses them in later captures
        self._graphs[key] = _Captured(g, tuple(direct), tuple(copied), writes, single)
        self.captures += 1
        g.replay()  # the capture ran nothing: this call is the first replay (its inputs are in place)
        self.replays += 1
        return self._bufs[writes[0]] if single else tuple(self._bufs[k] for k in writes)
