"""Routing capture in the vLLM plugin (vLLM 0.32.0): the contract of vLLM's routed-experts capture
points, the binding on vLLM's real router and sink classes, the row encoding against the store's own
decoder, the graph-safe op, and the row mapping through a real sidecar (eager and slab paths: padded
rows never stored, worker order, preemption, abort)."""

from __future__ import annotations

import ast
import inspect
import json
import zlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: the engine venv (.ci/engines-venv) runs these")
pytestmark = pytest.mark.engines

import torch  # noqa: E402
from tracestore.client.engines.graph import GraphCapture  # noqa: E402
from tracestore.client.engines.recording import EngineRecorder  # noqa: E402
from tracestore.client.engines.routing import route_rows, route_spec  # noqa: E402
from tracestore.client.engines.rows import RowMapper, Scheduled  # noqa: E402
from tracestore.client.engines.setting import parse_setting  # noqa: E402
from tracestore.client.engines.vllm import hooks  # noqa: E402
from tracestore.server.testing import ServeProcess  # noqa: E402

from tests.engines import _ast  # noqa: E402
from tests.engines.test_graph_capture import FORBIDDEN, OpLog  # noqa: E402
from tracestore.artifacts import Routing, decode_routing  # noqa: E402
from tracestore.errors import ConfigError  # noqa: E402
from tracestore.plan import MicrobatchPlan  # noqa: E402

FUSED = "vllm.model_executor.layers.fused_moe"


def params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


# -- contract -------------------------------------------------------------------------------------


def test_router_capture_fn_sees_logical_ids_before_the_eplb_mapping() -> None:
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    assert params(BaseRouter.set_capture_fn) == ["self", "capture_fn"]
    assert "self.capture_fn = None" in inspect.getsource(BaseRouter.__init__).replace(
        "self.capture_fn: Callable[[torch.Tensor], None] | None = None", "self.capture_fn = None"
    )
    fn = _ast.functions(_ast.source_tree(f"{FUSED}.router.base_router"), "_select_experts")[0]
    order = [_ast.dotted(c.func) for c in ast.walk(fn) if isinstance(c, ast.Call)]
    assert "self.capture_fn" in order and "self._apply_eplb_mapping" in order
    lines = {_ast.dotted(c.func): c.lineno for c in ast.walk(fn) if isinstance(c, ast.Call)}
    assert lines["self.capture_fn"] < lines["self._apply_eplb_mapping"]  # logical (pre-EPLB) ids


def test_monolithic_sink_is_filled_by_routing_replay_out() -> None:
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsMonolithic
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsSink

    assert params(RoutedExpertsSink.__init__) == ["self", "moe_config", "capture_fn"]
    assert callable(FusedMoEExpertsMonolithic.supports_routing_replay_capture)
    src = inspect.getsource(importlib_module(f"{FUSED}.modular_kernel"))
    assert "routing_replay_out = routing_sink.buffer[: len(a1q)]" in src
    assert "routing_sink.capture_fn(routing_replay_out)" in src
    assert "routing_replay_out=routing_replay_out" in src
    # every monolithic quant method hands the layer's sink to the kernel
    assert "routing_sink=layer.routing_sink" in inspect.getsource(
        importlib_module("vllm.model_executor.layers.quantization.modelopt")
    )
    # the binding tracestore mirrors: vLLM's own, for its RoutedExpertsCapturer
    bind = inspect.getsource(importlib_module(f"{FUSED}.routed_experts_capturer").bind_routed_experts_capturer)
    for needle in (
        "quant_method.is_monolithic",
        'getattr(quant_method, "moe_kernel", None)',
        'getattr(moe_kernel, "impl", None)',
        'getattr(impl, "fused_experts", None)',
        "fused_experts.supports_routing_replay_capture()",
        "module.routed_experts.routing_sink = RoutedExpertsSink(",
        "module.router.set_capture_fn(capture_fn)",
        "module.layer_id",
    ):
        assert needle in bind, needle


