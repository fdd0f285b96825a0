"""Training-side TRACE rounding and RTN fake-quant as PyTorch custom ops (docs/integration.md, "Applying guidance").

``tracestore::guided_fp4`` and ``tracestore::rtn_fp4`` are ``torch.library`` custom ops with a
CPU kernel (the torch reference in ``tracestore.guided``), a CUDA kernel (``_source_guided.py``'s
``guided_fwd``, bit-exact to the reference), a fake implementation (so ``torch.compile`` traces
them without graph breaks) and a straight-through autograd formula (:func:`_ste_backward`).

Example::

    y = guided_fp4(x, guidance)                   # x [N, D]; guidance rows aligned to x's rows
    y = guided_fp4(x, guidance, rows=perm)        # x's row i uses guidance row perm[i] (expert dispatch)
    y = rtn_fp4(x, NVFP4, global_scale=None)      # sites without records
"""

from __future__ import annotations

from typing import Any

if __name__ != "tracestore.kernels.guided":  # see kernels/__init__.py: never define the ops twice
    raise ImportError(f"{__file__} is tracestore.kernels.guided; import it under that name, not {__name__!r}")

import torch

from tracestore.errors import ConfigError, DTypeError, ShapeError
from tracestore.formats import FP4Format, get_format, packed_row_bytes
from tracestore.fp4 import resolve_global_scale, sane_global_scales
from tracestore.guidance import Guidance
from tracestore.guided import guided_round, rtn_fake_quant
from tracestore.settings import GUIDED_TABLE, read_env

from . import _launch as L
from ._common import DTYPE_CODE, check_aligned, check_float, fmt_code, fmt_name
from ._lut import lut_tensor
from ._params import GuidedB1, GuidedFwd, GuidedRows, RowDiv
from .record import blocks_per_thread

# b = 1 with rule "bracket" (the paper's configuration) runs ``guided_b1``: Newton quotient and a
# two-add decision, no table. The general table kernel can be forced for it
# (TRACESTORE_GUIDED_TABLE=1; the tests run both paths, the bench compares them).
_TABLE_B1: bool = read_env(GUIDED_TABLE)
# scale blocks per thread in guided_b1 (1, 2 or 4; bench_kernels compares them)
BLOCKS_PER_THREAD = 2  # H200 bf16 65536x2048: 0.152 ms, against 0.167 with 1 and 0.269 with 4
_luts: dict[tuple[int, str, torch.device], torch.Tensor] = {}


def _lut(bits: int, rule: str, device: torch.device) -> torch.Tensor:
    key = (bits, rule, device)
    t = _luts.get(key)
    if t is None:
        t = _luts[key] = lut_tensor(bits, rule, device)
    return t


def _aligned(t: torch.Tensor, align: int) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % align == 0 else t.clone()


# ---------------------------------------------------------------------------------------- guided_fp4


@torch.library.custom_op("tracestore::guided_fp4", mutates_args=())
def _guided_fp4_op(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    token_scales: torch.Tensor | None,
    valid: torch.Tensor | None,
    rows: torch.Tensor | None,
    mask: torch.Tensor | None,
    bits: int,
    fmt: str,
    rule: str,
) -> torch.Tensor:
    """CPU kernel: the torch reference on gathered rows, fallback g = the record's (sanitized) g."""
    f = get_format(fmt)
    if rows is not None:
        codes, scales = codes[rows], scales[rows]
        global_scale = global_scale[rows] if global_scale.dim() else global_scale
        token_scales = None if token_scales is None else token_scales[rows]
        valid = None if valid is None else valid[rows]
    ok = valid
    if mask is not None:
        ok = mask if ok is None else ok & mask
    g = global_scale
    return guided_round(
        x,
        codes,
        scales,
        g,
        bits,
        f,
        rule,  # type: ignore[arg-type]
        token_scales=token_scales,
        valid=ok,
        fallback_global_scale=sane_global_scales(g) if f.has_global_scale else None,
    ).clone()


