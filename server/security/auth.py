"""Who may call the sidecar, and what each caller may do.

Transport: TLS on the TCP port (:class:`ServerTls`; client certificates required when a client CA
is given), its files read again on SIGHUP. The unix socket stays plaintext: it is local.

Authentication: bearer tokens (``authorization: Bearer <token>`` metadata, what
``grpc.access_token_call_credentials`` sends), checked by :class:`AuthInterceptor` against a token
file (:class:`TokenFile`, also read again on SIGHUP) that holds only SHA-256 digests::

    # sha256:<hex digest of the token> <scope>[,<scope>...] [name]
    sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 write:rl-*,read:rl-* rollout
    sha256:60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752 admin ops

``printf %s "$TOKEN" | sha256sum`` gives a token's digest. Scopes: ``write:<run glob>`` (Write and
Seal of matching runs), ``read:<run glob>`` (Read), ``admin`` (Stat of every run and the storage
URL; it grants neither reads nor writes). Globs are :func:`fnmatch.fnmatchcase` patterns. A
presented token is hashed and compared with every digest in the file (``hmac.compare_digest``, no
early exit). Tokens are never logged; a caller is named by the file's ``name`` column, else by the
first 8 hex digits of its digest. The name is the caller's identity: writer ids and trajectories
belong to the identity that first used them, so tokens listed under one name act as one caller
(rotate a token by listing the new one under the old name, then removing the old one). Health and
reflection stay open (probes need them).

Unix-socket peers: grpcio reports such a peer only as ``unix:`` (no uid/gid), so by default the
socket file's permissions are the boundary: a unix-socket call without a token is the identity
``unix-socket`` with every scope, unless the sidecar is told to require tokens there too. A token
presented on the socket is checked like any other (a wrong one is refused, never ignored). The
token file may also authorize unix-socket peers by their uid or gid::

    uid:1000 write:rl-*,read:rl-* rollout      # or user:<name>; resolved when the file is read
    gid:2000 read:*                            # or group:<name>: the peer's primary group

Such a peer proves its uid and gid with a peer token from ``<unix socket>.peer``
(``server/security/peer_auth.py``: the kernel's SO_PEERCRED, signed by the sidecar, valid a minute,
good only on the unix socket); the uid's entry wins over the gid's, and the identity is named by the
entry's name, else ``uid:<n>``/``gid:<n>``. With any such entry in the file, a unix-socket call
without a token is refused.

Authorization: the interceptor puts the caller's :class:`Identity` in a context variable for the
handler's duration (:func:`caller`); the handlers check it against each request's run.
A Write stream already open asks :func:`recheck` what the file says of its caller now, and ends
once a reload has revoked its credential or changed its scopes. TLS is :mod:`.tls`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import hmac
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import grpc
from tracestore.server.config import is_loopback_host  # noqa: F401  (the service asks auth)
from tracestore.server.security.peer_auth import PeerTokens

from tracestore.errors import ConfigError, PermissionDeniedError
from tracestore.peer import PREFIX as PEER_PREFIX

log = logging.getLogger("tracestore.server.security.auth")

SERVICE_PREFIX = "/tracestore.v1.TraceStore/"
_DIGEST = re.compile(r"sha256:([0-9a-fA-F]{64})")
_NAME = re.compile(r"[A-Za-z0-9._@:+-]{1,64}")
_DIGITS = re.compile(r"[0-9]+")


@dataclasses.dataclass(frozen=True)
class Identity:
    """An authenticated caller: a name for logs and the run globs it may write and read."""

    name: str
    write: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    admin: bool = False

    def may_write(self, run: str) -> bool:
        return any(fnmatchcase(run, g) for g in self.write)

    def may_read(self, run: str) -> bool:
        return any(fnmatchcase(run, g) for g in self.read)

    def may_see(self, run: str) -> bool:
        """Stat of one run: admin, or read or write access to it."""
        return self.admin or self.may_read(run) or self.may_write(run)


# Authentication off (no token file): the sidecar then listens on loopback and the unix socket only.
ANYONE = Identity("anyone", ("*",), ("*",), True)
# A unix-socket peer without a token, where the socket file's permissions are the boundary.
UNIX_PEER = Identity("unix-socket", ("*",), ("*",), True)
# Authentication on but no identity set for this call (a handler reached without the interceptor):
# every check fails.
NOBODY = Identity("unauthenticated")

_CALLER: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("tracestore_caller", default=None)
# The caller's identity as the token file says now (None: no longer accepted), for calls that
# outlive a reload: an open Write stream asks it again and ends once its token is revoked.
_RECHECK: contextvars.ContextVar[Callable[[], Identity | None] | None] = contextvars.ContextVar(
    "tracestore_recheck", default=None
)


def recheck() -> Callable[[], Identity | None] | None:
    """For the call this handler serves: a function giving the caller's identity under the token
    file as it is now (None once its credential is no longer accepted); None with authentication
    off."""
    return _RECHECK.get()


def caller(auth_enabled: bool) -> Identity:
    """The identity of the call this handler serves (:data:`ANYONE` with authentication off)."""
    if not auth_enabled:
        return ANYONE
    return _CALLER.get() or NOBODY


def require_write(who: Identity, run: str) -> None:
    if not who.may_write(run):
        raise PermissionDeniedError(f"caller {who.name!r} may not write run {run!r}")


def require_read(who: Identity, run: str) -> None:
    if not who.may_read(run):
        raise PermissionDeniedError(f"caller {who.name!r} may not read run {run!r}")


def require_see(who: Identity, run: str) -> None:
    if not who.may_see(run):
        raise PermissionDeniedError(f"caller {who.name!r} may not see run {run!r}")


# -- token file ----------------------------------------------------------------------------------


def parse_scopes(text: str, where: str) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """``write:<glob>,read:<glob>,admin`` -> (write globs, read globs, admin)."""
    write: list[str] = []
    read: list[str] = []
    admin = False
    for scope in text.split(","):
        kind, sep, glob = scope.partition(":")
        if scope == "admin":
            admin = True
        elif sep and kind in ("write", "read") and glob and not any(c.isspace() for c in glob):
            (write if kind == "write" else read).append(glob)
        else:
            raise ConfigError(f"{where}: scope {scope!r} is not write:<run glob>, read:<run glob> or admin")
    return tuple(write), tuple(read), admin


def load_token_file(path: str | os.PathLike[str]) -> list[tuple[bytes, Identity]]:
    """(SHA-256 digest, identity) per token line of a token file (format: module docstring)."""
    return parse_token_file(path)[0]


PEER_KINDS = ("uid", "gid", "user", "group")


def _peer_rule(fields: list[str], where: str) -> tuple[tuple[str, int], Identity]:
    """``uid:<n>``/``user:<name>``/``gid:<n>``/``group:<name>`` ``<scopes> [name]`` ->
    (("uid" or "gid", number), identity)."""
    kind, _, value = fields[0].partition(":")
    if len(fields) not in (2, 3) or not value:
        raise ConfigError(
            f"{where}: expected '{kind}:<{'name' if kind in ('user', 'group') else 'number'}> "
            "<scope>[,<scope>...] [name]'"
        )
    if kind in ("uid", "gid"):
        if not _DIGITS.fullmatch(value):  # (not str.isdigit: it takes '²', which int() refuses)
            raise ConfigError(f"{where}: {kind}:{value!r} is not a number (user:<name> and group:<name> take names)")
        key = (kind, int(value))
    elif kind == "user":
        import pwd

        try:
            key = ("uid", pwd.getpwnam(value).pw_uid)
        except (KeyError, ValueError):  # ValueError: a name with a NUL in it
            raise ConfigError(f"{where}: user {value!r} is not a user on this host") from None
    else:
        import grp

        try:
            key = ("gid", grp.getgrnam(value).gr_gid)
        except (KeyError, ValueError):
            raise ConfigError(f"{where}: group {value!r} is not a group on this host") from None
    write, read, admin = parse_scopes(fields[1], where)
    name = fields[2] if len(fields) == 3 else f"{key[0]}:{key[1]}"
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: name {name!r} must be 1-64 of A-Z a-z 0-9 . _ @ : + -")
    return key, Identity(name, write, read, admin)


def parse_token_file(
    path: str | os.PathLike[str],
) -> tuple[list[tuple[bytes, Identity]], dict[tuple[str, int], Identity]]:
    """The token lines (SHA-256 digest, identity) and the unix-peer lines ((``"uid"``|``"gid"``,
    number) -> identity) of a token file. Errors name the file and line, never the line's text
    beyond its scope field."""
    p = Path(path)
    try:
        st = p.stat()
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {p}: {exc.strerror or exc}") from None
    mode = st.st_mode & 0o777
    if mode & 0o022:
        world = bool(mode & 0o002)
        writers, members = ("every user", "anyone on this host") if world else ("its group", "any member of its group")
        raise ConfigError(
            f"token file {p} is writable by {writers} (mode {mode:04o}): {members} could add a token of their own "
            f"for the next reload; expected at most 0640 (chmod go-w {p})"
        )
    if mode & 0o004:
        log.warning(
            "token file %s is readable by every user (mode %04o): expected at most 0640 (chmod o-r %s)", p, mode, p
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{p}:{at}: not UTF-8 text (byte {exc.start} of the file); expected a UTF-8 token file"
        ) from None
    entries: list[tuple[bytes, Identity]] = []
    rules: dict[tuple[str, int], Identity] = {}
    seen: set[bytes] = set()
    unnamed: set[str] = set()
    for n, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{p}:{n}"
        if fields[0].partition(":")[0] in PEER_KINDS:
            key, who = _peer_rule(fields, where)
            if key in rules:
                raise ConfigError(f"{where}: {key[0]}:{key[1]} is listed twice")
            rules[key] = who
            continue
        m = _DIGEST.fullmatch(fields[0])
        if m is None or len(fields) not in (2, 3):
            raise ConfigError(f"{where}: expected 'sha256:<64 hex digits> <scope>[,<scope>...] [name]'")
        digest = bytes.fromhex(m.group(1))
        if digest in seen:
            raise ConfigError(f"{where}: the same token digest is listed twice")
        seen.add(digest)
        write, read, admin = parse_scopes(fields[1], where)
        name = fields[2] if len(fields) == 3 else f"sha256:{m.group(1)[:8].lower()}"
        if len(fields) == 2:
            if name in unnamed:  # two tokens would be one identity by chance
                raise ConfigError(f"{where}: two unnamed tokens share the digest prefix {name}; name them")
            unnamed.add(name)
        if not _NAME.fullmatch(name):
            raise ConfigError(f"{where}: name {name!r} must be 1-64 of A-Z a-z 0-9 . _ @ : + -")
        entries.append((digest, Identity(name, write, read, admin)))
    return entries, rules


class TokenFile:
    """The tokens (and unix-peer uid/gid entries) the sidecar accepts, from ``path``; :meth:`reload`
    reads the file again (a file that fails to parse leaves the entries in use unchanged)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self._entries, self._peers = parse_token_file(self.path)
        if not self._entries and not self._peers:
            log.warning("token file %s lists no tokens: every TCP call will be refused", self.path)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def peer_rules(self) -> int:
        """How many uid/gid entries the file has (unix-socket peers need a peer token when any)."""
        return len(self._peers)

    def reload(self) -> int:
        entries, peers = parse_token_file(self.path)
        self._entries, self._peers = entries, peers  # reference swaps: calls in flight see old or new
        return len(entries)

    def authenticate(self, token: str) -> Identity | None:
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for known, who in self._entries:  # every entry, no early exit
            if hmac.compare_digest(digest, known):
                found = who
        return found

    def authenticate_peer(self, uid: int, gid: int) -> Identity | None:
        """The identity of a unix-socket peer: its uid's entry, else its gid's, else None."""
        peers = self._peers
        return peers.get(("uid", uid)) or peers.get(("gid", gid))


