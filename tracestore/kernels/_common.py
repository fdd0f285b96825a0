"""Argument checks and small helpers shared by the kernel launchers."""

from __future__ import annotations

from typing import Any

import torch

from tracestore.errors import ConfigError, DTypeError, ShapeError
from tracestore.formats import FP4Format, check_bits, get_format

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def fmt_code(fmt: FP4Format) -> int:
    """Kernel template code: 0 NVFP4, 1 MXFP4 floor, 2 MXFP4 rceil."""
    if fmt.name == "nvfp4":
        return 0
    return 2 if fmt.scale_rule == "rceil" else 1


def fmt_name(fmt: FP4Format) -> str:
    """The canonical string of a format (custom ops take strings): nvfp4 | mxfp4 | mxfp4-rceil."""
    if fmt.name == "nvfp4":
        return "nvfp4"
    return "mxfp4-rceil" if fmt.scale_rule == "rceil" else "mxfp4"


def site_params(site: Any) -> tuple[int, FP4Format, int]:
    """(width, fmt, bits) of a ``SiteSpec``, or of anything with ``width``, ``bits`` and ``fmt``."""
    try:
        width = int(site.width)
        bits = check_bits(site.bits)
        fmt = get_format(site.fmt if hasattr(site, "fmt") else site.format)
    except AttributeError as exc:
        raise ConfigError(
            f"site must be a tracestore.records.SiteSpec (width, bits, format), got {type(site).__name__}"
        ) from exc
    if width <= 0 or width % fmt.block:
        raise ShapeError(f"site width {width} must be a positive multiple of the {fmt} block {fmt.block}")
    return width, fmt, bits


def check_rows_2d(x: torch.Tensor, name: str, width: int) -> torch.Tensor:
    """``x`` as 2-D [rows, width] without copying (leading dims flattened); rows unit-strided."""
    if x.dim() == 0 or x.shape[-1] != width:
        raise ShapeError(f"{name} must have shape [..., {width}], got {list(x.shape)}")
    if x.dim() != 2:
        if not x.is_contiguous():
            raise ShapeError(f"{name} with more than 2 dims must be contiguous to flatten without a copy")
        x = x.view(-1, width)
    if width and x.stride(1) != 1:
        raise ShapeError(f"{name} rows must be contiguous (stride 1 along the last dim), got strides {x.stride()}")
    return x


def check_aligned(t: torch.Tensor, name: str, align: int) -> None:
    """Vector loads need aligned rows: base and row stride (bytes) multiples of ``align``."""
    row_bytes = t.stride(0) * t.element_size() if t.dim() >= 1 else 0
    if t.data_ptr() % align or row_bytes % align:
        raise ShapeError(
            f"{name} must start on a {align}-byte boundary with a row stride that is a multiple of {align} "
            f"bytes for the GPU kernel (got address %{align} = {t.data_ptr() % align}, row stride {row_bytes} B); "
            "pass a freshly allocated or .contiguous() tensor"
        )


def check_uint8(t: Any, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise DTypeError(f"{name} must be a torch.uint8 tensor, got {got}")
    return t


def check_float(x: Any, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPE_CODE:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise DTypeError(f"{name} must be a float32, bfloat16 or float16 tensor, got {got}")
    return x


def same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ConfigError(f"{name} is on {t.device} but the kernel runs on {device}; move it there first")


def use_gpu(device: torch.device) -> bool:
    return device.type == "cuda"
