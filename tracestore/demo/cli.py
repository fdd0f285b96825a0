"""``tracestore demo``: TRACE end to end on a randomly initialised transformers MoE model."""

from __future__ import annotations

import argparse
import pathlib
import sys
import textwrap
from typing import Any

from tracestore.cli import env_default


def register(sub: argparse._SubParsersAction) -> None:
    e = env_default
    p = sub.add_parser(
        "demo",
        help="TRACE end to end on a small random MoE model: FP4 rollout -> records -> training -> fidelity report",
        description="Generate with a KV cache and FP4 at every site (MoE-block inputs, post-RoPE K/V), quantized "
        "and recorded by the tracestore kernels (their CPU reference without a GPU), staged with "
        "RolloutRecorder.record_slab -> `tracestore serve` -> storage, read back with GuidanceReader, and "
        "train a copy of the model for --steps steps (forward, backward, AdamW) in five modes (BF16, vanilla "
        "RTN QAT, TRACE compact, TRACE all layers, TRACE b=4) through the public hook GuidedFP4Hooks. Prints "
        "per mode and step the log-prob difference and KL between rollout and trainer beside per-site MSE; "
        "writes results.json and PNG plots into --out. Every --flag can also be set as TRACESTORE_FLAG "
        "(e.g. TRACESTORE_ARCH).",
    )
    p.add_argument("--arch", default=e("--arch", "qwen3_moe"), help="transformers MoE model type: qwen3_moe "
                   "(default), qwen2_moe, mixtral, olmoe, phimoe, gpt_oss, granitemoe, granitemoeshared, dbrx, "
                   "jetmoe, deepseek_v2, deepseek_v3 (MLA), llama4 (text), jamba, granitemoehybrid, nemotron_h "
                   "(Mamba hybrids), qwen3_next, qwen3_5_moe, minimax (linear-attention hybrids), lfm2_moe "
                   "(convolution hybrid), qwen3_vl_moe (vision-language)")  # fmt: skip
    p.add_argument("--layers", type=int, default=int(e("--layers", 8)), help="decoder layers (default 8)")
    p.add_argument("--hidden", type=int, default=int(e("--hidden", 512)), help="hidden size (default 512)")
    p.add_argument("--heads", type=int, default=int(e("--heads", 8)), help="attention heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=int(e("--kv-heads", 2)), help="K/V heads (default 2)")
    p.add_argument("--experts", type=int, default=int(e("--experts", 8)), help="routed experts (default 8)")
    p.add_argument("--top-k", type=int, default=int(e("--top-k", 2)), help="experts per token (default 2)")
    p.add_argument("--vocab", type=int, default=int(e("--vocab", 1024)), help="vocabulary size (default 1024)")
    p.add_argument("--trajectories", type=int, default=int(e("--trajectories", 8)), help="batch of rollouts (8)")
    p.add_argument("--prompt", type=int, default=int(e("--prompt", 32)), help="prompt tokens (default 32)")
    p.add_argument("--tokens", type=int, default=int(e("--tokens", 64)), help="generated tokens per trajectory (64)")
    p.add_argument("--bits", type=int, default=int(e("--bits", 1)), help="b of the compact/all-layers modes (1)")
    p.add_argument("--rule", default=e("--rule", "bracket"), choices=("bracket", "paper"), help="guided rounding rule")
    p.add_argument("--format", default=e("--format", "nvfp4"), choices=("nvfp4", "mxfp4"), help="FP4 format (nvfp4)")
    p.add_argument("--scales", default=e("--scales", "static"), choices=("static", "token", "forward"),
                   help="NVFP4 decode-side g: static = calibrated per site (default), token = per-token, "
                   "forward = per-forward dynamic amax")  # fmt: skip
    p.add_argument("--steps", type=int, default=int(e("--steps", 3)), help="training steps per mode (3)")
    p.add_argument("--lr", type=float, default=float(e("--lr", 1e-4)), help="AdamW learning rate (1e-4)")
    p.add_argument(
        "--storage", default=e("--storage", None), help="file:// URL for the records (default: OUT/service/store)"
    )
    p.add_argument("--transport", default=e("--transport", "auto"), choices=("auto", "service", "memory"),
                   help="service: through RolloutRecorder/serve/GuidanceReader; memory: records held in memory; "
                   "auto: service when installed")  # fmt: skip
    p.add_argument("--device", default=e("--device", None), help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=e("--dtype", "bf16"), choices=("bf16", "fp32"), help="model dtype (bf16)")
    p.add_argument("--seed", type=int, default=int(e("--seed", 0)))
    p.add_argument("--threads", type=int, default=int(e("--threads", 1)), help="torch CPU threads (default 1: "
                   "the ops are small; 0 keeps torch's default)")  # fmt: skip
    p.add_argument("--out", default=e("--out", "tracestore-demo"), help="output directory (default ./tracestore-demo)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _progress(enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    def make(desc: str, total: int) -> Any:
        bar = tqdm(total=total, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=True)

        def step(n: int) -> None:
            bar.update(n)
            if bar.n >= total:
                bar.close()

        return step

    return make


def run(ns: argparse.Namespace) -> int:
    from tracestore.errors import MissingExtraError, TraceStoreError, require

    try:
        torch = require("torch", "torch")
        require("transformers", "demo")
        from tracestore.demo import report
        from tracestore.demo.model import ModelSpec
        from tracestore.demo.run import DemoConfig, run_demo
    except MissingExtraError as exc:
        print(f"tracestore demo: {exc}", file=sys.stderr)
        return 2
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")  # type: ignore[attr-defined]
    try:
        cfg = DemoConfig(
            model=ModelSpec(ns.arch, ns.layers, ns.hidden, ns.heads, ns.kv_heads, ns.experts, ns.top_k, vocab=ns.vocab),
            trajectories=ns.trajectories, prompt=ns.prompt, tokens=ns.tokens, bits=ns.bits, rule=ns.rule,
            device=device, dtype=ns.dtype, seed=ns.seed, storage=ns.storage, transport=ns.transport,
            format=ns.format, scales=ns.scales, steps=ns.steps, lr=ns.lr, threads=ns.threads or None,
        )  # fmt: skip
        out = pathlib.Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        results = run_demo(cfg, out=out, progress=_progress(not ns.no_progress and sys.stderr.isatty()))
    except TraceStoreError as exc:
        print(f"tracestore demo: {exc}", file=sys.stderr)
        return 2
    print(report.format_table(results))
    paths = [report.write_json(results, out), *report.write_plots(results, out)]
    print("\n".join(textwrap.wrap("wrote " + ", ".join(str(p) for p in paths), report.WIDTH, subsequent_indent="  ")))
    return 0 if all(c["ok"] for c in results["expectations"]) else 1
