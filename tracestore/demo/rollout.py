"""The rollout: KV-cache generation (prefill, then one token per forward) with FP4 at every site,
quantized and recorded by ``tracestore.kernels`` as an engine would.

At every hooked site (MoE-block inputs; K/V as they enter the cache, after RoPE) the engine side
quantizes the forward's rows with ``record_from_activations`` into a static ``RecordSlab`` holding
the full 4-bit codes (the engine's packed FP4 GEMM input), and the model consumes those values
dequantized. Each recorded run then takes its rows from the engine's codes with
``record_from_codes`` into its own slab (its sites, its b), which the caller stages once per
forward (``RolloutRecorder.record_slab``). Without a GPU the kernels run their CPU reference.

The decode-side g of NVFP4 (``scales``): ``"static"`` (default) — one calibrated g per site from an
unquantized calibration forward (amax / 2688), fixed for the whole rollout, as engines with
calibrated static activation scales do; ``"token"`` — one g per row (per-token activation scales);
``"forward"`` — amax / 2688 of each forward's tensor on the device (dynamic). MXFP4 has none.

A rollout runs forwards for positions 0..n-2 only: the last sampled token never enters the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tracestore.client.hf.hooks import HFSiteHooks, HookedSite
from tracestore.formats import FP4Format
from tracestore.kernels import RecordSlab, record_from_activations, record_from_codes
from tracestore.kernels._common import fmt_name
from tracestore.packing import unpack_fp4

SCALES = ("static", "token", "forward")


@dataclasses.dataclass
class SiteTrace:
    """What one site saw over positions 0..n-2: ``y`` float32 [B, n-1, w] (the value the model
    consumed there), and when quantized the codes uint8 [B, n-1, w], scale bytes uint8
    [B, n-1, w/block] and decode-side g float32 [B, n-1] (per row)."""

    y: torch.Tensor
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    g: torch.Tensor | None = None


@dataclasses.dataclass
class Rollout:
    """tokens int64 [B, n]; ``logprobs`` float32 [B, n-P] of tokens P..n-1 and ``dist`` float32
    [B, n-P, vocab] (log-softmax) as the rollout computed them when sampling; per-site traces; the
    (start, end) positions of each forward; the static g per site when ``scales`` is "static"."""

    tokens: torch.Tensor
    prompt_len: int
    logprobs: torch.Tensor
    dist: torch.Tensor
    sites: dict[str, SiteTrace]
    forwards: list[tuple[int, int]]
    static_g: dict[str, float] = dataclasses.field(default_factory=dict)


# (start, end, {run: its slab with this forward's rows}, rows per site)
OnForward = Callable[[int, int, Mapping[str, RecordSlab], int, torch.Tensor], None]


def calibrate(model: Any, prompts: torch.Tensor) -> dict[str, float]:
    """Static decode-side g per site: amax / 2688 over one unquantized forward of ``prompts``."""
    amax: dict[str, float] = {}

    def see(site: HookedSite, x: torch.Tensor) -> None:
        amax[site.name] = max(amax.get(site.name, 0.0), float(x.detach().float().abs().amax()))

    with HFSiteHooks(model, see), torch.no_grad():
        model(input_ids=prompts, use_cache=False)
    return {k: (v / 2688.0 if v > 0 else 1.0) for k, v in amax.items()}


class _Engine:
    """The hook: FP4 at every site through the kernels, rows kept for the report and the runs."""

    def __init__(
        self,
        batch: int,
        n_rows: int,
        fmt: FP4Format | None,
        device: torch.device,
        scales: str,
        static_g: dict[str, float],
        runs: Mapping[str, Any],
        capacity: int,
    ) -> None:
        self.batch, self.n_rows, self.fmt, self.device = batch, n_rows, fmt, device
        self.scales, self.static_g, self.runs, self.capacity = scales, static_g, runs, capacity
        self.pos = 0
        self.sites: dict[str, SiteTrace] = {}
        self.engine: RecordSlab | None = None
        self.specs: dict[str, Any] = {}
        self.slabs = {
            name: RecordSlab.allocate(spec.sites, capacity, device) for name, spec in runs.items() if spec.sites
        }
        self.run_specs = {name: {s.name: s for s in spec.sites} for name, spec in runs.items()}
        self.g_dev: dict[str, torch.Tensor] = {}

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

    def bind(self, sites: tuple[HookedSite, ...]) -> None:
        """The engine's slab: every hooked site at b = 4 with the packed FP4 codes it consumes."""
        if self.fmt is None:
            return
        self.specs = {s.name: s.spec(bits=4, format=fmt_name(self.fmt)) for s in sites}
        self.engine = RecordSlab.allocate(tuple(self.specs.values()), self.capacity, self.device, with_fp4=True)

    def _g(self, site: HookedSite, rows: torch.Tensor) -> Any:
        assert self.fmt is not None
        if not self.fmt.has_global_scale or self.scales == "forward":
            return None  # MX: none; forward: amax/2688 of this forward's tensor, on the device
        if self.scales == "token":
            return (rows.detach().float().abs().amax(-1) / 2688.0).contiguous()
        g = self.g_dev.get(site.name)
        if g is None:
            g = self.g_dev[site.name] = torch.tensor([self.static_g[site.name]], device=self.device)
        return g

    def __call__(self, site: HookedSite, x: torch.Tensor) -> torch.Tensor | None:
        b, t, w = x.shape
        sl = slice(self.pos, self.pos + t)
        tr = self._trace(site)
        if self.fmt is None or self.engine is None:
            tr.y[:, sl] = x.detach().float()
            return None
        rows_x = x.detach().reshape(b * t, w).contiguous()
        g = self._g(site, rows_x)
        rec = record_from_activations(rows_x, self.specs[site.name], self.engine[site.name], global_scale=g)
        y = rec.dequantize(self.fmt)  # what the engine's FP4 GEMM consumes
        g_rows = rec.global_scale.contiguous()
        assert rec.fp4 is not None and tr.codes is not None and tr.scales is not None and tr.g is not None
        for run, specs in self.run_specs.items():
            spec = specs.get(site.name)
            if spec is not None:  # the run's b low bits from the engine's own codes
                gr = g_rows if self.fmt.has_global_scale else None
                record_from_codes(rec.fp4, rec.scales, spec, self.slabs[run][site.name], global_scale=gr)
        y = y.reshape(b, t, w).to(x.dtype)  # the model's dtype, as the trainer's guided values
        tr.y[:, sl] = y.float()
        tr.codes[:, sl] = unpack_fp4(rec.fp4).reshape(b, t, w)
        tr.scales[:, sl] = rec.scales.reshape(b, t, -1)
        tr.g[:, sl] = g_rows.reshape(b, t)
        return y


