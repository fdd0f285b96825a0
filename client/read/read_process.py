"""Plan reads in child processes, so decoding does not wait for a training loop's GIL.

``GuidanceReader(url, run, process=True)`` hands each read of a storage URL to a child process that
owns a :class:`~tracestore.storage.reader.StoreReader`; ``process=N`` to N of them, each reading a
slice of the plan's rows. A read in a thread of the trainer's own process shares the interpreter
lock with the training loop, which slows it several times over, and one process's decode reaches a
parallelism of only ~2 (the per-chunk checks and page walks hold the GIL). Children have their own
interpreters, so they compete only for cores.

Nothing is copied back. The parent owns memfd blocks that it and the children map: a block's
descriptor goes to a child once (``SCM_RIGHTS`` over its unix socketpair). For a read the parent
takes a block as large as the whole result, lays every site's arrays out in it
(:meth:`~tracestore.storage.reader.StoreReader.layout`), and gives each child the plan rows
``[r0, r1)`` and the matching rows of those arrays (``StoreReader.read(out=...)``): the children
write disjoint rows of one block, and the parent's arrays are views of it. A block serves a later
read only once every array of the read that filled it is gone: they are all views of one base
array, whose ``weakref.finalize`` queues the block for the next read to take back. Blocks are
reused, not made anew per read, because faulting in fresh pages costs as much as the read.

A child starts as ``python -c`` with a small bootstrap, not through ``multiprocessing``, so the
trainer's ``__main__`` is never imported again. It exits when its socket closes, which also
happens when the parent dies. If it dies itself, the read in progress raises
:class:`~tracestore.errors.StorageError`, and the next read starts a new child.

Messages both ways are :mod:`tracestore.worker`'s (a length, then a pickle); a block's descriptor
travels beside an 8-byte note.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import mmap
import os
import queue
import signal
import socket
import struct
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from tracestore import worker
from tracestore.errors import StorageError, TraceStoreError
from tracestore.storage.rows import Layout, SiteRows, output_arrays, output_sections

log = logging.getLogger(__name__)

_FD_NOTE = struct.pack("<Q", 1)  # the byte message a block's descriptor travels with
BLOCK_ROUND = 2 << 20  # block sizes are whole multiples of this (so a little growth still fits)
# Free blocks kept for the next reads (more are unmapped). One is enough for the usual pattern
# (step k trains on one result while the next is prefetched into another, then k's block is free),
# so a reader holds (live results + 1) blocks of shared memory, each as large as a plan's rows.
SPARE_BLOCKS = 1
MIN_SLICE_BYTES = 8 << 20  # a plan is split among children only into slices of at least this
START_TIMEOUT_S = 60.0  # for a child's start (imports, opening the store), if the read timeout is shorter

# What a child is told to fill: the read's layout (StoreReader.layout), the block's sections
# (tracestore.storage.rows.output_sections) and the plan tokens [t0, t1) of its slice
Target = tuple[Any, Any, tuple[int, int]]


# -- a child ----------------------------------------------------------------------------------------


def serve(sock: socket.socket) -> None:
    """A child's loop: ``init``, then ``read`` messages until the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the parent left mid-read
        _serve_loop(sock)


def _serve_loop(sock: socket.socket) -> None:
    from tracestore.storage.reader import StoreReader
    from tracestore.storage.store import Store

    maps: dict[int, mmap.mmap] = {}
    reader: StoreReader | None = None
    try:
        while True:
            try:
                msg = worker.recv(sock)
            except EOFError:
                return
            kind = msg[0]
            if kind in ("read", "drop"):
                for i in msg[3] if kind == "read" else msg[1]:
                    mm = maps.pop(i, None)
                    if mm is not None:
                        with contextlib.suppress(BufferError):
                            mm.close()
                if kind == "drop":
                    continue
            try:
                if kind == "init":
                    _, source, run, storage_options = msg
                    reader = StoreReader(Store(source, storage_options), run)
                    worker.send(sock, ("ready",))
                elif kind == "read":
                    _, block, n_new, _, (layout, sections, tokens), kwargs = msg
                    if n_new:  # the block's descriptor follows the message
                        _, fds, _, _ = socket.recv_fds(sock, 8, 1)
                        try:
                            maps[block] = mmap.mmap(fds[0], os.fstat(fds[0]).st_size)
                        finally:
                            for fd in fds:
                                os.close(fd)
                    assert reader is not None, "read before init"
                    out = output_arrays(np.frombuffer(maps[block], np.uint8), layout, sections, tokens)
                    result = reader.read(out=out, **kwargs)
                    reply = {name: _beside(rows) for name, rows in result.items()}
                    mismatched = dict(result.stats.mismatched)
                    del out, result
                    worker.send(sock, ("rows", reply, mismatched))
                else:
                    raise ValueError(f"unknown message {kind!r}")
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the parent
                worker.send(sock, ("error", type(exc).__module__, type(exc).__qualname__, str(exc)))
    finally:
        if reader is not None:
            reader.close()


