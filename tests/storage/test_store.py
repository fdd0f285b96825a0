"""Storage conformance suite: every test runs on memory://, file:// and s3:// (moto on loopback)."""

from __future__ import annotations

import numpy as np
import pytest

from tracestore import (
    ConfigError,
    ConflictError,
    CorruptionError,
    MissingRecordsError,
    NotFoundError,
    PrefixLink,
    RunSpec,
    SiteSpec,
    TrajectorySeal,
    ValidationError,
)
from tracestore.plan import MicrobatchPlan
from tracestore.storage.reader import OutputArrays, StoreReader
from tracestore.storage.store import Store

from .conftest import RUN, SITES, SPEC, expected_rows, make_chunk

S0, S1, S2 = SITES


def _check(res, chunks, site, segments, cols=None):
    exp = expected_rows(chunks, site, segments, cols)
    got = res[site.name]
    np.testing.assert_array_equal(got.valid, exp["valid"])
    np.testing.assert_array_equal(got.codes, exp["codes"])
    np.testing.assert_array_equal(got.scales, exp["scales"])
    np.testing.assert_array_equal(got.global_scale, exp["global_scale"])


def test_run_spec_round_trip(store: Store):
    assert store.get_run(RUN) == SPEC
    assert Store(store.url, store.storage.storage_options).get_run(RUN) == SPEC  # from storage, not cache
    assert store.put_run(SPEC) is False  # repeat: no-op
    with pytest.raises(ConflictError, match="already declared"):
        store.put_run(RunSpec(RUN, SITES[:1]))
    with pytest.raises(NotFoundError, match="put_run"):
        store.get_run("nope")
    assert store.list_runs() == [RUN]


def test_write_read_packed_plan(store: Store):
    rng = np.random.default_rng(1)
    chunks = []
    for w, traj in enumerate(["t0", "t1", "t2"]):
        for s in SITES:
            chunks += [make_chunk(s, traj, 0, 7, rng=rng), make_chunk(s, traj, 7, 9, rng=rng)]
        store.write_shard(RUN, 0, f"w{w % 2}", w, [c for c in chunks if c.trajectory == traj])
    plan = MicrobatchPlan.from_cu_seqlens(["t2", "t0", "t1"], [0, 16, 21, 30], offsets=[0, 3, 7])
    res = StoreReader(store, RUN).read(plan)
    assert set(res) == {s.name for s in SITES}
    for s in SITES:
        _check(res, chunks, s, plan.segments)
        assert res[s.name].valid.all() and (res[s.name].policy_version == 0).all()
    assert res.stats.chunks == 3 * 3 * 2 - 3  # t0 [3, 8) needs both of its chunks, t1 [7,16) only the 2nd
    assert store.list_writers(RUN, 0) == ["w0", "w1"]
    assert store.list_trajectories(RUN, 0) == ["t0", "t1", "t2"]
    assert store.list_versions(RUN) == [0]


def test_repeated_write_is_noop_and_conflict_detected(store: Store):
    rng = np.random.default_rng(2)
    chunks = [make_chunk(S0, "t0", 0, 5, rng=rng)]
    seal = TrajectorySeal(RUN, 0, "t0", 6, (S0.name,))
    first = store.write_shard(RUN, 0, "w0", 0, chunks, seals=[seal])
    again = store.write_shard(RUN, 0, "w0", 0, chunks, seals=[seal])
    assert first.written and not again.written and first.nbytes == again.nbytes
    assert len(store.manifest_paths(RUN, 0)) == 1
    files = store.storage.find(f"{RUN}/v0")
    assert sorted(files) == sorted([first.path, first.manifest_path])  # no temp files left behind
    with pytest.raises(ConflictError, match="different"):
        store.write_shard(RUN, 0, "w0", 0, [make_chunk(S0, "t0", 0, 5, rng=rng)])


