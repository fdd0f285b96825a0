"""TLS for the sidecar's TCP port (:class:`ServerTls`, its PEM files read again on SIGHUP) and a
throwaway PKI for tests and benchmarks (:func:`write_test_pki`)."""

from __future__ import annotations

import ipaddress
import os
import ssl
import threading
from pathlib import Path
from typing import Any

import grpc

from tracestore.errors import ConfigError


class ServerTls:
    """TLS for the TCP port from PEM files: ``cert`` (chain) and ``key``; with ``client_ca`` every
    client must present a certificate that CA signed. :meth:`reload` reads the files again; new
    connections then use them (gRPC asks :meth:`_fetch` before each handshake). Files that do not
    load, or a key that does not match its certificate, leave the ones in use unchanged."""

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
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


# -- certificates for tests and benches ------------------------------------------------------------


def write_test_pki(
    directory: str | os.PathLike[str], *, prefix: str = "", hosts: tuple[str, ...] = ("localhost", "127.0.0.1")
) -> dict[str, Path]:
    """A throwaway CA, a server certificate for ``hosts`` and a client certificate, as PEM files
    in ``directory`` (``{prefix}ca.pem``, ``{prefix}server.pem``/``.key``,
    ``{prefix}client.pem``/``.key``); returns their paths by role (``ca``, ``server``,
    ``server_key``, ``client``, ``client_key``). For tests, benches and trying TLS locally:
    one-day validity, P-256 keys, keys written 0600. Needs the ``cryptography`` package (the ``dev`` extra)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def builder(subject: str, issuer: x509.Name, key: Any) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
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
                digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
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
        b = builder(f"tracestore {stem}", ca.subject, key).add_extension(x509.ExtendedKeyUsage([usage]), False)
        if stem == "server":
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        paths[stem], paths[f"{stem}_key"] = write(stem, b.sign(ca_key, hashes.SHA256()), key)
    return paths
