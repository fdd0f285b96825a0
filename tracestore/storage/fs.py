"""fsspec access with a timeout on every call, retries with backoff, and create-only atomic publish.

``storage_options`` go to fsspec untouched (tracestore never handles credentials). Every call
runs on a small worker pool and is bounded by ``timeout`` seconds: a black-holed S3 endpoint
makes s3fs PUTs hang forever, so a hang surfaces here as
:class:`~tracestore.errors.StorageError` instead. Transient failures (timeouts, connection
errors, other ``OSError`` that is not "not found / exists / permission") are retried (tenacity)
with exponential backoff and jitter, at most ``retries`` times and never starting a retry later
than ``retry_deadline`` seconds after the first attempt began (default 30 s); each retry and
each final error is counted in :attr:`Storage.stats` and reported to
``on_event(kind, op, detail)`` so a server can feed its metrics without this module importing
prometheus.

Publishing is create-only on every backend (never a partial object, never a replaced one): S3 and
memory get one PUT of the whole bytes (``If-None-Match: *``); local disk gets a temp file in the
target directory, fsync, a create-only ``link``, and an fsync of the directory
(:func:`~tracestore.storage.local.publish_local`, the one local publish path). A shard on local disk
is written straight into that temp file while it is encoded
(:class:`~tracestore.storage.local.ShardFile`, :meth:`Storage.publish_stream`).

An async filesystem's event loop (fsspec's, shared by s3fs and the like) gets the handler of
:func:`~tracestore.storage.aio.read_unread_body_errors`: a request body that a reset connection
kept from being sent is logged at DEBUG, not as "Task exception was never retrieved".
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
import tenacity
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

from tracestore.errors import ConflictError, NotFoundError, StorageError, TraceStoreError
from tracestore.storage.aio import read_unread_body_errors
from tracestore.storage.config import DEFAULT_RETRY_DEADLINE_S
from tracestore.storage.local import ShardFile, publish_local, write_all

T = TypeVar("T")
EventHook = Callable[[str, str, str], None]
"""``on_event(kind, op, detail)``; kind is ``"retry"``, ``"timeout"`` or ``"error"``."""

RETRY_DEADLINE_ENV = "TRACESTORE_STORAGE_RETRY_DEADLINE"
"""The variable of ``tracestore serve --storage-retry-deadline`` (read by the settings layer)."""


def default_retry_deadline() -> float:
    """The retry deadline of a :class:`Storage` made without one:
    :data:`DEFAULT_RETRY_DEADLINE_S`."""
    return DEFAULT_RETRY_DEADLINE_S


def backoff_wait(backoff: float, max_backoff: float) -> tenacity.wait.wait_base:
    """Before retry n (1, 2, ...): a wait drawn uniformly from [h, 2h], h = ``backoff`` * 2**(n-2),
    capped at ``max_backoff`` ("equal jitter": at least half the exponential step, so a single
    caller still backs off, and a random other half, so callers that failed together spread out)."""
    half, cap = backoff / 2, max_backoff / 2
    return tenacity.wait_exponential(multiplier=half, max=cap) + tenacity.wait_random_exponential(
        multiplier=half, max=cap
    )


_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


# Connection-level errors of the S3 stack are not OSError subclasses (botocore's
# EndpointConnectionError, ReadTimeoutError ...): recognize them by their package.
_NETWORK_PACKAGES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "gcsfs", "adlfs")


def _drop_frames(exc: BaseException | None) -> None:
    """Clear the frames of a failed attempt's traceback and of the exceptions it chains. An async
    client's failure (raised again through a future, an event loop's task) sits in reference cycles
    with the request it failed: the body it was sending and the copy aiohttp makes of it, which
    only the garbage collector would free: a PUT against a black-holed S3 endpoint would leave one
    shard and its copy per timed-out attempt outside the memory budget."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, TraceStoreError):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError):
        return not isinstance(exc, _PERMANENT)
    return any(type(exc).__module__.startswith(p) for p in _NETWORK_PACKAGES)


