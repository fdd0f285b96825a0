"""The Arrow schema of record chunks and the lossless chunk <-> Arrow conversion (no torch).

One row per :class:`~tracestore.records.RecordChunk`. Byte payloads are ``large_binary``
(codes and scales row-major, token scales as float32 little-endian bytes), so a table can hold
more than 2 GiB of codes. The schema version lives in the schema metadata
(``tracestore.schema_version``); :func:`table_to_chunks` refuses versions it does not know.

Example::

    table = chunks_to_table(chunks)          # pa.Table with CHUNK_SCHEMA
    assert all(a.same_bytes(b) for a, b in zip(chunks, table_to_chunks(table)))
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from tracestore.errors import CorruptionError, ValidationError
from tracestore.records import RecordChunk

SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = b"tracestore.schema_version"

CHUNK_SCHEMA = pa.schema(
    [
        pa.field("run", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("trajectory", pa.string(), nullable=False),
        pa.field("site", pa.string(), nullable=False),
        pa.field("token_start", pa.int64(), nullable=False),
        pa.field("n_tokens", pa.int64(), nullable=False),
        pa.field("n_rows", pa.int64(), nullable=False),
        pa.field("global_scale", pa.float32(), nullable=False),
        pa.field("checksum", pa.uint32(), nullable=False),
        pa.field("codes", pa.large_binary(), nullable=False),
        pa.field("scales", pa.large_binary(), nullable=False),
        pa.field("token_scales", pa.large_binary(), nullable=True),
        pa.field("ids_crc", pa.uint32(), nullable=True),
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()},
)
KEY_COLUMNS: tuple[str, ...] = ("run", "policy_version", "trajectory", "site", "token_start", "n_tokens", "n_rows")
BYTE_COLUMNS: tuple[str, ...] = ("codes", "scales", "token_scales")
# Columns a table may lack: shards written before chunks carried token identity have no ids_crc
# (their chunks read as carrying none).
OPTIONAL_COLUMNS: tuple[str, ...] = ("ids_crc",)


# Below this mean value size a column is copied into one buffer instead of viewed value by value.
#: a one-value Arrow view costs ~15 us; copying a decode-sized value (~11 KB) well under one
VIEW_MIN_BYTES = 64 << 10


def _large_binary_views(parts: Sequence[np.ndarray | None]) -> pa.ChunkedArray | pa.Array:
    """A large_binary column whose values point at the arrays' own memory (no copy): one chunk per
    value, when the values are large (mean ``VIEW_MIN_BYTES`` or more); else one copy.

    Saves a full copy of the payload when a shard is encoded (the Parquet writer reads the values
    where they are).
    """
    present = [p.nbytes for p in parts if p is not None]
    if not present or sum(present) < VIEW_MIN_BYTES * len(present):
        return _large_binary(parts)
    arrays = []
    for p in parts:
        if p is None:
            arrays.append(pa.nulls(1, pa.large_binary()))
            continue
        data = np.ascontiguousarray(p).view(np.uint8).reshape(-1)
        offsets = np.array([0, data.size], dtype=np.int64)
        arrays.append(
            pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
        )
    return pa.chunked_array(arrays, pa.large_binary())


def _large_binary(parts: Sequence[np.ndarray | None]) -> pa.Array:
    """One large_binary array from byte arrays (None -> null) with a single concatenation."""
    sizes = np.array([0 if p is None else p.nbytes for p in parts], dtype=np.int64)
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    present = [np.ascontiguousarray(p).view(np.uint8).reshape(-1) for p in parts if p is not None]
    data = np.concatenate(present) if present else np.zeros(0, np.uint8)
    validity = None
    if any(p is None for p in parts):
        mask = np.array([p is not None for p in parts], dtype=bool)
        validity = pa.py_buffer(np.packbits(mask, bitorder="little"))
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(parts), [validity, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def chunks_to_table(
    chunks: Sequence[RecordChunk], checksums: Sequence[int] | None = None, *, zero_copy: bool = False
) -> pa.Table:
    """Record chunks -> a ``pa.Table`` with :data:`CHUNK_SCHEMA` (one row per chunk, order kept).

    ``checksums``: the chunks' :attr:`RecordChunk.checksum` values when the caller already has them.
    ``zero_copy``: byte columns reference the chunks' arrays (one Arrow chunk per row) instead of
    one contiguous copy; the table then keeps those arrays alive.
    """
    for c in chunks:
        if not isinstance(c, RecordChunk):
            raise ValidationError(f"chunks_to_table expects RecordChunk objects, got {type(c).__name__}")
    if checksums is None:
        checksums = [c.checksum for c in chunks]
    elif len(checksums) != len(chunks):
        raise ValidationError(f"{len(checksums)} checksums given for {len(chunks)} chunks")
    cols = [
        pa.array([c.run for c in chunks], pa.string()),
        pa.array([c.policy_version for c in chunks], pa.int64()),
        pa.array([c.trajectory for c in chunks], pa.string()),
        pa.array([c.site for c in chunks], pa.string()),
        pa.array([c.token_start for c in chunks], pa.int64()),
        pa.array([c.n_tokens for c in chunks], pa.int64()),
        pa.array([c.n_rows for c in chunks], pa.int64()),
        pa.array(np.array([c.global_scale for c in chunks], dtype=np.float32), pa.float32()),
        pa.array(np.array(checksums, dtype=np.uint32), pa.uint32()),
    ]
    binary = _large_binary_views if zero_copy else _large_binary
    cols += [
        binary([c.codes for c in chunks]),
        binary([c.scales for c in chunks]),
        binary([None if c.token_scales is None else c.token_scales.astype("<f4") for c in chunks]),
        pa.array([c.ids_crc for c in chunks], pa.uint32()),
    ]
    return pa.Table.from_arrays(cols, schema=CHUNK_SCHEMA)


def schema_version_of(schema: pa.Schema) -> int:
    """The schema version in ``schema``'s metadata (CorruptionError when absent)."""
    meta = schema.metadata or {}
    raw = meta.get(SCHEMA_VERSION_KEY)
    if raw is None:
        raise CorruptionError("table has no tracestore.schema_version metadata: not a tracestore record table")
    try:
        return int(raw)
    except ValueError as exc:
        raise CorruptionError(f"tracestore.schema_version {raw!r} is not an integer") from exc


