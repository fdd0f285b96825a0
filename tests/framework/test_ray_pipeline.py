"""The Ray pipeline of examples/ray_pipeline.py, small, on a local Ray cluster on the CPU.

Two rollout actors (each with its own `tracestore serve`), a data-parallel-2 trainer group and a
context-parallel-2 trainer group, two steps; in the second, one rollout actor's sidecar is killed
in the middle of its rollout. Every rank's guidance rows equal the records of exactly its tokens,
each rank's reader holds only its slice, the driver moves only small refs, the killed sidecar's
trajectories come back unguided in their refs, and every ref handed out stays readable
(`tracestore check` exits 0 on all of them afterwards).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tracestore.cli import main

pytest.importorskip("ray", reason="the Ray pipeline test needs ray (pip install 'tracestore[framework]')")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_pipeline.py"


def _example():
    spec = importlib.util.spec_from_file_location("ray_pipeline", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ray_pipeline"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_ray_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = _example().run(str(tmp_path / "work"), n_rollout=2, batch=3, num_cpus=4)
    assert summary["problems"] == [], summary["problems"]
    v0, v1 = summary["steps"]
    assert v0["unguided"] == [] and v0["refs"] == 6
    # the killed sidecar's rollout: its three trajectories are unguided, with the reason
    assert sorted(t for t, _ in v1["unguided"]) == [f"v1-r1-p{j}::a0" for j in range(3)]
    assert {r for _, r in v1["unguided"]} <= {"sidecar_unreachable", "unpublished", "not_durable"}
    assert max(v0["ref_bytes_max"], v1["ref_bytes_max"]) <= 512
    for step in (v0, v1):
        assert len(step["ranks"]) == 4
        for rank in step["ranks"]:
            assert rank["held_bytes"] <= 2 * rank["slice_bytes"] + (256 << 10)
    # in the forward, the trained codes keep the recorded low bits: exactly on the DP ranks (their
    # full-sequence forward is the rollout's), nearly on the CP ranks (chunk-local attention)
    for rank in v0["ranks"]:
        assert rank["agreement"], rank
        floor = 0.999 if rank["group"] == "dp2-padded" else 0.95
        assert min(rank["agreement"].values()) >= floor, rank
        assert rank["agreement"]["layers.0.attn.k"] >= 0.999  # K/V of layer 0: no attention before them
    # a DP rank trains only the unguided rollout's samples in step 1: all its rows are RTN
    assert any(r["unguided_fraction"] == 1.0 for r in v1["ranks"])
    # everything acknowledged stays readable, the killed actor's step-0 refs included
    assert main(["check", summary["storage"], "--refs", summary["refs_file"]]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "OK: aligned" in out and out.count("unguided (") == 3
