"""The demo pipeline: rollout → records → training forwards in five modes → fidelity report."""

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
from tracestore.demo.rollout import Rollout, run_rollout
from tracestore.demo.train import Mode, SiteGuidance, standard_modes, train_forward
from tracestore.demo.transport import ServiceTransport, default_workdir, run_id, service_available
from tracestore.errors import ConfigError, MissingExtraError
from tracestore.formats import get_format
from tracestore.packing import pack_bits


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
    # torch intra-op threads on the CPU. The demo's ops are tiny, so threads mostly synchronise: on the
    # shared 2-core machine (load ~4.5) the default run took 86 s with 2 threads and 8.7 s with 1.
    threads: int | None = 1

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


def memory_guidance(roll: Rollout, mode: Mode, fmt_name: str = "nvfp4") -> dict[str, SiteGuidance]:
    """Guidance for ``mode`` straight from the rollout's in-memory records (no service): the low
    ``mode.bits`` of each code, scale bytes and g; the last position is unrecorded (valid False)."""
    out: dict[str, SiteGuidance] = {}
    for name, tr in roll.sites.items():
        layer = int(name.split(".")[1])
        if not mode.records(layer) or tr.codes is None or tr.scales is None or tr.g is None:
            continue
        b, n1, _ = tr.codes.shape
        pad = (0, 0, 0, 1)  # one unrecorded row per trajectory at the end
        out[name] = SiteGuidance(
            packed=torch.nn.functional.pad(pack_bits(tr.codes, mode.bits), pad),
            scales=torch.nn.functional.pad(tr.scales, pad),
            g=torch.nn.functional.pad(tr.g, (0, 1), value=1.0),
            valid=torch.nn.functional.pad(torch.ones(b, n1, dtype=torch.bool, device=tr.codes.device), (0, 1)),
            bits=mode.bits,
        )
    return out


Progress = Callable[[str, int], Any]  # (description, total) -> callable(step)


def _site_widths(model: Any) -> dict[str, int]:
    from tracestore.client.hf_hooks import HFSiteHooks

    with HFSiteHooks(model, lambda site, x: None) as hooks:
        return {s.name: s.width for s in hooks.sites}


def _same(a: SiteGuidance, b: SiteGuidance) -> bool:
    return (
        a.bits == b.bits
        and torch.equal(a.valid, b.valid)
        and torch.equal(a.packed[a.valid], b.packed[b.valid])
        and torch.equal(a.scales[a.valid], b.scales[b.valid])
        and torch.equal(a.g[a.valid], b.g[b.valid])
    )


def run_demo(
    cfg: DemoConfig,
    *,
    out: pathlib.Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the pipeline; returns the results dict (``results.json``). Records travel through the
    service (``cfg.transport`` "service", or "auto" when its parts are installed) or stay in memory."""
    threads = torch.get_num_threads()
    if cfg.threads is not None and cfg.device == "cpu":
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, out, progress)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: DemoConfig, out: pathlib.Path | None, progress: Progress | None) -> dict[str, Any]:
    fmt = get_format("nvfp4")
    dtype = DTYPES[cfg.dtype]
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    model = build_model(cfg.model, dtype=dtype, device=cfg.device, seed=cfg.seed)
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 1)
    prompts = torch.randint(3, cfg.model.vocab, (cfg.trajectories, cfg.prompt), generator=gen, device=cfg.device)
    modes = standard_modes(cfg.model.layers, cfg.bits)
    timings["build_model_s"] = time.perf_counter() - t0

    why_not = service_available() if cfg.transport != "memory" else "--transport memory"
    if cfg.transport == "service" and why_not:
        raise MissingExtraError(f"--transport service needs the client SDK and server: {why_not}")
    transport: dict[str, Any] = {"path": "memory" if why_not else "service"}
    with contextlib.ExitStack() as stack:
        service: ServiceTransport | None = None
        if not why_not:
            workdir = default_workdir(out)
            service = stack.enter_context(ServiceTransport(modes, _site_widths(model), workdir, cfg.storage))
            transport.update(storage=service.storage, address=service.address, runs=[run_id(m) for m in service.modes])
        n_pos = cfg.prompt + cfg.tokens - 1
        t = time.perf_counter()
        bar = progress("rollout (FP4, KV cache)", n_pos) if progress else None
        on_forward = service.on_forward if service else None
        roll = run_rollout(model, prompts, cfg.tokens, fmt=fmt, generator=gen, on_forward=on_forward, progress=bar)
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

        stats: dict[str, dict[str, fidelity.SiteStats]] = {}
        logprob: dict[str, dict[str, float]] = {}
        identical: dict[str, bool] = {}
        t = time.perf_counter()
        step = progress("training forwards", len(modes)) if progress else None
        for mode in modes:
            source = ref if mode.quant == "none" else roll
            guidance: dict[str, SiteGuidance] = {}
            if mode.quant == "trace":
                guidance = memory_guidance(roll, mode)
                if service is not None:
                    read = service.guidance(roll, mode)
                    identical[mode.name] = set(read) == set(guidance) and all(
                        _same(read[k], guidance[k]) for k in guidance
                    )
                    guidance = read  # train on what came back through the service
            tr = train_forward(model, roll.tokens, roll.prompt_len, mode, fmt, guidance, cfg.rule)
            stats[mode.name] = {
                name: fidelity.site_stats(st.y, tr.y[name], st.codes, tr.codes.get(name))
                for name, st in source.sites.items()
            }
            logprob[mode.name] = fidelity.logprob_diff(source, tr)
            if step:
                step(1)
        timings["training_s"] = time.perf_counter() - t

    moe_rows = fidelity.layer_table(modes, stats, cfg.model.layers, "mlp.input")
    kv_rows = {kind: fidelity.layer_table(modes, stats, cfg.model.layers, f"attn.{kind}") for kind in ("k", "v")}
    checks = fidelity.expectations(modes, moe_rows, logprob)
    # bytes one token costs on the wire/storage per TRACE mode (docs/numerics.md §6: b + 8/16 bits per value)
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
            f"service: RolloutRecorder -> tracestore serve ({transport['address']}) -> {transport['storage']}"
            " -> GuidanceReader; training used the records read back"
        )
        checks.append(
            {
                "check": "records read back through GuidanceReader are byte-identical to what the rollout recorded",
                "measured": ", ".join(f"{k}: {v}" for k, v in identical.items()),
                "ok": all(identical.values()),
            }
        )
    else:
        transport["summary"] = f"in memory (NOT through the service: {why_not})"
    timings["total_s"] = time.perf_counter() - t0
    return {
        "config": {**dataclasses.asdict(cfg), "model": dataclasses.asdict(cfg.model)},
        "modes": [{"name": m.name, "label": m.label, "layers": sorted(m.layers), "bits": m.bits} for m in modes],
        "transport": transport,
        "moe_input": moe_rows,
        "kv": kv_rows,
        "logprob_diff": logprob,
        "record_bytes_per_token": record_bytes,
        "expectations": checks,
        "timings": timings,
    }
