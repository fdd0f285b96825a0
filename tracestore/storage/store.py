"""Store: durable Parquet shards of record chunks on any fsspec URL.

Layout under the root URL::

    {run}/run.json                                          the RunSpec (create-only)
    {run}/v{policy_version}/{writer}/part-{seq:08d}.parquet  one shard, published with one call
    {run}/v{policy_version}/{writer}/part-{seq:08d}.manifest.json   written after it: makes it visible

Writers own their key space (writer id + sequence number), so nothing needs a coordinator;
a reader's view of a version is the union of the manifests present. Keys are deterministic and
writes create-only: repeating a ``write_shard`` call (a retry after a lost ack) is a no-op, the
same key with different bytes is a :class:`ConflictError`.

Example::

    store = Store("file://./tracestore-data")
    store.put_run(RunSpec("run-1", (SiteSpec("layers.23.mlp.input", "moe_input", 23, 2048),)))
    info = store.write_shard("run-1", 0, "sidecar-0", 0, chunks, seals=[TrajectorySeal(...)])
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

from tracestore import faults as _faults
from tracestore.errors import ConfigError, ConflictError, CorruptionError, NotFoundError, ValidationError
from tracestore.records import PrefixLink, RecordChunk, RunSpec, TrajectorySeal, validate_id
from tracestore.storage.fs import EventHook, Storage, env_number
from tracestore.storage.manifest import Manifest, shard_name
from tracestore.storage.shard_write import (
    MIN_ROW_GROUP_BYTES,
    ROW_GROUP_BYTES,
    ShardPart,
    check_shard_inputs,
    encode_shard,
    split_shard,
)

log = logging.getLogger("tracestore.storage")

_VERSION_DIR = re.compile(r"v(\d+)")
_MANIFEST_FILE = re.compile(r"part-(\d+)\.manifest\.json")
# the temp files our local publish writes next to its target (tracestore.storage.fs): ".<name>.tmp-<uuid4 hex>"
_RUN_TEMP = re.compile(r"\.run\.json\.tmp-[0-9a-f]{32}")
_SHARD_TEMP = re.compile(r"\.part-\d{8,}\.(?:parquet|manifest\.json)\.tmp-[0-9a-f]{32}")
_NO_TEMP = re.compile(r"(?!)")  # version directories hold none
STALE_TEMP_AGE_S = 600.0
"""Default grace of :meth:`Store.remove_stale_temp_files`, at least 10x the storage timeout."""

PART_SEQ_STRIDE = 10**18
"""The second file of a split shard ``seq`` is shard ``seq + PART_SEQ_STRIDE`` of the same writer
(``part-1000000000000000007`` beside ``part-00000007``); :meth:`Store.write_shard` refuses shard
numbers from here up, so the two ranges never meet (a sidecar's numbers, microseconds since 1970,
reach 10**18 in the year 33658)."""
SHARD_FILES_ENV = "TRACESTORE_SHARD_FILES"
SPLIT_MIB_ENV = "TRACESTORE_SHARD_SPLIT_MIB"
SPLIT_MIN_BYTES = 64 << 20
"""Default payload from which a write is split into two files written side by side. Measured on a
2-core box (bench/bench_storage.py, case ``split``; one-file time / two-file time, median of 6
runs): 15 MiB 0.83 local, 0.94 memory:// (a loss); 30 MiB 1.03 / 1.18; 60 MiB 1.05 / 1.08; 120 MiB
1.19 / 1.08. Below this a shard stays one file: fewer files for readers, and no measured gain to lose."""
SPLIT_MIN_CHUNK_BYTES = 32 << 10
"""Only shards whose chunks hold this many bytes on average are split: the per-chunk work (checks,
sort, index, manifest) holds the GIL, so a shard of small chunks gains nothing from a second
encoder and loses the cost of cutting it in two (case ``split``, 60 MiB: 24 KiB chunks 1.00 local,
1.05 memory://; 48 KiB chunks 1.02 / 1.29; a decode shard of one-token chunks, 0.4 KiB: 0.82 / 0.94)."""


def default_shard_files() -> int:
    """``TRACESTORE_SHARD_FILES`` (1 or 2) when set, else 2 on a machine with 2 or more cores, else 1."""
    raw = os.environ.get(SHARD_FILES_ENV, "").strip()
    if not raw:
        return 2 if (os.cpu_count() or 1) >= 2 else 1
    if raw not in ("1", "2"):
        raise ConfigError(f"{SHARD_FILES_ENV}={raw!r}: expected 1 or 2 (the most files one shard is written as)")
    return int(raw)


def default_split_min_bytes() -> int:
    """``TRACESTORE_SHARD_SPLIT_MIB`` (MiB, >= 0) when set, else :data:`SPLIT_MIN_BYTES` (64 MiB)."""
    mib = env_number(SPLIT_MIB_ENV, SPLIT_MIN_BYTES / (1 << 20), lambda v: v >= 0, "a number of MiB >= 0")
    return int(mib * (1 << 20))


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """The result of :meth:`Store.write_shard`.

    A write split into two files (:meth:`Store.write_shard`) is described as a whole (``path`` and
    ``manifest_path`` of its first file, counts and bytes of both) and file by file in ``parts``.
    """

    run: str
    policy_version: int
    writer: str
    seq: int
    path: str | None  # root-relative Parquet path (of the first file); None for a seal/link-only write
    manifest_path: str
    n_chunks: int
    nbytes: int  # bytes of the Parquet file(s)
    payload_bytes: int  # codes + scales + token scales of the chunks
    written: bool  # False when an identical shard was already there (a repeated call)
    parts: tuple[ShardInfo, ...] = ()  # the files of a split write, first first; () for one file


def _version(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValidationError(f"policy_version must be an integer >= 0, got {v!r}")
    return v


class Store:
    """Record storage on an fsspec URL (``file://`` default, ``memory://``, ``s3://``...).

    ``storage_options`` are passed to fsspec untouched; ``timeout`` bounds every storage call
    (seconds); transient errors are retried ``retries`` times with jittered exponential backoff,
    none starting after ``retry_deadline`` seconds (default: ``TRACESTORE_STORAGE_RETRY_DEADLINE``
    or 30 s); ``on_event(kind, op,
    detail)`` is called on each retry / timeout / error (for metrics). ``stats`` counts them.

    ``shard_files`` (1 or 2), ``split_min_bytes``, ``split_min_chunk_bytes``: a
    :meth:`write_shard` of at least ``split_min_bytes`` of record payload, in chunks of at least
    ``split_min_chunk_bytes`` on average, is written as two shard files encoded side by side when
    ``shard_files`` is 2 (defaults: :func:`default_shard_files`, :func:`default_split_min_bytes`,
    :data:`SPLIT_MIN_CHUNK_BYTES`).
    """

    def __init__(
        self,
        url: str = "file://./tracestore-data",
        storage_options: dict[str, Any] | None = None,
        *,
        timeout: float = 60.0,
        retries: int = 3,
        on_event: EventHook | None = None,
        row_group_bytes: int = ROW_GROUP_BYTES,
        min_row_group_bytes: int = MIN_ROW_GROUP_BYTES,
        retry_deadline: float | None = None,
        shard_files: int | None = None,
        split_min_bytes: int | None = None,
        split_min_chunk_bytes: int = SPLIT_MIN_CHUNK_BYTES,
    ) -> None:
        self.storage = Storage(
            url, storage_options, timeout=timeout, retries=retries, on_event=on_event, retry_deadline=retry_deadline
        )
        self.url = url
        self.row_group_bytes = int(row_group_bytes)
        self.min_row_group_bytes = int(min_row_group_bytes)
        self.shard_files = default_shard_files() if shard_files is None else int(shard_files)
        if self.shard_files not in (1, 2):
            raise ValidationError(f"shard_files must be 1 or 2, got {shard_files!r}")
        self.split_min_bytes = default_split_min_bytes() if split_min_bytes is None else int(split_min_bytes)
        if self.split_min_bytes < 0:
            raise ValidationError(f"split_min_bytes must be >= 0, got {split_min_bytes!r}")
        self.split_min_chunk_bytes = int(split_min_chunk_bytes)
        self._runs: dict[str, RunSpec] = {}
        self._manifests: dict[str, Manifest] = {}  # manifests are immutable once published
        # Parquet footers of shards, shared by every reader of this store: keyed by the manifest's
        # (path, size, crc32) of the shard, so a file replaced under the same path is not matched
        self._footers: dict[tuple[str, int, int], Any] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    @property
    def stats(self) -> dict[str, int]:
        return self.storage.stats

    # ------------------------------------------------------------------ runs

    def put_run(self, spec: RunSpec) -> bool:
        """Declare a run (create-only). Repeating the same spec is a no-op; a different one conflicts."""
        if not isinstance(spec, RunSpec):
            raise ValidationError(f"put_run expects a RunSpec, got {type(spec).__name__}")
        data = spec.to_json().encode()
        try:
            written = self.storage.publish(f"{spec.run}/run.json", data)
        except ConflictError:
            existing = self.get_run(spec.run)
            raise ConflictError(
                f"run {spec.run} is already declared with other sites: {existing.to_json()}; "
                "use a new run id to change sites"
            ) from None
        with self._lock:
            self._runs[spec.run] = spec
        return written

    def get_run(self, run: str) -> RunSpec:
        validate_id("run", run)
        with self._lock:
            if run in self._runs:
                return self._runs[run]
        try:
            data = self.storage.cat(f"{run}/run.json")
        except NotFoundError:
            raise NotFoundError(
                f"run {run!r} is not declared in {self.url}; call put_run(RunSpec(...)) first"
            ) from None
        spec = RunSpec.from_json(data)
        with self._lock:
            self._runs[run] = spec
        return spec

    def _ensure_run_json(self, spec: RunSpec) -> None:
        """Make sure ``spec``'s run.json is on storage before a shard of the run is published.

        A storage root wiped under a running writer (an object store restarted empty) would
        otherwise get shards whose run is declared nowhere: nothing of it readable. One small
        read per ``write_shard``; a missing run.json is put back create-only; a run.json that
        declares other sites is a :class:`ConflictError` (it is never overwritten)."""
        rel = f"{spec.run}/run.json"
        data = spec.to_json().encode()
        try:
            existing = self.storage.cat(rel)
        except NotFoundError:
            try:
                self.storage.publish(rel, data)
                return
            except ConflictError:  # put there meanwhile, with other bytes
                existing = self.storage.cat(rel)
        if existing == data:
            return
        try:
            same = RunSpec.from_json(existing) == spec
        except ValidationError:
            same = False
        if not same:
            raise ConflictError(
                f"{self.url}/{rel} declares run {spec.run} with other sites than this writer's: "
                f"{existing[:500]!r}; not writing shards of run {spec.run} under it"
            )

    # ------------------------------------------------------------------ writing

    def shard_paths(self, run: str, policy_version: int, writer: str, seq: int) -> tuple[str, str]:
        base = f"{run}/v{policy_version}/{writer}/{shard_name(seq)}"
        return f"{base}.parquet", f"{base}.manifest.json"

    def write_shard(
        self,
        run: str,
        policy_version: int,
        writer: str,
        seq: int,
        chunks: Sequence[RecordChunk],
        seals: Sequence[TrajectorySeal] = (),
        links: Sequence[PrefixLink] = (),
        *,
        files: int | None = None,
    ) -> ShardInfo:
        """Publish one complete shard create-only, then its manifest. Repeating the call is a no-op.

        Chunks are validated against the run's sites; seals must list declared sites. Returns
        :class:`ShardInfo`. Raises ConflictError if ``(run, version, writer, seq)`` already holds
        different data.

        Two files: with ``files=2`` (default: the store's ``shard_files``) and at least
        ``split_min_bytes`` of payload in two or more trajectories, the shard is cut by trajectory
        (:func:`~tracestore.storage.shard_write.split_shard`) into shard ``seq`` and shard
        ``seq + PART_SEQ_STRIDE``, each a complete shard with its own manifest, encoded and
        published side by side. Both Parquet files are durable before either manifest is
        published, and the manifest of ``seq`` is published last: when it is there, everything is.
        A crash before that leaves at most the other file's trajectories visible, which a repeat of
        the call completes (the split is a function of the content, so the repeat is byte-identical).
        A repeat that chooses the other layout (one file where an earlier attempt wrote two, or the
        reverse: another core count or setting after a restart) finds the first attempt's file in
        its way and completes that layout instead.
        """
        validate_id("run", run)
        validate_id("writer", writer)
        policy_version = _version(policy_version)
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise ValidationError(f"seq must be an integer >= 0, got {seq!r}")
        if seq >= PART_SEQ_STRIDE:
            raise ValidationError(
                f"seq must be < {PART_SEQ_STRIDE} (numbers from there up name the second files of split shards), "
                f"got {seq}"
            )
        if files is not None and files not in (1, 2):
            raise ValidationError(f"files must be 1 or 2, got {files!r}")
        spec = self.get_run(run)
        self._ensure_run_json(spec)
        for c in chunks:
            if not isinstance(c, RecordChunk):
                raise ValidationError(f"write_shard expects RecordChunk objects, got {type(c).__name__}")
            c.validate(spec.site(c.site))
        for s in seals:
            if not isinstance(s, TrajectorySeal):
                raise ValidationError(f"seals must be TrajectorySeal objects, got {type(s).__name__}")
            for name in s.sites:
                spec.site(name)
        for x in links:
            if not isinstance(x, PrefixLink):
                raise ValidationError(f"links must be PrefixLink objects, got {type(x).__name__}")
        # fail before anything is written
        ordered = check_shard_inputs(run, policy_version, chunks, seals, links)
        one: list[ShardPart] = [(list(chunks), list(seals), list(links))]
        n_files = self.shard_files if files is None else files
        layout = one
        if n_files > 1 and ordered:
            payload = sum(c.nbytes for c in ordered)
            if payload >= self.split_min_bytes and payload >= self.split_min_chunk_bytes * len(ordered):
                layout = split_shard(ordered, seals, links, n_files)
        key = (run, policy_version, writer, seq)
        try:
            done = self._write_parts(key, layout)
        except ConflictError:
            # the other layout, as an earlier attempt of this shard may have chosen it
            other = one if len(layout) > 1 else split_shard(ordered, seals, links, 2)
            if len(other) == len(layout):
                raise
            try:
                done = self._write_parts(key, other)
            except ConflictError:
                pass
            else:
                log.info("shard %s/v%d/%s/%d repeated as %d file(s), as it was first written", *key, len(other))
                return done
            raise
        return done

    def _write_parts(self, key: tuple[str, int, str, int], layout: Sequence[ShardPart]) -> ShardInfo:
        """Publish the files of ``layout`` (part k as shard ``seq + k * PART_SEQ_STRIDE``) side by
        side, then their manifests, part 0's last."""
        run, policy_version, writer, seq = key
        n = len(layout)
        if n == 1:
            done = [self._publish_shard_file(key, seq, *layout[0])]
        else:
            results: list[tuple[bool, Manifest] | None] = [None] * n
            errors: list[BaseException | None] = [None] * n

            def publish(k: int) -> None:
                try:
                    results[k] = self._publish_shard_file(key, seq + k * PART_SEQ_STRIDE, *layout[k])
                except BaseException as exc:  # noqa: BLE001 - raised by the caller below
                    errors[k] = exc

            # daemon threads, like the storage calls they wait on: an exit never waits for storage
            helpers = [
                threading.Thread(target=publish, args=(k,), name="tracestore-shard-part", daemon=True)
                for k in range(1, n)
            ]
            for t in helpers:
                t.start()
            publish(0)
            for t in helpers:
                t.join()
            failed = [e for e in errors if e is not None]
            if failed:  # nothing is visible: no manifest of this layout was published
                raise next((e for e in failed if isinstance(e, ConflictError)), failed[0])
            done = [r for r in results if r is not None]
        for _ in done:
            _faults.point("store.shard_published")
        infos: list[ShardInfo] = []
        for k in [*range(1, n), 0]:
            written, manifest = done[k]
            manifest_path = self.shard_paths(run, policy_version, writer, manifest.seq)[1]
            written = self.storage.publish(manifest_path, manifest.to_json()) or written
            _faults.point("store.manifest_published")
            with self._lock:
                self._manifests[manifest_path] = manifest
            infos.append(
                ShardInfo(
                    run,
                    policy_version,
                    writer,
                    manifest.seq,
                    manifest.shard,
                    manifest_path,
                    len(manifest.chunks),
                    manifest.shard_bytes,
                    sum(e.nbytes for e in manifest.chunks),
                    written,
                )
            )
        if n == 1:
            return infos[0]
        parts = (infos[-1], *infos[:-1])
        return dataclasses.replace(
            parts[0],
            n_chunks=sum(p.n_chunks for p in parts),
            nbytes=sum(p.nbytes for p in parts),
            payload_bytes=sum(p.payload_bytes for p in parts),
            written=any(p.written for p in parts),
            parts=parts,
        )

    def _publish_shard_file(
        self,
        key: tuple[str, int, str, int],
        seq: int,
        chunks: Sequence[RecordChunk],
        seals: Sequence[TrajectorySeal],
        links: Sequence[PrefixLink],
    ) -> tuple[bool, Manifest]:
        """Encode and publish one shard's Parquet file (none without chunks); (written, its manifest)."""
        run, policy_version, writer, _ = key
        shard_path = self.shard_paths(run, policy_version, writer, seq)[0]

        def encode(sink: Any = None) -> tuple[bytes | memoryview | None, Manifest]:
            return encode_shard(
                run,
                policy_version,
                writer,
                seq,
                shard_path,
                chunks,
                seals,
                links,
                row_group_bytes=self.row_group_bytes,
                min_row_group_bytes=self.min_row_group_bytes,
                sink=sink,
            )

        if chunks and self.storage.local:
            # stream to disk while encoding (no in-memory copy of the shard; writeback overlaps encoding)
            written, (_, manifest) = self.storage.publish_stream(shard_path, encode)
            return written, manifest
        data, manifest = encode()
        written = self.storage.publish(shard_path, data) if data is not None else False
        return written, manifest

    # ------------------------------------------------------------------ listing

    def list_runs(self) -> list[str]:
        out = []
        for name in self.storage.ls_dirs(""):
            try:
                validate_id("run", name)
            except ValidationError:
                continue
            out.append(name)
        return sorted(out)

    def list_versions(self, run: str) -> list[int]:
        validate_id("run", run)
        out = []
        for name in self.storage.ls_dirs(run):
            m = _VERSION_DIR.fullmatch(name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def manifest_paths(self, run: str, policy_version: int) -> list[str]:
        """Root-relative paths of the committed manifests of one version (sorted)."""
        validate_id("run", run)
        base = f"{run}/v{_version(policy_version)}/"
        out = []
        for p in self.storage.find(base.rstrip("/")):
            if not p.startswith(base):
                continue
            parts = p[len(base) :].split("/")
            if len(parts) == 2 and _MANIFEST_FILE.fullmatch(parts[1]):
                out.append(p)
        return sorted(out)

    def read_manifest(self, path: str) -> Manifest:
        with self._lock:
            cached = self._manifests.get(path)
        if cached is not None:
            return cached
        m = Manifest.from_json(self.storage.cat(path), where=f"{self.url}/{path}")
        expect_dir = path.rsplit("/", 3)
        if len(expect_dir) == 4 and (
            expect_dir[0].rsplit("/", 1)[-1] != m.run
            or expect_dir[1] != f"v{m.policy_version}"
            or expect_dir[2] != m.writer
            or expect_dir[3] != f"{shard_name(m.seq)}.manifest.json"
        ):
            raise CorruptionError(f"manifest {path} describes run {m.run} v{m.policy_version} {m.writer}/{m.seq}")
        with self._lock:
            self._manifests[path] = m
        return m

    _MAX_FOOTERS = 4096

    def cached_footer(self, m: Manifest) -> Any:
        """The parsed Parquet footer (``pq.FileMetaData``) of ``m``'s shard if a reader kept one."""
        with self._lock:
            return self._footers.get((m.shard or "", m.shard_bytes, m.shard_crc32))

    def keep_footer(self, m: Manifest, footer: Any) -> None:
        """Remember the footer of ``m``'s shard for later readers (bounded; oldest dropped first)."""
        with self._lock:
            self._footers[(m.shard or "", m.shard_bytes, m.shard_crc32)] = footer
            while len(self._footers) > self._MAX_FOOTERS:
                del self._footers[next(iter(self._footers))]

    def manifests(self, run: str, policy_version: int) -> list[Manifest]:
        return [self.read_manifest(p) for p in self.manifest_paths(run, policy_version)]

    def list_writers(self, run: str, version: int) -> list[str]:
        return sorted({p.split("/")[2] for p in self.manifest_paths(run, version)})

    def list_trajectories(self, run: str, version: int) -> list[str]:
        out: set[str] = set()
        for m in self.manifests(run, version):
            out |= m.trajectories
        return sorted(out)

    # ------------------------------------------------------------------ maintenance

    def remove_stale_temp_files(self, older_than_s: float | None = None) -> list[str]:
        """Delete temp files that crashed local writers left behind; returns their root-relative paths.

        Local disk only (S3 and memory publish with one call and never leave any). A writer killed
        between writing its temp file and the create-only link leaves ``.<name>.tmp-<uuid4 hex>``
        next to the shard, manifest or run.json it was publishing; readers never see those files,
        this reclaims their space. Only names our writers create, only where they create them
        (``{run}/`` and ``{run}/v{N}/{writer}/``), and only files unmodified for ``older_than_s``
        seconds (default: the larger of :data:`STALE_TEMP_AGE_S` and 10x the storage timeout; a
        live writer modifies its temp file until the moment it publishes), so a live writer's temp
        file is never removed. Files that vanish or cannot be removed meanwhile are skipped.
        """
        if older_than_s is None:
            older_than_s = max(STALE_TEMP_AGE_S, 10 * self.storage.timeout)
        if not older_than_s >= 0:
            raise ValidationError(f"older_than_s must be >= 0 seconds, got {older_than_s!r}")
        if not self.storage.local:
            return []
        import os
        import time

        cutoff = time.time() - older_than_s
        removed: list[str] = []

        def entries(path: str) -> list[os.DirEntry[str]]:
            try:
                with os.scandir(path) as it:
                    return list(it)
            except OSError:  # absent, not a directory, unreadable
                return []

        def sweep(directory: os.DirEntry[str] | str, rel: str, pattern: re.Pattern[str]) -> list[os.DirEntry[str]]:
            subdirs = []
            for e in entries(directory if isinstance(directory, str) else directory.path):
                try:
                    if e.is_dir(follow_symlinks=False):
                        subdirs.append(e)
                    elif (
                        pattern.fullmatch(e.name)
                        and e.is_file(follow_symlinks=False)
                        and e.stat(follow_symlinks=False).st_mtime < cutoff
                    ):
                        os.unlink(e.path)
                        removed.append(f"{rel}/{e.name}")
                except OSError:
                    continue
            return subdirs

        for run_dir in entries(self.storage.full("")):
            try:
                if not run_dir.is_dir(follow_symlinks=False):
                    continue
                validate_id("run", run_dir.name)
            except (OSError, ValidationError):
                continue
            for vdir in sweep(run_dir, run_dir.name, _RUN_TEMP):
                if _VERSION_DIR.fullmatch(vdir.name):
                    for wdir in sweep(vdir, f"{run_dir.name}/{vdir.name}", _NO_TEMP):
                        sweep(wdir, f"{run_dir.name}/{vdir.name}/{wdir.name}", _SHARD_TEMP)
        return removed

    def close(self) -> None:
        """Release the worker threads (the store stays usable: new calls start new ones)."""
        self.storage.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ retention

    def delete_versions_older_than(self, run: str, keep: int) -> list[int]:
        """Retention: delete every policy version ``< keep`` of ``run``; returns the deleted versions.

        Manifests go first (the data stops being visible), then the shards and directories.
        """
        keep = _version(keep)
        deleted = []
        for v in self.list_versions(run):
            if v >= keep:
                continue
            for p in self.manifest_paths(run, v):
                self.storage.rm(p)
                with self._lock:
                    m = self._manifests.pop(p, None)
                    if m is not None:
                        self._footers.pop((m.shard or "", m.shard_bytes, m.shard_crc32), None)
            self.storage.rm(f"{run}/v{v}", recursive=True)
            deleted.append(v)
        return deleted
