"""The training side: real training steps on a copy of the model, one per mode.

Modes (:func:`standard_modes`): BF16 reference (no quantization), vanilla RTN QAT (every site RTN
with the trainer's own scales) and TRACE (the public hook ``GuidedFP4Hooks``: ``guided_fp4`` with
the rollout's records at recorded sites, RTN elsewhere). Rows without a record — the last token of
each trajectory never entered a rollout forward — fall back to RTN with the trainer's own scales.

Each step is a teacher-forced forward over the rollout's tokens, a policy-gradient loss on the
generated tokens (a fixed reward per trajectory, advantages centred over the batch), backward and an
AdamW step. Before each update the step's forward is compared with the rollout: per-token
log-probability differences, KL(rollout || trainer) of the next-token distributions, and per site
the MSE of the values the model consumed and the FP4 codes that differ.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from tracestore.client.hf.hooks import HFSiteHooks, HookedSite
from tracestore.client.hf.train_hooks import GuidedFP4Hooks
from tracestore.demo import fidelity
from tracestore.demo.modes import Mode, standard_modes  # noqa: F401  (the demo's modes, used with training)
from tracestore.demo.rollout import Rollout
from tracestore.formats import E2M1_MAGNITUDES, FP4Format
from tracestore.fp4 import quantize_blocks, scale_values
from tracestore.guidance import Guidance

_MAGS = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)


def codes_on_grid(y: torch.Tensor, scales: torch.Tensor, g: torch.Tensor | float, fmt: FP4Format) -> torch.Tensor:
    """E2M1 codes of fake-quantized ``y`` [..., w] on the grid ``float(sf)*g`` (``g`` one value or
    one per row): the nearest magnitude (gaps are >= 0.5 codewords; the bf16 cast of y moves a
    value by <= 2**-8 relative)."""
    lead = y.shape[:-1]
    gt = torch.as_tensor(g, dtype=torch.float32, device=y.device)
    s = scale_values(scales, fmt).unsqueeze(-1) * (gt.reshape(*lead, 1, 1) if gt.numel() > 1 else gt.reshape(()))
    m = (y.float().reshape(*lead, -1, fmt.block) / s).abs()
    k = (m.unsqueeze(-1) - _MAGS.to(y.device)).abs().argmin(-1).to(torch.uint8)
    return (torch.signbit(y.float()).reshape(k.shape).to(torch.uint8) * 8 | k).reshape(y.shape)


def effective_g(g: Guidance) -> torch.Tensor:
    """Per row: the record's decode-side g times its token scale (a per-row g is a token scale)."""
    n = g.n_rows
    gs = torch.as_tensor(g.global_scale, dtype=torch.float32, device=g.scales.device).expand(n)
    return gs * g.token_scales if g.token_scales is not None else gs.clone()


def rtn_codes(x2: torch.Tensor, fmt: FP4Format, g: torch.Tensor | None) -> torch.Tensor:
    """The trainer's own RTN codes of ``x2`` [N, w] with decode-side g (one, or one per row)."""
    n, w = x2.shape
    gg = None
    if fmt.has_global_scale and g is not None:
        gg = torch.where(torch.isfinite(g) & (g != 0), g, torch.ones_like(g)).float()
        gg = gg.reshape(n, 1) if gg.numel() > 1 else gg.reshape(())
    codes, _ = quantize_blocks(x2.float().reshape(n, -1, fmt.block), fmt, gg)
    return codes.reshape(n, w)


