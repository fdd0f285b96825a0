"""``DURABLE``: the write-ahead log records how many bytes of each segment an fdatasync made durable,
and replay refuses a segment cut below that (acknowledged entries lost to damage) while it still
cuts a torn tail past it (a crash before the sync). A record a crash left torn or stale never
makes replay refuse."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from tracestore.server.wal.log import HEADER, WriteAheadLog
from tracestore.server.wal.mark import read_marks

from tracestore.errors import CorruptionError


def _log(tmp_path: Path, n: int, *, segment_bytes: int = 4096, direct: bool = True) -> list[bytes]:
    wal = WriteAheadLog(tmp_path, segment_bytes=segment_bytes, direct=direct)
    list(wal.replay())
    wal.start()
    payloads = [os.urandom(200 + i) for i in range(n)]
    for p in payloads:
        wal.append(1, [p])
    wal.close()
    return payloads


def _segments(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("wal-*.log"))


def _ends(path: Path) -> list[int]:
    """Byte offsets where the entries of ``path`` end."""
    data, pos, out = path.read_bytes(), 0, []
    while pos + HEADER.size <= len(data):
        pos += HEADER.size + HEADER.unpack_from(data, pos)[0]
        out.append(pos)
    return out


@pytest.mark.parametrize("direct", [True, False])
def test_each_sync_records_what_it_made_durable(tmp_path: Path, direct: bool) -> None:
    wal = WriteAheadLog(tmp_path, segment_bytes=4096, direct=direct)
    list(wal.replay())
    wal.start()
    for i in range(30):
        _, ticket = wal.append(1, [os.urandom(300 + i)])
        assert wal.wait_synced(ticket, 10)
        marks = read_marks(tmp_path)  # written before the sync is reported: it covers this entry
        assert marks[wal.active_index] == wal.segments[-1].size
    wal.close()
    segs = _segments(tmp_path)
    assert len(segs) > 2
    assert read_marks(tmp_path) == {int(p.name[4:16]): p.stat().st_size for p in segs}


@pytest.mark.parametrize("segment", ["newest", "older"])
@pytest.mark.parametrize("how", ["truncated-at-entry", "zeroed-from-entry"])
def test_a_segment_cut_below_its_durable_bytes_is_refused(tmp_path: Path, segment: str, how: str) -> None:
    _log(tmp_path, 40)
    segs = _segments(tmp_path)
    seg = segs[-1] if segment == "newest" else segs[0]
    ends = _ends(seg)
    assert len(ends) >= 3
    at = ends[len(ends) // 2 - 1]
    data = seg.read_bytes()
    damaged = data[:at] if how == "truncated-at-entry" else data[:at] + bytes(len(data) - at)
    seg.write_bytes(damaged)
    with pytest.raises(CorruptionError, match=rf"{seg.name} is cut short at byte {at} .* {len(data)} bytes of it"):
        list(WriteAheadLog(tmp_path).replay())
    assert seg.read_bytes() == damaged  # nothing cut


def test_a_newest_segment_gone_is_refused(tmp_path: Path) -> None:
    _log(tmp_path, 40)
    newest = _segments(tmp_path)[-1]
    newest.unlink()
    with pytest.raises(CorruptionError, match=rf"{newest.name} is missing"):
        list(WriteAheadLog(tmp_path).replay())


def test_a_torn_record_is_ignored_and_a_torn_tail_still_cut(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A power cut tore the record itself: its CRC fails, replay warns and checks without it (the
    torn last entry of the newest segment is cut as before): never a refusal."""
    payloads = _log(tmp_path, 12, segment_bytes=1 << 20)
    mark = tmp_path / "DURABLE"
    data = bytearray(mark.read_bytes())
    data[len(data) // 2] ^= 0x01
    mark.write_bytes(bytes(data))
    (seg,) = _segments(tmp_path)
    seg.write_bytes(seg.read_bytes()[:-20])
    with caplog.at_level(logging.WARNING, logger="tracestore.server"):
        got = [p for _, _, p in WriteAheadLog(tmp_path).replay()]
    assert got == payloads[:-1]
    assert "not a valid record of durable bytes" in caplog.text


def test_a_record_naming_retired_segments_is_ignored(tmp_path: Path) -> None:
    """Segments deleted once committed, then a crash before the next record: it names segments
    older than the oldest present, which replay does not ask for."""
    payloads = _log(tmp_path, 40)
    segs = _segments(tmp_path)
    first = WriteAheadLog(tmp_path)
    kept = [p for _, _, p in first.replay()]
    first.close()
    gone = sum(len(_ends(p)) for p in segs[:2])
    for p in segs[:2]:
        p.unlink()
    assert sorted(read_marks(tmp_path))[0] == int(segs[0].name[4:16])
    assert [p for _, _, p in WriteAheadLog(tmp_path).replay()] == kept[gone:] == payloads[gone:]


def test_a_log_without_a_record_replays_as_before(tmp_path: Path) -> None:
    """An older sidecar's log (no DURABLE): segments are checked as they were before the record."""
    payloads = _log(tmp_path, 12, segment_bytes=1 << 20)
    (tmp_path / "DURABLE").unlink()
    (seg,) = _segments(tmp_path)
    seg.write_bytes(seg.read_bytes()[:-20])
    assert [p for _, _, p in WriteAheadLog(tmp_path).replay()] == payloads[:-1]