def test_write_validation(store: Store):
    rng = np.random.default_rng(3)
    ok = make_chunk(S0, "t0", 0, 3, rng=rng)
    with pytest.raises(ValidationError, match="does not belong"):
        store.write_shard(RUN, 1, "w0", 0, [ok])
    with pytest.raises(ValidationError):
        store.write_shard(RUN, 0, "../escape", 0, [ok])
    with pytest.raises(ValidationError):
        store.write_shard(RUN, 0, "w0", -1, [ok])
    with pytest.raises(NotFoundError, match="no site"):
        store.write_shard(RUN, 0, "w0", 0, [make_chunk(SiteSpec("other", "other", 0, 64), "t0", 0, 3, rng=rng)])
    wrong_width = make_chunk(SiteSpec(S0.name, "moe_input", 20, 32), "t0", 0, 3, rng=rng)
    with pytest.raises(ValueError, match="codes must be uint8"):
        store.write_shard(RUN, 0, "w0", 0, [wrong_width])
    with pytest.raises(NotFoundError):
        store.write_shard(RUN, 0, "w0", 0, [], seals=[TrajectorySeal(RUN, 0, "t0", 4, ("missing-site",))])
    with pytest.raises(NotFoundError, match="put_run"):
        store.write_shard("other-run", 0, "w0", 0, [])
    assert store.list_versions(RUN) == []  # nothing was published


def test_missing_names_trajectory_site_tokens_and_mask(store: Store):
    rng = np.random.default_rng(4)
    chunks = [make_chunk(S0, "t0", 0, 4, rng=rng), make_chunk(S0, "t0", 6, 4, rng=rng)]
    store.write_shard(RUN, 0, "w0", 0, chunks)
    reader = StoreReader(store, RUN)
    msg = r"trajectory t0 site layers\.20\.mlp\.input tokens \[4, 6\), \[10, 12\)"
    with pytest.raises(MissingRecordsError, match=msg):
        reader.read([("t0", 0, 12)], sites=[S0.name])
    res = reader.read([("t0", 0, 12)], sites=[S0.name], on_missing="mask")
    _check(res, chunks, S0, [("t0", 0, 12)])
    assert res.stats.missing_rows == 4
    with pytest.raises(MissingRecordsError, match="t9"):
        reader.read([("t9", 0, 1)], sites=[S0.name])


def test_sealed_final_position_is_not_missing(store: Store):
    rng = np.random.default_rng(5)
    chunks = [make_chunk(s, "t0", 0, 9, rng=rng) for s in SITES]
    store.write_shard(RUN, 0, "w0", 0, chunks)
    reader = StoreReader(store, RUN)
    with pytest.raises(MissingRecordsError, match=r"tokens \[9, 10\)"):
        reader.read([("t0", 0, 10)])  # not sealed yet: the last token is missing
    with pytest.raises(MissingRecordsError, match="no seal"):
        reader.read([("t0", 0, 9)], require_sealed=True)
    store.write_shard(RUN, 0, "w0", 1, [], seals=[TrajectorySeal(RUN, 0, "t0", 10, tuple(s.name for s in SITES))])
    res = reader.read([("t0", 0, 10)], require_sealed=True)
    for s in SITES:
        assert res[s.name].valid[: 9 * s.rows_per_token].all() and not res[s.name].valid[9 * s.rows_per_token :].any()
    assert res.stats.exempt_rows == sum(s.rows_per_token for s in SITES)
    with pytest.raises(MissingRecordsError, match=r"tokens \[10, 11\)"):
        reader.read([("t0", 0, 11)])  # past the seal


def test_prefix_links_resolve(store: Store):
    rng = np.random.default_rng(6)
    a = [make_chunk(S0, "a", 0, 8, rng=rng)]
    b = [make_chunk(S0, "b", 4, 6, rng=rng)]
    c = [make_chunk(S0, "c", 6, 3, rng=rng)]
    store.write_shard(RUN, 0, "w0", 0, a + b, links=[PrefixLink(RUN, 0, "b", "a", 4)])
    store.write_shard(RUN, 0, "w1", 0, c, links=[PrefixLink(RUN, 0, "c", "b", 6)])
    res = StoreReader(store, RUN).read([("c", 0, 9), ("b", 2, 6)], sites=[S0.name])
    got = res[S0.name].codes
    np.testing.assert_array_equal(got[0:4], a[0].codes[0:4])  # c -> b -> a
    np.testing.assert_array_equal(got[4:6], b[0].codes[0:2])  # c -> b
    np.testing.assert_array_equal(got[6:9], c[0].codes)
    np.testing.assert_array_equal(got[9:13], np.concatenate([a[0].codes[2:4], b[0].codes[0:2]]))
    assert res[S0.name].valid.all()


