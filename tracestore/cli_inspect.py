"""``tracestore inspect URL``: summarize stored records, and ``--validate`` them (exit 1 on any problem).

The summary lists runs, policy versions, writers, shards, bytes, sites, tokens and seals. With
``--validate`` every shard is read in full: its whole-file crc32 against the manifest, every page
checksum and every chunk checksum; every sealed trajectory must have a record for every token of
every sealed site (except its final position, unrecorded by design). Any corrupt or missing
record is printed and the exit status is 1.

Example::

    tracestore inspect file://./tracestore-data --run run-1 --version 3 --trajectory t-17 --validate
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, TextIO

from tracestore.errors import TraceStoreError


def register(sub: argparse._SubParsersAction) -> None:
    from tracestore.cli import env_default

    p = sub.add_parser(
        "inspect",
        help="summarize stored records; --validate checks every checksum and sealed trajectory",
        description="Summarize a tracestore storage URL (sizes, sites, tokens, completeness). "
        "With --validate, read every shard and exit 1 on any corrupt or missing record. "
        "Env twins: TRACESTORE_RUN, TRACESTORE_VERSION, TRACESTORE_TRAJECTORY, "
        "TRACESTORE_STORAGE_OPTIONS, TRACESTORE_TIMEOUT.",
    )
    p.add_argument("url", help="storage URL, e.g. file://./tracestore-data or s3://bucket/prefix")
    p.add_argument("--run", default=env_default("--run", None), help="only this run")
    p.add_argument("--version", type=int, default=env_default("--version", None), help="only this policy version")
    p.add_argument("--trajectory", default=env_default("--trajectory", None), help="show one trajectory's coverage")
    p.add_argument("--validate", action="store_true", help="verify all checksums and seals; exit 1 on any problem")
    p.add_argument(
        "--storage-options",
        default=env_default("--storage-options", None),
        help='JSON object passed to fsspec untouched, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )
    p.add_argument("--timeout", type=float, default=float(env_default("--timeout", 60.0)), help="seconds per call")
    p.set_defaults(func=run)


def _ranges(tokens: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(tokens):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _fmt_ranges(r: list[tuple[int, int]]) -> str:
    s = ", ".join(f"[{a}, {b})" for a, b in r[:6])
    return s + (f", ... ({len(r)} ranges)" if len(r) > 6 else "")


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def validate_version(store: object, run: str, version: int, out: TextIO) -> int:
    """Verify every shard and sealed trajectory of one version; print problems, return their count."""
    from tracestore.fsutil import CountingFile
    from tracestore.plan import MicrobatchPlan
    from tracestore.reader import StoreReader
    from tracestore.records import crc32
    from tracestore.shards import open_parquet, read_entries
    from tracestore.store import Store

    if not isinstance(store, Store):
        raise TypeError("validate_version needs a Store")
    problems = 0
    for path in store.manifest_paths(run, version):
        try:
            m = store.read_manifest(path)
        except TraceStoreError as exc:
            print(f"CORRUPT {path}: {exc}", file=out)
            problems += 1
            continue
        if m.shard is None:
            continue
        where = f"{store.url}/{m.shard}"
        try:
            data = store.storage.cat(m.shard)
            if len(data) != m.shard_bytes or crc32(data) != m.shard_crc32:
                print(
                    f"CORRUPT shard {where}: {len(data)} B crc32 {crc32(data):#010x}, manifest says "
                    f"{m.shard_bytes} B crc32 {m.shard_crc32:#010x}",
                    file=out,
                )
                problems += 1
            import io

            pf = open_parquet(CountingFile(io.BytesIO(data)), where)
            read_entries(pf, m, list(m.chunks), where)
        except TraceStoreError as exc:
            print(f"CORRUPT {exc}", file=out)
            problems += 1
    reader = StoreReader(store, run)
    reader.refresh([version])
    seals: dict[str, Any] = {}
    for m in store.manifests(run, version):
        for s in m.seals:
            if s.trajectory not in seals or s.n_tokens > seals[s.trajectory].n_tokens:
                seals[s.trajectory] = s
    for traj, seal in sorted(seals.items()):
        try:
            res = reader.read(
                MicrobatchPlan([(traj, 0, seal.n_tokens)]),
                versions=[version],
                sites=seal.sites,
                on_missing="error",
                refresh=False,
            )
            del res
        except TraceStoreError as exc:
            print(f"MISSING sealed trajectory {traj}: {exc}", file=out)
            problems += 1
    return problems


def run(ns: argparse.Namespace) -> int:
    from tracestore.store import Store

    out = sys.stdout
    try:
        options = None
        if ns.storage_options:
            try:
                options = json.loads(ns.storage_options)
            except ValueError as exc:
                print(f"tracestore inspect: --storage-options is not JSON: {exc}", file=sys.stderr)
                return 2
        store = Store(ns.url, options, timeout=ns.timeout)
        runs = [ns.run] if ns.run else store.list_runs()
        if not runs:
            print(f"{ns.url}: no runs", file=out)
        problems = 0
        for run_id in runs:
            spec = store.get_run(run_id)
            versions = [ns.version] if ns.version is not None else store.list_versions(run_id)
            print(f"run {run_id}: {len(spec.sites)} sites, versions {versions}", file=out)
            for s in spec.sites:
                print(
                    f"  site {s.name}: {s.kind} layer {s.layer} width {s.width} {s.format} b={s.bits} "
                    f"rows/token {s.rows_per_token} ({s.code_bytes + s.scale_bytes} B/row)",
                    file=out,
                )
            for v in versions:
                problems += _summarize_version(store, run_id, v, ns.trajectory, out)
                if ns.validate:
                    n = validate_version(store, run_id, v, out)
                    print(f"  v{v}: validation {'OK' if n == 0 else f'FAILED ({n} problems)'}", file=out)
                    problems += n
        return 1 if (ns.validate and problems) else 0
    except TraceStoreError as exc:
        print(f"tracestore inspect: {exc}", file=sys.stderr)
        return 1


def _summarize_version(store: object, run_id: str, v: int, trajectory: str | None, out: TextIO) -> int:
    from tracestore.store import Store

    if not isinstance(store, Store):
        raise TypeError("needs a Store")
    manifests = store.manifests(run_id, v)
    writers = {m.writer for m in manifests}
    shard_bytes = sum(m.shard_bytes for m in manifests)
    payload = sum(e.nbytes for m in manifests for e in m.chunks)
    n_chunks = sum(len(m.chunks) for m in manifests)
    tokens: dict[str, dict[str, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
    for m in manifests:
        for e in m.chunks:
            tokens[e.trajectory][e.site].append((e.token_start, e.token_end))
    seals = {s.trajectory: s for m in manifests for s in m.seals}
    links = {x.trajectory: x for m in manifests for x in m.links}
    trajs = set(tokens) | set(seals) | set(links)
    site_tokens: dict[str, int] = defaultdict(int)
    for per_site in tokens.values():
        for site, rs in per_site.items():
            site_tokens[site] += sum(b - a for a, b in _ranges(rs))
    all_tokens = sum(site_tokens.values())
    per_token = f", {shard_bytes / max(1, max(site_tokens.values(), default=1)):.0f} B/token" if site_tokens else ""
    print(
        f"  v{v}: {len(writers)} writers, {len(manifests)} shards, {_bytes(shard_bytes)} on storage "
        f"({_bytes(payload)} payload), {n_chunks} chunks, {len(trajs)} trajectories "
        f"({len(seals)} sealed, {len(trajs) - len(seals)} open), {len(links)} prefix links, "
        f"{all_tokens} site-tokens{per_token}",
        file=out,
    )
    for site in sorted(site_tokens):
        print(f"    {site}: {site_tokens[site]} tokens", file=out)
    if trajectory is not None:
        seal = seals.get(trajectory)
        link = links.get(trajectory)
        print(
            f"  trajectory {trajectory} (v{v}): "
            + (f"sealed at {seal.n_tokens} tokens, sites {list(seal.sites)}" if seal else "not sealed")
            + (f"; tokens [0, {link.n_tokens}) linked to {link.source}" if link else ""),
            file=out,
        )
        for site, rs in sorted(tokens.get(trajectory, {}).items()):
            print(f"    {site}: {_fmt_ranges(_ranges(rs))}", file=out)
        if trajectory not in trajs:
            print(f"    no records, seal or link for {trajectory} in v{v}", file=out)
    return 0