@_guided_fp4_op.register_kernel("cuda")
def _guided_fp4_cuda(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    token_scales: torch.Tensor | None,
    valid: torch.Tensor | None,
    rows: torch.Tensor | None,
    mask: torch.Tensor | None,
    bits: int,
    fmt: str,
    rule: str,
) -> torch.Tensor:
    f = get_format(fmt)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    check_aligned(x2, "x", 16)
    n, width = x2.shape
    nb = width // f.block
    y = torch.empty_like(x2)
    g = (global_scale.reshape(-1) if global_scale.dim() else global_scale.reshape(1)).contiguous()
    # record rows are read as 2-byte (NVFP4) / 4-byte (MX) words: make them contiguous and aligned
    codes, scales = _aligned(codes, 4), scales.contiguous()
    token_scales = None if token_scales is None else token_scales.contiguous()
    dt = DTYPE_CODE[x.dtype]
    records = GuidedRows(
        codes=codes,
        c_stride=codes.stride(0),
        scales=scales,
        s_stride=scales.stride(0),
        g=g,
        g_per_row=int(global_scale.dim() > 0),
        ts=token_scales,
        valid=valid,
        rows=rows,
        mask=mask,
    )
    x_stride, y_stride = x2.stride(0) * x2.element_size(), y.stride(0) * y.element_size()
    if bits == 1 and rule == "bracket" and not _TABLE_B1:
        # MX blocks are 32 values: two per thread take 128 registers (0.274 vs 0.231 ms for one)
        group = blocks_per_thread(nb, BLOCKS_PER_THREAD if f.block == 16 else 1)
        name = f"guided_b1<{dt},{fmt_code(f)},{int(token_scales is not None)},{group}>"
        div = RowDiv.of(nb // group)
        args_b1 = GuidedB1(x=x2, x_stride=x_stride, n_rows=n, div=div, records=records, y=y, y_stride=y_stride)
        L.launch(name, x.device, n * div.ng, args_b1)
    else:  # one thread per scale block
        lut = _lut(bits, rule, x.device)
        args = GuidedFwd(x=x2, x_stride=x_stride, n_rows=n, nb=nb, records=records, lut=lut, y=y, y_stride=y_stride)
        L.launch(f"guided_fwd<{dt},{fmt_code(f)},{bits},0>", x.device, n * nb, args)
    return y.view(x.shape)


@_guided_fp4_op.register_fake
def _guided_fp4_fake(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    token_scales: torch.Tensor | None,
    valid: torch.Tensor | None,
    rows: torch.Tensor | None,
    mask: torch.Tensor | None,
    bits: int,
    fmt: str,
    rule: str,
) -> torch.Tensor:
    return torch.empty_like(x)


def _ste_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    """Straight-through estimator: dL/dx = dL/dy; records and scales get no gradient."""
    return (grad,) + (None,) * ctx.n_other


def _setup_guided(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.n_other = len(inputs) - 1


_guided_fp4_op.register_autograd(_ste_backward, setup_context=_setup_guided)


def _check_index(t: torch.Tensor | None, name: str, n: int, dtype: torch.dtype, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise DTypeError(f"{name} must be a {dtype} tensor, got {got}")
    if tuple(t.shape) != (n,):
        raise ShapeError(f"{name} must have shape [{n}] (one per row of x), got {list(t.shape)}")
    if t.device != device:
        raise ConfigError(f"{name} is on {t.device}, x on {device}")


def guided_fp4(
    x: torch.Tensor,
    guidance: Guidance,
    rows: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    fallback_global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """TRACE rounding of ``x`` [..., width] toward the rollout's records (docs/numerics.md §7, §8).

    ``guidance`` holds M record rows; x's row i uses guidance row ``rows[i]`` (int64[N], e.g. the
    token permutation of an expert dispatch) or row i when ``rows`` is None (then M == N). ``mask``
    bool[N]: False rows (and ``guidance.valid`` False rows, and blocks whose scale byte is NaN) fall
    back to RTN with the training side's own block scales and the record's g. Every g (the record's
    and the fallback's) that is 0, negative or not finite is used as 1 (docs/numerics.md §3). Output
    has x's dtype and shape; backward is straight-through. ``fallback_global_scale`` (float32, one
    element or one per guidance row, on x's device): the g that rows without a record
    (``guidance.valid`` False) quantize with instead of the record's (the reader gives such
    rows 1.0), e.g. the trainer's own RTN scale; rows with a record keep theirs.
    """
    if not isinstance(guidance, Guidance):
        raise ConfigError(f"guidance must be a tracestore.guidance.Guidance, got {type(guidance).__name__}")
    x = check_float(x)
    width = guidance.width
    if x.dim() == 0 or x.shape[-1] != width:
        raise ShapeError(f"x must have shape [..., {width}] to match the guidance rows, got {list(x.shape)}")
    n = x.numel() // width if width else 0
    m = guidance.n_rows
    dev = x.device
    _check_index(rows, "rows", n, torch.int64, dev)
    _check_index(mask, "mask", n, torch.bool, dev)
    if rows is None and m != n:
        raise ShapeError(f"x has {n} rows but guidance has {m}; pass rows= to gather guidance rows per x row")
    for name, t in (
        ("codes", guidance.codes),
        ("scales", guidance.scales),
        ("valid", guidance.valid),
        ("token_scales", guidance.token_scales),
    ):
        if t is not None and t.device != dev:
            raise ConfigError(f"guidance.{name} is on {t.device} but x is on {dev}; use guidance.to(x.device)")
    g = guidance.global_scale
    gt = g if isinstance(g, torch.Tensor) else torch.full((), float(g), dtype=torch.float32, device=dev)
    if gt.device != dev:
        raise ConfigError(f"guidance.global_scale is on {gt.device} but x is on {dev}")
    if fallback_global_scale is not None and guidance.valid is not None:
        fb = fallback_global_scale
        if not isinstance(fb, torch.Tensor) or fb.dtype != torch.float32 or fb.numel() not in (1, m):
            raise ShapeError(f"fallback_global_scale must be a float32 tensor of 1 or {m} elements")
        if fb.device != dev:
            raise ConfigError(f"fallback_global_scale is on {fb.device} but x is on {dev}")
        gt = torch.where(guidance.valid, gt, fb.reshape(-1) if fb.numel() > 1 else fb.reshape(()))
    return _guided_fp4_op(
        x,
        guidance.codes,
        guidance.scales,
        gt,
        guidance.token_scales,
        guidance.valid,
        rows,
        mask,
        guidance.bits,
        fmt_name(guidance.fmt),
        guidance.rule,
    )


# ---------------------------------------------------------------------------------------- rtn_fp4


@torch.library.custom_op("tracestore::rtn_fp4", mutates_args=())
def _rtn_fp4_op(x: torch.Tensor, global_scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """CPU kernel: the torch reference ``rtn_fake_quant``."""
    f = get_format(fmt)
    return rtn_fake_quant(x, f, global_scale if f.has_global_scale else None).clone()


@_rtn_fp4_op.register_kernel("cuda")
def _rtn_fp4_cuda(x: torch.Tensor, global_scale: torch.Tensor, fmt: str) -> torch.Tensor:
    f = get_format(fmt)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    check_aligned(x2, "x", 16)
    n, width = x2.shape
    nb = width // f.block
    y = torch.empty_like(x2)
    dt = DTYPE_CODE[x.dtype]
    L.launch(
        f"guided_fwd<{dt},{fmt_code(f)},1,1>",
        x.device,
        n * nb,
        GuidedFwd(
            x=x2,
            x_stride=x2.stride(0) * x2.element_size(),
            n_rows=n,
            nb=nb,
            records=GuidedRows(
                codes=None,
                c_stride=0,
                scales=None,
                s_stride=0,
                g=global_scale,
                g_per_row=0,
                ts=None,
                valid=None,
                rows=None,
                mask=None,
            ),
            lut=None,
            y=y,
            y_stride=y.stride(0) * y.element_size(),
        ),
    )
    return y.view(x.shape)


@_rtn_fp4_op.register_fake
def _rtn_fp4_fake(x: torch.Tensor, global_scale: torch.Tensor, fmt: str) -> torch.Tensor:
    return torch.empty_like(x)


_rtn_fp4_op.register_autograd(_ste_backward, setup_context=_setup_guided)


def rtn_fp4(
    x: torch.Tensor, fmt: FP4Format | str = "nvfp4", global_scale: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Plain FP4 fake quantization (docs/numerics.md §2–§4) in x's dtype; backward straight-through.

    ``global_scale`` (NVFP4, decode-side): a float, a one-element float32 tensor, or None =
    amax(|x|)/2688 of this tensor. Example: ``y = rtn_fp4(x, "mxfp4")``.
    """
    f = get_format(fmt)
    x = check_float(x)
    if x.dim() == 0 or x.shape[-1] % f.block:
        raise ShapeError(
            f"x's last dimension must be a positive multiple of the {f} block {f.block}, got {list(x.shape)}"
        )
    if not f.has_global_scale:
        if global_scale is not None:
            raise ConfigError(f"{f} has no global scale; pass global_scale=None")
        g = torch.ones((), dtype=torch.float32, device=x.device)
    elif global_scale is None:
        g = resolve_global_scale(x.detach(), None)
    elif isinstance(global_scale, torch.Tensor):
        if global_scale.numel() != 1:
            raise ShapeError(f"global_scale must have one element, got {list(global_scale.shape)}")
        g = global_scale.detach().to(device=x.device, dtype=torch.float32).reshape(())
    else:
        # a device fill, not a host-to-device copy: capturable in a CUDA graph (0 / non-finite -> 1
        # is applied by the kernels and the reference alike)
        g = torch.full((), float(global_scale), dtype=torch.float32, device=x.device)
    return _rtn_fp4_op(x, g, fmt_name(f))


def check_guidance_rows(guidance: Guidance, width: int) -> None:
    """Raise unless ``guidance`` rows are ``width`` values wide (helper for integrations)."""
    if guidance.width != width or guidance.codes.shape[1] != packed_row_bytes(width, guidance.bits):
        raise ShapeError(f"guidance rows are {guidance.width} wide, expected {width}")
