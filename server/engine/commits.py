"""The flusher's side of the engine (:class:`~tracestore.server.engine.flusher.FlushSource`):
which writers are due for a shard, planning each shard in the WAL, holding the memory its encoding
takes, and settling a committed shard (DONE in the WAL, memory and held staging released, the
writer's committed and durable sequences moved). Every method takes the engine's lock itself.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
from tracestore.server.config import ServerConfig
from tracestore.server.engine.flusher import Batch, Round
from tracestore.server.engine.journal import Journal
from tracestore.server.engine.memory import MemoryBudget, StagingHolds
from tracestore.server.engine.sessions import WriterState
from tracestore.server.metrics import Metrics

from tracestore.errors import TraceStoreError
from tracestore.records import RecordChunk

if TYPE_CHECKING:
    from tracestore.server.engine.message import Message

log = logging.getLogger("tracestore.server")

INGEST_QUIET_S = 0.2  # seconds without a new message that count as a pause in ingest
DEFER_MAX_INTERVALS = 5  # shards of a WAL sidecar wait for a pause at most this many flush intervals


def _arrow_own_pools() -> list[pa.MemoryPool]:
    """Arrow's own allocators (one of them is the default of its C++ code), where built in."""
    pools = []
    for make in (pa.mimalloc_memory_pool, pa.jemalloc_memory_pool):
        with contextlib.suppress(NotImplementedError):
            pools.append(make())
    return pools


_ARROW_POOLS = _arrow_own_pools()


class CommitSide:
    """The flusher's side of :class:`~tracestore.server.engine.core.Engine`, which sets every
    attribute declared here."""

    _lock: threading.Lock
    _room: threading.Condition
    _stopped: bool
    _draining: bool
    _force: int
    _last_ingest: float
    _in_flight: set[int]
    config: ServerConfig
    journal: Journal | None
    budget: MemoryBudget
    holds: StagingHolds
    metrics: Metrics
    shard_bytes: int
    shards_committed: int

    @property
    def writers(self) -> dict[tuple[str, str], WriterState]:
        raise NotImplementedError

    @property
    def in_use(self) -> int:
        raise NotImplementedError

    def _release(self, st: WriterState, group: list[Message]) -> None:
        raise NotImplementedError

    def _update_gauges(self) -> None:
        raise NotImplementedError

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
        if self.journal is None or now - self._last_ingest >= INGEST_QUIET_S:
            return False
        return now - st.pending[0].received < DEFER_MAX_INTERVALS * self.config.flush_interval_s

    def next_round(self) -> Round | None:
        """The shards the flusher commits next, each planned in the WAL; their messages count as in
        flight until :meth:`round_finished`. Recovers a failed WAL first (on the flusher thread,
        so no commit is in flight). None once the engine is stopped."""
        with self._lock:
            if self._stopped:
                return None
            if self.journal is not None and self.journal.failed:
                return self.journal.recover()
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
        assert self.journal is not None  # (only a WAL gives PLAN tickets)
        return self.journal.wal.wait_synced(ticket, timeout=timeout)

    def hold_commit(self, chunks: Sequence[RecordChunk]) -> int:
        """The room writing a shard of ``chunks`` takes (:meth:`MemoryBudget.hold_commit`)."""
        need = self.budget.commit_need(max((c.nbytes for c in chunks), default=0), sum(c.nbytes for c in chunks))
        return self.budget.hold_commit(need)

    def release_commit(self, held: int) -> None:
        """The shard write is over: what its encoding took is given back, to the system too."""
        # Parquet's page buffers come from Arrow's C++ default pool (mimalloc here: chosen as
        # pyarrow is imported, before server/cli.py's tune_malloc), which keeps what the encoder
        # freed for its next use, uncounted once the hold is given back; released here.
        # 57 MiB messages: peak RSS over idle 269-276 MiB with the release, 297-326 MiB without
        for pool in _ARROW_POOLS:
            pool.release_unused()
        self.budget.release_commit(held)

    def round_finished(self) -> None:
        with self._lock:  # (StagingHolds.make_room may copy out held messages of a failed shard meanwhile)
            self._in_flight = set()
            self._room.notify_all()

    def committed(self, batch: Batch) -> None:
        """``batch`` is in storage: log DONE, release its memory and held staging, and move its
        writer's committed (without a WAL: durable) sequence."""
        group = batch.messages
        with self._lock:
            st = self.writers[(batch.run, batch.writer)]
            if self.journal is not None:
                self.journal.done(st, batch.shard)
            self._release(st, group)
            held = False
            for m in group:
                held = held or m.held_pool is not None
                self.holds.release(st, m)
                self.holds.durable(m)
            if held:
                st.notify()  # released_sequence moved
            self.shards_committed += 1
            last = group[-1]
            if last.epoch == st.epoch:
                st.committed_seq = max(st.committed_seq, last.seq)
                if self.journal is None and last.seq > st.durable_seq:
                    st.durable_seq = last.seq
                    for m in group:
                        self.metrics.durable_ack_latency.observe(time.monotonic() - m.received)
                    st.notify()
            if self.journal is not None:
                self.journal.retire()
            self._update_gauges()
            self._room.notify_all()

    def _plan(self, st: WriterState) -> Batch:
        """The next group of ``st``'s messages to commit as one shard, planned in the WAL
        (lock held). Raises StorageError (nothing planned) when the WAL refuses the PLAN entry."""
        first = st.pending[0]
        if first.shard_seq is not None:  # planned before a crash: repeat exactly that group
            return Batch(st.run, st.writer, first.shard_seq, [m for m in st.pending if m.shard_seq == first.shard_seq])
        group = st.next_group(self.shard_bytes)
        shard = st.shard_next
        ticket = 0
        if self.journal is not None:
            ticket = self.journal.plan(st, shard, group)
        st.shard_next += 1
        for m in group:
            m.shard_seq, m.plan_ticket = shard, ticket
        return Batch(st.run, st.writer, shard, group)
