"""The write-ahead log's files: the entry format, the segment files of a directory, and replay.

An entry is ``<IIB`` (payload length, CRC-32 of type byte + payload, type) followed by the payload;
a segment is ``wal-<index>.log`` (12 digits), entries back to back, possibly followed by zero
padding (direct mode cuts it on rotation and close, a crash may leave it). Nothing here holds a
:class:`~tracestore.server.wal.log.WriteAheadLog`'s state: these are the checks replay runs on the
files before the log opens, and the file-system helpers it shares with the appending side.

A crash can leave a torn tail only at the very end of the newest segment: replay cuts a bad entry
there only when no intact entry follows it anywhere in the file (zero padding after the last entry
is the end of a segment). A bad entry followed by intact ones, a bad entry in an older segment, or a
missing segment between two present ones is corruption of acknowledged data: replay refuses
(:class:`CorruptionError` naming the segment and byte offset) and never truncates. So is a segment
whose intact entries end (the file ends, zero padding or a torn entry begins) before the bytes
``DURABLE`` records as made durable by an fdatasync (:mod:`tracestore.server.wal.mark`), and a
segment that record names past the newest one present: a crash never takes away synced bytes.
"""

from __future__ import annotations

import logging
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from tracestore.checksum import crc32
from tracestore.errors import ConfigError, CorruptionError

log = logging.getLogger("tracestore.server")
HEADER = struct.Struct("<IIB")
MAX_ENTRY = 1 << 31
SECTOR = 512  # the device writes whole sectors: a torn write zero-fills from a sector boundary on
SEGMENT_RE = re.compile(r"wal-(\d{12})\.log")
MARK = "DURABLE"  # the record of bytes made durable per segment (mark.py)
WAYS_OUT = (
    "Restore the segment from a backup, or move the WAL directory aside to start empty (losing the acknowledged "
    "records not yet committed to storage)"
)

Buffer = bytes | bytearray | memoryview


class Checked(NamedTuple):
    """An entry part whose CRC-32 (seed 0) the caller has computed already (the sidecar checks
    every received payload's CRC): the entry's CRC is combined from it (``crc32_combine``, ~0.2 us)
    instead of reading the part's bytes a second time.

    ``verify``: the bytes may change under us (a writer's shared memory, which another process
    could overwrite between the caller's CRC and the copy here). The copy in the log is then
    checked against ``crc`` right after it is made, while it is in cache, and the append refused
    (CorruptionError, nothing appended) if they differ: an entry whose bytes do not match its CRC
    would stop every later replay of the log, not only the offending writer's message."""

    data: Buffer
    crc: int
    verify: bool = False


Part = Buffer | Checked


@dataclass
class Segment:
    index: int
    path: Path
    size: int = 0


def segment_path(directory: Path, index: int) -> Path:
    return directory / f"wal-{index:012d}.log"


# -- file-system helpers ----------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def cut(path: Path, size: int) -> None:
    """Truncate ``path`` to ``size`` bytes and fsync it."""
    with open(path, "r+b") as f:
        f.truncate(size)
        os.fsync(f.fileno())


def lock_directory(directory: Path) -> int:
    """Take an exclusive ``flock`` on ``directory/LOCK`` for the log's lifetime; a second log (a
    second sidecar) on the same directory would delete or truncate the first one's live segments."""
    import fcntl

    path = directory / "LOCK"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:  # not ours to write, or a symlink in its place (ELOOP)
        raise ConfigError(
            f"cannot open the write-ahead log's lock file {path}: {exc.strerror}; expected a regular file the "
            "sidecar's user may write (or none)"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"write-ahead log directory {directory} is in use by another running sidecar (it holds {path}); "
            "give each sidecar its own --wal-dir"
        ) from None
    return fd


# -- scanning ---------------------------------------------------------------------------------------


def entry_at(data: bytes | memoryview, pos: int) -> tuple[int, int] | None:
    """``(kind, end)`` of an intact entry at ``pos``, or None."""
    if pos + HEADER.size > len(data):
        return None
    length, crc, kind = HEADER.unpack_from(data, pos)
    end = pos + HEADER.size + length
    if end > len(data):
        return None
    if crc32(data[pos + HEADER.size : end], crc32(bytes([kind]))) != crc:
        return None
    return kind, end


