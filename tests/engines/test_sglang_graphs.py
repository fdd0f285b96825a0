"""SGLang 0.5.23 under CUDA graphs: the graph runners and capture backends the plugin hooks (their
symbols, signatures and the source facts it relies on), the slab armed between SGLang's warm-up
forwards, and rows committed after a replay padded to a captured batch size (``raw_bs`` < ``bs``),
driven by SGLang's own Req / ScheduleBatch / ForwardBatch / CudaGraphConfig classes through a real
sidecar.

SGLang's graph runners need CUDA and sgl-kernel, so the capture here is a CPU stand-in for
``torch.cuda.CUDAGraph``: a dispatch mode logs the ops a forward dispatches while "capturing", and a
"replay" re-dispatches only the logged ``tracestore::`` ops on the same (static) tensors, with no
Python of the hooks: what a CUDA graph replays of the plugin. FlashInfer's fused-MoE entry is a
shape-correct fake."""

from __future__ import annotations

import ast
import inspect
import json
import sys
import types
import zlib
from array import array
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "sglang.srt.managers.schedule_batch",
    reason="SGLang is not importable here: the engine venv (.ci/engines-venv) runs these",
)
pytestmark = pytest.mark.engines

import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, ScheduleBatch  # noqa: E402
from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from tracestore.client.engines import capture as cap  # noqa: E402
from tracestore.client.engines.capture import MOE_ENTRIES  # noqa: E402
from tracestore.client.engines.recording import EngineRecorder  # noqa: E402
from tracestore.client.engines.setting import parse_setting  # noqa: E402
from tracestore.client.engines.sglang import hooks  # noqa: E402
from tracestore.client.engines.sglang.graphs import graph_capacity  # noqa: E402
from tracestore.server.testing import ServeProcess  # noqa: E402

from tests.engines import _ast  # noqa: E402
from tracestore import NVFP4, Store, StoreReader, quantize  # noqa: E402
from tracestore.artifacts import decode_routing  # noqa: E402
from tracestore.packing import pack_bits, pack_fp4  # noqa: E402

H = 64
MOE = "layers.1.mlp.input"
DENSE = "layers.1.self_attn.o_proj.input"
ROUTER = "layers.1.mlp.router"
DECODE_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"
PREFILL_RUNNER = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner"
# ops that read device data on the host, or whose output shape depends on values (a host sync)
FORBIDDEN = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero"}


def params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def method_tree(cls: type, name: str) -> ast.AST:
    return ast.parse(inspect.getsource(getattr(cls, name)).strip().replace("\n    ", "\n"))


# -- contract -----------------------------------------------------------------------------------


