"""Unix-socket peers authorized by uid/gid: the token file's ``uid:``/``gid:``/``user:``/``group:``
entries, peer tokens from ``<socket>.peer`` (the kernel's SO_PEERCRED, signed by the sidecar),
real gRPC over the unix socket, and (as root) processes of other users in the socket's group."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tracestore.client import RolloutRecorder, SiteOutput
from tracestore.client.transport import channel
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import Sidecar
from tracestore.server.security.auth import TokenFile, parse_token_file
from tracestore.server.security.peer_auth import PeerTokens
from tracestore.server.testing import SPEC, make_chunk, write_request

from tests.security.test_auth import code_of, stream, token_line
from tracestore.errors import ConfigError
from tracestore.peer import PEER_SUFFIX, TOKEN_TTL_S, fetch_peer_token
from tracestore.storage.store import Store
from tracestore.v1 import tracestore_pb2 as pb

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: runs processes as other users")
ME = os.getuid()
ADMIN_TOKEN = "tok-admin-" + "x" * 20


def test_peer_tokens_are_signed_expire_and_name_their_peer() -> None:
    t = PeerTokens()
    tok = t.mint(1000, 2000)
    assert t.verify(tok) == (1000, 2000)
    assert PeerTokens().verify(tok) is None  # another sidecar's key
    body, _, sig = tok.rpartition(".")
    forged = body.replace("peer1.1000.", "peer1.0.", 1) + "." + sig  # claims root with the same signature
    assert t.verify(forged) is None
    assert t.verify(tok[:-1] + ("0" if tok[-1] != "0" else "1")) is None
    assert t.verify(t.mint(1, 1, now=time.time() - TOKEN_TTL_S - 5)) is None  # expired
    for junk in ("", "peer1.", "peer1.a.b.c.d.e", "sha256:abc", "peer1..."):
        assert t.verify(junk) is None


def test_token_file_peer_entries(tmp_path: Path) -> None:
    p = tmp_path / "t"
    p.write_text(
        token_line("a", "admin", "ops") + "\n"
        "uid:1000 write:rl-*,read:rl-* rollout\n"
        "gid:2000 read:*\n"
        "user:root read:root-*\n"
        "group:root write:g-*  # a comment\n"
    )
    entries, rules = parse_token_file(p)
    assert [e[1].name for e in entries] == ["ops"]
    assert {k: (v.name, v.write, v.read) for k, v in rules.items()} == {
        ("uid", 1000): ("rollout", ("rl-*",), ("rl-*",)),
        ("gid", 2000): ("gid:2000", (), ("*",)),
        ("uid", 0): ("uid:0", (), ("root-*",)),
        ("gid", 0): ("gid:0", ("g-*",), ()),
    }
    tf = TokenFile(p)
    assert tf.peer_rules == 4 and len(tf) == 1
    assert tf.authenticate_peer(1000, 2000).name == "rollout"  # the uid's entry wins
    assert tf.authenticate_peer(1001, 2000).name == "gid:2000"
    assert tf.authenticate_peer(1001, 2001) is None
    for bad, words in (
        ("uid:x1 write:*", "is not a number"),
        ("uid: write:*", "expected 'uid:<number>"),
        ("user:no-such-user-ts write:*", "is not a user on this host"),
        ("group:no-such-group-ts write:*", "is not a group on this host"),
        ("uid:0 write:*\nuser:root read:*", "uid:0 is listed twice"),
        ("gid:5 delete:*", "scope 'delete:*'"),
    ):
        p.write_text(bad + "\n")
        with pytest.raises(ConfigError, match=re.escape(words)):
            parse_token_file(p)


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ts-peer-", dir="/tmp"))  # reachable by other users (root tests)
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _sidecar(base: Path, rules: str, **kw: object) -> Sidecar:
    (base / "tokens").write_text(token_line(ADMIN_TOKEN, "admin,write:*,read:*", "all") + "\n" + rules)
    cfg = ServerConfig(storage=f"file://{base / 'store'}", wal_dir=str(base / "wal"), port=0, metrics_port=None,
                       unix_socket=str(base / "s.sock"), flush_interval_s=0.05, auth_tokens=str(base / "tokens"),
                       **kw)  # type: ignore[arg-type]  # fmt: skip
    sc = Sidecar(cfg).start()
    Store(cfg.storage).put_run(SPEC)
    return sc


def _write(ch: grpc.Channel, traj: str, writer: str, token: str | None = None) -> str:
    req = write_request(1, [make_chunk(traj, 0, 2)], writer=writer).SerializeToString()
    call = ch.stream_stream("/tracestore.v1.TraceStore/Write")
    md = None if token is None else [("authorization", f"Bearer {token}")]
    return code_of(lambda: list(call(iter([req]), metadata=md, timeout=20)))


def test_unix_peers_by_uid_through_the_client_and_refusals(base: Path) -> None:
    sc = _sidecar(base, f"uid:{ME} read:run-a me\n")
    sock = base / "s.sock"
    try:
        peer = Path(str(sock) + PEER_SUFFIX)
        assert stat.S_ISSOCK(os.lstat(peer).st_mode)
        assert stat.S_IMODE(os.lstat(peer).st_mode) == stat.S_IMODE(os.lstat(sock).st_mode) == 0o600
        assert sorted(p.name for p in base.iterdir()) == ["s.sock", "s.sock.peer", "store", "tokens", "wal"]
        with channel(f"unix://{sock}") as ch:  # the client fetches a peer token for every call
            assert _write(ch, "by-uid", "w-me") == "PERMISSION_DENIED"  # uid entry: read only
            stat_call = ch.unary_unary("/tracestore.v1.TraceStore/Stat")
            req = pb.StatRequest(run="run-a").SerializeToString()
            assert pb.StatResponse.FromString(stat_call(req, timeout=10)).version
        with grpc.insecure_channel(f"unix://{sock}") as raw:
            # without a token the uid check could be skipped: refused, saying what to send
            _, err = stream(raw, [write_request(1, [make_chunk("x", 0, 2)], writer="w0").SerializeToString()], None)
            assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "uid/gid" in (err.details() or "")
            assert _write(raw, "x", "w1", "peer1.0.0.9999999999.00.forged") == "UNAUTHENTICATED"
            assert _write(raw, "x", "w2", ADMIN_TOKEN) == "OK"  # a bearer token works on the socket too
        token = fetch_peer_token(str(sock))
        with grpc.insecure_channel(f"127.0.0.1:{sc.port}") as tcp:  # a peer token is good on the socket only
            assert _write(tcp, "x", "w3", token) == "UNAUTHENTICATED"
        # the file now lets this uid write: new calls follow it (SIGHUP reload)
        (base / "tokens").write_text(
            token_line(ADMIN_TOKEN, "admin", "all") + f"\nuid:{ME} write:run-a,read:run-a me\n"
        )
        sc.reload()
        rec = RolloutRecorder(f"unix://{sock}", SPEC, "rec-me", staging_bytes=1 << 20, linger_s=0.0, give_up_s=30)
        site = SPEC.site("layers.1.mlp.input")
        codes = np.full((4, site.code_bytes), 7, np.uint8)
        assert rec.record_forward(
            [("rec-traj", 0, 4)], {site.name: SiteOutput(codes, np.ones((4, site.scale_bytes), np.uint8), 0.5)}
        )
        assert rec.flush(30) and rec.error is None, rec.stats
        rec.close(1)
        # no uid/gid entries left: unix peers pass by the socket's permissions again, token or not
        (base / "tokens").write_text(token_line(ADMIN_TOKEN, "admin", "all") + "\n")
        sc.reload()
        with channel(f"unix://{sock}") as ch, grpc.insecure_channel(f"unix://{sock}") as raw:
            assert _write(ch, "after", "w4") == "OK"
            assert _write(raw, "after2", "w5") == "OK"
    finally:
        sc.stop(5)
    assert not os.path.exists(str(sock) + PEER_SUFFIX)  # removed with the socket


def test_a_peer_token_is_good_only_at_its_sidecar_and_while_its_rule_is_listed(base: Path) -> None:
    """A peer token is a bearer token for 60 s, so the audit asked what else it opens: another
    sidecar (its own key) refuses it on its socket, and once a SIGHUP removes the uid's entry the
    same unexpired token is refused (the entry is looked up on every call, not when minted)."""
    other_base = base / "other"
    other_base.mkdir()
    sc = _sidecar(base, f"uid:{ME} write:run-a me\ngid:{ME + 1} read:run-a someone-else\n")
    other = _sidecar(other_base, f"uid:{ME} write:run-a me\n")
    try:
        token = fetch_peer_token(str(base / "s.sock"))
        with grpc.insecure_channel(f"unix://{other_base / 's.sock'}") as raw:
            assert _write(raw, "t0", "w0", token) == "UNAUTHENTICATED"
        with grpc.insecure_channel(f"unix://{base / 's.sock'}") as raw:
            assert _write(raw, "t1", "w1", token) == "OK"
            (base / "tokens").write_text(token_line(ADMIN_TOKEN, "admin", "all") + f"\ngid:{ME + 1} read:run-a x\n")
            sc.reload()
            assert _write(raw, "t2", "w2", token) == "UNAUTHENTICATED"
    finally:
        other.stop(5)
        sc.stop(5)


def test_no_peer_endpoint_without_a_token_file_or_unix_socket(base: Path) -> None:
    cfg = ServerConfig(storage=f"memory://peer-{os.getpid()}", wal_dir=None, port=0, metrics_port=None,
                       unix_socket=str(base / "s.sock"))  # fmt: skip
    sc = Sidecar(cfg).start()
    try:
        assert not os.path.exists(str(base / "s.sock") + PEER_SUFFIX)
        with pytest.raises(ConfigError, match="cannot get a peer token"):
            fetch_peer_token(str(base / "s.sock"))
    finally:
        sc.stop(1)


# -- other users -----------------------------------------------------------------------------------

GROUP, READER_UID, OUTSIDER_UID = 61910, 61911, 61912

# Everything is imported and the request built as root (the interpreter lives where other users
# cannot read), then the process becomes the other user for the call.
_CALL = """
import json, os, sys, socket
import grpc
import tracestore.peer
from tracestore.client.transport import channel
from tracestore.server.testing import make_chunk, write_request
a = json.loads(sys.argv[1])
req = write_request(1, [make_chunk(a["traj"], 0, 2)], writer=a["writer"]).SerializeToString()
os.setgroups(a["groups"]); os.setgid(a["gid"]); os.setuid(a["uid"])
out = {"uid": os.getuid()}
with channel(a["address"]) as ch:
    try:
        list(ch.stream_stream("/tracestore.v1.TraceStore/Write")(iter([req]), timeout=20))
        out["code"] = "OK"
    except grpc.RpcError as exc:
        out["code"], out["details"] = exc.code().name, exc.details()
