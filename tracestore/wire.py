"""The tracestore.v1 wire format: conversions between the record model (tracestore.records) and
its messages, and the codec of ``WriteRequest`` chunk payloads spliced by hand.

Client and server speak domain types; only this module and the RPC glue touch ``*_pb2`` objects.
Payload bytes are never reinterpreted here: arrays become ``bytes`` row-major, little-endian.

Payload splicing: a sender writes each ``WriteRequest.chunks`` entry as the serialized chunk head
(every field but the payloads) followed by its ``codes``, ``scales`` and ``token_scales`` fields,
tag and length prefixed, the payload bytes joined straight from staging memory
(:func:`inline_chunk_parts`). Protobuf concatenation merges repeated fields, so the result is an
ordinary WriteRequest. The receiver reads it back without copying the payloads
(:func:`decode_write`). The field numbers and this layout are known here only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from tracestore.errors import ValidationError
from tracestore.records import (
    MAX_TOKEN_END,
    PrefixLink,
    RecordChunk,
    RunSpec,
    SiteSpec,
    TrajectorySeal,
    validate_id,
)
from tracestore.v1 import tracestore_pb2 as pb

_KIND_TO_PB = {
    "moe_input": pb.SITE_KIND_MOE_INPUT,
    "key": pb.SITE_KIND_KEY,
    "value": pb.SITE_KIND_VALUE,
    "other": pb.SITE_KIND_OTHER,
    "routed_experts": pb.SITE_KIND_ROUTED_EXPERTS,
    "logprobs": pb.SITE_KIND_LOGPROBS,
}
_PB_TO_KIND = {v: k for k, v in _KIND_TO_PB.items()}


def run_spec_to_pb(spec: RunSpec) -> pb.RunSpec:
    return pb.RunSpec(
        run=spec.run,
        sites=[
            pb.Site(
                name=s.name,
                kind=_KIND_TO_PB[s.kind],
                layer=s.layer,
                width=s.width,
                format=s.format,
                bits=s.bits,
                rows_per_token=s.rows_per_token,
                n_experts=s.n_experts,
                gate=s.gate or "",
            )
            for s in spec.sites
        ],
    )


def run_spec_from_pb(msg: pb.RunSpec) -> RunSpec:
    sites = []
    for s in msg.sites:
        if s.kind not in _PB_TO_KIND:
            raise ValidationError(f"site {s.name!r}: kind must be one of {sorted(_KIND_TO_PB)}, got enum {s.kind}")
        sites.append(
            SiteSpec(
                name=s.name,
                kind=_PB_TO_KIND[s.kind],  # type: ignore[arg-type]
                layer=s.layer,
                width=s.width,
                format=s.format or "nvfp4",
                bits=s.bits or 1,
                rows_per_token=s.rows_per_token or 1,
                n_experts=s.n_experts,
                gate=s.gate or None,
            )
        )
    return RunSpec(msg.run, tuple(sites))


def chunk_to_pb(chunk: RecordChunk, *, checksum: bool = True) -> pb.Chunk:
    """Inline-bytes wire chunk (cross-host path)."""
    ts = chunk.token_scales
    return pb.Chunk(
        policy_version=chunk.policy_version,
        trajectory=chunk.trajectory,
        site=chunk.site,
        token_start=chunk.token_start,
        n_tokens=chunk.n_tokens,
        codes=chunk.codes.tobytes(),
        scales=chunk.scales.tobytes(),
        global_scale=chunk.global_scale,
        token_scales=b"" if ts is None else ts.astype("<f4", copy=False).tobytes(),
        has_token_scales=ts is not None,
        checksum=chunk.checksum if checksum else 0,
        ids_crc=chunk.ids_crc,
    )


def payload_sizes(site: SiteSpec, n_tokens: int, has_token_scales: bool) -> tuple[int, int, int, int]:
    """(rows, codes, scales, token_scales bytes) of a chunk of ``n_tokens`` at ``site``."""
    rows = n_tokens * site.rows_per_token
    return rows, rows * site.code_bytes, rows * site.scale_bytes, rows * 4 if has_token_scales else 0


def chunk_from_parts(
    run: str,
    c: pb.Chunk,
    site: SiteSpec,
    codes: bytes | memoryview,
    scales: bytes | memoryview,
    token_scales: bytes | memoryview | None,
    cls: type[RecordChunk] = RecordChunk,
) -> RecordChunk:
    """A validated RecordChunk (or ``cls``) from wire fields and payload buffers (not copied).

    Every check of the RecordChunk constructor runs here, on the wire's types (protobuf ints and
    float32s, buffers of the sizes the site's layout gives), and the chunk is then built without
    repeating them (:meth:`RecordChunk.from_checked_fields`), then checked against ``site``."""
    validate_id("run", run)
    validate_id("trajectory", c.trajectory)
    if c.site != site.name:
        raise ValidationError(f"trajectory {c.trajectory!r}: chunk of site {c.site!r} parsed as site {site.name!r}")
    if c.n_tokens < 1 or c.token_start < 0 or c.policy_version < 0:
        raise ValidationError(
            f"trajectory {c.trajectory!r} site {c.site!r}: expected token_start >= 0, n_tokens >= 1 and "
            f"policy_version >= 0, got {c.token_start}, {c.n_tokens}, {c.policy_version}"
        )
    if c.token_start + c.n_tokens > MAX_TOKEN_END:
        raise ValidationError(
            f"trajectory {c.trajectory} site {c.site}: tokens must end at or before 2^40 (MAX_TOKEN_END), "
            f"got {c.token_start + c.n_tokens}"
        )
    g = c.global_scale  # a float32 on the wire
    if not (0.0 < g < math.inf):  # (False for NaN too)
        raise ValidationError(
            f"trajectory {c.trajectory} site {c.site} tokens [{c.token_start}, {c.token_start + c.n_tokens}): "
            f"global_scale must be finite and > 0, got {g!r}"
        )
    rows, nc, ns, nt = payload_sizes(site, c.n_tokens, token_scales is not None)
    got = (len(codes), len(scales), 0 if token_scales is None else len(token_scales))
    if got != (nc, ns, nt):
        raise ValidationError(
            f"trajectory {c.trajectory!r} site {c.site!r} tokens [{c.token_start}, {c.token_start + c.n_tokens}): "
            f"expected codes/scales/token_scales of {nc}/{ns}/{nt} bytes ({rows} rows of {site.code_bytes}/"
            f"{site.scale_bytes}/4 bytes; {site.payload_layout}), got {got[0]}/{got[1]}/{got[2]}"
        )
    chunk = cls.from_checked_fields(
        run,
        c.policy_version,
        c.trajectory,
        c.site,
        c.token_start,
        c.n_tokens,
        np.frombuffer(codes, np.uint8).reshape(rows, site.code_bytes),
        np.frombuffer(scales, np.uint8).reshape(rows, site.scale_bytes),
        g,
        None if token_scales is None else np.frombuffer(token_scales, "<f4").astype(np.float32, copy=False),
        c.ids_crc if c.HasField("ids_crc") else None,  # fixed32: a uint32
    )
    return chunk.validate(site)


def seal_to_pb(seal: TrajectorySeal) -> pb.TrajectorySeal:
    return pb.TrajectorySeal(
        policy_version=seal.policy_version, trajectory=seal.trajectory, n_tokens=seal.n_tokens, sites=list(seal.sites)
    )


def seal_from_pb(run: str, s: pb.TrajectorySeal) -> TrajectorySeal:
    return TrajectorySeal(run, s.policy_version, s.trajectory, s.n_tokens, tuple(s.sites))


def link_to_pb(link: PrefixLink) -> pb.PrefixLink:
    return pb.PrefixLink(
        policy_version=link.policy_version, trajectory=link.trajectory, source=link.source, n_tokens=link.n_tokens
    )


def link_from_pb(run: str, s: pb.PrefixLink) -> PrefixLink:
    return PrefixLink(run, s.policy_version, s.trajectory, s.source, s.n_tokens)


# -- the hand-spliced payload codec --------------------------------------------------------------

# Field numbers of the spliced fields (see tracestore.proto): WriteRequest.chunks,
# Chunk.codes/scales/token_scales.
WRITE_CHUNKS = pb.WriteRequest.CHUNKS_FIELD_NUMBER
PAYLOAD_FIELDS = (pb.Chunk.CODES_FIELD_NUMBER, pb.Chunk.SCALES_FIELD_NUMBER, pb.Chunk.TOKEN_SCALES_FIELD_NUMBER)
_PAYLOAD_INDEX = {number: i for i, number in enumerate(PAYLOAD_FIELDS)}  # field number -> codes/scales/token_scales

# Below this many bytes a received chunk is parsed by protobuf instead of scanned
SMALL_CHUNK = 16 << 10  # protobuf: 5x faster per small chunk than the scan
# Up to this many bytes a whole WriteRequest is parsed by protobuf in one call: a shared-memory
# request (chunk headers only) or a few small inline chunks, whose payload copies cost less than
# walking the fields in Python.
SMALL_REQUEST = 256 << 10

_NOT_WRITE = "Write request is not a valid tracestore.v1.WriteRequest message"


def varint(n: int) -> bytes:
    """The protobuf base-128 varint of ``n >= 0``."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``buf[pos:end]``; ValidationError when it is cut
    off or longer than 64 bits."""
    value, shift = 0, 0
    while True:
        if pos >= end or shift > 63:
            raise ValidationError(f"{_NOT_WRITE}: bad varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def len_field(number: int, length: int) -> bytes:
    """Protobuf tag + length prefix of a length-delimited field (wire type 2)."""
    return varint(number << 3 | 2) + varint(length)


# A window of decode chunks repeats a few payload sizes thousands of times: their prefixes are kept.
_CACHE_LIMIT = 1 << 12
_FRAMES: dict[tuple[int, int, int], tuple[bytes, bytes, bytes, int]] = {}
_LEADS: dict[int, bytes] = {}


def _frame(nc: int, ns: int, nt: int) -> tuple[bytes, bytes, bytes, int]:
    """Prefixes of the payload fields of these sizes (empty for an empty field: protobuf leaves one
    out) and the bytes they take with their payloads."""
    codes, scales, token_scales = PAYLOAD_FIELDS
    lc = len_field(codes, nc) if nc else b""
    ls = len_field(scales, ns) if ns else b""
    lt = len_field(token_scales, nt) if nt else b""
    if len(_FRAMES) >= _CACHE_LIMIT:
        _FRAMES.clear()
    frame = _FRAMES[(nc, ns, nt)] = (lc, ls, lt, len(lc) + len(ls) + len(lt) + nc + ns + nt)
    return frame


def inline_chunk_parts(head: bytes, codes: list[Any], scales: list[Any], token_scales: list[Any] | None) -> list[Any]:
    """Wire bytes of one ``WriteRequest.chunks`` entry as buffers, payloads not copied: ``head`` is
    the serialized chunk without its payloads; each payload is a list of buffers that together form
    the field (one, or a coalesced run of them); an empty one is left out, as protobuf leaves it.

    Appending these to a serialized WriteRequest lets a sender join header and payload straight
    from its staging memory in one copy, instead of copying each payload into a message object and
    again when serializing (slow for large bytes fields).
    """
    nc = len(codes[0]) if len(codes) == 1 else sum(map(len, codes))  # (one buffer: the common case)
    ns = len(scales[0]) if len(scales) == 1 else sum(map(len, scales))
    nt = 0 if token_scales is None else sum(map(len, token_scales))
    frame = _FRAMES.get((nc, ns, nt))
    lc, ls, lt, size = frame if frame is not None else _frame(nc, ns, nt)
    body = len(head) + size
    lead = _LEADS.get(body)
    if lead is None:
        if len(_LEADS) >= _CACHE_LIMIT:
            _LEADS.clear()
        lead = _LEADS[body] = len_field(WRITE_CHUNKS, body)
    parts = [lead, head]
    if nc:
        parts.append(lc)
        parts += codes
    if ns:
        parts.append(ls)
        parts += scales
    if nt and token_scales is not None:
        parts.append(lt)
        parts += token_scales
    return parts


def decode_message(cls: Any, data: bytes, what: str) -> Any:
    """``cls.FromString(data)``; ValidationError naming ``what`` when it is not such a message."""
    try:
        return cls.FromString(data)
    except DecodeError as exc:
        raise ValidationError(f"{what} is not a valid tracestore.v1.{cls.__name__} message: {exc}") from exc


def fields(buf: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """Yield (field number, wire type, field start, value start, value end) over [pos, end)."""
    while pos < end:
        start = pos
        tag = buf[pos]
        if tag < 0x80:  # every tracestore.v1 field number fits a one-byte tag
            pos += 1
        else:
            tag, pos = read_varint(buf, pos, end)
        number, wt = tag >> 3, tag & 7
        if wt == 0:
            stop = pos + 1 if pos < end and buf[pos] < 0x80 else read_varint(buf, pos, end)[1]
        elif wt == 2:
            if pos < end and buf[pos] < 0x80:  # lengths below 128: one byte
                n, pos = buf[pos], pos + 1
            else:
                n, pos = read_varint(buf, pos, end)
            stop = pos + n
        elif wt == 1:
            stop = pos + 8
        elif wt == 5:
            stop = pos + 4
        else:
            raise ValidationError(f"Write request is not a valid tracestore.v1.WriteRequest: wire type {wt}")
        if stop > end or number == 0:
            raise ValidationError(f"{_NOT_WRITE}: truncated field")
        yield number, wt, start, pos, stop
        pos = stop


# A received chunk: its small fields, views of codes/scales/token_scales (None: absent) and, per
# payload field read in place, (index 0-2 of the field, start, end) in the request, in order.
DecodedChunk = tuple[pb.Chunk, list[memoryview | None], list[tuple[int, int, int]]]


def decode_write(data: bytes) -> tuple[pb.WriteRequest, list[DecodedChunk]]:
    """Parse a WriteRequest without copying large chunk payloads: the request without its chunks,
    and per chunk its small fields (a pb.Chunk), memoryviews of its payloads into ``data`` and
    where they lie in it (so a caller can checksum each payload once). Protobuf would copy each
    payload twice (into its arena, then into ``bytes``). Chunks below :data:`SMALL_CHUNK` bytes are
    parsed by protobuf (views of its ``bytes``, no locations), and so is a whole request of at most
    :data:`SMALL_REQUEST` bytes."""
    if len(data) <= SMALL_REQUEST:
        req = decode_message(pb.WriteRequest, data, "Write request")
        whole: list[DecodedChunk] = [
            (c, [memoryview(c.codes), memoryview(c.scales), memoryview(c.token_scales)], []) for c in req.chunks
        ]
        req.ClearField("chunks")  # (the chunk messages stay valid, detached from the request)
        return req, whole
    buf = memoryview(data)
    rest: list[memoryview] = []
    chunks: list[DecodedChunk] = []
    for number, wt, start, a, b in fields(buf, 0, len(buf)):
        if number != WRITE_CHUNKS or wt != 2:
            rest.append(buf[start:b])
            continue
        if b - a < SMALL_CHUNK:  # small: protobuf's C parser is faster than scanning, copies are cheap
            small = decode_message(pb.Chunk, bytes(buf[a:b]), "Write request chunk")
            views: list[memoryview | None] = [memoryview(x) for x in (small.codes, small.scales, small.token_scales)]
            chunks.append((small, views, []))
            continue
        head: list[memoryview] = []
        payload: list[memoryview | None] = [None, None, None]
        spans: list[tuple[int, int, int]] = []
        for n2, wt2, s2, a2, b2 in fields(buf, a, b):
            i = _PAYLOAD_INDEX.get(n2)
            if i is not None and wt2 == 2:
                payload[i] = buf[a2:b2]  # last one wins, as in protobuf
                spans.append((i, a2, b2))
            else:
                head.append(buf[s2:b2])
        chunks.append((decode_message(pb.Chunk, b"".join(head), "Write request chunk"), payload, spans))
    return decode_message(pb.WriteRequest, b"".join(rest), "Write request"), chunks
