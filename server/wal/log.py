"""The sidecar's write-ahead log: segment files of checksummed entries, group-committed with fsync.

An entry is ``<IIB`` (payload length, CRC-32 of type byte + payload, type) followed by the payload.
The CRC-32 is :mod:`tracestore.checksum`'s (ISA-L when installed, zlib-identical values); record
chunks inside carry their own checksums, verified again on replay.

Where the file system takes ``O_DIRECT`` (ext4, xfs; not tmpfs), an append only copies the entry
into an aligned in-memory buffer, which keeps page-cache allocation off the appending thread. One
background thread writes everything appended so far (``pwrite`` of whole 4 KiB blocks; the
partial last block is rewritten by the next write), ``fdatasync``s it and reports the highest
durable ticket: many appends share one write and one flush (group commit). Elsewhere appends go
to the page cache at once (``os.writev``) and the thread only fsyncs.

Replay repairs only a torn tail of the newest segment (zero padding after the last entry is the end
of a segment) and refuses any other damage; the entry format, the segment files and the replay
checks are in :mod:`tracestore.server.wal.files`.

After each fdatasync the sync thread records in ``DURABLE`` how far each segment is durable
(:mod:`tracestore.server.wal.mark`: one ``pwrite``, no extra fsync before the acknowledgement);
replay refuses a segment cut below that. Segments are deleted oldest first once the caller says
their entries are committed elsewhere *and* the entry saying so is durable
(``delete_before(index, after=ticket)``).

A failed write or fdatasync (ENOSPC, EIO) puts the log in a failed state: appends raise
:class:`StorageError` and :attr:`WriteAheadLog.error` is set, so the owner can report itself
unhealthy. :meth:`WriteAheadLog.recover` then cuts every segment back to what the last successful
fdatasync covered (the bytes after it cannot be trusted after a failed fsync), opens a fresh
segment with the caller's header and lets appends continue; the owner re-appends what was not
durable. Only one process may use a directory: it is locked with ``flock`` for the log's lifetime.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import queue
import stat
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from tracestore.server.wal.files import (
    HEADER,
    MAX_ENTRY,
    Buffer,
    Checked,
    Part,
    Segment,
    apply_entries,
    cut,
    find_segments,
    fsync_dir,
    lock_directory,
    replay_segments,
    segment_path,
)
from tracestore.server.wal.mark import DurableMark, read_marks
from tracestore.server.wal.stream import StreamedEntries

from tracestore import faults
from tracestore.checksum import FAST, crc32, crc32_address, crc32_combine
from tracestore.errors import CorruptionError, StorageError

log = logging.getLogger("tracestore.server")
BLOCK = 4096  # O_DIRECT alignment of buffers, offsets and lengths (covers 512 B and 4 KiB sectors)


# The write path's own os calls (pwrite, fdatasync) stay in this module, beside the sync thread
# that makes them (tests/server/wal/test_recovery.py fails them through this module's ``os``).


def _pwrite(fd: int, buf: mmap.mmap, n: int, offset: int) -> None:
    """Whole blocks from an aligned buffer to an aligned file offset (O_DIRECT)."""
    with memoryview(buf) as view:
        done = 0
        while done < n:
            done += os.pwrite(fd, view[done:n], offset + done)


def _write_jobs(jobs: list[tuple[int, tuple[mmap.mmap, int, int] | None, int]]) -> None:
    """Write rotated segments' last buffers and cut each file to its entries (no zero padding)."""
    for fd, out, size in jobs:
        if out is not None:
            _pwrite(fd, *out)
        os.ftruncate(fd, size)


