"""One small interface over CUDA, Ascend NPU and CPU: device, collective backend, streams, events, pinned memory.

=========  ==========  =======  ======================================================================
platform   device      backend  streams / events / host memory
=========  ==========  =======  ======================================================================
``cuda``   cuda:<i>    nccl     ``torch.Stream`` / ``torch.Event`` (device-generic); exact-size pinned
                                memory through ``cudaHostRegister`` (see :func:`pin_exact`)
``npu``    npu:<i>     hccl     the same generic types through ``torch_npu`` (import-guarded); pinned
                                memory from the driver's host allocator
``cpu``    cpu         gloo     :class:`HostStream` / :class:`HostEvent`: no-op streams, events that
                                record the host clock and wait for a pending collective; no pinning
=========  ==========  =======  ======================================================================

The executor is written against this interface only, so the CPU tests run the very code path the
accelerators run (stream switches, event waits and records), with host clocks in place of device ones.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

__all__ = ["Platform", "HostStream", "HostEvent", "detect_platform", "device_shortfall", "platform_for"]


class HostEvent:
    """A CPU event: ``record`` stamps the host clock; ``work`` may hold a pending async collective that any
    stream waiting on this event must first complete (gloo ``async_op=True``)."""

    __slots__ = ("time_ns", "work")

    def __init__(self) -> None:
        self.time_ns = 0
        self.work: Any = None

    def record(self, stream: Any = None) -> None:
        self.time_ns = time.perf_counter_ns()

    def wait(self, stream: Any = None) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def synchronize(self) -> None:
        self.wait()

    def query(self) -> bool:
        return self.work is None or self.work.is_completed()

    def elapsed_time(self, end: "HostEvent") -> float:
        """Milliseconds from this event to ``end`` (the ``torch.Event`` convention)."""
        return (end.time_ns - self.time_ns) / 1e6


class HostStream:
    """A CPU "stream": work runs in issue order on the host, so the only thing to wait for is a pending
    collective attached to an event."""

    __slots__ = ("name",)

    def __init__(self, name: str = "host") -> None:
        self.name = name

    def wait_event(self, event: HostEvent) -> None:
        event.wait()

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        event = event or HostEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> "HostStream":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Platform:
    """Handles for one device kind. ``kind`` is ``"cuda"``, ``"npu"`` or ``"cpu"``."""

    kind: str
    device: torch.device
    backend: str

    def __post_init__(self) -> None:
        if self.kind not in ("cuda", "npu", "cpu"):
            raise ValueError(f"platform kind must be cuda, npu or cpu, got {self.kind!r}")

    # -- capabilities ------------------------------------------------------------------------------
    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"

    @property
    def supports_pinned(self) -> bool:
        return self.kind != "cpu"

    @property
    def _module(self) -> Any:
        """``torch.cuda`` or ``torch.npu``: the fallback for calls older torch lacks generically."""
        return getattr(torch, self.kind)

    # -- streams and events ------------------------------------------------------------------------
    def new_stream(self, name: str = "side", priority: int = 0) -> Any:
        """A stream; ``priority < 0`` is higher than the default (0): its kernels get the device's free
        multiprocessors before those of default-priority streams."""
        if not self.is_accelerator:
            return HostStream(name)
        if hasattr(torch, "Stream") and hasattr(torch.Stream, "__enter__"):
            return torch.Stream(device=self.device, priority=priority)
        return self._module.Stream(device=self.device, priority=priority)

    def current_stream(self) -> Any:
        if not self.is_accelerator:
            return _HOST_STREAM
        acc = getattr(torch, "accelerator", None)
        if acc is not None and hasattr(acc, "current_stream"):
            return acc.current_stream(self.device)
        return self._module.current_stream(self.device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context in which kernels (and collectives) are issued on ``stream``."""
        if not self.is_accelerator:
            return contextlib.nullcontext(stream)
        if hasattr(stream, "__enter__"):
            return stream
        return self._module.stream(stream)

    def stream_setter(self) -> Any:
        """A function ``set(stream)`` making ``stream`` current (no context object, for the executor's hot
        loop: one call per switch instead of an enter/exit pair); a no-op on CPU."""
        if not self.is_accelerator:
            return _no_op
        acc = getattr(torch, "accelerator", None)
        if acc is not None and hasattr(acc, "set_stream"):
            return acc.set_stream
        return self._module.set_stream

    def new_event(self, timing: bool = False) -> Any:
        if not self.is_accelerator:
            return HostEvent()
        if hasattr(torch, "Event"):
            return torch.Event(device=self.device, enable_timing=timing)
        return self._module.Event(enable_timing=timing)

    def synchronize(self) -> None:
        if self.is_accelerator:
            acc = getattr(torch, "accelerator", None)
            if acc is not None and hasattr(acc, "synchronize"):
                acc.synchronize(self.device)
            else:
                self._module.synchronize(self.device)

    # -- memory ------------------------------------------------------------------------------------
    def _mem(self, name: str) -> Any:
        acc = getattr(torch, "accelerator", None)
        fn = getattr(acc, name, None) if acc is not None else None
        return fn if fn is not None else getattr(self._module, name)

    def memory_allocated(self) -> int:
        """Bytes held by tensors on the device (0 on CPU: host tensors are measured with PSS/USS)."""
        return int(self._mem("memory_allocated")(self.device)) if self.is_accelerator else 0

    def max_memory_allocated(self) -> int:
        return int(self._mem("max_memory_allocated")(self.device)) if self.is_accelerator else 0

    def reset_peak_memory_stats(self) -> None:
        if self.is_accelerator:
            self._mem("reset_peak_memory_stats")(self.device)

    def describe(self) -> dict[str, str]:
        """Machine facts for benchmark records."""
        out = {"platform": self.kind, "backend": self.backend, "torch": torch.__version__}
        if self.kind == "cuda":
            out["device_name"] = torch.cuda.get_device_name(self.device)
            out["cuda"] = str(torch.version.cuda)
        elif self.kind == "npu":
            out["device_name"] = str(self._module.get_device_name(self.device))
        return out


