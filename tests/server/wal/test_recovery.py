"""Regression tests for the WAL and engine defects the black-box fault suite found.

- a crash right after a shard commit wedged the sidecar for good (segments deleted before the
  commit's DONE entry was durable);
- one ENOSPC/EIO on the WAL stopped every write until a manual restart, health stayed SERVING;
- replay treated any bad entry of the newest segment as a torn tail (dropping acknowledged
  entries after it), and did not notice a missing segment;
- a second sidecar on one WAL directory deleted the first one's live segment;
- one chunk with policy version 2**62 wiped the dedupe/conflict state of the run's real versions.

Device errors are injected at the system-call boundary of the WAL module (``os.fdatasync`` and
``os.pwrite`` raising ENOSPC while a switch is on): the engine, the WAL and the store are the real
ones. The crash test runs ``tracestore serve`` as a separate process and kills it with SIGKILL at
a named crash point (``TRACESTORE_FAULT``).
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from tracestore.client import RolloutRecorder, SiteOutput
from tracestore.server.engine.core import Engine
from tracestore.server.rpc.ingest import parse_write
from tracestore.server.testing import SPEC, ServeProcess, make_chunk, start_engine, submit_request, write_request
from tracestore.server.wal import log as wal_mod
from tracestore.server.wal.log import HEADER, WriteAheadLog

from tracestore.errors import ConfigError, ConflictError, CorruptionError, LimitError, StorageError
from tracestore.plan import MicrobatchPlan
from tracestore.records import RunSpec
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store

SITE = SPEC.site("layers.1.mlp.input")


def _engine(url: str, wal: Path | None, **kw: object) -> Engine:
    return start_engine(url, wal, **kw)  # type: ignore[no-any-return]


def _submit(eng: Engine, req: object) -> tuple[object, bool]:
    return submit_request(eng, req)  # type: ignore[arg-type]


def _until(what: str, fn: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not fn():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class DiskFull:
    """While on, the WAL module's fdatasync and pwrite fail with ENOSPC (a full device)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on = False
        real_sync, real_pwrite = os.fdatasync, os.pwrite

        def fdatasync(fd: int) -> None:
            if self.on:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            real_sync(fd)

        def pwrite(fd: int, data: object, offset: int) -> int:
            if self.on:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

        class _Os:
            def __getattr__(self, name: str) -> object:
                return getattr(os, name)

        fake = _Os()
        fake.fdatasync = fdatasync  # type: ignore[attr-defined]
        fake.pwrite = pwrite  # type: ignore[attr-defined]
        monkeypatch.setattr(wal_mod, "os", fake)


# -- a failed WAL recovers by itself ---------------------------------------------------------------


def test_wal_disk_full_degrades_then_recovers_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path / 'data'}"
    disk = DiskFull(monkeypatch)
    eng = _engine(url, tmp_path / "wal", flush_interval_s=3600, wal_retry_s=0.2)
    try:
        st, _ = _submit(eng, write_request(1, [make_chunk("t1", 0, 4, seed=1)]))
        _until("message 1 durable", lambda: eng.durable(st)[1] == 1)  # type: ignore[arg-type]
        assert eng.degraded() == []
        disk.on = True
        _submit(eng, write_request(2, [make_chunk("t2", 0, 4, seed=2)]))  # accepted, never synced
        _until("the WAL failure to be reported", lambda: eng.degraded() == ["wal_failed"])
        with pytest.raises(StorageError, match="write-ahead log"):
            _submit(eng, write_request(3, [make_chunk("t3", 0, 4, seed=3)]))
        assert eng.durable(st)[1] == 1  # type: ignore[arg-type]  # message 2 is not acknowledged
        assert not eng.flush(0.5)  # the flusher cannot plan a shard on a failed WAL ...
        assert eng._flusher is not None and eng._flusher.is_alive()  # ... and survives that
        disk.on = False  # space is back
        _until("recovery", lambda: eng.degraded() == [])
        _until("message 2 durable after recovery", lambda: eng.durable(st)[1] == 2)  # type: ignore[arg-type]
        _submit(eng, write_request(3, [make_chunk("t3", 0, 4, seed=3)]))
        _until("message 3 durable", lambda: eng.durable(st)[1] == 3)  # type: ignore[arg-type]
        eng._stopped = True  # crash: nothing was committed to storage (flush interval 1 h)
        assert eng.wal is not None
        eng.wal.close()
    finally:
        eng.close()
    eng2 = _engine(url, tmp_path / "wal", flush_interval_s=3600)
    try:
        assert eng2.durable(eng2.writers[(SPEC.run, "w0")])[1:] == (3, 3)
        assert eng2.flush(10)
        rows = StoreReader(eng2.store, SPEC.run).read(
            MicrobatchPlan([("t1", 0, 4), ("t2", 0, 4), ("t3", 0, 4)]), sites=[SITE.name]
        )[SITE.name]
        want = [make_chunk(f"t{i}", 0, 4, seed=i) for i in (1, 2, 3)]
        assert rows.valid.all()
        assert rows.codes.tobytes() == b"".join(c.codes.tobytes() for c in want)
        entries = [e for m in eng2.store.manifests(SPEC.run, 0) for e in m.chunks]
        assert len(entries) == 3  # no duplicates
    finally:
        eng2.close()