def test_graph_runner_and_backend_symbols() -> None:
    """What the graph hooks wrap and read, as SGLang 0.5.23 defines it."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend

    for runner in (DecodeCudaGraphRunner, PrefillCudaGraphRunner):
        assert "capture" in vars(runner) and "execute" in vars(runner), runner  # their own: the hooked attribute
        assert params(runner.capture) == ["self"]
        assert params(runner.execute)[:2] == ["self", "forward_batch"]
    for backend in (FullCudaGraphBackend, BreakableCudaGraphBackend):
        assert "capture_one" in vars(backend)
        assert params(backend.capture_one) == ["self", "shape_key", "forward_fn", "capture_inputs", "post_warmup_hook"]
        # two eager warm-up calls of forward_fn, then the captured call
        tree = method_tree(backend, "capture_one")
        loops = [n for n in ast.walk(tree) if isinstance(n, ast.For) and "range(2)" in ast.unparse(n.iter)]
        assert loops and any("forward_fn()" in ast.unparse(n) for n in loops), backend
    # the runners' largest forward (graph_capacity) and what the replay hook reads
    assert "self.max_num_token = " in inspect.getsource(DecodeCudaGraphRunner.__init__)
    assert "self.max_num_tokens = max(self.capture_num_tokens)" in inspect.getsource(PrefillCudaGraphRunner.__init__)
    assert callable(ModelRunner.decode_num_tokens_per_req)
    init = inspect.getsource(ModelRunner.__init__)
    for attr in ("self.is_draft_worker = ", "self.gpu_id = ", "self.spec_algorithm = "):
        assert attr in init, attr
    assert {f for f in CudaGraphConfig.__dataclass_fields__} == {"decode", "prefill"}
    assert {"backend", "bs"} <= set(PhaseConfig.__dataclass_fields__)
    from sglang.srt.model_executor.cuda_graph_config import Backend

    assert Backend.DISABLED == "disabled"


def test_replays_pad_after_the_real_rows() -> None:
    """Decode: the real rows are ``raw_bs * captured_req_width`` (the ForwardBatch's), padded to
    the captured ``bs``; prefill: ``len(forward_batch.input_ids)`` padded to the token bucket. The
    replay entries are the runners' ``execute``, called from ``ModelRunner._forward_raw`` only."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    dec = inspect.getsource(DecodeCudaGraphRunner.load_batch)
    assert "raw_bs = forward_batch.batch_size" in dec
    assert "raw_num_token = raw_bs * self.captured_req_width" in dec
    assert "padded_num_tokens = bs * self.captured_req_width" in dec
    assert "bs = self._pad_to_bucket(raw_bs, self.capture_bs)" in dec
    pre = inspect.getsource(PrefillCudaGraphRunner.load_batch)
    assert "num_tokens = len(forward_batch.input_ids)" in pre
    assert "static_num_tokens = self._pad_to_bucket(num_tokens, self.capture_num_tokens)" in pre
    raw = method_tree(ModelRunner, "_forward_raw")
    calls = {_ast.dotted(c.func) for c in ast.walk(raw) if isinstance(c, ast.Call)}
    assert {"self.decode_cuda_graph_runner.execute", "self.prefill_cuda_graph_runner.execute"} <= calls
    # prefill graphs are captured before decode graphs (one slab serves both)
    setup = _ast.source_tree("sglang.srt.model_executor.model_runner_components.cuda_graph_setup")
    fn = _ast.functions(setup, "capture_cuda_graphs")[0]
    lines = {_ast.dotted(c.func): c.lineno for c in ast.walk(fn) if isinstance(c, ast.Call)}
    assert lines["capture_prefill_graph"] < lines["capture_decode_graph"]


def test_graph_hooks_apply_to_the_real_targets() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    eng = EngineRecorder(parse_setting("sidecar=127.0.0.1:1 run=greg policy_version=0"))
    old = hooks.GRAPH
    try:
        targets = hooks.register_hooks(eng.setting, eng)
        HookRegistry.apply_hooks()
        graph_targets = {t for t in targets if t.endswith((".capture", ".execute", ".capture_one"))}
        assert len(graph_targets) == 6 and graph_targets <= HookRegistry._patched
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

        assert params(DecodeCudaGraphRunner.execute)[:2] == ["self", "forward_batch"]  # wrapped, signature kept
        assert eng.graph is hooks.GRAPH
    finally:
        hooks.ENGINE, hooks.MAPPER, hooks.GRAPH = None, None, old


def test_graph_capacity_covers_both_phases() -> None:
    mr = SimpleNamespace(decode_num_tokens_per_req=lambda: 1)
    cfg = CudaGraphConfig(
        decode=PhaseConfig(backend="full", bs=[1, 2, 4, 8, 160]), prefill=PhaseConfig(backend="breakable", bs=[64, 512])
    )
    prefill_runner = SimpleNamespace(model_runner=mr, max_num_tokens=512)
    assert graph_capacity(prefill_runner, cfg) == 512
    assert graph_capacity(SimpleNamespace(model_runner=mr, max_num_token=160), None) == 160
    off = CudaGraphConfig(
        decode=PhaseConfig(backend="full", bs=[8, 1024]), prefill=PhaseConfig(backend="disabled", bs=[4096])
    )
    assert graph_capacity(SimpleNamespace(model_runner=mr, max_num_token=1024), off) == 1024


# -- a CPU stand-in for a CUDA graph ---------------------------------------------------------------


class CpuGraph(TorchDispatchMode):
    """Logs the ``tracestore::`` ops dispatched while capturing (every op name too); :meth:`replay`
    re-dispatches exactly those on the same tensors (as a CUDA graph replays its kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict]] = []
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(f"{func.namespace}::{func._opname}")
        if func.namespace == "tracestore":
            self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))

    def replay(self) -> None:
        for func, args, kwargs in self.calls:
            func(*args, **kwargs)


def backend_capture_one(
    graphs: dict[Any, CpuGraph], backend: Any, shape_key: Any, forward_fn: Callable[[], Any], *args: Any, **kw: Any
) -> None:
    """What SGLang's backends do in ``capture_one``: two eager warm-ups, then the captured call."""
    for _ in range(2):
        forward_fn()
    with CpuGraph() as g:
        forward_fn()
    graphs[shape_key] = g


def row_of(rid: str, pos: int) -> torch.Tensor:
    """The activation of request ``rid`` at ``pos`` (a row stored at the wrong place shows)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}:{pos}".encode()))
    return torch.randn(1, H, generator=gen) * (1 + pos % 3)


def route_of(rid: str, pos: int) -> list[int]:
    c = zlib.crc32(f"{rid}/{pos}".encode())
    return [c % 8, (c % 8 + 1 + (c >> 8) % 7) % 8]


G_MOE = torch.tensor([2.0**-8])  # powers of two: 1 / (1 / g) is g exactly
G_DENSE = torch.tensor([2.0**-7])
MAX_ROWS = 16


def quantized(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = quantize(x, NVFP4, global_scale=float(g))
    return pack_fp4(q.codes), q.scales


class Model:
    """One decoder layer's hooked calls, as SGLang's model makes them: ``FusedMoE.forward`` (the
    FlashInfer entry, imported inside, gets the FC1 codes), SGLang's routed-experts capture site,
    and a ModelOpt FP4 linear fed prequantized codes (scales swizzled 128x4). It reads its inputs
    from ``self.buf``: for a graph, views of static buffers of ``MAX_ROWS`` rows (as SGLang's
    graph runners slice theirs), for an eager forward the batch's own tensors."""

    def __init__(self) -> None:
        from sglang.srt.layers.moe import topk

        self.topk = topk
        self.buf: dict[str, torch.Tensor] = {}
        self.static: dict[str, torch.Tensor] = {}
        self.moe_layer = SimpleNamespace(layer_id=1, w13_input_scale_quant=1.0 / G_MOE)
        self.linear = SimpleNamespace(
            prefix="model.layers.1.self_attn.o_proj", input_scale_inv=1.0 / G_DENSE, _accepts_prequantized_fp4=True
        )

    def load(self, rows: list[tuple[str, int]], padded: int, static: bool) -> None:
        """The inputs of these rows, then junk rows up to ``padded``."""
        from tracestore.layouts import swizzle_scales

        xs = [row_of(r, p) for r, p in rows]
        junk = torch.Generator().manual_seed(len(rows) * 131 + padded)
        xs += [torch.randn(1, H, generator=junk) * 40 for _ in range(padded - len(rows))]
        x = torch.cat(xs)
        moe, dense = quantized(x, G_MOE), quantized(x * 0.5, G_DENSE)
        new = {
            "moe_codes": moe[0],
            "moe_sf": moe[1],
            "dense_codes": dense[0],
            "dense_sf": swizzle_scales(dense[1], fill=0x7F).reshape(-1),  # 128 rows x 4 blocks for <= 128 rows
            "ids": torch.tensor([route_of(r, p) for r, p in rows] + [[7, 6]] * (padded - len(rows))),
        }
        if not static:
            self.buf = new
            return
        if not self.static:
            self.static = {
                k: torch.zeros((MAX_ROWS, *v.shape[1:]) if k != "dense_sf" else v.shape, dtype=v.dtype)
                for k, v in new.items()
            }
        self.buf = {}
        for k, v in new.items():
            view = self.static[k] if k == "dense_sf" else self.static[k][:padded]
            view.copy_(v)
            self.buf[k] = view

    def forward(self) -> None:
        def moe_body(layer: Any) -> Any:
            from flashinfer.fused_moe import trtllm_fp4_block_scale_moe

            return trtllm_fp4_block_scale_moe(
                hidden_states=self.buf["moe_codes"], hidden_states_scale=self.buf["moe_sf"], num_experts=8
            )

        hooks.around_moe_forward(moe_body, self.moe_layer)
        self.topk.capture_routed_experts_if_allowed(self.topk.TopKConfig(top_k=2, layer_id=1), 1, self.buf["ids"])
        hooks.around_linear_apply(
            lambda m, layer, x, b: None, None, self.linear, (self.buf["dense_codes"], self.buf["dense_sf"])
        )


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def entry(*, hidden_states: torch.Tensor, **kw: Any) -> torch.Tensor:  # trtllm_fp4_block_scale_moe's shape
        return torch.zeros(hidden_states.shape[0], hidden_states.shape[1] * 2)

    fi, fm = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.fused_moe")
    for name in MOE_ENTRIES:
        setattr(fm, name, entry)
        setattr(fi, name, entry)
    fi.fused_moe = fm  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fm)
    yield


