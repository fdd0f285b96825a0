"""The local temp file a shard is written into: native Arrow streams, checksums and writeback
behind the writers, and the primitives that let two writers fill one file (Linux).

:class:`ShardFile` is what :meth:`tracestore.storage.fs.Storage.publish_stream` hands the shard
encoder; the temp file is then fsynced, linked into place create-only and its directory fsynced
there (never a partial object: docs/data-model.md, "Storage layout").
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from tracestore.errors import StorageError
from tracestore.records import crc32


def _libc_call(name: str, argtypes: list[Any]) -> Callable[..., None] | None:
    """A Linux libc function that raises OSError on a non-zero return; None where libc has none."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int

    def call(*args: int) -> None:
        if fn(*args) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{name}: {os.strerror(err)}")

    return call


def _sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux ``sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE)``: start writeback, do not wait."""
    import ctypes

    call = _libc_call("sync_file_range", [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint])
    if call is None:  # pragma: no cover - not Linux
        return None

    def start_writeback(fd: int, offset: int, nbytes: int) -> None:
        call(fd, offset, nbytes, 2)  # 2 = SYNC_FILE_RANGE_WRITE

    return start_writeback


_START_WRITEBACK = _sync_file_range()


def _fallocate() -> Callable[..., None] | None:
    """Linux ``fallocate(fd, mode, offset, len)``; None where libc has none."""
    import ctypes

    return _libc_call("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong])


_FALLOCATE = _fallocate()
_FALLOC_FL_COLLAPSE_RANGE = 0x08
_COLLAPSE_OK: dict[int, bool] = {}  # st_dev -> whether the filesystem collapses ranges (ext4, XFS)


class Region:
    """Bytes an Arrow writer appends to one region of a :class:`ShardFile` from ``start`` on:
    :meth:`advance` checksums (ISA-L, read back from the page cache) and starts the writeback of
    what reached the file, in the writer's own thread."""

    def __init__(self, fd: int, start: int, sync_every: int = 8 << 20) -> None:
        self._fd = fd
        self.start = self.done = self._synced = start
        self.crc32 = 0
        self._sync_every = sync_every

    def advance(self, end: int) -> None:
        """Take in the bytes ``[done, end)`` (they must be in the file)."""
        while self.done < end:
            data = os.pread(self._fd, min(ShardFile.READ, end - self.done), self.done)
            if not data:
                raise StorageError(f"short read of a shard at byte {self.done} of {end}")
            self.crc32 = crc32(data, self.crc32)
            self.done += len(data)
        if self.done - self._synced >= self._sync_every and _START_WRITEBACK is not None:
            _START_WRITEBACK(self._fd, self._synced, self.done - self._synced)
            self._synced = self.done


