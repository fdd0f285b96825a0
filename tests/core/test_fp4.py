"""Quantization reference: enumerated codes, ties, scale bytes; NaN/zero/saturation; errors."""

import math

import numpy as np
import pytest
import torch

from tracestore import (
    MXFP4,
    MXFP4_RCEIL,
    NVFP4,
    ConfigError,
    DTypeError,
    ShapeError,
    TraceStoreError,
    dequantize,
    get_format,
    quantize,
)
from tracestore.formats import (
    E2M1_BOUNDARIES,
    E2M1_MAGNITUDES,
    E4M3_TO_FLOAT,
    E8M0_TO_FLOAT,
    FP4Format,
    sane_global_scale,
)
from tracestore.fp4 import (
    e2m1_table,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    mx_scale_bytes,
    rtn_codes,
    sane_global_scales,
)

FORMATS = [NVFP4, MXFP4, MXFP4_RCEIL]


@pytest.mark.parametrize("code", range(16))
def test_every_code_is_a_fixed_point(code):
    value = e2m1_table()[code]
    expected = 0 if code == 0 else code  # +0 and -0 keep their sign bit: RTN(-0.0) is code 8
    assert rtn_codes(value.reshape(1)).item() == expected
    assert value.item() == (-1 if code & 8 else 1) * E2M1_MAGNITUDES[code & 7]


TIES = [(b, i) for i, b in enumerate(E2M1_BOUNDARIES)]


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["pos", "neg"])
@pytest.mark.parametrize(("boundary", "lower"), TIES, ids=[f"tie={b}" for b, _ in TIES])
def test_every_tie_goes_to_the_even_code(boundary, lower, sign):
    even = lower if lower % 2 == 0 else lower + 1
    got = rtn_codes(torch.tensor([sign * boundary])).item()
    assert got == even | (8 if sign < 0 else 0)
    # a hair either side goes to the nearer code
    below = torch.nextafter(torch.tensor([boundary]), torch.tensor([0.0]))
    above = torch.nextafter(torch.tensor([boundary]), torch.tensor([10.0]))
    assert rtn_codes(below).item() == lower
    assert rtn_codes(above).item() == lower + 1


@pytest.mark.parametrize("z", [6.0, 6.5, 1e30, float("inf")])
def test_saturation(z):
    assert rtn_codes(torch.tensor([z, -z])).tolist() == [7, 15]


def test_nan_and_signed_zero():
    assert rtn_codes(torch.tensor([float("nan"), -float("nan"), -0.0, 0.0])).tolist() == [7, 7, 8, 0]


@pytest.mark.parametrize("byte", range(256))
def test_e4m3_byte_round_trip(byte):
    b = torch.tensor([byte], dtype=torch.uint8)
    v = e4m3_decode(b)
    ref = E4M3_TO_FLOAT[byte]
    if math.isnan(ref):
        assert torch.isnan(v).all()
        assert e4m3_encode(v).item() == 0x7F
    else:
        assert v.item() == ref
        assert e4m3_encode(v).item() == byte


def test_e4m3_encode_rounds_half_even_and_saturates():
    vals = E4M3_TO_FLOAT[:0x7F].astype(np.float64)  # all non-negative finite values
    mids = (vals[:-1] + vals[1:]) / 2  # exactly representable in float32
    got = e4m3_encode(torch.tensor(mids, dtype=torch.float32)).numpy()
    lower = np.arange(len(mids))
    expected = np.where(lower % 2 == 0, lower, lower + 1)  # the even mantissa
    np.testing.assert_array_equal(got, expected)
    assert e4m3_encode(torch.tensor([448.0, 464.0, 1e9, float("inf")])).tolist() == [0x7E] * 4
    assert e4m3_encode(torch.tensor([2.0**-10, 2.0**-10 * 1.0001, 2.0**-9])).tolist() == [0, 1, 1]


def test_e4m3_encode_matches_torch_float8_on_random_values():
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(200_000, generator=gen) * torch.exp(torch.randn(200_000, generator=gen) * 6)).clamp(-448, 448)
    ours = e4m3_encode(x)
    theirs = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("byte", range(256))
