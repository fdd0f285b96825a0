"""``tracestore inspect URL``: summarize stored records, and ``--validate`` them (exit 1 on any problem).

The summary lists runs, policy versions, writers, shards, bytes, sites, tokens and seals. With
``--validate`` every manifest's checksum is verified and every shard is read in full: its
whole-file crc32 against the manifest, every page checksum, every key column and every chunk's
byte lengths and checksum; every sealed trajectory must have a record for every token of every
sealed site (except its final position, unrecorded by design), following its prefix links, each
checked against its source. Any corrupt or missing record is printed and the exit status is 1.
``--json`` prints one JSON object (runs, versions, sizes, sites, tokens, problems) instead.

Exit status: 0 records found (and, with ``--validate``, all valid); 1 ``--validate`` found a
problem, or storage failed; 2 a usage or configuration error; 3 nothing there: the location does
not exist or holds no runs, or the ``--run``/``--policy-version`` asked for is not stored.

Validation works on whole columns (:class:`tracestore.storage.manifest.ManifestColumns`,
:func:`tracestore.storage.shard_read.verify_shard`), never one Python object per chunk: a decode shard holds
~300,000 chunks. Shards are verified ``--jobs`` at a time (default: one per core): by this
process and ``jobs - 1`` worker processes, once a version holds :data:`PARALLEL_MIN_BYTES` of
shards (a worker costs ~0.35 s of CPU to start: the time this process takes to verify ~200 MB);
this process reads the manifests and checks completeness first, then verifies what the workers
have not taken. A large local shard is split between them by row groups. A worker is started as
``python -c`` with a small bootstrap and gets its work as pickles over a socketpair.
Completeness comes from the manifests alone (the chunks were just verified); only trajectories
whose chunks overlap within a version are read once more, to compare the overlapping bytes.

Example::

    tracestore inspect file://./tracestore-data --run run-1 --policy-version 3 --trajectory t-17 --validate
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures
import contextlib
import dataclasses
import io
import json
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from tracestore.cli import JSON_OBJECT, SWITCH, Setting, add_settings, integer, number, optional, text
from tracestore.errors import CorruptionError, TraceStoreError, ValidationError

PARALLEL_MIN_BYTES = 1 << 30
"""Shards of a version are verified in worker processes too once they add up to this many bytes.
Below it a worker's start costs about what it saves: on the 2-core box 490 MB of decode shards
validated in 0.89 s in one process and in 0.96-1.38 s with one worker beside it."""
SPLIT_BYTES = 32 << 20  # a local shard is cut into units of at least this size, one per worker at most


NOTHING = 3
"""Exit status when nothing is there (no location, no runs, or not the run/version asked for)."""

SETTINGS = (
    Setting("--run", optional(text("a run id")), None, "only this run", metavar="RUN"),
    Setting("--policy-version", optional(integer(0)), None, "only this policy version", metavar="N",
            deprecated=("--version",)),
    Setting("--trajectory", optional(text("a trajectory id")), None, "show one trajectory's coverage", metavar="ID"),
    Setting("--validate", SWITCH, False, "verify all checksums and seals; exit 1 on any problem", switch=True),
    Setting("--json", SWITCH, False, "print one JSON object instead of the summary", switch=True),
    Setting("--jobs", integer(0), 0,
            "shards verified at once, by this process and jobs-1 worker processes (0: one per core)"),
    Setting("--storage-options", JSON_OBJECT, None,
            'JSON object passed to fsspec untouched, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
            secret=True, show="none", metavar="JSON"),
    Setting("--timeout", number(gt=0), 60.0, "seconds per storage call", metavar="SECONDS"),
)  # fmt: skip


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="summarize stored records; --validate checks every checksum and sealed trajectory",
        description="Summarize a tracestore storage URL (sizes, sites, tokens, completeness). "
        "With --validate, read every shard and exit 1 on any corrupt or missing record. Exit status: 0 records "
        "found (and valid), 1 problems found or storage failed, 2 usage or configuration error, 3 nothing there "
        "(no such location, no runs, or not the --run/--policy-version asked for). Settings: flag, else "
        "TRACESTORE_<FLAG>, else the [inspect] table of a --config file.",
    )
    p.add_argument("url", help="storage URL, e.g. file://./tracestore-data or s3://bucket/prefix")
    add_settings(p, "inspect", SETTINGS)
    p.set_defaults(func=run)


def _ranges(tokens: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(tokens):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _fmt_ranges(r: list[tuple[int, int]]) -> str:
    s = ", ".join(f"[{a}, {b})" for a, b in r[:6])
    return s + (f", ... ({len(r)} ranges)" if len(r) > 6 else "")


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


# ---------------------------------------------------------------------------- one version's manifests


@dataclasses.dataclass
class _Coverage:
    """What the chunks of one version cover, per (trajectory, site): merged token intervals."""

    intervals: dict[tuple[str, str], tuple[list[int], list[int]]]  # sorted, disjoint starts / ends
    overlapping: set[tuple[str, str]]  # chunks overlap without being the same chunk twice
    ends: dict[str, int]  # largest token end of any site, per trajectory


class _Version:
    """The manifests of one (run, version) as columns; ``corrupt``: (path, message) of those that
    do not load. ``on_manifest(m)`` is called for each manifest as soon as it is loaded."""

    def __init__(self, store: Any, run: str, version: int, on_manifest: Callable[[Any], None] | None = None) -> None:
        from tracestore.storage.manifest import ManifestColumns, shard_name

        self.run, self.version = run, version
        self.manifests: list[ManifestColumns] = []
        self.corrupt: list[tuple[str, str]] = []
        for path in store.manifest_paths(run, version):
            try:
                m = ManifestColumns.from_json(store.storage.cat(path), where=f"{store.url}/{path}")
                writer = path.split("/")[-2]
                if (m.run, m.policy_version, m.writer, f"{shard_name(m.seq)}.manifest.json") != (
                    run,
                    version,
                    writer,
                    path.rsplit("/", 1)[-1],
                ):
                    raise CorruptionError(
                        f"manifest {path} describes run {m.run} v{m.policy_version} {m.writer}/{m.seq}"
                    )
            except TraceStoreError as exc:
                self.corrupt.append((path, str(exc)))
                continue
            self.manifests.append(m)
            if on_manifest is not None:
                on_manifest(m)
        self._coverage: _Coverage | None = None

    @property
    def seals(self) -> dict[str, Any]:
        """The largest seal of each trajectory."""
        out: dict[str, Any] = {}
        for m in self.manifests:
            for s in m.seals:
                if s.trajectory not in out or s.n_tokens > out[s.trajectory].n_tokens:
                    out[s.trajectory] = s
        return out

    def coverage(self) -> _Coverage:
        if self._coverage is None:
            self._coverage = self._cover()
        return self._coverage

    def _cover(self) -> _Coverage:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        ms = [m for m in self.manifests if len(m)]
        if not ms:
            return _Coverage({}, set(), {})
        traj = pc.dictionary_encode(pa.chunked_array([m.trajectory for m in ms]).combine_chunks())
        site = pc.dictionary_encode(pa.chunked_array([m.site for m in ms]).combine_chunks())
        t = traj.indices.to_numpy().astype(np.int64)
        s = site.indices.to_numpy().astype(np.int64)
        start = np.concatenate([m.token_start for m in ms])
        end = start + np.concatenate([m.n_tokens for m in ms])
        crc = np.concatenate([m.checksum for m in ms])
        tnames, snames = traj.dictionary.to_pylist(), site.dictionary.to_pylist()
        pair = t * len(snames) + s
        if len(pair) and int(pair.max()) < 1 << 31 and int(start.max()) < 1 << 32:
            order = np.argsort((pair << 32) | start, kind="stable")  # one int64 key: ~5x faster than lexsort
        else:  # pragma: no cover - billions of pairs or tokens
            order = np.lexsort((start, pair))
        t, s, start, end, crc, pair = t[order], s[order], start[order], end[order], crc[order], pair[order]
        first = np.ones(len(pair), bool)
        first[1:] = pair[1:] != pair[:-1]
        group = np.cumsum(first) - 1
        big = np.int64(1) << 40  # token indices are far below it
        reach = np.maximum.accumulate(group * big + end) - group * big  # running max end within each pair
        prev = np.empty_like(reach)
        prev[0] = 0
        prev[1:] = reach[:-1]
        new = first | (start > prev)  # an interval starts here (after a gap or at the pair's start)
        overlap = ~first & (start < prev)
        # a chunk that repeats the one before it (same tokens, same checksum) is the same chunk
        # again; any other overlap, even with a repeat between, is compared byte for byte
        same = np.zeros(len(pair), bool)
        same[1:] = (start[1:] == start[:-1]) & (end[1:] == end[:-1]) & (crc[1:] == crc[:-1]) & ~first[1:]
        overlapping = {(tnames[t[i]], snames[s[i]]) for i in np.flatnonzero(overlap & ~same).tolist()}
        heads = np.flatnonzero(new)
        lasts = np.append(heads[1:] - 1, len(pair) - 1)
        intervals: dict[tuple[str, str], tuple[list[int], list[int]]] = {}
        for i, a, b in zip(heads.tolist(), start[heads].tolist(), reach[lasts].tolist(), strict=True):
            key = (tnames[t[i]], snames[s[i]])
            starts, ends = intervals.setdefault(key, ([], []))
            starts.append(a)
            ends.append(b)
        t_first = np.flatnonzero(np.r_[True, t[1:] != t[:-1]])  # (sorted by trajectory first)
        max_end = np.maximum.reduceat(end, t_first)
        ends_of = {tnames[i]: e for i, e in zip(t[t_first].tolist(), max_end.tolist(), strict=True)}
        return _Coverage(intervals, overlapping, ends_of)

    def links(self) -> Any:
        """A :class:`~tracestore.storage.reader.LinkIndex` of this version (links, seals, chunk extents)."""
        from tracestore.storage.reader import LinkIndex

        index = LinkIndex(self.run)
        for t, end in self.coverage().ends.items():
            index.holds(t, self.version, end)
        for m in self.manifests:
            for seal in m.seals:
                index.add_seal(seal)
            for link in m.links:
                index.add_link(link, m.where)
        return index


def _missing(cov: _Coverage, owner: str, site: str, lo: int, hi: int) -> list[tuple[int, int]]:
    """The token ranges of [lo, hi) that no chunk of ``owner``'s ``site`` covers."""
    starts, ends = cov.intervals.get((owner, site), ([], []))
    out = []
    at = lo
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while at < hi and i < len(starts):
        if ends[i] <= at:
            i += 1
            continue
        if starts[i] > at:
            out.append((at, min(starts[i], hi)))
        at = max(at, ends[i])
        i += 1
    if at < hi:
        out.append((at, hi))
    return out


