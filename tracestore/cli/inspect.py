"""``tracestore inspect URL``: summarize stored records, and ``--validate`` them (exit 1 on any problem).

The summary lists runs, policy versions, writers, shards, bytes, sites, tokens and seals. With
``--validate`` every manifest's checksum is verified and every shard is read in full: its
whole-file crc32 against the manifest, every page checksum, every key column and every chunk's
byte lengths and checksum; every sealed trajectory must have a record for every token of every
sealed site (except its final position, unrecorded by design), following its prefix links, each
checked against its source. Any corrupt or missing record is printed and the exit status is 1.
``--json`` prints one JSON object (runs, versions, sizes, sites, tokens, problems) instead.

Exit status: 0 records found (and, with ``--validate``, all valid); 1 ``--validate`` found a
problem, or storage failed; 2 a usage or configuration error; 3 nothing there: the location does
not exist or holds no runs, or the ``--run``/``--policy-version`` asked for is not stored.

Validation works on whole columns, never one Python object per chunk: the shards are verified
``--jobs`` at a time, in worker processes too for a large version (:mod:`tracestore.cli.verify`),
while this process loads the manifests and checks every sealed trajectory's completeness from
them (:mod:`tracestore.cli.coverage`).

Example::

    tracestore inspect file://./tracestore-data --run run-1 --policy-version 3 --trajectory t-17 --validate
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections import defaultdict
from typing import Any, TextIO

from tracestore.cli import JSON_OBJECT, SWITCH, Setting, add_settings, integer, number, optional, text
from tracestore.cli.coverage import VersionRecords, check_sealed
from tracestore.cli.verify import PARALLEL_MIN_BYTES, Verifier, VerifyWorkers, job_count
from tracestore.errors import TraceStoreError, ValidationError

NOTHING = 3
"""Exit status when nothing is there (no location, no runs, or not the run/version asked for)."""

SETTINGS = (
    Setting("--run", optional(text("a run id")), None, "only this run", metavar="RUN"),
    Setting(
        "--policy-version",
        optional(integer(0)),
        None,
        "only this policy version",
        metavar="N",
        deprecated=("--version",),
    ),
    Setting("--trajectory", optional(text("a trajectory id")), None, "show one trajectory's coverage", metavar="ID"),
    Setting("--validate", SWITCH, False, "verify all checksums and seals; exit 1 on any problem", switch=True),
    Setting("--json", SWITCH, False, "print one JSON object instead of the summary", switch=True),
    Setting(
        "--jobs",
        integer(0),
        0,
        "shards verified at once, by this process and jobs-1 worker processes (0: one per core)",
    ),
    Setting(
        "--storage-options",
        JSON_OBJECT,
        None,
        'JSON object passed to fsspec untouched, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
        secret=True,
        show="none",
        metavar="JSON",
    ),
    Setting("--timeout", number(gt=0), 60.0, "seconds per storage call", metavar="SECONDS"),
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="summarize stored records; --validate checks every checksum and sealed trajectory",
        description="Summarize a tracestore storage URL (sizes, sites, tokens, completeness). "
        "With --validate, read every shard and exit 1 on any corrupt or missing record. Exit status: 0 records "
        "found (and valid), 1 problems found or storage failed, 2 usage or configuration error, 3 nothing there "
        "(no such location, no runs, or not the --run/--policy-version asked for). Settings: flag, else "
        "TRACESTORE_<FLAG>, else the [inspect] table of a --config file.",
    )
    p.add_argument("url", help="storage URL, e.g. file://./tracestore-data or s3://bucket/prefix")
    add_settings(p, "inspect", SETTINGS)
    p.set_defaults(func=run)


def _fmt_ranges(r: list[tuple[int, int]]) -> str:
    s = ", ".join(f"[{a}, {b})" for a, b in r[:6])
    return s + (f", ... ({len(r)} ranges)" if len(r) > 6 else "")


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


# ---------------------------------------------------------------------------- validation


def validate_version(
    store: object,
    run: str,
    version: int,
    out: TextIO,
    *,
    jobs: int | None = None,
    parallel_min_bytes: int = PARALLEL_MIN_BYTES,
    loaded: VersionRecords | None = None,
    verifier: Verifier | None = None,
) -> int:
    """Verify every manifest, shard and sealed trajectory of one version; print problems, return
    their count. ``jobs``: shards verified at once, by this process and ``jobs - 1`` worker
    processes when the version holds ``parallel_min_bytes`` or more (default: one per core);
    ``loaded``/``verifier``: the version already loaded with its shards submitted as they loaded
    (what :func:`run` does)."""
    from tracestore.storage.store import Store

    if not isinstance(store, Store):
        raise TypeError("validate_version needs a Store")
    own: list[VerifyWorkers] = []
    n = job_count(jobs)

    def workers() -> VerifyWorkers:
        own.append(VerifyWorkers(n - 1))
        return own[0]

    try:
        if verifier is None:
            verifier = Verifier(store, run, version, workers if n > 1 else None, parallel_min_bytes)
        if loaded is None:
            loaded = VersionRecords(store, run, version, verifier.submit)
        problems = 0
        for path, msg in loaded.corrupt:
            print(f"CORRUPT {path}: {msg}", file=out)
            problems += 1
        try:
            problems += check_sealed(store, loaded, out)
        finally:
            for p in verifier.problems():
                print(f"CORRUPT {p}", file=out)
                problems += 1
    finally:
        for w in own:
            w.close()
    return problems


# ---------------------------------------------------------------------------- the command


class _Nothing(Exception):
    """Nothing there: exit status :data:`NOTHING`."""


def run(ns: argparse.Namespace) -> int:
    from tracestore.cli import resolve
    from tracestore.storage.store import Store

    resolve(ns)
    report: dict[str, Any] = {"url": ns.url, "runs": [], "ok": True}
    out: TextIO = io.StringIO() if ns.json else sys.stdout
    started: list[VerifyWorkers] = []
    rc = 0
    try:
        store = Store(ns.url, ns.storage_options, timeout=ns.timeout)
        jobs = job_count(ns.jobs)

        def workers() -> VerifyWorkers:  # started once, for the first version large enough; then shared
            if not started:
                started.append(VerifyWorkers(jobs - 1))
            return started[0]

        stored_runs = store.list_runs()
        if not stored_runs:
            there = store.storage.exists("")
            raise _Nothing("holds no tracestore runs" if there else "nothing there (no such location)")
        if ns.run is not None and ns.run not in stored_runs:
            _check_run_id(ns.run)
            raise _Nothing(f"no run {ns.run!r} (runs: {', '.join(stored_runs[:20])})")
        problems = 0
        for run_id in [ns.run] if ns.run is not None else stored_runs:
            spec = store.get_run(run_id)
            stored = store.list_versions(run_id)
            if ns.policy_version is not None and ns.policy_version not in stored:
                raise _Nothing(f"run {run_id} has no policy version {ns.policy_version} (versions: {stored})")
            versions = [ns.policy_version] if ns.policy_version is not None else stored
            entry: dict[str, Any] = {"run": run_id, "sites": [], "versions": []}
            report["runs"].append(entry)
            print(f"run {run_id}: {len(spec.sites)} sites, versions {versions}", file=out)
            for s in spec.sites:
                entry["sites"].append(
                    {
                        "name": s.name,
                        "kind": s.kind,
                        "layer": s.layer,
                        "width": s.width,
                        "format": s.format,
                        "bits": s.bits,
                        "rows_per_token": s.rows_per_token,
                        "row_bytes": s.code_bytes + s.scale_bytes,
                    }
                )
                print(
                    f"  site {s.name}: {s.kind} layer {s.layer} width {s.width} {s.format} b={s.bits} "
                    f"rows/token {s.rows_per_token} ({s.code_bytes + s.scale_bytes} B/row)",
                    file=out,
                )
            for v in versions:
                verifier = Verifier(store, run_id, v, workers if jobs > 1 else None) if ns.validate else None
                loaded = VersionRecords(store, run_id, v, None if verifier is None else verifier.submit)
                summary: dict[str, Any] = {}
                try:
                    summary = _version_summary(loaded, ns.trajectory)
                    entry["versions"].append(summary)
                    _print_version(summary, out)
                finally:
                    if verifier is not None:
                        lines = io.StringIO()
                        n = validate_version(store, run_id, v, lines, loaded=loaded, verifier=verifier)
                        out.write(lines.getvalue())
                        summary["validation"] = {"ok": n == 0, "problems": lines.getvalue().splitlines()}
                        print(f"  v{v}: validation {'OK' if n == 0 else f'FAILED ({n} problems)'}", file=out)
                        problems += n
        if ns.validate and problems:
            report["ok"], rc = False, 1
    except _Nothing as exc:
        report.update(ok=False, nothing=str(exc))
        print(f"tracestore inspect: {ns.url}: {exc}", file=sys.stderr)
        rc = NOTHING
    except ValidationError as exc:
        report.update(ok=False, error=str(exc))
        print(f"tracestore inspect: {exc}", file=sys.stderr)
        rc = 2
    except TraceStoreError as exc:
        report.update(ok=False, error=str(exc))
        print(f"tracestore inspect: {exc}", file=sys.stderr)
        rc = 1
    finally:
        for w in started:
            w.close()
    if ns.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    return rc


def _check_run_id(run: str) -> None:
    """A --run that is no valid run id is a usage error (exit 2), not 'nothing there'."""
    from tracestore.records import validate_id

    validate_id("run", run)


def _version_summary(v: VersionRecords, trajectory: str | None) -> dict[str, Any]:
    """What ``inspect`` reports of one version, as plain JSON values."""
    ms = v.manifests
    shard_bytes = sum(m.shard_bytes for m in ms)
    cov = v.coverage()
    seals = v.seals
    links = {x.trajectory: x for m in ms for x in m.links}
    trajs = set(cov.ends) | set(seals) | set(links)
    site_tokens: dict[str, int] = defaultdict(int)
    per_traj: dict[str, list[list[int]]] = {}
    for (t, site), (starts, ends) in cov.intervals.items():
        site_tokens[site] += sum(b - a for a, b in zip(starts, ends, strict=True))
        if t == trajectory:
            per_traj[site] = [[a, b] for a, b in zip(starts, ends, strict=True)]
    out: dict[str, Any] = {
        "version": v.version,
        "writers": len({m.writer for m in ms}),
        "shards": len(ms),
        "shard_bytes": shard_bytes,
        "payload_bytes": sum(int(m.nbytes.sum()) for m in ms),
        "chunks": sum(len(m) for m in ms),
        "trajectories": len(trajs),
        "sealed": len(seals),
        "open": len(trajs) - len(seals),
        "prefix_links": len(links),
        "site_tokens": dict(sorted(site_tokens.items())),
        "bytes_per_token": shard_bytes / max(1, max(site_tokens.values())) if site_tokens else None,
        "corrupt_manifests": [{"path": path, "error": msg} for path, msg in v.corrupt],
    }
    if trajectory is not None:
        seal, link = seals.get(trajectory), links.get(trajectory)
        out["trajectory"] = {
            "id": trajectory,
            "present": trajectory in trajs,
            "sealed_tokens": seal.n_tokens if seal else None,
            "sealed_sites": list(seal.sites) if seal else None,
            "link": {"tokens": link.n_tokens, "source": link.source} if link else None,
            "coverage": dict(sorted(per_traj.items())),
        }
    return out


def _print_version(d: dict[str, Any], out: TextIO) -> None:
    all_tokens = sum(d["site_tokens"].values())
    per_token = f", {d['bytes_per_token']:.0f} B/token" if d["bytes_per_token"] is not None else ""
    corrupt = f", {len(d['corrupt_manifests'])} manifests that do not load" if d["corrupt_manifests"] else ""
    print(
        f"  v{d['version']}: {d['writers']} writers, {d['shards']} shards, {_bytes(d['shard_bytes'])} on storage "
        f"({_bytes(d['payload_bytes'])} payload), {d['chunks']} chunks, {d['trajectories']} trajectories "
        f"({d['sealed']} sealed, {d['open']} open), {d['prefix_links']} prefix links, "
        f"{all_tokens} site-tokens{per_token}{corrupt}",
        file=out,
    )
    for site, n in d["site_tokens"].items():
        print(f"    {site}: {n} tokens", file=out)
    t = d.get("trajectory")
    if t is not None:
        link = t["link"]
        print(
            f"  trajectory {t['id']} (v{d['version']}): "
            + (
                f"sealed at {t['sealed_tokens']} tokens, sites {t['sealed_sites']}"
                if t["sealed_tokens"] is not None
                else "not sealed"
            )
            + (f"; tokens [0, {link['tokens']}) linked to {link['source']}" if link else ""),
            file=out,
        )
        for site, rs in t["coverage"].items():
            print(f"    {site}: {_fmt_ranges([(a, b) for a, b in rs])}", file=out)
        if not t["present"]:
            print(f"    no records, seal or link for {t['id']} in v{d['version']}", file=out)
