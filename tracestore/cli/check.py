"""``tracestore check URL --refs refs.jsonl`` (or ``--plan plan.json --run RUN``): fail-loud alignment check.

For every trajectory (a TraceRef's stored id, or a plan segment) and every site it reports
``recorded`` tokens (a record was read), ``unrecorded_final`` (the final position of a sealed
trajectory, unrecorded by design), ``missing`` tokens (no record, not the final position),
``wrong_version`` tokens (a record of another policy version than the ref's, or than the
trajectory's seal for a plan; refs are read across every stored version, newest winning, as a
step mixing versions reads them) and ``via_links`` tokens (served through prefix links, each link
checked against its source by the reader). Refs are first checked against their seals: run, a seal
of the stored id in the ref's version, its token count and its site set
(:func:`tracestore.traceref.check_refs`). Unguided refs are listed (their rows train with
RTN) and are not misalignment.

With ``--tokens FILE`` (JSON lines ``{"trajectory": stored id, "token_ids": [...]}``, each
trajectory's input token ids from position 0, as the trainer will see them) every record that
carries its token identity is also checked against them (:mod:`tracestore.identity`): per site
``misaligned`` counts the tokens of records made for other token ids, and ``identity`` says how
many chunks were verified, carried no identity or could not be checked. Without it the identity
is not checked (the report says so).

Artifact sites (docs/data-model.md "Artifacts") count as recorded where a row is stored, and per
site ``artifact_valid`` counts those flagged valid; for a run with ``routed_experts`` sites,
``artifacts`` gives the run's coverage over the tokens checked: tokens with valid routing at every
MoE layer read, tokens with an FP4 record at every FP4 site read, and tokens with both.

Exit status: 0 when everything is aligned, 1 on any misalignment (a ref problem, a missing,
wrong-version or misaligned token, a read error such as a corrupt shard or a failing prefix link),
2 on usage errors. ``--json`` prints one JSON object instead of the table.

Example::

    tracestore check file://./tracestore-data --refs step-17.refs.jsonl
    tracestore check s3://bucket/trace --run run-1 --plan rank3.plan.json --json
    tracestore check file://./tracestore-data --refs step-17.refs.jsonl --tokens step-17.tokens.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from tracestore.cli import JSON_OBJECT, SWITCH, Kind, Setting, add_settings, integer, optional, text
from tracestore.errors import ConfigError, TraceStoreError


def _csv(what: str, item: Callable[[str], Any]) -> Kind:
    """A comma-separated list (a TOML array in a config file) of ``item``s."""

    def parse(raw: Any) -> list[Any]:
        parts = raw.split(",") if isinstance(raw, str) else raw if isinstance(raw, list) else None
        if not parts:
            raise ValueError
        out = [item(p.strip() if isinstance(p, str) else p) for p in parts]
        if any(v is None or v == "" for v in out):
            raise ValueError
        return out

    return Kind(what, parse)


def _version(raw: Any) -> int:
    return int(integer(0).parse(raw))


def _site(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError
    return raw


SETTINGS = (
    Setting(
        "--refs",
        optional(text("a JSON-lines file of TraceRefs, or '-'")),
        None,
        "JSON-lines file of TraceRefs ('-': standard input); this or --plan",
        show="none",
        metavar="FILE",
    ),
    Setting(
        "--plan",
        optional(text("a JSON plan file")),
        None,
        'JSON file of a plan: [[trajectory, token_start, token_end], ...] or {"segments": [...]} '
        "(null trajectory: padding); this or --refs",
        show="none",
        metavar="FILE",
    ),
    Setting(
        "--tokens",
        optional(text("a JSON-lines file of token ids")),
        None,
        'JSON-lines file of {"trajectory": id, "token_ids": [...]}: check each record\'s token identity',
        show="none",
        metavar="FILE",
    ),
    Setting(
        "--run", optional(text("a run id")), None, "the run (required with --plan)", show="the refs' run", metavar="RUN"
    ),
    Setting(
        "--versions",
        optional(_csv("comma-separated policy versions (integers >= 0)", _version)),
        None,
        "comma-separated policy versions a --plan reads",
        show="all",
        metavar="V,...",
    ),
    Setting(
        "--sites",
        optional(_csv("comma-separated site names", _site)),
        None,
        "comma-separated sites to check",
        show="all of the run's",
        metavar="SITE,...",
    ),
    Setting("--json", SWITCH, False, "print one JSON object instead of the table", switch=True),
    Setting(
        "--storage-options",
        JSON_OBJECT,
        None,
        "JSON object passed to fsspec untouched",
        secret=True,
        show="none",
        metavar="JSON",
    ),
)

_RANK = {"flag": 3, "env": 2, "file": 1, "default": 0}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="check TraceRefs or a plan against storage; exit 1 on any misalignment",
        description="Report, per trajectory and site, tokens with records, the final positions "
        "(unrecorded by design), missing tokens, tokens of a wrong policy version and tokens served "
        "through prefix links; exit 1 on any misalignment. Give --refs or --plan. Settings: flag, else "
        "TRACESTORE_<FLAG>, else the [check] table of a --config file.",
    )
    p.add_argument("url", help="storage URL, e.g. file://./tracestore-data or s3://bucket/prefix")
    add_settings(p, "check", SETTINGS)
    p.set_defaults(func=run)


def source(ns: argparse.Namespace) -> tuple[str | None, str | None]:
    """(refs, plan) of resolved ``ns``, exactly one set: of --refs and --plan the one from the
    higher source (flag > variable > file) wins; both from the same source, or neither, is a usage
    error."""
    refs, plan = ns.refs, ns.plan
    if refs is None and plan is None:
        raise ConfigError("give --refs FILE or --plan FILE (or TRACESTORE_REFS, TRACESTORE_PLAN, [check] refs/plan)")
    if refs is not None and plan is not None:
        r, p = _RANK[ns._sources["refs"]], _RANK[ns._sources["plan"]]
        if r == p:
            raise ConfigError(f"--refs and --plan both given ({ns._sources['refs']}): give one")
        return (refs, None) if r > p else (None, plan)
    return refs, plan


def _load_refs(path: str) -> list[Any]:
    from tracestore.traceref import read_jsonl

    if path == "-":
        return read_jsonl(sys.stdin)
    return read_jsonl(path)


def _load_tokens(path: str) -> dict[str, list[int]]:
    """``{trajectory: token ids}`` of a JSON-lines file (``-``: standard input)."""
    out: dict[str, list[int]] = {}
    f = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            if (
                not isinstance(d, dict)
                or not isinstance(d.get("trajectory"), str)
                or not isinstance(d.get("token_ids"), list)
            ):
                raise ValueError(f'{path} line {i}: expected {{"trajectory": "...", "token_ids": [...]}}')
            out[d["trajectory"]] = d["token_ids"]
    finally:
        if f is not sys.stdin:
            f.close()
    return out


def _load_plan(path: str) -> list[tuple[str | None, int, int]]:
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    segs = d.get("segments") if isinstance(d, dict) else d
    if not isinstance(segs, list):
        raise ValueError(f"{path}: expected a list of [trajectory, token_start, token_end] or {{'segments': [...]}}")
    return [(s[0], int(s[1]), int(s[2])) for s in segs]


def check(
    url: str,
    *,
    refs: Sequence[Any] | None = None,
    plan: Sequence[tuple[str | None, int, int]] | None = None,
    run: str | None = None,
    versions: Sequence[int] | None = None,
    sites: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    tokens: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The report ``tracestore check`` prints (``report["ok"]``: aligned). ``tokens``: each
    trajectory's token ids from position 0, to check every record's token identity."""
    import numpy as np

    from tracestore.plan import MicrobatchPlan
    from tracestore.storage.reader import LinkIndex, StoreReader
    from tracestore.storage.store import Store
    from tracestore.traceref import check_refs

    if (refs is None) == (plan is None):
        raise ValueError("give refs or a plan")
    if refs is not None:
        runs = sorted({r.run for r in refs})
        if run is None:
            if len(runs) != 1:
                raise ValueError(f"the refs name runs {runs}: pass --run")
            run = runs[0]
    if run is None:
        raise ValueError("--run is required with --plan")
    store = Store(url, storage_options)
    report: dict[str, Any] = {"url": url, "run": run, "problems": [], "trajectories": [], "unguided": []}
    report["identity_checked"] = tokens is not None
    with StoreReader(store, run) as reader:
        spec = reader.spec
        site_names = list(spec.site_names) if sites is None else [spec.site(s).name for s in sites]
        all_versions = reader.versions()
        work: list[tuple[str, int, int, set[int], int | None]] = []  # (stored id, a, b, versions, ref version)
        if refs is not None:
            report["problems"] += check_refs(refs, reader, strict=False)
            for r in refs:
                if r.run != run:
                    continue
                if not r.guided:
                    report["unguided"].append({"trajectory": r.stored_id, "reason": r.reason, "tokens": r.n_tokens})
                    continue
                # all versions, newest winning as in a read of a step that mixes versions: a record
                # of the trajectory in another version than its ref's shows up as wrong_version
                work.append((r.stored_id, 0, r.n_tokens, set(all_versions), r.policy_version))
        else:
            vs = set(all_versions if versions is None else versions)
            assert plan is not None
            for t, a, b in MicrobatchPlan(plan).segments:
                if t is not None:
                    work.append((t, a, b, vs, None))
        report["segments"] = len(work)
        reader.refresh(all_versions)
        links = LinkIndex(run)
        for v in all_versions:
            for path in store.manifest_paths(run, v):
                links.add_manifest(f"{store.url}/{path}", store.read_manifest(path))
        for stored, a, b, vs, ref_version in work:
            entry: dict[str, Any] = {"trajectory": stored, "tokens": [a, b], "sites": {}}
            report["trajectories"].append(entry)
            present = sorted(vs & set(all_versions))
            if not present:
                report["problems"].append(f"{stored}: no records in versions {sorted(vs)}")
                entry["error"] = "no such version"
                continue
            seal = reader.seal(stored, present)
            expect_v = ref_version if ref_version is not None else (seal.policy_version if seal is not None else None)
            try:
                pieces = links.resolve(stored, a, b, set(present), "mask")
                via = sum(hi - lo for owner, lo, hi in pieces if owner != stored)
                ids = None if tokens is None or stored not in tokens else {stored: tokens[stored]}
                res = reader.read(
                    [(stored, a, b)],
                    versions=present,
                    sites=site_names,
                    on_missing="mask",
                    token_ids=ids,
                    on_mismatch="mask",
                )
            except TraceStoreError as exc:
                report["problems"].append(f"{stored} tokens [{a}, {b}): {type(exc).__name__}: {exc}")
                entry["error"] = f"{type(exc).__name__}: {exc}"
                continue
            final = seal.n_tokens - 1 if seal is not None else None
            st = res.stats
            if tokens is not None:
                entry["identity"] = {
                    "verified": st.ids_verified,
                    "absent": st.ids_absent,
                    "unverifiable": st.ids_unverifiable,
                }
                if stored not in tokens:
                    report["problems"].append(f"{stored}: no token ids in the --tokens file")
            misaligned = st.misaligned.get(stored, {})
            fp4_ok = np.ones(b - a, bool) if any(not spec.site(n).is_artifact for n in site_names) else None
            route_ok = np.ones(b - a, bool) if any(spec.site(n).kind == "routed_experts" for n in site_names) else None
            for name in site_names:
                rows = res[name]
                k = rows.site.rows_per_token
                valid = rows.valid.reshape(-1, k).all(axis=1)
                pv = rows.policy_version.reshape(-1, k)[:, 0]
                toks = np.arange(a, b)
                is_final = toks == final if final is not None else np.zeros(b - a, bool)
                if stored in st.mismatched:  # masked by the identity check: misaligned, not missing
                    valid = np.zeros_like(valid)
                missing = ~valid & ~is_final if stored not in st.mismatched else np.zeros(b - a, bool)
                wrong = valid & (pv != expect_v) if expect_v is not None else np.zeros(b - a, bool)
                s = {
                    "recorded": int(valid.sum()),
                    "unrecorded_final": int((~valid & is_final).sum()),
                    "missing": int(missing.sum()),
                    "wrong_version": int(wrong.sum()),
                    "via_links": via,
                    "misaligned": int(misaligned.get(name, 0)),
                }
                if rows.site.is_artifact:  # a stored row counts as valid only with its flag set
                    flagged = valid & (rows.scales[:, 0] & 1).astype(bool)
                    s["artifact_valid"] = int(flagged.sum())
                    if route_ok is not None and rows.site.kind == "routed_experts":
                        route_ok &= flagged
                elif fp4_ok is not None:
                    fp4_ok &= valid
                entry["sites"][name] = s
                if s["misaligned"]:
                    report["problems"].append(
                        f"{stored} site {name}: {s['misaligned']} tokens recorded for other token ids "
                        f"({st.mismatched.get(stored, '')})"
                    )
                if s["missing"]:
                    first = [int(x) for x in toks[missing][:8]]
                    report["problems"].append(f"{stored} site {name}: {s['missing']} missing tokens, e.g. {first}")
                if s["wrong_version"]:
                    got = sorted({int(x) for x in pv[wrong]})
                    report["problems"].append(
                        f"{stored} site {name}: {s['wrong_version']} tokens of versions {got}, expected v{expect_v}"
                    )
            if route_ok is not None:
                cov = report.setdefault("artifacts", {"tokens": 0, "routing": 0, "fp4": 0, "both": 0})
                cov["tokens"] += b - a
                cov["routing"] += int(route_ok.sum())
                if fp4_ok is not None:
                    cov["fp4"] += int(fp4_ok.sum())
                    cov["both"] += int((fp4_ok & route_ok).sum())
    report["ok"] = not report["problems"]
    return report


