"""``tracestore inspect --validate`` (:func:`tracestore.cli.inspect.validate_version`): whole-column
verification finds exactly what a per-chunk read finds, in this process and in worker processes,
on real Parquet files on local disk; and it scales (a decode-sized store within seconds)."""

from __future__ import annotations

import io
import time
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tracestore import PrefixLink, SiteSpec, TrajectorySeal
from tracestore.checksum import crc32_combine
from tracestore.cli.inspect import validate_version
from tracestore.storage.arrow import CHUNK_SCHEMA, chunks_to_table
from tracestore.storage.manifest import ManifestColumns
from tracestore.storage.shard_read import _crc_fixed_rows, crc32_combine_many, verify_shard
from tracestore.storage.shard_write import _WRITER_OPTIONS, encode_shard
from tracestore.storage.store import Store

from .conftest import RUN, SITES, SPEC, make_chunk

S0, S1, S2 = SITES


def _validate(store: Store, version: int = 0, **kw) -> tuple[int, str]:
    out = io.StringIO()
    n = validate_version(store, RUN, version, out, **kw)
    return n, out.getvalue()


def _write(store: Store, writer: str, seq: int, chunks: list, link=None, seal=None) -> None:
    """A shard of version 0 with an optional link (trajectory, source, n) and seal (trajectory, n) of site S0."""
    links = [PrefixLink(RUN, 0, *link)] if link else []
    seals = [TrajectorySeal(RUN, 0, seal[0], seal[1], (S0.name,))] if seal else []
    store.write_shard(RUN, 0, writer, seq, chunks, seals=seals, links=links)


MODES = {"in-process": {"jobs": 1}, "workers": {"jobs": 2, "parallel_min_bytes": 0}}


def _mixed_store(tmp_path, seed: int = 60) -> tuple[Store, list]:
    """Shards with every kind of chunk: multi-row sites, MXFP4, token scales, chunks of 1 and of
    many tokens, several row groups, seal-only and link-only writes."""
    store = Store(f"file://{tmp_path}/store", min_row_group_bytes=0)
    store.put_run(SPEC)
    rng = np.random.default_rng(seed)
    chunks = []
    for t in range(5):
        for s in SITES:
            for a in range(0, 12, 1 + t):
                chunks.append(
                    make_chunk(s, f"t{t}", a, min(1 + t, 12 - a), rng=rng, token_scales=bool(rng.integers(2)))
                )
    order = rng.permutation(len(chunks))
    for k in range(3):
        store.write_shard(RUN, 0, f"w{k}", 0, [chunks[i] for i in order[k::3]])
    seals = [TrajectorySeal(RUN, 0, f"t{t}", 13, tuple(s.name for s in SITES)) for t in range(5)]
    store.write_shard(RUN, 0, "w9", 0, [], seals=seals)
    _write(store, "w9", 1, [make_chunk(S0, "u", 6, 4, rng=rng)], ("u", "t0", 6), ("u", 11))
    return store, chunks


@pytest.mark.parametrize("mode", MODES)
def test_validate_a_healthy_store(tmp_path, mode):
    store, _ = _mixed_store(tmp_path)
    n, out = _validate(store, **MODES[mode])
    assert (n, out) == (0, "")


