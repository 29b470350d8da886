"""The executor's eager ops on CUDA through the driver API directly: H2D / D2D copies, event records and waits.

Each op of the hot loop is one driver call (``cuMemcpyHtoDAsync``, ``cuMemcpyDtoDAsync``, ``cuEventRecord``,
``cuStreamWaitEvent``) on a stream named by its handle, with pointers resolved once at compile time: no
``Tensor.copy_`` dispatch, no stream switch, no ``torch.Event`` wrapper. On a slow host each torch-level call
costs ~5-10 us and an op takes 3-5 of them (measured on the H200 host: 36 us of load issue per block through
torch); a ``ctypes`` call costs ~1 us. The bytes moved and the order of the streams are the same, so the output
is bit-identical. Kernels still come from torch on its current stream, whose handle the compute ops wait and
record on; an all-gather (W > 1) is a bound ``ncclAllGather`` on the executor's own communicator
(:mod:`dlo_fn.runtime.nccl_raw`), or else its process group's call with the all-gather stream made current
around it (``Executor._bind_gather``).

:func:`raw_cuda` returns None (the executor keeps the torch calls) off CUDA, where ``libcuda`` cannot be loaded,
or when ``DLO_FN_RAW_CUDA=0``.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

__all__ = ["RawCuda", "RawEvent", "RawStream", "raw_cuda", "stream_handle"]

_DISABLE_TIMING = 2


def stream_handle(stream: Any) -> int:
    """The ``cudaStream_t`` of a ``torch.cuda.Stream`` or a device-generic ``torch.Stream`` on CUDA."""
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        handle = torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                                   device_type=stream.device_type).cuda_stream
    return int(handle)


class RawCuda:
    """Driver entry points with their argument types bound once."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, sz, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        self._create = lib.cuEventCreate
        self._create.argtypes = (ctypes.POINTER(vp), u)
        self._destroy = getattr(lib, "cuEventDestroy_v2", None) or lib.cuEventDestroy
        self._destroy.argtypes = (vp,)
        self._record = lib.cuEventRecord
        self._record.argtypes = (vp, vp)
        self._wait = lib.cuStreamWaitEvent
        self._wait.argtypes = (vp, vp, u)
        self._query = lib.cuEventQuery  # 0: done, 600 (CUDA_ERROR_NOT_READY): pending (runtime.nccl_raw's watchdog)
        self._query.argtypes = (vp,)
        self._h2d = lib.cuMemcpyHtoDAsync_v2
        self._h2d.argtypes = (ctypes.c_uint64, vp, sz, vp)
        self._d2d = lib.cuMemcpyDtoDAsync_v2
        self._d2d.argtypes = (ctypes.c_uint64, ctypes.c_uint64, sz, vp)

        # The same entry points once more without argtypes, for calls whose arguments are bound once as ctypes
        # objects (the executor's fast segments): no per-call conversion (~0.5 us of a ~1.5-2 us ctypes call on
        # a slow host). ``lib[name]`` is a fresh function pointer; ``lib.name`` is the cached one above.
        self._fast = {name: lib[name] for name in ("cuStreamWaitEvent", "cuEventRecord", "cuMemcpyHtoDAsync_v2",
                                                     "cuMemcpyDtoDAsync_v2")}

    def bind_wait(self, stream: int, event: int) -> tuple[Any, tuple]:
        """``(fn, args)``: ``fn(*args)`` makes ``stream`` wait for ``event`` and returns the CUresult."""
        vp = ctypes.c_void_p
        return self._fast["cuStreamWaitEvent"], (vp(stream), vp(event), ctypes.c_uint(0))

    def bind_carry_wait(self, stream: int, event: int) -> tuple[Any, tuple]:
        """:meth:`bind_wait` on an event of the previous run (recorded before this run began)."""
        return self.bind_wait(stream, event)

    def bind_record(self, event: int, stream: int) -> tuple[Any, tuple]:
        vp = ctypes.c_void_p
        return self._fast["cuEventRecord"], (vp(event), vp(stream))

    def bind_copy(self, dst: int, src: int, nbytes: int, stream: int, device_src: bool) -> tuple[Any, tuple]:
        fn = self._fast["cuMemcpyDtoDAsync_v2" if device_src else "cuMemcpyHtoDAsync_v2"]
        src_arg = ctypes.c_uint64(src) if device_src else ctypes.c_void_p(src)
        return fn, (ctypes.c_uint64(dst), src_arg, ctypes.c_size_t(nbytes), ctypes.c_void_p(stream))

    @staticmethod
    def check(code: int, what: str) -> None:
        if code:
            raise RuntimeError(f"CUDA driver call {what} failed with CUresult {code}")

    def new_event(self) -> "RawEvent":
        ev = ctypes.c_void_p()
        self.check(self._create(ctypes.byref(ev), _DISABLE_TIMING), "cuEventCreate")
        return RawEvent(self, ev.value)

    def copy(self, dst: int, src: int, nbytes: int, stream: int, device_src: bool) -> None:
        code = (self._d2d if device_src else self._h2d)(dst, src, nbytes, stream)
        if code:
            self.check(code, "cuMemcpyDtoDAsync" if device_src else "cuMemcpyHtoDAsync")


class RawEvent:
    """A driver event (no timing) with the ``record(stream)`` of ``torch.Event``; ``stream`` a :class:`RawStream`."""

    __slots__ = ("cu", "handle", "__weakref__")

    def __init__(self, cu: RawCuda, handle: int) -> None:
        self.cu, self.handle = cu, handle

    def record(self, stream: "RawStream") -> None:
        self.cu.check(self.cu._record(self.handle, stream.handle), "cuEventRecord")

    def __del__(self) -> None:
        try:
            self.cu._destroy(self.handle)
        except Exception:  # interpreter shutdown: the context may be gone already
            pass


class RawStream:
    """A stream handle with the ``wait_event`` of ``torch.Stream`` for :class:`RawEvent` s."""

    __slots__ = ("cu", "handle")

    def __init__(self, cu: RawCuda, handle: int) -> None:
        self.cu, self.handle = cu, handle

    def wait_event(self, event: RawEvent) -> None:
        self.cu.check(self.cu._wait(self.handle, event.handle, 0), "cuStreamWaitEvent")


def raw_cuda(platform: Any) -> RawCuda | None:
    """Driver calls for the executor's eager loop, or None (see the module docstring)."""
    if platform.kind != "cuda" or os.environ.get("DLO_FN_RAW_CUDA", "1") == "0":
        return None
    try:
        return RawCuda(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None