def new_req(rid: str, ids: list[int]) -> Req:
    r = Req(rid, "", array("q", ids), SamplingParams(max_new_tokens=64))
    r.refresh_fill_ids()
    return r


def extend(r: Req, prefix_len: int, end: int) -> Req:
    r.refresh_fill_ids()
    r.prefix_len, r.extend_end = prefix_len, end
    return r


class GraphEngine:
    """The plugin's hooks registered with SGLang's HookRegistry; a prefill 'graph runner' captured
    at token buckets ``buckets``, then a decode one at batch sizes ``capture_bs``, through the
    hooked capture / capture_one (as SGLang captures them: prefill first, largest shape first);
    scheduler steps through the hooked run_batch: a batch replays the graph of the smallest shape
    that fits (padded with junk rows), else runs eagerly."""

    def __init__(
        self, address: str, run: str, capture_bs: tuple[int, ...] = (4, 8), buckets: tuple[int, ...] = (16,)
    ) -> None:
        from sglang.srt.plugins.hook_registry import HookRegistry

        text = f"sidecar={address} run={run} policy_version=0 writer=sgg-{run} sites=all"
        self.engine = EngineRecorder(parse_setting(text))
        hooks.GRAPH = None
        hooks.register_hooks(self.engine.setting, self.engine)
        HookRegistry.apply_hooks()
        hooks.N_EXPERTS = None
        self.model = Model()
        self.capture_bs, self.buckets = capture_bs, buckets
        self.mr = SimpleNamespace(
            is_draft_worker=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            device="cpu",
            gpu_id=0,
            decode_num_tokens_per_req=lambda: 1,
            model_config=SimpleNamespace(hf_text_config=SimpleNamespace(num_experts=8)),
        )
        self.runner = SimpleNamespace(model_runner=self.mr, max_num_token=max(capture_bs))
        self.prefill_runner = SimpleNamespace(model_runner=self.mr, max_num_tokens=max(buckets))
        self.mr.decode_cuda_graph_runner, self.mr.eager_runner = self.runner, object()
        self.mr.prefill_cuda_graph_runner = self.prefill_runner
        cfg = SimpleNamespace(hf_text_config=SimpleNamespace(num_experts=8))
        self.scheduler = SimpleNamespace(
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            model_config=cfg,
            tp_worker=SimpleNamespace(model_runner=self.mr),
        )
        self.graphs: dict[tuple[str, int], CpuGraph] = {}

    def capture(self) -> None:
        """SGLang's ``PrefillCudaGraphRunner.capture`` then ``DecodeCudaGraphRunner.capture``."""

        def capture(phase: str, sizes: tuple[int, ...]) -> Callable[[Any], None]:
            def run(runner: Any) -> None:
                for n in sorted(sizes, reverse=True):
                    self.model.load([("warm", i) for i in range(n)], n, static=True)
                    hooks.around_capture_one(
                        lambda *a, **k: backend_capture_one(self.graphs, *a, **k), None, (phase, n), self.model.forward
                    )

            return run

        hooks.around_graph_capture(capture("prefill", self.buckets), self.prefill_runner)
        hooks.around_graph_capture(capture("decode", self.capture_bs), self.runner)

    def step(self, mode: ForwardMode, reqs: list[Req], rows: list[tuple[str, int]]) -> None:
        batch = ScheduleBatch(reqs=reqs, forward_mode=mode)
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(reqs),
            input_ids=torch.zeros(len(rows), dtype=torch.int64),
            req_pool_indices=torch.arange(len(reqs)),
            seq_lens=torch.tensor([r.seqlen for r in reqs]),
            out_cache_loc=torch.arange(len(rows)),
            seq_lens_sum=sum(r.seqlen for r in reqs),
        )

        def forward(scheduler: Any, b: ScheduleBatch) -> str:
            if not rows:  # an idle batch: no forward
                return "result"
            if mode.is_decode():
                phase, runner, size, shapes = "decode", self.runner, fb.batch_size, self.capture_bs
            else:
                phase, runner, size, shapes = "prefill", self.prefill_runner, len(rows), self.buckets
            shape = next((n for n in sorted(shapes) if n >= size), None)
            if shape is not None:
                padded = shape

                def replay(runner: Any, forward_batch: ForwardBatch) -> None:
                    self.model.load(rows, padded, static=True)  # the runner's load_batch: pads to the shape
                    self.graphs[(phase, padded)].replay()

                hooks.around_graph_execute(replay, runner, fb)
            else:  # SGLang's eager runner
                self.model.load(rows, len(rows), static=False)
                self.model.forward()
            return "result"

        assert hooks.around_run_batch(forward, self.scheduler, batch) == "result"
        hooks.after_process_batch_result(None, self.scheduler, batch, "result")

    def close(self) -> None:
        assert self.engine.close(30)
        hooks.ENGINE, hooks.MAPPER, hooks.GRAPH = None, None, None


