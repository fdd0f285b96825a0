"""The sidecar's ingest engine: admission, WAL replay and shutdown, under one lock.

No gRPC here (``rpc/service.py`` parses requests and maps errors to status codes). The engine holds
the lock and ties its parts together; each part owns its state:

- ``runs.py``: the run slots;
- ``sessions.py``: the writer sessions (the epochs and sequences messages are fenced against,
  writer ownership, each writer's queue);
- ``memory.py``: the memory budget and the writers' shared memory the sidecar holds;
- ``journal.py``: the write-ahead log bookkeeping (acks at fsync, segment retirement, recovery from
  a failed log);
- ``dedupe.py``: the dedupe index, with the trajectory owners of ``owners.py``;
- ``flusher.py``: the flusher thread, which reaches the engine through its ``FlushSource``
  protocol, implemented by ``commits.py``;
- ``message.py``: the message and WAL entry format.

No part imports this module; the engine calls the stateful ones with its lock held.

Life of a message (one numbered batch of chunks/seals/links from one writer):
``submit`` checks (epoch, sequence) against the writer's session — a resend is answered as
success, a gap or an older epoch is refused — checks every chunk key against what this server has
seen (same bytes: dropped as a retry; different bytes: :class:`ConflictError`), waits for room in
the memory budget (or refuses with :class:`OverBudgetError`), appends the raw message to the WAL
and queues it. It is *durable* when the WAL fsync covering it returns (``wal_dir`` set) or when its
shard is committed (no WAL). The flusher groups a writer's queued messages into shards
(``Store.write_shard`` with a per-writer shard number recorded in the WAL *before* the write, so a
re-flush after a crash repeats the identical call, which the store treats as a no-op), then
releases the memory and retires WAL segments whose every message is committed. How long a
shared-memory payload stays a view into the writer's staging is ``memory.py``'s to say.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from tracestore.server.config import ServerConfig
from tracestore.server.engine.commits import CommitSide
from tracestore.server.engine.dedupe import DedupeIndex
from tracestore.server.engine.flusher import Flusher, Waker
from tracestore.server.engine.journal import Journal
from tracestore.server.engine.memory import MemoryBudget, OverBudgetError, StagingHolds, largest_chunk
from tracestore.server.engine.message import (
    CLAIMS,
    DATA,
    STATE,
    Message,
    Owner,
    Plan,
    decode_claims,
    decode_entry,
    decode_state,
)
from tracestore.server.engine.owners import table_path
from tracestore.server.engine.runs import RunSlots
from tracestore.server.engine.sessions import Sessions, WriterState
from tracestore.server.metrics import Metrics
from tracestore.server.wal.log import Part, WriteAheadLog

from tracestore.errors import ConflictError, TraceStoreError
from tracestore.records import RunSpec

log = logging.getLogger("tracestore.server")


# Why the sidecar reports itself unhealthy (health NOT_SERVING, Stat.degraded, a metric): a fixed set.
DEGRADED_REASONS = ("wal_failed", "flusher_dead", "flusher_stalled", "storage_refusing")


class DrainingError(TraceStoreError, RuntimeError):
    """The server is shutting down and accepts no new writes."""


def _draining_error() -> DrainingError:
    return DrainingError("the sidecar is shutting down; reconnect to its replacement and resend")


class Engine(CommitSide):
    """Ingest state of one sidecar. ``store`` follows the tracestore.storage.store.Store contract.
    The flusher's side of it (:class:`~tracestore.server.engine.commits.CommitSide`) lives in
    ``commits.py``."""

    def __init__(self, config: ServerConfig, store: Any, metrics: Metrics) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # budget freed / flush finished
        per_identity = config.writers_per_identity if config.auth_tokens is not None else None
        self.sessions = Sessions(config.max_writers, per_identity)
        share = config.runs_per_identity if config.auth_tokens is not None else None
        self.run_slots = RunSlots(config.max_runs, share, self._busy_runs)
        self._dedupe = DedupeIndex(config.dedupe_versions, table_path(config))
        self.budget = MemoryBudget(config, metrics, self._room, press=self._commit_now, store=store)
        self.holds = StagingHolds(metrics, self.sessions.writers)
        self._in_flight: set[int] = set()  # id() of messages whose shard the flusher is writing now
        self._force = 0  # flush requests outstanding
        self._draining = False
        self._stopped = False
        self._last_ingest = 0.0  # when submit last admitted a message
        self.shards_committed = 0
        self.journal: Journal | None = None  # with a WAL, from start()
        self._flusher = Flusher(self, store, metrics)
        self.parse_wal_data: Callable[[bytes], Message] | None = None
        metrics.memory_budget.set(config.memory_budget_bytes)
        metrics.backlog_oldest_age.set_function(self.backlog_oldest_age)
        # A shard's encoding and upload take memory too: the budget counts them while the flusher
        # commits (MemoryBudget.hold_commit) and cuts shards at a quarter of the budget (a sixteenth
        # where shards are published from memory: tests/faults/test_rss_bounds.py measures it).
        self.shard_bytes = self.budget.shard_bytes

    @property
    def writers(self) -> dict[tuple[str, str], WriterState]:
        return self.sessions.writers

    @property
    def wal(self) -> WriteAheadLog | None:
        """The write-ahead log (None without ``wal_dir``, or before :meth:`start`)."""
        return None if self.journal is None else self.journal.wal

    @property
    def in_use(self) -> int:
        """Bytes of admitted messages not committed yet (the backlog), held against the budget."""
        return self.budget.in_use

    # -- runs (the slots: runs.py) ----------------------------------------------------------------

    @property
    def runs(self) -> dict[str, RunSpec]:
        """The specs of the runs holding a slot (least recently written first)."""
        return self.run_slots.specs

    def declare_run(self, spec: RunSpec, identity: str | None = None) -> None:
        """Create the run on storage, or check that the stored one is identical; the run takes a
        slot for ``identity``'s writes (LimitError when none is free)."""
        with self._lock:
            known = self.run_slots.get(spec.run)
        if known is not None and known != spec:
            raise ConflictError(f"run {spec.run} is already declared with different sites; runs are immutable")
        if known is None:
            with self._lock:  # refused before anything is created on storage
                self.run_slots.admit(spec.run, identity)
            self.store.put_run(spec)
        with self._lock:
            self.run_slots.admit(spec.run, identity, spec)

    def write_spec(self, run: str, identity: str | None = None) -> RunSpec:
        """The spec of ``run``, which ``identity`` is about to write: the run takes a slot
        (LimitError when none is free). NotFoundError, and no slot, for a run never declared."""
        with self._lock:
            spec = self.run_slots.get(run)
            self.run_slots.admit(run, identity, spec)
        if spec is None:
            spec = self.store.get_run(run)  # NotFoundError when never declared
            with self._lock:
                self.run_slots.admit(run, identity, spec)
        return spec

    def run_spec(self, run: str) -> RunSpec:
        """The spec of ``run`` for anything but a write (Read, Stat, WAL replay): takes no slot and
        is never refused for a limit. NotFoundError for a run never declared."""
        with self._lock:
            spec = self.run_slots.get(run)
        # (the Store keeps the specs it has read: immutable, and only those of runs that exist)
        return spec if spec is not None else self.store.get_run(run)

    def _busy_runs(self) -> set[str]:
        """Runs with messages queued, not committed yet (lock held)."""
        return {w.run for w in self.writers.values() if w.pending}

    # -- start / replay ---------------------------------------------------------------------------

    def start(self, parse_wal_data: Callable[[bytes], Message]) -> int:
        """Replay the WAL (if any) and start the flusher; returns the messages replayed."""
        self.parse_wal_data = parse_wal_data
        replayed = 0
        if self.config.wal_dir is not None:
            self.journal = Journal(
                self.config,
                self.metrics,
                self.sessions,
                on_synced=self._on_synced,
                claims=self._dedupe.open_claims,
                owners=self._dedupe.owners,
            )
            replayed = self.journal.replay(self._replay_entry)
            # the runs with records queued again are busy: they get their slots back (runs.py)
            queued = {id(m) for w in self.writers.values() for m in w.pending}
            self.run_slots.restore_replayed(queued, self.run_spec)
            self.journal.start()
        self._update_gauges()
        self._flusher.start()
        if replayed:
            log.info("replayed %d messages from the write-ahead log", replayed)
        return replayed

    def _replay_entry(self, segment: int, kind: int, payload: bytes) -> int:
        """Rebuild the parts' state from one WAL entry; 1 for a message queued again, else 0."""
        if kind == STATE:
            self.sessions.restore(decode_state(payload))
            return 0
        if kind == CLAIMS:
            self._dedupe.restore_claims(decode_claims(payload))
            return 0
        if kind == DATA:
            assert self.parse_wal_data is not None
            msg = self.parse_wal_data(payload)
            self._dedupe.restore_owners(msg, self.sessions.get(msg.run, msg.writer).owner)  # committed or not
            st = self.sessions.replayed(msg, segment)
            if st is None:
                return 0  # covered by a state snapshot (already committed)
            msg.segment = segment
            # Chunks dropped as identical resends when this message was accepted are in the raw
            # request again: drop them again, or the flush would store them twice.
            with contextlib.suppress(ConflictError):
                self._dedupe.check(msg)
            self._remember(msg, st.owner)
            self._enqueue(st, msg)
            self.run_slots.replayed(st, msg)
            return 1
        entry = decode_entry(kind, payload)
        if entry is None:
            return 0
        st = self.sessions.get(entry.run, entry.writer)
        if isinstance(entry, Owner):
            st.owner = entry.identity
        elif isinstance(entry, Plan):
            ids = set(entry.messages)
            for m in st.pending:
                if (m.epoch, m.seq) in ids:
                    m.shard_seq = entry.shard
            st.shard_next = max(st.shard_next, entry.shard + 1)
        else:
            done = [m for m in st.pending if m.shard_seq == entry.shard]
            self._release(st, done)
        return 0

    # -- submit -----------------------------------------------------------------------------------

    def reserve(self, estimate: int) -> int:
        """Room for a message a stream is about to read (:meth:`MemoryBudget.reserve`); returns
        the bytes reserved (pass them to :meth:`submit`); raises OverBudgetError."""
        with self._lock:
            return self.budget.reserve(estimate, lambda: self._draining, _draining_error)

    def reserve_stream(self) -> int:
        """Room for one more open Write stream's own memory (:meth:`MemoryBudget.reserve_stream`),
        held until the stream ends (:meth:`unreserve`)."""
        with self._lock:
            return self.budget.reserve_stream()

    def unreserve(self, nbytes: int) -> None:
        self.budget.unreserve(nbytes)

    def expect(self, msg: Message | None, arrived: int = 0) -> None:
        """Keep free the room that committing ``msg`` (parsed, on its way to :meth:`submit`) will
        need, instead of that of a message of ``arrived`` bytes not parsed yet (see
        :meth:`arrived`); ``msg`` None: that message will not be submitted."""
        with self._room:
            if msg is not None:
                msg.largest_chunk = largest_chunk(msg)
                self.budget.expect(msg.largest_chunk, msg.nbytes)
                msg.room_counted = True
            if arrived:
                self.budget.unexpect(arrived, arrived)
                self._room.notify_all()  # (the room kept free may be smaller now)

    def forget(self, msg: Message) -> None:
        """``msg`` will not join the backlog (refused, or a resend): the room kept free for its
        commit (:meth:`expect`) is given back; nothing when it is queued or was never counted."""
        if msg.room_counted and not msg.queued:
            with self._room:
                if msg.room_counted and not msg.queued:
                    self.budget.forget(msg)
                    self._room.notify_all()

    def arrived(self, nbytes: int) -> None:
        """A message of ``nbytes`` was received, not parsed yet: until :meth:`expect` says what its
        commit needs, the room kept free for it is that of one chunk as large as the message, so
        that no stream reserves what that commit may need meanwhile."""
        with self._room:
            self.budget.expect(nbytes, nbytes)

    def _commit_now(self) -> None:
        """The budget is full: ask the flusher to commit what is pending now (lock held)."""
        self._force = max(self._force, 1)
        self._flusher.kick()

    def submit(
        self,
        msg: Message,
        wal_parts: Sequence[Part],
        reserved: int = 0,
        hold: tuple[str, int] | None = None,
        identity: str | None = None,
    ) -> tuple[WriterState, bool]:
        """Admit one message; returns (writer state, duplicate). Raises on gaps, conflicts, no room.
        ``reserved``: bytes this caller reserved with :meth:`reserve` (taken over here). ``hold``:
        (pool, its bytes) of a writer that keeps its staging until released: with a WAL, the
        message's shared-memory payload is then read in place until its shard is committed
        (:meth:`StagingHolds.hold`). Without ``hold`` the caller has made the payload its own (or
        has no WAL). ``identity``: the authenticated caller (None with authentication off). A writer
        id belongs to the identity that first used it, and a trajectory to the identity that first
        wrote it: another identity can neither fence that writer (new epochs, huge epochs) nor write
        the trajectory's records, seals or links, nor link a trajectory of its own to it
        (:class:`PermissionDeniedError`)."""
        # The caller's reservation stays this message's room while it waits for admission (so the
        # message is never in memory uncounted), and becomes its share of ``in_use`` when it is
        # admitted. A session made for this message goes again if the message is refused, so a
        # refused first message leaves no empty session behind (in WAL snapshots too, owned by no
        # one).
        opened: list[WriterState] = []
        try:
            return self._admit(msg, wal_parts, reserved, hold, identity, opened)
        except BaseException:
            if opened:
                with self._lock:
                    self.sessions.discard(opened[0])
            raise
        finally:
            if msg.reservation_held:
                self.unreserve(msg.reservation_held)
                msg.reservation_held = 0
            self.forget(msg)

    def _admit(
        self,
        msg: Message,
        wal_parts: Sequence[Part],
        held: int,
        hold: tuple[str, int] | None,
        identity: str | None,
        opened: list[WriterState],
    ) -> tuple[WriterState, bool]:
        msg.reservation_held = held
        deadline = time.monotonic() + self.config.backpressure_timeout_s
        if msg.nbytes > self.config.memory_budget_bytes:
            raise OverBudgetError(
                f"message of {msg.nbytes} bytes exceeds the whole memory budget of "
                f"{self.config.memory_budget_bytes} bytes; send smaller batches",
                retry_after_s=0.0,
            )
        with self._lock:
            waited = False
            while True:
                if self._draining:
                    raise _draining_error()
                st, new = self.sessions.admit(msg, identity)
                if new:
                    opened.append(st)
                if identity is not None:
                    st.check_owner(msg, identity)
                    self._dedupe.check_owner(msg, identity)
                dup = st.check_sequence(msg)
                if dup:
                    self.metrics.ingest_duplicates.inc()
                    return st, True
                if self.budget.fits(msg.nbytes, own=held, msg=msg):
                    break
                self.budget.wait(deadline, first=not waited, detail="nothing of this message was accepted")
                waited = True
            self._dedupe.check(msg)
            claim = identity if st.owner is None else None
            if claim:
                # Set before the appends: when the DATA entry opens a new segment, that segment's
                # STATE header (the snapshot of every session) must carry the claim, or it is lost
                # with the segment that holds the OWNER entry once that one is retired.
                st.owner = claim
            if self.journal is not None:
                try:
                    self.journal.append(st, msg, wal_parts, claim)
                except BaseException:
                    if claim:
                        st.owner = None
                    raise
            self._remember(msg, identity)
            self.holds.admit(msg)
            if msg.epoch != st.epoch:
                while any(id(m) in self._in_flight for m in st.held.values()):
                    self._room.wait(0.1)  # their commit releases them (a shard write in progress)
                self.holds.own_all(st)
                st.epoch, st.durable_seq, st.committed_seq = msg.epoch, 0, 0
            if hold is not None and self.journal is not None and msg.shm_chunks:
                pool, capacity = hold
                self.holds.hold(st, msg, pool, capacity, self._in_flight)
            st.received_seq = msg.seq
            self.budget.reserved -= held  # counted in in_use from here on
            msg.reservation_held = 0
            if held > msg.nbytes:
                self._room.notify_all()
            self._enqueue(st, msg)
            self.metrics.ingest_records.labels(msg.path).inc(sum(c.n_rows for c in msg.chunks))
            self.metrics.ingest_chunks.labels(msg.path).inc(len(msg.chunks))
            self.metrics.ingest_bytes.labels(msg.path).inc(msg.nbytes)
            self._update_gauges()
            self._last_ingest = time.monotonic()
            if st.pending_bytes >= self.shard_bytes:
                self._flusher.kick()
            return st, False

    def _remember(self, msg: Message, identity: str | None = None) -> None:
        sealed, past = self._dedupe.remember(msg, identity)
        self.metrics.sealed_trajectories.inc(sealed)
        self.metrics.tokens_past_seals.inc(past)

    def _enqueue(self, st: WriterState, msg: Message) -> None:
        st.pending.append(msg)
        st.pending_bytes += msg.nbytes
        self.budget.enqueue(msg)
        msg.queued = True
        if self.journal is not None:
            self.journal.track(msg)

    def _release(self, st: WriterState, group: list[Message]) -> None:
        ids = {id(m) for m in group}
        st.pending = deque(m for m in st.pending if id(m) not in ids)
        for m in group:
            st.pending_bytes -= m.nbytes
            self.budget.dequeue(m)
            m.queued = False
            if self.journal is not None:
                self.journal.settle(m)

    def _update_gauges(self) -> None:
        self.metrics.memory_in_use.set(self.in_use)
        self.metrics.backlog_bytes.set(self.in_use)
        self.metrics.open_trajectories.set(self._dedupe.open_trajectories)

    def backlog_oldest_age(self) -> float:
        """Seconds the oldest uncommitted message has waited (:meth:`Sessions.oldest_pending`)."""
        oldest = self.sessions.oldest_pending()
        return 0.0 if oldest is None else max(0.0, time.monotonic() - oldest)

    # -- durability -------------------------------------------------------------------------------

    def _on_synced(self, ticket: int) -> None:
        now = time.monotonic()
        with self._lock:
            assert self.journal is not None
            touched: set[int] = set()
            for st, msg in self.journal.synced(ticket):
                if msg.epoch == st.epoch and msg.seq > st.durable_seq:
                    st.durable_seq = msg.seq
                self.holds.durable(msg)
                self.metrics.durable_ack_latency.observe(now - msg.received)
                if id(st) not in touched:
                    touched.add(id(st))
                    st.notify()

    def listen(self, st: WriterState, waker: Waker) -> None:
        with self._lock:
            st.listeners.add(waker)

    def unlisten(self, st: WriterState, waker: Waker) -> None:
        with self._lock:
            st.listeners.discard(waker)

    def durable(self, st: WriterState) -> tuple[int, int, int]:
        """(epoch, durable_seq, received_seq) of a writer, consistently."""
        return self.progress(st)[:3]

    def progress(self, st: WriterState) -> tuple[int, int, int, int]:
        """(epoch, durable_seq, received_seq, released_seq) of a writer, consistently:
        ``released_seq`` is the highest durable sequence below every message still held."""
        with self._lock:
            return st.progress()

    # -- flushing ---------------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Commit everything accepted so far to storage; True when done within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            # Per writer, the newest message queued now, as (epoch, sequence): a queue is in that
            # order, and may hold an older epoch's messages behind a new epoch's first (a sequence
            # alone said "done" while (epoch 1, seq 2) waited behind (epoch 2, seq 1)).
            target = {k: (w.pending[-1].epoch, w.pending[-1].seq) for k, w in self.writers.items() if w.pending}
            self._force += 1
            self._flusher.kick()

            def waiting(k: tuple[str, str], last: tuple[int, int]) -> bool:
                pending = self.writers[k].pending
                return bool(pending) and (pending[0].epoch, pending[0].seq) <= last

            try:
                while any(waiting(k, last) for k, last in target.items()):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._room.wait(left if left is None else min(left, 0.5))
                return True
            finally:
                self._force -= 1

    def degraded(self) -> list[str]:
        """Why this sidecar cannot do its job right now (empty: healthy), from DEGRADED_REASONS:
        the WAL failed (writes are refused until it recovers), the flusher thread died or is stuck
        in one commit for longer than ``storage_unhealthy_s``, or storage has refused every commit
        for that long."""
        reasons = []
        if self.journal is not None and self.journal.failed:
            reasons.append("wal_failed")
        return reasons + self._flusher.health(self.config.storage_unhealthy_s)

    # -- stop -------------------------------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        """Refuse new writes, commit what is pending within ``timeout``; the WAL keeps the rest."""
        with self._lock:
            self._draining = True
            self._room.notify_all()
        return self.flush(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the flusher, waiting at most ``timeout`` s for a shard write in progress (a storage
        outage can hold one for retries x storage timeout); what is not committed by then stays in
        the fsynced WAL and is replayed by the next start."""
        with self._lock:
            self._stopped = True
        stuck = not self._flusher.stop(timeout)  # logs what it was doing if it did not stop
        if self.journal is not None:
            with self._lock:
                if not stuck and not any(w.pending for w in self.writers.values()):
                    self.journal.truncate()  # everything is committed
            self.journal.close()

    def stat(self, run: str = "") -> dict[str, Any]:
        with self._lock:
            writers = [w.stat() for w in self.writers.values() if not run or w.run == run]
            return dict(
                draining=self._draining,
                backlog_bytes=self.in_use,
                memory_in_use_bytes=self.in_use,
                memory_budget_bytes=self.config.memory_budget_bytes,
                wal_bytes=0 if self.journal is None else self.journal.wal.nbytes,
                open_trajectories=self._dedupe.open_trajectories,
                shards_committed=self.shards_committed,
                writers=writers,
            )
