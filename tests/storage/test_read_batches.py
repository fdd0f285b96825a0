"""A read of many row groups decodes in batches on several threads (shard_read.read_chunks): the
rows, same-version comparisons and corruption reports are those of a read in one batch."""

from __future__ import annotations

import numpy as np
import pytest

from tracestore import ConflictError, CorruptionError
from tracestore.storage import shard_read
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store

from .conftest import RUN, SITES, expected_rows, make_chunk

S0 = SITES[0]
TRAJS = [f"t{i}" for i in range(6)]


def _store(tmp_path) -> tuple[Store, list]:
    from .conftest import SPEC

    store = Store(f"file://{tmp_path}/store", min_row_group_bytes=0)  # one row group per trajectory
    store.put_run(SPEC)
    rng = np.random.default_rng(31)
    chunks = [make_chunk(S0, t, a, 32, rng=rng) for t in TRAJS for a in (0, 32)]
    info = store.write_shard(RUN, 0, "w0", 0, chunks)
    assert len(store.read_manifest(info.manifest_path).row_groups) == len(TRAJS)  # several batches
    return store, chunks


def _plan():
    return [(t, 0, 64) for t in TRAJS]


@pytest.mark.parametrize("hold_gil", [False, True])
def test_batched_read_equals_one_batch(tmp_path, monkeypatch, hold_gil):
    store, chunks = _store(tmp_path)
    one = StoreReader(store, RUN).read(_plan(), sites=[S0.name], hold_gil=hold_gil)[S0.name]
    monkeypatch.setattr(shard_read, "READ_BATCH_BYTES", 1)  # a batch per row group, on every thread
    got = StoreReader(store, RUN).read(_plan(), sites=[S0.name], hold_gil=hold_gil)[S0.name]
    want = expected_rows(chunks, S0, _plan())
    for name in ("codes", "scales", "valid", "global_scale"):
        np.testing.assert_array_equal(getattr(got, name), want[name], err_msg=name)
        np.testing.assert_array_equal(getattr(got, name), getattr(one, name), err_msg=name)


def test_batched_read_compares_same_version_overlaps(tmp_path, monkeypatch):
    store, chunks = _store(tmp_path)
    monkeypatch.setattr(shard_read, "READ_BATCH_BYTES", 1)
    same = next(c for c in chunks if c.trajectory == "t4" and c.token_start == 32)
    store.write_shard(RUN, 0, "w1", 0, [same])  # a retry through another writer: identical bytes
    got = StoreReader(store, RUN).read(_plan(), sites=[S0.name])[S0.name]
    np.testing.assert_array_equal(got.codes, expected_rows(chunks, S0, _plan())["codes"])
    other = make_chunk(S0, "t4", 40, 4, rng=np.random.default_rng(32))
    store.write_shard(RUN, 0, "w2", 0, [other])
    with pytest.raises(ConflictError, match=r"trajectory t4 site layers\.20\.mlp\.input tokens \[40, 44\)"):
        StoreReader(store, RUN).read(_plan(), sites=[S0.name])


def test_batched_read_names_a_corrupt_chunk_in_a_later_batch(tmp_path, monkeypatch):
    store, chunks = _store(tmp_path)
    monkeypatch.setattr(shard_read, "READ_BATCH_BYTES", 1)
    (m,) = store.manifests(RUN, 0)
    assert m.shard is not None
    data = bytearray(store.storage.cat(m.shard))
    last = next(c for c in chunks if c.trajectory == TRAJS[-1] and c.token_start == 32)
    at = bytes(data).find(last.codes.tobytes()[:64])  # codes are stored uncompressed
    assert at > 0
    data[at + 10] ^= 0x04
    store.storage.fs.pipe_file(store.storage.full(m.shard), bytes(data))
    with pytest.raises(CorruptionError, match=rf"part-00000000\.parquet.*trajectory {TRAJS[-1]}"):
        StoreReader(store, RUN).read(_plan(), sites=[S0.name])
    StoreReader(store, RUN).read(_plan()[:-1], sites=[S0.name])  # the other row groups still verify
