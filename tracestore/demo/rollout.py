"""The rollout: KV-cache generation (prefill, then one token per forward) with FP4 fake-quant.

Every hooked site (MoE-block inputs; K/V as they enter the cache, after RoPE) is quantized with
NVFP4 and a per-forward decode-side global scale ``g = amax/2688`` of that forward's tensor, as an
inference engine does; the dequantized value is what the model consumes. The full 4-bit codes,
scale bytes and ``g`` of every forward are kept (and handed to ``on_forward`` for recording).
A rollout runs forwards for positions 0..n-2 only: the last sampled token never enters the model
(docs/data-model.md, "Trajectory seals").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from tracestore.client.hf_hooks import HFSiteHooks, HookedSite
from tracestore.errors import ConfigError
from tracestore.formats import FP4Format
from tracestore.fp4 import dequantize, quantize


@dataclasses.dataclass
class SiteTrace:
    """What one site saw over positions 0..n-2: ``y`` float32 [B, n-1, w] (the value the model
    consumed there), and when quantized the codes uint8 [B, n-1, w], scale bytes uint8
    [B, n-1, w/block] and decode-side g float32 [B, n-1] (one value per forward)."""

    y: torch.Tensor
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    g: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class ForwardRecord:
    """One site's quantization outcome in one forward: rows [B, T, ...] at positions [start, start+T)."""

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: float


@dataclasses.dataclass
class Rollout:
    """tokens int64 [B, n]; logprobs float32 [B, n-P] of tokens P..n-1 as the rollout computed
    them when sampling; per-site traces; the (start, end) positions of each forward."""

    tokens: torch.Tensor
    prompt_len: int
    logprobs: torch.Tensor
    sites: dict[str, SiteTrace]
    forwards: list[tuple[int, int]]


OnForward = Callable[[int, int, dict[str, ForwardRecord]], None]


class _SiteState:
    """Buffers the hook fills; ``pos`` is the first position of the running forward."""

    def __init__(self, batch: int, n_rows: int, fmt: FP4Format | None, device: torch.device) -> None:
        self.batch, self.n_rows, self.fmt, self.device = batch, n_rows, fmt, device
        self.pos = 0
        self.sites: dict[str, SiteTrace] = {}
        self.forward: dict[str, ForwardRecord] = {}

    def _trace(self, site: HookedSite) -> SiteTrace:
        tr = self.sites.get(site.name)
        if tr is None:
            shape = (self.batch, self.n_rows)
            tr = SiteTrace(torch.zeros(*shape, site.width, dtype=torch.float32, device=self.device))
            if self.fmt is not None:
                tr.codes = torch.zeros(*shape, site.width, dtype=torch.uint8, device=self.device)
                tr.scales = torch.zeros(*shape, site.width // self.fmt.block, dtype=torch.uint8, device=self.device)
                tr.g = torch.zeros(*shape, dtype=torch.float32, device=self.device)
            self.sites[site.name] = tr
        return tr

    def __call__(self, site: HookedSite, x: torch.Tensor) -> torch.Tensor | None:
        b, t, w = x.shape
        sl = slice(self.pos, self.pos + t)
        tr = self._trace(site)
        if self.fmt is None:
            tr.y[:, sl] = x.float()
            return None
        q = quantize(x.detach().reshape(b * t, w), self.fmt)  # per-forward g from this tensor's amax
        y = dequantize(q).reshape(b, t, w).to(x.dtype)
        codes, scales = q.codes.reshape(b, t, w), q.scales.reshape(b, t, -1)
        tr.y[:, sl] = y.float()
        if tr.codes is None or tr.scales is None or tr.g is None:  # _trace allocates them whenever fmt is set
            raise ConfigError(f"{site.name}: quantized trace without code/scale buffers")
        tr.codes[:, sl], tr.scales[:, sl] = codes, scales
        tr.g[:, sl] = float(q.global_scale)
        self.forward[site.name] = ForwardRecord(codes, scales, float(q.global_scale))
        return y


def run_rollout(
    model: Any,
    prompts: torch.Tensor,
    n_new: int,
    *,
    fmt: FP4Format | None,
    tokens: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    on_forward: OnForward | None = None,
    progress: Callable[[int], Any] | None = None,
) -> Rollout:
    """Generate ``n_new`` tokens after ``prompts`` (int64 [B, P]) with a KV cache.

    ``fmt`` None runs unquantized (the BF16 reference). ``tokens`` [B, P+n_new] replays given
    tokens instead of sampling (teacher-forced decode, same forwards). ``on_forward(start, end,
    records)`` is called after each forward with that forward's per-site quantization outcomes.
    ``progress(n)`` is called with the number of positions each forward covered.
    """
    batch, plen = prompts.shape
    n = plen + n_new
    if tokens is not None and tuple(tokens.shape) != (batch, n):
        raise ValueError(f"tokens must be [B, P+n_new] = {(batch, n)}, got {tuple(tokens.shape)}")
    device = prompts.device
    state = _SiteState(batch, n - 1, fmt, device)
    out = torch.empty(batch, n, dtype=torch.long, device=device)
    out[:, :plen] = prompts
    logprobs = torch.empty(batch, n_new, dtype=torch.float32, device=device)
    forwards: list[tuple[int, int]] = []
    with HFSiteHooks(model, state) as hooks, torch.no_grad():
        cache = hooks.new_cache()
        start, end = 0, plen
        while True:
            state.pos, state.forward = start, {}
            logits = (
                model(input_ids=out[:, start:end], **hooks.cache_kwargs(cache), use_cache=True).logits[:, -1].float()
            )
            if cache.get_seq_length() != end:  # e.g. a transformers that ignores the cache keyword
                raise ConfigError(
                    f"the model did not use the KV cache: it holds {cache.get_seq_length()} positions after "
                    f"a forward up to position {end}; check the transformers version's cache keyword"
                )
            forwards.append((start, end))
            if on_forward is not None and state.forward:
                on_forward(start, end, state.forward)
            if progress is not None:
                progress(end - start)
            lp = torch.log_softmax(logits, dim=-1)
            nxt = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(1) if tokens is None else tokens[:, end]
            out[:, end] = nxt
            logprobs[:, end - plen] = lp.gather(1, nxt[:, None]).squeeze(1)
            if end == n - 1:
                break
            start, end = end, end + 1
    return Rollout(out, plen, logprobs, state.sites, forwards)