class ShardFile:
    """A temp file that Arrow writers fill natively, checksummed and written back behind them.

    ``stream`` is a buffered native Arrow output stream onto ``path`` (the Parquet writer writes
    into it without the GIL and without a copy through Python). After handing over a batch of
    bytes (a row group) the writer calls :meth:`progress`; a background thread then adds the bytes
    that reached the file to the running crc32 (ISA-L, read back from the page cache) and starts
    their writeback (``sync_file_range``, or ``fdatasync`` where that is missing) every
    ``sync_every`` bytes, so the owner's final ``fsync`` has little left to flush. :meth:`finish`
    closes the stream, checksums the rest and raises the first error; then :attr:`size` and
    :attr:`crc32` describe the whole file. The caller owns ``fd`` (a read-write descriptor of
    ``path``) and its final fsync.

    Two writers at once (see ``tracestore.storage.shards``): :meth:`open_at` gives a second stream that
    appends from a far offset (the gap is a hole), :class:`Region` checksums each writer's bytes,
    :meth:`collapse` removes the gap without moving data (``FALLOC_FL_COLLAPSE_RANGE``, where
    :meth:`can_collapse`), and ``finish(size, crc)`` takes the checksum the owner assembled.
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
        self._streams = [self.stream]
        self._cv = threading.Condition()
        self._kicks = 0
        self._limit: int | None = None
        self._final = False
        self._given: tuple[int, int] | None = None
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

    # -- two writers ---------------------------------------------------------------------------

    def file_size(self) -> int:
        return os.fstat(self._fd).st_size

    @property
    def block_size(self) -> int:
        return max(512, int(os.fstat(self._fd).st_blksize))

    def pread(self, offset: int, n: int) -> bytes:
        data = os.pread(self._fd, n, offset)
        if len(data) != n:
            raise StorageError(f"short read of {self.path}: {len(data)} of {n} bytes at {offset}")
        return data

    def restart(self) -> None:
        """Empty the file and give :attr:`stream` anew (nothing written may have been checksummed)."""
        import pyarrow as pa

        for stream in self._streams:
            if not stream.closed:
                stream.close()
        os.ftruncate(self._fd, 0)
        self.stream = pa.BufferedOutputStream(pa.OSFile(self.path, "wb"), 1 << 20)
        self._streams = [self.stream]

    def region(self, start: int) -> Region:
        return Region(self._fd, start, self._sync_every)

    def open_at(self, offset: int) -> Any:
        """A second native stream whose bytes go to the file from byte ``offset`` on (the file,
        still empty, is extended to it; the gap is a hole). The stream appends, so it starts
        at position 0 as the Parquet writer requires, and reports absolute positions once it
        has written; it is unbuffered (a buffered one reports its first block's positions from 0)."""
        import pyarrow as pa

        if self.file_size() != 0:
            raise StorageError(f"open_at needs the shard file {self.path} still empty")
        stream = pa.OSFile(self.path, "ab")
        self._streams.append(stream)
        os.ftruncate(self._fd, offset)
        return stream

    def can_collapse(self) -> bool:
        """Whether :meth:`collapse` works on this filesystem (probed once per device)."""
        dev = os.fstat(self._fd).st_dev
        ok = _COLLAPSE_OK.get(dev)
        if ok is None:
            ok = False
            if _FALLOCATE is not None:
                probe = f"{self.path}.probe"
                pfd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    blk = max(512, int(os.fstat(pfd).st_blksize))
                    os.write(pfd, bytes(3 * blk))
                    _FALLOCATE(pfd, _FALLOC_FL_COLLAPSE_RANGE, blk, blk)
                    ok = os.fstat(pfd).st_size == 2 * blk
                except OSError:
                    ok = False
                finally:
                    os.close(pfd)
                    os.unlink(probe)
            _COLLAPSE_OK[dev] = ok
        return ok

    def collapse(self, offset: int, nbytes: int) -> None:
        """Remove bytes ``[offset, offset + nbytes)`` (block-aligned); later bytes move down."""
        if _FALLOCATE is None:  # pragma: no cover - not Linux
            raise OSError("fallocate is not available")
        _FALLOCATE(self._fd, _FALLOC_FL_COLLAPSE_RANGE, offset, nbytes)
        # The collapse writes back and drops the page cache from ``offset`` on (the moved half):
        # a reader right after the write (a trainer on this host) would read it from disk, +60-70 ms
        # per 106 MB shard measured here. Ask the kernel to read it back in the background.
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(self._fd, offset, 0, os.POSIX_FADV_WILLNEED)

    def write_at(self, offset: int, parts: Sequence[Any], *, last: bool = False) -> int:
        """Write ``parts`` from ``offset`` on (``last``: and cut the file after them); return
        the offset after them."""
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                n = os.pwrite(self._fd, view[: self.READ], offset)
                view, offset = view[n:], offset + n
        if last and self.file_size() > offset:
            os.ftruncate(self._fd, offset)
        return offset

    # -------------------------------------------------------------------------------------------

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
                if final and self._given is not None:
                    return
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

    def finish(self, size: int | None = None, crc: int | None = None) -> None:
        """Close the streams and wait until every byte is checksummed (or take ``size`` and
        ``crc`` computed by the owner); raise the first error."""
        try:
            for stream in self._streams:
                if not stream.closed:
                    stream.close()
        finally:
            with self._cv:
                if size is not None and crc is not None and self._given is None:
                    self._given = (size, crc)
                self._final = True
                self._cv.notify()
            self._thread.join()
        if self._error is not None:
            raise StorageError(f"writing the shard {self.path} failed: {self._error!r}") from self._error
        if self._given is not None:
            self.size, self.crc32 = self._given
