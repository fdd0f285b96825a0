"""Readers check a prefix link against the linked trajectory's own records before following it:
records are stored once, under the source, so a linked prefix holds no chunks of its own; links of
one trajectory in the versions read name one source; and a link is written by the writer that
records its trajectory (its chunks and seals). Each violation is a ConflictError naming the link,
its manifest and what conflicts; the source itself may be another writer's.

Real Parquet shards and manifests on local disk, written through Store.write_shard.
"""

from __future__ import annotations

import numpy as np
import pytest

from tracestore import ConflictError, PrefixLink, TrajectorySeal
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store

from .conftest import RUN, SITES, SPEC, make_chunk

S0 = SITES[0]


def _store(tmp_path) -> Store:
    store = Store(f"file://{tmp_path}/store", min_row_group_bytes=0)
    store.put_run(SPEC)
    return store


def _read(store: Store, plan, versions=None, on_missing="error"):
    return StoreReader(Store(store.url), RUN).read(plan, versions=versions, sites=[S0.name], on_missing=on_missing)


def _manifest(store: Store, version: int, writer: str, seq: int) -> str:
    return f"{store.url}/{RUN}/v{version}/{writer}/part-{seq:08d}.manifest.json"


def test_link_over_own_records_in_the_same_version(tmp_path):
    """The audit's redirect: another writer links alice's recorded, sealed trajectory to its own."""
    store = _store(tmp_path)
    rng = np.random.default_rng(70)
    alice = make_chunk(S0, "t-alice", 0, 4, rng=rng)
    evil = make_chunk(S0, "t-evil", 0, 4, rng=rng)
    store.write_shard(RUN, 0, "w-alice", 1, [alice], seals=[TrajectorySeal(RUN, 0, "t-alice", 5, (S0.name,))])
    store.write_shard(RUN, 0, "w-mallory", 1, [evil], links=[PrefixLink(RUN, 0, "t-alice", "t-evil", 4)])
    link = r"prefix link t-alice -> t-evil \(run run-1 v0, tokens \[0, 4\)\) in manifest "
    own = _manifest(store, 0, "w-alice", 1)
    for versions in (0, None):
        for on_missing in ("error", "mask"):  # loud either way: never served, never masked
            with pytest.raises(ConflictError, match=link) as err:
                _read(store, [("t-alice", 0, 4)], versions, on_missing)
            msg = str(err.value)
            assert _manifest(store, 0, "w-mallory", 1) in msg
            assert f"v0 site {S0.name} tokens [0, 4) in manifest {own} (writer w-alice)" in msg
            assert "expected none" in msg
    # tokens past the link are t-alice's own and read as before
    rows = _read(store, [("t-alice", 4, 5)], on_missing="mask")[S0.name]
    assert not rows.valid.any()  # the sealed final position


def test_link_in_a_newer_version_over_own_records_of_an_older_one(tmp_path):
    store = _store(tmp_path)
    rng = np.random.default_rng(71)
    alice = make_chunk(S0, "t-alice", 0, 4, rng=rng)
    store.write_shard(RUN, 0, "w-alice", 1, [alice], seals=[TrajectorySeal(RUN, 0, "t-alice", 5, (S0.name,))])
    evil = make_chunk(S0, "t-evil", 0, 4, version=1, rng=rng)
    # the same writer id (a sidecar that forgot who owns it): only the overlap is wrong
    store.write_shard(RUN, 1, "w-alice", 2, [evil], links=[PrefixLink(RUN, 1, "t-alice", "t-evil", 4)])
    with pytest.raises(ConflictError, match=r"prefix link t-alice -> t-evil \(run run-1 v1.*holds records of its own"):
        _read(store, [("t-alice", 0, 4)])
    with pytest.raises(ConflictError, match=r"v0 site .* tokens \[0, 4\) in manifest .*/v0/w-alice/"):
        _read(store, [("t-alice", 0, 4)], versions=[0, 1], on_missing="mask")
    # each version alone is consistent: v0 has alice's records, v1 a link and no records of t-alice
    np.testing.assert_array_equal(_read(store, [("t-alice", 0, 4)], versions=0)[S0.name].codes, alice.codes)
    np.testing.assert_array_equal(_read(store, [("t-alice", 0, 4)], versions=1)[S0.name].codes, evil.codes)


def test_link_in_an_older_version_under_own_records_of_a_newer_one(tmp_path):
    store = _store(tmp_path)
    rng = np.random.default_rng(72)
    src = make_chunk(S0, "s", 0, 4, rng=rng)
    store.write_shard(RUN, 0, "w0", 1, [src], links=[PrefixLink(RUN, 0, "t", "s", 4)])
    store.write_shard(RUN, 1, "w0", 1, [make_chunk(S0, "t", 2, 4, version=1, rng=rng)])
    with pytest.raises(ConflictError, match=r"prefix link t -> s .*v1 site .* tokens \[2, 6\)"):
        _read(store, [("t", 0, 6)])


