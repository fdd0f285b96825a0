"""Entries larger than the write-ahead log's buffers, copied through them piece by piece.

With ``O_DIRECT`` the log copies every entry into one of two aligned buffers that the sync thread
writes in turn (:mod:`~tracestore.server.wal.log`). The buffers keep their size, a share of the
memory budget that counts them; grown to fit the largest entry, they would stay that large for
the sidecar's lifetime. :class:`StreamedEntries` copies an entry that does not fit into the
active buffer, hands the full buffer to the sync thread (which writes it at its file offset and
swaps in the other buffer, as for any full buffer), and goes on with the rest.

A part whose copy must match the CRC it had at receipt (a shared-memory payload its writer could
still change: ``Checked.verify``) is checked piece by piece as it is copied. When the whole part's
CRC differs, some of the entry may already be in the file past the log's end: the log is rewound
to where the entry began (the bytes of its first block before the entry are put back into the
active buffer), what of it was written is cut off the file (fdatasynced before anything more is
appended), and the entry is not appended, as for an entry that fits.

Nothing of a streamed entry is acknowledged before all of it is written and fdatasynced: its ticket
is handed out once the last piece is in a buffer, and the sync thread reports a ticket only after
the fdatasync that follows the write of every buffer taken before it. ``DURABLE`` never claims the
entry's bytes before then either: the sync thread records each segment's size, which grows by the
entry only once all of it is copied.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence

from tracestore.server.wal.files import Buffer

from tracestore.checksum import crc32, crc32_combine
from tracestore.errors import CorruptionError

BLOCK = 4096  # O_DIRECT alignment (log.BLOCK)


class StreamedEntries:
    """The part of :class:`~tracestore.server.wal.log.WriteAheadLog` that copies an entry larger
    than a buffer through its buffers (module docstring). The log's state it uses: the buffers
    (``_bufs``, ``_active``), the fill mark and the file offset of the active buffer's first byte
    (``_fill``, ``_base``), the condition the sync thread waits on, and two flags the sync thread
    follows: ``_swap_wanted`` (take the active buffer now) and ``_writing`` (a buffer taken is being
    written); ``_streaming`` keeps other appends out while an entry goes through."""

    _bufs: list[mmap.mmap]
    _fd: int
    _active: int
    _fill: int
    _base: int
    _cond: threading.Condition
    _error: BaseException | None
    _closed: bool
    _swap_wanted: bool
    _writing: bool
    _streaming: bool

    def _wait_streamed(self) -> None:
        """With the lock held: wait while another thread streams an entry (it lets the lock go
        whenever it hands a buffer over, and nothing may be appended in the middle of its entry)."""
        while self._streaming and self._error is None and not self._closed:
            self._cond.wait(1.0)

    def _stream_in(self, bufs: Sequence[Buffer], checks: dict[int, int]) -> None:
        """With the lock held: copy the entry ``bufs`` through the buffers; ``checks``: {index in
        ``bufs``: the CRC its copy must have}. CorruptionError (the log rewound, nothing
        appended) when a checked part's copy differs; OSError when the sync thread failed."""
        self._streaming = True
        try:
            self._stream_parts(bufs, checks)
        finally:
            self._streaming = False
            self._cond.notify_all()

    def _stream_parts(self, bufs: Sequence[Buffer], checks: dict[int, int]) -> None:
        start = self._base + self._fill  # the entry's file offset
        head = bytes(self._bufs[self._active][self._fill - self._fill % BLOCK : self._fill])
        for i, b in enumerate(bufs):
            view = memoryview(b).cast("B") if isinstance(b, memoryview) else memoryview(b)
            want, crc, off = checks.get(i), 0, 0
            while off < len(view):
                buf = self._bufs[self._active]
                room = len(buf) - self._fill
                if room == 0:
                    self._hand_over()
                    continue
                n = min(room, len(view) - off)
                buf[self._fill : self._fill + n] = view[off : off + n]
                if want is not None:  # the copy, as it lies in the buffer
                    with memoryview(buf) as copy:
                        crc = crc32_combine(crc, crc32(copy[self._fill : self._fill + n]), n)
                self._fill += n
                off += n
            if want is not None and crc != want:
                self._rewind(start, head)
                raise CorruptionError(
                    f"a shared-memory payload of {len(view)} bytes changed while the sidecar received it (CRC "
                    f"{want:#010x} at receipt, not what it holds now): its writer reused a staging region "
                    "before the sidecar released it; the message is refused"
                )

    def _hand_over(self) -> None:
        """With the lock held: have the sync thread take the full active buffer (it writes it and
        makes the other buffer active, starting with the last partial block) and wait until it
        has."""
        self._swap_wanted = True
        self._cond.notify_all()
        while self._swap_wanted:
            if self._error is not None:
                raise OSError(f"write-ahead log sync failed earlier: {self._error}")
            if self._closed:
                raise OSError("write-ahead log closed while an entry was being appended")
            self._cond.wait(1.0)

    def _rewind(self, start: int, head: bytes) -> None:
        """With the lock held: make file offset ``start`` the end of the log again, once the sync
        thread has written every buffer handed over (``head``: the bytes before ``start`` in its
        block). What of the entry reached the file is cut off and the cut fdatasynced first: left
        there, it would lie after the entries appended next, where a replay after a crash finds a
        complete entry with a wrong checksum (or an intact one inside the payload) after the last
        entry, and refuses the log as corrupt."""
        while self._writing and self._error is None:
            self._cond.wait(1.0)
        block = start - start % BLOCK
        if block >= self._base:  # nothing of the entry was handed over
            self._fill = start - self._base
            return
        if self._error is None:  # (a failed log is cut back to what was synced by recover())
            os.ftruncate(self._fd, start)
            os.fdatasync(self._fd)
        self._base = block
        self._bufs[self._active][: len(head)] = head
        self._fill = len(head)
