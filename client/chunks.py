"""From queued records to Write messages: the recorder's queue items, the trajectories it dropped,
the sender's end of the queue (:class:`Outbox`) and the one chunk builder (:class:`ChunkBuilder`).

The engine thread appends items to :attr:`Outbox.queue`; everything else here runs on the sender
thread (:mod:`tracestore.client.session`), under the recorder's lock where a method says so.
A chunk is a run of one (trajectory, site, policy version)'s rows with adjacent tokens and one
global scale; messages are cut at about ``batch_bytes``. Staged forwards reach the builder two
ways: split into pieces (prefills, and anything over shared memory that goes as offsets), or
whole, a window of decode steps gathered by one numpy copy per site (:meth:`ChunkBuilder.gather`).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import struct
import time
from collections import deque
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import numpy as np

from tracestore.checksum import chunk_checksum_parts
from tracestore.records import PrefixLink, RunSpec, SiteSpec, TrajectorySeal
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import inline_chunk_parts, link_to_pb, seal_to_pb

from .staging import StagingPool

log = logging.getLogger("tracestore.client")

_F32 = struct.Struct("<f")
_NBYTES = operator.attrgetter("nbytes")
_REF_STATE_LIMIT = 1 << 20  # entries per TraceRef bookkeeping dict of a recorder


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


@dataclasses.dataclass(frozen=True)
class SlabPlan:
    """A RecordSlab checked against the run: per site (name, SiteSpec, field), row bytes, rows per token."""

    fields: tuple[tuple[str, Any, Any], ...]
    row_bytes: int
    rows_per_token: int
    code_scale_bytes: int  # per row, summed over the sites: the payload before token scales

    def staged_bytes(self, rows: int) -> int:
        """Room for the raw rows and for the per-site layout made of them (64-byte aligned)."""
        lay = sum(-(-(rows * (f.code_bytes + f.scale_bytes + 4) + 4) // 64) * 64 for _, _, f in self.fields)
        return -(-max(rows * self.row_bytes, lay) // 64) * 64


@dataclasses.dataclass
class SlabForward(Forward):
    """A forward staged as raw RecordSlab rows (one copy per slab); the sender lays it out per site
    (:meth:`Outbox.unslab`) before anything else reads it. ``staged``: per slab, its plan, the
    staging offset of its rows and their count."""

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
    without a lock (set membership)."""

    def __init__(self, stats: dict[str, int]) -> None:
        self.ids: set[str] = set()
        self._why: dict[str, str] = {}
        self._unreported: dict[str, int] = {}
        self._stats = stats  # the recorder's counters: "unguided" counts them

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
            log.warning("%d trajectories unguided (%s), e.g. %s", len(new), reason, new[0])

    def why(self, trajectory: str) -> str:
        return self._why.get(trajectory, "refused")

    def forget(self, trajectory: str) -> None:
        self._why.pop(trajectory, None)

    def report(self, req: pb.WriteRequest) -> None:
        """Add the counts not yet reported to ``req`` (then they are reported)."""
        for reason, n in self._unreported.items():
            req.unguided.add(reason=reason, count=n)
        self._unreported = {}


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
        policy_version: Any,
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
        self._policy_version = policy_version  # () -> the recorder's current policy version
        self.batch_bytes = batch_bytes
        self.window_bytes = window_bytes
        self.linger_s = linger_s

    def ready(self, closing: bool) -> bool:
        """Whether there is something to send now (under the lock)."""
        return bool(self.queue) and not self._lingering(closing)

    def _lingering(self, closing: bool) -> bool:
        """Hold the queue back until it fills a window (or its oldest record is ``linger_s`` old) so
        consecutive decode steps coalesce into chunks of many tokens. Holding only up to
        ``batch_bytes`` sent every ~2 steps of a 256 x 20-site decode batch (~2 tokens per chunk:
        per-chunk work on both sides made the sidecar fall behind at 25 ms steps). A forward that
        does not coalesce (:meth:`coalesces`) goes at once."""
        queued = self.in_bytes - self._out_bytes
        if self.urgent or closing or queued >= self.window_bytes or not self.queue:
            return False
        first = self.queue[0]
        if isinstance(first, Forward) and not self.coalesces(first):
            return False
        born = first.queued if isinstance(first, Piece | Forward) else 0.0
        return time.monotonic() - born < self.linger_s

    def coalesces(self, fwd: Forward) -> bool:
        """Whether ``fwd`` waits to be coalesced with later forwards (:meth:`ChunkBuilder.gather`): a
        decode-like forward of at most ``batch_bytes``. One whose sequences are long (prefill) makes
        long chunks by itself and goes as it is (over shared memory: descriptors, no gather copy).
        Deciding by bytes alone made 6.3 MiB prefills with ``batch_bytes`` of 8 MiB linger for a 64
        MiB window and travel gathered, inline: 0.3 vs 1.0 GB/s in bench_ingest."""
        return fwd.nbytes <= self.batch_bytes and not fwd.long_segments

    def take(
        self, limit: int | None = None, fwds: list[Forward] | None = None
    ) -> tuple[list[Piece], list[TrajectorySeal | PrefixLink]]:
        """Take up to ``limit`` bytes off the queue (under the lock; callers keep appending
        meanwhile). With ``fwds``, forwards that coalesce (decode steps) go there whole, their
        bookkeeping done, for :meth:`ChunkBuilder.gather`; others are split into pieces."""
        limit = self.batch_bytes if limit is None else limit
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
                extras.append(item)
                size += 64
        return pieces, extras

    def unslab(self, fwd: SlabForward) -> SlabForward:
        """Lay a slab forward's raw rows out per site, as record_forward stages them: codes, scales,
        token scales when the site's rows carry different g (then g 1.0), g."""
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
                    add(Piece(t, name, version, a, n, region, off + row * cb, off + nc + row * sb,
                              ts0 + row * 4 if nt else -1, g_off, r * per, queued, g))  # fmt: skip
                row += r
        region.refs = len(pieces)
        if not pieces:
            self._pool.release(region.offset)
        return pieces

    def _seal(self, f: Finish) -> TrajectorySeal | None:
        known = self._sites_of.pop(f.trajectory, None)
        version = self.versions.pop(f.trajectory, self._policy_version())
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
        return lost

    def forget_unsealed(self) -> set[str]:
        """The trajectories recorded and not sealed yet, forgotten (under the lock)."""
        lost = set(self._sites_of)
        self._sites_of.clear()
        self.versions.clear()
        return lost


