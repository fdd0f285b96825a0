"""Writer ids and trajectories belong to the identity that first used them (authentication on).

Two callers may both write run-a. Before ownership existed, either could fence the other's writer
forever with one message of epoch 2**64-1, write records into the other's trajectories (so the
owner got ALREADY_EXISTS), or redirect the other's trajectory to its own bytes with a prefix link.
Each attack is a real gRPC call against a sidecar with a WAL; the claims survive a restart.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from pathlib import Path

import grpc
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import Sidecar
from tracestore.server.testing import SPEC, make_chunk, write_request

from tracestore.records import PrefixLink
from tracestore.storage.store import Store
from tracestore.v1 import tracestore_pb2 as pb

TOKENS = {"alice": secrets.token_urlsafe(24), "mallory": secrets.token_urlsafe(24)}


def _sidecar(tmp: Path) -> Sidecar:
    lines = [
        f"sha256:{hashlib.sha256(t.encode()).hexdigest()} write:{SPEC.run},read:{SPEC.run} {n}"
        for n, t in TOKENS.items()
    ]
    (tmp / "tokens").write_text("\n".join(lines) + "\n")
    cfg = ServerConfig(storage=f"file://{tmp / 'data'}", wal_dir=str(tmp / "wal"), port=0, metrics_port=None,
                       flush_interval_s=0.05, auth_tokens=str(tmp / "tokens"))  # fmt: skip
    return Sidecar(cfg).start()


def _write(port: int, who: str, reqs: Sequence[pb.WriteRequest]) -> str:
    """Stream the requests as ``who``; the final status code name ("OK" once all were acked)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.stream_stream("/tracestore.v1.TraceStore/Write")
        want = reqs[-1].sequence
        try:
            for raw in call(
                iter([r.SerializeToString() for r in reqs]),
                metadata=(("authorization", f"Bearer {TOKENS[who]}"),),
                timeout=20,
            ):
                ack = pb.WriteResponse.FromString(raw)
                if ack.durable_sequence >= want and ack.epoch == reqs[-1].epoch:
                    return "OK"
        except grpc.RpcError as exc:
            return exc.code().name
    return "no ack"


def test_another_identity_cannot_fence_write_or_link_into_what_is_not_its_own(tmp_path: Path) -> None:
    Store(f"file://{tmp_path / 'data'}").put_run(SPEC)
    sc = _sidecar(tmp_path)
    try:
        assert _write(sc.port, "alice", [write_request(1, [make_chunk("t-alice", 0, 4)], writer="w-alice")]) == "OK"
        assert _write(sc.port, "mallory", [write_request(1, [make_chunk("t-evil", 0, 4)], writer="w-mallory")]) == "OK"
        # fencing alice's writer with the largest epoch
        fence = write_request(1, [make_chunk("t-m1", 0, 4)], writer="w-alice", epoch=2**64 - 1)
        assert _write(sc.port, "mallory", [fence]) == "PERMISSION_DENIED"
        # alice's session goes on at epoch 1
        assert _write(sc.port, "alice", [write_request(2, [make_chunk("t-alice", 4, 4)], writer="w-alice")]) == "OK"
        # records squatted into alice's trajectory (other tokens, so no byte conflict would stop it)
        squat = write_request(2, [make_chunk("t-alice", 8, 4)], writer="w-mallory")
        assert _write(sc.port, "mallory", [squat]) == "PERMISSION_DENIED"
        # alice's trajectory redirected to mallory's bytes through a prefix link
        hijack = write_request(2, links=[PrefixLink(SPEC.run, 0, "t-alice", "t-evil", 4)], writer="w-mallory")
        assert _write(sc.port, "mallory", [hijack]) == "PERMISSION_DENIED"
        # a trajectory of mallory's own that reuses alice's records as its prefix
        borrow = write_request(2, links=[PrefixLink(SPEC.run, 0, "t-m2", "t-alice", 4)], writer="w-mallory")
        assert _write(sc.port, "mallory", [borrow]) == "PERMISSION_DENIED"
        # mallory's own writer still works after the refusals
        ok = write_request(2, [make_chunk("t-evil", 4, 4)], writer="w-mallory")
        assert _write(sc.port, "mallory", [ok]) == "OK"
    finally:
        sc.stop(5)
    # the writer id's owner is durable: a restarted sidecar (WAL replay) still refuses mallory
    sc = _sidecar(tmp_path)
    try:
        again = write_request(1, [make_chunk("t-m3", 0, 4)], writer="w-alice", epoch=7)
        assert _write(sc.port, "mallory", [again]) == "PERMISSION_DENIED"
        assert _write(sc.port, "alice", [write_request(3, [make_chunk("t-alice", 8, 4)], writer="w-alice")]) == "OK"
    finally:
        sc.stop(5)


