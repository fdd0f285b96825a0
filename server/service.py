"""The gRPC service ``tracestore.v1.TraceStore`` and the :class:`Sidecar` that hosts it.

Handlers take raw request bytes (generic handlers, no deserializer) and parse them themselves so
a malformed message is INVALID_ARGUMENT with an explanation. Errors map to status codes by class
(:func:`status_of`); no traceback ever reaches a client.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, Literal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tracestore import __version__
from tracestore.errors import (
    ConfigError,
    ConflictError,
    CorruptionError,
    LimitError,
    MissingRecordsError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
    TraceStoreError,
    UnauthenticatedError,
    ValidationError,
)
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import run_spec_from_pb, run_spec_to_pb

from .auth import (
    AuthInterceptor,
    ServerTls,
    TokenFile,
    caller,
    is_loopback_host,
    require_read,
    require_see,
    require_write,
)
from .config import HEALTH_THREADS, READ_SLICE_BYTES, ServerConfig
from .engine import DEGRADED_REASONS, DrainingError, Engine, OverBudgetError, SequenceError, Waker
from .ingest import parse_seal, parse_write, scan_write, seal_message, wal_parser
from .message import pack_wal_data
from .metrics import Metrics, storage_op, unguided_reason
from .reflection import enable_server_reflection
from .shm import ShmPools

log = logging.getLogger("tracestore.server")
SERVICE = "tracestore.v1.TraceStore"
# A Write stream that has waited this long for its next message while other streams wait for a turn
# to read is ended (OK, once all it sent is durable), so idle recorders cannot starve busy ones.
READ_TURN_IDLE_S = 2.0
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
    if isinstance(exc, SequenceError):
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


def read_size(req: pb.ReadRequest, spec: Any, sites: list[str]) -> int:
    """Bytes a Read's output takes (per row of each site read: codes and scales of the column range,
    policy version, global scale, token scale, valid and stale flags), computed from the request
    alone; raises ValidationError for what no read could serve (undeclared or repeated sites,
    negative versions, empty or negative token ranges, column ranges outside a site)."""
    declared = set(spec.site_names)
    for name in sites:
        if name not in declared:
            raise ValidationError(
                f"run {spec.run} declares no site {name[:200]!r}; expected sites among {sorted(declared)}"
            )
    if len(set(sites)) != len(sites):
        raise ValidationError(f"expected each site once in the Read request, got {sites}")
    bad = [v for v in req.versions if v < 0]
    if bad:
        raise ValidationError(f"expected policy versions >= 0 in the Read request, got {bad[:10]}")
    tokens = 0
    for i, seg in enumerate(req.plan):
        if not 0 <= seg.token_start < seg.token_end:
            raise ValidationError(
                f"plan segment {i} ({seg.trajectory[:200]!r}): expected 0 <= token_start < token_end, "
                f"got [{seg.token_start}, {seg.token_end})"
            )
        tokens += seg.token_end - seg.token_start  # a Python int: no overflow, however large
    nbytes = 0
    for name in sites:
        site = spec.site(name)
        width = site.width
        if req.has_columns:
            if not 0 <= req.column_start < req.column_end <= site.width:
                raise ValidationError(
                    f"site {name}: expected a column range within [0, {site.width}], got "
                    f"[{req.column_start}, {req.column_end})"
                )
            width = req.column_end - req.column_start
        row = width * site.bits // 8 + width // site.fmt.block + 8 + 4 + 4 + 1 + 1
        nbytes += tokens * site.rows_per_token * row
    return nbytes


def _details(exc: BaseException) -> str:
    if status_of(exc) is grpc.StatusCode.INTERNAL:
        return f"internal error ({type(exc).__name__}); see the sidecar log"
    return str(exc)[:2000]


class ReadTurns:
    """Turns to read a message, first come first served: a Write stream takes one before it asks
    gRPC for its next message and gives it back once the message has arrived. There are only as
    many as the memory budget covers at ``max_message_bytes`` each (a message arrives whole, up to
    that size, once it is asked for), so the streams without one wait with nothing read."""

    def __init__(self, turns: int, on_waiting: Callable[[int], None] | None = None) -> None:
        self.free = turns
        self._queue: deque[object] = deque()
        self._cond = threading.Condition()
        self._on_waiting = on_waiting

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def acquire(self, give_up: Callable[[], bool], poll_s: float = 0.25) -> bool:
        """Wait for a turn (in arrival order); False once ``give_up()`` is true (polled)."""
        me = object()
        with self._cond:
            if self.free > 0 and not self._queue:
                self.free -= 1
                return True
            self._queue.append(me)
            self._changed()
            try:
                while not (self.free > 0 and self._queue[0] is me):
                    if give_up():
                        return False
                    self._cond.wait(poll_s)
                self.free -= 1
                return True
            finally:
                self._queue.remove(me)
                self._changed()
                self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self.free += 1
            self._cond.notify_all()

    def _changed(self) -> None:
        if self._on_waiting is not None:
            self._on_waiting(len(self._queue))


class CallSlots:
    """A count limit taken without waiting: ``take()`` is False when all ``limit`` are in use."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.used >= self.limit:
                return False
            self.used += 1
            return True

    def give(self) -> None:
        with self._lock:
            self.used -= 1