def test_wal_failure_during_commit_keeps_segments_until_done_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DONE entry of a commit is refused by a failed WAL: no segment may be retired until a
    recovered WAL holds it, and a crash in between replays to the same, converged state."""
    url = f"file://{tmp_path / 'data'}"
    disk = DiskFull(monkeypatch)
    eng = _engine(url, tmp_path / "wal", flush_interval_s=3600, wal_segment_bytes=4096, wal_retry_s=3600)
    try:
        st = None
        for i in range(1, 9):
            st, _ = _submit(eng, write_request(i, [make_chunk(f"t{i}", 0, 64, seed=i)]))
        _until("all durable", lambda: eng.durable(st)[1] == 8)  # type: ignore[arg-type]
        segments = sorted(p.name for p in (tmp_path / "wal").glob("wal-*.log"))
        assert len(segments) >= 2
        # the PLAN is durable before the shard is written; make the WAL fail right after it
        orig = eng.store.write_shard

        def write_then_fail(*a: object, **k: object) -> object:
            out = orig(*a, **k)
            disk.on = True
            return out

        eng.store.write_shard = write_then_fail  # type: ignore[method-assign]
        eng.flush(2)
        _until("the WAL failure", lambda: "wal_failed" in eng.degraded())
        time.sleep(0.3)
        # committed to storage, DONE refused: the old segments must all still be there
        assert sorted(p.name for p in (tmp_path / "wal").glob("wal-*.log"))[: len(segments)] == segments
        eng._stopped = True
        assert eng.wal is not None
        eng.wal.close()
    finally:
        eng.close()
    disk.on = False
    eng2 = _engine(url, tmp_path / "wal", flush_interval_s=0.05)
    try:
        assert eng2.flush(10)
        assert eng2.degraded() == []
        entries = [e for m in eng2.store.manifests(SPEC.run, 0) for e in m.chunks]
        assert sorted(e.trajectory for e in entries) == sorted(f"t{i}" for i in range(1, 9))
    finally:
        eng2.close()


# -- a crash right after a shard commit ------------------------------------------------------------


def _workload(rec: RolloutRecorder, sent: dict[str, bytes], stop: threading.Event) -> None:
    rng = np.random.default_rng(7)
    i = 0
    while not stop.is_set():
        trajs = [f"traj-{i}-{k}" for k in range(16)]
        codes = rng.integers(0, 256, (16 * 6, SITE.code_bytes), dtype=np.uint8)
        scales = rng.integers(0, 256, (16 * 6, SITE.scale_bytes), dtype=np.uint8)
        if not rec.record_forward([(t, 0, 6) for t in trajs], {SITE.name: SiteOutput(codes, scales, 0.5)}):
            return
        for k, t in enumerate(trajs):
            sent[t] = codes[k * 6 : (k + 1) * 6].tobytes() + scales[k * 6 : (k + 1) * 6].tobytes()
        i += 1
        time.sleep(0.002)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 4])
def test_crash_right_after_segments_retire_does_not_wedge(tmp_path: Path, n: int) -> None:
    """SIGKILL right after a commit retired WAL segments (1 MiB segments, so PLANs span segments),
    restart: the sidecar converges (everything acknowledged is committed, no conflict loop) and
    every acknowledged record is readable once."""
    flags = ["--flush-interval", "0.2", "--wal-segment-mib", "1", "--shard-target-mib", "1"]
    sp = ServeProcess(tmp_path, flags=flags, env={"TRACESTORE_FAULT": f"commit.retired:{n}"}).start()
    rec = RolloutRecorder(sp.address, SPEC, "wedge-writer", staging_bytes=16 << 20, give_up_s=120, linger_s=0.0)
    sent: dict[str, bytes] = {}
    stop = threading.Event()
    worker = threading.Thread(target=_workload, args=(rec, sent, stop), daemon=True)
    worker.start()
    try:
        assert sp.proc is not None
        sp.proc.wait(timeout=90)  # it kills itself at the crash point
        sp.env = {}
        sp.proc = None
        sp.start()
        time.sleep(1.0)
    finally:
        stop.set()
        worker.join()
    assert rec.flush(60), rec.stats
    rec.close()
    assert sp.terminate(60) == 0, sp.log_tail()
    assert "conflict" not in sp.log_tail().lower(), sp.log_tail()
    # nothing left uncommitted in the WAL: a drained sidecar keeps only a fresh header segment
    assert all(p.stat().st_size < 64 << 10 for p in (tmp_path / "wal").glob("wal-*.log"))
    store = Store(sp.storage)
    trajs = sorted(sent)
    rows = StoreReader(store, SPEC.run).read(MicrobatchPlan([(t, 0, 6) for t in trajs]), sites=[SITE.name])[SITE.name]
    assert rows.valid.all()
    for j, t in enumerate(trajs):
        got = rows.codes[j * 6 : (j + 1) * 6].tobytes() + rows.scales[j * 6 : (j + 1) * 6].tobytes()
        assert got == sent[t], t
    keys = [(e.trajectory, e.token_start) for m in store.manifests(SPEC.run, 0) for e in m.chunks]
    assert len(keys) == len(set(keys)), "duplicate chunks in storage"


# -- replay: torn tail versus corruption -----------------------------------------------------------


def _log_with(tmp_path: Path, n: int, segment_bytes: int = 1 << 20, *, last_synced: bool = True) -> list[bytes]:
    """A closed log of ``n`` entries; with ``last_synced=False`` its DURABLE record is left as a crash
    before the last entry's fdatasync returned leaves it (not covering that entry)."""
    wal = WriteAheadLog(tmp_path, segment_bytes=segment_bytes)
    list(wal.replay())
    wal.start()
    payloads = [os.urandom(100 + i) for i in range(n)]
    durable, ticket = b"", 0
    for i, p in enumerate(payloads):
        if i == n - 1 and not last_synced:
            assert wal.wait_synced(ticket, 10)
            durable = (tmp_path / "DURABLE").read_bytes()
        _, ticket = wal.append(1, [p])
    wal.close()
    if durable:
        (tmp_path / "DURABLE").write_bytes(durable)
    return payloads


