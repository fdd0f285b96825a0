"""2. WAL damage. A WAL of several 1 MiB segments holding only acknowledged, uncommitted records
(storage never flushed: long flush interval) is damaged at the head / middle / tail of an old
segment and of the newest segment, or loses a middle segment: the sidecar must refuse to start
(non-zero exit, a message naming the segment and the byte offset) and change nothing in the WAL
directory. A torn tail (bytes a crash cut short at the very end of the newest segment, never
acknowledged) is repaired and the start proceeds, every acknowledged record intact.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from .harness import Rec, Sidecar, StartError, Writer, row, verify, wal_data_request, wal_entries, wal_segments

FLAGS = ["--wal-segment-mib", "1", "--flush-interval", "3600", "--shard-target-mib", "64", "--grace", "10"]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Rec]]:
    """A sidecar's WAL (4+ segments of acknowledged records) and empty storage, after a SIGKILL."""
    base = tmp_path_factory.mktemp("waltemplate")
    sc = Sidecar(base, flags=FLAGS)
    w = Writer("dmg-w", trajs=4, tokens=256, window=8)
    try:
        sc.start()
        res = w.session(sc.address, max_new=60, timeout=60)
        assert res.code is None and not w.unacked, (res, sc.log()[-2000:])
    finally:
        sc.kill()
    segs = wal_segments(base / "wal")
    assert len(segs) >= 4, [p.name for p in segs]
    return base, w.acked_recs


def _copy(template: tuple[Path, list[Rec]], dest: Path) -> Path:
    shutil.copytree(template[0] / "wal", dest / "wal")
    if (template[0] / "data").exists():
        shutil.copytree(template[0] / "data", dest / "data")
    return dest / "wal"


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


DAMAGE = [
    ("old", "head"),
    ("old", "middle"),
    ("old", "tail"),
    ("newest", "head"),
    ("newest", "middle"),
    ("newest", "tail"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("segment", "where"), DAMAGE, ids=[f"{s}-{w}" for s, w in DAMAGE])
def test_damaged_segment_refuses_to_start(segment: str, where: str, template, tmp_path: Path) -> None:
    r = row(f"2 wal damage {segment} segment {where}")
    r.trials, r.acked = 1, len(template[1])
    wal = _copy(template, tmp_path)
    segs = wal_segments(wal)
    seg = segs[0] if segment == "old" else segs[-1]
    entries = wal_entries(seg)
    assert len(entries) >= 3, (seg.name, entries)
    if where == "head":
        entry = entries[0]
        at = entry[0] + 4  # the first entry's CRC field
    else:
        entry = entries[len(entries) // 2] if where == "middle" else entries[-1]
        at = entry[0] + entry[1] // 2  # a payload byte inside the entry
    _flip(seg, at)
    sc = Sidecar(tmp_path, flags=FLAGS)
    before = sc.wal_files()
    rc, log = sc.start_expect_exit(timeout=30)
    after = sc.wal_files()  # (files that existed before: a started sidecar adds its own new segment)
    if rc is None and sc.alive():  # it started: drain it and count what the damaged WAL lost
        sc.terminate(30)
        chk = verify(sc.storage, template[1])
        r.lost, r.duplicated = chk.lost_total, chk.duplicated
    sc.kill()
    names_offset = seg.name in log and (re.search(rf"\b{entry[0]}\b", log) or re.search(rf"\b{at}\b", log))
    changed = sorted(k for k in before if before[k] != after.get(k))
    if rc is None:
        r.add_note("started on a damaged WAL")
    elif rc == 0:
        r.add_note("exit code 0")
    if changed:
        r.add_note(f"WAL files changed: {changed}")
    if rc not in (None, 0) and not names_offset:
        r.add_note(f"message does not name {seg.name} and byte {entry[0]}: {log.strip()[-200:]}")
    assert rc is not None, f"the sidecar started on a WAL damaged at {seg.name} byte {at}:\n{log[-1500:]}"
    assert rc != 0, log[-1500:]
    assert not changed, f"the refused start changed WAL files {changed}"
    assert names_offset, f"the refusal does not name {seg.name} and byte offset {entry[0]} (or {at}):\n{log[-1500:]}"


@pytest.mark.timeout(60)
def test_missing_middle_segment_refuses_to_start(template, tmp_path: Path) -> None:
    r = row("2 wal missing middle segment")
    r.trials, r.acked = 1, len(template[1])
    wal = _copy(template, tmp_path)
    segs = wal_segments(wal)
    gone = segs[len(segs) // 2]
    gone.unlink()
    index = int(re.search(r"(\d+)", gone.name).group(1))  # type: ignore[union-attr]
    sc = Sidecar(tmp_path, flags=FLAGS)
    before = sc.wal_files()
    rc, log = sc.start_expect_exit(timeout=30)
    sc.kill()
    after = sc.wal_files()
    named = gone.name in log or re.search(rf"segment\(?s?\)?\s+{index}\b", log) is not None
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if rc is None or rc == 0:
        r.add_note(f"started without {gone.name}")
    if changed:
        r.add_note(f"WAL files changed: {changed}")
    if rc not in (None, 0) and not named:
        r.add_note(f"message does not name the missing segment: {log.strip()[-200:]}")
    assert rc not in (None, 0), f"the sidecar started with {gone.name} missing:\n{log[-1500:]}"
    assert not changed, f"the refused start changed WAL files {changed}"
    assert named, f"the refusal does not name the missing segment {gone.name}:\n{log[-1500:]}"


TORN = ["partial-entry-appended", "last-entry-truncated", "zeroed-last-block"]


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", TORN)
def test_torn_tail_is_repaired(how: str, template, tmp_path: Path) -> None:
    """Bytes a crash cut short at the end of the newest segment: the start repairs them and proceeds."""
    r = row(f"2 wal torn tail ({how})")
    r.trials = 1
    wal = _copy(template, tmp_path)
    seg = wal_segments(wal)[-1]
    entries = wal_entries(seg)
    data = seg.read_bytes()[: entries[-1][0] + entries[-1][1]]  # (drop any zero padding)
    expected = list(template[1])
    if how == "partial-entry-appended":
        # an append that never completed: a header promising 64 KiB, 1000 bytes of it
        import struct

        data += struct.pack("<IIB", 65536, 0x12345678, 1) + bytes(range(256)) * 4
    else:
        last_off, last_len, _ = entries[-1]
        req = wal_data_request(seg, last_off)  # this message becomes "never acknowledged"
        torn = {(c.trajectory, c.site) for c in req.chunks}
        expected = [x for x in expected if (x.trajectory, x.site) not in torn]
        if how == "last-entry-truncated":
            data = data[: last_off + last_len // 2]
        else:  # the last entry's bytes from a 4 KiB block boundary on never reached the disk
            cut = max(last_off + 9, (last_off + last_len // 2) // 4096 * 4096)
            data = data[:cut] + bytes(last_off + last_len - cut)
    seg.write_bytes(data)
    r.acked = len(expected)
    sc = Sidecar(tmp_path, flags=FLAGS)
    try:
        sc.start(timeout=30)
    except StartError as exc:
        r.add_note(f"refused to start: {exc.log.strip()[-160:]}")
        raise
    rc = sc.terminate(30)  # the drain commits everything replayed
    chk = verify(sc.storage, expected)
    r.lost, r.duplicated = chk.lost_total, chk.duplicated
    if rc != 0:
        r.add_note(f"SIGTERM exit code {rc}")
    if not chk.ok():
        r.add_note(str(chk)[:160])
    assert rc == 0, sc.log()[-1500:]
    assert chk.ok(), chk