def test_worker_processes_verify_units(tmp_path):
    """Units verified in a worker process (this process does not help here) give the same answers."""
    from tracestore.cli.verify import Verifier, VerifyWorkers

    store, _ = _mixed_store(tmp_path)
    manifests = [ManifestColumns.from_json(store.storage.cat(p), p) for p in store.manifest_paths(RUN, 0)]
    verifier = Verifier(store, RUN, 0)
    units = [u for m in manifests if m.shard for u in verifier._units(m)]
    damaged = manifests[0]
    raw = bytearray(store.storage.cat(damaged.shard))
    raw[len(raw) // 2] ^= 0x10
    workers = VerifyWorkers(1)
    try:
        assert [workers.submit(u).result(timeout=60) for u in units] == [[]] * len(units)
        store.storage.fs.pipe_file(store.storage.full(damaged.shard), bytes(raw))
        problems = workers.submit(units[0]).result(timeout=60)
        assert problems and all(damaged.shard in p for p in problems), problems
    finally:
        workers.close()


def test_verify_shard_computes_every_chunk_checksum(tmp_path):
    """The column-wise checksums equal RecordChunk.checksum for every kind of chunk."""
    store, chunks = _mixed_store(tmp_path)
    spec = store.get_run(RUN)
    sites = {s.name: (s.code_bytes, s.scale_bytes, s.rows_per_token) for s in spec.sites}
    checked = 0
    for path in store.manifest_paths(RUN, 0):
        m = ManifestColumns.from_json(store.storage.cat(path), path)
        if m.shard is None:
            continue
        assert verify_shard(pa.memory_map(store.storage.full(m.shard)), m, m.shard, sites=sites) is None
        for g in range(len(m.row_groups)):  # and each row group alone
            assert verify_shard(pa.memory_map(store.storage.full(m.shard)), m.groups(g, g + 1), m.shard) is None
        checked += len(m)
    assert checked == len(chunks) + 1


def test_crc32_combine_many_and_fixed_rows():
    rng = np.random.default_rng(61)
    a = rng.integers(0, 2**32, 500, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, 500, dtype=np.uint64).astype(np.uint32)
    n = rng.integers(0, 5000, 500)
    got = crc32_combine_many(a, b, n)
    assert got.tolist() == [crc32_combine(int(x), int(y), int(k)) for x, y, k in zip(a, b, n, strict=True)]
    assert crc32_combine_many(a, b, 7).tolist() == [crc32_combine(int(x), int(y), 7) for x, y in zip(a, b, strict=True)]
    rows = np.zeros(300, [("x", "<i8"), ("y", "<f4"), ("z", "<i8")])
    rows["x"] = rng.integers(0, 1 << 40, 300)
    rows["y"] = rng.standard_normal(300)
    rows["z"] = 5
    want = [zlib.crc32(r.tobytes()) for r in rows]
    assert _crc_fixed_rows(rows).tolist() == want


def _put_shard(store: Store, seq: int, data: bytes, manifest) -> None:
    store.storage.publish(manifest.shard, data)
    store.storage.publish(store.shard_paths(RUN, 0, "wx", seq)[1], manifest.to_json())


def test_validate_finds_a_chunk_whose_bytes_differ_from_its_checksum(tmp_path):
    """A writer that stored other bytes than it checksummed: pages, keys and the stored checksum
    column all agree with the manifest; only the chunk checksum can tell."""
    store = Store(f"file://{tmp_path}/store")
    store.put_run(SPEC)
    rng = np.random.default_rng(62)
    chunks = [make_chunk(S0, f"t{i}", 0, 4, rng=rng) for i in range(4)]
    path, _ = store.shard_paths(RUN, 0, "wx", 0)
    _, manifest = encode_shard(RUN, 0, "wx", 0, path, chunks)
    bad = list(chunks)
    codes = chunks[2].codes.copy()
    codes[1, 3] ^= 0x40
    bad[2] = make_chunk(S0, "t2", 0, 4, rng=rng)
    object.__setattr__(bad[2], "codes", codes)
    object.__setattr__(bad[2], "scales", chunks[2].scales)
    object.__setattr__(bad[2], "global_scale", chunks[2].global_scale)
    table = chunks_to_table(bad, [c.checksum for c in chunks])  # the checksums of the good bytes
    schema = CHUNK_SCHEMA.with_metadata({**(CHUNK_SCHEMA.metadata or {})})
    buf = io.BytesIO()
    pq.write_table(table.replace_schema_metadata(schema.metadata), buf, **_WRITER_OPTIONS)
    data = buf.getvalue()
    import dataclasses

    manifest = dataclasses.replace(manifest, shard_bytes=len(data), shard_crc32=zlib.crc32(data))
    _put_shard(store, 0, data, manifest)
    for mode in MODES.values():
        n, out = _validate(store, **mode)
        assert n == 1, out
        assert "part-00000000.parquet" in out and "trajectory t2" in out and "checksum mismatch" in out


def test_validate_finds_a_chunk_that_does_not_fit_its_site(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    store.put_run(SPEC)
    wide = SiteSpec(S0.name, "moe_input", 20, 128)  # twice the declared width
    path, _ = store.shard_paths(RUN, 0, "wx", 0)
    data, manifest = encode_shard(RUN, 0, "wx", 0, path, [make_chunk(wide, "t0", 0, 3)])
    _put_shard(store, 0, bytes(data), manifest)
    n, out = _validate(store, jobs=1)
    assert n == 1 and "trajectory t0" in out and "site's layout" in out, out


@pytest.mark.parametrize("mode", MODES)
def test_validate_finds_damaged_and_swapped_shards(tmp_path, mode):
    store, _ = _mixed_store(tmp_path)
    paths = [p for p in store.manifest_paths(RUN, 0) if store.read_manifest(p).shard]
    m0, m1 = (store.read_manifest(p) for p in paths[:2])
    raw = bytearray(store.storage.cat(m0.shard))
    raw[len(raw) // 3] ^= 0x04
    store.storage.fs.pipe_file(store.storage.full(m0.shard), bytes(raw))
    other = store.storage.cat(m1.shard)
    store.storage.fs.pipe_file(store.storage.full(m1.shard), other[:-1] + b"\0")  # the footer's magic
    n, out = _validate(store, **MODES[mode])
    lines = [x for x in out.splitlines() if x.startswith("CORRUPT")]
    assert n == len(lines) >= 3, out
    assert any(m0.shard in x and "crc32" in x for x in lines)  # the whole file
    assert any(m0.shard in x and ("checksum" in x or "decode" in x) for x in lines if "manifest says" not in x)
    assert any(m1.shard in x and "not a readable Parquet file" in x for x in lines)


def test_validate_reports_a_damaged_manifest_and_checks_the_rest(tmp_path):
    store, _ = _mixed_store(tmp_path)
    p = store.manifest_paths(RUN, 0)[1]
    data = bytearray(store.storage.cat(p))
    data[len(data) // 2] ^= 0x01
    store.storage.fs.pipe_file(store.storage.full(p), bytes(data))
    n, out = _validate(Store(store.url), jobs=1)
    assert out.startswith(f"CORRUPT {p}: manifest ") and "fails its checksum" in out
    # the chunks it listed are gone from the index: their sealed trajectories have holes
    assert n == out.count("\n") and "MISSING sealed trajectory" in out


def test_validate_sealed_trajectories_through_links(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    store.put_run(SPEC)
    rng = np.random.default_rng(63)
    _write(store, "w0", 0, [make_chunk(S0, "a", 0, 6, rng=rng)], None, ("a", 7))
    _write(store, "w1", 0, [make_chunk(S0, "b", 6, 4, rng=rng)], ("b", "a", 6), ("b", 11))
    assert _validate(store) == (0, "")
    # a link past its source's seal, and one to a source of nothing
    _write(store, "w1", 1, [make_chunk(S0, "c", 8, 2, rng=rng)], ("c", "a", 8), ("c", 11))
    _write(store, "w1", 2, [make_chunk(S0, "d", 2, 2, rng=rng)], ("d", "zz", 2), ("d", 5))
    n, out = _validate(store)
    assert n == 2, out
    assert "MISSING sealed trajectory c: prefix link c -> a" in out and "sealed at 7" in out
    assert "MISSING sealed trajectory d: prefix link d -> zz" in out and "no record, seal or link" in out


def test_validate_compares_overlapping_chunks(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    store.put_run(SPEC)
    rng = np.random.default_rng(64)
    a = make_chunk(S0, "t", 0, 6, rng=rng)
    store.write_shard(RUN, 0, "w0", 0, [a], seals=[TrajectorySeal(RUN, 0, "t", 7, (S0.name,))])
    store.write_shard(RUN, 0, "w1", 0, [a])  # the same chunk again: harmless
    assert _validate(store) == (0, "")
    store.write_shard(RUN, 0, "w2", 0, [make_chunk(S0, "t", 2, 2, rng=rng)])  # other bytes for tokens 2-3
    n, out = _validate(store)
    assert n == 1 and "stored twice with different bytes" in out, out


def test_validate_scales_to_decode_shards(tmp_path):
    """~60,000 one-token chunks (a decode step of 256 sequences x 20 sites, 12 steps): the
    per-chunk validation that ran before took minutes for 385k chunks; whole columns take well
    under a second here (the bound leaves room for a loaded machine)."""
    sites = tuple(SiteSpec(f"layers.{i}.mlp.input", "moe_input", i, 256) for i in range(20))
    from tracestore.records import RecordChunk, RunSpec

    spec = RunSpec("decode", sites)
    store = Store(f"file://{tmp_path}/store")
    store.put_run(spec)
    rng = np.random.default_rng(65)
    steps, seqs = 12, 256
    n = steps * seqs * len(sites)
    codes = rng.integers(0, 256, (n, sites[0].code_bytes), dtype=np.uint8)
    scales = rng.integers(0, 256, (n, sites[0].scale_bytes), dtype=np.uint8)
    chunks = []
    k = 0
    for step in range(steps):
        for q in range(seqs):
            for s in sites:
                chunks.append(
                    RecordChunk("decode", 0, f"q{q}", s.name, step, 1, codes[k : k + 1], scales[k : k + 1], 1.0)
                )
                k += 1
    store.write_shard("decode", 0, "w0", 0, chunks,
                      seals=[TrajectorySeal("decode", 0, f"q{q}", steps + 1, tuple(s.name for s in sites))
                             for q in range(seqs)])  # fmt: skip
    out = io.StringIO()
    t0 = time.perf_counter()
    problems = validate_version(store, "decode", 0, out, jobs=1)
    took = time.perf_counter() - t0
    assert problems == 0, out.getvalue()
    assert took < 8.0, f"validating {n} chunks took {took:.1f} s"
