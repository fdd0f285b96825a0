"""Shard encoding (record chunks -> Parquet bytes + manifest) and verified row-group decoding.

A shard is one Parquet file, one row per record chunk, sorted by (trajectory, site,
token_start). Row groups break at a (trajectory, site) boundary once they hold
``min_row_group_bytes`` and always before ``row_group_bytes``, so a pipeline stage reading a few
sites of a trajectory fetches only their row groups. Column compression: code bits are stored
uncompressed (packed low FP4 bits are incompressible: bench/bench_storage.py measured every codec
at 1.00x on them), scales, token scales and key columns zstd level 1 (real E4M3 scales: 0.65x).
Page checksums are written and verified (reliability.md: a flipped byte in a compressed page
otherwise came back as wrong data).

The manifest (small JSON, written after the shard) lists every chunk's key, row group and
checksum; readers use it to fetch only the row groups they need and to detect swapped or
truncated files.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tracestore.arrow import (
    CHUNK_SCHEMA,
    KEY_COLUMNS,
    SCHEMA_VERSION,
    binary_views,
    chunk_from_parts,
    chunks_to_table,
    schema_version_of,
)
from tracestore.errors import ConflictError, CorruptionError, ValidationError
from tracestore.records import PrefixLink, RecordChunk, TrajectorySeal, crc32

MANIFEST_FORMAT = "tracestore.manifest"
MANIFEST_VERSION = 1
SHARD_META_KEY = b"tracestore.shard"

ROW_GROUP_BYTES = 16 << 20
MIN_ROW_GROUP_BYTES = 1 << 20  # 4 MiB wrote ~4% faster but a half-sites read fetched 24 of 30 MB instead of 13

# Column compression (see module docstring); dictionary only for the repeated strings.
# bench_storage on real quantized tokens: codes 1.00x under every codec; E4M3 scales 0.646x with
# zstd-1, 0.649x with zstd-3, 0.638x with zstd-9 (snappy/lz4 ~1.00x), and zstd-1 encodes fastest.
COMPRESSION: dict[str, str] = {name: ("NONE" if name == "codes" else "ZSTD") for name in CHUNK_SCHEMA.names}
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
        cols: dict[str, list[Any]] = {f.name: [] for f in dataclasses.fields(ChunkEntry)}
        for c in self.chunks:
            for k in cols:
                cols[k].append(getattr(c, k))
        d = {
            "format": MANIFEST_FORMAT,
            "manifest_version": MANIFEST_VERSION,
            "schema_version": SCHEMA_VERSION,
            "run": self.run,
            "policy_version": self.policy_version,
            "writer": self.writer,
            "seq": self.seq,
            "shard": self.shard,
            "shard_bytes": self.shard_bytes,
            "shard_crc32": self.shard_crc32,
            "row_groups": list(self.row_groups),
            "chunks": cols,
            "seals": [s.to_dict() for s in self.seals],
            "links": [x.to_dict() for x in self.links],
        }
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        try:
            d = json.loads(data)
            if d.get("format") != MANIFEST_FORMAT or d.get("manifest_version") != MANIFEST_VERSION:
                raise ValueError(f"format {d.get('format')!r} version {d.get('manifest_version')!r}")
            cols = d["chunks"]
            names = [f.name for f in dataclasses.fields(ChunkEntry)]
            chunks = tuple(ChunkEntry(*vals) for vals in zip(*(cols[n] for n in names), strict=True))
            return cls(
                d["run"],
                int(d["policy_version"]),
                d["writer"],
                int(d["seq"]),
                d["shard"],
                int(d["shard_bytes"]),
                int(d["shard_crc32"]),
                tuple(int(n) for n in d["row_groups"]),
                chunks,
                tuple(TrajectorySeal.from_dict(s) for s in d["seals"]),
                tuple(PrefixLink.from_dict(x) for x in d["links"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptionError(
                f"manifest {where} does not decode ({exc}); expected a tracestore manifest v1"
            ) from exc

    @property
    def trajectories(self) -> set[str]:
        out = {c.trajectory for c in self.chunks}
        out.update(s.trajectory for s in self.seals)
        out.update(x.trajectory for x in self.links)
        return out


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
) -> tuple[memoryview | None, Manifest]:
    """Encode one shard: Parquet bytes (None when there are no chunks) and its manifest.

    With ``sink`` (a writable binary file object with ``size`` and ``crc32`` attributes, such as
    :class:`tracestore.fsutil.SyncingWriter`) the Parquet bytes stream into it instead and the
    returned bytes are None.
    """
    ordered = check_shard_inputs(run, policy_version, chunks, seals, links)
    if not ordered:
        manifest = Manifest(run, policy_version, writer, seq, None, 0, 0, (), (), tuple(seals), tuple(links))
        return None, manifest

    # row-group boundaries
    groups: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, c in enumerate(ordered):
        if i > start:
            prev = ordered[i - 1]
            boundary = (prev.trajectory, prev.site) != (c.trajectory, c.site)
            if acc + c.nbytes > row_group_bytes or (boundary and acc >= min_row_group_bytes):
                groups.append((start, i - start))
                start, acc = i, 0
        acc += c.nbytes
    groups.append((start, len(ordered) - start))

    shard_meta = json.dumps(
        {"run": run, "policy_version": policy_version, "writer": writer, "seq": seq},
        sort_keys=True,
    ).encode()
    schema = CHUNK_SCHEMA.with_metadata({**(CHUNK_SCHEMA.metadata or {}), SHARD_META_KEY: shard_meta})
    # Checksums run on the worker pool (zlib.crc32 releases the GIL) while the Parquet writer,
    # which also releases it, encodes the row groups whose checksums are already known.
    futures = [_verify_pool().submit(_checksums, ordered[a : a + n]) for a, n in groups]
    crcs: list[int] = []
    out = pa.BufferOutputStream() if sink is None else sink
    with pq.ParquetWriter(
        out,
        schema,
        compression=COMPRESSION,
        compression_level={n: ZSTD_LEVEL for n, c in COMPRESSION.items() if c == "ZSTD"},
        use_dictionary=DICTIONARY_COLUMNS,
        write_statistics=STATISTICS_COLUMNS,
        write_page_checksum=True,
        data_page_size=1 << 20,
    ) as w:
        for (a, n), fut in zip(groups, futures, strict=True):
            group_crcs = fut.result()
            crcs.extend(group_crcs)
            table = chunks_to_table(ordered[a : a + n], group_crcs, zero_copy=True)
            table = table.replace_schema_metadata(schema.metadata)
            w.write_table(table, row_group_size=n)
    data: memoryview | None = None
    if sink is None:
        buf = memoryview(out.getvalue()).cast("B")  # no copy: published straight from Arrow's buffer
        data, size, crc = buf, len(buf), crc32(buf)
    else:
        size, crc = int(sink.size), int(sink.crc32)

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


def open_parquet(f: Any, where: str, metadata: pq.FileMetaData | None = None) -> pq.ParquetFile:
    """ParquetFile over a file handle with page-checksum verification; CorruptionError if unreadable."""
    try:
        return pq.ParquetFile(f, metadata=metadata, page_checksum_verification=True, pre_buffer=True)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise CorruptionError(f"shard {where}: not a readable Parquet file ({exc})") from exc


def read_entries(
    pf: pq.ParquetFile, manifest: Manifest, entries: Sequence[ChunkEntry], where: str
) -> dict[ChunkEntry, RecordChunk]:
    """Read the row groups holding ``entries`` and return their verified chunks.

    Every chunk is checked against the manifest (key, checksum) and its own stored checksum, so
    a flipped byte, a truncated file or another shard's file in this place raises
    :class:`CorruptionError` naming the shard and the chunk.
    """
    by_group: dict[int, list[ChunkEntry]] = {}
    for e in entries:
        by_group.setdefault(e.row_group, []).append(e)
    groups = sorted(by_group)
    version = schema_version_of(pf.schema_arrow)
    if version != SCHEMA_VERSION:
        raise CorruptionError(f"shard {where}: schema version {version}, this tracestore reads {SCHEMA_VERSION}")
    if pf.metadata.num_row_groups != len(manifest.row_groups):
        raise CorruptionError(
            f"shard {where}: has {pf.metadata.num_row_groups} row groups, its manifest lists "
            f"{len(manifest.row_groups)} (file replaced or truncated)"
        )
    # Read in batches of row groups and verify each batch's chunk checksums on the worker pool while
    # the next batch decodes (both release the GIL), instead of one read followed by one verify pass.
    batches: list[list[int]] = [[]]
    acc = 0
    for g in groups:
        if batches[-1] and acc >= READ_BATCH_BYTES:
            batches.append([])
            acc = 0
        batches[-1].append(g)
        acc += sum(e.nbytes for e in by_group[g])
    out: dict[ChunkEntry, RecordChunk] = {}
    pending: list[tuple[concurrent.futures.Future[list[int]], list[tuple[ChunkEntry, RecordChunk, str]]]] = []
    for batch in batches:
        batch_entries = [e for g in batch for e in by_group[g]]
        decoded = _decode_groups(pf, manifest, batch, batch_entries, where)
        pending.append((_verify_pool().submit(_checksums, [c for _, c, _ in decoded]), decoded))
    for fut, decoded in pending:
        for actual, (e, c, desc) in zip(fut.result(), decoded, strict=True):
            if actual != e.checksum:
                raise CorruptionError(f"{desc}: checksum mismatch (stored {e.checksum:#010x}, computed {actual:#010x})")
            out[e] = c
    return out


READ_BATCH_BYTES = 64 << 20  # with ISA-L crc32 verification is cheap; fewer, larger reads win


def _decode_groups(
    pf: pq.ParquetFile, manifest: Manifest, groups: list[int], entries: list[ChunkEntry], where: str
) -> list[tuple[ChunkEntry, RecordChunk, str]]:
    """Decode some row groups; check each wanted row's key against the manifest (not yet its checksum)."""
    try:
        table = pf.read_row_groups(groups, use_threads=True)
    except (OSError, pa.ArrowException, ValueError) as exc:
        desc = "; ".join(
            f"chunk (trajectory {e.trajectory}, site {e.site}, tokens [{e.token_start}, {e.token_end}))"
            for e in entries[:3]
        )
        more = f" and {len(entries) - 3} more" if len(entries) > 3 else ""
        raise CorruptionError(f"shard {where}: row groups {groups} holding {desc}{more} fail to decode: {exc}") from exc
    base = {}
    row = 0
    for g in groups:
        base[g] = row
        row += manifest.row_groups[g]
    if table.num_rows != row:
        raise CorruptionError(f"shard {where}: row groups {groups} hold {table.num_rows} rows, manifest says {row}")
    keys = {n: table.column(n).to_pylist() for n in ("run", "policy_version", "trajectory", "site")}
    nums = {n: table.column(n).to_numpy() for n in ("token_start", "n_tokens", "n_rows")}
    g_col = table.column("global_scale").to_numpy()
    crc = table.column("checksum").to_numpy()
    codes = binary_views(table.column("codes"))
    scales = binary_views(table.column("scales"))
    tscales = binary_views(table.column("token_scales"))
    out = []
    for e in entries:
        j = base[e.row_group] + e.row
        key = {
            "run": keys["run"][j],
            "policy_version": int(keys["policy_version"][j]),
            "trajectory": keys["trajectory"][j],
            "site": keys["site"][j],
            "token_start": int(nums["token_start"][j]),
            "n_tokens": int(nums["n_tokens"][j]),
            "n_rows": int(nums["n_rows"][j]),
        }
        expect = (manifest.run, manifest.policy_version, e.trajectory, e.site, e.token_start, e.n_tokens, e.n_rows)
        got = tuple(key[k] for k in KEY_COLUMNS)
        chunk_desc = f"chunk (trajectory {e.trajectory}, site {e.site}, tokens [{e.token_start}, {e.token_end}))"
        if got != expect or int(crc[j]) != e.checksum:
            raise CorruptionError(
                f"shard {where}: {chunk_desc} in row group {e.row_group} row {e.row} holds "
                f"{got[2:5]} (checksum {int(crc[j]):#010x}, manifest {e.checksum:#010x}): wrong file in place?"
            )
        desc = f"shard {where}: {chunk_desc}"
        chunk = chunk_from_parts(
            key, float(g_col[j]), int(crc[j]), codes[j], scales[j], tscales[j], verify=False, where=desc
        )
        out.append((e, chunk, desc))
    return out


def _checksums(chunks: Sequence[RecordChunk]) -> list[int]:
    return [c.checksum for c in chunks]


_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _verify_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="tracestore-crc"
        )
    return _POOL
