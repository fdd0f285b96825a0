"""The chunk checksum (tracestore.checksum): equal to the encoding docs/data-model.md specifies,
computed here from scratch with zlib and struct, through every entry point."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracestore.checksum import ChunkKey, chunk_checksum, chunk_checksum_from_crcs, crc32, record_checksum
from tracestore.records import RecordChunk


def _spec_checksum(c: RecordChunk) -> int:
    """The chunk checksum as docs/data-model.md writes it, with zlib and struct only."""
    rows, cb = c.codes.shape
    data = b"tracestore.chunk.v1\0" + f"{c.run}\0{c.trajectory}\0{c.site}\0".encode()
    data += struct.pack("<qqqqqqf", c.policy_version, c.token_start, c.n_tokens, rows, cb, c.scales.shape[1],
                        c.global_scale)  # fmt: skip
    data += c.codes.tobytes() + c.scales.tobytes()
    data += b"\0" if c.token_scales is None else b"\1" + c.token_scales.astype("<f4").tobytes()
    if c.ids_crc is not None:
        data += b"\2" + struct.pack("<I", c.ids_crc)
    return zlib.crc32(data)


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 40),
    cb=st.integers(1, 300),
    sb=st.integers(1, 20),
    start=st.integers(0, 10**9),
    version=st.integers(0, 10**6),
    g=st.floats(1e-30, 1e30),
    with_ts=st.booleans(),
    ids=st.none() | st.integers(0, 2**32 - 1),
    traj=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,20}", fullmatch=True).filter(lambda t: ".." not in t),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_entry_point_gives_the_specified_checksum(rows: int, cb: int, sb: int, start: int, version: int,
                                                        g: float, with_ts: bool, ids: int | None, traj: str,
                                                        seed: int) -> None:  # fmt: skip
    rng = np.random.default_rng(seed)
    c = RecordChunk("run-x", version, traj, "site.a", start, rows,
                    codes=rng.integers(0, 256, (rows, cb), dtype=np.uint8),
                    scales=rng.integers(0, 256, (rows, sb), dtype=np.uint8), global_scale=g,
                    token_scales=rng.random(rows, dtype=np.float32) if with_ts else None, ids_crc=ids)  # fmt: skip
    want = _spec_checksum(c)
    assert record_checksum(c) == c.checksum == want
    key = ChunkKey(c.run, version, traj, "site.a", start, rows, rows, cb, sb, g, ids)
    assert c.key.head() == key.head()  # (RecordChunk keeps g as float32; the head hashes it as float32)
    ts = None if c.token_scales is None else c.token_scales.tobytes()
    # payloads split into pieces anywhere hash as their concatenation
    cut = int(rng.integers(0, rows * cb + 1))
    codes = c.codes.tobytes()
    assert chunk_checksum(key, [codes[:cut], codes[cut:]], [c.scales.tobytes()], None if ts is None else [ts]) == want
    crcs = [(zlib.crc32(b), len(b)) for b in (codes, c.scales.tobytes())]
    assert chunk_checksum_from_crcs(key, crcs[0], crcs[1], None if ts is None else (zlib.crc32(ts), len(ts))) == want


@given(data=st.binary(max_size=5000), seed=st.integers(0, 2**32 - 1))
def test_crc32_is_zlib_crc32(data: bytes, seed: int) -> None:
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data, seed) == zlib.crc32(data, seed)


def test_sidecar_checksum_is_computed_once_at_receipt() -> None:
    """The sidecar verifies the writer's checksum once over the received bytes and hands that value
    on (the dedupe index, and the shard writer reads ``chunk.checksum``): never recomputed later.
    Shown by changing the received buffer afterwards: the chunk still reports the verified value."""
    from tracestore.server.rpc.ingest import parse_write
    from tracestore.server.testing import SPEC, make_chunk, write_request

    from tracestore.wire import SMALL_REQUEST

    c = make_chunk("t-once", 0, 2000)
    while c.nbytes <= SMALL_REQUEST:  # a request over SMALL_REQUEST: payloads viewed in place, not copied
        c = make_chunk("t-once", 0, 2 * c.n_tokens)
    raw = bytearray(write_request(1, [c]).SerializeToString())
    _, msg, _ = parse_write(raw, lambda run: SPEC, None)
    (got,) = msg.chunks
    assert got.checksum == c.checksum == msg.crcs[0]
    raw[len(raw) // 2] ^= 0xFF  # lands in the codes payload the chunk views
    assert record_checksum(got) != c.checksum
    assert got.checksum == c.checksum  # cached at receipt, not recomputed over today's bytes


@given(n=st.sampled_from([0, 1, 4095, 4096, 5000, 200_000, 1 << 20, (1 << 20) + 1, 3 << 20]),
       seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["bytes", "memoryview", "ndarray"]))  # fmt: skip
@settings(max_examples=40, deadline=None)
def test_crc32_held_is_zlib_crc32(n: int, seed: int, kind: str) -> None:
    """The GIL-holding CRC (ISA-L through ctypes, 4 KiB..1 MiB) and its fallbacks give zlib's values
    for any contiguous buffer, chained from any seed."""
    from tracestore.checksum import crc32_held

    data = np.random.default_rng(seed).bytes(n)
    buf: object = {"bytes": data, "memoryview": memoryview(data)[:],
                   "ndarray": np.frombuffer(data, np.uint8).reshape(-1, 1).data}[kind]  # fmt: skip
    assert crc32_held(buf) == zlib.crc32(data)
    assert crc32_held(buf, seed) == zlib.crc32(data, seed)


def test_write_request_crc_is_combined_from_its_payloads() -> None:
    """scan_write reads each large payload once and combines the request's CRC (the WAL entry's)
    from the payload CRCs and the bytes between them: equal to a plain CRC of the whole request,
    for small (protobuf-parsed) and large chunks, token scales, and a payload field sent twice."""
    from tracestore.server.rpc.ingest import scan_write
    from tracestore.server.testing import make_chunk, write_request

    from tracestore.v1 import tracestore_pb2 as pb
    from tracestore.wire import SMALL_REQUEST, len_field

    chunks = [make_chunk("t-a", 0, 2000), make_chunk("t-b", 0, 7), make_chunk("t-c", 5, 3000, seed=3)]
    req = write_request(4, chunks)
    req.chunks[2].has_token_scales = True
    req.chunks[2].token_scales = np.arange(3000, dtype="<f4").tobytes()
    raw = req.SerializeToString()
    _, got, crc = scan_write(raw)
    assert crc == zlib.crc32(raw)
    for (_c, views, crcs), want in zip(got, req.chunks, strict=True):
        for view, part, field in zip(views, crcs, (want.codes, want.scales, want.token_scales), strict=True):
            assert bytes(view or b"") == field
            assert part is None or part == zlib.crc32(field)

    # one more chunk whose codes field comes twice: the last one wins, the CRC covers both (a
    # request over SMALL_REQUEST, so that it is scanned rather than parsed by protobuf whole)
    first, last = b"\x01" * 40_000, b"\x07" * (SMALL_REQUEST + 1)
    body = b"".join(pb.Chunk(trajectory="t-d", codes=x).SerializeToString() for x in (first, last))
    twice = raw + len_field(pb.WriteRequest.CHUNKS_FIELD_NUMBER, len(body)) + body
    _, got2, crc2 = scan_write(twice)
    assert crc2 == zlib.crc32(twice)
    assert got2[-1][0].trajectory == "t-d"
    assert bytes(got2[-1][1][0] or b"") == last and got2[-1][2][0] == zlib.crc32(last)


def test_small_request_parsed_whole_gives_what_the_scan_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request of at most SMALL_REQUEST bytes is parsed by protobuf in one call: the same chunk
    fields, payload bytes and request CRC as the field scan gives (SMALL_REQUEST set to 0)."""
    from tracestore.server.rpc.ingest import scan_write
    from tracestore.server.testing import make_chunk, write_request

    from tracestore import wire

    req = write_request(3, [make_chunk("t-a", 0, 60), make_chunk("t-b", 4, 7), make_chunk("t-c", 0, 90, seed=2)])
    req.chunks[1].has_token_scales = True
    req.chunks[1].token_scales = np.arange(7, dtype="<f4").tobytes()
    raw = req.SerializeToString()
    assert len(raw) <= wire.SMALL_REQUEST
    whole = scan_write(raw)
    monkeypatch.setattr(wire, "SMALL_REQUEST", 0)
    scanned = scan_write(raw)
    assert whole[0] == scanned[0] and not whole[0].chunks
    assert whole[2] == scanned[2] == zlib.crc32(raw)
    assert len(whole[1]) == len(scanned[1]) == 3
    for (c1, v1, _), (c2, v2, _) in zip(whole[1], scanned[1], strict=True):
        assert c1.trajectory == c2.trajectory and c1.token_start == c2.token_start and c1.n_tokens == c2.n_tokens
        assert [bytes(v or b"") for v in v1] == [bytes(v or b"") for v in v2]


