"""The sidecar's unix socket: who may connect (mode and group, set before anyone can reach it),
and what ``--unix-socket`` may remove (only a stale socket, never a file, directory or symlink)."""

from __future__ import annotations

import os
import socket
import stat
import uuid
from pathlib import Path

import grpc
import pytest
from tracestore.server.config import ServerConfig
from tracestore.server.service import Sidecar
from tracestore.server.testing import SPEC

from tracestore.errors import ConfigError
from tracestore.v1 import tracestore_pb2 as pb

SITE = SPEC.site("layers.1.mlp.input")
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: runs processes as other users")


def _config(sock: Path, **kw: object) -> ServerConfig:
    return ServerConfig(storage=f"memory://sock-{uuid.uuid4().hex}", wal_dir=None, port=0, metrics_port=None,
                        unix_socket=str(sock), **kw)  # type: ignore[arg-type]  # fmt: skip


# -- what --unix-socket may remove ---------------------------------------------------------------


def test_a_regular_file_at_the_socket_path_is_never_deleted(tmp_path: Path) -> None:
    victim = tmp_path / "precious.db"
    victim.write_bytes(b"data that must survive")
    with pytest.raises(ConfigError, match=rf"{victim} exists and is a regular file, not a socket"):
        Sidecar(_config(victim)).start()
    assert victim.read_bytes() == b"data that must survive"


def test_a_directory_at_the_socket_path_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "dir"
    d.mkdir()
    (d / "inside").write_text("x")
    with pytest.raises(ConfigError, match=rf"{d} exists and is a directory, not a socket"):
        Sidecar(_config(d)).start()
    assert (d / "inside").read_text() == "x"


@pytest.mark.parametrize("target", ["file", "stale socket"])
def test_a_symlink_at_the_socket_path_is_refused_and_kept(tmp_path: Path, target: str) -> None:
    dest = tmp_path / "dest"
    if target == "file":
        dest.write_text("x")
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(dest))
        s.close()
    link = tmp_path / "link.sock"
    link.symlink_to(dest)
    with pytest.raises(ConfigError, match=rf"{link} exists and is a symlink, not a socket"):
        Sidecar(_config(link)).start()
    assert link.is_symlink() and dest.exists()


def test_a_stale_socket_is_taken_over_and_a_live_one_refused(tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock))  # bound, nobody listening: what a crashed server leaves
    stale.close()
    sc = Sidecar(_config(sock)).start()
    try:
        assert stat.S_ISSOCK(os.lstat(sock).st_mode)
        with pytest.raises(ConfigError, match="in use by a running server"):
            Sidecar(_config(sock)).start()
        _stat_over(sock)
    finally:
        sc.stop(1)
    assert not sock.exists()


def test_stop_removes_only_its_own_socket(tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    sc = Sidecar(_config(sock)).start()
    try:
        os.unlink(sock)
        sock.write_text("someone else's file now")
    finally:
        sc.stop(1)
    assert sock.read_text() == "someone else's file now"


# -- who may connect -----------------------------------------------------------------------------


def test_socket_is_owner_only_by_default(tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    sc = Sidecar(_config(sock)).start()
    try:
        st = os.lstat(sock)
        assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
        assert [p.name for p in tmp_path.iterdir()] == ["s.sock"]  # the private bind directory is gone
        _stat_over(sock)
    finally:
        sc.stop(1)


@root_only
def test_socket_group_and_mode(tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    sc = Sidecar(_config(sock, socket_group="54320")).start()
    try:
        st = os.lstat(sock)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, 54320)
        assert sc.shm.group == 54320  # pools must then be readable by that group
    finally:
        sc.stop(1)
    sc = Sidecar(_config(sock, socket_group="54320", socket_mode=0o600)).start()
    try:
        assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o600
        assert sc.shm.group is None  # the group cannot connect: pools are the sidecar uid's own
    finally:
        sc.stop(1)


@pytest.mark.parametrize("mode", [0o666, 0o662, 0o1660])
def test_socket_mode_for_other_users_is_refused(tmp_path: Path, mode: int) -> None:
    with pytest.raises(ConfigError, match="at most 0770"):
        Sidecar(_config(tmp_path / "s.sock", socket_mode=mode)).start()
    assert not (tmp_path / "s.sock").exists()


def _stat_over(sock: Path) -> None:
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        raw = ch.unary_unary("/tracestore.v1.TraceStore/Stat")(pb.StatRequest().SerializeToString(), timeout=10)
    assert pb.StatResponse.FromString(raw).version
