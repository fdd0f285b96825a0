"""Join two Parquet files of one schema into one by rewriting the footer (no re-encoding).

Arrow's Parquet writer encodes row groups one after another on one core. A shard is written
faster when two writers encode its two halves at once and the halves are joined: a Parquet file
is ``PAR1``, column-chunk bytes, a Thrift ``FileMetaData`` footer, the footer's length and
``PAR1`` (parquet-format), and every byte position in the footer is absolute. The joined file is
the first file without its footer, the second file's bytes (unreferenced bytes between column
chunks are allowed), and one footer that lists the row groups of both, the second's moved by
where its bytes now lie.

Footers are Thrift compact protocol (Apache Thrift ``TCompactProtocol``). Only positions are
rewritten: ``RowGroup.file_offset`` and ``ordinal``, ``ColumnChunk.file_offset`` and its
page-index offsets, ``ColumnMetaData`` data/index/dictionary page and bloom-filter offsets;
every other byte is copied. :func:`join_footers` does not walk the first footer's row groups:
the fields after them must be the same bytes in both footers (same schema, metadata, writer).
"""

from __future__ import annotations

from collections.abc import Callable

from tracestore.errors import CorruptionError

MAGIC = b"PAR1"

# compact-protocol type ids
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT, _UUID = range(1, 14)

# field ids (parquet-format parquet.thrift)
_FMD_NUM_ROWS, _FMD_ROW_GROUPS = 3, 4
_RG_COLUMNS, _RG_FILE_OFFSET, _RG_ORDINAL = 1, 5, 7
_CC_FILE_OFFSET, _CC_META, _CC_OFFSET_INDEX, _CC_COLUMN_INDEX = 2, 3, 4, 6
_CMD_OFFSETS = frozenset((9, 10, 11, 14))  # data / index / dictionary page offsets, bloom filter offset
_CC_OFFSETS = frozenset((_CC_FILE_OFFSET, _CC_OFFSET_INDEX, _CC_COLUMN_INDEX))



class _Bad(Exception):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, pos
        shift += 7
        if shift > 70:
            raise _Bad("varint too long")


def _zigzag(buf: bytes, pos: int) -> tuple[int, int]:
    n, pos = _varint(buf, pos)
    return (n >> 1) ^ -(n & 1), pos


def _skip(buf: bytes, pos: int, t: int, depth: int = 0) -> int:
    if t in (_I16, _I32, _I64):
        while buf[pos] & 0x80:
            pos += 1
        return pos + 1
    if t in (_TRUE, _FALSE):
        return pos
    if t == _BYTE:
        return pos + 1
    if t == _DOUBLE:
        return pos + 8
    if t == _UUID:
        return pos + 16
    if t == _BINARY:
        n, pos = _varint(buf, pos)
        return pos + n
    if depth > 32:
        raise _Bad("nesting too deep")
    if t in (_LIST, _SET):
        head = buf[pos]
        pos += 1
        size, et = head >> 4, head & 0x0F
        if size == 15:
            size, pos = _varint(buf, pos)
        if et in (_TRUE, _FALSE, _BYTE):
            return pos + size
        for _ in range(size):
            pos = _skip(buf, pos, et, depth + 1)
        return pos
    if t == _MAP:
        size, pos = _varint(buf, pos)
        if size:
            kt, vt = buf[pos] >> 4, buf[pos] & 0x0F
            pos += 1
            for _ in range(size):
                pos = _skip(buf, pos, kt, depth + 1)
                pos = _skip(buf, pos, vt, depth + 1)
        return pos
    if t == _STRUCT:
        while True:
            head = buf[pos]
            pos += 1
            if head == 0:
                return pos
            ft, delta = head & 0x0F, head >> 4
            if not delta:
                _, pos = _zigzag(buf, pos)
            pos = _skip(buf, pos, ft, depth + 1)
    raise _Bad(f"unknown thrift type {t}")


def _list_items(buf: bytes, pos: int) -> tuple[int, int, int]:
    """(element type, element count, offset of the first element) of the list at ``pos``."""
    head = buf[pos]
    size, et = head >> 4, head & 0x0F
    pos += 1
    if size == 15:
        size, pos = _varint(buf, pos)
    return et, size, pos


def _walk(buf: bytes, pos: int, level: int, found: list[tuple[int, int, int, int]]) -> int:
    """Walk a RowGroup (level 0), ColumnChunk (1) or ColumnMetaData (2) struct at ``pos`` once,
    appending (start, end, value, kind) for each position field (kind 1: a byte offset, 0: the
    row group ordinal); return the struct's end."""
    fid = 0
    while True:
        head = buf[pos]
        pos += 1
        if head == 0:
            return pos
        t, delta = head & 0x0F, head >> 4
        if delta:
            fid += delta
        else:
            fid, pos = _zigzag(buf, pos)
        if t == _I64 and (
            (level == 0 and fid == _RG_FILE_OFFSET)
            or (level == 1 and fid in _CC_OFFSETS)
            or (level == 2 and fid in _CMD_OFFSETS)
        ):
            value, end = _zigzag(buf, pos)
            found.append((pos, end, value, 1))
            pos = end
        elif level == 0 and t == _I16 and fid == _RG_ORDINAL:
            value, end = _zigzag(buf, pos)
            found.append((pos, end, value, 0))
            pos = end
        elif level == 0 and t == _LIST and fid == _RG_COLUMNS:
            et, n, pos = _list_items(buf, pos)
            if et != _STRUCT:
                raise _Bad("RowGroup.columns is not a list of structs")
            for _ in range(n):
                pos = _walk(buf, pos, 1, found)
        elif level == 1 and t == _STRUCT and fid == _CC_META:
            pos = _walk(buf, pos, 2, found)
        else:
            pos = _skip(buf, pos, t)


