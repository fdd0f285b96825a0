"""Train–rollout fidelity per layer: MSE of the quantized site inputs, relative excess over BF16,
adjacency of mismatched codes, log-probability differences, and the demo's checks on them."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tracestore.demo.modes import Mode


@dataclasses.dataclass(frozen=True)
class SiteStats:
    """One site in one mode: ``mse`` of the consumed values over positions 0..n-2; codes that differ
    from the rollout's (``mismatch`` share) and the share of those that are adjacent codewords."""

    mse: float
    mismatch: float | None = None
    adjacent: float | None = None
    values: int = 0  # values compared (for shares over several sites)


def _signed_index(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 code -> position on the signed codeword line (-7..7); +0 and -0 are both 0."""
    k = (codes & 7).to(torch.int16)
    return torch.where((codes & 8) != 0, -k, k)


def site_stats(roll_y: torch.Tensor, train_y: torch.Tensor, roll_codes: Any, train_codes: Any) -> SiteStats:
    """Compare the rollout's rows [B, n-1, w] with the trainer's [B, n, w] (last dropped)."""
    n1 = roll_y.shape[1]
    mse = float(((train_y[:, :n1] - roll_y) ** 2).mean())
    if roll_codes is None or train_codes is None:
        return SiteStats(mse)
    a, b = _signed_index(roll_codes), _signed_index(train_codes[:, :n1])
    diff = (a - b).abs()
    n_mis = int((diff > 0).sum())
    adjacent = float((diff == 1).sum()) / n_mis if n_mis else None
    return SiteStats(mse, n_mis / diff.numel(), adjacent, diff.numel())


def step_summary(step: Any) -> dict[str, Any]:
    """One training step (``train.StepStats``) as a row: log-prob and KL statistics, the mean site
    MSE of the MoE inputs and of K/V, and over all quantized values the share of FP4 codes that
    differ from the rollout's and, of those, the share one codeword away."""
    moe = [s.mse for n, s in step.sites.items() if n.endswith("mlp.input")]
    kv = [s.mse for n, s in step.sites.items() if ".attn." in n]
    coded = [s for s in step.sites.values() if s.mismatch is not None]
    total = sum(s.values for s in coded)
    mis = sum(s.mismatch * s.values for s in coded)
    adj = sum((s.adjacent or 0.0) * s.mismatch * s.values for s in coded)
    return {
        "step": step.step,
        "logp_mean": step.logp_mean,
        "logp_max": step.logp_max,
        "kl_mean": step.kl_mean,
        "loss": step.loss,
        "mse_moe": sum(moe) / len(moe) if moe else None,
        "mse_kv": sum(kv) / len(kv) if kv else None,
        "mismatch": mis / total if total else None,
        "adjacent": adj / mis if mis else None,
    }


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
            # over a zero QAT MSE: 0 when this mode's is zero too, else infinitely worse
            row[f"ratio_{m.name}"] = s.mse / d_rtn if d_rtn > 0 else (0.0 if s.mse == 0 else math.inf)
            row[f"mismatch_{m.name}"] = s.mismatch
            row[f"adjacent_{m.name}"] = s.adjacent
            row[f"recorded_{m.name}"] = m.records(layer)
        rows.append(row)
    return rows


# K/V site suffixes: multi-head attention's post-RoPE key and value, MLA's latent and rotary key
KV_SUFFIXES = ("attn.k", "attn.v", "attn.kv_latent", "attn.k_rope")


def kv_tables(
    modes: tuple[Mode, ...], stats: dict[str, dict[str, SiteStats]], n_layers: int
) -> dict[str, list[dict[str, Any]]]:
    """:func:`layer_table` for every K/V site kind the model has, keyed by the suffix after
    ``attn.`` (``k``, ``v``; ``kv_latent``, ``k_rope`` for MLA); kinds without a site are left
    out."""
    tables = {s.removeprefix("attn."): layer_table(modes, stats, n_layers, s) for s in KV_SUFFIXES}
    return {kind: rows for kind, rows in tables.items() if rows}


def expectations(
    modes: tuple[Mode, ...], rows: list[dict[str, Any]], logprob: dict[str, dict[str, float]]
) -> list[dict[str, Any]]:
    """The demo's expectations, each with the measured value and whether it held."""
    out: list[dict[str, Any]] = []
    for m in modes:
        if m.quant != "trace":
            continue
        if m.layers == frozenset(r["layer"] for r in rows) or len(m.layers) >= len(rows):
            worst = max(r[f"ratio_{m.name}"] for r in rows)
            out.append(
                {
                    "check": f"{m.name}: MSE <= 5% of vanilla QAT at every layer",
                    "measured": f"worst ratio {worst:.4g}",
                    "ok": bool(worst <= 0.05),
                }
            )
        else:
            rec = [r for r in rows if r["layer"] in m.layers]
            worst = max(r[f"ratio_{m.name}"] for r in rec)
            out.append(
                {
                    "check": f"{m.name}: MSE below vanilla QAT at every recorded layer",
                    "measured": f"worst ratio {worst:.4g}",
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
