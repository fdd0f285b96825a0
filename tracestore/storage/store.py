"""Store: durable Parquet shards of record chunks on any fsspec URL.

Layout under the root URL::

    {run}/run.json                                          the RunSpec (create-only)
    {run}/v{policy_version}/{writer}/part-{seq:08d}.parquet  one shard, published with one call
    {run}/v{policy_version}/{writer}/part-{seq:08d}.manifest.json   written after it: makes it visible

Writers own their key space (writer id + sequence number), so nothing needs a coordinator;
a reader's view of a version is the union of the manifests present. Keys are deterministic and
writes create-only: repeating a ``write_shard`` call (a retry after a lost ack) is a no-op, the
same key with different bytes is a :class:`ConflictError`.

This module owns the write side: the runs (``run.json`` and a cache of the specs), the settings that
split a large write into two shard files, and ``write_shard``. :class:`Store` extends
:class:`~tracestore.storage.catalog.Catalog`, which owns the committed side: the listing, the
manifest and footer caches, retention and the sweep of stale temp files.

Example::

    store = Store("file://./tracestore-data")
    store.put_run(RunSpec("run-1", (SiteSpec("layers.23.mlp.input", "moe_input", 23, 2048),)))
    info = store.write_shard("run-1", 0, "sidecar-0", 0, chunks, seals=[TrajectorySeal(...)])
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

from tracestore import faults as _faults
from tracestore.errors import ConfigError, ConflictError, NotFoundError, ValidationError
from tracestore.records import PrefixLink, RecordChunk, RunSpec, TrajectorySeal, validate_id, validate_version
from tracestore.storage.catalog import STALE_TEMP_AGE_S, Catalog
from tracestore.storage.config import SPLIT_MIN_BYTES, SPLIT_MIN_CHUNK_BYTES, StorageConfig
from tracestore.storage.fs import EventHook, Storage
from tracestore.storage.manifest import Manifest
from tracestore.storage.shard_write import (
    BytesSink,
    ShardPart,
    check_shard_inputs,
    encode_shard,
    shard_size_hint,
    split_shard,
)

__all__ = [
    "PART_SEQ_STRIDE",
    "SHARD_FILES_ENV",
    "SPLIT_MIB_ENV",
    "SPLIT_MIN_BYTES",
    "SPLIT_MIN_CHUNK_BYTES",
    "STALE_TEMP_AGE_S",
    "ShardInfo",
    "Store",
    "default_shard_files",
    "default_split_min_bytes",
]

log = logging.getLogger("tracestore.storage")


PART_SEQ_STRIDE = 10**18
"""The second file of a split shard ``seq`` is shard ``seq + PART_SEQ_STRIDE`` of the same writer
(``part-1000000000000000007`` beside ``part-00000007``); :meth:`Store.write_shard` refuses shard
numbers from here up, so the two ranges never meet (a sidecar's numbers, microseconds since 1970,
reach 10**18 in the year 33658)."""
SHARD_FILES_ENV = "TRACESTORE_SHARD_FILES"
"""The variable of ``tracestore serve --shard-files`` (read by the settings layer, not here)."""
SPLIT_MIB_ENV = "TRACESTORE_SHARD_SPLIT_MIB"
"""The variable of ``tracestore serve --shard-split-mib`` (read by the settings layer, not here)."""


def default_shard_files() -> int:
    """The most files one shard is written as by default: 2 with 2 or more cores, else 1."""
    return StorageConfig().files


def default_split_min_bytes() -> int:
    """The default payload from which a write is split in two: :data:`SPLIT_MIN_BYTES`."""
    return SPLIT_MIN_BYTES


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


class Store(Catalog):
    """Record storage on an fsspec URL (``file://`` default, ``memory://``, ``s3://``...).

    ``storage_options`` are passed to fsspec untouched. ``config`` (a
    :class:`~tracestore.storage.config.StorageConfig`; default: its defaults) holds the timeouts,
    retries and shard-splitting knobs; the keyword arguments ``timeout``, ``retries``,
    ``retry_deadline``, ``shard_files``, ``split_min_bytes``, ``split_min_chunk_bytes``,
    ``row_group_bytes`` and ``min_row_group_bytes`` replace single fields of it (an invalid one
    raises :class:`~tracestore.errors.ValidationError`). ``on_event(kind, op, detail)`` is called on
    each retry / timeout / error (for metrics); ``stats`` counts them.

    Listing, the manifest and footer caches, retention and the stale-temp sweep come from
    :class:`~tracestore.storage.catalog.Catalog`.
    """

    def __init__(
        self,
        url: str = "file://./tracestore-data",
        storage_options: dict[str, Any] | None = None,
        *,
        config: StorageConfig | None = None,
        on_event: EventHook | None = None,
        timeout: float | None = None,
        retries: int | None = None,
        row_group_bytes: int | None = None,
        min_row_group_bytes: int | None = None,
        retry_deadline: float | None = None,
        shard_files: int | None = None,
        split_min_bytes: int | None = None,
        split_min_chunk_bytes: int | None = None,
    ) -> None:
        given: dict[str, Any] = {
            "timeout_s": timeout,
            "retries": retries,
            "row_group_bytes": row_group_bytes,
            "min_row_group_bytes": min_row_group_bytes,
            "retry_deadline_s": retry_deadline,
            "shard_files": shard_files,
            "split_min_bytes": split_min_bytes,
            "split_min_chunk_bytes": split_min_chunk_bytes,
        }
        try:
            cfg = dataclasses.replace(config or StorageConfig(), **{k: v for k, v in given.items() if v is not None})
        except ConfigError as exc:
            raise ValidationError(str(exc)) from None
        self.config = cfg
        storage = Storage(
            url,
            storage_options,
            timeout=cfg.timeout_s,
            retries=cfg.retries,
            on_event=on_event,
            retry_deadline=cfg.retry_deadline_s,
        )
        super().__init__(storage, url)
        self.row_group_bytes = cfg.row_group_bytes
        self.min_row_group_bytes = cfg.min_row_group_bytes
        self.shard_files = cfg.files
        self.split_min_bytes = cfg.split_min_bytes
        self.split_min_chunk_bytes = cfg.split_min_chunk_bytes
        self._runs: dict[str, RunSpec] = {}  # guarded by the catalog's lock

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    @property
    def stats(self) -> dict[str, int]:
        return self.storage.stats

    # ------------------------------------------------------------------ runs

    def put_run(self, spec: RunSpec) -> bool:
        """Declare a run (create-only): the same spec is a no-op, a different one conflicts."""
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
        published side by side. Both Parquet files are durable before either manifest is published,
        and the manifest of ``seq`` is published last: when it is there, everything is. A crash
        before that leaves at most the other file's trajectories visible, which a repeat of the call
        completes (the split is a function of the content, so the repeat is byte-identical). A
        repeat that chooses the other layout (one file where an earlier attempt wrote two, or the
        reverse: another core count or setting after a restart) finds the first attempt's file in
        its way and completes that layout instead.
        """
        validate_id("run", run)
        validate_id("writer", writer)
        policy_version = validate_version(policy_version)
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
            self._remember_manifest(manifest_path, manifest)
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
        """Encode and publish a shard's Parquet file (none without chunks); (written, manifest)."""
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
        # published from memory: encoded straight into the bytes the upload sends
        # (shard_write.BytesSink)
        sink = BytesSink(shard_size_hint(chunks)) if chunks else None
        _, manifest = encode(sink)
        data = None if sink is None else sink.getvalue()
        del sink
        written = self.storage.publish(shard_path, data) if data is not None else False
        return written, manifest

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Release the worker threads (the store stays usable: new calls start new ones)."""
        self.storage.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