class _PoolState:
    """What a :class:`DaemonPool`'s workers share (they hold this, not the pool, so an unclosed
    pool is still collected and its idle workers then exit, as ``ThreadPoolExecutor``'s do)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple, dict] | None]
        self.queue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.threads = 0
        self.idle = 0
        self.closed = False

    def work(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            del item
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                    fut.set_exception(exc)
                else:
                    fut.set_result(result)
            del fut, fn, args, kwargs
            with self.lock:
                self.idle += 1

    def stop(self, cancel_futures: bool) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            threads = self.threads
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None and cancel_futures:
                item[0].cancel()
        for _ in range(threads):
            self.queue.put(None)


class DaemonPool:
    """A minimal executor whose workers are daemon threads.

    A call stuck past its timeout (a black-holed S3 PUT never returns) is abandoned by
    :meth:`Storage.call`, but a ``ThreadPoolExecutor`` worker is joined at interpreter exit, so one
    such call kept a finished sidecar or test process alive for minutes or for ever. Abandoning it
    at exit is safe: nothing is visible before its create-only publish. Workers start on demand, up
    to ``workers``; they exit on :meth:`shutdown` or when the pool is collected."""

    def __init__(self, workers: int, name: str) -> None:
        self._max = max(1, int(workers))
        self._name = name
        self._state = _PoolState()
        weakref.finalize(self, self._state.stop, True)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        st = self._state
        with st.lock:
            if st.closed:
                raise RuntimeError(f"{self._name} pool is shut down")
            st.queue.put((fut, fn, args, kwargs))
            if st.idle == 0 and st.threads < self._max:
                st.threads += 1
                threading.Thread(target=st.work, name=f"{self._name}-{st.threads}", daemon=True).start()
            else:
                st.idle = max(0, st.idle - 1)
        return fut

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        """Stop taking work; cancel what has not started; idle workers exit (``wait`` is ignored:
        a stuck call is never waited for)."""
        self._state.stop(cancel_futures)


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
        backoff: float = 0.5,
        on_event: EventHook | None = None,
        workers: int = 8,
        retry_deadline: float | None = None,
        max_backoff: float = 10.0,
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
        self.max_backoff = float(max_backoff)
        self.retry_deadline = default_retry_deadline() if retry_deadline is None else float(retry_deadline)
        if not self.retry_deadline > 0:
            raise StorageError(f"retry_deadline must be > 0 seconds, got {retry_deadline!r}")
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
        if isinstance(self.fs, AsyncFileSystem) and not self.fs.asynchronous:
            # aiohttp's unread request-body errors on fsspec's loop (tracestore.storage.aio)
            read_unread_body_errors(self.fs.loop)

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def close(self) -> None:
        """Shut the worker pool down (a later call starts a new one)."""
        with self._lock:
            pool, self._pool = self._pool, self._new_pool()
        pool.shutdown(wait=False, cancel_futures=True)

    def _new_pool(self) -> DaemonPool:
        return DaemonPool(self._workers, "tracestore-io")

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

    def count_read(self, nbytes: int) -> None:
        """Add ``nbytes`` that a caller read through a handle of its own (a memory map, a
        :class:`CountingFile`) to ``stats["bytes_read"]``."""
        self._count("bytes_read", nbytes)

    def _event(self, kind: str, op: str, detail: str) -> None:
        self._count({"retry": "retries", "timeout": "timeouts", "error": "errors"}[kind])
        if self.on_event is not None:
            with contextlib.suppress(Exception):  # a metrics hook must never break storage
                self.on_event(kind, op, detail)

    def call(self, op: str, fn: Callable[..., T], *args: Any, retry: bool = True, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` bounded by the timeout, retrying transient errors: at most
        ``retries`` times, waiting :func:`backoff_wait` between attempts, and starting no retry
        later than ``retry_deadline`` seconds after the first attempt began."""
        op = " ".join(op.split())  # "list " (the root) reads "list"
        attempts = 1 + (self.retries if retry else 0)

        began: list[float] = []  # when each attempt began
        failed: list[BaseException] = []  # the failure a retry follows

        def attempt() -> T:
            now = time.monotonic()
            if began and now - began[0] >= self.retry_deadline:
                # the wait ended late (a loaded host): no retry; tenacity stops on this failure,
                # its clock being past the deadline too
                raise failed[-1]
            began.append(now)
            fut = self._pool.submit(fn, *args, **kwargs)
            try:
                return fut.result(timeout=self.timeout)
            except concurrent.futures.TimeoutError:
                if not fut.cancel():  # still running: once it ends, its failure holds nothing
                    fut.add_done_callback(lambda f: None if f.cancelled() else _drop_frames(f.exception()))
                self._event("timeout", op, f"no answer in {self.timeout:g} s")
                raise TimeoutError(f"{op} timed out after {self.timeout:g} s") from None

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            if exc is not None:
                failed[:] = [exc]
            self._event("retry", op, repr(exc))
            _drop_frames(exc)

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(attempts) | tenacity.stop_before_delay(self.retry_deadline),
            wait=backoff_wait(self.backoff, self.max_backoff),
            retry=tenacity.retry_if_exception(_transient),
            before_sleep=before_sleep,
            reraise=True,
        )
        t0 = time.monotonic()
        try:
            return retrying(attempt)
        except Exception as exc:
            if _transient(exc):
                self._event("error", op, repr(exc))
                n = len(began)
                raise StorageError(
                    f"{op} on {self.url} failed after {n} attempt(s) in {time.monotonic() - t0:.1f} s "
                    f"(timeout {self.timeout:g} s each, retry deadline {self.retry_deadline:g} s): {exc!r}; "
                    "check that the storage is reachable and its credentials"
                ) from exc
            if isinstance(exc, (TraceStoreError, FileExistsError)):
                raise
            if isinstance(exc, FileNotFoundError):
                raise NotFoundError(f"{op}: not found on {self.url} ({exc})") from exc
            self._event("error", op, repr(exc))
            if isinstance(exc, PermissionError):
                raise StorageError(f"{op}: permission denied on {self.url}: {exc}") from exc
            raise StorageError(f"{op} on {self.url} failed: {exc!r}") from exc

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

    def du(self, rel: str) -> int:
        """Bytes of all files below ``rel`` (0 when absent)."""

        def _du() -> int:
            path = self.full(rel)
            if hasattr(self.fs, "invalidate_cache"):
                self.fs.invalidate_cache(path)
            try:
                return int(self.fs.du(path, total=True))
            except FileNotFoundError:
                return 0

        return self.call(f"list {rel}", _du)

    def open_read(self, rel: str) -> Any:
        """A binary handle for ranged reads, no read-ahead (pyarrow asks for exact ranges)."""
        kw: dict[str, Any] = {} if self.local else {"cache_type": "none", "block_size": 1 << 20}
        return self.call(f"open {rel}", self.fs.open, self.full(rel), "rb", **kw)

    # ------------------------------------------------------------------ writes

    def publish(self, rel: str, data: bytes | bytearray | memoryview) -> bool:
        """Write ``data`` at ``rel`` create-only and atomically; True if written, False if already there.

        An existing object with identical bytes is a harmless repeat (False); different bytes raise
        :class:`ConflictError`. Never leaves a partial object: S3 gets one PUT
        (``If-None-Match: *``), local disk a temp file in the same directory, fsync, a create-only
        link, fsync of the directory.
        """
        if self.local:
            written, _ = self.call(f"write {rel}", publish_local, self.full(rel), lambda fd, _tmp: write_all(fd, data))
            if written:
                self._count("bytes_written", len(data))
            return written
        try:
            body = data if isinstance(data, (bytes, bytearray)) else bytes(data)  # (a bytearray: shard_write.BytesSink)
            self.call(f"write {rel}", self.fs.pipe_file, self.full(rel), body, mode="create", **self._bounded())
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

    def _bounded(self) -> dict[str, Any]:
        """For an async filesystem (s3fs): the call's own ``timeout``, so that fsspec cancels a
        request that outlives it. Left running, a PUT that timed out (storage black-holed) kept its
        body and its upload copy for as long as the filesystem retried it, while the next attempt
        uploaded another copy: every retry held another shard."""
        return {"timeout": self.timeout} if isinstance(self.fs, AsyncFileSystem) and not self.fs.asynchronous else {}

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

        def fill(fd: int, tmp: str) -> tuple[int, T]:
            shard = ShardFile(fd, tmp)
            try:
                value = produce(shard)
            finally:
                shard.finish()
            return shard.size, value

        written, (size, value) = self.call(
            f"write {rel}", publish_local, self.full(rel), fill, crash_point="store.temp_written"
        )
        if written:
            self._count("bytes_written", size)
        return written, value

    def rm(self, rel: str, recursive: bool = False) -> None:
        def _rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.full(rel), recursive=recursive)

        self.call(f"delete {rel}", _rm)


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
