"""fsspec access with a timeout on every call, retries with backoff, and create-only atomic publish.

``storage_options`` go to fsspec untouched (tracestore never handles credentials). Every call
runs on a small worker pool and is bounded by ``timeout`` seconds: a black-holed S3 endpoint
makes s3fs PUTs hang forever (shared/reliability.md), so a hang surfaces here as
:class:`~tracestore.errors.StorageError` instead. Transient failures (timeouts, connection
errors, other ``OSError`` that is not "not found / exists / permission") are retried with
exponential backoff; each retry and each final error is counted in :attr:`Storage.stats` and
reported to ``on_event(kind, op, detail)`` so a server can feed its metrics without this module
importing prometheus.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import filecmp
import io
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tracestore.errors import ConflictError, NotFoundError, StorageError, TraceStoreError
from tracestore.records import crc32

T = TypeVar("T")
EventHook = Callable[[str, str, str], None]
"""``on_event(kind, op, detail)``; kind is ``"retry"``, ``"timeout"`` or ``"error"``."""

_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


# Connection-level errors of the S3 stack are not OSError subclasses (botocore's
# EndpointConnectionError, ReadTimeoutError ...): recognize them by their package.
_NETWORK_PACKAGES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "gcsfs", "adlfs")


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, TraceStoreError):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError):
        return not isinstance(exc, _PERMANENT)
    return any(type(exc).__module__.startswith(p) for p in _NETWORK_PACKAGES)


class Storage:
    """A filesystem root (any fsspec URL) with bounded, retried calls.

    ``Storage("s3://bucket/prefix", {"endpoint_url": ...}, timeout=30)``; paths passed to the
    methods are relative to the root (``"run-1/v0/w0/part-00000000.parquet"``).
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.05,
        on_event: EventHook | None = None,
        workers: int = 8,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise StorageError(f"storage URL must be a non-empty string like 'file://./data', got {url!r}")
        if not timeout or timeout <= 0:
            raise StorageError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.on_event = on_event
        self.stats: dict[str, int] = {"retries": 0, "timeouts": 0, "errors": 0, "bytes_written": 0, "bytes_read": 0}
        self._lock = threading.Lock()
        self._workers = workers
        self._pool = self._new_pool()
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **self.storage_options)
        except ImportError as exc:
            from tracestore.errors import MissingExtraError

            raise MissingExtraError(
                f"no fsspec backend for {url!r} ({exc}); for s3:// install `pip install 'tracestore[s3]'`"
            ) from exc
        except (ValueError, TypeError) as exc:
            raise StorageError(f"cannot open storage {url!r}: {exc}") from exc
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def close(self) -> None:
        """Shut the worker pool down (a later call starts a new one)."""
        with self._lock:
            pool, self._pool = self._pool, self._new_pool()
        pool.shutdown(wait=False, cancel_futures=True)

    def _new_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="tracestore-io")

    def full(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def rel(self, full: str) -> str:
        full = full.rstrip("/")
        prefix = self.root.lstrip("/") + "/"
        f = full.lstrip("/")
        return f[len(prefix) :] if f.startswith(prefix) else f

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _event(self, kind: str, op: str, detail: str) -> None:
        self._count({"retry": "retries", "timeout": "timeouts", "error": "errors"}[kind])
        if self.on_event is not None:
            with contextlib.suppress(Exception):  # a metrics hook must never break storage
                self.on_event(kind, op, detail)

    def call(self, op: str, fn: Callable[..., T], *args: Any, retry: bool = True, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` bounded by the timeout, retrying transient errors."""
        attempts = 1 + (self.retries if retry else 0)
        last: BaseException | None = None
        for attempt in range(attempts):
            if attempt:
                self._event("retry", op, repr(last))
                time.sleep(self.backoff * (2 ** (attempt - 1)))
            fut = self._pool.submit(fn, *args, **kwargs)
            try:
                return fut.result(timeout=self.timeout)
            except concurrent.futures.TimeoutError:
                fut.cancel()
                self._event("timeout", op, f"no answer in {self.timeout:g} s")
                last = TimeoutError(f"{op} timed out after {self.timeout:g} s")
            except Exception as exc:
                if not _transient(exc):
                    if isinstance(exc, (TraceStoreError, FileExistsError)):
                        raise
                    if isinstance(exc, FileNotFoundError):
                        raise NotFoundError(f"{op}: not found on {self.url} ({exc})") from exc
                    self._event("error", op, repr(exc))
                    if isinstance(exc, PermissionError):
                        raise StorageError(f"{op}: permission denied on {self.url}: {exc}") from exc
                    raise StorageError(f"{op} on {self.url} failed: {exc!r}") from exc
                last = exc
        self._event("error", op, repr(last))
        raise StorageError(
            f"{op} on {self.url} failed after {attempts} attempt(s) (timeout {self.timeout:g} s each): {last!r}; "
            "check that the storage is reachable"
        ) from last

    # ------------------------------------------------------------------ reads

    def cat(self, rel: str) -> bytes:
        data = self.call(f"read {rel}", self.fs.cat_file, self.full(rel))
        self._count("bytes_read", len(data))
        return bytes(data)

    def exists(self, rel: str) -> bool:
        return bool(self.call(f"exists {rel}", self.fs.exists, self.full(rel)))

    def size(self, rel: str) -> int:
        return int(self.call(f"size {rel}", self.fs.size, self.full(rel)))

    def ls_dirs(self, rel: str) -> list[str]:
        """Names of the entries directly under ``rel`` (directories and files); [] when absent."""

        def _ls() -> list[str]:
            path = self.full(rel)
            try:
                entries = self.fs.ls(path, detail=False, refresh=True) if not self.local else self.fs.ls(path, False)
            except FileNotFoundError:
                return []
            return [str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries]

        return self.call(f"list {rel}", _ls)

    def find(self, rel: str) -> list[str]:
        """All files below ``rel`` as root-relative paths ([] when absent)."""

        def _find() -> list[str]:
            path = self.full(rel)
            if hasattr(self.fs, "invalidate_cache"):
                self.fs.invalidate_cache(path)
            try:
                return [self.rel(p) for p in self.fs.find(path)]
            except FileNotFoundError:
                return []

        return self.call(f"list {rel}", _find)

    def open_read(self, rel: str) -> Any:
        """A binary file handle for ranged reads (no read-ahead cache: pyarrow asks for exact ranges)."""
        kw: dict[str, Any] = {} if self.local else {"cache_type": "none", "block_size": 1 << 20}
        return self.call(f"open {rel}", self.fs.open, self.full(rel), "rb", **kw)

    # ------------------------------------------------------------------ writes

    def publish(self, rel: str, data: bytes | memoryview) -> bool:
        """Write ``data`` at ``rel`` create-only and atomically; True if written, False if already there.

        An existing object with identical bytes is a harmless repeat (False); different bytes raise
        :class:`ConflictError`. Never leaves a partial object: S3 gets one PUT (``If-None-Match: *``),
        local disk a temp file in the same directory, fsync, a create-only link, fsync of the directory.
        """
        try:
            if self.local:
                self.call(f"write {rel}", self._publish_local, self.full(rel), data)
            else:
                self.call(f"write {rel}", self.fs.pipe_file, self.full(rel), bytes(data), mode="create")
        except FileExistsError:
            existing = self.cat(rel)
            if existing != bytes(data):
                raise ConflictError(
                    f"{self.full(rel)} already exists with different bytes ({len(existing)} B vs {len(data)} B): "
                    "the same shard key was written twice with different contents"
                ) from None
            return False
        self._count("bytes_written", len(data))
        return True

    def publish_stream(self, rel: str, produce: Callable[[ShardFile], T]) -> tuple[bool, T]:
        """Local disk only: ``produce(file)`` writes a file's bytes, published like :meth:`publish`.

        ``file`` is a :class:`ShardFile`: a native Arrow output stream onto a temp file in the
        target directory (the encoder writes without the GIL and without copies through Python)
        whose written bytes a background thread checksums and starts writing back while the
        encoder goes on, so the final fsync has little left to flush and no second copy of the
        shard is held in memory. Returns (written, produce's result); an existing file with
        identical bytes gives written=False, different bytes ConflictError.
        """
        if not self.local:
            raise StorageError(f"publish_stream needs local storage, {self.url} is not")
        result = self.call(f"write {rel}", self._publish_local_stream, self.full(rel), produce)
        written, size, value = result
        if written:
            self._count("bytes_written", size)
        return written, value

    @staticmethod
    def _publish_local_stream(path: str, produce: Callable[[ShardFile], T]) -> tuple[bool, int, T]:
        directory = os.path.dirname(path)
        created = _missing_dirs(directory)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            shard = ShardFile(fd, tmp)
            try:
                value = produce(shard)
            finally:
                shard.finish()
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        try:
            os.link(tmp, path)  # the create-only rename
            written = True
        except FileExistsError:
            if not filecmp.cmp(tmp, path, shallow=False):
                raise ConflictError(
                    f"{path} already exists with different bytes: the same shard key was written twice "
                    "with different contents"
                ) from None
            written = False
        finally:
            os.unlink(tmp)
        _fsync_dirs([directory, *[os.path.dirname(c) for c in created]])
        return written, shard.size, value

    @staticmethod
    def _publish_local(path: str, data: bytes | memoryview) -> None:
        directory = os.path.dirname(path)
        created = _missing_dirs(directory)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            # link() is the create-only rename: it fails with FileExistsError instead of replacing.
            os.link(tmp, path)
        finally:
            os.unlink(tmp)
        _fsync_dirs([directory, *[os.path.dirname(c) for c in created]])

    def rm(self, rel: str, recursive: bool = False) -> None:
        def _rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.full(rel), recursive=recursive)

        self.call(f"delete {rel}", _rm)


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
    """Linux ``sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE)``: start writeback, do not wait."""
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


def _fallocate() -> Callable[[int, int, int, int], None] | None:
    """Linux ``fallocate(fd, mode, offset, len)``; None where libc has none."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    fn.restype = ctypes.c_int

    def fallocate(fd: int, mode: int, offset: int, nbytes: int) -> None:
        if fn(fd, mode, offset, nbytes) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fallocate: {os.strerror(err)}")

    return fallocate


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

    Two writers at once (see ``tracestore.shards``): :meth:`open_at` gives a second stream that
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


class CountingFile(io.RawIOBase):
    """Wraps a binary file handle and counts the bytes handed out (for read accounting)."""

    def __init__(self, f: Any) -> None:
        super().__init__()
        self._f = f
        self.bytes_read = 0
        self.io_error: Exception | None = None  # set when the storage (not the bytes) failed

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self._f.seek(offset, whence))

    def tell(self) -> int:
        return int(self._f.tell())

    def _read(self, size: int) -> bytes:
        try:
            return bytes(self._f.read(size))
        except Exception as exc:
            self.io_error = exc
            raise

    def read(self, size: int = -1) -> bytes:
        data = self._read(size)
        self.bytes_read += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self._read(len(b))
        n = len(data)
        b[:n] = data
        self.bytes_read += n
        return n

    def close(self) -> None:
        try:
            self._f.close()
        finally:
            super().close()
