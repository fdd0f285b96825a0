"""A trajectory stays its owner's for good: sealed or open, across a clean restart, a crash after
the WAL was drained, and once the sidecar's memory has forgotten it.

Before, trajectory owners lived in memory (the 262,144 written most recently) and, for open
trajectories only, in the WAL segments' headers. A clean stop truncates the WAL, and a crash after
the segments holding a sealed trajectory's messages were retired replays nothing of it: either way
the restarted sidecar let another identity with write scope on the same run write the sealed
trajectory in a new policy version (which a read of all versions then served as the owner's), seal
it there, or link it to bytes of its own. Every sidecar here is a real process or a real server on
real sockets, with file:// storage and a WAL.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from tracestore.server.testing import SPEC, ServeProcess, make_chunk, wait_for, write_request

from tracestore.errors import PermissionDeniedError, StorageError
from tracestore.records import PrefixLink, TrajectorySeal
from tracestore.storage.store import Store
from tracestore.v1 import tracestore_pb2 as pb

from .test_ownership import TOKENS, _sidecar, _write

SITE = SPEC.sites[0].name


def _serve(tmp: Path, *flags: str) -> ServeProcess:
    """A ``tracestore serve`` process on ``tmp`` whose tokens give alice and mallory write and read
    scope on the same run."""
    lines = [
        f"sha256:{hashlib.sha256(t.encode()).hexdigest()} write:{SPEC.run},read:{SPEC.run} {n}"
        for n, t in TOKENS.items()
    ]
    (tmp / "tokens").write_text("\n".join(lines) + "\n")
    (tmp / "tokens").chmod(0o600)
    flags = ("--auth-tokens", str(tmp / "tokens"), "--flush-interval", "0.05", "--metrics-port", "off", *flags)
    return ServeProcess(tmp, flags=list(flags))


def _attacks(port: int) -> list[str]:
    """Mallory's attempts on alice's sealed t-alice, each the first message of a writer id of her
    own: the status code of each."""
    attempts = [
        # records in a policy version alice has not written (a read of all versions serves the newest)
        dict(chunks=[make_chunk("t-alice", 0, 8, seed=9, version=1)]),
        # a seal of it in another version
        dict(seals=[TrajectorySeal(SPEC.run, 1, "t-alice", 9, (SITE,))]),
        # redirecting it to her own bytes
        dict(links=[PrefixLink(SPEC.run, 2, "t-alice", "t-evil", 4)]),
        # a trajectory of her own that reuses alice's records
        dict(links=[PrefixLink(SPEC.run, 0, "t-m2", "t-alice", 4)]),
    ]
    return [
        _write(port, "mallory", [write_request(1, writer=f"w-mallory-{i}", **a)])  # type: ignore[arg-type]
        for i, a in enumerate(attempts)
    ]


def _nothing_of_mallorys_in(data: Path) -> None:
    """No manifest on storage has mallory's writer write t-alice, in any version."""
    store = Store(f"file://{data}")
    for v in store.list_versions(SPEC.run):
        for m in store.manifests(SPEC.run, v):
            if m.writer.startswith("w-mallory"):
                assert "t-alice" not in m.trajectories and all(x.source != "t-alice" for x in m.links), (v, m)


def _alice_v1() -> pb.WriteRequest:
    """Alice's next message: t-alice in policy version 1."""
    return write_request(2, [make_chunk("t-alice", 0, 8, version=1)], writer="w-alice")


def _alice_then_mallory(port: int, alice_tokens: int = 8) -> None:
    """Alice writes and seals t-alice (one message); mallory writes t-evil of her own."""
    chunk = make_chunk("t-alice", 0, alice_tokens)
    seal = TrajectorySeal(SPEC.run, 0, "t-alice", alice_tokens + 1, (SITE,))
    assert _write(port, "alice", [write_request(1, [chunk], seals=[seal], writer="w-alice")]) == "OK"
    evil = make_chunk("t-evil", 0, alice_tokens)
    assert _write(port, "mallory", [write_request(1, [evil], writer="w-mallory")]) == "OK"


def test_a_sealed_trajectory_stays_its_owners_after_a_clean_restart(tmp_path: Path) -> None:
    Store(f"file://{tmp_path / 'data'}").put_run(SPEC)
    sp = _serve(tmp_path)
    sp.start()
    try:
        _alice_then_mallory(sp.port)
        assert sp.terminate() == 0  # a clean stop: everything committed, the WAL cut to one fresh segment
        (segment,) = (tmp_path / "wal").glob("wal-*.log")
        assert b"t-alice" not in segment.read_bytes()
        sp.start()
        assert _attacks(sp.port) == ["PERMISSION_DENIED"] * 4
        # alice writes her own trajectory in a new version, mallory her own
        assert _write(sp.port, "alice", [_alice_v1()]) == "OK"
        assert _write(sp.port, "mallory", [write_request(2, [make_chunk("t-evil", 8, 4)], writer="w-mallory")]) == "OK"
        assert sp.terminate() == 0
    finally:
        sp.kill()
    _nothing_of_mallorys_in(tmp_path / "data")


