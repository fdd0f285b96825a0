"""Shard verification for ``tracestore inspect --validate``: every shard read in full, here or in
worker processes.

Each shard's whole-file size and crc32 are checked against its manifest, then every page checksum,
every key column and every chunk's byte lengths and checksum, on whole columns
(:func:`tracestore.storage.shard_read.verify_shard`), never one Python object per chunk: a decode
shard holds ~300,000 chunks. Shards are verified ``--jobs`` at a time (default: one per core) by
this process and ``jobs - 1`` worker processes, once a version holds :data:`PARALLEL_MIN_BYTES` of
shards. This process reads the manifests and checks completeness first, then verifies what the
workers have not taken (:meth:`VerifyWorkers.help`). A large local shard is split between them by
row groups (:data:`SPLIT_BYTES`). A worker is a :mod:`tracestore.worker` child running
:func:`worker_main`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from tracestore import worker
from tracestore.errors import TraceStoreError

PARALLEL_MIN_BYTES = 1 << 30  # 2-core box, 490 MB: 0.89 s alone, 0.96-1.38 s with a worker
"""Shards of a version are verified in worker processes too once they add up to this many bytes;
below it a worker's start costs about what it saves."""
SPLIT_BYTES = 32 << 20  # a local shard is cut into units of at least this size, one per worker at most


@dataclasses.dataclass
class _Unit:
    """Row groups of one shard to verify (picklable: runs in a worker process)."""

    url: str
    storage_options: dict[str, Any]
    timeout: float
    local_path: str | None  # the file on local disk, else read through the storage
    cols: Any  # ManifestColumns of the row groups to verify
    where: str
    whole: bool  # also check the whole file's size and crc32 against the manifest
    sites: dict[str, tuple[int, int, int]]


_STORAGE: dict[tuple[str, str, float], Any] = {}


def _verify_unit(u: _Unit) -> list[str]:
    """The problems found in one unit (``CORRUPT ...`` lines without the prefix)."""
    import pyarrow as pa

    from tracestore.checksum import crc32
    from tracestore.storage.shard_read import verify_shard

    m = u.cols
    problems = []
    try:
        if u.local_path is not None:
            f: Any = pa.memory_map(u.local_path)
        else:
            from tracestore.storage.fs import Storage

            key = (u.url, json.dumps(u.storage_options, sort_keys=True, default=str), u.timeout)
            storage = _STORAGE.get(key)
            if storage is None:
                storage = _STORAGE[key] = Storage(u.url, u.storage_options, timeout=u.timeout)
            f = pa.BufferReader(storage.cat(m.shard))
    except FileNotFoundError:
        return [f"shard {u.where} listed in manifest {m.where} is gone"]
    except (OSError, TraceStoreError) as exc:
        return [f"shard {u.where}: cannot be read ({exc})"]
    try:
        if u.whole:
            size = f.size()
            crc = crc32(f.read_buffer(size)) if size == m.shard_bytes else None
            f.seek(0)
            if size != m.shard_bytes or crc != m.shard_crc32:
                got = f"{size} B" + (f" crc32 {crc:#010x}" if crc is not None else "")
                problems.append(f"shard {u.where}: {got}, manifest says {m.shard_bytes} B crc32 {m.shard_crc32:#010x}")
        problem = verify_shard(f, m, u.where, sites=u.sites)
        if problem is not None:
            problems.append(problem)
    finally:
        f.close()
    return problems


def worker_main(sock: socket.socket) -> None:
    """A verification worker (:func:`tracestore.worker.start`): verify each unit its parent sends,
    answer with the problems, exit when the parent closes the socket (or dies)."""
    while True:
        try:
            unit = worker.recv(sock)
        except EOFError:
            return
        try:
            result = _verify_unit(unit)
        except Exception as exc:  # noqa: BLE001 - reported as the unit's problem
            result = [f"shard {unit.where}: verification failed ({type(exc).__name__}: {exc})"]
        worker.send(sock, result)


