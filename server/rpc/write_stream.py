"""One Write stream of the service, and the turns to read that all Write streams share.

A Write stream (:class:`WriteStream`) runs two threads beside the gRPC one: a receiver takes
messages off the wire, each only once it holds a turn to read (:class:`ReadTurns`) and has
reserved room in the engine's memory budget for the largest message gRPC may deliver, and hands
it on; a consumer parses each message, authorizes its run, decides whether its shared-memory
payload is held in place or copied, and submits it to the engine. The gRPC thread sends an ack
whenever the writer's durable (or released) sequence moves, and ends the stream with the first
error, at shutdown, or when it has waited for a message while other streams wait for a turn (the
longer the queue, the sooner: :meth:`ReadTurns.idle_limit`) or one was just refused for want of a
slot (:data:`READ_TURN_IDLE_S`), in the last two cases once all it sent is durable.

The stream reports errors through the service's ``fail`` (``service.py``: the status code and
the details the caller may see), which aborts the call.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from tracestore.server.config import ServerConfig
from tracestore.server.engine.core import Engine
from tracestore.server.engine.flusher import Waker
from tracestore.server.engine.memory import OverBudgetError
from tracestore.server.engine.sessions import WriterState
from tracestore.server.metrics import Metrics, unguided_reason
from tracestore.server.rpc.ingest import parse_write, scan_write
from tracestore.server.rpc.shm import ShmPools
from tracestore.server.security.auth import Identity, require_write

from tracestore.errors import PermissionDeniedError, UnauthenticatedError
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import run_spec_from_pb

# A Write stream that has waited this long for its next message while other streams were just
# refused a slot, or wait for a turn to read (then sooner: ReadTurns.idle_limit), is ended (OK,
# once all it sent is durable), so idle recorders cannot starve busy ones nor keep others out. A
# recorder (client/record/session.py) loses nothing by it: with nothing unacknowledged it opens its
# next stream after its reconnect pause.
READ_TURN_IDLE_S = 2.0
# While streams wait for a turn, holders idle this long pass their turns on, so that the turns go
# round every waiting stream within about TURN_WAIT_S however many wait (ReadTurns.idle_limit);
# but never sooner than TURN_IDLE_MIN_S (time for a message its writer already sent to arrive).
# The pace follows the longest queue of the last TURN_PEAK_S. A message that has begun to arrive
# looks idle too (gRPC says nothing until all of it is in), so a stream that has sent messages
# before keeps its turn longer by the time its largest one takes at TURN_ARRIVAL_BPS.
TURN_WAIT_S = 1.0
TURN_IDLE_MIN_S = 0.05
TURN_PEAK_S = 2 * TURN_WAIT_S
TURN_ARRIVAL_BPS = 32 << 20  # a 4 MiB message: 125 ms more
# How often an open stream asks whether its caller's credential still holds (a SIGHUP reload may
# revoke it): a revoked writer is refused within this, busy or idle.
RECHECK_S = 0.25

# The service's error report: (context, method, error, trailing metadata); aborts the call.
Fail = Callable[[grpc.ServicerContext, str, BaseException, dict[str, str]], None]


class ReadTurns:
    """Turns to read a message, first come first served: a Write stream takes one before it asks
    gRPC for its next message and gives it back once the message has arrived. There are only as
    many as the memory budget covers at ``max_message_bytes`` each (a message arrives whole, up to
    that size, once it is asked for), so the streams without one wait with nothing read.

    A message once asked for cannot be un-asked, so a turn held by a stream whose writer sends
    nothing comes back only when that stream ends: :meth:`idle_limit` says how long such a holder
    may keep it while others wait. It shrinks as the queue grows, so that however many idle streams
    queue ahead of a writer with a message (up to ``--max-streams``), its turn comes within about
    :data:`TURN_WAIT_S`: the waiting streams pass through the turns ``turns`` at a time."""

    def __init__(self, turns: int, on_waiting: Callable[[int], None] | None = None) -> None:
        self.turns = turns
        self.free = turns
        self._lock = threading.Lock()
        # the streams waiting, in arrival order: each with a condition of its own (a release wakes
        # the one it hands its turn to, not every waiting stream) and whether it was handed one
        self._queue: deque[_Waiter] = deque()
        self._on_waiting = on_waiting
        # the longest the queue was within the last TURN_PEAK_S, and since when (monotonic)
        self._peak, self._peak_at = 0, 0.0

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def acquire(self, give_up: Callable[[], bool], poll_s: float = 0.25) -> bool:
        """Wait for a turn (in arrival order); False once ``give_up()`` is true (polled)."""
        with self._lock:
            if self.free > 0 and not self._queue:
                self.free -= 1
                return True
            me = _Waiter(threading.Condition(self._lock))
            self._queue.append(me)
            self._changed()
            while not me.granted:
                if give_up():
                    self._queue.remove(me)
                    self._changed()
                    return False
                me.cond.wait(poll_s)
            return True  # release() took it off the queue and handed it its turn

    def release(self) -> None:
        """Give a turn back: straight to the stream that has waited longest, if any."""
        with self._lock:
            if not self._queue:
                self.free += 1
                return
            head = self._queue.popleft()
            head.granted = True
            self._changed()
            head.cond.notify()

    def idle_limit(self) -> float:
        """Seconds a turn holder may wait for a message that does not come while others wait: a
        share of :data:`TURN_WAIT_S` such that the streams waiting and those holding turns,
        ``turns`` at a time, all get a turn within it (never less than :data:`TURN_IDLE_MIN_S`).
        Counted from the longest the queue was within the last :data:`TURN_PEAK_S`: a stream that
        joined the end of a long queue must not wait longer as the queue ahead of it shortens."""
        waiting = len(self._queue)
        if time.monotonic() - self._peak_at <= TURN_PEAK_S:
            waiting = max(waiting, self._peak)
        return max(TURN_IDLE_MIN_S, TURN_WAIT_S * self.turns / (waiting + self.turns))

    def _changed(self) -> None:
        waiting, now = len(self._queue), time.monotonic()
        if waiting >= self._peak or now - self._peak_at > TURN_PEAK_S:
            self._peak, self._peak_at = waiting, now
        if self._on_waiting is not None:
            self._on_waiting(waiting)


class _Waiter:
    """A stream waiting for a turn (:meth:`ReadTurns.acquire`)."""

    __slots__ = ("cond", "granted")

    def __init__(self, cond: threading.Condition) -> None:
        self.cond = cond
        self.granted = False


class WriteStream:
    """The state of one open Write stream: what its two threads share with the gRPC thread (the
    writer session it acks, its first error, whether the consumer has stopped, whether it is
    waiting for a message or working on one) and the one-message handoff between them.

    ``who`` is the caller (read in the gRPC thread), ``identity`` the name its writer ids are
    owned by (None with authentication off), ``recheck()`` the caller as the token file says now
    (checked every :data:`RECHECK_S`: a reload that revokes the credential, or changes its scopes,
    ends the stream UNAUTHENTICATED); ``draining()`` says the sidecar is shutting down;
    ``slot_wanted()`` that a Write stream was just refused for want of a slot, so that this one,
    if idle, makes room (:meth:`idle_while_others_wait`)."""

    def __init__(
        self,
        engine: Engine,
        shm: ShmPools,
        metrics: Metrics,
        turns: ReadTurns,
        config: ServerConfig,
        *,
        who: Identity,
        identity: str | None,
        draining: Callable[[], bool],
        fail: Fail,
        slot_wanted: Callable[[], bool] = lambda: False,
        recheck: Callable[[], Identity | None] | None = None,
    ) -> None:
        self.engine, self.shm, self.metrics, self.turns = engine, shm, metrics, turns
        self.bound = config.max_message_bytes  # gRPC delivers no bigger message
        self.who, self.identity = who, identity
        self.recheck = recheck  # the caller as the token file says now (reloads revoke open streams)
        self._checked = time.monotonic()
        self.draining, self.fail = draining, fail
        self.slot_wanted = slot_wanted  # a stream was just refused for want of a slot (--max-streams)
        self.waker = Waker()
        self.state: WriterState | None = None  # the session of the last message admitted
        self.epoch: int | None = None  # ... and its epoch
        self.error: BaseException | None = None  # the first failure: it ends the stream
        self.failed_seq: int | None = None  # the sequence of the message that failed, if known
        self.done = False  # the consumer has stopped
        # when the receiver asked gRPC for the next message (None: not waiting for one),
        # and whether the consumer is working on a message
        self.reading_since: float | None = None
        self.busy = False
        self.largest = 0  # bytes of the largest message received on this stream
        self._turn_lock = threading.Lock()
        self._turn_held = False  # the receiver holds a turn (ReadTurns) not handed on yet
        # Two threads per stream: one takes messages off the wire (after reserving budget for them),
        # one parses and admits them, so receiving message n+1 overlaps processing message n.
        self.handoff: queue.Queue[tuple[bytes, int] | None] = queue.Queue(maxsize=1)
        self.may_write: set[str] = set()  # runs this stream's caller was found to be allowed to write

    def run_spec(self, run: str) -> Any:  # every message's run passes here: each is authorized
        if run not in self.may_write:
            require_write(self.who, run)
            self.may_write.add(run)
        return self.engine.write_spec(run, self.identity)

    def declare(self, spec: pb.RunSpec) -> None:
        require_write(self.who, spec.run)
        self.engine.declare_run(run_spec_from_pb(spec), self.identity)

    def serve(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """The stream's responses (serialized WriteResponse acks); runs in the gRPC thread."""
        local = context.peer().startswith("unix:")
        self.metrics.active_streams.inc()
        threading.Thread(
            target=self._receive, args=(requests, context), name="tracestore-write-receiver", daemon=True
        ).start()
        reader = threading.Thread(target=self._consume, args=(local,), name="tracestore-write-reader", daemon=True)
        reader.start()
        sent = (0, 0, 0)
        try:
            while True:
                self.waker.wait(self._poll_s())
                self._recheck()
                st, err, done = self.state, self.error, self.done
                if st is not None:
                    epoch, durable, received, released = self.engine.progress(st)
                    if epoch == self.epoch and (epoch, durable, released) != sent and durable > 0:
                        sent = (epoch, durable, released)
                        yield pb.WriteResponse(
                            epoch=epoch,
                            durable_sequence=durable,
                            received_sequence=received,
                            released_sequence=released,
                        ).SerializeToString()
                    if (done or self.draining() or self.idle_while_others_wait()) and (
                        err is None and durable >= received
                    ):
                        break  # on shutdown (or to let a waiting stream read): once all it sent is durable
                elif err is None and (done or self.draining() or self.idle_while_others_wait()):
                    break  # nothing admitted, nothing to acknowledge: a stop need not wait for it
                if err is not None:
                    meta = {} if self.failed_seq is None else {"tracestore-failed-sequence": str(self.failed_seq)}
                    self.fail(context, "Write", err, meta)
                if not context.is_active():
                    break
            self.metrics.requests.labels("Write", "OK").inc()
        finally:
            self._give_turn()  # the next stream need not wait for gRPC to end this one's pending read
            self.metrics.active_streams.dec()
            if self.state is not None:
                self.engine.unlisten(self.state, self.waker)

    def _give_turn(self) -> None:
        """Hand this stream's turn on, once: by the receiver when its message has arrived, or by the
        gRPC thread as the stream ends (its reservation stays until the receiver lets go of it)."""
        with self._turn_lock:
            held, self._turn_held = self._turn_held, False
        if held:
            self.turns.release()

    def _recheck(self) -> None:
        now = time.monotonic()
        if self.recheck is None or self.error is not None or now - self._checked < RECHECK_S:
            return
        self._checked = now
        if self.recheck() != self.who:
            self.error = UnauthenticatedError(
                f"caller {self.who.name!r}: its credential was revoked, or its scopes changed, by a reload of the "
                "token file; reconnect with a valid token"
            )
            self.waker.wake()

    def _receive(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> None:
        def give_up_turn() -> bool:
            return self.error is not None or self.draining() or not context.is_active()

        it = iter(requests)
        try:
            while self.error is None:
                # Once asked for a message, gRPC takes in all of it (flow control opens the window
                # to its size): ask only with a turn and room in the budget for the largest one.
                if not self.turns.acquire(give_up_turn):
                    break
                with self._turn_lock:
                    self._turn_held = True
                try:
                    reserved = self.engine.reserve(self.bound)
                    self.reading_since = time.monotonic()
                    if self.turns.waiting:
                        self.waker.wake()  # others wait: pass the turn on once idle (_poll_s)
                    try:
                        raw = next(it)
                    except BaseException:
                        self.engine.unreserve(reserved)
                        raise
                finally:
                    self.reading_since = None
                    self._give_turn()
                self.largest = max(self.largest, len(raw))
                keep = min(reserved, max(len(raw), 1))  # what the message holds from here on
                if keep < reserved:
                    self.engine.unreserve(reserved - keep)
                # Its commit's room is kept free before the next stream reserves (the consumer
                # replaces this bound by the room the parsed message needs: Engine.expect).
                self.engine.arrived(len(raw))
                self.handoff.put((raw, keep))
                # The consumer's now: a reference here would keep the message alive, uncounted once
                # its shard is committed, while this thread waits for its next turn.
                del raw
        except StopIteration:
            pass
        except grpc.RpcError:
            pass  # the client went away mid-stream
        except Exception as exc:  # noqa: BLE001 - over budget / draining before reading
            if self.error is None:
                self.error = exc
        finally:
            self.handoff.put(None)

    def _consume(self, local: bool) -> None:
        shm = self.shm.viewer(self.identity) if local else None  # pools it opens count in its share
        copies = [0]

        def before_copy(pool: str, count: Callable[[], int]) -> None:
            # Another user's pool is copied while the message is parsed: room for the copies first,
            # so small messages naming large regions cannot make the sidecar copy past its budget.
            if self.shm.copies(pool) and (nbytes := count()):
                limit = self.engine.budget.limit
                if nbytes > limit:
                    raise OverBudgetError(
                        f"the message references {nbytes} bytes of shared-memory pool {pool!r}, more than the "
                        f"whole memory budget of {limit} bytes; send smaller batches",
                        retry_after_s=0.0,
                    )
                copies[0] = self.engine.reserve(nbytes)

        try:
            while True:
                self.busy = False
                item = self.handoff.get()
                self.busy = True
                if item is None:
                    break
                raw, reserved = item
                arrived = len(raw)  # the room kept free for it until it is parsed (Engine.arrived)
                if self.error is not None:
                    self.engine.unreserve(reserved)
                    self.engine.expect(None, arrived)
                    continue
                seq, msg = None, None
                reserved_left = reserved  # until submit() takes the reservation over
                copies[0] = 0  # reserved for copies of another user's pool (before_copy)
                try:
                    req, msg, wal_parts = parse_write(
                        raw,
                        self.run_spec,
                        shm,
                        path="shm" if local else "grpc",
                        declare=self.declare,
                        before_copy=before_copy if shm is not None else None,
                    )
                    self.engine.expect(msg, arrived)
                    arrived = 0
                    reserved += copies[0]  # the copies are the message's from here on
                    reserved_left, copies[0] = reserved, 0
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
                    st, _dup = self.engine.submit(msg, wal_parts, reserved, hold, self.identity)
                except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                    # A message refused before submit gives its reservation back, so malformed
                    # messages never shrink the budget
                    if reserved_left + copies[0]:
                        self.engine.unreserve(reserved_left + copies[0])
                    if arrived:
                        self.engine.expect(None, arrived)
                    if msg is not None:
                        self.engine.forget(msg)
                    if seq is None and isinstance(exc, PermissionDeniedError):
                        # named, so that the writer drops that message rather than resend it
                        with contextlib.suppress(Exception):
                            seq = scan_write(raw)[0].sequence or None
                    if self.error is None:
                        self.error, self.failed_seq = exc, seq
                    self.waker.wake()
                    continue  # drain the handoff (releasing reservations) until the receiver stops
                if self.state is not st:
                    if self.state is not None:
                        self.engine.unlisten(self.state, self.waker)
                    self.state = st
                    self.engine.listen(st, self.waker)
                self.epoch = msg.epoch
                # Not kept alive while the next message is awaited: once its shard is committed
                # the budget no longer counts it.
                del item, raw, req, msg, wal_parts
                self.waker.wake()
        finally:
            self.done = True
            self.waker.wake()

    def idle_while_others_wait(self) -> bool:
        """This stream's turn to read, or its slot, is wasted: it has waited for a message that has
        not come (its first one included), everything it took is processed, and other streams wait
        for a turn (it waited :meth:`_turn_limit`) or were just refused for want of a slot
        (it waited READ_TURN_IDLE_S). So a stream that never sends cannot hold its --max-streams
        slot while others are refused, and idle streams pass turns on at the pace of the queue
        rather than one wait each."""
        since = self.reading_since
        if since is None or self.busy or not self.handoff.empty():
            return False
        idle = time.monotonic() - since
        if self.turns.waiting > 0:
            return idle > self._turn_limit()
        return idle > READ_TURN_IDLE_S and self.slot_wanted()

    def _turn_limit(self) -> float:
        """How long this stream may hold its turn without a message while others wait:
        :meth:`ReadTurns.idle_limit`, plus the time its largest message so far takes to arrive at
        TURN_ARRIVAL_BPS (a writer of large messages is not cut off while one arrives), at most
        READ_TURN_IDLE_S. Only bytes it sent earn a stream the extra (a refused message ends it)."""
        return min(READ_TURN_IDLE_S, self.turns.idle_limit() + self.largest / TURN_ARRIVAL_BPS)

    def _poll_s(self) -> float:
        """How long the gRPC thread sleeps between looks at the stream (a wake-up cuts it short):
        RECHECK_S, or less while it holds a turn others wait for, so that it passes the turn on as
        soon as it has waited :meth:`_turn_limit`."""
        since = self.reading_since
        if since is None or not self.turns.waiting:
            return RECHECK_S
        return min(RECHECK_S, max(0.01, since + self._turn_limit() - time.monotonic()))
