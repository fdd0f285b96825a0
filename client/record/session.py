"""The recorder's Write session: the sender thread, its gRPC stream to the sidecar and what the
sidecar answers.

Messages are numbered per writer ``(writer, epoch, sequence)`` and streamed; an acknowledgement
releases their staging once the sidecar reports them durable (and, over shared memory, released).
On a lost connection the session reconnects after a backoff with full jitter and resends the
unacknowledged messages (the sidecar answers duplicates as success). A message refused for its
content is dropped and its trajectories unguided; a sequence gap starts a new epoch; a sidecar
that acknowledges nothing for ``give_up_s`` (unreachable, refusing, frozen with the stream open, or
ending streams without acknowledging) makes the records that waited that long unguided; a writer
fenced by a newer epoch or refused for good stops the recorder (:attr:`WriteSession.error`).
Refusals are logged (WARNING, the first of each status code since the last acknowledgement) and a
give-up is reported with the last refusal's code. Trailers are checked before they are trusted: a
``tracestore-failed-sequence`` naming no pending message is ignored, ``retry-after-ms`` is capped.
An acknowledgement beyond the last sequence sent in the epoch (another instance wrote under this
writer id and epoch) starts a new epoch, like a sequence gap.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from tracestore.client.transport import channel, method

from tracestore.errors import PermissionDeniedError, TraceStoreError
from tracestore.records import RunSpec
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import run_spec_to_pb

from .chunks import ChunkBuilder
from .items import Forward, Outgoing, Unguided
from .outbox import Outbox

log = logging.getLogger("tracestore.client")

# gRPC codes (by name, so this module does not need grpc at import time)
_CONTENT_ERRORS = {"INVALID_ARGUMENT", "ALREADY_EXISTS", "DATA_LOSS", "NOT_FOUND", "PERMISSION_DENIED"}
# Ends of a stream that say the sidecar could not be reached or stopped answering (the others are
# refusals: a give-up after them is reported with the refusal's code). STALLED: no acknowledgement
# for give_up_s with the stream open; OK: the stream ended with messages unacknowledged.
_UNREACHABLE = {"UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED", "UNKNOWN", "STALLED", "OK"}
_WARN_EVERY_S = 10.0  # at most one WARNING per status code this often (and once per code between acks)


class WriterFencedError(TraceStoreError, RuntimeError):
    """Another recorder took this writer id over with a newer epoch (or something wrote under it
    with an epoch this recorder cannot pass): this recorder stops (``RolloutRecorder.error``)."""


class WriteSession:
    """Sends an :class:`Outbox`'s items, built by a :class:`ChunkBuilder`, to the sidecar at
    ``address`` on a thread of its own (:meth:`start`).

    ``cond`` is the recorder's lock: the session's state and the outbox change under it, and it is
    notified whenever a flush may be done. ``stats`` are the recorder's counters. ``on_sealed(out)``
    is called under the lock once ``out``'s seals are durable. See ``RolloutRecorder`` for the
    backoff and give-up parameters."""

    def __init__(
        self,
        address: str,
        credentials: tuple[Any, str | None],
        run_spec: RunSpec,
        writer: str,
        epoch: int,
        outbox: Outbox,
        builder: ChunkBuilder,
        unguided: Unguided,
        cond: threading.Condition,
        stats: dict[str, int],
        on_sealed: Callable[[Outgoing], None],
        *,
        shm: bool,
        give_up_s: float,
        reconnect_backoff_s: float,
        reconnect_cap_s: float,
        inflight_bytes: int,
    ) -> None:
        self.address = address
        self._credentials = credentials
        self.run_spec = run_spec
        self.writer = writer
        self.epoch = epoch
        self._outbox = outbox
        self._builder = builder
        self._unguided = unguided
        self._cond = cond
        self.stats = stats
        self._on_sealed = on_sealed
        self._shm = shm
        self.give_up_s = give_up_s
        self.reconnect_backoff_s = reconnect_backoff_s
        self.reconnect_cap_s = reconnect_cap_s
        self.inflight_bytes = inflight_bytes
        self._unacked: deque[Outgoing] = deque()
        # durable, but the sidecar still reads their shared-memory regions (released_sequence)
        self._unreleased: deque[Outgoing] = deque()
        self._next_seq = 1
        self.closed = False
        self._busy = False  # the sender holds items it took off the queue and has not numbered yet
        # Since when no acknowledgement advanced this epoch's durable sequence, as seen by a failed
        # attempt or a stalled stream (None: not down). Cleared only by an acknowledgement that
        # releases messages (not by one of another epoch, nor one that advances nothing).
        self._down_since: float | None = time.monotonic()
        # When the oldest unacknowledged message last saw progress (an ack advancing it, or its own
        # send when nothing else was waiting): a stream open that long without one is stalled
        self._progress_at = time.monotonic()
        # (code, details) of the last failed attempt since progress: not the exception, whose
        # traceback would hold the sender's frames, and so this session, in a reference cycle
        self._last_error: tuple[str, str] | None = None
        self._warned: set[str] = set()  # status codes logged since progress
        self._warned_at: dict[str, float] = {}
        # Why the recorder stopped for good (fenced, refused): set once, by the sender thread
        self.error: TraceStoreError | None = None
        self.stop_reason = ""
        self._acks_seen = 0  # acknowledgements that covered messages (they reset the backoff)
        self.thread = threading.Thread(target=self._run, name=f"tracestore-recorder-{writer}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def pending(self) -> bool:
        """Whether messages are taken and not yet durable (under the lock)."""
        return bool(self._unacked) or self._busy

    def close(self) -> None:
        """Stop the sender thread now (the recorder flushed first, as long as it was told to):
        whatever is still queued or unacknowledged is dropped and its trajectories are unguided
        (``closed_unacknowledged``)."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout=10)
        with self._cond:
            n = len(self._unacked) + len(self._outbox.queue)
            if n:
                lost = self._drop_pending()
                log.warning(
                    "recorder %s closed with %d messages or records not acknowledged by the sidecar at %s: "
                    "%d trajectories unguided (closed_unacknowledged)",
                    self.writer,
                    n,
                    self.address,
                    len(lost - self._unguided.ids),
                )
                self._unguided.mark(lost, "closed_unacknowledged")
            self._cond.notify_all()

    def _run(self) -> None:
        ch = None
        failures = 0  # attempts since the last acknowledgement: the backoff's exponent
        while True:
            with self._cond:
                if self.closed or self.error is not None:
                    break
            acks = self._acks_seen
            wait = 0.0
            cap = min(self.reconnect_cap_s, max(self.reconnect_backoff_s, self.give_up_s / 4))
            try:
                if ch is None:
                    ch = channel(self.address, *self._credentials)
                self._stream(ch)
                with self._cond:
                    ended_early = bool(self._unacked) and not self.closed
                if ended_early:  # ended with OK, messages unacknowledged: a failed attempt
                    raise _StreamError("OK", "the sidecar ended the stream before acknowledging", None, 0.0)
            except _StreamError as exc:
                if self.closed:  # cancelled by close()
                    break
                session = self._session_epoch(ch) if exc.code == "FAILED_PRECONDITION" else None
                self._on_stream_error(exc, session)
                if exc.code == "RESOURCE_EXHAUSTED":
                    wait = min(max(exc.retry_after, 0.0), cap)  # a trailer cannot park the sender
                if exc.code in ("UNAVAILABLE", "STALLED") and ch is not None:
                    ch.close()
                    ch = None
            except Exception as exc:  # noqa: BLE001 - never let the sender die
                log.exception("recorder sender error: %s", exc)
            with self._cond:
                if self.closed or self.error is not None:
                    break
            # Every attempt that ended (refused, cut off, or ended by a draining sidecar) waits
            # before the next: without acknowledgements in between the wait grows, so a writer
            # the sidecar keeps refusing never spins on reconnects and resends (the engine's GIL).
            failures = 0 if self._acks_seen != acks else failures + 1
            bound = min(cap, self.reconnect_backoff_s * 2.0 ** min(failures, 40))
            self._pause(max(wait, random.uniform(0.0, bound)))
            self._give_up_if_down()
        if ch is not None:
            ch.close()

    def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if the recorder is closed meanwhile."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)

    def _session_epoch(self, ch: Any) -> int | None:
        """The epoch of this writer's session at the sidecar (``Stat``), None if unknown."""
        if ch is None:
            return None
        try:
            stat_call = method(ch, "Stat", "unary_unary")
            raw = stat_call(pb.StatRequest(run=self.run_spec.run).SerializeToString(), timeout=5)
            for w in pb.StatResponse.FromString(raw).writers:
                if w.run == self.run_spec.run and w.writer == self.writer:
                    return int(w.epoch)
        except Exception as exc:  # noqa: BLE001 - unknown: treated as a gap (a new epoch)
            log.warning("recorder %s: cannot read its session's epoch from the sidecar: %s", self.writer, exc)
        return None

    def _drop_pending(self) -> set[str]:
        """Drop every unacknowledged message and queued item, releasing their staging; return
        their trajectories (``stats["dropped"]`` counts them). Under the lock."""
        self.stats["dropped"] += len(self._unacked) + len(self._outbox.queue)
        lost: set[str] = set()
        for out in self._unacked:
            lost |= out.trajectories
            self._outbox.release(out)
        self._unacked.clear()
        return lost | self._outbox.drop()

    def _stop_for_good(self, error: TraceStoreError, reason: str) -> None:
        """The sidecar will never take this writer's messages: stop sending, drop what is pending
        and mark every trajectory not yet sealed unguided. Under the lock, sender thread."""
        if self.error is not None:
            return
        self.stop_reason = reason
        self.error = error
        log.error("recorder %s stops: %s", self.writer, error)
        lost = self._drop_pending() | self._outbox.forget_unsealed()  # the latter: recorded, not sealed
        self._unguided.mark(lost, reason)
        self._cond.notify_all()

    def _give_up_if_down(self) -> None:
        with self._cond:
            down = self._down_since
            if down is None or time.monotonic() - down < self.give_up_s:
                return
            if not self._unacked and not self._outbox.queue:
                return
            # Only records that waited the whole give-up time are dropped; fresh ones get their chance.
            ages = [p.queued for o in self._unacked for p in o.pieces]
            # (a message of seals or links only has no age: it waits as long as the sidecar is down)
            ages += [o.born for o in self._unacked if o.pieces == [] and o.born != float("inf")]
            ages += self._outbox.queued_since()
            if ages and time.monotonic() - min(ages) < self.give_up_s:
                return
            n = len(self._unacked) + len(self._outbox.queue)
            lost = self._drop_pending()
            # a fresh epoch: sequence restarts at 1, no gap with what the sidecar has
            old = self.epoch
            self.epoch = max(self.epoch + 1, time.time_ns())
            self._next_seq = 1
            last = self._last_error
            reason = _give_up_reason(last)
            log.warning(
                "recorder %s: nothing acknowledged by the sidecar at %s for %.1f s (last: %s); dropped %d "
                "messages or records of epoch %d, %d trajectories unguided (%s); continuing as epoch %d",
                self.writer,
                self.address,
                time.monotonic() - down,
                " ".join(last) if last is not None else "no answer",
                n,
                old,
                len(lost - self._unguided.ids),
                reason,
                self.epoch,
            )
            self._unguided.mark(lost, reason)
            self._down_since = time.monotonic()
            self._cond.notify_all()

    def _take(self) -> tuple[list[Forward], list[Any], list[Any]]:
        """A window off the outbox (under the lock): whole decode forwards, pieces, seals and links."""
        fwds: list[Forward] = []
        pieces, extras = self._outbox.take(self._outbox.window_bytes, fwds)
        if self._shm and len(fwds) == 1:  # nothing to coalesce: its chunks travel as descriptors
            pieces[:0] = self._outbox.expand(fwds.pop())
        return fwds, pieces, extras

    def _stream(self, ch: Any) -> None:
        import grpc

        call = method(ch, "Write", "stream_stream")
        sendq: deque[Outgoing | None] = deque()
        send_cv = threading.Condition()
        first = [True]

        def requests() -> Iterator[bytes]:
            # Serialized here, when gRPC pulls the next message (its own thread): the one copy of a
            # message's payload exists only while gRPC sends it, however many are in flight.
            while True:
                with send_cv:
                    while not sendq:
                        send_cv.wait(0.5)
                    item = sendq.popleft()
                if item is None:
                    return
                if first[0]:
                    first[0] = False
                    req = pb.WriteRequest()
                    req.CopyFrom(item.req)
                    req.run_spec.CopyFrom(run_spec_to_pb(self.run_spec))
                    yield Outgoing(item.seq, req, [], set(), 0, item.payload).serialize()
                else:
                    yield item.serialize()

        def push(out: Outgoing) -> None:
            with send_cv:
                sendq.append(out)
                send_cv.notify()

        responses = call(requests(), wait_for_ready=False)
        stop = threading.Event()
        err: list[Any] = []
        ended: list[_StreamError] = []  # why this side ended the stream (stalled, a conflicting ack)

        def acks() -> None:
            try:
                for raw in responses:
                    r = pb.WriteResponse.FromString(raw)
                    released = r.released_sequence if r.HasField("released_sequence") else None
                    conflict = self._on_ack(r.epoch, r.durable_sequence, released)
                    if conflict is not None:
                        ended.append(conflict)
                        responses.cancel()
                        break
            except grpc.RpcError as exc:
                err.append(exc)
            finally:
                stop.set()
                with self._cond:
                    self._cond.notify_all()

        t = threading.Thread(target=acks, daemon=True, name="tracestore-recorder-acks")
        t.start()
        outbox, builder = self._outbox, self._builder
        try:
            with self._cond:
                resend = list(self._unacked)
            for out in resend:  # resend in order; the sidecar answers duplicates as success
                push(out)
                self.stats["resent"] += 1
            while not stop.is_set():
                with self._cond:
                    if self.closed:  # close() flushed first: what is still pending is dropped
                        break
                    if self._unacked and time.monotonic() - self._progress_at >= self.give_up_s:
                        # open, yet nothing acknowledged for give_up_s (a frozen sidecar, one that
                        # never acknowledges): end it so the give-up runs
                        if self._down_since is None:
                            self._down_since = self._progress_at
                        ended.append(
                            _StreamError(
                                "STALLED",
                                f"no acknowledgement for {time.monotonic() - self._progress_at:.1f} s with "
                                f"{len(self._unacked)} messages pending and the stream open",
                                None,
                                0.0,
                            )
                        )
                        break
                    inflight = sum(o.nbytes for o in self._unacked)
                    if inflight > self.inflight_bytes or not outbox.ready(self.closed):
                        self._cond.wait(0.02)
                        continue
                    fwds, pieces, extras = self._take()
                    self._busy = bool(pieces or extras or fwds)
                if not pieces and not extras and not fwds:
                    continue
                try:
                    # Each message goes to gRPC as soon as it is built, not once the whole window
                    # is, so the sidecar works while the rest of a window is built.
                    outs = itertools.chain(
                        builder.gather(fwds) if fwds else (), builder.build(pieces, extras, self._shm)
                    )
                    for out in outs:
                        with self._cond:
                            out.seq = self._next_seq
                            out.req.epoch = self.epoch
                            out.req.sequence = out.seq
                            self._next_seq += 1
                            if not self._unacked:
                                self._progress_at = time.monotonic()
                            self._unacked.append(out)
                        self.stats["messages"] += 1
                        self.stats["chunks"] += out.chunks
                        self.stats["bytes"] += out.nbytes
                        push(out)
                except Exception:
                    # what was taken and not numbered is lost: its trajectories must not pass for recorded
                    lost = {t for f in fwds for t, _, _ in f.segs}
                    lost.update(p.trajectory for p in pieces)
                    lost.update(e.trajectory for e in extras)
                    with self._cond:
                        self.stats["dropped"] += 1
                        self._unguided.mark(lost, "sender_error")
                    raise
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
        finally:
            with send_cv:
                sendq.append(None)
                send_cv.notify()
            if not stop.is_set() and not ended and not (self.closed and self._unacked):
                stop.wait(1.0)  # the sidecar ends the stream once what it sent is durable
            if not stop.is_set():
                responses.cancel()
            t.join(timeout=5)
        if ended:
            raise ended.pop()  # (no local name: the traceback would hold it in a reference cycle)
        if err:
            exc = err.pop()  # out of the list the acks thread's frame holds: no reference cycle
            code = exc.code().name if exc.code() is not None else "UNKNOWN"
            meta = dict(exc.trailing_metadata() or ())
            raise _StreamError(
                code,
                exc.details() or "",
                _int(meta.get("tracestore-failed-sequence")),
                _int(meta.get("retry-after-ms"), 0) / 1000.0,
            )

    def _on_ack(self, epoch: int, durable: int, released: int | None = None) -> _StreamError | None:
        """The sidecar's progress for ``epoch``: messages up to ``durable`` are durable; their
        staging is released too, up to ``released`` when the sidecar reports it (older sidecars
        do not: then with ``durable``). Returns the error to end the stream with when the ack
        covers sequences this recorder never sent in the epoch (then nothing is released)."""
        with self._cond:
            if epoch != self.epoch:
                return None  # an old epoch's (or a bogus) ack: no progress
            if durable >= self._next_seq:
                # Sequences this recorder never sent are "durable": another instance wrote under
                # this writer id and epoch (the sidecar answers our messages as its resends).
                return _StreamError(
                    "ACK_CONFLICT",
                    f"the sidecar at {self.address} acknowledged sequence {durable} of writer {self.writer} epoch "
                    f"{epoch}, but this recorder sent only up to {self._next_seq - 1}: another instance wrote "
                    f"under this writer id and epoch (give each instance its own writer id, and never reuse an "
                    f"explicit epoch)",
                    None,
                    0.0,
                )
            if self._unacked and self._unacked[0].seq <= durable:
                self._acks_seen += 1  # acknowledged messages: the sidecar takes this writer's records
                self._down_since = None
                self._progress_at = time.monotonic()
                self._last_error = None
                self._warned.clear()
            # Held messages of earlier epochs: a sidecar copies them out before it accepts a new
            # epoch's first message (or it is not the one that held them), so this ack frees them.
            while self._unreleased and self._unreleased[0].req.epoch != epoch:
                self._outbox.release(self._unreleased.popleft())
            while self._unacked and self._unacked[0].seq <= durable:
                out = self._unacked.popleft()
                if out.req.seals:
                    self._on_sealed(out)
                if released is not None and out.seq > released and out.pieces:
                    self._unreleased.append(out)  # durable; the sidecar still reads its regions
                else:
                    self._outbox.release(out)
                self.stats["acked_messages"] += 1
            if released is not None:
                while self._unreleased and self._unreleased[0].seq <= released:
                    self._outbox.release(self._unreleased.popleft())
            self._cond.notify_all()
        return None

    def _on_stream_error(self, exc: _StreamError, session_epoch: int | None = None) -> None:
        """A Write stream ended with ``exc``; ``session_epoch``: the epoch of this writer's session
        at the sidecar, when the error was FAILED_PRECONDITION and it could be read."""
        with self._cond:
            if self._down_since is None:
                self._down_since = time.monotonic()
            self.stats["reconnects"] += 1
            self._last_error = (exc.code, exc.details)
            pending = next((o for o in self._unacked if o.seq == exc.failed_seq), None)
            # retried ends are logged once per code between acknowledgements (and at most every
            # _WARN_EVERY_S): a sidecar refusing every attempt does not flood the engine's log
            now = time.monotonic()
            warn = exc.code not in self._warned and now - self._warned_at.get(exc.code, -_WARN_EVERY_S) >= _WARN_EVERY_S
            self._warned.add(exc.code)
            if warn:
                self._warned_at[exc.code] = now
            if exc.code == "PERMISSION_DENIED":
                self._stop_for_good(
                    PermissionDeniedError(
                        f"the sidecar at {self.address} refused writer {self.writer} of run {self.run_spec.run}: "
                        f"{exc.details}"
                    ),
                    "permission_denied",
                )
            elif exc.code == "FAILED_PRECONDITION" and session_epoch is not None and session_epoch > self.epoch:
                self._stop_for_good(
                    WriterFencedError(
                        f"writer {self.writer} of run {self.run_spec.run} is fenced at {self.address}: its session "
                        f"there has epoch {session_epoch}, newer than this recorder's {self.epoch} (another "
                        f"instance took this writer id over); give each instance its own writer id"
                    ),
                    "fenced",
                )
            elif exc.code in _CONTENT_ERRORS and pending is not None:
                # The sidecar refused one message for its content: drop it, mark its trajectories
                # unguided and renumber the later ones (the sidecar accepted none of them). A
                # trailer naming no pending message is ignored (the refusal is retried like one
                # without).
                keep: deque[Outgoing] = deque()
                for out in self._unacked:
                    if out is pending:  # (so exc.failed_seq names a pending message)
                        self._outbox.release(out)
                        self._unguided.mark(out.trajectories, exc.code.lower())
                        self.stats["rejected_messages"] += 1
                        self.stats["dropped"] += 1
                        log.warning("sidecar refused message %d: %s %s", out.seq, exc.code, exc.details)
                    else:
                        if out.seq > pending.seq:
                            out.seq -= 1
                            out.req.sequence = out.seq
                        keep.append(out)
                self._unacked = keep
                self._next_seq -= 1
            elif exc.code in ("FAILED_PRECONDITION", "ACK_CONFLICT"):
                # gap, fenced epoch or an ack of what this recorder never sent: start a new epoch;
                # chunk-level dedupe makes the resend safe
                self.epoch = max(self.epoch + 1, time.time_ns())
                for i, out in enumerate(self._unacked, start=1):
                    out.seq = i
                    out.req.sequence = i
                    out.req.epoch = self.epoch
                self._next_seq = len(self._unacked) + 1
                if warn:
                    log.warning(
                        "recorder %s: %s: %s; restarting as epoch %d", self.writer, exc.code, exc.details, self.epoch
                    )
            elif warn:
                # OK: a sidecar that ends idle streams may race a message just sent (not a refusal);
                # an idle recorder loses nothing by a stream that ends
                idle = not self._unacked and not self._outbox.queue
                log.log(
                    logging.INFO if exc.code == "OK" or idle else logging.WARNING,
                    "recorder %s: Write stream to %s ended: %s %s (%d messages unacknowledged); retrying, "
                    "giving up after %.0f s without acknowledgements",
                    self.writer,
                    self.address,
                    exc.code,
                    exc.details,
                    len(self._unacked),
                    self.give_up_s,
                )
            self._cond.notify_all()


def _give_up_reason(last: tuple[str, str] | None) -> str:
    """The unguided reason of a give-up after ``last`` (the last failed attempt's code, details)."""
    code = last[0] if last is not None else "UNAVAILABLE"
    if code in _UNREACHABLE:
        return "sidecar_unreachable"
    if code == "ACK_CONFLICT":  # a session conflict, like a gap the sidecar refuses
        return "failed_precondition"
    return code.lower()


class _StreamError(Exception):
    def __init__(self, code: str, details: str, failed_seq: int | None, retry_after: float) -> None:
        super().__init__(f"{code}: {details}")
        self.code, self.details, self.failed_seq, self.retry_after = code, details, failed_seq, retry_after


def _int(v: Any, default: int | None = None) -> Any:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default
