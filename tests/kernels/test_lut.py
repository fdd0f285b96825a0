"""The kernel's decision table (kernels/_lut.py) against the reference guided_codes, on the CPU."""

import pytest
import torch

from tracestore.guided import guided_codes
from tracestore.kernels._lut import REGIONS, decision_table, lut_codes, n_codes


def _z_values(gen: torch.Generator) -> torch.Tensor:
    grid = torch.arange(0, 30, dtype=torch.float32) * 0.25
    up = torch.nextafter(grid, torch.full_like(grid, 100.0))
    down = torch.nextafter(grid, torch.full_like(grid, -100.0))
    special = torch.tensor([float("nan"), float("inf"), 0.0, 1e-45, 1e-38, 5.999999, 6.0, 1e30])
    pts = torch.cat([grid, up, down, special])
    rnd = torch.randn(60_000, generator=gen) * 3
    uni = torch.rand(60_000, generator=gen) * 7
    return torch.cat([pts, -pts, rnd, uni, -uni])


@pytest.mark.parametrize("rule", ["bracket", "paper"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_table_matches_reference(bits, rule, gen):
    z = _z_values(gen)
    c = torch.randint(0, n_codes(bits), z.shape, generator=gen, dtype=torch.uint8)
    ref = guided_codes(z, c, bits, rule)
    got = lut_codes(z, c, bits, rule)
    bad = (ref != got).nonzero()
    assert bad.numel() == 0, (
        f"first mismatch z={z[bad[0]].item()!r} c={c[bad[0]].item()}: {ref[bad[0]]} vs {got[bad[0]]}"
    )


def test_table_shape_and_saturation():
    for bits in (1, 2, 3, 4):
        t = decision_table(bits, "bracket")
        assert len(t) == n_codes(bits) and all(len(r) == REGIONS for r in t)
        assert all(r[REGIONS - 1] == 7 for r in t)  # |z| >= 6 saturates
        assert all(r[0] == 0 for r in t)  # z = 0 is on a codeword
