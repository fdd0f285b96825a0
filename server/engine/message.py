"""A writer message and the sidecar's write-ahead log entries: what the engine queues, the flusher
writes and replay rebuilds.

A :class:`Message` is one numbered batch of chunks, seals and links from one writer, parsed and
validated (``ingest.py`` makes them from Write and Seal requests). The write-ahead log holds six
kinds of entries, each framed and checksummed by ``wal/log.py``:

========  ===============================================================================
``DATA``  a message: u32 request length, the raw request, then its shared-memory payloads
          (:func:`pack_wal_data`, :func:`unpack_wal_data`; replay parses it again)
``STATE`` the header of every segment: each writer session (run, writer, epoch, sequence,
          next shard number, owner), so a replay that starts after deleted segments still
          knows which messages were committed (:func:`encode_state`, :func:`decode_state`)
``PLAN``  a shard number given to a group of a writer's messages, durable before the shard
          is written (:class:`Plan`)
``DONE``  that shard is committed: its messages are not replayed (:class:`Done`)
``OWNER`` the authenticated identity that first used a writer id (:class:`Owner`)
``CLAIMS`` after ``STATE`` in every segment's header (with authentication on): the identity that
          owns each open trajectory (:func:`encode_claims`), so that a replay that starts after
          deleted segments still knows who may write them
========  ===============================================================================

``STATE``, ``PLAN``, ``DONE``, ``OWNER`` and ``CLAIMS`` payloads are JSON.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from tracestore.server.wal.log import Checked, Part

from tracestore.errors import ValidationError
from tracestore.records import PrefixLink, RecordChunk, TrajectorySeal

# WAL entry types
DATA, STATE, PLAN, DONE, OWNER, CLAIMS = 1, 2, 3, 4, 5, 6
_LEN = struct.Struct("<I")


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
    # and shared-memory payloads the writer keeps until the ack): re-appended if the WAL fails
    # first.
    wal_parts: Sequence[Part] | None = None
    ticket: int = 0  # WAL ticket of the DATA entry
    plan_ticket: int = 0  # WAL ticket of the PLAN entry that gave it ``shard_seq``
    reservation_held: int = 0  # budget its stream reserved for it, held until it is admitted
    # bytes of its largest chunk, and whether the room its commit needs is kept free in the memory
    # budget (MemoryBudget.expect: from when it is parsed until it leaves the backlog or is refused)
    largest_chunk: int = 0
    room_counted: bool = False
    queued: bool = False  # in its writer's backlog (Engine._enqueue .. Engine._release)

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


def pack_wal_data(request: Part, blobs: Sequence[Part]) -> list[Part]:
    """A DATA entry's WAL payload: u32 request length, raw request, shared-memory payloads."""
    n = len(request.data) if isinstance(request, Checked) else len(request)
    return [_LEN.pack(n), request, *blobs]


def unpack_wal_data(payload: bytes) -> tuple[memoryview, memoryview]:
    if len(payload) < 4:
        raise ValidationError("write-ahead log data entry shorter than its length prefix")
    (n,) = _LEN.unpack_from(payload)
    view = memoryview(payload)
    return view[4 : 4 + n], view[4 + n :]


class Session(NamedTuple):
    """One writer session in a STATE entry."""

    run: str
    writer: str
    epoch: int
    seq: int  # the highest sequence received (and, at replay, committed) in ``epoch``
    shard_next: int
    owner: str | None


def encode_state(sessions: Iterable[Session]) -> bytes:
    return json.dumps({"writers": [list(s) for s in sessions]}).encode()


def decode_state(payload: bytes) -> list[Session]:
    """The sessions of a STATE entry (one written before writer ownership existed has no owners)."""
    return [
        Session(run, writer, epoch, seq, shard_next, owner[0] if owner else None)
        for run, writer, epoch, seq, shard_next, *owner in json.loads(payload)["writers"]
    ]


Claim = tuple[str, str, str]  # (run, trajectory, identity)


def encode_claims(claims: Iterable[Claim]) -> bytes:
    """``{"claims": {run: {identity: [trajectory, ...]}}}``: grouped, so that encoding tens of
    thousands of open trajectories at each segment rotation stays a few milliseconds."""
    grouped: dict[str, dict[str, list[str]]] = {}
    for run, trajectory, identity in claims:
        grouped.setdefault(run, {}).setdefault(identity, []).append(trajectory)
    return json.dumps({"claims": grouped}, separators=(",", ":")).encode()


def decode_claims(payload: bytes) -> list[Claim]:
    return [
        (run, t, identity)
        for run, by_identity in json.loads(payload)["claims"].items()
        for identity, trajectories in by_identity.items()
        for t in trajectories
    ]


class Plan(NamedTuple):
    """A PLAN entry: ``messages`` ((epoch, sequence) of each) of a writer form shard ``shard``."""

    run: str
    writer: str
    shard: int
    messages: list[tuple[int, int]]


class Done(NamedTuple):
    """A DONE entry: shard ``shard`` of a writer is committed to storage."""

    run: str
    writer: str
    shard: int


class Owner(NamedTuple):
    """An OWNER entry: the writer id belongs to the authenticated ``identity``."""

    run: str
    writer: str
    identity: str


def encode_entry(entry: Plan | Done | Owner) -> bytes:
    """The payload of a PLAN, DONE or OWNER entry: a JSON object of the entry's fields."""
    return json.dumps(entry._asdict()).encode()


def decode_entry(kind: int, payload: bytes) -> Plan | Done | Owner | None:
    """A PLAN, DONE or OWNER entry; None for any other kind."""
    if kind not in (PLAN, DONE, OWNER):
        return None
    info = json.loads(payload)
    run, writer = info["run"], info["writer"]
    if kind == PLAN:
        return Plan(run, writer, info["shard"], [(epoch, seq) for epoch, seq in info["messages"]])
    if kind == DONE:
        return Done(run, writer, info["shard"])
    return Owner(run, writer, info["identity"])