def test_conflicting_links_and_cycles(store: Store):
    rng = np.random.default_rng(14)
    store.write_shard(RUN, 0, "w0", 0, [make_chunk(S0, t, 0, 4, rng=rng) for t in ("a", "b", "c")])
    store.write_shard(RUN, 0, "w0", 1, [], links=[PrefixLink(RUN, 0, "c", "a", 2)])
    store.write_shard(RUN, 0, "w1", 0, [], links=[PrefixLink(RUN, 0, "c", "b", 2)])
    with pytest.raises(ConflictError, match="different sources"):
        StoreReader(store, RUN).read([("c", 0, 4)], sites=[S0.name])
    store.write_shard(RUN, 1, "w0", 0, [], links=[PrefixLink(RUN, 1, "x", "y", 2), PrefixLink(RUN, 1, "y", "x", 2)])
    with pytest.raises(CorruptionError, match="cycle"):
        StoreReader(store, RUN).read([("x", 0, 4)], versions=1, sites=[S0.name])


def test_versions_newest_wins_and_staleness(store: Store):
    rng = np.random.default_rng(7)
    v0 = [make_chunk(S0, "t0", 0, 8, version=0, rng=rng)]
    v2 = [make_chunk(S0, "t0", 4, 4, version=2, rng=rng), make_chunk(S0, "t1", 0, 4, version=2, rng=rng)]
    store.write_shard(RUN, 0, "w0", 0, v0)
    store.write_shard(RUN, 2, "w0", 0, v2)
    reader = StoreReader(store, RUN)
    res = reader.read([("t0", 0, 8)], sites=[S0.name])
    rows = res[S0.name]
    assert rows.policy_version.tolist() == [0] * 4 + [2] * 4
    np.testing.assert_array_equal(rows.codes[4:], v2[0].codes)
    only0 = reader.read([("t0", 0, 8)], versions=0, sites=[S0.name])[S0.name]
    np.testing.assert_array_equal(only0.codes, v0[0].codes)
    with pytest.raises(MissingRecordsError):
        reader.read([("t0", 0, 8)], sites=[S0.name], max_staleness=1)  # v0 is dropped as stale
    flagged = reader.read([("t0", 0, 8)], sites=[S0.name], max_staleness=1, stale="flag")[S0.name]
    assert flagged.valid.all() and flagged.stale.tolist() == [True] * 4 + [False] * 4
    fresh = reader.read([("t0", 0, 8)], sites=[S0.name], max_staleness=1, current_version=1, on_missing="mask")
    assert fresh[S0.name].valid.all()  # 0 >= 1 - 1


def test_site_subset_and_column_range(store: Store):
    rng = np.random.default_rng(8)
    chunks = [make_chunk(s, "t0", 0, 5, rng=rng, token_scales=(s is S1)) for s in SITES]
    store.write_shard(RUN, 0, "w0", 0, chunks)
    reader = StoreReader(store, RUN)
    res = reader.read([("t0", 1, 5)], sites=[S1.name], columns=(16, 48))
    assert list(res) == [S1.name]
    _check(res, chunks, S1, [("t0", 1, 5)], cols=(16, 48))
    assert res[S1.name].codes.shape == (8, 8) and res[S1.name].scales.shape == (8, 2)
    np.testing.assert_array_equal(res[S1.name].token_scales, chunks[1].token_scales[2:10])
    res = reader.read([("t0", 0, 5)], columns={S2.name: (32, 64)}, sites=[S0.name, S2.name])
    _check(res, chunks, S0, [("t0", 0, 5)])
    _check(res, chunks, S2, [("t0", 0, 5)], cols=(32, 64))
    assert res[S0.name].token_scales is None
    for bad in [(8, 24), (0, 80), (32, 16), (1,)]:
        with pytest.raises(ConfigError):
            reader.read([("t0", 0, 5)], sites=[S0.name], columns=bad)
    with pytest.raises(ConfigError):
        reader.read([("t0", 0, 5)], sites=[S2.name], columns=(16, 48))  # MX blocks are 32 wide


