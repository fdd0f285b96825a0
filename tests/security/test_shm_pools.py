"""A client on the unix socket names the shared-memory pool the sidecar reads its records from.
Attacks on that name, against a real sidecar over its real unix socket, with real files: a
symlink to a root-only file (its bytes must never come back through Read), a hard link to one, a
FIFO (must not block the sidecar's pool lock: the next recorder still writes), files of the wrong
kind, owner, mode or size. Also the recorder's own sweep of dead pools, which opens pool-named
files in the same directory."""

from __future__ import annotations

import os
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tracestore.client import RolloutRecorder, SiteOutput
from tracestore.client.record.staging import StagingPool
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import Sidecar
from tracestore.server.rpc.shm import ShmPools
from tracestore.server.testing import SPEC

from tracestore.errors import PermissionDeniedError, ValidationError
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import run_spec_to_pb

SITE = SPEC.site("layers.1.mlp.input")
N_TOKENS = 16
SECRET = bytes(np.random.default_rng(7).integers(0, 256, 64 << 10, dtype=np.uint8))
REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED}
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: files of other owners, devices")


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sidecar, Path, Path]]:
    base = tmp_path_factory.mktemp("shm-attacks")
    shm = base / "shm"
    shm.mkdir()
    cfg = ServerConfig(storage=f"memory://shm-attacks-{uuid.uuid4().hex}", wal_dir=None, port=0, metrics_port=None,
                       unix_socket=str(base / "s.sock"), shm_dir=str(shm), flush_interval_s=0.05)  # fmt: skip
    sc = Sidecar(cfg).start()
    try:
        yield sc, base / "s.sock", shm
    finally:
        sc.stop(2)


def _shm_write(sock: Path, pool: str, traj: str, *, timeout: float = 10.0) -> grpc.RpcError | None:
    """One Write naming ``pool``: codes at offset 0, scales right after, no checksum (the attacker
    does not know the bytes). None when the sidecar acknowledged it, else its error."""
    _, nc, _, _ = _sizes()
    req = pb.WriteRequest(run=SPEC.run, writer=f"attacker-{uuid.uuid4().hex[:8]}", epoch=1, sequence=1, shm_pool=pool)
    req.run_spec.CopyFrom(run_spec_to_pb(SPEC))
    c = req.chunks.add(trajectory=traj, site=SITE.name, token_start=0, n_tokens=N_TOKENS, global_scale=1.0)
    c.shm.codes_offset, c.shm.scales_offset = 0, nc
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        call = ch.stream_stream("/tracestore.v1.TraceStore/Write")
        try:
            for raw in call(iter([req.SerializeToString()]), timeout=timeout):
                if pb.WriteResponse.FromString(raw).durable_sequence >= 1:
                    return None
        except grpc.RpcError as exc:
            return exc
    raise AssertionError("the Write stream ended without an acknowledgement or an error")


def _sizes() -> tuple[int, int, int, int]:
    from tracestore.wire import payload_sizes

    return payload_sizes(SITE, N_TOKENS, False)


def _read_back(sc: Sidecar, traj: str) -> bytes:
    """What the sidecar's Read RPC returns for ``traj`` (codes + scales), b"" when it has none."""
    return _read_back_at(f"127.0.0.1:{sc.port}", traj)


def _read_back_at(address: str, traj: str) -> bytes:
    """What the Read RPC at ``address`` returns for ``traj`` (codes + scales), b"" when it has none."""
    req = pb.ReadRequest(run=SPEC.run, plan=[pb.Segment(trajectory=traj, token_start=0, token_end=N_TOKENS)],
                         sites=[SITE.name])  # fmt: skip
    got = b""
    with grpc.insecure_channel(address) as ch:
        try:
            for raw in ch.unary_stream("/tracestore.v1.TraceStore/Read")(req.SerializeToString(), timeout=30):
                r = pb.ReadResponse.FromString(raw)
                got += r.codes + r.scales
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
    return got


def _refused(err: grpc.RpcError | None, pool: str, *expect: str) -> str:
    assert err is not None, f"the sidecar read pool {pool!r}"
    assert err.code() in REFUSED, (err.code(), err.details())
    details = err.details() or ""
    assert pool in details, details
    for word in expect:
        assert word in details, details
    return details


def _secret_file(base: Path, mode: int = 0o600) -> Path:
    f = base / f"secret-{uuid.uuid4().hex[:8]}"
    f.write_bytes(SECRET)
    os.chmod(f, mode)
    return f


