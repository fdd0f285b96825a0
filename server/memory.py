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
Otherwise (an older writer, or the pool mostly held) the payload is copied out before the message
can become durable, and released with it.

The engine (``engine.py``) moves bytes in and out of both with its lock held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping

from tracestore.errors import LimitError, TraceStoreError

from .config import ServerConfig
from .message import Message
from .metrics import Metrics
from .sessions import WriterState

# Memory one open Write stream costs the sidecar besides its messages and its HTTP/2 receive window
# (ServerConfig.stream_window), counted against the budget with the window while the stream is open:
# gRPC's buffers and the stream's three threads' stacks. Measured with gRPC's 64 KiB window: 300 idle
# streams +19 MiB RSS (~64 KiB each); under a flood the windows fill and the threads run, so 192 KiB
# per stream covered window and all.
STREAM_OVERHEAD_BYTES = 128 << 10
# A WAL sidecar holds (reads without copying, until the shard is committed) at most this share of a
# writer's staging pool: the rest stays free for the writer's forwards in flight.
SHM_HOLD_FRACTION = 0.5


class OverBudgetError(TraceStoreError, MemoryError):
    """The memory budget stayed full for the backpressure timeout; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class MemoryBudget:
    """``in_use``: bytes of admitted messages (the backlog); ``reserved``: bytes reserved for
    memory about to be used. ``room`` is the engine's condition (on its lock), notified when
    either shrinks; ``press()`` asks the flusher to commit now."""

    def __init__(self, config: ServerConfig, metrics: Metrics, room: threading.Condition, press: Callable[[], None]):
        self.limit = config.memory_budget_bytes
        self.stream_bytes = config.stream_window + STREAM_OVERHEAD_BYTES  # one open Write stream's
        self.in_use = 0
        self.reserved = 0
        self._config = config
        self._metrics = metrics
        self._room = room
        self._press = press

    def fits(self, nbytes: int, own: int = 0) -> bool:
        """``nbytes`` more fit beside what is counted but ``own`` (the caller's own reservation),
        or nothing else is counted (what is larger than the budget waits for no one)."""
        others = self.in_use + self.reserved - own
        return others + nbytes <= self.limit or others == 0

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
        stream; LimitError at once when the budget cannot hold it beside what it holds now. Without
        this, 300 streams flooding a 64 MiB budget grew the sidecar by up to 144 MiB."""
        n = self.stream_bytes
        if self.in_use + self.reserved + n > self.limit:
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
        """Admit ``msg``'s shared-memory payload into pool ``pool`` (``capacity`` bytes) as held past
        durability, under :data:`SHM_HOLD_FRACTION` of the pool: the oldest held messages are
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
