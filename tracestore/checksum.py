"""The wire path's CRC-32 and record-chunk checksum: the ones :mod:`tracestore.records` defines.

``records.crc32`` is ISA-L's crc32 when ``isal`` is installed (zlib-identical values; 1.2-3.6 GB/s
for zlib against ~23 GB/s measured on the bench machine, the largest per-byte cost of ingest), else
zlib's. Kept as a module so the client and server import one name for the checksum they exchange.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from tracestore.identity import fold_ids
from tracestore.records import (
    _crc32_combine,
    chunk_checksum,
    chunk_checksum_from_crcs,
    chunk_checksum_parts,
    crc32,
    crc32_combine,
)

# ISA-L's crc32 and crc32_combine (C), rather than zlib's crc32 and the Python combine
FAST = crc32 is not zlib.crc32 and crc32_combine is not _crc32_combine


def _gil_held_crc() -> Callable[[int, int, int], int] | None:
    """ISA-L's ``crc32_gzip_refl(crc, address, length)`` (isa-l/crc.h) as the isal module exports
    it, called through ``ctypes.PyDLL`` (which keeps the GIL); None where it is not exported or
    does not give zlib's values (checked here, at import)."""
    if not FAST:
        return None
    try:
        from isal import isal_zlib

        fn = ctypes.PyDLL(isal_zlib.__file__).crc32_gzip_refl
    except (ImportError, OSError, AttributeError):  # pragma: no cover - depends on the isal build
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64]
    probe = np.arange(3000, dtype="<u4")
    at = probe.ctypes.data
    if fn(0, at, probe.nbytes) != zlib.crc32(probe.tobytes()) or fn(7, at, 5) != zlib.crc32(probe.tobytes()[:5], 7):
        return None  # pragma: no cover - a different function under that name
    return fn  # type: ignore[no-any-return]


_HELD = _gil_held_crc()
HOLD_BYTES = (4 << 10, 1 << 20)  # below: isal keeps the GIL itself; above: long enough to give it up


def crc32_address(address: int, length: int, value: int = 0) -> int:
    """The CRC-32 of ``length`` bytes at ``address`` (memory the caller keeps alive), keeping the
    GIL like :func:`crc32_held` where the ISA-L symbol is available."""
    if _HELD is None or length > HOLD_BYTES[1]:
        return int(crc32((ctypes.c_char * length).from_address(address), value))
    return int(_HELD(value, address, length))


def crc32_held(data: Any, value: int = 0) -> int:
    """``crc32``, keeping the GIL for buffers of 4 KiB to 1 MiB (at most ~50 us of work here).

    isal's crc32, like zlib's, releases the GIL above 5 KiB. On a thread that checksums many
    chunk payloads in a row while other threads want the GIL (the sidecar's stream reader, beside
    gRPC's threads), each release costs a futex hand-off and then a wait to get the GIL back: a
    200 KB CRC took 0.73 ms instead of 6 us next to one busy Python thread (measured here). Not
    for a thread that should yield to others, such as the recorder's sender beside the engine."""
    a = np.frombuffer(data, np.uint8)
    if a.size < HOLD_BYTES[0]:
        return int(crc32(data, value))
    return crc32_address(a.ctypes.data, a.size, value)


__all__ = [
    "FAST", "chunk_checksum", "chunk_checksum_from_crcs", "chunk_checksum_parts", "crc32", "crc32_combine",
    "crc32_address", "crc32_held", "record_checksum",
]  # fmt: skip


def record_checksum(chunk: Any) -> int:
    """``RecordChunk.checksum`` for any object with a chunk's fields (e.g. a received, unvalidated one)."""
    return fold_ids(chunk_checksum(
        chunk.run, chunk.policy_version, chunk.trajectory, chunk.site, chunk.token_start, chunk.n_tokens,
        chunk.codes, chunk.scales, chunk.global_scale, chunk.token_scales,
    ), getattr(chunk, "ids_crc", None))  # fmt: skip
