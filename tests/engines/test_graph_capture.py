"""Graph-safe capture (``tracestore.client.engines.graph``): the capture path is device tensor ops only
(run on the meta device, where any host read of device data raises, and under a dispatch mode that
lists every op), traceable whole by ``torch.compile(fullgraph=True)`` without being dropped as dead
code, and rows committed from the slab map to (trajectory, position) by the scheduler's plan, padded
rows never stored — checked through a real sidecar against an independent quantization. The GPU
tests capture the hook (and the routing op) inside a real ``torch.cuda.CUDAGraph`` and replay it
with new inputs. No
engine is needed: FlashInfer's entry is a shape-correct fake built on tracestore's quantizer."""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tracestore.client.engines.capture import SCOPE, wrap_moe_entry
from tracestore.client.engines.codes import codes_from_values, record_rows, swizzle_8x4
from tracestore.client.engines.graph import GraphCapture
from tracestore.client.engines.recording import EngineRecorder
from tracestore.client.engines.routing import route_spec
from tracestore.client.engines.rows import RowMapper, Scheduled
from tracestore.client.engines.setting import parse_setting
from tracestore.server.testing import ServeProcess

from tracestore import NVFP4, Store, StoreReader, quantize
from tracestore.artifacts import decode_routing
from tracestore.layouts import swizzle_scales
from tracestore.packing import pack_bits, pack_fp4

SITE = "layers.0.mlp.input"
H = 64
# ops that read device data on the host, or whose output shape depends on values (a host sync)
FORBIDDEN = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero"}


class OpLog(TorchDispatchMode):
    """Every aten/custom op dispatched inside the block, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(f"{func.namespace}::{func._opname}")
        return func(*args, **(kwargs or {}))


def _pad(n: int, m: int) -> int:
    return -(-n // m) * m


def _sf(layout: str, t: int, device: str) -> torch.Tensor:
    nb = H // 16
    if layout == "linear":
        return torch.empty(t, nb, dtype=torch.float8_e4m3fn, device=device)
    if layout == "8x4":
        return torch.empty(_pad(t, 8) * _pad(nb, 4), dtype=torch.uint8, device=device)
    return torch.empty(_pad(t, 128) * _pad(nb, 4), dtype=torch.uint8, device=device)


@pytest.mark.parametrize("layout", ["linear", "8x4", "swizzled128x4"])
@pytest.mark.parametrize("per_token", [False, True])
def test_capture_path_is_device_ops_only(layout: str, per_token: bool) -> None:
    graph = GraphCapture(bits=2)
    graph.active = True
    graph.install()
    t = 40
    packed = torch.empty(t, H // 2, dtype=torch.uint8, device="meta")
    sf = _sf(layout, t, "meta")
    scale = torch.empty(t if per_token else 1, dtype=torch.float32, device="meta")
    kw = {"token_scale": scale} if per_token else {"global_scale": scale}
    # (on the meta device the op dispatches to its fake; the body is called directly below)
    graph.write(packed, sf, scale, SITE, layout, H, per_token)  # before arming: the site is noted
    assert graph.widths == {SITE: H} and graph.stats["writes"] == 0
    assert graph.arm(64, "meta") and graph.slab is not None
    with OpLog() as hook_ops:
        graph.record(SITE, packed, sf, layout, H, **kw)
    assert hook_ops.names == ["tracestore::engine_record"]  # the hook itself: one op, nothing else
    with OpLog() as body:  # the op's body, as a captured graph replays it (meta: a host read raises)
        graph.write(packed, sf, scale, SITE, layout, H, per_token)
    ops = {n.split("::")[1] for n in body.names}
    assert not ops & FORBIDDEN, ops & FORBIDDEN
    assert "copy_" in ops and graph.stats["writes"] == 1
    # a forward wider than the slab writes the rows it holds; the rest are refused at commit time
    big = torch.empty(80, H // 2, dtype=torch.uint8, device="meta")
    graph.write(big, _sf(layout, 80, "meta"), torch.empty(80) if per_token else scale, SITE, layout, H, per_token)
    assert graph.stats["clipped"] == 1 and graph.stats["writes"] == 2


def _quantized(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: FP4 codes and E4M3 scale bytes of row ``x[r]`` under its own decode-side ``g[r]``."""
    qs = [quantize(x[r : r + 1], NVFP4, global_scale=float(g[r])) for r in range(x.shape[0])]
    return torch.cat([q.codes for q in qs]), torch.cat([q.scales for q in qs]), g.float()


