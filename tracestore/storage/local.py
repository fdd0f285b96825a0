"""Local-disk publishing: the one create-only atomic path (:func:`publish_local`: a temp file in
the target directory, fsync, a create-only ``link``, an fsync of the directory) and the shard file
an encoder streams into while the bytes are checksummed and written back (:class:`ShardFile`).
:class:`tracestore.storage.fs.Storage` calls these for ``file://`` stores."""

from __future__ import annotations

import filecmp
import os
import threading
import uuid
from collections.abc import Callable
from typing import TypeVar

from tracestore import faults as _faults
from tracestore.checksum import crc32
from tracestore.errors import ConflictError, StorageError

T = TypeVar("T")


def publish_local(path: str, fill: Callable[[int, str], T], crash_point: str | None = None) -> tuple[bool, T]:
    """Create ``path`` on local disk, create-only and atomically: ``fill(fd, tmp)`` writes a temp
    file in the same directory (``.<name>.tmp-<uuid4 hex>``, read-write descriptor ``fd``), which is
    fsynced, linked into place (``link`` fails instead of replacing) and removed, and the directory
    (and any directory created for it) fsynced. Returns (written, fill's result): written is False
    when ``path`` already holds identical bytes; different bytes raise :class:`ConflictError`.
    ``crash_point``: a :func:`tracestore.faults.point` hit once the temp file is durable."""
    directory = os.path.dirname(path)
    created = _missing_dirs(directory)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        value = fill(fd, tmp)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    if crash_point is not None:
        _faults.point(crash_point)
    try:
        os.link(tmp, path)  # the create-only rename
        written = True
    except FileExistsError:
        if not filecmp.cmp(tmp, path, shallow=False):
            raise ConflictError(
                f"{path} already exists with different bytes ({os.path.getsize(path)} B vs "
                f"{os.path.getsize(tmp)} B): the same shard key was written twice with different contents"
            ) from None
        written = False
    finally:
        os.unlink(tmp)
    _fsync_dirs([directory, *[os.path.dirname(c) for c in created]])
    return written, value


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def _missing_dirs(directory: str) -> list[str]:
    created = []
    d = directory
    while d and not os.path.isdir(d):
        created.append(d)
        d = os.path.dirname(d)
    return created


def _fsync_dirs(dirs: list[str]) -> None:
    for dpath in dirs:
        dfd = os.open(dpath, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux ``sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE)``: start writeback, do not wait;
    None where libc has none."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def start_writeback(fd: int, offset: int, nbytes: int) -> None:
        if fn(fd, offset, nbytes, 2) != 0:  # 2 = SYNC_FILE_RANGE_WRITE
            err = ctypes.get_errno()
            raise OSError(err, f"sync_file_range: {os.strerror(err)}")

    return start_writeback


_START_WRITEBACK = _sync_file_range()


class ShardFile:
    """The temp file a local shard is encoded into (:meth:`Storage.publish_stream`), checksummed
    and written back behind the encoder.

    ``stream`` is a buffered native Arrow output stream onto ``path`` (the Parquet writer writes
    into it without the GIL and without a copy through Python). After handing over a batch of
    bytes (a row group) the writer calls :meth:`progress`; a background thread then adds the bytes
    that reached the file to the running crc32 (ISA-L, read back from the page cache) and starts
    their writeback (``sync_file_range``, or ``fdatasync`` where that is missing) every
    ``sync_every`` bytes, so the owner's final ``fsync`` has little left to flush. :meth:`finish`
    closes the stream, checksums the rest and raises the first error; then :attr:`size` and
    :attr:`crc32` describe the whole file. The caller owns ``fd`` (a read-write descriptor of
    ``path``) and its final fsync.
    """

    READ = 4 << 20

    def __init__(self, fd: int, path: str, sync_every: int = 8 << 20) -> None:
        import pyarrow as pa

        self._fd = fd
        self.path = path
        self.size = 0
        self.crc32 = 0
        self._sync_every = sync_every
        self.stream = pa.BufferedOutputStream(pa.OSFile(path, "wb"), 1 << 20)
        self._cv = threading.Condition()
        self._kicks = 0
        self._limit: int | None = None
        self._final = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tracestore-shard-sync", daemon=True)
        self._thread.start()

    def progress(self, limit: int | None = None) -> None:
        """Bytes were handed to :attr:`stream`: checksum and start writing back what reached the
        file, up to byte ``limit`` (None: all of it)."""
        with self._cv:
            self._kicks += 1
            self._limit = limit
            self._cv.notify()

    def _run(self) -> None:
        done = synced = 0
        crc = 0
        view = memoryview(bytearray(self.READ))
        try:
            while True:
                with self._cv:
                    while not self._kicks and not self._final:
                        self._cv.wait()
                    self._kicks = 0
                    final, limit = self._final, self._limit
                end = os.fstat(self._fd).st_size
                if limit is not None and not final:
                    end = min(end, limit)
                while done < end:
                    n = os.preadv(self._fd, [view[: min(self.READ, end - done)]], done)
                    if n <= 0:
                        raise OSError(f"short read of {self.path} at byte {done} of {end}")
                    crc = crc32(view[:n], crc)
                    done += n
                if not final and done - synced >= self._sync_every:
                    if _START_WRITEBACK is not None:
                        _START_WRITEBACK(self._fd, synced, done - synced)
                    else:  # pragma: no cover - not Linux
                        os.fdatasync(self._fd)
                    synced = done
                if final:
                    self.size, self.crc32 = done, crc
                    return
        except BaseException as exc:  # surfaced by finish()
            self._error = exc

    def finish(self) -> None:
        """Close the stream and wait until every byte is checksummed; raise the first error."""
        try:
            if not self.stream.closed:
                self.stream.close()
        finally:
            with self._cv:
                self._final = True
                self._cv.notify()
            self._thread.join()
        if self._error is not None:
            raise StorageError(f"writing the shard {self.path} failed: {self._error!r}") from self._error