def full(r: Req) -> list[int]:
    return list(r.origin_input_ids) + list(r.output_ids)


def test_graph_replays_record_real_rows_never_padding(sidecar: ServeProcess, fake_flashinfer: None) -> None:
    """SGLang with CUDA graphs on: warm-ups note the sites, the slab is armed before the capture,
    the captured ops alone (no hook Python) write each replay's rows, and the committed rows are
    the batch's real requests at their positions, never the padding of a captured size. Prefills
    run eagerly beside the replays; an aborted request ends with a gap."""
    e = GraphEngine(sidecar.address, "sgg")
    try:
        e.capture()
        graph = hooks.GRAPH
        assert graph is not None and graph.armed and graph.capacity == 16  # the prefill graphs' largest bucket
        assert set(e.graphs) == {("prefill", 16), ("decode", 8), ("decode", 4)}
        assert set(graph.widths) == {MOE, DENSE} and set(graph.routes) == {ROUTER}
        for key, cg in e.graphs.items():  # each captured graph: one op per site, nothing that reads on the host
            ops = [n for n in cg.names if n.startswith("tracestore::")]
            assert sorted(ops) == sorted(["tracestore::engine_record"] * 2 + ["tracestore::engine_route"]), key
            assert not {n.split("::")[1] for n in cg.names} & FORBIDDEN
        a, b, c = new_req("a", [1, 2, 3, 4]), new_req("b", [5, 6]), new_req("c", [9, 9, 9])
        d = new_req("d", list(range(40, 60)))
        e.step(
            ForwardMode.EXTEND,
            [extend(a, 0, 4), extend(b, 0, 2), extend(c, 0, 3)],
            [*[("a", p) for p in range(4)], ("b", 0), ("b", 1), *[("c", p) for p in range(3)]],
        )  # fmt: skip  (9 tokens: the prefill graph's 16-token bucket)
        e.step(ForwardMode.EXTEND, [extend(d, 0, 20)], [("d", p) for p in range(20)])  # 20 > 16: eager
        for r, t in ((a, 10), (b, 20), (c, 30), (d, 60)):
            r.output_ids.append(t)
        e.step(ForwardMode.DECODE, [b, a, c, d], [("b", 2), ("a", 4), ("c", 3), ("d", 20)])  # raw_bs 4 -> bs 4
        assert not graph.stats["gathers"]  # the replay's first rows are the batch's
        c.finished_reason = FINISH_ABORT()
        e.step(ForwardMode.IDLE, [c], [])
        for r, t in ((a, 11), (b, 21), (d, 61)):
            r.output_ids.append(t)
        e.step(ForwardMode.DECODE, [a, b, d], [("a", 5), ("b", 3), ("d", 21)])  # raw_bs 3 -> bs 4
        for r, t in ((a, 12), (b, 22), (d, 62)):
            r.output_ids.append(t)
        e.step(ForwardMode.DECODE, [d], [("d", 22)])  # raw_bs 1 -> bs 4
        d.output_ids.append(63)
        for r in (a, b, d):
            r.finished_reason = FINISH_LENGTH(length=len(r.output_ids))
        e.step(ForwardMode.IDLE, [a, b, d], [])
        stats = dict(e.engine.stats)
    finally:
        e.close()
    ends = hooks.ENDINGS
    assert ends["a"]["gap"] is None and ends["b"]["gap"] is None and ends["d"]["gap"] is None
    assert ends["c"]["gap"] == "aborted"
    assert json.loads(ends["a"]["trace_ref"])["guided"] and not json.loads(ends["c"]["trace_ref"])["guided"]
    assert stats["rows"] == 9 + 20 + 4 + 3 + 1  # prefill replay, eager prefill, decode replays' real rows
    sidecar.terminate()
    sidecar.start()
    with StoreReader(Store(sidecar.storage), "sgg") as reader:
        for req in (a, b, d):
            n = ends[req.rid]["n_tokens"]
            assert n == len(full(req))
            got = reader.read([(ends[req.rid]["trajectory"], 0, n)], on_missing="mask")
            route = got[ROUTER]
            experts = decode_routing(route.site, route.codes, route.scales, route.valid)
            assert experts.experts[:-1].tolist() == [route_of(req.rid, p) for p in range(n - 1)]
            for site, g, scale in ((MOE, G_MOE, 1.0), (DENSE, G_DENSE, 0.5)):
                rows = got[site]
                assert not rows.valid[n - 1]
                for p in range(n - 1):
                    q = quantize(row_of(req.rid, p) * scale, NVFP4, global_scale=float(g))
                    assert rows.valid[p], (site, req.rid, p)
                    assert rows.codes[p].tobytes() == pack_bits(q.codes, 1)[0].numpy().tobytes(), (site, req.rid, p)
                    assert rows.scales[p].tobytes() == q.scales[0].numpy().tobytes(), (site, req.rid, p)
                    assert np.float32(rows.global_scale[p]) == np.float32(g), (site, req.rid, p)