def test_background_reads_keeping_the_gil_return_the_same_rows(store: Store):
    # hold_gil=True (GuidanceReader's prefetch) copies and checksums with the GIL kept: same rows,
    # for whole rows and column ranges (the non-contiguous copies), token scales, two shards
    rng = np.random.default_rng(11)
    chunks = [make_chunk(s, t, 0, 9, rng=rng, token_scales=(s is S1)) for t in ("t0", "t1") for s in SITES]
    store.write_shard(RUN, 0, "w0", 0, chunks[:3])
    store.write_shard(RUN, 0, "w1", 0, chunks[3:])
    reader = StoreReader(store, RUN)
    plan = [("t1", 2, 9), ("t0", 0, 9), (None, 0, 3)]
    for kw in ({}, {"columns": {S0.name: (16, 48), S1.name: (32, 64)}}):
        a, b = reader.read(plan, **kw), reader.read(plan, hold_gil=True, **kw)
        assert set(a) == set(b) == {s.name for s in SITES}
        for s in SITES:
            for field in ("codes", "scales", "global_scale", "token_scales", "valid", "policy_version"):
                x, y = getattr(a[s.name], field), getattr(b[s.name], field)
                assert (x is None) == (y is None), field
                if x is not None:
                    np.testing.assert_array_equal(x, y, err_msg=f"{s.name}.{field}")
        _check(b, chunks, S0, MicrobatchPlan(plan).segments, cols=kw.get("columns", {}).get(S0.name))


def test_reads_into_caller_arrays_fill_them_in_place(store: Store):
    # out=: rows land in the caller's arrays (e.g. rows of a shared block), layout() gives the
    # shapes; the same rows as a read into new memory; wrong arrays are refused, naming the field
    rng = np.random.default_rng(12)
    chunks = [make_chunk(s, t, 0, 9, rng=rng, token_scales=(s is S1)) for t in ("t0", "t1") for s in SITES]
    store.write_shard(RUN, 0, "w0", 0, chunks)
    reader = StoreReader(store, RUN)
    plan = [("t1", 2, 9), (None, 0, 3), ("t0", 0, 9)]
    n_tokens = MicrobatchPlan(plan).n_tokens
    cols = {S0.name: (16, 48)}
    out = {}
    for site, n, cb, sb in reader.layout(n_tokens, columns=cols):
        out[site.name] = OutputArrays(
            np.full((n, cb), 0xAB, np.uint8), np.full((n, sb), 0xAB, np.uint8), np.zeros(n, np.int64),
            np.zeros(n, np.float32), np.zeros(n, bool),
        )  # fmt: skip
    got, want = reader.read(plan, columns=cols, out=out), reader.read(plan, columns=cols)
    for s in SITES:
        assert got[s.name].codes is out[s.name].codes and got[s.name].valid is out[s.name].valid
        for field in ("codes", "scales", "global_scale", "token_scales", "valid", "policy_version"):
            x, y = getattr(got[s.name], field), getattr(want[s.name], field)
            assert (x is None) == (y is None), field
            if x is not None:
                np.testing.assert_array_equal(x, y, err_msg=f"{s.name}.{field}")
    bad = dict(out)
    o = out[S0.name]
    bad[S0.name] = OutputArrays(o.codes[:, :-1], o.scales, o.policy_version, o.global_scale, o.valid)
    with pytest.raises(
        ValidationError, match=r"out\['layers\.20\.mlp\.input'\]\.codes must be a writable C-contiguous uint8"
    ):
        reader.read(plan, columns=cols, out=bad)
    with pytest.raises(ValidationError, match=r"out has no OutputArrays for site layers\.3\.attn\.k"):
        reader.read(plan, columns=cols, out={k: v for k, v in out.items() if k != S2.name})


def test_duplicates_across_shards(store: Store):
    rng = np.random.default_rng(9)
    c = make_chunk(S0, "t0", 0, 6, rng=rng)
    store.write_shard(RUN, 0, "w0", 0, [c])
    store.write_shard(RUN, 0, "w1", 0, [c])  # a retry through another writer: identical bytes
    reader = StoreReader(store, RUN)
    _check(reader.read([("t0", 0, 6)], sites=[S0.name]), [c], S0, [("t0", 0, 6)])
    other = make_chunk(S0, "t0", 3, 2, rng=rng)
    store.write_shard(RUN, 0, "w2", 0, [other])
    with pytest.raises(ConflictError, match=r"trajectory t0 site layers\.20\.mlp\.input tokens \[3, 5\)"):
        reader.read([("t0", 0, 6)], sites=[S0.name])


