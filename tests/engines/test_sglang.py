"""SGLang 0.5.23: the contract (every hooked symbol, with its signature), routing recorded at SGLang's
routed-experts capture site (its real ``select_experts``), and the row mapping driven by SGLang's own
Req / ScheduleBatch / ForwardMode classes, FP4 and routing rows recorded through a real sidecar."""

from __future__ import annotations

import ast
import inspect
import json
import zlib
from array import array
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip(
    "sglang.srt.managers.schedule_batch",
    reason="SGLang is not importable here: the engine venv (.ci/engines-venv) runs these",
)
pytestmark = pytest.mark.engines

import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, ScheduleBatch  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from tracestore.client.engines.capture import MOE_ENTRIES  # noqa: E402
from tracestore.client.engines.recording import EngineRecorder  # noqa: E402
from tracestore.client.engines.rows import RowMapper  # noqa: E402
from tracestore.client.engines.setting import parse_setting  # noqa: E402
from tracestore.client.engines.sglang import hooks  # noqa: E402
from tracestore.server.testing import ServeProcess  # noqa: E402

from tests.engines import _ast  # noqa: E402
from tracestore import Store, StoreReader  # noqa: E402
from tracestore.artifacts import decode_routing  # noqa: E402

SITE = "layers.1.mlp.input"


def params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


# -- contract -----------------------------------------------------------------------------------


def test_version_and_plugin_group() -> None:
    import sglang
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from tracestore.client.engines.sglang import VALIDATED_VERSIONS

    assert sglang.__version__ in VALIDATED_VERSIONS
    assert plugins.GENERAL_PLUGINS_GROUP == "sglang.srt.plugins"
    assert {t.name for t in HookType} == {"BEFORE", "AFTER", "AROUND", "REPLACE"}
    assert params(HookRegistry.register) == ["target", "hook", "hook_type", "source"]
    # a plugin that raises is logged and skipped: SGLang then runs without recording
    fn = _ast.functions(_ast.source_tree("sglang.srt.plugins"), "load_plugins")[0]
    assert any(
        isinstance(n, ast.Try) and any(isinstance(c, ast.Call) and _ast.dotted(c.func) == "func" for c in ast.walk(n))
        for n in ast.walk(fn)
    )


@pytest.mark.parametrize(
    "module",
    ["sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager", "sglang.srt.entrypoints.engine"],
)
def test_processes_that_load_plugins(module: str) -> None:
    assert list(_ast.calls(_ast.source_tree(module), "load_plugins"))


def test_hooked_methods() -> None:
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization import modelopt_quant
    from sglang.srt.managers.scheduler import Scheduler

    assert params(Scheduler.run_batch)[:2] == ["self", "batch"]
    assert params(Scheduler.process_batch_result)[:3] == ["self", "batch", "result"]
    assert "layer_id" in inspect.getsource(FusedMoE.__init__) and callable(FusedMoE.forward)
    assert params(modelopt_quant.ModelOptFp4LinearMethod.apply) == ["self", "layer", "x", "bias"]
    # a module global the method reads at call time; None where sgl-kernel's CUDA ops are absent (CPU)
    assert hasattr(modelopt_quant, "fp4_quantize")
    apply_tree = ast.parse(
        inspect.getsource(modelopt_quant.ModelOptFp4LinearMethod.apply).strip().replace("\n    ", "\n")
    )
    assert list(_ast.calls(apply_tree, "fp4_quantize"))


