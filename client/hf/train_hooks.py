"""Guided FP4 fake quantization for training a transformers model: the trainer's half of TRACE.

:class:`GuidedFP4Hooks` attaches to the same sites :class:`~tracestore.client.hf.hooks.HFSiteHooks`
records in a rollout (every MoE-block input, the post-RoPE K/V entering the KV cache) and replaces
each site's input by its FP4 fake quantization, in forward and backward (straight-through):

- sites with guidance for the microbatch (``GuidanceReader(...).read(plan)`` results, rows aligned
  to the plan) round toward the rollout's recorded codes with :func:`tracestore.kernels.guided_fp4`
  (the CUDA kernel on a GPU, the torch reference on the CPU); rows without a record (padding, the
  unrecorded last position, missing records) fall back to RTN with the trainer's own scales;
- other sites get plain RTN (:func:`tracestore.kernels.rtn_fp4`), or are left alone (``rtn=False``).

A site sees ``x`` as ``[batch, tokens, width]``; its rows, flattened batch-major, must be the
plan's rows: ``MicrobatchPlan.padded(ids, lengths, max_len=tokens)`` for a padded batch,
``MicrobatchPlan.from_cu_seqlens`` for one packed row. The hooks hold no per-forward state, so a
recomputed layer (activation checkpointing) rounds exactly as in its first forward, and the guided
op is a ``torch.library`` custom op that ``torch.compile`` traces without a graph break.

Example::

    hooks = GuidedFP4Hooks(model, fmt="nvfp4")
    reader = GuidanceReader(storage_url, run, device="cuda")
    for plan, batch in microbatches:
        hooks.set_guidance(reader.read(plan))        # before the forward; kept for its backward
        loss = loss_fn(model(**batch).logits, batch)
        loss.backward()
        optimizer.step(); optimizer.zero_grad()
    hooks.remove()
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from tracestore.client.hf.hooks import HFSiteHooks, HookedSite

from tracestore.errors import ConfigError, ShapeError
from tracestore.formats import FP4Format, get_format
from tracestore.guidance import Guidance

# decode-side g from an amax: docs/numerics.md §3 (6 * 448)
_DIVISOR = 2688.0


class GuidedFP4Hooks:
    """FP4 fake quantization of a transformers model's hooked sites for training (see the module).

    ``fmt``: the rollout's format (``"nvfp4"``, ``"mxfp4"``, ``"mxfp4-rceil"``). ``rtn_scale``: the
    decode-side g of RTN (NVFP4 only), for sites without guidance and rows without a record:
    ``"tensor"`` (default; amax of the site's tensor / 2688, a per-forward dynamic scale),
    ``"token"`` (one g per row from the row's amax), a float (one static g for every site) or
    ``{site: g}`` (calibrated static scales; sites missing from it use the tensor's amax).
    ``rtn=False`` leaves sites without guidance unquantized. ``sites``: only these site names are
    quantized (default all hooked sites); ``layers``, ``kv``, ``moe`` choose the hooked sites as
    :class:`HFSiteHooks` does. A compiled model is refused (attach, then ``torch.compile``); so is a
    model that already has a hook set, unless ``stack=True``. Use as a context manager or call
    :meth:`remove`.
    """

    def __init__(
        self,
        model: Any,
        fmt: FP4Format | str = "nvfp4",
        *,
        rtn: bool = True,
        rtn_scale: str | float | Mapping[str, float] = "tensor",
        sites: Iterable[str] | None = None,
        layers: Iterable[int] | None = None,
        kv: bool = True,
        moe: bool = True,
        stack: bool = False,
    ) -> None:
        self.fmt = get_format(fmt)
        if isinstance(rtn_scale, str) and rtn_scale not in ("tensor", "token"):
            raise ConfigError(f"rtn_scale must be 'tensor', 'token', a float or {{site: g}}, got {rtn_scale!r}")
        self.rtn = bool(rtn)
        self.rtn_scale = rtn_scale
        self._guidance: dict[str, Guidance] = {}
        self._static: dict[tuple[str, torch.device], torch.Tensor] = {}
        self.hooks = HFSiteHooks(model, self, layers=layers, kv=kv, moe=moe, stack=stack, owner="GuidedFP4Hooks")
        self.only: frozenset[str] | None = None
        if sites is not None:
            self.only = frozenset(sites)
            unknown = sorted(self.only - {s.name for s in self.hooks.sites})
            if unknown:
                self.hooks.remove()
                raise ConfigError(f"sites {unknown} are not hooked in this model: {[s.name for s in self.hooks.sites]}")

    @property
    def sites(self) -> tuple[HookedSite, ...]:
        return self.hooks.sites

    def set_guidance(self, guidance: Mapping[str, Guidance] | None) -> GuidedFP4Hooks:
        """The records of the next microbatch, ``{site name: Guidance}`` (``GuidanceReader.read``),
        kept until replaced (a checkpointed backward recomputes with them). Artifact entries of the
        read (:class:`~tracestore.artifacts.Routing`, ``LogProbs``) are skipped. Sites not hooked,
        or guidance of another format or width, are refused here rather than mid-forward."""
        from tracestore.artifacts import LogProbs, Routing

        # a read's artifact rows (routing, log-probs) are for other hooks (RoutingReplayHooks)
        guidance = {k: v for k, v in dict(guidance or {}).items() if not isinstance(v, (Routing, LogProbs))}
        widths = {s.name: s.width for s in self.hooks.sites}
        for name, g in guidance.items():
            if name not in widths or (self.only is not None and name not in self.only):
                raise ConfigError(f"guidance for {name}, which the model does not have: hooked sites {list(widths)}")
            if not isinstance(g, Guidance):
                raise ConfigError(f"guidance[{name!r}] must be a tracestore.guidance.Guidance, got {type(g).__name__}")
            if g.fmt != self.fmt:
                raise ConfigError(f"guidance for {name} is {g.fmt}, the hooks quantize {self.fmt}")
            if g.width != widths[name]:
                raise ShapeError(f"guidance for {name} is {g.width} values wide, the site {widths[name]}")
        self._guidance = guidance
        return self

    def _rtn_g(self, site: HookedSite, x2: torch.Tensor) -> torch.Tensor:
        """The RTN decode-side g for ``x2`` [N, width]: one element, or one per row ("token")."""
        mode = self.rtn_scale
        if isinstance(mode, (int, float)) or (isinstance(mode, Mapping) and site.name in mode):
            key = (site.name, x2.device)
            g = self._static.get(key)
            if g is None:
                v = float(mode if isinstance(mode, (int, float)) else mode[site.name])
                g = self._static[key] = torch.tensor(v, dtype=torch.float32, device=x2.device)
            return g
        with torch.no_grad():
            amax = x2.detach().abs().amax(dim=-1) if mode == "token" else x2.detach().abs().amax()
            return amax.float() / _DIVISOR  # 0 or non-finite -> 1 inside the ops

    def __call__(self, site: HookedSite, x: torch.Tensor) -> torch.Tensor | None:
        if self.only is not None and site.name not in self.only:
            return None
        w = x.shape[-1]
        x2 = x.reshape(-1, w)
        g = self._guidance.get(site.name)
        if g is not None:
            if g.n_rows != x2.shape[0]:
                raise ShapeError(
                    f"{site.name}: guidance has {g.n_rows} rows but the site sees {x2.shape[0]} "
                    f"({list(x.shape[:-1])}); read it for this microbatch's plan, rows batch-major"
                )
            fb = self._rtn_g(site, x2) if self.fmt.has_global_scale else None
            return _guided(x2, g, fb).reshape(x.shape)
        if not self.rtn:
            return None
        if not self.fmt.has_global_scale:
            return _rtn(x2, self.fmt, None).reshape(x.shape)
        gr = self._rtn_g(site, x2)
        if gr.dim() == 0:
            return _rtn(x2, self.fmt, gr).reshape(x.shape)
        return _rtn_rows(x2, self.fmt, gr).reshape(x.shape)

    def remove(self) -> None:
        """Detach every hook."""
        self.hooks.remove()
        self._guidance = {}

    def __enter__(self) -> GuidedFP4Hooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _guided(x2: torch.Tensor, g: Guidance, fb: torch.Tensor | None) -> torch.Tensor:
    from tracestore.kernels import guided_fp4

    return guided_fp4(x2, g, fallback_global_scale=fb)


def _rtn(x2: torch.Tensor, fmt: FP4Format, g: torch.Tensor | None) -> torch.Tensor:
    from tracestore.kernels import rtn_fp4

    return rtn_fp4(x2, fmt, g)


def _rtn_rows(x2: torch.Tensor, fmt: FP4Format, g: torch.Tensor) -> torch.Tensor:
    """RTN with one decode-side g per row: the guided op with no record on any row falls back to
    exactly that (docs/numerics.md §8), with straight-through backward."""
    from tracestore.formats import packed_row_bytes
    from tracestore.kernels import guided_fp4

    n, w = x2.shape
    none = Guidance(
        torch.zeros(n, packed_row_bytes(w, 1), dtype=torch.uint8, device=x2.device),
        torch.zeros(n, w // fmt.block, dtype=torch.uint8, device=x2.device),
        g,
        1,
        fmt,
        valid=torch.zeros(n, dtype=torch.bool, device=x2.device),
    )
    return guided_fp4(x2, none)


__all__ = ["GuidedFP4Hooks"]
