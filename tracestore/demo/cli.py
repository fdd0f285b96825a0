"""``tracestore demo``: TRACE end to end on a randomly initialised transformers MoE model."""

from __future__ import annotations

import argparse
import pathlib
import sys
import textwrap
from typing import Any

from tracestore.cli import SWITCH, Kind, Setting, add_settings, choice, integer, number, optional, text


def count(lo: int) -> Kind:
    """An integer of at least ``lo``; a value that is no integer reads "expected an integer", one
    below ``lo`` "expected an integer (at least lo)"."""

    def parse(raw: object) -> int:
        v = integer().parse(raw)
        if v < lo:
            raise ValueError(f"at least {lo}")
        return int(v)

    return Kind("an integer", parse, "N")


ARCHS = (
    "qwen3_moe (default), qwen2_moe, mixtral, olmoe, phimoe, gpt_oss, granitemoe, granitemoeshared, dbrx, jetmoe, "
    "deepseek_v2, deepseek_v3 (MLA), llama4 (text), jamba, granitemoehybrid, nemotron_h (Mamba hybrids), "
    "qwen3_next, qwen3_5_moe, minimax (linear-attention hybrids), lfm2_moe (convolution hybrid), qwen3_vl_moe "
    "(vision-language)"
)

SETTINGS = (
    Setting(
        "--arch",
        text("a transformers MoE model type"),
        "qwen3_moe",
        f"transformers MoE model type: {ARCHS}",
        metavar="TYPE",
    ),
    Setting("--layers", count(1), 8, "decoder layers"),
    Setting("--hidden", count(1), 512, "hidden size"),
    Setting("--heads", count(1), 8, "attention heads"),
    Setting("--kv-heads", count(1), 2, "K/V heads"),
    Setting("--experts", count(1), 8, "routed experts"),
    Setting("--top-k", count(1), 2, "experts per token"),
    Setting("--vocab", count(1), 1024, "vocabulary size"),
    Setting("--trajectories", count(1), 8, "batch of rollouts"),
    Setting("--prompt", count(1), 32, "prompt tokens"),
    Setting("--tokens", count(2), 64, "generated tokens per trajectory"),
    Setting("--bits", integer(1, 4), 1, "b of the compact/all-layers modes"),
    Setting("--rule", choice("bracket", "paper"), "bracket", "guided rounding rule"),
    Setting("--format", choice("nvfp4", "mxfp4"), "nvfp4", "FP4 format"),
    Setting(
        "--scales",
        choice("static", "token", "forward"),
        "static",
        "NVFP4 decode-side g: static = calibrated per site, token = per-token, forward = per-forward dynamic amax",
    ),
    Setting("--steps", count(1), 3, "training steps per mode"),
    Setting("--lr", number(ge=0), 1e-4, "AdamW learning rate"),
    Setting(
        "--storage",
        optional(text("a file:// URL")),
        None,
        "file:// URL for the records",
        show="OUT/service/store",
        metavar="URL",
    ),
    Setting(
        "--transport",
        choice("auto", "service", "memory"),
        "auto",
        "service: through RolloutRecorder/serve/GuidanceReader; memory: records held in memory; "
        "auto: service when installed",
    ),
    Setting(
        "--device",
        optional(text("a torch device such as cpu, cuda or cuda:1")),
        None,
        "cpu or cuda",
        show="cuda when available",
        metavar="DEVICE",
    ),
    Setting("--dtype", choice("bf16", "fp32"), "bf16", "model dtype"),
    Setting("--seed", integer(0), 0, "random seed"),
    Setting("--threads", integer(0), 1, "torch CPU threads (the ops are small; 0 keeps torch's default)"),
    Setting("--out", text("a directory"), "tracestore-demo", "output directory", metavar="DIR"),
    Setting(
        "--r3",
        SWITCH,
        False,
        "also run the R3 + TRACE mode: routing, FP4 records and log-probs recorded through its own serve and "
        "storage, replayed with RoutingReplayHooks in BF16, FP4 and FP4 + TRACE training (--r3)",
        switch=True,
    ),
    Setting(
        "--progress",
        SWITCH,
        True,
        "progress bars on standard error when it is a terminal (--no-progress: none)",
        switch=True,
    ),
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="TRACE end to end on a small random MoE model: FP4 rollout -> records -> training -> fidelity report",
        description="Generate with a KV cache and FP4 at every site (MoE-block inputs, post-RoPE K/V), quantized "
        "and recorded by the tracestore kernels (their CPU reference without a GPU), staged with "
        "RolloutRecorder.record_slab -> `tracestore serve` -> storage, read back with GuidanceReader, and "
        "train a copy of the model for --steps steps (forward, backward, AdamW) in five modes (BF16, vanilla "
        "RTN QAT, TRACE compact, TRACE all layers, TRACE b=4) through the public hook GuidedFP4Hooks. Prints "
        "per mode and step the log-prob difference and KL between rollout and trainer beside per-site MSE; "
        "writes results.json and PNG plots into --out. Settings: flag, else TRACESTORE_<FLAG> (e.g. "
        "TRACESTORE_ARCH), else the [demo] table of a --config file.",
    )
    add_settings(p, "demo", SETTINGS)
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
    from tracestore.cli import resolve
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
    resolve(ns)
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")  # type: ignore[attr-defined]
    try:
        cfg = DemoConfig(
            model=ModelSpec(ns.arch, ns.layers, ns.hidden, ns.heads, ns.kv_heads, ns.experts, ns.top_k, vocab=ns.vocab),
            trajectories=ns.trajectories,
            prompt=ns.prompt,
            tokens=ns.tokens,
            bits=ns.bits,
            rule=ns.rule,
            device=device,
            dtype=ns.dtype,
            seed=ns.seed,
            storage=ns.storage,
            transport=ns.transport,
            format=ns.format,
            scales=ns.scales,
            steps=ns.steps,
            lr=ns.lr,
            threads=ns.threads or None,
        )
        out = pathlib.Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        results = run_demo(cfg, out=out, progress=_progress(ns.progress and sys.stderr.isatty()))
        if ns.r3:
            from tracestore.demo.r3 import run_r3

            results["r3"] = run_r3(cfg, out / "r3")
            results["expectations"] += results["r3"]["expectations"]
    except TraceStoreError as exc:
        print(f"tracestore demo: {exc}", file=sys.stderr)
        return 2
    print(report.format_table(results))
    paths = [report.write_json(results, out), *report.write_plots(results, out)]
    print("\n".join(textwrap.wrap("wrote " + ", ".join(str(p) for p in paths), report.WIDTH, subsequent_indent="  ")))
    return 0 if all(c["ok"] for c in results["expectations"]) else 1