def test_parse_without_isal_gives_the_same_message_and_wal_entry(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:  # fmt: skip
    """Without ISA-L (FAST False: zlib's crc32, no C combine) the sidecar reads payloads again
    instead of combining CRCs: the same chunk checksums, and a byte-identical WAL segment."""
    from tracestore.server.rpc import ingest as wire
    from tracestore.server.testing import SPEC, make_chunk, write_request
    from tracestore.server.wal import log as wal_mod

    raw = write_request(2, [make_chunk("t-a", 0, 2000), make_chunk("t-b", 0, 5)]).SerializeToString()

    def segment(parts: list[wal_mod.Part], name: str) -> bytes:
        wal = wal_mod.WriteAheadLog(tmp_path / name)
        list(wal.replay())
        wal.start()
        wal.append(1, parts)
        wal.close()
        (f,) = (tmp_path / name).glob("wal-*.log")
        return f.read_bytes()

    _, fast, parts = wire.parse_write(raw, lambda run: SPEC, None)
    assert any(isinstance(p, wal_mod.Checked) for p in parts)
    combined = segment(parts, "fast")
    monkeypatch.setattr(wire, "FAST", False)
    monkeypatch.setattr(wal_mod, "FAST", False)
    _, slow, plain = wire.parse_write(raw, lambda run: SPEC, None)
    assert not any(isinstance(p, wal_mod.Checked) for p in plain)
    assert fast.crcs == slow.crcs == [c.checksum for c in slow.chunks]
    assert segment(plain, "slow") == combined


def test_shared_memory_payloads_are_checked_again_when_copied_into_the_wal(tmp_path: Path) -> None:
    """parse_write marks a message's shared-memory payloads Checked(verify=True) (another process's
    memory: the WAL checks its copy against the CRC taken at receipt), its own bytes not."""
    from tracestore.client.record.staging import StagingPool
    from tracestore.server.rpc.ingest import ShmPools, parse_write
    from tracestore.server.testing import SPEC, make_chunk, write_request
    from tracestore.server.wal.log import Checked

    chunk = make_chunk("t-shm", 0, 300)
    pool = StagingPool(1 << 20, shared=True, shm_dir=str(tmp_path))
    try:
        assert pool.name is not None
        req = write_request(1, [chunk])
        req.shm_pool, req.keeps_staging = pool.name, True
        pc = req.chunks[0]
        pool.view[0 : chunk.codes.nbytes] = chunk.codes.tobytes()
        pool.view[8192 : 8192 + chunk.scales.nbytes] = chunk.scales.tobytes()
        pc.ClearField("codes")
        pc.ClearField("scales")
        pc.shm.codes_offset, pc.shm.scales_offset = 0, 8192
        pools = ShmPools(str(tmp_path))
        _, msg, parts = parse_write(req.SerializeToString(), lambda run: SPEC, pools.view, path="shm")
        checked = [p for p in parts if isinstance(p, Checked)]
        assert [p.verify for p in checked] == [False, True, True]  # the request, then codes and scales
        assert [p.crc for p in checked[1:]] == [zlib.crc32(chunk.codes.tobytes()), zlib.crc32(chunk.scales.tobytes())]
        assert msg.crcs == [chunk.checksum]
        del parts, checked, msg
        pools.close()
    finally:
        pool.close()
