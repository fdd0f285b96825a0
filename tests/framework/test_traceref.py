"""TraceRef: round trips, size, rejection of foreign or forged handles, attempts, and the
recorder -> sidecar -> storage -> rank plan path with a real `tracestore serve` process."""

from __future__ import annotations

import io
import json
import pickle
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tracestore.client import GuidanceReader, RolloutRecorder, SiteOutput
from tracestore.client.record.traceref import (
    TraceRef,
    attempt_id,
    check_refs,
    read_jsonl,
    site_digest,
    split_attempt_id,
    write_jsonl,
)
from tracestore.server.testing import ServeProcess

from tracestore.errors import MissingRecordsError, ValidationError
from tracestore.rank_plan import RankCoord, TrainerLayout, rank_plan
from tracestore.records import RunSpec, SiteSpec
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store

SPEC = RunSpec(
    "refs",
    (
        SiteSpec("layers.0.mlp.input", "moe_input", 0, 64),
        SiteSpec("layers.0.attn.k", "key", 0, 32, rows_per_token=1, bits=2),
        SiteSpec("layers.1.mlp.input", "moe_input", 1, 64, rows_per_token=2),
    ),
)


def test_round_trips_and_size() -> None:
    long = TraceRef("r" * 64, 2**40, "t" * (128 - 13), 999_999_999, 10**9, "0123456789abcdef", False,
                    "sidecar_unreachable", "w" * 128)  # fmt: skip
    for r in (TraceRef("run-1", 3, "prompt-1-sample-2", 1, 4096, site_digest(SPEC)), long):
        assert TraceRef.from_json(r.to_json()) == r
        assert pickle.loads(pickle.dumps(r)) == r
        assert TraceRef.from_dict(json.loads(json.dumps(r.to_dict()))) == r
        # every id at its longest (run 64, trajectory 128 with the suffix, writer 128): still ~0.5 kB
        bound = 576 if r is long else 256
        assert len(r.to_json()) <= bound and len(pickle.dumps(r)) <= bound, (len(r.to_json()), len(pickle.dumps(r)))
    buf = io.StringIO()
    write_jsonl([long, long], buf)
    assert read_jsonl(io.StringIO(buf.getvalue())) == [long, long]


def test_forged_and_malformed_refs_are_refused() -> None:
    r = TraceRef("run-1", 0, "a", 0, 12, site_digest(SPEC))
    d = r.to_dict()
    d["n_tokens"] = 13
    with pytest.raises(ValidationError, match="fails its CRC"):
        TraceRef.from_dict(d)
    with pytest.raises(ValidationError, match="line 2"):
        read_jsonl(io.StringIO(r.to_json() + "\n" + json.dumps(d) + "\n"))
    with pytest.raises(ValidationError, match="n_tokens"):
        TraceRef("run-1", 0, "a", 0, 0, site_digest(SPEC))
    with pytest.raises(ValidationError, match="base id"):
        TraceRef("run-1", 0, "a::a0", 0, 5, site_digest(SPEC))
    with pytest.raises(ValidationError, match="reason"):
        TraceRef("run-1", 0, "a", 0, 5, site_digest(SPEC), guided=False, reason="because")
    with pytest.raises(ValidationError, match="format"):
        TraceRef.from_dict({**r.to_dict(), "v": 9})


def test_attempt_ids() -> None:
    assert attempt_id("q-1:s2", 3) == "q-1:s2::a3"
    assert split_attempt_id("q-1:s2::a3") == ("q-1:s2", 3)
    assert split_attempt_id(attempt_id("x:a1", 0)) == ("x:a1", 0)
    with pytest.raises(ValidationError, match="reserved"):
        attempt_id("a::b", 0)
    for bad in ("plain", "a::a01", "a::a", "a::b::a1"):
        with pytest.raises(ValidationError):
            split_attempt_id(bad)
    with pytest.raises(ValidationError, match="too long"):
        attempt_id("t" * 126, 10)


def _outputs(n: int, rng: np.random.Generator) -> dict[str, SiteOutput]:
    out = {}
    for s in SPEC.sites:
        rows = n * s.rows_per_token
        out[s.name] = SiteOutput(
            rng.integers(0, 256, (rows, s.code_bytes), dtype=np.uint8),
            rng.integers(0, 256, (rows, s.scale_bytes), dtype=np.uint8),
            float(np.float32(rng.uniform(0.1, 1))),
        )
    return out


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[ServeProcess]:
    with ServeProcess(tmp_path / "sc", flags=["--flush-interval", "0.05"]) as sp:
        yield sp


