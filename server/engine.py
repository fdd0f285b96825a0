"""The sidecar's ingest engine: writer sessions, deduplication, the WAL, the memory budget and the flusher.

No gRPC here (the service in ``service.py`` parses requests and maps errors to status codes).

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

import bisect
import contextlib
import dataclasses
import json
import logging
import struct
import threading
import time
import traceback
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
    ValidationError,
)
from tracestore.records import PrefixLink, RecordChunk, RunSpec, TrajectorySeal

from .config import ServerConfig
from .metrics import Metrics
from .wal import Checked, Part, WriteAheadLog

log = logging.getLogger("tracestore.server")

# WAL entry types
DATA, STATE, PLAN, DONE, OWNER = 1, 2, 3, 4, 5
# Why the sidecar reports itself unhealthy (health NOT_SERVING, Stat.degraded, a metric): a fixed set.
DEGRADED_REASONS = ("wal_failed", "flusher_dead", "flusher_stalled", "storage_refusing")
INGEST_QUIET_S = 0.2  # seconds without a new message that count as a pause in ingest
DEFER_MAX_INTERVALS = 5  # shards of a WAL sidecar wait for a pause at most this many flush intervals
# A WAL sidecar holds (reads without copying, until the shard is committed) at most this share of a
# writer's staging pool: the rest stays free for the writer's forwards in flight.
SHM_HOLD_FRACTION = 0.5
_LEN = struct.Struct("<I")
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


class Waker:
    """A condition with a sticky flag: a ``wake()`` before ``wait()`` is never lost."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._dirty = False

    def wake(self) -> None:
        with self.cond:
            self._dirty = True
            self.cond.notify_all()

    def wait(self, timeout: float) -> None:
        with self.cond:
            if not self._dirty:
                self.cond.wait(timeout)
            self._dirty = False


