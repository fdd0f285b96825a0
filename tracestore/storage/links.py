"""LinkIndex: a run's prefix links and what each trajectory holds per version, to read through
links and to check every link followed against its source (the rules are in
:mod:`tracestore.storage.reader`)."""

from __future__ import annotations

from typing import Literal

from tracestore.errors import ConflictError, CorruptionError, MissingRecordsError, TraceStoreError
from tracestore.records import PrefixLink, TrajectorySeal
from tracestore.storage.manifest import Manifest

OnMissing = Literal["error", "mask"]


class LinkIndex:
    """The prefix links of one run and what each trajectory holds per version, to resolve reads
    through links and to check every link followed against its source (the rules:
    :mod:`tracestore.storage.reader`).

    ``add_manifest(path, m)`` indexes a manifest; :meth:`resolve` splits a trajectory's token
    range into the pieces each owner trajectory holds. ``extent[(trajectory, version)]``: the
    tokens a trajectory holds in a version (largest chunk end of any site, seal or own link);
    ``sealed[(trajectory, version)]``: its largest seal there.
    """

    def __init__(self, run: str) -> None:
        self.run = run
        self.links: dict[str, list[tuple[PrefixLink, str]]] = {}
        self.extent: dict[tuple[str, int], int] = {}
        self.sealed: dict[tuple[str, int], int] = {}

    def holds(self, trajectory: str, version: int, n_tokens: int) -> None:
        """Note that ``trajectory`` has something up to token ``n_tokens`` in ``version``."""
        key = (trajectory, version)
        if n_tokens > self.extent.get(key, 0):
            self.extent[key] = n_tokens

    def add_seal(self, seal: TrajectorySeal) -> None:
        key = (seal.trajectory, seal.policy_version)
        self.sealed[key] = max(self.sealed.get(key, 0), seal.n_tokens)
        self.holds(seal.trajectory, seal.policy_version, seal.n_tokens)

    def add_link(self, link: PrefixLink, where: str) -> None:
        self.links.setdefault(link.trajectory, []).append((link, where))
        self.holds(link.trajectory, link.policy_version, link.n_tokens)

    def add_manifest(self, path: str, m: Manifest) -> None:
        v = m.policy_version
        ends: dict[str, int] = {}
        for e in m.chunks:
            if e.token_end > ends.get(e.trajectory, 0):
                ends[e.trajectory] = e.token_end
        for t, end in ends.items():
            self.holds(t, v, end)
        for s in m.seals:
            self.add_seal(s)
        for x in m.links:
            self.add_link(x, path)

    def link(self, trajectory: str, vs: set[int]) -> tuple[PrefixLink, str] | None:
        """The link of ``trajectory`` a read of versions ``vs`` follows (newest version, longest)
        with its manifest's path; ConflictError when that version links it to two sources."""
        links = [(x, p) for x, p in self.links.get(trajectory, ()) if x.policy_version in vs]
        best = max(links, key=lambda xp: (xp[0].policy_version, xp[0].n_tokens), default=None)
        if best is not None:
            sources = {x.source for x, _ in links if x.policy_version == best[0].policy_version}
            if len(sources) > 1:
                raise ConflictError(
                    f"run {self.run} v{best[0].policy_version}: trajectory {trajectory} has prefix links to "
                    f"different sources {sorted(sources)}"
                )
        return best

    def describe(self, link: PrefixLink, where: str) -> str:
        return (
            f"prefix link {link.trajectory} -> {link.source} (run {self.run} v{link.policy_version}, "
            f"tokens [0, {link.n_tokens})) in manifest {where}"
        )

    def check(self, link: PrefixLink, where: str) -> TraceStoreError | None:
        """What is wrong with following ``link`` (an error to raise), or None."""
        key = (link.source, link.policy_version)
        have = self.extent.get(key, 0)
        if have == 0:
            return MissingRecordsError(
                f"{self.describe(link, where)}: its source {link.source} has no record, seal or link in "
                f"v{link.policy_version}"
            )
        sealed = self.sealed.get(key)
        if sealed is not None and link.n_tokens > sealed:
            return CorruptionError(
                f"{self.describe(link, where)}: its source {link.source} is sealed at {sealed} tokens"
            )
        if link.n_tokens > have:
            return MissingRecordsError(
                f"{self.describe(link, where)}: its source {link.source} holds only {have} tokens in "
                f"v{link.policy_version}"
            )
        return None

    def resolve(
        self, traj: str, a: int, b: int, vs: set[int], on_missing: OnMissing = "error"
    ) -> list[tuple[str | None, int, int]]:
        """Split tokens [a, b) of ``traj`` into (owner trajectory, lo, hi) pieces, following links
        (each checked, :meth:`check`); owner None: tokens behind a link whose source is missing,
        with ``on_missing="mask"`` (they are read as invalid)."""
        out: list[tuple[str | None, int, int]] = []
        todo: list[tuple[str, int, int, tuple[str, ...]]] = [(traj, a, b, (traj,))]
        while todo:
            t, lo, hi, path = todo.pop()
            found = self.link(t, vs)
            if found is None or lo >= found[0].n_tokens:
                out.append((t, lo, hi))
                continue
            link, where = found
            if link.source in path:
                cycle = " -> ".join((*path[path.index(link.source) :], link.source))
                raise CorruptionError(f"{self.describe(link, where)} forms a cycle {cycle}")
            cut = min(hi, link.n_tokens)
            problem = self.check(link, where)
            if problem is None:
                todo.append((link.source, lo, cut, (*path, link.source)))
            elif isinstance(problem, CorruptionError) or on_missing == "error":
                raise problem
            else:
                out.append((None, lo, cut))
            if hi > cut:
                todo.append((t, cut, hi, path))
        return sorted(out, key=lambda p: p[1])
