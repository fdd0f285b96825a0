"""Bearer tokens and per-RPC authorization over real gRPC (loopback TCP and a unix socket).

Each RPC (Write, Seal, Read, Stat) is called by every kind of caller and must be allowed,
UNAUTHENTICATED or PERMISSION_DENIED exactly as the table says; non-admins never see the storage
URL (Stat or error details); health and reflection stay open; the token file reloads; a sidecar
refuses to serve a non-loopback host without TLS and tokens unless told --insecure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tracestore.client import GuidanceReader, RolloutRecorder, SiteOutput
from tracestore.client.transport import is_sidecar_address, resolve_token
from tracestore.server.cli import storage_options_from
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import Sidecar
from tracestore.server.security.auth import TokenFile, load_token_file
from tracestore.server.testing import SPEC, make_chunk, wait_for, write_request

from tracestore.errors import ConfigError, PermissionDeniedError, UnauthenticatedError
from tracestore.records import RunSpec
from tracestore.storage.store import Store
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import run_spec_to_pb

SITE = "layers.1.mlp.input"
OTHER = RunSpec("other-1", SPEC.sites)
# caller -> (token, scopes); None: no token at all, "bad": a token the file does not list
CALLERS = {
    "writer": "write:run-a",
    "reader": "read:run-a",
    "other": "write:other-*,read:other-*",
    "admin": "admin",
    "all": "admin,write:*,read:*",
}
TOKENS = {name: "tok-" + secrets.token_urlsafe(24) for name in CALLERS}


def token_line(token: str, scopes: str, name: str | None = None) -> str:
    return f"sha256:{hashlib.sha256(token.encode()).hexdigest()} {scopes}" + (f" {name}" if name else "")


def write_tokens(path: Path, callers: dict[str, str] = CALLERS, tokens: dict[str, str] = TOKENS) -> None:
    lines = ["# test tokens", *(token_line(tokens[n], s, n) for n, s in callers.items())]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    d = tmp_path_factory.mktemp("auth")
    write_tokens(d / "tokens")
    cfg = ServerConfig(storage=f"file://{d / 'data'}", wal_dir=str(d / "wal"), port=0, metrics_port=None,
                       unix_socket=str(d / "s.sock"), flush_interval_s=0.05, auth_tokens=str(d / "tokens"))  # fmt: skip
    sc = Sidecar(cfg).start()
    store = Store(cfg.storage)
    store.put_run(SPEC)
    store.put_run(OTHER)
    # one trajectory of run-a to read back, written by a caller allowed to
    with grpc.insecure_channel(f"127.0.0.1:{sc.port}") as ch:
        req = write_request(1, [make_chunk("readable", 0, 4)], writer="setup").SerializeToString()
        acks, err = stream(ch, [req], "all")
        assert err is None and acks, err
    assert sc.engine is not None and sc.engine.flush(20)
    yield sc
    sc.stop(5)


@pytest.fixture(scope="module")
def channel(sidecar: Sidecar) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{sidecar.port}") as ch:
        yield ch


def meta(who: str | None) -> list[tuple[str, str]] | None:
    if who is None:
        return None
    return [("authorization", f"Bearer {'tok-not-listed' if who == 'bad' else TOKENS[who]}")]


def stream(
    ch: grpc.Channel, requests: Sequence[bytes], who: str | None
) -> tuple[list[pb.WriteResponse], grpc.RpcError | None]:
    call = ch.stream_stream("/tracestore.v1.TraceStore/Write")
    out = []
    try:
        for raw in call(iter(requests), metadata=meta(who), timeout=20):
            out.append(pb.WriteResponse.FromString(raw))
    except grpc.RpcError as exc:
        return out, exc
    return out, None


def code_of(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


WHO = [None, "bad", "writer", "reader", "other", "admin", "all"]
TABLE = {  # RPC on run-a -> expected code per caller, in WHO order
    "Write": ["UNAUTHENTICATED", "UNAUTHENTICATED", "OK", "PERMISSION_DENIED", "PERMISSION_DENIED",
              "PERMISSION_DENIED", "OK"],
    "Seal": ["UNAUTHENTICATED", "UNAUTHENTICATED", "OK", "PERMISSION_DENIED", "PERMISSION_DENIED",
             "PERMISSION_DENIED", "OK"],
    "Read": ["UNAUTHENTICATED", "UNAUTHENTICATED", "PERMISSION_DENIED", "OK", "PERMISSION_DENIED",
             "PERMISSION_DENIED", "OK"],
    "Stat(run-a)": ["UNAUTHENTICATED", "UNAUTHENTICATED", "OK", "OK", "PERMISSION_DENIED", "OK", "OK"],
    "Stat()": ["UNAUTHENTICATED", "UNAUTHENTICATED", "OK", "OK", "OK", "OK", "OK"],
}  # fmt: skip


@pytest.mark.parametrize("rpc", sorted(TABLE))
def test_scopes_table(rpc: str, channel: grpc.Channel) -> None:
    got = []
    for i, who in enumerate(WHO):
        writer = f"tbl-{rpc[:4].lower()}-{i}"
        if rpc == "Write":
            req = write_request(1, [make_chunk(f"tbl-{i}", 0, 2)], writer=writer).SerializeToString()
            _, err = stream(channel, [req], who)
            got.append("OK" if err is None else err.code().name)
        elif rpc == "Seal":
            traj = pb.TrajectorySeal(trajectory=f"tbl-s{i}", n_tokens=2, sites=[SITE])
            seal = pb.SealRequest(run=SPEC.run, writer=writer, epoch=1, sequence=1, seals=[traj])
            call = channel.unary_unary("/tracestore.v1.TraceStore/Seal")
            got.append(code_of(lambda: call(seal.SerializeToString(), metadata=meta(who), timeout=20)))  # noqa: B023
        elif rpc == "Read":
            read = pb.ReadRequest(run=SPEC.run, plan=[pb.Segment(trajectory="readable", token_start=0, token_end=4)],
                                  sites=[SITE])  # fmt: skip
            call = channel.unary_stream("/tracestore.v1.TraceStore/Read")
            got.append(code_of(lambda: list(call(read.SerializeToString(), metadata=meta(who), timeout=20))))  # noqa: B023
        else:
            stat = pb.StatRequest(run=SPEC.run if "run-a" in rpc else "")
            call = channel.unary_unary("/tracestore.v1.TraceStore/Stat")
            got.append(code_of(lambda: call(stat.SerializeToString(), metadata=meta(who), timeout=20)))  # noqa: B023
    assert dict(zip(map(str, WHO), got, strict=True)) == dict(zip(map(str, WHO), TABLE[rpc], strict=True))


def test_stream_carrying_another_run_is_denied_at_that_message(channel: grpc.Channel) -> None:
    one = write_request(1, [make_chunk("mixed", 0, 2)], writer="mixed").SerializeToString()
    two = write_request(2, [make_chunk("mixed", 2, 2, spec=OTHER)], writer="mixed", spec=OTHER).SerializeToString()
    _, err = stream(channel, [one, two], "writer")
    assert err is not None and err.code() == grpc.StatusCode.PERMISSION_DENIED, err
    assert "other-1" in (err.details() or "")
    # the writer is told which message was refused (it drops that one instead of resending it)
    assert dict(err.trailing_metadata() or ())["tracestore-failed-sequence"] == "2"


def test_declaring_a_run_needs_write_on_it(channel: grpc.Channel, sidecar: Sidecar) -> None:
    spec = RunSpec("secret-run", SPEC.sites)
    req = write_request(1, [make_chunk("x", 0, 2, spec=spec)], writer="decl", spec=spec, declare=True)
    _, err = stream(channel, [req.SerializeToString()], "writer")
    assert err is not None and err.code() == grpc.StatusCode.PERMISSION_DENIED, err
    assert "secret-run" not in [p.name for p in Path(sidecar.config.storage.removeprefix("file://")).iterdir()]
    # a run spec riding along for another run than the message's is checked too
    req = write_request(1, [make_chunk("x", 0, 2)], writer="decl2")
    req.run_spec.CopyFrom(run_spec_to_pb(spec))
    _, err = stream(channel, [req.SerializeToString()], "writer")
    assert err is not None and err.code() == grpc.StatusCode.PERMISSION_DENIED, err


def test_stat_shows_only_visible_runs_and_storage_url_to_admins(channel: grpc.Channel, sidecar: Sidecar) -> None:
    req = write_request(1, [make_chunk("o", 0, 2, spec=OTHER)], writer="other-writer", spec=OTHER).SerializeToString()
    assert stream(channel, [req], "other")[1] is None
    call = channel.unary_unary("/tracestore.v1.TraceStore/Stat")

    def stat(who: str, run: str = "") -> pb.StatResponse:
        return pb.StatResponse.FromString(call(pb.StatRequest(run=run).SerializeToString(), metadata=meta(who)))

    for who in ("admin", "all"):
        s = stat(who)
        assert s.storage_url == sidecar.config.storage
        assert {w.run for w in s.writers} == {SPEC.run, OTHER.run}
    owners = {(w.run, w.writer): w.owner for w in sidecar.engine.writers.values()}
    for who in ("writer", "reader", "other"):
        s = stat(who)
        assert s.storage_url == ""
        assert sidecar.config.storage not in str(s)
        # only its own writer ids (before: every writer of the runs it may see, other identities' too)
        seen = {(w.run, w.writer) for w in s.writers}
        assert seen == {k for k, owner in owners.items() if owner == who}, (who, seen)
    assert {w.writer for w in stat("other").writers} == {"other-writer"}
    assert not stat("reader").writers
    s = stat("reader", SPEC.run)
    assert s.storage_url == "" and [x.name for x in s.run_spec.sites] == list(SPEC.site_names)


def test_error_details_hide_the_storage_location_from_non_admins(channel: grpc.Channel, sidecar: Sidecar) -> None:
    """An undeclared run's NOT_FOUND names the store; only an admin is told where it is."""
    ghost = RunSpec("other-ghost", SPEC.sites)  # never declared
    req = write_request(1, [make_chunk("g", 0, 2, spec=ghost)], writer="ghost", spec=ghost).SerializeToString()
    root = sidecar.config.storage.removeprefix("file://")
    _, err = stream(channel, [req], "other")
    assert err is not None and err.code() == grpc.StatusCode.NOT_FOUND, err
    details = err.details() or ""
    assert "<storage>" in details and root not in details and sidecar.config.storage not in details, details
    _, err = stream(channel, [req], "all")
    assert err is not None and root in (err.details() or ""), err.details()


