"""Block-scale layouts (docs/numerics.md §5): row-major ⇄ CUTLASS's swizzled 128×4 tiles.

Logical ``S[r, c]`` of an ``R × C`` scale matrix lives at byte
``((r//128)·(C'/4) + c//4)·512 + (r%32)·16 + ((r%128)//32)·4 + c%4`` of the swizzled buffer, rows
padded to ``R'`` (multiple of 128) and columns to ``C'`` (multiple of 4). Works on torch tensors
and numpy arrays alike (only reshape/transpose/indexing are used).
"""

from __future__ import annotations

from typing import Any

from tracestore.errors import ShapeError

TILE_ROWS = 128
TILE_COLS = 4


def padded_shape(rows: int, cols: int) -> tuple[int, int]:
    """(R', C'): rows rounded up to 128, columns to 4."""
    return (-(-rows // TILE_ROWS) * TILE_ROWS, -(-cols // TILE_COLS) * TILE_COLS)


def swizzled_offset(r: int, c: int, cols: int) -> int:
    """Byte offset of logical (r, c) in a swizzled buffer of a matrix with ``cols`` columns."""
    cp = padded_shape(1, cols)[1]
    return ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def _permute(a: Any, axes: tuple[int, ...]) -> Any:
    return a.permute(*axes) if hasattr(a, "permute") else a.transpose(axes)


def unswizzle_scales(buf: Any, rows: int, cols: int) -> Any:
    """Swizzled 128×4 buffer (flat or any shape, R'·C' bytes) -> row-major ``[rows, cols]``."""
    rp, cp = padded_shape(rows, cols)
    n = int(buf.numel()) if hasattr(buf, "numel") else int(buf.size)
    if n != rp * cp:
        raise ShapeError(
            f"a swizzled scale buffer for {rows}×{cols} scales holds {rp}×{cp} = {rp * cp} bytes "
            f"(rows padded to 128, columns to 4), got {n}"
        )
    tiles = buf.reshape(rp // 128, cp // 4, 32, 4, 4)
    return _permute(tiles, (0, 3, 2, 1, 4)).reshape(rp, cp)[:rows, :cols]


def swizzle_scales(scales: Any, fill: int = 0) -> Any:
    """Row-major ``[rows, cols]`` -> flat swizzled buffer of R'·C' bytes (padding = ``fill``)."""
    if scales.ndim != 2:
        raise ShapeError(f"scales must be 2-D [rows, cols], got shape {tuple(scales.shape)}")
    rows, cols = scales.shape
    rp, cp = padded_shape(rows, cols)
    if hasattr(scales, "new_full"):
        padded = scales.new_full((rp, cp), fill)
    else:
        import numpy as np

        padded = np.full((rp, cp), fill, dtype=scales.dtype)
    padded[:rows, :cols] = scales
    tiles = padded.reshape(rp // 128, 4, 32, cp // 4, 4)
    out = _permute(tiles, (0, 3, 2, 1, 4)).reshape(-1)
    return out.contiguous() if hasattr(out, "contiguous") else out.copy()
