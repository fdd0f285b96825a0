"""``DURABLE`` in a write-ahead log directory: how many bytes of each segment an ``fdatasync`` made
durable, so that replay can tell a torn tail (bytes a crash cut short, never acknowledged: cut)
from acknowledged entries that damage took away (refused).

After every fdatasync that returns, the log's sync thread rewrites this small file with the
segments that sync covered and their sizes: the newest as far as the sync reached, the older ones
whole (each is synced before a later sync reports). It never claims a byte no fdatasync covered:
after any crash every claimed byte is on the device, so a segment whose intact entries end before
its claim was truncated or zeroed by file-system or disk damage, and lost acknowledged entries.

The file is text::

    tracestore write-ahead log: bytes of each segment made durable (fdatasync returned)
    wal-000000000003.log 67108901
    wal-000000000004.log 52345
    crc32 1a2b3c4d

(CRC-32 of the lines before it), padded with newlines so that the file never shrinks. It is
rewritten in place with one ``pwrite`` and is not fsynced on every commit (that would double the
flushes on the path to an acknowledgement): a background thread fdatasyncs it at most once every
:data:`SYNC_EVERY_S` seconds while it changed, and :meth:`DurableMark.close` syncs it. A crash may
leave an older record (it claims less) or a torn one (its CRC fails: ignored with a warning);
either only makes the check less strict, never refuses a log a crash left behind. A record that
names segments the directory no longer holds, older than its oldest, is stale (they were retired)
and ignored.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from tracestore.server.wal.files import MARK, SEGMENT_RE, fsync_dir

from tracestore.checksum import crc32
from tracestore.errors import ConfigError

log = logging.getLogger("tracestore.server")
TITLE = b"tracestore write-ahead log: bytes of each segment made durable (fdatasync returned)\n"
SYNC_EVERY_S = 1.0


def _lines(claims: Iterable[tuple[int, int]]) -> bytes:
    return "".join([f"wal-{i:012d}.log {n}\n" for i, n in claims]).encode()  # (segment_path's names)


def encode(claims: Iterable[tuple[int, int]]) -> bytes:
    """The file's text for ``claims`` ``[(segment index, bytes durable)]``, oldest first."""
    body = TITLE + _lines(claims)
    return body + f"crc32 {crc32(body):08x}\n".encode()


def read_marks(directory: Path) -> dict[int, int]:
    """``{segment index: bytes durable}`` from ``directory/DURABLE``; empty when there is none or it
    is empty (a log of an older sidecar, or none synced yet), and, with a warning, when it cannot be
    read or fails its CRC (a write a crash tore): replay then checks segments without it."""
    path = directory / MARK
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("write-ahead log: cannot read %s (%s); replay cannot check segments against it", path, exc)
        return {}
    if not data:
        return {}
    at = data.find(b"\ncrc32 ") + 1
    try:
        if at == 0 or not data.startswith(TITLE) or int(data[at + 6 : at + 14], 16) != crc32(data[:at]):
            raise ValueError("checksum mismatch")
        marks = {}
        for line in data[len(TITLE) : at].decode().splitlines():
            name, size = line.split(" ")
            m = SEGMENT_RE.fullmatch(name)
            if m is None:
                raise ValueError(f"not a segment: {name!r}")
            marks[int(m.group(1))] = int(size)
    except ValueError as exc:
        log.warning(
            "write-ahead log: %s is not a valid record of durable bytes (%s: a write a crash tore?); replay "
            "checks the segments without it",
            path,
            exc,
        )
        return {}
    return marks


class DurableMark:
    """The writing side of ``directory/DURABLE``: :meth:`write` (from the log's sync thread, after
    each fdatasync that returned), a thread that syncs it every :data:`SYNC_EVERY_S` seconds while
    it changed, and :meth:`close`. A failed write or sync is logged (once until one succeeds) and
    the log goes on: a stale record only makes replay's check less strict."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / MARK
        self._fd = -1
        self._size = 0  # the file's length: records are padded to it, so it never shrinks
        self._dirty = False
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._older: tuple[tuple[int, int], tuple[int, int], bytes] | None = None  # (first, last, lines)

    def open(self) -> None:
        """Open (create) the file and start the syncing thread; ConfigError when it cannot be opened
        (a symlink or a directory in its place, no permission)."""
        created = not self.path.exists()
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(
                f"cannot open the write-ahead log's record of durable bytes {self.path}: {exc.strerror}; expected "
                "a regular file the sidecar's user may write (or none)"
            ) from None
        self._size = os.fstat(self._fd).st_size
        if created:
            fsync_dir(self.path.parent)
        self._thread = threading.Thread(target=self._sync_loop, name="tracestore-wal-mark", daemon=True)
        self._thread.start()

    def record(self, claims: list[tuple[int, int]]) -> bytes:
        """:func:`encode` of ``claims`` (oldest first), reusing the older segments' lines from the
        last call while the first and the last of them are the same: an older segment's size does
        not change, save the one the log's recovery cuts back (then the last older one)."""
        if len(claims) < 2:
            return encode(claims)
        first, last = claims[0], claims[-2]
        if self._older is None or self._older[:2] != (first, last):
            self._older = (first, last, _lines(claims[:-1]))
        body = TITLE + self._older[2] + _lines(claims[-1:])
        return body + f"crc32 {crc32(body):08x}\n".encode()

    def write(self, record: bytes) -> None:
        """Replace the record with ``record`` (:func:`encode`); not synced here."""
        if self._fd < 0:
            return
        data = record.ljust(self._size, b"\n")
        try:
            os.pwrite(self._fd, data, 0)
        except OSError as exc:
            self._failed("write", exc)
            return
        self._size = max(self._size, len(data))
        self._dirty = True

    def _failed(self, what: str, exc: OSError) -> None:
        if not self._failing:
            log.warning(
                "write-ahead log: cannot %s %s (%s); replay's check for lost acknowledged entries uses the last "
                "record that reached the disk",
                what,
                self.path,
                exc,
            )
        self._failing = True

    def _sync(self) -> None:
        if not self._dirty:
            return
        self._dirty = False  # (a write from now on sets it again)
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            self._failed("sync", exc)
        else:
            self._failing = False

    def _sync_loop(self) -> None:
        while not self._stop.wait(SYNC_EVERY_S):
            self._sync()

    def close(self, record: bytes | None = None) -> None:
        """Stop the thread, write ``record`` if given (all of it durable), sync and close."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._fd < 0:
            return
        if record is not None:
            self.write(record)
        self._sync()
        os.close(self._fd)
        self._fd = -1