print(json.dumps(out), flush=True)
"""


def _call_as(uid: int, sock: Path, traj: str) -> dict[str, object]:
    who = {"uid": uid, "gid": uid, "groups": [GROUP], "address": f"unix://{sock}", "traj": traj, "writer": f"w{uid}"}
    p = subprocess.run([sys.executable, "-c", _CALL, json.dumps(who)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@root_only
def test_other_users_in_the_sockets_group_are_told_apart_by_uid_and_gid(base: Path) -> None:
    """Two users of the socket's group connect (mode 0660): each gets its own entry's scopes — the
    reader's uid entry allows no writes, the outsider has no entry (UNAUTHENTICATED) until a gid
    entry for its primary group is added. Before, grpcio's anonymous unix peers all got every scope."""
    sc = _sidecar(base, f"uid:{READER_UID} read:run-a reader\n", socket_group=str(GROUP))
    sock = base / "s.sock"
    try:
        peer = os.lstat(str(sock) + PEER_SUFFIX)
        assert (stat.S_IMODE(peer.st_mode), peer.st_gid) == (0o660, GROUP)
        got = _call_as(READER_UID, sock, "r0")
        assert got["code"] == "PERMISSION_DENIED" and "reader" in str(got["details"]), got
        got = _call_as(OUTSIDER_UID, sock, "o0")
        assert got["code"] == "UNAUTHENTICATED" and f"uid {OUTSIDER_UID}" in str(got["details"]), got
        (base / "tokens").write_text(f"uid:{READER_UID} read:run-a reader\ngid:{OUTSIDER_UID} write:run-a\n")
        sc.reload()
        assert _call_as(OUTSIDER_UID, sock, "o1")["code"] == "OK"
        assert _call_as(READER_UID, sock, "r1")["code"] == "PERMISSION_DENIED"  # its uid entry wins
    finally:
        sc.stop(5)