def test_compiled_fullgraph_keeps_and_runs_the_op() -> None:
    graph = GraphCapture(bits=1)
    graph.active = True
    graph.install()

    def step(packed: torch.Tensor, sf: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        graph.record(SITE, packed, sf, "linear", H, global_scale=g * 1.0)
        return packed.float().sum()  # the forward's "output"; the record is a side effect only

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(7)
    g = torch.tensor([0.01])
    x = torch.randn(6, H, generator=gen)
    codes, sf, _ = _quantized(x, g.expand(6))
    compiled(pack_fp4(codes), sf, g)  # unarmed: notes the site
    assert graph.arm(8, "cpu") and graph.slab is not None
    for seed in (1, 2, 3):  # new inputs each call: the same compiled graph writes each forward's rows
        x = torch.randn(6, H, generator=torch.Generator().manual_seed(seed))
        g = torch.tensor([0.003 * seed])
        codes, sf, _ = _quantized(x, g.expand(6))
        compiled(pack_fp4(codes), sf, g)
        buf = graph.slab[SITE]
        assert torch.equal(buf.codes[:6], pack_bits(codes, 1))
        assert torch.equal(buf.scales[:6], sf)
        assert torch.equal(buf.global_scale[:6], g.expand(6))
    assert graph.stats["writes"] == 3


# -- rows through a real sidecar ------------------------------------------------------------------


def activation(rid: str, pos: int) -> torch.Tensor:
    """The FC1 input of request ``rid`` at ``pos`` (a function of both, so a row stored at the wrong
    place shows up)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}:{pos}".encode()))
    return torch.randn(1, H, generator=gen) * (1 + pos % 3)


class FakeEngine:
    """A forward = the wrapped FlashInfer entry fed one batch's codes, padded with junk rows to a
    "captured size"; per-token scales (vLLM's ``nvfp4_per_token`` path)."""

    def __init__(self, address: str, run: str, device: str, bits: int = 4, kernel: bool = True) -> None:
        self.setting = parse_setting(f"sidecar={address} run={run} policy_version=0 writer=w-{run} bits={bits}")
        self.rec = EngineRecorder(self.setting)
        self.graph = GraphCapture(bits, kernel=kernel)
        self.graph.active = True
        self.graph.install()
        self.rec.graph = self.graph
        self.mapper = RowMapper(block=4)
        self.calls: list[torch.Tensor] = []
        self.entry = wrap_moe_entry(self._flashinfer, self.rec.capture, lambda: bits, self.graph)
        self.device = device
        self.ids: dict[str, list[int]] = {}
        self.bits = bits

    def _flashinfer(self, **kw: Any) -> torch.Tensor:  # shape-correct stand-in for trtllm_fp4_block_scale_moe
        x = kw["hidden_states"]
        return torch.zeros(x.shape[0], x.shape[1] * 2, dtype=torch.bfloat16, device=x.device)

    def inputs(self, rows: list[tuple[str, int]], padded: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xs = [activation(r, p) for r, p in rows]
        junk = torch.Generator().manual_seed(len(rows) * 31 + padded)
        xs += [torch.randn(1, H, generator=junk) * 50 for _ in range(padded - len(rows))]
        x = torch.cat(xs)
        g = x.abs().amax(-1) / 2688
        codes, sf, g = _quantized(x, g)
        return pack_fp4(codes).to(self.device), sf.to(self.device), g.to(self.device)

    def forward(self, packed: torch.Tensor, sf: torch.Tensor, pts: torch.Tensor) -> None:
        SCOPE.enter(SITE, None)
        try:
            self.entry(hidden_states=packed, hidden_states_scale=sf, per_token_scale=pts, num_experts=8)
        finally:
            SCOPE.leave()


def expected(rid: str, pos: int, bits: int) -> tuple[np.ndarray, np.ndarray, float]:
    x = activation(rid, pos)
    g = x.abs().amax(-1) / 2688
    codes, sf, g = _quantized(x, g)
    return pack_bits(codes, bits)[0].numpy(), sf[0].numpy(), float(g[0])


def check_stored(sp: ServeProcess, run: str, traj: str, n: int, bits: int, rid: str) -> None:
    with StoreReader(Store(sp.storage), run) as reader:
        rows = reader.read([(traj, 0, n)], on_missing="mask")[SITE]
    for p in range(n - 1):
        c, s, g = expected(rid, p, bits)
        assert rows.valid[p], (traj, p)
        assert rows.codes[p].tobytes() == c.tobytes() and rows.scales[p].tobytes() == s.tobytes(), (traj, p)
        ts = 1.0 if rows.token_scales is None else float(rows.token_scales[p])
        assert np.float32(rows.global_scale[p] * ts) == np.float32(g), (traj, p)
    assert not rows.valid[n - 1]


def run_steps(eng: FakeEngine, step_forward: Any) -> dict[str, dict]:
    """Three steps of two requests: a prefill in a worker order that is not the plan's (gathered),
    a decode (the slab's first rows as they are), a recompute of a preempted request (only its new
    position stored: gathered). Every forward is padded past its scheduled rows."""
    m, rec = eng.mapper, eng.rec
    ids = {"a": [11, 12, 13, 14, 15], "b": [21, 22, 23]}
    for rid, prompt in ids.items():
        m.add(rid, prompt)
    warm = eng.inputs([("warm", 0)], 4)  # the engine's warm-up forward: notes the site, not committed
    eng.forward(*warm)
    rec.discard_forward()
    assert eng.graph.arm(16, eng.device)

    def step(batch: list[Scheduled], order: list[tuple[str, int]], padded: int) -> None:
        plan = m.step(batch)
        rows = []
        for rid, n in order:
            s = next(b for b in batch if b.request_id == rid)
            rows += [(rid, s.start + i) for i in range(n)]
        step_forward(eng.inputs(rows, padded))
        assert rec.end_forward(plan, order)

    step([Scheduled("a", 0, 5, 0, ids["a"]), Scheduled("b", 0, 3, 0, ids["b"])], [("b", 3), ("a", 5)], 12)
    ids["a"].append(16)
    ids["b"].append(24)
    step([Scheduled("a", 5, 1, 0, [16]), Scheduled("b", 3, 1, 0, [24])], [("a", 1), ("b", 1)], 4)
    ids["a"].append(17)
    ids["b"].append(25)
    # a was preempted: recomputed from scratch (positions 0..5 already stored), b decodes
    step([Scheduled("a", 0, 7, 0, ids["a"]), Scheduled("b", 4, 1, 0, [25])], [("a", 7), ("b", 1)], 16)
    ids["a"].append(18)
    ids["b"].append(26)
    out = {rid: rec.end_request(m.finish(rid, ids[rid])) for rid in ("a", "b")}
    assert rec.close(30)
    return out


def test_rows_map_by_plan_and_padding_is_never_stored(sidecar: ServeProcess) -> None:
    eng = FakeEngine(sidecar.address, "gcpu", "cpu")
    out = run_steps(eng, lambda inp: eng.forward(*inp))
    assert out["a"]["gap"] is None and out["b"]["gap"] is None
    assert eng.rec.stats["rows"] == 8 + 2 + 2  # the prefill, two decodes, a's one new position
    assert eng.graph.stats["gathers"] == 2  # the prefill's worker order and the recompute
    sidecar.terminate()
    sidecar.start()
    check_stored(sidecar, "gcpu", "a::a0", 8, 4, "a")
    check_stored(sidecar, "gcpu", "b::a0", 6, 4, "b")


def test_a_failed_forward_leaves_a_gap_never_a_guided_ref(sidecar: ServeProcess) -> None:
    """The mapper counts a step's planned rows as recorded when it plans them; a forward whose rows
    then fail to reach the recorder (here: the graph capture off, so no site was captured) must end
    its requests with a gap and an unguided ref, not a seal over missing rows."""
    eng = FakeEngine(sidecar.address, "gfail", "cpu")
    m, rec = eng.mapper, eng.rec
    m.add("a", [1, 2, 3])
    m.add("b", [4, 5, 6])
    eng.forward(*eng.inputs([("a", 0)], 2))  # warm-up: notes the site
    rec.discard_forward()
    eng.graph.arm(8, "cpu")
    plan = m.step([Scheduled("a", 0, 3, 0, [1, 2, 3])])
    eng.forward(*eng.inputs([("a", p) for p in range(3)], 4))
    assert rec.end_forward(plan)  # a's prompt recorded
    eng.graph.active = False  # the next forward's rows never reach the slab
    plan = m.step([Scheduled("a", 3, 1, 0, [7]), Scheduled("b", 0, 3, 0, [4, 5, 6])])
    with pytest.raises(Exception, match="captured no site"):
        rec.end_forward(plan)
    out = {r: rec.end_request(m.finish(r, ids)) for r, ids in (("a", [1, 2, 3, 7, 8]), ("b", [4, 5, 6, 9]))}
    assert rec.close(30)
    for r in ("a", "b"):
        ref = json.loads(out[r]["trace_ref"])
        assert out[r]["gap"] == "unrecorded_positions" and not ref["guided"] and ref["reason"] == "incomplete"
    assert rec.stats["seals"] == 0 and rec.stats["gaps"] == 2


def test_planned_rows_past_the_slab_are_refused_not_invented() -> None:
    graph = GraphCapture(bits=1)
    graph.active = True
    graph.install()
    x = torch.randn(4, H)
    codes, sf, g = _quantized(x, x.abs().amax(-1) / 2688)
    graph.record(SITE, pack_fp4(codes), sf, "linear", H, token_scale=g)
    graph.arm(4, "cpu")
    with pytest.raises(Exception, match="slab holds 4"):
        graph.commit(None, [("t", 0, 5)], np.arange(5), None)


def test_8x4_and_swizzled_rows_are_the_linear_rows() -> None:
    """The same codes with scales in each layout land as the same slab rows (the store's layout)."""
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(3))
    g = torch.tensor([0.004])
    codes, sf, _ = _quantized(x, g.expand(40))
    slabs = {}
    for layout, buf in (
        ("linear", sf),
        ("8x4", swizzle_8x4(sf, fill=0x7F)),
        ("swizzled128x4", swizzle_scales(sf, fill=0x7F)),
    ):
        graph = GraphCapture(bits=3)
        graph.active = True
        graph.install()
        graph.record(SITE, pack_fp4(codes), buf, layout, H, global_scale=g)
        graph.arm(48, "cpu")
        graph.record(SITE, pack_fp4(codes), buf, layout, H, global_scale=g)
        assert graph.slab is not None
        slabs[layout] = graph.slab.data[:40].clone()
    ref = record_rows(pack_fp4(codes), sf, layout="linear", bits=3, global_scale=g)
    assert torch.equal(slabs["linear"], slabs["8x4"]) and torch.equal(slabs["linear"], slabs["swizzled128x4"])
    assert graph.slab is not None
    assert torch.equal(graph.slab[SITE].codes[:40], ref[0]) and torch.equal(graph.slab[SITE].scales[:40], ref[1])


# -- a real CUDA graph ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [True, False], ids=["record-kernel", "torch-ops"])
def test_cuda_graph_replays_record_new_inputs_bit_exactly(sidecar: ServeProcess, kernel: bool) -> None:
    """The hook captured once in a ``torch.cuda.CUDAGraph`` per padded size; each step copies its new
    inputs into the graph's static buffers, replays, commits. Stored rows equal an independent
    quantization of each (request, position)'s activation."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA-graph capture test needs one")
    run = f"ggpu{int(kernel)}"
    eng = FakeEngine(sidecar.address, run, "cuda", kernel=kernel)
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}

    def replay(inp: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        padded = inp[0].shape[0]
        if padded not in graphs:  # capture this size once, as an engine does at start-up
            static = tuple(t.clone() for t in inp)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                eng.forward(*static)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                eng.forward(*static)
            graphs[padded] = (g, static)
        g, static = graphs[padded]
        for s, t in zip(static, inp, strict=True):
            s.copy_(t)
        writes = eng.graph.stats["writes"]
        g.replay()  # no Python hook runs here
        assert eng.graph.stats["writes"] == writes

    out = run_steps(eng, replay)
    assert out["a"]["gap"] is None and out["b"]["gap"] is None
    assert eng.rec.stats["rows"] == 12 and len(graphs) == 3
    assert eng.graph.kernel is kernel  # (the kernel path did not fall back)
    sidecar.terminate()
    sidecar.start()
    check_stored(sidecar, run, "a::a0", 8, 4, "a")
    check_stored(sidecar, run, "b::a0", 6, 4, "b")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["linear", "8x4", "swizzled128x4"])
@pytest.mark.parametrize("per_token", [False, True])
def test_record_kernel_and_torch_ops_write_the_same_slab_bytes(layout: str, per_token: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    t, width = 37, 128
    x = torch.randn(t, width, generator=torch.Generator().manual_seed(5))
    g = x.abs().amax(-1) / 2688 if per_token else torch.tensor([0.002]).expand(t)
    qs = [quantize(x[r : r + 1], NVFP4, global_scale=float(g[r])) for r in range(t)]
    codes, sf = torch.cat([q.codes for q in qs]), torch.cat([q.scales for q in qs])
    buf = {"linear": sf, "8x4": swizzle_8x4(sf, fill=0x7F), "swizzled128x4": swizzle_scales(sf, fill=0x7F)}[layout]
    packed, buf = pack_fp4(codes).cuda(), buf.cuda()
    scale = (g if per_token else g[:1]).contiguous().cuda()
    slabs = []
    for kernel in (True, False):
        graph = GraphCapture(bits=2, kernel=kernel)
        graph.install()
        graph.note(SITE, width)
        graph.arm(48, "cuda")
        graph.write(packed, buf, scale, SITE, layout, width, per_token)
        assert graph.kernel is kernel and graph.slab is not None
        slabs.append(graph.slab.data[:t].cpu())
    assert torch.equal(slabs[0], slabs[1])


def test_codes_from_values_without_the_check_is_elementwise() -> None:
    """The graph path's E2M1 codes from vLLM-style float values: the checked form's codes, with no
    table tensor (a host copy) and no host read — it runs on the meta device."""
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    vals = torch.tensor(mags + [-m for m in mags])
    assert torch.equal(codes_from_values(vals, check=False), codes_from_values(vals))
    assert codes_from_values(vals, check=False).tolist() == list(range(16))
    with OpLog() as ops:
        codes_from_values(torch.empty(4, 16, device="meta"), check=False)
    assert not {n.split("::")[1] for n in ops.names} & FORBIDDEN


@pytest.mark.gpu
def test_a_graph_captured_before_arming_stops_every_commit() -> None:
    """A CUDA graph captured while the slab did not exist replays without writing rows; the slab
    would then hold another forward's rows for it. The capture counts it and refuses to commit."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA-graph capture test needs one")
    graph = GraphCapture(bits=1)
    graph.active = True
    graph.install()
    x = torch.randn(8, H)
    codes, sf, g = _quantized(x, x.abs().amax(-1) / 2688)
    packed, sf, g = pack_fp4(codes).cuda(), sf.cuda(), g.cuda()
    graph.record(SITE, packed, sf, "linear", H, token_scale=g)  # noted, outside any capture
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        graph.record(SITE, packed, sf, "linear", H, token_scale=g)  # captured before arming
    assert graph.stats["unarmed_capture"] == 1
    assert graph.arm(8, "cuda")
    with pytest.raises(Exception, match="captured before the slab was armed, or a write"):
        graph.commit(None, [("t", 0, 8)], np.arange(8), None)


@pytest.mark.parametrize("layout", ["linear", "8x4", "swizzled128x4"])
@pytest.mark.parametrize("per_token", [False, True])
def test_record_kernel_arguments_give_the_torch_bytes_on_the_cpu(layout: str, per_token: bool) -> None:
    """The GPU path's call of ``record_from_codes`` (scales put in row order, g per row or one),
    run here by the kernels' CPU reference, writes what the torch path writes; the GPU test above
    compares the CUDA kernel itself. Rows past the slab are clipped the same way."""
    t, width, cap = 37, 128, 32
    x = torch.randn(t, width, generator=torch.Generator().manual_seed(6))
    g = x.abs().amax(-1) / 2688 if per_token else torch.tensor([0.002]).expand(t)
    qs = [quantize(x[r : r + 1], NVFP4, global_scale=float(g[r])) for r in range(t)]
    codes, sf = torch.cat([q.codes for q in qs]), torch.cat([q.scales for q in qs])
    buf = {"linear": sf, "8x4": swizzle_8x4(sf, fill=0x7F), "swizzled128x4": swizzle_scales(sf, fill=0x7F)}[layout]
    scale = (g if per_token else g[:1]).contiguous()
    out = []
    for writer in ("_write_kernel", "_write_torch"):
        graph = GraphCapture(bits=2)
        graph.note(SITE, width)
        graph.arm(cap, "cpu")
        assert graph.slab is not None
        getattr(graph, writer)(graph.slab, SITE, pack_fp4(codes), buf, scale, layout, width, per_token, cap)
        out.append(graph.slab.data.clone())
    assert torch.equal(out[0], out[1])


@pytest.mark.gpu
def test_cuda_graph_replays_write_each_steps_routing() -> None:
    """The route op captured once in a ``torch.cuda.CUDAGraph``; each replay copies that step's ids
    (written into the graph's static input) into the routing rows."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA-graph capture test needs one")
    graph = GraphCapture(1)
    graph.active = True
    graph.install()
    spec = route_spec(2, 4, 300)
    graph.note_route(spec)
    assert graph.arm(32, "cuda")
    static = torch.zeros(24, 4, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.route(spec, static)  # warm the op up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        graph.route(spec, static)
    assert graph.stats["unarmed_capture"] == 0
    assert graph.route_rows is not None
    for seed in (1, 2, 3):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(300, generator=gen)[:4] for _ in range(24)]).to(torch.int32)
        static.copy_(ids.cuda())
        cuda_graph.replay()
        torch.cuda.synchronize()
        codes = graph.route_rows.codes[spec.name][:24].cpu().numpy()
        rows = decode_routing(spec, codes, np.ones((24, 1), np.uint8))
        assert np.array_equal(rows.experts, ids.numpy()), seed
