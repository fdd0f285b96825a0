"""One site's rows of one forward as the engine hands them to ``RolloutRecorder.record_forward``
(:class:`SiteOutput`) and their checks: shapes and dtypes named by site, and a per-row global
scale moved into the token scales."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from tracestore.errors import ConfigError, DTypeError, ShapeError


@dataclasses.dataclass
class SiteOutput:
    """One site's rows of one forward: ``codes`` uint8 [rows, code_bytes], ``scales`` uint8
    [rows, scale_bytes] (torch tensors on any device, or numpy), ``global_scale`` the decode-side
    g: a float or a one-element tensor, or a float32 tensor of one g per row (per-token NVFP4
    activation scales; stored as the rows' token scales with the chunk's g 1.0, which dequantizes
    to the same values bit for bit, docs/numerics.md §6-§7), ``token_scales`` float32 [rows] or
    None (not together with a per-row g)."""

    codes: Any
    scales: Any
    global_scale: Any = 1.0
    token_scales: Any = None


def per_row_g(out: SiteOutput, name: str, rows: int) -> SiteOutput:
    """``out`` with a per-row global scale moved into the token scales (chunk g 1.0); one value
    passes unchanged. A g of another length, or one per row beside token scales, is refused."""
    g = out.global_scale
    n = getattr(g, "numel", None)
    n = n() if callable(n) else getattr(g, "size", 1)
    if n == 1:
        return out
    if n != rows:
        raise ShapeError(
            f"{name}.global_scale has {n} values: give the forward's one decode-side g, or one per row ({rows})"
        )
    if out.token_scales is not None:
        raise ConfigError(
            f"{name}: a per-row global_scale and token_scales together cannot be stored exactly (the record keeps "
            "one per-row scale); fold them into one per-row scale"
        )
    if not _dtype_is_cached(getattr(g, "dtype", None), "float32"):
        raise DTypeError(f"{name}.global_scale per row must be float32, got {getattr(g, 'dtype', type(g).__name__)}")
    return SiteOutput(out.codes, out.scales, 1.0, _sane_per_row(g.reshape(-1)))


def _sane_per_row(g: Any) -> Any:
    """Per-row g with the §3 rule applied elementwise (0, negative or not finite: 1), on the
    tensor's own device: they become the rows' token scales, which nothing else checks."""
    if hasattr(g, "detach"):  # a torch tensor (torch is loaded already)
        from tracestore.fp4 import sane_global_scales

        return sane_global_scales(g)
    a = np.asarray(g, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        return np.where((a > 0) & (a <= np.finfo(np.float32).max), a, np.float32(1.0))


def _dtype_is(dt: Any, want: str) -> bool:
    return str(dt if dt is not None else "").endswith(want)


# str() of a numpy dtype is Python code (~2.5 us; 40 calls per decode step of 20 sites): decided
# once per dtype object (numpy and torch dtypes are hashable singletons)
_dtype_is_cached = functools.lru_cache(maxsize=256)(_dtype_is)


def check_array(x: Any, shape: tuple[int, ...], name: str, dtype: str = "uint8") -> None:
    got = tuple(getattr(x, "shape", ()))
    if got != shape:
        raise ShapeError(f"{name} must have shape {list(shape)}, got {list(got)}")
    dt = getattr(x, "dtype", None)
    try:
        ok = _dtype_is_cached(dt, dtype)
    except TypeError:  # an unhashable dtype-like attribute: decided every time
        ok = _dtype_is(dt, dtype)
    if not ok:
        raise DTypeError(f"{name} must have dtype {dtype}, got {dt if dt is not None else ''}")
