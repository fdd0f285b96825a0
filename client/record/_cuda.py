"""The few CUDA driver calls the recorder's engine-facing copy makes, without releasing the GIL.

Why not torch for these. The recorder's engine-thread call queues one device-to-host copy of a
slab on a side stream plus two stream/event dependencies. Through torch that is about seven
Python-level CUDA calls, and every one of them releases the GIL and takes it back: in a process
whose recorder sender thread is running Python, each re-acquisition may wait for that thread
(up to the interpreter's switch interval, 5 ms by default). The same calls through
``ctypes.PyDLL`` (which keeps the GIL for the duration of the foreign call; each of these returns
in microseconds, nothing here blocks) make the call one uninterrupted stretch of the engine
thread.

Only the non-blocking calls hold the GIL: :meth:`DriverEvent.synchronize`, which waits for a copy
to land (the sender thread), goes through a ``ctypes.CDLL`` handle of the same library, which
releases it. The CUDA driver API (``libcuda.so.1``) is used rather than the runtime because its
name is fixed on every Linux install with an NVIDIA driver, and its handles are the ones torch's
streams and pointers carry (``torch.cuda.Stream.cuda_stream`` is a ``CUstream``, ``data_ptr()``
a ``CUdeviceptr`` or a registered host address). It acts on the calling thread's current
context, which torch made current on the engine thread with its first CUDA call.

:func:`driver` returns None wherever the library or a symbol is missing (no NVIDIA driver, a
ROCm build of torch): the recorder then keeps its torch path. ``TRACESTORE_RECORDER_COPY=torch``
forces that path (for comparison in benchmarks).

Function signatures: CUDA Driver API reference, "Stream Management", "Event Management" and "Memory
Management" (``cuMemcpyDtoHAsync_v2``, ``cuMemsetD32Async``, ``cuEventCreate``, ``cuEventRecord``,
``cuStreamWaitEvent``, ``cuEventSynchronize``, ``cuEventQuery``, ``cuEventDestroy_v2``).
"""

from __future__ import annotations

import ctypes
import threading

from tracestore.errors import TraceStoreError
from tracestore.settings import RECORDER_COPY, read_env

_CU_EVENT_DISABLE_TIMING = 0x2
_CUDA_ERROR_NOT_READY = 600


class CudaDriverError(TraceStoreError):
    """A CUDA driver call failed; the message names the call and the driver's error name."""


class Driver:
    """``libcuda.so.1`` bound twice: ``held`` (PyDLL: the GIL stays with the caller) for calls
    that return at once, ``free`` (CDLL: the GIL is released) for waits."""

    def __init__(self, held: ctypes.PyDLL, free: ctypes.CDLL) -> None:
        vp, sz, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        self._held = held
        self._memcpy = held.cuMemcpyDtoHAsync_v2
        self._memcpy.argtypes = [vp, ctypes.c_uint64, sz, vp]
        self._record = held.cuEventRecord
        self._record.argtypes = [vp, vp]
        self._wait = held.cuStreamWaitEvent
        self._wait.argtypes = [vp, vp, u]
        self._query = held.cuEventQuery
        self._query.argtypes = [vp]
        self._create = held.cuEventCreate
        self._create.argtypes = [ctypes.POINTER(vp), u]
        self._destroy = held.cuEventDestroy_v2
        self._destroy.argtypes = [vp]
        self._memset = held.cuMemsetD32Async
        self._memset.argtypes = [ctypes.c_uint64, u, sz, vp]
        self._sync = free.cuEventSynchronize
        self._sync.argtypes = [vp]
        self._name = held.cuGetErrorName
        self._name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for f in (
            self._memcpy,
            self._memset,
            self._record,
            self._wait,
            self._query,
            self._create,
            self._destroy,
            self._sync,
        ):
            f.restype = ctypes.c_int
        self._name.restype = ctypes.c_int
        self._events: list[int] = []  # pooled event handles
        self._lock = threading.Lock()

    def _check(self, rc: int, what: str) -> None:
        if rc:
            name = ctypes.c_char_p()
            self._name(rc, ctypes.byref(name))
            raise CudaDriverError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")

    def event(self) -> DriverEvent:
        """A timing-less event (a pooled handle, a new one when the pool is empty)."""
        with self._lock:
            if self._events:
                return DriverEvent(self, self._events.pop())
        handle = ctypes.c_void_p()
        self._check(self._create(ctypes.byref(handle), _CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        return DriverEvent(self, int(handle.value or 0))

    def give_back(self, event: DriverEvent) -> None:
        """Return ``event``'s handle to the pool: nothing waits on it any more (a stream wait
        already issued keeps the state the event had at that call, so it may be recorded again).
        The wrapper is spent: giving it back or synchronizing it again does nothing."""
        handle, event.handle = event.handle, 0
        if not handle:
            return
        with self._lock:
            if len(self._events) < 64:
                self._events.append(handle)
                return
        self._destroy(handle)

    def fill32(self, dst: int, value: int, count: int, stream: int) -> None:
        """Queue setting ``count`` 32-bit words at device address ``dst`` to ``value`` on ``stream``."""
        self._check(self._memset(dst, value, count, stream), "cuMemsetD32Async")

    def copy_to_host(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue ``nbytes`` from device address ``src`` to pinned host address ``dst`` on ``stream``."""
        self._check(self._memcpy(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")

    def record(self, event: DriverEvent, stream: int) -> None:
        self._check(self._record(event.handle, stream), "cuEventRecord")

    def wait(self, stream: int, event: DriverEvent) -> None:
        """Make ``stream``'s later work wait for ``event`` (no host wait)."""
        self._check(self._wait(stream, event.handle, 0), "cuStreamWaitEvent")


class DriverEvent:
    """One use of a pooled CUDA event: ``synchronize`` waits (GIL released) and returns the
    handle to the pool; ``query`` tells whether the work before it has finished. A spent event
    (handle 0) is finished: both return at once."""

    __slots__ = ("driver", "handle")

    def __init__(self, driver: Driver, handle: int) -> None:
        self.driver = driver
        self.handle = handle

    def query(self) -> bool:
        if not self.handle:
            return True
        rc = self.driver._query(self.handle)
        if rc == _CUDA_ERROR_NOT_READY:
            return False
        self.driver._check(rc, "cuEventQuery")
        return True

    def wait_host(self) -> None:
        """Wait for the event (the GIL is released meanwhile); the handle stays with its owner."""
        if self.handle:
            self.driver._check(self.driver._sync(self.handle), "cuEventSynchronize")

    def synchronize(self) -> None:
        """Wait for the event (the GIL is released meanwhile), then give its handle back."""
        if self.handle:
            self.driver._check(self.driver._sync(self.handle), "cuEventSynchronize")
            self.driver.give_back(self)


_DRIVER: list[Driver | None] = []


def driver() -> Driver | None:
    """The process's :class:`Driver`, or None where the CUDA driver library cannot be used."""
    if not _DRIVER:
        d: Driver | None = None
        if read_env(RECORDER_COPY) != "torch":
            try:
                d = Driver(ctypes.PyDLL("libcuda.so.1"), ctypes.CDLL("libcuda.so.1"))
            except (OSError, AttributeError):
                d = None
        _DRIVER.append(d)
    return _DRIVER[0]


__all__ = ["CudaDriverError", "Driver", "DriverEvent", "driver"]