def test_runner_config_and_loader_fields() -> None:
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    assert {"experts_per_token", "num_logical_experts"} <= set(FusedMoEConfig.__dataclass_fields__)
    assert isinstance(inspect.getattr_static(MoERunner, "layer_id"), property)
    init = inspect.getsource(MoERunner.__init__)
    assert all(f"self.{a} = {a}" in init for a in ("router", "routed_experts", "moe_config"))
    assert "self.routing_sink" in inspect.getsource(RoutedExperts.__init__)
    assert "quant_method" in dir(RoutedExperts) or "self.quant_method" in inspect.getsource(RoutedExperts)
    assert params(BaseModelLoader.load_model) == ["self", "vllm_config", "model_config", "prefix"]
    get_model = inspect.getsource(importlib_module("vllm.model_executor.model_loader").get_model)
    assert "loader.load_model(" in get_model and "model_config=model_config" in get_model


def importlib_module(name: str) -> Any:
    import importlib

    return importlib.import_module(name)


# -- encoding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_experts, width", [(8, 2), (256, 8), (300, 4), (65536, 2)])
def test_rows_decode_with_the_store_decoder(n_experts: int, width: int) -> None:
    spec = route_spec(5, width, n_experts)
    assert spec.name == "layers.5.mlp.router" and spec.kind == "routed_experts" and spec.gate is None
    gen = torch.Generator().manual_seed(n_experts)
    ids = torch.stack([torch.randperm(n_experts, generator=gen)[:width] for _ in range(9)])
    extra = torch.full((9, 1), -1)  # a fused shared-expert column after the routed ones: dropped
    codes, flags, g = route_rows(torch.cat([ids, extra], 1).to(torch.int32), spec)
    rows = decode_routing(spec, codes.numpy(), flags.numpy())
    assert np.array_equal(rows.experts, ids.numpy()) and rows.valid.all() and rows.gate is None
    assert float(g) == 1.0


def test_route_op_is_device_ops_only_and_compiles_whole() -> None:
    graph = GraphCapture(bits=1)
    graph.active = True
    graph.install()
    spec = route_spec(0, 2, 8)
    graph.note_route(spec)
    assert graph.arm(16, "meta") and graph.slab is None and graph.route_rows is not None
    ids = torch.empty(12, 2, dtype=torch.int64, device="meta")
    with OpLog() as hook:
        graph.route(spec, ids)
    assert hook.names == ["tracestore::engine_route"]
    with OpLog() as body:
        graph.write_route(ids, spec.name)
    ops = {n.split("::")[1] for n in body.names}
    assert not ops & FORBIDDEN and "copy_" in ops
    graph = GraphCapture(bits=1)
    graph.active = True
    graph.install()
    graph.note_route(spec)
    graph.arm(8, "cpu")

    def step(logits: torch.Tensor) -> torch.Tensor:
        top = torch.topk(logits, 2, dim=-1)
        graph.route(spec, top.indices)
        return top.values.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for seed in (1, 2):
        logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
        compiled(logits)
        assert torch.equal(graph.route_rows.codes[spec.name][:6], torch.topk(logits, 2).indices.to(torch.uint8))


# -- binding on vLLM's classes ----------------------------------------------------------------------


@pytest.fixture
def engine() -> Iterator[EngineRecorder]:
    eng = EngineRecorder(parse_setting("sidecar=127.0.0.1:1 run=routes policy_version=0"))
    old = hooks.ENGINE, hooks.GRAPH
    hooks.ENGINE, hooks.GRAPH = eng, None
    yield eng
    hooks.ENGINE, hooks.GRAPH = old


def _runner(router: Any, monolithic: bool = False, fused: Any = None, layer: int = 3) -> SimpleNamespace:
    """A vLLM MoERunner's routing attributes (the fields the contract above checks) around real
    router / kernel objects."""
    qm = SimpleNamespace(
        is_monolithic=monolithic, moe_kernel=SimpleNamespace(impl=SimpleNamespace(fused_experts=fused))
    )
    cfg = SimpleNamespace(experts_per_token=2, num_logical_experts=8)
    return SimpleNamespace(
        layer_id=layer,
        moe_config=cfg,
        router=router,
        routed_experts=SimpleNamespace(quant_method=qm, routing_sink=None),
    )