def bearer_token(metadata: Any) -> tuple[str | None, bool]:
    """(token, malformed) from the ``authorization`` metadata: (None, False) without any,
    (None, True) for one that is not a single ``Bearer <token>``."""
    values = [v for k, v in metadata or () if k == "authorization"]
    if not values:
        return None, False
    if len(values) != 1 or not isinstance(values[0], str):
        return None, True
    scheme, _, token = values[0].strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None, True
    return token, False


class AuthInterceptor(grpc.ServerInterceptor):
    """Authenticates every ``tracestore.v1.TraceStore`` call (other services pass untouched) and
    runs its handler with the caller's :class:`Identity` set (:func:`caller`).

    The token is checked where gRPC looks the handler up; the refusal (UNAUTHENTICATED) happens
    when the handler would start, where the peer is known (unix-socket peers may go without).
    ``on_refused()`` is called for every refusal (a metric)."""

    def __init__(
        self,
        tokens: TokenFile,
        *,
        unix_needs_token: bool = False,
        on_refused: Callable[[], None] | None = None,
        peer_tokens: PeerTokens | None = None,
    ) -> None:
        self.tokens = tokens
        self.unix_needs_token = unix_needs_token
        self.peer_tokens = peer_tokens
        self.on_refused = on_refused
        self._log_lock = threading.Lock()
        self._last_log = 0.0
        self._unlogged = 0

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        method = details.method
        if not method.startswith(SERVICE_PREFIX):
            return continuation(details)  # health, reflection: open
        handler = continuation(details)
        if handler is None:
            return None
        token, malformed = bearer_token(details.invocation_metadata)
        tokens = self.tokens
        peer = None  # (uid, gid) of a valid peer token
        if token is not None and token.startswith(PEER_PREFIX):
            peer = self.peer_tokens.verify(token) if self.peer_tokens is not None else None
        presented = token is not None or malformed

        def identify(unix: bool) -> Identity | None:
            """The caller under the token file as it is now."""
            if token is not None and peer is None and not token.startswith(PEER_PREFIX):
                found = tokens.authenticate(token)
                if found is not None:
                    return found
            if peer is not None and unix:
                found = tokens.authenticate_peer(*peer)
                if found is not None:
                    return found
            # no uid/gid entries: on the unix socket its permissions decide, for a valid peer token or none
            if unix and not self.unix_needs_token and not tokens.peer_rules and (peer is not None or not presented):
                return UNIX_PEER
            return None

        def resolve(context: grpc.ServicerContext) -> Identity:
            unix = context.peer().startswith("unix:")
            who = identify(unix)
            if who is not None:
                return who
            if peer is not None:
                why = (
                    f"unix-socket peer uid {peer[0]} (gid {peer[1]}) has no uid: or gid: entry in the token file"
                    if unix
                    else "a unix-socket peer token is accepted only on the unix socket"
                )
            elif presented:
                why = "the bearer token is not accepted"
            elif unix and tokens.peer_rules:
                why = (
                    "this sidecar authorizes unix-socket peers by uid/gid: send a peer token from "
                    "<socket>.peer (tracestore's client does) or a bearer token"
                )
            else:
                why = "this call needs 'authorization: Bearer <token>' metadata (call credentials)"
            self._refused(method, context.peer(), why)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
            raise AssertionError("unreachable: abort raises")

        return _with_identity(handler, resolve, identify)

    def _refused(self, method: str, peer: str, why: str) -> None:
        if self.on_refused is not None:
            with contextlib.suppress(Exception):
                self.on_refused()
        # At most one line every 10 s, with the count of those left out (no token ever appears).
        with self._log_lock:
            now = time.monotonic()
            if now - self._last_log < 10.0:
                self._unlogged += 1
                return
            more, self._unlogged, self._last_log = self._unlogged, 0, now
        log.warning(
            "refused %s from %s: %s%s", method, peer, why, f" ({more} more refused since the last line)" if more else ""
        )


