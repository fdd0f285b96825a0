"""Writer sessions: the table every writer message is fenced against.

A session (:class:`WriterState`) is one writer id of one run: its epoch; the highest sequence it
has had received, made durable (acknowledged) and committed (in a shard); the next shard number;
the identity that owns it; its queue of messages not committed yet; the messages whose
shared-memory payload the sidecar holds; and the streams waiting on its progress.

Fencing (:meth:`WriterState.check_sequence`): a message of an older epoch than the session's (a
newer instance took over the writer id) or with a gap in its sequence is refused with
:class:`SequenceError`, a resend of a received sequence is recognised as one, and a new epoch
starts at sequence 1. :class:`Sessions` holds the sessions per (run, writer), at most
``max_writers`` of them; every WAL segment starts with their snapshot (:meth:`Sessions.snapshot`,
a STATE entry), so a replay that starts after deleted segments still knows what was committed.

Sessions are never evicted: the epoch fences older instances of a writer and the owner keeps the
writer id its identity's, and both must outlive any idle time. So that one identity cannot take
every session from the others on a shared sidecar, an authenticated identity holds at most
``per_identity`` of them; and a session exists only once a message of it was admitted (a first
message that is refused takes its new, empty session away again: :meth:`Sessions.discard`).

Not thread-safe: the engine (``core.py``) calls all of it with its lock held.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterable, Mapping

from tracestore.server.engine.flusher import Waker
from tracestore.server.engine.message import Message, Session

from tracestore.errors import CorruptionError, LimitError, PermissionDeniedError, TraceStoreError


class SequenceError(TraceStoreError, ValueError):
    """A writer message out of order: a sequence gap, or an epoch older than the session's."""


@dataclasses.dataclass
class WriterState:
    run: str
    writer: str
    epoch: int = 0
    received_seq: int = 0
    durable_seq: int = 0
    committed_seq: int = 0
    shard_next: int = 0
    held: dict[int, Message] = dataclasses.field(default_factory=dict)  # this epoch's held messages by seq
    pending: deque[Message] = dataclasses.field(default_factory=deque)
    pending_bytes: int = 0
    listeners: set[Waker] = dataclasses.field(default_factory=set)
    owner: str | None = None  # the authenticated identity that first used this writer id (durable)
    # the identity whose message made this session, until that message is admitted and claims it
    # (counted against that identity's share meanwhile; not durable)
    opened_by: str | None = None

    @property
    def blank(self) -> bool:
        """Nothing was ever admitted to this session: it carries no fencing, owner or queue."""
        return (
            self.epoch == 0
            and self.received_seq == 0
            and self.owner is None
            and not self.pending
            and not self.held
            and not self.listeners
        )

    def check_sequence(self, msg: Message) -> bool:
        """Whether ``msg`` is a resend of a received message (True) or the next one (False); raises
        SequenceError for an older epoch, a new epoch that does not start at 1, or a gap."""
        if msg.epoch < self.epoch:
            raise SequenceError(
                f"writer {msg.writer} of run {msg.run}: epoch {msg.epoch} is older than the session's epoch "
                f"{self.epoch} (a newer instance took over this writer id); start a new epoch"
            )
        if msg.epoch > self.epoch:
            if msg.seq != 1:
                raise SequenceError(
                    f"writer {msg.writer} of run {msg.run}: a new epoch {msg.epoch} must start at sequence 1, "
                    f"got {msg.seq}"
                )
            return False
        if msg.seq <= self.received_seq:
            return True
        if msg.seq != self.received_seq + 1:
            raise SequenceError(
                f"writer {msg.writer} of run {msg.run} epoch {msg.epoch}: expected sequence "
                f"{self.received_seq + 1}, got {msg.seq} (a gap: messages were lost; resend from "
                f"{self.received_seq + 1})"
            )
        return False

    def check_owner(self, msg: Message, identity: str) -> None:
        """``identity`` may use this writer id: it is unowned or ``identity``'s."""
        if self.owner is not None and self.owner != identity:
            raise PermissionDeniedError(
                f"writer {msg.writer} of run {msg.run} belongs to another identity; use a writer id of your own"
            )

    def next_group(self, limit: int) -> list[Message]:
        """The queued messages not planned yet that the next shard takes: from the head of the
        queue, up to ``limit`` bytes (at least one message)."""
        group: list[Message] = []
        size = 0
        for m in self.pending:
            if m.shard_seq is not None or (group and size + m.nbytes > limit):
                break
            group.append(m)
            size += m.nbytes
        return group

    def stat(self) -> dict[str, object]:
        """This session as ``Stat`` shows it."""
        return dict(
            run=self.run,
            writer=self.writer,
            epoch=self.epoch,
            received_sequence=self.received_seq,
            durable_sequence=self.durable_seq,
            committed_sequence=self.committed_seq,
            owner=self.owner,
        )

    def progress(self) -> tuple[int, int, int, int]:
        """(epoch, durable_seq, received_seq, released_seq): ``released_seq`` is the highest
        durable sequence below every message still held."""
        released = self.durable_seq
        if self.held:
            released = min(released, next(iter(self.held)) - 1)  # held is in sequence order
        return self.epoch, self.durable_seq, self.received_seq, released

    def notify(self) -> None:
        """Wake the streams waiting on this writer's progress."""
        for waker in list(self.listeners):
            waker.wake()


