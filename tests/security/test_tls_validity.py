"""The server certificate's validity window, checked at start and on every TLS reload (SIGHUP).

An expired server certificate is refused (start: ``ConfigError``, ``tracestore serve`` exits 2;
reload: the files in use stay); one not valid yet, or expiring within 7 days, starts (or is taken
on reload) with a WARNING naming the file and the notBefore/notAfter time. A certificate valid for
longer than that is taken without a warning.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cryptography", reason="throwaway certificates need the cryptography package (dev extra)")

from tracestore.server.config import ServerConfig  # noqa: E402
from tracestore.server.rpc.service import Sidecar  # noqa: E402
from tracestore.server.security.tls import write_test_pki  # noqa: E402

from tracestore.errors import ConfigError  # noqa: E402

NOW = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
DAY = datetime.timedelta(days=1)


def stamp(t: datetime.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def pki(tmp: Path, name: str, window: tuple[datetime.datetime, datetime.datetime] | None) -> dict[str, Path]:
    return write_test_pki(tmp / name, server_validity=window)


def start(tmp: Path, paths: dict[str, Path]) -> Sidecar:
    cfg = ServerConfig(storage=f"file://{tmp / 'data'}", wal_dir=str(tmp / "wal"), port=0, metrics_port=None,
                       tls_cert=str(paths["server"]), tls_key=str(paths["server_key"]))  # fmt: skip
    return Sidecar(cfg).start()


def tls_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    got = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    return [m for m in got if "TLS certificate" in m]


def test_expired_certificate_refused_at_start(tmp_path: Path) -> None:
    expired = (NOW - 30 * DAY, NOW - 2 * DAY)
    paths = pki(tmp_path, "old", expired)
    with pytest.raises(ConfigError, match="expired") as refused:
        start(tmp_path / "a", paths)
    assert str(paths["server"]) in str(refused.value) and stamp(expired[1]) in str(refused.value)
    # the command: one line on standard error and exit status 2, before anything is served
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACESTORE_")}
    proc = subprocess.run(
        [sys.executable, "-m", "tracestore.cli", "serve", "--storage", f"file://{tmp_path / 'b' / 'data'}",
         "--wal-dir", str(tmp_path / "b" / "wal"), "--port", "0", "--metrics-port", "off", "--storage-check", "off",
         "--tls-cert", str(paths["server"]), "--tls-key", str(paths["server_key"])],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "expired" in proc.stderr and str(paths["server"]) in proc.stderr and stamp(expired[1]) in proc.stderr


@pytest.mark.parametrize(
    ("window", "words", "when"),
    [
        ((NOW - DAY, NOW + 3 * DAY), "expires", 1),  # within 7 days
        ((NOW + 2 * DAY, NOW + 30 * DAY), "not valid before", 0),  # not valid yet
    ],
    ids=["expiring-soon", "not-yet-valid"],
)
def test_soon_expiring_or_not_yet_valid_certificate_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
    window: tuple[datetime.datetime, datetime.datetime], words: str, when: int,
) -> None:  # fmt: skip
    paths = pki(tmp_path, "pki", window)
    caplog.set_level(logging.INFO)
    sc = start(tmp_path, paths)
    try:
        got = tls_warnings(caplog)
        assert len(got) == 1, caplog.text
        assert words in got[0] and str(paths["server"]) in got[0] and stamp(window[when]) in got[0], got
    finally:
        sc.stop(5)


def test_valid_certificate_starts_without_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    sc = start(tmp_path, pki(tmp_path, "pki", None))  # the helper's default: 30 days
    try:
        assert tls_warnings(caplog) == [], caplog.text
    finally:
        sc.stop(5)


def test_reload_checks_the_new_certificate(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good, soon, expired = (
        pki(tmp_path, "good", None),
        pki(tmp_path, "soon", (NOW - DAY, NOW + 2 * DAY)),
        pki(tmp_path, "expired", (NOW - 10 * DAY, NOW - DAY)),
    )
    live = {role: tmp_path / f"live-{role}" for role in ("server", "server_key")}

    def install(paths: dict[str, Path]) -> None:
        for role, path in live.items():
            path.write_bytes(paths[role].read_bytes())

    install(good)
    caplog.set_level(logging.INFO)
    sc = start(tmp_path, live)
    try:
        assert tls_warnings(caplog) == []
        install(soon)
        sc.reload()
        got = tls_warnings(caplog)
        assert len(got) == 1 and str(live["server"]) in got[0] and stamp(NOW + 2 * DAY) in got[0], caplog.text
        assert "read the TLS files again" in caplog.text
        caplog.clear()
        install(expired)
        sc.reload()
        failed = [r.getMessage() for r in caplog.records if "reload of the TLS files failed" in r.getMessage()]
        assert len(failed) == 1 and "expired" in failed[0] and stamp(NOW - DAY) in failed[0], caplog.text
        assert "read the TLS files again" not in caplog.text
    finally:
        sc.stop(5)


def test_validity_windows_read_both_time_forms_and_every_chain_certificate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from cryptography import x509
    from tracestore.server.security.tls import check_validity, validity_windows

    far = datetime.datetime(2051, 6, 1, 12, 30, 5, tzinfo=datetime.timezone.utc)  # GeneralizedTime from 2050 on
    a = pki(tmp_path, "far", (NOW - DAY, far))
    b = pki(tmp_path, "old", (NOW - 30 * DAY, NOW - DAY))  # UTCTime
    for paths in (a, b):
        for role in ("server", "ca", "client"):
            cert = x509.load_pem_x509_certificate(paths[role].read_bytes())
            assert validity_windows(paths[role].read_bytes()) == [(cert.not_valid_before_utc, cert.not_valid_after_utc)]
    # a chain: the server's own certificate first, then an expired one: that one only warns
    chain = a["server"].read_bytes() + b["server"].read_bytes()
    caplog.set_level(logging.INFO)
    check_validity("chain.pem", chain)
    assert len(tls_warnings(caplog)) == 1 and "certificate 2 of its chain" in caplog.text and "expired" in caplog.text
    with pytest.raises(ConfigError, match="expired"):
        check_validity("chain.pem", b["server"].read_bytes() + a["server"].read_bytes())
    # as of a given time: 7 days before notAfter warns, 8 days before does not
    caplog.clear()
    check_validity("far.pem", a["server"].read_bytes(), now=far - 8 * DAY)
    assert tls_warnings(caplog) == []
    check_validity("far.pem", a["server"].read_bytes(), now=far - 7 * DAY)
    assert len(tls_warnings(caplog)) == 1 and stamp(far) in caplog.text
    # dates it cannot read: a warning, not a refusal (the ssl module loaded the file already)
    caplog.clear()
    check_validity("bad.pem", b"-----BEGIN CERTIFICATE-----\nMAA=\n-----END CERTIFICATE-----\n")
    assert "cannot read its validity dates" in caplog.text
