"""Capture inside vLLM: scale layouts against vLLM's own swizzle, records of vLLM's ``ref_nvfp4_quant``
decoded bit for bit, and the hooks installed on vLLM's real modules (FlashInfer replaced by a
shape-correct fake built on tracestore's reference quantizer, since FlashInfer needs a GPU)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: the engine venv (.ci/engines-venv) runs these")
pytestmark = pytest.mark.engines

import torch  # noqa: E402
from tracestore.client.engines import capture as cap  # noqa: E402
from tracestore.client.engines.capture import MOE_ENTRIES  # noqa: E402
from tracestore.client.engines.codes import (  # noqa: E402
    codes_from_values,
    record_rows,
    scales_to_rowmajor,
    swizzle_8x4,
)
from tracestore.client.engines.recording import EngineRecorder  # noqa: E402
from tracestore.client.engines.setting import parse_setting  # noqa: E402
from tracestore.client.engines.vllm import hooks  # noqa: E402
from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils as emu  # noqa: E402
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import swizzle_blockscale  # noqa: E402

from tests.engines import _ast  # noqa: E402
from tracestore import NVFP4, quantize  # noqa: E402
from tracestore.errors import DTypeError, ShapeError, ValidationError  # noqa: E402
from tracestore.fp4 import dequantize_codes  # noqa: E402
from tracestore.packing import pack_bits, pack_fp4, unpack_bits  # noqa: E402

SHAPES = [(1, 1), (7, 3), (32, 4), (33, 5), (128, 8), (129, 130), (300, 17)]


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_swizzled_128x4_matches_vllm(monkeypatch: pytest.MonkeyPatch, rows: int, cols: int) -> None:
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)  # vLLM's swizzle ends in .cuda()
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    raw = torch.randint(0, 0x7E, (rows, cols), dtype=torch.uint8, generator=g)
    swz = swizzle_blockscale(raw.view(torch.float8_e4m3fn))  # vLLM's own swizzle
    assert torch.equal(scales_to_rowmajor(swz, rows, cols, "swizzled128x4"), raw)
    back = emu.convert_swizzled_to_linear(swz.view(torch.uint8).reshape(-1), rows, cols * 16, 16)
    assert torch.equal(back[:rows, :cols], raw)


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_8x4_and_linear_layouts(rows: int, cols: int) -> None:
    raw = torch.randint(0, 0x7E, (rows, cols), dtype=torch.uint8)
    buf = swizzle_8x4(raw, fill=0xFF)
    assert buf.numel() == -(-rows // 8) * 8 * -(-cols // 4) * 4
    assert torch.equal(scales_to_rowmajor(buf, rows, cols, "8x4"), raw)
    # S[r, c] at ((r//8)*(C'/4) + c//4)*32 + (r%8)*4 + c%4
    cp = -(-cols // 4) * 4
    for r, c in [(0, 0), (rows - 1, cols - 1), (rows // 2, cols // 2)]:
        assert buf[((r // 8) * (cp // 4) + c // 4) * 32 + (r % 8) * 4 + c % 4] == raw[r, c]
    assert torch.equal(scales_to_rowmajor(raw.view(torch.float8_e4m3fn), rows, cols, "linear"), raw)


def test_layout_errors_are_clear() -> None:
    with pytest.raises(ShapeError, match="8x4 scale buffer"):
        scales_to_rowmajor(torch.zeros(31, dtype=torch.uint8), 8, 4, "8x4")
    with pytest.raises(ValidationError, match="scale layout"):
        scales_to_rowmajor(torch.zeros(4, dtype=torch.uint8), 1, 4, "swizzled")
    with pytest.raises(DTypeError, match="float8_e4m3fn or uint8"):
        scales_to_rowmajor(torch.zeros(4), 1, 4, "linear")
    with pytest.raises(ShapeError, match="multiple of the NVFP4 block"):
        record_rows(torch.zeros(2, 4, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), global_scale=1.0)
    with pytest.raises(ValidationError, match="global_scale"):
        record_rows(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))


@pytest.mark.parametrize("t, h", [(1, 16), (5, 64), (33, 272), (128, 512)])
@pytest.mark.parametrize("power_of_two", [True, False])
def test_records_of_ref_nvfp4_quant_decode_bit_for_bit(t: int, h: int, power_of_two: bool) -> None:
    gen = torch.Generator().manual_seed(t * h)
    x = (torch.randn(t, h, generator=gen) * 3).to(torch.bfloat16)
    if t * h > 16:
        x[0, :16] = 0  # an all-zero block
    amax = x.float().abs().max()
    enc = torch.tensor([2.0 ** torch.floor(torch.log2(2688 / amax)).item()]) if power_of_two else 2688 / amax.reshape(1)
    values, sf = emu.ref_nvfp4_quant(x, enc, 16)  # vLLM's pure-torch reference
    packed, scales, g = hooks.record_ref_quant(x, enc, 16, emu)
    assert packed.shape == (t, h // 8) and scales.shape == (t, h // 16) and scales.dtype == torch.uint8
    want_codes = codes_from_values(values)
    assert torch.equal(unpack_bits(packed, 1, h), want_codes & 1)  # b = 1: the mantissa bit
    assert torch.equal(scales.view(torch.float8_e4m3fn).float(), sf)  # scale bytes: vLLM's scales exactly
    # full codes (b = 4) decode to vLLM's dequantized values
    ours = dequantize_codes(want_codes, scales, g, NVFP4)
    theirs = (values.reshape(t, h // 16, 16) * (sf.unsqueeze(-1) / enc)).reshape(t, h)
    if power_of_two:
        assert torch.equal(ours, theirs)
    else:  # m*sf*g (numerics §3) vs vLLM's m*(sf/enc): one float32 rounding apart at most
        assert torch.allclose(ours, theirs, rtol=2**-23, atol=0)
    assert torch.equal(emu.ref_nvfp4_quant_dequant(x, enc, 16), theirs.to(x.dtype))


def test_codes_from_values_enumerates_all_16_codes() -> None:
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    vals = torch.tensor(mags + [-m for m in mags])
    assert codes_from_values(vals).tolist() == list(range(16))
    with pytest.raises(ValidationError, match="E2M1"):
        codes_from_values(torch.tensor([0.75]))


@pytest.fixture
def engine() -> Iterator[EngineRecorder]:
    eng = EngineRecorder(parse_setting("sidecar=127.0.0.1:1 run=hooks policy_version=0 sites=all"))
    old = hooks.ENGINE, None if hooks.GRAPH is None else hooks.GRAPH.active
    hooks.ENGINE = eng
    hooks.set_graph_mode(True)  # eager forwards: the hooks capture into the recorder
    yield eng
    hooks.ENGINE = old[0]
    if hooks.GRAPH is not None:
        hooks.GRAPH.active = bool(old[1])


def _fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, list[dict]]:
    """flashinfer / flashinfer.fused_moe with shape-correct FP4 MoE entries: they dequantize the FP4
    input with tracestore's reference (the 'experts' are the identity) and return [T, H] bf16."""
    calls: list[dict] = []

    def entry(**kw: object) -> torch.Tensor:
        calls.append(kw)
        x, sf, pts = kw["hidden_states"], kw["hidden_states_scale"], kw.get("per_token_scale")
        from tracestore.packing import unpack_fp4

        codes = unpack_fp4(x)  # type: ignore[arg-type]
        y = dequantize_codes(codes, sf.view(torch.uint8), 1.0, NVFP4)  # type: ignore[union-attr]
        return (y * (pts.reshape(-1, 1) if pts is not None else 1.0)).to(torch.bfloat16)  # type: ignore[union-attr]

    fi = types.ModuleType("flashinfer")
    fm = types.ModuleType("flashinfer.fused_moe")
    for name in MOE_ENTRIES:
        setattr(fm, name, entry)
        setattr(fi, name, entry)
    fi.fused_moe = fm  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fm)
    return fm, calls


