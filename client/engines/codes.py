"""Engine NVFP4 codes and block scales -> the store's record rows, bit for bit (docs/numerics.md §5, §6).

Engines hand their GEMMs packed FP4 codes (``uint8 [T, H/2]``, element ``2j`` in the low nibble)
and E4M3 block scales (``float8_e4m3fn`` or ``uint8``) in one of three layouts:

- ``"linear"``: row-major ``[T, H/16]`` (FlashInfer's fused-MoE entry, ``SfLayout.layout_linear``);
- ``"swizzled128x4"``: CUTLASS's 128×4 tiles, rows padded to 128 and columns to 4
  (:func:`tracestore.layouts.unswizzle_scales`);
- ``"8x4"``: 8-row × 4-column tiles, row-major inside a tile and tiles row-major, rows padded to
  8 and columns to 4: logical ``S[r, c]`` at byte ``((r//8)·(C'/4) + c//4)·32 + (r%8)·4 + c%4``
  (TensorRT-LLM's ``SWIZZLED_8x4``, which vLLM's trtllm FP4 GEMM backend uses for m ≤ 32).

:func:`record_rows` turns one site's codes and scales into the rows a
:class:`tracestore.client.SiteOutput` carries: packed low ``bits`` of every code, row-major scale
bytes and the decode-side global scale. Every step is a torch tensor op on the tensors' own device
(no host synchronisation); nothing is allocated beyond the outputs.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from tracestore.errors import DTypeError, ShapeError, ValidationError
from tracestore.formats import check_bits
from tracestore.layouts import unswizzle_scales
from tracestore.packing import pack_bits, unpack_fp4

ScaleLayout = Literal["linear", "swizzled128x4", "8x4"]
LAYOUTS: tuple[str, ...] = ("linear", "swizzled128x4", "8x4")
BLOCK = 16  # NVFP4: 16 values per E4M3 scale


def _pad(n: int, m: int) -> int:
    return -(-n // m) * m


def scale_bytes(sf: torch.Tensor) -> torch.Tensor:
    """E4M3 scales as raw bytes: ``float8_e4m3fn`` is reinterpreted, ``uint8`` passed through."""
    if sf.dtype == torch.uint8:
        return sf
    if sf.dtype == torch.float8_e4m3fn:
        return sf.view(torch.uint8)
    raise DTypeError(f"block scales must be float8_e4m3fn or uint8 (raw E4M3 bytes), got {sf.dtype}")


# The 8x4 offset is FlashInfer's get_sf_out_offset_8x4(mIdx, kIdx, numCols)
# (flashinfer-ai/flashinfer, csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh; checked
# at fb28d72): mTileIdx· (ceil(numCols/4)·32) + kTileIdx·32 + (m%8)·4 + k%4, numCols the scale
# columns (num_vecs_per_row in nvfp4QuantAndPerTokenScaleKernel and cvt_quant_get_sf_out_offset,
# which call it).
def unswizzle_8x4(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """8×4-tiled buffer (flat or any shape, R'·C' bytes; R' = rows padded to 8, C' = cols to 4)
    -> row-major ``[rows, cols]`` (a view where the buffer allows it)."""
    rp, cp = _pad(rows, 8), _pad(cols, 4)
    if buf.numel() != rp * cp:
        raise ShapeError(
            f"an 8x4 scale buffer for {rows}×{cols} scales holds {rp}×{cp} = {rp * cp} bytes "
            f"(rows padded to 8, columns to 4), got {buf.numel()}"
        )
    tiles = buf.reshape(rp // 8, cp // 4, 8, 4)
    return tiles.permute(0, 2, 1, 3).reshape(rp, cp)[:rows, :cols]


def swizzle_8x4(scales: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """Row-major ``[rows, cols]`` -> flat 8×4-tiled buffer (padding = ``fill``); the inverse of
    :func:`unswizzle_8x4`, for tests and fakes."""
    if scales.ndim != 2:
        raise ShapeError(f"scales must be 2-D [rows, cols], got shape {tuple(scales.shape)}")
    rows, cols = scales.shape
    rp, cp = _pad(rows, 8), _pad(cols, 4)
    padded = scales.new_full((rp, cp), fill)
    padded[:rows, :cols] = scales
    return padded.reshape(rp // 8, 8, cp // 4, 4).permute(0, 2, 1, 3).reshape(-1).contiguous()


def scales_to_rowmajor(sf: torch.Tensor, rows: int, cols: int, layout: str) -> torch.Tensor:
    """Block scales in ``layout`` (one of :data:`LAYOUTS`) -> ``uint8 [rows, cols]`` row-major bytes."""
    raw = scale_bytes(sf)
    if layout == "linear":
        if raw.numel() != rows * cols:
            raise ShapeError(f"linear block scales for {rows}×{cols} hold {rows * cols} bytes, got {raw.numel()}")
        return raw.reshape(rows, cols)
    if layout == "swizzled128x4":
        out: Any = unswizzle_scales(raw.reshape(-1), rows, cols)
        return out  # type: ignore[no-any-return]
    if layout == "8x4":
        return unswizzle_8x4(raw.reshape(-1), rows, cols)
    raise ValidationError(f"scale layout must be one of {LAYOUTS}, got {layout!r}")


def record_rows(
    packed: torch.Tensor,
    sf: torch.Tensor,
    *,
    layout: str = "linear",
    bits: int = 1,
    global_scale: torch.Tensor | float | None = None,
    token_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One site's engine codes -> ``(codes, scales, g)`` record rows.

    ``packed``: ``uint8 [T, H/2]`` FP4 codes as the GEMM eats them. ``sf``: their E4M3 block scales
    in ``layout``. ``global_scale``: the **decode-side** ``g`` (engines keep the encode-side
    ``1/g``: convert first), a float or a one-element tensor; ``token_scale``: one float32 decode
    scale per token (per-token NVFP4 activations), which replaces ``global_scale`` and becomes the
    rows' ``g``. Returns ``codes uint8 [T, H·bits/8]`` (low ``bits`` of each code, packed),
    ``scales uint8 [T, H/16]`` and ``g float32`` (``[1]``, or ``[T]`` with ``token_scale``), all on
    ``packed``'s device.

    >>> codes, scales, g = record_rows(packed, sf, layout="swizzled128x4", bits=1, global_scale=g_dec)
    """
    bits = check_bits(bits)
    if packed.dtype != torch.uint8:
        raise DTypeError(f"packed FP4 codes must be uint8 (two codes a byte), got {packed.dtype}")
    if packed.ndim != 2:
        raise ShapeError(f"packed FP4 codes must be 2-D [tokens, hidden/2], got shape {tuple(packed.shape)}")
    rows, half = packed.shape
    width = half * 2
    if width % BLOCK:
        raise ShapeError(f"hidden size {width} is not a multiple of the NVFP4 block {BLOCK}")
    scales = scales_to_rowmajor(sf, rows, width // BLOCK, layout)
    codes = pack_bits(unpack_fp4(packed), bits)
    if token_scale is not None:
        if global_scale is not None:
            raise ValidationError("give either global_scale or token_scale, not both")
        if token_scale.dtype != torch.float32:
            raise DTypeError(f"token_scale must be float32, got {token_scale.dtype}")
        if token_scale.numel() != rows:
            raise ShapeError(f"token_scale holds {token_scale.numel()} values for {rows} tokens (one per token)")
        return codes, scales.contiguous(), token_scale.reshape(rows)
    if global_scale is None:
        raise ValidationError("a decode-side global_scale (or a per-token token_scale) is needed")
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device).reshape(-1)
    if g.numel() != 1:
        raise ShapeError(f"global_scale must hold one value, got {g.numel()}")
    return codes, scales.contiguous(), g


def codes_from_values(values: torch.Tensor, check: bool = True) -> torch.Tensor:
    """FP4 values as floats (±0, ±0.5, … ±6, as vLLM's pure-torch reference returns them) -> E2M1
    codes ``uint8`` 0..15; the sign bit of the float (-0.0 included) is bit 3. Any other value
    raises, unless ``check=False`` (no host read: inside a captured graph), which maps it to the
    E2M1 magnitude at or above it (6 past 6)."""
    mag = values.abs().to(torch.float32)
    if not check:  # elementwise only (no table tensor: that would be a host-to-device copy)
        m2 = mag * 2  # 0, 1, 2, 3, 4, 6, 8, 12 -> codes 0..7
        k = torch.where(m2 < 4, m2.ceil(), torch.where(m2 < 8, 4 + (m2 > 4).float(), 6 + (m2 > 8).float()))
        k = k.clamp(max=7)
    else:
        table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=values.device)
        k = torch.searchsorted(table, mag.contiguous())
        if not bool(((k < 8) & (table[k.clamp(max=7)] == mag)).all()):
            raise ValidationError("values are not E2M1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6 with a sign)")
    return (k.to(torch.uint8) | (torch.signbit(values).to(torch.uint8) << 3)).to(torch.uint8)
