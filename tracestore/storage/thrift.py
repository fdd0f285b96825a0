"""The few Apache Thrift compact-protocol primitives tracestore reads Parquet metadata with.

Parquet page headers and footers are Thrift structs in the compact protocol (Apache Thrift
``TCompactProtocol`` spec): a field header byte holds a field-id delta (high nibble; 0 = a zigzag
varint id follows) and a type (low nibble, 0 = end of struct); integers are zigzag varints; a list
header holds its size (high nibble, 15 = a varint size follows) and element type. Used by
:mod:`tracestore.storage.pagecrc` (page checksums) and :mod:`tracestore.storage.pqconcat` (footer rewriting).
"""

from __future__ import annotations

STOP = 0
BOOL_TRUE, BOOL_FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT, UUID = range(1, 14)
MAX_DEPTH = 32


class ThriftError(Exception):
    """Bytes that are not a well-formed compact-protocol struct (callers turn it into
    :class:`~tracestore.errors.CorruptionError` naming the file)."""


def varint(buf: bytes, pos: int) -> tuple[int, int]:
    """(unsigned value, offset after it); IndexError past the end of ``buf``."""
    out = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, pos
        shift += 7
        if shift > 63:
            raise ThriftError("varint longer than 64 bits")


def zigzag(buf: bytes, pos: int) -> tuple[int, int]:
    """(signed value of a zigzag varint, offset after it)."""
    n, pos = varint(buf, pos)
    return (n >> 1) ^ -(n & 1), pos


def field_header(buf: bytes, pos: int, fid: int) -> tuple[int, int, int]:
    """(type, field id, offset of the value) of the field header at ``pos``, ``fid`` being the
    previous field's id; type STOP ends the struct."""
    head = buf[pos]
    pos += 1
    if head == 0:
        return STOP, fid, pos
    ttype, delta = head & 0x0F, head >> 4
    if delta:
        return ttype, fid + delta, pos
    fid, pos = zigzag(buf, pos)
    return ttype, fid, pos


def list_header(buf: bytes, pos: int) -> tuple[int, int, int]:
    """(element type, element count, offset of the first element) of the list at ``pos``."""
    head = buf[pos]
    size, etype = head >> 4, head & 0x0F
    pos += 1
    if size == 15:
        size, pos = varint(buf, pos)
    return etype, size, pos


def skip(buf: bytes, pos: int, ttype: int, depth: int = 0) -> int:
    """The offset after the value of type ``ttype`` at ``pos``."""
    if ttype in (I16, I32, I64):
        while buf[pos] & 0x80:
            pos += 1
        return pos + 1
    if ttype in (BOOL_TRUE, BOOL_FALSE):
        return pos  # a struct field's bool lives in its header
    if ttype == BYTE:
        return pos + 1
    if ttype == DOUBLE:
        return pos + 8
    if ttype == UUID:
        return pos + 16
    if ttype == BINARY:
        n, pos = varint(buf, pos)
        return pos + n
    if depth > MAX_DEPTH:
        raise ThriftError("nesting too deep")
    if ttype in (LIST, SET):
        etype, size, pos = list_header(buf, pos)
        if etype in (BOOL_TRUE, BOOL_FALSE, BYTE):
            return pos + size  # one byte per element
        for _ in range(size):
            pos = skip(buf, pos, etype, depth + 1)
        return pos
    if ttype == MAP:
        size, pos = varint(buf, pos)
        if size:
            kt, vt = buf[pos] >> 4, buf[pos] & 0x0F
            pos += 1
            for _ in range(size):
                pos = skip(buf, pos, kt, depth + 1)
                pos = skip(buf, pos, vt, depth + 1)
        return pos
    if ttype == STRUCT:
        fid = 0
        while True:
            ftype, fid, pos = field_header(buf, pos, fid)
            if ftype == STOP:
                return pos
            pos = skip(buf, pos, ftype, depth + 1)
    raise ThriftError(f"unknown thrift type {ttype}")


def uvarint_bytes(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def zigzag_bytes(n: int) -> bytes:
    """A signed 64-bit value as a zigzag varint."""
    return uvarint_bytes((n << 1) ^ (n >> 63))


def list_header_bytes(etype: int, n: int) -> bytes:
    return bytes([(n << 4) | etype]) if n < 15 else bytes([0xF0 | etype]) + uvarint_bytes(n)