def test_health_and_reflection_need_no_token(channel: grpc.Channel) -> None:
    h = health_pb2_grpc.HealthStub(channel)
    assert h.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
    r = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert "tracestore.v1.TraceStore" in {s.name for s in resp.list_services_response.service}


def test_unix_socket_peers_pass_by_socket_permissions(sidecar: Sidecar) -> None:
    """Without uid:/gid: entries in the token file (tests/security/test_peer_auth.py has them), no
    token on the unix socket means the socket's owner/group, while a token that is presented must
    still be a valid one."""
    with grpc.insecure_channel(f"unix://{sidecar.config.unix_socket}") as ch:
        req = write_request(1, [make_chunk("via-unix", 0, 2)], writer="unix-w").SerializeToString()
        assert stream(ch, [req], None)[1] is None
        _, err = stream(ch, [req], "bad")
        assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_unix_needs_token(tmp_path: Path) -> None:
    write_tokens(tmp_path / "tokens")
    cfg = ServerConfig(storage=f"memory://auth-unix-{os.getpid()}", wal_dir=str(tmp_path / "wal"), port=0,
                       metrics_port=None,
                       unix_socket=str(tmp_path / "s.sock"), auth_tokens=str(tmp_path / "tokens"),
                       unix_needs_token=True)  # fmt: skip
    sc = Sidecar(cfg).start()
    try:
        Store(cfg.storage).put_run(SPEC)
        with grpc.insecure_channel(f"unix://{cfg.unix_socket}") as ch:
            req = write_request(1, [make_chunk("u", 0, 2)], writer="u").SerializeToString()
            _, err = stream(ch, [req], None)
            assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stream(ch, [req], "writer")[1] is None
    finally:
        sc.stop(5)


