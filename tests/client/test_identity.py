"""Every row carries its token identity end to end: RolloutRecorder(token_ids=...) -> a real
`tracestore serve` -> storage -> GuidanceReader (from storage, from read processes and through
the sidecar's Read) and `tracestore check --tokens`, each comparing with the trainer's token ids.

A deliberately shifted forward (the recorder told the tokens sit one position later than they do,
the bug class of keying rows by a padded index) is refused with GuidanceMismatch, masked with its
reason under on_mismatch="mask", counted in the sidecar's and the reader's metrics, and reported
per site by `tracestore check`; the other trajectories of the same reads stay guided.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("grpc", reason="the sidecar needs the server extra")

from tracestore.client import GuidanceReader, RolloutRecorder, SiteOutput  # noqa: E402
from tracestore.server.testing import ServeProcess  # noqa: E402

from tracestore.errors import GuidanceMismatch, ShapeError, ValidationError  # noqa: E402
from tracestore.identity import ids_crc  # noqa: E402
from tracestore.records import RunSpec, SiteSpec  # noqa: E402
from tracestore.storage.reader import StoreReader  # noqa: E402
from tracestore.storage.store import Store  # noqa: E402

SITES = (
    SiteSpec("layers.1.mlp.input", "moe_input", layer=1, width=64),
    SiteSpec("layers.1.mlp.experts", "moe_input", layer=1, width=32, rows_per_token=2, bits=2),
)
PROMPT, GEN = 7, 6
N = PROMPT + GEN  # tokens per trajectory; positions 0 .. N-2 are forwarded


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with ServeProcess(tmp_path_factory.mktemp("identity"), unix_socket=True, flags=["--flush-interval", "0.1"]) as sp:
        yield sp


def outputs(n: int, rng: np.random.Generator) -> dict[str, SiteOutput]:
    out = {}
    for s in SITES:
        rows = n * s.rows_per_token
        out[s.name] = SiteOutput(
            rng.integers(0, 256, (rows, s.code_bytes), dtype=np.uint8),
            rng.integers(0, 256, (rows, s.scale_bytes), dtype=np.uint8),
            float(np.float32(rng.uniform(0.1, 1))),
        )
    return out


def rollout(served: ServeProcess, run: str, trajs: list[str], shift: str | None = None) -> dict[str, list[int]]:
    """Record ``trajs`` (prefill, then one-token decode steps) with their token ids; ``shift``: that
    trajectory's decode steps are stored one position later than they ran (each row and its token
    id belong to the position before the one it is stored at). Returns the ids."""
    rng = np.random.default_rng(len(run))
    ids = {t: rng.integers(3, 50_000, N).tolist() for t in trajs}
    rec = RolloutRecorder(served.address, RunSpec(run, SITES), writer=f"w-{run}")
    try:
        segs = [(t, 0, PROMPT) for t in trajs]
        prompt_ids = [i for t in trajs for i in ids[t][:PROMPT]]
        rec.record_forward(segs, outputs(len(segs) * PROMPT, rng), token_ids=prompt_ids)
        for p in range(PROMPT, N - 1):
            segs = [(t, p + (t == shift), p + 1 + (t == shift)) for t in trajs]
            rec.record_forward(segs, outputs(len(segs), rng), token_ids=[ids[t][p] for t in trajs])
        for t in trajs:
            rec.finish(t, N)
        assert rec.flush(timeout=60)
    finally:
        rec.close()
    with GuidanceReader(served.address, run, prefetch=False, on_missing="mask") as r:
        r.read_host([(t, 0, N) for t in trajs])  # a sidecar read commits what it holds to storage first
    return ids


def test_identity_values_are_the_documented_crc() -> None:
    """CRC-32 over the tag and the int32 little-endian ids (what docs/data-model.md states)."""
    import zlib

    ids = [1, 15043, 3186, 2**31 - 1]
    assert ids_crc(ids) == zlib.crc32(b"tracestore.ids.v1\0" + np.array(ids, "<i4").tobytes())
    with pytest.raises(ValidationError, match="0..2\\^31-1"):
        ids_crc([-1])


def test_every_chunk_is_verified_from_storage_processes_and_the_sidecar(served: ServeProcess) -> None:
    ids = rollout(served, "idok", ["a", "b"])
    plan = [("a", 0, N), ("b", 0, N)]
    with StoreReader(Store(served.storage), "idok") as reader:
        res = reader.read(plan, on_missing="mask", token_ids=ids)
        st = res.stats
        assert st.ids_verified == st.chunks > 0 and st.ids_absent == st.ids_unverifiable == 0
        packed = np.concatenate([ids["a"], ids["b"]])  # the microbatch's input_ids, aligned with the plan
        assert reader.read(plan, on_missing="mask", token_ids=packed).stats.ids_verified == st.chunks
    for source, kw in ((served.storage, {"process": 2}), (served.address, {}), (f"unix://{served.socket}", {})):
        with GuidanceReader(source, "idok", prefetch=False, on_missing="mask", **kw) as r:
            rows = r.read_host(plan, token_ids=ids)
            assert r.last_report is not None and not r.last_report.mismatched
            assert rows[SITES[0].name].valid.sum() == 2 * (N - 1)


def test_a_shifted_record_is_refused_masked_counted_and_reported(served: ServeProcess, tmp_path: Path) -> None:
    ids = rollout(served, "idshift", ["good", "bad"], shift="bad")
    plan = [("good", 0, N), ("bad", 0, N)]
    before = _sidecar_counts(served)
    # refused, naming the trajectory and where its ids diverge, from storage and through the sidecar
    with StoreReader(Store(served.storage), "idshift") as reader:
        with pytest.raises(GuidanceMismatch, match=r"trajectory bad: .* other token ids.*differ at a position"):
            reader.read(plan, on_missing="mask", token_ids=ids)
        masked = reader.read(plan, on_missing="mask", token_ids=ids, on_mismatch="mask")
        assert set(masked.stats.mismatched) == {"bad"}
        assert set(masked.stats.misaligned["bad"]) == {s.name for s in SITES}
        for s in SITES:
            k = s.rows_per_token
            assert masked[s.name].valid[: (N - 1) * k].all()  # "good" stays guided
            assert not masked[s.name].valid[N * k :].any()  # "bad" is unguided, whole
    for source, kw in ((served.address, {}), (served.storage, {"process": 1}), (served.storage, {})):
        with GuidanceReader(source, "idshift", prefetch=False, on_missing="mask", **kw) as r:
            with pytest.raises(GuidanceMismatch, match="trajectory bad"):
                r.read_host(plan, token_ids=ids)
            assert r.stats["mismatch_refused"] == 1
        with GuidanceReader(source, "idshift", prefetch=False, on_missing="mask", on_mismatch="mask", **kw) as r:
            rows = r.read_host(plan, token_ids=ids)
            assert r.last_report is not None and set(r.last_report.mismatched) == {"bad"}
            assert "differ at a position" in r.last_report.mismatched["bad"]
            assert rows[SITES[0].name].valid[: N - 1].all() and not rows[SITES[0].name].valid[N:].any()
            assert r.stats["mismatch_masked"] == 1
    after = _sidecar_counts(served)
    assert after["refused"] - before["refused"] == 1 and after["masked"] - before["masked"] == 1
    # the reader's own Prometheus counter (prometheus_client is installed with the server extra)
    from prometheus_client import REGISTRY

    got = REGISTRY.get_sample_value(
        "tracestore_reader_guidance_mismatches_total", {"run": "idshift", "outcome": "refused"}
    )
    assert got is not None and got >= 3
    # tracestore check --tokens: the misaligned rows per site, exit status 1; the good one aligned
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text("".join(json.dumps({"trajectory": t, "token_ids": v}) + "\n" for t, v in ids.items()))
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps([["good", 0, N], ["bad", 0, N]]))
    out = _check(served.storage, "--run", "idshift", "--plan", str(plan_file), "--tokens", str(tokens), "--json")
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    by = {e["trajectory"]: e for e in report["trajectories"]}
    assert all(s["misaligned"] == 0 for s in by["good"]["sites"].values())
    assert by["good"]["identity"]["verified"] > 0 and by["good"]["identity"]["absent"] == 0
    assert all(s["misaligned"] > 0 for s in by["bad"]["sites"].values())
    assert any("bad site" in p and "other token ids" in p for p in report["problems"])
    text = _check(served.storage, "--run", "idshift", "--plan", str(plan_file), "--tokens", str(tokens))
    assert "other token ids" in text.stdout and "MISALIGNED" in text.stdout
    # without the bad trajectory the check passes; without --tokens it says identity went unchecked
    plan_file.write_text(json.dumps([["good", 0, N]]))
    ok = _check(served.storage, "--run", "idshift", "--plan", str(plan_file), "--tokens", str(tokens))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "token identity not checked" in _check(served.storage, "--run", "idshift", "--plan", str(plan_file)).stdout


def test_token_ids_are_checked_where_they_come_in(served: ServeProcess) -> None:
    rec = RolloutRecorder(served.address, RunSpec("idbad", SITES), writer="w-idbad", connect=False)
    rng = np.random.default_rng(0)
    try:
        with pytest.raises(ShapeError, match="token_ids holds 2 ids; the segments hold 3 tokens"):
            rec.record_forward([("t", 0, 3)], outputs(3, rng), token_ids=[1, 2])
        with pytest.raises(ValidationError, match="integers"):
            rec.record_forward([("t", 0, 1)], outputs(1, rng), token_ids=[1.5])
    finally:
        rec.close(timeout=1)
    with StoreReader(Store(served.storage), "idok") as reader:
        with pytest.raises(ValueError, match="start at token 0"):
            reader.read([("a", 2, 5)], token_ids=np.arange(3))
        with pytest.raises(ValueError, match="3 ids for a plan of 4 tokens"):
            reader.read([("a", 0, 4)], token_ids=np.arange(3))


def _sidecar_counts(served: ServeProcess) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{served.metrics_port}/metrics", timeout=10).read().decode()
    out = {"refused": 0.0, "masked": 0.0}
    for line in text.splitlines():
        if line.startswith("tracestore_guidance_mismatches_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


def _check(url: str, *args: str) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "tracestore", "check", url, *args], capture_output=True, text=True, timeout=120
    )