class TraceStoreService:
    """Handlers of tracestore.v1.TraceStore over one :class:`Engine`.

    Threads: each open Write stream holds one gRPC worker thread (and two of its own) for its
    whole life, so at most ``max_streams`` are admitted; Read and Seal, which can run long, take at
    most ``workers - HEALTH_THREADS`` threads together; what remains answers health checks and Stat.
    Memory: a Write stream reserves ``max_message_bytes`` of the engine's budget before it asks
    for a message and keeps only the message's size once it has arrived (plus one
    ``max_message_bytes`` reserved for good: gRPC's copy of the message it is delivering); a Read
    reserves its output size before it reads storage and releases it when its stream ends.
    """

    def __init__(self, engine: Engine, metrics: Metrics, shm: ShmPools, config: ServerConfig) -> None:
        self.engine = engine
        self.metrics = metrics
        self.shm = shm
        self.config = config
        self._readers: dict[str, Any] = {}
        self._readers_lock = threading.Lock()
        self.draining = False
        self.streams = CallSlots(config.max_streams)
        self.long_calls = CallSlots(max(1, config.workers - HEALTH_THREADS))
        self.turns = ReadTurns(config.reading_streams, on_waiting=metrics.waiting_streams.set)
        # gRPC copies each message it receives out of its buffers into a bytes object, one message at
        # a time: for that moment the message takes twice its size. Room for the second copy of
        # the largest message stays reserved as long as the service runs.
        self.copy_room = engine.reserve(config.max_message_bytes)

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
        ``max_streams`` at once: one more is refused at once, before it takes anything."""
        if not self.streams.take():
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
                yield from self._write(requests, context)
            finally:
                self.engine.unreserve(own)
        finally:
            self.streams.give()

    def _write(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        waker = Waker()
        box: dict[str, Any] = {"state": None, "epoch": None, "error": None, "failed_seq": None, "done": False}
        # when the receiver asked gRPC for the next message (None: not waiting for one),
        # and whether the consumer is working on a message
        box.update(reading_since=None, busy=False)
        local = context.peer().startswith("unix:")
        shm = self.shm.view if local else None
        self.metrics.active_streams.inc()

        who = self._caller()
        may_write: set[str] = set()  # runs this stream's caller was found to be allowed to write

        def run_spec(run: str) -> Any:  # every message's run passes here: each is authorized
            if run not in may_write:
                require_write(who, run)
                may_write.add(run)
            return self.engine.run_spec(run)

        def declare(spec: pb.RunSpec) -> None:
            require_write(who, spec.run)
            self.engine.declare_run(run_spec_from_pb(spec))

        # Two threads per stream: one takes messages off the wire (after reserving budget for them),
        # one parses and admits them, so receiving message n+1 overlaps processing message n.
        handoff: queue.Queue[tuple[bytes, int] | None] = queue.Queue(maxsize=1)
        bound = self.config.max_message_bytes  # gRPC delivers no bigger message

        def give_up_turn() -> bool:
            return box["error"] is not None or self.draining or not context.is_active()

        def receive() -> None:
            it = iter(requests)
            try:
                while box["error"] is None:
                    # Once asked for a message, gRPC takes in all of it (flow control opens the window
                    # to its size): ask only with a turn and room in the budget for the largest one.
                    if not self.turns.acquire(give_up_turn):
                        break
                    try:
                        reserved = self.engine.reserve(bound)
                        box["reading_since"] = time.monotonic()
                        try:
                            raw = next(it)
                        except BaseException:
                            self.engine.unreserve(reserved)
                            raise
                    finally:
                        box["reading_since"] = None
                        self.turns.release()
                    keep = min(reserved, max(len(raw), 1))  # what the message holds from here on
                    if keep < reserved:
                        self.engine.unreserve(reserved - keep)
                    handoff.put((raw, keep))
            except StopIteration:
                pass
            except grpc.RpcError:
                pass  # the client went away mid-stream
            except Exception as exc:  # noqa: BLE001 - over budget / draining before reading
                if box["error"] is None:
                    box["error"] = exc
            finally:
                handoff.put(None)

        def consume() -> None:
            try:
                while True:
                    box["busy"] = False
                    item = handoff.get()
                    box["busy"] = True
                    if item is None:
                        break
                    raw, reserved = item
                    if box["error"] is not None:
                        self.engine.unreserve(reserved)
                        continue
                    seq = None
                    reserved_left = reserved  # until submit() takes the reservation over
                    try:
                        req, msg, wal_parts = parse_write(
                            raw, run_spec, shm, path="shm" if local else "grpc", declare=declare
                        )  # fmt: skip
                        seq = req.sequence
                        hold = None
                        if msg.shm_chunks and self.engine.wal is not None:
                            # Durable at the WAL fsync, before its shard is written: a writer that keeps
                            # its regions until released is read in place, any other gets a copy now.
                            if req.keeps_staging:
                                hold = (req.shm_pool, self.shm.capacity(req.shm_pool))
                            else:
                                msg.own_shm()
                        for u in req.unguided:
                            self.metrics.unguided_trajectories.labels(unguided_reason(u.reason)).inc(u.count)
                        reserved_left = 0
                        st, _dup = self.engine.submit(msg, wal_parts, reserved, hold, self._identity(who))
                    except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                        # A message refused before submit gives its reservation back (else each
                        # malformed message shrank the budget of every stream for good)
                        if reserved_left:
                            self.engine.unreserve(reserved_left)
                        if seq is None and isinstance(exc, PermissionDeniedError):
                            # named, so that the writer drops that message rather than resend it
                            with contextlib.suppress(Exception):
                                seq = scan_write(raw)[0].sequence or None
                        if box["error"] is None:
                            box["error"], box["failed_seq"] = exc, seq
                        waker.wake()
                        continue  # drain the handoff (releasing reservations) until the receiver stops
                    if box["state"] is not st:
                        if box["state"] is not None:
                            self.engine.unlisten(box["state"], waker)
                        box["state"] = st
                        self.engine.listen(st, waker)
                    box["epoch"] = msg.epoch
                    waker.wake()
            finally:
                box["done"] = True
                waker.wake()

        threading.Thread(target=receive, name="tracestore-write-receiver", daemon=True).start()
        reader = threading.Thread(target=consume, name="tracestore-write-reader", daemon=True)
        reader.start()
        sent = (0, 0, 0)
        try:
            while True:
                waker.wait(0.25)
                st, err, done = box["state"], box["error"], box["done"]
                if st is not None:
                    epoch, durable, received, released = self.engine.progress(st)
                    if epoch == box["epoch"] and (epoch, durable, released) != sent and durable > 0:
                        sent = (epoch, durable, released)
                        yield pb.WriteResponse(
                            epoch=epoch, durable_sequence=durable, received_sequence=received,
                            released_sequence=released,
                        ).SerializeToString()  # fmt: skip
                    if (done or self.draining or self._idle_while_others_wait(box, handoff)) and (
                        err is None and durable >= received
                    ):
                        break  # on shutdown (or to let a waiting stream read): once all it sent is durable
                elif err is None and (done or self._idle_while_others_wait(box, handoff)):
                    break
                if err is not None:
                    meta = {} if box["failed_seq"] is None else {"tracestore-failed-sequence": str(box["failed_seq"])}
                    self._fail(context, "Write", err, meta)
                if not context.is_active():
                    break
            self.metrics.requests.labels("Write", "OK").inc()
        finally:
            self.metrics.active_streams.dec()
            if box["state"] is not None:
                self.engine.unlisten(box["state"], waker)

    def _idle_while_others_wait(self, box: dict[str, Any], handoff: queue.Queue[Any]) -> bool:
        """A stream's turn to read is wasted: it has waited READ_TURN_IDLE_S for a message that has not
        come, everything it took is processed, and other streams wait for a turn."""
        since = box["reading_since"]
        return (
            since is not None
            and self.turns.waiting > 0
            and time.monotonic() - since > READ_TURN_IDLE_S
            and not box["busy"]
            and handoff.empty()
        )

    # -- Seal -------------------------------------------------------------------------------------

    def _refuse_busy(self, context: grpc.ServicerContext, method: str) -> None:
        limit = LimitError(
            f"{self.long_calls.limit} Read and Seal calls are running on this sidecar, its limit (workers - "
            f"{HEALTH_THREADS}, --workers {self.config.workers}); retry later"
        )
        self._fail(context, method, limit, {})

    def seal(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        """Unary twin of a Write message; returns once it is durable (one of the long-call slots)."""
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
            msg = seal_message(req, self.engine.run_spec)
            wal = pb.WriteRequest(
                run=req.run, writer=req.writer, epoch=req.epoch, sequence=req.sequence, seals=req.seals, links=req.links
            ).SerializeToString()
            st, _ = self.engine.submit(msg, pack_wal_data(wal, []), identity=self._identity(self._caller()))
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
        the memory budget from before storage is read until the stream ends."""
        if not self.long_calls.take():
            self._refuse_busy(context, "Read")
        reserved = [0]
        try:
            yield from self._read(raw, context, reserved)
        finally:
            if reserved[0]:
                self.engine.unreserve(reserved[0])
            self.long_calls.give()

    def _read(self, raw: bytes, context: grpc.ServicerContext, reserved: list[int]) -> Iterator[bytes]:
        t0 = time.monotonic()
        try:
            rows_by_site = self._read_rows(raw, reserved)
        except Exception as exc:  # noqa: BLE001
            self._fail(context, "Read", exc, {})
            return
        nbytes = 0
        for site, rows in rows_by_site:
            n = int(rows.codes.shape[0])
            cb, sb = int(rows.codes.shape[1]), int(rows.scales.shape[1])
            per_row = cb + sb + 4 + 4 + 1 + 8
            step = max(1, READ_SLICE_BYTES // max(per_row, 1))
            for a in range(0, max(n, 1), step):
                b = min(n, a + step)
                if not context.is_active():
                    return
                ts = rows.token_scales
                msg = pb.ReadResponse(
                    site=site,
                    row_start=a,
                    n_rows=b - a,
                    total_rows=n,
                    code_bytes=cb,
                    scale_bytes=sb,
                    codes=rows.codes[a:b].tobytes(),
                    scales=rows.scales[a:b].tobytes(),
                    global_scale=rows.global_scale[a:b].astype("<f4").tobytes(),
                    token_scales=b"" if ts is None else ts[a:b].astype("<f4").tobytes(),
                    has_token_scales=ts is not None,
                    valid=rows.valid[a:b].astype("u1").tobytes(),
                    policy_version=rows.policy_version[a:b].astype("<i8").tobytes(),
                )
                nbytes += (b - a) * per_row
                yield msg.SerializeToString()
        self.metrics.read_bytes.inc(nbytes)
        self.metrics.read_latency.observe(time.monotonic() - t0)
        self.metrics.requests.labels("Read", "OK").inc()

    def _read_rows(self, raw: bytes, reserved: list[int]) -> list[tuple[str, Any]]:
        from tracestore.plan import MicrobatchPlan
        from tracestore.records import validate_id
        from tracestore.storage.reader import StoreReader

        from .ingest import _decode

        req = _decode(pb.ReadRequest, raw, "Read request")
        assert isinstance(req, pb.ReadRequest)
        require_read(self._caller(), req.run)
        validate_id("run", req.run)
        spec = self.engine.run_spec(req.run)
        sites = list(req.sites) or list(spec.site_names)
        nbytes = read_size(req, spec, sites)  # checks the request; before anything is read or allocated
        if nbytes > self.config.read_limit_bytes:
            raise LimitError(
                f"the read plan needs {nbytes} bytes of output, over this sidecar's limit of "
                f"{self.config.read_limit_bytes} bytes (max_read_bytes, --max-read-mib; at most what the memory "
                "budget holds beside one received message); read fewer tokens or sites at a time"
            )
        # (an empty trajectory id is a padding segment: the client sends None that way)
        plan = MicrobatchPlan([(s.trajectory or None, s.token_start, s.token_end) for s in req.plan])
        # Read-your-writes: commit what this sidecar holds before reading storage.
        if not self.engine.flush(self.config.storage_timeout_s):
            raise StorageError("could not commit pending records before the read (storage is behind); retry")
        # the output, and the slices of it being serialized and sent
        reserved[0] = self.engine.reserve(self.config.read_reservation(nbytes))
        on_missing: Literal["error", "mask"] = "mask" if req.on_missing == pb.ON_MISSING_MASK else "error"
        columns = (req.column_start, req.column_end) if req.has_columns else None
        with self._readers_lock:
            reader = self._readers.get(req.run)
            if reader is None:
                reader = self._readers[req.run] = StoreReader(self.engine.store, req.run)
        result = reader.read(
            plan, versions=list(req.versions) or None, sites=sites, columns=columns, on_missing=on_missing
        )
        return [(s, result[s]) for s in sites]

    # -- Stat -------------------------------------------------------------------------------------

    def stat(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            from .ingest import _decode

            req = _decode(pb.StatRequest, raw, "Stat request")
            assert isinstance(req, pb.StatRequest)
            who = self._caller()
            if req.run:
                require_see(who, req.run)
            s = self.engine.stat(req.run)
            if not who.admin:  # the sidecar-wide view is an admin's; others see their runs' writers
                s["writers"] = [w for w in s["writers"] if who.may_see(w["run"])]
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
            writers=[pb.WriterState(**w) for w in s["writers"]],
            storage_url=self.config.storage if who.admin else "",
            run_spec=spec,
            degraded=self.degraded(),
        ).SerializeToString()

    def degraded(self) -> list[str]:
        """Why the engine reports itself unhealthy (its fixed set of reasons); empty: healthy."""
        return list(self.engine.degraded())


def _claim_unix_socket(path: str) -> None:
    """Remove a stale socket (one nobody listens on: left over from a crash); refuse one a live
    server still answers on, and anything at ``path`` that is not a socket (a regular file,
    directory or symlink there is never removed)."""
    import socket
    import stat

    from .shm import file_kind

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot check --unix-socket {path}: {exc.strerror}") from exc
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(
            f"--unix-socket {path} exists and is {file_kind(st.st_mode)}, not a socket; it is left alone: "
            "remove it or choose another path"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        try:
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):  # still the socket checked above
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise ConfigError(f"cannot remove the stale unix socket {path}: {exc.strerror}") from exc
        return
    except OSError as exc:
        raise ConfigError(
            f"cannot tell whether a server listens on unix socket {path} ({exc.strerror}); remove it or choose "
            "another --unix-socket"
        ) from exc
    finally:
        probe.close()
    raise ConfigError(f"unix socket {path} is in use by a running server; choose another --unix-socket")


def _socket_access(cfg: ServerConfig) -> tuple[int | None, int]:
    """The unix socket's group (None: the sidecar's own) and mode, from ``socket_group`` and
    ``socket_mode``. Other users (the mode's last digit) are never admitted: they would reach
    every run, and no shared-memory pool could be checked against them (server/shm.py)."""
    gid = None
    if cfg.socket_group is not None:
        name = str(cfg.socket_group)
        if name.isdigit():
            gid = int(name)
        else:
            import grp

            try:
                gid = grp.getgrnam(name).gr_gid
            except KeyError:
                raise ConfigError(f"socket_group {name!r} (--socket-group) is not a group on this host") from None
    mode = (0o660 if gid is not None else 0o600) if cfg.socket_mode is None else cfg.socket_mode
    if not isinstance(mode, int) or mode < 0 or mode & ~0o770:
        raise ConfigError(
            f"socket_mode (--socket-mode) must be at most 0770 (nothing for other users), got {mode!r}: admit "
            "local users through --socket-group"
        )
    return gid, mode


def _bind_unix_socket(server: grpc.Server, path: str, gid: int | None, mode: int) -> os.stat_result:
    """Listen on unix socket ``path`` with group ``gid`` and ``mode`` from the first moment anyone
    can reach it: bound inside a fresh 0700 directory next to ``path``, given its group and mode
    there, then hard-linked to ``path`` (which never replaces anything that appeared there since
    :func:`_claim_unix_socket`). Returns the socket's stat."""
    import tempfile

    parent = os.path.dirname(os.path.abspath(path))
    try:
        private = tempfile.mkdtemp(prefix=".ts-", dir=parent)
    except OSError as exc:
        raise ConfigError(f"cannot listen on unix socket {path}: {exc}") from exc
    tmp = os.path.join(private, "s")
    try:
        if len(os.fsencode(tmp)) > 107:  # sun_path holds 108 bytes with the NUL
            raise ConfigError(
                f"unix socket path {path} is too long: it is bound first as {tmp} ({len(os.fsencode(tmp))} bytes, "
                "at most 107); choose a shorter --unix-socket"
            )
        try:
            server.add_insecure_port(f"unix:{tmp}")
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on unix socket {path}") from exc
        try:
            if gid is not None:
                os.chown(tmp, -1, gid)
            os.chmod(tmp, mode)
        except OSError as exc:
            raise ConfigError(
                f"cannot give unix socket {path} group {gid} and mode {mode:04o} ({exc.strerror}): the sidecar's "
                "user must be a member of --socket-group"
            ) from exc
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise ConfigError(f"{path} appeared while the sidecar bound it; choose another --unix-socket") from None
        except OSError as exc:
            raise ConfigError(f"cannot listen on unix socket {path}: {exc.strerror}") from exc
        return os.lstat(path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        with contextlib.suppress(OSError):
            os.rmdir(private)


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
                cfg.storage, cfg.storage_options, timeout=cfg.storage_timeout_s, on_event=self._storage_event
            )
            self._store.remove_stale_temp_files()  # left by writers killed mid-publish (local disk only)
        self.engine = Engine(cfg, self._store, self.metrics)
        self.shm = ShmPools(cfg.shm_dir, on_change=self.metrics.shm_capacity.set, max_pool_bytes=cfg.max_shm_pool_bytes)
        service = self.service = TraceStoreService(self.engine, self.metrics, self.shm, cfg)
        interceptors = []
        if self._tokens is not None:
            refused = self.metrics.rejected.labels(grpc.StatusCode.UNAUTHENTICATED.name).inc
            needs = cfg.unix_needs_token
            interceptors.append(AuthInterceptor(self._tokens, unix_needs_token=needs, on_refused=refused))
        server = grpc.server(
            # a thread per Write stream up to the cap, and `workers` more (health, Stat, Read, Seal)
            futures.ThreadPoolExecutor(max_workers=cfg.rpc_threads, thread_name_prefix="tracestore-rpc"),
            options=cfg.grpc_options(),
            maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
            interceptors=interceptors,
        )
        server.add_generic_rpc_handlers((service.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        # grpc.reflection.v1 and v1alpha (server/reflection.py)
        enable_server_reflection((pb.DESCRIPTOR.services_by_name["TraceStore"].full_name, health.SERVICE_NAME), server)
        try:
            address = f"{cfg.host}:{cfg.port}"
            tls = self._tls
            self.port = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
        except RuntimeError as exc:
            raise ConfigError(
                f"cannot listen on {cfg.host}:{cfg.port} (in use by another process?); choose another --port"
            ) from exc
        if cfg.unix_socket:
            gid, mode = _socket_access(cfg)
            _claim_unix_socket(cfg.unix_socket)
            st = _bind_unix_socket(server, cfg.unix_socket, gid, mode)
            self._socket_id = (st.st_dev, st.st_ino)
            # Pools must be readable by everyone the socket admits (server/shm.py): its group, or
            # only the sidecar's uid
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
        self.engine.start(wal_parser(self.engine.run_spec))
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
        if self._tokens is None:
            log.warning(
                "no --auth-tokens: every caller may read and write every run; serving %s%s",
                tcp if is_loopback_host(cfg.host) else f"{tcp}, NOT loopback (--insecure)",
                f" and unix:{cfg.unix_socket}" if cfg.unix_socket else "",
            )
        else:
            clear = not cfg.tls_cert and not is_loopback_host(cfg.host)
            log.info(
                "serving %s with %d bearer token(s)%s%s", tcp, len(self._tokens),
                f"; unix:{cfg.unix_socket} needs tokens too" if cfg.unix_needs_token else "",
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
            except TraceStoreError as exc:
                log.error("reload of the %s failed, the ones in use stay: %s", what, exc)
            else:
                log.info("reloaded the %s%s", what, "" if n is None else f" ({n} tokens)")

    def stop(self, grace: float | None = None) -> bool:
        """NOT_SERVING at once, stop accepting, drain streams, commit (or leave in the fsynced WAL)."""
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
            self._server.stop(max(0.1, t_end - time.monotonic())).wait()
        if self.engine is not None:
            ok = self.engine.flush(max(0.1, t_end - time.monotonic())) and ok
            self.engine.close(timeout=max(0.0, t_end - time.monotonic()))
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        sock_id = getattr(self, "_socket_id", None)
        if self.config.unix_socket and sock_id is not None:
            with contextlib.suppress(OSError):  # only our own socket, not whatever took the path since
                st = os.lstat(self.config.unix_socket)
                if (st.st_dev, st.st_ino) == sock_id:
                    os.unlink(self.config.unix_socket)
        return ok

    def wait(self) -> None:
        if self._server is not None:
            self._server.wait_for_termination()