def test_symlink_to_a_root_only_file_is_not_read(sidecar: tuple[Sidecar, Path, Path]) -> None:
    sc, sock, shm = sidecar
    secret = _secret_file(sock.parent)
    name = f"tracestore-{uuid.uuid4().hex[:8]}"
    (shm / name).symlink_to(secret)
    err = _shm_write(sock, name, "t-symlink")
    got = _read_back(sc, "t-symlink")
    assert SECRET[:64] not in got, "the root-only file's bytes came back through Read"
    _refused(err, name, "symlink")


def test_hard_link_to_a_root_only_file_is_not_read(sidecar: tuple[Sidecar, Path, Path]) -> None:
    """Same owner as the sidecar, regular file, 0600: only the link count gives it away."""
    sc, sock, shm = sidecar
    secret = _secret_file(shm.parent)
    name = f"tracestore-{uuid.uuid4().hex[:8]}"
    os.link(secret, shm / name)
    err = _shm_write(sock, name, "t-hardlink")
    assert SECRET[:64] not in _read_back(sc, "t-hardlink")
    _refused(err, name, "one link")


def test_fifo_does_not_block_the_pool_lock(sidecar: tuple[Sidecar, Path, Path]) -> None:
    """A FIFO under a pool's name: opening it for reading waited for a writer forever, holding the
    lock every new pool is mapped under, so each later same-host recorder hung."""
    sc, sock, shm = sidecar
    name = f"tracestore-{uuid.uuid4().hex[:8]}"
    fifo = shm / name
    os.mkfifo(fifo, 0o600)
    try:
        t0 = time.monotonic()
        err = _shm_write(sock, name, "t-fifo", timeout=10)
        assert time.monotonic() - t0 < 5
        _refused(err, name, "regular file", "FIFO")
        # the lock is free: a real recorder maps its own pool and its records arrive
        rec = RolloutRecorder(f"unix://{sock}", SPEC, f"after-fifo-{uuid.uuid4().hex[:6]}", shm_dir=str(shm),
                              staging_bytes=1 << 20, linger_s=0.0)  # fmt: skip
        try:
            rows = N_TOKENS * SITE.rows_per_token
            codes = np.full((rows, SITE.code_bytes), 0x5A, np.uint8)
            scales = np.full((rows, SITE.scale_bytes), 0x21, np.uint8)
            assert rec.record_forward([("t-after-fifo", 0, N_TOKENS)], {SITE.name: SiteOutput(codes, scales, 0.5)})
            assert rec.flush(15), rec.stats
        finally:
            rec.close(5)
        assert _read_back(sc, "t-after-fifo") == codes.tobytes() + scales.tobytes()
    finally:
        _unblock(fifo)


