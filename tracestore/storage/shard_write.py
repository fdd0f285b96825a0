"""Encoding a shard: record chunks -> one Parquet file and its manifest.

A shard is one Parquet file, one row per record chunk, sorted by (trajectory, site,
token_start), exact repeats of a chunk dropped. Row groups break at a (trajectory, site) boundary
once they hold ``min_row_group_bytes`` and always before ``row_group_bytes``, so a pipeline stage
reading a few sites of a trajectory fetches only their row groups. One Parquet writer encodes the
shard, with a CRC-32 in every page header (``write_page_checksum``; every read verifies them,
:mod:`tracestore.storage.shard_read`), while the worker pool builds the next row groups' Arrow
tables.

A large write is cut into two shards by :func:`split_shard` (whole trajectories, about equal
bytes), which :meth:`tracestore.storage.store.Store.write_shard` encodes side by side, one Parquet
writer each (two cores: the writers release the GIL while they encode and compress).

Column compression: code bits are stored uncompressed (packed low FP4 bits are incompressible);
scales and token scales are zstd level 1 (:data:`ZSTD_COLUMNS`); the small per-chunk key and
checksum columns are Snappy, which stores them in as few bytes as zstd does while costing far
less per page (a decode shard's row groups hold a few dozen chunks, so each of these columns is
a page of a few hundred bytes, and zstd sets up a compression context for every page).
Dictionary encoding only for the repeated strings.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tracestore.errors import ConflictError, ValidationError
from tracestore.records import PrefixLink, RecordChunk, TrajectorySeal, crc32
from tracestore.storage.arrow import CHUNK_SCHEMA, chunks_to_table
from tracestore.storage.config import MIN_ROW_GROUP_BYTES, ROW_GROUP_BYTES
from tracestore.storage.manifest import ChunkEntry, Manifest
from tracestore.storage.shard_read import worker_pool

SHARD_META_KEY = b"tracestore.shard"


# Column compression (see module docstring); dictionary only for the repeated strings.
#: bench_storage, real tokens: codes 1.00x under every codec, E4M3 scales 0.65x with zstd-1
ZSTD_COLUMNS = ("scales", "token_scales")
#: bench_storage, decode shard: per-chunk columns Snappy vs zstd-1: same bytes, encode CPU -20%
COMPRESSION: dict[str, str] = {
    name: ("NONE" if name == "codes" else "ZSTD" if name in ZSTD_COLUMNS else "SNAPPY") for name in CHUNK_SCHEMA.names
}
ZSTD_LEVEL = 1  # zstd-3 and zstd-9 save under 2% more of the scales and encode slower
DICTIONARY_COLUMNS = ["run", "trajectory", "site"]
STATISTICS_COLUMNS = ["run", "policy_version", "trajectory", "site", "token_start", "n_tokens"]


class BytesSink(io.RawIOBase):
    """A sink for :func:`encode_shard` that collects the Parquet file in one ``bytearray``, for a
    store that publishes shards from memory (S3): room for ``size_hint`` bytes is allocated once,
    the encoder's writes fill it in place, and :meth:`getvalue` hands the very buffer out. Encoded
    into Arrow's growing buffer instead, a shard took its size about twice over while the buffer
    doubled, and once more as the ``bytes`` that the upload needs. A ``bytearray`` body is sent as
    it is: botocore wraps ``bytes`` in a ``BytesIO``, which aiohttp copies out again for every
    attempt of the PUT (``getbuffer``), and a failed attempt's copy lived on until the garbage
    collector freed the attempt."""

    def __init__(self, size_hint: int = 0) -> None:
        super().__init__()
        self._buf = bytearray(max(0, size_hint))  # (a write past the end extends it)
        self.size = 0
        self.crc32 = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        with memoryview(b) as view:
            n = view.nbytes
            self._buf[self.size : self.size + n] = view.cast("B") if view.ndim != 1 or view.format != "B" else view
        self.crc32 = crc32(b, self.crc32)
        self.size += n
        return n

    def finish(self) -> None:
        """The file is complete: drop the room it did not use."""
        del self._buf[self.size :]

    def getvalue(self) -> bytearray:
        """The file's bytes (after :meth:`finish`), without a copy."""
        return self._buf


def shard_size_hint(chunks: Sequence[RecordChunk]) -> int:
    """About the size of a shard file of ``chunks``: their payload stored as it is (codes are
    not compressed; scales compress, so this errs high) plus the per-chunk columns and footer."""
    return sum(c.nbytes for c in chunks) + 256 * len(chunks) + (64 << 10)


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
    """Check that everything belongs to (run, version); the chunks sorted and de-duplicated."""
    for c in chunks:
        if c.run != run or c.policy_version != policy_version:
            raise ValidationError(f"{c.key_str}: does not belong to shard run {run} v{policy_version}")
    owners: list[TrajectorySeal | PrefixLink] = [*seals, *links]
    for item in owners:
        if item.run != run or item.policy_version != policy_version:
            raise ValidationError(f"{item!r} does not belong to shard run {run} v{policy_version}")
    return _dedupe_sorted(chunks)


ShardPart = tuple[list[RecordChunk], list[TrajectorySeal], list[PrefixLink]]


