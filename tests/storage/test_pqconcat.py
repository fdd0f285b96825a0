"""Two Parquet writers at once, joined by footer rewrite (tracestore.storage.pqconcat), give the file one
writer would give; local shards written that way read back exactly, and every fallback works."""

from __future__ import annotations

import io
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tracestore import CorruptionError
from tracestore.storage import pqconcat
from tracestore.storage import shards as shards_mod
from tracestore.storage.arrow import chunks_to_table
from tracestore.storage.reader import StoreReader
from tracestore.storage.shardfile import ShardFile
from tracestore.storage.shards import _WRITER_OPTIONS
from tracestore.storage.store import Store

from .conftest import RUN, SITES, SPEC, make_chunk


def _chunks(n_traj: int = 6, seed: int = 1) -> list:
    rng = np.random.default_rng(seed)
    return [
        make_chunk(s, f"t{t:02d}", a, 40, rng=rng, token_scales=(t % 3 == 0))
        for t in range(n_traj)
        for s in SITES
        for a in (0, 40)
    ]


def _parquet(table: pa.Table, group_rows: int) -> bytes:
    out = pa.BufferOutputStream()
    with pq.ParquetWriter(out, table.schema, **_WRITER_OPTIONS) as w:
        for a in range(0, table.num_rows, group_rows):
            w.write_table(table.slice(a, group_rows), row_group_size=group_rows)
    return out.getvalue().to_pybytes()


@pytest.mark.parametrize("groups_first", [1, 7, 20])  # the joined list of row groups crosses 15 (long header)
def test_joined_halves_are_the_one_writer_file(groups_first):
    table = chunks_to_table(_chunks(n_traj=10))
    rows = 2
    k = groups_first * rows
    a, b = _parquet(table.slice(0, k), rows), _parquet(table.slice(k), rows)
    body_a, footer_a = pqconcat.split_file(a)
    body_b, footer_b = pqconcat.split_file(b)
    # the second file's bytes after its PAR1 land where the first footer started
    joined = pqconcat.join_footers(footer_a, pqconcat.Footer(footer_b), body_a - 4)
    out = a[:body_a] + b[4:body_b] + joined + len(joined).to_bytes(4, "little") + pqconcat.MAGIC
    assert out == _parquet(table, rows)
    assert pq.ParquetFile(io.BytesIO(out), page_checksum_verification=True).read().equals(table)


def test_footers_of_other_schemas_do_not_join():
    table = chunks_to_table(_chunks(n_traj=2))
    other = table.drop_columns(["token_scales"])
    _, footer_a = pqconcat.split_file(_parquet(table, 3))
    _, footer_b = pqconcat.split_file(_parquet(other, 3))
    with pytest.raises(CorruptionError, match="differ"):
        pqconcat.join_footers(footer_a, pqconcat.Footer(footer_b), 100)
    with pytest.raises(CorruptionError, match="not a Parquet file"):
        pqconcat.split_file(b"PAR1 not really")


def _collapsible(tmp_path) -> bool:
    import os

    fd = os.open(tmp_path / "probe-fs", os.O_RDWR | os.O_CREAT)
    f = ShardFile(fd, str(tmp_path / "probe-fs"))
    try:
        return f.can_collapse()
    finally:
        f.finish()
        os.close(fd)


def _write(tmp_path, name: str, chunks: list) -> tuple[bytes, Store, object]:
    store = Store(f"file://{tmp_path}/{name}", min_row_group_bytes=0, row_group_bytes=4096)
    store.put_run(SPEC)
    info = store.write_shard(RUN, 0, "w", 0, chunks)
    data = (tmp_path / name / str(info.path)).read_bytes()
    m = store.read_manifest(info.manifest_path)
    assert (m.shard_bytes, m.shard_crc32) == (len(data), zlib.crc32(data)) == (info.nbytes, m.shard_crc32)
    return data, store, info


def _same_records(store: Store, chunks: list) -> None:
    res = StoreReader(store, RUN).read([(t, 0, 80) for t in sorted({c.trajectory for c in chunks})])
    for site in SITES:
        rows = res[site.name]
        assert rows.valid.all()
        k = site.rows_per_token
        for i, t in enumerate(sorted({c.trajectory for c in chunks})):
            for c in (c for c in chunks if c.trajectory == t and c.site == site.name):
                o = (i * 80 + c.token_start) * k
                assert np.array_equal(rows.codes[o : o + c.n_rows], c.codes)
                assert np.array_equal(rows.scales[o : o + c.n_rows], c.scales)


@pytest.mark.parametrize(
    "case", ["halves", "first half outgrows its room", "no collapse on this filesystem", "collapse fails", "bad join"]
)
def test_local_shards_in_two_halves_read_back(tmp_path, monkeypatch, case):
    chunks = _chunks()
    monkeypatch.setattr(shards_mod, "PARALLEL_ENCODE", False)
    one, _, _ = _write(tmp_path, "one", chunks)
    monkeypatch.setattr(shards_mod, "PARALLEL_ENCODE", True)
    monkeypatch.setattr(shards_mod.os, "cpu_count", lambda: 2)
    if case == "first half outgrows its room":
        monkeypatch.setattr(shards_mod, "_size_bound", lambda chunks, n: 0)
    if case == "no collapse on this filesystem":
        monkeypatch.setattr(ShardFile, "can_collapse", lambda self: False)
    if case == "collapse fails":

        def fail(self, offset, nbytes):
            raise OSError(22, "collapse refused")

        monkeypatch.setattr(ShardFile, "collapse", fail)
    if case == "bad join":  # a footer whose row groups would land elsewhere is caught before publishing
        join = pqconcat.join_footers
        monkeypatch.setattr(pqconcat, "join_footers", lambda first, second, delta: join(first, second, delta + 8))
    data, store, _ = _write(tmp_path, "two", chunks)
    assert pq.ParquetFile(io.BytesIO(one)).metadata.num_row_groups > 15  # a long row group list header
    if case != "halves" or not _collapsible(tmp_path):
        assert data == one  # the fallbacks write what one writer writes
    else:
        # the same table; the two-writer file holds < one block of padding and a spare PAR1 more
        assert data != one and 0 < len(data) - len(one) < 4096 + 4
    table = pq.ParquetFile(io.BytesIO(data), page_checksum_verification=True).read()
    assert table.equals(pq.ParquetFile(io.BytesIO(one)).read())
    _same_records(store, chunks)
