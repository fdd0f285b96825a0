"""The demo pipeline, the production line end to end: an FP4 rollout quantized and recorded by the
kernels (CPU reference or CUDA) → ``RolloutRecorder.record_slab`` → ``tracestore serve`` →
storage → ``GuidanceReader`` → the public training hook ``GuidedFP4Hooks`` → real training steps
in five modes → fidelity report."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time
from collections.abc import Callable
from typing import Any

import torch

from tracestore.demo import fidelity
from tracestore.demo.model import DTYPES, ModelSpec, build_model
from tracestore.demo.rollout import SCALES, Rollout, calibrate, run_rollout
from tracestore.demo.train import Mode, effective_g, standard_modes, train_steps
from tracestore.demo.transport import ServiceTransport, default_workdir, run_id, run_specs, service_available
from tracestore.errors import ConfigError, MissingExtraError
from tracestore.formats import get_format
from tracestore.guidance import Guidance
from tracestore.packing import pack_bits

FORMATS = ("nvfp4", "mxfp4")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything ``tracestore demo`` takes (see ``tracestore demo --help``)."""

    model: ModelSpec = ModelSpec()
    trajectories: int = 8
    prompt: int = 32
    tokens: int = 64  # generated tokens per trajectory
    bits: int = 1
    rule: str = "bracket"
    device: str = "cpu"
    dtype: str = "bf16"
    seed: int = 0
    storage: str | None = None  # file:// URL for the service path; None: a temp dir under out
    transport: str = "auto"  # "service" | "memory" | "auto" (service when its parts are installed)
    format: str = "nvfp4"
    scales: str = "static"  # NVFP4 decode-side g: calibrated static per site | per token | per forward
    steps: int = 3  # training steps per mode
    lr: float = 1e-4
    # torch intra-op threads on the CPU. The demo's ops are tiny, so threads mostly synchronise.
    threads: int | None = 1  # 2-core box: 8.7 s with 1 thread, 86 s with 2

    def __post_init__(self) -> None:
        if self.trajectories < 1 or self.prompt < 1 or self.tokens < 2:
            raise ConfigError(
                "need trajectories >= 1, prompt >= 1 and tokens >= 2, "
                f"got {self.trajectories}, {self.prompt}, {self.tokens}"
            )
        if self.bits not in (1, 2, 3, 4):
            raise ConfigError(f"bits must be 1..4, got {self.bits}")
        if self.rule not in ("bracket", "paper"):
            raise ConfigError(f"rule must be 'bracket' or 'paper', got {self.rule!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1 (or None: torch's default), got {self.threads}")
        if self.transport not in ("service", "memory", "auto"):
            raise ConfigError(f"transport must be 'service', 'memory' or 'auto', got {self.transport!r}")
        if self.format not in FORMATS:
            raise ConfigError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.scales not in SCALES:
            raise ConfigError(f"scales must be one of {SCALES}, got {self.scales!r}")
        if self.steps < 1 or not self.lr >= 0:
            raise ConfigError(f"need steps >= 1 and lr >= 0, got {self.steps}, {self.lr}")


def memory_guidance(roll: Rollout, mode: Mode, fmt_name: str = "nvfp4", rule: str = "bracket") -> dict[str, Guidance]:
    """Guidance for ``mode`` straight from the rollout's in-memory records (no service), rows
    trajectory-major over the training tokens: the low ``mode.bits`` of each code, scale bytes and
    g; the last position is unrecorded (valid False, g 1.0 as the reader gives it)."""
    fmt = get_format(fmt_name)
    out: dict[str, Guidance] = {}
    for name, tr in roll.sites.items():
        layer = int(name.split(".")[1])
        if not mode.records(layer) or tr.codes is None or tr.scales is None or tr.g is None:
            continue
        b, n1, _ = tr.codes.shape
        pad = (0, 0, 0, 1)  # one unrecorded row per trajectory at the end
        valid = torch.nn.functional.pad(torch.ones(b, n1, dtype=torch.bool, device=tr.codes.device), (0, 1))
        g = torch.nn.functional.pad(tr.g, (0, 1), value=1.0) if fmt.has_global_scale else torch.ones(b, n1 + 1)
        out[name] = Guidance(
            torch.nn.functional.pad(pack_bits(tr.codes, mode.bits), pad).reshape(b * (n1 + 1), -1),
            torch.nn.functional.pad(tr.scales, pad).reshape(b * (n1 + 1), -1),
            g.reshape(-1).to(tr.codes.device).float(),
            mode.bits,
            fmt,
            rule,  # type: ignore[arg-type]
            valid=valid.reshape(-1),
        )
    return out


