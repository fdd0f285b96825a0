"""What the engine counts against memory: its own budget, and the writers' shared memory it holds.

:class:`MemoryBudget` is the sidecar's memory budget (``memory_budget_bytes``): the bytes of
admitted messages until their shard is committed, and the reservations taken before memory is
used (a stream's room for the message it is about to read, a Read's output, each open Write
stream's own buffers). A full budget is backpressure: the flusher is asked to commit at once, and
what waits for room past ``backpressure_timeout_s`` is refused with :class:`OverBudgetError`.

:class:`StagingHolds` counts the writers' shared-memory staging that messages name (the same-host
path). Such payloads stay views into the writer's staging pool while the writer keeps the
regions: without a WAL until the shard is committed (that is the ack), with a WAL until the shard
is committed too when the writer set ``keeps_staging`` and its held regions stay under
:data:`SHM_HOLD_FRACTION` of its pool (*held*); then the response's ``released_sequence`` trails
``durable_sequence`` and the WAL append is the only copy the sidecar makes of those bytes.
Otherwise (a writer without ``keeps_staging``, or the pool mostly held) the payload is copied out
before the message can become durable, and released with it.

The engine (``core.py``) moves bytes in and out of both with its lock held.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Collection, Mapping

from tracestore.server.config import ServerConfig
from tracestore.server.engine.message import Message
from tracestore.server.engine.sessions import WriterState
from tracestore.server.metrics import Metrics

from tracestore.errors import LimitError, TraceStoreError

# Memory one open Write stream costs the sidecar besides its messages and its HTTP/2 receive window
# (ServerConfig.stream_window), counted against the budget with the window while the stream is open:
# gRPC's buffers and the stream's three threads' stacks.
#: 300 idle streams: ~64 KiB each; flooding, 192 KiB each with gRPC's 64 KiB window
STREAM_OVERHEAD_BYTES = 128 << 10
# A WAL sidecar holds (reads without copying, until the shard is committed) at most this share of a
# writer's staging pool: the rest stays free for the writer's forwards in flight.
SHM_HOLD_FRACTION = 0.5
# Encoding a shard holds, in each of the (at most two) files written side by side, the Parquet
# page that its largest chunk's codes go into and its compressed scales.
ENCODE_COPIES = 3  # 1.35x the chunk per file: 22 MiB for a 16 MiB chunk
# Publishing a shard from memory (S3) holds the file and the upload's copy of it.
PUBLISH_COPIES = 2
# The write-ahead log's aligned buffers (two in use, one spare): a share of the budget each, within
# 1..16 MiB; counted against the budget (WAL_BUFFERS of them) for as long as the engine runs.
WAL_BUFFER_SHARE = 32
WAL_BUFFERS = 3


def largest_chunk(msg: Message) -> int:
    """Bytes of ``msg``'s largest chunk (0 without chunks)."""
    return max((c.nbytes for c in msg.chunks), default=0)


