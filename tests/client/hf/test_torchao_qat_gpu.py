"""torchao QAT -> TRACE on a GPU: TraceNVFP4FakeQuantizedLinear's activation path dispatches to the
CUDA kernel (tracestore.kernels.guided_fp4) for CUDA inputs; it must equal the CPU path's reference
(tracestore.guided.guided_round, run here on the same CUDA tensors) bit for bit, in forward and in
the straight-through backward, with rows without a record falling back to RTN with the trainer's
own per-tensor g."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao", reason="needs torchao (pip install 'tracestore[framework]')")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale  # noqa: E402
from torchao.prototype.qat import NVFP4FakeQuantizeConfig  # noqa: E402
from tracestore.client.hf.torchao_qat import (  # noqa: E402
    TraceGuidance,
    TraceNVFP4FakeQuantizedLinear,
    torchao_nvfp4_fake_quant,
)

from tracestore.formats import NVFP4  # noqa: E402
from tracestore.fp4 import quantize  # noqa: E402
from tracestore.guidance import Guidance  # noqa: E402
from tracestore.guided import guided_round  # noqa: E402
from tracestore.packing import pack_bits  # noqa: E402

SITE = "layers.0.mlp.input"


def _records(x: torch.Tensor, bits: int, valid: torch.Tensor) -> Guidance:
    q = quantize(x.detach().float(), NVFP4)
    g = torch.full((x.shape[0],), float(q.global_scale), dtype=torch.float32, device=x.device)
    return Guidance(pack_bits(q.codes, bits), q.scales, g, bits=bits, fmt=NVFP4, valid=valid)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("rule", ["bracket", "paper"])
@pytest.mark.parametrize("per_tensor", [True, False])
def test_cuda_activation_path_equals_the_reference_bit_for_bit(dtype, bits, rule, per_tensor) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows, width, out = 96, 128, 64
    linear = torch.nn.Linear(width, out, bias=True, device=dev, dtype=dtype)
    cfg = NVFP4FakeQuantizeConfig(use_per_tensor_scale=per_tensor)
    model = torch.nn.Sequential(linear)
    guidance = TraceGuidance(model, site_of=lambda name: SITE if name == "0" else None, rule=rule)
    mod = TraceNVFP4FakeQuantizedLinear.from_nvfp4(linear, guidance)
    mod.activation_config, mod.weight_config = cfg, cfg
    model[0] = mod

    x_roll = torch.randn(rows, width, device=dev, dtype=dtype)
    valid = torch.ones(rows, dtype=torch.bool, device=dev)
    valid[::7] = False  # rows without a record: RTN with the trainer's own g
    rec = _records(x_roll, bits, valid)
    guidance.set({SITE: rec})
    x = (x_roll.float() * (1 + 1e-2 * torch.randn_like(x_roll.float()))).to(dtype).requires_grad_(True)

    y = model(x.reshape(4, rows // 4, width))
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    assert guidance.used == {SITE: 1}

    xr = x.detach().clone().requires_grad_(True)
    own = (
        per_tensor_amax_to_scale(xr.detach().abs().max()).float()
        if per_tensor
        else torch.ones((), dtype=torch.float32, device=dev)
    )
    xq = guided_round(xr, rec.codes, rec.scales, rec.global_scale, bits, NVFP4, rule,
                      valid=rec.valid, fallback_global_scale=own)  # fmt: skip
    wq = torchao_nvfp4_fake_quant(mod.weight, mod.weight_config)
    want = torch.nn.functional.linear(xq, wq, mod.bias).reshape(y.shape)
    want.backward(grad_out)

    assert y.dtype == want.dtype
    assert torch.equal(y, want)
    assert torch.equal(x.grad, xr.grad)


def test_cuda_path_moves_cpu_guidance_to_the_input_device() -> None:
    torch.manual_seed(1)
    dev = torch.device("cuda")
    linear = torch.nn.Linear(64, 32, device=dev)
    model = torch.nn.Sequential(linear)
    guidance = TraceGuidance(model, site_of=lambda name: SITE if name == "0" else None)
    model[0] = TraceNVFP4FakeQuantizedLinear.from_nvfp4(linear, guidance)
    x = torch.randn(16, 64)
    cpu = _records(x, 1, torch.ones(16, dtype=torch.bool))
    guidance.set({SITE: cpu})
    y_cpu_guidance = model(x.to(dev))
    guidance.set({SITE: cpu.to(dev)})
    assert torch.equal(y_cpu_guidance, model(x.to(dev)))