def test_router_binding_records_the_ids_vllm_routes_with(engine: EngineRecorder) -> None:
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    router = CPURouter(top_k=2, global_num_experts=8)
    foreign: list[torch.Tensor] = []
    router.set_capture_fn(lambda ids: foreign.append(ids.clone()))  # e.g. vLLM's own capturer
    runner = _runner(router)
    assert hooks.bind_routing(runner) == "router" and hooks.bind_routing(runner) == "router"  # idempotent
    x, logits = torch.randn(7, 16), torch.randn(7, 8)
    _, topk_ids = router.select_experts(x, logits)
    codes, flags, _ = engine._sites["layers.3.mlp.router"]
    spec = engine.artifacts["layers.3.mlp.router"]
    assert (spec.width, spec.n_experts) == (2, 8)
    assert np.array_equal(decode_routing(spec, codes.numpy(), flags.numpy()).experts, topk_ids.numpy())
    assert len(foreign) == 1 and torch.equal(foreign[0], topk_ids)  # the earlier capture still runs, once


def test_monolithic_binding_uses_vllms_sink(engine: EngineRecorder, caplog: pytest.LogCaptureFixture) -> None:
    from vllm.model_executor.layers.fused_moe.experts.trtllm_nvfp4_moe import TrtLlmNvFp4ExpertsMonolithic
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsSink

    fused = object.__new__(TrtLlmNvFp4ExpertsMonolithic)  # the kernel class (its GPU setup skipped)
    fused.moe_config = SimpleNamespace(
        ep_size=1, use_ep=False, dp_size=1, max_num_tokens=32, experts_per_token=2, device="cpu"
    )
    runner = _runner(None, monolithic=True, fused=fused, layer=1)
    assert hooks.bind_routing(runner) == "sink"
    sink = runner.routed_experts.routing_sink
    assert isinstance(sink, RoutedExpertsSink) and sink.buffer.dtype == torch.int16
    ids = torch.tensor([[3, 1], [0, 7], [5, 2]], dtype=torch.int16)
    out = sink.buffer[:3]  # as vLLM's forward_monolithic: FlashInfer writes routing_replay_out, then the sink's fn
    out.copy_(ids)
    sink.capture_fn(out)
    codes, flags, _ = engine._sites["layers.1.mlp.router"]
    assert np.array_equal(decode_routing(route_spec(1, 2, 8), codes.numpy(), flags.numpy()).experts, ids.numpy())
    # a monolithic kernel without routing_replay_out: no sink (vLLM would refuse it), said once
    engine.discard_forward()
    no_replay = type("NoReplay", (TrtLlmNvFp4ExpertsMonolithic,), {"supports_routing_replay_capture": lambda s: False})
    plain: Any = object.__new__(no_replay)
    runner.routed_experts.quant_method.moe_kernel.impl.fused_experts = plain
    with caplog.at_level("ERROR", logger="tracestore.client.engines"):
        assert hooks.bind_routing(runner) is None
    assert runner.routed_experts.routing_sink is None and "routing_replay_out" in caplog.text


def test_run_spec_declares_routing_and_a_redeclaration_is_refused(engine: EngineRecorder) -> None:
    spec = route_spec(0, 2, 8)
    engine.capture_route(spec, torch.tensor([[1, 2]]))
    engine.discard_forward()
    with pytest.raises(Exception, match="declared as"):
        engine.capture_route(route_spec(0, 2, 16), torch.tensor([[1, 2]]))
    with pytest.raises(ConfigError, match="routing= must be 0 or 1"):
        parse_setting("sidecar=x run=r policy_version=0 routing=yes")
    assert not parse_setting("sidecar=x run=r policy_version=0 routing=0").routing


# -- rows through a real sidecar ------------------------------------------------------------------


SPECS = [route_spec(0, 2, 8), route_spec(1, 2, 300)]  # uint8 ids and uint16 ids


def routed(rid: str, pos: int, spec: Any) -> list[int]:
    """The experts request ``rid`` routes position ``pos`` to at ``spec``'s layer (a function of all
    three, so a row stored at the wrong place shows up)."""
    h = zlib.crc32(f"{rid}:{pos}:{spec.name}".encode())
    a = h % spec.n_experts
    return [a, (a + 1 + (h >> 16) % (spec.n_experts - 1)) % spec.n_experts]