def test_e8m0_byte_round_trip(byte):
    v = e8m0_decode(torch.tensor([byte], dtype=torch.uint8))
    if byte == 0xFF:
        assert torch.isnan(v).all() and math.isnan(E8M0_TO_FLOAT[byte])
        assert mx_scale_bytes(torch.tensor([float("nan")]), "floor").item() == 0xFF
        return
    assert v.item() == E8M0_TO_FLOAT[byte] == 2.0 ** (byte - 127)
    # floor rule: amax = 4 * 2^(e-127) -> k = e-127 (until the top of float32's range)
    if byte <= 252:
        assert mx_scale_bytes(torch.tensor([2.0 ** (byte - 125)]), "floor").item() == max(byte, 0)
    # rceil rule: amax = 6 * 2^(e-127) -> k = e-127
    if 1 <= byte <= 254:
        amax = torch.tensor([6.0]) * e8m0_decode(torch.tensor([byte], dtype=torch.uint8))
        if torch.isfinite(amax).all():
            assert mx_scale_bytes(amax, "rceil").item() == byte


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_zero_block(fmt):
    q = quantize(torch.zeros(2, fmt.block), fmt, None)
    assert q.codes.eq(0).all() and q.scales.eq(0).all()
    assert dequantize(q).eq(0).all()


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_nan_block(fmt):
    x = torch.ones(2, fmt.block)
    x[1, 3] = float("nan")
    q = quantize(x, fmt, 1.0 if fmt is NVFP4 else None)
    assert q.scales[1].item() == fmt.nan_scale_byte
    assert q.codes[1].eq(7).all()
    assert torch.isnan(dequantize(q)[1]).all()
    assert not torch.isnan(dequantize(q)[0]).any()


DEGENERATE_G = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -0.5, -3.0e38, -(2.0**-140)]


@pytest.mark.parametrize("g", DEGENERATE_G)
def test_degenerate_global_scale_means_one(g):
    """docs/numerics.md §3: a g that is not a positive finite float32 becomes 1."""
    x = torch.linspace(-3, 3, 32)
    for given in (g, torch.tensor(g)):
        q = quantize(x, NVFP4, given)
        assert torch.equal(q.codes, quantize(x, NVFP4, 1.0).codes)
        assert torch.equal(q.scales, quantize(x, NVFP4, 1.0).scales)
        assert q.global_scale == 1.0
    assert quantize(torch.zeros(16), NVFP4).global_scale == 1.0


def test_sane_global_scales_elementwise():
    g = torch.tensor([*DEGENERATE_G, 0.75, 2.0**-140, 3.0e38])
    want = torch.tensor([1.0] * len(DEGENERATE_G) + [0.75, 2.0**-140, 3.0e38])
    assert torch.equal(sane_global_scales(g).view(torch.int32), want.view(torch.int32))
    assert [sane_global_scale(float(v)) for v in g] == want.tolist()
    assert sane_global_scale(float(np.float32(2.0**-140))) == 2.0**-140  # subnormals are kept


def test_subnormal_global_scale_is_used_as_given():
    """A positive subnormal g is finite and nonzero: kept, though 1/g overflows to inf (§3)."""
    x = torch.cat([torch.zeros(16), torch.linspace(-1, 1, 16)])
    q = quantize(x, NVFP4, 2.0**-140)
    assert q.global_scale == 2.0**-140
    assert q.scales.tolist() == [0x7F, 0x7E]  # 0·inf is NaN: the all-zero block reads as NaN (§8)


def test_default_global_scale_is_amax_over_2688():
    x = torch.tensor([0.5, -12.0] + [0.0] * 14)
    assert quantize(x, NVFP4).global_scale == np.float32(12.0) / np.float32(2688.0)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_quantize_like_their_float32_value(fmt, dtype):
    x = (torch.randn(7, 3 * 32, generator=torch.Generator().manual_seed(3)) * 5).to(dtype)
    a, b = quantize(x, fmt), quantize(x.float(), fmt)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("shape", [(1, 32), (3, 5, 64), (17 * 32,), (2, 1, 1, 96)])
def test_any_leading_shape(fmt, shape):
    x = torch.randn(shape)
    q = quantize(x, fmt)
    assert q.codes.shape == x.shape and q.scales.shape == (*shape[:-1], shape[-1] // fmt.block)
    flat = quantize(x.reshape(-1, shape[-1]), fmt, q.global_scale if fmt is NVFP4 else None)
    assert torch.equal(flat.codes.reshape(shape), q.codes)


def test_errors_are_typed_and_say_what_was_expected():
    with pytest.raises(ShapeError, match="multiple of the nvfp4 block size 16") as e:
        quantize(torch.zeros(4, 24), NVFP4)
    assert isinstance(e.value, ValueError) and isinstance(e.value, TraceStoreError)
    with pytest.raises(DTypeError, match="float32, bfloat16 or float16") as e2:
        quantize(torch.zeros(4, 16, dtype=torch.int32), NVFP4)
    assert isinstance(e2.value, TypeError)
    with pytest.raises(DTypeError):
        quantize(np.zeros((4, 16), dtype=np.float32), NVFP4)  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match="scalar"):
        quantize(torch.tensor(1.0), NVFP4)
    with pytest.raises(ConfigError, match="unknown FP4 format"):
        get_format("fp8")
    with pytest.raises(ConfigError):
        FP4Format("nvfp4", 32)
    with pytest.raises(ShapeError, match="no global scale"):
        quantize(torch.zeros(32), MXFP4, 1.0)
