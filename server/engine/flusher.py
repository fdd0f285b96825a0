"""The sidecar's shard flusher: one thread that commits queued writer messages to storage as shards.

The messages, their shard plans and the memory they hold belong to the engine; the flusher owns
its thread, its retries and its health, and reaches the engine only through :class:`FlushSource`
(it imports nothing from ``core.py``). One round:

1. :meth:`FlushSource.next_round` names the shards due now (:class:`Batch`: a writer's messages
   under one shard number, planned in the write-ahead log), or says to wait, back off or stop;
2. the flusher waits until the newest PLAN entry of the round is durable
   (:meth:`FlushSource.wait_planned`): a restart then repeats the same shard numbers (a no-op for
   the store), never a second shard of the same chunks;
3. it writes each shard, one ``Store.write_shard`` per policy version (a large one as two files
   encoded side by side; the call returns once both and their manifests are durable), and reports
   it with :meth:`FlushSource.committed` (the engine logs DONE, releases the memory and acknowledges), or
   stops the round at the first failure: the group stays queued and is retried after a backoff
   (doubling from 0.05 s to 5 s);
4. :meth:`FlushSource.round_finished` ends every round that named shards, failed or not.

Health (:meth:`Flusher.health`): the thread is *dead* when it ended without being stopped,
*stalled* while one round's commits take longer than the limit, and storage is *refusing* while
every commit since the first failure has failed for that long.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any, Protocol

from tracestore.server.engine.message import Message
from tracestore.server.metrics import Metrics

from tracestore import faults
from tracestore.records import PrefixLink, RecordChunk, TrajectorySeal

log = logging.getLogger("tracestore.server")

BACKOFF_FIRST_S = 0.05  # after a failed round; doubled per failure, back to this after a good one
BACKOFF_MAX_S = 5.0
PLAN_SYNC_TIMEOUT_S = 30.0  # longest wait for a round's PLAN entries to become durable


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


@dataclasses.dataclass(frozen=True)
class Batch:
    """One shard to commit: one writer's messages, in order, planned as shard number ``shard``."""

    run: str
    writer: str
    shard: int
    messages: list[Message]


def clear_frames(exc: BaseException) -> None:
    """Clear the frames of ``exc``'s traceback and of the exceptions it chains (``__cause__``,
    ``__context__``). A storage client's exception, raised again from a ``concurrent.futures``
    future, sits in a reference cycle (its traceback's frame holds the future, which holds it)
    with the request it failed, the shard's bytes and the client's copy of them (aiohttp copies a
    ``BytesIO`` body). Clearing only the top exception's frames would leave each failed commit's
    shard and its copy to the garbage collector, outside the memory budget."""
    seen: set[int] = set()
    chained: BaseException | None = exc
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__


@dataclasses.dataclass(frozen=True)
class Round:
    """What the flusher does next: commit ``batches`` once WAL ticket ``plan_ticket`` (0: none) is
    durable; with no batches, wait ``wait_s`` for a kick (0: go on at once), or back off."""

    batches: Sequence[Batch] = ()
    plan_ticket: int = 0
    wait_s: float = 0.0
    back_off: bool = False


class FlushSource(Protocol):
    """The engine operations the flusher needs."""

    def next_round(self) -> Round | None:
        """The next round; None once the engine is stopped (the flusher thread then ends)."""

    def wait_planned(self, ticket: int, timeout: float) -> bool:
        """Wait until the WAL entry ``ticket`` is durable; False if it is not within ``timeout``."""

    def committed(self, batch: Batch) -> None:
        """``batch`` is in storage."""

    def round_finished(self) -> None:
        """The round's commits are over (each committed or not); none is in flight."""

    def hold_commit(self, chunks: Sequence[RecordChunk]) -> int:
        """Count what writing a shard of ``chunks`` takes (encoding, publishing) in the memory
        budget until :meth:`release_commit`; returns the bytes held. Never waits."""

    def release_commit(self, held: int) -> None:
        """The shard write that :meth:`hold_commit` counted is over."""


