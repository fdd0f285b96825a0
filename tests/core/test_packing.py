"""pack_bits/unpack_bits, engine FP4 packing and scale swizzling: round trips and errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tracestore import ConfigError, ShapeError, pack_bits, pack_fp4, unpack_bits, unpack_fp4
from tracestore.layouts import padded_shape, swizzle_scales, swizzled_offset, unswizzle_scales

codes_2d = arrays(np.uint8, st.tuples(st.integers(1, 4), st.integers(1, 70)), elements=st.integers(0, 15))


@settings(max_examples=60, deadline=None)
@given(codes=codes_2d, bits=st.integers(1, 4))
def test_pack_unpack_round_trip_and_numpy_layout(codes, bits):
    c = torch.from_numpy(codes)
    packed = pack_bits(c, bits)
    width = codes.shape[1]
    assert packed.shape == (codes.shape[0], (width * bits + 7) // 8)
    assert torch.equal(unpack_bits(packed, bits, width), c & ((1 << bits) - 1) if bits < 4 else c)
    # docs/numerics.md §6: numpy packbits(bitorder="little") of the bit-planes, row by row
    low = codes & ((1 << bits) - 1) if bits < 4 else codes
    planes = ((low[..., None] >> np.arange(bits)) & 1).reshape(codes.shape[0], -1)
    expected = np.packbits(planes, axis=-1, bitorder="little")
    np.testing.assert_array_equal(packed.numpy(), expected)


@settings(max_examples=30, deadline=None)
@given(
    codes=arrays(
        np.uint8, st.tuples(st.integers(1, 3), st.integers(1, 20).map(lambda n: 2 * n)), elements=st.integers(0, 15)
    )
)
def test_fp4_nibbles(codes):
    c = torch.from_numpy(codes)
    p = pack_fp4(c)
    assert torch.equal(p & 0xF, c[:, 0::2]) and torch.equal(p >> 4, c[:, 1::2])
    assert torch.equal(unpack_fp4(p), c)


def test_packing_errors():
    c = torch.zeros(2, 16, dtype=torch.uint8)
    for bad in (0, 5, -1, 1.5, True):
        with pytest.raises(ConfigError, match="bits must be an integer in 1..4"):
            pack_bits(c, bad)  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match=r"ceil\(16\*2/8\) = 4 bytes"):
        unpack_bits(torch.zeros(2, 3, dtype=torch.uint8), 2, 16)
    with pytest.raises(TypeError):
        pack_bits(c.to(torch.int64), 1)
    with pytest.raises(ShapeError, match="even width"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 13), seed=st.integers(0, 1000))
def test_swizzle_round_trip_and_offsets(rows, cols, seed):
    s = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (rows, cols), dtype=np.uint8))
    buf = swizzle_scales(s)
    rp, cp = padded_shape(rows, cols)
    assert buf.numel() == rp * cp
    assert torch.equal(unswizzle_scales(buf, rows, cols), s)
    np.testing.assert_array_equal(unswizzle_scales(swizzle_scales(s.numpy()), rows, cols), s.numpy())
    for r, c in [(0, 0), (rows - 1, cols - 1), (rows // 2, cols // 2)]:
        assert buf[swizzled_offset(r, c, cols)] == s[r, c]


def test_swizzle_size_error():
    with pytest.raises(ShapeError, match="128"):
        unswizzle_scales(torch.zeros(100, dtype=torch.uint8), 38, 8)