# ---------------------------------------------------------------------------- shard verification


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

    from tracestore.records import crc32
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


_LEN_BYTES = 8
# A worker is ``python -c`` with this bootstrap, not a multiprocessing child: multiprocessing's
# spawn runs the caller's ``__main__`` again (a script without a main guard would re-run itself).
_BOOT = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[2]); "
    "from tracestore.cli.inspect import _worker_main; _worker_main(int(sys.argv[1]))"
)


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(len(data).to_bytes(_LEN_BYTES, "little") + data)


def _recv(sock: socket.socket) -> Any:
    head = _recv_exact(sock, _LEN_BYTES)
    return pickle.loads(_recv_exact(sock, int.from_bytes(head, "little")))


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        got = sock.recv_into(view)
        if not got:
            raise EOFError("the other end closed")
        view = view[got:]
    return buf


def _worker_main(fd: int) -> None:
    """A verification worker: verify each unit its parent sends, answer with the problems, exit
    when the parent closes the socket (or dies)."""
    sock = socket.socket(fileno=fd)
    while True:
        try:
            unit = _recv(sock)
        except EOFError:
            return
        try:
            result = _verify_unit(unit)
        except Exception as exc:  # noqa: BLE001 - reported as the unit's problem
            result = [f"shard {unit.where}: verification failed ({type(exc).__name__}: {exc})"]
        _send(sock, result)


