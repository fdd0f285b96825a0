"""Peak RSS of the sidecar against its memory bound, per scenario, and the table of them.

The bound is the one docs/operations.md promises: the sidecar's peak resident set minus its idle
resident set (right after it started, before any traffic) stays within ``--memory-budget-mib`` +
64 MiB. :class:`RssWatch` measures it from outside, the way an OOM killer sees the process:
VmHWM after resetting it at idle (``/proc/<pid>/clear_refs``), and VmRSS sampled every 5 ms as a
fallback where the reset is not allowed. Every measurement becomes a row of the table printed at
the end of the fault suite (scenario, budget, bound, idle RSS, peak RSS, peak - idle, ok).
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterable

from .harness import PeakSampler, Sidecar

SLACK_MIB = 64  # what the sidecar may hold beyond its budget (docs/operations.md)
SETTLE_S = 0.5  # after the ready file: the sidecar's start-up work is over


@dataclasses.dataclass
class RssRow:
    """One scenario's measurement (MiB)."""

    scenario: str
    budget_mib: int
    idle_mib: float = 0.0
    peak_mib: float = 0.0
    note: str = ""

    @property
    def bound_mib(self) -> int:
        return self.budget_mib + SLACK_MIB

    @property
    def grown_mib(self) -> float:
        return self.peak_mib - self.idle_mib

    @property
    def ok(self) -> bool:
        return self.peak_mib > 0 and self.grown_mib <= self.bound_mib


RSS_ROWS: list[RssRow] = []


class RssWatch:
    """Peak RSS of ``sc`` from now until :meth:`stop` (idle RSS taken at construction); adds its
    row to :data:`RSS_ROWS` at once, so a failing test still shows its numbers."""

    def __init__(self, sc: Sidecar, scenario: str, budget_mib: int) -> None:
        self.row = RssRow(scenario, budget_mib)
        RSS_ROWS.append(self.row)
        self._peak = PeakSampler(sc.pid)
        self.row.idle_mib = self._peak.base / 1024
        self._peak.__enter__()

    def stop(self) -> RssRow:
        """End the measurement (idempotent) and fill in the row's peak."""
        if self._peak is not None:
            self._peak.__exit__(None, None, None)
            self.row.peak_mib = self._peak.peak / 1024
            self._peak = None  # type: ignore[assignment]
        return self.row

    def check(self) -> str | None:
        """The bound's breach, in words (None: within it)."""
        r = self.stop()
        if r.ok:
            return None
        return (
            f"{r.scenario}: the sidecar grew {r.grown_mib:.0f} MiB (idle {r.idle_mib:.0f}, peak {r.peak_mib:.0f}) "
            f"for a {r.budget_mib} MiB budget; bound {r.bound_mib} MiB"
        )


def start_idle(sc: Sidecar) -> None:
    """Start ``sc`` and let it settle, so that its RSS now is its idle RSS."""
    sc.start(timeout=60)
    time.sleep(SETTLE_S)


def format_rss_table(rows: Iterable[RssRow]) -> str:
    head = ("scenario", "budget", "bound", "idle RSS", "peak RSS", "peak - idle", "ok")
    lines = [
        (r.scenario, f"{r.budget_mib}", f"{r.bound_mib}", f"{r.idle_mib:.0f}", f"{r.peak_mib:.0f}",
         f"{r.grown_mib:.0f}", "yes" if r.ok else "NO")
        for r in rows
    ]  # fmt: skip
    widths = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(head)]

    def fmt(cols: Iterable[str]) -> str:
        pairs = enumerate(zip(cols, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    out = ["peak RSS of the sidecar per scenario (MiB; bound = budget + 64)", fmt(head), fmt("-" * w for w in widths)]
    out += [fmt(x) for x in lines]
    return "\n".join(out)


class BlackHole:
    """A TCP listener on ``port`` that accepts connections and never reads nor answers: a storage
    endpoint that black-holes requests (a hung load balancer, a dead backend behind a live port)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(128)
        self.sock.settimeout(0.1)
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._accept, daemon=True)
        self._t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.conns.append(self.sock.accept()[0])

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=5)
        for c in self.conns:
            c.close()
        self.sock.close()