# -- the chunk builder ----------------------------------------------------------------------------


class ChunkBuilder:
    """Builds Write messages from staged rows: one chunk per run of rows (see the module docstring),
    each checksummed and spliced into the message (:func:`tracestore.wire.inline_chunk_parts`) or,
    over shared memory, sent as staging offsets; messages of about ``batch_bytes``."""

    def __init__(
        self, run_spec: RunSpec, writer: str, pool: StagingPool, npool: np.ndarray, batch_bytes: int, unguided: Unguided
    ) -> None:
        self.run = run_spec.run
        self.writer = writer
        self.batch_bytes = batch_bytes
        self._sites = {s.name: s for s in run_spec.sites}
        self._pool = pool
        self._np = npool
        self.unguided = unguided

    def runs(self, pieces: list[Piece]) -> list[list[Piece]]:
        """Coalesce pieces of one (trajectory, site, version) with adjacent tokens and the same
        global scale into runs, one chunk each: decode steps record one token per sequence, and a
        chunk per token costs ~75 us of sidecar CPU and a Parquet row (measured), so one chunk per
        run is what makes decode-heavy rollouts affordable. Order of first appearance is kept."""
        runs: list[list[Piece]] = []
        last: dict[tuple[str, str, int], list[Piece]] = {}
        for p in pieces:
            key = (p.trajectory, p.site, p.version)
            run = last.get(key)
            if run is not None:
                q = run[-1]
                if q.token_start + q.n_tokens == p.token_start and (q.ts_off < 0) == (p.ts_off < 0) and q.g == p.g:
                    run.append(p)
                    continue
            run = [p]
            runs.append(run)
            last[key] = run
        return runs

    def build(
        self, pieces: list[Piece], extras: Sequence[TrajectorySeal | PrefixLink], shm: bool
    ) -> Iterator[Outgoing]:
        """Messages of ``pieces`` (coalesced into runs), each as soon as it is full; seals and links
        ride in the last one (after the records they close). ``shm``: a piece that is a run by itself
        travels as offsets into the shared staging pool (a coalesced run is not contiguous: inline).
        The messages hold the pieces' staging until released."""
        fill = _Fill(self, (self._pool.name or "") if shm else None)
        view = self._pool.view
        for run in self.runs(pieces):
            p = run[0]
            site = self._sites[p.site]
            cb, sb, rpt = site.code_bytes, site.scale_bytes, site.rows_per_token
            has_ts = p.ts_off >= 0
            codes, scales, ts = [], [], []
            n_tokens = nbytes = 0
            for q in run:
                rows = q.n_tokens * rpt
                codes.append(view[q.codes_off : q.codes_off + rows * cb])
                scales.append(view[q.scales_off : q.scales_off + rows * sb])
                if has_ts:
                    ts.append(view[q.ts_off : q.ts_off + rows * 4])
                n_tokens += q.n_tokens
                nbytes += q.nbytes
            fill.add(
                p.version, p.trajectory, site, p.token_start, n_tokens, _F32.unpack(p.g)[0],
                codes, scales, ts if has_ts else None, nbytes, run, p if shm and len(run) == 1 else None,
            )  # fmt: skip
            if fill.done:
                yield from fill.take()
        fill.finish(extras)
        yield from fill.take()

    def gather(self, fwds: list[Forward]) -> list[Outgoing]:
        """Messages for whole forwards taken in order (decode steps), with the chunks :meth:`build`
        would make: rows of one (trajectory, version) with adjacent tokens and the same global
        scale form one chunk, across forwards and changes of the batch.

        The runs are found once per window over the segments, not per (segment, site); then per
        site one numpy gather puts every run's rows next to each other, so a chunk is one slice of
        it. Staging is released once the rows are gathered (the messages own copies).
        Trajectories unguided by now are skipped."""
        outs: list[Outgoing] = []
        i = 0
        while i < len(fwds):  # sub-windows of forwards with the same sites (and token-scale use)
            sig = [(x[0], x[5] > 0) for x in fwds[i].sites]
            j = i + 1
            while j < len(fwds) and [(x[0], x[5] > 0) for x in fwds[j].sites] == sig:
                j += 1
            outs += self._gather_window(fwds[i:j])
            i = j
        return outs

    def _gather_window(self, win: list[Forward]) -> list[Outgoing]:
        unguided = self.unguided.ids
        npool = self._np
        # runs: [trajectory, version, token_start, n_tokens, [(forward, window token offset, n)]]
        runs: list[list[Any]] = []
        last: dict[tuple[str, int], list[Any]] = {}
        base = 0
        for fi, f in enumerate(win):
            v = f.version
            for t, a, b in f.segs:
                a, n = int(a), int(b) - int(a)
                if t not in unguided:
                    r = last.get((t, v))
                    if r is not None and r[2] + r[3] == a:
                        r[3] += n
                        r[4].append((fi, base, n))
                    else:
                        r = last[(t, v)] = [t, v, a, n, [(fi, base, n)]]
                        runs.append(r)
                base += n
        fill = _Fill(self, None, win[0].queued)
        add = fill.add
        if runs:
            los = np.fromiter((lo for r in runs for _, lo, _ in r[4]), np.int64)
            lens = np.fromiter((n for r in runs for _, _, n in r[4]), np.int64)
            ends = np.cumsum(lens)
            perm = np.repeat(los - (ends - lens), lens) + np.arange(int(ends[-1]) if len(ends) else 0)
        for s_idx, (_, site, *_) in enumerate(win[0].sites if runs else ()):
            rpt = site.rows_per_token
            has_ts = win[0].sites[s_idx][5] > 0
            at = [f.sites[s_idx] for f in win]  # name, site, offset, nc, ns, nt, g_off
            codes = _gather_rows(npool, [(o, nc) for _, _, o, nc, _, _, _ in at], base, perm)
            scales = _gather_rows(npool, [(o + nc, ns) for _, _, o, nc, ns, _, _ in at], base, perm)
            ts = (
                _gather_rows(npool, [(o + nc + ns, nt) for _, _, o, nc, ns, nt, _ in at], base, perm)
                if has_ts
                else None
            )
            gb = [bytes(npool[x[6] : x[6] + 4]) for x in at]
            one_g = gb.count(gb[0]) == len(gb)
            tc, tsb, tt = rpt * site.code_bytes, rpt * site.scale_bytes, rpt * 4  # bytes per token
            per_token = tc + tsb + (tt if has_ts else 0)
            pos = 0
            for t, v, start, n_run, parts in runs:
                if one_g:
                    pieces = [(start, n_run, gb[0])]
                else:  # split where the global scale changes between forwards
                    pieces = []
                    for fi, _, n in parts:
                        if pieces and pieces[-1][2] == gb[fi]:
                            a0, n0, g0 = pieces[-1]
                            pieces[-1] = (a0, n0 + n, g0)
                        else:
                            pieces.append((start + sum(p[1] for p in pieces), n, gb[fi]))
                for a, n, g in pieces:
                    tb = [ts[pos * tt : (pos + n) * tt]] if ts is not None else None
                    add(
                        v, t, site, a, n, _F32.unpack(g)[0], [codes[pos * tc : (pos + n) * tc]],
                        [scales[pos * tsb : (pos + n) * tsb]], tb, n * per_token,
                    )  # fmt: skip
                    pos += n
                    if fill.chunks & 127 == 0:
                        time.sleep(0)  # let a waiting engine thread have the GIL (a window is ~50 ms of work)
        for f in win:
            self._pool.release(f.region.offset)
        fill.finish(())
        return fill.take()


