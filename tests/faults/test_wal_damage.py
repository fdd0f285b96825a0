"""2. WAL damage. A WAL of several 1 MiB segments holding only acknowledged, uncommitted records
(storage never flushed: long flush interval) is damaged at the head / middle / tail of an old
segment and of the newest segment, or loses a middle segment: the sidecar must refuse to start
(non-zero exit, a message naming the segment and the byte offset) and change nothing in the WAL
directory. A torn tail (bytes a crash cut short at the very end of the newest segment, never
acknowledged) is repaired and the start proceeds, every acknowledged record intact.

A segment cut or zeroed below what the sidecar had durably written (``DURABLE`` in the WAL
directory records it after every fdatasync), or a newest segment gone as a whole, is refused the
same way: those bytes held acknowledged records, so a silent cut would lose them. An entry whose
checksum holds but whose contents do not decode is refused naming its segment and byte offset.
"""

from __future__ import annotations

import re
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from .harness import (
    Rec,
    Row,
    Sidecar,
    StartError,
    Writer,
    row,
    verify,
    wal_data_request,
    wal_entries,
    wal_segments,
)

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
        # a crash before this entry's fdatasync: the record of what was durable could not cover it
        _rewind_mark(wal, seg.name, last_off)
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


# -- DURABLE: what the sidecar had durably written ----------------------------------------------
# (the format server/wal/mark.py writes: a title line, one "<segment file> <bytes>" line per
# segment, "crc32 <8 hex digits>" over the lines before it, newline padding)


def _mark(wal: Path) -> dict[str, int] | None:
    """{segment file name: bytes durably written} from ``wal/DURABLE``; None without one."""
    path = wal / "DURABLE"
    if not path.exists():
        return None
    data = path.read_bytes()
    at = data.index(b"\ncrc32 ") + 1
    body, crc = data[:at], int(data[at + 6 : at + 14], 16)
    assert zlib.crc32(body) == crc, "DURABLE fails its checksum"
    return {name: int(n) for name, n in (line.split() for line in body.decode().splitlines()[1:])}


def _rewind_mark(wal: Path, name: str, size: int) -> None:
    """Make ``DURABLE`` say at most ``size`` bytes of ``name`` were durable (what a crash before the
    fdatasync of the bytes after them leaves); nothing to do for a sidecar that writes none."""
    marks = _mark(wal)
    if marks is None:
        return
    marks[name] = min(marks.get(name, size), size)
    body = "tracestore write-ahead log: bytes of each segment made durable (fdatasync returned)\n"
    body += "".join(f"{k} {v}\n" for k, v in sorted(marks.items()))
    data = body.encode() + f"crc32 {zlib.crc32(body.encode()):08x}\n".encode()
    (wal / "DURABLE").write_bytes(data)


def _refused(seg: Path, offsets: tuple[int, ...], tmp_path: Path, r: Row) -> None:
    """Start a sidecar on ``tmp_path``'s WAL: it must exit non-zero, leave every WAL file as it was
    and name ``seg`` with one of ``offsets`` (byte offsets) and a way out for the operator."""
    sc = Sidecar(tmp_path, flags=FLAGS)
    before = sc.wal_files()
    rc, log = sc.start_expect_exit(timeout=30)
    after = sc.wal_files()
    if rc is None and sc.alive():
        sc.terminate(30)
    sc.kill()
    changed = sorted(k for k in before if before[k] != after.get(k))
    named = seg.name in log and any(re.search(rf"\b{o}\b", log) for o in offsets)
    advice = "restore" in log.lower() and "aside" in log.lower()
    if rc is None:
        r.add_note("started on a WAL that lost acknowledged entries")
    elif rc == 0:
        r.add_note("exit code 0")
    if changed:
        r.add_note(f"WAL files changed: {changed}")
    if rc not in (None, 0) and not (named and advice):
        r.add_note(f"message does not name {seg.name} at byte {offsets[0]} with a way out: {log.strip()[-200:]}")
    assert rc is not None, f"the sidecar started on a WAL that lost acknowledged entries of {seg.name}:\n{log[-1500:]}"
    assert rc != 0, log[-1500:]
    assert not changed, f"the refused start changed WAL files {changed}"
    assert named, f"the refusal does not name {seg.name} and byte {offsets}:\n{log[-1500:]}"
    assert advice, f"the refusal does not say what the operator can do:\n{log[-1500:]}"
    assert "resend" not in log, f"a message written for network clients:\n{log[-1500:]}"