def _offset_of(path: Path, k: int) -> int:
    data = path.read_bytes()
    pos = 0
    for _ in range(k):
        pos += HEADER.size + HEADER.unpack_from(data, pos)[0]
    return pos


def _newest(tmp_path: Path) -> Path:
    return sorted(tmp_path.glob("wal-*.log"))[-1]


@pytest.mark.parametrize("where", ["payload", "length"])
def test_damage_in_the_middle_of_the_newest_segment_is_refused_not_truncated(tmp_path: Path, where: str) -> None:
    _log_with(tmp_path, 150)
    seg = _newest(tmp_path)
    size = seg.stat().st_size
    at = _offset_of(seg, 75) + (HEADER.size + 3 if where == "payload" else 1)
    data = bytearray(seg.read_bytes())
    data[at] ^= 0x5A
    seg.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match=rf"{seg.name}.* at byte {_offset_of(seg, 75)}"):
        list(WriteAheadLog(tmp_path).replay())
    assert seg.stat().st_size == size  # nothing acknowledged was cut away
    assert seg.read_bytes() == bytes(data)


@pytest.mark.parametrize("where", ["head", "middle", "tail"])
def test_damage_in_an_older_segment_is_refused(tmp_path: Path, where: str) -> None:
    _log_with(tmp_path, 120, segment_bytes=4096)
    old = sorted(tmp_path.glob("wal-*.log"))[0]
    data = bytearray(old.read_bytes())
    at = {"head": 2, "middle": len(data) // 2, "tail": len(data) - 1}[where]
    data[at] ^= 0xFF
    old.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match=old.name):
        list(WriteAheadLog(tmp_path).replay())
    assert old.read_bytes() == bytes(data)