def test_recorder_refs_attempts_and_reads(served: ServeProcess) -> None:
    rng = np.random.default_rng(1)
    rec = RolloutRecorder(served.address, SPEC, "w-refs", staging_bytes=4 << 20, give_up_s=2.0)
    sent: dict[str, dict[str, SiteOutput]] = {}
    # attempt 0 of "p0" is aborted after 3 tokens (never finished); attempt 1 completes
    a0 = rec.attempt("p0")
    aborted = _outputs(3, rng)
    assert rec.record_forward([(a0, 0, 3)], aborted)
    a1 = rec.attempt("p0")
    assert (a0, a1) == ("p0::a0", "p0::a1")
    with pytest.raises(ValidationError, match="write-once"):
        rec.attempt("p0", 1)
    ids = [a1, rec.attempt("p1"), rec.attempt("p2", 5)]
    for t, n in zip(ids, (9, 6, 11), strict=True):
        sent[t] = _outputs(n - 1, rng)  # forwards cover positions 0..n-2
        assert rec.record_forward([(t, 0, n - 1)], sent[t])
        assert rec.finish(t, n)
    refs = rec.refs(ids, timeout=30)
    assert [r.stored_id for r in refs] == ids and all(r.guided for r in refs), refs
    assert [r.n_tokens for r in refs] == [9, 6, 11] and refs[2].attempt == 5
    with pytest.raises(ValidationError, match="never finished"):
        rec.refs([rec.attempt("p9")], timeout=1)
    # a guided ref exists only once its shard is on storage: read it back at once, directly
    store = Store(served.storage)
    with StoreReader(store, SPEC.run) as reader:
        layout = TrainerLayout(dp_size=2)
        for dp in range(2):
            rp = rank_plan(refs, layout, RankCoord(dp=dp), run_spec=SPEC, on_missing="error")
            got = rp.read(reader)
            for name in rp.sites:
                s = SPEC.site(name)
                rows = got[name]
                k = s.rows_per_token
                for row_tok, (traj, tok) in enumerate(rp.token_map()):
                    assert traj is not None
                    r0 = row_tok * k
                    if tok == refs[ids.index(traj)].n_tokens - 1:  # the final position: unrecorded
                        assert not rows.valid[r0 : r0 + k].any()
                        continue
                    o = sent[traj][name]
                    assert np.array_equal(rows.codes[r0 : r0 + k], o.codes[tok * k : (tok + 1) * k])
                    assert np.array_equal(rows.scales[r0 : r0 + k], o.scales[tok * k : (tok + 1) * k])
            # one final position per trajectory falls back to RTN
            assert got.exempt_rows and got.unguided_fraction == pytest.approx(got.unguided_rows / got.rows_total)
        # the aborted attempt's records are untouched beside attempt 1's
        res = reader.read([(a0, 0, 3)], sites=[SPEC.sites[0].name], on_missing="error")
        assert np.array_equal(res[SPEC.sites[0].name].codes, aborted[SPEC.sites[0].name].codes)
        # a forged token count (a well-formed handle, new CRC) or another run's ref fails loudly
        forged = TraceRef(SPEC.run, 0, "p1", 0, 7, refs[1].sites)
        with pytest.raises(ValidationError, match="says 7 tokens, its seal on storage says 6"):
            check_refs([forged], reader)
        with pytest.raises(ValidationError, match="says 7 tokens"):
            rank_plan([forged], TrainerLayout(), run_spec=SPEC).read(reader)
        with pytest.raises(ValidationError, match="belongs to run 'other'"):
            check_refs([TraceRef("other", 0, "p1", 0, 6, refs[1].sites)], reader)
        with pytest.raises(MissingRecordsError, match="no seal"):
            check_refs([TraceRef(SPEC.run, 0, "p1", 1, 6, refs[1].sites)], reader)
        # a guided ref whose trajectory never reached storage: RTN rows and a count, or an error
        ghost = TraceRef(SPEC.run, 0, "ghost", 0, 4, refs[1].sites)
        got = rank_plan([refs[1], ghost], TrainerLayout(), run_spec=SPEC).read(reader)
        assert got.missing_refs == ["ghost::a0"] and got.missing_rows == 4 * (1 + 1 + 2)
        assert got.unguided_rows == (4 + 1) * (1 + 1 + 2)  # ghost's rows + refs[1]'s final position
        with pytest.raises(MissingRecordsError, match="no seal of ghost::a0"):
            rank_plan([refs[1], ghost], TrainerLayout(), run_spec=SPEC, on_missing="error").read(reader)
        wrong_sites = TraceRef(SPEC.run, 0, "p1", 0, 6, site_digest(SPEC, [SPEC.sites[0].name]))
        assert "site digest" in check_refs([wrong_sites], reader, strict=False)[0]
    # GuidanceReader reports the share of rows without a record
    with GuidanceReader(served.storage, SPEC.run, on_missing="mask") as gr:
        plan = [(ids[1], 0, 6), (None, 0, 2)]
        rows = gr.read_host(plan)
        assert rows.report.rows == 6 * (1 + 1 + 2) and rows.report.unguided_rows == 1 * (1 + 1 + 2)
        assert gr.last_report == rows.report
        assert gr.read(plan).report.unguided_fraction == pytest.approx(1 / 6)

    # the sidecar dies: what was acknowledged (guided refs) stays readable; later trajectories
    # come back unguided, with a reason, and train with RTN
    served.kill()
    late = rec.attempt("p3")
    assert rec.record_forward([(late, 0, 4)], _outputs(4, rng))
    rec.finish(late, 5)
    t0 = time.monotonic()
    [lref] = rec.refs([late], timeout=10)
    assert not lref.guided and lref.reason in ("sidecar_unreachable", "unpublished", "not_durable"), lref
    assert time.monotonic() - t0 < 12
    with StoreReader(Store(served.storage), SPEC.run) as reader:
        rp = rank_plan([*refs, lref], TrainerLayout(), run_spec=SPEC)
        got = rp.read(reader)
        assert got.unguided_ref_rows == 5 * (1 + 1 + 2) and rp.unguided_tokens == 5
        n_real = sum(r.n_tokens for r in refs) + 5
        assert got.rows_total == n_real * 4
        assert got.unguided_rows == (5 + len(refs)) * 4  # the unguided ref + each final position
    rec.close(timeout=1)