class Flusher:
    """The flusher thread of one engine; ``store`` follows the contract of ``Store``."""

    def __init__(self, source: FlushSource, store: Any, metrics: Metrics) -> None:
        self._source = source
        self.store = store
        self.metrics = metrics
        self._wake = Waker()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._busy_since: float | None = None  # when the current round's commits began
        self._refusing_since: float | None = None  # first failed commit since the last good one

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tracestore-flusher", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """Ask for a round now (a flush request, a full shard, no room in the budget)."""
        self._wake.wake()

    def stop(self, timeout: float) -> bool:
        """End the thread after its current round, waiting at most ``timeout`` s for a commit in
        progress; False if it is still running then."""
        self._stopped = True
        self._wake.wake()
        if self._thread is None:
            return True
        self._thread.join(timeout=max(0.0, timeout))
        if not self._thread.is_alive():
            return True
        if self._busy_since is not None:
            log.warning("a shard write is still in progress at shutdown; the write-ahead log keeps its records")
        else:
            log.warning(
                "the shard flusher did not stop within the %.1f s left of the grace period; the write-ahead "
                "log keeps what is not committed",
                timeout,
            )
        return False

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self, limit: float) -> list[str]:
        """What is wrong, in order: ``flusher_dead``, ``flusher_stalled`` (one round's commits for
        longer than ``limit`` s), ``storage_refusing`` (every commit failed for that long)."""
        reasons = []
        now = time.monotonic()
        if self._thread is not None and not self._thread.is_alive() and not self._stopped:
            reasons.append("flusher_dead")
        busy = self._busy_since
        if busy is not None and now - busy > limit:
            reasons.append("flusher_stalled")
        refusing = self._refusing_since
        if refusing is not None and now - refusing > limit:
            reasons.append("storage_refusing")
        return reasons

    def _loop(self) -> None:
        """Commit rounds until stopped; never die of an error (one not expected is logged, counted
        as a failed commit, and retried with backoff)."""
        backoff = BACKOFF_FIRST_S
        while True:
            try:
                ok = self._round()
            except Exception:  # noqa: BLE001 - the flusher must outlive any one commit
                log.exception("the shard flusher hit an unexpected error; retrying")
                ok = False
                self._refusing_since = self._refusing_since or time.monotonic()
            if ok is None:
                self._stopped = True
                return
            if ok:
                backoff = BACKOFF_FIRST_S
            else:
                self._pause(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _round(self) -> bool | None:
        """One round: True (progress or nothing due), False (back off), None (stop)."""
        r = None if self._stopped else self._source.next_round()
        if r is None:
            return None
        if not r.batches:
            if r.wait_s > 0:
                self._wake.wait(r.wait_s)
            return not r.back_off
        self._busy_since = time.monotonic()
        # A shard is written only once its PLAN entry is durable: a restart then repeats the
        # same shard number (a no-op), never a second shard of the same chunks. (A SIGKILL
        # between an unsynced PLAN and its shard wrote every chunk twice: test_crash.)
        ok = True
        try:
            if r.plan_ticket and not self._source.wait_planned(r.plan_ticket, PLAN_SYNC_TIMEOUT_S):
                ok = False
            elif r.plan_ticket:
                faults.point("commit.plan_synced")
            for batch in r.batches if ok else ():
                ok = self._commit(batch)
                if not ok:
                    break
        finally:
            self._busy_since = None
            self._source.round_finished()
        return ok

    def _pause(self, seconds: float) -> None:
        """Back off after a failed round; ends early when stopped (the engine's grace period)."""
        end = time.monotonic() + seconds
        while not self._stopped:
            left = end - time.monotonic()
            if left <= 0:
                return
            self._wake.wait(min(left, 0.25))

    def _write(
        self,
        batch: Batch,
        version: int,
        chunks: list[RecordChunk],
        seals: list[TrajectorySeal],
        links: list[PrefixLink],
    ) -> None:
        """One shard to the store; encoding and publishing it count in the memory budget."""
        held = self._source.hold_commit(chunks)
        try:
            self.store.write_shard(batch.run, version, batch.writer, batch.shard, chunks, seals=seals, links=links)
        finally:
            self._source.release_commit(held)

    def _commit(self, batch: Batch) -> bool:
        by_version: dict[int, tuple[list[RecordChunk], list[TrajectorySeal], list[PrefixLink]]] = {}
        for m in batch.messages:
            for c in m.chunks:
                by_version.setdefault(c.policy_version, ([], [], []))[0].append(c)
            for s in m.seals:
                by_version.setdefault(s.policy_version, ([], [], []))[1].append(s)
            for link in m.links:
                by_version.setdefault(link.policy_version, ([], [], []))[2].append(link)
        t0 = time.monotonic()
        try:
            for version, (chunks, seals, links) in sorted(by_version.items()):
                self._write(batch, version, chunks, seals, links)
        except Exception as exc:  # storage down / slow: keep everything, retry later
            # The failure's traceback frames hold the encoded shard (and form reference cycles the
            # GC collects late): clear them now, or each retry adds a shard's worth of memory.
            clear_frames(exc)
            self.metrics.storage_errors.labels("write_shard").inc()
            self.metrics.storage_retries.labels("write_shard").inc()
            self._refusing_since = self._refusing_since or time.monotonic()
            log.warning("shard %s/%s/%d not committed yet (%s); will retry", batch.run, batch.writer, batch.shard, exc)
            return False
        faults.point("commit.stored")
        nbytes = sum(m.nbytes for m in batch.messages)
        self.metrics.shard_write_latency.observe(time.monotonic() - t0)
        self.metrics.shard_bytes.inc(nbytes)
        self.metrics.shards.inc(max(1, len(by_version)))
        self.metrics.last_commit_timestamp.set(time.time())
        self._refusing_since = None
        self._source.committed(batch)
        return True