def test_missing_middle_segment_is_refused(tmp_path: Path) -> None:
    _log_with(tmp_path, 120, segment_bytes=4096)
    segs = sorted(tmp_path.glob("wal-*.log"))
    assert len(segs) >= 3
    segs[1].unlink()
    with pytest.raises(CorruptionError, match="missing segment"):
        list(WriteAheadLog(tmp_path).replay())


@pytest.mark.parametrize("cut", ["inside_last_entry", "garbage_after"])
def test_a_torn_tail_is_cut_and_everything_before_it_replays(tmp_path: Path, cut: str) -> None:
    payloads = _log_with(tmp_path, 40, last_synced=cut != "inside_last_entry")
    seg = _newest(tmp_path)
    data = seg.read_bytes()
    if cut == "inside_last_entry":
        seg.write_bytes(data[: len(data) - 30])
        want = payloads[:-1]
    else:
        seg.write_bytes(data + HEADER.pack(500, 1234, 1) + b"\x07" * 100)  # a write cut short
        want = payloads
    wal = WriteAheadLog(tmp_path)
    assert [p for _, _, p in wal.replay()] == want
    assert seg.stat().st_size == _offset_of(seg, len(want))


def test_replay_refuses_a_sequence_gap_of_one_writer(tmp_path: Path, memory_url: str) -> None:
    """Entries of a writer jump from sequence 2 to 4 (the entry for 3 vanished as a whole, e.g. a
    segment restored from an older backup): refused instead of silently replayed."""
    eng = _engine(memory_url, tmp_path / "wal", flush_interval_s=3600)
    raws = [write_request(i, [make_chunk(f"t{i}", 0, 4, seed=i)]).SerializeToString() for i in (1, 2, 3, 4)]
    st = None
    for raw in raws:
        _, msg, parts = parse_write(raw, eng.run_spec, None)
        st, _ = eng.submit(msg, parts)
    _until("durable", lambda: eng.durable(st)[1] == 4)  # type: ignore[arg-type]
    eng._stopped = True
    assert eng.wal is not None
    eng.wal.close()
    eng.close()
    # rebuild the log without message 3 (valid entries throughout: only the gap check can see it)
    entries = [(k, p) for _, k, p in WriteAheadLog(tmp_path / "wal").replay()]
    shutil.rmtree(tmp_path / "wal")
    wal = WriteAheadLog(tmp_path / "wal")
    list(wal.replay())
    wal.start()
    for kind, payload in entries:
        if raws[2] not in payload:
            wal.append(kind, [payload])
    wal.close()
    with pytest.raises(CorruptionError, match=r"jumps from \(epoch 1, sequence 2\) to \(epoch 1, sequence 4\)"):
        _engine(memory_url, tmp_path / "wal")


# -- one WAL directory, one sidecar ---------------------------------------------------------------


def test_second_wal_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    first = WriteAheadLog(tmp_path)
    list(first.replay())
    first.start()
    first.append(1, [b"acknowledged"])
    with pytest.raises(ConfigError, match="in use by another running sidecar"):
        WriteAheadLog(tmp_path)
    first.append(1, [b"still here"])
    first.close()
    assert [p for _, _, p in WriteAheadLog(tmp_path).replay()] == [b"acknowledged", b"still here"]


# -- dedupe state, limits ---------------------------------------------------------------------------


def test_a_huge_policy_version_does_not_wipe_dedupe_state(memory_url: str) -> None:
    eng = _engine(memory_url, None, flush_interval_s=3600)
    try:
        _submit(eng, write_request(1, [make_chunk("t1", 0, 4, seed=1)]))
        _submit(eng, write_request(2, [make_chunk("t9", 0, 4, seed=9, version=2**62)]))
        with pytest.raises(ConflictError, match="different bytes"):
            _submit(eng, write_request(3, [make_chunk("t1", 0, 4, seed=2)]))
    finally:
        eng.close()