def _unblock(fifo: Path) -> None:
    """Release a reader stuck opening ``fifo`` (the sidecar before this fix), so the test ends."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: nobody is waiting on it
        return
    os.close(fd)


@pytest.mark.parametrize(
    ("what", "make", "expect"),
    [
        ("world-readable", lambda p: _file(p, 0o644), "mode 0644"),
        ("group-writable", lambda p: _file(p, 0o620), "mode 0620"),
        ("setuid", lambda p: _file(p, 0o4600), "mode 4600"),
        ("another owner", lambda p: _file(p, 0o600, uid=54321), "owned by uid 54321"),
        ("a directory", lambda p: p.mkdir(mode=0o700), "a directory"),
        ("a character device", lambda p: os.mknod(p, 0o600 | stat.S_IFCHR, os.makedev(1, 5)), "character device"),
        ("too small", lambda p: _file(p, 0o600, size=1024), "1024 bytes"),
    ],
)
@root_only
def test_pools_of_the_wrong_kind_owner_mode_or_size_are_refused(
    sidecar: tuple[Sidecar, Path, Path], what: str, make: Any, expect: str
) -> None:
    sc, sock, shm = sidecar
    name = f"tracestore-{uuid.uuid4().hex[:8]}"
    make(shm / name)
    traj = f"t-{uuid.uuid4().hex[:8]}"
    err = _shm_write(sock, name, traj)
    assert SECRET[:64] not in _read_back(sc, traj)
    _refused(err, name, expect)


def _file(path: Path, mode: int, *, uid: int | None = None, size: int = len(SECRET)) -> None:
    path.write_bytes(SECRET[:size])
    os.chmod(path, mode)
    if uid is not None:
        os.chown(path, uid, -1)


@pytest.mark.parametrize("name", ["tracestore-..", "tracestore-../secret", "../tracestore-x", "tracestore-a/b", "x"])
def test_pool_names_outside_the_directory_are_refused(tmp_path: Path, name: str) -> None:
    pools = ShmPools(str(tmp_path / "shm"))
    with pytest.raises(ValidationError, match="must match"):
        pools.view(name, 0, 1)


def test_pool_larger_than_the_limit_is_refused(tmp_path: Path) -> None:
    pool = StagingPool(4 << 20, shared=True, shm_dir=str(tmp_path))
    try:
        assert pool.name is not None
        with pytest.raises(ValidationError, match=r"4194304 bytes: expected 4096 to 1048576"):
            ShmPools(str(tmp_path), max_pool_bytes=1 << 20).view(pool.name, 0, 1)
        small = ShmPools(str(tmp_path), max_pool_bytes=8 << 20)
        assert bytes(small.view(pool.name, 0, 4)) == b"\0\0\0\0"
        small.close()
    finally:
        pool.close()


@root_only
def test_with_a_socket_group_only_group_readable_pools_of_that_group_are_read(tmp_path: Path) -> None:
    """A sidecar whose socket admits a group reads only pools that group may read: a 0600 pool
    (even the sidecar's own) would otherwise be readable through the sidecar by every member."""
    pools = ShmPools(str(tmp_path), group=54320)
    own = StagingPool(1 << 20, shared=True, shm_dir=str(tmp_path))
    grouped = StagingPool(1 << 20, shared=True, shm_dir=str(tmp_path), group=54320)
    try:
        assert own.name is not None and grouped.name is not None
        with pytest.raises(PermissionDeniedError, match=r"expected group 54320, group-readable \(0640\)"):
            pools.view(own.name, 0, 1)
        assert stat.S_IMODE(os.stat(grouped.path or "").st_mode) == 0o640
        assert len(pools.view(grouped.name, 0, 8)) == 8
    finally:
        pools.close()
        own.close()
        grouped.close()


def test_sweep_of_dead_pools_neither_blocks_on_a_fifo_nor_follows_a_symlink(tmp_path: Path) -> None:
    """A new recorder sweeps pool-named files of dead recorders; one that is a FIFO hung it in
    open() forever, one that is a symlink was opened through to its target."""
    fifo = tmp_path / f"tracestore-pool-{uuid.uuid4().hex}"
    link = tmp_path / f"tracestore-pool-{uuid.uuid4().hex}"
    os.mkfifo(fifo, 0o600)
    target = tmp_path / "target"
    target.write_bytes(b"x" * 4096)
    link.symlink_to(target)
    made: list[StagingPool] = []
    t = threading.Thread(target=lambda: made.append(StagingPool(1 << 16, shared=True, shm_dir=str(tmp_path))))
    t.start()
    t.join(5)
    hung = t.is_alive()
    if hung:
        _unblock(fifo)
        t.join(5)
    for p in made:
        p.close()
    assert not hung, "creating a staging pool hung on a FIFO in its directory"
    assert fifo.exists() and link.is_symlink() and target.read_bytes() == b"x" * 4096


@root_only
def test_another_users_pool_truncated_under_the_sidecar_is_refused_not_a_crash(tmp_path: Path) -> None:
    """A member of the socket's group (another uid) truncates its pool after the sidecar has read
    from it, then sends a message referencing the bytes that are gone. Before: the sidecar had the
    pool mapped and died of SIGBUS reading it (every writer of that sidecar lost its connection).
    Now another user's pool is copied out with pread: INVALID_ARGUMENT naming the pool, and the
    sidecar keeps serving, its earlier acknowledged record readable."""
    from tracestore.server.testing import ServeProcess

    gid = 54321
    shm = tmp_path / "shm"
    shm.mkdir()
    flags = ["--shm-dir", str(shm), "--socket-group", str(gid), "--flush-interval", "0.05"]
    with ServeProcess(tmp_path / "sc", wal=False, unix_socket=True, flags=flags) as sp:
        assert sp.socket is not None
        name = f"tracestore-pool-{uuid.uuid4().hex[:12]}"
        path = shm / name
        payload = np.random.default_rng(3).integers(0, 256, 64 << 10, dtype=np.uint8).tobytes()
        path.write_bytes(payload)
        os.chown(path, 65534, gid)  # another user, in the socket's group
        os.chmod(path, 0o640)
        assert _shm_write(Path(sp.socket), name, "t-before") is None
        os.truncate(path, 0)  # the owner truncates its pool under the sidecar
        err = _shm_write(Path(sp.socket), name, "t-after")
        assert sp.proc is not None and sp.proc.poll() is None, f"the sidecar died:\n{sp.log_tail()}"
        details = _refused(err, name, "truncated")
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, details
        # Still serving: the record acknowledged before the truncation reads back, byte for byte.
        _, nc, ns, _ = _sizes()
        deadline = time.monotonic() + 20
        got = b""
        while time.monotonic() < deadline and not got:
            got = _read_back_at(sp.address, "t-before")
            time.sleep(0.05)
        assert got == payload[: nc + ns]


def _group_pool(shm: Path, name: str, byte: int, *, uid: int, gid: int) -> Path:
    path = shm / name
    path.write_bytes(bytes([byte]) * (64 << 10))
    os.chown(path, uid, gid)
    os.chmod(path, 0o640)
    return path


@root_only
def test_a_copy_never_reads_through_a_descriptor_closed_and_reused_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another uid's pool is copied out with pread. Before: view() took the pool's descriptor under
    the lock and read from it after releasing it; meanwhile another stream naming any pool closed
    the descriptors of unlinked pools, and the next open() in the sidecar reused the number, so the
    copy read that other file (here a root-only one) as the pool's bytes. The thread switch at the
    unlocked read is made deterministic with events."""
    gid = 54322
    pools = ShmPools(str(tmp_path), group=gid)
    name = "tracestore-pool-reused"
    path = _group_pool(tmp_path, name, ord("A"), uid=65534, gid=gid)
    pools.view(name, 0, 0)  # opened once: its descriptor is kept for later copies
    paused, resume = threading.Event(), threading.Event()
    pread = ShmPools._pread

    def preempted(self: ShmPools, pool: str, fd: int, offset: int, length: int) -> memoryview:
        paused.set()
        resume.wait(10)
        return pread(self, pool, fd, offset, length)

    monkeypatch.setattr(ShmPools, "_pread", preempted)
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(bytes(pools.view(name, 0, 4096))))
    t.start()
    assert paused.wait(10)
    monkeypatch.setattr(ShmPools, "_pread", pread)
    path.unlink()  # the pool's owner unlinks it ...
    with pytest.raises(ValidationError):
        pools.view("tracestore-pool-missing", 0, 0)  # ... and names another: the sidecar forgets the first
    secret = _secret_file(tmp_path)
    fd = os.open(secret, os.O_RDONLY)  # the next descriptor the sidecar opens
    try:
        resume.set()
        t.join(10)
    finally:
        os.close(fd)
        pools.close()
    assert got == [b"A" * 4096], f"the copy of {name} read {got[0][:24] if got else None!r}, not the pool's bytes"


@root_only
def test_a_pool_with_a_posix_acl_is_refused(tmp_path: Path) -> None:
    """With a POSIX ACL a pool's group mode bits are the ACL's mask: a 0640 pool of the socket's
    group whose ACL lets only the sidecar's uid read it (group::---) passed the group check, so any
    other member could name it and read it back through the sidecar."""
    import struct

    gid = 54323
    name = "tracestore-pool-acl"
    path = _group_pool(tmp_path, name, ord("V"), uid=65534, gid=gid)

    def entry(tag: int, perm: int, qualifier: int = 0xFFFFFFFF) -> bytes:  # struct posix_acl_xattr_entry
        return struct.pack("<HHI", tag, perm, qualifier)

    # user::rw- user:<sidecar>:r-- group::--- mask::r-- other::--- (tags: linux/posix_acl_xattr.h)
    acl = struct.pack("<I", 2) + entry(1, 6) + entry(2, 4, os.geteuid()) + entry(4, 0) + entry(0x10, 4) + entry(0x20, 0)
    try:
        os.setxattr(path, "system.posix_acl_access", acl)
    except OSError as exc:
        pytest.skip(f"this file system takes no POSIX ACLs: {exc}")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    pools = ShmPools(str(tmp_path), group=gid)
    try:
        with pytest.raises(PermissionDeniedError, match="carries a POSIX ACL"):
            pools.view(name, 0, 8)
    finally:
        pools.close()


@root_only
def test_a_root_owned_pool_is_copied_by_a_sidecar_of_another_uid(tmp_path: Path) -> None:
    """A non-root sidecar mapped root's pools in place ("root could kill it anyway"), but a root
    engine in another container cannot otherwise: truncating such a pool under the mapping killed
    the sidecar with SIGBUS. Only the sidecar's own pools are mapped; root's are copied with pread."""
    gid = 54324
    name = "tracestore-pool-root"
    _group_pool(tmp_path, name, ord("R"), uid=0, gid=gid)
    pools = ShmPools(str(tmp_path), group=gid)
    pools.uid = 61901  # the sidecar runs as another uid than the pool's owner (root)
    try:
        assert bytes(pools.view(name, 0, 4)) == b"RRRR"
        assert name in pools._copied and name not in pools._maps, "root's pool was mapped in place"
    finally:
        pools.close()


def test_a_caller_that_may_not_write_gets_no_pool_opened(tmp_path: Path) -> None:
    """The sidecar opened the pool a Write names before it authorized the Write: a read-only caller's
    refused Writes each left a pool open (a pool stays open while its file exists), and 64 of them
    locked every recorder out of the shared-memory path."""
    import hashlib

    token = "reader-" + uuid.uuid4().hex
    (tmp_path / "tokens").write_text(f"sha256:{hashlib.sha256(token.encode()).hexdigest()} read:* trainer\n")
    shm = tmp_path / "shm"
    shm.mkdir()
    cfg = ServerConfig(storage=f"file://{tmp_path / 'data'}", wal_dir=str(tmp_path / "wal"), port=0,
                       metrics_port=None, unix_socket=str(tmp_path / "s.sock"), shm_dir=str(shm),
                       auth_tokens=str(tmp_path / "tokens"))  # fmt: skip
    sc = Sidecar(cfg).start()
    try:
        name = f"tracestore-{uuid.uuid4().hex[:8]}"
        _file(shm / name, 0o600)
        req = pb.WriteRequest(run=SPEC.run, writer="w-reader", epoch=1, sequence=1, shm_pool=name)
        with grpc.insecure_channel(f"unix:{tmp_path / 's.sock'}") as ch:
            call = ch.stream_stream("/tracestore.v1.TraceStore/Write")
            with pytest.raises(grpc.RpcError) as e:
                list(call(iter([req.SerializeToString()]), metadata=[("authorization", f"Bearer {token}")], timeout=10))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value.details()
        assert sc.shm.capacity(name) == 0, "a caller that may not write got the sidecar to open its pool"
    finally:
        sc.stop(5)


@root_only
def test_copies_of_another_users_pool_are_counted_before_they_are_made(tmp_path: Path) -> None:
    """Another user's pool is copied out while its message is parsed. Before, every reference was
    copied first and the budget consulted after: a 325-byte message naming 4 x 96 MiB of a sparse
    pool (holes cost its owner nothing) grew the sidecar by ~380 MiB against a 64 MiB budget, and
    was refused anyway. Now the bytes a message references are reserved before any copy."""
    from tracestore.server.testing import ServeProcess

    from tracestore.wire import payload_sizes

    def peak_rss(pid: int) -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM"))

    gid = 54325
    shm = tmp_path / "shm"
    shm.mkdir()
    name = f"tracestore-pool-{uuid.uuid4().hex[:12]}"
    with open(shm / name, "wb") as f:
        f.truncate(1 << 30)
    os.chown(shm / name, 65534, gid)  # a member of the socket's group: its pool is copied
    os.chmod(shm / name, 0o640)
    flags = ["--shm-dir", str(shm), "--socket-group", str(gid), "--memory-budget-mib", "64", "--max-message-mib", "8"]
    with ServeProcess(tmp_path / "sc", unix_socket=True, flags=flags) as sp:
        assert sp.proc is not None and sp.socket is not None
        before = peak_rss(sp.proc.pid)
        n = 1 << 23
        _, nc, _, _ = payload_sizes(SITE, n, False)
        req = pb.WriteRequest(run=SPEC.run, writer="member", epoch=1, sequence=1, shm_pool=name)
        req.run_spec.CopyFrom(run_spec_to_pb(SPEC))
        for i in range(4):
            c = req.chunks.add(trajectory=f"t{i}", site=SITE.name, token_start=0, n_tokens=n, global_scale=1.0)
            c.shm.codes_offset, c.shm.scales_offset = 0, nc
        with grpc.insecure_channel(f"unix:{sp.socket}") as ch, pytest.raises(grpc.RpcError) as e:
            list(ch.stream_stream("/tracestore.v1.TraceStore/Write")(iter([req.SerializeToString()]), timeout=60))
        grew = peak_rss(sp.proc.pid) - before
        assert grew < 64 << 20, f"the sidecar grew {grew >> 20} MiB copying a message it refused"
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert "more than the whole memory budget" in (e.value.details() or "")
