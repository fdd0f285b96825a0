"""Artifact sites (routed experts, log-probs): declarations, row encoding, chunk validation, wire."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tracestore.artifacts import (
    decode_logprobs,
    decode_routing,
    encode_logprobs,
    encode_routing,
    logprobs_site,
    routed_experts_site,
    routing_bytes_per_token,
)
from tracestore.errors import ConfigError, ShapeError, ValidationError
from tracestore.records import RecordChunk, RunSpec, SiteSpec
from tracestore.traceref import site_digest
from tracestore.wire import chunk_from_parts, chunk_to_pb, run_spec_from_pb, run_spec_to_pb


@pytest.mark.parametrize(("n", "fmt", "bits"), [(1, "uint8", 8), (8, "uint8", 8), (256, "uint8", 8),
                                                 (257, "uint16", 16), (65536, "uint16", 16)])  # fmt: skip
def test_id_dtype_follows_expert_count(n: int, fmt: str, bits: int) -> None:
    s = routed_experts_site(3, top_k=1, n_experts=n)
    assert (s.name, s.format, s.bits, s.code_bytes, s.scale_bytes) == ("layers.3.mlp.router", fmt, bits, bits // 8, 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_experts": 300, "format": "uint8"}, "take format 'uint16'"),
        ({"n_experts": 8, "format": "uint16"}, "take format 'uint8'"),
        ({"n_experts": 0}, "n_experts must be >= 1"),
        ({"n_experts": 65537}, "uint16 ids"),
        ({"n_experts": 4, "width": 5}, "exceeds n_experts"),
        ({"n_experts": 8, "gate": "float16"}, "gate must be None or one of"),
        ({"n_experts": 8, "bits": 4}, "expected bits 8"),
        ({"n_experts": 8, "rows_per_token": 2}, "one row per token"),
    ],
)
def test_bad_routing_declarations(kwargs: dict[str, object], match: str) -> None:
    args = {"name": "layers.0.mlp.router", "kind": "routed_experts", "layer": 0, "width": 2, **kwargs}
    with pytest.raises((ConfigError, ValidationError), match=match):
        SiteSpec(**args)  # type: ignore[arg-type]


def test_fp4_site_json_and_digest_unchanged() -> None:
    """Existing runs still read: an FP4 site's dict (run.json, the TraceRef digest) has no new keys."""
    s = SiteSpec("layers.1.mlp.input", "moe_input", 1, 64)
    assert set(s.to_dict()) == {"name", "kind", "layer", "width", "format", "bits", "rows_per_token"}
    spec = RunSpec("r", (s,))
    stored = json.dumps({"run": "r", "sites": [{"name": "layers.1.mlp.input", "kind": "moe_input", "layer": 1,
                         "width": 64, "format": "nvfp4", "bits": 1, "rows_per_token": 1}]}, sort_keys=True)  # fmt: skip
    assert spec.to_json() == stored and RunSpec.from_json(stored) == spec
    assert site_digest(spec, ["layers.1.mlp.input"]) == site_digest(RunSpec.from_json(stored), ["layers.1.mlp.input"])
    with pytest.raises(ConfigError, match="belong to routed_experts"):
        SiteSpec("layers.1.mlp.input", "moe_input", 1, 64, n_experts=8)


def test_artifact_site_has_no_fp4_format() -> None:
    with pytest.raises(ConfigError, match="not an FP4 site"):
        _ = logprobs_site().fmt


@pytest.mark.parametrize("gate", [None, "float32", "bfloat16"])
@pytest.mark.parametrize("n_experts", [8, 256, 384])
def test_routing_round_trip(gate: str | None, n_experts: int) -> None:
    rng = np.random.default_rng(n_experts)
    site = routed_experts_site(2, top_k=4, n_experts=n_experts, gate=gate)
    experts = np.stack([rng.choice(n_experts, 4, replace=False) for _ in range(7)])
    weights = rng.random((7, 4)).astype(np.float32)
    valid = np.array([1, 1, 0, 1, 1, 1, 0], bool)
    codes, scales = encode_routing(site, experts, None if gate is None else weights, valid)
    assert codes.shape == (7, site.code_bytes) and scales.shape == (7, site.scale_bytes)
    assert site.scale_bytes == 1 + 4 * {None: 0, "float32": 4, "bfloat16": 2}[gate]
    d = decode_routing(site, codes, scales)
    assert np.array_equal(d.valid, valid)
    assert np.array_equal(d.experts[valid], experts[valid]) and not d.experts[~valid].any()
    if gate is None:
        assert d.gate is None
    else:
        assert d.gate is not None
        tol = 0 if gate == "float32" else 2**-8
        np.testing.assert_allclose(d.gate[valid], weights[valid], rtol=tol, atol=0)
    # a row missing from the read is invalid whatever its flag says
    present = np.ones(7, bool)
    present[0] = False
    assert not decode_routing(site, codes, scales, present).valid[0]


