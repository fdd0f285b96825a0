"""CPU reference of FP4 quantization (torch), bit-exact to ``docs/numerics.md`` §1–§4.

Readable first: every kernel in ``tracestore.kernels`` is tested against these functions.
They are plain torch ops, so they also run (slowly) on a GPU and under ``torch.compile``.
"""

from __future__ import annotations

import dataclasses

import torch

from tracestore.errors import DTypeError, ShapeError
from tracestore.formats import (
    E2M1_BOUNDARIES,
    E2M1_MAGNITUDES,
    E4M3_MAX,
    E4M3_NAN_BYTE,
    E8M0_BIAS,
    E8M0_NAN_BYTE,
    NAN_CODE,
    NVFP4_GLOBAL_DIVISOR,
    SIGN_BIT,
    FP4Format,
    get_format,
)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLT_MAX = torch.finfo(torch.float32).max


@dataclasses.dataclass(frozen=True)
class Quantized:
    """An FP4-quantized tensor: ``codes`` uint8[..., D] in 0..15, ``scales`` uint8[..., D//block]
    (raw E4M3/E8M0 bytes, row-major), ``global_scale`` the decode-side float32 g (1.0 for MXFP4)."""

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: float
    fmt: FP4Format


def check_float_tensor(x: object, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise DTypeError(f"{name} must be a torch.Tensor of float32/bfloat16/float16, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise DTypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ShapeError(f"{name} must have shape [..., D], got a scalar")
    return x


def check_uint8(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise DTypeError(f"{name} must be a torch.uint8 tensor, got {got}")
    return t


def check_width(width: int, fmt: FP4Format, name: str = "x") -> int:
    if width <= 0 or width % fmt.block:
        raise ShapeError(
            f"{name}'s last dimension ({width}) must be a positive multiple of the {fmt.name} "
            f"block size {fmt.block}; pad the tensor or pick another site width"
        )
    return width // fmt.block


def _f32(v: float | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(v, dtype=torch.float32).reshape(())


def sane_global_scales(g: torch.Tensor) -> torch.Tensor:
    """Decode-side NVFP4 g, elementwise, as records store and the trainer uses it (docs/numerics.md
    §3): float32 ``g`` where it is a positive finite number, 1.0 where it is 0, -0, negative, ±inf
    or NaN. Positive subnormals are kept bit for bit. Same shape and device as ``g``."""
    g = g.to(torch.float32)
    return torch.where((g > 0) & (g <= FLT_MAX), g, torch.ones_like(g))


def resolve_global_scale(x: torch.Tensor, global_scale: float | torch.Tensor | None) -> torch.Tensor:
    """Decode-side g as a float32 scalar: given, or amax(|x|)/2688; then :func:`sane_global_scales`
    (0, negative or non-finite -> 1, §3)."""
    if global_scale is None:
        g = x.float().abs().amax().to(torch.float32) / NVFP4_GLOBAL_DIVISOR
    else:
        g = _f32(global_scale).to(x.device)
    return sane_global_scales(g)


def rtn_codes(z: torch.Tensor) -> torch.Tensor:
    """Round float32 values to E2M1 codes (uint8), ties to the even code, saturating at 6.

    -0.0 keeps its sign (code 8); NaN -> code 7 (docs/numerics.md §2).
    """
    z = z.float()
    a = z.abs()
    k = torch.zeros(z.shape, dtype=torch.uint8, device=z.device)
    for i, b in enumerate(E2M1_BOUNDARIES):
        # strictly above the boundary -> upper code; exactly on it -> the even one of (i, i+1)
        up = (a > b) | ((a == b) & (i % 2 == 1))
        k += up.to(torch.uint8)
    sign = torch.signbit(z).to(torch.uint8) * SIGN_BIT
    codes = k | sign
    return torch.where(torch.isnan(z), torch.full_like(codes, NAN_CODE), codes)


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32[16]: value of each code."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """float32 -> E4M3 ("fn") bytes: round to nearest even, saturate to ±448, NaN -> 0x7F."""
    v = v.float()
    a = torch.clamp(v.abs(), max=E4M3_MAX)  # saturate first: the binade below must be 448's
    # Exponent of the value's binade, clamped at the subnormal floor 2^-6 (step 2^-9 below it).
    _, e = torch.frexp(a)  # a = m * 2^e with m in [0.5, 1)
    e = torch.clamp(e - 1, min=-6)
    step = torch.ldexp(torch.ones_like(a), (e - 3).to(torch.int32))
    n = torch.round(a / step)  # round-half-even; exact (power-of-two step)
    q = torch.clamp(n * step, max=E4M3_MAX)
    # Re-encode the rounded value (rounding may have carried into the next binade).
    _, e2 = torch.frexp(q)
    e2 = torch.clamp(e2 - 1, min=-6)
    normal = q >= 2.0**-6
    man_normal = torch.round(q / torch.ldexp(torch.ones_like(q), e2.to(torch.int32)) * 8 - 8)
    man_sub = torch.round(q / 2.0**-9)
    byte = torch.where(normal, ((e2 + 7) * 8).float() + man_normal, man_sub).to(torch.int32)
    byte = byte | (torch.signbit(v).to(torch.int32) << 7)
    byte = torch.where(torch.isnan(v), torch.full_like(byte, E4M3_NAN_BYTE), byte)
    return byte.to(torch.uint8)


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes -> float32 (0x7F/0xFF -> NaN)."""
    b = b.to(torch.int32)
    sign = torch.where((b & 0x80) != 0, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 7).float()
    normal = torch.ldexp(1.0 + man / 8.0, (exp - 7).to(torch.int32))
    sub = man * 2.0**-9
    val = sign * torch.where(exp == 0, sub, normal)
    return torch.where((b & 0x7F) == E4M3_NAN_BYTE, torch.full_like(val, float("nan")), val)


def e8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 2^(e-127) (0xFF -> NaN)."""
    b = b.to(torch.int32)
    val = torch.ldexp(torch.ones(b.shape, dtype=torch.float32, device=b.device), b - E8M0_BIAS)
    return torch.where(b == E8M0_NAN_BYTE, torch.full_like(val, float("nan")), val)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    _, e = torch.frexp(a)
    return e - 1  # exact for every positive finite float32, subnormals included


def mx_scale_bytes(amax: torch.Tensor, rule: str) -> torch.Tensor:
    """Per-block E8M0 byte from the block's amax (float32), docs/numerics.md §4."""
    amax = amax.float()
    if rule == "floor":
        k = _floor_log2(amax) - 2
    else:  # rceil: k = ceil(log2(amax / 6)), the division in float32
        v = amax / 6.0
        m, e = torch.frexp(v)
        k = torch.where(m == 0.5, e - 1, e)
        k = torch.where(v == 0, torch.full_like(k, -E8M0_BIAS), k)  # amax/6 underflowed to 0
    k = torch.clamp(k, -E8M0_BIAS, E8M0_BIAS)
    byte = (k + E8M0_BIAS).to(torch.int32)
    byte = torch.where(amax == 0, torch.zeros_like(byte), byte)
    byte = torch.where(~torch.isfinite(amax), torch.full_like(byte, E8M0_NAN_BYTE), byte)
    return byte.to(torch.uint8)


def _block_amax(xb: torch.Tensor) -> torch.Tensor:
    # torch.amax propagates NaN (CUDA's fmaxf would drop it, docs/numerics.md §3).
    return xb.abs().amax(dim=-1)


def quantize_blocks(xb: torch.Tensor, fmt: FP4Format, g: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """RTN of blocked float32 ``xb`` [..., nb, block] -> (codes uint8 [..., nb, block], scale bytes
    uint8 [..., nb]). ``g``: NVFP4's decode-side global scale, a scalar or broadcastable to
    [..., nb]."""
    amax = _block_amax(xb)
    if fmt.name == "nvfp4":
        if g is None:
            raise ShapeError("NVFP4 needs a global scale")
        s_enc = 1.0 / g
        sf = e4m3_encode(amax * (s_enc * _f32(1.0 / 6.0).to(xb.device)))
        enc = torch.clamp(s_enc / e4m3_decode(sf), max=FLT_MAX)  # all-zero block: sf 0 -> FLT_MAX
        return rtn_codes(xb * enc.unsqueeze(-1)), sf
    sf = mx_scale_bytes(amax, fmt.scale_rule)
    # x * 2^-k is exact: scale by an exact power of two (NaN byte -> NaN -> code 7).
    inv = torch.ldexp(torch.ones_like(amax), E8M0_BIAS - sf.to(torch.int32))
    inv = torch.where(sf == E8M0_NAN_BYTE, torch.full_like(inv, float("nan")), inv)
    return rtn_codes(xb * inv.unsqueeze(-1)), sf


def quantize(x: torch.Tensor, fmt: FP4Format | str, global_scale: float | torch.Tensor | None = None) -> Quantized:
    """RTN-quantize ``x`` [..., D] (float32/bf16/fp16) to FP4 codes and block scales.

    ``global_scale`` is decode-side (NVFP4 only; None = amax(|x|)/2688). Example::

        q = quantize(torch.randn(4, 64), NVFP4)   # q.codes uint8[4, 64], q.scales uint8[4, 4]
    """
    fmt = get_format(fmt)
    x = check_float_tensor(x)
    nblocks = check_width(x.shape[-1], fmt)
    xb = x.float().reshape(*x.shape[:-1], nblocks, fmt.block)
    if fmt.name == "nvfp4":
        g = resolve_global_scale(x, global_scale)
        g_out = float(g)
    else:
        if global_scale is not None:
            raise ShapeError("MXFP4 has no global scale; pass global_scale=None")
        g, g_out = None, 1.0
    codes, sf = quantize_blocks(xb, fmt, g)
    return Quantized(codes.reshape(x.shape), sf, g_out, fmt)


def scale_values(scales: torch.Tensor, fmt: FP4Format) -> torch.Tensor:
    """Scale bytes -> float32 block scales (without the global scale)."""
    return e4m3_decode(scales) if fmt.name == "nvfp4" else e8m0_decode(scales)


def dequantize_codes(
    codes: torch.Tensor, scales: torch.Tensor, global_scale: float | torch.Tensor, fmt: FP4Format | str
) -> torch.Tensor:
    """``m(code) * float(sf) * g`` in float32, in that order (docs/numerics.md §3)."""
    fmt = get_format(fmt)
    check_uint8(codes, "codes")
    check_uint8(scales, "scales")
    nblocks = check_width(codes.shape[-1], fmt, "codes")
    if tuple(scales.shape) != (*codes.shape[:-1], nblocks):
        raise ShapeError(
            f"scales must have shape {(*codes.shape[:-1], nblocks)} for codes {tuple(codes.shape)}, "
            f"got {tuple(scales.shape)}"
        )
    m = e2m1_table(codes.device)[codes.long()].reshape(*codes.shape[:-1], nblocks, fmt.block)
    sf = scale_values(scales, fmt).unsqueeze(-1)
    y = m * sf
    if fmt.name == "nvfp4":
        y = y * _f32(global_scale).to(codes.device)
    return y.reshape(codes.shape)


def dequantize(q: Quantized) -> torch.Tensor:
    """Dequantize a :class:`Quantized` to float32 of the original shape."""
    return dequantize_codes(q.codes, q.scales, q.global_scale, q.fmt)
