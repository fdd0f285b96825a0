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
    traj=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,20}", fullmatch=True),
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