def _print(report: dict[str, Any], out: TextIO) -> None:
    print(f"run {report['run']} at {report['url']}: {report['segments']} trajectories checked", file=out)
    for e in report["trajectories"]:
        a, b = e["tokens"]
        if "error" in e:
            print(f"  {e['trajectory']} [{a}, {b}): ERROR {e['error']}", file=out)
            continue
        for name, s in e["sites"].items():
            flag = "" if not (s["missing"] or s["wrong_version"] or s["misaligned"]) else "  <-- misaligned"
            print(
                f"  {e['trajectory']} [{a}, {b}) {name}: recorded {s['recorded']}, final {s['unrecorded_final']}, "
                f"missing {s['missing']}, wrong version {s['wrong_version']}, via links {s['via_links']}, "
                f"other token ids {s['misaligned']}{flag}",
                file=out,
            )
        if "identity" in e:
            i = e["identity"]
            print(
                f"  {e['trajectory']} identity: {i['verified']} chunks verified, {i['absent']} without token ids, "
                f"{i['unverifiable']} unverifiable",
                file=out,
            )
    cov = report.get("artifacts")
    if cov is not None:
        print(
            f"  artifact coverage: {cov['tokens']} tokens checked; valid routing at every MoE layer {cov['routing']}, "
            f"FP4 records at every site {cov['fp4']}, both {cov['both']} (final positions unrecorded by design)",
            file=out,
        )
    for u in report["unguided"]:
        print(f"  {u['trajectory']}: unguided ({u['reason']}), {u['tokens']} tokens train with RTN", file=out)
    if not report["identity_checked"]:
        print("  token identity not checked (give --tokens FILE)", file=out)
    else:
        bad = sum(s["misaligned"] for e in report["trajectories"] for s in e.get("sites", {}).values())
        print(f"  token identity: {bad} site-tokens of the run recorded for other token ids", file=out)
    for p in report["problems"]:
        print(f"PROBLEM: {p}", file=out)
    print("OK: aligned" if report["ok"] else f"MISALIGNED: {len(report['problems'])} problems", file=out)


def run(ns: argparse.Namespace) -> int:
    from tracestore.cli import resolve

    try:
        resolve(ns)
        refs, plan = source(ns)
    except ConfigError as exc:
        print(f"tracestore check: {exc}", file=sys.stderr)
        return 2
    try:
        report = check(
            ns.url,
            refs=_load_refs(refs) if refs else None,
            plan=_load_plan(plan) if plan else None,
            run=ns.run,
            versions=ns.versions,
            sites=ns.sites,
            storage_options=ns.storage_options,
            tokens=_load_tokens(ns.tokens) if ns.tokens else None,
        )
    except (ValueError, OSError, TraceStoreError) as exc:
        print(f"tracestore check: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if ns.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        _print(report, sys.stdout)
    return 0 if report["ok"] else 1