def test_writer_and_run_limits(memory_url: str) -> None:
    eng = _engine(memory_url, None, max_writers=2, max_runs=1, flush_interval_s=3600)
    try:
        eng.store.put_run(RunSpec("another-run", SPEC.sites))
        _submit(eng, write_request(1, [make_chunk("t1", 0, 4)], writer="a"))
        _submit(eng, write_request(1, [make_chunk("t2", 0, 4)], writer="b"))
        with pytest.raises(LimitError, match="max_writers"):
            _submit(eng, write_request(1, [make_chunk("t3", 0, 4)], writer="c"))
        assert list(eng.writers) == [(SPEC.run, "a"), (SPEC.run, "b")]  # the refused one left no session
        _submit(eng, write_request(2, [make_chunk("t4", 0, 4)], writer="a"))  # known writers go on
        # run-a has records waiting to be committed: its slot is taken
        with pytest.raises(LimitError, match="max_runs"):
            eng.write_spec("another-run")
        assert eng.run_spec("another-run").run == "another-run"  # a lookup to read takes no slot
        assert eng.flush(10)
        assert eng.write_spec("another-run").run == "another-run"  # run-a's committed: its slot is reused
        assert list(eng.runs) == ["another-run"]
    finally:
        eng.close()


def test_a_flipped_byte_in_the_complete_last_entry_is_corruption_not_a_torn_tail(tmp_path: Path) -> None:
    """The newest segment's last entry is all there but one byte differs: it was written (and may
    have been acknowledged), so replay refuses instead of cutting it as a torn tail."""
    wal = WriteAheadLog(tmp_path)
    list(wal.replay())
    wal.start()
    for i in range(5):
        wal.append(1, [os.urandom(3000 + i)])
    wal.close()
    seg = _newest(tmp_path)
    data = bytearray(seg.read_bytes())
    data[_offset_of(seg, 4) + HEADER.size + 1000] ^= 0x01
    seg.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="last entry, which is complete"):
        list(WriteAheadLog(tmp_path).replay())
    assert seg.read_bytes() == bytes(data)


def test_a_last_entry_zero_filled_from_a_sector_is_a_torn_tail(tmp_path: Path) -> None:
    """A crash after the file grew but before the last entry's later sectors reached the device:
    those sectors read back as zeros. That entry was never acknowledged: it is cut."""
    payloads = _log_with(tmp_path, 3)
    wal = WriteAheadLog(tmp_path)
    list(wal.replay())
    wal.start()
    durable = (tmp_path / "DURABLE").read_bytes()  # as the crash leaves it: the entry never synced
    wal.append(1, [os.urandom(5000)])
    wal.close()
    (tmp_path / "DURABLE").write_bytes(durable)
    seg = _newest(tmp_path)
    data = bytearray(seg.read_bytes())
    start = _offset_of(seg, 0)  # the newest segment holds just that entry
    cut = -(-(start + 2000) // 512) * 512
    data[cut:] = bytes(len(data) - cut)
    seg.write_bytes(bytes(data))
    assert [p for _, _, p in WriteAheadLog(tmp_path).replay()] == payloads
    assert seg.stat().st_size == start


# -- the entry format stays readable -------------------------------------------------------------


def test_wal_entries_keep_the_format_earlier_sidecars_wrote() -> None:
    """A restart replays segments a previous sidecar wrote: each entry kind encodes to the bytes it
    always did, and a STATE entry written before writer ownership existed (no owner) still reads."""
    from tracestore.server.engine import message as m

    entries = [
        (m.PLAN, m.Plan("r", "w0", 7, [(1, 2), (1, 3)]), b'"shard": 7, "messages": [[1, 2], [1, 3]]}'),
        (m.DONE, m.Done("r", "w0", 7), b'"shard": 7}'),
        (m.OWNER, m.Owner("r", "w0", "alice"), b'"identity": "alice"}'),
    ]
    for kind, entry, tail in entries:
        assert m.encode_entry(entry) == b'{"run": "r", "writer": "w0", ' + tail
        assert m.decode_entry(kind, m.encode_entry(entry)) == entry
    assert m.decode_entry(m.DATA, b"not json") is None  # (a DATA entry is a message, parsed elsewhere)
    sessions = [m.Session("r", "w0", 2, 5, 9, "alice"), m.Session("r", "w1", 1, 1, 3, None)]
    state = m.encode_state(sessions)
    assert state == b'{"writers": [["r", "w0", 2, 5, 9, "alice"], ["r", "w1", 1, 1, 3, null]]}'
    assert m.decode_state(state) == sessions
    assert m.decode_state(b'{"writers": [["r", "w0", 2, 5, 9]]}') == [m.Session("r", "w0", 2, 5, 9, None)]