def test_padding_and_context_parallel_plans(store: Store):
    rng = np.random.default_rng(10)
    chunks = [make_chunk(S0, t, 0, n, rng=rng) for t, n in (("a", 13), ("b", 7))]
    store.write_shard(RUN, 0, "w0", 0, chunks)
    reader = StoreReader(store, RUN)
    plan = MicrobatchPlan.padded(["a", "b"], [13, 7], max_len=16)
    res = reader.read(plan, sites=[S0.name])
    _check(res, chunks, S0, plan.segments)
    assert res[S0.name].valid.sum() == 20 and res[S0.name].codes.shape[0] == 32
    seen = []
    for rank in range(2):
        plan = MicrobatchPlan.context_parallel(["a", "b"], [13, 7], cp_size=2, cp_rank=rank)
        res = reader.read(plan, sites=[S0.name])
        _check(res, chunks, S0, plan.segments)
        seen += [(s.trajectory, t) for s in plan.segments if s.trajectory for t in range(s.token_start, s.token_end)]
    assert sorted(seen) == sorted([("a", t) for t in range(13)] + [("b", t) for t in range(7)])


def test_reads_are_ranged(store: Store):
    rng = np.random.default_rng(11)
    trajs = [f"t{i}" for i in range(12)]
    chunks = [make_chunk(s, t, 0, 1024, rng=rng) for t in trajs for s in SITES]
    store = Store(store.url, store.storage.storage_options, row_group_bytes=1 << 20, min_row_group_bytes=0)
    info = store.write_shard(RUN, 0, "w0", 0, chunks)
    reader = StoreReader(store, RUN)
    res = reader.read([("t5", 0, 1024)], sites=[S0.name])
    assert res.stats.row_groups == 1 and res.stats.chunks == 1
    one_chunk = chunks[5 * 3].nbytes
    # the footer, plus the one (trajectory, site) row group: far below the shard's size
    assert res.stats.bytes_read < info.nbytes / 10, (res.stats.bytes_read, info.nbytes, one_chunk)
    res2 = reader.read([("t5", 0, 1024)], sites=[S0.name])
    assert res2.stats.bytes_read < res.stats.bytes_read  # the footer is cached
    assert one_chunk <= res2.stats.bytes_read < 1.2 * one_chunk, (res2.stats.bytes_read, one_chunk)


def test_seal_only_and_link_only_writes(store: Store):
    info = store.write_shard(RUN, 3, "w0", 0, [], seals=[TrajectorySeal(RUN, 3, "x", 5, (S0.name,))])
    assert info.path is None and info.n_chunks == 0
    assert store.list_trajectories(RUN, 3) == ["x"]
    reader = StoreReader(store, RUN)
    assert reader.read([("x", 4, 5)], sites=[S0.name])[S0.name].valid.tolist() == [False]  # final position


def test_unpublished_shard_is_invisible(store: Store):
    rng = np.random.default_rng(12)
    c = make_chunk(S0, "t0", 0, 4, rng=rng)
    info = store.write_shard(RUN, 0, "w0", 0, [c])
    # a shard whose manifest never landed (writer crashed in between): copy bytes to seq 1
    store.storage.publish(f"{RUN}/v0/w0/part-00000001.parquet", store.storage.cat(info.path))
    assert len(store.manifest_paths(RUN, 0)) == 1
    assert StoreReader(store, RUN).read([("t0", 0, 4)], sites=[S0.name]).stats.shards == 1


