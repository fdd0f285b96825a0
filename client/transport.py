"""gRPC channel setup shared by the recorder and the reader (no torch here)."""

from __future__ import annotations

from typing import Any

from tracestore.errors import require

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
    """``host:port`` and ``unix://...`` name a sidecar; anything else with ``://`` is a storage URL."""
    if source.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return True
    if "://" in source:
        return False
    host, sep, port = source.rpartition(":")
    return bool(sep and host and port.isdigit())


def grpc_target(address: str) -> str:
    return address


def channel(address: str) -> Any:
    grpc: Any = require("grpc", "server")
    return grpc.insecure_channel(grpc_target(address), options=CHANNEL_OPTIONS)


def method(ch: Any, name: str, kind: str) -> Any:
    """A raw-bytes callable for ``/tracestore.v1.TraceStore/<name>`` (we (de)serialize ourselves)."""
    path = f"/tracestore.v1.TraceStore/{name}"
    factory = {
        "stream_stream": ch.stream_stream,
        "unary_unary": ch.unary_unary,
        "unary_stream": ch.unary_stream,
    }[kind]
    return factory(path, request_serializer=None, response_deserializer=None)