def binary_views(arr: pa.Array | pa.ChunkedArray) -> list[np.ndarray | None]:
    """Zero-copy uint8 views of each value of a (large_)binary array; None for nulls."""
    if isinstance(arr, pa.ChunkedArray):
        out: list[np.ndarray | None] = []
        for ch in arr.chunks:
            out.extend(binary_views(ch))
        return out
    if arr.type == pa.binary():
        arr = arr.cast(pa.large_binary())
    validity, off_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(off_buf, dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    valid = None if arr.null_count == 0 else arr.is_valid().to_numpy(zero_copy_only=False)
    views: list[np.ndarray | None] = []
    for i in range(len(arr)):
        if valid is not None and not valid[i]:
            views.append(None)
        else:
            views.append(data[offsets[i] : offsets[i + 1]])
    return views


def table_to_chunks(table: pa.Table, *, verify: bool = True, where: str = "table") -> list[RecordChunk]:
    """A record table -> chunks (order kept). Arrays are read-only views into Arrow memory.

    ``verify`` recomputes each chunk's checksum and raises :class:`CorruptionError` naming
    ``where`` and the chunk when it differs from the stored one.
    """
    version = schema_version_of(table.schema)
    if version != SCHEMA_VERSION:
        raise CorruptionError(
            f"{where}: tracestore schema version {version} is not supported (this is {SCHEMA_VERSION})"
        )
    missing = [n for n in CHUNK_SCHEMA.names if n not in table.column_names and n not in OPTIONAL_COLUMNS]
    if missing:
        raise CorruptionError(f"{where}: record table lacks columns {missing}")
    py = {n: table.column(n).to_pylist() for n in KEY_COLUMNS}
    g = table.column("global_scale").to_numpy()
    crc = table.column("checksum").to_numpy()
    codes = binary_views(table.column("codes"))
    scales = binary_views(table.column("scales"))
    tscales = binary_views(table.column("token_scales"))
    ids = table.column("ids_crc").to_pylist() if "ids_crc" in table.column_names else [None] * table.num_rows
    out: list[RecordChunk] = []
    for i in range(table.num_rows):
        out.append(
            chunk_from_parts(
                {k: py[k][i] for k in KEY_COLUMNS},
                float(g[i]),
                int(crc[i]),
                codes[i],
                scales[i],
                tscales[i],
                ids[i],
                verify=verify,
                where=f"{where} row {i}",
            )
        )
    return out


def chunk_from_parts(
    key: dict,
    global_scale: float,
    checksum: int,
    codes: np.ndarray | None,
    scales: np.ndarray | None,
    token_scales: np.ndarray | None,
    ids_crc: int | None = None,
    *,
    verify: bool,
    where: str,
) -> RecordChunk:
    """One chunk from its stored columns; checks byte lengths and (optionally) the checksum."""
    desc = (
        f"{where} (trajectory {key['trajectory']} site {key['site']} v{key['policy_version']} "
        f"tokens [{key['token_start']}, {key['token_start'] + key['n_tokens']}))"
    )
    n_rows = key["n_rows"]
    if codes is None or scales is None or n_rows <= 0 or codes.size % n_rows or scales.size % n_rows:
        raise CorruptionError(f"{desc}: codes/scales byte lengths do not divide into {n_rows} rows")
    if token_scales is not None and token_scales.size != 4 * n_rows:
        raise CorruptionError(f"{desc}: token_scales holds {token_scales.size} bytes, expected {4 * n_rows}")
    try:
        chunk = RecordChunk(
            key["run"],
            key["policy_version"],
            key["trajectory"],
            key["site"],
            key["token_start"],
            key["n_tokens"],
            codes.reshape(n_rows, -1),
            scales.reshape(n_rows, -1),
            global_scale,
            None if token_scales is None else token_scales.view("<f4").astype(np.float32, copy=False),
            ids_crc,
        )
    except ValidationError as exc:
        raise CorruptionError(f"{desc}: stored record does not validate: {exc}") from exc
    except ValueError as exc:
        raise CorruptionError(f"{desc}: stored record does not validate: {exc}") from exc
    if verify:
        actual = chunk.checksum
        if actual != checksum:
            raise CorruptionError(f"{desc}: checksum mismatch (stored {checksum:#010x}, computed {actual:#010x})")
    return chunk
