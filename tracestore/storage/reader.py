"""StoreReader: microbatch-aligned, rank-sharded, verified reads of stored records.

For a run, a set of policy versions, a :class:`~tracestore.plan.MicrobatchPlan`, an optional
site subset (a pipeline stage's layers) and an optional column range (a tensor-parallel rank's
heads), :meth:`StoreReader.read` returns per-site arrays aligned row-for-row to the plan plus a
validity mask. Only the row groups that hold the plan's (trajectory, site, token) ranges are
fetched, using the manifests' index (ranged reads; never the whole step). Every chunk's checksum
is verified on every read.

Resolution rules
- A trajectory's tokens ``[0, P)`` covered by a :class:`~tracestore.records.PrefixLink` are read
  from the link's source (recursively), transparently. A link is checked against its source
  before anything is read through it (:class:`LinkIndex`): the source must hold a record, seal or
  link in the link's own version, at least ``P`` tokens of it (its largest seal, else its records),
  and following links must never come back to a trajectory already on the way (a cycle). A link
  past its source's seal or in a cycle is :class:`~tracestore.errors.CorruptionError`; one whose
  source is missing or not yet recorded that far is
  :class:`~tracestore.errors.MissingRecordsError` (``on_missing="mask"``: those rows come back
  invalid). The link is also checked against its own trajectory in every selected version
  (:meth:`LinkIndex.check_trajectory`): the trajectory may hold no chunk of its own overlapping
  the linked prefix (records are stored once, under the source), its links must name one source,
  and the link's manifest must have the writer of the trajectory's own chunks, seals and links
  (the source may be another writer's); each violation is a
  :class:`~tracestore.errors.ConflictError`, also with ``on_missing="mask"``. Each error names the
  link and its manifest; no row is ever served through a failing link.
- When several selected versions hold the same token, the newest wins (a re-rollout after a weight
  update supersedes); two chunks of one version covering a token must hold identical bytes, else
  :class:`~tracestore.errors.ConflictError` names the key.
- The last position of a sealed trajectory is unrecorded by design (the rollout never forwards the
  final sampled token): it comes back invalid and is never reported missing.
- Padding segments (trajectory ``None``) come back invalid.

Example::

    reader = StoreReader(store, "run-1")
    res = reader.read(MicrobatchPlan([("t0", 0, 512)]), sites=["layers.23.mlp.input"], columns=(0, 1024))
    rows = res["layers.23.mlp.input"]   # SiteRows: codes [512, 128], scales [512, 64], valid [512] ...
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tracestore.errors import (
    ConfigError,
    CorruptionError,
    MissingRecordsError,
    NotFoundError,
    ValidationError,
)
from tracestore.plan import MicrobatchPlan
from tracestore.records import SiteSpec, TrajectorySeal, validate_id
from tracestore.storage.fs import CountingFile, Storage
from tracestore.storage.identity_check import IdentityCheck, OnMismatch, TokenIds
from tracestore.storage.links import LinkIndex, OnMissing
from tracestore.storage.manifest import ChunkEntry, Manifest
from tracestore.storage.read_out import ReadResult, ReadStats, ReadTask, SiteOut, site_outs
from tracestore.storage.rows import (
    ColumnRange,
    Layout,
    OutputArrays,
    SiteRows,
    column_range,
    output_arrays,
    output_sections,
    read_layout,
)
from tracestore.storage.shard_read import DATA_COLUMNS, StoredChunk, open_parquet, read_chunks
from tracestore.storage.store import Store

__all__ = [
    "Layout",
    "LinkIndex",
    "OutputArrays",
    "ReadResult",
    "ReadStats",
    "SiteRows",
    "StoreReader",
    "output_arrays",
    "output_sections",
]

StalePolicy = Literal["drop", "flag"]


def _open_ranged(storage: Storage, path: str) -> tuple[Any, bool]:
    """``path`` opened for a decoder's ranged reads, and whether several threads may read it at
    once. On local disk a memory map: the decoder reads pages in place (no copy into read
    buffers) from any thread. Elsewhere a :class:`CountingFile` over an fsspec handle without
    read-ahead (pyarrow asks for exact ranges), one reader at a time."""
    if storage.local:
        return pa.memory_map(storage.full(path)), True
    return CountingFile(storage.fs.open(storage.full(path), "rb", cache_type="none")), False


def _fetched_bytes(md: pq.FileMetaData, entries: Sequence[ChunkEntry], with_footer: bool) -> int:
    """The bytes a read of ``entries`` takes from a memory-mapped shard: their row groups' data
    columns, and the footer when it was not cached."""
    names = md.schema.to_arrow_schema().names
    cols = [names.index(n) for n in DATA_COLUMNS]
    nbytes = sum(md.row_group(g).column(c).total_compressed_size for g in {e.row_group for e in entries} for c in cols)
    return nbytes + (md.serialized_size + 8 if with_footer else 0)


def _ranges(tokens: np.ndarray) -> list[tuple[int, int]]:
    """Sorted token indices -> maximal [start, end) runs."""
    if tokens.size == 0:
        return []
    breaks = np.nonzero(np.diff(tokens) != 1)[0]
    starts = np.concatenate([[tokens[0]], tokens[breaks + 1]])
    ends = np.concatenate([tokens[breaks] + 1, [tokens[-1] + 1]])
    return [(int(a), int(b)) for a, b in zip(starts, ends, strict=True)]


def _disjoint(cands: list[tuple[Manifest, ChunkEntry]]) -> bool:
    """Candidates (sorted newest version first, then by token start) of one version that do not
    overlap: each is read as a whole, and nothing is compared."""
    end = -1
    for m, e in cands:
        if m.policy_version != cands[0][0].policy_version or e.token_start < end:
            return False
        end = e.token_start + e.n_tokens
    return True


class StoreReader:
    """Reads one run of a :class:`~tracestore.storage.store.Store` aligned to microbatch plans.

    Manifests and Parquet footers are cached in the Store (they are immutable, so readers of one
    Store share them); new manifests are picked up
    on each read (``refresh=True``). ``workers`` shards are fetched concurrently. Thread-safe:
    index refreshes are serialized, reads from several threads run concurrently.
    """

    def __init__(self, store: Store, run: str, *, workers: int = 4) -> None:
        if not isinstance(store, Store):
            raise ValidationError(f"StoreReader needs a Store, got {type(store).__name__}")
        self.store = store
        self.run = validate_id("run", run)
        self.spec = store.get_run(run)
        self._lock = threading.RLock()
        self._stats_lock = threading.Lock()
        self._listed: dict[int, list[str]] = {}  # version -> manifest paths seen at the last refresh
        self._by_traj: dict[tuple[str, str], list[tuple[Manifest, ChunkEntry]]] = {}  # (trajectory, site)
        self._seals: dict[str, list[TrajectorySeal]] = {}
        self._links = LinkIndex(self.run)
        self._indexed: set[str] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tracestore-read")

    def close(self) -> None:
        """Release the reader's worker threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ index

    def versions(self) -> list[int]:
        return self.store.list_versions(self.run)

    def refresh(self, versions: Iterable[int]) -> None:
        """List the manifests of ``versions`` and index any new ones."""
        with self._lock:
            self._refresh(versions)

    def _refresh(self, versions: Iterable[int]) -> None:
        for v in versions:
            paths = self.store.manifest_paths(self.run, v)
            old = set(self._listed.get(v, []))
            if old - set(paths):  # retention removed some: rebuild from scratch
                self._reset()
                old = set()
            listed = []
            for p in paths:
                if p not in old and p not in self._indexed:
                    try:
                        m = self.store.read_manifest(p)
                    except NotFoundError:
                        # listed but not readable yet (S3 under concurrent writes: moto served a
                        # listed manifest as 404 in ~1 of 3 full test runs) or just deleted by
                        # retention: not visible this time; the next refresh looks again
                        continue
                    self._index(p, m)
                listed.append(p)
            self._listed[v] = listed

    def _reset(self) -> None:
        # new objects rather than clear(): reads running concurrently keep their consistent view
        self._by_traj = {}
        self._seals = {}
        self._links = LinkIndex(self.run)
        self._indexed = set()
        listed = dict(self._listed)
        self._listed.clear()
        for paths in listed.values():
            for p in paths:
                if self.store.storage.exists(p):
                    self._index(p, self.store.read_manifest(p))

    def _index(self, path: str, m: Manifest) -> None:
        if m.run != self.run:
            raise CorruptionError(f"manifest {path} belongs to run {m.run}, not {self.run}")
        for e in m.chunks:
            self._by_traj.setdefault((e.trajectory, e.site), []).append((m, e))
        for s in m.seals:
            self._seals.setdefault(s.trajectory, []).append(s)
        self._links.add_manifest(f"{self.store.url}/{path}", m)
        self._indexed.add(path)

    def _sealed_end(self, trajectory: str, version: int) -> int | None:
        seal = self.seal(trajectory, (version,))
        return None if seal is None else seal.n_tokens

    def seal(self, trajectory: str, versions: Iterable[int] | None = None) -> TrajectorySeal | None:
        """The newest seal of ``trajectory`` among ``versions`` (all indexed when None)."""
        vs = None if versions is None else set(versions)
        seals = [s for s in self._seals.get(trajectory, []) if vs is None or s.policy_version in vs]
        return max(seals, key=lambda s: (s.policy_version, s.n_tokens), default=None)

    # ------------------------------------------------------------------ read

    def read(
        self,
        plan: MicrobatchPlan | Sequence[tuple[str | None, int, int]],
        versions: int | Iterable[int] | None = None,
        sites: Iterable[str] | None = None,
        columns: ColumnRange | Mapping[str, ColumnRange] | None = None,
        on_missing: OnMissing = "error",
        max_staleness: int | None = None,
        *,
        current_version: int | None = None,
        stale: StalePolicy = "drop",
        require_sealed: bool = False,
        refresh: bool = True,
        hold_gil: bool = False,
        out: Mapping[str, OutputArrays] | None = None,
        token_ids: TokenIds | None = None,
        on_mismatch: OnMismatch = "error",
    ) -> ReadResult:
        """Read the records of ``plan`` (see the module docstring for the rules).

        ``versions``: one version, several, or None for all of the run's versions.
        ``max_staleness``: records of versions older than ``current_version - max_staleness``
        (``current_version`` defaults to the newest version stored) are dropped (``stale="drop"``)
        or returned and flagged in ``SiteRows.stale`` (``stale="flag"``). ``on_missing="error"``
        raises :class:`MissingRecordsError` naming trajectory, site and tokens; ``"mask"`` returns
        them invalid. ``require_sealed`` demands a seal for every trajectory in the plan.
        ``hold_gil``: short copies and CRCs keep the GIL, for a read in a background thread beside
        one that is busy in Python (see :func:`~tracestore.storage.read_out._copy_held`); the
        default gives it up and decodes faster alone. ``out``: where each site's rows go
        (:class:`OutputArrays` of the shapes :meth:`layout` gives, for every site read; default: one
        new buffer from Arrow's memory pool), e.g. rows of a shared-memory block that another
        process maps (:mod:`tracestore.client.read.read_process`). ``token_ids``: the trainer's
        token ids (a mapping trajectory -> ids from position 0, or one array aligned with the plan's
        tokens when every segment starts at 0): every chunk that carries its token identity is
        checked against them (:mod:`tracestore.storage.identity_check`); on a difference
        ``on_mismatch="error"`` raises :class:`~tracestore.errors.GuidanceMismatch` and ``"mask"``
        returns that trajectory's rows invalid, with the reason in ``stats.mismatched``.
        """
        if not isinstance(plan, MicrobatchPlan):
            plan = MicrobatchPlan(plan)
        check = None if token_ids is None else IdentityCheck(self.run, plan, token_ids, on_mismatch)
        if on_missing not in ("error", "mask"):
            raise ConfigError(f"on_missing must be 'error' or 'mask', got {on_missing!r}")
        if stale not in ("drop", "flag"):
            raise ConfigError(f"stale must be 'drop' or 'flag', got {stale!r}")
        site_specs = self._sites(sites)
        col = {s.name: column_range(s, columns) for s in site_specs}

        all_versions = self.versions()
        if versions is None:
            vs = set(all_versions)
        elif isinstance(versions, (int, np.integer)):
            vs = {int(versions)}
        else:
            vs = {int(v) for v in versions}
        stale_below = -1
        if max_staleness is not None:
            if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
                raise ConfigError(f"max_staleness must be an integer >= 0 or None, got {max_staleness!r}")
            current = current_version if current_version is not None else max(all_versions, default=0)
            stale_below = current - max_staleness
            if stale == "drop":
                vs = {v for v in vs if v >= stale_below}
        present = sorted(v for v in vs if v in set(all_versions))
        with self._lock:  # index updates are serialized; the reads themselves run concurrently
            if refresh or any(v not in self._listed for v in present):
                self.refresh(present)
        return self._read(
            plan, set(present), site_specs, col, on_missing, stale_below, require_sealed, hold_gil, out, check
        )

    def layout(
        self,
        n_tokens: int,
        sites: Iterable[str] | None = None,
        columns: ColumnRange | Mapping[str, ColumnRange] | None = None,
    ) -> list[tuple[SiteSpec, int, int, int]]:
        """What a read of a plan of ``n_tokens`` tokens returns: ``(site, n_rows, code_bytes,
        scale_bytes)`` per site, in the order :meth:`read` takes them (for ``out=``)."""
        site_specs = self._sites(sites)
        return read_layout(site_specs, {s.name: column_range(s, columns) for s in site_specs}, n_tokens)

    def _sites(self, sites: Iterable[str] | None) -> list[SiteSpec]:
        if sites is None:
            return list(self.spec.sites)
        if isinstance(sites, str):
            sites = [sites]
        return [self.spec.site(s) for s in sites]

    def _read(
        self,
        plan: MicrobatchPlan,
        vs: set[int],
        site_specs: list[SiteSpec],
        col: dict[str, ColumnRange],
        on_missing: OnMissing,
        stale_below: int,
        require_sealed: bool,
        hold_gil: bool = False,
        out: Mapping[str, OutputArrays] | None = None,
        check: IdentityCheck | None = None,
    ) -> ReadResult:
        stats = ReadStats()
        if require_sealed:
            unsealed = [t for t in plan.trajectories if self.seal(t, vs) is None]
            if unsealed:
                raise MissingRecordsError(
                    f"run {self.run}: trajectories {unsealed[:10]} have no seal in versions {sorted(vs)} "
                    "(require_sealed=True)"
                )
        # 1. plan -> tasks per site
        tasks: dict[str, list[ReadTask]] = {s.name: [] for s in site_specs}
        pieces_of = []
        for seg in plan.segments:
            pieces_of.append(
                []
                if seg.trajectory is None
                else self._links.resolve(seg.trajectory, seg.token_start, seg.token_end, vs, on_missing)
            )
        for s in site_specs:
            for i, seg in enumerate(plan.segments):
                base = int(plan.offsets[i]) - seg.token_start
                for owner, lo, hi in pieces_of[i]:
                    if owner is None:  # behind a link whose source is missing (on_missing="mask")
                        continue
                    # a trajectory sealed in a version has no token at or past that seal's n_tokens:
                    # that version's rows there (a forward that ran on after the sequence ended) are
                    # never read as valid
                    cands = []
                    stops: dict[int, int] = {}  # id(entry) -> where its version's seal cuts it
                    for m, e in self._by_traj.get((owner, s.name), ()):
                        if m.policy_version not in vs or e.token_start >= hi or e.token_end <= lo:
                            continue
                        end = self._sealed_end(owner, m.policy_version)
                        if end is not None and e.token_end > end:
                            if max(lo, e.token_start) >= end:
                                continue
                            stops[id(e)] = end
                        cands.append((m, e))
                    cands.sort(key=lambda me: (-me[0].policy_version, me[1].token_start))
                    if check is not None and seg.trajectory is not None:
                        for _, e in cands:
                            check.expect(seg.trajectory, owner, hi, e)
                    if _disjoint(cands):  # the common case: one version's chunks, none overlapping
                        for m, e in cands:
                            a, b = max(lo, e.token_start), min(hi, e.token_end, stops.get(id(e), hi))
                            tasks[s.name].append(ReadTask(e, m, a, b, base + a, False))
                        continue
                    filled = np.full(hi - lo, -1, dtype=np.int64)
                    for m, e in cands:
                        a, b = max(lo, e.token_start), min(hi, e.token_end, stops.get(id(e), hi))
                        window = filled[a - lo : b - lo]
                        free = window == -1
                        if free.all():  # the common case: nothing of this range is filled yet
                            tasks[s.name].append(ReadTask(e, m, a, b, base + a, False))
                            window[:] = m.policy_version
                            continue
                        for kind, mask in ((False, free), (True, window == m.policy_version)):
                            for ra, rb in _ranges(np.nonzero(mask)[0]):
                                tasks[s.name].append(ReadTask(e, m, a + ra, a + rb, base + a + ra, kind))
                        window[free] = m.policy_version
        # 2. output buffers (one allocation for all sites unless ``out`` gives them)
        outs = site_outs(site_specs, col, plan.n_tokens, out, hold_gil)
        # 3. fetch the chunks; each verified chunk is placed by the thread that decoded it, while
        # other batches decode (rows of different tasks never overlap: see the planning above).
        # Bookkeeping by entry identity: a ChunkEntry's hash walks all its fields.
        needed: dict[str, tuple[Manifest, dict[int, ChunkEntry]]] = {}
        places: dict[int, list[tuple[SiteOut, ReadTask]]] = {}
        compared: set[int] = set()  # entries a same-version overlap is compared with, kept when read
        loaded: dict[int, StoredChunk] = {}
        for name, tl in tasks.items():
            for t in tl:
                if t.manifest.shard is None:
                    raise CorruptionError(f"manifest of {t.manifest.writer}/{t.manifest.seq} lists chunks but no shard")
                needed.setdefault(t.manifest.shard, (t.manifest, {}))[1][id(t.entry)] = t.entry
                if t.compare:
                    compared.add(id(t.entry))
                else:
                    places.setdefault(id(t.entry), []).append((outs[name], t))

        def place(c: StoredChunk) -> None:
            key = id(c.entry)
            for site_out, t in places.get(key, ()):
                site_out.place(t, c)
            if check is not None:
                check.see(c.entry, c.ids_crc)
            if key in compared:
                loaded[key] = c

        jobs = sorted(needed.items())
        if len(jobs) == 1:  # one shard: no hand-off to the reader's pool (a fresh reader starts no thread)
            path, (m, es) = jobs[0]
            self._load(path, m, list(es.values()), stats, place, hold_gil)
        else:
            futs = [
                self._pool.submit(self._load, path, m, list(es.values()), stats, place, hold_gil)
                for path, (m, es) in jobs
            ]
            for fut in futs:
                fut.result()
        # 4. same-version overlaps are compared once everything is in place; then finish each site
        for name, tl in tasks.items():
            for t in tl:
                if t.compare:
                    outs[name].compare(t, loaded[id(t.entry)], self.run)
        rows: dict[str, SiteRows] = {}
        missing: list[str] = []
        for s in site_specs:
            rows[s.name] = outs[s.name].finish(stale_below)
            self._check_missing(plan, s, rows[s.name], vs, stats, missing)
        if missing and on_missing == "error":
            more = f" (and {len(missing) - 20} more)" if len(missing) > 20 else ""
            raise MissingRecordsError(
                f"run {self.run} versions {sorted(vs)}: no record for " + "; ".join(missing[:20]) + more
            )
        if check is not None:
            check.finish(rows, stats)
        return ReadResult(plan, rows, stats)

    def _load(
        self,
        path: str,
        m: Manifest,
        entries: list[ChunkEntry],
        stats: ReadStats,
        on_chunk: Callable[[StoredChunk], None],
        hold_gil: bool = False,
    ) -> None:
        storage = self.store.storage
        where = f"{self.store.url}/{path}"

        def _op() -> int:
            footer = self.store.cached_footer(m)
            f, shared = _open_ranged(storage, path)
            try:
                size = f.seek(0, 2)
                f.seek(0)
                if size != m.shard_bytes:
                    raise CorruptionError(
                        f"shard {where}: {size} bytes, its manifest says {m.shard_bytes} (truncated or replaced)"
                    )
                try:
                    pf = open_parquet(f, where, footer)
                    # over a file several threads may read, batches of row groups decode concurrently
                    source = (lambda meta: pf if meta is None else open_parquet(f, where, meta)) if shared else pf
                    read_chunks(source, m, entries, where, on_chunk, hold_gil=hold_gil)
                except CorruptionError:
                    if isinstance(f, CountingFile) and f.io_error is not None:  # the storage failed, not the bytes
                        raise f.io_error from None
                    raise
                if footer is None:
                    self.store.keep_footer(m, pf.metadata)
                if isinstance(f, CountingFile):
                    return f.bytes_read
                return _fetched_bytes(pf.metadata, entries, footer is None)
            finally:
                f.close()

        try:
            nbytes = storage.call(f"read {path}", _op)
        except NotFoundError:
            raise NotFoundError(f"shard {where} listed in a manifest is gone (deleted by retention?)") from None
        with self._stats_lock:
            stats.shards += 1
            stats.row_groups += len({e.row_group for e in entries})
            stats.chunks += len(entries)
            stats.bytes_read += nbytes
        storage.count_read(nbytes)

    def _check_missing(
        self, plan: MicrobatchPlan, s: SiteSpec, rows: SiteRows, vs: set[int], stats: ReadStats, out: list[str]
    ) -> None:
        k = s.rows_per_token
        tok_valid = np.asarray(rows.valid.reshape(-1, k).all(axis=1), dtype=bool)
        if tok_valid.all():
            return
        # only the segments holding an invalid token are looked at (a plan has hundreds)
        bad_segments = np.unique(np.searchsorted(plan.offsets, np.nonzero(~tok_valid)[0], side="right") - 1)
        for i in bad_segments.tolist():
            seg = plan.segments[i]
            if seg.trajectory is None:
                continue
            o = int(plan.offsets[i])
            bad = np.nonzero(~tok_valid[o : o + seg.n_tokens])[0] + seg.token_start
            if bad.size == 0:
                continue
            seal = self.seal(seg.trajectory, vs)
            if seal is not None and seal.n_tokens - 1 in bad:
                bad = bad[bad != seal.n_tokens - 1]
                stats.exempt_rows += k
            if bad.size == 0:
                continue
            stats.missing_rows += int(bad.size) * k
            spans = ", ".join(f"[{a}, {b})" for a, b in _ranges(bad)[:8])
            past = f" (at or past its seal's n_tokens={seal.n_tokens})" if seal and bad.max() >= seal.n_tokens else ""
            out.append(f"trajectory {seg.trajectory} site {s.name} tokens {spans}{past}")
