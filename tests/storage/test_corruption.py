"""Corruption is detected and never served: flipped bytes, truncated, swapped and damaged files.

Every case names the shard (and the chunk where one can be named) and leaves other shards readable.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import numpy as np
import pyarrow.parquet as pq
import pytest

from tracestore import CorruptionError, TrajectorySeal
from tracestore.cli import main as cli_main
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store

from .conftest import RUN, SITES, make_chunk

S0 = SITES[0]


def _two_shards(store: Store):
    rng = np.random.default_rng(20)
    a = [make_chunk(S0, t, 0, 256, rng=rng) for t in ("t1", "t2")]
    b = [make_chunk(S0, "t3", 0, 256, rng=rng)]
    store = Store(store.url, store.storage.storage_options, min_row_group_bytes=0)  # one row group per chunk
    ia = store.write_shard(RUN, 0, "w0", 0, a)
    ib = store.write_shard(RUN, 0, "w0", 1, b)
    return store, a, b, ia, ib


def _overwrite(store: Store, rel: str, data: bytes) -> None:
    store.storage.fs.pipe_file(store.storage.full(rel), data)  # plain overwrite, bypassing create-only


def _read(store: Store, traj: str, hold_gil: bool = False):
    return StoreReader(store, RUN).read([(traj, 0, 256)], sites=[S0.name], hold_gil=hold_gil)


def test_flipped_code_byte_names_shard_and_chunk(store: Store):
    store, a, b, ia, ib = _two_shards(store)
    data = bytearray(store.storage.cat(ia.path))
    at = bytes(data).find(a[1].codes.tobytes()[:64])  # t2's codes are stored uncompressed
    assert at > 0
    data[at + 100] ^= 0x10
    _overwrite(store, ia.path, bytes(data))
    for hold_gil in (False, True):  # the CRCs of a background read (GIL kept) catch it the same
        with pytest.raises(CorruptionError, match=r"part-00000000\.parquet.*trajectory t2") as err:
            _read(store, "t2", hold_gil)
        assert "site layers.20.mlp.input" in str(err.value)
    _read(store, "t1")  # another row group of the same shard still verifies
    _read(store, "t3")  # and the other shard


def test_flipped_byte_in_compressed_scales_page(store: Store):
    store, a, b, ia, ib = _two_shards(store)
    data = bytearray(store.storage.cat(ia.path))
    md = pq.ParquetFile(io.BytesIO(bytes(data))).metadata
    col = md.schema.to_arrow_schema().get_field_index("scales")
    chunk_md = md.row_group(0).column(col)
    assert chunk_md.compression == "ZSTD"
    data[chunk_md.data_page_offset + chunk_md.total_compressed_size // 2] ^= 0x01
    _overwrite(store, ia.path, bytes(data))
    for hold_gil in (False, True):
        with pytest.raises(CorruptionError, match=r"part-00000000\.parquet"):
            _read(store, "t1", hold_gil)
    _read(store, "t3")


def test_truncated_shard(store: Store):
    store, a, b, ia, ib = _two_shards(store)
    _overwrite(store, ia.path, store.storage.cat(ia.path)[:-1000])
    with pytest.raises(CorruptionError, match=r"part-00000000\.parquet.*truncated"):
        _read(store, "t1")
    _read(store, "t3")


def test_swapped_shard(store: Store):
    store, a, b, ia, ib = _two_shards(store)
    rng = np.random.default_rng(21)
    # a same-sized impostor: another writer's shard with the same shape, copied over w0's seq 1
    other = store.write_shard(RUN, 0, "w9", 0, [make_chunk(S0, "t4", 0, 256, rng=rng)])
    _overwrite(store, ib.path, store.storage.cat(other.path))
    with pytest.raises(CorruptionError, match=r"part-00000001\.parquet"):
        _read(store, "t3")
    _read(store, "t1")
    _read(store, "t4")


def test_damaged_manifest(store: Store):
    store, a, b, ia, ib = _two_shards(store)
    _overwrite(store, ib.manifest_path, b'{"format": "something else"}')
    fresh = Store(store.url, store.storage.storage_options)  # no cached manifest
    with pytest.raises(CorruptionError, match=r"manifest .*part-00000001\.manifest\.json"):
        StoreReader(fresh, RUN).read([("t1", 0, 256)], sites=[S0.name])


def _inspect(*args: str) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli_main(["inspect", *args])
    return rc, buf.getvalue()


def test_inspect_validate(store: Store):
    store, a, b, ia, ib = _two_shards(store)
    opts = ["--storage-options", json.dumps(store.storage.storage_options)] if store.storage.storage_options else []
    store.write_shard(RUN, 0, "w0", 2, [], seals=[TrajectorySeal(RUN, 0, "t1", 257, (S0.name,))])
    rc, out = _inspect(store.url, *opts, "--validate", "--trajectory", "t1")
    assert rc == 0, out
    assert "validation OK" in out and "sealed at 257 tokens" in out and "[0, 256)" in out
    # a sealed trajectory with a hole is reported as missing
    store.write_shard(RUN, 0, "w0", 3, [], seals=[TrajectorySeal(RUN, 0, "t3", 300, (S0.name,))])
    rc, out = _inspect(store.url, *opts, "--run", RUN, "--version", "0", "--validate")
    assert rc == 1 and "MISSING sealed trajectory t3" in out and "[256, 299)" in out
    # and a flipped byte anywhere in a shard fails validation, naming it
    data = bytearray(store.storage.cat(ia.path))
    data[len(data) // 2] ^= 0xFF
    _overwrite(store, ia.path, bytes(data))
    rc, out = _inspect(store.url, *opts, "--validate")
    assert rc == 1 and "CORRUPT shard" in out and "part-00000000.parquet" in out
    rc, out = _inspect(store.url, *opts)  # the summary alone does not validate
    assert rc == 0 and "v0:" in out
