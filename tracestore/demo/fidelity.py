"""Train–rollout fidelity per layer: MSE of the quantized site inputs, relative excess over BF16,
adjacency of mismatched codes, log-probability differences; the checks of issue 6."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from tracestore.demo.rollout import Rollout
from tracestore.demo.train import Mode, TrainTrace


@dataclasses.dataclass(frozen=True)
class SiteStats:
    """One site in one mode: ``mse`` of the consumed values over positions 0..n-2; codes that differ
    from the rollout's (``mismatch`` share) and the share of those that are adjacent codewords."""

    mse: float
    mismatch: float | None = None
    adjacent: float | None = None


def _signed_index(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 code -> position on the signed codeword line (-7..7); +0 and -0 are both 0."""
    k = (codes & 7).to(torch.int16)
    return torch.where((codes & 8) != 0, -k, k)


def site_stats(roll_y: torch.Tensor, train_y: torch.Tensor, roll_codes: Any, train_codes: Any) -> SiteStats:
    """Compare the rollout's rows [B, n-1, w] with the trainer's rows [B, n, w] (last position dropped)."""
    n1 = roll_y.shape[1]
    mse = float(((train_y[:, :n1] - roll_y) ** 2).mean())
    if roll_codes is None or train_codes is None:
        return SiteStats(mse)
    a, b = _signed_index(roll_codes), _signed_index(train_codes[:, :n1])
    diff = (a - b).abs()
    n_mis = int((diff > 0).sum())
    adjacent = float((diff == 1).sum()) / n_mis if n_mis else None
    return SiteStats(mse, n_mis / diff.numel(), adjacent)


def logprob_diff(roll: Rollout, train: TrainTrace) -> dict[str, float]:
    """|log p_train − log p_rollout| over the generated tokens: max and mean."""
    d = (train.logprobs - roll.logprobs).abs()
    return {"max": float(d.max()), "mean": float(d.mean())}


def layer_table(
    modes: tuple[Mode, ...], stats: dict[str, dict[str, SiteStats]], n_layers: int, kind_suffix: str
) -> list[dict[str, Any]]:
    """Rows per layer for sites named ``layers.{i}.{kind_suffix}``: D per mode, excess, ratios."""
    rows = []
    for layer in range(n_layers):
        name = f"layers.{layer}.{kind_suffix}"
        if name not in stats["bf16"]:
            continue
        d_bf16 = stats["bf16"][name].mse
        d_rtn = stats["rtn"][name].mse
        row: dict[str, Any] = {"layer": layer, "site": name, "mse_bf16": d_bf16}
        for m in modes[1:]:
            s = stats[m.name][name]
            row[f"mse_{m.name}"] = s.mse
            row[f"excess_{m.name}"] = (s.mse - d_bf16) / d_bf16 if d_bf16 > 0 else math.inf
            row[f"ratio_{m.name}"] = s.mse / d_rtn if d_rtn > 0 else math.nan
            row[f"mismatch_{m.name}"] = s.mismatch
            row[f"adjacent_{m.name}"] = s.adjacent
            row[f"recorded_{m.name}"] = m.records(layer)
        rows.append(row)
    return rows


def expectations(
    modes: tuple[Mode, ...], rows: list[dict[str, Any]], logprob: dict[str, dict[str, float]]
) -> list[dict[str, Any]]:
    """Issue 6's expectations, each with the measured value and whether it held."""
    out: list[dict[str, Any]] = []
    for m in modes:
        if m.quant != "trace":
            continue
        if m.layers == frozenset(r["layer"] for r in rows) or len(m.layers) >= len(rows):
            worst = max(r[f"ratio_{m.name}"] for r in rows)
            out.append(
                {
                    "check": f"{m.name}: MSE <= 5% of vanilla QAT at every layer",
                    "measured": f"worst ratio {worst:.4f}",
                    "ok": bool(worst <= 0.05),
                }
            )
        else:
            rec = [r for r in rows if r["layer"] in m.layers]
            worst = max(r[f"ratio_{m.name}"] for r in rec)
            out.append(
                {
                    "check": f"{m.name}: MSE below vanilla QAT at every recorded layer",
                    "measured": f"worst ratio {worst:.4f}",
                    "ok": bool(worst < 1.0),
                }
            )
        gap_trace = abs(logprob[m.name]["mean"] - logprob["bf16"]["mean"])
        gap_rtn = abs(logprob["rtn"]["mean"] - logprob["bf16"]["mean"])
        out.append(
            {
                "check": f"{m.name}: mean |dlogp| closer to BF16's than vanilla QAT's is",
                "measured": f"|{m.name} - bf16| {gap_trace:.3g} vs |rtn - bf16| {gap_rtn:.3g}",
                "ok": bool(gap_trace < gap_rtn),
            }
        )
    return out
