"""The engine's write-ahead log bookkeeping: what it appends, what waits for an fsync, which
segments may go, and how it comes back from a failed log.

The log itself (framing, fsync, segment files) is ``wal/log.py`` and its entry format
``message.py``; :class:`Journal` keeps what the engine needs on top of it:

- the messages whose DATA entry waits for its fsync (:meth:`Journal.synced` hands them back
  once it returns: that is their acknowledgement);
- per segment, how many of its messages are not committed yet: a segment is deleted once it
  holds none and the DONE entries saying so are durable (:meth:`Journal.retire`);
- the DONE entries a failed log refused, and the messages not durable when it failed: both are
  appended again when the device takes writes again (:meth:`Journal.recover`).

Every new segment starts with a STATE entry, the writer sessions' snapshot (``sessions.py``), and
with authentication on a CLAIMS entry, who owns each open trajectory (``dedupe.py``). With
authentication on, the trajectory owners table (``owners.py``) is written before any segment is
deleted (:meth:`Journal.retire`, :meth:`Journal.truncate`): a trajectory's owner is always in the
table or in a segment still on disk.

Not thread-safe: the engine (``core.py``) calls it with its lock held.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from tracestore.server.config import ServerConfig
from tracestore.server.engine.flusher import Round
from tracestore.server.engine.memory import wal_buffer_bytes
from tracestore.server.engine.message import (
    CLAIMS,
    DATA,
    DONE,
    OWNER,
    PLAN,
    STATE,
    Claim,
    Done,
    Message,
    Owner,
    Plan,
    encode_claims,
    encode_entry,
    encode_state,
)
from tracestore.server.engine.owners import TrajectoryOwners
from tracestore.server.engine.sessions import Sessions, WriterState
from tracestore.server.metrics import Metrics
from tracestore.server.wal.log import Part, WriteAheadLog

from tracestore import faults
from tracestore.errors import StorageError, TraceStoreError

log = logging.getLogger("tracestore.server")


class Journal:
    """The engine's side of its WAL in ``config.wal_dir``; ``on_synced(ticket)`` is the WAL's
    callback after each fsync (the engine takes its lock, then calls :meth:`synced`). ``owners``:
    the trajectory owners, whose table is opened once the directory is locked and written before
    segments go."""

    def __init__(
        self,
        config: ServerConfig,
        metrics: Metrics,
        sessions: Sessions,
        on_synced: Callable[[int], None],
        claims: Callable[[], list[Claim]] | None = None,
        owners: TrajectoryOwners | None = None,
    ) -> None:
        assert config.wal_dir is not None
        self.metrics = metrics
        self.retry_s = config.wal_retry_s
        self._sessions = sessions
        self._claims = claims
        self.wal = WriteAheadLog(
            config.wal_dir,
            segment_bytes=config.wal_segment_bytes,
            on_synced=on_synced,
            segment_header=self._header,
            buffer_bytes=wal_buffer_bytes(config),  # (counted against the memory budget)
        )
        self._owners = owners
        if owners is not None:
            try:
                owners.open()  # (the WAL holds the directory's lock from here)
            except BaseException:
                self.wal.close()
                raise
        self._acks: deque[tuple[int, WriterState, Message]] = deque()  # WAL ticket, writer, message
        self._outstanding: dict[int, int] = {}  # segment -> its messages not committed yet
        self._done_ticket = 0  # WAL ticket of the newest DONE entry: segments go only once it is durable
        self._done_backlog: list[bytes] = []  # DONE entries a failed WAL refused: re-appended on recovery
        self._redo: list[tuple[WriterState, Message]] = []  # not durable at a WAL failure, not re-appended yet
        self._retry_at = 0.0

    def _header(self, resume: dict[int, Message] | None = None) -> list[tuple[int, bytes]]:
        entries = [(STATE, encode_state(self._sessions.snapshot(resume=resume)))]
        claims = None if self._claims is None else self._claims()
        if claims:
            entries.append((CLAIMS, encode_claims(claims)))
        return entries

    @property
    def failed(self) -> bool:
        """The log refused a write or an fsync: nothing is appended until :meth:`recover`."""
        return self.wal.error is not None

    def replay(self, apply: Callable[[int, int, bytes], int]) -> int:
        """Hand every intact entry, oldest first, to ``apply(segment, kind, payload)``; returns the
        sum of what it returned. An entry it cannot decode stops the start naming its segment file
        and byte offset (``WriteAheadLog.replay_into``)."""
        kinds = {DATA: "DATA", STATE: "STATE", PLAN: "PLAN", DONE: "DONE", OWNER: "OWNER", CLAIMS: "CLAIMS"}
        return self.wal.replay_into(apply, kinds)

    def start(self) -> None:
        """After the replay: start the log's threads and delete the segments found committed."""
        self.wal.start()
        self.retire()
        self.metrics.wal_bytes.set(self.wal.nbytes)

    # -- appends ----------------------------------------------------------------------------------

    def append(self, st: WriterState, msg: Message, parts: Sequence[Part], claim: str | None) -> None:
        """Log ``msg`` (its DATA entry ``parts``), after an OWNER entry when it makes the ``claim``
        that its writer id is that identity's (durable no later than the message that makes it)."""
        if claim is not None:
            self.wal.append(OWNER, [encode_entry(Owner(st.run, st.writer, claim))])
        segment, ticket = self.wal.append(DATA, parts)
        msg.segment, msg.ticket, msg.wal_parts = segment, ticket, parts
        self._acks.append((ticket, st, msg))
        self.metrics.wal_bytes.set(self.wal.nbytes)

    def synced(self, ticket: int) -> list[tuple[WriterState, Message]]:
        """The messages that WAL ticket ``ticket`` made durable, in order."""
        durable = []
        while self._acks and self._acks[0][0] <= ticket:
            _, st, msg = self._acks.popleft()
            msg.wal_parts = None
            durable.append((st, msg))
        return durable

    def plan(self, st: WriterState, shard: int, group: list[Message]) -> int:
        """Log that ``group`` is shard ``shard`` of ``st``'s writer; returns the PLAN entry's
        ticket. Raises StorageError (nothing logged) when the WAL refuses it."""
        plan = Plan(st.run, st.writer, shard, [(m.epoch, m.seq) for m in group])
        _, ticket = self.wal.append(PLAN, [encode_entry(plan)])
        faults.point("commit.planned")
        return ticket

    def done(self, st: WriterState, shard: int) -> None:
        """Log that shard ``shard`` of ``st``'s writer is committed."""
        done = encode_entry(Done(st.run, st.writer, shard))
        try:
            _, self._done_ticket = self.wal.append(DONE, [done])
        except TraceStoreError:
            # The WAL failed: keep the DONE for its recovery. Until then no segment is
            # retired (a replay without it would rebuild the shard from a partial group).
            self._done_backlog.append(done)
        else:
            faults.point("commit.done_appended")

    # -- segments ---------------------------------------------------------------------------------

    def track(self, msg: Message) -> None:
        """``msg`` (logged in ``msg.segment``) is queued, not committed yet."""
        self._outstanding[msg.segment] = self._outstanding.get(msg.segment, 0) + 1

    def settle(self, msg: Message) -> None:
        """``msg`` is committed: its segment holds one message less that it must keep."""
        self._outstanding[msg.segment] -= 1

    def retire(self) -> None:
        """Delete WAL segments whose every message is committed — once the DONE entries saying so
        are durable (a crash before that replays the PLANs, and a PLAN whose messages were partly
        deleted would rebuild a different shard under a committed shard's number: the sidecar wedged
        on that conflict for good) — and, with trajectory owners, once every claim made so far is in
        their table (the owners' writer thread deletes them then, off the engine's lock)."""
        if self._done_backlog:
            return
        live = [s for s, n in self._outstanding.items() if n > 0]
        keep_from = min(live, default=self.wal.active_index)
        for s in [s for s in self._outstanding if s < keep_from]:
            del self._outstanding[s]
        after = self._done_ticket

        def delete() -> None:
            self.wal.delete_before(keep_from, after=after)
            self.metrics.wal_bytes.set(self.wal.nbytes)

        if self._owners is not None and keep_from > self.wal.segments[0].index:
            self._owners.persist_then(delete)
        else:
            delete()

    def truncate(self) -> None:
        """Everything is committed (at shutdown): keep only a fresh segment holding the writer
        sessions (so resends after the restart are still recognised), once the trajectory owners
        are in their table (else the log stays whole, and its replay claims them again)."""
        if self._owners is not None:
            try:
                self._owners.persist()
            except StorageError as exc:
                log.warning("%s; the write-ahead log is kept whole (its replay claims them again)", exc)
                return
        self._outstanding.clear()
        self.wal.delete_before(self.wal.rotate())

    def close(self) -> None:
        """Close the owners table (after its pending write and deletion), then the log."""
        if self._owners is not None:
            self._owners.close()
        self.wal.close()

    # -- recovery ---------------------------------------------------------------------------------

    def recover(self) -> Round:
        """On the flusher thread (so no commit is in flight): bring a failed WAL back once the
        device takes writes again — cut back to what is durable, then re-append, in their order,
        the DONE entries it refused and every message not durable yet, under a header whose writer
        sessions end just before those messages (replay would otherwise skip them as already
        committed). Plans that were not durable are dropped (their groups are re-planned).
        Returns a round without shards: go on once recovered, back off while the device still
        refuses (retried every ``wal_retry_s``)."""
        now = time.monotonic()
        if now < self._retry_at:
            return Round(wait_s=min(0.25, self._retry_at - now))
        self._retry_at = now + self.retry_s
        durable = self.wal.synced_ticket
        # (a recovery that failed half-way left some messages re-appended, the rest in _redo)
        redo = self._redo = [(st, m) for t, st, m in self._acks if t > durable] + self._redo
        self._acks = deque(x for x in self._acks if x[0] <= durable)
        first: dict[int, Message] = {}
        for st, m in redo:
            first.setdefault(id(st), m)
        try:
            self.wal.recover(self._header(resume=first))
            while self._done_backlog:
                _, self._done_ticket = self.wal.append(DONE, [self._done_backlog[0]])
                del self._done_backlog[0]
            n_redo = len(redo)
            while self._redo:
                st, m = self._redo[0]
                assert m.wal_parts is not None
                segment, ticket = self.wal.append(DATA, m.wal_parts)
                self._outstanding[m.segment] -= 1
                m.segment, m.ticket = segment, ticket
                self._outstanding[segment] = self._outstanding.get(segment, 0) + 1
                self._acks.append((ticket, st, m))
                del self._redo[0]
        except TraceStoreError as exc:
            log.warning("write-ahead log still failing (%s); retrying in %.1f s", exc, self.retry_s)
            return Round(back_off=True)
        for w in self._sessions.writers.values():
            for m in w.pending:
                if m.shard_seq is not None and m.plan_ticket > durable:
                    m.shard_seq = None  # its PLAN never became durable: plan it again
        log.warning("write-ahead log recovered: re-appended %d messages not durable at the failure", n_redo)
        self.retire()
        return Round()
