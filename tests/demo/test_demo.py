"""tracestore demo: a small run end to end (kernels -> record_slab -> serve -> storage -> reader ->
GuidedFP4Hooks -> training steps), the expectations, and the parts it is built of."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

torch = pytest.importorskip("torch", reason="the demo needs torch")
pytest.importorskip("transformers", reason="the demo needs the demo extra (transformers)")

from tracestore.cli import main  # noqa: E402
from tracestore.demo.fidelity import site_stats  # noqa: E402
from tracestore.demo.model import ModelSpec, build_model  # noqa: E402
from tracestore.demo.report import WIDTH, format_table  # noqa: E402
from tracestore.demo.rollout import run_rollout  # noqa: E402
from tracestore.demo.run import DemoConfig, memory_guidance, run_demo  # noqa: E402
from tracestore.demo.train import codes_on_grid, standard_modes, train_steps  # noqa: E402
from tracestore.demo.transport import run_specs, service_available  # noqa: E402
from tracestore.errors import ConfigError  # noqa: E402
from tracestore.formats import NVFP4  # noqa: E402
from tracestore.fp4 import dequantize, quantize  # noqa: E402
from tracestore.packing import pack_bits, unpack_bits  # noqa: E402

SMALL = ModelSpec(
    "qwen3_moe", layers=4, hidden=64, heads=2, kv_heads=1, experts=4, top_k=2, expert_hidden=64, vocab=256
)
SMALL_ARGS = ["--layers", "4", "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--experts", "4", "--vocab", "256",
              "--trajectories", "4", "--prompt", "8", "--tokens", "16", "--device", "cpu", "--no-progress"]  # fmt: skip


def small_config(**kw: object) -> DemoConfig:
    base: dict[str, object] = {"model": SMALL, "trajectories": 4, "prompt": 8, "tokens": 16, "device": "cpu"}
    return DemoConfig(**{**base, **kw})  # type: ignore[arg-type]


def assert_issue_expectations(results: dict) -> None:
    """Issue 6, checked from the per-layer numbers (not only from the report's own flags)."""
    rows = results["moe_input"]
    assert len(rows) == SMALL.layers
    half = SMALL.layers // 2
    # FP4 amplifies a discrepancy where it flips codes. At layer 0 the trainer's and the rollout's
    # inputs differ only by the attention's reduction order, which on some CPUs (an AVX2-only AMD
    # EPYC, 2026-12-02) flips no code in these small runs: there vanilla QAT equals the rollout
    # (excess -1) and there is nothing to amplify. The deeper half must flip codes everywhere.
    assert all(r["mse_rtn"] > 0 for r in rows if r["layer"] >= half), [r["mse_rtn"] for r in rows]
    for r in rows:
        assert r["mse_bf16"] > 0, "the BF16 reference must show some train-rollout discrepancy"
        if r["mse_rtn"] > 0:
            assert r["excess_rtn"] > 1, "vanilla QAT must show FP4-amplified discrepancy where codes flip"
        assert r["ratio_trace_all"] <= 0.05, r
        assert r["ratio_trace_full"] <= 0.05, r
        if r["layer"] >= half:
            assert r["recorded_trace_compact"]
            assert r["ratio_trace_compact"] < 1.0, r
        else:
            assert not r["recorded_trace_compact"]
    lp = results["logprob_diff"]
    gap_rtn = abs(lp["rtn"]["mean"] - lp["bf16"]["mean"])
    for m in ("trace_compact", "trace_all", "trace_full"):
        assert abs(lp[m]["mean"] - lp["bf16"]["mean"]) < gap_rtn, (m, lp)
    assert all(c["ok"] for c in results["expectations"]), results["expectations"]
    steps = results["per_step"]
    assert set(steps) == {"bf16", "rtn", "trace_compact", "trace_all", "trace_full"}
    for rows_ in steps.values():
        assert [r["step"] for r in rows_] == list(range(results["config"]["steps"]))
    # step 0 trains on the rollout's weights: TRACE on every layer consumes exactly the rollout's values
    assert steps["trace_all"][0]["mse_moe"] == 0 and steps["trace_all"][0]["mismatch"] == 0
    assert steps["rtn"][0]["mismatch"] > 0 and steps["rtn"][0]["kl_mean"] > steps["trace_all"][0]["kl_mean"]
    text = format_table(results)
    assert text.splitlines()[0].startswith("VERDICT: OK")
    assert max(map(len, text.splitlines())) <= WIDTH


@pytest.mark.slow
def test_small_demo_in_memory_meets_the_issue_expectations() -> None:
    results = run_demo(small_config(transport="memory"))
    assert results["transport"]["path"] == "memory"
    assert "NOT through the service" in results["transport"]["summary"]
    assert_issue_expectations(results)


@pytest.mark.slow
@pytest.mark.skipif(service_available() is not None, reason=f"service parts not installed: {service_available()}")
def test_small_demo_through_the_service_meets_the_issue_expectations(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # A relative --out, as the README's `tracestore demo` uses (./tracestore-demo): the server
    # subprocess runs in another directory, so every path handed to it must be absolute.
    monkeypatch.chdir(tmp_path)
    results = run_demo(small_config(transport="service"), out=pathlib.Path("."))
    t = results["transport"]
    assert t["path"] == "service" and t["storage"].startswith("file://")
    assert t["read_back_identical"] == {"trace_compact": True, "trace_all": True, "trace_full": True}
    assert "record_slab" in t["summary"] and "GuidedFP4Hooks" in t["summary"]
    assert list((tmp_path / "service" / "store").rglob("*.parquet")), "no shard reached storage"
    assert_issue_expectations(results)


def test_rollout_runs_positions_0_to_n_minus_2_and_training_aligns_with_it() -> None:
    """fp32, unquantized: the cached rollout and the teacher-forced training forward agree to float
    noise, which only holds when rows, positions and log-prob offsets line up."""
    model = build_model(SMALL, dtype=torch.float32, seed=3)
    prompts = torch.randint(3, 256, (2, 5), generator=torch.Generator().manual_seed(4))
    roll = run_rollout(model, prompts, 6, fmt=None, generator=torch.Generator().manual_seed(5))
    assert roll.forwards == [(0, 5), (5, 6), (6, 7), (7, 8), (8, 9), (9, 10)]
    assert roll.tokens.shape == (2, 11) and torch.equal(roll.tokens[:, :5], prompts)
    assert roll.dist.shape == (2, 6, 256)
    replay = run_rollout(model, prompts, 6, fmt=None, tokens=roll.tokens)
    assert torch.equal(replay.tokens, roll.tokens)
    (step,) = train_steps(model, roll, roll, standard_modes(4)[0], NVFP4, None, steps=1, lr=0.0)
    assert step.logp_max < 1e-4 and step.kl_mean < 1e-6
    for name, tr in roll.sites.items():
        assert tr.y.shape[1] == 10  # the last token never entered a forward
        assert step.sites[name].mse < 1e-9, name


def test_training_steps_update_a_copy_and_report_each_step() -> None:
    model = build_model(SMALL, dtype=torch.float32, seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = torch.randint(3, 256, (2, 5), generator=torch.Generator().manual_seed(4))
    roll = run_rollout(model, prompts, 4, fmt=NVFP4, scales="token", generator=torch.Generator().manual_seed(5))
    mode = standard_modes(4)[3]
    steps = train_steps(model, roll, roll, mode, NVFP4, memory_guidance(roll, mode), rtn_scale="token", steps=3)
    assert [s.step for s in steps] == [0, 1, 2]
    assert steps[0].logp_max < steps[2].logp_max  # the trainer moves away from the rollout's policy
    assert all(s.sites["layers.3.mlp.input"].mismatch == 0 for s in steps[:1])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the base is untouched


@pytest.mark.parametrize("scales", ["static", "token", "forward"])
def test_fp4_rollout_records_through_kernels_into_run_slabs(scales: str) -> None:
    model = build_model(SMALL, dtype=torch.bfloat16, seed=3)
    prompts = torch.randint(3, 256, (2, 5), generator=torch.Generator().manual_seed(4))
    modes = standard_modes(4)
    from tracestore.client.hf.hooks import HFSiteHooks

    with HFSiteHooks(model, lambda s, x: None) as h:
        runs = run_specs(modes, h.sites, "nvfp4")
    seen: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def on_forward(start: int, end: int, slabs: dict, rows: int, token_ids: object = None) -> None:
        assert rows == 2 * (end - start)
        b = slabs["trace_compact"]["layers.3.mlp.input"]
        seen.append((start, end, b.codes[:rows].clone(), b.scales[:rows].clone(), b.global_scale[:rows].clone()))

    roll = run_rollout(
        model, prompts, 4, fmt=NVFP4, scales=scales, runs=runs, on_forward=on_forward,
        generator=torch.Generator().manual_seed(5),
    )  # fmt: skip
    tr = roll.sites["layers.3.mlp.input"]
    assert tr.g is not None and tr.codes is not None and tr.scales is not None
    assert [(s, e) for s, e, *_ in seen] == [(0, 5), (5, 6), (6, 7), (7, 8)]
    for start, end, codes, scales_, g in seen:  # slab rows are batch-major: row b*T + t
        t = end - start
        assert torch.equal(unpack_bits(codes, 1, 64).reshape(2, t, 64), tr.codes[:, start:end] & 1)
        assert torch.equal(scales_.reshape(2, t, -1), tr.scales[:, start:end])
        assert torch.equal(g.reshape(2, t), tr.g[:, start:end])
    if scales == "static":
        assert torch.all(tr.g == roll.static_g["layers.3.mlp.input"])
    elif scales == "forward":  # one g per forward
        assert all(bool((tr.g[:, s:e] == tr.g[0, s]).all()) for s, e in roll.forwards)
    else:  # one per token
        assert tr.g.unique().numel() > len(roll.forwards)
    compact = modes[2]
    gd = memory_guidance(roll, compact)
    assert set(gd) == {f"layers.{i}.{s}" for i in (2, 3) for s in ("mlp.input", "attn.k", "attn.v")}
    g = gd["layers.3.mlp.input"]
    assert g.codes.shape == (2 * 9, 64 // 8) and g.scales.shape == (2 * 9, 4)
    valid = g.valid.reshape(2, 9)
    assert bool(valid[:, :8].all()) and not valid[:, 8].any()
    assert torch.equal(g.codes.reshape(2, 9, -1)[:, :8], pack_bits(tr.codes, 1))


def test_codes_on_grid_recovers_the_codes_of_dequantized_values() -> None:
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * 3
    q = quantize(x, NVFP4)
    for dtype in (torch.float32, torch.bfloat16):
        y = dequantize(q).to(dtype)
        got = codes_on_grid(y, q.scales, torch.full((6,), float(q.global_scale)), NVFP4)
        assert torch.equal(got, q.codes), dtype


def test_site_stats_counts_adjacent_mismatches_on_the_signed_codeword_line() -> None:
    roll = torch.tensor([[[1, 2, 8, 0, 9, 3]]], dtype=torch.uint8)  # +0.5 +1 -0 +0 -0.5 +1.5
    train = torch.tensor([[[1, 3, 0, 9, 1, 5], [0] * 6]], dtype=torch.uint8)[
        :, :1
    ]  # same, adj, same(+-0), adj, 2 apart, 2 apart
    y = torch.zeros(1, 1, 6)
    s = site_stats(y, torch.zeros(1, 2, 6), roll, torch.cat([train, train], 1))
    assert s.mse == 0.0
    assert s.mismatch == pytest.approx(4 / 6) and s.adjacent == pytest.approx(2 / 4)


def test_cli_writes_table_json_and_plots(tmp_path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "out"
    rc = main(["demo", "--out", str(out), "--transport", "memory", "--layers", "2", "--steps", "2", *SMALL_ARGS[2:]])
    text = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert rc == (0 if all(c["ok"] for c in results["expectations"]) else 1)
    lines = text.splitlines()
    assert lines[0].startswith("VERDICT:") and "Checks" in lines and "in memory (NOT through the service" in text
    assert max(map(len, lines)) <= WIDTH
    assert sum(1 for line in lines if line.startswith("Columns:")) == 1
    assert " 0 " in text or text.count(" 0\n")  # exact zeros print as 0
    assert results["config"]["model"]["layers"] == 2 and len(results["moe_input"]) == 2
    assert all(len(v) == 2 for v in results["per_step"].values())
    assert all(math.isfinite(r["mse_rtn"]) for r in results["moe_input"])
    for png in ("excess_mse.png", "logprob_diff.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{"scales": "token"}, {"scales": "forward"}, {"format": "mxfp4"}])
def test_small_demo_scales_and_formats_meet_the_expectations(kw: dict) -> None:
    results = run_demo(small_config(transport="memory", **kw))
    assert all(c["ok"] for c in results["expectations"]), results["expectations"]
    assert results["per_step"]["trace_all"][0]["mismatch"] == 0
    # vanilla QAT's mismatches: mostly one codeword away (reported per layer)
    assert all(r["adjacent_rtn"] is None or r["adjacent_rtn"] > 0.5 for r in results["moe_input"])


def test_bad_configuration_is_refused_with_a_clear_message(capsys) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="arch must be one of"):
        ModelSpec("llama")
    with pytest.raises(ConfigError, match="multiples of 16"):
        ModelSpec(hidden=72, heads=3, kv_heads=1)
    with pytest.raises(ConfigError, match="bits must be 1..4"):
        DemoConfig(bits=5)
    with pytest.raises(ConfigError, match="scales must be one of"):
        DemoConfig(scales="row")
    with pytest.raises(ConfigError, match="format must be one of"):
        DemoConfig(format="fp8")
    assert main(["demo", "--arch", "gpt2", "--no-progress", "--transport", "memory"]) == 2
    assert "arch must be one of" in capsys.readouterr().err