def zeroed_from_a_sector(data: bytes, pos: int) -> bool:
    """Whether everything from some sector boundary after ``pos`` to the end is zero: what a write
    cut short by a crash leaves of a complete-looking entry (the file's size covers blocks whose
    data never reached the device, which read back as zeros). A complete entry with a wrong checksum
    and no such zero tail is damage to bytes that were written, possibly acknowledged."""
    end = len(data.rstrip(b"\0"))
    boundary = -(-max(end, pos + 1) // SECTOR) * SECTOR
    return boundary < len(data)


def intact_after(data: bytes, start: int) -> int | None:
    """Offset of the first intact entry at or after ``start`` (any byte offset), or None. Candidates
    are offsets whose header names a known entry type (1..15) and a length that fits in the file;
    only those are checksummed (a few per 4 KiB of random bytes, none in zero padding)."""
    import numpy as np

    n = len(data)
    if n - start < HEADER.size:
        return None
    buf = np.frombuffer(data, dtype=np.uint8)
    step = 1 << 22
    for lo in range(start, n - HEADER.size + 1, step):
        hi = min(n - HEADER.size + 1, lo + step)
        kinds = buf[lo + 8 : hi + 8]
        cand = np.flatnonzero((kinds >= 1) & (kinds <= 15))
        if cand.size == 0:
            continue
        at = cand + lo
        length = (
            buf[at].astype(np.uint64)
            | (buf[at + 1].astype(np.uint64) << 8)
            | (buf[at + 2].astype(np.uint64) << 16)
            | (buf[at + 3].astype(np.uint64) << 24)
        )
        fits = at[(at.astype(np.uint64) + HEADER.size + length) <= n]
        for pos in fits.tolist():
            if entry_at(data, pos) is not None:
                return int(pos)
    return None


def lost_tail(seg: Segment, end: int, durable: int, what: str) -> CorruptionError:
    """The refusal for a segment whose intact entries end at ``end`` (``what`` is there) while an
    fdatasync had made ``durable`` bytes of it durable."""
    mark = seg.path.parent / MARK
    return CorruptionError(
        f"write-ahead log segment {seg.path} is cut short at byte {end} ({what}), but {durable} bytes of it were "
        f"durably written (an fdatasync returned; recorded in {mark}): the entries in bytes {end}..{durable} were "
        "acknowledged and are gone. A crash never takes away synced bytes: the file was truncated or overwritten "
        "(damage to the file system or the disk). The sidecar will not start and has changed nothing. "
        f"{WAYS_OUT}; or, to replay what is left and lose only those entries, delete {mark} and start again"
    )


def scan_segment(seg: Segment, data: bytes, *, last: bool, durable: int = 0) -> int:
    """Byte offset where ``seg``'s intact entries end; raises CorruptionError for damage that is
    not a torn tail of the newest segment, and when they end before ``durable`` (the bytes of it an
    fdatasync made durable, from ``DURABLE``)."""
    pos = 0
    while pos < len(data):
        entry = entry_at(data, pos)
        if entry is not None:
            pos = entry[1]
            continue
        if data.count(0, pos) == len(data) - pos:
            if pos < durable:
                raise lost_tail(seg, pos, durable, f"zeros from there to the file's end at byte {len(data)}")
            return pos  # zero padding after the last entry (direct mode): the end, not damage
        if pos + HEADER.size > len(data):
            bad = "truncated entry header"
        else:
            length = HEADER.unpack_from(data, pos)[0]
            bad = "truncated entry" if pos + HEADER.size + length > len(data) else "checksum mismatch"
        later = intact_after(data, pos + 1)
        if last and later is None and (bad != "checksum mismatch" or zeroed_from_a_sector(data, pos)):
            if pos < durable:
                raise lost_tail(seg, pos, durable, f"a {bad} there, the last bytes of the file")
            log.warning(
                "write-ahead log %s: cut a torn tail of %d bytes at byte %d (%s; a write the crash interrupted, "
                "never acknowledged)",
                seg.path,
                len(data) - pos,
                pos,
                bad,
            )
            return pos
        where = (
            "an older segment"
            if not last
            else f"the newest segment, with an intact entry at byte {later}"
            if later is not None
            else "the newest segment's last entry, which is complete (a torn write leaves it short or "
            "zero-filled from a sector on)"
        )
        raise CorruptionError(
            f"write-ahead log segment {seg.path} is corrupt at byte {pos} ({bad}) in {where}: the entries "
            "from there on may hold acknowledged records, so the sidecar will not start and has changed "
            f"nothing. {WAYS_OUT}"
        )
    if pos < durable:
        raise lost_tail(seg, pos, durable, "the file ends there")
    return pos


# -- replay -----------------------------------------------------------------------------------------

# what decoding an entry's contents raises when they are not what its type says
UNDECODABLE = (ValueError, KeyError, TypeError, IndexError, struct.error, CorruptionError)


def find_segments(directory: Path) -> list[Segment]:
    """The segments in ``directory``, oldest first; CorruptionError when one between is missing."""
    found = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := SEGMENT_RE.fullmatch(p.name)) is not None)
    for (a, pa), (b, _) in zip(found, found[1:], strict=False):
        if b != a + 1:
            raise CorruptionError(
                f"write-ahead log {directory} is missing segment(s) {a + 1}..{b - 1} between {pa.name} and "
                f"wal-{b:012d}.log: acknowledged records may be lost; restore the missing segment(s), or "
                "move the directory aside to start empty (losing what was acknowledged and not yet committed)"
            )
    return [Segment(i, p, p.stat().st_size) for i, p in found]