def _with_identity(
    handler: grpc.RpcMethodHandler, resolve: Callable[[Any], Identity], identify: Callable[[bool], Identity | None]
) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour run in a context holding the resolved identity; a streamed
    response is produced step by step in that context (gRPC may pull it from several threads)."""
    req_s, resp_s = handler.request_streaming, handler.response_streaming
    if req_s and resp_s:
        behavior, factory = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif req_s:
        behavior, factory = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif resp_s:
        behavior, factory = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        behavior, factory = handler.unary_unary, grpc.unary_unary_rpc_method_handler

    def enter(context: Any) -> contextvars.Context:
        ctx = contextvars.copy_context()
        ctx.run(_CALLER.set, resolve(context))
        unix = context.peer().startswith("unix:")
        ctx.run(_RECHECK.set, lambda: identify(unix))
        return ctx

    if resp_s:

        def run(request: Any, context: Any) -> Any:
            ctx = enter(context)
            return _steps_in(ctx, ctx.run(behavior, request, context))

    else:

        def run(request: Any, context: Any) -> Any:
            return enter(context).run(behavior, request, context)

    return factory(
        run, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


def _steps_in(ctx: contextvars.Context, responses: Any) -> Iterator[Any]:
    it = ctx.run(iter, responses)
    try:
        while True:
            try:
                item = ctx.run(next, it)
            except StopIteration:
                return
            yield item
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            ctx.run(close)
