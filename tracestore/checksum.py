"""CRC-32 and the record-chunk checksum: the one module that defines them.

A chunk's checksum is the CRC-32 (zlib's values) of a canonical encoding (docs/data-model.md):
the tag :data:`CHECKSUM_TAG`; ``run\\0trajectory\\0site\\0`` (UTF-8); :data:`HEAD` packed as
``(policy_version, token_start, n_tokens, n_rows, code_bytes, scale_bytes, g)``; the codes bytes;
the scales bytes; then ``b"\\1"`` + the token scales' float32 little-endian bytes, or ``b"\\0"``;
then, for a chunk with a token identity, ``b"\\2"`` + ``ids_crc`` as ``<I`` (:func:`fold_ids`).

Everything but the payloads is a :class:`ChunkKey`. Two entry points compute the value:
:func:`chunk_checksum` over the payload bytes (each field may lie in several buffers), and
:func:`chunk_checksum_from_crcs` from the payloads' own CRC-32s without reading them again.
:func:`record_checksum` applies the first to any object with a chunk's fields.

``crc32`` is ISA-L's when ``isal`` is installed (zlib-identical values, several times faster: the
largest per-byte cost of ingest), else zlib's.

Example::

    key = ChunkKey("run-1", 0, "traj-7", "layers.0.mlp.input", token_start=0, n_tokens=2,
                   n_rows=2, code_bytes=1024, scale_bytes=128, global_scale=1.0)
    chunk_checksum(key, [codes], [scales], None) == record.checksum
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_fast_crc32: Callable[..., int] | None
_fast_combine: Callable[[int, int, int], int] | None
try:  # optional: ISA-L's CRC-32 (same values as zlib's)
    from isal.isal_zlib import crc32 as _fast_crc32
except ImportError:  # pragma: no cover - depends on the environment
    _fast_crc32 = None
try:
    from isal.isal_zlib import crc32_combine as _fast_combine
except ImportError:  # pragma: no cover - depends on the environment
    _fast_combine = None


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib's crc32_combine (GF(2) matrix method, as in zlib's crc32.c)."""

    def times(mat: list[int], vec: int) -> int:
        out, i = 0, 0
        while vec:
            if vec & 1:
                out ^= mat[i]
            vec >>= 1
            i += 1
        return out

    def square(mat: list[int]) -> list[int]:
        return [times(mat, mat[n]) for n in range(32)]

    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = square(odd)  # two zero bits
    odd = square(even)  # four zero bits
    while True:
        even = square(odd)  # first pass: one zero byte
        if len2 & 1:
            crc1 = times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = square(even)
        if len2 & 1:
            crc1 = times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


crc32: Callable[..., int] = zlib.crc32 if _fast_crc32 is None else _fast_crc32
"""zlib-compatible CRC-32 (``crc32(data, value=0)``): ISA-L's when ``isal`` is installed, else zlib's."""

crc32_combine: Callable[[int, int, int], int] = _crc32_combine if _fast_combine is None else _fast_combine
"""``crc32_combine(crc(a), crc(b), len(b)) == crc32(a + b)`` (zlib semantics)."""

FAST = _fast_crc32 is not None and _fast_combine is not None  # ISA-L's crc32 and crc32_combine (C)

CHECKSUM_TAG = b"tracestore.chunk.v1\0"
HEAD = struct.Struct("<qqqqqqf")  # policy_version, token_start, n_tokens, n_rows, code_bytes, scale_bytes, g
HEAD_DTYPE = np.dtype(
    [("pv", "<i8"), ("ts", "<i8"), ("nt", "<i8"), ("nr", "<i8"), ("cb", "<i8"), ("sb", "<i8"), ("g", "<f4")]
)  # HEAD as a numpy record, for checksums computed column-wise
IDS_TAG = 2  # the byte before a chunk's ids_crc in its checksum
IDS_FOLD = struct.Struct("<BI")
IDS_FOLD_DTYPE = np.dtype([("tag", "u1"), ("ids", "<u4")])  # IDS_FOLD as a numpy record


@dataclasses.dataclass(frozen=True)
class ChunkKey:
    """Everything a chunk's checksum covers but its payloads: where its rows belong (run, policy
    version, trajectory, site, tokens ``[token_start, token_start + n_tokens)``), their shape
    (``n_rows`` rows of ``code_bytes`` code and ``scale_bytes`` scale bytes), the decode-side
    global scale g (hashed as float32) and the token identity ``ids_crc`` (None: none)."""

    run: str
    policy_version: int
    trajectory: str
    site: str
    token_start: int
    n_tokens: int
    n_rows: int
    code_bytes: int
    scale_bytes: int
    global_scale: float
    ids_crc: int | None = None

    @classmethod
    def of(cls, chunk: Any) -> ChunkKey:
        """The key of any object with a chunk's fields and 2-D ``codes``/``scales`` (a
        ``RecordChunk``, or a received one not validated yet)."""
        n_rows, code_bytes = chunk.codes.shape
        return cls(
            chunk.run,
            chunk.policy_version,
            chunk.trajectory,
            chunk.site,
            chunk.token_start,
            chunk.n_tokens,
            n_rows,
            code_bytes,
            chunk.scales.shape[1],
            chunk.global_scale,
            getattr(chunk, "ids_crc", None),
        )

    def head(self) -> bytes:
        """The encoding's bytes before the payloads."""
        return key_prefix(self.run, self.trajectory, self.site) + HEAD.pack(
            self.policy_version,
            self.token_start,
            self.n_tokens,
            self.n_rows,
            self.code_bytes,
            self.scale_bytes,
            np.float32(self.global_scale),
        )


