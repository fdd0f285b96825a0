"""TLS for the sidecar's TCP port (:class:`ServerTls`, its PEM files read again on SIGHUP), the
server certificate's validity window checked each time they are read (:func:`check_validity`), and
a throwaway PKI for tests and benchmarks (:func:`write_test_pki`)."""

from __future__ import annotations

import base64
import binascii
import datetime
import ipaddress
import logging
import os
import re
import ssl
import threading
from pathlib import Path
from typing import Any

import grpc

from tracestore.errors import ConfigError

log = logging.getLogger("tracestore.server")

#: a server certificate that expires within this long is logged as a WARNING when it is read
WARN_BEFORE_EXPIRY = datetime.timedelta(days=7)


class ServerTls:
    """TLS for the TCP port from PEM files: ``cert`` (chain) and ``key``; with ``client_ca`` every
    client must present a certificate that CA signed. :meth:`reload` reads the files again; new
    connections then use them (gRPC asks :meth:`_fetch` before each handshake). Files that do not
    load, a key that does not match its certificate, or an expired certificate
    (:func:`check_validity`) raise :class:`ConfigError`: at start nothing serves, on reload the
    ones in use stay unchanged."""

    def __init__(self, cert: str, key: str, client_ca: str | None = None) -> None:
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._initial = self._load()
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self._lock = threading.Lock()

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self._fetch, require_client_authentication=self.client_ca is not None
        )

    def reload(self) -> None:
        config = self._load()
        with self._lock:
            self._pending = config

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            config, self._pending = self._pending, None
        return config

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        try:
            cert, key = Path(self.cert).read_bytes(), Path(self.key).read_bytes()
            ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        except OSError as exc:
            raise ConfigError(f"cannot read TLS file {exc.filename}: {exc.strerror or exc}") from None
        return cert, key, ca

    def _load(self) -> grpc.ServerCertificateConfiguration:
        got = self._read()
        # gRPC would only fail the handshakes; the ssl module checks the PEM and the key pair now.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.cert, self.key)
            if self.client_ca:
                ctx.load_verify_locations(cafile=self.client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"TLS files do not load (certificate {self.cert}, key {self.key}, client CA {self.client_ca}): "
                f"{getattr(exc, 'reason', None) or exc}"
            ) from None
        if self._read() != got:
            raise ConfigError("TLS files changed while being loaded; load them again (SIGHUP)")
        cert, key, ca = got
        check_validity(self.cert, cert)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


# -- validity window -------------------------------------------------------------------------------

_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", re.S)


def _tlv(der: bytes, pos: int) -> tuple[int, int, int]:
    """The DER element at ``pos``: (tag, start of its contents, end of its contents)."""
    if pos + 2 > len(der):
        raise ValueError("truncated DER")
    tag, size, pos = der[pos], der[pos + 1], pos + 2
    if size & 0x80:  # long form: the next (size & 0x7f) bytes are the length
        n = size & 0x7F
        if not 1 <= n <= 4 or pos + n > len(der):
            raise ValueError("bad DER length")
        size, pos = int.from_bytes(der[pos : pos + n], "big"), pos + n
    if pos + size > len(der):
        raise ValueError("truncated DER")
    return tag, pos, pos + size


def _asn1_time(tag: int, raw: bytes) -> datetime.datetime:
    """A UTCTime (tag 0x17, ``YYMMDDHHMMSSZ``: years 50-99 are 19xx) or GeneralizedTime (0x18,
    ``YYYYMMDDHHMMSSZ``), the forms RFC 5280 allows in a certificate, as an aware UTC datetime."""
    text = raw.decode("ascii")
    if tag == 0x17:
        yy = int(text[:2])
        text = f"{1900 + yy if yy >= 50 else 2000 + yy}{text[2:]}"
    elif tag != 0x18:
        raise ValueError(f"not a certificate time (tag {tag:#x})")
    return datetime.datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=datetime.timezone.utc)


def validity_windows(pem: bytes) -> list[tuple[datetime.datetime, datetime.datetime]]:
    """``(notBefore, notAfter)`` of each certificate in a PEM file, in file order (the first is a
    chain's own certificate). Reads only the fields in front of the validity in DER (version,
    serial number, signature algorithm, issuer), with no dependency beyond the standard library;
    raises ValueError for what it cannot read."""
    out = []
    for block in _PEM_CERT.findall(pem):
        try:
            der = base64.b64decode(b"".join(block.split()), validate=True)
        except binascii.Error as exc:
            raise ValueError(f"bad base64 ({exc})") from None
        _, pos, _ = _tlv(der, 0)  # Certificate
        _, pos, _ = _tlv(der, pos)  # tbsCertificate
        if _tlv(der, pos)[0] == 0xA0:  # [0] version, absent in v1 certificates
            pos = _tlv(der, pos)[2]
        for _ in range(3):  # serialNumber, signature, issuer
            pos = _tlv(der, pos)[2]
        tag, pos, _ = _tlv(der, pos)
        if tag != 0x30:
            raise ValueError("no validity sequence")
        t1, s1, e1 = _tlv(der, pos)
        t2, s2, e2 = _tlv(der, e1)
        out.append((_asn1_time(t1, der[s1:e1]), _asn1_time(t2, der[s2:e2])))
    return out


