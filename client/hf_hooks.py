"""Hooks that see every MoE-block input and the K/V entering the KV cache of a Hugging Face model.

Nothing in the model is edited or monkeypatched:

- MoE-block inputs: a forward pre-hook on each layer's sparse-MoE block (the module that owns the
  ``experts``), which may replace the block's input (fake quantization).
- K/V after the rotary embedding: transformers dispatches attention through
  ``AttentionInterface`` by ``config._attn_implementation``; we register a wrapper of the model's
  own implementation (``sdpa`` or ``eager``) under ``tracestore_<base>`` that receives the
  post-RoPE key/value states. With a KV cache the key/value it receives already include the past,
  so generation uses :meth:`HFSiteHooks.new_cache`, a ``DynamicCache`` whose ``update`` passes the
  *new* K/V through the hook before they are stored (what an FP4 KV cache does); the attention
  wrapper then leaves that layer alone for this call.

The callback ``fn(site, x)`` gets ``x`` as ``[batch, tokens, width]`` in the model's dtype
(K/V heads flattened: ``width = kv_heads * head_dim``, so rows line up with the MoE-input sites'
token rows) and returns a replacement of the same shape, or ``None`` to leave it unchanged.

Example::

    hooks = HFSiteHooks(model, lambda site, x: rtn_fake_quant(x, NVFP4))
    cache = hooks.new_cache()
    out = model(input_ids, **hooks.cache_kwargs(cache), use_cache=True)
    hooks.remove()
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from tracestore.errors import ConfigError, ShapeError, require

if TYPE_CHECKING:
    from torch import nn

SiteKind = Literal["moe_input", "key", "value"]
SiteFn = Callable[["HookedSite", torch.Tensor], "torch.Tensor | None"]

_IMPL_PREFIX = "tracestore_"
# attention module -> (hooks, layer index); weak so a dropped model frees its hooks
_ATTN_OWNERS: weakref.WeakKeyDictionary[Any, tuple[HFSiteHooks, int]] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class HookedSite:
    """One hooked quantization site: ``name`` as in design.md §4 (``layers.3.mlp.input``,
    ``layers.3.attn.k``), its ``kind``, decoder ``layer`` and ``width`` (values per token)."""

    name: str
    kind: SiteKind
    layer: int
    width: int


def site_name(layer: int, kind: SiteKind) -> str:
    """The canonical site name for ``layer`` and ``kind``."""
    suffix = {"moe_input": "mlp.input", "key": "attn.k", "value": "attn.v"}[kind]
    return f"layers.{layer}.{suffix}"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword under which ``model``'s forward takes its KV cache, bound to ``cache``."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ConfigError(
            f"{type(model).__name__} has no decoder layers at .model.layers; expected a transformers "
            "decoder-only causal LM (e.g. Qwen3MoeForCausalLM)"
        )
    return list(layers)


def _moe_block(layer: nn.Module) -> nn.Module | None:
    """The shallowest submodule that owns ``experts`` (the sparse-MoE block), or None (dense layer)."""
    for _, module in sorted(layer.named_modules(), key=lambda kv: kv[0].count(".")):
        if module is not layer and hasattr(module, "experts"):
            return module
    return None


def _attention(layer: nn.Module) -> Any:
    attn = getattr(layer, "self_attn", None)
    if attn is None or not hasattr(attn, "layer_idx"):
        raise ConfigError(f"{type(layer).__name__} has no self_attn with a layer_idx; cannot hook its K/V")
    return attn


def _kv_width(model: Any) -> int:
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * int(head_dim)


def _heads_to_rows(t: torch.Tensor) -> torch.Tensor:
    """[B, heads, T, hd] -> [B, T, heads*hd]."""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def _rows_to_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, w = t.shape
    return t.reshape(b, n, heads, w // heads).transpose(1, 2)


def _base_attention(impl: str, module: nn.Module) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise ConfigError(f"{type(module).__module__} defines no eager_attention_forward")
        return fn  # type: ignore[no-any-return]
    return ALL_ATTENTION_FUNCTIONS[impl]  # type: ignore[no-any-return]


def _hooked_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kw: Any):
    owner = _ATTN_OWNERS.get(module)
    if owner is None:
        raise ConfigError(
            "a tracestore_* attention implementation ran on a module with no HFSiteHooks attached; "
            "call model.set_attn_implementation('sdpa') after HFSiteHooks.remove()"
        )
    hooks, layer = owner
    if layer in hooks._cached:  # the K/V went through the hooked cache on their way in
        hooks._cached.discard(layer)
    else:
        key, value = hooks._kv(layer, key, value)
    return _base_attention(hooks.base_impl, module)(module, query, key, value, *args, **kw)


def _register_impl(base: str) -> str:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = _IMPL_PREFIX + base
    AttentionInterface.register(name, _hooked_attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def _hooked_cache_class() -> type:
    from transformers.cache_utils import DynamicCache

    class HookedCache(DynamicCache):
        """A ``DynamicCache`` that passes each layer's new (post-RoPE) K/V through the hooks
        before storing them."""

        def __init__(self, hooks: HFSiteHooks, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._tracestore_hooks = hooks

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kw: Any):
            hooks = self._tracestore_hooks
            key_states, value_states = hooks._kv(layer_idx, key_states, value_states)
            hooks._cached.add(layer_idx)
            return super().update(key_states, value_states, layer_idx, *args, **kw)

    return HookedCache


class HFSiteHooks:
    """Call ``fn(site, x)`` on every MoE-block input and on the K/V entering the KV cache.

    ``layers`` limits the hooked decoder layers (default all); ``kv=False`` hooks MoE inputs only.
    Works for transformers MoE causal LMs whose decoder layers sit at ``model.model.layers`` with
    ``self_attn`` and a block owning ``experts`` (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, ...).
    Dense layers (no MoE block) get only K/V sites. Use as a context manager or call :meth:`remove`.
    """

    def __init__(self, model: Any, fn: SiteFn, *, layers: Iterable[int] | None = None, kv: bool = True) -> None:
        require("transformers", "demo")
        if not callable(fn):
            raise ConfigError(f"fn must be callable as fn(site, x), got {type(fn).__name__}")
        self.model = model
        self.fn = fn
        decoder = _decoder_layers(model)
        wanted = range(len(decoder)) if layers is None else sorted(set(layers))
        for i in wanted:
            if not 0 <= i < len(decoder):
                raise ConfigError(f"layer {i} is out of range: the model has {len(decoder)} decoder layers")
        cfg = model.config.get_text_config()
        self._kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        kv_width = _kv_width(model)
        self._sites: dict[str, HookedSite] = {}
        self._handles: list[Any] = []
        self._cached: set[int] = set()
        self._kv_layers: set[int] = set()
        for i in wanted:
            block = _moe_block(decoder[i])
            if block is not None:
                site = HookedSite(site_name(i, "moe_input"), "moe_input", i, int(cfg.hidden_size))
                self._sites[site.name] = site
                self._handles.append(block.register_forward_pre_hook(self._moe_pre_hook(site)))
            if kv:
                attn = _attention(decoder[i])
                layer_idx = int(attn.layer_idx)
                for kind in ("key", "value"):
                    s = HookedSite(site_name(layer_idx, kind), kind, layer_idx, kv_width)  # type: ignore[arg-type]
                    self._sites[s.name] = s
                self._kv_layers.add(layer_idx)
                _ATTN_OWNERS[attn] = (self, layer_idx)
        self.previous_impl: str | None = None
        self.base_impl = "sdpa"
        if kv:
            current = str(model.config._attn_implementation or "eager")
            self.base_impl = current.removeprefix(_IMPL_PREFIX)
            if self.base_impl not in ("sdpa", "eager"):
                raise ConfigError(
                    f"K/V hooks wrap the 'sdpa' or 'eager' attention implementation, the model uses "
                    f"{current!r}; load it with attn_implementation='sdpa'"
                )
            self.previous_impl = current
            model.set_attn_implementation(_register_impl(self.base_impl))  # type: ignore[operator]

    @property
    def sites(self) -> tuple[HookedSite, ...]:
        """Hooked sites, in layer order (MoE input, then K, then V per layer)."""
        order = {"moe_input": 0, "key": 1, "value": 2}
        return tuple(sorted(self._sites.values(), key=lambda s: (s.layer, order[s.kind])))

    def new_cache(self) -> Any:
        """A fresh KV cache for generation whose new K/V pass through the hooks as they enter it."""
        return _hooked_cache_class()(self, config=self.model.config)

    def cache_kwargs(self, cache: Any) -> dict[str, Any]:
        """``{name: cache}`` for the model's forward: ``cache`` (transformers >= 5.24 renames it) or
        ``past_key_values`` (older 5.x, where an unknown ``cache=`` is silently ignored)."""
        return cache_kwargs(self.model, cache)

    def _apply(self, site: HookedSite, x: torch.Tensor) -> torch.Tensor:
        y = self.fn(site, x)
        if y is None:
            return x
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ShapeError(f"hook for {site.name} must return None or a tensor of shape {tuple(x.shape)}, got {got}")
        return y.to(x.dtype)

    def _moe_pre_hook(self, site: HookedSite) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            x = args[0]
            if x.dim() != 3:
                raise ShapeError(
                    f"{site.name}: expected the MoE input as [batch, tokens, hidden], got {tuple(x.shape)}"
                )
            return (self._apply(site, x), *args[1:])

        return hook

    def _kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self._kv_layers:
            return key, value
        k = self._apply(self._sites[site_name(layer, "key")], _heads_to_rows(key))
        v = self._apply(self._sites[site_name(layer, "value")], _heads_to_rows(value))
        return _rows_to_heads(k, self._kv_heads), _rows_to_heads(v, self._kv_heads)

    def remove(self) -> None:
        """Detach every hook and restore the model's attention implementation."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for attn, (owner, _) in list(_ATTN_OWNERS.items()):
            if owner is self:
                del _ATTN_OWNERS[attn]
        if self.previous_impl is not None:
            self.model.set_attn_implementation(self.previous_impl)  # type: ignore[operator]
            self.previous_impl = None

    def __enter__(self) -> HFSiteHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def site_outputs(records: dict[str, tuple[torch.Tensor, torch.Tensor, float]], run_spec: Any) -> dict[str, Any]:
    """``RolloutRecorder`` outputs for the sites of ``run_spec`` from full FP4 codes.

    ``records[site] = (codes uint8 [B, T, w] in 0..15, scales uint8 [B, T, w/block], g)``; each
    declared site's low ``bits`` are packed (numerics.md §6) into rows ordered batch-major, which
    matches segments ``[(trajectory_b, start, start+T) for b in batch]``.
    """
    from tracestore.client.recorder import SiteOutput

    from tracestore.packing import pack_bits

    out = {}
    for site in run_spec.sites:
        if site.name not in records:
            raise ConfigError(
                f"run {run_spec.run} declares site {site.name!r} but this forward produced no record for it"
            )
        codes, scales, g = records[site.name]
        b, t, w = codes.shape
        out[site.name] = SiteOutput(pack_bits(codes.reshape(b * t, w), site.bits), scales.reshape(b * t, -1), g)
    return out


