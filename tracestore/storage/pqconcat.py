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
from tracestore.storage import thrift as T

MAGIC = b"PAR1"

# field ids (parquet-format parquet.thrift)
_FMD_NUM_ROWS, _FMD_ROW_GROUPS = 3, 4
_RG_COLUMNS, _RG_FILE_OFFSET, _RG_ORDINAL = 1, 5, 7
_CC_FILE_OFFSET, _CC_META, _CC_OFFSET_INDEX, _CC_COLUMN_INDEX = 2, 3, 4, 6
_CMD_OFFSETS = frozenset((9, 10, 11, 14))  # data / index / dictionary page offsets, bloom filter offset
_CC_OFFSETS = frozenset((_CC_FILE_OFFSET, _CC_OFFSET_INDEX, _CC_COLUMN_INDEX))


def _walk(buf: bytes, pos: int, level: int, found: list[tuple[int, int, int, int]]) -> int:
    """Walk a RowGroup (level 0), ColumnChunk (1) or ColumnMetaData (2) struct at ``pos`` once,
    appending (start, end, value, kind) for each position field (kind 1: a byte offset, 0: the
    row group ordinal); return the struct's end."""
    fid = 0
    while True:
        t, fid, pos = T.field_header(buf, pos, fid)
        if t == T.STOP:
            return pos
        if t == T.I64 and (
            (level == 0 and fid == _RG_FILE_OFFSET)
            or (level == 1 and fid in _CC_OFFSETS)
            or (level == 2 and fid in _CMD_OFFSETS)
        ):
            value, end = T.zigzag(buf, pos)
            found.append((pos, end, value, 1))
            pos = end
        elif level == 0 and t == T.I16 and fid == _RG_ORDINAL:
            value, end = T.zigzag(buf, pos)
            found.append((pos, end, value, 0))
            pos = end
        elif level == 0 and t == T.LIST and fid == _RG_COLUMNS:
            et, n, pos = T.list_header(buf, pos)
            if et != T.STRUCT:
                raise T.ThriftError("RowGroup.columns is not a list of structs")
            for _ in range(n):
                pos = _walk(buf, pos, 1, found)
        elif level == 1 and t == T.STRUCT and fid == _CC_META:
            pos = _walk(buf, pos, 2, found)
        else:
            pos = T.skip(buf, pos, t)


def _layout(buf: bytes) -> tuple[list[tuple[int, int, int, int]], int]:
    """The top-level fields of a FileMetaData up to and including ``row_groups`` (the rest are
    not walked); returns them and the offset of the byte after the row_groups field's header."""
    out = []
    fid = pos = 0
    while True:
        t, fid, pos = T.field_header(buf, pos, fid)
        if t == T.STOP:
            raise T.ThriftError("FileMetaData without row_groups")
        if fid == _FMD_ROW_GROUPS:
            if t != T.LIST:
                raise T.ThriftError("row_groups is not a list")
            out.append((fid, t, pos, -1))
            return out, pos
        end = T.skip(buf, pos, t)
        out.append((fid, t, pos, end))
        pos = end


class Footer:
    """A Parquet footer walked once: where its row groups and their position fields lie."""

    def __init__(self, buf: bytes) -> None:
        try:
            self.buf = buf
            self.head, rg = _layout(buf)
            self.n_rows = next(T.zigzag(buf, a)[0] for f, t, a, _ in self.head if f == _FMD_NUM_ROWS)
            et, self.n_groups, self.items = T.list_header(buf, rg)
            if et != T.STRUCT:
                raise T.ThriftError("row_groups is not a list of structs")
            self.positions: list[tuple[int, int, int, int]] = []
            pos = self.items
            for _ in range(self.n_groups):
                pos = _walk(buf, pos, 0, self.positions)
            self.items_end = pos
        except (IndexError, ValueError, StopIteration, T.ThriftError) as exc:
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
            parts += [self.buf[pos:a], T.zigzag_bytes(new)]
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
        et, n_a, items_a = T.list_header(first, rg)
    except (IndexError, ValueError, T.ThriftError) as exc:
        raise CorruptionError(f"Parquet footer does not parse: {exc}") from None
    if et != T.STRUCT or not first.endswith(tail) or len(first) - len(tail) < items_a:
        raise CorruptionError("Parquet footers to join differ after their row groups (other schema or metadata?)")
    skip = (_FMD_NUM_ROWS, _FMD_ROW_GROUPS)
    if {f: first[a:b] for f, _, a, b in head if f not in skip} != {
        f: buf[a:b] for f, _, a, b in second.head if f not in skip
    }:
        raise CorruptionError("Parquet footers to join differ before their row groups (other schema?)")
    _, _, a, b = next(x for x in head if x[0] == _FMD_NUM_ROWS)
    rows = T.zigzag(first, a)[0] + second.n_rows
    return b"".join(
        [
            first[:a],
            T.zigzag_bytes(rows),
            first[b:rg],
            T.list_header_bytes(T.STRUCT, n_a + second.n_groups),
            first[items_a : len(first) - len(tail)],
            second.shifted_items(delta, n_a),
            tail,
        ]
    )


def footer_tail(footer: bytes) -> list[bytes]:
    """What ends a Parquet file after its column chunks: the footer, its length and ``PAR1``."""
    return [footer, len(footer).to_bytes(4, "little"), MAGIC]


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
