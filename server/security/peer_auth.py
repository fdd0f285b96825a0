"""Unix-socket peers authorized by their uid or gid.

grpcio does not tell a handler who is at the other end of its unix socket (no SO_PEERCRED), so the
sidecar serves a second, tiny socket beside it, ``<unix socket>.peer``, with the same group and
mode. A client connects there; the kernel reports the connecting process's uid and gid
(``SO_PEERCRED``, taken when it connected, so it cannot be forged); the sidecar answers one line, a
token naming that uid and gid, valid :data:`TOKEN_TTL_S` seconds and signed (HMAC-SHA256) with a key
that exists only in this sidecar's memory. The client sends it as its bearer token on its next gRPC
call over the unix socket, and the interceptor (``server/security/auth.py``) checks the signature,
the expiry and that the call came over the unix socket, then looks the uid up in the token file's
``uid:<n>`` / ``user:<name>`` entries, else the gid in its ``gid:<n>`` / ``group:<name>`` entries.
The client fetches a fresh token for every call (one local round trip, tens of microseconds), so a
token never outlives its use and a sidecar restart (a new key) costs only a call that raced it.

The socket's group and mode decide who may connect at all; the uid and gid entries decide what
each connecting user may do. Once the token file has any such entry, a unix-socket call without a
token is refused (it could otherwise skip the uid check).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time

from tracestore.server.security.unix_socket import bind_unix_socket, claim_unix_socket

from tracestore.peer import PREFIX, TOKEN_TTL_S

log = logging.getLogger("tracestore.server.security.auth")

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class PeerTokens:
    """Mints and checks peer tokens: ``peer1.<uid>.<gid>.<expiry>.<nonce>.<hmac>``."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def _sign(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()

    def mint(self, uid: int, gid: int, now: float | None = None) -> str:
        expiry = int(time.time() if now is None else now) + TOKEN_TTL_S
        body = f"{int(uid)}.{int(gid)}.{expiry}.{secrets.token_hex(8)}"
        return f"{PREFIX}{body}.{self._sign(body)}"

    def verify(self, token: str, now: float | None = None) -> tuple[int, int] | None:
        """``(uid, gid)`` of a token this sidecar minted and that has not expired, else None."""
        if not token.startswith(PREFIX):
            return None
        body, _, sig = token[len(PREFIX) :].rpartition(".")
        if not hmac.compare_digest(sig.encode(), self._sign(body).encode()):
            return None
        try:
            uid, gid, expiry, _nonce = body.split(".")
            ids = int(uid), int(gid)
            live = int(expiry) >= (time.time() if now is None else now)
        except ValueError:
            return None
        return ids if live else None


class PeerEndpoint:
    """Listens on ``path`` (group ``gid``, ``mode``: the unix socket's) and answers each connection
    with a token for the connecting process's uid and gid, on a thread of its own."""

    def __init__(self, path: str, tokens: PeerTokens, gid: int | None, mode: int) -> None:
        self.path, self.tokens = path, tokens
        claim_unix_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            st = bind_unix_socket(lambda tmp: sock.bind(tmp), path, gid, mode, "--unix-socket (its .peer endpoint)")
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        self._sock, self._id = sock, (st.st_dev, st.st_ino)
        self._thread = threading.Thread(target=self._serve, name="tracestore-peer-auth", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed by stop()
            with conn:
                try:
                    conn.settimeout(2.0)
                    _pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
                    conn.sendall((self.tokens.mint(uid, gid) + "\n").encode())
                except OSError as exc:  # a peer that went away: nothing to answer
                    log.debug("peer endpoint: %s", exc)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(5)
        with contextlib.suppress(OSError):
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._id:
                os.unlink(self.path)
