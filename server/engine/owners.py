"""Who owns each trajectory (with authentication on): the identity that first wrote it, per (run,
trajectory) in every policy version, for as long as the sidecar's WAL directory lasts.

An owner is looked up in memory first, then in the table:

- **the cache**: the :data:`~tracestore.server.engine.dedupe.MAX_OWNED_TRAJECTORIES` most recently
  written or looked-up trajectories with their owner or "no owner" (the table changes only through
  this object, so a cached "no owner" stays true until a claim here replaces it).
- **unpersisted claims**: those not yet in the table, in memory until they are (never dropped).
  Each was made by a message whose WAL ``DATA`` entry names the trajectory under a writer id whose
  owner the WAL keeps, so a replay of the segments still on disk claims it again (the engine replays
  the claims of every ``DATA`` entry, committed or not).
- **the table**: ``owners.sqlite3`` in the WAL directory (SQLite, write-ahead journal,
  ``synchronous=FULL``), one row per owned trajectory, first claim wins. Before the journal deletes
  WAL segments it asks :meth:`TrajectoryOwners.persist_then` to write every unpersisted claim and
  only then delete them; at a clean stop :meth:`TrajectoryOwners.persist` does so before the log is
  truncated. So every claim is in the table or in a segment still on disk: ownership survives a
  clean restart, a crash, and a log drained to nothing. While the sidecar serves, the writes run on
  this object's own thread, never under the engine's lock (a commit waits for an fsync); lookups
  use a second connection, which a write in progress does not block. The WAL directory is locked by
  one sidecar, the only writer of its table.

A trajectory that memory does not hold is first checked against a :class:`Presence` filter of the
table's keys (built by the writer thread at start): one the table cannot hold (every new one, but a
false "maybe" in under 1%) costs no query, one memory forgot costs one (the keys of one message in
one query per run), and the answer is cached. Never a lookup per chunk.

Without a table (``path`` None: authentication off, or an index built alone) the cache is all
there is: a claim it drops is forgotten.

The engine calls everything but the writer thread with its lock held (through ``dedupe.py`` and
``journal.py``); the unpersisted claims are handed between the two under this object's own lock.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from tracestore.server.config import ServerConfig
from tracestore.server.engine.message import Message

from tracestore.errors import CorruptionError, PermissionDeniedError, StorageError

log = logging.getLogger("tracestore.server")

TABLE_FILE = "owners.sqlite3"
Key = tuple[str, str]  # (run, trajectory)
_UNKNOWN: Any = object()  # (not in the cache)
_INSERT = "INSERT OR IGNORE INTO owners (run, trajectory, identity) VALUES (?, ?, ?)"


def table_path(config: ServerConfig) -> Path | None:
    """Where the sidecar of ``config`` keeps its owners table: in the WAL directory, with
    authentication on (None otherwise: no identities, no ownership)."""
    if config.auth_tokens is None or config.wal_dir is None:
        return None
    return Path(config.wal_dir) / TABLE_FILE


class Presence:
    """A Bloom filter of the keys in the table: :meth:`maybe` leaves out only keys never added.
    Three probes and at least 16 bits a key while it holds at most ``capacity`` keys (a false
    "maybe" for under 1% of absent keys); the writer thread builds it for
    twice the table's rows, so it takes 2 to 8 bytes per owned trajectory, at least 1 MiB. Probes
    come from ``hash()`` of the key, which is fixed for the life of the process only: the filter is
    built from the table at each start. One thread adds (the writer thread), any reads; a key is
    added before anything relies on it being there."""

    def __init__(self, capacity: int) -> None:
        nbits = 1 << max(23, (16 * max(capacity, 1) - 1).bit_length())
        self.capacity = nbits // 16
        self.count = 0
        self._mask = nbits - 1
        self._bits = bytearray(nbits // 8)

    def maybe(self, keys: Iterable[Key]) -> list[Key]:
        """Those of ``keys`` the filter may hold (one loop: this runs under the engine's lock)."""
        m, bits = self._mask, self._bits
        out = []
        for key in keys:
            h = hash(key)
            a, b = h & 0xFFFFFFFF, ((h >> 32) & 0xFFFFFFFF) | 1
            i, j, k = a & m, (a + b) & m, (a + 2 * b) & m
            if bits[i >> 3] & (1 << (i & 7)) and bits[j >> 3] & (1 << (j & 7)) and bits[k >> 3] & (1 << (k & 7)):
                out.append(key)
        return out

    def add(self, keys: Iterable[Key]) -> None:
        """Add ``keys`` (vectorized: the same probes as :meth:`maybe`)."""
        h = np.fromiter((hash(k) for k in keys), dtype=np.int64).view(np.uint64)
        a, b = h & np.uint64(0xFFFFFFFF), (h >> np.uint64(32)) | np.uint64(1)
        view = np.frombuffer(self._bits, dtype=np.uint8)
        for j in range(3):
            i = (a + np.uint64(j) * b) & np.uint64(self._mask)
            np.bitwise_or.at(
                view, (i >> np.uint64(3)).astype(np.intp), np.left_shift(1, i & np.uint64(7)).astype(np.uint8)
            )
        self.count += len(h)


def trajectories(msg: Message) -> list[Key]:
    """(run, trajectory) of every chunk, seal and link ``msg`` writes, each once, in order."""
    keys = [(c.run, c.trajectory) for c in msg.chunks]
    keys += [(x.run, x.trajectory) for x in msg.seals]
    keys += [(x.run, x.trajectory) for x in msg.links]
    return list(dict.fromkeys(keys))


class TrajectoryOwners:
    """Trajectory owners: a cache of ``cache_size`` lookups, the claims not persisted yet, and the
    table at ``path`` (opened by :meth:`open`; see the module docstring)."""

    def __init__(self, path: Path | None, cache_size: int) -> None:
        self.path = path
        self.cache_size = cache_size
        self._cache: OrderedDict[Key, str | None] = OrderedDict()  # least recently used first
        # Claims not in the table: new ones (``_pending``), and those the writer thread took and has
        # not committed yet (``_writing``; kept when a write fails, and taken again with the next).
        # Each dict is replaced, never changed, once handed over, so a lookup reads them unlocked
        # (``_pending`` first: a claim moves from there to ``_writing``).
        self._pending: dict[Key, str] = {}
        self._writing: dict[Key, str] = {}
        self._mu = threading.Condition()
        self._write_lock = threading.Lock()  # one write at a time: the writer thread's or persist()'s
        self._then: list[Callable[[], None]] = []  # to run once what is unpersisted now is in the table
        self._closed = False
        self._reader: sqlite3.Connection | None = None
        self._writer: sqlite3.Connection | None = None
        self._thread: threading.Thread | None = None
        self._presence: Presence | None = None  # the table's keys (None until the writer thread built it)
        self.presence_built = threading.Event()  # set once the writer thread tried to build it
        self.lookups = 0  # trajectories looked up in the table (each one not in memory)

    # -- lookups and claims (the engine's lock held) -----------------------------------------------

    def owner(self, key: Key) -> str | None:
        """The identity that owns trajectory ``key``; None when no one does."""
        owner = self.known(key)
        if owner is None and key not in self._cache and self.path is not None:
            owner = self._resolve([key]).get(key)
        return owner

    def known(self, key: Key) -> str | None:
        """The owner of ``key`` as memory holds it (no table lookup)."""
        cache, pending, writing = self._unpersisted()
        return cache.get(key) or pending.get(key) or writing.get(key)

    @property
    def unpersisted(self) -> int:
        """Claims not in the table yet."""
        _, pending, writing = self._unpersisted()
        return len(pending) + len(writing)

    def _unpersisted(self) -> tuple[OrderedDict[Key, str | None], dict[Key, str], dict[Key, str]]:
        """The cache and the two dicts of claims not in the table, read in the order that sees every
        such claim in one of them while the writer thread moves them (it sets ``_writing`` before it
        empties ``_pending``, and empties ``_writing`` only once the table has them; a dict handed
        over is never changed again)."""
        pending = self._pending
        return self._cache, pending, self._writing

    def check(self, msg: Message, identity: str) -> None:
        """``identity`` may write the trajectories ``msg`` names and link to their sources;
        PermissionDeniedError otherwise."""
        cache, pending, writing = self._unpersisted()
        keys = trajectories(msg)
        if msg.links:
            keys += [(x.run, x.source) for x in msg.links]
        missing = []
        for key in keys:
            # A cached owner is current; one pushed out of the cache may not be persisted yet.
            owner = cache.get(key, _UNKNOWN)
            if owner is _UNKNOWN:
                owner = pending.get(key) or writing.get(key)
                if owner is None:
                    missing.append(key)
                    continue
            if owner is not None and owner != identity:
                self._refuse(msg, key)
        if missing and self.path is not None:
            for key, owner in self._resolve(missing).items():
                if owner != identity:
                    self._refuse(msg, key)

    def claim(self, keys: list[Key], identity: str) -> None:
        """The trajectories ``keys`` are ``identity``'s unless someone owns them already; all of
        them become the most recently used."""
        cache, pending, writing = self._unpersisted()
        table = self.path is not None
        resolved: dict[Key, str] = {}
        if table:
            missing = [k for k in keys if k not in cache and (pending.get(k) or writing.get(k)) is None]
            if missing:  # (not checked first: a replay; or pushed out of a tiny cache since)
                resolved = self._resolve(missing)
        new: dict[Key, str] = {}
        for key in keys:
            owner = cache.pop(key, None) or pending.get(key) or writing.get(key) or resolved.get(key)
            if owner is None:
                owner = new[key] = identity
            cache[key] = owner  # (popped: now the most recent)
        if new and table:
            with self._mu:
                self._pending.update(new)
        self._trim()

    # -- the table --------------------------------------------------------------------------------

    def open(self) -> None:
        """Open (or create) the table and start its writer thread (the WAL directory is locked by
        then); CorruptionError naming it when it is damaged. Nothing to open without a table."""
        if self.path is None or self._reader is not None:
            return
        self._writer = self._connect()
        self._reader = self._connect()
        self._thread = threading.Thread(target=self._write_loop, name="tracestore-owners", daemon=True)
        self._thread.start()

    def persist_then(self, action: Callable[[], None]) -> None:
        """Run ``action`` once every claim made so far is in the table: now when none is waiting,
        else on the writer thread after it wrote them (never when that write fails: a later call
        asks again)."""
        if not self.unpersisted:
            action()
            return
        with self._mu:
            self._then.append(action)
            self._mu.notify_all()

    def persist(self) -> None:
        """Write every claim made so far to the table, on the calling thread; StorageError when the
        table refuses them (they stay unpersisted)."""
        if self.unpersisted:
            self._write()

    def close(self) -> None:
        """Stop the writer thread (after the write in progress) and close the table; claims not
        written stay in the WAL."""
        with self._mu:
            self._closed = True
            self._mu.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for db in (self._reader, self._writer):
            if db is not None:
                db.close()
        self._reader = self._writer = None

    def _write_loop(self) -> None:
        """The writer thread: build the presence filter (lookups go to the table until then); then,
        whenever actions wait, write the claims not in the table, then run them (none when the
        write fails: a later request asks again)."""
        try:
            with self._write_lock:
                self._presence = self._build_presence()
        except StorageError as exc:
            log.warning("%s; every trajectory new to memory is looked up in it", exc)
        self.presence_built.set()
        while True:
            with self._mu:
                while not self._then and not self._closed:
                    self._mu.wait()
                if self._closed:
                    return
                actions, self._then = self._then, []
            try:
                self._write()
            except StorageError as exc:
                log.warning("%s; WAL segments are kept until it takes them", exc)
                continue
            for action in actions:
                try:
                    action()
                except Exception:  # an action's failure is its own (the claims are written)
                    log.exception("after writing trajectory owners")

    def _write(self) -> None:
        """Move the new claims to ``_writing`` and write all of it in one transaction; then they
        leave memory's unpersisted claims (kept there when the write fails)."""
        with self._write_lock:
            with self._mu:
                batch = {**self._writing, **self._pending}
                self._writing = batch  # first: see _unpersisted
                self._pending = {}
            if not batch:
                return
            if self._writer is None:
                self.open()
            assert self._writer is not None
            try:
                with self._writer:
                    self._writer.executemany(_INSERT, [(run, t, who) for (run, t), who in batch.items()])
            except sqlite3.Error as exc:
                raise StorageError(f"trajectory owners table {self.path} refused {len(batch)} claims: {exc}") from exc
            presence = self._presence
            if presence is not None:
                presence.add(batch)
                if presence.count > presence.capacity:
                    self._presence = self._build_presence()
            self._writing = {}  # (committed and in the filter first: see _unpersisted)

    def _build_presence(self) -> Presence:
        """A presence filter of every key in the table, for twice as many (``_write_lock`` held:
        no write meanwhile)."""
        assert self._writer is not None
        try:
            (n,) = self._writer.execute("SELECT COUNT(*) FROM owners").fetchone()
            presence = Presence(2 * n)
            cursor = self._writer.execute("SELECT run, trajectory FROM owners")
            while rows := cursor.fetchmany(1 << 16):
                presence.add(rows)
        except sqlite3.Error as exc:
            raise StorageError(f"trajectory owners table {self.path}: could not read its keys: {exc}") from exc
        return presence

    def _connect(self) -> sqlite3.Connection:
        assert self.path is not None
        db = None
        try:
            # check_same_thread off: the engine's lock serializes the lookups, from any thread
            db = sqlite3.connect(self.path, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            with db:
                db.execute(
                    "CREATE TABLE IF NOT EXISTS owners (run TEXT NOT NULL, trajectory TEXT NOT NULL, "
                    "identity TEXT NOT NULL, PRIMARY KEY (run, trajectory)) WITHOUT ROWID"
                )
        except sqlite3.Error as exc:
            if db is not None:
                db.close()
            # OperationalError is no damage (a permission, a full disk); other DatabaseErrors are
            if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
                raise CorruptionError(
                    f"trajectory owners table {self.path} does not open ({exc}): restore it from a backup of "
                    "the WAL directory; moving it aside forgets which identity owns each trajectory whose "
                    "WAL segments are gone"
                ) from exc
            raise StorageError(f"trajectory owners table {self.path} does not open: {exc}") from exc
        return db

    # -- helpers ----------------------------------------------------------------------------------

    def _trim(self) -> None:
        cache = self._cache
        while len(cache) > self.cache_size:
            cache.popitem(last=False)

    def _refuse(self, msg: Message, key: Key) -> None:
        """PermissionDeniedError: ``msg`` writes or links to ``key``, which another owns."""
        if key in trajectories(msg):
            raise PermissionDeniedError(
                f"trajectory {key[1]} of run {key[0]} was written by another identity; "
                "its records, seal and links are not yours to write"
            )
        link = next(x for x in msg.links if (x.run, x.source) == key)
        raise PermissionDeniedError(
            f"trajectory {link.trajectory} may not link to {link.source} v{link.policy_version}, which "
            "another identity wrote"
        )

    def _resolve(self, keys: list[Key]) -> dict[Key, str]:
        """The owners the table has for ``keys`` (none of them in memory), each key's answer cached
        (None: no owner). Only the keys its presence filter may hold are looked up: a query lets
        other threads take the GIL while the engine's lock is held, which cost ingest far more than
        the query itself."""
        presence = self._presence
        maybe = keys if presence is None else presence.maybe(keys)
        found = self._lookup(maybe) if maybe else {}
        cache = self._cache
        for key in keys:
            cache[key] = found.get(key)  # (not in the cache: added as the most recent)
        self._trim()
        return found

    def _lookup(self, keys: list[Key]) -> dict[Key, str]:
        """The owners the table has for ``keys`` (one query per run and 500 keys)."""
        if self._reader is None:
            self.open()
        db = self._reader
        assert db is not None
        self.lookups += len(keys)
        by_run: dict[str, list[str]] = {}
        for run, t in keys:
            by_run.setdefault(run, []).append(t)
        found: dict[Key, str] = {}
        try:
            for run, ts in by_run.items():
                for i in range(0, len(ts), 500):
                    part = ts[i : i + 500]
                    marks = ",".join("?" * len(part))  # placeholders only: the values are bound
                    query = f"SELECT trajectory, identity FROM owners WHERE run = ? AND trajectory IN ({marks})"
                    found.update(((run, t), str(who)) for t, who in db.execute(query, [run, *part]))
        except sqlite3.Error as exc:
            raise StorageError(f"trajectory owners table {self.path}: lookup failed: {exc}") from exc
        return found
