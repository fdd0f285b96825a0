"""The sidecar's unix socket: who may connect (mode and group, set before anyone can reach it),
what ``--unix-socket`` may remove (only a stale socket, never a file, directory or symlink), and
a recorder running as another user of the socket's group writing through the socket and shared
memory to a sidecar running as a third user, records read back."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tracestore.client import GuidanceReader
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import Sidecar
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


# -- a recorder of another user, through the socket and shared memory ---------------------------

GROUP, SIDECAR_UID, RECORDER_UID, OUTSIDER_UID = 61900, 61901, 61902, 61903

# Imports happen as root (the interpreter lives where other users cannot read), then the process
# becomes the other user for everything it does.
_AS_USER = """
import json, os, sys
{imports}
a = json.loads(sys.argv[1])
os.setgroups(a["groups"]); os.setgid(a["gid"]); os.setuid(a["uid"])
"""

_SIDECAR = (
    _AS_USER.format(
        imports="""
import grp, socket, stat, tempfile, fsspec.implementations.local
import tracestore.plan, tracestore.storage.reader, tracestore.storage.store, tracestore.records
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import Sidecar
"""
    )
    + """
sc = Sidecar(ServerConfig(**a["config"])).start()
print(json.dumps({"port": sc.port}), flush=True)
sys.stdin.read()
sc.stop(5)
"""
)

_RECORDER = (
    _AS_USER.format(
        imports="""
import grp, stat
import numpy as np, numpy.random
from tracestore.client import RolloutRecorder, SiteOutput
from tracestore.server.testing import SPEC
import tracestore.client.transport, grpc
"""
    )
    + """
rec = RolloutRecorder(a["address"], SPEC, a["writer"], shm_dir=a["shm_dir"], staging_bytes=1 << 20, linger_s=0.0,
                      give_up_s=a["give_up_s"])
site = SPEC.site("layers.1.mlp.input")
rng = np.random.default_rng(a["seed"])
codes = rng.integers(0, 256, (a["n"], site.code_bytes), dtype=np.uint8)
scales = rng.integers(0, 256, (a["n"], site.scale_bytes), dtype=np.uint8)
ok = rec.record_forward([(a["traj"], 0, a["n"])], {site.name: SiteOutput(codes, scales, 0.5)})
flushed = rec.flush(a["flush_s"])
st = os.stat(rec.pool.path)
print(json.dumps({"ok": ok, "flushed": flushed, "error": None if rec.error is None else str(rec.error),
                  "stats": rec.stats, "pool_mode": stat.S_IMODE(st.st_mode), "pool_gid": st.st_gid}), flush=True)
