"""One version's manifests for ``tracestore inspect``: loaded as columns, what their chunks cover,
and whether every sealed trajectory is complete.

Completeness comes from the manifests alone (``--validate`` verifies the chunks themselves in
:mod:`tracestore.cli.verify`): every sealed trajectory must have a record for every token of every
sealed site (except its final position, unrecorded by design), following its prefix links. Only
trajectories whose chunks overlap within a version are read once more, to compare the
overlapping bytes.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from tracestore.errors import CorruptionError, TraceStoreError


@dataclasses.dataclass
class _Coverage:
    """What the chunks of one version cover, per (trajectory, site): merged token intervals."""

    intervals: dict[tuple[str, str], tuple[list[int], list[int]]]  # sorted, disjoint starts / ends
    overlapping: set[tuple[str, str]]  # chunks overlap without being the same chunk twice
    ends: dict[str, int]  # largest token end of any site, per trajectory


class VersionRecords:
    """The manifests of one (run, version) as columns; ``corrupt``: (path, message) of those that
    do not load. ``on_manifest(m)`` is called for each manifest as soon as it is loaded."""

    def __init__(self, store: Any, run: str, version: int, on_manifest: Callable[[Any], None] | None = None) -> None:
        from tracestore.storage.manifest import ManifestColumns, shard_name

        self.run, self.version = run, version
        self.manifests: list[ManifestColumns] = []
        self.corrupt: list[tuple[str, str]] = []
        for path in store.manifest_paths(run, version):
            try:
                m = ManifestColumns.from_json(store.storage.cat(path), where=f"{store.url}/{path}")
                writer = path.split("/")[-2]
                if (m.run, m.policy_version, m.writer, f"{shard_name(m.seq)}.manifest.json") != (
                    run,
                    version,
                    writer,
                    path.rsplit("/", 1)[-1],
                ):
                    raise CorruptionError(
                        f"manifest {path} describes run {m.run} v{m.policy_version} {m.writer}/{m.seq}"
                    )
            except TraceStoreError as exc:
                self.corrupt.append((path, str(exc)))
                continue
            self.manifests.append(m)
            if on_manifest is not None:
                on_manifest(m)
        self._coverage: _Coverage | None = None

    @property
    def seals(self) -> dict[str, Any]:
        """The largest seal of each trajectory."""
        out: dict[str, Any] = {}
        for m in self.manifests:
            for s in m.seals:
                if s.trajectory not in out or s.n_tokens > out[s.trajectory].n_tokens:
                    out[s.trajectory] = s
        return out

    def coverage(self) -> _Coverage:
        if self._coverage is None:
            self._coverage = self._cover()
        return self._coverage

    def _cover(self) -> _Coverage:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        ms = [m for m in self.manifests if len(m)]
        if not ms:
            return _Coverage({}, set(), {})
        traj = pc.dictionary_encode(pa.chunked_array([m.trajectory for m in ms]).combine_chunks())
        site = pc.dictionary_encode(pa.chunked_array([m.site for m in ms]).combine_chunks())
        t = traj.indices.to_numpy().astype(np.int64)
        s = site.indices.to_numpy().astype(np.int64)
        start = np.concatenate([m.token_start for m in ms])
        end = start + np.concatenate([m.n_tokens for m in ms])
        crc = np.concatenate([m.checksum for m in ms])
        tnames, snames = traj.dictionary.to_pylist(), site.dictionary.to_pylist()
        pair = t * len(snames) + s
        if len(pair) and int(pair.max()) < 1 << 31 and int(start.max()) < 1 << 32:
            order = np.argsort((pair << 32) | start, kind="stable")  # one int64 key: ~5x faster than lexsort
        else:  # pragma: no cover - billions of pairs or tokens
            order = np.lexsort((start, pair))
        t, s, start, end, crc, pair = t[order], s[order], start[order], end[order], crc[order], pair[order]
        first = np.ones(len(pair), bool)
        first[1:] = pair[1:] != pair[:-1]
        group = np.cumsum(first) - 1
        big = np.int64(1) << 40  # token indices are far below it
        reach = np.maximum.accumulate(group * big + end) - group * big  # running max end within each pair
        prev = np.empty_like(reach)
        prev[0] = 0
        prev[1:] = reach[:-1]
        new = first | (start > prev)  # an interval starts here (after a gap or at the pair's start)
        overlap = ~first & (start < prev)
        # a chunk that repeats the one before it (same tokens, same checksum) is the same chunk
        # again; any other overlap, even with a repeat between, is compared byte for byte
        same = np.zeros(len(pair), bool)
        same[1:] = (start[1:] == start[:-1]) & (end[1:] == end[:-1]) & (crc[1:] == crc[:-1]) & ~first[1:]
        overlapping = {(tnames[t[i]], snames[s[i]]) for i in np.flatnonzero(overlap & ~same).tolist()}
        heads = np.flatnonzero(new)
        lasts = np.append(heads[1:] - 1, len(pair) - 1)
        intervals: dict[tuple[str, str], tuple[list[int], list[int]]] = {}
        for i, a, b in zip(heads.tolist(), start[heads].tolist(), reach[lasts].tolist(), strict=True):
            key = (tnames[t[i]], snames[s[i]])
            starts, ends = intervals.setdefault(key, ([], []))
            starts.append(a)
            ends.append(b)
        t_first = np.flatnonzero(np.r_[True, t[1:] != t[:-1]])  # (sorted by trajectory first)
        max_end = np.maximum.reduceat(end, t_first)
        ends_of = {tnames[i]: e for i, e in zip(t[t_first].tolist(), max_end.tolist(), strict=True)}
        return _Coverage(intervals, overlapping, ends_of)

    def links(self) -> Any:
        """A :class:`~tracestore.storage.reader.LinkIndex` of this version (links, seals, extents)."""
        from tracestore.storage.reader import LinkIndex

        index = LinkIndex(self.run)
        for t, end in self.coverage().ends.items():
            index.holds(t, self.version, end)
        for m in self.manifests:  # with their writers: a link must come from its trajectory's
            for seal in m.seals:
                index.add_seal(seal, m.where, m.writer)
            for link in m.links:
                index.add_link(link, m.where, m.writer)
        return index


def _missing(cov: _Coverage, owner: str, site: str, lo: int, hi: int) -> list[tuple[int, int]]:
    """The token ranges of [lo, hi) that no chunk of ``owner``'s ``site`` covers."""
    starts, ends = cov.intervals.get((owner, site), ([], []))
    out = []
    at = lo
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while at < hi and i < len(starts):
        if ends[i] <= at:
            i += 1
            continue
        if starts[i] > at:
            out.append((at, min(starts[i], hi)))
        at = max(at, ends[i])
        i += 1
    if at < hi:
        out.append((at, hi))
    return out