def _vllm_call_keywords(entry: str) -> set[str]:
    tree = _ast.source_tree("vllm.model_executor.layers.fused_moe.experts.trtllm_nvfp4_moe")
    return _ast.keywords(next(_ast.calls(tree, f"flashinfer.fused_moe.{entry}")))


@pytest.mark.parametrize("entry", MOE_ENTRIES)
@pytest.mark.parametrize("per_token", [True, False])
def test_flashinfer_moe_entry_records_fc1_input(
    monkeypatch: pytest.MonkeyPatch, engine: EngineRecorder, entry: str, per_token: bool
) -> None:
    fm, calls = _fake_flashinfer(monkeypatch)
    assert sorted(hooks.install_flashinfer()) == sorted(
        f"{m}:{e}" for m in ("flashinfer.fused_moe", "flashinfer") for e in MOE_ENTRIES
    )
    assert hooks.install_flashinfer() == []  # idempotent
    t, h = 11, 96
    x = torch.randn(t, h) * 4
    if per_token:  # one decode scale per token (FlashInfer's per-token path), blocks under g = 1
        pts = x.abs().amax(dim=1) / 2688
        q = quantize(x / pts.reshape(-1, 1), NVFP4, 1.0)
    else:
        pts = None
        q = quantize(x, NVFP4)
    kwargs = dict.fromkeys(_vllm_call_keywords(entry))  # the keywords vLLM's call site passes
    kwargs.update(
        hidden_states=pack_fp4(q.codes), hidden_states_scale=q.scales.view(torch.float8_e4m3fn), per_token_scale=pts
    )
    cap.SCOPE.enter("layers.3.mlp.input", None if per_token else torch.tensor([q.global_scale]))
    try:
        out = getattr(sys.modules["flashinfer.fused_moe"], entry)(**kwargs)
    finally:
        cap.SCOPE.leave()
    assert len(calls) == 1 and calls[0]["hidden_states"] is kwargs["hidden_states"]  # passed on unchanged
    assert out.shape == (t, h) and out.dtype == torch.bfloat16
    codes, scales, g = engine._sites["layers.3.mlp.input"]
    assert torch.equal(codes, pack_bits(q.codes, 1)) and torch.equal(scales, q.scales)
    assert torch.equal(g, pts) if per_token else float(g) == float(q.global_scale)
    # outside a MoE runner nothing is recorded; the entry still runs
    engine.discard_forward()
    getattr(fm, entry)(**kwargs)
    assert engine._sites == {}
    for m in (sys.modules["flashinfer"], fm):
        for e in MOE_ENTRIES:
            cap.unpatch_attr(m, e)