def test_retention_and_listing(store: Store):
    rng = np.random.default_rng(13)
    for v in range(4):
        store.write_shard(RUN, v, "w0", 0, [make_chunk(S0, f"t{v}", 0, 3, version=v, rng=rng)])
    reader = StoreReader(store, RUN)
    assert reader.read([("t1", 0, 3)], sites=[S0.name])[S0.name].valid.all()
    assert store.list_versions(RUN) == [0, 1, 2, 3]
    assert store.delete_versions_older_than(RUN, 2) == [0, 1]
    assert store.list_versions(RUN) == [2, 3]
    assert store.storage.find(f"{RUN}/v0") == [] and store.storage.find(f"{RUN}/v1") == []
    with pytest.raises(MissingRecordsError):
        reader.read([("t1", 0, 3)], sites=[S0.name])
    assert reader.read([("t3", 0, 3)], sites=[S0.name])[S0.name].valid.all()
    assert store.delete_versions_older_than(RUN, 2) == []


def test_shard_file_layout(store: Store):
    import io
    import zlib

    import pyarrow.parquet as pq

    rng = np.random.default_rng(15)
    chunks = [make_chunk(s, t, 0, 4, rng=rng) for t in ("b", "a") for s in SITES]
    info = store.write_shard(RUN, 0, "w0", 0, chunks)
    assert info.path == f"{RUN}/v0/w0/part-00000000.parquet"
    data = store.storage.cat(info.path)
    m = store.read_manifest(info.manifest_path)
    assert (m.shard_bytes, m.shard_crc32) == (len(data), zlib.crc32(data)) == (info.nbytes, m.shard_crc32)
    pf = pq.ParquetFile(io.BytesIO(data))
    assert pf.metadata.metadata[b"tracestore.schema_version"] == b"1"
    rg = pf.metadata.row_group(0)
    comp = {rg.column(i).path_in_schema: rg.column(i).compression for i in range(rg.num_columns)}
    assert comp["codes"] == "UNCOMPRESSED" and comp["scales"] == "ZSTD" and comp["token_scales"] == "ZSTD"
    assert comp["trajectory"] == comp["token_start"] == comp["checksum"] == "SNAPPY"  # per-chunk columns
    table = pf.read()
    cols = [table[n].to_pylist() for n in ("trajectory", "site", "token_start")]
    keys = list(zip(*cols, strict=True))
    assert keys == sorted(keys)  # rows sorted by (trajectory, site, token_start)


def test_stale_temp_files_are_removed(store: Store):
    import os
    import time

    rng = np.random.default_rng(16)
    info = store.write_shard(RUN, 0, "w0", 0, [make_chunk(S0, "t0", 0, 4, rng=rng)])
    if not store.storage.local:
        assert store.remove_stale_temp_files(0) == []  # one-call publishes never leave temp files
        return
    shard_dir = os.path.dirname(store.storage.full(info.path))
    crashed = os.path.join(shard_dir, ".part-00000001.parquet.tmp-" + "d" * 32)  # named as our writers name them
    fresh = os.path.join(shard_dir, ".part-00000002.parquet.tmp-" + "e" * 32)
    for p in (crashed, fresh):
        with open(p, "wb") as f:
            f.write(b"partial")
    old = time.time() - 7200
    os.utime(crashed, (old, old))
    assert store.remove_stale_temp_files(3600) == [f"{RUN}/v0/w0/.part-00000001.parquet.tmp-{'d' * 32}"]
    assert os.path.exists(fresh) and not os.path.exists(crashed)
    assert StoreReader(store, RUN).read([("t0", 0, 4)], sites=[S0.name])[S0.name].valid.all()
    with StoreReader(store, RUN) as r, store:
        r.read([("t0", 0, 4)], sites=[S0.name])
    assert store.list_versions(RUN) == [0]  # usable after close


def test_concurrent_reads_while_writing(store: Store):
    import threading

    rng = np.random.default_rng(17)
    base = [make_chunk(S0, f"t{i}", 0, 16, rng=rng) for i in range(6)]
    store.write_shard(RUN, 0, "w0", 0, base)
    reader = StoreReader(store, RUN)
    errors: list[BaseException] = []

    def read_loop(i: int) -> None:
        try:
            for _ in range(5):
                res = reader.read([(f"t{i}", 0, 16), (f"t{(i + 1) % 6}", 4, 12)], sites=[S0.name])
                _check(res, base, S0, [(f"t{i}", 0, 16), (f"t{(i + 1) % 6}", 4, 12)])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=read_loop, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for seq in range(1, 4):  # new shards land while the reads run
        store.write_shard(RUN, 0, f"w{seq}", 0, [make_chunk(S0, f"new{seq}", 0, 4, rng=rng)])
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert reader.read([("new3", 0, 4)], sites=[S0.name])[S0.name].valid.all()


