"""The all-gathers of the executor's driver-call path on an NCCL communicator of its own, called through ``ctypes``.

Why: at W > 1 the eager loop's bound is not the loop but ``torch.distributed``'s NCCL call. One c10d all-gather
costs ~34 us of host time back to back on the H200's host and ~3x that between two blocks (a ``Work`` object,
its events, the watchdog's queue, the coalescing state; ``bench.allgather_host``), against ~1 us for a driver
call. So the driver-call path (:mod:`dlo_fn.runtime.cuda_raw`) issues its all-gathers the way it issues its
copies: ``ncclAllGather(send, recv, bytes, ncclUint8, comm, stream)`` with every argument bound once, at compile
time, as a ``ctypes`` object, and the all-gather stream passed by handle (no stream switch). A load group's
all-gathers are one ``ncclGroupStart`` / ``ncclGroupEnd`` launch.

**The communicator.** :func:`own_communicator` makes one per executor from its shard group: group rank 0 draws
the unique id (``ncclGetUniqueId``), the c10d group broadcasts it, and every rank joins on its device
(``ncclCommInitRank``). ``libnccl.so.2`` is the library torch loaded (found by its soname, or in the ``nvidia``
wheel's folder). The ranks first agree (one all-reduce) that every one of them can: if one cannot (no library,
``DLO_FN_RAW_NCCL=0``, no driver calls) they all keep c10d's calls, and say why once.

**Faults.** c10d's watchdog does not see these calls, so the communicator has its own, in two parts:

* :class:`Watchdog`, a thread that records a marker event on the all-gather stream every ``poll_s`` and checks
  that the last one completed (:class:`StallProbe`). The stream stuck behind one marker for ``timeout_s`` (the
  process group's timeout: a peer that died or stopped answering; NCCL's kernels spin on a dead peer) or an
  asynchronous NCCL error make it abort the communicator (``ncclCommAbort``: the kernels return), log one line
  naming the rank and the time, and end the process with :data:`FAULT_EXIT_CODE`;
* :class:`Monitor`, a small process the thread beats to after every check. While the main thread waits in a
  synchronous copy (``.cpu()``, ``.item()``) for a stream that never finishes, the driver blocks the watchdog's
  own CUDA calls (measured on the H200), so the thread cannot see the stall it is in; its beats stop, and after
  ``timeout_s`` and a little more the monitor prints one line and kills the process (SIGKILL).

Ending the process is what c10d's NCCL watchdog does by default (``TORCH_NCCL_ASYNC_ERROR_HANDLING``: tear
down): after an aborted collective the slots hold garbage, and the process must not go on to return an output
computed from them; the launcher (``serve_local``, torchrun) sees a rank that died. The watchdog pauses its
probe (not its beats) while a CUDA graph is being captured (:meth:`NcclComm.paused`), since its marker would
join the capture.

Step graphs keep capturing c10d's all-gather (:mod:`dlo_fn.runtime.graph`); the torch-event loop (NPU, CPU, a
recorded timeline) keeps c10d's calls too.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from dlo_fn.runtime.dist import exit_now

__all__ = ["FAULT_EXIT_CODE", "Monitor", "NcclComm", "NcclLib", "RAW_NCCL_ENV", "StallProbe", "Watchdog", "load_nccl",
           "own_communicator"]

log = logging.getLogger(__name__)

RAW_NCCL_ENV = "DLO_FN_RAW_NCCL"
FAULT_EXIT_CODE = 87  # the process ended by the watchdog (a stalled or failed all-gather)
_UNIQUE_ID_BYTES = 128
_NCCL_UINT8 = 1
_CUDA_ERROR_NOT_READY = 600
_ABORT_WAIT_S = 5.0


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * _UNIQUE_ID_BYTES)]


class NcclLib:
    """NCCL's entry points with their argument types, and the same ones without (for calls whose arguments are
    bound once as ctypes objects: no conversion per call, as in :class:`~dlo_fn.runtime.cuda_raw.RawCuda`)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, i, res = ctypes.c_void_p, ctypes.c_int, ctypes.c_int
        self.lib = lib
        sig = {
            "ncclGetVersion": (ctypes.POINTER(i),),
            "ncclGetUniqueId": (ctypes.POINTER(_UniqueId),),
            "ncclCommInitRank": (ctypes.POINTER(vp), i, _UniqueId, i),
            "ncclAllGather": (vp, vp, ctypes.c_size_t, i, vp, vp),
            "ncclGroupStart": (),
            "ncclGroupEnd": (),
            "ncclCommAbort": (vp,),
            "ncclCommDestroy": (vp,),
            "ncclCommGetAsyncError": (vp, ctypes.POINTER(res)),
        }
        for name, argtypes in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, res
            setattr(self, name[4:].lower(), fn)
        self._error_string = lib.ncclGetErrorString
        self._error_string.argtypes, self._error_string.restype = (res,), ctypes.c_char_p
        self.fast = {name: lib[name] for name in ("ncclAllGather", "ncclGroupStart", "ncclGroupEnd")}
        v = ctypes.c_int()
        self.check(self.getversion(ctypes.byref(v)), "ncclGetVersion")
        self.version = v.value

    def error(self, code: int) -> str:
        return (self._error_string(code) or b"?").decode("ascii", "replace")

    def check(self, code: int, what: str) -> None:
        if code:
            raise RuntimeError(f"NCCL call {what} failed: {self.error(code)} (ncclResult_t {code})")