def test_logprobs_round_trip() -> None:
    site = logprobs_site()
    lp = np.array([-0.5, -3.25, 0.0, -12.0], np.float32)
    codes, scales = encode_logprobs(site, lp, np.array([1, 0, 1, 1], bool))
    values, valid = decode_logprobs(site, codes, scales)
    assert valid.tolist() == [True, False, True, True] and values[valid].tolist() == [-0.5, 0.0, -12.0]


def _chunk(site: SiteSpec, codes: np.ndarray, scales: np.ndarray, n: int) -> RecordChunk:
    return RecordChunk("r", 0, "t", site.name, 0, n, codes, scales, 1.0)


def test_chunk_validation_names_the_layout() -> None:
    site = routed_experts_site(0, top_k=2, n_experts=8, gate="float32")
    codes, scales = encode_routing(site, np.array([[1, 2], [3, 4]]), np.ones((2, 2), np.float32))
    _chunk(site, codes, scales, 2).validate(site)
    with pytest.raises(ShapeError, match=r"scales must be uint8\[2, 9\] \(routed_experts: codes = top_k 2 uint8"):
        _chunk(site, codes, scales[:, :5], 2).validate(site)
    bad = scales.copy()
    bad[1, 0] = 3
    with pytest.raises(ValidationError, match="flag byte 3; expected 0 or 1"):
        _chunk(site, codes, bad, 2).validate(site)
    over = codes.copy()
    over[0, 1] = 8
    with pytest.raises(ValidationError, match="below n_experts 8"):
        _chunk(site, over, scales, 2).validate(site)
    twice = codes.copy()
    twice[1] = [5, 5]
    with pytest.raises(ValidationError, match="names an expert twice"):
        _chunk(site, twice, scales, 2).validate(site)
    flagged_off = scales.copy()
    flagged_off[0, 0] = 0  # an invalid row's ids are not checked
    _chunk(site, over, flagged_off, 2).validate(site)
    lps = logprobs_site()
    c, s = encode_logprobs(lps, np.array([np.nan], np.float32), np.array([False]))
    _chunk(lps, c, s, 1).validate(lps)
    c[:] = np.frombuffer(np.float32(np.inf).tobytes(), np.uint8)
    s[:] = 1
    with pytest.raises(ValidationError, match="finite"):
        _chunk(lps, c, s, 1).validate(lps)
    with pytest.raises(ValidationError, match="global_scale 1.0"):
        RecordChunk("r", 0, "t", site.name, 0, 2, codes, scales, 0.5).validate(site)


def test_wire_round_trip_and_size_refusal() -> None:
    spec = RunSpec("r", (SiteSpec("layers.0.mlp.input", "moe_input", 0, 32),
                         routed_experts_site(0, 8, 300, gate="bfloat16"), logprobs_site()))  # fmt: skip
    assert run_spec_from_pb(run_spec_to_pb(spec)) == spec
    site = spec.site("layers.0.mlp.router")
    codes, scales = encode_routing(site, np.arange(16).reshape(2, 8) * 7, np.ones((2, 8), np.float32))
    c = chunk_to_pb(_chunk(site, codes, scales, 2))
    got = chunk_from_parts("r", c, site, c.codes, c.scales, None)
    assert np.array_equal(got.codes, codes) and np.array_equal(got.scales, scales)
    with pytest.raises(
        ValidationError, match=r"expected codes/scales/token_scales of 32/34/0 bytes .*uint16 expert ids"
    ):
        chunk_from_parts("r", c, site, c.codes[:-2], c.scales, None)


def test_bytes_per_token() -> None:
    assert routing_bytes_per_token(58, 8, 256) == 58 * 9
    assert routing_bytes_per_token(58, 8, 256, "bfloat16") == 58 * 25