def _forward(rows: list[tuple[str, int]], padded: int) -> None:
    """One forward: each MoE layer's capture point handed its ids, padded rows with ids outside the
    expert range (a stored padded row would be refused by the store's checks)."""
    for spec in SPECS:
        ids = [routed(r, p, spec) for r, p in rows] + [[spec.n_experts + 7, 0]] * (padded - len(rows))
        hooks.route_capture_fn(spec)(torch.tensor(ids, dtype=torch.int32))


@pytest.mark.parametrize("graph_mode", [False, True], ids=["eager", "slab"])
def test_routing_rows_map_by_plan_with_gaps_as_fp4_rows(sidecar: ServeProcess, graph_mode: bool) -> None:
    run = f"route{int(graph_mode)}"
    rec = EngineRecorder(parse_setting(f"sidecar={sidecar.address} run={run} policy_version=0 writer=w-{run}"))
    graph = GraphCapture(1)
    graph.active = graph_mode
    graph.install()
    rec.graph = graph
    old = hooks.ENGINE, hooks.GRAPH
    hooks.ENGINE, hooks.GRAPH = rec, graph
    try:
        m = RowMapper(block=4)
        ids = {"a": [11, 12, 13, 14, 15], "b": [21, 22, 23], "c": [31, 32]}
        for rid, prompt in ids.items():
            m.add(rid, prompt)
        for spec in SPECS:
            graph.note_route(spec)
        _forward([("warm", 0)], 4)  # the warm-up forward: never committed
        rec.discard_forward()
        assert graph.arm(16, "cpu")

        def step(batch: list[Scheduled], order: list[tuple[str, int]], padded: int) -> None:
            plan = m.step(batch)
            rows = []
            for rid, n in order:
                s = next(b for b in batch if b.request_id == rid)
                rows += [(rid, s.start + i) for i in range(n)]
            _forward(rows, padded)
            assert rec.end_forward(plan, order)

        step([Scheduled(r, 0, len(ids[r]), 0, ids[r]) for r in "abc"], [("c", 2), ("b", 3), ("a", 5)], 12)
        for r, t in (("a", 16), ("b", 24), ("c", 33)):
            ids[r].append(t)
        step([Scheduled(r, len(ids[r]) - 1, 1, 0, [ids[r][-1]]) for r in "abc"], [("a", 1), ("b", 1), ("c", 1)], 4)
        ids["a"].append(17)
        ids["b"].append(25)
        # a was preempted and recomputes from scratch (positions 0..5 already stored); c is aborted
        step([Scheduled("a", 0, 7, 0, ids["a"]), Scheduled("b", 4, 1, 0, [25])], [("a", 7), ("b", 1)], 16)
        ids["a"].append(18)
        ids["b"].append(26)
        out = {r: rec.end_request(m.finish(r, ids[r])) for r in "ab"}
        out["c"] = rec.end_request(m.finish("c", ids["c"] + [34], aborted=True))
        assert rec.close(30)
    finally:
        hooks.ENGINE, hooks.GRAPH = old
    assert out["a"]["gap"] is None and out["b"]["gap"] is None
    assert out["c"]["gap"] == "aborted" and not json.loads(out["c"]["trace_ref"])["guided"]
    assert rec.stats["rows"] == 10 + 3 + 2  # the prefill, a decode of three, a's one new position and b's
    assert {s.name for s in rec.run_spec.sites} == {s.name for s in SPECS}
    if graph_mode:
        assert graph.stats["writes"] > 0 and graph.stats["gathers"] == 2
    sidecar.terminate()
    sidecar.start()
    from tracestore.client import GuidanceReader

    with GuidanceReader(str(sidecar.storage), run, prefetch=False) as reader:
        for r, n in (("a", 8), ("b", 6)):
            got = reader.read(MicrobatchPlan([(f"{r}::a0", 0, n)]), token_ids=ids[r])
            for spec in SPECS:
                rows = got[spec.name]
                assert isinstance(rows, Routing)
                assert rows.valid[:-1].all() and not rows.valid[-1]
                want = torch.tensor([routed(r, p, spec) for p in range(n - 1)])
                assert torch.equal(rows.experts[:-1], want), (r, spec.name)
