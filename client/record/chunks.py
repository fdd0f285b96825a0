"""From staged rows to Write messages: the one chunk builder (:class:`ChunkBuilder`), on the
sender thread. A chunk is a run of one (trajectory, site, policy version)'s rows with adjacent
tokens and one global scale; messages are cut at about ``batch_bytes``. Staged forwards reach the
builder two ways: split into pieces (prefills, and anything over shared memory that goes as
offsets), or whole, a window of decode steps gathered by one numpy copy per site
(:meth:`ChunkBuilder.gather`)."""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from tracestore.checksum import ChunkKey, chunk_checksum
from tracestore.formats import sane_global_scale
from tracestore.identity import TokenLedger
from tracestore.records import PrefixLink, RunSpec, SiteSpec, TrajectorySeal
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import inline_chunk_parts, link_to_pb, seal_to_pb

from .items import Forward, Outgoing, Piece, Unguided
from .staging import StagingPool

_F32 = struct.Struct("<f")

# -- the chunk builder ----------------------------------------------------------------------------


class ChunkBuilder:
    """Builds Write messages from staged rows: one chunk per run of rows (see the module docstring),
    each checksummed and spliced into the message (:func:`tracestore.wire.inline_chunk_parts`) or,
    over shared memory, sent as staging offsets; messages of about ``batch_bytes``."""

    def __init__(
        self,
        run_spec: RunSpec,
        writer: str,
        pool: StagingPool,
        npool: np.ndarray,
        batch_bytes: int,
        unguided: Unguided,
        ledger: TokenLedger | None = None,
    ) -> None:
        self.run = run_spec.run
        self.ledger = TokenLedger() if ledger is None else ledger  # token ids: each chunk's identity
        self.writer = writer
        self.batch_bytes = batch_bytes
        self._sites = {s.name: s for s in run_spec.sites}
        self._pool = pool
        self._np = npool
        self.unguided = unguided

    def runs(self, pieces: list[Piece]) -> list[list[Piece]]:
        """Coalesce pieces of one (trajectory, site, version) with adjacent tokens and the same
        global scale into runs, one chunk each: decode steps record one token per sequence, and a
        chunk per token costs sidecar CPU and a Parquet row, so one chunk per run is what makes
        decode-heavy rollouts affordable. Order of first appearance is kept."""
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
        ride in the last one (after the records they close). ``shm``: a piece that is a run by
        itself travels as offsets into the shared staging pool (a coalesced run is not contiguous:
        inline). The messages hold the pieces' staging until released."""
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
        bases = []  # each forward's first token in the window
        for fi, f in enumerate(win):
            bases.append(base)
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
            moves = _moves(bases, base, perm)
        # Every site's rows are gathered first (one copy each, out of staging), then staging is
        # released, then the chunks are made: the engine may stage new forwards meanwhile.
        gathered = []
        for s_idx, (_, site, *_) in enumerate(win[0].sites if runs else ()):
            at = [f.sites[s_idx] for f in win]  # name, site, offset, nc, ns, nt, g_off
            codes = _gather_rows(npool, [(o, nc) for _, _, o, nc, _, _, _ in at], moves)
            scales = _gather_rows(npool, [(o + nc, ns) for _, _, o, nc, ns, _, _ in at], moves)
            ts = (
                _gather_rows(npool, [(o + nc + ns, nt) for _, _, o, nc, ns, nt, _ in at], moves)
                if win[0].sites[s_idx][5] > 0
                else None
            )
            gathered.append((site, codes, scales, ts, [bytes(npool[x[6] : x[6] + 4]) for x in at]))
            time.sleep(0)  # a site's copies hold the GIL: the engine thread may want it between them
        for f in win:
            self._pool.release(f.region.offset)
        for site, codes, scales, ts, gb in gathered:
            rpt = site.rows_per_token
            has_ts = ts is not None
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
        self._sane: dict[float, float] = {}  # g -> sane_global_scale(g); a NaN adds an entry each time
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
        sane = self._sane.get(g)
        if sane is None:  # 0, negative or not finite: 1 (docs/numerics.md §3), as the trainer uses it
            sane = self._sane[g] = sane_global_scale(g)  # (an np.errstate per call: once per g)
        g = sane
        ledger = self.b.ledger
        ids = ledger.crc(trajectory, token_start + n_tokens) if ledger else None
        rows = n_tokens * site.rows_per_token
        key = ChunkKey(self.run, version, trajectory, site.name, token_start, n_tokens, rows, cb, sb, g, ids)
        crc = chunk_checksum(key, codes, scales, ts)
        head = pb.Chunk(
            policy_version=version, trajectory=trajectory, site=site.name, token_start=token_start,
            n_tokens=n_tokens, global_scale=g, has_token_scales=ts is not None, checksum=crc,
            ids_crc=ids,
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


def _moves(bases: list[int], n_tok: int, perm: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Where the window tokens to keep (``perm``, in order) come from: each one's forward and its
    token index in that forward (``bases``: each forward's first token in the window, ``n_tok``
    tokens in all), and each forward's token count."""
    starts = np.asarray(bases, np.int64)
    sizes = np.diff(np.append(starts, n_tok)).tolist()
    fidx = np.searchsorted(starts, perm, side="right") - 1
    return fidx, perm - starts[fidx], sizes


def _gather_rows(
    pool: np.ndarray, spans: list[tuple[int, int]], moves: tuple[np.ndarray, np.ndarray, list[int]]
) -> memoryview:
    """The staged bytes ``pool[o : o + n]`` of each forward (``spans``; equal bytes per token), the
    tokens kept in window order as :func:`_moves` says, in one gather out of staging: the pool seen
    as rows of a token's bytes starting at every byte, indexed by each token's offset."""
    fidx, loc, sizes = moves
    if not len(fidx):
        return memoryview(b"")
    f0 = int(fidx[0])
    width = spans[f0][1] // sizes[f0]
    starts = np.fromiter((o for o, _ in spans), np.int64, len(spans))
    rows = as_strided(pool, shape=(pool.size - width + 1, width), strides=(1, 1), writeable=False)
    return rows[starts[fidx] + loc * width].reshape(-1).data