class VerifyWorkers:
    """``n`` worker processes, each fed units by one thread of this process (which waits on its
    socket without the GIL). A worker that cannot start or dies reports its unit as a problem; the
    next unit starts a new one."""

    def __init__(self, n: int) -> None:
        self.queue: queue.SimpleQueue[tuple[concurrent.futures.Future[list[str]], _Unit] | None]
        self.queue = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._serve, name=f"tracestore-validate-{i}", daemon=True) for i in range(n)
        ]
        for t in self.threads:
            t.start()  # each starts its worker now, while the caller goes on loading manifests

    def submit(self, unit: _Unit) -> concurrent.futures.Future[list[str]]:
        fut: concurrent.futures.Future[list[str]] = concurrent.futures.Future()
        self.queue.put((fut, unit))
        return fut

    def help(self) -> None:
        """Verify queued units in this thread until none is left (the caller has nothing else to
        do meanwhile: one process more for the same cores)."""
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if item is None:  # closing: leave it to the workers
                self.queue.put(None)
                return
            fut, unit = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(_verify_unit(unit))
                except Exception as exc:  # noqa: BLE001 - reported as the unit's problem
                    fut.set_result([f"shard {unit.where}: verification failed ({type(exc).__name__}: {exc})"])

    def close(self) -> None:
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads:
            t.join()

    @staticmethod
    def _start() -> tuple[subprocess.Popen[bytes], socket.socket] | str:
        try:
            return worker.start("tracestore.cli.verify", "worker_main")
        except OSError as exc:
            return f"could not start a validation worker ({sys.executable}): {exc}"

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        worker.stop(proc, sock)

    def _serve(self) -> None:
        child = self._start()
        try:
            while True:
                item = self.queue.get()
                if item is None:
                    return
                fut, unit = item
                if not fut.set_running_or_notify_cancel():
                    continue
                if isinstance(child, str):
                    fut.set_result([f"shard {unit.where}: not verified: {child}"])
                    child = self._start()
                    continue
                try:
                    worker.send(child[1], unit)
                    fut.set_result(worker.recv(child[1]))
                except (OSError, EOFError, pickle.UnpicklingError) as exc:
                    self._stop(*child)
                    code = child[0].returncode
                    fut.set_result([f"shard {unit.where}: not verified: its worker exited (code {code}) ({exc})"])
                    child = self._start()
        finally:
            if not isinstance(child, str):
                self._stop(*child)


class Verifier:
    """Verifies the shards of one version as their manifests load: in this process, or in
    ``workers`` (when given) for a version of at least ``parallel_min_bytes`` on storage."""

    def __init__(
        self,
        store: Any,
        run: str,
        version: int,
        workers: Callable[[], VerifyWorkers] | None = None,
        parallel_min_bytes: int = PARALLEL_MIN_BYTES,
    ) -> None:
        self.store = store
        self.sites = {s.name: (s.code_bytes, s.scale_bytes, s.rows_per_token) for s in store.get_run(run).sites}
        self.local = bool(store.storage.local)
        self.workers: VerifyWorkers | None = None
        # (memory:// lives in this process only)
        if (
            workers is not None
            and not store.url.startswith("memory:")
            and store.storage.du(f"{run}/v{version}") >= parallel_min_bytes
        ):
            self.workers = workers()
        self.results: list[list[str] | concurrent.futures.Future[list[str]]] = []

    def _units(self, m: Any) -> list[_Unit]:
        st = self.store.storage
        where = f"{self.store.url}/{m.shard}"
        local = st.full(m.shard) if self.local else None
        n = len(m.row_groups)
        parts = 1
        if local is not None and self.workers is not None:
            parts = max(1, min(len(self.workers.threads) + 1, n, m.shard_bytes // SPLIT_BYTES))
        cuts = [round(i * n / parts) for i in range(parts + 1)]
        units = []
        for a, b in zip(cuts, cuts[1:], strict=False):
            units.append(
                _Unit(self.store.url, st.storage_options, st.timeout, local, m.groups(a, b), where, a == 0, self.sites)
            )
        return units

    def submit(self, m: Any) -> None:
        if m.shard is None:
            return
        for u in self._units(m):
            self.results.append(_verify_unit(u) if self.workers is None else self.workers.submit(u))

    def problems(self) -> list[str]:
        out = []
        if self.workers is not None:
            self.workers.help()
        for r in self.results:
            out += r if isinstance(r, list) else r.result()
        return out


def job_count(jobs: int | None) -> int:
    """``jobs`` when given, else the CPUs this process may run on."""
    if jobs:
        return jobs
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1