def key_prefix(run: str, trajectory: str, site: str) -> bytes:
    """The encoding's first bytes: the tag and the key strings."""
    return CHECKSUM_TAG + f"{run}\0{trajectory}\0{site}\0".encode()


def fold_ids(checksum: int, ids: int | None) -> int:
    """A chunk checksum extended by its token identity: ``crc32(b"\\2" + <I ids, checksum)``;
    unchanged when the chunk carries none (so chunks without identity keep their checksum)."""
    if ids is None:
        return checksum
    return zlib.crc32(IDS_FOLD.pack(IDS_TAG, ids), checksum)


def chunk_checksum(
    key: ChunkKey,
    codes: Sequence[Any],
    scales: Sequence[Any],
    token_scales: Sequence[Any] | None,
    *,
    crc_fn: Callable[..., int] | None = None,
) -> int:
    """The checksum of the chunk ``key`` whose codes, scales and token scales (None: none) are the
    concatenation of the byte buffers given for each, in order. ``crc_fn``: the CRC-32 to hash the
    payloads with (same values; default :data:`crc32`)."""
    f = crc32 if crc_fn is None else crc_fn
    crc = crc32(key.head())
    for part in codes:
        crc = f(part, crc)
    for part in scales:
        crc = f(part, crc)
    if token_scales is None:
        return fold_ids(crc32(b"\0", crc), key.ids_crc)
    crc = crc32(b"\1", crc)
    for part in token_scales:
        crc = f(part, crc)
    return fold_ids(crc, key.ids_crc)


def chunk_checksum_from_crcs(
    key: ChunkKey, codes: tuple[int, int], scales: tuple[int, int], token_scales: tuple[int, int] | None
) -> int:
    """:func:`chunk_checksum` from the CRC-32s (seed 0) of the payloads, each given as
    ``(crc, length)``, combined with ``crc32_combine`` instead of reading the bytes again."""
    crc = crc32(key.head())
    crc = crc32_combine(crc, codes[0], codes[1])
    crc = crc32_combine(crc, scales[0], scales[1])
    if token_scales is None:
        return fold_ids(crc32(b"\0", crc), key.ids_crc)
    return fold_ids(crc32_combine(crc32(b"\1", crc), token_scales[0], token_scales[1]), key.ids_crc)


def record_checksum(chunk: Any) -> int:
    """The checksum of any object with a chunk's fields (``RecordChunk.checksum``, or a received
    chunk not validated yet): 2-D ``codes``/``scales``, float32 ``token_scales`` [rows] or None."""
    ts = chunk.token_scales
    return chunk_checksum(
        ChunkKey.of(chunk),
        [np.ascontiguousarray(chunk.codes).data],
        [np.ascontiguousarray(chunk.scales).data],
        None if ts is None else [np.ascontiguousarray(ts, dtype="<f4").data],
    )


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
#: a 200 KB CRC holding the GIL: 6 us; releasing it beside busy threads: 0.73 ms
HOLD_BYTES = (4 << 10, 1 << 20)  # below: isal keeps the GIL itself; above: long enough to give it up


def crc32_address(address: int, length: int, value: int = 0) -> int:
    """The CRC-32 of ``length`` bytes at ``address`` (memory the caller keeps alive), keeping the
    GIL like :func:`crc32_held` where the ISA-L symbol is available."""
    if _HELD is None or length > HOLD_BYTES[1]:
        return int(crc32((ctypes.c_char * length).from_address(address), value))
    return int(_HELD(value, address, length))


def crc32_held(data: Any, value: int = 0) -> int:
    """``crc32``, keeping the GIL for buffers of 4 KiB to 1 MiB (at most ~50 us of work).

    isal's crc32, like zlib's, releases the GIL above 5 KiB; on a thread that checksums many
    payloads in a row beside other busy threads (the sidecar's stream reader), each release costs
    a hand-off and a wait to get the GIL back. Not for a thread that should yield to others, such
    as the recorder's sender beside the engine."""
    a = np.frombuffer(data, np.uint8)
    if a.size < HOLD_BYTES[0]:
        return int(crc32(data, value))
    return crc32_address(a.ctypes.data, a.size, value)
