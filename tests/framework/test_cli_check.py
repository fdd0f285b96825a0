"""`tracestore check`: per trajectory and site counts, exit 1 on any misalignment, --json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tracestore.client.record.traceref import TraceRef, attempt_id, site_digest, write_jsonl

from tracestore.cli import main
from tracestore.records import PrefixLink, RecordChunk, RunSpec, SiteSpec, TrajectorySeal
from tracestore.storage.store import Store

SPEC = RunSpec(
    "chk",
    (SiteSpec("layers.0.mlp.input", "moe_input", 0, 32), SiteSpec("layers.0.attn.k", "key", 0, 32, rows_per_token=2)),
)
DIGEST = site_digest(SPEC)


def chunk(traj: str, a: int, n: int, site: str, version: int = 0) -> RecordChunk:
    s = SPEC.site(site)
    rng = np.random.default_rng([a, n, version, len(traj)])
    rows = n * s.rows_per_token
    return RecordChunk(
        SPEC.run, version, traj, site, a, n,
        rng.integers(0, 256, (rows, s.code_bytes), dtype=np.uint8),
        rng.integers(0, 256, (rows, s.scale_bytes), dtype=np.uint8), 0.5,
    )  # fmt: skip


@pytest.fixture()
def store(tmp_path: Path) -> tuple[str, dict[str, TraceRef]]:
    url = f"file://{tmp_path / 'store'}"
    st = Store(url)
    st.put_run(SPEC)
    names = [s.name for s in SPEC.sites]
    good, linked, holey, newer = (attempt_id(t, 0) for t in ("good", "linked", "holey", "newer"))
    chunks = [chunk(good, 0, 7, n) for n in names]  # 8 tokens: 0..6 recorded, 7 final
    chunks += [chunk(linked, 4, 3, n) for n in names]  # tokens 0..3 through the link to `good`
    chunks += [chunk(holey, 0, 3, n) for n in names] + [chunk(holey, 4, 2, n) for n in names]  # token 3 missing
    chunks += [chunk(newer, 0, 5, n) for n in names]
    seals = [
        TrajectorySeal(SPEC.run, 0, t, n, tuple(names)) for t, n in ((good, 8), (linked, 8), (holey, 7), (newer, 6))
    ]
    st.write_shard(SPEC.run, 0, "w0", 1, chunks, seals, [PrefixLink(SPEC.run, 0, linked, good, 4)])
    # a newer version re-records two tokens of `newer`: its ref (v0) now reads v1 rows there
    st.write_shard(SPEC.run, 1, "w0", 2, [chunk(newer, 1, 2, n, version=1) for n in names])
    refs = {
        t.split("::")[0]: TraceRef(SPEC.run, 0, t.split("::")[0], 0, n, DIGEST)
        for t, n in ((good, 8), (linked, 8), (holey, 7), (newer, 6))
    }
    return url, refs


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(["check", *args])
    return rc, capsys.readouterr().out


def test_aligned_refs_exit_zero(store: tuple[str, dict[str, TraceRef]], tmp_path: Path, capsys) -> None:
    url, refs = store
    f = tmp_path / "ok.jsonl"
    unguided = TraceRef(SPEC.run, 0, "lost", 0, 9, DIGEST, False, "sidecar_unreachable")
    write_jsonl([refs["good"], refs["linked"], unguided], f)
    rc, out = _run([url, "--refs", str(f)], capsys)
    assert rc == 0, out
    assert "OK: aligned" in out and "lost::a0: unguided (sidecar_unreachable)" in out
    rc, out = _run([url, "--refs", str(f), "--json"], capsys)
    rep = json.loads(out)
    assert rc == 0 and rep["ok"]
    linked = next(e for e in rep["trajectories"] if e["trajectory"] == "linked::a0")
    assert linked["sites"]["layers.0.attn.k"] == {
        "recorded": 7, "unrecorded_final": 1, "missing": 0, "wrong_version": 0, "via_links": 4, "misaligned": 0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("which", "needle"),
    [
        ("holey", "1 missing tokens, e.g. [3]"),
        ("newer", "2 tokens of versions [1], expected v0"),
        ("forged", "says 9 tokens, its seal on storage says 8"),
        ("other-run", "belongs to run 'elsewhere'"),
    ],
)
def test_misalignment_exits_one(store, tmp_path: Path, capsys, which: str, needle: str) -> None:
    url, refs = store
    ref = {
        "forged": TraceRef(SPEC.run, 0, "good", 0, 9, DIGEST),
        "other-run": TraceRef("elsewhere", 0, "good", 0, 8, DIGEST),
    }.get(which) or refs[which]
    f = tmp_path / "bad.jsonl"
    write_jsonl([refs["good"], ref], f)
    rc, out = _run([url, "--refs", str(f), "--run", SPEC.run], capsys)
    assert rc == 1 and needle in out and "MISALIGNED" in out, out


def test_plan_mode_and_usage_errors(store, tmp_path: Path, capsys) -> None:
    url, _ = store
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"segments": [["good::a0", 0, 8], [None, 0, 3], ["holey::a0", 0, 3]]}))
    rc, out = _run([url, "--plan", str(plan), "--run", SPEC.run, "--json"], capsys)
    assert rc == 0, out
    assert json.loads(out)["segments"] == 2
    plan.write_text(json.dumps([["holey::a0", 0, 7]]))
    rc, out = _run([url, "--plan", str(plan), "--run", SPEC.run, "--versions", "0"], capsys)
    assert rc == 1 and "missing" in out
    rc, _ = _run([url, "--plan", str(plan)], capsys)  # no --run
    assert rc == 2
    bad = tmp_path / "edited.jsonl"
    d = TraceRef(SPEC.run, 0, "good", 0, 8, DIGEST).to_dict()
    d["n_tokens"] = 5
    bad.write_text(json.dumps(d) + "\n")
    rc, _ = _run([url, "--refs", str(bad)], capsys)
    assert rc == 2
