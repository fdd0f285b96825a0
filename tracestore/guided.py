"""TRACE guided rounding and RTN fake-quant (torch CPU reference), docs/numerics.md §7–§8.

Both return ``x``'s dtype and have a straight-through backward (dy/dx = 1).
"""

from __future__ import annotations

from typing import Literal

import torch

from tracestore.errors import ConfigError, ShapeError
from tracestore.formats import E2M1_MAGNITUDES, E2M1_MAX, GUIDED_RULES, NVFP4, FP4Format, check_bits, get_format
from tracestore.fp4 import (
    check_float_tensor,
    check_uint8,
    check_width,
    dequantize,
    e2m1_table,
    quantize,
    quantize_blocks,
    rtn_codes,
    sane_global_scales,
    scale_values,
)
from tracestore.packing import unpack_bits

Rule = Literal["bracket", "paper"]
RULES = GUIDED_RULES


class StraightThrough(torch.autograd.Function):
    """Forward returns the precomputed fake-quantized ``y``; backward passes ``dy`` to ``x``
    unchanged (straight-through estimator: dy/dx = 1). Scales and records get no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def _ste(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    y = y.to(x.dtype)
    return StraightThrough.apply(x, y) if x.requires_grad else y


def rtn_fake_quant(
    x: torch.Tensor, fmt: FP4Format | str = NVFP4, global_scale: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Plain FP4 fake quantization ``dequantize(quantize(x))`` in ``x``'s dtype; backward STE.

    Example: ``y = rtn_fake_quant(x.requires_grad_(), NVFP4)``.
    """
    fmt = get_format(fmt)
    x = check_float_tensor(x)
    with torch.no_grad():
        y = dequantize(quantize(x.detach(), fmt, global_scale))
    return _ste(x, y)


def _magnitudes(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)


def _paper_codes(
    z: torch.Tensor, c: torch.Tensor, bits: int, kminus: torch.Tensor, kplus: torch.Tensor
) -> torch.Tensor:
    """Rule "paper" (the paper's Algorithm 1): the candidate r nearest to |z| among codes whose low
    bits are c, then the bracket end nearest to (sign)·m_r; an unresolvable tie gives RTN(z)."""
    mags = _magnitudes(z.device)
    a = z.abs()
    neg = torch.signbit(z)
    sigma = neg.to(torch.uint8) * 8
    ks = torch.arange(8, device=z.device, dtype=torch.uint8)
    if bits == 4:
        cand = ks == (c & 7).unsqueeze(-1)
        target_neg = (c & 8) != 0
    else:
        cand = (ks & ((1 << bits) - 1)) == c.unsqueeze(-1)
        target_neg = neg
    dist = torch.where(cand, (mags - a.unsqueeze(-1)).abs(), torch.full_like(mags, float("inf")))
    best = dist.amin(-1, keepdim=True)
    tied = cand & (dist == best)
    inside = tied & ((ks == kminus.unsqueeze(-1)) | (ks == kplus.unsqueeze(-1)))
    n_tied = tied.sum(-1)
    n_inside = inside.sum(-1)
    r = torch.where(n_tied == 1, tied.to(torch.uint8).argmax(-1), inside.to(torch.uint8).argmax(-1))
    give_up = (n_tied > 1) & (n_inside != 1)
    t = torch.where(target_neg, -mags[r], mags[r])
    sgn = torch.where(neg, -1.0, 1.0)
    d_lo = (sgn * mags[kminus.long()] - t).abs()
    d_hi = (sgn * mags[kplus.long()] - t).abs()
    out = torch.where(d_hi < d_lo, sigma | kplus, sigma | kminus)
    return torch.where(give_up, rtn_codes(z), out)


def guided_codes(z: torch.Tensor, c: torch.Tensor, bits: int, rule: Rule = "bracket") -> torch.Tensor:
    """TRACE's code choice for float32 ``z = x / s`` given recorded low bits ``c`` (uint8).

    Returns E2M1 codes (uint8). NaN ``z`` -> code 7 (callers output NaN for NaN x).
    """
    bits = check_bits(bits)
    if rule not in RULES:
        raise ConfigError(f"rule must be one of {RULES}, got {rule!r}")
    mags = _magnitudes(z.device)
    a = z.abs()
    neg = torch.signbit(z)
    sigma = neg.to(torch.uint8) * 8
    # bracket: k- = max{k: m_k <= a}, k+ = min{k: m_k >= a}
    kminus = (a.unsqueeze(-1) >= mags[1:]).sum(-1).to(torch.uint8)
    on_code = mags[kminus.long()] == a
    kplus = torch.where(on_code, kminus, kminus + 1).clamp(max=7)
    mask = 15 if bits == 4 else (1 << bits) - 1
    c = c.to(torch.uint8)
    lo_code, hi_code = sigma | kminus, sigma | kplus
    lo_hit = (lo_code & mask) == c
    hi_hit = (hi_code & mask) == c

    if rule == "bracket":
        # One bit names the rollout's code whenever it is a bracket end (adjacent codes differ in
        # bit 0); only the values where neither or both ends match fall through to the paper rule.
        out = torch.where(lo_hit, lo_code, hi_code)
        undecided = ~(lo_hit ^ hi_hit)
    else:
        out = lo_code.clone()
        undecided = torch.ones_like(lo_hit)
    idx = undecided.nonzero(as_tuple=True)
    if idx[0].numel():
        out[idx] = _paper_codes(z[idx], c[idx], bits, kminus[idx], kplus[idx])
    out = torch.where(on_code, lo_code, out)  # a on a codeword: that codeword
    out = torch.where(a >= E2M1_MAX, sigma | 7, out)  # saturate like RTN
    return torch.where(torch.isnan(z), torch.full_like(out, 7), out)


