"""What this sidecar has accepted per key: the index that turns resends into no-ops and refuses
conflicting bytes.

A key holds one value: a chunk's tokens of one (run, policy version, trajectory, site), a
trajectory's seal, a trajectory's prefix link. :meth:`DedupeIndex.check` drops the chunks of a
message that were accepted before with the same bytes (a writer's retry) and refuses
(:class:`ConflictError`) one that overlaps accepted tokens with different bytes, or a seal or link
that differs from the accepted one, and (:class:`ValidationError`) a chunk that reaches past its
trajectory's seal, in the same message or an earlier one. With authentication on, a trajectory also
belongs to the identity that first wrote it (:meth:`DedupeIndex.check_owner`; the owners are
``owners.py``'s).

Memory stays bounded on a long-running sidecar: the index keeps the newest ``versions`` distinct
policy versions of each run and forgets older ones (they are no longer written). Trajectory owners
are kept apart from that window (a caller chooses the versions it writes, so four messages in new
versions would otherwise have dropped every owner of the run): per (run, trajectory), whatever the
version, in the sidecar's owners table, with the :data:`MAX_OWNED_TRAJECTORIES` most recently
written or looked up in memory (:class:`~tracestore.server.engine.owners.TrajectoryOwners`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tracestore.server.engine.message import Message
from tracestore.server.engine.owners import TrajectoryOwners, trajectories

from tracestore.errors import ConflictError, ValidationError
from tracestore.records import RecordChunk

Span = tuple[int, int, int]  # token_start, token_end, chunk checksum
# Trajectory owners kept in memory (least recently used forgotten first; with an owners table they
# are looked up there again): ~200 bytes each, ~50 MiB. A trajectory is written for minutes; this
# many outlive every trajectory a sidecar has in flight.
MAX_OWNED_TRAJECTORIES = 1 << 18


class DedupeIndex:
    """Chunks, seals, links and trajectory owners seen per (run, policy version, trajectory[,
    site]); the owners' table is at ``owners_path`` (None: memory only). Not thread-safe: the engine
    calls it with its lock held."""

    def __init__(self, versions: int, owners_path: Path | None = None) -> None:
        self.versions = versions
        # (run, version, trajectory, site) -> sorted [(start, end, checksum)] of chunks seen
        self._index: dict[tuple[str, int, str, str], list[Span]] = {}
        self._seals: dict[tuple[str, int, str], tuple[int, tuple[str, ...]]] = {}
        self._links: dict[tuple[str, int, str], tuple[str, int]] = {}
        self._open: set[tuple[str, str]] = set()  # (run, trajectory) with records and no seal
        self._sealed: set[tuple[str, str]] = set()
        self._versions: dict[str, list[int]] = {}  # per run: distinct policy versions with dedupe state
        # (run, trajectory) -> identity whose writer first wrote it, in any version (with authentication on)
        self.owners = TrajectoryOwners(owners_path, MAX_OWNED_TRAJECTORIES)

    @property
    def open_trajectories(self) -> int:
        """Trajectories with records and no seal."""
        return len(self._open)

    def check_owner(self, msg: Message, identity: str) -> None:
        """``identity`` may write the trajectories ``msg`` names and link to their sources."""
        self.owners.check(msg, identity)

    def open_claims(self) -> list[tuple[str, str, str]]:
        """(run, trajectory, identity) of every open trajectory (records, no seal) whose owner is in
        memory: what a WAL segment's header keeps (the owners table has the others)."""
        known = ((run, t, self.owners.known((run, t))) for run, t in self._open)
        return [(run, t, identity) for run, t, identity in known if identity is not None]

    def restore_claims(self, claims: Iterable[tuple[str, str, str]]) -> None:
        """Replay of a CLAIMS entry: those trajectories are those identities' (first claim wins)."""
        for run, t, identity in claims:
            self.owners.claim([(run, t)], identity)
            if (run, t) not in self._sealed:
                self._open.add((run, t))

    def restore_owners(self, msg: Message, identity: str | None) -> None:
        """Replay of a DATA entry, committed or not: the trajectories ``msg`` writes are its
        writer's owner's, ``identity`` (None: written with authentication off, nothing claimed),
        unless someone owns them already."""
        if identity is not None:
            self.owners.claim(trajectories(msg), identity)

    def check(self, msg: Message) -> None:
        """Refuse ``msg`` (ConflictError) if it writes different bytes under a key seen before;
        drop from it the chunks seen before with the same bytes (identical resends)."""
        fresh: list[RecordChunk] = []
        fresh_crcs: list[int] = []
        batch: dict[tuple[str, int, str, str], list[Span]] = {}
        ends = {(x.run, x.policy_version, x.trajectory): x.n_tokens for x in msg.seals}
        for c, crc in zip(msg.chunks, msg.crcs, strict=True):
            key = (c.run, c.policy_version, c.trajectory, c.site)
            sealed = self._seals.get(key[:3])
            end = ends.get(key[:3], sealed[0] if sealed is not None else None)
            if end is not None and c.token_end > end:
                raise ValidationError(
                    f"{c.key_str}: tokens [{c.token_start}, {c.token_end}) reach past the trajectory's seal "
                    f"(n_tokens={end}); a sealed trajectory has no token at or past n_tokens"
                )
            span = (c.token_start, c.token_end, crc)
            same = False
            for spans in (self._index.get(key, []), batch.get(key, [])):
                i = bisect.bisect_left(spans, (c.token_start, -1, -1))
                for s, e, k in spans[max(0, i - 1) : i + 2]:
                    if s < c.token_end and c.token_start < e:
                        if (s, e, k) == span:
                            same = True
                        else:
                            raise ConflictError(
                                f"{c.key_str}: overlaps tokens [{s}, {e}) already written with different bytes; "
                                "a key holds one value (resend identical bytes, or use a new policy version)"
                            )
            if not same:
                bisect.insort(batch.setdefault(key, []), span)
                fresh.append(c)
                fresh_crcs.append(crc)
        for seal in msg.seals:
            prev = self._seals.get((seal.run, seal.policy_version, seal.trajectory))
            if prev is not None and prev != (seal.n_tokens, seal.sites):
                raise ConflictError(
                    f"trajectory {seal.trajectory} v{seal.policy_version} is already sealed with "
                    f"n_tokens={prev[0]} sites={list(prev[1])}, got n_tokens={seal.n_tokens}"
                )
        for link in msg.links:
            prevl = self._links.get((link.run, link.policy_version, link.trajectory))
            if prevl is not None and prevl != (link.source, link.n_tokens):
                raise ConflictError(
                    f"trajectory {link.trajectory} v{link.policy_version} already links to {prevl[0]} "
                    f"for {prevl[1]} tokens, got {link.source} for {link.n_tokens}"
                )
        msg.chunks, msg.crcs = fresh, fresh_crcs  # identical resends of single chunks are dropped here

    def remember(self, msg: Message, identity: str | None = None) -> tuple[int, int]:
        """Record what ``msg`` writes (and, with ``identity``, that its trajectories are that
        identity's unless another one wrote them first). Returns how many trajectories it sealed
        for the first time, and the site-tokens accepted earlier that those seals cut (at or past
        their n_tokens: stored, never read as valid)."""
        if identity is not None:
            self.owners.claim(trajectories(msg), identity)  # the first writer's, now the most recent
        for c, crc in zip(msg.chunks, msg.crcs, strict=True):
            self._see_version(c.run, c.policy_version)
            bisect.insort(
                self._index.setdefault((c.run, c.policy_version, c.trajectory, c.site), []),
                (c.token_start, c.token_end, crc),
            )
            if (c.run, c.trajectory) not in self._sealed:
                self._open.add((c.run, c.trajectory))
        sealed = past = 0
        for s in msg.seals:
            self._see_version(s.run, s.policy_version)
            if (s.run, s.policy_version, s.trajectory) not in self._seals:
                past += self._tokens_past(s.run, s.policy_version, s.trajectory, s.sites, s.n_tokens)
            self._seals[(s.run, s.policy_version, s.trajectory)] = (s.n_tokens, s.sites)
            if (s.run, s.trajectory) not in self._sealed:
                self._sealed.add((s.run, s.trajectory))
                sealed += 1
            self._open.discard((s.run, s.trajectory))
        for link in msg.links:
            self._see_version(link.run, link.policy_version)
            self._links[(link.run, link.policy_version, link.trajectory)] = (link.source, link.n_tokens)
        return sealed, past

    def _tokens_past(self, run: str, version: int, trajectory: str, sites: Iterable[str], end: int) -> int:
        """Site-tokens accepted for a trajectory at or past ``end`` (its seal's n_tokens)."""
        return sum(
            max(0, e - max(s, end))
            for site in sites
            for s, e, _ in self._index.get((run, version, trajectory, site), ())
        )

    def _see_version(self, run: str, version: int) -> None:
        """Keep state for the newest ``versions`` policy versions of a run only."""
        versions = self._versions.setdefault(run, [])
        i = bisect.bisect_left(versions, version)
        if i < len(versions) and versions[i] == version:
            return
        versions.insert(i, version)
        if len(versions) <= self.versions:
            return
        # Distinct versions, not arithmetic on the newest one: a single message with version 2**62
        # once dropped the state of every real version and let conflicting bytes in.
        del versions[: len(versions) - self.versions]
        floor = versions[0]
        stores: tuple[dict[Any, Any], ...] = (self._index, self._seals, self._links)
        for d in stores:
            for key in [k for k in d if k[0] == run and k[1] < floor]:
                del d[key]
        # trajectories of dropped versions are neither open nor remembered as sealed
        live = {k[2] for k in self._index if k[0] == run} | {k[2] for k in self._seals if k[0] == run}
        self._open = {k for k in self._open if k[0] != run or k[1] in live}
        self._sealed = {k for k in self._sealed if k[0] != run or k[1] in live}
