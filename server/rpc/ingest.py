"""Parsing of Write/Seal requests into engine messages (the shared-memory pools are in ``shm.py``).

Parsing happens inside the handler (raw bytes in, explicit ``FromString``) so malformed input is
INVALID_ARGUMENT with a message, never gRPC's opaque INTERNAL (docs/protocol.md, "Transport").
"""

from __future__ import annotations

from collections.abc import Callable

from tracestore.server.engine.message import Message, pack_wal_data, unpack_wal_data
from tracestore.server.rpc.shm import POOL_NAME, ShmPools  # noqa: F401 - re-exported: they lived here before server/rpc/shm.py
from tracestore.server.wal.log import Buffer, Checked, Part

from tracestore.checksum import (
    FAST,
    ChunkKey,
    chunk_checksum_from_crcs,
    crc32,
    crc32_combine,
    crc32_held,
    record_checksum,
)
from tracestore.errors import CorruptionError, ValidationError
from tracestore.records import RecordChunk, RunSpec, validate_id
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import (
    chunk_from_parts,
    decode_message,
    decode_write,
    link_from_pb,
    payload_sizes,
    seal_from_pb,
)


class VerifiedChunk(RecordChunk):
    """A RecordChunk whose checksum the sidecar computed once, over the bytes it received (ISA-L),
    and checked against the one the writer sent. ``checksum`` returns that value, so the dedupe
    index and the shard writer (``shards._checksums`` reads ``chunk.checksum``) never recompute
    it."""

    _crc: int

    @property
    def checksum(self) -> int:
        return self._crc


_INT64_MAX = (1 << 63) - 1
InlineChunk = tuple[pb.Chunk, list[memoryview | None], list[int | None]]


def scan_write(data: bytes) -> tuple[pb.WriteRequest, list[InlineChunk], int | None]:
    """Parse a WriteRequest without copying chunk payloads (:func:`tracestore.wire.decode_write`):
    returns the request without its chunks; per chunk, its small fields (a pb.Chunk), memoryviews
    of codes/scales/token_scales into ``data`` and their CRC-32s; and the CRC-32 of all of ``data``.

    With ISA-L (``FAST``) every large payload is read once, here: its CRC serves both its chunk's
    checksum and the request's (the write-ahead log's entry CRC), which is combined from the
    payloads' and the few bytes between them. Without, the CRCs are None."""
    req, decoded = decode_write(data)
    if not FAST:
        return req, [(c, payload, [None, None, None]) for c, payload, _ in decoded], None
    buf = memoryview(data)
    chunks: list[InlineChunk] = []
    crc, done = 0, 0  # the request's CRC over data[:done]
    for c, payload, spans in decoded:
        payload_crc: list[int | None] = [None, None, None]
        for i, a, b in spans:
            part = crc32_held(buf[a:b])
            crc = crc32_combine(crc32(buf[done:a], crc), part, b - a)
            payload_crc[i], done = part, b
        chunks.append((c, payload, payload_crc))
    return req, chunks, crc32(buf[done:], crc)


def parse_write(
    data: bytes,
    run_spec: Callable[[str], RunSpec],
    shm: Callable[[str, int, int], Buffer] | None,
    *,
    verify: bool = True,
    path: str = "grpc",
    declare: Callable[[pb.RunSpec], None] | None = None,
    before_copy: Callable[[str, Callable[[], int]], None] | None = None,
) -> tuple[pb.WriteRequest, Message, list[Part]]:
    """Parse and validate one WriteRequest. Returns the wire message, the engine message and its
    write-ahead log entry (:func:`pack_wal_data` of the raw request and the shared-memory payloads,
    in chunk order, each with its CRC-32 where it was computed here).

    ``shm(pool, offset, length)`` resolves shared-memory references; None refuses them.
    Shared-memory chunks stay views into the writer's pool (``Message.shm_chunks`` lists them):
    right only while the writer keeps the regions, that is until the message is durable without a
    WAL (its shard committed), or, with a WAL, until the sidecar reports the message released to a
    writer that set ``keeps_staging``; otherwise ``Message.own_shm`` copies them out first.
    ``before_copy(pool, nbytes)`` is called before anything is read from ``pool``; ``nbytes()``
    counts the bytes the message's shared-memory references span (the sidecar copies another user's
    pool: room in the budget first; counted only then).
    The checksum stays the one computed here, at receipt, so a writer that scribbles on a region
    it has not had acknowledged yet (it gave up on the sidecar) produces a chunk that fails its
    checksum on read (DATA_LOSS), never silently different records.
    """
    req, chunks, crc = scan_write(data)
    if declare is not None and req.HasField("run_spec"):
        check_run_spec(req.run_spec)
        declare(req.run_spec)  # the run spec may ride along with any message
    if shm is not None and req.shm_pool:
        # Authorized first (run_spec checks the caller may write the run): a pool stays open while
        # its file exists, so a caller that may not write must not get the sidecar to open one.
        validate_id("run", req.run)
        spec = run_spec(req.run)
        shm(req.shm_pool, 0, 0)  # map (and report) the writer's pool even when this message is inline
        if before_copy is not None:
            before_copy(req.shm_pool, lambda: _shm_bytes(chunks, spec))
    msg, blobs = _parse(req, chunks, req.seals, req.links, run_spec, shm, verify=verify, path=path)
    return req, msg, pack_wal_data(data if crc is None else Checked(data, crc), blobs)