def load_nccl() -> tuple[NcclLib | None, str]:
    """``(library, "")`` or ``(None, why not)``: the ``libnccl.so.2`` torch loaded (by soname: the process has it
    already when torch's CUDA library links it), else the one in the ``nvidia-nccl`` wheel's folder."""
    names = ["libnccl.so.2"]
    try:
        import nvidia.nccl  # the wheel torch's CUDA builds depend on

        names += [os.path.join(p, "lib", "libnccl.so.2") for p in nvidia.nccl.__path__]
    except ImportError:
        pass
    why = "no libnccl.so.2"
    for name in names:
        try:
            return NcclLib(ctypes.CDLL(name)), ""
        except (OSError, AttributeError, RuntimeError) as exc:
            why = f"{name}: {str(exc).splitlines()[0][:120]}"
    return None, why


class Watchdog:
    """A thread that calls ``probe()`` every ``poll_s`` seconds and ``on_fault(reason)`` once, when ``probe``
    returns a reason (a string) or raises; then it stops. ``probe`` runs only while not :meth:`paused`."""

    def __init__(self, probe: Callable[[], str | None], on_fault: Callable[[str], None], poll_s: float,
                 name: str = "dlo_fn-nccl-watchdog", setup: Callable[[], None] | None = None,
                 heartbeat: Callable[[], None] | None = None) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self.probe, self.on_fault, self.poll_s, self._setup = probe, on_fault, poll_s, setup
        self.heartbeat = heartbeat  # called after every tick, paused or not (a Monitor's beat)
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._paused = 0
        self.fault: str | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            if self._setup is not None:
                self._setup()
            while not self._stop.wait(self.poll_s):
                with self._lock:
                    reason = None if self._paused else self.probe()
                if reason is not None:
                    break
                if self.heartbeat is not None:
                    self.heartbeat()
        except Exception as exc:  # noqa: BLE001 - a probe that cannot run is a fault too
            reason = f"the watchdog's probe failed ({type(exc).__name__}: {exc})"
        else:
            if reason is None:  # stopped
                return
        self.fault = reason
        self.on_fault(reason)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No probe inside (a CUDA graph capture, which the probe's marker event would join)."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5 * self.poll_s, 1.0))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


_MONITOR = """
import os, select, signal, sys, time
pid, limit, line, parent = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
# parent: it watches its parent, whose death (this process reparented) means nothing to kill, not a stall
last = time.monotonic()
while True:
    ready, _, _ = select.select([0], [], [], min(1.0, max(0.0, last + limit - time.monotonic())))
    if ready:
        data = os.read(0, 4096)
        if not data or b"q" in data:
            sys.exit(0)
        last = time.monotonic()
    elif parent and os.getppid() != pid:
        sys.exit(0)
    elif time.monotonic() - last >= limit:
        print(line.replace("{s}", f"{time.monotonic() - last:.0f}"), file=sys.stderr, flush=True)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(0)
"""


class Monitor:
    """A small process that kills ``pid`` (SIGKILL) and prints ``line`` (``{s}``: the seconds it waited) when no
    :meth:`beat` came for ``limit_s``; it exits quietly on :meth:`stop` or when the beating process is gone (its
    pipe closes; or, watching its own parent, once it is reparented: a child forked from the parent may hold the
    pipe open, and a dead parent's pid may be reused).

    Why a process: while one thread of a CUDA process waits in a synchronous copy (``.cpu()``, ``.item()``) for a
    stream that never finishes, the driver blocks every other thread's CUDA calls (seen on the H200: a thread's
    ``cuEventRecord`` / ``cuEventQuery`` waited as long as the copy did, pure Python kept running), so the
    watchdog thread can be stuck inside its own probe. Its beats then stop, and this process ends the stuck one
    from outside."""

    def __init__(self, limit_s: float, line: str, pid: int | None = None) -> None:
        import subprocess

        target = pid or os.getpid()
        self.proc = subprocess.Popen([sys.executable, "-c", _MONITOR, str(target), str(limit_s), line,
                                      "1" if target == os.getpid() else "0"],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)
        self._fd = self.proc.stdin.fileno()
        os.set_blocking(self._fd, False)

    def beat(self) -> None:
        try:
            os.write(self._fd, b".")
        except (BlockingIOError, BrokenPipeError, OSError):  # a full pipe still holds beats; a gone monitor none
            pass

    def stop(self) -> None:
        try:
            os.write(self._fd, b"q")
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - it exits on the closed pipe anyway
            self.proc.kill()


class StallProbe:
    """The watchdog's check of one stream (``probe()``): a marker event recorded on it, and the time it has
    been pending; a reason once it has been pending ``timeout_s``, or when ``async_error()`` reports one."""

    def __init__(self, cu: Any, stream: int, timeout_s: float, async_error: Callable[[], str | None]) -> None:
        self.cu, self.stream, self.timeout_s, self.async_error = cu, stream, timeout_s, async_error
        self.marker: Any = None
        self.since: float | None = None

    def __call__(self) -> str | None:
        err = self.async_error()
        if err is not None:
            return err
        if self.marker is None:
            self.marker = self.cu.new_event()
        now = time.monotonic()
        if self.since is not None:
            code = self.cu._query(self.marker.handle)
            if code == _CUDA_ERROR_NOT_READY:
                if now - self.since >= self.timeout_s:
                    return (f"the all-gather stream made no progress for {now - self.since:.0f} s (timeout "
                            f"{self.timeout_s:.0f} s): a peer rank died or stopped answering its all-gathers")
                return None
            self.cu.check(code, "cuEventQuery")
        self.cu.check(self.cu._record(self.marker.handle, self.stream), "cuEventRecord")
        self.since = now
        return None


class NcclComm:
    """One NCCL communicator over a process group's ranks, its bound all-gathers and its watchdog."""

    def __init__(self, nccl: NcclLib, handle: int, rank: int, world: int, device: torch.device) -> None:
        self.nccl, self.rank, self.world, self.device = nccl, rank, world, device
        self._comm = ctypes.c_void_p(handle)
        self.watchdog: Watchdog | None = None
        self.monitor: Monitor | None = None
        self.closed = False
        self._pid = os.getpid()  # a forked child's copy must not stop the parent's monitor or destroy its comm

    def async_error(self) -> str | None:
        code = ctypes.c_int()
        self.nccl.check(self.nccl.commgetasyncerror(self._comm, ctypes.byref(code)), "ncclCommGetAsyncError")
        return None if code.value == 0 else f"NCCL reported {self.nccl.error(code.value)} (ncclResult_t {code.value})"

    def bind(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], stream: int) -> tuple[tuple[Any, tuple], ...]:
        """The driver-call segment's calls ``(fn, args)`` for the all-gather of ``pairs`` ((output, input) uint8
        views; output = world x input) on ``stream``: one ``ncclAllGather`` per pair, a group launch for several."""
        fast, vp = self.nccl.fast, ctypes.c_void_p
        calls = []
        for out, inp in pairs:
            n = inp.numel() * inp.element_size()
            if out.numel() * out.element_size() != n * self.world:
                raise ValueError(f"all-gather output of {out.numel()} bytes for {self.world} x {n} input bytes")
            calls.append((fast["ncclAllGather"], (vp(inp.data_ptr()), vp(out.data_ptr()), ctypes.c_size_t(n),
                                                  ctypes.c_int(_NCCL_UINT8), self._comm, vp(stream))))
        if len(calls) > 1:
            calls = [(fast["ncclGroupStart"], ()), *calls, (fast["ncclGroupEnd"], ())]
        return tuple(calls)

    def all_gather(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], stream: int) -> None:
        for fn, args in self.bind(pairs, stream):
            self.nccl.check(fn(*args), getattr(fn, "__name__", "nccl"))

    def paused(self) -> Any:
        return self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()

    def watch(self, cu: Any, stream: int, timeout_s: float, poll_s: float | None = None,
              on_fault: Callable[[str], None] | None = None) -> Watchdog:
        """Start the watchdog on ``stream`` (see the module docstring); ``on_fault`` default: abort, log, exit."""
        probe = StallProbe(cu, stream, timeout_s, self.async_error)
        device = self.device

        def setup() -> None:  # the driver calls of the thread need the device's context current
            torch.cuda.set_device(device)

        poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 10)
        # the watchdog thread stuck in a CUDA call (Monitor's docstring) for the timeout and a little more
        self.monitor = Monitor(timeout_s + 2 * poll_s + 1.0, _ending(
            f"dlo_fn: rank {self.rank}: the executor's all-gather watchdog has been blocked for {{s}} s (timeout "
            f"{timeout_s:.0f} s) behind a device that does not finish its all-gathers: a peer rank died or stopped "
            "answering; its monitor killed this process (SIGKILL)"))
        self.watchdog = Watchdog(probe, on_fault or self._fail_process, poll_s, setup=setup,
                                 heartbeat=self.monitor.beat)
        return self.watchdog

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.nccl.commabort(self._comm)

    def _fail_process(self, reason: str) -> None:
        if self.monitor is not None:  # this thread ends the process itself now, within _ABORT_WAIT_S
            self.monitor.stop()
        _report(f"dlo_fn: rank {self.rank}: aborting the executor's all-gather communicator and ending this process "
                f"(exit {FAULT_EXIT_CODE}), so that no output is computed from unfinished weights: {reason}")
        # ncclCommAbort frees device memory, which can wait for the device (the kernel that holds the stream): it
        # gets a few seconds, then the process ends anyway (the driver tears its context down)
        aborting = threading.Thread(target=self.abort, daemon=True)
        aborting.start()
        aborting.join(_ABORT_WAIT_S)
        exit_now(FAULT_EXIT_CODE)

    def close(self) -> None:
        """Stop the watchdog and destroy the communicator (after the device has finished its all-gathers; an
        aborted one is gone already). A no-op in a process forked from the one that made it."""
        if os.getpid() != self._pid:
            return
        if self.watchdog is not None:
            self.watchdog.stop()
            self.monitor.stop()
        if not self.closed:
            self.closed = True
            self.nccl.commdestroy(self._comm)