def test_recorder_and_reader_with_tokens(sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK sends the token itself (metadata over a plaintext loopback channel, since gRPC
    refuses call credentials there); a reader without read scope gets PermissionDeniedError."""
    address = f"127.0.0.1:{sidecar.port}"
    rng = np.random.default_rng(3)
    site = SPEC.site(SITE)
    codes = rng.integers(0, 256, (5, site.code_bytes), dtype=np.uint8)
    scales = rng.integers(0, 256, (5, site.scale_bytes), dtype=np.uint8)
    rec = RolloutRecorder(address, SPEC, "sdk-writer", staging_bytes=4 << 20, token=TOKENS["writer"])
    try:
        assert rec.record_forward([("sdk-t", 0, 5)], {SITE: SiteOutput(codes, scales, 0.5)})
        rec.finish("sdk-t", 6)
        assert rec.flush(30), rec.stats
        assert rec.stats["unguided"] == 0, rec.stats
    finally:
        rec.close()
    monkeypatch.setenv("TRACESTORE_TOKEN", TOKENS["reader"])  # the environment's token
    with GuidanceReader(address, SPEC.run, sites=[SITE], prefetch=False) as reader:
        rows = reader.read_host([("sdk-t", 0, 5)])[SITE]
        assert rows.codes.tobytes() == codes.tobytes() and rows.scales.tobytes() == scales.tobytes()
    for token, error in ((TOKENS["writer"], PermissionDeniedError), ("tok-not-listed", UnauthenticatedError)):
        reader = GuidanceReader(address, SPEC.run, sites=[SITE], prefetch=False, token=token)
        with reader, pytest.raises(error):
            reader.read_host([("sdk-t", 0, 5)])


def test_recorder_without_write_scope_drops_its_records(sidecar: Sidecar) -> None:
    """PERMISSION_DENIED names the refused message (tracestore-failed-sequence), so the recorder
    marks its records unguided instead of resending them in a loop."""
    site = SPEC.site(SITE)
    rec = RolloutRecorder(f"127.0.0.1:{sidecar.port}", SPEC, "no-scope", staging_bytes=4 << 20,
                          token=TOKENS["reader"], give_up_s=30)  # fmt: skip
    try:
        zeros = np.zeros((2, site.code_bytes), np.uint8), np.zeros((2, site.scale_bytes), np.uint8)
        assert rec.record_forward([("denied", 0, 2)], {SITE: SiteOutput(*zeros, 0.5)})
        rec.finish("denied", 2)
        wait_for("the refused records unguided", lambda: rec.stats["unguided"] >= 1, timeout=20)
        before = rec.stats["reconnects"]
        time.sleep(1.0)
        assert rec.stats["reconnects"] - before <= 2, rec.stats  # no tight retry loop
    finally:
        rec.close()


def test_token_file_reload(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tokens"
    old, new = {"w": "tok-old-" + secrets.token_hex(8)}, {"w": "tok-new-" + secrets.token_hex(8)}
    write_tokens(path, {"w": "write:*"}, old)
    cfg = ServerConfig(storage=f"memory://auth-reload-{os.getpid()}", wal_dir=str(tmp_path / "wal"), port=0,
                       metrics_port=None, auth_tokens=str(path))  # fmt: skip
    sc = Sidecar(cfg).start()
    caplog.set_level(logging.DEBUG)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sc.port}") as ch:
            stat = ch.unary_unary("/tracestore.v1.TraceStore/Stat")

            def code(token: str) -> str:
                md = [("authorization", f"Bearer {token}")]
                return code_of(lambda: stat(pb.StatRequest().SerializeToString(), metadata=md))

            assert (code(old["w"]), code(new["w"])) == ("OK", "UNAUTHENTICATED")
            write_tokens(path, {"w": "write:*"}, new)
            sc.reload()
            assert (code(old["w"]), code(new["w"])) == ("UNAUTHENTICATED", "OK")
            path.write_text("this is not a token line\n")
            sc.reload()  # logged, and the tokens in use stay
            assert code(new["w"]) == "OK"
            assert any("reload of the token file failed" in r.getMessage() for r in caplog.records)
            # Before: a file that is not UTF-8 (an editor saved a comment as latin-1) raised
            # UnicodeDecodeError out of the SIGHUP handler and the sidecar exited.
            path.write_bytes((token_line(new["w"], "write:*") + "  # owner: Jos\xe9\n").encode("latin-1"))
            sc.reload()
            assert code(new["w"]) == "OK"
    finally:
        sc.stop(5)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert old["w"] not in text and new["w"] not in text  # tokens are never logged


def test_token_file_format(tmp_path: Path) -> None:
    p = tmp_path / "t"
    p.write_text(token_line("a", "write:run-*,read:run-?,admin", "ops") + "  # comment\n\n" + token_line("b", "read:x"))
    entries = load_token_file(p)
    assert [(e[1].name, e[1].write, e[1].read, e[1].admin) for e in entries] == [
        ("ops", ("run-*",), ("run-?",), True),
        (f"sha256:{hashlib.sha256(b'b').hexdigest()[:8]}", (), ("x",), False),
    ]
    tf = TokenFile(p)
    assert tf.authenticate("a") == entries[0][1] and tf.authenticate("c") is None
    for bad, words in (
        ("sha256:abc write:*", "expected 'sha256:"),
        (token_line("a", "delete:*"), "scope 'delete:*'"),
        (token_line("a", "write:"), "scope 'write:'"),
        (token_line("a", "write:*") + "\n" + token_line("a", "read:*"), "listed twice"),
        ("uid:x1000 write:*", "is not a number"),
        ("plain-token write:*", "expected 'sha256:"),
        ("sha256:" + "ab" * 32 + " read:*\nsha256:" + "ab" * 4 + "cd" * 28 + " read:*", "share the digest prefix"),
        ("uid:\u00b2 write:*", "is not a number"),  # str.isdigit() takes it, int() did not: a traceback
        ("user:a\x00b write:*", "is not a user"),  # getpwnam raised ValueError: a traceback
    ):
        p.write_text(bad + "\n")
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            load_token_file(p)
        assert "plain-token" not in str(e.value)
    p.write_bytes(b"# owner: Jos\xe9\n" + token_line("a", "read:x").encode())
    with pytest.raises(ConfigError, match=re.escape(f"{p}:1: not UTF-8 text")):
        load_token_file(p)
    # Writable by every user: anyone could add a token of their own (before: only a warning)
    p.write_text(token_line("a", "read:x"))
    p.chmod(0o666)
    with pytest.raises(ConfigError, match="writable by every user"):
        load_token_file(p)


@pytest.mark.parametrize("mode", [0o660, 0o664, 0o620, 0o670])
def test_a_token_file_its_group_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    """Group members could add an admin token for the next reload (before: accepted silently)."""
    p = tmp_path / "tokens"
    p.write_text(token_line("a", "read:x"))
    p.chmod(mode)
    with pytest.raises(ConfigError, match=re.escape(f"writable by its group (mode {mode:04o})")):
        load_token_file(p)


def test_a_token_file_every_user_can_read_loads_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    p = tmp_path / "tokens"
    p.write_text(token_line("a", "read:x"))
    for mode, warned in ((0o644, True), (0o640, False), (0o600, False)):
        p.chmod(mode)
        caplog.clear()
        with caplog.at_level("WARNING", logger="tracestore.server.security.auth"):
            load_token_file(p)
        assert ("readable by every user" in caplog.text) == warned, (oct(mode), caplog.text)


@pytest.mark.parametrize(
    ("kw", "ok"),
    [
        ({}, False),
        ({"insecure": True}, True),
        ({"auth_tokens": "t"}, False),
        ({"tls_cert": "c", "tls_key": "k"}, False),
        ({"tls_cert": "c", "tls_key": "k", "auth_tokens": "t"}, True),
    ],
)
def test_non_loopback_host_needs_tls_and_tokens_or_insecure(kw: dict[str, object], ok: bool) -> None:
    for host in ("0.0.0.0", "10.1.2.3", "::", "example.org"):
        if ok:
            ServerConfig(host=host, **kw)  # type: ignore[arg-type]
        else:
            with pytest.raises(ConfigError, match="--insecure"):
                ServerConfig(host=host, **kw)  # type: ignore[arg-type]
    for host in ("127.0.0.1", "127.0.0.5", "localhost", "::1", "[::1]"):
        ServerConfig(host=host)


def test_serve_refuses_a_non_loopback_host_and_binds_it_with_insecure(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tracestore.cli", "serve", "--storage", f"file://{tmp_path}/data", "--wal-dir", "off",
           "--port", "0", "--metrics-port", "off", "--host", "0.0.0.0"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACESTORE_")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "--insecure" in r.stderr, r.stderr
    _serves(host="0.0.0.0", dial="127.0.0.1", insecure=True)


def _serves(host: str, dial: str, **kw: object) -> None:
    """A sidecar bound to ``host`` answers health checks at ``dial``."""
    sc = Sidecar(ServerConfig(storage=f"memory://auth-bind-{os.getpid()}", wal_dir=None, host=host, port=0,
                              metrics_port=None, **kw)).start()  # type: ignore[arg-type]  # fmt: skip
    try:
        with grpc.insecure_channel(f"{dial}:{sc.port}") as ch:
            h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert h.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        sc.stop(5)


def _ns(**kw: str) -> argparse.Namespace:
    """``tracestore serve`` arguments as the CLI parses them (flags, then TRACESTORE_* variables)."""
    from tracestore.cli import build_parser

    argv = ["serve"]
    for name, value in kw.items():
        argv += [f"--{name.replace('_', '-')}", value]
    return build_parser().parse_args(argv)


def test_storage_options_from_file_env_or_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    secret = {"key": "AKIA-not-real", "secret": "s3cr3t-" + secrets.token_hex(4)}
    f = tmp_path / "opts.json"
    f.write_text(json.dumps(secret))
    f.chmod(0o600)
    monkeypatch.delenv("TRACESTORE_STORAGE_OPTIONS", raising=False)
    caplog.set_level(logging.WARNING)
    assert storage_options_from(_ns(storage_options_file=str(f))) == secret
    assert not caplog.records
    monkeypatch.setenv("TRACESTORE_STORAGE_OPTIONS", json.dumps(secret))
    assert storage_options_from(_ns()) == secret
    assert not caplog.records
    # On the command line (visible to every local user in /proc/PID/cmdline) only options that say
    # where, not who: before, credentials there were taken with a warning.
    with pytest.raises(ConfigError, match=r"names 'key', 'secret'.*/proc/PID/cmdline") as e:
        storage_options_from(_ns(storage_options=json.dumps(secret)))
    assert secret["secret"] not in str(e.value)
    with pytest.raises(ConfigError, match="names 'aws_secret_access_key'"):
        storage_options_from(_ns(storage_options=json.dumps({"client_kwargs": {"aws_secret_access_key": "x"}})))
    where = {"endpoint_url": "http://127.0.0.1:9000", "client_kwargs": {"region_name": "us-east-1"}}
    assert storage_options_from(_ns(storage_options=json.dumps(where))) == where
    f.chmod(0o644)
    caplog.clear()
    storage_options_from(_ns(storage_options_file=str(f)))
    assert any("readable by other users" in r.getMessage() for r in caplog.records)
    f.write_text('{"secret": "s3cr3t-leak" ')
    with pytest.raises(ConfigError, match="not JSON") as e:
        storage_options_from(_ns(storage_options_file=str(f)))
    assert "s3cr3t" not in str(e.value)
    with pytest.raises(ConfigError, match="not both"):
        storage_options_from(_ns(storage_options_file=str(f), storage_options="{}"))
    assert "s3cr3t" not in repr(ServerConfig(storage_options=secret))


def test_client_addresses_and_token_safety(monkeypatch: pytest.MonkeyPatch) -> None:
    for addr in ("127.0.0.1:7433", "grpcs://sidecar.example:7433", "https://sidecar.example:7433",
                 "https://sidecar.example:7433/", "unix:///run/ts.sock"):  # fmt: skip
        assert is_sidecar_address(addr), addr
    for url in ("https://example.org/trace", "https://example.org", "s3://b/p", "file:///x"):
        assert not is_sidecar_address(url), url
    monkeypatch.delenv("TRACESTORE_TOKEN", raising=False)
    assert resolve_token("10.0.0.1:7433") is None
    for local in ("127.0.0.1:1", "localhost:1", "[::1]:1", "unix:///x.sock", "ipv4:127.0.0.1:1"):
        assert resolve_token(local, token="t") == "t"
    assert resolve_token("grpcs://10.0.0.1:7433", token="t") == "t"
    assert resolve_token("10.0.0.1:7433", grpc.ssl_channel_credentials(), token="t") == "t"
    with pytest.raises(ConfigError, match="in the clear"):
        resolve_token("10.0.0.1:7433", token="t")
    # gRPC reads a bare IPv6 target with several colons as a host without a port: "::1:7433" is the
    # address ::1:7433 (not loopback), port 443. Before, it was split at the last colon into ::1.
    for remote in ("::1:7433", "ipv4:127.0.0.1:1,10.0.0.1:1", "ipv6:[::1]:1,[2001:db8::1]:1"):
        with pytest.raises(ConfigError, match="in the clear"):
            resolve_token(remote, token="t")
    assert resolve_token("ipv6:[::1]:1", token="t") == "t"
    monkeypatch.setenv("TRACESTORE_TOKEN", "from-env")
    with pytest.raises(ConfigError, match="in the clear"):
        RolloutRecorder("10.0.0.1:7433", SPEC, "w", staging_bytes=1 << 20, connect=False)


def test_sighup_while_the_sidecar_starts_does_not_end_it(tmp_path: Path) -> None:
    """SIGHUP (sent after rotating a Secret) reaching a sidecar that is still starting (checking
    storage, replaying its WAL) ended it: the handler was installed only once it served."""
    import signal

    tokens = tmp_path / "tokens"
    tokens.write_text(token_line("t-" + secrets.token_hex(8), "admin") + "\n")
    ready, log = tmp_path / "ready.json", tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "tracestore.cli", "serve", "--storage", f"file://{tmp_path}/data", "--wal-dir",
           str(tmp_path / "wal"), "--port", "0", "--metrics-port", "off", "--auth-tokens", str(tokens),
           "--ready-file", str(ready), "--log-level", "INFO"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACESTORE_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while b" serve, pid " not in log.read_bytes():  # its settings line: started, not serving yet
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.002)
        proc.send_signal(signal.SIGHUP)
        wait_for("the sidecar to serve", lambda: ready.exists(), 60)
        assert proc.poll() is None, f"SIGHUP during start ended the sidecar ({proc.returncode}):\n{log.read_text()}"
    finally:
        proc.terminate()
        proc.wait(60)


def test_ipv6_loopback_host_binds_and_the_config_hides_the_storage_url(tmp_path: Path) -> None:
    """--host ::1 (a documented loopback host) failed to bind ("in use?"): the address was not
    bracketed. And repr(ServerConfig) showed a password in the storage URL."""
    import socket

    assert "pw" not in repr(ServerConfig(storage="s3://user:pw@host/bucket"))
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    _serves(host="::1", dial="[::1]")
