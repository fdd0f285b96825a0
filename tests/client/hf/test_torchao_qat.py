"""torchao NVFP4 QAT -> TRACE in one quantize_ call, on the CPU (tiny random Qwen2-MoE: its shared
expert's gate/up projections read the MoE block's input, a recorded site)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("torchao", reason="needs torchao (pip install 'tracestore[framework]')")
pytest.importorskip("transformers")

from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale  # noqa: E402
from torchao.prototype.qat import NVFP4FakeQuantizeConfig, NVFP4FakeQuantizedLinear  # noqa: E402
from torchao.quantization import quantize_  # noqa: E402
from torchao.quantization.qat import QATConfig  # noqa: E402
from tracestore.client.hf.torchao_qat import (  # noqa: E402
    TraceGuidance,
    TraceNVFP4FakeQuantizedLinear,
    TraceQATConfig,
    default_site_of,
    torchao_nvfp4_fake_quant,
)

from tracestore.demo.model import ModelSpec, build_model  # noqa: E402
from tracestore.errors import ShapeError  # noqa: E402
from tracestore.formats import NVFP4  # noqa: E402
from tracestore.fp4 import dequantize, quantize  # noqa: E402
from tracestore.guidance import Guidance  # noqa: E402
from tracestore.guided import guided_round  # noqa: E402
from tracestore.packing import pack_bits  # noqa: E402

SPEC = ModelSpec(arch="qwen2_moe", layers=2, hidden=64, heads=4, kv_heads=2, experts=4, top_k=2, expert_hidden=32,
                 vocab=128)  # fmt: skip


def records_of(x: torch.Tensor, valid: torch.Tensor | None = None) -> Guidance:
    """What a rollout records for activations ``x`` [rows, w]: b = 1 low bits, scales, g."""
    q = quantize(x.detach().float(), NVFP4)
    g = torch.full((x.shape[0],), float(q.global_scale), dtype=torch.float32)
    return Guidance(pack_bits(q.codes, 1), q.scales, g, bits=1, fmt=NVFP4, valid=valid)


def test_prepare_switch_train_convert() -> None:
    torch.manual_seed(0)
    model = build_model(SPEC).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(model, QATConfig(activation_config=NVFP4FakeQuantizeConfig(),
                                   weight_config=NVFP4FakeQuantizeConfig(), step="prepare"))  # fmt: skip
    prepared = {n for n, m in model.named_modules() if isinstance(m, NVFP4FakeQuantizedLinear)}
    assert "model.layers.0.mlp.shared_expert.up_proj" in prepared
    ids = torch.randint(3, SPEC.vocab, (2, 9))
    with pytest.raises(Exception, match="scaling"):  # torchao's own forward needs a Blackwell GPU
        model(input_ids=ids)

    guidance = TraceGuidance(model)
    quantize_(model, TraceQATConfig(guidance))  # the one line
    swapped = {n for n, m in model.named_modules() if isinstance(m, TraceNVFP4FakeQuantizedLinear)}
    assert swapped == prepared
    assert default_site_of("model.layers.1.mlp.shared_expert.gate_proj") == "layers.1.mlp.input"
    assert default_site_of("model.layers.1.self_attn.q_proj") is None

    # capture what each guided linear consumes and produces
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    originals = {}
    for name, m in model.named_modules():
        if isinstance(m, TraceNVFP4FakeQuantizedLinear) and default_site_of(name):
            originals[name] = m

            def hook(mod, args, out, name=name):  # noqa: ANN001
                seen[name] = (args[0].detach().reshape(-1, args[0].shape[-1]), out.detach())

            m.register_forward_hook(hook)

    # no guidance yet: RTN everywhere (runs on the CPU), records taken from the actual inputs
    model(input_ids=ids).logits.sum()
    x0 = seen["model.layers.0.mlp.shared_expert.up_proj"][0]
    x1 = seen["model.layers.1.mlp.shared_expert.up_proj"][0]
    valid = torch.ones(x0.shape[0], dtype=torch.bool)
    valid[-3:] = False  # e.g. final positions: RTN fallback
    guidance.set({"layers.0.mlp.input": records_of(x0, valid), "layers.1.mlp.input": records_of(x1)})

    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert guidance.used == {"layers.0.mlp.input": 2, "layers.1.mlp.input": 2}  # gate and up of each layer
    up0 = originals["model.layers.0.mlp.shared_expert.up_proj"]
    assert up0.weight.grad is not None and up0.weight.grad.abs().sum() > 0

    # layer 0's input is the one the records were taken from: TRACE reproduces the rollout's
    # dequantized activation exactly on recorded rows (identity), RTN on the others, and the
    # linear is torchao's NVFP4 weight fake-quant applied to it
    x, y = seen["model.layers.0.mlp.shared_expert.up_proj"]
    assert torch.equal(x, x0)
    xq = guided_round(x, *_rows(guidance, "layers.0.mlp.input"), valid=valid,
                      fallback_global_scale=per_tensor_amax_to_scale(x.abs().max()))  # fmt: skip
    assert torch.equal(xq[:-3], dequantize(quantize(x0, NVFP4))[:-3])
    want = torch.nn.functional.linear(xq, torchao_nvfp4_fake_quant(up0.weight.detach(), up0.weight_config))
    assert torch.equal(y, want)
    # layer 1 (its input moved since the records were taken): exactly guided_round of what it got
    x, y = seen["model.layers.1.mlp.shared_expert.up_proj"]
    up1 = originals["model.layers.1.mlp.shared_expert.up_proj"]
    xq = guided_round(x, *_rows(guidance, "layers.1.mlp.input"),
                      fallback_global_scale=per_tensor_amax_to_scale(x.abs().max()))  # fmt: skip
    assert torch.equal(
        y, torch.nn.functional.linear(xq, torchao_nvfp4_fake_quant(up1.weight.detach(), up1.weight_config))
    )
    opt.step()

    # misaligned guidance is refused loudly
    guidance.set({"layers.0.mlp.input": records_of(x0[:-1])})
    with pytest.raises(ShapeError, match="rows must align"):
        model(input_ids=ids)

    # torchao's convert step still recognises the modules
    guidance.clear()
    quantize_(model, QATConfig(step="convert"))
    assert not any(isinstance(m, NVFP4FakeQuantizedLinear) for m in model.modules())
    assert torch.isfinite(model(input_ids=ids).logits).all()


def _rows(guidance: TraceGuidance, site: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = guidance._rows[site]
    return g.codes, g.scales, g.global_scale  # type: ignore[return-value]