def same_records(a: Guidance, b: Guidance) -> bool:
    """Same valid rows, same code and scale bytes on them, same effective g (g × token scale)."""
    if a.valid is None or b.valid is None or not torch.equal(a.valid.cpu(), b.valid.cpu()):
        return False
    v = a.valid.cpu()
    return (
        a.bits == b.bits
        and torch.equal(a.codes.cpu()[v], b.codes.cpu()[v])
        and torch.equal(a.scales.cpu()[v], b.scales.cpu()[v])
        and torch.equal(effective_g(a).cpu()[v], effective_g(b).cpu()[v])
    )


Progress = Callable[[str, int], Any]  # (description, total) -> callable(step)


def _hooked_sites(model: Any) -> tuple[Any, ...]:
    from tracestore.client.hf.hooks import HFSiteHooks

    with HFSiteHooks(model, lambda site, x: None) as hooks:
        return hooks.sites


def run_demo(
    cfg: DemoConfig,
    *,
    out: pathlib.Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the pipeline; returns the results dict (``results.json``). Records travel through the
    service (``cfg.transport`` "service", or "auto" when its parts are installed) or stay in
    memory."""
    threads = torch.get_num_threads()
    if cfg.threads is not None and cfg.device == "cpu":
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, out, progress)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: DemoConfig, out: pathlib.Path | None, progress: Progress | None) -> dict[str, Any]:
    fmt = get_format(cfg.format)
    dtype = DTYPES[cfg.dtype]
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    model = build_model(cfg.model, dtype=dtype, device=cfg.device, seed=cfg.seed)
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 1)
    prompts = torch.randint(3, cfg.model.vocab, (cfg.trajectories, cfg.prompt), generator=gen, device=cfg.device)
    modes = standard_modes(cfg.model.layers, cfg.bits)
    sites = _hooked_sites(model)
    runs = run_specs(modes, sites, cfg.format)
    scales = cfg.scales if fmt.has_global_scale else "none"
    static_g = calibrate(model, prompts) if scales == "static" else {}
    rtn_scale: Any = {"static": static_g, "token": "token"}.get(scales, "tensor")
    timings["build_model_s"] = time.perf_counter() - t0

    why_not = service_available() if cfg.transport != "memory" else "--transport memory"
    if cfg.transport == "service" and why_not:
        raise MissingExtraError(f"--transport service needs the client SDK and server: {why_not}")
    transport: dict[str, Any] = {"path": "memory" if why_not else "service"}
    n_pos = cfg.prompt + cfg.tokens - 1
    with contextlib.ExitStack() as stack:
        service: ServiceTransport | None = None
        if not why_not:
            service = stack.enter_context(ServiceTransport(runs, default_workdir(out), cfg.storage))
            transport.update(storage=service.storage, address=service.address, runs=[s.run for s in runs.values()])
        t = time.perf_counter()
        bar = progress("rollout (FP4 kernels, KV cache)", n_pos) if progress else None
        roll = run_rollout(
            model,
            prompts,
            cfg.tokens,
            fmt=fmt,
            scales=cfg.scales,
            static_g=static_g or None,
            runs=runs if service is not None else None,
            generator=gen,
            on_forward=service.on_forward if service is not None else None,
            progress=bar,
        )
        timings["rollout_fp4_s"] = time.perf_counter() - t
        if service is not None:
            t = time.perf_counter()
            service.finish(cfg.trajectories, cfg.prompt + cfg.tokens)
            timings["seal_flush_s"] = time.perf_counter() - t
            transport.update(recorder_stats=service.stats, sent_bytes=service.sent_bytes)

        t = time.perf_counter()
        bar = progress("rollout replay (BF16 reference)", n_pos) if progress else None
        ref = run_rollout(model, prompts, cfg.tokens, fmt=None, tokens=roll.tokens, progress=bar)
        timings["rollout_bf16_s"] = time.perf_counter() - t

        per_step: dict[str, list[dict[str, Any]]] = {}
        step0: dict[str, dict[str, fidelity.SiteStats]] = {}
        identical: dict[str, bool] = {}
        t = time.perf_counter()
        bar = progress("training steps", len(modes) * cfg.steps) if progress else None
        for mode in modes:
            guidance: dict[str, Guidance] = {}
            if mode.quant == "trace":
                guidance = memory_guidance(roll, mode, cfg.format, cfg.rule)
                if service is not None:
                    b, n = roll.tokens.shape
                    read = service.guidance((int(b), int(n)), mode, cfg.device, cfg.rule, roll.tokens)
                    identical[mode.name] = set(read) == set(guidance) and all(
                        same_records(read[k], guidance[k]) for k in guidance
                    )
                    guidance = read  # train on what came back through the service
            steps = train_steps(
                model,
                roll,
                ref if mode.quant == "none" else roll,
                mode,
                fmt,
                guidance,
                rtn_scale=rtn_scale,
                steps=cfg.steps,
                lr=cfg.lr,
            )
            step0[mode.name] = steps[0].sites
            per_step[mode.name] = [fidelity.step_summary(s) for s in steps]
            if bar:
                bar(cfg.steps)
        timings["training_s"] = time.perf_counter() - t

    moe_rows = fidelity.layer_table(modes, step0, cfg.model.layers, "mlp.input")
    kv_rows = fidelity.kv_tables(modes, step0, cfg.model.layers)
    logprob = {m: {"max": s[0]["logp_max"], "mean": s[0]["logp_mean"]} for m, s in per_step.items()}
    checks = fidelity.expectations(modes, moe_rows, logprob)
    # bytes one token costs on the wire/storage per TRACE mode (docs/numerics.md §6: b + 8/block bits per value)
    record_bytes = {
        m.name: sum(
            tr.y.shape[-1] * m.bits // 8 + tr.y.shape[-1] // fmt.block
            for name, tr in roll.sites.items()
            if m.records(int(name.split(".")[1]))
        )
        for m in modes
        if m.quant == "trace"
    }
    if service is not None:
        transport["read_back_identical"] = identical
        transport["summary"] = (
            f"kernels ({'CUDA' if str(cfg.device).startswith('cuda') else 'CPU reference'}) -> "
            f"RolloutRecorder.record_slab -> tracestore serve ({transport['address']}) -> {transport['storage']}"
            " -> GuidanceReader -> GuidedFP4Hooks; training used the records read back"
        )
        checks.append(
            {
                "check": "records read back through GuidanceReader are byte-identical to what the rollout recorded",
                "measured": ", ".join(f"{k}: {v}" for k, v in identical.items()),
                "ok": all(identical.values()),
            }
        )
    else:
        transport["summary"] = f"in memory (NOT through the service: {why_not}); training through GuidedFP4Hooks"
    timings["total_s"] = time.perf_counter() - t0
    return {
        "config": {**dataclasses.asdict(cfg), "model": dataclasses.asdict(cfg.model)},
        "modes": [{"name": m.name, "label": m.label, "layers": sorted(m.layers), "bits": m.bits} for m in modes],
        "transport": transport,
        "scales": {"mode": scales, "static_g": static_g},
        "per_step": per_step,
        "moe_input": moe_rows,
        "kv": kv_rows,
        "logprob_diff": logprob,
        "record_bytes_per_token": record_bytes,
        "expectations": checks,
        "timings": timings,
        "runs": {name: run_id(m) for m in modes for name in [m.name] if m.quant == "trace"},
    }
