"""The wire-path checksum equals records.chunk_checksum bit for bit (it only swaps the crc32 engine)."""

from __future__ import annotations

import zlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tracestore.records import RecordChunk, chunk_checksum
from tracestore.v1.checksum import crc32, record_checksum


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 40),
    cb=st.integers(1, 300),
    sb=st.integers(1, 20),
    start=st.integers(0, 10**9),
    version=st.integers(0, 10**6),
    g=st.floats(1e-30, 1e30),
    with_ts=st.booleans(),
    traj=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,20}", fullmatch=True).filter(lambda t: ".." not in t),
    seed=st.integers(0, 2**32 - 1),
)
def test_equals_records_checksum(rows: int, cb: int, sb: int, start: int, version: int, g: float, with_ts: bool,
                                 traj: str, seed: int) -> None:  # fmt: skip
    rng = np.random.default_rng(seed)
    c = RecordChunk("run-x", version, traj, "site.a", start, rows,
                    codes=rng.integers(0, 256, (rows, cb), dtype=np.uint8),
                    scales=rng.integers(0, 256, (rows, sb), dtype=np.uint8), global_scale=g,
                    token_scales=rng.random(rows, dtype=np.float32) if with_ts else None)  # fmt: skip
    assert record_checksum(c) == c.checksum == chunk_checksum(
        c.run, c.policy_version, c.trajectory, c.site, c.token_start, c.n_tokens, c.codes, c.scales,
        c.global_scale, c.token_scales)  # fmt: skip


@given(data=st.binary(max_size=5000), seed=st.integers(0, 2**32 - 1))
def test_crc32_is_zlib_crc32(data: bytes, seed: int) -> None:
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data, seed) == zlib.crc32(data, seed)


def test_sidecar_checksum_is_computed_once_at_receipt() -> None:
    """The sidecar verifies the writer's checksum once over the received bytes and hands that value
    on (the dedupe index, and the shard writer reads ``chunk.checksum``): never recomputed later.
    Shown by changing the received buffer afterwards: the chunk still reports the verified value."""
    from tracestore.server.testing import SPEC, make_chunk, write_request
    from tracestore.server.wire import parse_write

    c = make_chunk("t-once", 0, 2000)  # > 16 KiB: payload viewed in place, not copied
    raw = bytearray(write_request(1, [c]).SerializeToString())
    _, msg, _ = parse_write(raw, lambda run: SPEC, None)
    (got,) = msg.chunks
    assert got.checksum == c.checksum == msg.crcs[0]
    raw[len(raw) // 2] ^= 0xFF  # lands in the codes payload the chunk views
    assert chunk_checksum(got.run, got.policy_version, got.trajectory, got.site, got.token_start, got.n_tokens,
                          got.codes, got.scales, got.global_scale, got.token_scales) != c.checksum  # fmt: skip
    assert got.checksum == c.checksum  # cached at receipt, not recomputed over today's bytes