def test_link_by_another_writer_than_the_trajectorys_records(tmp_path):
    store = _store(tmp_path)
    rng = np.random.default_rng(73)
    src = make_chunk(S0, "s", 0, 8, rng=rng)
    own = make_chunk(S0, "t", 4, 4, rng=rng)
    store.write_shard(RUN, 0, "w-src", 1, [src])
    # t's records past the prefix and its seal by w-t; the link by w-other: no overlap, other writer
    store.write_shard(RUN, 0, "w-t", 1, [own], seals=[TrajectorySeal(RUN, 0, "t", 9, (S0.name,))])
    store.write_shard(RUN, 0, "w-other", 1, [], links=[PrefixLink(RUN, 0, "t", "s", 4)])
    with pytest.raises(ConflictError) as err:
        _read(store, [("t", 0, 8)])
    msg = str(err.value)
    assert f"prefix link t -> s (run run-1 v0, tokens [0, 4)) in manifest {_manifest(store, 0, 'w-other', 1)}" in msg
    assert "was written by writer w-other" in msg
    assert f"records in manifest {_manifest(store, 0, 'w-t', 1)} (v0) by writer w-t" in msg
    assert f"seal in manifest {_manifest(store, 0, 'w-t', 1)} (v0) by writer w-t" in msg
    assert "expected the link to come from the writer that records t" in msg


def test_link_by_another_writer_than_the_trajectorys_seal(tmp_path):
    """A trajectory that is all prefix (no records of its own): its seal's writer must write its link."""
    store = _store(tmp_path)
    rng = np.random.default_rng(74)
    store.write_shard(RUN, 0, "w-src", 1, [make_chunk(S0, "s", 0, 8, rng=rng)])
    store.write_shard(RUN, 0, "w-t", 1, [], seals=[TrajectorySeal(RUN, 0, "t", 5, (S0.name,))])
    store.write_shard(RUN, 1, "w-other", 1, [make_chunk(S0, "s", 0, 8, version=1, rng=rng)],
                      links=[PrefixLink(RUN, 1, "t", "s", 5)])  # fmt: skip
    with pytest.raises(ConflictError, match=r"prefix link t -> s \(run run-1 v1.*writer w-other.*seal .*by writer w-t"):
        _read(store, [("t", 0, 4)])
    assert _read(store, [("t", 0, 4)], versions=1)[S0.name].valid.all()  # v1 alone: no seal of t


def test_links_to_different_sources_in_different_versions(tmp_path):
    store = _store(tmp_path)
    rng = np.random.default_rng(75)
    a, b = make_chunk(S0, "a", 0, 4, rng=rng), make_chunk(S0, "b", 0, 4, version=1, rng=rng)
    store.write_shard(RUN, 0, "w0", 1, [a], links=[PrefixLink(RUN, 0, "t", "a", 4)])
    store.write_shard(RUN, 1, "w0", 1, [b], links=[PrefixLink(RUN, 1, "t", "b", 4)])
    with pytest.raises(
        ConflictError, match=r"prefix link t -> b \(run run-1 v1.*different sources \['a', 'b'\]"
    ) as err:
        _read(store, [("t", 0, 4)], on_missing="mask")
    assert _manifest(store, 0, "w0", 1) in str(err.value) and _manifest(store, 1, "w0", 1) in str(err.value)
    np.testing.assert_array_equal(_read(store, [("t", 0, 4)], versions=0)[S0.name].codes, a.codes)
    np.testing.assert_array_equal(_read(store, [("t", 0, 4)], versions=1)[S0.name].codes, b.codes)


def test_grpo_group_and_a_source_of_another_writer_still_read(tmp_path):
    """The legitimate shapes: a GRPO sample links the prompt to sample 0 and records from token n
    on, with its seal, by its own writer; the source may be recorded by another engine's writer;
    links of several versions to one source; chains of links."""
    store = _store(tmp_path)
    rng = np.random.default_rng(76)
    n = 6
    prompt = make_chunk(S0, "q-s0", 0, n + 2, rng=rng)
    s1 = make_chunk(S0, "q-s1", n, 2, rng=rng)
    s2 = make_chunk(S0, "q-s2", n, 3, rng=rng)
    s3 = make_chunk(S0, "q-s3", 2, 3, rng=rng)
    seal = (S0.name,)
    seals = [TrajectorySeal(RUN, 0, t, n + 3, seal) for t in ("q-s0", "q-s1")]
    store.write_shard(RUN, 0, "engine-0", 1, [prompt, s1], seals=seals, links=[PrefixLink(RUN, 0, "q-s1", "q-s0", n)])
    # another engine's writer records q-s2 over the source engine-0 recorded; q-s3 links to q-s2 (a chain)
    store.write_shard(RUN, 0, "engine-1", 1, [s2], links=[PrefixLink(RUN, 0, "q-s2", "q-s0", n)])
    store.write_shard(RUN, 0, "engine-1", 2, [], seals=[TrajectorySeal(RUN, 0, "q-s2", n + 4, seal)])
    store.write_shard(RUN, 0, "engine-2", 1, [s3], links=[PrefixLink(RUN, 0, "q-s3", "q-s2", 2)])
    # a later version links q-s1 to the same source again (same writer, no records below n)
    store.write_shard(RUN, 1, "engine-0", 1, [make_chunk(S0, "q-s0", 0, n, version=1, rng=rng)],
                      links=[PrefixLink(RUN, 1, "q-s1", "q-s0", n)])  # fmt: skip
    res = _read(store, [("q-s1", 0, n + 2), ("q-s2", 0, n + 3), ("q-s3", 0, 5)], versions=0, on_missing="mask")
    rows = res[S0.name]
    assert rows.valid.all()
    want = [prompt.codes[:n], s1.codes, prompt.codes[:n], s2.codes, prompt.codes[:2], s3.codes]
    np.testing.assert_array_equal(rows.codes, np.concatenate(want))
    rows = _read(store, [("q-s1", 0, n + 2)])[S0.name]  # both versions: v1's prefix, v0's own records
    assert rows.valid.all() and rows.policy_version.tolist() == [1] * n + [0] * 2
    np.testing.assert_array_equal(rows.codes[n:], s1.codes)
