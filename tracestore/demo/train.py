"""The training side: one teacher-forced full-sequence forward over the rollout's tokens.

Modes (``MODES``): BF16 reference (no quantization), vanilla RTN QAT (every site RTN with the
trainer's own global scale), and TRACE (``guided_round`` with the rollout's records at recorded
sites, RTN elsewhere). Positions without a record — the last token of each trajectory never
entered a rollout forward — fall back to RTN with the trainer's own scales (docs/numerics.md §8).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from tracestore.client.hf_hooks import HFSiteHooks, HookedSite
from tracestore.errors import ConfigError, ShapeError
from tracestore.formats import E2M1_MAGNITUDES, FP4Format
from tracestore.fp4 import quantize, resolve_global_scale, scale_values
from tracestore.guided import guided_round, rtn_fake_quant

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


@dataclasses.dataclass(frozen=True)
class SiteGuidance:
    """Records of one site aligned to the training rows [B, n]: ``packed`` uint8 [B, n, w*bits/8],
    ``scales`` uint8 [B, n, w/block], ``g`` float32 [B, n], ``valid`` bool [B, n]."""

    packed: torch.Tensor
    scales: torch.Tensor
    g: torch.Tensor
    valid: torch.Tensor
    bits: int


@dataclasses.dataclass
class TrainTrace:
    """Per site: ``y`` float32 [B, n, w] (the value the model consumed), ``codes`` uint8 [B, n, w]
    (the trainer's FP4 codes; None unquantized); ``logprobs`` float32 [B, n-P]."""

    y: dict[str, torch.Tensor]
    codes: dict[str, torch.Tensor]
    logprobs: torch.Tensor


_MAGS = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)


def codes_on_grid(y: torch.Tensor, scales: torch.Tensor, g: torch.Tensor, fmt: FP4Format) -> torch.Tensor:
    """E2M1 codes of fake-quantized ``y`` [..., w] on the grid ``float(sf)*g``: the nearest
    magnitude (gaps are >= 0.5 codewords; the bf16 cast of y moves a value by <= 2**-8 relative)."""
    lead = y.shape[:-1]
    s = (scale_values(scales, fmt) * g.unsqueeze(-1)).unsqueeze(-1)
    m = (y.float().reshape(*lead, -1, fmt.block) / s).abs()
    k = (m.unsqueeze(-1) - _MAGS.to(y.device)).abs().argmin(-1).to(torch.uint8)
    return (torch.signbit(y.float()).reshape(k.shape).to(torch.uint8) * 8 | k).reshape(y.shape)


class _TrainHook:
    def __init__(self, mode: Mode, fmt: FP4Format, guidance: dict[str, SiteGuidance], rule: str) -> None:
        self.mode, self.fmt, self.guidance, self.rule = mode, fmt, guidance, rule
        self.y: dict[str, torch.Tensor] = {}
        self.codes: dict[str, torch.Tensor] = {}

    def __call__(self, site: HookedSite, x: torch.Tensor) -> torch.Tensor | None:
        if self.mode.quant == "none":
            self.y[site.name] = x.detach().float()
            return None
        b, n, w = x.shape
        g_own = resolve_global_scale(x.detach(), None)  # the trainer's own decode-side g
        if self.mode.records(site.layer):
            gd = self.guidance.get(site.name)
            if gd is None:
                raise ConfigError(f"mode {self.mode.name} records layer {site.layer} but no guidance for {site.name}")
            if tuple(gd.scales.shape[:2]) != (b, n):
                raise ShapeError(
                    f"guidance for {site.name} covers {tuple(gd.scales.shape[:2])} rows, expected {(b, n)}"
                )
            y = guided_round(
                x,
                gd.packed,
                gd.scales,
                gd.g,
                gd.bits,
                self.fmt,
                self.rule,  # type: ignore[arg-type]
                valid=gd.valid,
                fallback_global_scale=g_own,
            )
            codes = codes_on_grid(y, gd.scales, gd.g, self.fmt)
            own = quantize(x.detach(), self.fmt, g_own).codes  # rows without a record used RTN
            codes = torch.where(gd.valid.unsqueeze(-1), codes, own)
        else:
            y = rtn_fake_quant(x, self.fmt, g_own)
            codes = quantize(x.detach(), self.fmt, g_own).codes
        self.y[site.name] = y.detach().float()
        self.codes[site.name] = codes
        return y


def train_forward(
    model: Any,
    tokens: torch.Tensor,
    prompt_len: int,
    mode: Mode,
    fmt: FP4Format,
    guidance: dict[str, SiteGuidance] | None = None,
    rule: str = "bracket",
) -> TrainTrace:
    """One teacher-forced forward over ``tokens`` [B, n] in ``mode``; log-probs of tokens P..n-1."""
    hook = _TrainHook(mode, fmt, guidance or {}, rule)
    with HFSiteHooks(model, hook), torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False).logits[:, prompt_len - 1 : -1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(2, tokens[:, prompt_len:, None]).squeeze(2)
    return TrainTrace(hook.y, hook.codes, lp)