def group_timeout_s(group: Any, device: torch.device, default: float) -> float:
    """The c10d timeout of ``group`` on ``device`` (its backend's options), or ``default`` where torch hides it."""
    try:
        return float(group._get_backend(device).options._timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError):
        return default


def own_communicator(group: Any, device: torch.device, can: bool, why_not: str = "",
                     timeout_s: float = 300.0) -> tuple[NcclComm | None, str]:
    """``(communicator, "")`` for the ranks of the NCCL process group ``group``, or ``(None, why not)``: a
    collective call of every rank of ``group`` (see the module docstring). ``can``: whether this rank may (its
    driver-call path is on and ``DLO_FN_RAW_NCCL`` is not ``0``); ``why_not`` says why not when it may not.
    ``timeout_s`` bounds the joining: past it the process ends (:data:`FAULT_EXIT_CODE`)."""
    import torch.distributed as dist

    if dist.get_backend(group) != "nccl":
        return None, f"the shard group's backend is {dist.get_backend(group)!r}, not NCCL"
    nccl = None
    if can:
        nccl, why_not = load_nccl()
    flag = torch.tensor([1 if nccl is not None else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if int(flag.item()) == 0:
        return None, why_not or "another rank of the shard group cannot (see its log)"
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    uid = _UniqueId()
    if rank == 0:
        nccl.check(nccl.getuniqueid(ctypes.byref(uid)), "ncclGetUniqueId")
    raw = torch.frombuffer(bytearray(bytes(uid)), dtype=torch.uint8).to(device)
    dist.broadcast(raw, src=dist.get_global_rank(group, 0), group=group)
    uid = _UniqueId.from_buffer_copy(bytes(raw.cpu().tolist()))
    handle = ctypes.c_void_p()
    # ncclCommInitRank waits for every rank: a peer that dies between the broadcast and here would hold it forever
    timer = threading.Timer(timeout_s, _fail_init, (rank, timeout_s))
    timer.daemon = True
    timer.start()
    try:
        with torch.cuda.device(device):
            nccl.check(nccl.comminitrank(ctypes.byref(handle), world, uid, rank), "ncclCommInitRank")
    finally:
        timer.cancel()
    return NcclComm(nccl, handle.value, rank, world, device), ""


def _fail_init(rank: int, timeout_s: float) -> None:
    _end_process(f"dlo_fn: rank {rank}: ncclCommInitRank did not return within {timeout_s:.0f} s (a peer rank died "
                 "or never joined)")


def _ending(line: str) -> str:
    return line + ": restart the job (DLO_FN_RAW_NCCL=0 uses torch.distributed's NCCL calls instead)"


def _report(line: str) -> None:
    """``line`` (and the way out) once, through the application's logging or on stderr, flushed: the process ends
    right after (the one line comes first: the abort that follows may not return)."""
    line = _ending(line)
    if log.hasHandlers():  # the application's logging (the CLI's goes to stderr)
        log.critical(line)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
    else:
        print(line, file=sys.stderr, flush=True)


def _end_process(line: str) -> None:
    _report(line + f"; ending this process (exit {FAULT_EXIT_CODE})")
    exit_now(FAULT_EXIT_CODE)
