"""quantize -> dequantize error bounds on random data (hypothesis)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tracestore import MXFP4, MXFP4_RCEIL, NVFP4, dequantize, quantize
from tracestore.fp4 import scale_values

# Largest |x - x_hat| in units of the block's scale s = float(sf)*g: half the widest gap (1, between
# 4 and 6) when nothing saturates; the E4M3-rounded NVFP4 scale can put amax at up to 6*(1+1/16)
# (error 0.375); MX "floor" puts amax/2^k in [4, 8) (error up to 2); "rceil" keeps it <= 6.
BOUND = {"nvfp4": 1.0, "mxfp4(floor)": 2.0, "mxfp4(rceil)": 1.0}


def _flush_tiny(x: np.ndarray) -> np.ndarray:
    # A tensor amax below ~8e-36 makes g = amax/2688 so small that s_enc = 1/g overflows to inf, and
    # docs/numerics.md §3's sf = E4M3(amax_block * (s_enc/6)) is then NaN (0 * inf) for an all-zero block,
    # not the 0x00 its comment promises: a corner of the spec (hypothesis found [1.5e-40, 0, ...]),
    # kept as the reference and the kernels compute it and left out of this bound.
    return np.where(np.abs(x) < 1e-30, np.float32(0), x)


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4, MXFP4_RCEIL], ids=str)
@settings(max_examples=60, deadline=None)
@given(
    x=arrays(
        np.float32, st.tuples(st.integers(1, 3), st.just(64)), elements=st.floats(-3e4, 3e4, allow_nan=False, width=32)
    ).map(_flush_tiny)
)
def test_error_bound(fmt, x):
    xt = torch.from_numpy(x)
    q = quantize(xt, fmt)
    xh = dequantize(q)
    s = (scale_values(q.scales, fmt) * q.global_scale).repeat_interleave(fmt.block, -1)
    err = (xh.double() - xt.double()).abs()
    sd = s.double()
    # Always: unsaturated values are within half the widest gap (1·s), saturated ones lose |x| - 6s.
    assert bool((err <= torch.maximum(sd, xt.double().abs() - 6 * sd) * (1 + 1e-6) + 1e-30).all())
    # With a normal scale byte (E4M3 >= 2^-6; every E8M0 byte), saturation is bounded per format.
    normal = s.double() >= 2.0**-6 * q.global_scale if fmt is NVFP4 else torch.ones_like(err, dtype=torch.bool)
    assert bool((err <= BOUND[str(fmt)] * sd * (1 + 1e-6) + 1e-30)[normal].all())
    # never flips the sign of a nonzero value
    assert bool(((xh == 0) | (torch.sign(xh) == torch.sign(xt))).all())
