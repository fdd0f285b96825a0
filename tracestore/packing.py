"""Bit packing of FP4 codes (torch reference), docs/numerics.md §1 and §6.

* ``pack_bits``/``unpack_bits``: the record's low ``b`` bits per value, element ``i``'s bits at
  bit offsets ``i*b .. i*b+b-1`` of the row, least significant first (numpy
  ``packbits(bitorder="little")`` of the bit-planes).
* ``pack_fp4``/``unpack_fp4``: the engines' packed FP4, element ``2j`` in the low nibble.
"""

from __future__ import annotations

import torch

from tracestore.errors import ShapeError
from tracestore.formats import check_bits, packed_row_bytes
from tracestore.fp4 import check_uint8


def low_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The recorded value of each code: ``code & (2^b - 1)`` for b ≤ 3, the whole code for b = 4."""
    bits = check_bits(bits)
    check_uint8(codes, "codes")
    return codes & ((1 << bits) - 1)


def pack_bits(codes: torch.Tensor, bits: int = 1) -> torch.Tensor:
    """Pack the low ``bits`` of each code: uint8[..., D] -> uint8[..., ceil(D*bits/8)].

    Example: ``pack_bits(torch.tensor([5, 12, 3, 9, 0, 15, 7, 1], dtype=torch.uint8), 1)`` -> ``[237]``.
    """
    c = low_bits(codes, bits)
    width = c.shape[-1]
    shifts = torch.arange(bits, dtype=torch.uint8, device=c.device)
    stream = ((c.unsqueeze(-1) >> shifts) & 1).reshape(*c.shape[:-1], width * bits)
    nbytes = packed_row_bytes(width, bits)
    pad = nbytes * 8 - width * bits
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    weights = (1 << torch.arange(8, dtype=torch.int32, device=c.device)).to(torch.uint8)
    return (stream.reshape(*c.shape[:-1], nbytes, 8) * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int = 1, width: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8[..., ceil(width*bits/8)] -> uint8[..., width]."""
    bits = check_bits(bits)
    check_uint8(packed, "packed")
    nbytes = packed.shape[-1]
    if width is None:
        if (nbytes * 8) % bits:
            raise ShapeError(f"cannot infer width from {nbytes} bytes at bits={bits}; pass width=")
        width = nbytes * 8 // bits
    if packed_row_bytes(width, bits) != nbytes:
        raise ShapeError(
            f"packed rows must be ceil({width}*{bits}/8) = {packed_row_bytes(width, bits)} bytes "
            f"for width {width} at bits={bits}, got {nbytes}"
        )
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(*packed.shape[:-1], nbytes * 8)
    planes = stream[..., : width * bits].reshape(*packed.shape[:-1], width, bits)
    weights = (1 << torch.arange(bits, dtype=torch.int32, device=packed.device)).to(torch.uint8)
    return (planes * weights).sum(-1, dtype=torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte as engines store FP4: uint8[..., D] -> uint8[..., D/2], element 2j low."""
    check_uint8(codes, "codes")
    if codes.shape[-1] % 2:
        raise ShapeError(f"packed FP4 needs an even width, got {codes.shape[-1]}")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: uint8[..., D/2] -> uint8[..., D]."""
    check_uint8(packed, "packed")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
