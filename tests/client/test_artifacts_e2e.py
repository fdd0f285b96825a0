"""Routing and log-prob artifacts through the existing chunk path: RolloutRecorder -> a separate
`tracestore serve` process (WAL, shards) -> storage -> GuidanceReader (storage and sidecar), with
prefix links, seals and invalid rows; the sidecar refuses a payload of the wrong size with
INVALID_ARGUMENT saying what it expected."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Set as AbstractSet

import grpc
import numpy as np
import pytest
import torch
from tracestore.client import GuidanceReader, RolloutRecorder, SiteOutput
from tracestore.server.testing import ServeProcess, write_request

from tracestore.artifacts import LogProbs, Routing, encode_logprobs, encode_routing, logprobs_site, routed_experts_site
from tracestore.cli.check import check
from tracestore.errors import ConfigError
from tracestore.records import RecordChunk, RunSpec, SiteSpec
from tracestore.v1 import tracestore_pb2 as pb

FP4 = SiteSpec("layers.1.mlp.input", "moe_input", 1, 32)
R1 = routed_experts_site(1, top_k=2, n_experts=8, gate="float32")
R2 = routed_experts_site(2, top_k=2, n_experts=300)  # uint16 ids
LP = logprobs_site()
SPEC = RunSpec("art", (FP4, R1, R2, LP))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    sp = ServeProcess(tmp_path_factory.mktemp("art"), unix_socket=True, flags=["--flush-interval", "0.1"])
    with sp:
        yield sp


class Truth:
    """What an engine routed: per (trajectory, site) position -> (experts, gate, valid), log-probs."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.rows: dict[tuple[str, str], dict[int, tuple[np.ndarray, np.ndarray, bool]]] = {}

    def forward(
        self, segs: list[tuple[str, int, int]], invalid: AbstractSet[tuple[str, int]] = frozenset()
    ) -> dict[str, SiteOutput]:
        n = sum(b - a for _, a, b in segs)
        valid = np.array([(t, p) not in invalid for t, a, b in segs for p in range(a, b)])
        out = {FP4.name: SiteOutput(self.rng.integers(0, 256, (n, FP4.code_bytes), dtype=np.uint8),
                                    self.rng.integers(0, 256, (n, FP4.scale_bytes), dtype=np.uint8), 0.5)}  # fmt: skip
        for site in (R1, R2):
            ex = np.stack([self.rng.choice(site.n_experts, 2, replace=False) for _ in range(n)])
            gw = self.rng.random((n, 2)).astype(np.float32)
            codes, scales = encode_routing(site, ex, gw if site.gate else None, valid)
            out[site.name] = SiteOutput(torch.from_numpy(codes), torch.from_numpy(scales))
            r = 0
            for t, a, b in segs:
                for p in range(a, b):
                    self.rows.setdefault((t, site.name), {})[p] = (ex[r], gw[r], bool(valid[r]))
                    r += 1
        lp = -self.rng.random(n).astype(np.float32)
        out[LP.name] = SiteOutput(*encode_logprobs(LP, lp, valid))
        r = 0
        for t, a, b in segs:
            for p in range(a, b):
                self.rows.setdefault((t, LP.name), {})[p] = (np.array([lp[r]]), np.zeros(0), bool(valid[r]))
                r += 1
        return out


def test_routing_through_sidecar_and_storage(served: ServeProcess) -> None:
    truth = Truth(1)
    rec = RolloutRecorder(served.unix_address, SPEC, "art-w", staging_bytes=4 << 20)
    # prefill of a (5 tokens), b links to a's prompt; a's position 2 was a retract: invalid row
    assert rec.record_forward([("a", 0, 5)], truth.forward([("a", 0, 5)], {("a", 2)}))
    rec.link_prefix("b", "a", 5)
    for step in range(3):
        segs = [("a", 5 + step, 6 + step), ("b", 5 + step, 6 + step)]
        assert rec.record_forward(segs, truth.forward(segs))
    rec.finish("a", 9)
    rec.finish("b", 9)
    assert rec.flush(60), rec.stats
    assert rec.stats["unguided"] == 0
    rec.close()
    plan = [("b", 0, 8), ("a", 3, 8)]
    # a sidecar Read flushes first; then storage, read in this process and in a read process
    for source, process in ((served.address, False), (served.storage, False), (served.storage, True)):
        with GuidanceReader(source, SPEC.run, prefetch=False, process=process) as reader:
            got = reader.read(plan)
        assert got.report.rows == 13  # FP4 rows only; artifacts are not RTN fallbacks
        for site in (R1, R2):
            r = got[site.name]
            assert isinstance(r, Routing) and r.experts.dtype == torch.int64 and r.experts.shape == (13, 2)
            want_valid, i = [], 0
            for t, a, b in plan:
                for p in range(a, b):
                    owner = "a" if t == "b" and p < 5 else t
                    ex, gw, ok = truth.rows[(owner, site.name)][p]
                    want_valid.append(ok)
                    if ok:
                        assert r.experts[i].tolist() == ex.tolist(), (source, site.name, t, p)
                        if site.gate:
                            assert r.gate is not None and r.gate[i].tolist() == gw.tolist()
                    i += 1
            assert r.valid.tolist() == want_valid
            assert want_valid.count(False) == 1  # a's position 2, read through b's link
        lp = got[LP.name]
        assert isinstance(lp, LogProbs) and lp.values.shape == (13,)
        assert lp.values[0].item() == truth.rows[("a", LP.name)][0][0][0]
    # a PP stage's subset: layer 2's routing only
    with GuidanceReader(served.storage, SPEC.run, sites=[R2.name]) as reader:
        assert set(reader.read(plan)) == {R2.name}
    # GuidedFP4Hooks-style consumers read FP4 entries; artifacts never pretend to be Guidance
    with GuidanceReader(served.storage, SPEC.run, sites=[R1.name], columns=(0, 16)) as reader:
        assert reader.read(plan)[R1.name].experts.shape == (13, 2)  # columns narrow FP4 sites only
    with pytest.raises(ConfigError, match="read whole"):
        GuidanceReader(served.storage, SPEC.run, sites=[R1.name], columns={R1.name: (0, 1)}).read(plan)
    # tracestore check: per-run artifact coverage (a's position 2 is flagged invalid, seen twice)
    report = check(served.storage, plan=[("a", 0, 9), ("b", 0, 9)], run=SPEC.run)
    assert report["ok"], report["problems"]
    assert report["artifacts"] == {"tokens": 18, "routing": 14, "fp4": 16, "both": 14}
    a = report["trajectories"][0]["sites"]
    assert a[R1.name]["recorded"] == 8 and a[R1.name]["artifact_valid"] == 7 and a[R1.name]["missing"] == 0
    assert a[LP.name]["artifact_valid"] == 7 and "artifact_valid" not in a[FP4.name]