class _Workers:
    """``n`` worker processes, each fed units by one thread of this process (which waits on its
    socket without the GIL). A worker that cannot start or dies reports its unit as a problem; the
    next unit starts a new one."""

    def __init__(self, n: int) -> None:
        self.queue: queue.SimpleQueue[tuple[concurrent.futures.Future[list[str]], _Unit] | None]
        self.queue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._serve, name=f"tracestore-validate-{i}", daemon=True)
                        for i in range(n)]  # fmt: skip
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
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(child.fileno()), json.dumps(sys.path)],
                pass_fds=[child.fileno()],
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            parent.close()
            return f"could not start a validation worker ({sys.executable}): {exc}"
        finally:
            child.close()
        return proc, parent

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _serve(self) -> None:
        worker = self._start()
        try:
            while True:
                item = self.queue.get()
                if item is None:
                    return
                fut, unit = item
                if not fut.set_running_or_notify_cancel():
                    continue
                if isinstance(worker, str):
                    fut.set_result([f"shard {unit.where}: not verified: {worker}"])
                    worker = self._start()
                    continue
                try:
                    _send(worker[1], unit)
                    fut.set_result(_recv(worker[1]))
                except (OSError, EOFError, pickle.UnpicklingError) as exc:
                    self._stop(*worker)
                    code = worker[0].returncode
                    fut.set_result([f"shard {unit.where}: not verified: its worker exited (code {code}) ({exc})"])
                    worker = self._start()
        finally:
            if not isinstance(worker, str):
                self._stop(*worker)