LOST = [
    ("newest", "truncated-mid-entry"),
    ("newest", "truncated-at-entry"),
    ("newest", "zeroed-from-entry"),
    ("older", "truncated-at-entry"),
    ("older", "zeroed-from-entry"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("segment", "how"), LOST, ids=[f"{s}-{h}" for s, h in LOST])
def test_acknowledged_tail_cut_by_damage_refuses_to_start(segment: str, how: str, template, tmp_path: Path) -> None:
    """File-system damage cut a segment mid-file (its size shrank, or blocks read back as zeros):
    the entries from there on were fsynced and acknowledged. Not a torn tail: refused."""
    r = row(f"2 wal {segment} segment {how}")
    r.trials, r.acked = 1, len(template[1])
    wal = _copy(template, tmp_path)
    segs = wal_segments(wal)
    seg = segs[-1] if segment == "newest" else segs[-2]
    entries = wal_entries(seg)
    assert len(entries) >= 4, (seg.name, entries)
    at = entries[len(entries) // 2][0]  # half the segment's entries survive
    data = seg.read_bytes()
    if how == "truncated-mid-entry":
        data = data[: at + entries[len(entries) // 2][1] // 2]
    elif how == "truncated-at-entry":
        data = data[:at]
    else:
        data = data[:at] + bytes(len(data) - at)
    seg.write_bytes(data)
    _refused(seg, (at,), tmp_path, r)


@pytest.mark.timeout(60)
def test_newest_segment_gone_refuses_to_start(template, tmp_path: Path) -> None:
    """The newest segment vanished as a whole (no gap between the others shows it): refused."""
    r = row("2 wal newest segment gone")
    r.trials, r.acked = 1, len(template[1])
    wal = _copy(template, tmp_path)
    gone = wal_segments(wal)[-1]
    size = len(gone.read_bytes().rstrip(b"\0"))
    gone.unlink()
    _refused(gone, (size, 0), tmp_path, r)


def _rewrite_entry(seg: Path, offset: int, payload: bytes) -> None:
    """Replace the entry at ``offset`` with one of the same type holding ``payload``, with a valid CRC."""
    data = seg.read_bytes()
    length, _, kind = struct.unpack_from("<IIB", data, offset)
    entry = struct.pack("<IIB", len(payload), zlib.crc32(payload, zlib.crc32(bytes([kind]))), kind) + payload
    seg.write_bytes(data[:offset] + entry + data[offset + 9 + length :])


UNDECODABLE = ["chunk-checksum", "request", "state"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", UNDECODABLE)
def test_checksum_valid_entry_that_does_not_decode_names_its_segment(what: str, template, tmp_path: Path) -> None:
    """An entry whose CRC holds but whose contents do not decode (bytes changed before the entry's
    CRC was computed, or a bug): refused naming the segment file and the entry's byte offset, with
    what the operator can do, not with advice for a network client ("resend")."""
    r = row(f"2 wal CRC-valid entry, {what} undecodable")
    r.trials, r.acked = 1, len(template[1])
    wal = _copy(template, tmp_path)
    seg = wal_segments(wal)[-2]
    entries = wal_entries(seg)
    if what == "state":
        off, total, kind = entries[0]
        assert kind == 2, entries[:2]  # STATE heads every segment
        _rewrite_entry(seg, off, b"{" * (total - 9))
    else:
        off, total, _ = next(e for e in entries[len(entries) // 2 :] if e[2] == 1)  # a DATA entry
        if what == "chunk-checksum":  # the last record's own checksum does not match its bytes
            req = wal_data_request(seg, off)
            req.chunks[-1].checksum = 0x12345678
            raw = req.SerializeToString()
            _rewrite_entry(seg, off, struct.pack("<I", len(raw)) + raw)
        else:  # not a WriteRequest at all
            _rewrite_entry(seg, off, struct.pack("<I", total - 13) + b"\xff" * (total - 13))
    _refused(seg, (off,), tmp_path, r)