@pytest.mark.parametrize(
    ("site", "cut", "expected"),
    [
        (R1, "codes", "expected codes/scales/token_scales of 6/27/0 bytes"),
        (R2, "scales", "expected codes/scales/token_scales of 12/3/0 bytes"),
        (LP, "codes", "logprobs: codes = 1 float32 log-prob"),
    ],
)
def test_sidecar_refuses_wrong_payload_sizes(served: ServeProcess, site: SiteSpec, cut: str, expected: str) -> None:
    codes = np.zeros((3, site.code_bytes), np.uint8)
    scales = np.ones((3, site.scale_bytes), np.uint8)
    req = write_request(1, [RecordChunk(SPEC.run, 0, "bad", site.name, 0, 3, codes, scales, 1.0)],
                        writer=f"bad-{site.name}", declare=True, spec=SPEC)  # fmt: skip
    field = req.chunks[0]
    setattr(field, cut, getattr(field, cut)[:-1])
    field.checksum = 0
    with grpc.insecure_channel(served.address) as ch:
        call = ch.stream_stream("/tracestore.v1.TraceStore/Write")
        with pytest.raises(grpc.RpcError) as err:
            list(call(iter([req.SerializeToString()]), timeout=20))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in (err.value.details() or "") and site.payload_layout.split(":")[0] in (err.value.details() or "")


def test_sidecar_refuses_bad_expert_ids(served: ServeProcess) -> None:
    codes = np.full((1, 2), 9, np.uint8)  # expert 9 of 8
    req = write_request(1, [RecordChunk(SPEC.run, 0, "bad-ids", R1.name, 0, 1, codes,
                                        np.ones((1, R1.scale_bytes), np.uint8), 1.0)],
                        writer="bad-ids", declare=True, spec=SPEC)  # fmt: skip
    with grpc.insecure_channel(served.address) as ch:
        call = ch.stream_stream("/tracestore.v1.TraceStore/Write")
        with pytest.raises(grpc.RpcError) as err:
            list(call(iter([req.SerializeToString()]), timeout=20))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "below n_experts 8" in (err.value.details() or "")
    assert pb.SITE_KIND_ROUTED_EXPERTS == 5


def test_routing_follows_rank_plans(served: ServeProcess) -> None:
    """CP zig-zag over packed (THD) samples and PP stages: each rank's routing rows are the rollout's
    routing of the tokens its plan names; a stage reads its layers' routing, the last the log-probs."""
    from tracestore.artifacts import decode_routing
    from tracestore.rank_plan import RankCoord, TrainerLayout, rank_plan
    from tracestore.storage.reader import StoreReader
    from tracestore.storage.store import Store

    truth = Truth(7)
    rec = RolloutRecorder(served.address, SPEC, "rank-w")
    lengths = {rec.attempt(base): n for base, n in (("rp-0", 11), ("rp-1", 7), ("rp-2", 14))}
    for t, n in lengths.items():
        assert rec.record_forward([(t, 0, n - 1)], truth.forward([(t, 0, n - 1)]))
        rec.finish(t, n)
    refs = rec.refs(list(lengths), timeout=60)
    rec.close()
    assert all(r.guided for r in refs), refs
    layout = TrainerLayout(cp_size=2, pp_size=2, stage_layers=(2, 1))  # layers 0-1 | layer 2
    seen_tokens = 0
    for cp in range(2):
        for pp in range(2):
            rp = rank_plan(refs, layout, RankCoord(cp=cp, pp=pp), run_spec=SPEC)
            routed = [s for s in rp.sites if SPEC.site(s).kind == "routed_experts"]
            assert routed == ([R1.name] if pp == 0 else [R2.name])
            assert (LP.name in rp.sites) == (pp == 1)
            with StoreReader(Store(served.storage), SPEC.run) as reader:
                got = rp.read(reader)
            fp4_sites = [s for s in rp.sites if not SPEC.site(s).is_artifact]
            assert got.rows_total == len(fp4_sites) * sum(t is not None for t, _ in rp.token_map())
            for name in routed:
                rows = got[name]
                d = decode_routing(rows.site, rows.codes, rows.scales, rows.valid)
                for i, (t, pos) in enumerate(rp.token_map()):
                    if t is None or pos == lengths[t] - 1:  # padding, the unrecorded final position
                        assert not d.valid[i]
                        continue
                    ex, _, ok = truth.rows[(t, name)][pos]
                    assert d.valid[i] == ok and d.experts[i].tolist() == ex.tolist(), (cp, pp, t, pos)
                    seen_tokens += pp == 0
    assert seen_tokens == sum(n - 1 for n in lengths.values())  # the CP ranks split every recorded token