_HOST_STREAM = HostStream("default")


def _no_op(*_args: Any) -> None:
    return None


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu and the hccl backend)
    except ImportError:
        return False
    return bool(torch.npu.is_available())


def device_shortfall(kind: str, local_rank: int, local_world_size: int, device_count: int) -> str | None:
    """None when each of this host's ``local_world_size`` ranks (this one ``local_rank``) has a device of its
    own among ``device_count``; else the one line that says so and what to do. Every rank of the host finds the
    same shortfall (``local_world_size`` is the host's), so rank 0 can say it for all."""
    ranks = max(local_world_size, local_rank + 1)
    if ranks <= device_count:
        return None
    devices = f"{device_count} {kind.upper()} device" + ("" if device_count == 1 else "s")
    return (
        f"{ranks} ranks on this host but {devices}: each rank needs a device of its own; start at most "
        f"{device_count} per host (torchrun --nproc-per-node {device_count}) or run the ranks on the CPU "
        "(--platform cpu)"
    )


def platform_for(kind: str, local_rank: int = 0) -> Platform:
    """The platform of ``kind`` for the process with this local rank (one device per process). ``ValueError``
    when the host has fewer devices than ranks (``$LOCAL_WORLD_SIZE``, which torchrun sets)."""
    if kind in ("cuda", "npu"):
        if kind == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("platform 'cuda' asked for but torch.cuda.is_available() is False")
        if kind == "npu" and not _npu_available():
            raise RuntimeError("platform 'npu' asked for but torch_npu is missing or sees no NPU")
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        why = device_shortfall(kind, local_rank, local_world_size, getattr(torch, kind).device_count())
        if why:
            raise ValueError(why)
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        return Platform("cuda", torch.device("cuda", local_rank), "nccl")
    if kind == "npu":
        torch.npu.set_device(local_rank)
        return Platform("npu", torch.device("npu", local_rank), "hccl")
    if kind == "cpu":
        return Platform("cpu", torch.device("cpu"), "gloo")
    raise ValueError(f"unknown platform {kind!r}: use cuda, npu or cpu")


def detect_platform(local_rank: int | None = None, prefer: str | None = None) -> Platform:
    """CUDA if available, else NPU if ``torch_npu`` sees one, else CPU. ``prefer`` (or the environment
    variable ``DLO_FN_PLATFORM``) forces a kind; ``local_rank`` defaults to ``$LOCAL_RANK`` or 0."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    prefer = prefer or os.environ.get("DLO_FN_PLATFORM") or None
    if prefer:
        return platform_for(prefer, local_rank)
    if torch.cuda.is_available():
        return platform_for("cuda", local_rank)
    if _npu_available():
        return platform_for("npu", local_rank)
    return platform_for("cpu", local_rank)


@contextlib.contextmanager
def host_timer() -> Iterator[list[float]]:
    """``with host_timer() as t: ...`` then ``t[0]`` is the elapsed wall time in seconds."""
    out: list[float] = []
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        out.append(time.perf_counter() - t0)
