"""vLLM end to end on the CPU: a tiny random NVFP4 Qwen3-MoE (tests/engines/nvfp4_model.py: NVFP4
attention projections and experts) generates with ``LLM.generate`` — vLLM's emulation kernels, the
experts given a CPU path (tests/engines/vllm_e2e_engine.py) — and the tracestore plugin (loaded
through its entry point) against a real ``tracestore serve``; then a trainer's TRACE forward in
transformers reproduces the engine's FP4 codes on every recorded value of every recorded site, the
MoE expert inputs (FC1) included, where plain RTN does not; the routing recorded at vLLM's own
routed-experts capture point, read back through ``GuidanceReader``, equals the experts the engine's
MoE layers consumed, and replayed on the trainer model (``RoutingReplayHooks``) the trainer's experts
are the engine's on every valid row. Run plainly, with vLLM's ngram speculative decoding (drafts held
until accepted, rejected ones never stored) and compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: the engine venv (.ci/engines-venv) runs these")
pytestmark = [pytest.mark.engines, pytest.mark.slow]

from tracestore.client.engines.rows import trajectory_id  # noqa: E402
from tracestore.server.testing import ServeProcess  # noqa: E402

from tests.engines.nvfp4_model import write_checkpoint  # noqa: E402
from tests.engines.trace_forward import load_trainer_model, trace_forward  # noqa: E402
from tracestore import Store, StoreReader  # noqa: E402
from tracestore.traceref import TraceRef, attempt_id, check_refs  # noqa: E402

HERE = Path(__file__).parent
SITES = {f"layers.{i}.self_attn.{p}.input" for i in (0, 1) for p in ("qkv_proj", "o_proj")} | {
    f"layers.{i}.mlp.input" for i in (0, 1)
}
ROUTERS = {f"layers.{i}.mlp.router" for i in (0, 1)}


def _engine_routing(result: dict, ids_of: dict[str, list[int]]) -> dict[str, dict[int, list[list[int]]]]:
    """Each trajectory's experts per position as the engine's MoE layers consumed them: its own
    forwards' rows, and for a prefix it did not compute (a cache hit, a GRPO sibling's prompt) the
    rows of the request that computed those positions with the same tokens."""
    by_req = {attempt_id(trajectory_id(rid), 0): {int(p): v for p, v in rows.items()}
              for rid, rows in result["routing"].items()}  # fmt: skip
    out = {}
    for traj, ids in ids_of.items():
        own = dict(by_req.get(traj, {}))
        for p in range(len(ids) - 1):
            if p not in own:
                src = next(
                    (t for t, r in by_req.items() if p in r and ids_of.get(t, [])[: p + 1] == ids[: p + 1]), None
                )
                assert src is not None, (traj, p)
                own[p] = by_req[src][p]
        out[traj] = own
    return out


def _check_routing(storage: Path, run: str, model: Any, ids_of: dict[str, list[int]], truth: dict) -> None:
    """Routing read through ``GuidanceReader`` equals ``truth`` on every fed position; replayed on
    the trainer model, the experts the trainer's MoE blocks use are the recorded ones on every valid
    row (the last position, never fed, falls back to the live router)."""
    import torch
    from tracestore.client import GuidanceReader, RoutingCapture, RoutingReplayHooks

    from tracestore.artifacts import Routing
    from tracestore.plan import MicrobatchPlan

    with GuidanceReader(str(storage), run, prefetch=False) as reader:
        for traj, ids in ids_of.items():
            rows = reader.read(MicrobatchPlan([(traj, 0, len(ids))]), token_ids=ids)
            routing = {k: v for k, v in rows.items() if isinstance(v, Routing)}
            assert set(routing) == ROUTERS, traj
            n = len(ids)
            for site, r in routing.items():
                layer = int(site.split(".")[1])
                assert r.site.width == 2 and r.site.n_experts == 8 and r.gate is None
                assert r.valid[:-1].all() and not r.valid[-1], traj
                want = torch.tensor([truth[traj][p][layer] for p in range(n - 1)])
                assert torch.equal(r.experts[:-1], want), (traj, site)  # the engine's ids, slot order kept
            r3 = RoutingReplayHooks(model).set_routing(routing)
            used = RoutingCapture(model)  # inside the replay: sees the experts the blocks are given
            with torch.no_grad():
                model(input_ids=torch.tensor([ids]), use_cache=False)
            used.remove()
            r3.remove()
            for site, r in routing.items():
                assert torch.equal(used.last[site][0][:-1], r.experts[:-1]), (traj, site)  # 100% on valid rows
            assert r3.stats["replayed_rows"] == 2 * (n - 1) and r3.stats["fallback_rows"] == 2


def _ids_by_trajectory(result: dict) -> dict[str, list[int]]:
    """Each ended trajectory's token ids: a request's own, or child k's of an n > 1 request (vLLM
    names child k of request r ``{k}_{r}-<suffix>``)."""
    out = {}
    for q in result["requests"]:
        for k, output in enumerate(q["all_output_ids"]):
            if len(q["all_output_ids"]) == 1:
                traj = q["tracestore"]["trajectory"]
            else:
                traj = next(
                    e["trajectory"] for e in result["ended"] if e["trajectory"].startswith(f"{k}_{q['request']}-")
                )
            out[traj] = q["prompt_ids"] + output
    return out


@pytest.mark.parametrize(
    "spec, compiled", [(False, False), (True, False), (False, True)], ids=["plain", "ngram-spec-decode", "compiled"]
)
def test_vllm_generate_records_and_trace_reproduces_the_engine_codes(
    tmp_path: Path, spec: bool, compiled: bool
) -> None:
    """``compiled``: ``enforce_eager=False`` — vLLM compiles the model with torch.compile (dynamo +
    inductor); the dense sites are recorded by the graph op inside the compiled graph, the MoE input
    by the op inside vLLM's opaque MoE op, every forward's rows committed from the slab."""
    model_dir = write_checkpoint(tmp_path / "model", moe=True)
    sp = ServeProcess(tmp_path / "sidecar", flags=["--flush-interval", "0.2"])
    sp.start()
    try:
        env = dict(os.environ)
        env["TRACESTORE_RECORD"] = f"sidecar={sp.address} run=e2e policy_version=3 sites=all bits=4 writer=vllm-cpu-0"
        out = tmp_path / "engine.json"
        # from outside the checkout, as an engine runs
        proc = subprocess.run(
            [sys.executable, str(HERE / "vllm_e2e_engine.py"), str(model_dir), str(out), "--moe", "--cases"]
            + (["--spec"] if spec else []) + (["--compiled"] if compiled else []),
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
    finally:
        sp.terminate()
    result = json.loads(out.read_text())
    assert result["flushed"], result
    graph = result["graph"]
    if compiled:  # every site went through the op into the slab; every forward committed from it
        assert graph["active"] and graph["armed"] and graph["writes"] > 0, graph
        assert graph["late"] == graph["unarmed_capture"] == graph["clipped"] == 0, graph
    else:
        assert not graph["active"] and graph["writes"] == 0, graph
    reqs = result["requests"]
    assert [q["num_cached_tokens"] for q in reqs] == [0, 0, 0, 64, 64]  # vLLM's own prefix-cache hits
    stats = result["stats"]
    # 3 prompts (14 tokens, one prefill) + 11 decode steps of 3; a 72-token prompt sampled twice (n = 2:
    # child 1 hits child 0's cached 64 tokens, computes 8) + 3 decode steps of 2; a 67-token prompt
    # hitting 64 cached tokens (3 computed) + 3 decode steps
    # every position once: the rows recorded at once plus the accepted drafts released later
    assert stats["rows"] + stats["released"] == (14 + 11 * 3) + (72 + 8 + 3 * 2) + (3 + 3)
    assert stats["links"] == 2 and stats["seals"] == 6 and stats["gaps"] == 0
    if spec:  # ngram drafts (greedy decoding of a random model repeats itself): some accepted, most not
        assert stats["released"] > 0 and stats["dropped"] > 0 and stats["held"] >= stats["released"] + stats["dropped"]
    else:
        assert stats["held"] == 0
    ids_of = _ids_by_trajectory(result)
    assert len(ids_of) == 6
    model = load_trainer_model(model_dir)
    _check_routing(sp.storage, "e2e", model, ids_of, _engine_routing(result, ids_of))
    with StoreReader(Store(sp.storage), "e2e") as reader:
        for ended in result["ended"]:
            traj, ids = ended["trajectory"], ids_of[ended["trajectory"]]
            ref = json.loads(ended["trace_ref"])
            assert ended["gap"] is None and ref["guided"] and ref["n_tokens"] == len(ids) == ended["n_tokens"]
            assert ref["policy_version"] == 3 and ref["writer"] == "vllm-cpu-0"
            rows = reader.read([(traj, 0, len(ids))], token_ids={traj: ids}, require_sealed=True)
            assert set(rows) == SITES | ROUTERS
            rows = {k: v for k, v in rows.items() if k in SITES}
            assert all(r.valid[:-1].all() and not r.valid[-1] for r in rows.values()), traj
            rtn = trace_forward(model, ids, rows, guided=False)
            traced = trace_forward(model, ids, rows, guided=True)
            for site in SITES:
                trainer, engine = traced[site]
                assert trainer.numel() == (len(ids) - 1) * 256
                assert int((trainer != engine).sum()) == 0, (traj, site)  # every value rounds as the engine did
            assert sum(int((a != b).sum()) for a, b in rtn.values()) > 0  # without guidance they differ


def test_vllm_multiprocess_engine_seals_in_its_worker(tmp_path: Path) -> None:
    """vLLM's default process layout (EngineCore, and the worker spawned from it): the worker records,
    the endings reach it through the connector's metadata while vLLM keeps the finished requests'
    blocks, it seals, and its recorder is flushed at shutdown. The request outputs carry the
    trajectory, the gap and the TraceRef, made by the scheduler from the run identity the worker
    sent back through vLLM's connector output; ``check_refs`` finds each sealed on storage."""
    model_dir = write_checkpoint(tmp_path / "model", moe=True)
    sp = ServeProcess(tmp_path / "sidecar", flags=["--flush-interval", "0.2"])
    sp.start()
    try:
        env = dict(os.environ)
        env["TRACESTORE_RECORD"] = f"sidecar={sp.address} run=mp policy_version=0 sites=all bits=4"
        out = tmp_path / "engine.json"
        proc = subprocess.run(
            [sys.executable, str(HERE / "vllm_e2e_engine.py"), str(model_dir), str(out), "--moe", "--mp"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=280,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
    finally:
        sp.terminate()
    reqs = json.loads(out.read_text())["requests"]
    assert len(reqs) == 3 and all(q["tracestore"]["gap"] is None for q in reqs)
    refs = [TraceRef.from_json(q["tracestore"]["trace_ref"]) for q in reqs]
    assert all(r.guided and r.run == "mp" for r in refs)
    model = load_trainer_model(model_dir)
    with StoreReader(Store(sp.storage), "mp") as reader:
        assert check_refs(refs, reader) == []
        for q in reqs:
            traj, ids = q["tracestore"]["trajectory"], q["prompt_ids"] + q["output_ids"]
            assert q["tracestore"]["n_tokens"] == len(ids)
            rows = reader.read([(traj, 0, len(ids))], token_ids={traj: ids}, require_sealed=True)
            assert set(rows) == SITES | ROUTERS and all(r.valid[:-1].all() for r in rows.values())
            rows = {k: v for k, v in rows.items() if k in SITES}
            for site, (trainer, engine) in trace_forward(model, ids, rows, guided=True).items():
                assert int((trainer != engine).sum()) == 0, (traj, site)


def test_example_vllm_record_runs_and_its_refs_check_out(tmp_path: Path) -> None:
    """``examples/engine/vllm_record.py`` as a user runs it (``--eager``; the CPU NVFP4 kernel from
    the test-only plugin on PYTHONPATH, a dense NVFP4 checkpoint): one JSON line per sample, each
    with a guided TraceRef that ``check_refs`` finds sealed on storage, every fed position readable."""
    from tests.engines.vllm_e2e_engine import plugin_dir

    model_dir = write_checkpoint(tmp_path / "model", moe=False)
    sp = ServeProcess(tmp_path / "sidecar", flags=["--flush-interval", "0.2"])
    sp.start()
    try:
        env = dict(os.environ)
        env["TRACESTORE_RECORD"] = f"sidecar={sp.address} run=example-run policy_version=0 sites=all"
        env["PYTHONPATH"] = os.pathsep.join([plugin_dir(str(tmp_path / "plugins")), str(HERE)])
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        example = HERE.parent.parent / "examples" / "engine" / "vllm_record.py"
        proc = subprocess.run(
            [sys.executable, str(example), str(model_dir), "--eager"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=280,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
    finally:
        sp.terminate()
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 4 and all(x["gap"] is None for x in lines)
    refs = [TraceRef.from_json(x["trace_ref"]) for x in lines]
    assert all(r.guided for r in refs)
    with StoreReader(Store(sp.storage), "example-run") as reader:
        assert check_refs(refs, reader) == []
        for r in refs:
            rows = reader.read([(r.stored_id, 0, r.n_tokens)], require_sealed=True)
            assert all(s.valid[:-1].all() for s in rows.values()), r.stored_id