def test_a_replay_whose_rows_are_not_the_plans_is_a_gap(sidecar: ServeProcess, fake_flashinfer: None) -> None:
    """A replayed ForwardBatch with another real row count than the scheduled batch commits
    nothing: its requests end with a gap, never with rows of the wrong tokens."""
    e = GraphEngine(sidecar.address, "sggbad", capture_bs=(4,))
    try:
        e.capture()
        a, b = new_req("a", [1, 2]), new_req("b", [3, 4])
        e.step(ForwardMode.EXTEND, [extend(a, 0, 2), extend(b, 0, 2)], [("a", 0), ("a", 1), ("b", 0), ("b", 1)])
        a.output_ids.append(5)
        b.output_ids.append(6)
        e.step(ForwardMode.DECODE, [a, b], [("a", 2)])  # the replay ran 1 row; the batch plans 2
        for r in (a, b):
            r.output_ids.append(7)
            r.finished_reason = FINISH_LENGTH(length=2)
        e.step(ForwardMode.IDLE, [a, b], [])
    finally:
        e.close()
    for rid in ("a", "b"):
        end = hooks.ENDINGS[rid]
        assert end["gap"] == "unrecorded_positions" and not json.loads(end["trace_ref"])["guided"], end


def test_speculative_decoding_records_nothing_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """A speculative scheduler's decode batch is one row per request, but its verify forward runs
    the drafts: the plugin stops recording rather than store draft rows as the batch's."""
    eng = EngineRecorder(parse_setting("sidecar=127.0.0.1:1 run=spec policy_version=0"))
    old = hooks.GRAPH
    try:
        hooks.register_hooks(eng.setting, eng)
        scheduler = SimpleNamespace(enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.EAGLE)
        batch = ScheduleBatch(reqs=[new_req("s", [1, 2])], forward_mode=ForwardMode.DECODE)
        with caplog.at_level("ERROR", logger="tracestore.client.engines"):
            assert hooks.around_run_batch(lambda sch, b: "ran", scheduler, batch) == "ran"
        assert "speculative decoding" in caplog.text and hooks.ENGINE is None and hooks.MAPPER is not None
        assert not hooks.MAPPER.known("s")
        # graph capture of a speculative worker: recording stops before any hook runs inside it
        hooks.ENGINE = eng
        mr = SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.EAGLE, is_draft_worker=True)
        assert hooks.around_graph_capture(lambda r: "captured", SimpleNamespace(model_runner=mr)) == "captured"
        assert hooks.ENGINE is None and hooks.GRAPH is not None and not hooks.GRAPH.active
    finally:
        hooks.ENGINE, hooks.MAPPER, hooks.GRAPH = None, None, old


