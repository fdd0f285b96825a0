"""Parquet page checksums verified with ISA-L (tracestore.storage.pagecrc) agree with Arrow's own check,
and the shard file (tracestore.storage.shardfile.ShardFile) checksums exactly the bytes it ends up holding."""

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
from tracestore.records import crc32_combine
from tracestore.storage.arrow import chunks_to_table
from tracestore.storage.pagecrc import _header, _plain_values, verify_pages
from tracestore.storage.shardfile import ShardFile
from tracestore.storage.shards import encode_shard

from .conftest import RUN, SITES, make_chunk


def _shard(page_checksums: bool = True) -> bytes:
    rng = np.random.default_rng(3)
    chunks = [make_chunk(s, t, 0, 200, rng=rng) for s in SITES for t in ("a", "b", "c")]
    if page_checksums:
        data, _ = encode_shard(RUN, 0, "w", 0, "x", chunks, min_row_group_bytes=0)
        assert data is not None
        return bytes(data)
    buf = io.BytesIO()
    pq.write_table(chunks_to_table(chunks), buf, row_group_size=2, data_page_size=1 << 12)
    return buf.getvalue()


def _column_chunks(data: bytes) -> list[tuple[int, int, str]]:
    md = pq.ParquetFile(io.BytesIO(data)).metadata
    out = []
    for g in range(md.num_row_groups):
        for c in range(md.num_columns):
            cc = md.row_group(g).column(c)
            start = (
                cc.dictionary_page_offset
                if cc.has_dictionary_page and cc.dictionary_page_offset
                else cc.data_page_offset
            )
            out.append((start, cc.total_compressed_size, cc.path_in_schema))
    return out


def test_every_page_of_a_shard_verifies():
    data = _shard()
    chunks = _column_chunks(data)
    pages = sum(verify_pages(memoryview(data)[a : a + n], name) for a, n, name in chunks)
    assert pages >= len(chunks)  # one or more pages per column chunk (dictionary pages too)


def _bodies(chunk: memoryview) -> list[tuple[int, int]]:
    """(offset, size) of every page body of a column chunk (headers parsed by pagecrc)."""
    out, pos = [], 0
    while pos < len(chunk):
        fields, body = _header(chunk, pos)
        out.append((body, fields[3]))
        pos = body + fields[3]
    return out


