"""LinkIndex: a run's prefix links and what each trajectory holds per version, to read through
links and to check every link followed against its source and against the linked trajectory's
own records (the rules are in :mod:`tracestore.storage.reader`)."""

from __future__ import annotations

from typing import Literal, NamedTuple

from tracestore.errors import ConflictError, CorruptionError, MissingRecordsError, TraceStoreError
from tracestore.records import PrefixLink, TrajectorySeal
from tracestore.storage.manifest import Manifest

OnMissing = Literal["error", "mask"]


class _Own(NamedTuple):
    """A trajectory's lowest-starting own chunk in one version, and where it is."""

    token_start: int
    token_end: int
    site: str
    where: str
    writer: str


class LinkIndex:
    """The prefix links of one run and what each trajectory holds per version, to resolve reads
    through links and to check every link followed against its source and against the linked
    trajectory's own records, seals and writer (the rules: :mod:`tracestore.storage.reader`).

    ``add_manifest(path, m)`` indexes a manifest; :meth:`resolve` splits a trajectory's token range
    into the pieces each owner trajectory holds. ``extent[(trajectory, version)]``: the tokens a
    trajectory holds in a version (largest chunk end of any site, seal or own link);
    ``sealed[(trajectory, version)]``: its largest seal there. From manifests (not from bare
    :meth:`holds` calls) it also keeps, per trajectory and version, its lowest-starting own chunk
    (``own``) and the writers of its own chunks and seals (``writers``: (writer, what) -> a
    manifest), so that following a link costs a few dictionary lookups, never a look at rows.
    """

    def __init__(self, run: str) -> None:
        self.run = run
        self.links: dict[str, list[tuple[PrefixLink, str, str | None]]] = {}  # (link, manifest, writer)
        self.extent: dict[tuple[str, int], int] = {}
        self.sealed: dict[tuple[str, int], int] = {}
        self.own: dict[str, dict[int, _Own]] = {}
        self.writers: dict[str, dict[int, dict[tuple[str, str], str]]] = {}  # (writer, what) -> a manifest

    def holds(self, trajectory: str, version: int, n_tokens: int) -> None:
        """Note that ``trajectory`` has something up to token ``n_tokens`` in ``version``."""
        key = (trajectory, version)
        if n_tokens > self.extent.get(key, 0):
            self.extent[key] = n_tokens

    def _wrote(self, trajectory: str, version: int, writer: str, what: str, where: str | None) -> None:
        self.writers.setdefault(trajectory, {}).setdefault(version, {}).setdefault((writer, what), str(where))

    def add_seal(self, seal: TrajectorySeal, where: str | None = None, writer: str | None = None) -> None:
        key = (seal.trajectory, seal.policy_version)
        self.sealed[key] = max(self.sealed.get(key, 0), seal.n_tokens)
        self.holds(seal.trajectory, seal.policy_version, seal.n_tokens)
        if writer is not None:
            self._wrote(seal.trajectory, seal.policy_version, writer, "seal", where)

    def add_link(self, link: PrefixLink, where: str, writer: str | None = None) -> None:
        self.links.setdefault(link.trajectory, []).append((link, where, writer))
        self.holds(link.trajectory, link.policy_version, link.n_tokens)

    def add_manifest(self, path: str, m: Manifest) -> None:
        v = m.policy_version
        ends: dict[str, int] = {}
        firsts: dict[str, tuple[int, int, str]] = {}  # trajectory -> its lowest (token_start, token_end, site)
        for e in m.chunks:
            t = e.trajectory
            if e.token_end > ends.get(t, 0):
                ends[t] = e.token_end
            first = firsts.get(t)
            if first is None or e.token_start < first[0]:
                firsts[t] = (e.token_start, e.token_end, e.site)
        for t, end in ends.items():
            self.holds(t, v, end)
        for t, (a, b, site) in firsts.items():
            by_version = self.own.setdefault(t, {})
            old = by_version.get(v)
            if old is None or a < old.token_start:
                by_version[v] = _Own(a, b, site, path, m.writer)
            self._wrote(t, v, m.writer, "records", path)
        for s in m.seals:
            self.add_seal(s, path, m.writer)
        for x in m.links:
            self.add_link(x, path, m.writer)

    def link(self, trajectory: str, vs: set[int]) -> tuple[PrefixLink, str] | None:
        """The link of ``trajectory`` a read of versions ``vs`` follows (newest version, longest)
        with its manifest's path; ConflictError when the selected versions link it to two
        sources."""
        found = self._link(trajectory, vs)
        return None if found is None else (found[0], found[1])

    def _link(self, trajectory: str, vs: set[int]) -> tuple[PrefixLink, str, str | None] | None:
        links = [xpw for xpw in self.links.get(trajectory, ()) if xpw[0].policy_version in vs]
        best = max(links, key=lambda xpw: (xpw[0].policy_version, xpw[0].n_tokens), default=None)
        if best is not None:
            sources = {x.source for x, _, _ in links}
            if len(sources) > 1:
                each = "; ".join(
                    sorted({f"{self.describe(x, p)} (writer {w})" for x, p, w in links if x.source != best[0].source})
                )
                raise ConflictError(
                    f"{self.describe(best[0], best[1])} (writer {best[2]}): trajectory {trajectory} has prefix "
                    f"links to different sources {sorted(sources)} in versions {sorted(vs)}, also {each}; "
                    f"expected every link of {trajectory} in the versions read to name one source"
                )
        return best

    def describe(self, link: PrefixLink, where: str) -> str:
        return (
            f"prefix link {link.trajectory} -> {link.source} (run {self.run} v{link.policy_version}, "
            f"tokens [0, {link.n_tokens})) in manifest {where}"
        )

    def check_trajectory(self, link: PrefixLink, where: str, writer: str | None, vs: set[int]) -> ConflictError | None:
        """What is wrong with ``link`` against its own trajectory's records in versions ``vs``
        (an error to raise), or None. Records are stored once, under the source: a linked prefix
        holds no chunks of its own, and a link is written by the writer that records its
        trajectory (its chunks, seals and other links); the source may be another writer's."""
        t = link.trajectory
        overlap = [
            f"v{v} site {o.site} tokens [{o.token_start}, {o.token_end}) in manifest {o.where} (writer {o.writer})"
            for v, o in sorted(self.own.get(t, {}).items())
            if v in vs and o.token_start < link.n_tokens
        ]
        if overlap:
            return ConflictError(
                f"{self.describe(link, where)} (writer {writer}): trajectory {t} holds records of its own "
                f"overlapping tokens [0, {link.n_tokens}): " + "; ".join(overlap) + f"; expected none (the "
                f"records of a linked prefix are stored once, under its source {link.source})"
            )
        if writer is None:
            return None
        others = [
            f"{what} in manifest {p} (v{v}) by writer {w}"
            for v, ws in sorted(self.writers.get(t, {}).items())
            if v in vs
            for (w, what), p in ws.items()
            if w != writer
        ]
        others += sorted(
            {
                f"{self.describe(x, p)} by writer {w}"
                for x, p, w in self.links.get(t, ())
                if w is not None and w != writer and x.policy_version in vs
            }
        )
        if others:
            return ConflictError(
                f"{self.describe(link, where)} was written by writer {writer}, but trajectory {t}'s "
                + "; ".join(others)
                + f"; expected the link to come from the writer that records {t}"
            )
        return None

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
        (each checked against its trajectory, :meth:`check_trajectory`, always an error, and its
        source, :meth:`check`); owner None: tokens behind a link whose source is missing, with
        ``on_missing="mask"`` (they are read as invalid)."""
        out: list[tuple[str | None, int, int]] = []
        todo: list[tuple[str, int, int, tuple[str, ...]]] = [(traj, a, b, (traj,))]
        while todo:
            t, lo, hi, path = todo.pop()
            found = self._link(t, vs)
            if found is None or lo >= found[0].n_tokens:
                out.append((t, lo, hi))
                continue
            link, where, writer = found
            if link.source in path:
                cycle = " -> ".join((*path[path.index(link.source) :], link.source))
                raise CorruptionError(f"{self.describe(link, where)} forms a cycle {cycle}")
            conflict = self.check_trajectory(link, where, writer, vs)
            if conflict is not None:
                raise conflict
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