def run_rollout(
    model: Any,
    prompts: torch.Tensor,
    n_new: int,
    *,
    fmt: FP4Format | None,
    scales: str = "static",
    static_g: dict[str, float] | None = None,
    runs: Mapping[str, Any] | None = None,
    tokens: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    on_forward: OnForward | None = None,
    progress: Callable[[int], Any] | None = None,
) -> Rollout:
    """Generate ``n_new`` tokens after ``prompts`` (int64 [B, P]) with a KV cache.

    ``fmt`` None runs unquantized (the BF16 reference). ``scales``: "static" (``static_g`` per site,
    calibrated here from ``prompts`` when not given), "token" or "forward" (see the module).
    ``runs`` ({name: RunSpec}) are recorded: after each forward ``on_forward(start, end, slabs,
    rows, token_ids)`` gets each run's slab with the forward's rows (batch-major: row ``b*T + t``)
    and the forward's input token ids (int64 [B, end - start]).
    ``tokens`` [B, P+n_new] replays given tokens instead of sampling (teacher-forced decode, same
    forwards). ``progress(n)`` is called with the number of positions each forward covered.
    """
    if scales not in SCALES:
        raise ValueError(f"scales must be one of {SCALES}, got {scales!r}")
    batch, plen = prompts.shape
    n = plen + n_new
    if tokens is not None and tuple(tokens.shape) != (batch, n):
        raise ValueError(f"tokens must be [B, P+n_new] = {(batch, n)}, got {tuple(tokens.shape)}")
    device = prompts.device
    if fmt is not None and fmt.has_global_scale and scales == "static" and static_g is None:
        static_g = calibrate(model, prompts)
    state = _Engine(batch, n - 1, fmt, device, scales, static_g or {}, runs or {}, batch * plen)
    out = torch.empty(batch, n, dtype=torch.long, device=device)
    out[:, :plen] = prompts
    logprobs = torch.empty(batch, n_new, dtype=torch.float32, device=device)
    dist: torch.Tensor | None = None
    forwards: list[tuple[int, int]] = []
    with HFSiteHooks(model, state) as hooks, torch.no_grad():
        state.bind(hooks.sites)
        cache = hooks.new_cache()
        start, end = 0, plen
        while True:
            state.pos = start
            logits = (
                model(input_ids=out[:, start:end], **hooks.cache_kwargs(cache), use_cache=True).logits[:, -1].float()
            )
            if cache.get_seq_length() != end:  # e.g. a transformers that ignores the cache keyword
                from tracestore.errors import ConfigError

                raise ConfigError(
                    f"the model did not use the KV cache: it holds {cache.get_seq_length()} positions after "
                    f"a forward up to position {end}; check the transformers version's cache keyword"
                )
            forwards.append((start, end))
            if on_forward is not None and state.slabs:
                on_forward(start, end, state.slabs, batch * (end - start), out[:, start:end])
            if progress is not None:
                progress(end - start)
            lp = torch.log_softmax(logits, dim=-1)
            if dist is None:
                dist = torch.empty(batch, n_new, lp.shape[-1], dtype=torch.float32, device=device)
            dist[:, end - plen] = lp
            nxt = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(1) if tokens is None else tokens[:, end]
            out[:, end] = nxt
            logprobs[:, end - plen] = lp.gather(1, nxt[:, None]).squeeze(1)
            if end == n - 1:
                break
            start, end = end, end + 1
    assert dist is not None
    return Rollout(out, plen, logprobs, dist, state.sites, forwards, dict(static_g or {}))
