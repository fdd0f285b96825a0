"""Entries larger than the write-ahead log's buffers (server/wal/stream.py): copied through the
buffers, which keep their size; a shared-memory part that changed while it was copied rewinds the
log, and a crash after that leaves a log that replays exactly the entries appended."""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
from tracestore.server.wal.log import Checked, WriteAheadLog

from tracestore.errors import CorruptionError

BUFFER = 16 << 10  # four 4 KiB blocks: an entry of 100 KiB goes through the buffers in pieces


def _open(directory: Path) -> WriteAheadLog:
    wal = WriteAheadLog(directory, segment_bytes=1 << 20, buffer_bytes=BUFFER)
    list(wal.replay())
    wal.start()
    if not wal.direct:
        wal.close()
        pytest.skip(f"{directory} refuses O_DIRECT: entries go to the page cache, not through buffers")
    return wal


def _replay(directory: Path) -> list[tuple[int, bytes]]:
    return [(kind, payload) for _, kind, payload in WriteAheadLog(directory).replay()]


def _crash_copy(src: Path, dst: Path) -> Path:
    """The log's files as a crash now would leave them (the sidecar's process gone, its fsynced
    writes on disk): copied while the log is open."""
    dst.mkdir()
    for p in src.iterdir():
        if p.name != "LOCK":
            shutil.copyfile(p, dst / p.name)
    return dst


def test_large_entries_go_through_buffers_that_keep_their_size(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    big = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (BUFFER, 5 * BUFFER + 17, 100_000)]
    wal = _open(tmp_path / "wal")
    wal.append(1, [b"before"])
    for i, b in enumerate(big):
        wal.append(2, [b[:100], Checked(b[100:], zlib.crc32(b[100:]), verify=i == 2)])
        _, ticket = wal.append(3, [b"small %d" % i])
    assert wal.wait_synced(ticket, timeout=10)
    assert [len(b) for b in wal._bufs] == [BUFFER, BUFFER]
    wal.close()
    want = [(1, b"before")] + [e for i, b in enumerate(big) for e in ((2, b), (3, b"small %d" % i))]
    assert _replay(tmp_path / "wal") == want


def test_a_changed_part_of_a_streamed_entry_leaves_a_log_that_replays_after_a_crash(tmp_path: Path) -> None:
    """The entry's first pieces are on disk when its last part's CRC is found wrong: the append
    raises CorruptionError, and what of it was written is cut off the file before the next
    entries are appended. Before, those bytes stayed after the next entries: a crash then left a
    newest segment with a complete-looking bad entry after its last one, and the sidecar refused
    to start ("corrupt at byte ...")."""
    payload = np.random.default_rng(2).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    d = tmp_path / "wal"
    wal = _open(d)
    wal.append(1, [b"before"])
    with pytest.raises(CorruptionError, match="changed while the sidecar received it"):
        wal.append(2, [b"head", Checked(payload, zlib.crc32(payload) ^ 1, verify=True)])
    _, ticket = wal.append(3, [b"after"])
    assert wal.wait_synced(ticket, timeout=10)
    crashed = _crash_copy(d, tmp_path / "crashed")
    assert _replay(crashed) == [(1, b"before"), (3, b"after")]
    # the log goes on, a streamed entry included, and closes whole
    _, ticket = wal.append(2, [b"head", Checked(payload, zlib.crc32(payload), verify=True)])
    assert wal.wait_synced(ticket, timeout=10)
    assert _replay(_crash_copy(d, tmp_path / "crashed-2")) == [(1, b"before"), (3, b"after"), (2, b"head" + payload)]
    wal.close()
    assert _replay(d) == [(1, b"before"), (3, b"after"), (2, b"head" + payload)]
