"""Plan reads in a child process, so decoding does not wait for a training loop's GIL.

``GuidanceReader(url, run, process=True)`` hands each read of a storage URL to one child process
that owns a :class:`~tracestore.reader.StoreReader`. A read in a thread of the trainer's own
process shares the interpreter lock with the training loop: beside a thread that is busy in
Python, a 198 MiB plan read ran at 0.22 GB/s on 2 cores and 0.14 GB/s on 16 (bench_ingest),
against ~1.3-1.8 GB/s alone. The child has its own interpreter, so its decode threads only
compete for cores.

Nothing is copied back. The child places the rows (``StoreReader.read(allocate=...)``) in a
memfd block that both processes map: its descriptor crosses the unix socketpair once
(``SCM_RIGHTS``), when the block is new. The parent's arrays are views of that block. The block
serves a later read only after every array of the read that filled it is gone: the read's
arrays are all views of one base array, and a ``weakref.finalize`` on it tells the child the
block is free. Blocks are reused, not made anew per read, because fresh pages fault in at ~1.5 GB/s
on the bench VM.

The child starts as ``python -c`` with a small bootstrap, not through ``multiprocessing``, so the
trainer's ``__main__`` is never imported again. It exits when the socket closes, which also
happens when the parent dies. If it dies itself, the read in progress raises
:class:`~tracestore.errors.StorageError`, and the next read starts a new child.

Wire format, both ways: an 8-byte little-endian length, then a pickle. The child only unpickles
what its parent sends it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import weakref
from typing import Any

import numpy as np

from tracestore.errors import StorageError, TraceStoreError

log = logging.getLogger(__name__)

_LEN = struct.Struct("<Q")
BLOCK_ROUND = 2 << 20  # block sizes are whole multiples of this (so a little growth still fits)
SPARE_BLOCKS = 2  # free blocks the child keeps mapped for the next reads; more are unmapped

_BOOT = (
    "import pickle, socket, struct, sys\n"
    "s = socket.socket(fileno=int(sys.argv[1]))\n"
    "(n,) = struct.unpack('<Q', s.recv(8, socket.MSG_WAITALL))\n"
    "sys.path[:0] = pickle.loads(s.recv(n, socket.MSG_WAITALL))\n"
    "from tracestore.client.read_process import serve\n"
    "serve(s)\n"
)


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("socket closed")
        got += k
    return bytes(buf)


def _recv(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return pickle.loads(_recv_exact(sock, n))


# -- the child --------------------------------------------------------------------------------------


class _Blocks:
    """The child's memfd blocks: id -> [fd, mmap, size, busy]."""

    def __init__(self) -> None:
        self.blocks: dict[int, list[Any]] = {}
        self.next_id = 0
        self.new: list[int] = []  # made during this read: their fds go to the parent
        self.dropped: list[int] = []  # unmapped since the last reply: the parent drops them too

    def take(self, n: int) -> tuple[int, np.ndarray]:
        free = [(b[2], i) for i, b in self.blocks.items() if not b[3] and b[2] >= n]
        if free:
            _, i = min(free)
        else:
            size = max(BLOCK_ROUND, -(-n // BLOCK_ROUND) * BLOCK_ROUND)
            fd = os.memfd_create("tracestore-read", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size)
            except BaseException:
                os.close(fd)
                raise
            i, self.next_id = self.next_id, self.next_id + 1
            self.blocks[i] = [fd, mm, size, False]
            self.new.append(i)
        block = self.blocks[i]
        block[3] = True
        return i, np.frombuffer(block[1], np.uint8, count=n)

    def free(self, i: int) -> None:
        block = self.blocks.get(i)
        if block is None:
            return
        block[3] = False
        spare = sorted((b[2], j) for j, b in self.blocks.items() if not b[3])
        for _, j in spare[:-SPARE_BLOCKS] if len(spare) > SPARE_BLOCKS else ():
            self._unmap(j)  # the smallest go first: the next read is as large as the last ones

    def _unmap(self, i: int) -> None:
        fd, mm, _, _ = self.blocks.pop(i)
        with contextlib.suppress(BufferError):  # a view of a finished read still alive here
            mm.close()
        os.close(fd)
        if i in self.new:  # never sent: the parent does not know it
            self.new.remove(i)
        else:
            self.dropped.append(i)


def serve(sock: socket.socket) -> None:
    """The child's loop: ``init``, then ``read`` and ``free`` messages until the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    from tracestore.reader import StoreReader
    from tracestore.store import Store

    blocks = _Blocks()
    reader: StoreReader | None = None
    try:
        while True:
            try:
                msg = _recv(sock)
            except EOFError:
                return
            kind = msg[0]
            if kind == "free":
                blocks.free(msg[1])
                continue
            try:
                if kind == "init":
                    _, source, run, storage_options = msg
                    reader = StoreReader(Store(source, storage_options), run)
                    _send(sock, ("ready",))
                elif kind == "read":
                    assert reader is not None, "read before init"
                    _send_rows(sock, blocks, reader, msg[1])
                else:
                    raise ValueError(f"unknown message {kind!r}")
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the parent
                _send(sock, ("error", type(exc).__module__, type(exc).__qualname__, str(exc)))
    finally:
        if reader is not None:
            reader.close()


def _send_rows(sock: socket.socket, blocks: _Blocks, reader: Any, kwargs: dict[str, Any]) -> None:
    taken: list[tuple[int, np.ndarray]] = []

    def allocate(n: int) -> np.ndarray:
        taken.append(blocks.take(n))
        return taken[-1][1]

    try:
        result = reader.read(allocate=allocate, **kwargs)
    except BaseException:
        for i, _ in taken:
            blocks.free(i)
        raise
    if len(taken) != 1:
        raise AssertionError(f"a read allocated {len(taken)} output buffers, expected 1")
    block, buf = taken[0]
    base = buf.ctypes.data
    end = base + buf.nbytes

    def where(a: np.ndarray) -> tuple[int, str, tuple[int, ...]]:
        at = a.ctypes.data
        if not (a.flags.c_contiguous and base <= at and at + a.nbytes <= end):
            raise AssertionError("a result array is not a contiguous view of the shared block")
        return at - base, a.dtype.str, a.shape

    sites = []
    for name in result:
        r = result[name]
        sites.append(
            (
                name,
                where(r.codes),
                where(r.scales),
                where(r.global_scale),
                where(r.valid),
                where(r.policy_version),
                None if r.token_scales is None else np.ascontiguousarray(r.token_scales, "<f4").tobytes(),
            )
        )
    new, blocks.new = blocks.new, []
    dropped, blocks.dropped = blocks.dropped, []
    _send(sock, ("rows", block, buf.nbytes, new, dropped, sites))
    if new:  # then the descriptors of the blocks the parent has not mapped yet
        socket.send_fds(sock, [_LEN.pack(len(new))], [blocks.blocks[i][0] for i in new])


# -- the parent -------------------------------------------------------------------------------------


class ReadProcess:
    """The parent's handle on its read process (see the module docstring). Thread-safe: reads
    are serialized (one in flight), frees may come from any thread."""

    def __init__(self, source: str, run: str, storage_options: dict[str, Any] | None, timeout: float) -> None:
        self.source, self.run, self.storage_options, self.timeout = source, run, storage_options, timeout
        self._req = threading.Lock()  # one read at a time
        self._send_lock = threading.RLock()  # whole messages; a finalizer may free inside a send
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._maps: dict[int, mmap.mmap] = {}
        self._generation = 0  # bumped per child: frees of a dead child's blocks are dropped
        self._closed = False
        with self._req:
            self._start()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(child.fileno())], pass_fds=[child.fileno()], stdin=subprocess.DEVNULL
            )
        except OSError as exc:
            parent.close()
            raise StorageError(f"could not start the read process ({sys.executable}): {exc}") from exc
        finally:
            child.close()
        self._generation += 1
        self._sock = parent
        parent.settimeout(self.timeout)
        try:
            self._send_raw(pickle.dumps(list(sys.path)))
            self._send_msg(("init", self.source, self.run, self.storage_options))
            reply = self._reply("start")
        except BaseException:
            self._stop()
            raise
        if reply[0] != "ready":  # pragma: no cover - protocol bug
            self._stop()
            raise StorageError(f"read process answered {reply[0]!r} to init")

    def _send_raw(self, data: bytes) -> None:
        assert self._sock is not None
        with self._send_lock:
            self._sock.sendall(_LEN.pack(len(data)) + data)

    def _send_msg(self, obj: Any) -> None:
        self._send_raw(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def _reply(self, what: str) -> Any:
        assert self._sock is not None
        try:
            msg = _recv(self._sock)
        except (EOFError, OSError) as exc:
            code = None if self._proc is None else self._proc.poll()
            self._stop()
            if isinstance(exc, TimeoutError):
                reason = f"did not answer in {self.timeout} s"
            else:
                reason = f"exited (code {code})" if code is not None else f"failed ({exc})"
            raise StorageError(f"the read process {reason} during {what} of {self.source}") from None
        if msg[0] == "error":
            raise _rebuild(msg[1], msg[2], msg[3])
        return msg

    def read(self, **kwargs: Any) -> dict[str, tuple[Any, ...]]:
        """``StoreReader.read(**kwargs)`` in the child; returns ``{site: (codes, scales, global_scale,
        valid, policy_version, token_scales)}``, numpy arrays over shared memory."""
        with self._req:
            if self._closed:
                raise StorageError("the reader is closed")
            if self._proc is not None and self._proc.poll() is not None:
                log.warning("the read process %d exited (code %s) while idle; starting another",
                            self._proc.pid, self._proc.returncode)  # fmt: skip
                self._stop()
            if self._sock is None:
                self._start()
            try:
                self._send_msg(("read", kwargs))
            except OSError as exc:
                self._stop()
                raise StorageError(f"the read process of {self.source} went away: {exc}") from None
            try:
                msg = self._reply("a read")
            except TraceStoreError:
                raise
            except Exception as exc:  # noqa: BLE001 - unknown to this side: keep the message
                raise StorageError(str(exc)) from exc
            if msg[0] != "rows":  # pragma: no cover - protocol bug
                raise StorageError(f"read process answered {msg[0]!r} to a read")
            _, block, nbytes, new, dropped, sites = msg
            if new:
                self._map(new)
            for i in dropped:
                self._maps.pop(i, None)
            generation = self._generation
        # Every array below is a view whose ``base`` is this one array (numpy stops collapsing
        # view chains at an array that does not own its memory), so it lives as long as any of
        # them. (Not a memoryview: numpy takes a new one from the exporter and drops ours.)
        base = np.frombuffer(self._maps[block], np.uint8, count=nbytes)
        weakref.finalize(base, self._free, generation, block)

        def arr(spec: tuple[int, str, tuple[int, ...]]) -> np.ndarray:
            off, dtype, shape = spec
            dt = np.dtype(dtype)
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            return base[off : off + n].view(dt).reshape(shape)

        out = {}
        for name, codes, scales, g, valid, pv, ts in sites:
            tsa = None if ts is None else np.frombuffer(ts, "<f4").astype(np.float32)
            out[name] = (arr(codes), arr(scales), arr(g), arr(valid), arr(pv), tsa)
        return out

    def _map(self, ids: list[int]) -> None:
        assert self._sock is not None
        _, fds, _, _ = socket.recv_fds(self._sock, _LEN.size, len(ids))
        if len(fds) != len(ids):
            for fd in fds:
                os.close(fd)
            self._stop()
            raise StorageError(f"read process sent {len(fds)} block descriptors, expected {len(ids)}")
        for i, fd in zip(ids, fds, strict=True):
            try:
                self._maps[i] = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)

    def _free(self, generation: int, block: int) -> None:
        """Every array of a read is gone: the child may reuse its block (any thread, at GC)."""
        if generation != self._generation or self._sock is None:
            return
        with contextlib.suppress(OSError):  # the child is gone; its blocks with it
            self._send_msg(("free", block))

    def _stop(self) -> None:
        sock, self._sock = self._sock, None
        self._maps = {}  # mappings stay valid for arrays still alive; the rest unmap when collected
        if sock is not None:
            sock.close()
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        with self._req:
            self._closed = True
            self._stop()


def _rebuild(module: str, qualname: str, message: str) -> Exception:
    """The child's exception as the same tracestore error class (others as StorageError)."""
    if module.startswith("tracestore."):
        try:
            cls = getattr(importlib.import_module(module), qualname)
        except (ImportError, AttributeError):
            cls = None
        if isinstance(cls, type) and issubclass(cls, TraceStoreError):
            return cls(message)
    return StorageError(f"read process failed: {qualname}: {message}")