def _wait(what: str, ok: object, timeout: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not ok():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_writer_claim_survives_the_segment_that_held_it(tmp_path: Path) -> None:
    """Alice's first message makes an OWNER entry that fills its segment, so her DATA entry opens a
    new one, whose STATE header snapshots every session. Before, the claim was set on the session
    only after both appends, so that header said "no owner"; once the first segment was retired
    (everything in it committed), a crash and replay forgot the claim, and mallory fenced w-alice
    with epoch 2**64-1. The crash is the WAL directory as the disk holds it, copied while the
    sidecar runs, and replayed by a new sidecar."""
    import shutil

    from tracestore.server.engine.message import Owner, encode_entry
    from tracestore.server.wal.files import HEADER

    Store(f"file://{tmp_path / 'data'}").put_run(SPEC)
    mallory = write_request(1, [make_chunk("t-m", 0, 256)], writer="w-mallory")
    owner_entry = HEADER.size + len(encode_entry(Owner(SPEC.run, "w-alice", "alice")))

    def start(wal: str, segment_bytes: int) -> Sidecar:
        lines = [f"sha256:{hashlib.sha256(t.encode()).hexdigest()} write:{SPEC.run} {n}" for n, t in TOKENS.items()]
        (tmp_path / "tokens").write_text("\n".join(lines) + "\n")
        cfg = ServerConfig(storage=f"file://{tmp_path / 'data'}", wal_dir=str(tmp_path / wal), port=0,
                           metrics_port=None, flush_interval_s=0.05, auth_tokens=str(tmp_path / "tokens"),
                           wal_segment_bytes=segment_bytes)  # fmt: skip
        return Sidecar(cfg).start()

    def after_mallory(sc: Sidecar) -> int:
        assert _write(sc.port, "mallory", [mallory]) == "OK"
        _wait("mallory committed", lambda: sc.engine.writers[(SPEC.run, "w-mallory")].committed_seq >= 1)
        return sc.engine.wal.segments[-1].size

    sc = start("wal-measure", 1 << 20)  # how full mallory's message leaves the segment
    try:
        size = after_mallory(sc)
    finally:
        sc.stop(5)
    sc = start("wal", size + owner_entry)  # ... so that alice's OWNER entry fills it exactly
    try:
        assert after_mallory(sc) == size
        assert _write(sc.port, "alice", [write_request(1, [make_chunk("t-alice", 0, 4)], writer="w-alice")]) == "OK"
        eng = sc.engine
        _wait("alice committed, the claim's segment retired",
              lambda: eng.writers[(SPEC.run, "w-alice")].committed_seq >= 1 and len(eng.wal.segments) == 1)  # fmt: skip
        shutil.copytree(tmp_path / "wal", tmp_path / "wal-crash")  # what a crash would leave
    finally:
        sc.stop(5)
    sc = start("wal-crash", 1 << 20)
    try:
        fence = write_request(1, [make_chunk("t-m2", 0, 4)], writer="w-alice", epoch=2**64 - 1)
        assert _write(sc.port, "mallory", [fence]) == "PERMISSION_DENIED"
        assert _write(sc.port, "alice", [write_request(2, [make_chunk("t-alice", 4, 4)], writer="w-alice")]) == "OK"
    finally:
        sc.stop(5)


def test_tokens_need_a_write_ahead_log(tmp_path: Path) -> None:
    """Who owns each writer id is recorded in the WAL. Before, --auth-tokens with --wal-dir off was
    served: a restart forgot every claim, and mallory fenced w-alice with epoch 2**64-1."""
    import subprocess
    import sys

    import pytest

    from tracestore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"needs a write-ahead log \(--wal-dir\)"):
        ServerConfig(storage="memory://x", wal_dir=None, auth_tokens=str(tmp_path / "tokens"))
    (tmp_path / "tokens").write_text(f"sha256:{hashlib.sha256(b'x').hexdigest()} write:*\n")
    cmd = [sys.executable, "-m", "tracestore.cli", "serve", "--storage", f"file://{tmp_path}/data", "--wal-dir", "off",
           "--auth-tokens", str(tmp_path / "tokens"), "--port", "0", "--metrics-port", "off"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs a write-ahead log" in r.stderr, r.stderr


def test_a_trajectory_is_owned_in_every_version_and_the_dedupe_window_does_not_drop_it(tmp_path: Path) -> None:
    """Trajectory owners were kept per (run, version, trajectory) in the dedupe index, which keeps
    the newest --dedupe-versions versions only. Before: mallory wrote alice's trajectory in another
    version (or linked it to her own bytes there, which a read of all versions then served), and one
    message of seals in four new versions dropped every owner of the run's older versions."""
    from tracestore.records import TrajectorySeal

    Store(f"file://{tmp_path / 'data'}").put_run(SPEC)
    sc = _sidecar(tmp_path)
    try:
        assert _write(sc.port, "alice", [write_request(1, [make_chunk("t-alice", 0, 4)], writer="w-alice")]) == "OK"
        assert _write(sc.port, "mallory", [write_request(1, [make_chunk("t-evil", 0, 4)], writer="w-mallory")]) == "OK"
        other_version = write_request(2, [make_chunk("t-alice", 0, 4, seed=9, version=1)], writer="w-mallory")
        assert _write(sc.port, "mallory", [other_version]) == "PERMISSION_DENIED"
        hijack = write_request(2, links=[PrefixLink(SPEC.run, 2, "t-alice", "t-evil", 4)], writer="w-mallory")
        assert _write(sc.port, "mallory", [hijack]) == "PERMISSION_DENIED"
        site = SPEC.sites[0].name
        flood = [TrajectorySeal(SPEC.run, v, f"t-m{v}", 2, (site,)) for v in (1000, 1001, 1002, 1003)]
        assert _write(sc.port, "mallory", [write_request(2, seals=flood, writer="w-mallory")]) == "OK"
        squat = write_request(3, [make_chunk("t-alice", 4, 4, seed=9)], writer="w-mallory")
        assert _write(sc.port, "mallory", [squat]) == "PERMISSION_DENIED"
        assert _write(sc.port, "alice", [write_request(2, [make_chunk("t-alice", 4, 4)], writer="w-alice")]) == "OK"
    finally:
        sc.stop(5)


def test_trajectory_owners_are_bounded_least_recently_written_first(monkeypatch: object) -> None:
    from tracestore.server.engine import dedupe
    from tracestore.server.engine.message import Message

    monkeypatch.setattr(dedupe, "MAX_OWNED_TRAJECTORIES", 3)  # type: ignore[attr-defined]
    index = dedupe.DedupeIndex(versions=4)

    def msg(traj: str) -> Message:
        c = make_chunk(traj, 0, 1)
        return Message(SPEC.run, "w-alice", 1, 1, [c], [], [], c.nbytes, [c.checksum])

    for t in ("a", "b", "c", "a", "d"):  # "a" written again: "b" is now the least recent
        index.remember(msg(t), "alice")
    assert list(index.owners._cache) == [(SPEC.run, "c"), (SPEC.run, "a"), (SPEC.run, "d")]


def test_an_open_trajectorys_owner_survives_a_crash(tmp_path: Path) -> None:
    """Trajectory owners lived in memory only: once the segment with alice's first message was
    retired (committed), a crash and replay forgot that t-alice is hers; mallory then wrote into it
    and alice's next write was refused (her recorder stops for good on PERMISSION_DENIED). Now every
    segment's header keeps the owners of the open trajectories, and the owners table every owner
    whose segments are gone. The copy is taken once every segment but the active one is deleted:
    those deletions may run late on the WAL's sync thread, and a copy that began while one ran
    once failed (a segment listed, then gone) under heavy CPU load."""
    import shutil

    Store(f"file://{tmp_path / 'data'}").put_run(SPEC)

    def start(wal: str) -> Sidecar:
        lines = [f"sha256:{hashlib.sha256(t.encode()).hexdigest()} write:{SPEC.run} {n}" for n, t in TOKENS.items()]
        (tmp_path / "tokens").write_text("\n".join(lines) + "\n")
        cfg = ServerConfig(storage=f"file://{tmp_path / 'data'}", wal_dir=str(tmp_path / wal), port=0,
                           metrics_port=None, flush_interval_s=0.05, auth_tokens=str(tmp_path / "tokens"),
                           wal_segment_bytes=4096)  # fmt: skip
        return Sidecar(cfg).start()

    sc = start("wal")
    try:  # each message is bigger than a segment: the next one opens a new segment
        assert _write(sc.port, "alice", [write_request(1, [make_chunk("t-alice", 0, 1000)], writer="w-alice")]) == "OK"
        assert _write(sc.port, "mallory", [write_request(1, [make_chunk("t-m", 0, 1000)], writer="w-mallory")]) == "OK"
        eng = sc.engine
        _wait("both committed, every segment but the active one deleted",
              lambda: all(st.committed_seq >= 1 for st in eng.writers.values())
              and len(eng.wal.segments) == 1 and eng.wal.segments[0].index > 1)  # fmt: skip
        shutil.copytree(tmp_path / "wal", tmp_path / "wal-crash")  # what a crash would leave
    finally:
        sc.stop(5)
    sc = start("wal-crash")
    try:
        squat = write_request(2, [make_chunk("t-alice", 1000, 4, seed=9)], writer="w-mallory")
        assert _write(sc.port, "mallory", [squat]) == "PERMISSION_DENIED"
        assert _write(sc.port, "alice", [write_request(2, [make_chunk("t-alice", 1000, 4)], writer="w-alice")]) == "OK"
    finally:
        sc.stop(5)