def test_cpu_emulation_linear_records_what_vllm_quantized(engine: EngineRecorder) -> None:
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel

    out_f, in_f = 24, 64
    w = torch.randn(out_f, in_f)
    wq = quantize(w, NVFP4)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(pack_fp4(wq.codes), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(wq.scales.view(torch.float8_e4m3fn), requires_grad=False)
    layer.weight_global_scale = torch.tensor([float(wq.global_scale)])
    layer.input_global_scale_inv = torch.tensor([2688 / 3.0])
    layer.prefix = "model.layers.2.self_attn.qkv_proj"
    kernel = EmulationNvFp4LinearKernel(NvFp4LinearLayerConfig())
    x = (torch.randn(5, in_f)).to(torch.bfloat16)
    before = kernel.apply_weights(layer, x)
    try:
        hooks._install_dense()
        for mod in (emu, sys.modules["vllm.model_executor.layers.fused_moe.utils"]):
            cap.patch_attr(mod, "ref_nvfp4_quant_dequant", lambda fn: hooks._wrap_ref_quant_dequant(emu, fn))
        after = kernel.apply_weights(layer, x)
        assert torch.equal(after, before)  # the engine computes exactly what it did
        codes, scales, g = engine._sites["layers.2.self_attn.qkv_proj.input"]
        want = hooks.record_ref_quant(x, layer.input_global_scale_inv, 16, emu)
        assert all(torch.equal(a, b) for a, b in zip((codes, scales, g), want, strict=True))
        # MoE a1 (first quantization inside a runner) is recorded under the runner's site, a2 is not
        from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

        engine.discard_forward()
        cap.SCOPE.enter("layers.4.mlp.input", None)
        hooks._MOE_SEEN.n = 0
        try:
            a1 = (torch.randn(3, in_f)).to(torch.bfloat16)
            moe_kernel_quantize_input(a1, torch.tensor([500.0]), "nvfp4", False, quantization_emulation=True)
            moe_kernel_quantize_input(
                torch.randn(6, 32).to(torch.bfloat16),
                torch.tensor([900.0]),
                "nvfp4",
                False,
                quantization_emulation=True,
            )
        finally:
            cap.SCOPE.leave()
        assert list(engine._sites) == ["layers.4.mlp.input"]
        assert torch.equal(
            engine._sites["layers.4.mlp.input"][0], hooks.record_ref_quant(a1, torch.tensor([500.0]), 16, emu)[0]
        )
    finally:
        for mod in (emu, sys.modules["vllm.model_executor.layers.fused_moe.utils"]):
            cap.unpatch_attr(mod, "ref_nvfp4_quant_dequant")
        from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel

        todo = list(NvFp4LinearKernel.__subclasses__())
        while todo:
            cls = todo.pop()
            todo += cls.__subclasses__()
            if "apply_weights" in vars(cls):
                cap.unpatch_attr(cls, "apply_weights")


def test_compiled_emulation_linear_records_through_the_graph_op(engine: EngineRecorder) -> None:
    """vLLM's real NVFP4 emulation linear under ``torch.compile(fullgraph=True)`` with the hooks in
    graph mode: dynamo traces through the wrappers without a break, the compiled graph keeps the
    record op, and each call's slab rows are the records of what vLLM's ``ref_nvfp4_quant`` made."""
    from tracestore.client.engines.graph import GraphCapture
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel, NvFp4LinearLayerConfig
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel

    out_f, in_f = 24, 64
    wq = quantize(torch.randn(out_f, in_f), NVFP4)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(pack_fp4(wq.codes), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(wq.scales.view(torch.float8_e4m3fn), requires_grad=False)
    layer.weight_global_scale = torch.tensor([float(wq.global_scale)])
    layer.input_global_scale_inv = torch.tensor([2688 / 3.0])
    layer.prefix = "model.layers.2.self_attn.qkv_proj"
    kernel = EmulationNvFp4LinearKernel(NvFp4LinearLayerConfig())
    graph, old = GraphCapture(bits=2), hooks.GRAPH
    graph.active = True
    graph.install()
    hooks.GRAPH = engine.graph = graph
    site = "layers.2.self_attn.qkv_proj.input"
    try:
        hooks._install_dense()
        for mod in (emu, sys.modules["vllm.model_executor.layers.fused_moe.utils"]):
            cap.patch_attr(mod, "ref_nvfp4_quant_dequant", lambda fn: hooks._wrap_ref_quant_dequant(emu, fn))
        torch._dynamo.reset()
        fwd = torch.compile(lambda x: kernel.apply_weights(layer, x), backend="aot_eager", fullgraph=True)
        x = torch.randn(5, in_f).to(torch.bfloat16)
        assert torch.equal(fwd(x), kernel.apply_weights(layer, x))  # warm-up: notes the site
        assert graph.widths == {site: in_f} and engine._sites == {}
        assert graph.arm(8, "cpu") and graph.slab is not None
        for seed in (1, 2):
            x = torch.randn(5, in_f, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
            fwd(x)
            values, sf = emu.ref_nvfp4_quant(x, layer.input_global_scale_inv, 16)  # vLLM's own quantizer
            buf = graph.slab[site]
            assert torch.equal(buf.codes[:5], pack_bits(codes_from_values(values), 2))
            assert torch.equal(buf.scales[:5], sf.to(torch.float8_e4m3fn).view(torch.uint8))
            assert torch.equal(buf.global_scale[:5], (1.0 / layer.input_global_scale_inv).expand(5))
        assert graph.stats["writes"] == 2 and engine._sites == {}
    finally:
        hooks.GRAPH, engine.graph = old, None
        for mod in (emu, sys.modules["vllm.model_executor.layers.fused_moe.utils"]):
            cap.unpatch_attr(mod, "ref_nvfp4_quant_dequant")
        todo = list(NvFp4LinearKernel.__subclasses__())
        while todo:
            cls = todo.pop()
            todo += cls.__subclasses__()
            if "apply_weights" in vars(cls):
                cap.unpatch_attr(cls, "apply_weights")


def test_site_names_match_hf_site_hooks() -> None:
    assert cap.site_name("model.layers.3.mlp.experts", moe=True) == "layers.3.mlp.input"
    assert cap.site_name("language_model.model.layers.12.mlp", moe=True) == "layers.12.mlp.input"
    assert cap.site_name("model.layers.0.self_attn.qkv_proj") == "layers.0.self_attn.qkv_proj.input"
    with pytest.raises(ValidationError, match="not under layers"):
        cap.site_name("lm_head")


def test_plugin_is_version_gated_and_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm
    from tracestore.client.engines import vllm as plugin

    from tracestore.errors import ConfigError

    monkeypatch.delenv("TRACESTORE_RECORD", raising=False)
    plugin.register()  # no setting: nothing happens
    monkeypatch.setenv("TRACESTORE_RECORD", "sidecar=127.0.0.1:1 run=r policy_version=0")
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(ConfigError, match=r"validated against vllm 0\.32\.0, but vllm 0\.33\.0 is installed"):
        plugin.register()


@pytest.mark.parametrize("rows, backend, swizzled, layout", [
    (5, "trtllm", True, "8x4"), (32, "flashinfer-trtllm", True, "8x4"), (33, "trtllm", True, "swizzled128x4"),
    (7, "none", True, "swizzled128x4"), (7, "cutlass", False, "linear"),
])  # fmt: skip
def test_scaled_fp4_quant_records_each_layout(
    engine: EngineRecorder, rows: int, backend: str, swizzled: bool, layout: str
) -> None:
    """vLLM's scaled_fp4_quant (a CUDA op) replaced by a fake on tracestore's reference that lays the
    scales out as vLLM documents for these arguments; the wrapper must pick the same layout."""
    from tracestore.layouts import swizzle_scales

    assert hooks.sf_layout(rows, swizzled, backend) == layout
    h = 48
    x = torch.randn(rows, h).to(torch.bfloat16)
    enc = torch.tensor([2688 / float(x.float().abs().max())])

    def fake(inp, gs, is_sf_swizzled_layout=True, backend="none", padded_n=None):  # noqa: ANN001, ANN202
        q = quantize(inp.float(), NVFP4, 1.0 / gs)
        sf = {"8x4": swizzle_8x4, "swizzled128x4": swizzle_scales, "linear": lambda a: a}[layout](q.scales)
        return pack_fp4(q.codes), sf.view(torch.float8_e4m3fn)

    wrapped = hooks._wrap_scaled_fp4_quant(fake)
    hooks._DENSE.name = "layers.0.mlp.down_proj.input"
    try:
        codes, sf = wrapped(x, enc, swizzled, backend)
    finally:
        hooks._DENSE.name = None
    q = quantize(x.float(), NVFP4, 1.0 / enc)
    got = engine._sites["layers.0.mlp.down_proj.input"]
    assert torch.equal(got[0], pack_bits(q.codes, 1)) and torch.equal(got[1], q.scales)
    assert torch.equal(codes, pack_fp4(q.codes))  # the engine gets the original's result unchanged