rec.close(1)
"""
)


def _as_user(script: str, uid: int, groups: list[int], args: dict[str, object], **kw: object) -> subprocess.Popen[str]:
    who = {"uid": uid, "gid": uid, "groups": groups, **args}
    return subprocess.Popen([sys.executable, "-c", script, json.dumps(who)], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)  # type: ignore[call-overload]  # fmt: skip


@pytest.fixture
def cross_uid() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="ts-xuid-", dir="/tmp"))  # not under root's 0700 pytest dir
    try:
        os.chmod(base, 0o755)
        (base / "shm").mkdir(mode=0o1777)
        os.chmod(base / "shm", 0o1777)  # like /dev/shm
        for d in ("run", "store"):
            (base / d).mkdir()
            os.chown(base / d, SIDECAR_UID, SIDECAR_UID)
        os.chmod(base / "run", 0o755)
        os.chmod(base / "store", 0o700)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@root_only
def test_recorder_of_another_user_in_the_sockets_group_writes_through_shared_memory(cross_uid: Path) -> None:
    """Sidecar as uid 61901, recorder as uid 61902, both in group 61900 (``--socket-group``): the
    socket is 0660 in that group, the recorder's pool 0640 in it, and its records arrive and read
    back over shared memory. Before: the socket was 0755 (no one else could connect) and the pool
    0600 (the sidecar could not read it). A user outside the group cannot connect."""
    base = cross_uid
    sock = base / "run" / "s.sock"
    config = dict(storage=f"file://{base / 'store'}", wal_dir=None, port=0, metrics_port=None, unix_socket=str(sock),
                  shm_dir=str(base / "shm"), flush_interval_s=0.1, socket_group=str(GROUP))  # fmt: skip
    side = _as_user(_SIDECAR, SIDECAR_UID, [GROUP], {"config": config}, stdin=subprocess.PIPE, cwd=base)
    try:
        assert side.stdout is not None
        line = side.stdout.readline()
        assert line, side.stderr.read() if side.stderr else ""
        assert json.loads(line)["port"] > 0
        st = os.lstat(sock)
        assert (stat.S_IMODE(st.st_mode), st.st_gid, st.st_uid) == (0o660, GROUP, SIDECAR_UID)

        n, traj = 48, "xuid-t0"
        args = dict(address=f"unix://{sock}", writer="xuid-w", shm_dir=str(base / "shm"), seed=11, n=n, traj=traj,
                    flush_s=30, give_up_s=30)  # fmt: skip
        rec = _as_user(_RECORDER, RECORDER_UID, [GROUP], args, cwd=base)
        out, err = rec.communicate(timeout=120)
        assert rec.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got["ok"] and got["flushed"] and got["error"] is None, got
        assert (got["pool_mode"], got["pool_gid"]) == (0o640, GROUP)
        assert got["stats"]["rejected_messages"] == 0

        rng = np.random.default_rng(11)
        codes = rng.integers(0, 256, (n, SITE.code_bytes), dtype=np.uint8)
        scales = rng.integers(0, 256, (n, SITE.scale_bytes), dtype=np.uint8)
        # acknowledged without a WAL = committed to storage: read it there (as root)
        reader = GuidanceReader(f"file://{base / 'store'}", SPEC.run, sites=[SITE.name], prefetch=False)
        try:
            rows = reader.read_host([(traj, 0, n)])[SITE.name]
        finally:
            reader.close()
        assert rows.valid.all()
        assert np.array_equal(rows.codes, codes) and np.array_equal(rows.scales, scales)

        # not in the group: the socket refuses the connection, nothing is acknowledged
        args.update(writer="outsider", traj="outsider-t0", flush_s=3)
        outsider = _as_user(_RECORDER, OUTSIDER_UID, [], args, cwd=base)
        out, err = outsider.communicate(timeout=120)
        assert outsider.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got["ok"] and not got["flushed"] and got["stats"]["acked_messages"] == 0, got
    finally:
        if side.stdin is not None:
            side.stdin.close()
        try:
            side.wait(30)
        except subprocess.TimeoutExpired:
            side.kill()


def test_a_sidecar_refused_at_the_wal_lock_leaves_no_socket_behind(tmp_path: Path) -> None:
    """Before: the second sidecar bound its unix socket (and peer endpoint) before it took the WAL
    lock, and its refusal left the socket file behind."""
    from tracestore.server.config import ServerConfig
    from tracestore.server.rpc.service import Sidecar

    from tracestore.errors import ConfigError

    def config(name: str) -> ServerConfig:
        return ServerConfig(storage=f"file://{tmp_path / 'data'}", wal_dir=str(tmp_path / "wal"), port=0,
                            metrics_port=None, unix_socket=str(tmp_path / f"{name}.sock"))  # fmt: skip

    first = Sidecar(config("first")).start()
    try:
        with pytest.raises(ConfigError, match="in use by another running sidecar"):
            Sidecar(config("second")).start()
        assert not (tmp_path / "second.sock").exists(), "the refused sidecar left its socket behind"
        assert (tmp_path / "first.sock").exists()
    finally:
        first.stop(5)


# -- TCP beside the socket ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "tcp"),
    [([], False), (["--port", "0"], True)],
    ids=["no-port-given:unix-only", "port-given:tcp-too"],
)
def test_without_tokens_tcp_listens_beside_the_socket_only_when_asked(
    tmp_path: Path, extra: list[str], tcp: bool
) -> None:
    """Before: `serve --unix-socket PATH` without tokens also listened on 127.0.0.1:7433, where any
    local user (uid 65534 in the report) read, wrote and fenced every run whatever the socket's mode."""
    sock, ready = tmp_path / "ts.sock", tmp_path / "ready.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACESTORE_")}
    cmd = [sys.executable, "-m", "tracestore.cli", "serve", "--storage", f"file://{tmp_path}/data", "--wal-dir", "off",
           "--metrics-port", "off", "--unix-socket", str(sock), "--ready-file", str(ready), *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):
            if ready.exists() or proc.poll() is not None:
                break
            import time

            time.sleep(0.05)
        assert ready.exists(), proc.communicate(timeout=10)[0] if proc.poll() is not None else "no ready file"
        port = json.loads(ready.read_text())["port"]
        assert (port is not None) == tcp
        if not tcp:  # nothing listens on the default port of this sidecar
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", 7433)) != 0
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            grpc.channel_ready_future(ch).result(timeout=10)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    if not tcp:
        assert "no TCP port" in out, out
