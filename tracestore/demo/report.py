"""The demo's outputs: a printed table, ``results.json`` and PNG plots under ``--out``."""

from __future__ import annotations

import json
import math
import pathlib
import textwrap
from typing import Any

FP4_MODES = ("rtn", "trace_compact", "trace_all", "trace_full")
SHORT = {"rtn": "QAT", "trace_compact": "compact", "trace_all": "all b1", "trace_full": "full b4"}
WIDTH = 120


def _g(v: Any, fmt: str = ".3g") -> str:
    """A number for the tables: '-' for none, '0' for an exact zero, else ``fmt``."""
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if v == 0:
        return "0"
    return format(v, fmt)


def _wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent or "  ")


def _worst(values: Any) -> float | None:
    """The largest finite value (a ratio over a zero QAT MSE is undefined and left out)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return max(finite) if finite else None


def verdict(results: dict[str, Any]) -> str:
    """One line: whether every check held, or how many failed and the first."""
    checks = results["expectations"]
    bad = [c for c in checks if not c["ok"]]
    if not bad:
        line = f"VERDICT: OK, all {len(checks)} checks hold"
        trace = [m for m in results["per_step"] if m.startswith("trace")]
        if trace and "rtn" in results["per_step"]:
            kl_q = results["per_step"]["rtn"][0]["kl_mean"]
            kl_t = max(results["per_step"][m][0]["kl_mean"] for m in trace)
            line += f"; step-0 KL(rollout||trainer): vanilla QAT {_g(kl_q)}, TRACE modes <= {_g(kl_t)}"
        return line[:WIDTH]
    first = f"{bad[0]['check']} ({bad[0]['measured']})"
    return f"VERDICT: FAILED {len(bad)} of {len(checks)} checks, first: {first}"[:WIDTH]


def format_table(results: dict[str, Any]) -> str:
    """The report as text, every line at most 120 columns: the verdict, the run, per mode and step
    the log-prob/KL/MSE/code statistics, the per-layer MoE-input table, the checks."""
    cfg, mdl = results["config"], results["config"]["model"]
    labels = {m["name"]: m["label"] for m in results["modes"]}
    sc = results.get("scales", {}).get("mode", "none")
    scale_text = {
        "static": "static per-site g (calibrated)",
        "token": "per-token g",
        "forward": "per-forward dynamic g",
        "none": "no global scale",
    }.get(sc, sc)
    lines = [verdict(results)]
    lines += _wrap(
        f"run: {mdl['arch']} {mdl['layers']} layers, hidden {mdl['hidden']}, {mdl['experts']} experts "
        f"top-{mdl['top_k']}; {cfg['format'].upper()} with {scale_text}; {cfg['trajectories']} trajectories x "
        f"({cfg['prompt']} prompt + {cfg['tokens']} generated) tokens; {cfg['steps']} AdamW steps per mode "
        f"(lr {cfg['lr']:g}) on a copy of the model; device {cfg['device']}, {cfg['dtype']}"
    )
    lines += _wrap("path: " + results["transport"]["summary"])
    lines.append("")
    lines += _wrap(
        "Columns: dlogp = |log p_train - log p_rollout| of each generated token (mean, max); "
        "KL = KL(rollout || trainer) of the next-token distributions, mean over generated positions; "
        "MSE moe / kv = mean over layers of the "
        "train-rollout MSE of the values the MoE blocks / the K/V caches consumed; codes = share of FP4 codes "
        "that differ from the rollout's; adj = share of those one codeword away. Step 0 runs on the rollout's "
        "weights; step s after s optimizer steps. 0 is an exact zero."
    )
    lines.append("")
    head = (
        f"{'mode':<34} {'step':>4} {'dlogp mean':>10} {'dlogp max':>10} {'KL mean':>10} {'MSE moe':>10} "
        f"{'MSE kv':>10} {'codes':>8} {'adj':>6}"
    )
    lines.append(head)
    for name, steps in results["per_step"].items():
        for r in steps:
            mis = None if r["mismatch"] is None else 100 * r["mismatch"]
            adj = None if r["adjacent"] is None else 100 * r["adjacent"]
            lines.append(
                f"{labels[name] if r['step'] == 0 else '':<34} {r['step']:>4} {_g(r['logp_mean'], '.3e'):>10} "
                f"{_g(r['logp_max'], '.3e'):>10} {_g(r['kl_mean'], '.3e'):>10} {_g(r['mse_moe'], '.3e'):>10} "
                f"{_g(r['mse_kv'], '.3e'):>10} {_g(mis, '.3f') + ('%' if mis else ''):>8} "
                f"{_g(adj, '.1f') + ('%' if adj else ''):>6}"
            )
    lines += [
        "",
        "Per layer at step 0: MoE-input MSE (D) and TRACE's MSE as a share of vanilla QAT's (* = layer recorded)",
    ]
    lines.append(
        f"{'layer':>5} {'D BF16':>10} {'D QAT':>10} "
        + " ".join(f"{SHORT[m] + '/QAT':>14}" for m in FP4_MODES[1:])
        + f" {'QAT codes':>10} {'QAT adj':>8}"
    )
    for r in results["moe_input"]:
        row = f"{r['layer']:>5} {_g(r['mse_bf16'], '.3e'):>10} {_g(r['mse_rtn'], '.3e'):>10} "
        row += " ".join(
            f"{_g(r['ratio_' + m], '.4f') + ('*' if r['recorded_' + m] else ' '):>14}" for m in FP4_MODES[1:]
        )
        mis = r.get("mismatch_rtn")
        row += f" {_g(None if mis is None else 100 * mis, '.3f') + '%':>10}"
        adj = r.get("adjacent_rtn")
        row += f" {_g(None if adj is None else 100 * adj, '.1f') + ('%' if adj else ''):>8}"
        lines.append(row)
    kv = [r for rows in results["kv"].values() for r in rows]
    if kv:
        lines += _wrap(
            "K/V entering the cache, all layers, worst MSE share of vanilla QAT: "
            + ", ".join(f"{SHORT[m]} {_g(_worst(r['ratio_' + m] for r in kv), '.4f')}" for m in FP4_MODES[1:])
        )
    lines += _wrap(
        "Record bytes per token (codes + scale bytes, all recorded sites): "
        + ", ".join(f"{labels[k]} {v} B" for k, v in results["record_bytes_per_token"].items())
    )
    if "r3" in results:
        from tracestore.demo.r3 import format_r3

        lines += ["", *format_r3(results["r3"])]
    lines += ["", "Checks"]
    for e in results["expectations"]:
        lines += _wrap(f"  [{'ok' if e['ok'] else 'FAILED'}] {e['check']}: {e['measured']}", "")
    t = results["timings"]
    lines += [""] + _wrap("timings (s): " + ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in t.items()))
    return "\n".join(line.rstrip() for line in lines)


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
