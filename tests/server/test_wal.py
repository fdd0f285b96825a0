"""Write-ahead log: appends survive reopen, torn tails are cut, real corruption is refused, segments retire."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from tracestore.server.wal import HEADER, WriteAheadLog

from tracestore.errors import CorruptionError


def _entries(wal: WriteAheadLog) -> list[tuple[int, bytes]]:
    return [(kind, payload) for _, kind, payload in wal.replay()]


def test_append_replay_and_group_commit(tmp_path: Path) -> None:
    synced: list[int] = []
    wal = WriteAheadLog(tmp_path, segment_bytes=4096, on_synced=synced.append)
    list(wal.replay())
    wal.start()
    written = []
    for i in range(50):
        payload = os.urandom(i * 37 % 500)
        _, ticket = wal.append(1 + i % 3, [payload[:10], payload[10:]])
        written.append((1 + i % 3, payload))
    assert wal.wait_synced(ticket, timeout=10)
    assert synced and synced[-1] == 50 and synced == sorted(synced)
    wal.close()
    assert len(list(tmp_path.glob("wal-*.log"))) > 1  # rotated at 4 KiB
    again = WriteAheadLog(tmp_path)
    assert _entries(again) == written


def test_concurrent_appends_are_all_replayed(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path, segment_bytes=1 << 14)
    list(wal.replay())
    wal.start()

    def worker(k: int) -> None:
        for i in range(100):
            wal.append(1, [f"{k}:{i}".encode()])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wal.close()
    got = sorted(p.decode() for _, p in _entries(WriteAheadLog(tmp_path)))
    assert got == sorted(f"{k}:{i}" for k in range(4) for i in range(100))


@pytest.mark.parametrize("cut", [1, HEADER.size - 1, HEADER.size + 3])
def test_torn_tail_is_truncated(tmp_path: Path, cut: int) -> None:
    wal = WriteAheadLog(tmp_path)
    list(wal.replay())
    wal.start()
    wal.append(1, [b"first"])
    wal.append(1, [b"second-entry"])
    wal.close()
    (seg,) = tmp_path.glob("wal-*.log")
    size = seg.stat().st_size
    last = HEADER.size + len(b"second-entry")
    with open(seg, "r+b") as f:
        f.truncate(size - last + cut)
    assert _entries(WriteAheadLog(tmp_path)) == [(1, b"first")]
    assert seg.stat().st_size == size - last  # cut back to the last whole entry


def test_corruption_in_an_older_segment_is_refused(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path, segment_bytes=64)
    list(wal.replay())
    wal.start()
    for i in range(6):
        wal.append(1, [bytes([i]) * 60])
    wal.close()
    first = sorted(tmp_path.glob("wal-*.log"))[0]
    data = bytearray(first.read_bytes())
    data[HEADER.size + 5] ^= 0xFF
    first.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="corrupt"):
        list(WriteAheadLog(tmp_path).replay())


def test_flipped_byte_in_the_newest_segment_drops_only_the_tail(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path)
    list(wal.replay())
    wal.start()
    for i in range(3):
        wal.append(1, [bytes([i]) * 10])
    wal.close()
    (seg,) = tmp_path.glob("wal-*.log")
    data = bytearray(seg.read_bytes())
    data[-3] ^= 0x01
    seg.write_bytes(bytes(data))
    assert _entries(WriteAheadLog(tmp_path)) == [(1, b"\0" * 10), (1, b"\1" * 10)]


def test_delete_before_keeps_the_active_segment(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path, segment_bytes=64)
    list(wal.replay())
    wal.start()
    for _ in range(5):
        wal.append(1, [b"x" * 60])
    active = wal.active_index
    freed = wal.delete_before(active + 100)
    assert freed > 0
    assert [p.name for p in tmp_path.glob("wal-*.log")] == [f"wal-{active:012d}.log"]
    wal.append(1, [b"after"])
    wal.close()
    assert _entries(WriteAheadLog(tmp_path))[-1] == (1, b"after")
