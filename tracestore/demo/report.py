"""The demo's outputs: a printed table, ``results.json`` and PNG plots under ``--out``."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

FP4_MODES = ("rtn", "trace_compact", "trace_all", "trace_full")
SHORT = {"rtn": "QAT", "trace_compact": "compact", "trace_all": "all b1", "trace_full": "full b4"}


def _g(v: Any, fmt: str = ".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return format(v, fmt)


def format_table(results: dict[str, Any]) -> str:
    """The per-layer table (MoE-block inputs), log-prob differences and the checks, as text."""
    bits = results["config"]["bits"]
    lines = [
        "Train-rollout MSE of the quantized MoE-block inputs (positions the rollout ran), per layer",
        f"(compact = TRACE b={bits} on the latter half of the layers; all b1 = TRACE b={bits} on every layer;"
        " full b4 = TRACE b=4 on every layer; * = layer recorded)",
        "",
    ]
    head = f"{'layer':>5} {'D_BF16':>9} " + " ".join(f"{'D ' + SHORT[m]:>12}" for m in FP4_MODES)
    head += " " + " ".join(f"{'excess ' + SHORT[m]:>15}" for m in FP4_MODES)
    head += " " + " ".join(f"{'/QAT ' + SHORT[m]:>13}" for m in FP4_MODES[1:])
    head += " " + " ".join(f"{'adj ' + SHORT[m]:>12}" for m in FP4_MODES)
    lines.append(head)
    for r in results["moe_input"]:
        mark = {m: "*" if r[f"recorded_{m}"] else " " for m in FP4_MODES}
        row = f"{r['layer']:>5} {_g(r['mse_bf16'], '.2e'):>9} "
        row += " ".join(f"{_g(r['mse_' + m], '.2e') + mark[m]:>12}" for m in FP4_MODES)
        row += " " + " ".join(f"{_g(r['excess_' + m], '.3g'):>15}" for m in FP4_MODES)
        row += " " + " ".join(f"{_g(r['ratio_' + m], '.4f'):>13}" for m in FP4_MODES[1:])
        row += " " + " ".join(f"{_g(r['adjacent_' + m], '.3f'):>12}" for m in FP4_MODES)
        lines.append(row)
    lines += [
        "",
        "Per-token |log p_train - log p_rollout| over the generated tokens",
        f"{'mode':<36} {'max':>10} {'mean':>10}",
    ]
    labels = {m["name"]: m["label"] for m in results["modes"]}
    for name, d in results["logprob_diff"].items():
        lines.append(f"{labels[name]:<36} {d['max']:>10.3e} {d['mean']:>10.3e}")
    lines += [
        "",
        "Record bytes per token (codes + scale bytes, all recorded sites): "
        + ", ".join(f"{labels[k]} {v} B" for k, v in results["record_bytes_per_token"].items()),
    ]
    kv = [r for rows in results["kv"].values() for r in rows]
    if kv:
        lines += ["", "K/V entering the cache (all layers): worst train-rollout MSE ratio to vanilla QAT"]
        lines.append("  " + ", ".join(f"{SHORT[m]} {max(r['ratio_' + m] for r in kv):.4f}" for m in FP4_MODES[1:]))
        recorded = [r for r in kv if r["recorded_trace_compact"]]
        if recorded:
            worst = max(r["ratio_trace_compact"] for r in recorded)
            lines[-1] += f" (compact at its recorded layers: {worst:.4f})"
    lines += ["", "Expectations (issue 6)"]
    for e in results["expectations"]:
        lines.append(f"  [{'ok' if e['ok'] else 'FAILED'}] {e['check']}: {e['measured']}")
    t = results["timings"]
    lines += [
        "",
        "path: " + results["transport"]["summary"],
        "timings: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()),
    ]
    return "\n".join(lines)


def _finite(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def write_json(results: dict[str, Any], out: pathlib.Path) -> pathlib.Path:
    path = out / "results.json"
    # strict JSON: a ratio over a zero BF16 discrepancy (inf) or of 0/0 (nan) is written as null
    path.write_text(json.dumps(_finite(results), indent=2, default=str, allow_nan=False) + "\n")
    return path


def write_plots(results: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
    """``excess_mse.png`` (relative excess MSE per layer, log scale) and ``logprob_diff.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {m["name"]: m["label"] for m in results["modes"]}
    rows = results["moe_input"]
    layers = [r["layer"] for r in rows]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for m, style in zip(FP4_MODES, ("o-", "s-", "^--", "v:"), strict=True):
        # (D - D_BF16) / D_BF16 can be <= 0 once TRACE aligns every code; plot D / D_BF16 on a log axis
        ys = [max(r[f"mse_{m}"] / r["mse_bf16"], 1e-3) if r["mse_bf16"] > 0 else math.nan for r in rows]
        ax.plot(layers, ys, style, label=labels[m])
    ax.axhline(1.0, color="gray", ls="--", lw=1, label="BF16 reference (D_FP4 = D_BF16)")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("D_FP4 / D_BF16 = 1 + relative excess\n(0 drawn at the 1e-3 floor)")
    ax.set_title("Train-rollout MSE of MoE-block inputs, relative to BF16")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "excess_mse.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(results["logprob_diff"])
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [results["logprob_diff"][n]["mean"] for n in names], width=0.4, label="mean")
    ax.bar([i + 0.2 for i in x], [results["logprob_diff"][n]["max"] for n in names], width=0.4, label="max")
    ax.set_xticks(list(x), [labels[n] for n in names], rotation=20, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("|log p_train - log p_rollout|")
    ax.set_title("Per-token log-probability difference")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "logprob_diff.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
