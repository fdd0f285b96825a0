"""gRPC channel setup shared by the recorder and the reader (no torch here)."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable
from typing import Any

from tracestore.errors import ConfigError, require
from tracestore.settings import TOKEN, read_env

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.http2.bdp_probe", 0),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.enable_retries", 0),
]


def is_sidecar_address(source: str) -> bool:
    """``host:port``, ``grpcs://host:port``, ``https://host:port`` (nothing after the port) and
    ``unix://...`` name a sidecar; anything else with ``://`` is a storage URL."""
    if source.startswith(("unix:", "dns:", "ipv4:", "ipv6:", "grpcs://")):
        return True
    if source.startswith("https://"):
        return _host_port(source.removeprefix("https://").rstrip("/"))
    if "://" in source:
        return False
    return _host_port(source)


def _host_port(source: str) -> bool:
    host, sep, port = source.rpartition(":")
    return bool(sep and host and port.isdigit())


def grpc_target(address: str) -> str:
    """The gRPC target of a sidecar address (``grpcs://`` and ``https://`` stripped)."""
    for scheme in ("grpcs://", "https://"):
        if address.startswith(scheme):
            return address.removeprefix(scheme).rstrip("/")
    return address


def is_local_target(target: str) -> bool:
    """A unix socket or a loopback ``host:port`` (where a token may travel without TLS)."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    rest = target.removeprefix("dns:").removeprefix("ipv4:").removeprefix("ipv6:").lstrip("/")
    return all(_loopback_host(_target_host(a)) for a in rest.split(","))  # ipv4:/ipv6: may list several


def _target_host(address: str) -> str:
    """The host of ``host[:port]`` as gRPC reads it: an IPv6 address only in brackets
    (``[::1]:7433``); a bare one with several colons is a host without a port (``::1:7433`` is the
    address ``::1:7433``, port 443)."""
    if address.startswith("["):
        return address[1:].partition("]")[0]
    host, sep, _port = address.rpartition(":")
    return address if not sep or ":" in host else host


def _loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_token(address: str, channel_credentials: Any = None, token: str | None = None) -> str | None:
    """The bearer token to send to ``address``: ``token``, else ``$TRACESTORE_TOKEN``, else None.
    Raises ConfigError where it would cross the network in the clear (no TLS, not a local
    target)."""
    token = token if token is not None else read_env(TOKEN)
    if token is None:
        return None
    if not isinstance(token, str) or not token.strip() or any(c.isspace() for c in token.strip()):
        raise ConfigError("the bearer token must be a non-empty string without whitespace")
    tls = channel_credentials is not None or grpc_target(address) != address
    if not tls and not is_local_target(address):
        raise ConfigError(
            f"a bearer token is sent only over TLS or to a unix socket or loopback address, not in the clear to "
            f"{address!r}: use grpcs://{address} (or channel_credentials=grpc.ssl_channel_credentials(...))"
        )
    return token.strip()


def channel(address: str, channel_credentials: Any = None, token: str | None = None) -> Any:
    """A channel to a sidecar. TLS with ``channel_credentials`` (a ``grpc.ChannelCredentials``) or
    for a ``grpcs://``/``https://`` address (the system's root certificates unless credentials are
    given). ``token`` (default ``$TRACESTORE_TOKEN``) goes as ``authorization: Bearer`` metadata:
    as call credentials over TLS; over a plaintext unix or loopback channel, where gRPC refuses
    call credentials, by an interceptor that adds the metadata to every call. Without a token, a
    unix-socket channel sends a fresh peer token with each call when the sidecar serves
    ``<socket>.peer`` (it authorizes unix peers by uid/gid: tracestore/peer.py)."""
    grpc: Any = require("grpc", "server")
    token = resolve_token(address, channel_credentials, token)
    target = grpc_target(address)
    if channel_credentials is None and target != address:
        channel_credentials = grpc.ssl_channel_credentials()
    if channel_credentials is not None:
        if token is not None:
            channel_credentials = grpc.composite_channel_credentials(
                channel_credentials, grpc.access_token_call_credentials(token)
            )
        return grpc.secure_channel(target, channel_credentials, options=CHANNEL_OPTIONS)
    ch = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    if token is not None:
        header = ("authorization", f"Bearer {token}")
        return grpc.intercept_channel(ch, *_bearer_interceptors(grpc, lambda: header))
    path = unix_socket_path(target)
    if path is not None:  # a sidecar that authorizes unix peers by uid/gid serves <path>.peer
        return grpc.intercept_channel(ch, *_bearer_interceptors(grpc, lambda: _peer_header(path)))
    return ch


def unix_socket_path(target: str) -> str | None:
    """The file of a ``unix:`` target (``unix:///abs`` or ``unix://abs`` -> ``/abs`` / ``abs``,
    ``unix:/abs``, ``unix:relative``), else None."""
    if not target.startswith("unix:"):
        return None
    return target.removeprefix("unix:").removeprefix("//")


def _peer_header(path: str) -> tuple[str, str] | None:
    """``authorization`` metadata with a fresh peer token when the sidecar at unix socket ``path``
    serves its ``.peer`` endpoint (tracestore/peer.py), else None (the socket's permissions decide).
    Fetched per call: a token lives a minute and dies with the sidecar that signed it."""
    from tracestore.peer import PEER_SUFFIX, fetch_peer_token

    if not os.path.exists(path + PEER_SUFFIX):
        return None
    try:
        return ("authorization", f"Bearer {fetch_peer_token(path)}")
    except ConfigError:  # the sidecar is going away: the call fails on its own, with gRPC's status
        return None


def _bearer_interceptors(grpc: Any, header: Callable[[], tuple[str, str] | None]) -> list[Any]:
    """Client interceptors that add ``header()`` (``authorization: Bearer <token>``; None: nothing)
    to every call's metadata."""

    class Details(grpc.ClientCallDetails):
        def __init__(self, d: Any) -> None:
            self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
            self.wait_for_ready, self.compression = d.wait_for_ready, d.compression
            h = header()
            self.metadata = [*(d.metadata or ()), *(() if h is None else (h,))]

    class Bearer(
        grpc.UnaryUnaryClientInterceptor,
        grpc.UnaryStreamClientInterceptor,
        grpc.StreamUnaryClientInterceptor,
        grpc.StreamStreamClientInterceptor,
    ):
        def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            return continuation(Details(details), request)

        def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
            return continuation(Details(details), request)

        def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
            return continuation(Details(details), requests)

        def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
            return continuation(Details(details), requests)

    return [Bearer()]


def method(ch: Any, name: str, kind: str) -> Any:
    """A raw-bytes callable for ``/tracestore.v1.TraceStore/<name>`` (the caller serializes)."""
    path = f"/tracestore.v1.TraceStore/{name}"
    factory = {
        "stream_stream": ch.stream_stream,
        "unary_unary": ch.unary_unary,
        "unary_stream": ch.unary_stream,
    }[kind]
    return factory(path, request_serializer=None, response_deserializer=None)