def test_a_sealed_trajectory_stays_its_owners_after_a_crash_once_its_segments_are_retired(tmp_path: Path) -> None:
    """Alice's message fills a 1 MiB segment, so mallory's opens the next; once both are committed
    every segment that named t-alice is deleted (the WAL holds nothing of it), then the sidecar is
    killed (SIGKILL) and started again on the same WAL and storage."""
    Store(f"file://{tmp_path / 'data'}").put_run(SPEC)
    wal = tmp_path / "wal"
    sp = _serve(tmp_path, "--wal-segment-mib", "1")
    sp.start()
    try:
        _alice_then_mallory(sp.port, alice_tokens=100_000)  # 1.2 MB each: one segment apiece

        def drained() -> bool:
            segments = list(wal.glob("wal-*.log"))
            return len(segments) == 1 and all(b"t-alice" not in s.read_bytes() for s in segments)

        wait_for("the segments naming t-alice retired", drained)
        sp.kill()
        sp.start()
        assert _attacks(sp.port) == ["PERMISSION_DENIED"] * 4
        assert _write(sp.port, "alice", [_alice_v1()]) == "OK"
        assert sp.terminate() == 0
    finally:
        sp.kill()
    _nothing_of_mallorys_in(tmp_path / "data")


def test_an_owner_the_sidecar_no_longer_keeps_in_memory_still_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidecar keeps a bounded number of trajectory owners in memory (two here); mallory's
    newer trajectories push t-alice out of them, yet it stays alice's."""
    from tracestore.server.engine import dedupe

    monkeypatch.setattr(dedupe, "MAX_OWNED_TRAJECTORIES", 2)
    Store(f"file://{tmp_path / 'data'}").put_run(SPEC)
    sc = _sidecar(tmp_path)
    try:
        _alice_then_mallory(sc.port)
        flood = [make_chunk(f"t-m{i}", 0, 2) for i in range(4)]
        assert _write(sc.port, "mallory", [write_request(2, flood, writer="w-mallory")]) == "OK"
        w = "w-mallory"
        squat = write_request(3, [make_chunk("t-alice", 0, 8, seed=9, version=1)], writer=w)
        assert _write(sc.port, "mallory", [squat]) == "PERMISSION_DENIED"
        assert sc.engine.flush(10)
    finally:
        sc.stop(5)
    sc = _sidecar(tmp_path)  # and after a clean restart, with the same small memory
    try:
        squat = write_request(3, [make_chunk("t-alice", 0, 8, seed=9, version=1)], writer="w-mallory")
        assert _write(sc.port, "mallory", [squat]) == "PERMISSION_DENIED"
        mine = write_request(3, [make_chunk("t-m0", 2, 2)], writer="w-mallory")
        assert _write(sc.port, "mallory", [mine]) == "OK"
    finally:
        sc.stop(5)
    _nothing_of_mallorys_in(tmp_path / "data")


def test_a_damaged_owners_table_stops_the_start(tmp_path: Path) -> None:
    """A sidecar that cannot read who owns what refuses to serve rather than serving without owners."""
    (tmp_path / "wal").mkdir(mode=0o700)
    (tmp_path / "wal" / "owners.sqlite3").write_bytes(b"not a database" * 512)
    sp = _serve(tmp_path)
    with pytest.raises(StorageError, match=r"owners table .*owners\.sqlite3 does not open \(file is not a database\)"):
        sp.start()


def test_a_new_trajectory_costs_no_table_query_and_a_forgotten_one_costs_one(tmp_path: Path) -> None:
    """The hot path's price: a trajectory the table does not hold is told apart in memory (its
    filter), one that memory forgot is one query, and the answer is kept."""
    from tracestore.server.engine.message import Message
    from tracestore.server.engine.owners import TrajectoryOwners

    def msg(*trajs: str) -> Message:
        chunks = [make_chunk(t, 0, 1) for t in trajs]
        return Message(SPEC.run, "w", 1, 1, chunks, [], [], 0, [c.checksum for c in chunks])

    owners = TrajectoryOwners(tmp_path / "owners.sqlite3", cache_size=4)
    owners.open()
    try:
        assert owners.presence_built.wait(20)
        owners.claim([(SPEC.run, f"t{i}") for i in range(100)], "alice")
        owners.persist()
        assert (owners.unpersisted, len(owners._cache)) == (0, 4)
        before = owners.lookups
        assert before == 0
        owners.check(msg(*(f"new{i}" for i in range(64))), "bob")
        assert owners.lookups == before
        with pytest.raises(PermissionDeniedError, match="t0 of run"):
            owners.check(msg("t0"), "bob")
        owners.check(msg("t0"), "alice")
        assert owners.lookups == before + 1
    finally:
        owners.close()
