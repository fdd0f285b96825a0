"""Fast, zlib-identical CRC-32 for the wire path, and the record chunk checksum computed with it.

``records.chunk_checksum`` defines the checksum (zlib CRC-32 over a canonical encoding). zlib's
crc32 ran at 1.2-3.6 GB/s on the bench machine and was the largest per-byte cost of ingest, paid on
the recorder and again on the sidecar; ISA-L's (``isal`` package, in the [server] extra) gives the
same values at ~23 GB/s there. Without ``isal`` this falls back to zlib. ``chunk_checksum`` here
must equal ``records.chunk_checksum`` bit for bit (tests/server/test_checksum.py enumerates cases).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

try:  # pragma: no cover - depends on the environment
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover
    _crc32 = zlib.crc32

crc32: Callable[..., int] = _crc32
FAST = crc32 is not zlib.crc32

_TAG = b"tracestore.chunk.v1\0"  # records._CHECKSUM_TAG
_HEAD = struct.Struct("<qqqqqqf")


def chunk_checksum(
    run: str,
    policy_version: int,
    trajectory: str,
    site: str,
    token_start: int,
    n_tokens: int,
    codes: Any,
    scales: Any,
    global_scale: float,
    token_scales: Any | None,
) -> int:
    """``records.chunk_checksum`` over buffers (numpy arrays or memoryviews), with the fast crc32.

    ``codes``/``scales`` are 2-D ``[rows, bytes]`` arrays, ``token_scales`` float32 ``[rows]`` or None.
    """
    n_rows, cb = codes.shape
    head = _TAG + f"{run}\0{trajectory}\0{site}\0".encode()
    head += _HEAD.pack(policy_version, token_start, n_tokens, n_rows, cb, scales.shape[1], np.float32(global_scale))
    crc = crc32(head)
    crc = crc32(np.ascontiguousarray(codes).data, crc)
    crc = crc32(np.ascontiguousarray(scales).data, crc)
    if token_scales is None:
        return crc32(b"\0", crc)
    crc = crc32(b"\1", crc)
    return crc32(np.ascontiguousarray(token_scales, dtype="<f4").data, crc)


def record_checksum(chunk: Any) -> int:
    """``RecordChunk.checksum`` with the fast crc32."""
    return chunk_checksum(
        chunk.run, chunk.policy_version, chunk.trajectory, chunk.site, chunk.token_start, chunk.n_tokens,
        chunk.codes, chunk.scales, chunk.global_scale, chunk.token_scales,
    )  # fmt: skip


def chunk_checksum_parts(
    run: str,
    policy_version: int,
    trajectory: str,
    site: str,
    token_start: int,
    n_tokens: int,
    n_rows: int,
    code_bytes: int,
    scale_bytes: int,
    codes: list[Any],
    scales: list[Any],
    global_scale: float,
    token_scales: list[Any] | None,
) -> int:
    """:func:`chunk_checksum` of a chunk whose rows lie in several buffers (a coalesced run):
    ``codes``/``scales``/``token_scales`` are lists of byte buffers, concatenated in order."""
    head = _TAG + f"{run}\0{trajectory}\0{site}\0".encode()
    head += _HEAD.pack(policy_version, token_start, n_tokens, n_rows, code_bytes, scale_bytes, np.float32(global_scale))
    crc = crc32(head)
    for part in codes:
        crc = crc32(part, crc)
    for part in scales:
        crc = crc32(part, crc)
    if token_scales is None:
        return crc32(b"\0", crc)
    crc = crc32(b"\1", crc)
    for part in token_scales:
        crc = crc32(part, crc)
    return crc