def _encode_zigzag(n: int) -> bytes:
    return _uvarint((n << 1) ^ (n >> 63))


def _list_header(et: int, n: int) -> bytes:
    return bytes([(n << 4) | et]) if n < 15 else bytes([0xF0 | et]) + _uvarint(n)


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _layout(buf: bytes) -> tuple[list[tuple[int, int, int, int]], int]:
    """The top-level fields of a FileMetaData up to and including ``row_groups`` (the rest are
    not walked); returns them and the offset of the byte after the row_groups field's header."""
    out = []
    fid = pos = 0
    while True:
        head = buf[pos]
        pos += 1
        if head == 0:
            raise _Bad("FileMetaData without row_groups")
        t, delta = head & 0x0F, head >> 4
        if delta:
            fid += delta
        else:
            fid, pos = _zigzag(buf, pos)
        if fid == _FMD_ROW_GROUPS:
            if t != _LIST:
                raise _Bad("row_groups is not a list")
            out.append((fid, t, pos, -1))
            return out, pos
        end = _skip(buf, pos, t)
        out.append((fid, t, pos, end))
        pos = end


class Footer:
    """A Parquet footer walked once: where its row groups and their position fields lie."""

    def __init__(self, buf: bytes) -> None:
        try:
            self.buf = buf
            self.head, rg = _layout(buf)
            self.n_rows = next(_zigzag(buf, a)[0] for f, t, a, _ in self.head if f == _FMD_NUM_ROWS)
            et, self.n_groups, self.items = _list_items(buf, rg)
            if et != _STRUCT:
                raise _Bad("row_groups is not a list of structs")
            self.positions: list[tuple[int, int, int, int]] = []
            pos = self.items
            for _ in range(self.n_groups):
                pos = _walk(buf, pos, 0, self.positions)
            self.items_end = pos
        except (IndexError, ValueError, StopIteration, _Bad) as exc:
            raise CorruptionError(f"Parquet footer does not parse: {exc}") from None

    def shifted_items(self, delta: int, first_ordinal: int) -> bytes:
        """The row group structs, every byte offset moved by ``delta``, ordinals from ``first_ordinal``."""
        parts = []
        pos, ordinal = self.items, first_ordinal
        for a, b, value, kind in self.positions:
            if kind:
                new = value + delta if value else 0  # Arrow writes the deprecated ColumnChunk.file_offset as 0
            else:
                new, ordinal = ordinal, ordinal + 1
            parts += [self.buf[pos:a], _encode_zigzag(new)]
            pos = b
        parts.append(self.buf[pos : self.items_end])
        return b"".join(parts)


def join_footers(first: bytes, second: Footer, delta: int) -> bytes:
    """The footer of a file holding the first file's row groups where they are and the second
    file's moved by ``delta`` bytes: the first footer with the second's row groups appended,
    shifted and renumbered. Raises :class:`CorruptionError` when the footers' schema or metadata
    differ."""
    buf = second.buf
    tail = buf[second.items_end :]  # the fields after row_groups, and the stop byte
    try:
        head, rg = _layout(first)
        et, n_a, items_a = _list_items(first, rg)
    except (IndexError, ValueError, _Bad) as exc:
        raise CorruptionError(f"Parquet footer does not parse: {exc}") from None
    if et != _STRUCT or not first.endswith(tail) or len(first) - len(tail) < items_a:
        raise CorruptionError("Parquet footers to join differ after their row groups (other schema or metadata?)")
    skip = (_FMD_NUM_ROWS, _FMD_ROW_GROUPS)
    if {f: first[a:b] for f, _, a, b in head if f not in skip} != {
        f: buf[a:b] for f, _, a, b in second.head if f not in skip
    }:
        raise CorruptionError("Parquet footers to join differ before their row groups (other schema?)")
    _, _, a, b = next(x for x in head if x[0] == _FMD_NUM_ROWS)
    rows = _zigzag(first, a)[0] + second.n_rows
    return b"".join(
        [
            first[:a],
            _encode_zigzag(rows),
            first[b:rg],
            _list_header(_STRUCT, n_a + second.n_groups),
            first[items_a : len(first) - len(tail)],
            second.shifted_items(delta, n_a),
            tail,
        ]
    )


def read_footer(read: Callable[[int, int], bytes], size: int) -> tuple[int, bytes]:
    """(offset where the footer starts, footer bytes) of a complete Parquet file of ``size``
    bytes whose bytes ``read(offset, n)`` returns."""
    if size < 12 or read(0, 4) != MAGIC or read(size - 4, 4) != MAGIC:
        raise CorruptionError("not a Parquet file (no PAR1 magic at both ends)")
    n = int.from_bytes(read(size - 8, 4), "little")
    start = size - 8 - n
    if start < 4:
        raise CorruptionError(f"Parquet footer length {n} does not fit a {size}-byte file")
    return start, read(start, n)


def split_file(data: bytes | memoryview) -> tuple[int, bytes]:
    """:func:`read_footer` of a file held in memory."""
    return read_footer(lambda offset, n: bytes(data[offset : offset + n]), len(data))