def split_shard(
    ordered: Sequence[RecordChunk],
    seals: Sequence[TrajectorySeal] = (),
    links: Sequence[PrefixLink] = (),
    parts: int = 2,
) -> list[ShardPart]:
    """Cut one shard's content into up to ``parts`` shards of about equal bytes, whole trajectories.

    ``ordered``: the chunks as :func:`check_shard_inputs` returns them (sorted, de-duplicated). A
    trajectory's chunks, seals and links stay together, and so does a link's source with the
    trajectory linked to it (one unit), so every part is a complete shard of its own: nothing in it
    points into another part. Units are placed largest first, each on the part with the fewest
    bytes so far (ties: the lower part; units of equal bytes in name order). The result is a pure
    function of the input, so a retry of the same shard splits it the same way and its parts are
    byte-identical repeats. Parts that would hold no chunks are not made: one part (everything)
    when fewer than two units hold chunks.
    """
    parent: dict[str, str] = {}

    def find(t: str) -> str:
        root = t
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[t] != root:
            parent[t], t = root, parent[t]
        return root

    for c in ordered:
        find(c.trajectory)
    for s in seals:
        find(s.trajectory)
    for x in links:
        a, b = find(x.trajectory), find(x.source)
        if a != b:
            parent[max(a, b)] = min(a, b)
    weight: dict[str, int] = {}
    for c in ordered:
        root = find(c.trajectory)
        weight[root] = weight.get(root, 0) + c.nbytes
    if parts < 2 or len(weight) < 2:
        return [(list(ordered), list(seals), list(links))]
    load = [0] * min(parts, len(weight))
    where: dict[str, int] = {}
    for root in sorted(weight, key=lambda r: (-weight[r], r)):
        k = min(range(len(load)), key=lambda i: (load[i], i))
        where[root] = k
        load[k] += weight[root]
    out: list[ShardPart] = [([], [], []) for _ in load]
    for c in ordered:
        out[where[find(c.trajectory)]][0].append(c)
    # seals and links of trajectories without chunks here stay with part 0
    for s in seals:
        out[where.get(find(s.trajectory), 0)][1].append(s)
    for x in links:
        out[where.get(find(x.trajectory), 0)][2].append(x)
    return out


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

    Without ``sink`` (memory:// and S3 publish from memory) the bytes are encoded into Arrow's
    growing buffer and returned without a copy. With ``sink`` the Parquet bytes go into it
    instead and the returned bytes are None: a :class:`tracestore.storage.local.ShardFile` (a native
    Arrow ``stream``, told of each row group by ``progress()``) or a writable binary file object;
    either has ``size`` and ``crc32`` attributes that are final after its ``finish()``.
    """
    ordered = check_shard_inputs(run, policy_version, chunks, seals, links)
    if not ordered:
        manifest = Manifest(run, policy_version, writer, seq, None, 0, 0, (), (), tuple(seals), tuple(links))
        return None, manifest
    groups = _row_groups(ordered, row_group_bytes, min_row_group_bytes)
    shard_meta = json.dumps(
        {"run": run, "policy_version": policy_version, "writer": writer, "seq": seq},
        sort_keys=True,
    ).encode()
    schema = CHUNK_SCHEMA.with_metadata({**(CHUNK_SCHEMA.metadata or {}), SHARD_META_KEY: shard_meta})
    # The row groups' Arrow tables (zero-copy views of the chunks' arrays) and their chunk
    # checksums are built on the worker pool while the Parquet writer, which releases the GIL,
    # encodes the row groups that are ready.
    futures = [worker_pool().submit(_group_table, ordered[a : a + n], schema) for a, n in groups]
    sizes = [n for _, n in groups]
    native = getattr(sink, "stream", None)
    data: bytes | memoryview | None = None
    # A native sink (ShardFile: ``stream`` + ``progress()``) is written without the GIL and told
    # after each row group; a Python sink gets the bytes through Arrow's buffered stream: the
    # Parquet writer's many small writes reach Python as ~1 MiB blocks, not one call each.
    if sink is None:
        out: Any = pa.BufferOutputStream()
    elif native is not None:
        out = native
    else:
        out = pa.BufferedOutputStream(pa.PythonFile(sink, "w"), 1 << 20)
    _write_groups(out, schema, sizes, futures, None if native is None else lambda: sink.progress(out.tell()))
    if sink is None:  # no copy: published straight from Arrow's buffer
        data = memoryview(out.getvalue())
        out.close()
        size, crc = len(data), crc32(data)
    else:
        if not out.closed:
            out.close()  # flushes the buffered tail into the sink
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
        tuple(sizes),
        tuple(entries),
        tuple(seals),
        tuple(links),
    )
    return data, manifest


def _row_groups(
    ordered: Sequence[RecordChunk], row_group_bytes: int, min_row_group_bytes: int
) -> list[tuple[int, int]]:
    """(first chunk, chunk count) of every row group of the sorted chunks (module docstring)."""
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
    return groups


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


def _group_table(chunks: Sequence[RecordChunk], schema: pa.Schema) -> tuple[list[int], pa.Table]:
    crcs = [c.checksum for c in chunks]
    return crcs, chunks_to_table(chunks, crcs, zero_copy=True).replace_schema_metadata(schema.metadata)