class _Verifier:
    """Verifies the shards of one version as their manifests load: in this process, or in
    ``workers`` (when given) for a version of at least ``parallel_min_bytes`` on storage."""

    def __init__(
        self,
        store: Any,
        run: str,
        version: int,
        workers: Callable[[], _Workers] | None = None,
        parallel_min_bytes: int = PARALLEL_MIN_BYTES,
    ) -> None:
        self.store = store
        self.sites = {s.name: (s.code_bytes, s.scale_bytes, s.rows_per_token) for s in store.get_run(run).sites}
        self.local = bool(store.storage.local)
        self.workers: _Workers | None = None
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
            units.append(_Unit(self.store.url, st.storage_options, st.timeout, local, m.groups(a, b), where, a == 0,
                               self.sites))  # fmt: skip
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


def _jobs(jobs: int | None) -> int:
    if jobs:
        return jobs
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def validate_version(
    store: object,
    run: str,
    version: int,
    out: TextIO,
    *,
    jobs: int | None = None,
    parallel_min_bytes: int = PARALLEL_MIN_BYTES,
    loaded: _Version | None = None,
    verifier: _Verifier | None = None,
) -> int:
    """Verify every manifest, shard and sealed trajectory of one version; print problems, return
    their count. ``jobs``: shards verified at once, by this process and ``jobs - 1`` worker
    processes when the version holds ``parallel_min_bytes`` or more (default: one per core);
    ``loaded``/``verifier``: the version already loaded with its shards submitted as they loaded
    (what :func:`run` does)."""
    from tracestore.storage.store import Store

    if not isinstance(store, Store):
        raise TypeError("validate_version needs a Store")
    own: list[_Workers] = []
    n = _jobs(jobs)

    def workers() -> _Workers:
        own.append(_Workers(n - 1))
        return own[0]

    try:
        if verifier is None:
            verifier = _Verifier(store, run, version, workers if n > 1 else None, parallel_min_bytes)
        if loaded is None:
            loaded = _Version(store, run, version, verifier.submit)
        problems = 0
        for path, msg in loaded.corrupt:
            print(f"CORRUPT {path}: {msg}", file=out)
            problems += 1
        try:
            problems += _check_sealed(store, loaded, out)
        finally:
            for p in verifier.problems():
                print(f"CORRUPT {p}", file=out)
                problems += 1
    finally:
        for w in own:
            w.close()
    return problems


def _check_sealed(store: Any, v: _Version, out: TextIO) -> int:
    """Every sealed trajectory has a record for every token of every sealed site (its final
    position excepted), through its prefix links; from the manifests, reading only where chunks
    of one version overlap (their bytes must agree)."""
    from tracestore.plan import MicrobatchPlan
    from tracestore.storage.reader import StoreReader

    seals = v.seals
    if not seals:
        return 0
    cov = v.coverage()
    links = v.links()
    problems = 0
    reader: StoreReader | None = None
    for traj, seal in sorted(seals.items()):
        try:
            pieces = links.resolve(traj, 0, seal.n_tokens, {v.version}, "error")
        except TraceStoreError as exc:
            print(f"MISSING sealed trajectory {traj}: {exc}", file=out)
            problems += 1
            continue
        missing = []
        overlaps = False
        for site in seal.sites:
            bad: list[tuple[int, int]] = []
            for owner, lo, hi in pieces:
                assert owner is not None  # on_missing="error" raises instead
                overlaps = overlaps or (owner, site) in cov.overlapping
                bad += _missing(cov, owner, site, lo, hi)
            bad = [(a, min(b, seal.n_tokens - 1)) for a, b in _ranges(bad) if a < seal.n_tokens - 1]
            if bad:
                spans = ", ".join(f"[{a}, {b})" for a, b in bad[:8])
                missing.append(f"trajectory {traj} site {site} tokens {spans}")
        if missing:
            more = f" (and {len(missing) - 20} more)" if len(missing) > 20 else ""
            msg = f"run {v.run} versions [{v.version}]: no record for " + "; ".join(missing[:20]) + more
            print(f"MISSING sealed trajectory {traj}: {msg}", file=out)
            problems += 1
            continue
        if overlaps:  # chunks of one version overlap: a read compares their bytes
            try:
                if reader is None:
                    reader = StoreReader(store, v.run)
                    reader.refresh([v.version])
                reader.read(
                    MicrobatchPlan([(traj, 0, seal.n_tokens)]),
                    versions=[v.version],
                    sites=seal.sites,
                    on_missing="error",
                    refresh=False,
                )
            except TraceStoreError as exc:
                print(f"MISSING sealed trajectory {traj}: {exc}", file=out)
                problems += 1
    if reader is not None:
        reader.close()
    return problems


