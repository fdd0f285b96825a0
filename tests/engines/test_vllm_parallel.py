"""Tensor and data parallelism with vLLM's own parallel state (gloo on the CPU, one process per
rank): the worker-role connector leaves recording to TP rank 0 (every rank of the group holds the
same MoE and column-parallel inputs), row-parallel inputs (a slice per rank) are not recorded on
any rank, and a ``sidecar=`` template gets each recording rank's own address."""

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


def run_ranks(tmp_path: Path, tp: int, dp: int) -> list[dict]:
    """Start ``tp × dp`` rank processes (vllm_tp_rank.py) and return what each wrote, by global rank."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "vllm_tp_rank.py"),
                *map(str, (r % tp, tp, port, tmp_path / f"r{r}.json", r // tp, dp)),
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(tp * dp)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(tp * dp)]


def test_only_tensor_parallel_rank_0_records(tmp_path: Path) -> None:
    r0, r1 = run_ranks(tmp_path, 2, 1)
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1) and r0["tp_size"] == r1["tp_size"] == 2
    assert r0["records"] and not r1["records"]
    assert r0["sites"] == {"column": "layers.0.self_attn.qkv_proj.input", "row": None}
    assert r1["sites"] == {"column": None, "row": None}
    assert r0["row_input_is_parallel"]
    assert r0["address"] == "unix:///run/ts/0-00.sock" and r1["address"] is None


def test_each_data_parallel_replica_records_to_its_own_sidecar(tmp_path: Path) -> None:
    """TP 2 × DP 2 in vLLM's offline data-parallel mode: vLLM's world spans both replicas (ranks
    0..3); TP rank 0 of each replica records, and ``sidecar=unix:///run/ts/{dp_rank}-{rank:02d}.sock``
    gives them ``0-00`` and ``1-02``."""
    out = run_ranks(tmp_path, 2, 2)
    assert [o["world_rank"] for o in out] == [0, 1, 2, 3]
    assert [o["ranks"] for o in out] == [{"rank": r, "dp_rank": r // 2} for r in range(4)]
    assert [o["records"] for o in out] == [True, False, True, False]
    assert [o["address"] for o in out] == ["unix:///run/ts/0-00.sock", None, "unix:///run/ts/1-02.sock", None]