def _utc(t: datetime.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _days(d: datetime.timedelta) -> str:
    return f"{d.total_seconds() / 86400:.1f} days"


def check_validity(path: str, pem: bytes, now: datetime.datetime | None = None) -> None:
    """Check the validity windows of the certificates in ``pem`` (the file ``path``) at ``now``
    (default: the clock). The first certificate, the server's own, expired: raises
    :class:`ConfigError` naming the file and its notAfter (every client would refuse it). Not
    valid yet (notBefore ahead: a clock behind, or a certificate issued for later), or expiring
    within :data:`WARN_BEFORE_EXPIRY`: a WARNING naming the file and the time; the sidecar serves.
    The chain's other certificates only ever warn (some published chains carry an expired
    cross-signed root that clients skip). A file whose dates cannot be read is logged as a
    WARNING and not checked (the ssl module has loaded it already)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    try:
        windows = validity_windows(pem)
    except ValueError as exc:
        log.warning("TLS certificate %s: cannot read its validity dates (%s); not checked", path, exc)
        return
    for i, (not_before, not_after) in enumerate(windows):
        which = f"TLS certificate {path}" + ("" if i == 0 else f" (certificate {i + 1} of its chain)")
        if now > not_after:
            what = f"{which} expired at {_utc(not_after)} (notAfter, {_days(now - not_after)} ago)"
            if i == 0:
                raise ConfigError(f"{what}: clients refuse it; renew it")
            log.warning("%s; clients that need it refuse the chain", what)
        elif now < not_before:
            log.warning(
                "%s is not valid before %s (notBefore, in %s): clients refuse it until then (is the clock right?)",
                which,
                _utc(not_before),
                _days(not_before - now),
            )
        elif not_after - now <= WARN_BEFORE_EXPIRY:
            log.warning(
                "%s expires at %s (notAfter, in %s): renew it and send SIGHUP to load the new one",
                which,
                _utc(not_after),
                _days(not_after - now),
            )


# -- certificates for tests and benches ------------------------------------------------------------


def write_test_pki(
    directory: str | os.PathLike[str],
    *,
    prefix: str = "",
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
    server_validity: tuple[datetime.datetime, datetime.datetime] | None = None,
) -> dict[str, Path]:
    """A throwaway CA, a server certificate for ``hosts`` and a client certificate, as PEM files
    in ``directory`` (``{prefix}ca.pem``, ``{prefix}server.pem``/``.key``,
    ``{prefix}client.pem``/``.key``); returns their paths by role (``ca``, ``server``,
    ``server_key``, ``client``, ``client_key``). For tests, benches and trying TLS locally:
    valid from an hour ago for 30 days (``server_validity``: the server certificate's own
    ``(notBefore, notAfter)``, timezone-aware, e.g. to test expired ones), P-256 keys, keys
    written 0600. Needs the ``cryptography`` package (the ``dev`` extra)."""

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def builder(
        subject: str, issuer: x509.Name, key: Any, validity: tuple[datetime.datetime, datetime.datetime] | None = None
    ) -> x509.CertificateBuilder:
        not_before, not_after = validity or (now - datetime.timedelta(hours=1), now + datetime.timedelta(days=30))
        return (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
        )

    def write(stem: str, cert: x509.Certificate, key: Any) -> tuple[Path, Path]:
        pem, key_path = out / f"{prefix}{stem}.pem", out / f"{prefix}{stem}.key"
        pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.unlink(missing_ok=True)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )
        return pem, key_path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        builder(f"{prefix}tracestore test CA", name(f"{prefix}tracestore test CA"), ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": out / f"{prefix}ca.pem"}  # the CA's key is not kept: nothing else is signed with it
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    for stem, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH), ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        validity = server_validity if stem == "server" else None
        b = builder(f"tracestore {stem}", ca.subject, key, validity)
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), False)
        if stem == "server":
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        paths[stem], paths[f"{stem}_key"] = write(stem, b.sign(ca_key, hashes.SHA256()), key)
    return paths