def _shm_bytes(chunks: list[InlineChunk], spec: RunSpec) -> int:
    """Bytes the shared-memory chunks of a message reference (those :func:`_parse` will refuse
    anyway, an undeclared site or a bad token count, count nothing)."""
    total = 0
    for c, _inline, _crcs in chunks:
        if c.HasField("shm") and c.site in spec.site_names and 0 < c.n_tokens <= 1 << 24:
            _, nc, ns, nt = payload_sizes(spec.site(c.site), c.n_tokens, c.has_token_scales)
            total += nc + ns + nt
    return total


def check_run_spec(spec: pb.RunSpec) -> None:
    """Refuse a declared site whose ``rows_per_token`` or ``bits`` is 0 (unset): the run's layout
    would otherwise be guessed (1), and a run is immutable once declared."""
    for s in spec.sites:
        for name, value, expected in (
            ("rows_per_token", s.rows_per_token, "token rows per token, 1 for most sites"),
            ("bits", s.bits, "low code bits kept per value, 1..4"),
        ):
            if value < 1:
                raise ValidationError(
                    f"run {spec.run[:200]!r} site {s.name[:200]!r}: expected {name} >= 1 ({expected}), got {value}"
                )


def parse_seal(data: bytes) -> pb.SealRequest:
    req = decode_message(pb.SealRequest, data, "Seal request")
    assert isinstance(req, pb.SealRequest)
    return req


def seal_message(req: pb.SealRequest, run_spec: Callable[[str], RunSpec]) -> Message:
    return _parse(req, [], req.seals, req.links, run_spec, None, verify=True, path="grpc")[0]