def wal_buffer_bytes(config: ServerConfig) -> int:
    """The size of each of the write-ahead log's aligned buffers under ``config``'s budget."""
    return min(16 << 20, max(1 << 20, config.memory_budget_bytes // WAL_BUFFER_SHARE))


class OverBudgetError(TraceStoreError, MemoryError):
    """The memory budget stayed full for the backpressure timeout; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RunningMax:
    """The largest of a changing multiset of sizes (a max-heap whose removed entries are dropped
    lazily): O(log n) per change, O(1) amortized per look."""

    def __init__(self) -> None:
        self._count: dict[int, int] = {}
        self._heap: list[int] = []  # sizes, negated

    def add(self, n: int) -> None:
        if n <= 0:
            return
        k = self._count.get(n, 0)
        self._count[n] = k + 1
        if k == 0:
            heapq.heappush(self._heap, -n)

    def remove(self, n: int) -> None:
        if n <= 0:
            return
        k = self._count[n] - 1
        if k:
            self._count[n] = k
        else:
            del self._count[n]

    @property
    def value(self) -> int:
        """The largest size present (0 when none)."""
        while self._heap and -self._heap[0] not in self._count:
            heapq.heappop(self._heap)
        return -self._heap[0] if self._heap else 0


class MemoryBudget:
    """``in_use``: bytes of admitted messages (the backlog); ``reserved``: bytes reserved for
    memory about to be used, ``fixed`` of them for good (the write-ahead log's buffers, gRPC's
    copies: :meth:`keep`). ``room`` is the engine's condition (on its lock), notified when either
    shrinks; ``press()`` asks the flusher to commit now.

    Committing a shard takes memory too (:meth:`commit_need`): its encoding, and where shards are
    published from memory (S3) the file and its upload copy. Committing is what gives memory
    back, so a commit must never wait for memory: the streams leave the room the next commit of
    the backlog may need free (:meth:`kept_free`: the encoding of the backlog's largest chunk,
    and the file and upload copy of a shard or of the backlog's largest message, whichever is
    larger), a message is admitted only with the room its own commit needs, and the flusher
    holds that room while it commits (:meth:`hold_commit`). Where shards are published from
    memory they are cut at a sixteenth of the budget instead of a quarter (:attr:`shard_bytes`)."""

    def __init__(
        self,
        config: ServerConfig,
        metrics: Metrics,
        room: threading.Condition,
        press: Callable[[], None],
        store: object = None,
    ) -> None:
        self.limit = config.memory_budget_bytes
        self.stream_bytes = config.stream_window + STREAM_OVERHEAD_BYTES  # one open Write stream's
        self.in_use = 0
        self.reserved = 0
        self.fixed = 0
        self._config = config
        self._metrics = metrics
        self._room = room
        self._press = press
        # a local store writes the shard to its file as it encodes; any other publishes it from memory
        self.publish_copies = 0 if getattr(getattr(store, "storage", None), "local", False) else PUBLISH_COPIES
        # a shard cut at a sixteenth of the budget when published from memory keeps an S3 outage
        # under the bound (64 MiB budget: peak RSS 92-99 MiB over idle, bound 128)
        share = 16 if self.publish_copies else 4
        self.shard_bytes = max(1, min(config.shard_target_bytes, config.memory_budget_bytes // share))
        self.headroom = self.publish_copies * self.shard_bytes  # kept free even with no backlog
        self.commit_held = 0  # held by the commit in progress
        self._chunks = RunningMax()  # the largest chunk of each message in the backlog
        self._messages = RunningMax()  # the size of each message in the backlog
        if config.wal_dir is not None:
            self.keep(WAL_BUFFERS * wal_buffer_bytes(config))

    def keep(self, nbytes: int) -> int:
        """Reserve ``nbytes`` for good (memory the sidecar holds however little it is sent; takes
        the engine's lock)."""
        with self._room:
            self.reserved += nbytes
            self.fixed += nbytes
        return nbytes

    def expect(self, largest: int, nbytes: int) -> None:
        """A message of ``nbytes`` whose largest chunk is ``largest`` bytes is on its way into the
        backlog: the room its commit needs is kept free from now on (:meth:`kept_free`; lock
        held)."""
        self._chunks.add(largest)
        self._messages.add(nbytes)

    def unexpect(self, largest: int, nbytes: int) -> None:
        """Undo :meth:`expect` (lock held)."""
        self._chunks.remove(largest)
        self._messages.remove(nbytes)

    def enqueue(self, msg: Message) -> None:
        """``msg`` joins the backlog (lock held); its commit's room is kept free until
        :meth:`dequeue` (from now on, unless :meth:`expect` counted it already)."""
        self.in_use += msg.nbytes
        if not msg.room_counted:
            msg.largest_chunk = largest_chunk(msg)
            self.expect(msg.largest_chunk, msg.nbytes)
            msg.room_counted = True

    def dequeue(self, msg: Message) -> None:
        """``msg`` leaves the backlog (lock held)."""
        self.in_use -= msg.nbytes
        self.forget(msg)

    def forget(self, msg: Message) -> None:
        """The room ``msg``'s commit needs is no longer kept free (lock held)."""
        if msg.room_counted:
            self.unexpect(msg.largest_chunk, msg.nbytes)
            msg.room_counted = False

    def commit_room(self, largest: int = 0, nbytes: int = 0) -> int:
        """The room a commit of the backlog may need, were a message of ``nbytes`` with a largest
        chunk of ``largest`` bytes in it too: a shard's commit takes at most
        :meth:`commit_need` of its largest chunk and its bytes, and a shard holds at most
        :attr:`shard_bytes` unless it is one message."""
        chunk = max(largest, self._chunks.value)
        shard = max(self.shard_bytes, nbytes, self._messages.value)
        return self.commit_need(chunk, shard if self.publish_copies else 0)

    def kept_free(self, largest: int = 0, nbytes: int = 0) -> int:
        """What the streams leave free: :meth:`commit_room` but what the commit in progress
        holds of it."""
        return max(0, self.commit_room(largest, nbytes) - self.commit_held)

    def fits(self, nbytes: int, own: int = 0, msg: Message | None = None) -> bool:
        """``nbytes`` more fit beside what is counted but ``own`` (the caller's own reservation)
        and what the streams leave free (with ``msg``, the message being admitted, in the
        backlog). What cannot fit, by waiting, beside what is counted now goes ahead: anything
        when nothing but the fixed reservations is counted (what is larger than the budget waits
        for no one), and ``msg`` when the backlog is empty and nothing is being committed (then
        only messages waiting like it hold the rest, and the commit of one of them is what makes
        room; the budget is then exceeded by at most the room that commit takes)."""
        others = self.in_use + self.reserved - own
        free = self.kept_free() if msg is None else self.kept_free(largest_chunk(msg), msg.nbytes)
        if others + nbytes + free <= self.limit or others <= self.fixed:
            return True
        return msg is not None and self.in_use == 0 and self.commit_held == 0

    def commit_need(self, largest_chunk: int, nbytes: int) -> int:
        """What committing a shard of ``nbytes`` of records takes while it is encoded and
        published, its largest chunk ``largest_chunk`` bytes."""
        return ENCODE_COPIES * largest_chunk + self.publish_copies * nbytes

    def hold_commit(self, need: int) -> int:
        """Count ``need`` bytes as held by a commit until :meth:`release_commit` (takes the
        engine's lock). No waiting: the streams leave that room free (:meth:`kept_free`), and
        were it short (a message larger than the budget allows, let in alone), only a commit
        could make more. Returns the bytes held."""
        with self._room:
            self.reserved += need
            self.commit_held += need
            return need

    def release_commit(self, nbytes: int) -> None:
        """The commit is over (committed or not): give its hold back (takes the engine's lock)."""
        with self._room:
            self.reserved -= nbytes
            self.commit_held -= nbytes
            self._room.notify_all()

    def reserve(self, estimate: int, draining: Callable[[], bool], refuse: Callable[[], Exception]) -> int:
        """Reserve ``estimate`` bytes (at most the budget) for a message about to be read, waiting
        for room up to ``backpressure_timeout_s`` (lock held), so a stream waits for room *before*
        taking a message off the wire: waiting streams then hold nothing but their HTTP/2 window,
        and memory stays within the budget however many streams there are. ``refuse()`` is raised
        once ``draining()`` says the sidecar shuts down. Returns the bytes reserved."""
        estimate = max(1, min(estimate, self.limit))
        deadline = time.monotonic() + self._config.backpressure_timeout_s
        waited = False
        while not self.fits(estimate):
            if draining():
                raise refuse()
            self.wait(deadline, first=not waited, detail="slow down and resend")
            waited = True
        self.reserved += estimate
        return estimate

    def reserve_stream(self) -> int:
        """Reserve :attr:`stream_bytes` (its HTTP/2 window and its threads) for an open Write
        stream; LimitError at once when the budget cannot hold it beside what it holds now."""
        n = self.stream_bytes
        if self.in_use + self.reserved + n + self.kept_free() > self.limit:
            raise LimitError(
                f"the memory budget ({self.limit} bytes) cannot hold another Write stream ({n} bytes: "
                f"its HTTP/2 window, buffers and threads) beside the {self.in_use} bytes of records and "
                f"{self.reserved} bytes reserved now; retry later or raise --memory-budget-mib"
                + (" or lower --stream-window-kib" if self._config.stream_window_bytes is not None else "")
            )
        self.reserved += n
        return n

    def wait(self, deadline: float, *, first: bool, detail: str) -> None:
        """No room: count the backpressure once per message (``first``), ask the flusher to commit
        now, and wait for room until ``deadline`` (then OverBudgetError, ``detail`` appended)."""
        if first:
            self._metrics.backpressure.inc()
        self._press()
        left = deadline - time.monotonic()
        if left <= 0:
            raise OverBudgetError(
                f"memory budget of {self.limit} bytes is full ({self.in_use} held, storage is behind); {detail}",
                retry_after_s=min(5.0, self._config.flush_interval_s),
            )
        self._room.wait(left)

    def unreserve(self, nbytes: int) -> None:
        """Give back a reservation (takes the engine's lock)."""
        with self._room:
            self.reserved -= nbytes
            self._room.notify_all()


class StagingHolds:
    """``in_use``: bytes of writers' staging named by messages not released yet; ``held``: per
    pool, the bytes held past durability. ``writers`` is the engine's session table."""

    def __init__(self, metrics: Metrics, writers: Mapping[tuple[str, str], WriterState]) -> None:
        self.in_use = 0
        self.held: dict[str, int] = {}
        self._metrics = metrics
        self._writers = writers

    def admit(self, msg: Message) -> None:
        """``msg`` is admitted: the staging it names is in use until it is released."""
        if msg.shm_bytes:
            self.in_use += msg.shm_bytes
            self._metrics.shm_in_use.set(self.in_use)

    def hold(self, st: WriterState, msg: Message, pool: str, capacity: int, in_flight: Collection[int]) -> None:
        """Admit ``msg``'s shared-memory payload into pool ``pool`` (``capacity`` bytes) as held
        past durability, under :data:`SHM_HOLD_FRACTION` of the pool: the oldest held messages are
        copied out first if need be (:meth:`make_room`), and ``msg`` itself only if that did not
        make room. ``in_flight``: ``id()`` of the messages whose shard is being written now."""
        limit = capacity * SHM_HOLD_FRACTION - msg.shm_bytes
        if self.held.get(pool, 0) > limit:
            self.make_room(pool, limit, in_flight)
        if self.held.get(pool, 0) > limit:
            msg.own_shm()
            return
        self.held[pool] = self.held.get(pool, 0) + msg.shm_bytes
        msg.held_pool = pool
        st.held[msg.seq] = msg

    def make_room(self, pool: str, limit: float, in_flight: Collection[int]) -> None:
        """Copy held messages of ``pool`` out of it, oldest first, until at most ``limit`` bytes of
        it are held; their regions are released with the next response. The oldest go first
        because the writer's staging is a ring that frees from its oldest region: a held message
        whose shard waits (ingest still going on, storage down) would otherwise stop the ring
        even with most of it free. Messages whose shard is being written right now are left
        (their commit releases them). Copies with the engine's lock held: only while a writer's
        shards lag half its pool behind its ingest."""
        held = [m for st in self._writers.values() for m in st.held.values() if m.held_pool == pool]
        held.sort(key=lambda m: m.received)
        for m in held:
            if self.held.get(pool, 0) <= limit:
                break
            if id(m) in in_flight:
                continue
            m.own_shm()
            st = self._writers[(m.run, m.writer)]
            self.release(st, m)
            st.notify()

    def durable(self, msg: Message) -> None:
        """``msg`` is durable: unless it is held, the writer may now release the staging it named
        (its ack is on its way)."""
        if msg.shm_bytes and msg.held_pool is None:
            self.in_use -= msg.shm_bytes
            msg.shm_bytes = 0
            self._metrics.shm_in_use.set(self.in_use)

    def release(self, st: WriterState, msg: Message) -> None:
        """The sidecar reads no more of the staging a held ``msg`` names."""
        if msg.held_pool is None:
            return
        left = self.held.get(msg.held_pool, 0) - msg.shm_bytes
        if left > 0:
            self.held[msg.held_pool] = left
        else:
            self.held.pop(msg.held_pool, None)
        if st.held.get(msg.seq) is msg:
            del st.held[msg.seq]
        msg.held_pool = None
        self.durable(msg)

    def own_all(self, st: WriterState) -> None:
        """A new epoch of ``st`` begins: copy the payloads its older epoch's messages still hold
        out of the writer's pool (the writer releases those regions at its new epoch's first ack,
        since the sequence numbers it gets then are no longer theirs). Rare: a writer starts a new
        epoch after a refused gap or when it restarts."""
        for msg in list(st.held.values()):
            msg.own_shm()
            self.release(st, msg)