def test_capture_path_is_the_op_only_on_the_meta_device(fake_flashinfer: None) -> None:
    """While a graph runner captures, every hooked site reaches the slab through one
    ``tracestore::`` op (the hooks' own Python reads nothing on the host: on the meta device a host
    read raises), and the op bodies, which a replay runs, dispatch no host-reading op."""
    eng = EngineRecorder(parse_setting("sidecar=127.0.0.1:1 run=meta policy_version=0 sites=all"))
    old = hooks.GRAPH
    try:
        hooks.GRAPH = None
        hooks.register_hooks(eng.setting, eng)
        hooks.N_EXPERTS = 8
        cap.install_flashinfer(hooks._capture, hooks._bits, hooks.GRAPH, route=hooks._route)
        graph = hooks.GRAPH
        assert graph is not None
        model = Model()
        t = 6
        model.buf = {
            "moe_codes": torch.empty(t, H // 2, dtype=torch.uint8, device="meta"),
            "moe_sf": torch.empty(t, H // 16, dtype=torch.uint8, device="meta"),
            "dense_codes": torch.empty(t, H // 2, dtype=torch.uint8, device="meta"),
            "dense_sf": torch.empty(128 * 4, dtype=torch.uint8, device="meta"),
            "ids": torch.empty(t, 2, dtype=torch.int64, device="meta"),
        }
        model.moe_layer.w13_input_scale_quant = torch.empty(1, device="meta")
        model.linear.input_scale_inv = torch.empty(1, device="meta")
        graph.active = True
        with CpuGraph() as captured:  # the hooks while SGLang captures: ops only
            model.forward()
        assert sorted(n for n in captured.names if n.startswith("tracestore::")) == sorted(
            ["tracestore::engine_record"] * 2 + ["tracestore::engine_route"]
        )
        assert not {n.split("::")[1] for n in captured.names} & FORBIDDEN

        def bodies() -> None:  # what a replay runs: the op bodies (on meta the op dispatches to its fake)
            for func, args, _ in captured.calls:
                if func._opname == "engine_record":
                    graph.write(*args[1:])
                else:
                    graph.write_route(*args[1:])

        bodies()  # the first warm-up, unarmed: notes the sites
        assert set(graph.widths) == {MOE, DENSE} and set(graph.routes) == {ROUTER}
        hooks._arm(SimpleNamespace(model_runner=SimpleNamespace(device="meta", gpu_id=0), max_num_token=8))
        assert graph.armed and graph.capacity == 8
        with CpuGraph() as body:
            bodies()
        ops = {n.split("::")[1] for n in body.names}
        assert not ops & FORBIDDEN and "copy_" in ops
        assert graph.stats["writes"] == 3 and not graph.stats["failed"]
    finally:
        if hooks.GRAPH is not None:
            hooks.GRAPH.active = False
        hooks.ENGINE, hooks.MAPPER, hooks.GRAPH, hooks.N_EXPERTS = None, None, old, None