class _Fill:
    """Messages being filled with chunks, in order, cut before a chunk that would take one past
    ``batch_bytes`` (a chunk is never split). The one place a chunk is made."""

    def __init__(self, builder: ChunkBuilder, shm_pool: str | None, born: float = float("inf")) -> None:
        self.b = builder
        self.run = builder.run
        self.limit = builder.batch_bytes
        self.shm_pool = shm_pool  # None: inline only
        self.born = born
        self.done: list[Outgoing] = []
        self.chunks = 0  # chunks added, over all messages
        self._open()

    def _open(self) -> None:
        req = pb.WriteRequest(run=self.run, writer=self.b.writer)
        if self.shm_pool is not None:
            req.shm_pool = self.shm_pool
            req.keeps_staging = True  # regions are kept until released_sequence covers them
        self.req = req
        self.payload: list[Any] = []
        self.pieces: list[Piece] = []
        self.trajs: set[str] = set()
        self.size = self.n = 0

    def add(
        self,
        version: int,
        trajectory: str,
        site: SiteSpec,
        token_start: int,
        n_tokens: int,
        g: float,
        codes: list[Any],
        scales: list[Any],
        ts: list[Any] | None,
        nbytes: int,
        pieces: list[Piece] | None = None,
        shm: Piece | None = None,
    ) -> None:
        """One chunk of ``n_tokens`` at ``token_start``, its payloads given as buffers that together
        form each field; ``pieces``: the staged pieces it is made of (the message holds them);
        ``shm``: send it as that piece's offsets into the shared pool instead of inline."""
        if self.size and self.size + nbytes > self.limit:
            self._cut(())
        cb, sb = site.code_bytes, site.scale_bytes
        crc = chunk_checksum_parts(
            self.run, version, trajectory, site.name, token_start, n_tokens, n_tokens * site.rows_per_token,
            cb, sb, codes, scales, g, ts,
        )  # fmt: skip
        head = pb.Chunk(
            policy_version=version, trajectory=trajectory, site=site.name, token_start=token_start,
            n_tokens=n_tokens, global_scale=g, has_token_scales=ts is not None, checksum=crc,
        )  # fmt: skip
        if shm is not None:  # descriptors only
            c = self.req.chunks.add()
            c.CopyFrom(head)
            c.shm.codes_offset = shm.codes_off
            c.shm.scales_offset = shm.scales_off
            c.shm.token_scales_offset = max(shm.ts_off, 0)
        else:  # payload straight from staging (or the gathered rows) into the wire bytes, at send time
            self.payload += inline_chunk_parts(head.SerializeToString(), codes, scales, ts)
        if pieces is not None:
            self.pieces += pieces
        self.trajs.add(trajectory)
        self.size += nbytes
        self.n += 1
        self.chunks += 1

    def finish(self, extras: Sequence[TrajectorySeal | PrefixLink]) -> None:
        """Close the last message, with ``extras`` (seals and links) in it."""
        if self.n or extras:
            self._cut(extras)

    def take(self) -> list[Outgoing]:
        done, self.done = self.done, []
        return done

    def _cut(self, extras: Sequence[TrajectorySeal | PrefixLink]) -> None:
        req = self.req
        for e in extras:
            if isinstance(e, TrajectorySeal):
                req.seals.append(seal_to_pb(e))
            else:
                req.links.append(link_to_pb(e))
            self.trajs.add(e.trajectory)
        self.b.unguided.report(req)
        self.done.append(Outgoing(0, req, self.pieces, self.trajs, self.size, self.payload, self.born, self.n))
        self._open()


def _gather_rows(pool: np.ndarray, spans: list[tuple[int, int]], n_tok: int, perm: np.ndarray) -> memoryview:
    """The staged bytes ``pool[o : o + n]`` of each forward, joined (``n_tok`` tokens in all, equal
    bytes per token) and reordered by token: ``perm`` lists the window tokens to keep, in order."""
    joined = np.concatenate([pool[o : o + n] for o, n in spans]).reshape(n_tok, -1)
    return np.take(joined, perm, axis=0).reshape(-1).data