def _parse(
    req: pb.WriteRequest | pb.SealRequest,
    chunks_in: list[InlineChunk],
    seals_pb: object,
    links_pb: object,
    run_spec: Callable[[str], RunSpec],
    shm: Callable[[str, int, int], Buffer] | None,
    *,
    verify: bool,
    path: str,
) -> tuple[Message, list[Part]]:
    validate_id("run", req.run)
    validate_id("writer", req.writer)
    if req.epoch < 1 or req.sequence < 1:
        raise ValidationError(f"epoch and sequence must both be >= 1, got epoch {req.epoch} sequence {req.sequence}")
    spec = run_spec(req.run)
    sites = spec.sites_by_name
    chunks: list[RecordChunk] = []
    crcs: list[int] = []
    blobs: list[Part] = []
    nbytes = 0
    shm_bytes = 0  # writer staging this message pins until it is released (acknowledged durable)
    shm_chunks: list[int] = []  # chunks that are views into the writer's pool
    for c, inline, part_crcs in chunks_in:
        codes: Buffer
        scales: Buffer
        ts: Buffer | None
        # (trajectory and site ids are checked by RecordChunk: once per chunk, not twice)
        site = sites.get(c.site)
        if site is None:
            validate_id("site", c.site)  # a malformed id is reported as one, not as undeclared
            raise ValidationError(f"run {req.run} declares no site {c.site!r}; declared: {list(spec.site_names)}")
        if c.HasField("shm"):
            if shm is None:
                raise ValidationError("shared-memory references are accepted only over the local unix socket")
            if any(x is not None and len(x) for x in inline):
                raise ValidationError(f"chunk of {c.trajectory!r}: set either shm or inline bytes, not both")
            if c.shm.token_scales_offset and not c.has_token_scales:  # type: ignore[attr-defined]
                raise ValidationError(
                    f"chunk of {c.trajectory!r} site {c.site!r}: shm.token_scales_offset is set but has_token_scales "
                    "is not; expected has_token_scales=true with token scales, or no token_scales_offset"
                )
            if not (0 < c.n_tokens <= 1 << 24):
                raise ValidationError(f"chunk of {c.trajectory!r}: n_tokens must be 1..2^24, got {c.n_tokens}")
            _, nc, ns, nt = payload_sizes(site, c.n_tokens, c.has_token_scales)
            codes = memoryview(shm(req.shm_pool, c.shm.codes_offset, nc))  # type: ignore[attr-defined]
            scales = memoryview(shm(req.shm_pool, c.shm.scales_offset, ns))  # type: ignore[attr-defined]
            ts = memoryview(shm(req.shm_pool, c.shm.token_scales_offset, nt)) if nt else None  # type: ignore[attr-defined]
            views = [codes, scales] if ts is None else [codes, scales, ts]
            if FAST:  # read once: the chunk checksum and the WAL entry's CRC are combined from these
                held = [crc32_held(v) for v in views]
                blobs.extend(
                    Checked(v, x, verify=True) for v, x in zip(views, held, strict=True)
                )  # another process's memory
                part_crcs = [*held, None][:3]
            else:
                blobs.extend(views)
            if path != "wal":  # (WAL replay: views into the entry, which the message owns)
                shm_chunks.append(len(chunks))
                shm_bytes += nc + ns + nt
        else:
            empty = memoryview(b"")
            codes = inline[0] if inline[0] is not None else empty
            scales = inline[1] if inline[1] is not None else empty
            if not c.has_token_scales and inline[2] is not None and len(inline[2]):
                raise ValidationError(
                    f"chunk of {c.trajectory!r} site {c.site!r}: {len(inline[2])} token_scales bytes sent but "
                    "has_token_scales is not set; expected has_token_scales=true with token scales, or none"
                )
            ts = (inline[2] if inline[2] is not None else empty) if c.has_token_scales else None
        if c.token_start + c.n_tokens > _INT64_MAX:  # (Python ints: the sum cannot wrap here)
            raise ValidationError(
                f"chunk of {c.trajectory!r} site {c.site!r}: tokens [{c.token_start}, {c.token_start + c.n_tokens}) "
                "end past 2^63 - 1; expected token_start + n_tokens <= 2^63 - 1"
            )
        chunk = chunk_from_parts(req.run, c, site, codes, scales, ts, cls=VerifiedChunk)
        if FAST:  # payload CRCs computed above (small chunks' here: protobuf parsed them)
            cc, cs, ct = part_crcs
            crc = chunk_checksum_from_crcs(
                ChunkKey.of(chunk),
                (crc32_held(codes) if cc is None else cc, len(codes)),
                (crc32_held(scales) if cs is None else cs, len(scales)),
                None if ts is None else (crc32_held(ts) if ct is None else ct, len(ts)),
            )
        else:
            crc = record_checksum(chunk)
        object.__setattr__(chunk, "_crc", crc)  # frozen dataclass: set once, here
        if verify and c.checksum and c.checksum != crc:
            raise CorruptionError(
                f"{chunk.key_str}: checksum {c.checksum:#010x} sent, {crc:#010x} computed over the bytes received "
                "(corrupted in memory or on the wire); resend"
            )
        chunks.append(chunk)
        crcs.append(crc)
        nbytes += chunk.nbytes
    seals = [seal_from_pb(req.run, s) for s in seals_pb]  # type: ignore[attr-defined]
    links = [link_from_pb(req.run, s) for s in links_pb]  # type: ignore[attr-defined]
    for seal in seals:
        unknown = [s for s in seal.sites if s not in spec.site_names]
        if unknown:
            raise ValidationError(f"seal of {seal.trajectory} names undeclared sites {unknown}")
    nbytes += 64 * (len(seals) + len(links))
    msg = Message(req.run, req.writer, req.epoch, req.sequence, chunks, seals, links, nbytes, crcs, path=path)
    msg.shm_bytes = shm_bytes
    msg.shm_chunks = shm_chunks
    return msg, blobs


def wal_parser(run_spec: Callable[[str], RunSpec]) -> Callable[[bytes], Message]:
    """Parse a WAL DATA entry back into a message (shared-memory payloads come from the entry)."""

    def parse(payload: bytes) -> Message:
        request, blob = unpack_wal_data(payload)
        cursor = [0]

        def from_blob(_pool: str, _offset: int, length: int) -> Buffer:
            start = cursor[0]
            cursor[0] += length
            return blob[start : start + length]

        req, chunks, _ = scan_write(bytes(request))
        msg, _ = _parse(req, chunks, req.seals, req.links, run_spec, from_blob, verify=True, path="wal")
        return msg

    return parse
