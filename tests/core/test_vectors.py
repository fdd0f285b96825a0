"""Every case in tests/vectors/public.json (docs/numerics.md §11), reproduced exactly."""

import pytest
import torch

from tracestore import MXFP4, NVFP4, dequantize, pack_bits, pack_fp4, quantize, unpack_bits
from tracestore.fp4 import mx_scale_bytes, rtn_codes
from tracestore.guided import guided_codes
from tracestore.layouts import swizzle_scales, swizzled_offset, unswizzle_scales

from .conftest import load_vectors

V = load_vectors()


@pytest.mark.parametrize("case", V["rtn"], ids=lambda c: f"z={c['z']}")
def test_rtn(case):
    assert rtn_codes(torch.tensor([float(case["z"])])).item() == case["code"]


@pytest.mark.parametrize("case", V["guided_unit_scale"], ids=lambda c: c["name"])
@pytest.mark.parametrize("rule", ["bracket", "paper"])
def test_guided_unit_scale(case, rule):
    z_train = torch.tensor([float(case["z_train"])])
    z_roll = torch.tensor([float(case["z_rollout"])])
    assert rtn_codes(z_roll).item() == case["rollout_code"]
    assert rtn_codes(z_train).item() == case["rtn_code"]
    c = torch.tensor([case["c"]], dtype=torch.uint8)
    assert guided_codes(z_train, c, case["b"], rule).item() == case[rule]


@pytest.mark.parametrize("name", ["nvfp4_two_blocks", "nvfp4_zero_block"])
def test_nvfp4_blocks(name):
    case = V[name]
    q = quantize(torch.tensor(case["x"], dtype=torch.float32), NVFP4, global_scale=case["g"])
    assert q.scales.tolist() == case["scale_bytes"]
    assert q.codes.tolist() == case["codes"]
    if "packed_fp4_bytes" in case:
        assert pack_fp4(q.codes).tolist() == case["packed_fp4_bytes"]
    if "dequantized" in case:
        assert dequantize(q).tolist() == case["dequantized"]


def test_nvfp4_divide_vs_multiply_near_tie():
    """docs/numerics.md §3: multiplying by enc (not dividing by sf*g) decides block 1, element 3 -> code 9."""
    case = V["nvfp4_two_blocks"]
    q = quantize(torch.tensor(case["x"]), NVFP4, global_scale=case["g"])
    assert q.codes[16 + 3].item() == 9 == case["codes"][19]


@pytest.mark.parametrize("case", V["mxfp4_scale_bytes"], ids=lambda c: f"amax={c['amax']}")
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_mxfp4_scale_bytes(case, rule):
    assert mx_scale_bytes(torch.tensor([case["amax"]]), rule).item() == case[rule]
    # and through quantize: a block whose amax is the case's amax
    x = torch.zeros(32)
    x[5] = case["amax"]
    assert quantize(x, MXFP4.with_rule(rule)).scales.item() == case[rule]


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_pack_bits(bits):
    case = V["pack_bits"]
    codes = torch.tensor(case["codes"], dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.tolist() == case[f"b{bits}"]
    assert torch.equal(unpack_bits(packed, bits, len(codes)), codes & ((1 << bits) - 1))


def test_swizzle_example():
    case = V["swizzle_128x4"]
    rows, cols, ex = case["rows"], case["cols"], case["example"]
    assert swizzled_offset(ex["r"], ex["c"], cols) == ex["byte_offset"]
    s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8)
    buf = swizzle_scales(s)
    assert buf[ex["byte_offset"]] == s[ex["r"], ex["c"]]
    assert torch.equal(unswizzle_scales(buf, rows, cols), s)
