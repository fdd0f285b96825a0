"""What Read calls may hold and make the sidecar do, apart from ingest.

:class:`ReadBudget` is the read budget (``ServerConfig.read_budget``, ``--read-budget-mib``): a
Read reserves its output there, not in the engine's memory budget, so reads that callers do not
take never hold the memory Write streams need. With tokens, an identity holds at most
:data:`READ_SHARE` of it while another identity holds or waits for some (alone it may take all),
and at most that share of the Read/Seal threads (:class:`ReadCalls`).

:class:`StallWatch` cancels a Read whose caller has taken no response for ``read_stall_s``: gRPC
resumes a Read's response generator only once the message it yielded was handed to the transport,
so a yield that has not returned after that long means the caller's HTTP/2 window stayed full (the
generator's own code cannot see it: a watcher thread cancels the call, which ends the pending send
and closes the generator, whose ``finally`` gives its reservation back).

:class:`CommitGate` keeps read-your-writes without letting reads cut shards at will: a Read first
commits what the sidecar holds, but reads together start such a commit at most once per
``flush_interval_s``; a Read arriving sooner waits for the next one (or for the flusher to commit
everything first), and one commit serves every Read that arrived before it began.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from tracestore.server.engine.memory import OverBudgetError

from tracestore.errors import LimitError

# With tokens, one identity holds at most this share of the read budget while another identity
# holds or waits for some of it, and at most this share of the Read/Seal threads.
READ_SHARE = 0.5


class ReadBudget:
    """``limit`` bytes of Read output reserved at once; ``share`` (None: no shares) the most one
    identity holds while another identity holds or waits for some. :meth:`take` waits up to
    ``wait_s`` for room; ``on_change(bytes_in_use)`` follows every change."""

    def __init__(self, limit: int, share: int | None, wait_s: float, on_change: Callable[[int], None]) -> None:
        self.limit = limit
        self.share = share
        self.in_use = 0
        self._wait_s = wait_s
        self._held: dict[str | None, int] = {}
        self._waiting: dict[str | None, int] = {}
        self._room = threading.Condition()
        self._on_change = on_change

    def _others(self, identity: str | None) -> bool:
        """Another identity holds or waits for read budget."""
        return any(k != identity for k in self._held) or any(k != identity for k in self._waiting)

    def _fits(self, identity: str | None, nbytes: int) -> bool:
        if self.in_use + nbytes > self.limit:
            return False
        if self.share is None or identity is None or not self._others(identity):
            return True
        return self._held.get(identity, 0) + nbytes <= self.share

    def take(self, identity: str | None, nbytes: int) -> int:
        """Reserve ``nbytes`` (at most :attr:`limit`) for ``identity``, waiting for room; raises
        OverBudgetError after ``wait_s``. Returns the bytes reserved (give them back with
        :meth:`give`)."""
        nbytes = max(1, min(nbytes, self.limit))
        deadline = time.monotonic() + self._wait_s
        with self._room:
            self._waiting[identity] = self._waiting.get(identity, 0) + 1
            try:
                while not self._fits(identity, nbytes):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._refusal(identity, nbytes)
                    self._room.wait(left)
            finally:
                left_waiting = self._waiting.pop(identity) - 1
                if left_waiting:
                    self._waiting[identity] = left_waiting
                self._room.notify_all()  # (one waiter fewer may let an identity alone take more)
            self._held[identity] = self._held.get(identity, 0) + nbytes
            self.in_use += nbytes
            self._on_change(self.in_use)
        return nbytes

    def _refusal(self, identity: str | None, nbytes: int) -> OverBudgetError:
        held = self._held.get(identity, 0)
        if self.share is not None and identity is not None and self._others(identity) and held + nbytes > self.share:
            why = (
                f"caller {identity!r} holds {held} bytes of it and may hold at most {self.share} (half) while "
                "others read"
            )
        else:
            why = f"{self.in_use} bytes are reserved by Reads in progress"
        return OverBudgetError(
            f"the read budget ({self.limit} bytes, --read-budget-mib) has no room for this Read's {nbytes} bytes "
            f"after {self._wait_s:g} s: {why}; retry later or read fewer tokens at a time",
            retry_after_s=1.0,
        )

    def give(self, identity: str | None, nbytes: int) -> None:
        """Give back ``nbytes`` that :meth:`take` reserved for ``identity``."""
        with self._room:
            left = self._held.pop(identity) - nbytes
            if left > 0:
                self._held[identity] = left
            self.in_use -= nbytes
            self._on_change(self.in_use)
            self._room.notify_all()


class ReadCalls:
    """Read calls running per identity: at most ``share`` of one identity (None: no limit)."""

    def __init__(self, share: int | None) -> None:
        self.share = share
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, identity: str | None) -> bool:
        """Count one more Read call of ``identity``; False (nothing counted) over its share."""
        if self.share is None or identity is None:
            return True
        with self._lock:
            n = self._held.get(identity, 0)
            if n >= self.share:
                return False
            self._held[identity] = n + 1
            return True

    def give(self, identity: str | None) -> None:
        if self.share is None or identity is None:
            return
        with self._lock:
            n = self._held.pop(identity) - 1
            if n:
                self._held[identity] = n


class Watched:
    """One Read under a :class:`StallWatch`: ``since`` is when its latest response was handed to
    gRPC, None while the Read is not waiting for its caller."""

    __slots__ = ("context", "since", "stalled")

    def __init__(self, context: Any) -> None:
        self.context = context
        self.since: float | None = None
        self.stalled = False


class StallWatch:
    """Cancels every watched Read whose response has waited ``stall_s`` for its caller, calling
    ``on_stall()`` for each. One thread checks them, running while any Read is watched."""

    def __init__(self, stall_s: float, on_stall: Callable[[], None]) -> None:
        self.stall_s = stall_s
        self._on_stall = on_stall
        self._reads: set[Watched] = set()
        self._lock = threading.Lock()
        self._running = False

    @contextlib.contextmanager
    def watching(self, context: Any) -> Iterator[Watched]:
        """Watch the Read of gRPC ``context`` until the block ends."""
        w = Watched(context)
        with self._lock:
            self._reads.add(w)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="tracestore-read-stalls", daemon=True).start()
        try:
            yield w
        finally:
            with self._lock:
                self._reads.discard(w)

    def _run(self) -> None:
        every = min(1.0, self.stall_s / 4)
        while True:
            time.sleep(every)
            now = time.monotonic()
            with self._lock:
                if not self._reads:
                    self._running = False
                    return
                stalled = [
                    w for w in self._reads if not w.stalled and w.since is not None and now - w.since > self.stall_s
                ]
                for w in stalled:
                    w.stalled = True
            for w in stalled:
                w.context.cancel()  # the pending send fails: gRPC closes the Read's generator
                self._on_stall()


class CommitGate:
    """Read-your-writes at a bounded rate: :meth:`before_read` returns once everything accepted
    before it was called is committed, by ``flush(timeout)`` calls that start at most once per
    ``interval_s`` (``pending()``: whether anything accepted is not committed yet)."""

    def __init__(
        self, flush: Callable[[float], bool], pending: Callable[[], bool], interval_s: float, timeout_s: float
    ) -> None:
        self._flush = flush
        self._pending = pending
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._last = -interval_s  # (monotonic) when the latest read-forced commit began
        self._done = -1.0  # ... the latest that succeeded
        self._failed = -1.0  # ... the latest that failed

    def before_read(self) -> bool:
        """Commit what was accepted before now, at most one commit per interval for all reads
        together; False if that could not be done within the storage timeout."""
        arrived = time.monotonic()
        if not self._pending():
            return True
        if not self._lock.acquire(timeout=self._interval_s + self._timeout_s):
            return False
        try:
            if self._done >= arrived:  # a commit that began after this read arrived is done
                return True
            if self._failed >= arrived:  # ... or failed: storage is behind for this read too
                return False
            while (wait := self._last + self._interval_s - time.monotonic()) > 0:
                if not self._pending():  # the flusher committed everything meanwhile
                    return True
                time.sleep(min(wait, 0.05))
            began = self._last = time.monotonic()
            ok = self._flush(self._timeout_s)
            if ok:
                self._done = began
            else:
                self._failed = began
            return ok
        finally:
            self._lock.release()


def read_call_share(read_threads: int, shares: bool) -> int | None:
    """Read calls one identity may run at once: :data:`READ_SHARE` of the ``read_threads`` Read and
    Seal share (at least one), or None without shares."""
    return max(1, int(read_threads * READ_SHARE)) if shares else None


def refuse_read_call(share: int, name: str) -> LimitError:
    """The error of a Read over its caller's share of the Read/Seal threads."""
    return LimitError(
        f"{share} Read calls of caller {name!r} are running on this sidecar, its share (half of the Read and "
        "Seal threads, --workers - 4); retry later"
    )
