"""tracestore demo --r3: routing replay beside TRACE end to end on a family the routing tests do
not train (OLMoE), through its own `tracestore serve` and storage."""

from __future__ import annotations

import json
import pathlib

import pytest

torch = pytest.importorskip("torch", reason="the demo needs torch")
pytest.importorskip("transformers", reason="the demo needs the demo extra (transformers)")

from tracestore.cli import main  # noqa: E402
from tracestore.demo.model import ModelSpec  # noqa: E402
from tracestore.demo.r3 import TRAINERS, format_r3, run_r3  # noqa: E402
from tracestore.demo.report import WIDTH  # noqa: E402
from tracestore.demo.run import DemoConfig  # noqa: E402
from tracestore.storage.store import Store  # noqa: E402

HOLDOUT = ModelSpec("olmoe", layers=2, hidden=64, heads=2, kv_heads=1, experts=8, top_k=2, expert_hidden=32, vocab=64)


def test_r3_mode_end_to_end(tmp_path: pathlib.Path) -> None:
    cfg = DemoConfig(model=HOLDOUT, trajectories=3, prompt=6, tokens=8, device="cpu")
    r3 = run_r3(cfg, tmp_path)
    assert [c["ok"] for c in r3["expectations"]] == [True] * 4, r3["expectations"]
    table = r3["table"]
    assert list(table) == [t[0] for t in TRAINERS]
    for name, row in table.items():
        assert row["routing_rows"] == 3 * 13 * 2  # positions 0..12 of 14, two MoE layers
        if name.endswith("_r3"):
            assert row["routing_agreement"] == 1.0 and row["replay"]["replayed_rows"] == 78
            assert row["replay"]["fallback_rows"] == 6  # each trajectory's final position, per layer
        else:
            assert row["replay"] is None and 0 < row["routing_agreement"] <= 1.0
    # the records, routing and log-probs are on storage, sealed, in one run
    store = Store(r3["storage"])
    kinds = {s.kind for s in store.get_run("demo-r3").sites}
    assert {"moe_input", "key", "value", "routed_experts", "logprobs"} <= kinds
    lines = format_r3(r3)
    assert all(len(line) <= WIDTH for line in lines) and any("FP4 + TRACE + R3" in line for line in lines)


def test_demo_cli_r3_writes_its_table(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--arch", "olmoe", "--layers", "2", "--hidden", "64", "--heads", "2", "--kv-heads", "1",
            "--experts", "4", "--vocab", "64", "--trajectories", "2", "--prompt", "4", "--tokens", "4",
            "--steps", "1", "--device", "cpu", "--no-progress", "--r3", "--out", str(tmp_path)]  # fmt: skip
    main(args)
    text = capsys.readouterr().out
    assert "R3 + TRACE (olmoe" in text and "FP4 + TRACE + R3" in text
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["r3"]["table"]) == {t[0] for t in TRAINERS}
    assert any(c["check"].startswith("R3: with replay") and c["ok"] for c in results["expectations"])