def test_flipped_byte_in_every_page_is_caught_by_us_and_by_arrow():
    data = _shard()
    checked = 0
    for a, n, name in _column_chunks(data)[:12]:  # every column of the first row group
        for off, size in _bodies(memoryview(data)[a : a + n]):
            for at in {off, off + size // 2, off + size - 1}:
                bad = bytearray(data)
                bad[a + at] ^= 0x04
                with pytest.raises(CorruptionError, match=f"{name}: page at byte .* fails its checksum"):
                    verify_pages(memoryview(bytes(bad))[a : a + n], name)
                with pytest.raises((OSError, pa.ArrowException)):  # Arrow agrees the file is damaged
                    pq.ParquetFile(io.BytesIO(bytes(bad)), page_checksum_verification=True).read_row_group(0)
                checked += 1
    assert checked >= 12


def test_truncated_and_unparseable_chunks():
    data = _shard()
    a, n, _ = _column_chunks(data)[9]  # codes of row group 0
    with pytest.raises(CorruptionError, match="claims|does not parse"):
        verify_pages(memoryview(data)[a : a + n - 1], "codes")
    with pytest.raises(CorruptionError, match="does not parse"):
        verify_pages(memoryview(b"\x15"), "codes")  # a field header and nothing after it
    with pytest.raises(CorruptionError, match="does not parse|claims"):
        verify_pages(memoryview(b"\xff" * 64), "codes")


def test_page_without_checksum_is_an_error():
    data = _shard(page_checksums=False)
    a, n, name = _column_chunks(data)[0]
    with pytest.raises(CorruptionError, match="has no checksum"):
        verify_pages(memoryview(data)[a : a + n], name)


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


def test_shard_file_two_regions_collapsed(tmp_path):
    """The primitives of a two-writer shard: a second stream far out, per-region checksums,
    the gap collapsed, the checksum assembled by the owner."""
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        f = ShardFile(fd, str(path))
        if not f.can_collapse():
            pytest.skip("this filesystem cannot collapse ranges (not ext4/XFS)")
        blk = f.block_size
        gap = 64 * blk
        second = f.open_at(gap)
        a, b = f.region(0), f.region(gap)
        f.stream.write(b"A" * (blk + 5))
        f.stream.flush()
        a.advance(f.stream.tell())
        second.write(b"B" * 3000)
        b.advance(second.tell())
        assert second.tell() == gap + 3000
        f.write_at(blk + 5, [bytes(blk - 5)])
        f.collapse(2 * blk, gap - 2 * blk)
        end = f.write_at(2 * blk + 3000, [b"tail"], last=True)
        crc = zlib.crc32(b"tail", crc32_combine(zlib.crc32(bytes(blk - 5), a.crc32), b.crc32, 3000))
        f.finish(end, crc)
    finally:
        os.close(fd)
    expect = b"A" * (blk + 5) + bytes(blk - 5) + b"B" * 3000 + b"tail"
    assert path.read_bytes() == expect
    assert (f.size, f.crc32) == (len(expect), zlib.crc32(expect))


def test_shard_file_surfaces_errors(tmp_path):
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    f = ShardFile(fd, str(path))
    f.stream.write(b"x" * 100)
    os.close(fd)  # the checksum thread's reads now fail
    with pytest.raises(StorageError, match="writing the shard"):
        f.finish()


def test_plain_values_of_the_codes_column_are_the_stored_codes():
    rng = np.random.default_rng(9)
    chunks = [make_chunk(s, t, 0, 300, rng=rng) for s in SITES for t in ("a", "b")]
    data, m = encode_shard(RUN, 0, "w", 0, "x", chunks, min_row_group_bytes=0)
    assert data is not None
    md = pq.ParquetFile(io.BytesIO(bytes(data))).metadata
    col = md.schema.to_arrow_schema().get_field_index("codes")
    by_key = {(c.trajectory, c.site, c.token_start): c for c in chunks}
    got = []
    for g in range(md.num_row_groups):
        cc = md.row_group(g).column(col)
        values: list[memoryview] = []
        verify_pages(
            memoryview(data)[cc.data_page_offset : cc.data_page_offset + cc.total_compressed_size], "codes", values
        )
        got += [bytes(v) for v in values]
    expect = [by_key[(e.trajectory, e.site, e.token_start)].codes.tobytes() for e in m.chunks]
    assert got == expect


def test_plain_values_fall_back_for_compressed_and_dictionary_columns():
    data = _shard()
    md = pq.ParquetFile(io.BytesIO(data)).metadata
    names = md.schema.to_arrow_schema().names
    for name in ("scales", "trajectory"):  # zstd pages; a dictionary page first
        cc = md.row_group(0).column(names.index(name))
        start = (
            cc.dictionary_page_offset if cc.has_dictionary_page and cc.dictionary_page_offset else cc.data_page_offset
        )
        values: list[memoryview] = []
        assert verify_pages(memoryview(data)[start : start + cc.total_compressed_size], name, values) >= 1
        assert values == []


def test_plain_values_that_do_not_tile_the_page_are_corruption():
    body = (3).to_bytes(4, "little") + b"abc" + (5).to_bytes(4, "little") + b"de"  # second value cut short
    out: list[memoryview] = []
    with pytest.raises(CorruptionError, match="runs past the page"):
        _plain_values(memoryview(body), 0, len(body), 2, out, "p")
    body = (3).to_bytes(4, "little") + b"abcXX"  # bytes left over
    with pytest.raises(CorruptionError, match="bytes after"):
        _plain_values(memoryview(body), 0, len(body), 1, [], "p")
    ok = (2).to_bytes(4, "little") + b"hi" + (0).to_bytes(4, "little")
    out = []
    _plain_values(memoryview(ok), 0, len(ok), 2, out, "p")
    assert [bytes(v) for v in out] == [b"hi", b""]
