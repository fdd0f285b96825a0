"""The demo's training modes: BF16, vanilla RTN QAT and TRACE at several layer sets and bits."""

from __future__ import annotations

import dataclasses
from typing import Literal

Quant = Literal["none", "rtn", "trace"]


@dataclasses.dataclass(frozen=True)
class Mode:
    """A training configuration: ``quant`` none/rtn/trace; for trace, the recorded ``layers``
    (every site of those layers: MoE input, K, V) and ``bits``."""

    name: str
    label: str
    quant: Quant
    layers: frozenset[int] = frozenset()
    bits: int = 1

    def records(self, layer: int) -> bool:
        return self.quant == "trace" and layer in self.layers


def standard_modes(n_layers: int, bits: int = 1) -> tuple[Mode, ...]:
    """The five modes of the demo; ``bits`` is the compact / all-layers TRACE b (default 1)."""
    every = frozenset(range(n_layers))
    latter = frozenset(range(n_layers // 2, n_layers))
    return (
        Mode("bf16", "BF16 reference", "none"),
        Mode("rtn", "vanilla RTN QAT", "rtn"),
        Mode("trace_compact", f"TRACE b={bits}, latter half", "trace", latter, bits),
        Mode("trace_all", f"TRACE b={bits}, all layers", "trace", every, bits),
        Mode("trace_full", "TRACE b=4, all layers (full info)", "trace", every, 4),
    )
