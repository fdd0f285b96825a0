"""The sender's end of the recorder's queue (:class:`Outbox`): the engine thread appends items to
:attr:`Outbox.queue`; the sender thread (:mod:`tracestore.client.record.session`) lays out slab
rows, splits forwards into pieces or keeps decode steps whole, resolves seals in queue order and
holds small forwards back to coalesce them, under the recorder's lock where a method says so."""

from __future__ import annotations

import operator
import struct
import time
from collections import deque

import numpy as np

from tracestore.identity import TokenLedger
from tracestore.records import PrefixLink, RunSpec, TrajectorySeal

from .items import (
    Finish,
    Forward,
    Item,
    Outgoing,
    Piece,
    Region,
    SlabForward,
    Unguided,
)
from .staging import StagingPool

_F32 = struct.Struct("<f")
_NBYTES = operator.attrgetter("nbytes")

# -- the sender's end of the queue -----------------------------------------------------------------


class Outbox:
    """The recorder's queue of items and what the sender thread does with them before building:
    lay out slab rows, split forwards into pieces (or keep decode steps whole for
    :meth:`ChunkBuilder.gather`), resolve seals (their sites and version, in queue order) and hold
    small forwards back to coalesce them.

    The engine thread appends to :attr:`queue` (``deque.append`` is atomic: it never waits for a
    lock the sender holds) and adds the payload bytes to :attr:`in_bytes`; every method runs on the
    sender thread, the recorder's lock held where it says so."""

    def __init__(
        self,
        run_spec: RunSpec,
        pool: StagingPool,
        npool: np.ndarray,
        unguided: Unguided,
        policy_version: int,
        *,
        batch_bytes: int,
        window_bytes: int,
        linger_s: float,
    ) -> None:
        self.queue: deque[Item] = deque()
        self.in_bytes = 0  # bytes record_forward queued (written by the engine thread only)
        self._out_bytes = 0  # bytes taken off the queue
        self.urgent = False  # send now, do not linger (a flush waits)
        self.versions: dict[str, int] = {}  # trajectory -> policy version of its last forward
        self._sites_of: dict[str, frozenset[str]] = {}  # trajectory -> sites recorded (for its seal)
        self._names: dict[tuple[str, ...], frozenset[str]] = {}
        self._run = run_spec.run
        self._sites = {s.name: s for s in run_spec.sites}
        self._pool = pool
        self._np = npool
        self._unguided = unguided
        # the recorder's current policy version (RolloutRecorder.policy_version reads and sets it):
        # a value, not a callback into the recorder, so the recorder is in no reference cycle and
        # its staging pool is freed when the last reference goes (not at some later cyclic
        # collection)
        self.policy_version = int(policy_version)
        self.batch_bytes = batch_bytes
        self.window_bytes = window_bytes
        self.linger_s = linger_s
        # token ids per trajectory for the chunks' identity (ChunkBuilder reads it); sealed ones are
        # forgotten at the next take, once the chunks taken with their seal are built
        self.ledger = TokenLedger()
        self._retired: list[str] = []

    def ready(self, closing: bool) -> bool:
        """Whether there is something to send now (under the lock)."""
        return bool(self.queue) and not self._lingering(closing)

    def _lingering(self, closing: bool) -> bool:
        """Hold the queue back until it fills a window (or its oldest record is ``linger_s`` old) so
        consecutive decode steps coalesce into chunks of many tokens (per-chunk work on both
        sides is what a sidecar falls behind on). A forward that does not coalesce
        (:meth:`coalesces`) goes at once."""
        queued = self.in_bytes - self._out_bytes
        if self.urgent or closing or queued >= self.window_bytes or not self.queue:
            return False
        first = self.queue[0]
        if isinstance(first, Forward) and not self.coalesces(first):
            return False
        born = first.queued if isinstance(first, Piece | Forward) else 0.0
        return time.monotonic() - born < self.linger_s

    def coalesces(self, fwd: Forward) -> bool:
        """Whether ``fwd`` waits to be coalesced with later forwards (:meth:`ChunkBuilder.gather`):
        a decode-like forward (short sequences) of at most half a window, whatever its bytes (a wide
        model's decode step is larger than ``batch_bytes``; sent alone, each of its tokens would be
        a chunk per site). One whose sequences are long (prefill) makes long chunks by itself and
        goes as it is (over shared memory: descriptors, no gather copy), however few bytes it has."""
        return not fwd.long_segments and 2 * fwd.nbytes <= self.window_bytes

    def take(
        self, limit: int | None = None, fwds: list[Forward] | None = None
    ) -> tuple[list[Piece], list[TrajectorySeal | PrefixLink]]:
        """Take up to ``limit`` bytes off the queue (under the lock; callers keep appending
        meanwhile). With ``fwds``, forwards that coalesce (decode steps) go there whole, their
        bookkeeping done, for :meth:`ChunkBuilder.gather`; others are split into pieces."""
        limit = self.batch_bytes if limit is None else limit
        if self._retired:
            for t in self._retired:
                self.ledger.forget(t)
            self._retired.clear()
        pieces: list[Piece] = []
        extras: list[TrajectorySeal | PrefixLink] = []
        size = 0
        queue = self.queue
        unguided = self._unguided.ids
        while queue and size < limit:
            item = queue.popleft()
            if type(item) is SlabForward:
                item = self.unslab(item)
            if fwds is not None and isinstance(item, Forward) and self.coalesces(item):
                if size and size + item.nbytes > limit:
                    queue.appendleft(item)
                    break
                self._note(item)
                self._out_bytes += item.nbytes
                fwds.append(item)
                size += item.nbytes
                continue
            if isinstance(item, Forward):
                expanded = self.expand(item)
                got = sum(map(_NBYTES, expanded))
                if size + got <= limit:  # all of it fits: no round trip through the queue
                    self._out_bytes += item.nbytes
                    pieces += expanded
                    size += got
                    continue
                # the pieces carry the bytes from here on (segments dropped as unguided do not)
                self._out_bytes += item.nbytes - got
                queue.extendleft(reversed(expanded))
                continue
            if isinstance(item, Piece):
                self._out_bytes += item.nbytes
                if item.trajectory in unguided:
                    self._unref(item.region)
                    continue
                pieces.append(item)
                size += item.nbytes
            elif isinstance(item, Finish):
                seal = self._seal(item)
                if seal is not None:
                    extras.append(seal)
                    size += 64
            else:
                if item.trajectory in unguided:
                    continue
                if self.ledger and isinstance(item, PrefixLink):
                    self.ledger.link(item.trajectory, item.source, item.n_tokens)
                extras.append(item)
                size += 64
        return pieces, extras

    def unslab(self, fwd: SlabForward) -> SlabForward:
        """Lay a slab forward's raw rows out per site, as record_forward stages them: codes, scales,
        token scales when the site's rows carry different g (then g 1.0), g. Once: the layout
        overwrites the raw rows in place, so a forward laid out and put back on the queue (it did
        not fit a window) is returned as it is."""
        if not fwd.staged:  # laid out already
            return fwd
        region = fwd.region
        if region.event is not None:
            region.event.synchronize()
            region.event = None
        npool = self._np
        sites = []
        extra = 0
        for plan, off, rows in fwd.staged:
            rb = plan.row_bytes
            raw = npool[off : off + rows * rb].reshape(rows, rb).copy()
            o = off
            for name, site, f in plan.fields:
                nc, ns = rows * f.code_bytes, rows * f.scale_bytes
                cs, ss = slice(f.codes, f.codes + f.code_bytes), slice(f.scales, f.scales + f.scale_bytes)
                npool[o : o + nc].reshape(rows, f.code_bytes)[:] = raw[:, cs]
                npool[o + nc : o + nc + ns].reshape(rows, f.scale_bytes)[:] = raw[:, ss]
                g = np.ascontiguousarray(raw[:, f.g : f.g + 4])
                nt = 0
                if rows > 1 and not (g.view(np.uint32) == g[0].view(np.uint32)).all():
                    nt = rows * 4  # one g per row: the rows' token scales, the chunk's g 1.0
                    npool[o + nc + ns : o + nc + ns + nt] = g.reshape(-1)
                    g = np.frombuffer(_F32.pack(1.0), np.uint8)
                g_off = o + nc + ns + nt
                npool[g_off : g_off + 4] = g.reshape(-1)[:4]
                sites.append((name, site, o, nc, ns, nt, g_off))
                extra += nt
                o += -(-(nc + ns + nt + 4) // 64) * 64
        fwd.sites = sites
        fwd.staged = []
        fwd.nbytes += extra
        self._out_bytes -= extra  # the token scales were not counted in in_bytes
        return fwd

    def _note(self, fwd: Forward) -> None:
        """Wait for a forward's copies and note its trajectories' sites and version (for seals)."""
        region = fwd.region
        if region.event is not None:
            region.event.synchronize()
            region.event = None
        trajs = [t for t, _, _ in fwd.segs]
        names = tuple(name for name, *_ in fwd.sites)
        fs = self._names.get(names)
        if fs is None:
            fs = self._names[names] = frozenset(names)
        sites_of = self._sites_of
        prev = {t: sites_of[t] for t in trajs if sites_of.get(t, fs) is not fs}
        sites_of.update(dict.fromkeys(trajs, fs))
        for t, old in prev.items():
            sites_of[t] = old | fs
        self.versions.update(dict.fromkeys(trajs, fwd.version))
        ids = fwd.ids
        if ids is not None:
            at = 0
            for t, a, b in fwd.segs:
                n = int(b) - int(a)
                self.ledger.note(t, int(a), ids[at : at + n])
                at += n
        elif self.ledger:  # positions recorded without ids: what the ledger knows of them is stale
            for t in trajs:
                self.ledger.lose(t)

    def expand(self, fwd: Forward) -> list[Piece]:
        """A forward's pieces, one per (segment, site) of a trajectory not unguided."""
        self._note(fwd)
        region = fwd.region
        pieces: list[Piece] = []
        unguided = self._unguided.ids
        view = self._pool.view
        segs = [(t, int(a), int(b) - int(a)) for t, a, b in fwd.segs]
        for name, site, off, nc, ns, nt, g_off in fwd.sites:
            g = bytes(view[g_off : g_off + 4])
            cb, sb, rpt = site.code_bytes, site.scale_bytes, site.rows_per_token
            per = cb + sb + (4 if nt else 0)
            row = 0
            version, queued, add = fwd.version, fwd.queued, pieces.append
            ts0 = off + nc + ns
            for t, a, n in segs:
                r = n * rpt
                if t not in unguided:
                    add(
                        Piece(
                            t,
                            name,
                            version,
                            a,
                            n,
                            region,
                            off + row * cb,
                            off + nc + row * sb,
                            ts0 + row * 4 if nt else -1,
                            g_off,
                            r * per,
                            queued,
                            g,
                        )
                    )
                row += r
        region.refs = len(pieces)
        if not pieces:
            self._pool.release(region.offset)
        return pieces

    def _seal(self, f: Finish) -> TrajectorySeal | None:
        known = self._sites_of.pop(f.trajectory, None)
        version = self.versions.pop(f.trajectory, self.policy_version)
        if self.ledger:
            self._retired.append(f.trajectory)
        if f.n_tokens < 0 or f.trajectory in self._unguided.ids:
            return None
        names = f.sites if f.sites is not None else tuple(sorted(known or self._sites))
        return TrajectorySeal(self._run, version, f.trajectory, f.n_tokens, names)

    def queued_since(self) -> list[float]:
        """When each record still queued was queued."""
        queued = list(self.queue)  # one C call: atomic against callers appending
        return [p.queued for p in queued if isinstance(p, Piece | Forward)]

    def release(self, out: Outgoing) -> None:
        """Release the staging a message holds (under the lock)."""
        for p in out.pieces:
            self._unref(p.region)

    def _unref(self, region: Region) -> None:
        region.refs -= 1
        if region.refs == 0:
            self._pool.release(region.offset)

    def drop(self) -> set[str]:
        """Drop every queued item, releasing its staging; return their trajectories (under the lock)."""
        lost: set[str] = set()
        while self.queue:
            item = self.queue.popleft()
            if isinstance(item, Forward):
                lost.update(t for t, _, _ in item.segs)
                if item.region.event is not None:  # a device copy may still be landing there
                    item.region.event.synchronize()
                self._pool.release(item.region.offset)
                self._out_bytes += item.nbytes
                continue
            lost.add(item.trajectory)
            if isinstance(item, Finish):
                self._sites_of.pop(item.trajectory, None)
                self.versions.pop(item.trajectory, None)
            if isinstance(item, Piece):
                self._out_bytes += item.nbytes
                self._unref(item.region)
        for t in lost:
            self.ledger.forget(t)
        return lost

    def forget_unsealed(self) -> set[str]:
        """The trajectories recorded and not sealed yet, forgotten (under the lock)."""
        lost = set(self._sites_of)
        self._sites_of.clear()
        self.versions.clear()
        self.ledger.clear()
        return lost
