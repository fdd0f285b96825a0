"""Reading a shard: verified decode of the row groups a read needs, and full verification.

Every read verifies two layers. Parquet page checksums (written by
:mod:`tracestore.storage.shard_write`) are verified by Arrow's decoder
(``page_checksum_verification=True``, :func:`open_parquet`) on every backend, so a flipped byte
inside a page, compressed or not, fails the decode. Every chunk's own checksum is then recomputed
over the manifest's key and the decoded bytes and compared with the manifest's
(:func:`read_chunks`), so a flipped byte, a truncated file or another shard's file in this place is
a :class:`CorruptionError` naming the shard and the chunk.

:func:`verify_shard` checks a whole shard at once (``tracestore inspect --validate``): every page,
every key column and stored checksum against the manifest (as :class:`ManifestColumns`), every
chunk's byte lengths, and every chunk's checksum from a few passes over the decoded columns
instead of one Python object per chunk (a decode shard holds ~300,000 chunks of one token).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tracestore.checksum import (
    HEAD_DTYPE,
    IDS_FOLD_DTYPE,
    IDS_TAG,
    ChunkKey,
    chunk_checksum,
    crc32,
    crc32_combine,
    crc32_held,
    key_prefix,
)
from tracestore.errors import CorruptionError
from tracestore.storage.arrow import CHUNK_SCHEMA, SCHEMA_VERSION, schema_version_of
from tracestore.storage.manifest import ChunkEntry, Manifest, ManifestColumns


def open_parquet(f: Any, where: str, metadata: pq.FileMetaData | None = None) -> pq.ParquetFile:
    """ParquetFile over a file handle, verifying page checksums; CorruptionError if unreadable.

    A memory map is read in place (no read-ahead buffers); any other file is pre-buffered (a
    few large ranged reads, not one per column chunk).
    """
    try:
        return pq.ParquetFile(
            f,
            metadata=metadata,
            page_checksum_verification=True,
            pre_buffer=not isinstance(f, pa.MemoryMappedFile),
        )
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise CorruptionError(f"shard {where}: not a readable Parquet file ({exc})") from exc


@dataclasses.dataclass(frozen=True)
class StoredChunk:
    """One verified chunk of a shard as read: read-only views into the decoded Arrow buffers.

    ``codes`` uint8 ``[n_rows, code_bytes]``, ``scales`` uint8 ``[n_rows, scale_bytes]``,
    ``token_scales`` float32 ``[n_rows]`` or None, ``ids_crc`` the chunk's token identity or None
    (:mod:`tracestore.identity`); the key is ``entry`` (checked, see :func:`read_chunks`).
    """

    entry: ChunkEntry
    codes: np.ndarray
    scales: np.ndarray
    global_scale: float
    token_scales: np.ndarray | None
    ids_crc: int | None = None


# Columns a read decodes: the key columns and the stored checksum are not needed because every
# chunk's checksum is recomputed over the manifest's key together with the stored bytes and
# compared with the manifest's (a row holding another key or other bytes cannot match); skipping
# them saves 8 column chunks per row group. Full validation (:func:`verify_shard`) reads them all.
DATA_COLUMNS = ["global_scale", "codes", "scales", "token_scales"]
IDS_COLUMN = "ids_crc"  # read too where the shard has it (chunks that carry token identity)
# Row groups decode in batches of about this size on the worker pool, each chunk verified and
# placed as it lands; a small batch is still in the CPU cache when its chunks are hashed and copied.
#: about one row group: 118 vs 138 ms CPU per 180 MiB read against 8 MiB batches (2-core box)
READ_BATCH_BYTES = 2 << 20
# Arrow's column threads as well: page decoding and page-CRC verification run in Arrow's C++
# without the GIL, so a batch's columns decode in parallel while the batches' Python (chunk CRCs,
# placing) takes turns on the GIL.
#: 30 MB read: data columns 10.8 ms with column threads, 21.0 ms without (2-core box)
DECODE_THREADS = True


def read_chunks(
    source: pq.ParquetFile | Callable[[pq.FileMetaData | None], pq.ParquetFile],
    manifest: Manifest,
    entries: Sequence[ChunkEntry],
    where: str,
    on_chunk: Callable[[StoredChunk], None],
    *,
    hold_gil: bool = False,
) -> None:
    """Read the row groups holding ``entries`` and hand each chunk, verified, to ``on_chunk``.

    Every chunk's checksum is recomputed (:func:`tracestore.checksum.chunk_checksum`) over the
    manifest's key and the stored bytes and must equal the manifest's value, so a flipped byte,
    a truncated file or another shard's file in this place raises :class:`CorruptionError`
    naming the shard and the chunk. Parquet page checksums are verified by Arrow's decoder
    (:func:`open_parquet`).

    ``source`` is a ParquetFile (batches decode one after another on it) or a function
    ``open(footer_or_None)`` that opens one over a thread-safe file such as a memory map (batches
    of ~:data:`READ_BATCH_BYTES` then decode concurrently on the worker pool). ``on_chunk(chunk)``
    is called in the thread that decoded the chunk, right after its checksum matched (while its
    bytes are still in the CPU cache), so a caller can place rows as they land; with a function
    ``source`` several threads call it at once (it must be thread-safe). The chunk's arrays are
    views into the decoded batch: a caller that keeps a chunk keeps its batch's memory.

    ``hold_gil``: the chunk CRCs of up to 1 MiB keep the GIL (for a read in a background thread
    beside a thread that is busy in Python; see :func:`tracestore.storage.read_out._copy_held`).
    """
    by_group: dict[int, list[ChunkEntry]] = {}
    for e in entries:
        by_group.setdefault(e.row_group, []).append(e)
    if not by_group:
        return
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

    def decode(batch: list[int], bpf: pq.ParquetFile) -> None:
        _read_batch(bpf, manifest, batch, [e for g in batch for e in by_group[g]], where, on_chunk, hold_gil)

    if isinstance(source, pq.ParquetFile) or len(batches) == 1:
        for batch in batches:
            decode(batch, pf)
        return
    meta = pf.metadata
    opener = source
    # The calling thread and up to VERIFY_WORKERS pool threads take the batches in order, each the
    # next one nobody took, until none is left; each decodes, verifies and places its batches
    # itself. Placing is mostly numpy copies, which release the GIL, so it runs on every core
    # instead of queuing behind the calling thread while the workers wait.
    todo = iter(batches)
    lock = threading.Lock()
    stop = threading.Event()  # set when a batch failed, or the read is over

    def drain(bpf: pq.ParquetFile | None) -> None:
        while True:
            with lock:
                batch = None if stop.is_set() else next(todo, None)
            if batch is None:
                return
            if bpf is None:
                bpf = opener(meta)
            try:
                decode(batch, bpf)
            except BaseException:
                stop.set()
                raise

    futures = [worker_pool().submit(drain, None) for _ in range(min(VERIFY_WORKERS, len(batches) - 1))]
    try:
        drain(pf)
        for f in futures:
            f.result()
    finally:
        stop.set()
        for f in futures:
            f.cancel()


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


def _chunk_desc(e: ChunkEntry) -> str:
    return f"chunk (trajectory {e.trajectory}, site {e.site}, tokens [{e.token_start}, {e.token_end}))"


def _describe(entries: Sequence[ChunkEntry]) -> str:
    desc = "; ".join(_chunk_desc(e) for e in entries[:3])
    return desc + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")


def _read_batch(
    pf: pq.ParquetFile,
    manifest: Manifest,
    groups: list[int],
    entries: list[ChunkEntry],
    where: str,
    on_chunk: Callable[[StoredChunk], None],
    hold_gil: bool = False,
) -> None:
    """Decode some row groups, verify every wanted chunk and hand it on (see
    :func:`read_chunks`)."""
    try:
        with_ids = IDS_COLUMN in pf.schema_arrow.names
        columns = [*DATA_COLUMNS, IDS_COLUMN] if with_ids else DATA_COLUMNS
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
    gs_all = table.column("global_scale").to_numpy().tolist()
    codes, scales, tscales = (_byte_views(table.column(n)) for n in ("codes", "scales", "token_scales"))
    ids_all = table.column(IDS_COLUMN).to_pylist() if with_ids else None
    run, version = manifest.run, manifest.policy_version
    crc_fn = crc32_held if hold_gil else None
    # per chunk only what the checks need (this loop holds the GIL while the other decode
    # workers wait for it): the parts are contiguous 1-D views, hashed as they lie
    for e in entries:
        j = base[e.row_group] + e.row
        c, s, ts = codes[j], scales[j], tscales[j]
        n = e.n_rows
        if c is None or s is None or c.size % n or s.size % n or (ts is not None and ts.size != 4 * n):
            raise CorruptionError(f"shard {where}: {_chunk_desc(e)}: stored byte lengths do not divide into {n} rows")
        cb, sb = c.size // n, s.size // n
        gs = gs_all[j]
        ids = None if ids_all is None else ids_all[j]
        key = ChunkKey(run, version, e.trajectory, e.site, e.token_start, e.n_tokens, n, cb, sb, gs, ids)
        actual = chunk_checksum(key, [c], [s], None if ts is None else [ts], crc_fn=crc_fn)
        if actual != e.checksum:
            raise CorruptionError(
                f"shard {where}: {_chunk_desc(e)}: checksum mismatch "
                f"(stored {e.checksum:#010x}, computed {actual:#010x})"
            )
        on_chunk(StoredChunk(e, c.reshape(n, cb), s.reshape(n, sb), gs, None if ts is None else ts.view("<f4"), ids))


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
# Batches decode on at most this many extra threads (besides each shard's loading thread); the
# encoder builds its row groups' Arrow tables on them too. The decode is GIL-bound (per-chunk
# checks and placing hold it between Arrow's and ISA-L's releases): more threads only queue on it.
#: 198 MiB read, 16 cores: 1.78 GB/s with 2 workers, 1.40 with 1, 1.46 with 8
VERIFY_WORKERS = 2


def worker_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(VERIFY_WORKERS, os.cpu_count() or 1), thread_name_prefix="tracestore-crc"
        )
    return _POOL


# ---------------------------------------------------------------------------- full validation


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
    checksum (:func:`tracestore.checksum.chunk_checksum`), computed over whole columns at once.
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
        if name in table.column_names and name not in ("token_scales", "ids_crc") and table.column(name).null_count:
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
    # 3. every chunk's checksum (tracestore.checksum: tag and key strings, the packed
    # numbers, codes, scales, token scales), from CRCs of the parts combined column-wise: one CRC
    # call per codes and scales value; the head's CRC by linearity from the bytes that differ
    # between chunks
    n_sites = len(snames)
    key = tcodes.indices.to_numpy().astype(np.int64) * n_sites + s_index
    uniq, inverse = np.unique(key, return_inverse=True)
    tnames = tcodes.dictionary.to_pylist()
    prefix = np.array(
        [crc32(key_prefix(cols.run, tnames[k // n_sites], snames[k % n_sites])) for k in uniq.tolist()],
        dtype=np.uint32,
    )[inverse.reshape(-1)]
    head = np.empty(n, HEAD_DTYPE)
    head["pv"] = cols.policy_version
    head["ts"], head["nt"], head["nr"], head["cb"], head["sb"] = start, ntok, nrows, cb, sb
    head["g"] = table.column("global_scale").to_numpy()
    step = HEAD_DTYPE.itemsize
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
    if "ids_crc" in table.column_names and table.column("ids_crc").null_count < n:  # identity folded in last
        ids = table.column("ids_crc")
        has_ids = ids.is_valid().to_numpy(zero_copy_only=False)
        fold = np.empty(int(has_ids.sum()), IDS_FOLD_DTYPE)
        fold["tag"], fold["ids"] = IDS_TAG, ids.drop_null().to_numpy()
        actual[has_ids] = crc32_combine_many(actual[has_ids], _crc_fixed_rows(fold), IDS_FOLD_DTYPE.itemsize)
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