def _beside(rows: SiteRows) -> tuple[tuple[int, int], bytes | None, bytes | None]:
    """What a child sends of one site's rows besides the shared block: the column range, the
    token scales and the stale flags of its slice (None: none of its records has token scales,
    none of its rows is stale)."""
    ts = None if rows.token_scales is None else np.ascontiguousarray(rows.token_scales, "<f4").tobytes()
    return rows.columns, ts, rows.stale.tobytes() if rows.stale.any() else None


# -- the parent -------------------------------------------------------------------------------------


class _Child:
    """One child process and its socket (parent side)."""

    def __init__(self, source: str, run: str, storage_options: dict[str, Any] | None, timeout: float) -> None:
        try:
            self.proc, parent = worker.start("tracestore.client.read.read_process", "serve")
        except OSError as exc:
            raise StorageError(f"could not start a read process ({sys.executable}): {exc}") from exc
        self.sock = parent
        self.timeout = timeout
        self.source = source
        self.blocks: set[int] = set()  # blocks whose descriptor it has
        self.drop: list[int] = []  # of those, unmapped in the parent since it last heard
        parent.settimeout(max(timeout, START_TIMEOUT_S))  # its imports can take a while on a busy host
        try:
            worker.send(parent, ("init", source, run, storage_options))
            reply = self.reply("start")
        except BaseException:
            self.stop()
            raise
        parent.settimeout(timeout)
        if reply[0] != "ready":  # pragma: no cover - protocol bug
            self.stop()
            raise StorageError(f"read process answered {reply[0]!r} to init")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def send_read(self, block: int, fd: int, dropped: list[int], target: Target, kwargs: Any) -> None:
        new = block not in self.blocks
        worker.send(self.sock, ("read", block, int(new), dropped, target, kwargs))
        if new:
            socket.send_fds(self.sock, [_FD_NOTE], [fd])
            self.blocks.add(block)

    def send_drops(self, dropped: list[int]) -> None:
        """Unmap the blocks the parent dropped (no reply): a child that no read uses for a while
        must not keep their memory alive."""
        worker.send(self.sock, ("drop", dropped))

    def reply(self, what: str) -> Any:
        """The next message, or raises: StorageError if the child died or timed out (then it is
        stopped), its own error class if it reported one."""
        try:
            msg = worker.recv(self.sock)
        except (EOFError, OSError) as exc:
            waited = self.sock.gettimeout()
            if isinstance(exc, TimeoutError):
                self.proc.kill()  # hung (or stopped): it will not answer this read any more
            self.stop()  # (waits for it: a reset socket can come before the exit status)
            code = self.proc.returncode
            if isinstance(exc, TimeoutError):
                reason = f"did not answer in {waited} s"
            else:
                reason = f"exited (code {code})" if code is not None else f"failed ({exc})"
            raise StorageError(f"a read process of {self.source} {reason} during {what}") from None
        except Exception as exc:  # noqa: BLE001 - a garbled reply: the protocol is out of step
            self.stop()
            raise StorageError(f"a read process of {self.source} sent a bad reply during {what}: {exc}") from exc
        if msg[0] == "error":
            raise _rebuild(msg[1], msg[2], msg[3])
        return msg

    def stop(self) -> None:
        worker.stop(self.proc, self.sock, timeout=5)  # (the shutdown wakes a thread blocked on the socket)