# ---------------------------------------------------------------------------- the command


class _Nothing(Exception):
    """Nothing there: exit status :data:`NOTHING`."""


def run(ns: argparse.Namespace) -> int:
    from tracestore.cli import resolve
    from tracestore.storage.store import Store

    resolve(ns)
    report: dict[str, Any] = {"url": ns.url, "runs": [], "ok": True}
    out: TextIO = io.StringIO() if ns.json else sys.stdout
    started: list[_Workers] = []
    rc = 0
    try:
        store = Store(ns.url, ns.storage_options, timeout=ns.timeout)
        jobs = _jobs(ns.jobs)

        def workers() -> _Workers:  # started once, for the first version large enough; then shared
            if not started:
                started.append(_Workers(jobs - 1))
            return started[0]

        stored_runs = store.list_runs()
        if not stored_runs:
            there = store.storage.exists("")
            raise _Nothing("holds no tracestore runs" if there else "nothing there (no such location)")
        if ns.run is not None and ns.run not in stored_runs:
            _check_run_id(ns.run)
            raise _Nothing(f"no run {ns.run!r} (runs: {', '.join(stored_runs[:20])})")
        problems = 0
        for run_id in [ns.run] if ns.run is not None else stored_runs:
            spec = store.get_run(run_id)
            stored = store.list_versions(run_id)
            if ns.policy_version is not None and ns.policy_version not in stored:
                raise _Nothing(f"run {run_id} has no policy version {ns.policy_version} (versions: {stored})")
            versions = [ns.policy_version] if ns.policy_version is not None else stored
            entry: dict[str, Any] = {"run": run_id, "sites": [], "versions": []}
            report["runs"].append(entry)
            print(f"run {run_id}: {len(spec.sites)} sites, versions {versions}", file=out)
            for s in spec.sites:
                entry["sites"].append({"name": s.name, "kind": s.kind, "layer": s.layer, "width": s.width,
                                       "format": s.format, "bits": s.bits, "rows_per_token": s.rows_per_token,
                                       "row_bytes": s.code_bytes + s.scale_bytes})  # fmt: skip
                print(
                    f"  site {s.name}: {s.kind} layer {s.layer} width {s.width} {s.format} b={s.bits} "
                    f"rows/token {s.rows_per_token} ({s.code_bytes + s.scale_bytes} B/row)",
                    file=out,
                )
            for v in versions:
                verifier = _Verifier(store, run_id, v, workers if jobs > 1 else None) if ns.validate else None
                loaded = _Version(store, run_id, v, None if verifier is None else verifier.submit)
                summary: dict[str, Any] = {}
                try:
                    summary = _version_summary(loaded, ns.trajectory)
                    entry["versions"].append(summary)
                    _print_version(summary, out)
                finally:
                    if verifier is not None:
                        lines = io.StringIO()
                        n = validate_version(store, run_id, v, lines, loaded=loaded, verifier=verifier)
                        out.write(lines.getvalue())
                        summary["validation"] = {"ok": n == 0, "problems": lines.getvalue().splitlines()}
                        print(f"  v{v}: validation {'OK' if n == 0 else f'FAILED ({n} problems)'}", file=out)
                        problems += n
        if ns.validate and problems:
            report["ok"], rc = False, 1
    except _Nothing as exc:
        report.update(ok=False, nothing=str(exc))
        print(f"tracestore inspect: {ns.url}: {exc}", file=sys.stderr)
        rc = NOTHING
    except ValidationError as exc:
        report.update(ok=False, error=str(exc))
        print(f"tracestore inspect: {exc}", file=sys.stderr)
        rc = 2
    except TraceStoreError as exc:
        report.update(ok=False, error=str(exc))
        print(f"tracestore inspect: {exc}", file=sys.stderr)
        rc = 1
    finally:
        for w in started:
            w.close()
    if ns.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    return rc


