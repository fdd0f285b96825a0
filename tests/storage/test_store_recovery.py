"""A store recovers from what crashes and outages leave behind, on real local disk: temp files of
killed writers are removed (only ours, only stale ones, also when a sidecar starts), and a storage
root wiped under a running Store gets its run.json back with the next shard."""

from __future__ import annotations

import os
import shutil
import time
import uuid

import numpy as np
import pytest

from tracestore import ConflictError, RunSpec, SiteSpec
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store

from .conftest import RUN, SITES, SPEC, make_chunk

S0 = SITES[0]


def _temp(directory: str, target: str, age_s: float) -> str:
    """A temp file named as our writers name them (``.<target>.tmp-<uuid4 hex>``), ``age_s`` old."""
    path = os.path.join(directory, f".{target}.tmp-{uuid.uuid4().hex}")
    with open(path, "wb") as f:
        f.write(b"partial")
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def _layout_with_temps(store: Store) -> tuple[list[str], list[str]]:
    """Stale temps of each kind our writers leave (shard, manifest, run.json) and files that must stay."""
    info = store.write_shard(RUN, 0, "w0", 0, [make_chunk(S0, "t0", 0, 4)])
    shard_dir = os.path.dirname(store.storage.full(info.path))
    run_dir = store.storage.full(RUN)
    stale = [
        _temp(shard_dir, "part-00000001.parquet", 7200),
        _temp(shard_dir, "part-00000001.manifest.json", 7200),
        _temp(run_dir, "run.json", 7200),
        # a sidecar's shard numbers start at the current microsecond: 16 digits
        _temp(shard_dir, "part-1796169309469735.parquet", 7200),
    ]
    keep = [
        _temp(shard_dir, "part-00000002.parquet", 1),  # a live writer's: fresh
        os.path.join(shard_dir, ".part-00000003.parquet.tmp-notauuid"),  # not a name we create
        os.path.join(shard_dir, ".notes.tmp-" + uuid.uuid4().hex),  # not ours either
        os.path.join(store.storage.full(""), ".part-00000004.parquet.tmp-" + uuid.uuid4().hex),  # outside the layout
    ]
    for p in keep[1:]:
        with open(p, "wb") as f:
            f.write(b"x")
        os.utime(p, (time.time() - 7200, time.time() - 7200))
    return stale, keep


def test_remove_stale_temp_files_removes_only_our_stale_temps(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    store.put_run(SPEC)
    stale, keep = _layout_with_temps(store)
    removed = store.remove_stale_temp_files()
    assert sorted(removed) == sorted(store.storage.rel(p) for p in stale)
    assert not any(os.path.exists(p) for p in stale)
    assert all(os.path.exists(p) for p in keep)
    assert store.remove_stale_temp_files() == []
    assert StoreReader(store, RUN).read([("t0", 0, 4)], sites=[S0.name])[S0.name].valid.all()


def test_remove_stale_temp_files_grace(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    store.put_run(SPEC)
    info = store.write_shard(RUN, 0, "w0", 0, [make_chunk(S0, "t0", 0, 4)])
    shard_dir = os.path.dirname(store.storage.full(info.path))
    recent = _temp(shard_dir, "part-00000001.parquet", 120)  # a slow live write: two minutes without a byte
    assert store.remove_stale_temp_files() == []  # the default grace keeps it
    assert os.path.exists(recent)
    with pytest.raises(ValueError, match="older_than_s"):
        store.remove_stale_temp_files(older_than_s=-1)
    assert store.remove_stale_temp_files(older_than_s=60) == [store.storage.rel(recent)]
    assert Store(f"file://{tmp_path}/absent").remove_stale_temp_files() == []  # no root yet: nothing to do


def test_sidecar_start_removes_stale_temp_files(tmp_path):
    pytest.importorskip("grpc")
    from tracestore.server.config import ServerConfig
    from tracestore.server.rpc.service import Sidecar

    url = f"file://{tmp_path}/store"
    store = Store(url)
    store.put_run(SPEC)
    stale, keep = _layout_with_temps(store)
    sc = Sidecar(ServerConfig(storage=url, wal_dir=None, port=0, metrics_port=None)).start()
    try:
        assert not any(os.path.exists(p) for p in stale)
        assert all(os.path.exists(p) for p in keep)
    finally:
        sc.stop(5)


# ---------------------------------------------------------------- storage wiped under a running Store


def test_wiped_storage_gets_run_json_back_with_the_next_shard(tmp_path):
    root = tmp_path / "store"
    store = Store(f"file://{root}")
    store.put_run(SPEC)
    rng = np.random.default_rng(50)
    store.write_shard(RUN, 0, "w0", 0, [make_chunk(S0, "t0", 0, 4, rng=rng)])
    shutil.rmtree(root)  # the object store restarted empty; this Store still has the spec cached
    c = make_chunk(S0, "t1", 0, 4, rng=rng)
    store.write_shard(RUN, 0, "w0", 1, [c])
    assert (root / RUN / "run.json").exists()
    fresh = Store(f"file://{root}")
    assert fresh.get_run(RUN) == SPEC
    rows = StoreReader(fresh, RUN).read([("t1", 0, 4)], sites=[S0.name])[S0.name]
    np.testing.assert_array_equal(rows.codes, c.codes)
    shutil.rmtree(root)  # again, under the same (run, version) this Store has written before
    store.write_shard(RUN, 0, "w0", 2, [], seals=[])
    assert Store(f"file://{root}").get_run(RUN) == SPEC


def test_wiped_storage_redeclared_with_other_sites_conflicts(tmp_path):
    root = tmp_path / "store"
    store = Store(f"file://{root}")
    store.put_run(SPEC)
    store.write_shard(RUN, 0, "w0", 0, [make_chunk(S0, "t0", 0, 4)])
    shutil.rmtree(root)
    other = RunSpec(RUN, (SiteSpec("layers.9.mlp.input", "moe_input", 9, 64),))
    Store(f"file://{root}").put_run(other)  # someone declared the run again, differently
    with pytest.raises(ConflictError, match=r"run\.json"):
        store.write_shard(RUN, 0, "w0", 1, [make_chunk(S0, "t1", 0, 4)])
    assert Store(f"file://{root}").get_run(RUN) == other  # never overwritten
    assert not (root / RUN / "v0" / "w0" / "part-00000001.manifest.json").exists()