class ReadProcesses:
    """The parent's side: ``n`` children, the shared blocks, and reads split among them (see the
    module docstring). Reads are serialized (one in flight); blocks come back from any thread."""

    def __init__(
        self, source: str, run: str, storage_options: dict[str, Any] | None, timeout: float, n: int = 1
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"the number of read processes must be an integer >= 1, got {n!r}")
        self.source, self.run, self.storage_options, self.timeout = source, run, storage_options, timeout
        self._req = threading.Lock()
        self._blocks_lock = threading.Lock()
        self._returned: queue.SimpleQueue[int] = queue.SimpleQueue()  # blocks whose arrays are gone
        self._blocks: dict[int, list[Any]] = {}  # id -> [fd, mmap, size, busy]
        self._next_block = 0
        self._closed = False
        self._pid = os.getpid()  # a forked copy of this object must neither read nor stop the children
        self._children: list[_Child | None] = [None] * n
        weakref.finalize(self, _stop_all, self._children, self._pid)
        with self._req:
            self._children[0] = self._child(0)  # the first one now: a bad URL fails here

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self._children if c is not None]

    def _child(self, i: int) -> _Child:
        if self._closed:
            raise StorageError("the reader is closed")
        c = self._children[i]
        if c is not None and not c.alive:
            log.warning("read process %d exited (code %s) while idle; starting another", c.proc.pid, c.proc.returncode)
            c.stop()
            c = None
        if c is None:
            c = self._children[i] = _Child(self.source, self.run, self.storage_options, self.timeout)
        return c

    # -- blocks -----------------------------------------------------------------------------------

    def _take(self, n: int) -> tuple[int, list[Any]]:
        with self._blocks_lock:
            self._collect()
            free = [(b[2], i) for i, b in self._blocks.items() if not b[3] and b[2] >= n]
            if free:
                i = min(free)[1]
            else:
                size = max(BLOCK_ROUND, -(-n // BLOCK_ROUND) * BLOCK_ROUND)
                fd = os.memfd_create("tracestore-read", os.MFD_CLOEXEC)
                try:
                    os.ftruncate(fd, size)
                    mm = mmap.mmap(fd, size)
                except BaseException:
                    os.close(fd)
                    raise
                i, self._next_block = self._next_block, self._next_block + 1
                self._blocks[i] = [fd, mm, size, False]
            self._blocks[i][3] = True
            return i, self._blocks[i]

    def _collect(self) -> None:
        """With the blocks lock held: free the blocks whose reads' arrays are all gone. Their
        finalizers only queue them (``SimpleQueue.put`` may be called from a finalizer, in any
        thread, at any allocation; taking a lock there could deadlock with this very thread)."""
        while True:
            try:
                i = self._returned.get_nowait()
            except queue.Empty:
                return
            self._free(i)

    def _free(self, i: int) -> None:
        """With the blocks lock held: block ``i`` may serve another read; unmap spares beyond
        SPARE_BLOCKS (the smallest first: the next read is like the last) here and, with their
        next message, in the children."""
        b = self._blocks.get(i)
        if b is None:
            return
        b[3] = False
        spare = sorted((x[2], j) for j, x in self._blocks.items() if not x[3])
        for _, j in spare[:-SPARE_BLOCKS] if len(spare) > SPARE_BLOCKS else ():
            fd, mm, _, _ = self._blocks.pop(j)
            with contextlib.suppress(BufferError):
                mm.close()
            os.close(fd)
            for c in self._children:
                if c is not None and j in c.blocks:
                    c.blocks.discard(j)
                    c.drop.append(j)

    def _drops(self, c: _Child) -> list[int]:
        with self._blocks_lock:  # (_free appends)
            dropped, c.drop = c.drop, []
        return dropped

    # -- reads ------------------------------------------------------------------------------------

    def read(
        self,
        segments: Sequence[tuple[str | None, int, int]],
        layout: Layout,
        **kwargs: Any,
    ) -> tuple[dict[str, SiteRows], dict[str, str]]:
        """``StoreReader.read(plan, **kwargs)`` in the children; ``layout``: what
        ``StoreReader.layout`` says that read returns. Returns ``{site: SiteRows}`` whose arrays
        (all but the token scales and stale flags) are views of shared memory, and the
        trajectories masked for other token ids (``stats.mismatched`` of the children's reads)."""
        if os.getpid() != self._pid:
            raise StorageError(
                "this GuidanceReader(process=...) was made in another process (this one is a fork of it): "
                "its children answer only there; make a reader in this process"
            )
        total, sections = output_sections(layout)
        slices = _slices(segments, min(len(self._children), max(1, total // MIN_SLICE_BYTES)))
        bounds = [(t0, t0 + sum(e - s for _, s, e in part)) for t0, part in slices]  # plan tokens of each
        with self._req:
            if self._closed:
                raise StorageError("the reader is closed")
            block, b = self._take(total)
            ok = False
            try:
                sent: list[tuple[int, _Child]] = []
                first: BaseException | None = None
                for k, ((_, part), tokens) in enumerate(zip(slices, bounds, strict=True)):
                    try:
                        c = self._child(k)
                        target = (layout, sections, tokens)
                        c.send_read(block, b[0], self._drops(c), target, dict(kwargs, plan=list(part)))
                        sent.append((k, c))
                    except (OSError, StorageError) as exc:
                        if self._children[k] is not None:
                            self._children[k].stop()  # type: ignore[union-attr]
                            self._children[k] = None
                        first = first or StorageError(f"a read process of {self.source} went away: {exc}")
                        break
                for idle in self._children[len(sent) :]:  # the others only unmap what the parent dropped
                    if idle is not None and idle.drop:
                        with contextlib.suppress(OSError):
                            idle.send_drops(self._drops(idle))
                parts: list[dict[str, tuple[tuple[int, int], bytes | None, bytes | None]]] = []
                mismatched: dict[str, str] = {}
                for k, c in sent:  # every reply, even after a failure: each socket stays in step
                    try:
                        got = c.reply("a read")
                        parts.append(got[1])
                        mismatched.update(got[2])
                    except BaseException as exc:
                        if not c.alive or c.sock.fileno() < 0:
                            self._children[k] = None
                        first = first or exc
                if first is not None:
                    raise first
                ok = True
            finally:
                if not ok:
                    with self._blocks_lock:
                        self._free(block)
        # Every array below is a view whose ``base`` is this one array (numpy stops collapsing view
        # chains at an array that does not own its memory), so it lives as long as any of them.
        base = np.frombuffer(b[1], np.uint8, count=total)
        weakref.finalize(base, self._returned.put, block)
        out = {}
        for (site, n, _, _), (name, o) in zip(layout, output_arrays(base, layout, sections).items(), strict=True):
            ts = None  # (a slice none of whose records has token scales sends None: 1.0 there)
            stale = np.zeros(n, bool)
            for p, (t0, t1) in zip(parts, bounds, strict=True):
                _, got_ts, got_stale = p[name]
                r0, r1 = t0 * site.rows_per_token, t1 * site.rows_per_token
                if got_ts is not None:
                    ts = np.ones(n, np.float32) if ts is None else ts
                    ts[r0:r1] = np.frombuffer(got_ts, "<f4")
                if got_stale is not None:
                    stale[r0:r1] = np.frombuffer(got_stale, bool)
            columns = parts[0][name][0]
            out[name] = SiteRows(site, columns, o.codes, o.scales, o.global_scale, ts, o.valid, o.policy_version, stale)
        return out, mismatched

    def close(self) -> None:
        """Stop the children now, without waiting for a read in flight (a prefetch nobody will
        collect): its socket closes under it and it ends with StorageError."""
        self._closed = True
        _stop_all(self._children, self._pid)


def _stop_all(children: list[_Child | None], pid: int) -> None:
    """Stop every child of ``children`` (also run by ``weakref.finalize`` when a ReadProcesses
    that was never closed is collected, so its children do not outlive it). Only in the process
    that started them (``pid``): in a forked copy (a DataLoader worker, say) shutting the sockets
    down would cut the real owner off its children."""
    if os.getpid() != pid:
        return
    for i, c in enumerate(children):
        children[i] = None
        if c is not None:
            c.stop()


def _slices(
    segments: Sequence[tuple[str | None, int, int]], k: int
) -> list[tuple[int, list[tuple[str | None, int, int]]]]:
    """``segments`` cut into ``k`` runs of nearly equal tokens (segments split where needed):
    ``[(first plan token, segments)]``."""
    n = sum(b - a for _, a, b in segments)
    if k <= 1 or n == 0:
        return [(0, list(segments))]
    cuts = [n * j // k for j in range(1, k)]
    out: list[tuple[int, list[tuple[str | None, int, int]]]] = [(0, [])]
    at = 0
    for traj, a, b in segments:
        while a < b:
            room = (cuts[len(out) - 1] - at) if len(out) <= len(cuts) else b - a
            if room == 0:
                out.append((at, []))
                continue
            take = min(room, b - a)
            out[-1][1].append((traj, a, a + take))
            a += take
            at += take
    return [s for s in out if s[1]]


def _rebuild(module: str, qualname: str, message: str) -> Exception:
    """A child's exception as the same tracestore error class (others as StorageError)."""
    if module.startswith("tracestore."):
        try:
            cls = getattr(importlib.import_module(module), qualname)
        except (ImportError, AttributeError):
            cls = None
        if isinstance(cls, type) and issubclass(cls, TraceStoreError):
            return cls(message)
    return StorageError(f"read process failed: {qualname}: {message}")
