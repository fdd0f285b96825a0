"""Shard encoding (record chunks -> Parquet bytes + manifest) and verified row-group decoding.

A shard is one Parquet file, one row per record chunk, sorted by (trajectory, site,
token_start). Row groups break at a (trajectory, site) boundary once they hold
``min_row_group_bytes`` and always before ``row_group_bytes``, so a pipeline stage reading a few
sites of a trajectory fetches only their row groups. Column compression: code bits are stored
uncompressed (packed low FP4 bits are incompressible: bench/bench_storage.py measured every codec
at 1.00x on them); every other column is zstd level 1: scales and token scales (real E4M3
scales: 0.65x) and the small per-chunk key and checksum columns too (:data:`ZSTD_COLUMNS`;
leaving those uncompressed would save ~10 ms of a ~121 ms encoder thread per 120 MiB shard and
grow it by ~4 KB).
Page checksums are written and verified (a flipped byte in a compressed page otherwise decoded
into wrong data): by Arrow's decoder, or, on local disk, by
:mod:`tracestore.storage.pagecrc` with ISA-L over the memory-mapped bytes the decoder then reads. Every
chunk's own checksum is verified on every read (:func:`read_chunks`).

The manifest (small JSON, written after the shard) lists every chunk's key, row group and
checksum; readers use it to fetch only the row groups they need and to detect swapped or
truncated files. Its chunk index is columns of little-endian integers in base64 (the smallest
unsigned width that holds each column) and, for trajectory and site, a list of distinct names
plus each chunk's index into it; the entries list the row groups' rows in order, so row group and
row are not stored. The manifest is canonical JSON (sorted keys, no whitespace) whose first member,
``"checksum": "crc32:<8 hex digits>"``, is the CRC-32 of the canonical JSON of every other member
(the file's bytes with that member left out: ``{`` followed by everything after its comma). It
is verified on every load (:meth:`Manifest.from_json`), so a damaged manifest is a
:class:`CorruptionError` naming it, never chunks, seals or prefix links silently read wrong.
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tracestore.checksum import crc32_held
from tracestore.errors import ConflictError, CorruptionError, ValidationError
from tracestore.records import (
    _CHECKSUM_TAG,
    PrefixLink,
    RecordChunk,
    TrajectorySeal,
    chunk_checksum_parts,
    crc32,
    crc32_combine,
)
from tracestore.storage import pqconcat
from tracestore.storage.arrow import (
    CHUNK_SCHEMA,
    KEY_COLUMNS,
    SCHEMA_VERSION,
    chunk_from_parts,
    chunks_to_table,
    schema_version_of,
)
from tracestore.storage.pagecrc import verify_pages

MANIFEST_FORMAT = "tracestore.manifest"
MANIFEST_VERSION = 2  # 2: a checksum over the content, the chunk index as binary columns (1: neither)
_CHECKSUM_HEAD = b'{"checksum":"crc32:'
_CHECKSUM_END = len(_CHECKSUM_HEAD) + 10  # 8 hex digits, '",'
SHARD_META_KEY = b"tracestore.shard"

ROW_GROUP_BYTES = 16 << 20
MIN_ROW_GROUP_BYTES = 1 << 20  # 4 MiB wrote ~4% faster but a half-sites read fetched 24 of 30 MB instead of 13
# Local shards are encoded by two Parquet writers at once into two regions of the temp file, then
# joined by collapsing the gap and rewriting the footer (tracestore.storage.pqconcat; where the filesystem
# cannot collapse ranges, one writer): Arrow's writer uses one core, and the zstd scales and page
# checksums that the format requires cost it ~70 of ~100 ms per 120 MB shard. Durable 120 MB
# write_shard, 31 interleaved runs on the loaded 2-core box: median 230 -> 199 ms, min 156 -> 127.
PARALLEL_ENCODE = True
# Shards published from memory (memory://, S3) are encoded in two halves too, joined by one copy
# into the bytes that are published (which the single-writer path copied out anyway), above this
# size (below it a second thread and the footer join cost more than they save).
MEMORY_HALVES_MIN_BYTES = 8 << 20

# Column compression (see module docstring); dictionary only for the repeated strings.
# bench_storage on real quantized tokens: codes 1.00x under every codec; E4M3 scales 0.646x with
# zstd-1, 0.649x with zstd-3, 0.638x with zstd-9 (snappy/lz4 ~1.00x), and zstd-1 encodes fastest.
# Key/metadata columns are zstd as issue 4 specifies; measured: leaving them uncompressed would save
# ~10 ms of a ~121 ms encoder thread per 120 MiB shard and grow it by 4.3 KB (0.004%).
ZSTD_COLUMNS = tuple(name for name in CHUNK_SCHEMA.names if name != "codes")
COMPRESSION: dict[str, str] = {name: ("ZSTD" if name in ZSTD_COLUMNS else "NONE") for name in CHUNK_SCHEMA.names}
ZSTD_LEVEL = 1
DICTIONARY_COLUMNS = ["run", "trajectory", "site"]
STATISTICS_COLUMNS = ["run", "policy_version", "trajectory", "site", "token_start", "n_tokens"]


def shard_name(seq: int) -> str:
    return f"part-{seq:08d}"


@dataclasses.dataclass(frozen=True)
class ChunkEntry:
    """One chunk as the manifest indexes it."""

    trajectory: str
    site: str
    token_start: int
    n_tokens: int
    n_rows: int
    row_group: int
    row: int  # index of the row inside its row group
    checksum: int
    nbytes: int

    @property
    def token_end(self) -> int:
        return self.token_start + self.n_tokens


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What one published shard holds; written after the shard, makes it visible to readers."""

    run: str
    policy_version: int
    writer: str
    seq: int
    shard: str | None  # root-relative path of the Parquet file; None for a seal/link-only write
    shard_bytes: int
    shard_crc32: int
    row_groups: tuple[int, ...]  # rows per row group
    chunks: tuple[ChunkEntry, ...]
    seals: tuple[TrajectorySeal, ...]
    links: tuple[PrefixLink, ...]

    def to_json(self) -> bytes:
        ints = {k: np.array([getattr(c, k) for c in self.chunks], dtype=np.int64) for k in _ENTRY_INTS}
        row_group, row = _rows_in_order(self.row_groups)
        got = (np.array([c.row_group for c in self.chunks], np.int64), np.array([c.row for c in self.chunks], np.int64))
        if not (np.array_equal(got[0], row_group) and np.array_equal(got[1], row)):
            raise ValidationError("manifest chunk entries must list the row groups' rows in order")
        d = _header(self)
        d["chunks"] = {
            "count": len(self.chunks),
            "trajectory": _encode_names([c.trajectory for c in self.chunks]),
            "site": _encode_names([c.site for c in self.chunks]),
            **{k: _encode_ints(v) for k, v in ints.items()},
        }
        return _canonical(d)

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Decode a manifest, verifying its checksum first; CorruptionError naming ``where`` if the
        bytes are damaged, not a v2 manifest, or describe seals or links of another run or version."""
        c = ManifestColumns.from_json(data, where)
        cols = [c.trajectory.to_pylist(), c.site.to_pylist()]
        cols += [
            getattr(c, k).tolist()
            for k in ("token_start", "n_tokens", "n_rows", "row_group", "row", "checksum", "nbytes")
        ]
        chunks = tuple(ChunkEntry(*vals) for vals in zip(*cols, strict=True))
        return cls(
            c.run, c.policy_version, c.writer, c.seq, c.shard, c.shard_bytes, c.shard_crc32, c.row_groups,
            chunks, c.seals, c.links,
        )  # fmt: skip

    @property
    def trajectories(self) -> set[str]:
        out = {c.trajectory for c in self.chunks}
        out.update(s.trajectory for s in self.seals)
        out.update(x.trajectory for x in self.links)
        return out


_ENTRY_INTS = ("token_start", "n_tokens", "n_rows", "checksum", "nbytes")  # stored; row group and row are not
_INT_WIDTHS = {"<u2": 1 << 16, "<u4": 1 << 32, "<u8": 1 << 64}


def _header(m: Manifest | ManifestColumns) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "manifest_version": MANIFEST_VERSION,
        "schema_version": SCHEMA_VERSION,
        "run": m.run,
        "policy_version": m.policy_version,
        "writer": m.writer,
        "seq": m.seq,
        "shard": m.shard,
        "shard_bytes": m.shard_bytes,
        "shard_crc32": m.shard_crc32,
        "row_groups": list(m.row_groups),
        "seals": [s.to_dict() for s in m.seals],
        "links": [x.to_dict() for x in m.links],
    }


def _canonical(d: dict[str, Any]) -> bytes:
    body = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    # "checksum" sorts before every other key, so this is the canonical JSON of the whole manifest
    return b'%s%08x",%s' % (_CHECKSUM_HEAD, crc32(body), body[1:])


def _encode_ints(a: np.ndarray) -> dict[str, str]:
    """Integers >= 0 as ``{"dtype": "<u2"|"<u4"|"<u8", "data": base64 of the little-endian values}``."""
    top = int(a.max()) if a.size else 0
    if a.size and int(a.min()) < 0:
        raise ValidationError(f"manifest integers must be >= 0, got {int(a.min())}")
    dtype = next(k for k, bound in _INT_WIDTHS.items() if top < bound)
    return {"dtype": dtype, "data": base64.b64encode(a.astype(dtype).tobytes()).decode()}


def _decode_ints(obj: Any, n: int, name: str) -> np.ndarray:
    if not isinstance(obj, dict) or obj.get("dtype") not in _INT_WIDTHS or not isinstance(obj.get("data"), str):
        raise ValueError(f"chunk column {name} is not {{dtype, data}}")
    raw = base64.b64decode(obj["data"], validate=True)
    a = np.frombuffer(raw, obj["dtype"])
    if a.shape != (n,):
        raise ValueError(f"chunk column {name} holds {a.size} values, expected {n}")
    if a.dtype == np.uint64 and a.size and int(a.max()) >= 1 << 63:
        raise ValueError(f"chunk column {name} holds a value past int64")
    return a.astype(np.int64)


def _encode_names(names: Sequence[str]) -> dict[str, Any]:
    """Strings as their distinct values (first appearance order) and each one's index."""
    index: dict[str, int] = {}
    codes = np.array([index.setdefault(x, len(index)) for x in names], dtype=np.int64)
    return {"values": list(index), "index": _encode_ints(codes)}


