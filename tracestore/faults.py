"""Named crash points for the fault suite (``tests/faults``): deterministic SIGKILLs at each step of
a shard commit and of the write-ahead log's life, instead of kills at random times.

Set ``TRACESTORE_FAULT=<point>[:<n>]`` in the sidecar's environment and the process kills itself
with SIGKILL the ``n``-th time (default: the first) it reaches ``<point>``. Unset (production), a
crash point costs one global load and a comparison. The points, in the order a commit takes them:

=========================  ===================================================================
``commit.planned``         the shard's PLAN entry is appended to the WAL, not yet durable
``commit.plan_synced``     the PLAN entry is durable; nothing of the shard is on storage
``store.temp_written``     the shard's bytes are in a temporary file/object, not yet published
``store.shard_published``  the shard is published; its manifest is not
``store.manifest_published`` the manifest is published (the shard is committed on storage)
``commit.stored``          every shard of the commit is on storage; no DONE entry yet
``commit.done_appended``   the DONE entry is appended, not yet durable
``commit.done_synced``     the DONE entry is durable; WAL segments not yet retired
``commit.retired``         WAL segments of committed messages are deleted
``wal.rotated``            a new WAL segment was opened (its header is not yet durable)
``wal.synced``             an fdatasync of the WAL returned (acks about to go out)
=========================  ===================================================================
"""

from __future__ import annotations

import os
import signal
import threading

from tracestore.settings import FAULT, read_env

POINTS = (
    "commit.planned",
    "commit.plan_synced",
    "store.temp_written",
    "store.shard_published",
    "store.manifest_published",
    "commit.stored",
    "commit.done_appended",
    "commit.done_synced",
    "commit.retired",
    "wal.rotated",
    "wal.synced",
)


def _parse(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, n = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"TRACESTORE_FAULT names an unknown crash point {name!r}; known: {', '.join(POINTS)}")
    count = int(n) if n else 1
    if count < 1:
        raise ValueError(f"TRACESTORE_FAULT count must be >= 1, got {n!r}")
    return name, count


_TARGET = _parse(read_env(FAULT))
_hits = 0
_lock = threading.Lock()


def point(name: str) -> None:
    """A crash point: SIGKILL this process here when ``TRACESTORE_FAULT`` names it."""
    global _hits
    if _TARGET is None or _TARGET[0] != name:
        return
    with _lock:
        _hits += 1
        if _hits >= _TARGET[1]:
            os.kill(os.getpid(), signal.SIGKILL)