def check_marks(directory: Path, segments: list[Segment], durable: dict[int, int]) -> None:
    """CorruptionError when ``durable`` (from ``DURABLE``) names a segment past the newest present:
    segments that held acknowledged records are gone as a whole. (Those older than the oldest
    present were retired after their records were committed: not checked.)"""
    newest = segments[-1].index if segments else 0
    gone = sorted(i for i in durable if i > newest)
    if gone:
        first, mark = segment_path(directory, gone[0]), directory / MARK
        raise CorruptionError(
            f"write-ahead log segment {first} is missing (the newest present is "
            f"{segments[-1].path.name if segments else 'none'}), but {durable[gone[0]]} bytes of it were durably "
            f"written (an fdatasync returned; recorded in {mark}): it and any segment after it held acknowledged "
            f"records. The sidecar will not start and has changed nothing. {WAYS_OUT}; or, to replay what is "
            f"left and lose those records, delete {mark} and start again"
        )


def replay_segments(
    directory: Path, segments: list[Segment], durable: dict[int, int]
) -> Iterator[tuple[int, int, bytes, int]]:
    """Yield ``(segment_index, type, payload, byte offset)`` for every intact entry of ``segments``
    (those of ``directory``), oldest first, after checking them all (:func:`check_marks`, and
    :func:`scan_segment` against ``durable``: ``{segment index: bytes an fdatasync made durable}``)
    and cutting a torn tail of the newest one (its ``size`` is updated)."""
    # Check every segment first: a corrupt log must stop the start before the caller acts on
    # any of its entries.
    check_marks(directory, segments, durable)
    ends: list[int] = []
    for n, seg in enumerate(segments):
        with open(seg.path, "rb") as f:
            data = f.read()
        end = scan_segment(seg, data, last=n == len(segments) - 1, durable=durable.get(seg.index, 0))
        ends.append(end)
    for seg, end in zip(segments, ends, strict=True):
        if end < seg.size:  # a torn tail of the newest segment
            cut(seg.path, end)
            seg.size = end
        with open(seg.path, "rb") as f:
            data = f.read(end)
        pos = 0
        while pos < end:
            length, _, kind = HEADER.unpack_from(data, pos)
            nxt = pos + HEADER.size + length
            yield seg.index, kind, data[pos + HEADER.size : nxt], pos
            pos = nxt


def apply_entries(
    directory: Path,
    entries: Iterable[tuple[int, int, bytes, int]],
    apply: Callable[[int, int, bytes], int],
    names: Mapping[int, str],
) -> int:
    """Hand each of ``entries`` (:func:`replay_segments`) to ``apply(segment_index, type,
    payload)``; returns the sum of what it returned. An entry whose contents ``apply`` cannot decode
    (:data:`UNDECODABLE`; its CRC-32 holds, so they were like this when written) is CorruptionError
    naming its segment file, byte offset and type (``names``) and the decoder's words, without
    advice meant for a network client ("resend"): the sidecar refuses to start."""
    n = 0
    for index, kind, payload, at in entries:
        try:
            n += apply(index, kind, payload)
        except UNDECODABLE as exc:
            detail = re.sub(r";\s*resend\b.*$", "", (str(exc).strip().splitlines() or [""])[0])
            raise CorruptionError(
                f"write-ahead log segment {segment_path(directory, index)}: the {names.get(kind, f'type-{kind}')} "
                f"entry at byte {at} ({len(payload)} bytes, its CRC-32 intact) cannot be replayed "
                f"({type(exc).__name__}: {detail}); it and the entries after it may hold acknowledged records, so "
                f"the sidecar will not start and has changed nothing. {WAYS_OUT}"
            ) from exc
    return n
