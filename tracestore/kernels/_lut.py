"""The guided-rounding decision table, generated from the torch reference (docs/numerics.md §7).

For ``a = |z| < 6`` every quantity §7 compares — codewords m_k, candidate midpoints, RTN
boundaries (the paper rule's give-up) — is a multiple of 0.25, so the chosen magnitude is
constant on each point ``j/4`` and each open interval ``(j/4, (j+1)/4)``. ``region(a)`` =
``2*floor(4a) + (4a not an integer)``, clamped at 48 (``a >= 6``: saturate). Indexed by the
recorded bits ``c`` (b = 4: ``c`` with its sign bit taken relative to z's sign, which makes the
table sign-symmetric) the table holds the output magnitude ``m``; the output is ``±m`` with z's
sign. ``lut_codes`` applies the table in torch, exactly as the CUDA kernel does, so CI checks the
table against ``guided_codes`` on the CPU.
"""

from __future__ import annotations

import functools

import torch

from tracestore.formats import E2M1_MAGNITUDES, check_bits
from tracestore.guided import guided_codes

REGIONS = 49


def n_codes(bits: int) -> int:
    return 16 if bits == 4 else 1 << bits


@functools.cache
def decision_table(bits: int, rule: str) -> tuple[tuple[int, ...], ...]:
    """``table[c][region]``: output magnitude code k (0..7) for a positive z, per the reference."""
    bits = check_bits(bits)
    reps = [(r // 2) * 0.25 + (0.125 if r % 2 else 0.0) for r in range(REGIONS)]
    z = torch.tensor(reps, dtype=torch.float32)
    rows = []
    for c in range(n_codes(bits)):
        codes = guided_codes(z, torch.full_like(z, c, dtype=torch.uint8), bits, rule)  # type: ignore[arg-type]
        if bool((codes & 8).any()):  # pragma: no cover - the reference keeps z's sign
            raise AssertionError("guided_codes returned a negative code for a positive z")
        rows.append(tuple(int(k) for k in codes))
    return tuple(rows)


def lut_tensor(bits: int, rule: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32[n_codes * 49]: the magnitude (not code) per (c, region), as the kernel reads."""
    mags = E2M1_MAGNITUDES
    flat = [mags[k] for row in decision_table(bits, rule) for k in row]
    return torch.tensor(flat, dtype=torch.float32, device=device)


def region(z: torch.Tensor) -> torch.Tensor:
    """Region index of float32 z, as the kernel computes it (NaN -> 48)."""
    q = torch.clamp(z.abs() * 4.0, max=24.0)
    q = torch.where(torch.isnan(q), torch.full_like(q, 24.0), q)
    j = q.to(torch.int64)
    return 2 * j + (q != j.to(torch.float32)).to(torch.int64)


def lut_codes(z: torch.Tensor, c: torch.Tensor, bits: int, rule: str) -> torch.Tensor:
    """E2M1 codes chosen by the table (the kernel's algorithm, in torch): NaN z -> code 7."""
    table = torch.tensor(decision_table(bits, rule), dtype=torch.uint8, device=z.device)
    nan = torch.isnan(z)
    sig = torch.signbit(z) & ~nan
    c = c.to(torch.int64)
    ci = c ^ (sig.to(torch.int64) << 3) if bits == 4 else c
    k = table[ci, region(z)]
    return k | (sig.to(torch.uint8) << 3)