# Every RPC of the sidecar, as another user: a peer token for each call (the client's channel) and
# no token (a raw channel). Requests are built as root before the process becomes that user.
_EVERY_RPC = """
import json, os, sys
import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
import tracestore.peer
from tracestore.client.transport import channel
from tracestore.server.testing import make_chunk, write_request
from tracestore.v1 import tracestore_pb2 as pb
a = json.loads(sys.argv[1])
S = "/tracestore.v1.TraceStore/"
writer, traj = "w-" + a["tag"], "t-" + a["tag"]
write = write_request(1, [make_chunk(traj, 0, 2)], writer=writer).SerializeToString()
seal = pb.SealRequest(run="run-a", writer=writer, epoch=1, sequence=2,
                      seals=[pb.TrajectorySeal(trajectory=traj, n_tokens=2)]).SerializeToString()
read = pb.ReadRequest(run="run-a", plan=[pb.Segment(trajectory="stored", token_start=0, token_end=2)],
                      sites=["layers.1.mlp.input"])
read = read.SerializeToString()
stat_a, stat_all = pb.StatRequest(run="run-a").SerializeToString(), pb.StatRequest().SerializeToString()
health = health_pb2.HealthCheckRequest().SerializeToString()
refl = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
os.setgroups(a["groups"]); os.setgid(a["gid"]); os.setuid(a["uid"])

def code(fn):
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code().name
    except Exception as exc:  # no channel at all (e.g. the socket refuses this user)
        return type(exc).__name__
    return "OK"

def storage_url(ch, req):
    return pb.StatResponse.FromString(ch.unary_unary(S + "Stat")(req, timeout=20)).storage_url

out = {}
for how in ("peer", "raw"):
    try:
        ch = channel(a["address"]) if how == "peer" else grpc.insecure_channel(a["address"])
    except Exception as exc:
        out[how] = {"channel": type(exc).__name__}
        continue
    with ch:
        out[how] = {
            "Write": code(lambda: list(ch.stream_stream(S + "Write")(iter([write]), timeout=20))),
            "Seal": code(lambda: ch.unary_unary(S + "Seal")(seal, timeout=20)),
            "Read": code(lambda: list(ch.unary_stream(S + "Read")(read, timeout=20))),
            "Stat run-a": code(lambda: ch.unary_unary(S + "Stat")(stat_a, timeout=20)),
            "Stat": code(lambda: ch.unary_unary(S + "Stat")(stat_all, timeout=20)),
            "health": code(lambda: ch.unary_unary("/grpc.health.v1.Health/Check")(health, timeout=20)),
            "reflection": code(lambda: list(ch.stream_stream(
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(iter([refl]), timeout=20))),
        }
        if out[how]["Stat"] == "OK":
            out[how]["storage_url"] = storage_url(ch, stat_all)
print(json.dumps(out), flush=True)
"""


