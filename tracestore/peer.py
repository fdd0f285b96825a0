"""Peer tokens of a sidecar's unix socket: the names both sides share, and the client's fetch.

A sidecar that authorizes unix-socket peers by uid or gid (its token file lists ``uid:``/``gid:``
entries) serves ``<unix socket>.peer`` beside its socket: a process that connects there gets one
line back, a short-lived token naming the uid and gid the kernel reports for it, which it sends as
its bearer token over the unix socket (the sidecar's side: ``server/security/peer_auth.py``; the
client's channels do this for every call, ``client/transport.py``).
"""

from __future__ import annotations

import socket

from tracestore.errors import ConfigError

PEER_SUFFIX = ".peer"
"""The peer endpoint of unix socket ``S`` is ``S + PEER_SUFFIX``."""
PREFIX = "peer1."
"""Every peer token starts with this (the version of its format)."""
TOKEN_TTL_S = 60
"""Seconds a peer token is accepted after it was minted."""


def fetch_peer_token(socket_path: str, timeout: float = 5.0) -> str:
    """A peer token from the sidecar whose unix socket is ``socket_path``; ConfigError naming the
    endpoint when none can be had."""
    path = socket_path + PEER_SUFFIX
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    data = b""
    try:
        s.settimeout(timeout)
        s.connect(path)
        while not data.endswith(b"\n") and len(data) < 512:
            part = s.recv(512)
            if not part:
                break
            data += part
    except OSError as exc:
        raise ConfigError(f"cannot get a peer token from {path}: {exc.strerror or exc}") from exc
    finally:
        s.close()
    token = data.decode(errors="replace").strip()
    if not token.startswith(PREFIX) or any(c.isspace() for c in token):
        raise ConfigError(f"{path} answered no peer token")
    return token