class WriteAheadLog(StreamedEntries):
    """Append-only, fsynced log in ``directory``.

    ``on_synced(ticket)`` is called from the sync thread after every fsync with the highest ticket
    now durable (tickets are 1, 2, 3 ... in append order). ``segment_header()`` returns entries
    ``[(type, payload)]`` written first in every new segment (the caller's state snapshot).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        segment_bytes: int = 64 << 20,
        on_synced: Callable[[int], None] | None = None,
        segment_header: Callable[[], Sequence[tuple[int, bytes]]] | None = None,
        buffer_bytes: int = 16 << 20,
        direct: bool = True,
    ) -> None:
        self.dir = Path(directory)
        # The sidecar's alone: segments hold the records of every writer (those staged in 0600 or
        # 0640 shared memory too), so no other user may read them.
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        self.dir.mkdir(mode=0o700, exist_ok=True)
        st = self.dir.stat()
        if stat.S_IMODE(st.st_mode) & 0o077 and st.st_uid == os.geteuid():
            # one we own (made before, with the umask): closed too. Another's (a mounted volume)
            # stays as it is; its segments are 0600 all the same.
            log.info("write-ahead log directory %s: mode %04o -> 0700", self.dir, stat.S_IMODE(st.st_mode))
            os.chmod(self.dir, 0o700)
        self.segment_bytes = int(segment_bytes)
        self._on_synced = on_synced
        self._segment_header = segment_header
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.segments: list[Segment] = []
        self._fd = -1
        self._retired: list[int] = []
        self._written = 0  # highest ticket handed out
        self._synced = 0
        self._closed = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._notifier: threading.Thread | None = None
        self._synced_q: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        # O_DIRECT mode: appends fill ``_bufs[_active]`` (its byte 0 goes to file offset ``_base``,
        # ``_fill`` bytes used); the sync thread swaps buffers, writes and flushes the full one.
        self.direct = bool(direct) and hasattr(os, "O_DIRECT")
        self._buffer_bytes = max(BLOCK, -(-int(buffer_bytes) // BLOCK) * BLOCK)
        self._bufs: list[mmap.mmap] = []
        self._active = 0
        self._fill = 0
        self._base = 0
        # buffers of rotated segments still to be written: (fd, (buffer, length, offset), size)
        self._jobs: list[tuple[int, tuple[mmap.mmap, int, int] | None, int]] = []
        # a rotated segment's buffer once written, reused by the next rotation so that a fresh
        # map's page faults stay off the ingest path
        self._spare: list[mmap.mmap] = []
        # an entry larger than a buffer goes through the buffers in pieces (wal/stream.py): the sync
        # thread takes the active buffer when asked, and says while it writes one it took
        self._swap_wanted = False
        self._writing = False
        self._streaming = False
        self._head_ticket = 0  # ticket covering the active segment's header entries
        self._delete_pending = 0  # delete_before(index) deferred until that header is durable
        self._delete_after = 0  # ... and until this ticket (the caller's DONE entry) is durable
        self._synced_pos = (0, 0)  # (segment index, size) the last successful fdatasync covered
        self._lock_fd = lock_directory(self.dir)
        self._mark = DurableMark(self.dir)  # opened by start(), after replay read it

    # -- replay ---------------------------------------------------------------------------------

    def replay(self) -> Iterator[tuple[int, int, bytes]]:
        """Yield ``(segment_index, type, payload)`` for every intact entry, oldest first.

        Only a torn tail is repaired: bad bytes at the end of the newest segment with no intact
        entry after them (a write the crash cut short; nothing after it was acknowledged). Anything
        else — a bad entry followed by intact ones, damage in an older segment, a segment missing
        between two present ones, a segment whose entries end before what ``DURABLE`` records as
        synced or that it names past the newest — raises :class:`CorruptionError` naming the segment
        and offset, before any entry of the log is yielded, and nothing is truncated: those bytes
        may be acknowledged records.
        """
        for index, kind, payload, _ in self._entries():
            yield index, kind, payload

    def replay_into(self, apply: Callable[[int, int, bytes], int], names: Mapping[int, str]) -> int:
        """:meth:`replay`, handing each entry to ``apply(segment_index, type, payload)``; returns
        the sum of what it returned. An entry whose contents ``apply`` cannot decode is
        CorruptionError naming the segment file, the byte offset and (``names``) the entry's type
        (:func:`apply_entries`)."""
        return apply_entries(self.dir, self._entries(), apply, names)

    def _entries(self) -> Iterator[tuple[int, int, bytes, int]]:
        self.segments = find_segments(self.dir)
        return replay_segments(self.dir, self.segments, read_marks(self.dir))

    # -- appending ------------------------------------------------------------------------------

    def start(self) -> None:
        """Open a fresh segment and start the sync thread (call after :meth:`replay`)."""
        self._mark.open()
        with self._lock:
            if self.segments:  # replayed segments are durable as they are
                self._synced_pos = (self.segments[-1].index, self.segments[-1].size)
            self._open_segment()
        self._thread = threading.Thread(target=self._sync_loop, name="tracestore-wal-sync", daemon=True)
        self._thread.start()
        if self._on_synced is not None:
            self._notifier = threading.Thread(target=self._notify_loop, name="tracestore-wal-acks", daemon=True)
            self._notifier.start()

    def _notify_loop(self) -> None:
        """Report synced tickets to ``on_synced`` from here, not from the sync thread: the callback
        takes the caller's lock, and the caller may hold that lock while an append waits for the
        sync thread to free buffer space."""
        assert self._on_synced is not None
        while True:
            item = self._synced_q.get()
            stop, ticket = item is None, item or 0
            while not self._synced_q.empty():  # report only the newest of a burst
                nxt = self._synced_q.get()
                if nxt is None:
                    stop = True
                else:
                    ticket = max(ticket, nxt)
            if ticket:
                self._on_synced(ticket)
            if stop:
                return

    def _open_segment(self, header: Sequence[tuple[int, bytes]] | None = None) -> None:
        if self.direct and self._fd >= 0:
            # The sync thread writes this segment's last buffer (and cuts the zero padding of its
            # last block) before it syncs and closes the fd; appends go on in a fresh buffer. No
            # waiting here: the caller may hold a lock the sync thread's callback needs.
            out = self._swap(keep_tail=False)
            self._jobs.append((self._fd, out, self.segments[-1].size))
            size = len(self._bufs[self._active])
            spare = self._spare.pop() if self._spare and len(self._spare[-1]) == size else None
            self._bufs[self._active] = spare if spare is not None else mmap.mmap(-1, size)
        if self._fd >= 0:  # the sync thread fsyncs and closes it before reporting later tickets
            self._retired.append(self._fd)
        index = self.segments[-1].index + 1 if self.segments else 1
        path = segment_path(self.dir, index)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if self.direct:
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError:  # tmpfs and others refuse O_DIRECT: page cache + fsync instead
                self.direct = False
                self._fd = os.open(path, flags | os.O_APPEND, 0o600)
            else:
                if not self._bufs:
                    self._bufs = [mmap.mmap(-1, self._buffer_bytes) for _ in range(2)]
                self._fill = self._base = 0
        else:
            self._fd = os.open(path, flags | os.O_APPEND, 0o600)
        fsync_dir(self.dir)
        self.segments.append(Segment(index, path, 0))
        if header is None and self._segment_header is not None:
            header = self._segment_header()
        if header is not None:
            for kind, payload in header:
                self._write(kind, [payload])
            # The header (the writers' sessions) replaces what older segments said: they may be
            # deleted only once it is durable (delete_before defers until then).
            self._written += 1
            self._head_ticket = self._written
            self._cond.notify_all()
        faults.point("wal.rotated")

    def rotate(self) -> int:
        """Start a new segment now (opening with the caller's state snapshot); returns its index."""
        with self._lock:
            self._wait_streamed()
            self._open_segment()
            self._cond.notify_all()
            return self.segments[-1].index

    def _copy_in(self, bufs: list[Buffer], total: int, checks: dict[int, int]) -> None:
        """With the lock held: copy one entry into the active buffer (waiting for the sync thread
        to take the buffer away when it is full; an entry larger than a buffer goes through both in
        pieces: :meth:`_stream_in`). ``checks``: {index in bufs: CRC its copy must have}
        (``Checked.verify``); on a mismatch nothing is appended (the fill mark stays; the sync
        thread zero-pads past it)."""
        if BLOCK + total > self._buffer_bytes:
            self._stream_in(bufs, checks)
            return
        # Wait for room, and while another thread streams an entry through the buffers (it lets
        # the lock go at each hand-over: an entry copied then would land inside that one).
        while self._streaming or self._fill + total > len(self._bufs[self._active]):
            if self._error is not None:
                raise OSError(f"write-ahead log sync failed earlier: {self._error}")
            if not self._streaming:  # taken even when all it holds is synced already
                self._swap_wanted = True
            self._cond.notify_all()
            self._cond.wait(1.0)
        buf, at = self._bufs[self._active], self._fill
        # the buffer's address, for the checks' CRCs (an mmap does not move; the export ends here)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf)) if checks else 0
        for i, b in enumerate(bufs):
            n = len(b)
            buf[at : at + n] = b
            want = checks.get(i)
            if want is not None and crc32_address(addr + at, n) != want:  # in cache: just copied
                raise CorruptionError(
                    f"a shared-memory payload of {n} bytes changed while the sidecar received it (CRC "
                    f"{want:#010x} at receipt, not what it holds now): its writer reused a staging region "
                    "before the sidecar released it; the message is refused"
                )
            at += n
        self._fill = at

    def _write(self, kind: int, parts: Sequence[Part]) -> None:
        data = [p.data if isinstance(p, Checked) else p for p in parts]
        length = sum(len(p) for p in data)
        if length >= MAX_ENTRY:
            raise StorageError(f"write-ahead log entry of {length} bytes exceeds the 2 GiB entry limit")
        crc = crc32(bytes([kind]))
        checks: dict[int, int] = {}
        for i, p in enumerate(parts):
            # combined where the copy can be checked (direct mode) or the bytes cannot change;
            # zlib's fallback combine is Python, slower than reading the bytes again
            if isinstance(p, Checked) and FAST and (self.direct or not p.verify):
                crc = crc32_combine(crc, p.crc, len(p.data))
                if p.verify:
                    checks[i + 1] = p.crc  # (bufs[0] is the header)
            else:
                crc = crc32(p.data if isinstance(p, Checked) else p, crc)
        bufs = [HEADER.pack(length, crc, kind), *data]
        total = HEADER.size + length
        if self.direct:
            self._copy_in(bufs, total, checks)
            self.segments[-1].size += total
            return
        done = os.writev(self._fd, bufs)
        if done != total:  # short write (disk full, signal): finish it the slow way
            rest = b"".join(bytes(b) for b in bufs)[done:]
            while rest:
                n = os.write(self._fd, rest)
                rest = rest[n:]
        self.segments[-1].size += total

    def append(self, kind: int, parts: Sequence[Part]) -> tuple[int, int]:
        """Append one entry (the concatenation of ``parts``); return ``(segment_index, ticket)``.
        Durable once ``on_synced(>= ticket)``. A :class:`Checked` part's CRC is trusted."""
        with self._lock:
            self._wait_streamed()
            if self._error is not None:
                raise StorageError(f"write-ahead log failed earlier: {self._error}")
            if self._closed:
                raise StorageError("write-ahead log is closed")
            try:
                if self.segments[-1].size >= self.segment_bytes:
                    self._open_segment()
                self._write(kind, parts)
            except CorruptionError:  # this entry's bytes (Checked.verify), not the log: nothing appended
                raise
            except OSError as exc:
                self._error = exc
                raise StorageError(f"write-ahead log append failed in {self.dir}: {exc}") from exc
            self._written += 1
            self._cond.notify_all()
            return self.segments[-1].index, self._written

    @property
    def active_index(self) -> int:
        return self.segments[-1].index

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.segments)

    def _sync_loop(self) -> None:
        while True:
            with self._lock:
                while (self._error is not None or self._idle()) and not self._closed:
                    self._cond.wait()
                if self._closed and (self._error is not None or self._idle()):
                    return
                target, fd = self._written, self._fd
                pos = (self.segments[-1].index, self.segments[-1].size)
                # once this round's syncs return, every segment is durable at its size now: the
                # older ones' last bytes (jobs, retired fds) are synced first
                claims = [(seg.index, seg.size) for seg in self.segments]
                retired, self._retired = self._retired, []
                jobs, self._jobs = self._jobs, []
                out = self._swap() if self.direct else None
                self._swap_wanted, self._writing = False, out is not None
            # write + fsync outside the lock so appends continue meanwhile (group commit); only this
            # thread closes retired segment fds, and close() joins it before closing the active one.
            try:
                _write_jobs(jobs)
                if jobs:
                    with self._lock:
                        self._spare = [out[0] for _, out, _ in jobs if out is not None][:1]
                for old in retired:
                    os.fdatasync(old)
                    os.close(old)
                if out is not None:
                    _pwrite(fd, *out)
                os.fdatasync(fd)
            except OSError as exc:
                for old in retired:  # recover() cuts these segments back; their fds are done
                    with contextlib.suppress(OSError):
                        os.close(old)
                with self._lock:
                    self._error, self._writing = exc, False
                    self._cond.notify_all()
                    log.error("write-ahead log in %s failed (%s); appends are refused until it recovers", self.dir, exc)
                    # Wait for recover() (or close): a failed fsync leaves the page cache's state
                    # unknown, so nothing more is written to these files.
                    while self._error is not None and not self._closed:
                        self._cond.wait()
                    if self._closed:
                        return
                continue
            faults.point("wal.synced")
            record = self._mark.record(claims)
            with self._lock:
                self._writing = False
                self._cond.notify_all()  # (an entry streamed through the buffers may wait to rewind)
                if self._error is not None:  # failed (an append) meanwhile: this sync may predate it
                    continue
                self._synced = target
                self._synced_pos = pos
                self._mark.write(record)  # (recover() cuts back no further than pos)
                self._cond.notify_all()
                pending = self._delete_pending if target >= max(self._head_ticket, self._delete_after) else 0
                self._delete_pending = 0 if pending else self._delete_pending
            if pending:
                if any(seg.index < pending for seg in self.segments[:-1]):
                    faults.point("commit.done_synced")
                if self._delete(pending):
                    faults.point("commit.retired")
            if self._on_synced is not None:
                self._synced_q.put(target)

    def _swap(self, keep_tail: bool = True) -> tuple[mmap.mmap, int, int] | None:
        """With the lock held: hand the active buffer to the sync thread as ``(buffer, length,
        file offset)`` (length rounded up to whole blocks, zero padded) and continue appending in
        the other one, which starts with a copy of the last partial block (rewritten next time)."""
        fill = self._fill
        if fill == 0:
            return None
        full = self._bufs[self._active]
        n = -(-fill // BLOCK) * BLOCK
        full[fill:n] = bytes(n - fill)
        if not keep_tail:  # the segment ends here
            offset, self._fill, self._base = self._base, 0, 0
            return full, n, offset
        keep = fill - fill % BLOCK
        self._active ^= 1
        nxt = self._bufs[self._active]
        nxt[: fill - keep] = full[keep:fill]
        offset = self._base
        self._base += keep
        self._fill = fill - keep
        self._cond.notify_all()  # appends waiting for room
        return full, n, offset

    def wait_synced(self, ticket: int, timeout: float | None = None) -> bool:
        """True once ``ticket`` is durable; False on timeout or when the log failed first."""
        with self._lock:
            self._cond.wait_for(lambda: self._synced >= ticket or self._error is not None, timeout)
            return self._synced >= ticket

    @property
    def error(self) -> BaseException | None:
        """The failure that stopped the log (None while it works)."""
        return self._error

    def _idle(self) -> bool:
        """With the lock held: nothing for the sync thread to write or sync."""
        return self._written == self._synced and not self._jobs and not self._swap_wanted

    @property
    def synced_ticket(self) -> int:
        return self._synced

    def recover(self, header: Sequence[tuple[int, bytes]]) -> None:
        """Leave the failed state: cut every segment back to what the last successful fdatasync
        covered (later bytes may or may not be on the device after a failed fsync; they are
        dropped, and their tickets are void), then open a fresh segment starting with ``header``.
        The caller re-appends whatever it still needs that was not durable, in order.
        Raises :class:`StorageError` (the log stays failed) while the device still refuses."""
        with self._lock:
            if self._error is None or self._closed:
                return
            try:
                for fd in {*self._retired, *(j[0] for j in self._jobs), self._fd} - {-1}:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                self._retired, self._jobs, self._fd = [], [], -1
                index, size = self._synced_pos
                keep = []
                for seg in self.segments:
                    if seg.index < index:
                        keep.append(seg)
                    elif seg.index == index:
                        cut(seg.path, size)
                        seg.size = size
                        keep.append(seg)
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            seg.path.unlink()
                fsync_dir(self.dir)
                self.segments = keep
                self._written = self._synced
                self._fill = self._base = 0
                self._open_segment(header)
                # the header must reach the device before appends are acknowledged again
                self._pwrite_and_sync_now()
            except OSError as exc:
                self._error = exc
                raise StorageError(f"write-ahead log in {self.dir} is still failing: {exc}") from exc
            failed, self._error = self._error, None
            log.warning("write-ahead log in %s recovered after %s", self.dir, failed)
            self._cond.notify_all()

    def _pwrite_and_sync_now(self) -> None:
        """With the lock held (recover only): write and sync the active segment's bytes here."""
        if self.direct:
            fill = self._fill
            if fill:
                buf = self._bufs[self._active]
                n = -(-fill // BLOCK) * BLOCK
                buf[fill:n] = bytes(n - fill)
                _pwrite(self._fd, buf, n, self._base)
        os.fdatasync(self._fd)
        self._synced = self._written
        self._synced_pos = (self.segments[-1].index, self.segments[-1].size)

    # -- retiring -------------------------------------------------------------------------------

    def delete_before(self, index: int, after: int = 0) -> int:
        """Delete segments with index < ``index`` (never the active one); return bytes freed.
        Deferred (to the sync thread, or close) while the active segment's header or ticket
        ``after`` is not durable: until the header is, the older segments hold the only durable
        copy of the writers' sessions, and until ``after`` (the caller's entry saying the older
        segments' records are committed) is, a crash would replay a log that no longer holds
        what that entry's work was planned from."""
        with self._lock:
            self._delete_after = max(self._delete_after, after)
            if self._error is not None or self._synced < max(self._head_ticket, self._delete_after):
                self._delete_pending = max(self._delete_pending, index)
                return 0
            index = max(index, self._delete_pending)
            self._delete_pending = 0
        freed = self._delete(index)
        if freed:
            faults.point("commit.retired")
        return freed

    def _delete(self, index: int) -> int:
        freed = 0
        with self._lock:
            keep = []
            for seg in self.segments:
                if seg.index < index and seg is not self.segments[-1]:
                    with contextlib.suppress(FileNotFoundError):
                        seg.path.unlink()
                    freed += seg.size
                else:
                    keep.append(seg)
            self.segments = keep
        if freed:
            fsync_dir(self.dir)
        return freed

    def close(self) -> None:
        """Fsync what was appended, stop the sync thread and close the segment."""
        with self._lock:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._notifier is not None:
            self._synced_q.put(None)
            self._notifier.join(timeout=30)
        with self._lock:
            if self._error is None:  # rotated segments' last buffers first, then their fds go
                _write_jobs(self._jobs)
            self._jobs = []
            for old in self._retired:
                try:
                    if self._error is None:
                        os.fdatasync(old)
                finally:
                    os.close(old)
            self._retired = []
            if self._fd >= 0:
                try:
                    if self._error is None:
                        if self.direct:
                            out = self._swap()
                            if out is not None:
                                _pwrite(self._fd, *out)
                            os.ftruncate(self._fd, self.segments[-1].size)
                        os.fdatasync(self._fd)
                finally:
                    os.close(self._fd)
                    self._fd = -1
            pending, self._delete_pending = (self._delete_pending if self._error is None else 0), 0
        if pending:  # everything, the header included, is durable now
            self._delete(pending)
        self._mark.close(self._mark.record([(s.index, s.size) for s in self.segments]) if self._error is None else None)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the directory's flock
            self._lock_fd = -1