def _row_global_scale(
    global_scale: float | torch.Tensor, fmt: FP4Format, lead: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """g as float32 broadcastable to [..., nblocks]: a scalar, or one per row (chunks recorded in
    different forwards carry different global scales); 0, negative or non-finite -> 1 (§3)."""
    if fmt.name != "nvfp4":
        return torch.ones((), dtype=torch.float32, device=device)
    g = sane_global_scales(torch.as_tensor(global_scale, dtype=torch.float32, device=device))
    if g.dim() == 0:
        return g
    if tuple(g.shape) != lead:
        raise ShapeError(f"global_scale must be a scalar or one value per row {lead}, got {tuple(g.shape)}")
    return g.unsqueeze(-1)


def _rtn_rows(xb: torch.Tensor, fmt: FP4Format, g: torch.Tensor) -> torch.Tensor:
    """RTN fake-quant of blocked float32 ``xb`` [..., nb, block] with a scalar or per-row g."""
    codes, sf = quantize_blocks(xb, fmt, g if fmt.name == "nvfp4" else None)
    y = e2m1_table(xb.device)[codes.long()] * scale_values(sf, fmt).unsqueeze(-1)
    return y * g.unsqueeze(-1) if fmt.name == "nvfp4" else y


def guided_round(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: float | torch.Tensor = 1.0,
    bits: int = 1,
    fmt: FP4Format | str = NVFP4,
    rule: Rule = "bracket",
    *,
    token_scales: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    fallback_global_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """TRACE rounding of ``x`` [..., D] toward the rollout's recorded codes (docs/numerics.md §7).

    ``packed`` uint8[..., D*bits/8] (from :func:`pack_bits`), ``scales`` uint8[..., D/block] raw
    rollout scale bytes, ``global_scale`` the rollout's decode-side g (NVFP4), optional
    ``token_scales`` float32[...]. Returns ``x``'s dtype; backward is straight-through. A g that
    is 0, negative or not finite is used as 1, as records store it (docs/numerics.md §3).

    Values not backed by a record — rows where ``valid`` is False, blocks whose scale byte is NaN —
    fall back to RTN with the training side's own block scales (docs/numerics.md §8) and decode-side
    global scale ``fallback_global_scale`` (default: the record's ``global_scale``) **[choice]**:
    one pass, no tensor-wide amax, identical on the GPU kernels.

    Example::

        q = quantize(x_rollout, NVFP4); p = pack_bits(q.codes, 1)
        y = guided_round(x_train, p, q.scales, q.global_scale, bits=1)
    """
    fmt = get_format(fmt)
    bits = check_bits(bits)
    if rule not in RULES:
        raise ConfigError(f"rule must be one of {RULES}, got {rule!r}")
    x = check_float_tensor(x)
    check_uint8(packed, "packed")
    check_uint8(scales, "scales")
    width = x.shape[-1]
    nblocks = check_width(width, fmt)
    lead = tuple(x.shape[:-1])
    if tuple(scales.shape) != (*lead, nblocks):
        raise ShapeError(f"scales must have shape {(*lead, nblocks)} for x {tuple(x.shape)}, got {tuple(scales.shape)}")
    if tuple(packed.shape[:-1]) != lead:
        raise ShapeError(f"packed must have leading shape {lead} like x, got {tuple(packed.shape)}")
    c = unpack_bits(packed, bits, width)
    if token_scales is not None and tuple(token_scales.shape) != lead:
        raise ShapeError(f"token_scales must have shape {lead}, got {tuple(token_scales.shape)}")
    if valid is not None and tuple(valid.shape) != lead:
        raise ShapeError(f"valid must have shape {lead} (one flag per row), got {tuple(valid.shape)}")

    with torch.no_grad():
        xf = x.detach().float().reshape(*lead, nblocks, fmt.block)
        sf = scale_values(scales, fmt)
        g = _row_global_scale(global_scale, fmt, lead, x.device)
        s = sf * g
        if token_scales is not None:
            s = s * token_scales.float().unsqueeze(-1)
        s = s.unsqueeze(-1)
        z = xf / s
        codes = guided_codes(z, c.reshape(*lead, nblocks, fmt.block), bits, rule)
        # y = (q·sf)·g[·token scale]: the same evaluation order as dequantize, so that invariant 1
        # (identity) holds bit for bit; q·(sf·g) differs in the last bit for ~22% of |q| ∈
        # {1.5, 3, 6}.
        y = e2m1_table(x.device)[codes.long()] * sf.unsqueeze(-1) * g.unsqueeze(-1)
        if token_scales is not None:
            y = y * token_scales.float().reshape(*lead, 1, 1)
        y = torch.where(s == 0, torch.where(torch.signbit(xf), -0.0, 0.0), y)
        y = torch.where(torch.isnan(xf), xf, y)
        # docs/numerics.md §8: NaN scale bytes and invalid rows fall back to RTN with our own scales.
        fallback = torch.isnan(sf).unsqueeze(-1).expand_as(y)
        if valid is not None:
            fallback = fallback | (~valid.bool()).reshape(*lead, 1, 1)
        if bool(fallback.any()):
            fg = g if fallback_global_scale is None else _row_global_scale(fallback_global_scale, fmt, lead, x.device)
            y = torch.where(fallback, _rtn_rows(xf, fmt, fg), y)
        y = y.reshape(x.shape)
    return _ste(x, y)
