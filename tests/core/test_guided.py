"""guided_round / rtn_fake_quant: docs/numerics.md §9 invariants on random data, gradients, errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tracestore import (
    MXFP4,
    MXFP4_RCEIL,
    NVFP4,
    ConfigError,
    DTypeError,
    ShapeError,
    dequantize,
    guided_round,
    pack_bits,
    quantize,
    rtn_fake_quant,
)
from tracestore.formats import E2M1_MAGNITUDES
from tracestore.fp4 import e2m1_table, rtn_codes
from tracestore.guided import guided_codes

FORMATS = [NVFP4, MXFP4, MXFP4_RCEIL]
MAGS = torch.tensor(E2M1_MAGNITUDES)

finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)


def _flush_tiny(x: np.ndarray) -> np.ndarray:
    # Invariant 1 needs s_enc = 1/g and s_enc/sf finite (tensor amax >~ 1e-35): for smaller tensors
    # docs/numerics.md §3 clamps enc at FLT_MAX while z = x/s does not, so the two sides disagree by design.
    return np.where(np.abs(x) < 1e-30, np.float32(0), x)


def activations(width: int) -> st.SearchStrategy[np.ndarray]:
    return arrays(np.float32, st.tuples(st.integers(1, 3), st.just(width)), elements=finite).map(_flush_tiny)


def perturb(x: np.ndarray, rel: float, seed: int) -> torch.Tensor:
    noise = np.random.default_rng(seed).standard_normal(x.shape).astype(np.float32)
    return torch.from_numpy(x * (1 + rel * noise))


@pytest.mark.parametrize("rule", ["bracket", "paper"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@settings(max_examples=40, deadline=None)
@given(x=activations(64))
def test_invariant_1_identity(x, fmt, bits, rule):
    xt = torch.from_numpy(x)
    q = quantize(xt, fmt)
    y = guided_round(xt, pack_bits(q.codes, bits), q.scales, q.global_scale, bits, fmt, rule)
    assert torch.equal(y, dequantize(q))


def _z(x: torch.Tensor, q) -> torch.Tensor:
    from tracestore.fp4 import scale_values

    s = scale_values(q.scales, q.fmt).repeat_interleave(q.fmt.block, -1) * q.global_scale
    return x / s


@pytest.mark.parametrize("rule", ["bracket", "paper"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@settings(max_examples=40, deadline=None)
@given(x=activations(32), rel=st.sampled_from([1e-3, 3e-2, 0.3, 3.0]), seed=st.integers(0, 2**16))
def test_invariants_2_3_4_on_unit_codes(x, bits, rule, rel, seed):
    q = quantize(torch.from_numpy(x), MXFP4)
    x_train = perturb(x, rel, seed)
    z = _z(x_train, q)
    c = q.codes & (15 if bits == 4 else (1 << bits) - 1)
    out = guided_codes(z, c, bits, rule)
    table = e2m1_table()
    v_out, v_roll, v_rtn = table[out.long()], table[q.codes.long()], table[rtn_codes(z).long()]
    a = z.abs()
    # 3. bracket: the output is one of the two codewords bracketing |z| (with z's sign), or 6 saturated
    lo = MAGS[(a.unsqueeze(-1) >= MAGS[1:]).sum(-1)]
    hi = torch.where(lo == a, lo, MAGS[((a.unsqueeze(-1) >= MAGS[1:]).sum(-1) + 1).clamp(max=7)])
    sat = a >= 6
    in_bracket = (v_out.abs() == lo) | (v_out.abs() == hi)
    same_sign = torch.signbit(v_out) == torch.signbit(z)
    assert bool((sat & (v_out.abs() == 6) | (~sat & in_bracket & same_sign)).all())
    # 2. with full information, never worse than RTN
    if bits == 4:
        assert bool(((v_out - v_roll).abs() <= (v_rtn - v_roll).abs()).all())
    # 4. b = 1 bracket: a rollout code at a bracket end is reproduced exactly
    if bits == 1 and rule == "bracket":
        roll_at_end = ~sat & (torch.signbit(v_roll) == torch.signbit(z)) & ((v_roll.abs() == lo) | (v_roll.abs() == hi))
        assert bool((out == q.codes)[roll_at_end].all())


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtype_and_straight_through_gradients(fmt, dtype):
    gen = torch.Generator().manual_seed(0)
    x_roll = torch.randn(5, 3 * 32, generator=gen)
    q = quantize(x_roll, fmt)
    p = pack_bits(q.codes, 1)
    x = (x_roll + 0.01 * torch.randn(x_roll.shape, generator=gen)).to(dtype).requires_grad_()
    for y in (
        guided_round(x, p, q.scales, q.global_scale, 1, fmt),
        rtn_fake_quant(x, fmt, q.global_scale if fmt is NVFP4 else None),
    ):
        assert y.dtype == dtype and y.shape == x.shape
        x.grad = None
        g_out = torch.randn(x.shape, generator=gen).to(dtype)
        y.backward(g_out)
        assert torch.equal(x.grad, g_out)  # dy/dx = 1 exactly: the upstream gradient, unchanged


def test_outputs_in_x_dtype_equal_float32_result_cast():
    x_roll = torch.randn(4, 64)
    q = quantize(x_roll, NVFP4)
    p = pack_bits(q.codes, 2)
    x = x_roll.to(torch.bfloat16)
    y = guided_round(x, p, q.scales, q.global_scale, 2)
    y32 = guided_round(x.float(), p, q.scales, q.global_scale, 2)
    assert torch.equal(y, y32.to(torch.bfloat16))


def test_nan_x_zero_scale_and_nan_scale_fallback():
    x_roll = torch.randn(3, 32)
    x_roll[1] = 0.0  # an all-zero rollout block: sf = 0, so s = 0 -> output 0 (keeping x's sign)
    q = quantize(x_roll, NVFP4)
    p = pack_bits(q.codes, 1)
    x = x_roll.clone()
    x[0, 0] = float("nan")
    x[1, :4] = torch.tensor([1.0, -2.0, 0.0, -0.0])
    y = guided_round(x, p, q.scales, q.global_scale, 1)
    assert torch.isnan(y[0, 0]) and not torch.isnan(y[0, 1:]).any()
    assert y[1, :16].eq(0).all()
    assert torch.signbit(y[1, :4]).tolist() == [False, True, False, True]
    # NaN scale byte (0x7F): that block falls back to RTN with our own block scales and the record's g
    scales = q.scales.clone()
    scales[2, 1] = 0x7F
    y = guided_round(x_roll, p, scales, q.global_scale, 1)
    rtn = rtn_fake_quant(x_roll, NVFP4, q.global_scale)
    assert torch.equal(y[2, 16:], rtn[2, 16:])
    assert torch.equal(y[2, :16], dequantize(q)[2, :16])


def test_valid_mask_and_per_row_global_scale():
    x1, x2 = torch.randn(2, 32), 10 * torch.randn(2, 32)
    q1, q2 = quantize(x1, NVFP4), quantize(x2, NVFP4)  # two forwards, two global scales
    x = torch.cat([x1, x2])
    codes = pack_bits(torch.cat([q1.codes, q2.codes]), 1)
    scales = torch.cat([q1.scales, q2.scales])
    g = torch.tensor([q1.global_scale] * 2 + [q2.global_scale] * 2)
    y = guided_round(x, codes, scales, g, 1)
    assert torch.equal(y, torch.cat([dequantize(q1), dequantize(q2)]))
    valid = torch.tensor([True, False, True, True])
    y = guided_round(x, codes, scales, g, 1, valid=valid)
    assert torch.equal(y[1], rtn_fake_quant(x1, NVFP4, q1.global_scale)[1])
    assert torch.equal(y[2:], dequantize(q2))


@pytest.mark.parametrize(
    "g", [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -0.5], ids=["0", "-0", "inf", "-inf", "nan", "neg"]
)
def test_degenerate_record_global_scale_means_one(g):
    """docs/numerics.md §3: the rollout's g, when 0, negative or not finite, is 1 on the training side
    too — in the guided values and in the RTN fallback (a NaN scale byte, an invalid row)."""
    x_roll = torch.randn(3, 32, generator=torch.Generator().manual_seed(5))
    q = quantize(x_roll, NVFP4, 1.0)
    p = pack_bits(q.codes, 1)
    scales = q.scales.clone()
    scales[2, 1] = 0x7F
    x = x_roll * 1.01
    valid = torch.tensor([True, False, True])
    want = guided_round(x, p, scales, 1.0, 1, valid=valid)
    assert torch.equal(guided_round(x_roll, p, q.scales, g, 1), dequantize(q))  # invariant 1 with g = 1
    assert torch.equal(guided_round(x, p, scales, g, 1, valid=valid), want)
    assert torch.equal(guided_round(x, p, scales, torch.tensor([g, 1.0, g]), 1, valid=valid), want)
    assert torch.equal(guided_round(x, p, scales, 1.0, 1, valid=valid, fallback_global_scale=g), want)


def test_token_scales_divide_z_and_multiply_output():
    x = torch.randn(2, 16)
    q = quantize(x / 4, NVFP4)  # as if the engine pre-divided by a per-token scale of 4
    ts = torch.tensor([4.0, 4.0])
    y = guided_round(x, pack_bits(q.codes, 1), q.scales, q.global_scale, 1, token_scales=ts)
    assert torch.equal(y, dequantize(q) * 4)


def test_guided_errors():
    x = torch.randn(2, 32)
    q = quantize(x, NVFP4)
    p = pack_bits(q.codes, 1)
    with pytest.raises(ConfigError, match="bits must be an integer in 1..4"):
        guided_round(x, p, q.scales, q.global_scale, bits=5)
    with pytest.raises(ConfigError, match="rule must be one of"):
        guided_round(x, p, q.scales, q.global_scale, rule="nearest")  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match="packed rows must be"):
        guided_round(x, p[:, :3], q.scales, q.global_scale)
    with pytest.raises(ShapeError, match="scales must have shape"):
        guided_round(x, p, q.scales[:1], q.global_scale)
    with pytest.raises(ShapeError, match="multiple of the nvfp4 block"):
        guided_round(x[:, :20], p, q.scales, q.global_scale)
    with pytest.raises(DTypeError, match="uint8"):
        guided_round(x, p.to(torch.int32), q.scales, q.global_scale)
    with pytest.raises(ShapeError, match="one value per row"):
        guided_round(x, p, q.scales, torch.ones(3))
