"""The recorder's queue items and records of what it dropped: staging regions, pieces, forwards
(per-site and slab), seals to resolve, the Write messages built from them (:class:`Outgoing`) and
the trajectories left unguided (:class:`Unguided`). Plain state shared by the engine-facing API
(:mod:`tracestore.client.record.recorder`), the sender's end of the queue
(:mod:`tracestore.client.record.outbox`) and the chunk builder
(:mod:`tracestore.client.record.chunks`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

from tracestore.records import PrefixLink, TrajectorySeal
from tracestore.v1 import tracestore_pb2 as pb

log = logging.getLogger("tracestore.client")

_REF_STATE_LIMIT = 1 << 20  # entries per TraceRef bookkeeping dict of a recorder
# Reasons of a recorder that stopped for good: every later forward is refused with them, logged once.
STOP_REASONS = frozenset({"fenced", "permission_denied"})
_LOG_EVERY_S = 60.0  # other reasons: a WARNING at most this often per reason, with the count since the last


def bounded_put(d: dict[Any, Any], key: Any, value: Any) -> None:
    """``d[key] = value``, dropping the oldest entry once ``d`` holds :data:`_REF_STATE_LIMIT`."""
    if key not in d and len(d) >= _REF_STATE_LIMIT:
        d.pop(next(iter(d)))
    d[key] = value


# -- queue items ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Region:
    offset: int
    size: int
    refs: int
    event: Any = None  # CUDA event the copy into it completes on


@dataclasses.dataclass(slots=True)
class Piece:
    """One chunk waiting to be sent: rows of one segment in a staging region."""

    trajectory: str
    site: str
    version: int
    token_start: int
    n_tokens: int
    region: Region
    codes_off: int
    scales_off: int
    ts_off: int  # -1: no token scales
    g_off: int
    nbytes: int
    queued: float = 0.0
    g: bytes = b""  # the global scale's float32 bytes (known once the copy landed)


@dataclasses.dataclass
class Forward:
    """One forward as record_forward queued it (one staging region for all its sites); the sender
    thread splits it into pieces, keeping per-segment Python work off the engine thread."""

    segs: Collection[tuple[str, int, int]]  # a list, or a client.recorder.Segments (column form)
    version: int
    sites: list[tuple[str, Any, int, int, int, int, int]]  # name, site, offset, nc, ns, nt, g_off
    region: Region
    queued: float
    nbytes: int = 0
    long_segments: bool = False  # its sequences are long enough to make long chunks alone (prefill)
    ids: Any = None  # int32 token ids of its tokens in segment order (tracestore.identity), or None


@dataclasses.dataclass(frozen=True)
class SlabPlan:
    """A RecordSlab checked against the run: per site (name, SiteSpec, field), row bytes, rows per token."""

    fields: tuple[tuple[str, Any, Any], ...]
    row_bytes: int
    rows_per_token: int
    code_scale_bytes: int  # per row, summed over the sites: the payload before token scales
    _sizes: dict[int, int] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def staged_bytes(self, rows: int) -> int:
        """Room for the raw rows and for the per-site layout made of them (64-byte aligned);
        remembered per row count (at most the slab's capacity of them: a decode step asks again
        every step)."""
        size = self._sizes.get(rows)
        if size is None:
            lay = sum(-(-(rows * (f.code_bytes + f.scale_bytes + 4) + 4) // 64) * 64 for _, _, f in self.fields)
            size = self._sizes[rows] = -(-max(rows * self.row_bytes, lay) // 64) * 64
        return size


@dataclasses.dataclass
class SlabForward(Forward):
    """A forward staged as raw RecordSlab rows (one copy per slab); the sender lays it out per site
    (:meth:`Outbox.unslab`) before anything else reads it. ``staged``: per slab, its plan, the
    staging offset of its rows and their count; emptied once laid out."""

    staged: list[tuple[SlabPlan, int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Finish:
    """A seal as finish() queued it; the sender resolves its sites and version in queue order."""

    trajectory: str
    n_tokens: int  # -1: the trajectory is unguided, only forget its bookkeeping
    sites: tuple[str, ...] | None


Item = Piece | Forward | Finish | TrajectorySeal | PrefixLink


@dataclasses.dataclass
class Outgoing:
    """A Write message, numbered once it is handed to the session."""

    seq: int
    req: pb.WriteRequest
    pieces: list[Piece]  # staging it holds until released (inline messages built from copies: none)
    trajectories: set[str]
    nbytes: int
    payload: list[Any] = dataclasses.field(default_factory=list)  # inline chunk wire parts
    born: float = float("inf")  # when its oldest record was queued (pieces carry their own)
    chunks: int = 0

    def serialize(self) -> bytes:
        head = self.req.SerializeToString()
        return b"".join([head, *self.payload]) if self.payload else head


# -- trajectories dropped -------------------------------------------------------------------------


class Unguided:
    """The trajectories a recorder dropped (unguided), why, and the counts per reason not yet
    reported to the sidecar (they ride in the next message). ``ids`` is read on the engine thread
    without a lock (set membership). Logged once per reason of a stopped recorder, else at most
    once per reason every ``_LOG_EVERY_S`` (with the count since the last WARNING)."""

    def __init__(self, stats: dict[str, int]) -> None:
        self.ids: set[str] = set()
        self._why: dict[str, str] = {}
        self._unreported: dict[str, int] = {}
        self._stats = stats  # the recorder's counters: "unguided" counts them
        self._logged: dict[str, float] = {}  # reason -> when its last WARNING was logged
        self._quiet: dict[str, int] = {}  # reason -> trajectories marked since then, not logged

    def __contains__(self, trajectory: str) -> bool:
        return trajectory in self.ids

    def mark(self, trajectories: Sequence[str] | set[str], reason: str) -> None:
        new = [t for t in trajectories if t not in self.ids]
        self.ids.update(new)
        for t in new:
            bounded_put(self._why, t, reason)
        if new:
            self._stats["unguided"] += len(new)
            self._unreported[reason] = self._unreported.get(reason, 0) + len(new)
            now = time.monotonic()
            last = self._logged.get(reason)
            if last is None or (reason not in STOP_REASONS and now - last >= _LOG_EVERY_S):
                self._logged[reason] = now
                since = self._quiet.pop(reason, 0)
                more = f" ({since} more since the last report)" if since else ""
                log.warning("%d trajectories unguided (%s), e.g. %s%s", len(new), reason, new[0], more)
            else:
                self._quiet[reason] = self._quiet.get(reason, 0) + len(new)
                log.debug("%d trajectories unguided (%s), e.g. %s", len(new), reason, new[0])

    def why(self, trajectory: str) -> str:
        return self._why.get(trajectory, "refused")

    def forget(self, trajectory: str) -> None:
        self._why.pop(trajectory, None)

    def report(self, req: pb.WriteRequest) -> None:
        """Add the counts not yet reported to ``req`` (then they are reported)."""
        for reason, n in self._unreported.items():
            req.unguided.add(reason=reason, count=n)
        self._unreported = {}
