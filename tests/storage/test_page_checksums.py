"""Parquet page checksums: every page a shard holds carries one and every read verifies it on every
backend (a flipped byte inside a page, compressed or not, is a CorruptionError naming the shard
before any chunk checksum is computed), and the local shard file (tracestore.storage.local.ShardFile)
checksums exactly the bytes it ends up holding."""

from __future__ import annotations

import io
import os
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tracestore import CorruptionError
from tracestore.errors import StorageError
from tracestore.storage.local import ShardFile
from tracestore.storage.reader import StoreReader
from tracestore.storage.shard_write import encode_shard
from tracestore.storage.store import Store

from .conftest import RUN, SITES, make_chunk

S0 = SITES[0]
PAGE_CRC = "CRC checksum verification failed"  # Arrow's message for a page that fails its checksum


def _shard() -> bytes:
    rng = np.random.default_rng(3)
    chunks = [make_chunk(s, t, 0, 200, rng=rng, token_scales=s is SITES[1]) for s in SITES for t in ("a", "b", "c")]
    data, _ = encode_shard(RUN, 0, "w", 0, "x", chunks, min_row_group_bytes=0)
    assert data is not None
    return bytes(data)


def _column_chunks(data: bytes, group: int) -> list[tuple[int, int, str, str]]:
    """(start, end, column, compression) of every column chunk of one row group."""
    md = pq.ParquetFile(io.BytesIO(data)).metadata
    out = []
    for c in range(md.num_columns):
        cc = md.row_group(group).column(c)
        start = (
            cc.dictionary_page_offset if cc.has_dictionary_page and cc.dictionary_page_offset else cc.data_page_offset
        )
        out.append((start, start + cc.total_compressed_size, cc.path_in_schema, cc.compression))
    return out


def test_a_flipped_byte_in_the_last_page_of_every_column_fails_its_page_checksum():
    """The last byte of a column chunk lies in its last page's body, which the page CRC covers:
    flipped, the checked decode fails on the page checksum for every column of every row group,
    while many of those flips decode without complaint when nobody checks (the layer matters)."""
    data = _shard()
    n_groups = pq.ParquetFile(io.BytesIO(data)).metadata.num_row_groups
    silent = 0
    kinds = set()
    for g in range(n_groups):
        for _, end, _name, compression in _column_chunks(data, g):
            bad = bytearray(data)
            bad[end - 1] ^= 0x04
            with pytest.raises(OSError, match=PAGE_CRC):
                pq.ParquetFile(pa.BufferReader(bytes(bad)), page_checksum_verification=True).read_row_group(g)
            try:
                pq.ParquetFile(pa.BufferReader(bytes(bad))).read_row_group(g)
                silent += 1
            except (OSError, pa.ArrowException):
                pass
            kinds.add(compression)
    assert kinds == {"ZSTD", "SNAPPY", "UNCOMPRESSED"}
    assert silent >= n_groups  # at least one silent flip per row group without page checksums


def _one_shard(store: Store):
    rng = np.random.default_rng(22)
    chunks = [make_chunk(S0, t, 0, 256, rng=rng) for t in ("t1", "t2")]
    store = Store(store.url, store.storage.storage_options, min_row_group_bytes=0)  # one row group per chunk
    return store, store.write_shard(RUN, 0, "w0", 0, chunks)


@pytest.mark.parametrize("column", ["codes", "scales"])  # uncompressed, zstd
def test_flipped_page_byte_is_corruption_naming_the_shard_on_every_backend(store: Store, column: str):
    store, info = _one_shard(store)
    data = bytearray(store.storage.cat(info.path))
    at = {name: end for _, end, name, _ in _column_chunks(bytes(data), 1)}[column] - 1
    data[at] ^= 0x01
    store.storage.fs.pipe_file(store.storage.full(info.path), bytes(data))  # bypassing create-only
    for hold_gil in (False, True):
        with pytest.raises(CorruptionError, match=rf"part-00000000\.parquet.*trajectory t2.*{PAGE_CRC}"):
            StoreReader(store, RUN).read([("t2", 0, 256)], sites=[S0.name], hold_gil=hold_gil)
    StoreReader(store, RUN).read([("t1", 0, 256)], sites=[S0.name])  # the other row group still verifies


def test_shard_file_size_and_crc(tmp_path):
    rng = np.random.default_rng(5)
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (1, 7, 1 << 20, 3 << 20, 0, 12345)]
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        f = ShardFile(fd, str(path), sync_every=1 << 20)  # small: exercises writeback
        for p in parts:
            f.stream.write(p)
            f.progress(f.stream.tell())
        f.finish()
        f.finish()  # idempotent
    finally:
        os.close(fd)
    expect = b"".join(parts)
    assert path.read_bytes() == expect
    assert f.size == len(expect) and f.crc32 == zlib.crc32(expect)


def test_shard_file_surfaces_errors(tmp_path):
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    f = ShardFile(fd, str(path))
    f.stream.write(b"x" * 100)
    os.close(fd)  # the checksum thread's reads now fail
    with pytest.raises(StorageError, match="writing the shard"):
        f.finish()
