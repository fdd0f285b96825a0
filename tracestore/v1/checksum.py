"""The wire path's CRC-32 and record-chunk checksum: the ones :mod:`tracestore.records` defines.

``records.crc32`` is ISA-L's crc32 when ``isal`` is installed (zlib-identical values; 1.2-3.6 GB/s
for zlib against ~23 GB/s measured on the bench machine, the largest per-byte cost of ingest), else
zlib's. Kept as a module so the client and server import one name for the checksum they exchange.
"""

from __future__ import annotations

import zlib
from typing import Any

from tracestore.records import chunk_checksum, chunk_checksum_parts, crc32

FAST = crc32 is not zlib.crc32

__all__ = ["FAST", "chunk_checksum", "chunk_checksum_parts", "crc32", "record_checksum"]


def record_checksum(chunk: Any) -> int:
    """``RecordChunk.checksum`` for any object with a chunk's fields (e.g. a received, unvalidated one)."""
    return chunk_checksum(
        chunk.run, chunk.policy_version, chunk.trajectory, chunk.site, chunk.token_start, chunk.n_tokens,
        chunk.codes, chunk.scales, chunk.global_scale, chunk.token_scales,
    )  # fmt: skip