def _check_run_id(run: str) -> None:
    """A --run that is no valid run id is a usage error (exit 2), not 'nothing there'."""
    from tracestore.records import validate_id

    validate_id("run", run)


def _version_summary(v: _Version, trajectory: str | None) -> dict[str, Any]:
    """What ``inspect`` reports of one version, as plain JSON values."""
    ms = v.manifests
    shard_bytes = sum(m.shard_bytes for m in ms)
    cov = v.coverage()
    seals = v.seals
    links = {x.trajectory: x for m in ms for x in m.links}
    trajs = set(cov.ends) | set(seals) | set(links)
    site_tokens: dict[str, int] = defaultdict(int)
    per_traj: dict[str, list[list[int]]] = {}
    for (t, site), (starts, ends) in cov.intervals.items():
        site_tokens[site] += sum(b - a for a, b in zip(starts, ends, strict=True))
        if t == trajectory:
            per_traj[site] = [[a, b] for a, b in zip(starts, ends, strict=True)]
    out: dict[str, Any] = {
        "version": v.version,
        "writers": len({m.writer for m in ms}),
        "shards": len(ms),
        "shard_bytes": shard_bytes,
        "payload_bytes": sum(int(m.nbytes.sum()) for m in ms),
        "chunks": sum(len(m) for m in ms),
        "trajectories": len(trajs),
        "sealed": len(seals),
        "open": len(trajs) - len(seals),
        "prefix_links": len(links),
        "site_tokens": dict(sorted(site_tokens.items())),
        "bytes_per_token": shard_bytes / max(1, max(site_tokens.values())) if site_tokens else None,
        "corrupt_manifests": [{"path": path, "error": msg} for path, msg in v.corrupt],
    }
    if trajectory is not None:
        seal, link = seals.get(trajectory), links.get(trajectory)
        out["trajectory"] = {
            "id": trajectory,
            "present": trajectory in trajs,
            "sealed_tokens": seal.n_tokens if seal else None,
            "sealed_sites": list(seal.sites) if seal else None,
            "link": {"tokens": link.n_tokens, "source": link.source} if link else None,
            "coverage": dict(sorted(per_traj.items())),
        }
    return out


def _print_version(d: dict[str, Any], out: TextIO) -> None:
    all_tokens = sum(d["site_tokens"].values())
    per_token = f", {d['bytes_per_token']:.0f} B/token" if d["bytes_per_token"] is not None else ""
    corrupt = f", {len(d['corrupt_manifests'])} manifests that do not load" if d["corrupt_manifests"] else ""
    print(
        f"  v{d['version']}: {d['writers']} writers, {d['shards']} shards, {_bytes(d['shard_bytes'])} on storage "
        f"({_bytes(d['payload_bytes'])} payload), {d['chunks']} chunks, {d['trajectories']} trajectories "
        f"({d['sealed']} sealed, {d['open']} open), {d['prefix_links']} prefix links, "
        f"{all_tokens} site-tokens{per_token}{corrupt}",
        file=out,
    )
    for site, n in d["site_tokens"].items():
        print(f"    {site}: {n} tokens", file=out)
    t = d.get("trajectory")
    if t is not None:
        link = t["link"]
        print(
            f"  trajectory {t['id']} (v{d['version']}): "
            + (f"sealed at {t['sealed_tokens']} tokens, sites {t['sealed_sites']}" if t["sealed_tokens"] is not None
               else "not sealed")
            + (f"; tokens [0, {link['tokens']}) linked to {link['source']}" if link else ""),
            file=out,
        )  # fmt: skip
        for site, rs in t["coverage"].items():
            print(f"    {site}: {_fmt_ranges([(a, b) for a, b in rs])}", file=out)
        if not t["present"]:
            print(f"    no records, seal or link for {t['id']} in v{d['version']}", file=out)
