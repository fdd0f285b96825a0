"""The gRPC service ``tracestore.v1.TraceStore`` and the :class:`Sidecar` that hosts it.

Handlers take raw request bytes (generic handlers, no deserializer) and parse them themselves so
a malformed message is INVALID_ARGUMENT with an explanation. Errors map to status codes by class
(:func:`status_of`); no traceback ever reaches a client, and the storage location reaches only
an admin.

The service holds the call limits, the turns to read and the error reporting every handler
shares; the parts with state of their own are beside it: one Write stream's threads and the
:class:`ReadTurns` all streams take turns with (``write_stream.py``), the Read RPC's reader per run
and its streamed slices (``reads.py``), and the unix socket the :class:`Sidecar` listens on
(``unix_socket.py``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tracestore.server.config import GRPC_COPIES, HEALTH_THREADS, ServerConfig
from tracestore.server.engine.core import DEGRADED_REASONS, DrainingError, Engine, Waker
from tracestore.server.engine.memory import OverBudgetError
from tracestore.server.engine.message import pack_wal_data
from tracestore.server.engine.sessions import SequenceError
from tracestore.server.metrics import Metrics, storage_op
from tracestore.server.rpc.ingest import parse_seal, seal_message, wal_parser
from tracestore.server.rpc.reads import ReadHold, Reads
from tracestore.server.rpc.reflection import enable_server_reflection
from tracestore.server.rpc.shm import ShmPools
from tracestore.server.rpc.slots import CallSlots, StreamSlots
from tracestore.server.rpc.write_stream import ReadTurns, WriteStream
from tracestore.server.security.auth import (
    AuthInterceptor,
    Identity,
    TokenFile,
    caller,
    is_loopback_host,
    recheck,
    require_see,
    require_write,
)
from tracestore.server.security.peer_auth import PeerEndpoint, PeerTokens
from tracestore.server.security.tls import ServerTls
from tracestore.server.security.unix_socket import (
    bind_unix_socket,
    claim_unix_socket,
    remove_unix_socket,
    socket_access,
)

from tracestore import __version__
from tracestore.errors import (
    ConfigError,
    ConflictError,
    CorruptionError,
    GuidanceMismatch,
    LimitError,
    MissingRecordsError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
    TraceStoreError,
    UnauthenticatedError,
)
from tracestore.peer import PEER_SUFFIX
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import run_spec_to_pb

log = logging.getLogger("tracestore.server")
SERVICE = "tracestore.v1.TraceStore"
HEALTH_PERIOD_S = 1.0  # how often the health status follows Engine.degraded()
# The health service name for liveness probes: NOT_SERVING only for what a restart mends (the
# flusher thread died). A full WAL device or a storage outage is not mended by a restart, and an
# unready rollout pod would stop its engine's traffic: probes watch this name, alerts the others.
LIVENESS = "tracestore.v1.Liveness"
RESTART_MENDS = ("flusher_dead",)
RETRY_AFTER_LIMIT_MS = 1000  # retry hint with a refusal for a count limit (streams, concurrent calls)


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for an exception (the table in docs/protocol.md, "Status codes")."""
    if isinstance(exc, UnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(exc, PermissionDeniedError):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, OverBudgetError | LimitError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, SequenceError | GuidanceMismatch):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, DrainingError | StorageError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, ConflictError):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(exc, CorruptionError):
        return grpc.StatusCode.DATA_LOSS
    if isinstance(exc, NotFoundError | MissingRecordsError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, TraceStoreError | ValueError | TypeError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def _details(exc: BaseException) -> str:
    if status_of(exc) is grpc.StatusCode.INTERNAL:
        return f"internal error ({type(exc).__name__}); see the sidecar log"
    return str(exc)[:2000]


class TraceStoreService:
    """Handlers of tracestore.v1.TraceStore over one :class:`Engine`.

    Threads: each open Write stream holds one gRPC worker thread (and two of its own) for its
    whole life, so at most ``max_streams`` are admitted; Read and Seal, which can run long, take at
    most ``workers - HEALTH_THREADS`` threads together; what remains answers health checks and Stat.
    Memory: a Write stream reserves ``max_message_bytes`` of the engine's budget before it asks
    for a message and keeps only the message's size once it has arrived (plus two
    ``max_message_bytes`` reserved for good: gRPC's copies of the message it is delivering); a Read
    reserves its output in the read budget, not this one, until its stream ends (``reads.py``).
    """

    def __init__(self, engine: Engine, metrics: Metrics, shm: ShmPools, config: ServerConfig) -> None:
        self.engine = engine
        self.metrics = metrics
        self.shm = shm
        self.config = config
        self.reads = Reads(engine, config, metrics)
        self.draining = False
        share = config.streams_per_identity if config.auth_tokens is not None else None
        self.streams = StreamSlots(config.max_streams, share)
        self.long_calls = CallSlots(max(1, config.workers - HEALTH_THREADS))
        self.turns = ReadTurns(config.reading_streams, on_waiting=metrics.waiting_streams.set)
        # gRPC joins each message it receives from copies of its buffer's slices, one at a time: for
        # that moment the message takes three times its size. Room for two copies of the largest
        # message stays reserved as long as the service runs (its buffers: the stream's
        # reservation).
        self.copy_room = engine.budget.keep(GRPC_COPIES * config.max_message_bytes)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Write": grpc.stream_stream_rpc_method_handler(self.write),
                "Seal": grpc.unary_unary_rpc_method_handler(self.seal),
                "Read": grpc.unary_stream_rpc_method_handler(self.read),
                "Stat": grpc.unary_unary_rpc_method_handler(self.stat),
            },
        )

    def _fail(self, context: grpc.ServicerContext, method: str, exc: BaseException, meta: dict[str, str]) -> None:
        code = status_of(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.exception("internal error in %s", method, exc_info=exc)
        if isinstance(exc, OverBudgetError):
            meta["retry-after-ms"] = str(int(exc.retry_after_s * 1000))
        elif isinstance(exc, LimitError):  # a count limit (streams, calls, writers, runs) may free up
            meta.setdefault("retry-after-ms", str(RETRY_AFTER_LIMIT_MS))
        self.metrics.rejected.labels(code.name).inc()
        if isinstance(exc, CorruptionError):
            self.metrics.checksum_failures.inc()
        self.metrics.requests.labels(method, code.name).inc()
        if meta:
            context.set_trailing_metadata(tuple(meta.items()))
        details = _details(exc)
        if not self._caller().admin:  # where the data lives is for admins only
            for where in self._storage_names():
                details = details.replace(where, "<storage>")
        context.abort(code, details)

    def _caller(self) -> Any:
        return caller(self.config.auth_tokens is not None)

    def _identity(self, who: Any) -> str | None:
        """The name writer ids and trajectories are owned by (None with authentication off)."""
        return who.name if self.config.auth_tokens is not None else None

    def _storage_names(self) -> list[str]:
        """How error messages may spell the storage location: its URL and its root path."""
        root = getattr(getattr(self.engine.store, "storage", None), "root", "") or ""
        names = {self.config.storage, root, root.lstrip("/")}
        return sorted((n for n in names if len(n) > 1), key=len, reverse=True)

    # -- Write ------------------------------------------------------------------------------------

    def write(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """Bidirectional stream: each message in, acks of the highest durable sequence out. At most
        ``max_streams`` at once, and ``max_streams_per_identity`` of one identity with tokens: one
        more is refused at once, before it takes anything. So is a caller who may write no run at
        all (its run is only known from the first message, which is authorized in the stream)."""
        who = self._caller()
        identity = self._identity(who)
        if not who.write:
            # (admin grants no writes: auth.py) refused before it holds a slot or any budget
            denied = PermissionDeniedError(
                f"caller {who.name!r} may not write any run: a Write stream needs a write:<run glob> scope "
                "that matches its run (in the sidecar's --auth-tokens file)"
            )
            self._fail(context, "Write", denied, {})
        refused = self.streams.take_for(identity)
        if refused == "max_streams_per_identity":
            limit = LimitError(
                f"{self.streams.share} Write streams of caller {who.name!r} are open on this sidecar, its share "
                "(max_streams_per_identity, --max-streams-per-identity); retry later, close idle streams, share a "
                "stream per process, or raise the share"
            )
            self._fail(context, "Write", limit, {})
        elif refused is not None:
            limit = LimitError(
                f"{self.streams.limit} Write streams are open on this sidecar, its limit (max_streams, "
                "--max-streams); retry later, share a stream per process, or raise the limit"
            )
            self._fail(context, "Write", limit, {})
        try:
            try:
                own = self.engine.reserve_stream()
            except LimitError as exc:
                self._fail(context, "Write", exc, {"retry-after-ms": str(RETRY_AFTER_LIMIT_MS)})
            try:
                yield from self._write(who, identity, requests, context)
            finally:
                self.engine.unreserve(own)
        finally:
            self.streams.give_for(identity)

    def _write(
        self, who: Identity, identity: str | None, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        stream = WriteStream(
            self.engine, self.shm, self.metrics, self.turns, self.config,
            who=who, identity=identity, draining=lambda: self.draining, fail=self._fail,
            slot_wanted=self.streams.wanted, recheck=recheck() if self.config.auth_tokens is not None else None,
        )  # fmt: skip
        yield from stream.serve(requests, context)

    # -- Seal -------------------------------------------------------------------------------------

    def _refuse_busy(self, context: grpc.ServicerContext, method: str) -> None:
        limit = LimitError(
            f"{self.long_calls.limit} Read and Seal calls are running on this sidecar, its limit (workers - "
            f"{HEALTH_THREADS}, --workers {self.config.workers}); retry later"
        )
        self._fail(context, method, limit, {})

    def seal(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        """Unary twin of a Write message; returns once it is durable (takes a long-call slot)."""
        if not self.long_calls.take():
            self._refuse_busy(context, "Seal")
        try:
            return self._seal(raw, context)
        finally:
            self.long_calls.give()

    def _seal(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            req = parse_seal(raw)
            require_write(self._caller(), req.run)
            identity = self._identity(self._caller())
            msg = seal_message(req, lambda run: self.engine.write_spec(run, identity))
            wal = pb.WriteRequest(
                run=req.run, writer=req.writer, epoch=req.epoch, sequence=req.sequence, seals=req.seals, links=req.links
            ).SerializeToString()
            st, _ = self.engine.submit(msg, pack_wal_data(wal, []), identity=identity)
            deadline = time.monotonic() + max(1.0, context.time_remaining() or self.config.grace_s)
            waker = Waker()
            self.engine.listen(st, waker)
            try:
                while True:
                    epoch, durable, _ = self.engine.durable(st)
                    if epoch != req.epoch or durable >= req.sequence:
                        break
                    if time.monotonic() > deadline or not context.is_active():
                        raise StorageError("the seal was accepted but is not durable yet; resend it (it is idempotent)")
                    waker.wait(0.1)
            finally:
                self.engine.unlisten(st, waker)
        except Exception as exc:  # noqa: BLE001
            self._fail(context, "Seal", exc, {})
            raise  # unreachable: abort raises
        self.metrics.requests.labels("Seal", "OK").inc()
        return pb.SealResponse(epoch=epoch, durable_sequence=durable).SerializeToString()

    # -- Read -------------------------------------------------------------------------------------

    def read(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Plan-aligned rows, in slices of about READ_SLICE_BYTES. The whole output is held against
        the read budget from before storage is read until the stream ends."""
        if not self.long_calls.take():
            self._refuse_busy(context, "Read")
        hold = ReadHold(self._identity(self._caller()))
        try:
            yield from self._read(raw, context, hold)
        finally:
            self.reads.release(hold)
            self.long_calls.give()

    def _read(self, raw: bytes, context: grpc.ServicerContext, hold: ReadHold) -> Iterator[bytes]:
        t0 = time.monotonic()
        try:
            rows_by_site, mismatched = self.reads.rows(raw, self._caller(), hold)
        except Exception as exc:  # noqa: BLE001
            self._fail(context, "Read", exc, {})
            return
        yield from self.reads.stream(rows_by_site, context, t0, mismatched)

    # -- Stat -------------------------------------------------------------------------------------

    def stat(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            from tracestore.server.rpc.ingest import decode_message

            req = decode_message(pb.StatRequest, raw, "Stat request")
            assert isinstance(req, pb.StatRequest)
            who = self._caller()
            if req.run:
                require_see(who, req.run)
            s = self.engine.stat(req.run)
            if not who.admin:  # the sidecar-wide view is an admin's; others see their own writer ids
                mine = self._identity(who)  # (with tokens: of runs they may see, theirs or not yet claimed)
                s["writers"] = [
                    w for w in s["writers"] if who.may_see(w["run"]) and (mine is None or w["owner"] in (None, mine))
                ]
            spec = None
            if req.run:
                with contextlib.suppress(NotFoundError):
                    spec = run_spec_to_pb(self.engine.run_spec(req.run))
        except Exception as exc:  # noqa: BLE001
            self._fail(context, "Stat", exc, {})
            raise
        self.metrics.requests.labels("Stat", "OK").inc()
        return pb.StatResponse(
            state=pb.SERVING_STATE_DRAINING if s["draining"] else pb.SERVING_STATE_SERVING,
            version=__version__,
            backlog_bytes=s["backlog_bytes"],
            memory_in_use_bytes=s["memory_in_use_bytes"],
            memory_budget_bytes=s["memory_budget_bytes"],
            wal_bytes=s["wal_bytes"],
            open_trajectories=s["open_trajectories"],
            shards_committed=s["shards_committed"],
            writers=[pb.WriterState(**{k: v for k, v in w.items() if k != "owner"}) for w in s["writers"]],
            storage_url=self.config.storage if who.admin else "",
            run_spec=spec,
            degraded=self.degraded(),
        ).SerializeToString()

    def degraded(self) -> list[str]:
        """Why the engine reports itself unhealthy (its fixed set of reasons); empty: healthy."""
        return list(self.engine.degraded())


class Sidecar:
    """A running sidecar: engine, gRPC server (TCP + optional unix socket), health, reflection, metrics.

    >>> sc = Sidecar(ServerConfig(storage="memory://x", wal_dir=None, port=0, metrics_port=None)).start()
    >>> sc.port > 0
    True
    >>> sc.stop()
    """

    def __init__(self, config: ServerConfig, store: Any = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.metrics.build_info.info({"version": __version__})
        self._store = store
        self.port = 0
        self.metrics_port: int | None = None
        self._server: grpc.Server | None = None
        self._http: Any = None
        self.engine: Engine | None = None
        self.service: TraceStoreService | None = None
        self.health = health.HealthServicer()
        self._stopped = threading.Event()
        self._serving: bool | None = None  # the health status last set (None: not yet)
        self._tls: ServerTls | None = None
        self._tokens: TokenFile | None = None
        self._peer_tokens: PeerTokens | None = None
        self._peer_endpoint: PeerEndpoint | None = None
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the unix socket it bound

    def _storage_event(self, kind: str, op: str, detail: str) -> None:
        # The store names the object ("write run-a/v0/..."): keep the operation word only, one of a
        # fixed set, so the label never carries run/writer/trajectory ids (metrics.py contract).
        name = storage_op(op)
        if kind == "retry":
            self.metrics.storage_retries.labels(name).inc()
        else:
            self.metrics.storage_errors.labels(name).inc()

    def start(self) -> Sidecar:
        """Bind every listener first (a port in use fails here, before the WAL is touched), then
        replay the WAL, then serve."""
        cfg = self.config
        # TLS and token files first: a file that does not load fails here, before anything else
        if cfg.tls_cert is not None and cfg.tls_key is not None:
            self._tls = ServerTls(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
        if cfg.auth_tokens is not None:
            self._tokens = TokenFile(cfg.auth_tokens)
        if self._store is None:
            from tracestore.storage.store import Store

            self._store = Store(
                cfg.storage, cfg.storage_options, config=cfg.storage_config(), on_event=self._storage_event
            )
            self._store.remove_stale_temp_files()  # left by writers killed mid-publish (local disk only)
        self.engine = Engine(cfg, self._store, self.metrics)
        self.shm = ShmPools.for_config(cfg, on_change=self.metrics.shm_capacity.set)  # (a share per identity)
        service = self.service = TraceStoreService(self.engine, self.metrics, self.shm, cfg)
        interceptors = []
        if self._tokens is not None:
            refused = self.metrics.rejected.labels(grpc.StatusCode.UNAUTHENTICATED.name).inc
            needs = cfg.unix_needs_token
            # unix-socket peers may prove their uid/gid with a token from <socket>.peer (peer_auth.py)
            self._peer_tokens = PeerTokens() if cfg.unix_socket and hasattr(socket, "SO_PEERCRED") else None
            interceptors.append(
                AuthInterceptor(self._tokens, unix_needs_token=needs, on_refused=refused, peer_tokens=self._peer_tokens)
            )
        server = grpc.server(
            # a thread per Write stream up to the cap, and `workers` more (health, Stat, Read, Seal)
            futures.ThreadPoolExecutor(max_workers=cfg.rpc_threads, thread_name_prefix="tracestore-rpc"),
            options=cfg.grpc_options(),
            maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
            interceptors=interceptors,
        )
        server.add_generic_rpc_handlers((service.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        # grpc.reflection.v1 and v1alpha (server/rpc/reflection.py)
        enable_server_reflection((pb.DESCRIPTOR.services_by_name["TraceStore"].full_name, health.SERVICE_NAME), server)
        if cfg.port is not None:  # None: the unix socket only
            try:
                host = f"[{cfg.host}]" if ":" in cfg.host and not cfg.host.startswith("[") else cfg.host  # IPv6
                address = f"{host}:{cfg.port}"
                tls = self._tls
                self.port = (server.add_secure_port(address, tls.credentials()) if tls
                             else server.add_insecure_port(address))  # fmt: skip
            except RuntimeError as exc:
                raise ConfigError(
                    f"cannot listen on {cfg.host}:{cfg.port} (in use by another process?); choose another --port"
                ) from exc
        if cfg.unix_socket:
            gid, mode = socket_access(cfg)
            claim_unix_socket(cfg.unix_socket)
            st = bind_unix_socket(lambda tmp: server.add_insecure_port(f"unix:{tmp}"), cfg.unix_socket, gid, mode)
            self._socket_id = (st.st_dev, st.st_ino)
            if self._peer_tokens is not None:
                self._peer_endpoint = PeerEndpoint(cfg.unix_socket + PEER_SUFFIX, self._peer_tokens, gid, mode)
            # Pools must be readable by everyone the socket admits (server/rpc/shm.py): its group,
            # or only the sidecar's uid
            self.shm.group = st.st_gid if mode & 0o020 else None
        if cfg.metrics_port is not None:
            from prometheus_client import start_http_server

            try:
                self._http, _ = start_http_server(cfg.metrics_port, cfg.metrics_host, registry=self.metrics.registry)
            except OSError as exc:
                raise ConfigError(
                    f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port} ({exc}); "
                    "choose another --metrics-port or 'off'"
                ) from exc
            self.metrics_port = self._http.server_port
        try:
            self.engine.start(wal_parser(self.engine.run_spec))
        except BaseException:
            # (a second sidecar refused at the WAL lock) leave no socket, peer endpoint or metrics
            # port of its own behind
            self._release_listeners()
            raise
        server.start()
        self._server = server
        self._log_security()
        self._follow_health()
        threading.Thread(target=self._health_loop, name="tracestore-health", daemon=True).start()
        return self

    def _health_loop(self) -> None:
        while not self._stopped.wait(HEALTH_PERIOD_S):
            try:
                self._follow_health()
            except Exception:  # noqa: BLE001 - the loop outlives a failing check; the status stays
                log.exception("health check of the engine failed")

    def _follow_health(self) -> None:
        """Health SERVING while the engine reports nothing wrong, NOT_SERVING while it does (a
        shutdown's NOT_SERVING is final: the servicer ignores later sets); tracestore_degraded."""
        assert self.service is not None
        reasons = self.service.degraded()
        for reason in DEGRADED_REASONS:
            self.metrics.degraded.labels(reason).set(1 if reason in reasons else 0)
        serving = not reasons
        if serving != self._serving:
            if not serving:
                log.error("degraded (%s): health NOT_SERVING", ", ".join(reasons))
            elif self._serving is not None:
                log.warning("no longer degraded: health SERVING")
        self._serving = serving
        up, down = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            self.health.set(name, up if serving else down)
        self.health.set(LIVENESS, down if any(r in RESTART_MENDS for r in reasons) else up)

    def _log_security(self) -> None:
        cfg = self.config
        tcp = f"{cfg.host}:{self.port} ({'mutual TLS' if cfg.tls_client_ca else 'TLS' if self._tls else 'plaintext'})"
        if cfg.port is None:
            tcp = "no TCP port (--port off, the default beside --unix-socket without --auth-tokens)"
        if self._tokens is None:
            log.warning(
                "no --auth-tokens: every caller may read and write every run; serving %s%s",
                tcp if cfg.port is None or is_loopback_host(cfg.host) else f"{tcp}, NOT loopback (--insecure)",
                f" and unix:{cfg.unix_socket}" if cfg.unix_socket else "",
            )
        else:
            clear = cfg.port is not None and not cfg.tls_cert and not is_loopback_host(cfg.host)
            peers = self._tokens.peer_rules
            log.info(
                "serving %s with %d bearer token(s)%s%s", tcp, len(self._tokens),
                f"; unix:{cfg.unix_socket} needs tokens too" if cfg.unix_needs_token else
                f"; unix:{cfg.unix_socket} peers authorized by {peers} uid/gid entr{'y' if peers == 1 else 'ies'}"
                if peers and cfg.unix_socket else "",
                "; tokens cross the network in the clear (--insecure)" if clear else "",
            )  # fmt: skip

    def reload(self) -> None:
        """Read the TLS files and the token file again (SIGHUP). What fails to load is logged and
        the files in use stay; new connections get the new certificate, new calls the new tokens."""
        for what, part in (("TLS files", self._tls), ("token file", self._tokens)):
            if part is None:
                continue
            try:
                n = part.reload()
            except Exception as exc:  # noqa: BLE001 - a SIGHUP never takes the sidecar down
                log.error("reload of the %s failed, the ones in use stay: %s", what, exc)
            else:
                if part is self._tls:  # gRPC takes them at the next handshake; it may still refuse them there
                    log.info("read the TLS files again: new connections get them (gRPC logs it and keeps the "
                             "ones in use if it cannot use them)")  # fmt: skip
                else:
                    log.info("reloaded the %s%s", what, "" if n is None else f" ({n} tokens)")

    def stop(self, grace: float | None = None) -> bool:
        """NOT_SERVING at once, stop accepting, drain streams, commit (or leave it in the WAL)."""
        if self._stopped.is_set():
            return True
        self._stopped.set()
        grace = self.config.grace_s if grace is None else grace
        t_end = time.monotonic() + grace
        self.health.enter_graceful_shutdown()
        if self.service is not None:
            self.service.draining = True
        ok = True
        if self.engine is not None:
            ok = self.engine.drain(max(0.1, grace * 0.5))
        if self._server is not None:
            left = max(0.1, t_end - time.monotonic())
            streams = int(self.metrics.active_streams._value.get())
            if streams:
                log.info("stopping: waiting up to %.1f s for %d open Write stream(s), each ending once what it "
                         "sent is durable", left, streams)  # fmt: skip
            self._server.stop(left).wait()
            if time.monotonic() >= t_end - 0.05:
                log.warning("stopping: the %.1f s grace period ended with calls still open; gRPC cancelled them "
                            "(writers resend what was not acknowledged)", grace)  # fmt: skip
        if self.engine is not None:
            ok = self.engine.flush(max(0.1, t_end - time.monotonic())) and ok
            self.engine.close(timeout=max(0.0, t_end - time.monotonic()))
        self._release_listeners()
        return ok

    def _release_listeners(self) -> None:
        """Close the metrics port; remove this sidecar's unix socket and its peer endpoint."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self.config.unix_socket and self._socket_id is not None:
            remove_unix_socket(self.config.unix_socket, self._socket_id)
            self._socket_id = None
        if self._peer_endpoint is not None:
            self._peer_endpoint.stop()
            self._peer_endpoint = None

    def wait(self) -> None:
        if self._server is not None:
            self._server.wait_for_termination()