def test_flashinfer_moe_entries_are_imported_at_call_time() -> None:
    tree = _ast.source_tree("sglang.srt.layers.moe.moe_runner.flashinfer_trtllm")
    imports = _ast.from_imports(tree)
    assert {
        ("flashinfer.fused_moe", "trtllm_fp4_block_scale_moe"),
        ("flashinfer.fused_moe", "trtllm_fp4_block_scale_routed_moe"),
    } <= imports
    assert ("flashinfer", "trtllm_fp4_block_scale_moe") in imports
    module_level = {(n.module, a.name) for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not {e for _, e in module_level} & set(MOE_ENTRIES)
    kws = [_ast.keywords(c) for c in _ast.calls(tree, "trtllm_fp4_block_scale_moe")]
    assert any({"hidden_states", "hidden_states_scale"} <= k for k in kws)
    routed = [_ast.keywords(c) for c in _ast.calls(tree, "dict")]
    assert any({"hidden_states", "hidden_states_scale", "per_token_scale"} <= k for k in routed)  # moe_kwargs


def test_routed_experts_capture_site() -> None:
    """SGLang's one routed-experts capture site: called by module global from ``topk.py`` with the
    logical ids (before the EPLB logical-to-physical remap); the fields the hook reads."""
    import dataclasses

    from sglang.srt.layers.moe import topk
    from sglang.srt.managers.scheduler import Scheduler

    assert params(topk.capture_routed_experts_if_allowed) == ["topk_config", "layer_id", "topk_ids"]
    tree = _ast.source_tree(topk.__name__)
    assert len(list(_ast.calls(tree, "capture_routed_experts_if_allowed"))) >= 2
    post = _ast.functions(tree, "_post_process_topk_ids")[0]
    first: dict[str, int] = {}
    for c in ast.walk(post):
        if isinstance(c, ast.Call):
            first.setdefault(_ast.dotted(c.func), c.lineno)
            first[_ast.dotted(c.func)] = min(first[_ast.dotted(c.func)], c.lineno)
    assert first["capture_routed_experts_if_allowed"] < first["topk_ids_logical_to_physical"]
    fields = {f.name for f in dataclasses.fields(topk.TopKConfig)}
    assert {"top_k", "layer_id", "allow_routed_experts_capture", "shared_experts"} <= fields
    assert isinstance(inspect.getattr_static(topk.TopKConfig, "num_shared_topk_slots"), property)
    assert "self.model_config = ModelConfig" in inspect.getsource(Scheduler)


def test_select_experts_routing_is_recorded_and_drafts_are_not() -> None:
    from sglang.srt.layers.moe import topk
    from sglang.srt.plugins.hook_registry import HookRegistry

    eng = EngineRecorder(parse_setting("sidecar=127.0.0.1:1 run=route policy_version=0"))
    old = hooks.ENGINE, hooks.N_EXPERTS
    targets = hooks.register_hooks(eng.setting, eng)
    try:
        HookRegistry.apply_hooks()
        assert f"{hooks.TOPK}.capture_routed_experts_if_allowed" in targets
        hooks.N_EXPERTS = 8
        x, logits = torch.randn(5, 16), torch.randn(5, 8)
        out = topk.select_experts(  # SGLang's own top-k (its torch-native path runs on the CPU)
            hidden_states=x, router_logits=logits, topk_config=topk.TopKConfig(top_k=2, layer_id=3, torch_native=True),
            layer_id=3,
        )  # fmt: skip
        codes, flags, _ = eng._sites["layers.3.mlp.router"]
        spec = eng.artifacts["layers.3.mlp.router"]
        assert (spec.width, spec.n_experts) == (2, 8)
        assert np.array_equal(decode_routing(spec, codes.numpy(), flags.numpy()).experts, out.topk_ids.numpy())
        eng.discard_forward()
        draft = topk.TopKConfig(top_k=2, layer_id=3, torch_native=True, allow_routed_experts_capture=False)
        topk.select_experts(hidden_states=x, router_logits=logits, topk_config=draft, layer_id=3)
        assert eng._sites == {}  # a draft model's routing is not the policy's
    finally:
        hooks.ENGINE, hooks.N_EXPERTS = old
        hooks.MAPPER = None
    assert hooks.model_n_experts(SimpleNamespace(n_routed_experts=256)) == 256
    assert hooks.model_n_experts(SimpleNamespace()) is None


def test_bypassed_routing_comes_back_through_routing_replay_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's bypassed top-k routes inside FlashInfer's TRT-LLM MoE (``routing_logits``, ``top_k``,
    ``num_experts`` in its call, checked on its source): the wrapped entry passes a
    ``routing_replay_out`` buffer, which a shape-correct fake entry fills as the kernel does (the
    top-k of the logits), and the ids are recorded for the running layer. An entry without the
    parameter is called as it was, and no routing is recorded."""
    import sys
    import types

    from tracestore.client.engines import capture as cap

    tree = _ast.source_tree("sglang.srt.layers.moe.moe_runner.flashinfer_trtllm")
    kws = [_ast.keywords(c) for c in _ast.calls(tree, "dict")] + [
        _ast.keywords(c) for c in _ast.calls(tree, "trtllm_fp4_block_scale_moe")
    ]
    assert any({"routing_logits", "top_k", "num_experts", "hidden_states"} <= k for k in kws)
    seen: list[dict] = []

    def kernel(*, routing_logits, hidden_states, top_k, num_experts, routing_replay_out=None, **kw):  # type: ignore[no-untyped-def]
        seen.append({"routing_replay_out": routing_replay_out, **kw})
        if routing_replay_out is not None:
            routing_replay_out.copy_(torch.topk(routing_logits.float(), top_k, dim=-1).indices.to(torch.int16))
        return torch.zeros(hidden_states.shape[0], 32)

    def old_kernel(*, routing_logits, hidden_states, top_k, num_experts, **kw):  # type: ignore[no-untyped-def]
        seen.append(kw)
        return torch.zeros(hidden_states.shape[0], 32)

    eng = EngineRecorder(parse_setting("sidecar=127.0.0.1:1 run=bypass policy_version=0"))
    old = hooks.ENGINE
    hooks.ENGINE = eng
    try:
        for fn, recorded in ((kernel, True), (old_kernel, False)):
            fi, fm = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.fused_moe")
            for name in MOE_ENTRIES:
                setattr(fm, name, fn)
                setattr(fi, name, fn)
            fi.fused_moe = fm  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, "flashinfer", fi)
            monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fm)
            cap.install_flashinfer(hooks._capture, hooks._bits, route=hooks._route)
            logits = torch.randn(6, 16, dtype=torch.bfloat16)

            def runner(layer: object, logits: torch.Tensor) -> torch.Tensor:  # the entry imported inside
                from flashinfer.fused_moe import trtllm_fp4_block_scale_moe

                return trtllm_fp4_block_scale_moe(
                    routing_logits=logits, hidden_states=torch.zeros(6, 32), top_k=4, num_experts=16
                )

            hooks.around_moe_forward(runner, SimpleNamespace(layer_id=5), logits)
            assert cap.SCOPE.route_layer is None  # restored after the layer
            if recorded:
                codes, flags, _ = eng._sites["layers.5.mlp.router"]
                spec = eng.artifacts["layers.5.mlp.router"]
                want = torch.topk(logits.float(), 4, dim=-1).indices
                assert (spec.width, spec.n_experts) == (4, 16)
                assert np.array_equal(decode_routing(spec, codes.numpy(), flags.numpy()).experts, want.numpy())
            else:
                assert "routing_replay_out" not in seen[-1] and eng._sites == {}
            eng.discard_forward()
    finally:
        hooks.ENGINE = old


def test_req_and_batch_fields() -> None:
    r = Req("r", "", array("q", [1, 2, 3]), SamplingParams(max_new_tokens=4))
    for name in (
        "rid",
        "origin_input_ids",
        "output_ids",
        "prefix_len",
        "extend_end",
        "full_untruncated_fill_ids",
        "seqlen",
        "finished_reason",
    ):
        assert hasattr(r, name), name
    assert ScheduleBatch(reqs=[r], forward_mode=ForwardMode.DECODE).forward_mode.is_decode()
    for m in ("is_extend", "is_decode", "is_idle", "is_target_verify"):
        assert callable(getattr(ForwardMode.EXTEND, m))


def test_cuda_graph_runner_fields() -> None:
    """What :func:`hooks.runs_cuda_graphs` reads: ``Scheduler.tp_worker``, ``TpModelWorker.model_runner``
    and the model runner's decode / prefill graph runners beside its eager runner."""
    from sglang.srt.managers import scheduler as sched_mod
    from sglang.srt.managers.tp_worker import TpModelWorker

    assert "self.tp_worker = TpModelWorker(" in inspect.getsource(sched_mod)
    assert isinstance(inspect.getattr_static(TpModelWorker, "model_runner"), property)
    mr = _ast.source_tree("sglang.srt.model_executor.model_runner")
    assigned = {_ast.dotted(t) for n in ast.walk(mr) if isinstance(n, ast.Assign) for t in n.targets}
    assert {"self.decode_cuda_graph_runner", "self.prefill_cuda_graph_runner", "self.eager_runner"} <= assigned


def test_overlap_records_nothing_and_unarmed_graphs_say_why(caplog: pytest.LogCaptureFixture) -> None:
    """Overlap scheduling: nothing is planned or recorded, and the log says why. CUDA graphs
    captured before the slab was armed (the plugin loaded after the capture): the log says so,
    and a replayed forward's requests end with a gap (the forward captured no rows)."""
    eager = object()
    off = SimpleNamespace(decode_cuda_graph_runner=eager, prefill_cuda_graph_runner=None, eager_runner=eager)
    on = SimpleNamespace(decode_cuda_graph_runner=object(), prefill_cuda_graph_runner=None, eager_runner=eager)
    assert not hooks.runs_cuda_graphs(SimpleNamespace(tp_worker=SimpleNamespace(model_runner=off)))
    assert hooks.runs_cuda_graphs(SimpleNamespace(tp_worker=SimpleNamespace(model_runner=on)))
    engine = EngineRecorder(parse_setting("sidecar=127.0.0.1:1 run=cg policy_version=0"))
    old = hooks.ENGINE, hooks.MAPPER, hooks._warned_overlap, hooks._warned_graph
    hooks.ENGINE, hooks.MAPPER, hooks._warned_overlap, hooks._warned_graph = engine, RowMapper(block=1), False, False
    try:
        scheduler = SimpleNamespace(enable_overlap=True, tp_worker=SimpleNamespace(model_runner=off))
        batch = ScheduleBatch(reqs=[new_req("o", [1, 2])], forward_mode=ForwardMode.EXTEND)
        with caplog.at_level("ERROR", logger="tracestore.client.engines"):
            assert hooks.around_run_batch(lambda sch, b: "ran", scheduler, batch) == "ran"
        assert "overlap scheduling" in caplog.text and not hooks.MAPPER.known("o")  # nothing planned
        scheduler = SimpleNamespace(enable_overlap=False, tp_worker=SimpleNamespace(model_runner=on))
        batch = ScheduleBatch(reqs=[new_req("g", [1, 2])], forward_mode=ForwardMode.EXTEND)
        with caplog.at_level("ERROR", logger="tracestore.client.engines"):
            assert hooks.around_run_batch(lambda sch, b: "ran", scheduler, batch) == "ran"  # a replay: no rows
        assert "before the slab was armed" in caplog.text
        ending = hooks.MAPPER.finish("g", [1, 2, 3])
        assert engine.end_request(ending)["gap"] == "unrecorded_positions"
    finally:
        hooks.ENGINE, hooks.MAPPER, hooks._warned_overlap, hooks._warned_graph = old


def test_hooks_register_and_apply_to_the_real_targets() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    eng = EngineRecorder(parse_setting("sidecar=127.0.0.1:1 run=reg policy_version=0 sites=all"))
    targets = hooks.register_hooks(eng.setting, eng)
    try:
        HookRegistry.apply_hooks()
        assert set(targets) <= HookRegistry._patched
        from sglang.srt.layers.linear import ReplicatedLinear

        layer = ReplicatedLinear(16, 16, bias=False, prefix="model.layers.3.self_attn.o_proj")
        assert getattr(layer, "prefix", None) is None  # SGLang keeps it only on some linears
        assert layer._tracestore_prefix == "model.layers.3.self_attn.o_proj"
    finally:
        hooks.ENGINE, hooks.MAPPER = None, None


def test_plugin_is_version_gated(monkeypatch: pytest.MonkeyPatch) -> None:
    import sglang
    from tracestore.client.engines import sglang as plugin

    from tracestore.errors import ConfigError

    monkeypatch.setenv("TRACESTORE_RECORD", "sidecar=127.0.0.1:1 run=r policy_version=0")
    monkeypatch.setattr(sglang, "__version__", "0.5.24")
    with pytest.raises(ConfigError, match=r"validated against sglang 0\.5\.23, but sglang 0\.5\.24 is installed"):
        plugin.register()


# -- rows ---------------------------------------------------------------------------------------


def route_of(prefix: list[int]) -> list[int]:
    """Two distinct experts of 8 for the token ending ``prefix`` (a row at the wrong place shows)."""
    c = zlib.crc32(np.asarray(prefix, dtype="<i4").tobytes(), 7)
    return [c % 8, (c % 8 + 1 + (c >> 8) % 7) % 8]


def row_bytes(prefix: list[int]) -> tuple[bytes, bytes]:
    c = zlib.crc32(np.asarray(prefix, dtype="<i4").tobytes())
    return c.to_bytes(4, "little"), bytes([(c >> 3) & 0x3F, (c >> 11) & 0x3F])


class Sched:
    """SGLang's two hooked scheduler steps around a 'forward' that captures one row per token, fed
    with SGLang's own Req and ScheduleBatch objects (the scheduler object itself is a stand-in)."""

    def __init__(self, address: str, run: str) -> None:
        text = f"sidecar={address} run={run} policy_version=0 writer=sg-{run}"
        self.engine = EngineRecorder(parse_setting(text))
        hooks.ENGINE, hooks.MAPPER, hooks.N_EXPERTS = self.engine, RowMapper(block=1), None
        cfg = SimpleNamespace(hf_text_config=SimpleNamespace(num_experts=8))
        self.scheduler = SimpleNamespace(enable_overlap=False, model_config=cfg)
        self.short = False  # the forward's FP4 site captures one row fewer than it runs
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        target = f"{hooks.TOPK}.capture_routed_experts_if_allowed"
        if target not in HookRegistry._patched:
            HookRegistry.register(target, hooks.after_capture_routed_experts, HookType.AFTER)
            HookRegistry.apply_hooks()

    def forward(self, scheduler: object, batch: ScheduleBatch) -> str:
        from sglang.srt.layers.moe import topk

        rc, rs, routed = [], [], []
        for req in batch.reqs:
            full = list(req.origin_input_ids) + list(req.output_ids)
            rng = [req.seqlen - 1] if batch.forward_mode.is_decode() else range(req.prefix_len, req.extend_end)
            for p in rng:
                c, s = row_bytes(full[: p + 1])
                rc.append(c)
                rs.append(s)
                routed.append(route_of(full[: p + 1]))
        # the MoE layer's top-k reaching SGLang's capture site, as select_experts hands it over
        topk.capture_routed_experts_if_allowed(topk.TopKConfig(top_k=2, layer_id=1), 1, torch.tensor(routed))
        if self.short:
            rc, rs = rc[:-1], rs[:-1]
        self.engine.capture(
            SITE,
            torch.tensor(np.frombuffer(b"".join(rc), np.uint8).reshape(-1, 4)),
            torch.tensor(np.frombuffer(b"".join(rs), np.uint8).reshape(-1, 2)),
            torch.ones(1),
        )
        return "result"

    def run(self, mode: ForwardMode, reqs: list[Req], short: bool = False) -> None:
        batch = ScheduleBatch(reqs=reqs, forward_mode=mode)
        self.short = short
        try:
            assert hooks.around_run_batch(self.forward, self.scheduler, batch) == "result"
        finally:
            self.short = False
        hooks.after_process_batch_result(None, self.scheduler, batch, "result")

    def close(self) -> None:
        assert self.engine.close(30)
        hooks.ENGINE, hooks.MAPPER = None, None


def new_req(rid: str, ids: list[int]) -> Req:
    r = Req(rid, "", array("q", ids), SamplingParams(max_new_tokens=64))
    r.refresh_fill_ids()
    return r


def extend(r: Req, prefix_len: int, end: int) -> Req:
    r.refresh_fill_ids()
    r.prefix_len, r.extend_end = prefix_len, end
    return r


def test_sglang_chunked_prefill_decode_retract_and_abort(sidecar: ServeProcess) -> None:
    s = Sched(sidecar.address, "sg")
    a, b, c = new_req("a", [1, 2, 3, 4, 5, 6]), new_req("b", [7, 8, 9]), new_req("c", [4, 4])
    s.run(ForwardMode.EXTEND, [extend(a, 0, 4), extend(b, 0, 3)])  # a's first chunk
    b.output_ids.append(20)
    s.run(ForwardMode.MIXED, [extend(a, 4, 6), extend(b, 3, 4)])  # a's last chunk mixed with b's decode
    a.output_ids.append(30)
    b.output_ids.append(21)
    s.run(ForwardMode.DECODE, [b, a])
    a.output_ids.append(31)
    b.output_ids.append(22)
    # b is retracted under KV pressure and re-prefilled with a 2-token prefix hit: only new rows stored
    s.run(ForwardMode.EXTEND, [extend(b, 2, 6)])
    b.output_ids.append(23)
    s.run(ForwardMode.EXTEND, [extend(c, 0, 2)])
    c.finished_reason = FINISH_ABORT()  # aborted after its prefill
    s.run(ForwardMode.IDLE, [c])
    a.finished_reason = FINISH_LENGTH(length=2)
    b.finished_reason = FINISH_LENGTH(length=4)
    s.run(ForwardMode.IDLE, [a, b])
    stats = dict(s.engine.stats)
    s.close()
    e = hooks.ENDINGS
    assert e["a"]["gap"] is None and e["b"]["gap"] is None and e["c"]["gap"] == "aborted"
    assert json.loads(e["a"]["trace_ref"])["guided"] and not json.loads(e["c"]["trace_ref"])["guided"]
    assert stats["rows"] == 4 + 3 + 2 + 1 + 2 + 1 + 2  # b's re-prefill stored only position 5
    sidecar.terminate()
    sidecar.start()
    with StoreReader(Store(sidecar.storage), "sg") as reader:
        for req in (a, b):
            full = list(req.origin_input_ids) + list(req.output_ids)
            n = e[req.rid]["n_tokens"]
            assert n == len(full)
            got = reader.read([(e[req.rid]["trajectory"], 0, n)], on_missing="mask")
            rows, route = got[SITE], got["layers.1.mlp.router"]
            experts = decode_routing(route.site, route.codes, route.scales, route.valid)
            assert experts.valid[:-1].all() and not experts.valid[-1]
            assert experts.experts[:-1].tolist() == [route_of(full[: p + 1]) for p in range(n - 1)], req.rid
            for p in range(n - 1):
                want = row_bytes(full[: p + 1])
                assert rows.valid[p] and rows.codes[p].tobytes() == want[0] and rows.scales[p].tobytes() == want[1], (
                    req.rid,
                    p,
                )


def test_sglang_a_trajectory_whose_rows_were_lost_is_never_a_prefix_source(sidecar: ServeProcess) -> None:
    """``a``'s prefill never reaches the recorder (its forward captures a row short), so ``a`` ends
    with a gap; then a radix-cache hit on ``a``'s prompt gets the gap ``prefix_unrecorded`` and a
    request with ``a``'s whole prompt from position 0 stores its own rows: never a link to
    ``a``'s missing rows."""
    s = Sched(sidecar.address, "sglost")
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    a = new_req("a", list(prompt))
    s.run(ForwardMode.EXTEND, [extend(a, 0, 9)], short=True)
    a.output_ids.append(100)
    s.run(ForwardMode.DECODE, [a])
    a.output_ids.append(101)
    a.finished_reason = FINISH_LENGTH(length=2)
    s.run(ForwardMode.IDLE, [a])
    h, g = new_req("h", prompt[:8] + [77, 78]), new_req("g", list(prompt))
    s.run(ForwardMode.EXTEND, [extend(h, 8, 10), extend(g, 0, 9)])  # h: 8 tokens from the radix cache
    for r, t in ((h, 300), (g, 400)):
        r.output_ids.append(t)
    s.run(ForwardMode.DECODE, [h, g])
    for r, t in ((h, 301), (g, 401)):
        r.output_ids.append(t)
        r.finished_reason = FINISH_LENGTH(length=2)
    s.run(ForwardMode.IDLE, [h, g])
    stats = dict(s.engine.stats)
    s.close()
    e = hooks.ENDINGS
    assert e["a"]["gap"] == "unrecorded_positions" and not json.loads(e["a"]["trace_ref"])["guided"]
    assert e["h"]["gap"] == "prefix_unrecorded" and not json.loads(e["h"]["trace_ref"])["guided"]
    assert e["g"]["gap"] is None and json.loads(e["g"]["trace_ref"])["guided"]
    assert stats["links"] == 0
    sidecar.terminate()
    sidecar.start()
    full = list(g.origin_input_ids) + list(g.output_ids)
    with StoreReader(Store(sidecar.storage), "sglost") as reader:
        rows = reader.read([(e["g"]["trajectory"], 0, len(full))], on_missing="mask")[SITE]
    for p in range(len(full) - 1):
        want = row_bytes(full[: p + 1])
        assert rows.valid[p] and rows.codes[p].tobytes() == want[0] and rows.scales[p].tobytes() == want[1], p