def _decode_names(obj: Any, n: int, name: str) -> pa.StringArray:
    if not isinstance(obj, dict) or not isinstance(obj.get("values"), list):
        raise ValueError(f"chunk column {name} is not {{values, index}}")
    values = pa.array(obj["values"], pa.string())
    index = _decode_ints(obj.get("index"), n, f"{name} index")
    if values.null_count or (n and int(index.max()) >= len(values)):
        raise ValueError(f"chunk column {name}: an index past its {len(values)} values")
    out = values.take(pa.array(index))
    assert isinstance(out, pa.StringArray)
    return out


def _rows_in_order(row_groups: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(row group, row) of every entry when the entries list the row groups' rows in order."""
    sizes = np.array(row_groups, dtype=np.int64).reshape(-1)
    starts = np.cumsum(sizes) - sizes
    return np.repeat(np.arange(len(sizes)), sizes), np.arange(int(sizes.sum())) - np.repeat(starts, sizes)


def manifest_dict(data: bytes, where: str) -> dict[str, Any]:
    """The decoded JSON of a manifest whose checksum verifies (see the module docstring).

    Raises :class:`CorruptionError` naming ``where`` when the checksum does not match, the bytes
    do not start with the checksum member (damaged, or a v1 manifest, which had none), or the
    JSON does not decode to a v2 manifest."""
    view = memoryview(data)
    head = bytes(view[:_CHECKSUM_END])
    stored = None
    if head.startswith(_CHECKSUM_HEAD) and head.endswith(b'",'):
        digits = head[len(_CHECKSUM_HEAD) : -2]
        if all(c in b"0123456789abcdef" for c in digits):
            stored = int(digits, 16)
    if stored is None:
        version = None
        try:
            old = json.loads(data)
            if isinstance(old, dict) and old.get("format") == MANIFEST_FORMAT:
                version = old.get("manifest_version")
        except ValueError:
            pass
        if version == 1:
            raise CorruptionError(
                f"manifest {where} is format v1, which carries no checksum (written by an older "
                f"tracestore); this tracestore reads only checksummed v{MANIFEST_VERSION} manifests: "
                "re-record the data or read it with the tracestore that wrote it"
            )
        raise CorruptionError(
            f"manifest {where} does not start with its checksum (damaged, or not a tracestore "
            f"manifest v{MANIFEST_VERSION})"
        )
    actual = crc32(view[_CHECKSUM_END:], crc32(b"{"))
    if actual != stored:
        raise CorruptionError(
            f"manifest {where} fails its checksum (stored {stored:#010x}, computed {actual:#010x}): "
            "the manifest is damaged"
        )
    try:
        d = json.loads(data)
    except ValueError as exc:  # pragma: no cover - a verified checksum over bytes that never decoded
        raise CorruptionError(f"manifest {where} does not decode ({exc})") from exc
    if not isinstance(d, dict) or d.get("format") != MANIFEST_FORMAT or d.get("manifest_version") != MANIFEST_VERSION:
        got = (d.get("format"), d.get("manifest_version")) if isinstance(d, dict) else type(d).__name__
        raise CorruptionError(f"manifest {where} is {got}, expected a tracestore manifest v{MANIFEST_VERSION}")
    return d


def _dedupe_sorted(chunks: Sequence[RecordChunk]) -> list[RecordChunk]:
    ordered = sorted(chunks, key=lambda c: (c.trajectory, c.site, c.token_start, c.n_tokens))
    out: list[RecordChunk] = []
    for c in ordered:
        prev = out[-1] if out else None
        if prev is not None and (prev.trajectory, prev.site, prev.token_start, prev.n_tokens) == (
            c.trajectory,
            c.site,
            c.token_start,
            c.n_tokens,
        ):
            if not prev.same_bytes(c):
                raise ConflictError(f"{c.key_str}: given twice in one shard with different bytes")
            continue  # an identical retry
        out.append(c)
    return out


def check_shard_inputs(
    run: str,
    policy_version: int,
    chunks: Sequence[RecordChunk],
    seals: Sequence[TrajectorySeal] = (),
    links: Sequence[PrefixLink] = (),
) -> list[RecordChunk]:
    """Check that everything belongs to (run, version); return the chunks sorted and de-duplicated."""
    for c in chunks:
        if c.run != run or c.policy_version != policy_version:
            raise ValidationError(f"{c.key_str}: does not belong to shard run {run} v{policy_version}")
    owners: list[TrajectorySeal | PrefixLink] = [*seals, *links]
    for item in owners:
        if item.run != run or item.policy_version != policy_version:
            raise ValidationError(f"{item!r} does not belong to shard run {run} v{policy_version}")
    return _dedupe_sorted(chunks)


def encode_shard(
    run: str,
    policy_version: int,
    writer: str,
    seq: int,
    shard_path: str,
    chunks: Sequence[RecordChunk],
    seals: Sequence[TrajectorySeal] = (),
    links: Sequence[PrefixLink] = (),
    *,
    row_group_bytes: int = ROW_GROUP_BYTES,
    min_row_group_bytes: int = MIN_ROW_GROUP_BYTES,
    sink: Any = None,
) -> tuple[bytes | memoryview | None, Manifest]:
    """Encode one shard: Parquet bytes (None when there are no chunks) and its manifest.

    Without ``sink`` (memory:// and S3 publish from memory) the bytes are encoded into a buffer of
    :func:`_size_bound` bytes, or, from ``MEMORY_HALVES_MIN_BYTES`` on and on more than one core,
    in two halves at once that are joined into one ``bytes`` (:func:`_encode_halves_in_memory`).

    With ``sink`` the Parquet bytes go into it instead and the returned bytes are None: a
    :class:`tracestore.storage.shardfile.ShardFile` (a native Arrow ``stream``, told of each row group by
    ``progress()``; on more than one core the row groups are then encoded in two halves at once
    and joined in it) or a writable binary file object; either has ``size`` and ``crc32``
    attributes that are final after its ``finish()``.
    """
    ordered = check_shard_inputs(run, policy_version, chunks, seals, links)
    if not ordered:
        manifest = Manifest(run, policy_version, writer, seq, None, 0, 0, (), (), tuple(seals), tuple(links))
        return None, manifest

    # row-group boundaries
    groups: list[tuple[int, int]] = []
    group_bytes: list[int] = []
    start, acc = 0, 0
    for i, c in enumerate(ordered):
        if i > start:
            prev = ordered[i - 1]
            boundary = (prev.trajectory, prev.site) != (c.trajectory, c.site)
            if acc + c.nbytes > row_group_bytes or (boundary and acc >= min_row_group_bytes):
                groups.append((start, i - start))
                group_bytes.append(acc)
                start, acc = i, 0
        acc += c.nbytes
    groups.append((start, len(ordered) - start))
    group_bytes.append(acc)

    shard_meta = json.dumps(
        {"run": run, "policy_version": policy_version, "writer": writer, "seq": seq},
        sort_keys=True,
    ).encode()
    schema = CHUNK_SCHEMA.with_metadata({**(CHUNK_SCHEMA.metadata or {}), SHARD_META_KEY: shard_meta})
    # The row groups' Arrow tables (zero-copy views of the chunks' arrays, ~12 ms of Python per
    # 120 MB shard) and their chunk checksums are built on the worker pool while the Parquet
    # writer, which releases the GIL, encodes the row groups that are ready.
    sizes = [n for _, n in groups]
    native = getattr(sink, "stream", None)
    split = len(groups)
    two = native is not None or (sink is None and sum(group_bytes) >= MEMORY_HALVES_MIN_BYTES)
    if two and PARALLEL_ENCODE and (os.cpu_count() or 1) > 1 and len(groups) > 1:
        split = _halfway(group_bytes)
    # submitted in the order the writers need them: with two halves, alternately
    pairs = itertools.zip_longest(range(split), range(split, len(groups)))
    order = [g for pair in pairs for g in pair if g is not None]
    submitted = {g: _verify_pool().submit(_group_table, ordered[groups[g][0] : sum(groups[g])], schema) for g in order}
    futures = [submitted[g] for g in range(len(groups))]
    data: bytes | memoryview | None = None
    joined = False  # encoded in two halves and joined
    if split < len(groups) and sink is None:
        data = _encode_halves_in_memory(ordered, groups, schema, sizes, futures, split)
        joined = data is not None
    elif split < len(groups) and sink.can_collapse():
        joined = _encode_halves(sink, schema, sizes, futures, split, _size_bound(ordered[: groups[split][0]], split))
        if not joined:
            sink.restart()
    if not joined:  # one writer
        # A native sink (tracestore.storage.shardfile.ShardFile: ``stream`` + ``progress()``) is written without
        # the GIL and told after each row group; a Python sink gets the bytes through Arrow's buffered
        # stream: the Parquet writer's many small writes reach Python as ~1 MiB blocks, not one call each.
        if sink is None:
            # Into one buffer sized by the bound: a growing BufferOutputStream reallocates (copy +
            # fresh pages, twice the shard in all), which cost a memory:// or S3 sidecar more system
            # time than the encoding itself (page zeroing; bench_ingest, perf).
            mem = pa.allocate_buffer(_size_bound(ordered, len(groups)))
            out: Any = pa.FixedSizeBufferWriter(mem)
        elif native is not None:
            out = sink.stream  # (a new one if the two halves had to be redone in one piece)
        else:
            out = pa.BufferedOutputStream(pa.PythonFile(sink, "w"), 1 << 20)
        try:
            _write_groups(out, schema, sizes, futures, None if native is None else lambda: sink.progress(out.tell()))
        except (OSError, pa.ArrowException):
            if sink is not None:
                raise
            # _size_bound is an upper bound by construction; should a codec ever outgrow it, the
            # shard is still written (into a growing buffer) instead of failing
            mem, out = None, pa.BufferOutputStream()
            _write_groups(out, schema, sizes, futures, None)
        if sink is not None and not out.closed:
            out.close()  # flushes the buffered tail into the sink
        if sink is None:  # no copy: published straight from Arrow's buffer
            data = memoryview(out.getvalue()) if mem is None else memoryview(mem)[: out.tell()]
            out.close()
    if data is not None:
        size, crc = len(data), crc32(data)
    else:
        sink.finish()  # the running crc is final once every byte is written
        size, crc = int(sink.size), int(sink.crc32)
    crcs = [c for fut in futures for c in fut.result()[0]]

    entries = []
    for g, (a, n) in enumerate(groups):
        for r in range(n):
            c = ordered[a + r]
            entries.append(
                ChunkEntry(c.trajectory, c.site, c.token_start, c.n_tokens, c.n_rows, g, r, crcs[a + r], c.nbytes)
            )
    manifest = Manifest(
        run,
        policy_version,
        writer,
        seq,
        shard_path,
        size,
        crc,
        tuple(n for _, n in groups),
        tuple(entries),
        tuple(seals),
        tuple(links),
    )
    return data, manifest


def open_parquet(
    f: Any, where: str, metadata: pq.FileMetaData | None = None, *, verify_pages: bool = True
) -> pq.ParquetFile:
    """ParquetFile over a file handle with page-checksum verification; CorruptionError if unreadable.

    ``verify_pages=False`` only for a reader that verifies the pages itself
    (:func:`read_chunks` with ``pages=``, over the same bytes).
    """
    try:
        return pq.ParquetFile(f, metadata=metadata, page_checksum_verification=verify_pages, pre_buffer=verify_pages)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise CorruptionError(f"shard {where}: not a readable Parquet file ({exc})") from exc


@dataclasses.dataclass(frozen=True)
class StoredChunk:
    """One verified chunk of a shard as read: read-only views into the decoded Arrow buffers.

    ``codes`` uint8 ``[n_rows, code_bytes]``, ``scales`` uint8 ``[n_rows, scale_bytes]``,
    ``token_scales`` float32 ``[n_rows]`` or None; the key is ``entry`` (checked, see
    :func:`read_chunks`).
    """

    entry: ChunkEntry
    codes: np.ndarray
    scales: np.ndarray
    global_scale: float
    token_scales: np.ndarray | None


# Columns a read decodes: the key columns and the stored checksum are not needed because every
# chunk's checksum is recomputed over the manifest's key together with the stored bytes and
# compared with the manifest's (a row holding another key or other bytes cannot match); skipping
# them saves 8 column chunks per row group (the stored checksum alone: ~10 of ~160 ms CPU per
# 192 MiB GuidanceReader read of sidecar shards). Full validation (``keys=True``) reads them all.
DATA_COLUMNS = ["global_scale", "codes", "scales", "token_scales"]
# Row groups decode in batches of about this size on the worker pool, each verified and placed
# as it lands (a 30 MB plan read: 4 batches; 8 and 16 MiB measured alike, 24 vs 25 ms median).
READ_BATCH_BYTES = 8 << 20
DECODE_THREADS = False  # parallelism comes from concurrent batches, not from Arrow's column threads


def read_chunks(
    source: pq.ParquetFile | Callable[[pq.FileMetaData | None], pq.ParquetFile],
    manifest: Manifest,
    entries: Sequence[ChunkEntry],
    where: str,
    *,
    on_batch: Callable[[list[StoredChunk]], None] | None = None,
    keys: bool = False,
    pages: memoryview | None = None,
    hold_gil: bool = False,
) -> dict[ChunkEntry, StoredChunk]:
    """Read the row groups holding ``entries``; return their chunks, each verified.

    Every chunk's checksum is recomputed (:func:`tracestore.records.chunk_checksum`) over the
    manifest's key and the stored bytes and must equal the manifest's value, so a flipped byte,
    a truncated file or another shard's file in this place raises :class:`CorruptionError`
    naming the shard and the chunk. Parquet page checksums are verified by the decoder
    (:func:`open_parquet`). ``keys=True`` also decodes the key columns and the stored checksum
    and compares them with the manifest (full validation, ``tracestore inspect``).

    ``source`` is a ParquetFile (batches decode one after another on it) or a function
    ``open(footer_or_None)`` that opens one over a thread-safe file such as a memory map (batches
    of ~:data:`READ_BATCH_BYTES` then decode concurrently on the worker pool). ``on_batch(chunks)``
    is called with each verified batch as soon as it is verified, in the thread that decoded it
    (with a function ``source``, several batches may be handed over at once from different
    threads: ``on_batch`` must be thread-safe), so a caller can place rows as they land.

    ``pages``: the whole file's bytes (a memory map). Every page of the column chunks decoded is
    then verified here with ISA-L crc32 (:mod:`tracestore.storage.pagecrc`) before decoding, and ``source``
    opens the file with ``verify_pages=False`` over those same bytes (Arrow's own check costs
    ~5x more CPU).

    ``hold_gil``: the page and chunk CRCs of up to 1 MiB keep the GIL (for a read in a background
    thread beside a thread that is busy in Python; see :func:`tracestore.storage.reader._copy_held`).
    """
    by_group: dict[int, list[ChunkEntry]] = {}
    for e in entries:
        by_group.setdefault(e.row_group, []).append(e)
    if not by_group:
        return {}
    pf = source if isinstance(source, pq.ParquetFile) else source(None)
    version = schema_version_of(pf.schema_arrow)
    if version != SCHEMA_VERSION:
        raise CorruptionError(f"shard {where}: schema version {version}, this tracestore reads {SCHEMA_VERSION}")
    md = pf.metadata
    if md.num_row_groups != len(manifest.row_groups):
        raise CorruptionError(
            f"shard {where}: has {md.num_row_groups} row groups, its manifest lists "
            f"{len(manifest.row_groups)} (file replaced or truncated)"
        )
    for g in by_group:
        if md.row_group(g).num_rows != manifest.row_groups[g]:
            raise CorruptionError(
                f"shard {where}: row group {g} holds {md.row_group(g).num_rows} rows, manifest says "
                f"{manifest.row_groups[g]} (file replaced?)"
            )
    # batches of about READ_BATCH_BYTES, balanced (the last one is not a small leftover)
    sizes = [(g, sum(e.nbytes for e in by_group[g])) for g in sorted(by_group)]
    total = sum(n for _, n in sizes)
    target = total / max(1, min(len(sizes), round(total / READ_BATCH_BYTES)))
    batches: list[list[int]] = [[]]
    acc = 0
    for g, n in sizes:
        if batches[-1] and acc >= target * len(batches) - n / 2:
            batches.append([])
        batches[-1].append(g)
        acc += n

    def decode(batch: list[int], bpf: pq.ParquetFile) -> list[StoredChunk]:
        codes = None
        if pages is not None:
            codes = _verify_pages(bpf.metadata, batch, _columns(keys), pages, where, by_group, hold_gil)
        entries_of = [e for g in batch for e in by_group[g]]
        return _read_batch(bpf, manifest, batch, entries_of, where, keys, codes, hold_gil)

    def done(chunks: list[StoredChunk]) -> list[StoredChunk]:
        if on_batch is not None:
            on_batch(chunks)
        return chunks

    results: list[list[StoredChunk]] = []
    if isinstance(source, pq.ParquetFile) or len(batches) == 1:
        results = [done(decode(batch, pf)) for batch in batches]
    else:
        meta = pf.metadata
        opener = source

        def decode_own(batch: list[int]) -> list[StoredChunk]:
            return done(decode(batch, opener(meta)))

        # Each worker decodes, verifies and hands its batch to on_batch itself; the calling thread
        # does the same with the first batch. Placing is mostly numpy copies, which release the
        # GIL, so it runs on every core instead of queuing behind the calling thread while the
        # workers wait (placing in the calling thread only: bench_ingest --only read, 7 runs of
        # 3 reps each, alternated, ratio to raw Parquet median 0.826 / mean 0.80; placing in the
        # workers: 0.839 / 0.87, on a 2-core box whose runs vary 0.65-0.92 on their own).
        futures = [_verify_pool().submit(decode_own, batch) for batch in batches[1:]]
        try:
            results = [done(decode(batches[0], pf))] + [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()
    return {c.entry: c for batch in results for c in batch}


def read_entries(
    pf: pq.ParquetFile, manifest: Manifest, entries: Sequence[ChunkEntry], where: str
) -> dict[ChunkEntry, RecordChunk]:
    """Read and fully validate ``entries`` (key columns too) as :class:`RecordChunk` objects."""
    out = {}
    for e, c in read_chunks(pf, manifest, entries, where, keys=True).items():
        key = {
            "run": manifest.run,
            "policy_version": manifest.policy_version,
            "trajectory": e.trajectory,
            "site": e.site,
            "token_start": e.token_start,
            "n_tokens": e.n_tokens,
            "n_rows": e.n_rows,
        }
        ts = None if c.token_scales is None else c.token_scales.view(np.uint8)
        out[e] = chunk_from_parts(
            key, c.global_scale, e.checksum, c.codes.reshape(-1), c.scales.reshape(-1), ts, verify=False, where=where
        )
    return out


def _byte_views(col: pa.ChunkedArray) -> list[np.ndarray | None]:
    """Zero-copy uint8 views of every value of a (large_)binary column; None for nulls."""
    out: list[np.ndarray | None] = []
    for arr in col.chunks:
        if arr.type == pa.binary():
            arr = arr.cast(pa.large_binary())
        _, off_buf, data_buf = arr.buffers()
        offsets = np.frombuffer(off_buf, dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1].tolist()
        data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        if arr.null_count:
            valid = arr.is_valid().to_numpy(zero_copy_only=False).tolist()
            out += [data[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(len(arr))]
        else:
            out += [data[offsets[i] : offsets[i + 1]] for i in range(len(arr))]
    return out


def _columns(keys: bool) -> list[str]:
    return list(CHUNK_SCHEMA.names) if keys else DATA_COLUMNS


def _chunk_desc(e: ChunkEntry) -> str:
    return f"chunk (trajectory {e.trajectory}, site {e.site}, tokens [{e.token_start}, {e.token_end}))"


def _describe(entries: Sequence[ChunkEntry]) -> str:
    desc = "; ".join(_chunk_desc(e) for e in entries[:3])
    return desc + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")


def _verify_pages(
    md: pq.FileMetaData,
    groups: list[int],
    columns: list[str],
    pages: memoryview,
    where: str,
    by_group: dict[int, list[ChunkEntry]],
    hold_gil: bool = False,
) -> list[np.ndarray] | None:
    """Verify every page of ``columns`` in ``groups``; return the codes values of those groups
    (zero-copy views of the pages, row order) when their pages allow it, else None.

    Codes are stored uncompressed and PLAIN, so their values are used where they lie in the
    memory map instead of being copied by Arrow's decoder and copied again into the output
    (each value is covered by its page checksum here and by its chunk checksum later)."""
    names = md.schema.to_arrow_schema().names
    codes: list[np.ndarray] | None = [] if "codes" in columns else None
    for g in groups:
        rg = md.row_group(g)
        for name in columns:
            i = names.index(name)
            cc = rg.column(i)
            start = cc.data_page_offset
            if cc.has_dictionary_page and cc.dictionary_page_offset:
                start = cc.dictionary_page_offset
            end = start + cc.total_compressed_size
            if start < 4 or end > len(pages):
                raise CorruptionError(f"shard {where}: row group {g} column {name} lies outside the file")
            values: list[memoryview] | None = None
            if name == "codes" and codes is not None:
                col = md.schema.column(i)
                plain_ok = (
                    cc.compression == "UNCOMPRESSED"
                    and cc.physical_type == "BYTE_ARRAY"
                    and col.max_definition_level == 0
                    and col.max_repetition_level == 0
                )
                values = [] if plain_ok else None
            try:
                verify_pages(pages[start:end], f"column {name}", values, hold_gil=hold_gil)
            except CorruptionError as exc:
                raise CorruptionError(f"shard {where}: row group {g} holding {_describe(by_group[g])}: {exc}") from None
            if codes is not None and name == "codes":
                if values is None or len(values) != rg.num_rows:
                    codes = None
                else:
                    codes += [np.frombuffer(v, dtype=np.uint8) for v in values]
    return codes


def _read_batch(
    pf: pq.ParquetFile,
    manifest: Manifest,
    groups: list[int],
    entries: list[ChunkEntry],
    where: str,
    keys: bool,
    codes_values: list[np.ndarray] | None = None,
    hold_gil: bool = False,
) -> list[StoredChunk]:
    """Decode some row groups and verify every wanted chunk (see :func:`read_chunks`).

    ``codes_values``: the codes of every row of ``groups`` already located (page-verified) in
    the file's bytes; the codes column is then not decoded."""
    columns = _columns(keys)
    if codes_values is not None:
        columns = [c for c in columns if c != "codes"]
    try:
        table = pf.read_row_groups(groups, columns=columns, use_threads=DECODE_THREADS)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise CorruptionError(
            f"shard {where}: row groups {groups} holding {_describe(entries)} fail to decode: {exc}"
        ) from exc
    base = {}
    row = 0
    for g in groups:
        base[g] = row
        row += manifest.row_groups[g]
    if table.num_rows != row:
        raise CorruptionError(f"shard {where}: row groups {groups} hold {table.num_rows} rows, manifest says {row}")
    g_col = table.column("global_scale").to_numpy()
    crc = table.column("checksum").to_numpy() if "checksum" in table.column_names else None
    codes: list[np.ndarray | None] = list(codes_values) if codes_values is not None else _byte_views(table["codes"])
    scales, tscales = (_byte_views(table.column(n)) for n in ("scales", "token_scales"))
    key_cols = {n: table.column(n).to_pylist() for n in KEY_COLUMNS} if keys else {}
    out = []
    run, version = manifest.run, manifest.policy_version
    gs_all = g_col.tolist()
    # per chunk only what the checks need (this loop holds the GIL while the other decode
    # workers wait for it): the parts are contiguous 1-D views, hashed as they lie
    for e in entries:
        j = base[e.row_group] + e.row
        if keys or crc is not None:
            expect = (run, version, e.trajectory, e.site, e.token_start, e.n_tokens, e.n_rows)
            got = tuple(key_cols[k][j] for k in KEY_COLUMNS) if keys else expect
            stored = e.checksum if crc is None else int(crc[j])  # read in full validation only
            if got != expect or stored != e.checksum:
                raise CorruptionError(
                    f"shard {where}: {_chunk_desc(e)} in row group {e.row_group} row {e.row} holds "
                    f"{got[2:5] if keys else 'another chunk'} (checksum {stored:#010x}, manifest "
                    f"{e.checksum:#010x}): wrong file in place?"
                )
        c, s, ts = codes[j], scales[j], tscales[j]
        n = e.n_rows
        if c is None or s is None or c.size % n or s.size % n or (ts is not None and ts.size != 4 * n):
            raise CorruptionError(f"shard {where}: {_chunk_desc(e)}: stored byte lengths do not divide into {n} rows")
        cb, sb = c.size // n, s.size // n
        gs = gs_all[j]
        actual = chunk_checksum_parts(
            run, version, e.trajectory, e.site, e.token_start, e.n_tokens, n, cb, sb, [c], [s], gs,
            None if ts is None else [ts], crc_fn=crc32_held if hold_gil else None,
        )  # fmt: skip
        c2, s2 = c.reshape(n, cb), s.reshape(n, sb)
        t4 = None if ts is None else ts.view("<f4")
        if actual != e.checksum:
            raise CorruptionError(
                f"shard {where}: {_chunk_desc(e)}: checksum mismatch "
                f"(stored {e.checksum:#010x}, computed {actual:#010x})"
            )
        out.append(StoredChunk(e, c2, s2, gs, t4))
    return out


_WRITER_OPTIONS: dict[str, Any] = {
    "compression": COMPRESSION,
    "compression_level": {n: ZSTD_LEVEL for n, c in COMPRESSION.items() if c == "ZSTD"},
    "use_dictionary": DICTIONARY_COLUMNS,
    "write_statistics": STATISTICS_COLUMNS,
    "write_page_checksum": True,
    "data_page_size": 1 << 20,
}


def _write_groups(
    out: Any,
    schema: pa.Schema,
    sizes: Sequence[int],
    futures: Sequence[concurrent.futures.Future[tuple[list[int], pa.Table]]],
    after_group: Callable[[], None] | None,
) -> None:
    with pq.ParquetWriter(out, schema, **_WRITER_OPTIONS) as w:
        for n, fut in zip(sizes, futures, strict=True):
            w.write_table(fut.result()[1], row_group_size=n)
            if after_group is not None:
                after_group()


def _halfway(group_bytes: Sequence[int]) -> int:
    """The index that splits ``group_bytes`` into two runs of most nearly equal total (>= 1 each)."""
    total, acc = sum(group_bytes), 0
    best, best_gap = 1, total
    for i, n in enumerate(group_bytes[:-1], start=1):
        acc += n
        if abs(total - 2 * acc) < best_gap:
            best, best_gap = i, abs(total - 2 * acc)
    return best


def _encode_halves(
    sink: Any,
    schema: pa.Schema,
    sizes: Sequence[int],
    futures: Sequence[concurrent.futures.Future[tuple[list[int], pa.Table]]],
    split: int,
    bound: int,
) -> bool:
    """Encode row groups ``[0, split)`` into ``sink.stream`` on a second thread while this thread
    encodes the rest into the same file from a far, block-aligned offset (``bound`` bytes hold the
    first half for sure; the gap is a hole); each thread checksums and starts the writeback of its
    own bytes as it goes. Then the first half's footer is overwritten with zeros up to a block
    boundary, the gap collapsed (no data moves, :meth:`ShardFile.collapse`), and the second half's
    footer replaced by one listing both (:mod:`tracestore.storage.pqconcat`), checked against what the
    writers wrote. Returns False, leaving the file to be rewritten by one writer, if the first
    half outgrew ``bound`` or the halves could not be joined."""
    blk = sink.block_size
    gap_end = -(-(bound + 8) // blk) * blk
    first_region = sink.region(0)
    errors: list[BaseException] = []

    sizes_out: list[int] = []

    def first() -> None:
        try:
            out = sink.stream
            _write_groups(out, schema, sizes[:split], futures[:split], lambda: _advance(out, first_region))
            sizes_out.append(out.tell())
            out.close()
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    out2 = sink.open_at(gap_end)  # before the first half writes anything
    second_region = sink.region(gap_end)
    thread = threading.Thread(target=first, name="tracestore-encode", daemon=True)
    thread.start()
    try:
        _write_groups(out2, schema, sizes[split:], futures[split:], lambda: _advance(out2, second_region))
        out2.close()
        size = sink.file_size()
        try:  # while the first half may still be encoding
            body2, footer2 = pqconcat.read_footer(lambda off, n: sink.pread(gap_end + off, n), size - gap_end)
            second_region.advance(gap_end + body2)
            walked = pqconcat.Footer(footer2)
        except CorruptionError as exc:
            errors.append(exc)  # unless the first half overwrote it, raised below
    finally:
        thread.join()
    if sizes_out and sizes_out[0] > gap_end:
        return False  # the first half ran into the second: re-encode in one piece
    if errors:
        raise errors[0]
    first_size = sizes_out[0]
    body1, footer1 = pqconcat.read_footer(sink.pread, first_size)
    first_region.advance(body1)
    pad_end = -(-body1 // blk) * blk
    pad = bytes(pad_end - body1)
    try:
        if pad:
            sink.write_at(body1, [pad])
        sink.collapse(pad_end, gap_end - pad_end)  # the second file's bytes now start at pad_end
        tail = pqconcat.footer_tail(pqconcat.join_footers(footer1, walked, pad_end - gap_end))
        end = sink.write_at(pad_end + body2, tail, last=True)
        footer2_md = pq.ParquetFile(pa.BufferReader(b"".join([pqconcat.MAGIC, *pqconcat.footer_tail(footer2)])))
        _check_joined(pa.memory_map(sink.path), sink.path, sizes, footer2_md.metadata, split, pad_end - gap_end)
    except (OSError, CorruptionError, pa.ArrowException):
        return False  # the filesystem or the footers did not let the halves join: one writer instead
    crc = crc32_combine(crc32(pad, first_region.crc32), second_region.crc32, body2)
    for part in tail:
        crc = crc32(part, crc)
    sink.finish(end, crc)
    return True


def _encode_halves_in_memory(
    ordered: Sequence[RecordChunk],
    groups: Sequence[tuple[int, int]],
    schema: pa.Schema,
    sizes: Sequence[int],
    futures: Sequence[concurrent.futures.Future[tuple[list[int], pa.Table]]],
    split: int,
) -> bytes | None:
    """A shard for memory:// or S3 (published from memory): row groups ``[0, split)`` encoded on a
    second thread into one buffer while this thread encodes the rest into another, then joined
    into the one ``bytes`` the storage publishes (the copy publishing made anyway): the first file
    without its footer, the second file, and a footer listing both (:mod:`tracestore.storage.pqconcat`),
    checked against what the writers wrote. None (encode in one piece) if a half outgrew its
    buffer or the footers did not join."""
    halves = [ordered[: groups[split][0]], ordered[groups[split][0] :]]
    bufs = [pa.allocate_buffer(_size_bound(h, n)) for h, n in zip(halves, (split, len(groups) - split), strict=True)]
    ends: list[int] = [0, 0]
    errors: list[BaseException] = []

    def encode(i: int, lo: int, hi: int) -> None:
        try:
            out = pa.FixedSizeBufferWriter(bufs[i])
            _write_groups(out, schema, sizes[lo:hi], futures[lo:hi], None)
            ends[i] = out.tell()
            out.close()
        except (OSError, pa.ArrowException) as exc:  # a half outgrew its bound
            errors.append(exc)

    thread = threading.Thread(target=encode, args=(0, 0, split), name="tracestore-encode", daemon=True)
    thread.start()
    try:
        encode(1, split, len(groups))
    finally:
        thread.join()
    if errors:
        return None
    first, second = memoryview(bufs[0])[: ends[0]], memoryview(bufs[1])[: ends[1]]
    try:
        body1, footer1 = pqconcat.split_file(first)
        body2, footer2 = pqconcat.split_file(second)
        walked = pqconcat.Footer(footer2)
        tail = pqconcat.footer_tail(pqconcat.join_footers(footer1, walked, body1))  # second's byte 0 at body1
    except CorruptionError:
        return None
    data = b"".join([first[:body1], second[:body2], *tail])
    try:
        second_md = pq.ParquetFile(pa.BufferReader(second)).metadata
        _check_joined(pa.BufferReader(data), "the shard in memory", sizes, second_md, split, body1)
    except (CorruptionError, pa.ArrowException):
        return None
    return data


def _advance(out: Any, region: Any) -> None:
    out.flush()  # what the region reads back must be in the file (the rest of it is a hole)
    region.advance(out.tell())


def _size_bound(chunks: Sequence[RecordChunk], n_groups: int) -> int:
    """More bytes than a Parquet file of ``chunks`` in ``n_groups`` row groups can take: payload
    (zstd never grows a page by more than ~0.4 %), 4-byte value lengths and key columns, page
    headers (pages of 1 MiB), column-chunk metadata in the footer, and 1 MiB to spare."""
    payload = sum(c.nbytes for c in chunks)
    keys = sum(64 + len(c.run) + len(c.trajectory) + len(c.site) for c in chunks)
    pages = payload // (1 << 20) + 12 * n_groups
    return int(payload * 1.01) + 2 * keys + 256 * pages + 4096 * 12 * n_groups + (1 << 20)


def _check_joined(
    source: Any, where: str, sizes: Sequence[int], second: pq.FileMetaData, split: int, delta: int
) -> None:
    """The joined file's footer, as Arrow reads it, lists ``sizes`` rows per row group and the
    second file's column chunks at their old offsets + ``delta``."""
    md = pq.ParquetFile(source).metadata
    ok = md.num_row_groups == len(sizes) and md.num_rows == sum(sizes)
    for g in range(md.num_row_groups if ok else 0):
        rg = md.row_group(g)
        ok = ok and rg.num_rows == sizes[g]
        if ok and g >= split:
            old = second.row_group(g - split)
            for c in (0, rg.num_columns - 1):
                ok = ok and rg.column(c).data_page_offset == old.column(c).data_page_offset + delta
    if not ok:
        raise CorruptionError(f"joining the two encoded halves of {where} gave a footer that does not match them")


def _group_table(chunks: Sequence[RecordChunk], schema: pa.Schema) -> tuple[list[int], pa.Table]:
    crcs = [c.checksum for c in chunks]
    return crcs, chunks_to_table(chunks, crcs, zero_copy=True).replace_schema_metadata(schema.metadata)


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
# Batches decode on at most this many extra threads (besides each shard's loading thread). The
# decode is GIL-bound (page walks, per-chunk checks and placing hold it between Arrow's and
# ISA-L's releases): a 198 MiB plan read (2 shards) on a 16-core host ran 1.40 / 1.78 / 1.76 /
# 1.63 / 1.46 GB/s with 1 / 2 / 3 / 4 / 8 workers (medians of 5); more threads only queue on the GIL.
VERIFY_WORKERS = 2


def _verify_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(VERIFY_WORKERS, os.cpu_count() or 1), thread_name_prefix="tracestore-crc"
        )
    return _POOL


# ---------------------------------------------------------------------------- full validation
# Checking every chunk of a shard at once (``tracestore inspect --validate``): the manifest as
# columns, and every chunk's checksum from a few passes over the decoded columns instead of one
# Python object per chunk (a decode shard holds ~300,000 chunks of one token).


@dataclasses.dataclass(frozen=True)
class ManifestColumns:
    """A manifest with its chunk index as columns (:meth:`from_json`), rows in shard order.

    ``trajectory`` and ``site`` are Arrow string arrays; the other entry fields int64 arrays. The
    entries list the row groups' rows in order (``row`` counts from 0 in each), so
    :meth:`groups` is a slice. :class:`Manifest` decodes through this (one entry object per chunk).
    """

    where: str
    run: str
    policy_version: int
    writer: str
    seq: int
    shard: str | None
    shard_bytes: int
    shard_crc32: int
    row_groups: tuple[int, ...]
    trajectory: pa.StringArray
    site: pa.StringArray
    token_start: np.ndarray
    n_tokens: np.ndarray
    n_rows: np.ndarray
    row_group: np.ndarray
    row: np.ndarray
    checksum: np.ndarray
    nbytes: np.ndarray
    seals: tuple[TrajectorySeal, ...]
    links: tuple[PrefixLink, ...]

    @classmethod
    def from_json(cls, data: bytes, where: str) -> ManifestColumns:
        """Decode a manifest (checksum verified, :func:`manifest_dict`) into columns;
        CorruptionError naming ``where`` if it does not decode to a well-formed manifest."""
        d = manifest_dict(data, where)
        try:
            c = d["chunks"]
            n = c["count"]
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"chunk count {n!r}")
            ints = {k: _decode_ints(c[k], n, k) for k in _ENTRY_INTS}
            row_groups = tuple(int(x) for x in d["row_groups"])
            if any(x < 1 for x in row_groups) or sum(row_groups) != n:
                raise ValueError(f"row groups {row_groups[:8]} do not hold the {n} chunks")
            row_group, row = _rows_in_order(row_groups)
            m = cls(
                where,
                str(d["run"]),
                int(d["policy_version"]),
                str(d["writer"]),
                int(d["seq"]),
                d["shard"],
                int(d["shard_bytes"]),
                int(d["shard_crc32"]),
                row_groups,
                _decode_names(c["trajectory"], n, "trajectory"),
                _decode_names(c["site"], n, "site"),
                ints["token_start"],
                ints["n_tokens"],
                ints["n_rows"],
                row_group,
                row,
                ints["checksum"],
                ints["nbytes"],
                tuple(TrajectorySeal.from_dict(s) for s in d["seals"]),
                tuple(PrefixLink.from_dict(x) for x in d["links"]),
            )
            if n and not isinstance(m.shard, str):
                raise ValueError("chunks but no shard")
        except (ValueError, KeyError, TypeError, OverflowError, binascii.Error, pa.ArrowException) as exc:
            raise CorruptionError(
                f"manifest {where} does not decode ({exc}); expected a tracestore manifest v{MANIFEST_VERSION}"
            ) from exc
        owned: tuple[TrajectorySeal | PrefixLink, ...] = (*m.seals, *m.links)
        for item in owned:
            if item.run != m.run or item.policy_version != m.policy_version:
                kind = "seal" if isinstance(item, TrajectorySeal) else "prefix link"
                raise CorruptionError(
                    f"manifest {where} of run {m.run} v{m.policy_version} holds a {kind} of run {item.run} "
                    f"v{item.policy_version} ({item.trajectory})"
                )
        return m

    def __len__(self) -> int:
        return len(self.trajectory)

    def groups(self, g0: int, g1: int) -> ManifestColumns:
        """The entries of row groups ``[g0, g1)`` only (everything else unchanged)."""
        a, b = int(sum(self.row_groups[:g0])), int(sum(self.row_groups[:g1]))
        names = ("trajectory", "site", "row_group", "row", *_ENTRY_INTS)
        cut: dict[str, Any] = {k: getattr(self, k)[a:b] for k in names}
        return dataclasses.replace(self, **cut)

    def describe(self, j: int) -> str:
        return (
            f"chunk (trajectory {self.trajectory[j]}, site {self.site[j]}, tokens "
            f"[{self.token_start[j]}, {self.token_start[j] + self.n_tokens[j]})) in row group "
            f"{self.row_group[j]} row {self.row[j]}"
        )


_HEAD = np.dtype(
    [("pv", "<i8"), ("ts", "<i8"), ("nt", "<i8"), ("nr", "<i8"), ("cb", "<i8"), ("sb", "<i8"), ("g", "<f4")]
)  # the packed "<qqqqqqf" of the chunk checksum's head (tracestore.records._checksum_head)
VALIDATE_BATCH_BYTES = 64 << 20  # row groups decoded at once by verify_shard


@functools.lru_cache(maxsize=1024)
def _shift_tables(n: int) -> np.ndarray:
    """Byte tables of the GF(2)-linear map ``c -> crc32_combine(c, 0, n)`` (uint32 [4, 256])."""
    cols = [crc32_combine(1 << i, 0, n) for i in range(32)]
    b = np.arange(256, dtype=np.uint32)
    out = np.zeros((4, 256), dtype=np.uint32)
    for k in range(4):
        for i in range(8):
            out[k] ^= ((b >> i) & 1) * np.uint32(cols[8 * k + i])
    return out


def crc32_combine_many(crc1: np.ndarray, crc2: np.ndarray | int, len2: np.ndarray | int) -> np.ndarray:
    """``crc32_combine`` elementwise (uint32 arrays; ``len2`` int64 or one length for all): the
    CRC-32 of each ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``, one table lookup per
    byte of ``crc1``."""
    crc1 = np.asarray(crc1, dtype=np.uint32)
    out = np.empty_like(crc1)
    lens = np.asarray(len2, dtype=np.int64)
    one = lens.ndim == 0 or not lens.size or lens.min() == lens.max()
    for n in [int(lens.flat[0]) if lens.size else 0] if one else np.unique(lens).tolist():
        t = _shift_tables(n)
        sel = slice(None) if one else lens == n
        x = crc1[sel]
        y = t[0][x & 255]
        y ^= t[1][(x >> 8) & 255]
        y ^= t[2][(x >> 16) & 255]
        y ^= t[3][x >> 24]
        out[sel] = y
    out ^= np.asarray(crc2, dtype=np.uint32)
    return out


def _binary_parts(col: pa.ChunkedArray) -> list[tuple[np.ndarray, memoryview, np.ndarray | None]]:
    """Per Arrow chunk of a (large_)binary column: value offsets (n + 1), the data buffer, and
    the validity (bool) when there are nulls."""
    out = []
    for arr in col.chunks:
        if arr.type == pa.binary():
            arr = arr.cast(pa.large_binary())
        _, off_buf, data_buf = arr.buffers()
        offsets = np.frombuffer(off_buf, dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
        valid = arr.is_valid().to_numpy(zero_copy_only=False) if arr.null_count else None
        out.append((offsets, memoryview(data_buf if data_buf is not None else b""), valid))
    return out


def _first_false(ok: np.ndarray) -> int | None:
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if bad.size else None


def verify_shard(
    source: Any,
    cols: ManifestColumns,
    where: str,
    *,
    sites: dict[str, tuple[int, int, int]] | None = None,
    use_threads: bool = False,
) -> str | None:
    """Fully verify the row groups of a shard that ``cols`` lists (all of the manifest's, or a
    slice from :meth:`ManifestColumns.groups`); return the first problem found, or None.

    ``source``: the shard file (a memory map or any ``pyarrow`` readable file). Every page
    checksum of those row groups (Arrow's decoder), every key column and stored checksum against
    the manifest, every chunk's byte lengths against its row count (and against
    ``sites[name] = (code_bytes, scale_bytes, rows_per_token)`` when given), and every chunk's
    checksum (:func:`tracestore.records.chunk_checksum`), computed over whole columns at once.
    The whole file's crc32 is not checked here (the caller has the bytes).
    """
    try:
        pf = pq.ParquetFile(source, page_checksum_verification=True)
        version = schema_version_of(pf.schema_arrow)
        md = pf.metadata
    except (OSError, pa.ArrowException, ValueError) as exc:
        return f"shard {where}: not a readable Parquet file ({exc})"
    if version != SCHEMA_VERSION:
        return f"shard {where}: schema version {version}, this tracestore reads {SCHEMA_VERSION}"
    if md.num_row_groups != len(cols.row_groups):
        return (
            f"shard {where}: has {md.num_row_groups} row groups, its manifest lists {len(cols.row_groups)} "
            "(file replaced or truncated)"
        )
    for g, n in enumerate(cols.row_groups):
        if md.row_group(g).num_rows != n:
            return f"shard {where}: row group {g} holds {md.row_group(g).num_rows} rows, manifest says {n}"
    if not len(cols):
        return None
    groups = np.unique(cols.row_group).tolist()
    batches: list[list[int]] = [[]]
    acc = 0
    sizes = np.bincount(cols.row_group, weights=cols.nbytes)
    for g in groups:
        if batches[-1] and acc + sizes[g] > VALIDATE_BATCH_BYTES:
            batches.append([])
            acc = 0
        batches[-1].append(g)
        acc += sizes[g]
    lo = 0
    for batch in batches:
        hi = lo + sum(cols.row_groups[g] for g in batch)
        try:
            table = pf.read_row_groups(batch, use_threads=use_threads)
        except (OSError, pa.ArrowException, ValueError) as exc:
            return f"shard {where}: row groups {batch[0]}-{batch[-1]} fail to decode: {exc}"
        problem = _verify_rows(table, cols, lo, hi, where, sites)
        if problem is not None:
            return problem
        del table
        lo = hi
    return None


def _verify_rows(
    table: pa.Table, cols: ManifestColumns, lo: int, hi: int, where: str, sites: dict[str, tuple[int, int, int]] | None
) -> str | None:
    """Check rows ``[lo, hi)`` of ``cols`` against ``table`` (their decoded row groups)."""
    n = hi - lo
    if table.num_rows != n:
        return f"shard {where}: rows {lo}-{hi} decode to {table.num_rows} rows"
    for name in CHUNK_SCHEMA.names:
        if name != "token_scales" and table.column(name).null_count:
            j = _first_false(table.column(name).is_valid().to_numpy(zero_copy_only=False))
            return f"shard {where}: {cols.describe(lo + (j or 0))}: {name} is null"
    # 1. the key columns and the stored checksum are the manifest's
    traj, site = cols.trajectory[lo:hi], cols.site[lo:hi]
    start, ntok, nrows = cols.token_start[lo:hi], cols.n_tokens[lo:hi], cols.n_rows[lo:hi]
    expect_crc = cols.checksum[lo:hi]
    ok = (
        pc.equal(table.column("run"), cols.run).to_numpy(zero_copy_only=False)
        & (table.column("policy_version").to_numpy() == cols.policy_version)
        & pc.equal(table.column("trajectory"), traj).to_numpy(zero_copy_only=False)
        & pc.equal(table.column("site"), site).to_numpy(zero_copy_only=False)
        & (table.column("token_start").to_numpy() == start)
        & (table.column("n_tokens").to_numpy() == ntok)
        & (table.column("n_rows").to_numpy() == nrows)
        & (table.column("checksum").to_numpy().astype(np.int64) == expect_crc)
    )
    j = _first_false(ok)
    if j is not None:
        got = tuple(table.column(k)[j].as_py() for k in ("trajectory", "site", "token_start"))
        stored = table.column("checksum")[j].as_py()
        return (
            f"shard {where}: {cols.describe(lo + j)} holds {got} (checksum {stored:#010x}, "
            f"manifest {int(expect_crc[j]):#010x}): wrong file in place?"
        )
    # 2. byte lengths: whole rows, and the site's layout
    codes, scales, tscales = (table.column(k) for k in ("codes", "scales", "token_scales"))
    if not [len(a) for a in codes.chunks] == [len(a) for a in scales.chunks] == [len(a) for a in tscales.chunks]:
        codes, scales, tscales = (pa.chunked_array([c.combine_chunks()]) for c in (codes, scales, tscales))
    parts = list(zip(_binary_parts(codes), _binary_parts(scales), _binary_parts(tscales), strict=True))
    clen = np.concatenate([np.diff(c[0]) for c, _, _ in parts])
    slen = np.concatenate([np.diff(s[0]) for _, s, _ in parts])
    tlen = np.concatenate([np.diff(t[0]) for _, _, t in parts])
    has_ts = np.concatenate([np.ones(len(t[0]) - 1, bool) if t[2] is None else t[2] for _, _, t in parts])
    ok = (ntok > 0) & (nrows >= ntok)
    nr = np.maximum(nrows, 1)
    cb, sb = clen // nr, slen // nr
    ok &= (clen % nr == 0) & (slen % nr == 0) & (~has_ts | (tlen == 4 * nrows))
    tcodes, scodes = pc.dictionary_encode(traj), pc.dictionary_encode(site)
    s_index = scodes.indices.to_numpy().astype(np.int64)
    snames = scodes.dictionary.to_pylist()
    if sites is not None:
        layout = np.array([sites.get(name, (-1, -1, -1)) for name in snames], dtype=np.int64).reshape(-1, 3)[s_index]
        ok &= (cb == layout[:, 0]) & (sb == layout[:, 1]) & (nrows == ntok * layout[:, 2])
    j = _first_false(ok)
    if j is not None:
        return (
            f"shard {where}: {cols.describe(lo + j)}: {clen[j]} code and {slen[j]} scale bytes in {nrows[j]} rows "
            "do not match the site's layout"
        )
    # 3. every chunk's checksum (tracestore.records.chunk_checksum: tag and key strings, the packed
    # numbers, codes, scales, token scales), from CRCs of the parts combined column-wise: one CRC
    # call per codes and scales value; the head's CRC by linearity from the bytes that differ
    # between chunks
    n_sites = len(snames)
    key = tcodes.indices.to_numpy().astype(np.int64) * n_sites + s_index
    uniq, inverse = np.unique(key, return_inverse=True)
    tnames = tcodes.dictionary.to_pylist()
    prefix = np.array(
        [
            crc32(_CHECKSUM_TAG + f"{cols.run}\0{tnames[k // n_sites]}\0{snames[k % n_sites]}\0".encode())
            for k in uniq.tolist()
        ],
        dtype=np.uint32,
    )[inverse.reshape(-1)]
    head = np.empty(n, _HEAD)
    head["pv"] = cols.policy_version
    head["ts"], head["nt"], head["nr"], head["cb"], head["sb"] = start, ntok, nrows, cb, sb
    head["g"] = table.column("global_scale").to_numpy()
    step = _HEAD.itemsize
    actual = crc32_combine_many(prefix, _crc_fixed_rows(head), np.full(n, step))
    crc_c = np.concatenate([_crc_values(cv, co) for (co, cv, _), _, _ in parts])
    crc_s = np.concatenate([_crc_values(sv, so) for _, (so, sv, _), _ in parts])
    actual = crc32_combine_many(crc32_combine_many(actual, crc_c, clen), crc_s, slen)
    tail = np.full(n, crc32(b"\0"), np.uint32)  # no token scales: one b"\0"
    if has_ts.any():
        crc_t = np.concatenate([_crc_values(tv, to, tvalid) for _, _, (to, tv, tvalid) in parts])
        one = np.full(int(has_ts.sum()), crc32(b"\1"), np.uint32)
        tail[has_ts] = crc32_combine_many(one, crc_t[has_ts], tlen[has_ts])
    actual = crc32_combine_many(actual, tail, np.where(has_ts, 1 + tlen, 1))
    j = _first_false(actual.astype(np.int64) == expect_crc)
    if j is not None:
        return (
            f"shard {where}: {cols.describe(lo + j)}: checksum mismatch "
            f"(stored {int(expect_crc[j]):#010x}, computed {int(actual[j]):#010x})"
        )
    return None


def _crc_values(data: memoryview, offsets: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
    """CRC-32 of every value ``data[offsets[i]:offsets[i + 1]]`` (0 where ``valid`` is False)."""
    n = len(offsets) - 1
    size = int(offsets[-1] - offsets[0]) if n > 0 else 0
    if n > 0 and size % n == 0 and size and int(offsets[1] - offsets[0]) * n == size:
        width = size // n
        rows = np.frombuffer(data, np.uint8, size, int(offsets[0])).reshape(n, width)
        if np.array_equal(np.diff(offsets), np.full(n, width)):  # values of one length: map over rows (no bytecode)
            out = np.fromiter(map(crc32, rows), np.uint32, n)
            if valid is not None:
                out[~valid] = 0
            return out
    o = offsets.tolist()
    out = np.array([crc32(data[a:b]) for a, b in zip(o, o[1:])], dtype=np.uint32).reshape(-1)  # noqa: B905
    if valid is not None:
        out[~valid] = 0
    return out


@functools.lru_cache(maxsize=4096)
def _byte_table(n: int, i: int) -> np.ndarray:
    """uint32[256]: the part of the CRC-32 of an ``n``-byte string that byte ``i`` adds, per value
    (``crc32(b at i, zeros elsewhere) ^ crc32(n zeros)``; the CRC is affine in the bytes)."""
    z = bytearray(n)
    base = crc32(bytes(z))
    out = np.empty(256, dtype=np.uint32)
    for b in range(256):
        z[i] = b
        out[b] = crc32(bytes(z)) ^ base
    return out


def _crc_fixed_rows(rows: np.ndarray) -> np.ndarray:
    """CRC-32 of every row of a structured array of fixed-size records: the first row's, plus, by
    linearity, the table contributions of the bytes where a row differs from it (few, for chunk
    heads: the token start's low bytes, the global scale)."""
    n, width = len(rows), rows.dtype.itemsize
    if n == 0:
        return np.zeros(0, dtype=np.uint32)
    raw = rows.view(np.uint8).reshape(n, width)
    ref = raw[0]
    acc = np.full(n, crc32(ref.tobytes()), dtype=np.uint32)
    fields: Mapping[str, Any] = rows.dtype.fields or {}
    for name, (_, at, *_) in fields.items():
        col = rows[name]
        if col.min() == col.max():
            continue
        for i in range(at, at + col.dtype.itemsize):
            diff = raw[:, i] ^ ref[i]
            if diff.any():
                acc ^= _byte_table(width, i)[diff]
    return acc
