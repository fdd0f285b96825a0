"""The sidecar's ingest engine: writer sessions, admission and the memory budget, shared-memory holds,
writer ownership and WAL replay, under one lock.

No gRPC here (the service in ``service.py`` parses requests and maps errors to status codes). The
engine coordinates three parts that own their own state: the dedupe index (``dedupe.py``: what was
accepted per key), the flusher (``flusher.py``: the thread that commits shards, which reaches the
engine through its ``FlushSource`` protocol) and the message and WAL entry format (``message.py``).

Life of a message (one numbered batch of chunks/seals/links from one writer):
``submit`` checks (epoch, sequence) against the writer's session — a resend is answered as
success, a gap or an older epoch is refused — checks every chunk key against what this server has
seen (same bytes: dropped as a retry; different bytes: :class:`ConflictError`), waits for room in
the memory budget (or refuses with :class:`OverBudgetError`), appends the raw message to the WAL
and queues it. It is *durable* when the WAL fsync covering it returns (``wal_dir`` set) or when its
shard is committed (no WAL). The flusher groups a writer's queued messages into shards
(``Store.write_shard`` with a per-writer shard number recorded in the WAL *before* the write, so a
re-flush after a crash repeats the identical call, which the store treats as a no-op), then
releases the memory and retires WAL segments whose every message is committed.

Shared-memory payloads (the same-host path) stay views into the writer's staging pool while the
writer keeps the regions: without a WAL until the shard is committed (that is the ack), with a WAL
until the shard is committed too when the writer set ``keeps_staging`` and its held regions stay
under :data:`SHM_HOLD_FRACTION` of its pool; then the response's ``released_sequence`` trails
``durable_sequence`` and the WAL append is the only copy the sidecar makes of those bytes.
Otherwise (an older writer, or the pool mostly held) the payload is copied out before the message
can become durable, and released with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from tracestore import faults
from tracestore.errors import (
    ConflictError,
    CorruptionError,
    LimitError,
    PermissionDeniedError,
    TraceStoreError,
)
from tracestore.records import RunSpec

from .config import ServerConfig
from .dedupe import DedupeIndex
from .flusher import Batch, Flusher, Round, Waker
from .message import (
    DATA,
    DONE,
    OWNER,
    PLAN,
    STATE,
    Done,
    Message,
    Owner,
    Plan,
    Session,
    decode_entry,
    decode_state,
    encode_entry,
    encode_state,
)
from .metrics import Metrics
from .wal import Part, WriteAheadLog

log = logging.getLogger("tracestore.server")

# Why the sidecar reports itself unhealthy (health NOT_SERVING, Stat.degraded, a metric): a fixed set.
DEGRADED_REASONS = ("wal_failed", "flusher_dead", "flusher_stalled", "storage_refusing")
INGEST_QUIET_S = 0.2  # seconds without a new message that count as a pause in ingest
DEFER_MAX_INTERVALS = 5  # shards of a WAL sidecar wait for a pause at most this many flush intervals
# A WAL sidecar holds (reads without copying, until the shard is committed) at most this share of a
# writer's staging pool: the rest stays free for the writer's forwards in flight.
SHM_HOLD_FRACTION = 0.5
# Memory one open Write stream costs the sidecar besides its messages, counted against the budget
# while the stream is open: gRPC's HTTP/2 receive window (64 KiB without BDP probing) and buffers,
# and its three threads' stacks. Measured: 300 idle streams +19 MiB RSS (~64 KiB each); under a flood
# the windows fill and the threads run, so twice that and some.
STREAM_BYTES = 192 << 10


class SequenceError(TraceStoreError, ValueError):
    """A writer message out of order: a gap in the sequence, or an epoch older than the session's."""


