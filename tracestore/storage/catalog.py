"""The committed side of a store's layout: the names its files have, what is listed, and two caches.

A :class:`Catalog` owns what readers see of a store: the names under the root URL (``{run}/``,
``v{N}/`` version directories, ``part-{seq}.manifest.json`` files, the shard paths, and the
``.<name>.tmp-<uuid4 hex>`` temp files a local publish writes beside its target), the listing of
runs, versions, writers, trajectories and manifests, and two caches shared by every reader of the
store, both dropped for what retention deletes: the parsed manifests (immutable once published)
and the Parquet footers of their shards. It also deletes: whole policy versions (retention) and
the temp files that killed local writers left behind.

:class:`~tracestore.storage.store.Store` is a Catalog with the write side on top (runs, the split
settings, ``write_shard``); the layout itself is described in that module.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

from tracestore.errors import CorruptionError, ValidationError
from tracestore.records import validate_id, validate_version
from tracestore.storage.fs import Storage
from tracestore.storage.manifest import Manifest, shard_name

_VERSION_DIR = re.compile(r"v(\d+)")
_MANIFEST_FILE = re.compile(r"part-(\d+)\.manifest\.json")
# the temp files our local publish writes next to its target (tracestore.storage.local):
# ".<name>.tmp-<uuid4 hex>"
_RUN_TEMP = re.compile(r"\.run\.json\.tmp-[0-9a-f]{32}")
_SHARD_TEMP = re.compile(r"\.part-\d{8,}\.(?:parquet|manifest\.json)\.tmp-[0-9a-f]{32}")
_NO_TEMP = re.compile(r"(?!)")  # version directories hold none
STALE_TEMP_AGE_S = 600.0
"""Default grace of :meth:`Catalog.remove_stale_temp_files`, at least 10x the storage timeout."""


class Catalog:
    """What is committed under ``url`` (on ``storage``): listing, the manifest and footer caches,
    retention and the temp-file sweep. ``_lock`` guards the caches (and, in a
    :class:`~tracestore.storage.store.Store`, its cache of run specs)."""

    def __init__(self, storage: Storage, url: str) -> None:
        self.storage = storage
        self.url = url
        # Parsed manifests (immutable once published), least recently used first, with their chunk
        # entries counted: bounded by _MAX_MANIFEST_ENTRIES (see _remember_manifest).
        self._manifests: OrderedDict[str, Manifest] = OrderedDict()
        self._manifest_entries = 0
        # Parquet footers of shards, shared by every reader of this store: keyed by the manifest's
        # (path, size, crc32) of the shard, so a file replaced under the same path is not matched
        self._footers: dict[tuple[str, int, int], Any] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ names

    def shard_paths(self, run: str, policy_version: int, writer: str, seq: int) -> tuple[str, str]:
        base = f"{run}/v{policy_version}/{writer}/{shard_name(seq)}"
        return f"{base}.parquet", f"{base}.manifest.json"

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
        base = f"{run}/v{validate_version(policy_version)}/"
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
                self._manifests.move_to_end(path)
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
        self._remember_manifest(path, m)
        return m

    # Chunk entries the manifest cache holds at most, so a long-lived sidecar does not keep every
    # manifest it published. A StoreReader indexes each manifest once and keeps what it indexed
    # itself, so the cache only spares re-reads (another reader of this store, the rebuild after
    # retention); least recently used manifests go first.
    _MAX_MANIFEST_ENTRIES = 1 << 18  # ~350 bytes each parsed: ~90 MiB

    def _remember_manifest(self, path: str, m: Manifest) -> None:
        """Cache the manifest at ``path`` (read, or just published by this store)."""
        with self._lock:
            old = self._manifests.pop(path, None)
            if old is not None:
                self._manifest_entries -= len(old.chunks)
            self._manifests[path] = m
            self._manifest_entries += len(m.chunks)
            while self._manifest_entries > self._MAX_MANIFEST_ENTRIES and len(self._manifests) > 1:
                _, dropped = self._manifests.popitem(last=False)
                self._manifest_entries -= len(dropped.chunks)

    _MAX_FOOTERS = 4096

    def cached_footer(self, m: Manifest) -> Any:
        """The parsed Parquet footer (``pq.FileMetaData``) of ``m``'s shard if a reader kept one."""
        with self._lock:
            return self._footers.get((m.shard or "", m.shard_bytes, m.shard_crc32))

    def keep_footer(self, m: Manifest, footer: Any) -> None:
        """Keep the footer of ``m``'s shard for later readers (bounded; oldest dropped first)."""
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
        """Delete temp files that crashed local writers left; returns their root-relative paths.

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

    # ------------------------------------------------------------------ retention

    def delete_versions_older_than(self, run: str, keep: int) -> list[int]:
        """Retention: delete every policy version ``< keep`` of ``run``; returns those deleted.

        Manifests go first (the data stops being visible), then the shards and directories.
        """
        keep = validate_version(keep)
        deleted = []
        for v in self.list_versions(run):
            if v >= keep:
                continue
            for p in self.manifest_paths(run, v):
                self.storage.rm(p)
                with self._lock:
                    m = self._manifests.pop(p, None)
                    if m is not None:
                        self._manifest_entries -= len(m.chunks)
                        self._footers.pop((m.shard or "", m.shard_bytes, m.shard_crc32), None)
            self.storage.rm(f"{run}/v{v}", recursive=True)
            deleted.append(v)
        return deleted
