"""TLS and mutual TLS on the sidecar's TCP port, over real sockets, with certificates made here.

Round trips through the SDK (recorder in, reader out) over TLS with a bearer token and over
mutual TLS; clients without a client certificate, with one from another CA, or speaking plaintext
are refused; a ``tracestore serve`` process picks up a new certificate and a new token file on
SIGHUP (new connections see them) and keeps the old ones when the new files do not load.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tracestore.client import GuidanceReader, RolloutRecorder, SiteOutput
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import Sidecar
from tracestore.server.security.tls import write_test_pki
from tracestore.server.testing import SPEC, ServeProcess

from tracestore.errors import ConfigError
from tracestore.storage.store import Store
from tracestore.v1 import tracestore_pb2 as pb

SITE = "layers.1.mlp.input"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    d = tmp_path_factory.mktemp("pki")
    return {"a": write_test_pki(d, prefix="a-"), "b": write_test_pki(d, prefix="b-")}


def creds(paths: dict[str, Path], client: dict[str, Path] | None = None) -> grpc.ChannelCredentials:
    """Channel credentials trusting ``paths``' CA, presenting ``client``'s certificate if given."""
    return grpc.ssl_channel_credentials(
        root_certificates=paths["ca"].read_bytes(),
        private_key=None if client is None else client["client_key"].read_bytes(),
        certificate_chain=None if client is None else client["client"].read_bytes(),
    )


def stat_code(target: str, credentials: grpc.ChannelCredentials | None, token: str | None = None) -> str:
    ch = grpc.insecure_channel(target) if credentials is None else grpc.secure_channel(target, credentials)
    md = None if token is None else [("authorization", f"Bearer {token}")]
    try:
        ch.unary_unary("/tracestore.v1.TraceStore/Stat")(pb.StatRequest().SerializeToString(), timeout=10, metadata=md)
    except grpc.RpcError as exc:
        return exc.code().name
    finally:
        ch.close()
    return "OK"


def round_trip(address: str, traj: str, **kw: object) -> None:
    """Record one trajectory through ``address`` and read it back through the same sidecar."""
    site = SPEC.site(SITE)
    rng = np.random.default_rng(sum(map(ord, traj)))
    codes = rng.integers(0, 256, (6, site.code_bytes), dtype=np.uint8)
    scales = rng.integers(0, 256, (6, site.scale_bytes), dtype=np.uint8)
    rec = RolloutRecorder(address, SPEC, f"w-{traj}", staging_bytes=4 << 20, **kw)  # type: ignore[arg-type]
    try:
        assert rec.record_forward([(traj, 0, 6)], {SITE: SiteOutput(codes, scales, 0.5)})
        rec.finish(traj, 7)
        assert rec.flush(30), rec.stats
        assert rec.stats["unguided"] == 0 and rec.stats["rejected_messages"] == 0, rec.stats
    finally:
        rec.close()
    with GuidanceReader(address, SPEC.run, sites=[SITE], prefetch=False, **kw) as reader:  # type: ignore[arg-type]
        rows = reader.read_host([(traj, 0, 6)])[SITE]
    assert rows.codes.tobytes() == codes.tobytes() and rows.scales.tobytes() == scales.tobytes()
    assert rows.valid.all()


def start(tmp: Path, **kw: object) -> Sidecar:
    cfg = ServerConfig(storage=f"file://{tmp / 'data'}", wal_dir=str(tmp / "wal"), port=0, metrics_port=None,
                       flush_interval_s=0.05, **kw)  # type: ignore[arg-type]  # fmt: skip
    sc = Sidecar(cfg).start()
    Store(cfg.storage).put_run(SPEC)
    return sc


def test_tls_round_trip_with_token(tmp_path: Path, pki: dict[str, dict[str, Path]]) -> None:
    a = pki["a"]
    token = "tok-" + secrets.token_urlsafe(24)
    (tmp_path / "tokens").write_text(f"sha256:{hashlib.sha256(token.encode()).hexdigest()} write:run-*,read:run-*\n")
    sc = start(tmp_path, tls_cert=str(a["server"]), tls_key=str(a["server_key"]), auth_tokens=str(tmp_path / "tokens"))
    try:
        # token as call credentials over TLS; the address says TLS (grpcs://), the credentials the CA
        round_trip(f"grpcs://127.0.0.1:{sc.port}", "tls-1", channel_credentials=creds(a), token=token)
        target = f"127.0.0.1:{sc.port}"
        assert stat_code(target, creds(a), token) == "OK"
        assert stat_code(target, creds(a)) == "UNAUTHENTICATED"
        assert stat_code(target, None, token) == "UNAVAILABLE"  # plaintext to a TLS port
        assert stat_code(target, creds(pki["b"]), token) == "UNAVAILABLE"  # a CA that did not sign it
    finally:
        sc.stop(5)


def test_mtls_round_trip_and_refusals(tmp_path: Path, pki: dict[str, dict[str, Path]]) -> None:
    a, b = pki["a"], pki["b"]
    sc = start(tmp_path, tls_cert=str(a["server"]), tls_key=str(a["server_key"]), tls_client_ca=str(a["ca"]))
    try:
        round_trip(f"127.0.0.1:{sc.port}", "mtls-1", channel_credentials=creds(a, client=a))
        target = f"127.0.0.1:{sc.port}"
        assert stat_code(target, creds(a, client=a)) == "OK"
        assert stat_code(target, creds(a)) == "UNAVAILABLE"  # no client certificate
        assert stat_code(target, creds(a, client=b)) == "UNAVAILABLE"  # a client certificate of another CA
        assert stat_code(target, None) == "UNAVAILABLE"
    finally:
        sc.stop(5)


def test_bad_tls_files_fail_at_start(tmp_path: Path, pki: dict[str, dict[str, Path]]) -> None:
    a, b = pki["a"], pki["b"]
    for cert, key, words in (
        (a["server"], b["server_key"], "do not load"),  # key of another certificate
        (a["server"], tmp_path / "missing.key", "cannot read"),
        (a["ca"].with_name("nope.pem"), a["server_key"], "cannot read"),
    ):
        with pytest.raises(ConfigError, match=words):
            start(tmp_path / "bad", tls_cert=str(cert), tls_key=str(key))
    with pytest.raises(ConfigError, match="together"):
        ServerConfig(tls_cert=str(a["server"]))
    with pytest.raises(ConfigError, match="needs TLS"):
        ServerConfig(tls_client_ca=str(a["ca"]))


@pytest.fixture
def serve(tmp_path: Path, pki: dict[str, dict[str, Path]]) -> Iterator[tuple[ServeProcess, Path]]:
    """A ``tracestore serve`` process with TLS from files in its work directory, and tokens."""
    live = tmp_path / "live"
    live.mkdir()
    for role in ("server", "server_key"):
        (live / role).write_bytes(pki["a"][role].read_bytes())
    (live / "tokens").write_text(f"sha256:{hashlib.sha256(b'tok-one').hexdigest()} admin\n")
    flags = ["--tls-cert", str(live / "server"), "--tls-key", str(live / "server_key"),
             "--auth-tokens", str(live / "tokens"), "--log-level", "INFO"]  # fmt: skip
    with ServeProcess(tmp_path / "sp", flags=flags) as sp:
        yield sp, live


def test_sighup_reloads_certificate_and_tokens(
    serve: tuple[ServeProcess, Path], pki: dict[str, dict[str, Path]]
) -> None:
    sp, live = serve
    a, b = pki["a"], pki["b"]
    target = sp.address
    assert stat_code(target, creds(a), "tok-one") == "OK"
    assert stat_code(target, creds(b), "tok-one") == "UNAVAILABLE"
    # a key that does not match the certificate: refused on SIGHUP, the old pair stays
    (live / "server_key").write_bytes(b["server_key"].read_bytes())
    assert sp.proc is not None
    sp.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "reload of the TLS files failed" not in sp.log_tail(20000):
        assert time.monotonic() < deadline, sp.log_tail()
        time.sleep(0.05)
    assert stat_code(target, creds(a), "tok-one") == "OK"
    # the new pair (another CA) and a new token file
    (live / "server").write_bytes(b["server"].read_bytes())
    (live / "tokens").write_text(f"sha256:{hashlib.sha256(b'tok-two').hexdigest()} admin\n")
    sp.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while stat_code(target, creds(b), "tok-two") != "OK":
        assert time.monotonic() < deadline, sp.log_tail()
        time.sleep(0.05)
    assert stat_code(target, creds(a), "tok-two") == "UNAVAILABLE"  # new connections get the new certificate
    assert stat_code(target, creds(b), "tok-one") == "UNAUTHENTICATED"
    assert "tok-one" not in sp.log_tail(100000) and "tok-two" not in sp.log_tail(100000)
    assert sp.terminate() == 0


def test_unix_socket_stays_plaintext_beside_tls(tmp_path: Path, pki: dict[str, dict[str, Path]]) -> None:
    a = pki["a"]
    sock = tmp_path / "s.sock"
    sc = start(tmp_path, tls_cert=str(a["server"]), tls_key=str(a["server_key"]), unix_socket=str(sock))
    try:
        assert stat_code(f"unix://{sock}", None) == "OK"
        assert stat_code(f"127.0.0.1:{sc.port}", None) == "UNAVAILABLE"
        round_trip(f"unix://{sock}", "unix-beside-tls")
    finally:
        sc.stop(5)
    assert not os.path.exists(sock)