class OverBudgetError(TraceStoreError, MemoryError):
    """The memory budget stayed full for the backpressure timeout; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DrainingError(TraceStoreError, RuntimeError):
    """The server is shutting down and accepts no new writes."""


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


class Engine:
    """Ingest state of one sidecar. ``store`` follows the tracestore.storage.store.Store contract."""

    def __init__(self, config: ServerConfig, store: Any, metrics: Metrics) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # budget freed / flush finished
        self.writers: dict[tuple[str, str], WriterState] = {}
        self.runs: dict[str, RunSpec] = {}
        self._dedupe = DedupeIndex(config.dedupe_versions)
        self.in_use = 0
        self.shm_in_use = 0  # bytes of writers' staging named by messages not yet released
        self._held_bytes: dict[str, int] = {}  # per pool: staging held past durability (WAL mode)
        self._in_flight: set[int] = set()  # id() of messages whose shard the flusher is writing now
        self._reserved = 0  # bytes streams reserved for messages they are reading
        self._acks: deque[tuple[int, WriterState, Message]] = deque()  # WAL ticket, writer, message
        self._seg_outstanding: dict[int, int] = {}
        self._force = 0  # flush requests outstanding
        self._draining = False
        self._stopped = False
        self._last_ingest = 0.0  # when submit last admitted a message
        self._done_ticket = 0  # WAL ticket of the newest DONE entry: segments go only once it is durable
        self._done_backlog: list[bytes] = []  # DONE entries a failed WAL refused: re-appended on recovery
        self._redo: list[tuple[WriterState, Message]] = []  # not durable at a WAL failure, not re-appended yet
        self._wal_retry_at = 0.0
        self.shards_committed = 0
        self.wal: WriteAheadLog | None = None
        self._flusher = Flusher(self, store, metrics)
        self.parse_wal_data: Callable[[bytes], Message] | None = None
        metrics.memory_budget.set(config.memory_budget_bytes)
        metrics.backlog_oldest_age.set_function(self.backlog_oldest_age)
        # Encoding a shard briefly needs about twice its size again (Arrow columns + Parquet
        # output): capping shards at a quarter of the budget keeps that transient inside
        # budget + 64 MiB (measured in tests/server/test_memory_bound.py).
        self.shard_bytes = max(1, min(config.shard_target_bytes, config.memory_budget_bytes // 4))

    # -- runs -------------------------------------------------------------------------------------

    def declare_run(self, spec: RunSpec) -> None:
        """Create the run on storage, or check that the stored one is identical."""
        with self._lock:
            known = self.runs.get(spec.run)
        if known is not None:
            if known != spec:
                raise ConflictError(f"run {spec.run} is already declared with different sites; runs are immutable")
            return
        self._check_run_limit(spec.run)
        self.store.put_run(spec)
        with self._lock:
            self.runs[spec.run] = spec

    def _check_run_limit(self, run: str) -> None:
        with self._lock:
            if run not in self.runs and len(self.runs) >= self.config.max_runs:
                raise LimitError(
                    f"this sidecar already serves {len(self.runs)} runs (max_runs); run {run} is refused: "
                    "start a sidecar per run group, or raise --max-runs"
                )

    def run_spec(self, run: str) -> RunSpec:
        with self._lock:
            spec = self.runs.get(run)
        if spec is None:
            self._check_run_limit(run)
            spec = self.store.get_run(run)  # NotFoundError when never declared
            with self._lock:
                self.runs[run] = spec
        return spec

    # -- start / replay ---------------------------------------------------------------------------

    def start(self, parse_wal_data: Callable[[bytes], Message]) -> int:
        """Replay the WAL (if any) and start the flusher; returns the number of messages replayed."""
        self.parse_wal_data = parse_wal_data
        replayed = 0
        if self.config.wal_dir is not None:
            self.wal = WriteAheadLog(
                self.config.wal_dir,
                segment_bytes=self.config.wal_segment_bytes,
                on_synced=self._on_synced,
                segment_header=self._snapshot,
            )
            for segment, kind, payload in self.wal.replay():
                replayed += self._replay_entry(segment, kind, payload)
            self.wal.start()
            self._retire_segments()
            self.metrics.wal_bytes.set(self.wal.nbytes)
        self._update_gauges()
        self._flusher.start()
        if replayed:
            log.info("replayed %d messages from the write-ahead log", replayed)
        return replayed

    def _snapshot(self) -> list[tuple[int, bytes]]:
        sessions = [
            Session(w.run, w.writer, w.epoch, w.received_seq, w.shard_next, w.owner) for w in self.writers.values()
        ]
        return [(STATE, encode_state(sessions))]

    def _state(self, run: str, writer: str) -> WriterState:
        key = (run, writer)
        st = self.writers.get(key)
        if st is None:
            # Shard numbers start at the current microsecond so that a writer whose WAL state was
            # lost (or a server without a WAL) never reuses the number of a committed shard.
            st = self.writers[key] = WriterState(run, writer, shard_next=time.time_ns() // 1000)
        return st

    def _replay_entry(self, segment: int, kind: int, payload: bytes) -> int:
        if kind == STATE:
            for session in decode_state(payload):
                st = self._state(session.run, session.writer)
                st.owner = st.owner or session.owner
                if (session.epoch, session.seq) > (st.epoch, st.received_seq):
                    st.epoch, st.received_seq = session.epoch, session.seq
                    st.durable_seq = st.committed_seq = session.seq
                st.shard_next = max(st.shard_next, session.shard_next)
            return 0
        if kind == DATA:
            assert self.parse_wal_data is not None
            msg = self.parse_wal_data(payload)
            known = (msg.run, msg.writer) in self.writers
            st = self._state(msg.run, msg.writer)
            if (msg.epoch, msg.seq) <= (st.epoch, st.received_seq):
                return 0  # covered by a state snapshot (already committed)
            if known and msg.seq != (st.received_seq + 1 if msg.epoch == st.epoch else 1):
                raise CorruptionError(
                    f"write-ahead log segment {segment}: writer {msg.writer} of run {msg.run} jumps from "
                    f"(epoch {st.epoch}, sequence {st.received_seq}) to (epoch {msg.epoch}, sequence {msg.seq}): "
                    "acknowledged messages between them are missing from the log; the sidecar will not start"
                )
            msg.segment = segment
            # Chunks dropped as identical resends when this message was accepted are in the raw
            # request again: drop them again, or the flush would store them twice.
            with contextlib.suppress(ConflictError):
                self._dedupe.check(msg)
            self._remember(msg, st.owner)
            st.epoch, st.received_seq, st.durable_seq = msg.epoch, msg.seq, msg.seq
            self._enqueue(st, msg)
            return 1
        entry = decode_entry(kind, payload)
        if entry is None:
            return 0
        st = self._state(entry.run, entry.writer)
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
        """Room for a message a stream is about to read (``estimate`` bytes), so a stream waits for
        room *before* taking a message off the wire: waiting streams then hold nothing but their
        HTTP/2 window, and memory stays within the budget however many streams there are.
        Returns the bytes reserved (pass them to :meth:`submit`); raises OverBudgetError."""
        budget = self.config.memory_budget_bytes
        estimate = max(1, min(estimate, budget))
        deadline = time.monotonic() + self.config.backpressure_timeout_s
        with self._lock:
            waited = False
            while self.in_use + self._reserved + estimate > budget and (self.in_use + self._reserved) > 0:
                if self._draining:
                    raise DrainingError("the sidecar is shutting down; reconnect to its replacement and resend")
                self._await_room(deadline, first=not waited, detail="slow down and resend")
                waited = True
            self._reserved += estimate
            return estimate

    def reserve_stream(self) -> int:
        """Room for one more open Write stream's own memory (:data:`STREAM_BYTES`: its HTTP/2 window
        and its threads), held until the stream ends (:meth:`unreserve`); LimitError at once when the
        budget cannot hold it beside what it holds now. Without this, 300 streams flooding a 64 MiB
        budget grew the sidecar by up to 144 MiB: budget + their windows and threads."""
        with self._lock:
            if self.in_use + self._reserved + STREAM_BYTES > self.config.memory_budget_bytes:
                raise LimitError(
                    f"the memory budget ({self.config.memory_budget_bytes} bytes) cannot hold another Write "
                    f"stream ({STREAM_BYTES} bytes of buffers and threads) beside the {self.in_use} bytes of "
                    f"records and {self._reserved} bytes reserved now; retry later or raise --memory-budget-mib"
                )
            self._reserved += STREAM_BYTES
            return STREAM_BYTES

    def _await_room(self, deadline: float, *, first: bool, detail: str) -> None:
        """With ``self._lock`` held and no room: count the backpressure once per message, ask the
        flusher to commit now, and wait for room until ``deadline`` (then OverBudgetError)."""
        if first:
            self.metrics.backpressure.inc()
        self._force = max(self._force, 1)
        self._flusher.kick()
        left = deadline - time.monotonic()
        if left <= 0:
            raise OverBudgetError(
                f"memory budget of {self.config.memory_budget_bytes} bytes is full "
                f"({self.in_use} held, storage is behind); {detail}",
                retry_after_s=min(5.0, self.config.flush_interval_s),
            )
        self._room.wait(left)

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes
            self._room.notify_all()

    def _hold(self, st: WriterState, msg: Message, pool: str, capacity: int) -> None:
        """Admit ``msg``'s shared-memory payload into pool ``pool`` (``capacity`` bytes) as held past
        durability, under :data:`SHM_HOLD_FRACTION` of the pool: the oldest held messages are
        copied out first if need be (:meth:`_make_room`), and ``msg`` itself only if that did not
        make room; lock held."""
        limit = capacity * SHM_HOLD_FRACTION - msg.shm_bytes
        if self._held_bytes.get(pool, 0) > limit:
            self._make_room(pool, limit)
        if self._held_bytes.get(pool, 0) > limit:
            msg.own_shm()
            return
        self._held_bytes[pool] = self._held_bytes.get(pool, 0) + msg.shm_bytes
        msg.held_pool = pool
        st.held[msg.seq] = msg

    def _make_room(self, pool: str, limit: float) -> None:
        """Copy held messages of ``pool`` out of it, oldest first, until at most ``limit`` bytes of
        it are held; their regions are released with the next response. The oldest go first
        because the writer's staging is a ring that frees from its oldest region: a held message
        whose shard waits (ingest still going on, storage down) would otherwise stop the ring
        even with most of it free. Messages whose shard is being written right now are left
        (their commit releases them). Copies with the lock held: only while a writer's shards lag
        half its pool behind its ingest."""
        held = [m for st in self.writers.values() for m in st.held.values() if m.held_pool == pool]
        held.sort(key=lambda m: m.received)
        for m in held:
            if self._held_bytes.get(pool, 0) <= limit:
                break
            if id(m) in self._in_flight:
                continue
            m.own_shm()
            st = self.writers[(m.run, m.writer)]
            self._release_held(st, m)
            self._notify(st)

    def _unhold(self, pool: str, nbytes: int) -> None:
        left = self._held_bytes.get(pool, 0) - nbytes
        if left > 0:
            self._held_bytes[pool] = left
        else:
            self._held_bytes.pop(pool, None)

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
        (:meth:`_hold`). Without ``hold`` the caller has made the payload its own (or has no WAL).
        ``identity``: the authenticated caller (None with authentication off). A writer id belongs
        to the identity that first used it, and a trajectory to the identity that first wrote it:
        another identity can neither fence that writer (new epochs, huge epochs) nor write the
        trajectory's records, seals or links, nor link a trajectory of its own to it
        (:class:`PermissionDeniedError`)."""
        # The caller's reservation stays this message's room while it waits for admission (given
        # back first, the message sat in memory uncounted while it waited), and becomes its share
        # of ``in_use`` when it is admitted.
        try:
            return self._submit(msg, wal_parts, reserved, hold, identity)
        finally:
            if msg.reservation_held:
                self.unreserve(msg.reservation_held)
                msg.reservation_held = 0

    def _submit(
        self, msg: Message, wal_parts: Sequence[Part], held: int, hold: tuple[str, int] | None, identity: str | None
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
                    raise DrainingError("the sidecar is shutting down; reconnect to its replacement and resend")
                if (msg.run, msg.writer) not in self.writers and len(self.writers) >= self.config.max_writers:
                    raise LimitError(
                        f"this sidecar already tracks {len(self.writers)} writers (max_writers); writer "
                        f"{msg.writer} of run {msg.run} is refused: use fewer writer ids, or raise --max-writers"
                    )
                st = self._state(msg.run, msg.writer)
                if identity is not None:
                    self._check_owner(st, msg, identity)
                dup = self._check_sequence(st, msg)
                if dup:
                    self.metrics.ingest_duplicates.inc()
                    return st, True
                others = self._reserved - held
                if self.in_use + others + msg.nbytes <= self.config.memory_budget_bytes or self.in_use + others == 0:
                    break
                self._await_room(deadline, first=not waited, detail="nothing of this message was accepted")
                waited = True
            self._dedupe.check(msg)
            claim = identity if st.owner is None else None
            if self.wal is not None:
                if claim is not None:  # the claim is durable no later than the message that makes it
                    self.wal.append(OWNER, [encode_entry(Owner(st.run, st.writer, claim))])
                segment, ticket = self.wal.append(DATA, wal_parts)
                msg.segment, msg.ticket, msg.wal_parts = segment, ticket, wal_parts
                self._acks.append((ticket, st, msg))
                self.metrics.wal_bytes.set(self.wal.nbytes)
            if claim:
                st.owner = identity
            self._remember(msg, identity)
            if msg.shm_bytes:
                self.shm_in_use += msg.shm_bytes
                self.metrics.shm_in_use.set(self.shm_in_use)
            if msg.epoch != st.epoch:
                while any(id(m) in self._in_flight for m in st.held.values()):
                    self._room.wait(0.1)  # their commit releases them (a shard write in progress)
                self._own_held(st)
                st.epoch, st.durable_seq, st.committed_seq = msg.epoch, 0, 0
            if hold is not None and self.wal is not None and msg.shm_chunks:
                self._hold(st, msg, *hold)
            st.received_seq = msg.seq
            self._reserved -= held  # counted in in_use from here on
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

    def _check_owner(self, st: WriterState, msg: Message, identity: str) -> None:
        """Lock held: ``identity`` may send this message (see :meth:`submit`)."""
        if st.owner is not None and st.owner != identity:
            raise PermissionDeniedError(
                f"writer {msg.writer} of run {msg.run} belongs to another identity; use a writer id of your own"
            )
        self._dedupe.check_owner(msg, identity)

    def _check_sequence(self, st: WriterState, msg: Message) -> bool:
        if msg.epoch < st.epoch:
            raise SequenceError(
                f"writer {msg.writer} of run {msg.run}: epoch {msg.epoch} is older than the session's epoch "
                f"{st.epoch} (a newer instance took over this writer id); start a new epoch"
            )
        if msg.epoch > st.epoch:
            if msg.seq != 1:
                raise SequenceError(
                    f"writer {msg.writer} of run {msg.run}: a new epoch {msg.epoch} must start at sequence 1, "
                    f"got {msg.seq}"
                )
            return False
        if msg.seq <= st.received_seq:
            return True
        if msg.seq != st.received_seq + 1:
            raise SequenceError(
                f"writer {msg.writer} of run {msg.run} epoch {msg.epoch}: expected sequence "
                f"{st.received_seq + 1}, got {msg.seq} (a gap: messages were lost; resend from "
                f"{st.received_seq + 1})"
            )
        return False

    def _remember(self, msg: Message, identity: str | None = None) -> None:
        sealed = self._dedupe.remember(msg, identity)
        if sealed:
            self.metrics.sealed_trajectories.inc(sealed)

    def _enqueue(self, st: WriterState, msg: Message) -> None:
        st.pending.append(msg)
        st.pending_bytes += msg.nbytes
        self.in_use += msg.nbytes
        if self.wal is not None:
            self._seg_outstanding[msg.segment] = self._seg_outstanding.get(msg.segment, 0) + 1

    def _update_gauges(self) -> None:
        self.metrics.memory_in_use.set(self.in_use)
        self.metrics.backlog_bytes.set(self.in_use)
        self.metrics.open_trajectories.set(self._dedupe.open_trajectories)

    def backlog_oldest_age(self) -> float:
        """Seconds the oldest uncommitted message has waited. Evaluated at every scrape (no lock: a
        snapshot of the writers), so it keeps growing while the flusher is stuck in a storage
        outage; refreshed only on ingest and commit it froze there and TraceStoreBacklogAgeHigh
        never fired."""
        oldest = None
        for w in list(self.writers.values()):
            try:
                t = w.pending[0].received
            except IndexError:
                continue
            oldest = t if oldest is None else min(oldest, t)
        return 0.0 if oldest is None else max(0.0, time.monotonic() - oldest)

    # -- durability -------------------------------------------------------------------------------

    def _on_synced(self, ticket: int) -> None:
        now = time.monotonic()
        with self._lock:
            touched: set[int] = set()
            while self._acks and self._acks[0][0] <= ticket:
                _, st, msg = self._acks.popleft()
                msg.wal_parts = None
                if msg.epoch == st.epoch and msg.seq > st.durable_seq:
                    st.durable_seq = msg.seq
                self._shm_durable(msg)
                self.metrics.durable_ack_latency.observe(now - msg.received)
                if id(st) not in touched:
                    touched.add(id(st))
                    self._notify(st)

    def _shm_durable(self, msg: Message) -> None:
        """``msg`` is durable: unless it is held, the writer may now release the staging it named
        (its ack is on its way); lock held."""
        if msg.shm_bytes and msg.held_pool is None:
            self.shm_in_use -= msg.shm_bytes
            msg.shm_bytes = 0
            self.metrics.shm_in_use.set(self.shm_in_use)

    def _release_held(self, st: WriterState, msg: Message) -> None:
        """The sidecar reads no more of the staging a held ``msg`` names; lock held."""
        if msg.held_pool is None:
            return
        self._unhold(msg.held_pool, msg.shm_bytes)
        if st.held.get(msg.seq) is msg:
            del st.held[msg.seq]
        msg.held_pool = None
        self._shm_durable(msg)

    def _own_held(self, st: WriterState) -> None:
        """A new epoch of ``st`` begins: copy the payloads its older epoch's messages still hold
        out of the writer's pool (the writer releases those regions at its new epoch's first ack,
        since the sequence numbers it gets then are no longer theirs); lock held. Rare: a writer
        starts a new epoch after a refused gap or when it restarts."""
        for msg in list(st.held.values()):
            msg.own_shm()
            self._release_held(st, msg)

    def _notify(self, st: WriterState) -> None:
        for waker in list(st.listeners):
            waker.wake()

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
            released = st.durable_seq
            if st.held:
                released = min(released, next(iter(st.held)) - 1)  # held is in sequence order
            return st.epoch, st.durable_seq, st.received_seq, released

    # -- flushing ---------------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Commit everything accepted so far to storage; True when done within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            target = {k: w.received_seq for k, w in self.writers.items() if w.pending}
            self._force += 1
            self._flusher.kick()
            try:
                while any(self.writers[k].pending and self.writers[k].pending[0].seq <= s for k, s in target.items()):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._room.wait(left if left is None else min(left, 0.5))
                return True
            finally:
                self._force -= 1

    def _due(self, st: WriterState, now: float) -> bool:
        if not st.pending:
            return False
        if self._force or self._draining:
            return True
        if self.in_use * 2 >= self.config.memory_budget_bytes:
            return True
        if self._ingesting(st, now):
            return False
        if st.pending_bytes >= self.shard_bytes:
            return True
        interval = self.config.flush_interval_s
        return now - st.pending[0].received >= interval

    def _ingesting(self, st: WriterState, now: float) -> bool:
        """With a WAL, acknowledgements do not wait for shards: while messages keep arriving (the
        last one less than INGEST_QUIET_S ago) and the backlog is under half the budget, the shard
        encoding waits for a pause instead of taking CPU from the ingest path (on the 2-core bench
        box it ran beside it and took a third of the durable ingest rate). Bounded lateness: a
        backlog older than DEFER_MAX_INTERVALS flush intervals is written regardless."""
        if self.wal is None or now - self._last_ingest >= INGEST_QUIET_S:
            return False
        return now - st.pending[0].received < DEFER_MAX_INTERVALS * self.config.flush_interval_s

    # -- the flusher's side (FlushSource) ----------------------------------------------------------

    def next_round(self) -> Round | None:
        """The shards the flusher commits next, each planned in the WAL; their messages count as in
        flight until :meth:`round_finished`. Recovers a failed WAL first (on the flusher thread,
        so no commit is in flight). None once the engine is stopped."""
        with self._lock:
            if self._stopped:
                return None
            if self.wal is not None and self.wal.error is not None:
                return self._recover_wal()
            now = time.monotonic()
            due = [w for w in self.writers.values() if self._due(w, now)]
            if not due:
                return Round(wait_s=min(0.05, self.config.flush_interval_s / 4))
            batches = []
            try:
                for w in due:
                    batches.append(self._plan(w))
            except TraceStoreError as exc:  # the WAL refused a PLAN entry: commit what was planned
                if self._stopped:
                    return None
                log.warning("could not plan a shard (%s); the write-ahead log recovers first", exc)
            if not batches:
                return Round(back_off=True)
            plan_ticket = max(m.plan_ticket for b in batches for m in b.messages)
            self._in_flight = {id(m) for b in batches for m in b.messages}
            return Round(batches, plan_ticket)

    def wait_planned(self, ticket: int, timeout: float) -> bool:
        assert self.wal is not None  # (only a WAL gives PLAN tickets)
        return self.wal.wait_synced(ticket, timeout=timeout)

    def round_finished(self) -> None:
        with self._lock:  # (_make_room may copy out held messages of a failed shard meanwhile)
            self._in_flight = set()
            self._room.notify_all()

    def committed(self, batch: Batch) -> None:
        """``batch`` is in storage: log DONE, release its memory and held staging, and move its
        writer's committed (without a WAL: durable) sequence."""
        group = batch.messages
        with self._lock:
            st = self.writers[(batch.run, batch.writer)]
            if self.wal is not None:
                done = encode_entry(Done(st.run, st.writer, batch.shard))
                try:
                    _, self._done_ticket = self.wal.append(DONE, [done])
                except TraceStoreError:
                    # The WAL failed: keep the DONE for its recovery. Until then no segment is
                    # retired (a replay without it would rebuild the shard from a partial group).
                    self._done_backlog.append(done)
                else:
                    faults.point("commit.done_appended")
            self._release(st, group)
            held = False
            for m in group:
                held = held or m.held_pool is not None
                self._release_held(st, m)
                self._shm_durable(m)
            if held:
                self._notify(st)  # released_sequence moved
            self.shards_committed += 1
            last = group[-1]
            if last.epoch == st.epoch:
                st.committed_seq = max(st.committed_seq, last.seq)
                if self.wal is None and last.seq > st.durable_seq:
                    st.durable_seq = last.seq
                    for m in group:
                        self.metrics.durable_ack_latency.observe(time.monotonic() - m.received)
                    self._notify(st)
            self._retire_segments()
            self._update_gauges()
            self._room.notify_all()

    def _plan(self, st: WriterState) -> Batch:
        """The next group of ``st``'s messages to commit as one shard, planned in the WAL (lock held).
        Raises StorageError (nothing planned) when the WAL refuses the PLAN entry."""
        first = st.pending[0]
        if first.shard_seq is not None:  # planned before a crash: repeat exactly that group
            return Batch(st.run, st.writer, first.shard_seq, [m for m in st.pending if m.shard_seq == first.shard_seq])
        group: list[Message] = []
        size = 0
        for m in st.pending:
            if m.shard_seq is not None or (group and size + m.nbytes > self.shard_bytes):
                break
            group.append(m)
            size += m.nbytes
        shard = st.shard_next
        ticket = 0
        if self.wal is not None:
            plan = Plan(st.run, st.writer, shard, [(m.epoch, m.seq) for m in group])
            _, ticket = self.wal.append(PLAN, [encode_entry(plan)])
            faults.point("commit.planned")
        st.shard_next += 1
        for m in group:
            m.shard_seq, m.plan_ticket = shard, ticket
        return Batch(st.run, st.writer, shard, group)

    def _recover_wal(self) -> Round:
        """With the lock held, on the flusher thread (so no commit is in flight): bring a failed WAL
        back once the device takes writes again — cut back to what is durable, then re-append, in
        their order, the DONE entries it refused and every message not durable yet, under a header
        whose writer sessions end just before those messages (replay would otherwise skip them as
        already committed). Plans that were not durable are dropped (their groups are re-planned).
        Returns a round without shards: go on once recovered, back off while the device still
        refuses (retried every ``wal_retry_s``)."""
        assert self.wal is not None
        now = time.monotonic()
        if now < self._wal_retry_at:
            return Round(wait_s=min(0.25, self._wal_retry_at - now))
        self._wal_retry_at = now + self.config.wal_retry_s
        durable = self.wal.synced_ticket
        # (a recovery that failed half-way left some messages re-appended, the rest in _redo)
        redo = self._redo = [(st, m) for t, st, m in self._acks if t > durable] + self._redo
        self._acks = deque(x for x in self._acks if x[0] <= durable)
        first: dict[int, Message] = {}
        for st, m in redo:
            first.setdefault(id(st), m)
        sessions = []
        for w in self.writers.values():
            f = first.get(id(w))
            epoch, seq = (f.epoch, f.seq - 1) if f is not None else (w.epoch, w.received_seq)
            sessions.append(Session(w.run, w.writer, epoch, seq, w.shard_next, w.owner))
        try:
            self.wal.recover([(STATE, encode_state(sessions))])
            while self._done_backlog:
                _, self._done_ticket = self.wal.append(DONE, [self._done_backlog[0]])
                del self._done_backlog[0]
            n_redo = len(redo)
            while self._redo:
                st, m = self._redo[0]
                assert m.wal_parts is not None
                segment, ticket = self.wal.append(DATA, m.wal_parts)
                self._seg_outstanding[m.segment] -= 1
                m.segment, m.ticket = segment, ticket
                self._seg_outstanding[segment] = self._seg_outstanding.get(segment, 0) + 1
                self._acks.append((ticket, st, m))
                del self._redo[0]
        except TraceStoreError as exc:
            log.warning("write-ahead log still failing (%s); retrying in %.1f s", exc, self.config.wal_retry_s)
            return Round(back_off=True)
        for w in self.writers.values():
            for m in w.pending:
                if m.shard_seq is not None and m.plan_ticket > durable:
                    m.shard_seq = None  # its PLAN never became durable: plan it again
        log.warning("write-ahead log recovered: re-appended %d messages not durable at the failure", n_redo)
        self._retire_segments()
        return Round()

    def _release(self, st: WriterState, group: list[Message]) -> None:
        ids = {id(m) for m in group}
        st.pending = deque(m for m in st.pending if id(m) not in ids)
        for m in group:
            st.pending_bytes -= m.nbytes
            self.in_use -= m.nbytes
            if self.wal is not None:
                self._seg_outstanding[m.segment] -= 1

    def _retire_segments(self) -> None:
        """Delete WAL segments whose every message is committed — once the DONE entries saying so
        are durable (a crash before that replays the PLANs, and a PLAN whose messages were partly
        deleted would rebuild a different shard under a committed shard's number: the sidecar
        wedged on that conflict for good)."""
        if self.wal is None or self._done_backlog:
            return
        live = [s for s, n in self._seg_outstanding.items() if n > 0]
        keep_from = min(live, default=self.wal.active_index)
        for s in [s for s in self._seg_outstanding if s < keep_from]:
            del self._seg_outstanding[s]
        self.wal.delete_before(keep_from, after=self._done_ticket)
        self.metrics.wal_bytes.set(self.wal.nbytes)

    def degraded(self) -> list[str]:
        """Why this sidecar cannot do its job right now (empty: healthy), from DEGRADED_REASONS:
        the WAL failed (writes are refused until it recovers), the flusher thread died or is stuck
        in one commit for longer than ``storage_unhealthy_s``, or storage has refused every commit
        for that long."""
        reasons = []
        if self.wal is not None and self.wal.error is not None:
            reasons.append("wal_failed")
        return reasons + self._flusher.health(self.config.storage_unhealthy_s)

    # -- stop -------------------------------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        """Refuse new writes, then commit what is pending within ``timeout`` (the WAL keeps the rest)."""
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
        stuck = not self._flusher.stop(timeout)
        if stuck:
            log.warning("a shard write is still in progress at shutdown; the write-ahead log keeps its records")
        if self.wal is not None:
            with self._lock:
                if not stuck and not any(w.pending for w in self.writers.values()):
                    # Everything is committed: keep only a fresh segment holding the writer
                    # sessions (so resends after the restart are still recognised).
                    self._seg_outstanding.clear()
                    self.wal.delete_before(self.wal.rotate())
            self.wal.close()

    def stat(self, run: str = "") -> dict[str, Any]:
        with self._lock:
            writers = [
                dict(
                    run=w.run,
                    writer=w.writer,
                    epoch=w.epoch,
                    received_sequence=w.received_seq,
                    durable_sequence=w.durable_seq,
                    committed_sequence=w.committed_seq,
                )
                for w in self.writers.values()
                if not run or w.run == run
            ]
            return dict(
                draining=self._draining,
                backlog_bytes=self.in_use,
                memory_in_use_bytes=self.in_use,
                memory_budget_bytes=self.config.memory_budget_bytes,
                wal_bytes=0 if self.wal is None else self.wal.nbytes,
                open_trajectories=self._dedupe.open_trajectories,
                shards_committed=self.shards_committed,
                writers=writers,
            )
