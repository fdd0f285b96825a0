"""Manifests carry a checksum over their content, verified on every load; prefix links are checked
against their source trajectory on every read.

Real Parquet shards and manifests on local disk; the damage is done to the files themselves.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tracestore import CorruptionError, MissingRecordsError, PrefixLink, TraceStoreError, TrajectorySeal
from tracestore.storage.manifest import MANIFEST_VERSION, Manifest
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store

from .conftest import RUN, SITES, SPEC, make_chunk

S0, S1 = SITES[0], SITES[1]


def _local_store(tmp_path) -> Store:
    store = Store(f"file://{tmp_path}/store", min_row_group_bytes=0)
    store.put_run(SPEC)
    return store


def _fingerprint(store: Store, plan: list[tuple[str, int, int]]) -> list[tuple[str, bytes]]:
    """Everything a read returns, as bytes (rows the manifest does not cover come back invalid)."""
    res = StoreReader(store, RUN).read(plan, on_missing="mask")
    out = []
    for name in sorted(res):
        r = res[name]
        parts = [r.codes, r.scales, r.global_scale, r.valid, r.policy_version]
        out.append((name, b"".join(np.ascontiguousarray(p).tobytes() for p in parts)))
    return out


def test_every_byte_flip_of_a_manifest_is_detected_or_harmless(tmp_path):
    store = _local_store(tmp_path)
    rng = np.random.default_rng(40)
    a = [make_chunk(s, "a", 0, 6, rng=rng) for s in (S0, S1)]
    b = [make_chunk(S0, "b", 4, 4, rng=rng)]
    store.write_shard(RUN, 0, "w0", 0, a)
    info = store.write_shard(
        RUN,
        0,
        "w1",
        0,
        b,
        seals=[TrajectorySeal(RUN, 0, "b", 9, (S0.name,))],
        links=[PrefixLink(RUN, 0, "b", "a", 4)],
    )
    plan = [("a", 0, 6), ("b", 0, 8)]
    fresh = Store(store.url)
    baseline = _fingerprint(fresh, plan)
    path = fresh.storage.full(info.manifest_path)
    with open(path, "rb") as f:
        original = f.read()
    links_at = original.index(b'"links"')
    assert len(original) > 300
    flips = np.random.default_rng(41).integers(1, 256, len(original))  # deterministic, never 0
    detected = harmless = 0
    silent: list[tuple[int, str]] = []
    misnamed: list[tuple[int, str]] = []
    for i in range(len(original)):
        damaged = bytearray(original)
        damaged[i] ^= int(flips[i])
        with open(path, "wb") as f:
            f.write(damaged)
        try:
            got = _fingerprint(Store(store.url), plan)  # a new Store: nothing cached
        except TraceStoreError as exc:
            if isinstance(exc, CorruptionError) and info.manifest_path in str(exc):
                detected += 1
            else:  # failed, but blamed on something else (the shard, a missing file)
                misnamed.append((i, f"{type(exc).__name__}: {str(exc)[-100:]}"))
            continue
        if got == baseline:
            harmless += 1
        else:
            silent.append((i, original[max(0, i - 20) : i + 20].decode(errors="replace")))
    with open(path, "wb") as f:
        f.write(original)
    assert silent == [], f"{len(silent)} flips changed what a read returns without an error: {silent[:5]}"
    assert misnamed == [], f"{len(misnamed)} flips raised without naming the manifest: {misnamed[:3]}"
    assert detected + harmless == len(original) and detected > links_at  # the links section included
    assert _fingerprint(Store(store.url), plan) == baseline


def test_manifest_is_canonical_json_with_a_leading_checksum(tmp_path):
    store = _local_store(tmp_path)
    info = store.write_shard(RUN, 0, "w0", 0, [make_chunk(S0, "t", 0, 3)])
    data = store.storage.cat(info.manifest_path)
    d = json.loads(data)
    assert d["manifest_version"] == MANIFEST_VERSION == 2
    assert d["checksum"].startswith("crc32:")
    assert json.dumps(d, sort_keys=True, separators=(",", ":")).encode() == data


def test_manifest_without_checksum_is_refused_naming_it(tmp_path):
    store = _local_store(tmp_path)
    info = store.write_shard(RUN, 0, "w0", 0, [make_chunk(S0, "t", 0, 3)])
    d = json.loads(store.storage.cat(info.manifest_path))
    del d["checksum"]
    d["manifest_version"] = 1  # what an older tracestore wrote: no checksum to verify
    old = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(CorruptionError, match=r"part-00000000\.manifest\.json.*v1.*checksum"):
        Manifest.from_json(old, where=info.manifest_path)
    store.storage.fs.pipe_file(store.storage.full(info.manifest_path), old)
    with pytest.raises(CorruptionError, match=r"part-00000000\.manifest\.json"):
        StoreReader(Store(store.url), RUN).read([("t", 0, 3)], sites=[S0.name])


def test_manifest_entries_of_another_run_or_version_are_refused(tmp_path):
    store = _local_store(tmp_path)
    info = store.write_shard(RUN, 0, "w0", 0, [], seals=[TrajectorySeal(RUN, 0, "t", 3, (S0.name,))])
    m = store.read_manifest(info.manifest_path)
    import dataclasses

    bad = dataclasses.replace(m, seals=(TrajectorySeal(RUN, 1, "t", 3, (S0.name,)),))
    with pytest.raises(CorruptionError, match=r"here\.json.*seal"):
        Manifest.from_json(bad.to_json(), where="here.json")


# ---------------------------------------------------------------- prefix links against their source


def _reader(store: Store) -> StoreReader:
    return StoreReader(Store(store.url), RUN)


def test_link_longer_than_the_sealed_source_is_corruption(tmp_path):
    store = _local_store(tmp_path)
    rng = np.random.default_rng(42)
    # the source holds records past its seal (a writer bug): a link may still only take what was sealed
    src = make_chunk(S0, "a", 0, 16, rng=rng)
    store.write_shard(RUN, 0, "w0", 0, [src], seals=[TrajectorySeal(RUN, 0, "a", 8, (S0.name,))])
    store.write_shard(RUN, 0, "w1", 0, [make_chunk(S0, "c", 12, 4, rng=rng)], links=[PrefixLink(RUN, 0, "c", "a", 12)])
    for on_missing in ("error", "mask"):
        with pytest.raises(CorruptionError, match=r"prefix link c -> a .*tokens \[0, 12\).*sealed at 8"):
            _reader(store).read([("c", 0, 16)], sites=[S0.name], on_missing=on_missing)


def test_link_longer_than_the_recorded_source_names_the_link(tmp_path):
    store = _local_store(tmp_path)
    rng = np.random.default_rng(43)
    store.write_shard(RUN, 0, "w0", 0, [make_chunk(S0, "a", 0, 8, rng=rng)])
    store.write_shard(RUN, 0, "w1", 0, [make_chunk(S0, "c", 12, 4, rng=rng)], links=[PrefixLink(RUN, 0, "c", "a", 12)])
    with pytest.raises(MissingRecordsError, match=r"prefix link c -> a .*tokens \[0, 12\).*8 tokens"):
        _reader(store).read([("c", 0, 16)], sites=[S0.name])
    rows = _reader(store).read([("c", 0, 16)], sites=[S0.name], on_missing="mask")[S0.name]
    assert not rows.valid[:12].any() and rows.valid[12:].all()  # nothing served through the link


def test_link_to_a_source_of_another_version_names_the_link(tmp_path):
    store = _local_store(tmp_path)
    rng = np.random.default_rng(44)
    store.write_shard(RUN, 0, "w0", 0, [make_chunk(S0, "a", 0, 8, rng=rng)])  # a exists in v0 only
    store.write_shard(RUN, 1, "w0", 0, [make_chunk(S0, "c", 4, 4, version=1, rng=rng)],
                      links=[PrefixLink(RUN, 1, "c", "a", 4)])  # fmt: skip
    with pytest.raises(MissingRecordsError, match=r"prefix link c -> a .*v1.*no record, seal or link"):
        _reader(store).read([("c", 0, 8)], sites=[S0.name])
    rows = _reader(store).read([("c", 0, 8)], sites=[S0.name], on_missing="mask")[S0.name]
    assert rows.valid.tolist() == [False] * 4 + [True] * 4


def test_cyclic_links_name_the_link(tmp_path):
    store = _local_store(tmp_path)
    rng = np.random.default_rng(45)
    # each records only past its link (a linked prefix has no records of its own: a ConflictError)
    chunks = [make_chunk(S0, "x", 2, 2, rng=rng), make_chunk(S0, "y", 3, 1, rng=rng)]
    store.write_shard(RUN, 0, "w0", 0, chunks, links=[PrefixLink(RUN, 0, "x", "y", 2), PrefixLink(RUN, 0, "y", "x", 3)])
    with pytest.raises(CorruptionError, match=r"prefix link [xy] -> [xy] .*cycle x -> y -> x"):
        _reader(store).read([("x", 0, 4)], sites=[S0.name], on_missing="mask")


def test_valid_link_chains_still_resolve(tmp_path):
    store = _local_store(tmp_path)
    rng = np.random.default_rng(46)
    a = make_chunk(S0, "a", 0, 8, rng=rng)
    b = make_chunk(S0, "b", 4, 6, rng=rng)
    c = make_chunk(S0, "c", 6, 3, rng=rng)
    store.write_shard(RUN, 0, "w0", 0, [a, b], links=[PrefixLink(RUN, 0, "b", "a", 4)],
                      seals=[TrajectorySeal(RUN, 0, "a", 9, (S0.name,))])  # fmt: skip
    # c links to b's first 6 tokens: b records [4, 10) itself and links [0, 4) to a
    store.write_shard(RUN, 0, "w1", 0, [c], links=[PrefixLink(RUN, 0, "c", "b", 6)])
    rows = _reader(store).read([("c", 0, 9)], sites=[S0.name])[S0.name]
    assert rows.valid.all()
    np.testing.assert_array_equal(rows.codes, np.concatenate([a.codes[:4], b.codes[:2], c.codes]))
    assert os.path.exists(f"{tmp_path}/store/{RUN}/run.json")
