"""Tensor parallelism with vLLM's own parallel state: two processes form a TP group of 2 (gloo on
the CPU); the worker-role connector leaves recording to TP rank 0 (every rank of the group holds
the same MoE and column-parallel inputs), and row-parallel inputs (a slice per rank) are not
recorded on any rank."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: the engine venv (.ci/engines-venv) runs these")
pytestmark = pytest.mark.engines

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_only_tensor_parallel_rank_0_records(tmp_path: Path) -> None:
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "vllm_tp_rank.py"), str(r), "2", str(port), str(tmp_path / f"r{r}.json")],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1))
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1) and r0["tp_size"] == r1["tp_size"] == 2
    assert r0["records"] and not r1["records"]
    assert r0["sites"] == {"column": "layers.0.self_attn.qkv_proj.input", "row": None}
    assert r1["sites"] == {"column": None, "row": None}
    assert r0["row_input_is_parallel"]