def _ranges(tokens: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(tokens):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def check_sealed(store: Any, v: VersionRecords, out: TextIO) -> int:
    """Every sealed trajectory has a record for every token of every sealed site (its final
    position excepted), through its prefix links; from the manifests, reading only where chunks
    of one version overlap (their bytes must agree)."""
    from tracestore.plan import MicrobatchPlan
    from tracestore.storage.reader import StoreReader

    seals = v.seals
    if not seals:
        return 0
    cov = v.coverage()
    links = v.links()
    problems = 0
    reader: StoreReader | None = None
    for traj, seal in sorted(seals.items()):
        try:
            pieces = links.resolve(traj, 0, seal.n_tokens, {v.version}, "error")
        except TraceStoreError as exc:
            print(f"MISSING sealed trajectory {traj}: {exc}", file=out)
            problems += 1
            continue
        missing = []
        overlaps = False
        for site in seal.sites:
            bad: list[tuple[int, int]] = []
            for owner, lo, hi in pieces:
                assert owner is not None  # on_missing="error" raises instead
                overlaps = overlaps or (owner, site) in cov.overlapping
                bad += _missing(cov, owner, site, lo, hi)
            bad = [(a, min(b, seal.n_tokens - 1)) for a, b in _ranges(bad) if a < seal.n_tokens - 1]
            if bad:
                spans = ", ".join(f"[{a}, {b})" for a, b in bad[:8])
                missing.append(f"trajectory {traj} site {site} tokens {spans}")
        if missing:
            more = f" (and {len(missing) - 20} more)" if len(missing) > 20 else ""
            msg = f"run {v.run} versions [{v.version}]: no record for " + "; ".join(missing[:20]) + more
            print(f"MISSING sealed trajectory {traj}: {msg}", file=out)
            problems += 1
            continue
        if overlaps:  # chunks of one version overlap: a read compares their bytes
            try:
                if reader is None:
                    reader = StoreReader(store, v.run)
                    reader.refresh([v.version])
                reader.read(
                    MicrobatchPlan([(traj, 0, seal.n_tokens)]),
                    versions=[v.version],
                    sites=seal.sites,
                    on_missing="error",
                    refresh=False,
                )
            except TraceStoreError as exc:
                print(f"MISSING sealed trajectory {traj}: {exc}", file=out)
                problems += 1
    if reader is not None:
        reader.close()
    return problems