class Sessions:
    """The writer sessions of one sidecar by (run, writer), at most ``max_writers``, and at most
    ``per_identity`` held by one authenticated identity (None: no share)."""

    def __init__(self, max_writers: int, per_identity: int | None = None) -> None:
        self.max_writers = max_writers
        self.per_identity = per_identity
        self.writers: dict[tuple[str, str], WriterState] = {}

    def get(self, run: str, writer: str) -> WriterState:
        """The session of ``writer``, new if there is none (no limit: replay and snapshots)."""
        key = (run, writer)
        st = self.writers.get(key)
        if st is None:
            # Shard numbers start at the current microsecond so that a writer whose WAL state was
            # lost (or a server without a WAL) never reuses the number of a committed shard.
            st = self.writers[key] = WriterState(run, writer, shard_next=time.time_ns() // 1000)
        return st

    def oldest_pending(self) -> float | None:
        """When the oldest uncommitted message was received (monotonic), None with none queued.
        Read at every metrics scrape without the engine's lock (a snapshot of the writers), so the
        backlog's age keeps growing while the flusher is stuck in a storage outage; refreshed only
        on ingest and commit it froze there and TraceStoreBacklogAgeHigh never fired."""
        oldest = None
        for w in list(self.writers.values()):
            try:
                t = w.pending[0].received
            except IndexError:
                continue
            oldest = t if oldest is None else min(oldest, t)
        return oldest

    def admit(self, msg: Message, identity: str | None = None) -> tuple[WriterState, bool]:
        """The session ``msg`` belongs to and whether it was made now (the caller gives a new one
        back with :meth:`discard` if the message is then refused); LimitError when a new one would
        be beyond ``max_writers``, or beyond ``per_identity`` sessions held by ``identity``."""
        st = self.writers.get((msg.run, msg.writer))
        if st is not None:
            return st, False
        if len(self.writers) >= self.max_writers:
            raise LimitError(
                f"this sidecar already tracks {len(self.writers)} writers (max_writers); writer "
                f"{msg.writer} of run {msg.run} is refused: use fewer writer ids, or raise --max-writers"
            )
        if identity is not None and self.per_identity is not None:
            # A scan, only when a new writer id asks for a session: at most max_writers entries.
            held = sum(1 for w in self.writers.values() if (w.owner or w.opened_by) == identity)
            if held >= self.per_identity:
                raise LimitError(
                    f"identity {identity!r} already holds {held} writer sessions on this sidecar, its share "
                    f"(max_writers_per_identity); writer {msg.writer} of run {msg.run} is refused: reuse writer "
                    "ids (a restarted engine keeps its writer id and starts a new epoch), or raise "
                    "--max-writers-per-identity"
                )
        st = self.get(msg.run, msg.writer)
        st.opened_by = identity
        return st, True

    def discard(self, st: WriterState) -> None:
        """Take back a session :meth:`admit` made for a message that was then refused, unless
        something was admitted to it meanwhile (another stream of the same writer id)."""
        key = (st.run, st.writer)
        if self.writers.get(key) is st and st.blank:
            del self.writers[key]

    def snapshot(self, resume: Mapping[int, Message] | None = None) -> list[Session]:
        """Every session as a STATE entry holds it; a writer in ``resume`` (by ``id()`` of its
        state) is written as it was just before that message, to be appended again."""
        sessions = []
        for w in self.writers.values():
            first = None if resume is None else resume.get(id(w))
            epoch, seq = (first.epoch, first.seq - 1) if first is not None else (w.epoch, w.received_seq)
            sessions.append(Session(w.run, w.writer, epoch, seq, w.shard_next, w.owner))
        return sessions

    def restore(self, sessions: Iterable[Session]) -> None:
        """Replay of a STATE entry: what it says was received is committed (messages gone)."""
        for session in sessions:
            st = self.get(session.run, session.writer)
            st.owner = st.owner or session.owner
            if (session.epoch, session.seq) > (st.epoch, st.received_seq):
                st.epoch, st.received_seq = session.epoch, session.seq
                st.durable_seq = st.committed_seq = session.seq
            st.shard_next = max(st.shard_next, session.shard_next)

    def replayed(self, msg: Message, segment: int) -> WriterState | None:
        """Replay of a DATA entry (from WAL segment ``segment``): the session, advanced to ``msg``
        (received and durable); None when a snapshot already covers it (committed). A message that
        skips sequences of a session the log knows is CorruptionError: acknowledged messages are
        missing from the log."""
        known = (msg.run, msg.writer) in self.writers
        st = self.get(msg.run, msg.writer)
        if (msg.epoch, msg.seq) <= (st.epoch, st.received_seq):
            return None
        if known and msg.seq != (st.received_seq + 1 if msg.epoch == st.epoch else 1):
            raise CorruptionError(
                f"write-ahead log segment {segment}: writer {msg.writer} of run {msg.run} jumps from "
                f"(epoch {st.epoch}, sequence {st.received_seq}) to (epoch {msg.epoch}, sequence {msg.seq}): "
                "acknowledged messages between them are missing from the log; the sidecar will not start"
            )
        st.epoch, st.received_seq, st.durable_seq = msg.epoch, msg.seq, msg.seq
        return st