@dataclasses.dataclass
class Message:
    """One numbered writer message, parsed and validated."""

    run: str
    writer: str
    epoch: int
    seq: int
    chunks: list[RecordChunk]
    seals: list[TrajectorySeal]
    links: list[PrefixLink]
    nbytes: int
    crcs: list[int]  # RecordChunk.checksum of each chunk (computed once, at parse time)
    received: float = dataclasses.field(default_factory=time.monotonic)
    segment: int = 0
    shard_seq: int | None = None
    path: str = "grpc"
    shm_bytes: int = 0  # writer shared-memory staging referenced, held by the writer until released
    shm_chunks: list[int] = dataclasses.field(default_factory=list)  # chunks that are views into the pool
    held_pool: str | None = None  # held past durability (WAL, keeps_staging): released at commit
    # The WAL entry's parts while it is not durable (the raw request, which the chunks view anyway,
    # and shared-memory payloads the writer keeps until the ack): re-appended if the WAL fails first.
    wal_parts: Sequence[Part] | None = None
    ticket: int = 0  # WAL ticket of the DATA entry
    plan_ticket: int = 0  # WAL ticket of the PLAN entry that gave it ``shard_seq``
    reservation_held: int = 0  # budget its stream reserved for it, held until it is admitted

    def own_shm(self) -> None:
        """Replace the payload views this message holds into a writer's shared-memory pool by
        private copies, so that the writer may reuse those regions (same bytes and checksums)."""
        for i in self.shm_chunks:
            c = self.chunks[i]
            object.__setattr__(c, "codes", c.codes.copy())  # frozen dataclass; same bytes, own memory
            object.__setattr__(c, "scales", c.scales.copy())
            if c.token_scales is not None:
                object.__setattr__(c, "token_scales", c.token_scales.copy())
        self.shm_chunks = []


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
        self._kick = threading.Condition(self._lock)  # flusher wake-up
        self.writers: dict[tuple[str, str], WriterState] = {}
        self.runs: dict[str, RunSpec] = {}
        # (run, version, trajectory, site) -> sorted [(start, end, checksum)] of chunks seen
        self._index: dict[tuple[str, int, str, str], list[tuple[int, int, int]]] = {}
        self._seals: dict[tuple[str, int, str], tuple[int, tuple[str, ...]]] = {}
        self._links: dict[tuple[str, int, str], tuple[str, int]] = {}
        self._open: set[tuple[str, str]] = set()  # (run, trajectory) with records and no seal
        self._sealed: set[tuple[str, str]] = set()
        self.in_use = 0
        self.shm_in_use = 0  # bytes of writers' staging named by messages not yet released
        self._held_bytes: dict[str, int] = {}  # per pool: staging held past durability (WAL mode)
        self._in_flight: set[int] = set()  # id() of messages whose shard the flusher is writing now
        self._reserved = 0  # bytes streams reserved for messages they are reading
        self._acks: deque[tuple[int, WriterState, Message]] = deque()  # WAL ticket, writer, message
        self._seg_outstanding: dict[int, int] = {}
        self._force = 0  # flush requests outstanding
        self._flush_generation = 0
        self._draining = False
        self._stopped = False
        self._last_ingest = 0.0  # when submit last admitted a message
        self._plan_ticket = 0  # WAL ticket of the newest PLAN entry
        self._done_ticket = 0  # WAL ticket of the newest DONE entry: segments go only once it is durable
        self._done_backlog: list[bytes] = []  # DONE entries a failed WAL refused: re-appended on recovery
        self._redo: list[tuple[WriterState, Message]] = []  # not durable at a WAL failure, not re-appended yet
        self._wal_retry_at = 0.0
        self._flush_busy_since: float | None = None  # when the flusher's current commit began
        self._refusing_since: float | None = None  # first failed commit since the last good one
        self._versions: dict[str, list[int]] = {}  # per run: distinct policy versions with dedupe state
        # (run, version, trajectory) -> identity whose writer first wrote it (with authentication on)
        self._traj_owner: dict[tuple[str, int, str], str] = {}
        self.shards_committed = 0
        self.wal: WriteAheadLog | None = None
        self._flusher: threading.Thread | None = None
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
        self._flusher = threading.Thread(target=self._flush_loop, name="tracestore-flusher", daemon=True)
        self._flusher.start()
        if replayed:
            log.info("replayed %d messages from the write-ahead log", replayed)
        return replayed

    def _snapshot(self) -> list[tuple[int, bytes]]:
        states = [[w.run, w.writer, w.epoch, w.received_seq, w.shard_next, w.owner] for w in self.writers.values()]
        return [(STATE, json.dumps({"writers": states}).encode())]

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
            for run, writer, epoch, seq, shard_next, *owner in json.loads(payload)["writers"]:
                st = self._state(run, writer)
                st.owner = st.owner or (owner[0] if owner else None)
                if (epoch, seq) > (st.epoch, st.received_seq):
                    st.epoch, st.received_seq = epoch, seq
                    st.durable_seq = st.committed_seq = seq
                st.shard_next = max(st.shard_next, shard_next)
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
                self._check_conflicts(msg)
            self._remember(msg, st.owner)
            st.epoch, st.received_seq, st.durable_seq = msg.epoch, msg.seq, msg.seq
            self._enqueue(st, msg)
            return 1
        info = json.loads(payload)
        st = self._state(info["run"], info["writer"])
        if kind == OWNER:
            st.owner = info["identity"]
            return 0
        if kind == PLAN:
            ids = {tuple(x) for x in info["messages"]}
            for m in st.pending:
                if (m.epoch, m.seq) in ids:
                    m.shard_seq = info["shard"]
            st.shard_next = max(st.shard_next, info["shard"] + 1)
        elif kind == DONE:
            done = [m for m in st.pending if m.shard_seq == info["shard"]]
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
        self._kick.notify_all()
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
            self._check_conflicts(msg)
            claim = identity is not None and st.owner is None
            if self.wal is not None:
                if claim:  # the claim is durable no later than the message that makes it
                    info = {"run": st.run, "writer": st.writer, "identity": identity}
                    self.wal.append(OWNER, [json.dumps(info).encode()])
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
                self._kick.notify_all()
            return st, False

    def _check_owner(self, st: WriterState, msg: Message, identity: str) -> None:
        """Lock held: ``identity`` may send this message (see :meth:`submit`)."""
        if st.owner is not None and st.owner != identity:
            raise PermissionDeniedError(
                f"writer {msg.writer} of run {msg.run} belongs to another identity; use a writer id of your own"
            )
        targets = [(c.run, c.policy_version, c.trajectory) for c in msg.chunks]
        targets += [(s.run, s.policy_version, s.trajectory) for s in msg.seals]
        targets += [(x.run, x.policy_version, x.trajectory) for x in msg.links]
        for key in dict.fromkeys(targets):
            owner = self._traj_owner.get(key)
            if owner is not None and owner != identity:
                raise PermissionDeniedError(
                    f"trajectory {key[2]} v{key[1]} of run {key[0]} was written by another identity; "
                    "its records, seal and links are not yours to write"
                )
        for link in msg.links:
            owner = self._traj_owner.get((link.run, link.policy_version, link.source))
            if owner is not None and owner != identity:
                raise PermissionDeniedError(
                    f"trajectory {link.trajectory} may not link to {link.source} v{link.policy_version}, which "
                    "another identity wrote"
                )

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

    def _check_conflicts(self, msg: Message) -> None:
        fresh: list[RecordChunk] = []
        fresh_crcs: list[int] = []
        batch: dict[tuple[str, int, str, str], list[tuple[int, int, int]]] = {}
        for c, crc in zip(msg.chunks, msg.crcs, strict=True):
            key = (c.run, c.policy_version, c.trajectory, c.site)
            span = (c.token_start, c.token_end, crc)
            same = False
            for spans in (self._index.get(key, []), batch.get(key, [])):
                i = bisect.bisect_left(spans, (c.token_start, -1, -1))
                for s, e, k in spans[max(0, i - 1) : i + 2]:
                    if s < c.token_end and c.token_start < e:
                        if (s, e, k) == span:
                            same = True
                        else:
                            raise ConflictError(
                                f"{c.key_str}: overlaps tokens [{s}, {e}) already written with different bytes; "
                                "a key holds one value (resend identical bytes, or use a new policy version)"
                            )
            if not same:
                bisect.insort(batch.setdefault(key, []), span)
                fresh.append(c)
                fresh_crcs.append(crc)
        for seal in msg.seals:
            prev = self._seals.get((seal.run, seal.policy_version, seal.trajectory))
            if prev is not None and prev != (seal.n_tokens, seal.sites):
                raise ConflictError(
                    f"trajectory {seal.trajectory} v{seal.policy_version} is already sealed with "
                    f"n_tokens={prev[0]} sites={list(prev[1])}, got n_tokens={seal.n_tokens}"
                )
        for link in msg.links:
            prevl = self._links.get((link.run, link.policy_version, link.trajectory))
            if prevl is not None and prevl != (link.source, link.n_tokens):
                raise ConflictError(
                    f"trajectory {link.trajectory} v{link.policy_version} already links to {prevl[0]} "
                    f"for {prevl[1]} tokens, got {link.source} for {link.n_tokens}"
                )
        msg.chunks, msg.crcs = fresh, fresh_crcs  # identical resends of single chunks are dropped here

    def _remember(self, msg: Message, identity: str | None = None) -> None:
        if identity is not None:
            keys = [(c.run, c.policy_version, c.trajectory) for c in msg.chunks]
            keys += [(s.run, s.policy_version, s.trajectory) for s in msg.seals]
            keys += [(x.run, x.policy_version, x.trajectory) for x in msg.links]
            for key in keys:
                self._see_version(key[0], key[1])
                self._traj_owner.setdefault(key, identity)
        for c, crc in zip(msg.chunks, msg.crcs, strict=True):
            self._see_version(c.run, c.policy_version)
            bisect.insort(
                self._index.setdefault((c.run, c.policy_version, c.trajectory, c.site), []),
                (c.token_start, c.token_end, crc),
            )
            if (c.run, c.trajectory) not in self._sealed:
                self._open.add((c.run, c.trajectory))
        for s in msg.seals:
            self._see_version(s.run, s.policy_version)
            self._seals[(s.run, s.policy_version, s.trajectory)] = (s.n_tokens, s.sites)
            if (s.run, s.trajectory) not in self._sealed:
                self._sealed.add((s.run, s.trajectory))
                self.metrics.sealed_trajectories.inc()
            self._open.discard((s.run, s.trajectory))
        for link in msg.links:
            self._see_version(link.run, link.policy_version)
            self._links[(link.run, link.policy_version, link.trajectory)] = (link.source, link.n_tokens)

    def _see_version(self, run: str, version: int) -> None:
        """Keep dedupe/conflict state for the newest ``dedupe_versions`` policy versions of a run only
        (memory stays bounded on a long-running sidecar; older versions are no longer written)."""
        versions = self._versions.setdefault(run, [])
        i = bisect.bisect_left(versions, version)
        if i < len(versions) and versions[i] == version:
            return
        versions.insert(i, version)
        if len(versions) <= self.config.dedupe_versions:
            return
        # Distinct versions, not arithmetic on the newest one: a single message with version 2**62
        # once dropped the state of every real version and let conflicting bytes in.
        del versions[: len(versions) - self.config.dedupe_versions]
        floor = versions[0]
        stores: tuple[dict[Any, Any], ...] = (self._index, self._seals, self._links, self._traj_owner)
        for d in stores:
            for key in [k for k in d if k[0] == run and k[1] < floor]:
                del d[key]
        # trajectories of dropped versions are neither open nor remembered as sealed
        live = {k[2] for k in self._index if k[0] == run} | {k[2] for k in self._seals if k[0] == run}
        self._open = {k for k in self._open if k[0] != run or k[1] in live}
        self._sealed = {k for k in self._sealed if k[0] != run or k[1] in live}

    def _enqueue(self, st: WriterState, msg: Message) -> None:
        st.pending.append(msg)
        st.pending_bytes += msg.nbytes
        self.in_use += msg.nbytes
        if self.wal is not None:
            self._seg_outstanding[msg.segment] = self._seg_outstanding.get(msg.segment, 0) + 1

    def _update_gauges(self) -> None:
        self.metrics.memory_in_use.set(self.in_use)
        self.metrics.backlog_bytes.set(self.in_use)
        self.metrics.open_trajectories.set(len(self._open))

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
            self._kick.notify_all()
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

    def _take(self, st: WriterState) -> list[Message]:
        """The next group of ``st``'s messages to commit as one shard, planned in the WAL (lock held).
        Raises StorageError (nothing planned) when the WAL refuses the PLAN entry."""
        first = st.pending[0]
        if first.shard_seq is not None:  # planned before a crash: repeat exactly that group
            return [m for m in st.pending if m.shard_seq == first.shard_seq]
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
            plan = {"run": st.run, "writer": st.writer, "shard": shard, "messages": [[m.epoch, m.seq] for m in group]}
            _, ticket = self.wal.append(PLAN, [json.dumps(plan).encode()])
            self._plan_ticket = ticket
            faults.point("commit.planned")
        st.shard_next += 1
        for m in group:
            m.shard_seq, m.plan_ticket = shard, ticket
        return group

    def _flush_loop(self) -> None:
        """The flusher thread: commits due shards, recovers a failed WAL, and never dies of an error
        (one it does not expect is logged, counted as a failed commit, and retried with backoff)."""
        backoff = 0.05
        while True:
            try:
                ok = self._flush_once()
            except Exception:  # noqa: BLE001 - the flusher must outlive any one commit
                log.exception("the shard flusher hit an unexpected error; retrying")
                ok = False
                with self._lock:
                    self._refusing_since = self._refusing_since or time.monotonic()
            if ok is None:
                return
            if ok:
                backoff = 0.05
            else:
                self._pause(backoff)
                backoff = min(backoff * 2, 5.0)

    def _flush_once(self) -> bool | None:
        """One round of the flusher: True (progress or nothing due), False (back off), None (stop)."""
        with self._lock:
            if self._stopped:
                return None
            if self.wal is not None and self.wal.error is not None:
                return self._recover_wal()
            now = time.monotonic()
            due = [w for w in self.writers.values() if self._due(w, now)]
            if not due:
                self._kick.wait(min(0.05, self.config.flush_interval_s / 4))
                return True
            groups = []
            try:
                for w in due:
                    groups.append((w, self._take(w)))
            except TraceStoreError as exc:  # the WAL refused a PLAN entry: commit what was planned
                if self._stopped:
                    return None
                log.warning("could not plan a shard (%s); the write-ahead log recovers first", exc)
            if not groups:
                return False
            plan_ticket = max(m.plan_ticket for _, group in groups for m in group)
            self._in_flight = {id(m) for _, group in groups for m in group}
            self._flush_busy_since = time.monotonic()
        # A shard is written only once its PLAN entry is durable: a restart then repeats the
        # same shard number (a no-op), never a second shard of the same chunks. (A SIGKILL
        # between an unsynced PLAN and its shard wrote every chunk twice: test_crash.)
        ok = True
        try:
            if self.wal is not None and plan_ticket and not self.wal.wait_synced(plan_ticket, timeout=30):
                ok = False
            elif self.wal is not None and plan_ticket:
                faults.point("commit.plan_synced")
            for st, group in groups if ok else ():
                ok = self._commit(st, group)
                if not ok:
                    break
        finally:
            with self._lock:  # (_make_room may copy out held messages of a failed shard meanwhile)
                self._in_flight = set()
                self._flush_busy_since = None
                self._room.notify_all()
        return ok

    def _recover_wal(self) -> bool:
        """With the lock held, on the flusher thread (so no commit is in flight): bring a failed WAL
        back once the device takes writes again — cut back to what is durable, then re-append, in
        their order, the DONE entries it refused and every message not durable yet, under a header
        whose writer sessions end just before those messages (replay would otherwise skip them as
        already committed). Plans that were not durable are dropped (their groups are re-planned).
        Returns True once recovered, False while the device still refuses (retried every
        ``wal_retry_s``)."""
        assert self.wal is not None
        now = time.monotonic()
        if now < self._wal_retry_at:
            self._kick.wait(min(0.25, self._wal_retry_at - now))
            return True
        self._wal_retry_at = now + self.config.wal_retry_s
        durable = self.wal.synced_ticket
        # (a recovery that failed half-way left some messages re-appended, the rest in _redo)
        redo = self._redo = [(st, m) for t, st, m in self._acks if t > durable] + self._redo
        self._acks = deque(x for x in self._acks if x[0] <= durable)
        first: dict[int, Message] = {}
        for st, m in redo:
            first.setdefault(id(st), m)
        states = []
        for w in self.writers.values():
            f = first.get(id(w))
            epoch, seq = (f.epoch, f.seq - 1) if f is not None else (w.epoch, w.received_seq)
            states.append([w.run, w.writer, epoch, seq, w.shard_next, w.owner])
        try:
            self.wal.recover([(STATE, json.dumps({"writers": states}).encode())])
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
            return False
        for w in self.writers.values():
            for m in w.pending:
                if m.shard_seq is not None and m.plan_ticket > durable:
                    m.shard_seq = None  # its PLAN never became durable: plan it again
        log.warning("write-ahead log recovered: re-appended %d messages not durable at the failure", n_redo)
        self._retire_segments()
        return True

    def _pause(self, seconds: float) -> None:
        """Back off after a failed commit; ends early when the engine closes (grace period)."""
        end = time.monotonic() + seconds
        with self._lock:
            while not self._stopped:
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._kick.wait(min(left, 0.25))

    def _commit(self, st: WriterState, group: list[Message]) -> bool:
        shard = group[0].shard_seq
        assert shard is not None
        by_version: dict[int, tuple[list[RecordChunk], list[TrajectorySeal], list[PrefixLink]]] = {}
        for m in group:
            for c in m.chunks:
                by_version.setdefault(c.policy_version, ([], [], []))[0].append(c)
            for s in m.seals:
                by_version.setdefault(s.policy_version, ([], [], []))[1].append(s)
            for link in m.links:
                by_version.setdefault(link.policy_version, ([], [], []))[2].append(link)
        t0 = time.monotonic()
        try:
            for version, (chunks, seals, links) in sorted(by_version.items()):
                self.store.write_shard(st.run, version, st.writer, shard, chunks, seals=seals, links=links)
        except Exception as exc:  # storage down / slow: keep everything, retry later
            # The failure's traceback frames hold the encoded shard (and form reference cycles the
            # GC collects late): clear them now, or each retry adds a shard's worth of memory.
            traceback.clear_frames(exc.__traceback__)
            self.metrics.storage_errors.labels("write_shard").inc()
            self.metrics.storage_retries.labels("write_shard").inc()
            with self._lock:
                self._refusing_since = self._refusing_since or time.monotonic()
            log.warning("shard %s/%s/%d not committed yet (%s); will retry", st.run, st.writer, shard, exc)
            return False
        faults.point("commit.stored")
        nbytes = sum(m.nbytes for m in group)
        self.metrics.shard_write_latency.observe(time.monotonic() - t0)
        self.metrics.shard_bytes.inc(nbytes)
        self.metrics.shards.inc(max(1, len(by_version)))
        self.metrics.last_commit_timestamp.set(time.time())
        with self._lock:
            self._refusing_since = None
            if self.wal is not None:
                done = json.dumps({"run": st.run, "writer": st.writer, "shard": shard}).encode()
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
        return True

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
        now = time.monotonic()
        limit = self.config.storage_unhealthy_s
        if self.wal is not None and self.wal.error is not None:
            reasons.append("wal_failed")
        if self._flusher is not None and not self._flusher.is_alive() and not self._stopped:
            reasons.append("flusher_dead")
        busy = self._flush_busy_since
        if busy is not None and now - busy > limit:
            reasons.append("flusher_stalled")
        refusing = self._refusing_since
        if refusing is not None and now - refusing > limit:
            reasons.append("storage_refusing")
        return reasons

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
            self._kick.notify_all()
        stuck = False
        if self._flusher is not None:
            self._flusher.join(timeout=max(0.0, timeout))
            stuck = self._flusher.is_alive()
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
                open_trajectories=len(self._open),
                shards_committed=self.shards_committed,
                writers=writers,
            )


def pack_wal_data(request: Part, blobs: Sequence[Part]) -> list[Part]:
    """WAL payload of a DATA entry: u32 request length, the raw request, then shared-memory payloads."""
    n = len(request.data) if isinstance(request, Checked) else len(request)
    return [_LEN.pack(n), request, *blobs]


def unpack_wal_data(payload: bytes) -> tuple[memoryview, memoryview]:
    if len(payload) < 4:
        raise ValidationError("write-ahead log data entry shorter than its length prefix")
    (n,) = _LEN.unpack_from(payload)
    view = memoryview(payload)
    return view[4 : 4 + n], view[4 + n :]
