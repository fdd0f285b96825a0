"""Write-ahead log: appends survive reopen, torn tails are cut, real corruption is refused, segments retire."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from tracestore.server.wal.log import HEADER, WriteAheadLog

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
    wal.close()  # on_synced runs on its own thread: joined here
    assert synced and synced[-1] == 50 and synced == sorted(synced)
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


@pytest.mark.parametrize("direct", [True, False])
def test_group_writes_across_rotations(tmp_path: Path, direct: bool) -> None:
    """Entries from several threads, larger and smaller than the write buffer, across rotations
    and many group writes (O_DIRECT where the file system takes it): all replayed, in order per
    thread, and every closed segment ends at its last entry (no padding left)."""
    synced: list[int] = []
    wal = WriteAheadLog(tmp_path, segment_bytes=96 << 10, buffer_bytes=8 << 10, direct=direct,
                        on_synced=synced.append)  # fmt: skip
    list(wal.replay())
    wal.start()
    sizes = [0, 1, 4095, 4096, 4097, 20000, 9, 70000, 333]

    def worker(k: int) -> None:
        for i in range(60):
            n = sizes[(i + k) % len(sizes)]
            wal.append(1 + k, [f"{k}:{i}:".encode(), bytes([i % 251]) * n])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wal.wait_synced(180, timeout=30)
    wal.close()
    assert synced[-1] == 180
    got: dict[int, list[bytes]] = {}
    for kind, payload in _entries(WriteAheadLog(tmp_path)):
        got.setdefault(kind, []).append(payload)
    for k in range(3):
        want = [f"{k}:{i}:".encode() + bytes([i % 251]) * sizes[(i + k) % len(sizes)] for i in range(60)]
        assert got[1 + k] == want
    segs = sorted(tmp_path.glob("wal-*.log"))
    assert len(segs) > 3
    for seg in segs:
        data = seg.read_bytes()
        pos = 0
        while pos < len(data):
            length = HEADER.unpack_from(data, pos)[0]
            pos += HEADER.size + length
        assert pos == len(data), seg.name


@pytest.mark.parametrize("cut", [1, HEADER.size - 1, HEADER.size + 3])
def test_torn_tail_is_truncated(tmp_path: Path, cut: int) -> None:
    """A crash tore the last entry before its fdatasync returned: DURABLE, as the crash left it,
    does not cover it, so replay cuts it."""
    wal = WriteAheadLog(tmp_path)
    list(wal.replay())
    wal.start()
    assert wal.wait_synced(wal.append(1, [b"first"])[1], 10)
    durable = (tmp_path / "DURABLE").read_bytes()  # what it said before the second entry's sync
    wal.append(1, [b"second-entry"])
    wal.close()
    (tmp_path / "DURABLE").write_bytes(durable)
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


def test_flipped_byte_in_the_newest_segments_last_entry_is_refused(tmp_path: Path) -> None:
    """A complete last entry with a wrong checksum was written (and perhaps acknowledged): not a torn
    tail (a torn write leaves an entry short or zero-filled from a sector on), so replay refuses and
    the file keeps every byte."""
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
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        _entries(WriteAheadLog(tmp_path))
    assert seg.read_bytes() == bytes(data)


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


def test_rotate_then_close_keeps_everything(tmp_path: Path) -> None:
    """The engine's clean shutdown: rotate (the old segment's buffer is written by the sync thread
    or by close) and close at once."""
    wal = WriteAheadLog(tmp_path, segment_header=lambda: [(2, b"snapshot")])
    list(wal.replay())
    wal.start()
    for i in range(5):
        wal.append(1, [bytes([i]) * 5000])
    wal.rotate()
    wal.append(1, [b"after"])
    wal.close()
    got = _entries(WriteAheadLog(tmp_path))
    assert got == [(2, b"snapshot"), *((1, bytes([i]) * 5000) for i in range(5)), (2, b"snapshot"), (1, b"after")]


def test_append_waiting_for_room_under_the_callers_lock(tmp_path: Path) -> None:
    """The engine appends holding its lock, and its on_synced takes that lock: an append that
    waits for the sync thread to free buffer space must not deadlock with the callback."""
    lock = threading.Lock()
    got: list[int] = []

    def on_synced(ticket: int) -> None:
        with lock:
            got.append(ticket)

    wal = WriteAheadLog(tmp_path, buffer_bytes=8192, on_synced=on_synced)
    list(wal.replay())
    wal.start()

    def worker() -> None:
        for _ in range(200):
            with lock:
                wal.append(1, [os.urandom(6000)])

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "append deadlocked with on_synced"
    wal.close()
    assert got[-1] == 200


def test_checked_parts_are_combined_not_reread(tmp_path: Path) -> None:
    """A Checked part's CRC (computed by the caller, as the sidecar does at receipt) is combined
    into the entry's CRC: the entry replays intact, byte for byte. A wrong one is not trusted
    silently: the entry then fails its checksum on replay (refused in an older segment)."""
    import zlib

    from tracestore.server.wal.log import Checked

    a, b = os.urandom(300_000), os.urandom(70_000)
    wal = WriteAheadLog(tmp_path, segment_bytes=1 << 20)
    list(wal.replay())
    wal.start()
    wal.append(1, [b"head", Checked(a, zlib.crc32(a)), memoryview(b)[:100], Checked(b[100:], zlib.crc32(b[100:]))])
    wal.append(2, [Checked(memoryview(a)[:0], 0), b"tail"])
    wal.close()
    assert _entries(WriteAheadLog(tmp_path)) == [(1, b"head" + a + b), (2, b"tail")]

    bad = tmp_path / "bad"
    wal = WriteAheadLog(bad, segment_bytes=4096)
    list(wal.replay())
    wal.start()
    wal.append(1, [Checked(a[:1000], zlib.crc32(a[:1000]) ^ 1)])  # a caller's wrong CRC
    wal.append(1, [os.urandom(5000)])  # rotates: the bad entry is now in an older segment
    wal.append(1, [b"newest"])
    wal.close()
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        _entries(WriteAheadLog(bad))


def test_a_shared_memory_part_that_changed_is_refused_and_the_log_stays_whole(tmp_path: Path) -> None:
    """A Checked part marked ``verify`` (a writer's shared memory, which it could overwrite after
    the sidecar checksummed it) is checked again once copied: if it no longer matches, the append
    raises CorruptionError and appends nothing, so the log still replays (before and after it)."""
    import zlib

    from tracestore.server.wal.log import Checked

    a = bytearray(os.urandom(200_000))
    wal = WriteAheadLog(tmp_path, segment_bytes=1 << 20)
    list(wal.replay())
    wal.start()
    wal.append(1, [b"before"])
    crc = zlib.crc32(a)
    a[1234] ^= 0xFF  # the writer scribbled on its region after the sidecar's CRC
    if wal.direct:
        with pytest.raises(CorruptionError, match="changed while the sidecar received it"):
            wal.append(1, [b"head", Checked(memoryview(a), crc, verify=True)])
    else:  # (page-cache mode, e.g. tmpfs: the CRC is taken over the bytes as written instead)
        wal.append(1, [b"head", Checked(memoryview(a), crc, verify=True)])
    wal.append(2, [b"after", Checked(bytes(a), zlib.crc32(a), verify=True)])
    wal.close()
    got = _entries(WriteAheadLog(tmp_path))
    assert got[0] == (1, b"before") and got[-1] == (2, b"after" + bytes(a))
    assert len(got) == (2 if wal.direct else 3)


def test_the_log_is_the_sidecars_alone(tmp_path: Path) -> None:
    """Segments hold every writer's records, those staged in 0600 or 0640 shared memory too. Before,
    the directory was made with the umask (0755) and segments 0644: any local user read the records
    the socket and pool modes kept from them."""
    import stat

    d = tmp_path / "new" / "wal"
    wal = WriteAheadLog(d, segment_bytes=4096, direct=False)
    list(wal.replay())
    wal.start()
    for _ in range(20):
        _, ticket = wal.append(1, [os.urandom(300)])
    assert wal.wait_synced(ticket, timeout=10)
    wal.close()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    segments = list(d.glob("wal-*.log"))
    assert len(segments) > 1 and {stat.S_IMODE(p.stat().st_mode) for p in segments} == {0o600}
    open_dir = tmp_path / "open"  # made before, with the umask
    open_dir.mkdir()
    open_dir.chmod(0o755)
    list(WriteAheadLog(open_dir).replay())
    assert stat.S_IMODE(open_dir.stat().st_mode) == 0o700


def test_a_lock_file_that_cannot_be_opened_is_a_clear_error(tmp_path: Path) -> None:
    """Before: a symlink (ELOOP) or an unwritable file in LOCK's place was a traceback at start."""
    from tracestore.server.wal.files import lock_directory

    from tracestore.errors import ConfigError

    (tmp_path / "elsewhere").write_text("")
    (tmp_path / "LOCK").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=r"cannot open the write-ahead log's lock file .*LOCK"):
        lock_directory(tmp_path)
