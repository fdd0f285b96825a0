"""The demo's K/V fidelity table covers every K/V site kind the hooks record: post-RoPE K and V for
multi-head attention, and MLA's latent and rotary key (attn.kv_latent, attn.k_rope)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tracestore.demo.fidelity import SiteStats, kv_tables  # noqa: E402
from tracestore.demo.train import standard_modes  # noqa: E402


def _stats(suffixes: tuple[str, ...], layers: int) -> dict[str, dict[str, SiteStats]]:
    modes = standard_modes(layers)
    names = [f"layers.{i}.{s}" for i in range(layers) for s in ("mlp.input", *suffixes)]
    return {m.name: {n: SiteStats(mse=1.0 + j) for j, n in enumerate(names)} for m in modes}


@pytest.mark.parametrize(
    ("suffixes", "kinds"),
    [(("attn.k", "attn.v"), ["k", "v"]), (("attn.kv_latent", "attn.k_rope"), ["kv_latent", "k_rope"])],
)
def test_kv_tables_hold_every_kv_site_kind(suffixes: tuple[str, ...], kinds: list[str]) -> None:
    layers = 2
    tables = kv_tables(standard_modes(layers), _stats(suffixes, layers), layers)
    assert list(tables) == kinds
    for kind, rows in tables.items():
        assert [r["site"] for r in rows] == [f"layers.{i}.attn.{kind}" for i in range(layers)]