class _Observed(GuidedFP4Hooks):
    """The public hook, also keeping what each site consumed and the FP4 codes it chose."""

    y: dict[str, torch.Tensor]
    codes: dict[str, torch.Tensor]

    def __init__(self, model: Any, fmt: FP4Format, shape: tuple[int, int], **kw: Any) -> None:
        self.shape, self.y, self.codes = shape, {}, {}
        super().__init__(model, fmt, **kw)

    def __call__(self, site: HookedSite, x: torch.Tensor) -> torch.Tensor | None:
        out = super().__call__(site, x)
        y = x if out is None else out
        x2 = x.detach().reshape(-1, x.shape[-1])
        y2 = y.detach().reshape(-1, x.shape[-1])
        own_g = self._rtn_g(site, x2) if self.fmt.has_global_scale else None
        codes = rtn_codes(x2, self.fmt, own_g)
        g = self._guidance.get(site.name)
        if g is not None:
            grid = codes_on_grid(y2, g.scales, effective_g(g), self.fmt)
            codes = torch.where(g.valid.reshape(-1, 1), grid, codes) if g.valid is not None else grid
        b, n = self.shape
        self.y[site.name] = y2.float().reshape(b, n, -1)
        self.codes[site.name] = codes.reshape(b, n, -1)
        return out


class _Plain:
    """The BF16 mode's observer: the site values, unchanged."""

    y: dict[str, torch.Tensor]
    codes: dict[str, torch.Tensor]

    def __init__(self, model: Any, shape: tuple[int, int]) -> None:
        self.shape, self.y, self.codes = shape, {}, {}
        self.hooks = HFSiteHooks(model, self)

    def __call__(self, site: HookedSite, x: torch.Tensor) -> None:
        self.y[site.name] = x.detach().float().reshape(*self.shape, -1)

    def remove(self) -> None:
        self.hooks.remove()


@dataclasses.dataclass
class StepStats:
    """One training step of one mode, measured on its forward before the update."""

    step: int
    logp_mean: float  # mean |log p_train - log p_rollout| over the generated tokens
    logp_max: float
    kl_mean: float  # mean KL(rollout || trainer) of the next-token distributions
    loss: float
    sites: dict[str, fidelity.SiteStats]


def advantages(roll: Rollout, vocab: int) -> torch.Tensor:
    """A fixed reward per trajectory (its share of generated tokens in the lower half of the
    vocabulary), centred over the batch: what a policy-gradient step needs, nothing more."""
    r = (roll.tokens[:, roll.prompt_len :] < vocab // 2).float().mean(1)
    return r - r.mean() if r.numel() > 1 else r - 0.5


def train_steps(
    base: Any,
    roll: Rollout,
    source: Rollout,
    mode: Mode,
    fmt: FP4Format,
    guidance: Mapping[str, Guidance] | None,
    *,
    rtn_scale: str | float | Mapping[str, float] = "tensor",
    steps: int = 3,
    lr: float = 1e-4,
) -> list[StepStats]:
    """``steps`` training steps of ``mode`` on a copy of ``base`` over ``roll.tokens``; ``source``
    is the rollout whose site values and token distributions the trainer's are compared with (the
    BF16 replay of the same tokens for the BF16 mode). ``guidance`` ({site: Guidance}, rows
    batch-major over ``roll.tokens``) for TRACE."""
    model = copy.deepcopy(base).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tokens, p = roll.tokens, roll.prompt_len
    shape = (int(tokens.shape[0]), int(tokens.shape[1]))
    obs: Any
    if mode.quant == "none":
        obs = _Plain(model, shape)
    else:
        obs = _Observed(model, fmt, shape, rtn_scale=rtn_scale)
        obs.set_guidance({k: v for k, v in (guidance or {}).items() if mode.records(int(k.split(".")[1]))})
    adv = advantages(roll, int(roll.dist.shape[-1]))
    out: list[StepStats] = []
    try:
        for step in range(steps):
            logits = model(input_ids=tokens, use_cache=False).logits[:, p - 1 : -1].float()
            lp_all = torch.log_softmax(logits, dim=-1)
            lp = lp_all.gather(2, tokens[:, p:, None]).squeeze(2)
            with torch.no_grad():
                d = (lp - source.logprobs).abs()
                kl = (source.dist.exp() * (source.dist - lp_all)).sum(-1)
                sites = {
                    name: fidelity.site_stats(st.y, obs.y[name], st.codes, obs.codes.get(name))
                    for name, st in source.sites.items()
                }
            loss = -(adv[:, None] * lp).mean()
            stats = StepStats(step, float(d.mean()), float(d.max()), float(kl.mean()), float(loss.detach()), sites)
            out.append(stats)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        obs.remove()
    return out