class FP4SiteRecorder:
    """NVFP4/MXFP4 fake quantization at every hooked site, recorded into ``RolloutRecorder``\\ s.

    Each site's input is quantized with a per-forward decode-side global scale (``quantize``:
    ``g = amax/2688`` of that forward's tensor), the model consumes the dequantized value, and
    after the forward every recorder gets the sites its run declares (low ``bits`` packed).
    Rows are batch-major: ``segments`` lists one ``(trajectory, start, end)`` per batch row.
    This is the readable CPU/any-device path; ``tracestore.kernels.record_from_activations``
    is the graph-safe GPU capture.

    Example::

        with FP4SiteRecorder(model, [recorder]) as fp4:
            cache = fp4.hooks.new_cache()
            with fp4.forward([("traj-0", 0, 12), ("traj-1", 0, 12)]):
                model(input_ids=prompt, **fp4.hooks.cache_kwargs(cache), use_cache=True)
    """

    def __init__(
        self,
        model: Any,
        recorders: Iterable[Any] = (),
        *,
        fmt: str = "nvfp4",
        fake_quant: bool = True,
        layers: Iterable[int] | None = None,
        kv: bool = True,
    ) -> None:
        from tracestore.formats import get_format

        self.fmt = get_format(fmt)
        self.fake_quant = fake_quant
        self.recorders = list(recorders)
        self.records: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        self._active = False
        self.hooks = HFSiteHooks(model, self._site, layers=layers, kv=kv)
        hooked = {s.name for s in self.hooks.sites}
        for rec in self.recorders:
            missing = [s.name for s in rec.run_spec.sites if s.name not in hooked]
            if missing:
                self.hooks.remove()
                raise ConfigError(
                    f"run {rec.run_spec.run} declares sites this model has no hook for: {missing[:4]}; "
                    f"hooked sites are named like {sorted(hooked)[:3]}"
                )

    def _site(self, site: HookedSite, x: torch.Tensor) -> torch.Tensor | None:
        from tracestore.fp4 import dequantize, quantize

        b, t, w = x.shape
        q = quantize(x.detach().reshape(b * t, w), self.fmt)
        if self._active:
            self.records[site.name] = (q.codes.reshape(b, t, w), q.scales.reshape(b, t, -1), float(q.global_scale))
        return dequantize(q).reshape(b, t, w).to(x.dtype) if self.fake_quant else None

    @contextlib.contextmanager
    def forward(self, segments: Sequence[tuple[str, int, int]]) -> Iterator[dict[str, Any]]:
        """Around one model forward over ``segments``; records it when the block exits cleanly.
        Yields this forward's ``{site: (codes, scales, g)}`` (filled once the forward ran)."""
        self.records = {}
        self._active = True
        try:
            yield self.records
        finally:
            self._active = False
        for rec in self.recorders:
            rec.record_forward(list(segments), site_outputs(self.records, rec.run_spec))

    def remove(self) -> None:
        self.hooks.remove()

    def __enter__(self) -> FP4SiteRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