def test_shard_of_many_row_groups_round_trips(store: Store):
    """A shard of many row groups, one Parquet writer, on every backend: what is read back is what
    was written, and every row group and page checksum verifies."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    store.min_row_group_bytes = 1  # a row group per (trajectory, site)
    rng = np.random.default_rng(13)
    trajs = [f"t{i}" for i in range(5)]
    chunks = [make_chunk(s, t, a, 40, rng=rng, token_scales=s is S1) for t in trajs for s in SITES for a in (0, 40)]
    info = store.write_shard(RUN, 0, "w", 0, chunks)
    data = store.storage.cat(info.path)
    pf = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True)
    assert pf.metadata.num_row_groups == len(trajs) * len(SITES) and pf.metadata.num_rows == len(chunks)
    assert pf.read().num_rows == len(chunks)
    plan = MicrobatchPlan([(t, 0, 80) for t in trajs])
    res = StoreReader(store, RUN).read(plan)
    for s in SITES:
        _check(res, chunks, s, plan.segments)


def test_the_manifest_cache_is_bounded_and_readers_still_read_everything(store: Store, monkeypatch):
    """Before: every manifest a Store published or read stayed cached for its life, so a long-lived
    sidecar grew with everything it wrote (+63 MiB per 80,000 chunks). Now the cache holds at most
    ``_MAX_MANIFEST_ENTRIES`` chunk entries, least recently used dropped first."""
    monkeypatch.setattr(type(store), "_MAX_MANIFEST_ENTRIES", 40)
    chunks = []
    for seq in range(1, 13):  # 12 shards of 10 chunks: 120 entries published
        batch = [make_chunk(S0, f"t{seq}-{i}", 0, 2) for i in range(10)]
        store.write_shard(RUN, 0, "w0", seq, batch)
        chunks += batch
    cached = store._manifests  # noqa: SLF001 - the bound is the point of this test
    assert sum(len(m.chunks) for m in cached.values()) <= 40 and len(cached) == 4
    assert store._manifest_entries == 40  # noqa: SLF001
    # a fresh reader still sees every shard (the dropped manifests are read again from storage)
    plan = MicrobatchPlan([(c.trajectory, 0, 2) for c in chunks])
    _check(StoreReader(store, RUN).read(plan, sites=[S0.name]), chunks, S0, [(c.trajectory, 0, 2) for c in chunks])
    assert sum(len(m.chunks) for m in cached.values()) <= 40
    assert store.delete_versions_older_than(RUN, 1) == [0]
    assert not cached and store._manifest_entries == 0  # noqa: SLF001


def test_a_shard_published_from_memory_is_sent_as_encoded() -> None:
    """A shard published from memory (S3, ``memory://``) reaches the filesystem as the buffer the
    encoder filled, a ``bytearray``: botocore would wrap ``bytes`` in a ``BytesIO``, which aiohttp
    copies out again for each attempt of the PUT (against a refusing endpoint those copies piled
    up until the garbage collector ran: 64 MiB budget, peak RSS - idle up to 144 MiB). Before, the
    shard was ``bytes``. It reads back whole."""
    store = Store("memory://sent-as-encoded")
    store.put_run(SPEC)
    bodies: list[bytes | bytearray] = []
    real = store.storage.fs.pipe_file

    def pipe_file(path: str, value: bytes | bytearray, **kw: object) -> object:
        bodies.append(value)
        return real(path, value, **kw)

    store.storage.fs.pipe_file = pipe_file  # type: ignore[method-assign]
    chunks = [make_chunk(SITES[0], f"t{i}", 0, 64, rng=np.random.default_rng(i)) for i in range(3)]
    store.write_shard(RUN, 0, "w0", 1, chunks)
    shards = [b for b in bodies if bytes(b[:4]) == b"PAR1"]
    assert shards and all(type(b) is bytearray for b in shards)
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert sorted(e.trajectory for m in store.manifests(RUN, 0) for e in m.chunks) == ["t0", "t1", "t2"]
    assert sum(pq.read_table(pa.BufferReader(bytes(b))).num_rows for b in shards) == 3