def _every_rpc_as(uid: int, groups: list[int], sock: Path) -> dict[str, dict[str, str]]:
    a = {"uid": uid, "gid": uid, "groups": groups, "address": f"unix://{sock}", "tag": str(uid)}
    p = subprocess.run([sys.executable, "-c", _EVERY_RPC, json.dumps(a)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@root_only
def test_the_uid_rule_covers_every_rpc_of_a_unix_peer(base: Path) -> None:
    """Issue 42's audit of "a unix peer's uid rule applies to everything it does": each RPC, tried
    by users of the socket's group. A uid with no entry is refused every TraceStore RPC (Write, Seal,
    Read, Stat with and without a run), with a peer token or with none; a read-only uid entry gets
    exactly its scopes (no Write or Seal, Read and Stat of its run, not the storage URL); without a
    token every TraceStore RPC is refused even for a listed uid. Health and reflection answer every
    peer the socket admits, by design (probes need them; they carry no run data). A user outside
    the socket's group reaches nothing at all."""
    sc = _sidecar(base, f"uid:{READER_UID} read:run-a reader\n", socket_group=str(GROUP))
    sock = base / "s.sock"
    try:
        with grpc.insecure_channel(f"unix://{sock}") as admin:  # a trajectory to read
            assert _write(admin, "stored", "w-admin", ADMIN_TOKEN) == "OK"
        assert sc.engine is not None and sc.engine.flush(30)
        traced = ("Write", "Seal", "Read", "Stat run-a", "Stat")
        open_ = {"health": "OK", "reflection": "OK"}
        refused = {rpc: "UNAUTHENTICATED" for rpc in traced} | open_
        outsider = _every_rpc_as(OUTSIDER_UID, [GROUP], sock)
        assert outsider == {"peer": refused, "raw": refused}, outsider
        reader = _every_rpc_as(READER_UID, [GROUP], sock)
        expected = {"Write": "PERMISSION_DENIED", "Seal": "PERMISSION_DENIED", "Read": "OK", "Stat run-a": "OK",
                    "Stat": "OK", "storage_url": ""} | open_  # fmt: skip
        assert reader == {"peer": expected, "raw": refused}, reader
        stranger = _every_rpc_as(OUTSIDER_UID + 1, [], sock)  # not in the socket's group
        unreachable = {rpc: "UNAVAILABLE" for rpc in (*traced, *open_)}
        assert stranger == {"peer": unreachable, "raw": unreachable}, stranger
    finally:
        sc.stop(5)
