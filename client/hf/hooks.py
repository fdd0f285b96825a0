"""Hooks that see every MoE-block input and the K/V entering the KV cache of a transformers model.

Nothing in the model is edited or monkeypatched. Where the hooks go comes from the model's layout
(:mod:`tracestore.client.hf.layouts`: decoder-layer list, attention module, MoE block, shared
expert):

- MoE-block inputs: a forward pre-hook on each layer's sparse-MoE block, which may replace the
  block's input (fake quantization); in a decoder layer that holds its experts itself (Gemma 4), on
  the module the layout names (``Layout.moe_inline``: the experts, whose flattened token rows are
  shown to the callback as ``[batch, tokens, hidden]``). A shared expert that sits beside the block
  and takes the same input gets the same replacement (one site, one callback call), as in an FP4
  engine that quantizes the MoE layer's input once for routed and shared experts; shared experts
  inside the block consume its hooked input anyway.
- K/V entering the KV cache: a forward pre-hook on each attention module that writes the cache hands
  the module, in place of its cache argument, a tap whose ``update(first, second, layer_idx)``
  passes the new tensors through the callback and then on to the cache: the forward's own, or in a
  forward without one (a training forward, ``use_cache=False``) a scratch cache that lives for that
  forward, so the attention runs the code and values it runs in a prefill. So the hooks see exactly
  what the attention caches, post-RoPE K and V for multi-head attention and the normalized latent
  and rotary key for MLA, once per new token, with a cache or without, in ``generate()`` with
  whatever cache it makes, under any attention implementation. Layers without such an attention
  (linear attention, Mamba) have no K/V sites, as dense layers have no MoE-input site. A decoder
  layer with several attention modules (LongCat-Flash) has K/V sites for each.

Sites are named ``layers.{i}.{suffix}`` with ``i`` the decoder layer's index: ``mlp.input`` (the
MoE block's input), ``attn.k`` and ``attn.v`` (post-RoPE key and value rows, K/V heads flattened),
and for MLA ``attn.kv_latent`` (the latent after ``kv_a_layernorm``, width kv_lora_rank) and
``attn.k_rope`` (the post-RoPE rotary key, width qk_rope_head_dim). The second, third, ... attention
module of a decoder layer (LongCat-Flash) names its sites ``attn1.*``, ``attn2.*``, ...

The callback ``fn(site, x)`` gets ``x`` as ``[batch, tokens, width]`` in the model's dtype (heads
flattened: rows line up with the MoE-input sites' token rows) and returns a replacement of the same
shape, or ``None`` to leave it unchanged.

Example::

    hooks = HFSiteHooks(model, lambda site, x: rtn_fake_quant(x, NVFP4))
    tokens = model.generate(input_ids, max_new_tokens=32, **hooks.cache_kwargs(hooks.new_cache()))
    hooks.remove()
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from tracestore.client.hf.layouts import KVStyle, Layout, SiteKind, decoder_layers, layout_for, text_config

from tracestore.errors import ConfigError, DTypeError, ShapeError, require

if TYPE_CHECKING:
    from torch import nn

SiteFn = Callable[["HookedSite", torch.Tensor], "torch.Tensor | None"]
_Slot = tuple[int, int]  # (decoder layer, attention module within it): where K/V enter the cache

_CACHE_ARGS = ("cache", "past_key_values", "past_key_value")


@dataclasses.dataclass(frozen=True)
class HookedSite:
    """One hooked quantization site: ``name`` (``layers.3.mlp.input``, ``layers.3.attn.k``, ...),
    its record ``kind`` (``moe_input``, ``key``, ``value``, or ``other`` for MLA's latent),
    decoder ``layer`` and ``width`` (values per token)."""

    name: str
    kind: SiteKind
    layer: int
    width: int

    def spec(self, bits: int = 1, format: str = "nvfp4") -> Any:
        """This site as a ``tracestore.records.SiteSpec`` (for a ``RunSpec``)."""
        from tracestore.records import SiteSpec

        return SiteSpec(self.name, self.kind, self.layer, self.width, format=format, bits=bits)


def site_name(layer: int, kind_or_suffix: str) -> str:
    """The site name for ``layer``: ``kind_or_suffix`` is ``moe_input``, ``key``, ``value`` or a
    suffix such as ``attn.kv_latent``."""
    suffix = {"moe_input": "mlp.input", "key": "attn.k", "value": "attn.v"}.get(kind_or_suffix, kind_or_suffix)
    return f"layers.{layer}.{suffix}"


def _with_prefix(suffix: str, prefix: str) -> str:
    """``attn.k`` with prefix ``attn1`` -> ``attn1.k`` (K/V sites of a second attention module)."""
    head, dot, rest = suffix.partition(".")
    return f"{prefix}.{rest}" if dot and head == "attn" else suffix


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword under which ``model``'s forward takes its KV cache, bound to ``cache``."""
    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def _cache_param(attn: nn.Module, where: str) -> tuple[str, int | None]:
    """The attention forward's cache parameter: name and positional index (None: keyword only)."""
    params = list(inspect.signature(attn.forward).parameters.values())
    for name in _CACHE_ARGS:
        for i, p in enumerate(params):
            if p.name == name:
                positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                return name, (i if positional else None)
    raise ConfigError(
        f"{where} takes no KV-cache argument ({' / '.join(_CACHE_ARGS)}); "
        "its K/V cannot be hooked: pass kv=False, or a Layout whose attention path names the module that "
        "writes the cache"
    )


class _CacheTap:
    """What a hooked attention module sees as its KV cache: ``update`` passes the new tensors
    through the hooks and on to the real cache; everything else is the real cache's. In a forward
    without a cache the real one is a scratch cache that lives for that forward (what a prefill
    would fill), so the attention runs the same code with the same values as it does in
    generation."""

    def __init__(self, hooks: HFSiteHooks, layer: _Slot, cache: Any) -> None:
        self._hooks, self._layer, self._cache = hooks, layer, cache

    def update(self, first: torch.Tensor, second: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        first, second = self._hooks._kv(self._layer, first, second)
        return self._cache.update(first, second, layer_idx, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_cache"], name)


# the hook sets attached to each model, keyed by its first decoder layer (its wrappers share it)
_ATTACHED: weakref.WeakKeyDictionary[Any, list[HFSiteHooks]] = weakref.WeakKeyDictionary()


def _refuse_compiled(model: Any, owner: str) -> None:
    """A compiled graph does not see hooks added to its module later: refuse, naming compile."""
    compiled = [
        name or "the model"
        for name, module in model.named_modules()
        if getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod")
    ]
    if hasattr(model, "_orig_mod"):
        compiled.insert(0, "the model (a torch.compile wrapper)")
    if compiled:
        raise ConfigError(
            f"{owner} on a torch.compile'd module ({compiled[0]}): a compiled graph does not run hooks added "
            "after it was compiled, so they would silently not apply; attach the hooks to the plain model, then "
            "compile it (torch.compile(model) after the hooks)"
        )


def _rows(site: HookedSite, t: torch.Tensor) -> torch.Tensor:
    """[B, heads, T, hd] -> [B, T, heads*hd], checked against the site's width."""
    if t.dim() != 4 or t.shape[1] * t.shape[3] != site.width:
        raise ShapeError(
            f"{site.name}: expected the cache update's tensor as [batch, heads, tokens, head_dim] with "
            f"heads x head_dim = {site.width}, got {tuple(t.shape)}"
        )
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


class HFSiteHooks:
    """Call ``fn(site, x)`` on every MoE-block input and on the K/V entering the KV cache.

    One line for the decoder-only MoE models of transformers, multimodal wrappers included (the
    hooks resolve to the language model): ``HFSiteHooks(model, fn)``, Gemma 4 (experts held by the
    decoder layer itself) and LongCat-Flash (two attention modules per decoder layer) included; a
    layer that holds its experts itself under a layout without ``moe_inline`` is refused with the
    reason. ``layers`` limits the hooked decoder layers (default all); ``kv=False`` hooks MoE inputs
    only, ``moe=False`` K/V only; ``layout`` overrides the registered
    :class:`~tracestore.client.hf.layouts.Layout`. Use as a context manager or call :meth:`remove`.
    A model compiled with ``torch.compile`` (or holding a compiled submodule) is refused: hook
    first, then compile. A second hook set on a model that has one is refused unless ``stack=True``
    (both run, in attach order); ``owner`` names this set in those errors.
    """

    def __init__(
        self,
        model: Any,
        fn: SiteFn,
        *,
        layers: Iterable[int] | None = None,
        kv: bool = True,
        layout: Layout | None = None,
        moe: bool = True,
        stack: bool = False,
        owner: str = "HFSiteHooks",
    ) -> None:
        require("transformers", "demo")
        if not callable(fn):
            raise ConfigError(f"fn must be callable as fn(site, x), got {type(fn).__name__}")
        _refuse_compiled(model, owner)
        self.model = model
        self.fn = fn
        self.owner = owner
        cfg = text_config(model)
        self.model_type, self.layout = layout_for(model)
        if layout is not None:
            self.layout = layout
        self.layers_path, decoder = decoder_layers(model, self.layout)
        self._key = decoder[0] if len(decoder) else model  # every wrapper of this model reaches the same layers
        attached = _ATTACHED.setdefault(self._key, [])
        if attached and not stack:
            raise ConfigError(
                f"{owner}: this model already has {', '.join(h.owner for h in attached)} attached at "
                f"{self.layers_path}; a second hook set would run after it unnoticed (a recorder would record "
                "already-rounded inputs): remove() the first, or pass stack=True to run both in attach order"
            )
        wanted = range(len(decoder)) if layers is None else sorted(set(layers))
        for i in wanted:
            if not 0 <= i < len(decoder):
                raise ConfigError(f"layer {i} is out of range: the model has {len(decoder)} decoder layers")
        self._sites: dict[str, HookedSite] = {}
        self._order: dict[str, int] = {}
        self._kv_sites: dict[_Slot, tuple[HookedSite, HookedSite]] = {}
        self._sharing: set[int] = set()  # layers whose shared expert sits beside the MoE block
        self._memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # such a layer -> (input, replacement)
        self._pending: set[_Slot] = set()  # attention modules running that have not written K/V yet
        self._lead: dict[int, tuple[int, ...]] = {}  # layer with inline experts -> its input's [batch, tokens]
        self._handles: list[Any] = []
        self._kv_free: dict[int, str] = {}
        self._scratch_cache: Any = None  # the K/V of a forward run without a cache, for that forward
        try:
            if kv:
                parent = self.layers_path.rpartition(".")[0]
                backbone = model.get_submodule(parent) if parent else model
                self._handles.append(backbone.register_forward_pre_hook(self._drop_scratch))
                self._handles.append(backbone.register_forward_hook(self._drop_scratch))
            for i in wanted:
                self._hook_layer(i, decoder[i], cfg, kv, moe)
            moe_layers = {s.layer for s in self._sites.values() if s.kind == "moe_input"}
            inline = [i for i in wanted if moe and i not in moe_layers and hasattr(decoder[i], "experts")]
            if inline:
                raise ConfigError(
                    f"{self.layers_path}.{inline[0]} ({type(decoder[inline[0]]).__name__}) holds its experts itself: "
                    "there is no MoE block module whose input is the layer's [batch, tokens, hidden] MoE input, "
                    "and this layout names no moe_inline module taking it (moe=False hooks the K/V only)"
                )
            if kv and wanted and not self._kv_sites and not self._kv_free:
                raise ConfigError(
                    f"{self.model_type or type(model).__name__}: no hooked decoder layer has an attention module at "
                    f"{self.layout.attention!r}; register its layout (tracestore.client.hf.layouts.register_layout)"
                )
        except BaseException:
            self.remove()
            raise
        attached.append(self)

    def _add(self, site: HookedSite) -> HookedSite:
        self._order[site.name] = len(self._order)
        self._sites[site.name] = site
        return site

    def _hook_layer(self, i: int, layer: nn.Module, cfg: Any, kv: bool, moe: bool) -> None:
        where = f"{self.layers_path}.{i}"
        block = self.layout.moe_block(layer) if moe else None
        if block is not None:
            site = self._add(HookedSite(site_name(i, "moe_input"), "moe_input", i, int(cfg.hidden_size)))
            self._handles.append(block.register_forward_pre_hook(self._moe_pre_hook(site, "MoE block")))
            shared = self.layout.shared_expert(layer, block)
            if shared is not None and not any(m is shared[1] for m in block.modules()):
                # beside the block: it takes the block's input, so it gets the same replacement
                self._sharing.add(i)
                what = f"shared expert {shared[0]}"
                self._handles.append(shared[1].register_forward_pre_hook(self._moe_pre_hook(site, what)))
                self._handles.append(layer.register_forward_pre_hook(self._forget(i)))
                self._handles.append(layer.register_forward_hook(self._forget(i)))
        inner = self.layout.inline_moe(layer) if moe and block is None else None
        if inner is not None:  # experts held by the layer: hook the module that takes the MoE input
            site = self._add(HookedSite(site_name(i, "moe_input"), "moe_input", i, int(cfg.hidden_size)))
            what = f"{self.layout.moe_inline} module of {where}"
            self._handles.append(layer.register_forward_pre_hook(self._lead_shape(i), with_kwargs=True))
            self._handles.append(inner.register_forward_pre_hook(self._inline_pre_hook(site, what)))
        if not kv:
            return
        why = self.layout.kv_free(cfg, i, layer)
        if why is not None:
            self._kv_free[i] = why  # linear attention / Mamba / conv: nothing enters a KV cache
            return
        attn = self.layout.attention_module(layer)
        if attn is None:
            if self.layout.no_kv:
                raise ConfigError(
                    f"{where} ({type(layer).__name__}) has neither an attention module at {self.layout.attention!r} "
                    f"nor an attention-less mixer at one of {list(self.layout.no_kv)}; its layout does not fit "
                    f"this model ({self.model_type})"
                )
            return
        several = isinstance(attn, torch.nn.ModuleList)  # several attention modules in the layer (LongCat-Flash)
        for j, module in enumerate(attn if several else [attn]):
            style: KVStyle = self.layout.kv_style(module)
            widths = style.widths(cfg, module)
            prefix = "attn" if j == 0 else f"attn{j}"
            first, second = (
                self._add(HookedSite(site_name(i, _with_prefix(suffix, prefix)), kind, i, int(w)))
                for (suffix, kind), w in zip(style.sites, widths, strict=True)
            )
            slot = (i, j)
            self._kv_sites[slot] = (first, second)
            path = f"{self.layout.attention}.{j}" if several else self.layout.attention
            owner = f"{where}.{path} ({type(module).__name__})"
            param, pos = _cache_param(module, owner)
            pre = self._attn_pre_hook(slot, param, pos)
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._attn_post_hook(slot, owner)))

    @property
    def sites(self) -> tuple[HookedSite, ...]:
        """Hooked sites in layer order (MoE input, then each attention module's two K/V sites)."""
        return tuple(sorted(self._sites.values(), key=lambda s: (s.layer, self._order[s.name])))

    def new_cache(self) -> Any:
        """A fresh KV cache for the model: a ``DynamicCache``, or the model's own cache class where
        it has one (MiniMax). Any cache works: the hooks tap what the attention writes into
        whichever cache its forward gets, so ``generate()`` needs none passed."""
        from transformers.cache_utils import Cache, DynamicCache

        supports = getattr(self.model, "_supports_default_dynamic_cache", None)
        if supports is None or supports():
            return DynamicCache(config=self.model.config)
        module = sys.modules[type(self.model).__module__]
        own = [
            c
            for c in vars(module).values()
            if isinstance(c, type) and issubclass(c, Cache) and c.__module__ == module.__name__
        ]
        if len(own) != 1:
            raise ConfigError(
                f"{type(self.model).__name__} does not take a DynamicCache and defines {len(own)} cache classes; "
                "pass no cache (the model makes its own)"
            )
        return own[0]()

    def cache_kwargs(self, cache: Any) -> dict[str, Any]:
        """``{name: cache}`` for the model's forward or ``generate()``: ``cache``
        (transformers >= 5.24 renames it) or ``past_key_values`` (older 5.x, where an unknown
        ``cache=`` is silently ignored)."""
        return cache_kwargs(self.model, cache)

    def _apply(self, site: HookedSite, x: torch.Tensor) -> torch.Tensor:
        try:
            y = self.fn(site, x)
        except (ShapeError, DTypeError) as exc:
            if site.name in str(exc):
                raise
            raise type(exc)(f"{site.name} (input {tuple(x.shape)}, {x.dtype}): {exc}") from exc
        if y is None:
            return x
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ShapeError(f"hook for {site.name} must return None or a tensor of shape {tuple(x.shape)}, got {got}")
        return y.to(x.dtype)

    def _moe_value(self, site: HookedSite, x: torch.Tensor, what: str) -> torch.Tensor:
        """The replacement of the MoE block's input; a shared expert beside the block that takes the
        same tensor gets the same replacement (the callback runs once per layer and forward)."""
        sharing = site.layer in self._sharing
        memo = self._memo.get(site.layer) if sharing else None
        if memo is not None:
            seen, y = memo
            if seen is x or (seen.shape == x.shape and torch.equal(seen, x)):
                return y
            raise ShapeError(
                f"{site.name}: the {what} of layer {site.layer} received another tensor {tuple(x.shape)} than the "
                f"{tuple(seen.shape)} its MoE block and shared expert share; the layout's shared path "
                f"{self.layout.shared!r} does not fit this model"
            )
        if x.dim() != 3 or x.shape[-1] != site.width:
            raise ShapeError(
                f"{site.name}: expected the {what}'s input as [batch, tokens, {site.width}], got {tuple(x.shape)}"
            )
        y = self._apply(site, x)
        if sharing:
            self._memo[site.layer] = (x, y)
        return y

    def _moe_pre_hook(self, site: HookedSite, what: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            if not args or not isinstance(args[0], torch.Tensor):
                raise ShapeError(
                    f"{site.name}: the {what} was called without its input [batch, tokens, {site.width}] as "
                    "the first positional argument"
                )
            return (self._moe_value(site, args[0], what), *args[1:])

        return hook

    def _lead_shape(self, layer: int) -> Callable[..., None]:
        """Pre-hook on a decoder layer holding its experts: remember its input's [batch, tokens]."""

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor) and x.dim() >= 2:
                self._lead[layer] = tuple(x.shape[:-1])

        return hook

    def _inline_pre_hook(self, site: HookedSite, what: str) -> Callable[..., Any]:
        """Pre-hook on the module of a decoder layer that takes its MoE input with the tokens
        flattened (``[batch*tokens, hidden]``): the callback sees ``[batch, tokens, hidden]``."""

        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0] if args else None
            lead = self._lead.get(site.layer)
            if not isinstance(x, torch.Tensor) or x.shape[-1] != site.width or lead is None:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ShapeError(
                    f"{site.name}: expected the {what}'s first positional argument as the layer's MoE input "
                    f"[batch*tokens, {site.width}] inside its decoder layer's forward, got {got}"
                )
            if x.dim() == 3:
                return (self._moe_value(site, x, what), *args[1:])
            rows = 1
            for n in lead:
                rows *= n
            if x.dim() != 2 or x.shape[0] != rows or len(lead) != 2:
                raise ShapeError(
                    f"{site.name}: the {what} got {tuple(x.shape)}, not the {rows} token rows of the layer's input "
                    f"{(*lead, site.width)}"
                )
            y = self._moe_value(site, x.reshape(*lead, site.width), what)
            return (y.reshape(x.shape), *args[1:])

        return hook

    def _forget(self, layer: int) -> Callable[..., None]:
        def hook(module: nn.Module, *rest: Any) -> None:
            self._memo.pop(layer, None)

        return hook

    def _attn_pre_hook(self, layer: _Slot, param: str, pos: int | None) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
            self._pending.add(layer)
            idx = getattr(module, "layer_idx", layer[0])
            name = next((n for n in _CACHE_ARGS if n in kwargs), None)
            if name is not None:
                kwargs[name] = _CacheTap(self, layer, kwargs[name] if kwargs[name] is not None else self._scratch(idx))
            elif pos is not None and len(args) > pos:
                cache = args[pos] if args[pos] is not None else self._scratch(idx)
                args = (*args[:pos], _CacheTap(self, layer, cache), *args[pos + 1 :])
            else:
                kwargs[param] = _CacheTap(self, layer, self._scratch(idx))
            return args, kwargs

        return hook

    def _scratch(self, idx: Any) -> Any:
        """This forward's scratch cache (a fresh one where layer ``idx`` already holds K/V: a new
        forward that did not pass through the backbone, or a recomputed layer)."""
        scratch = self._scratch_cache
        layers = getattr(scratch, "layers", [])
        if scratch is None or (
            isinstance(idx, int) and idx < len(layers) and getattr(layers[idx], "is_initialized", False)
        ):
            scratch = self._scratch_cache = self.new_cache()
        return scratch

    def _drop_scratch(self, *args: Any) -> None:
        self._scratch_cache = None

    def _attn_post_hook(self, layer: _Slot, owner: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if layer in self._pending:
                self._pending.discard(layer)
                names = " and ".join(s.name for s in self._kv_sites[layer])
                raise ConfigError(
                    f"{owner} ran without writing new K/V into its cache, so {names} would never be seen; if this "
                    "layer keeps no KV cache of its own (linear attention, K/V shared with another layer), leave it "
                    "out (layers=...) or name its type in the layout's no_kv_types"
                )

        return hook

    def _kv(self, layer: _Slot, first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._pending.discard(layer)
        sites = self._kv_sites.get(layer)
        if sites is None:
            return first, second
        out = []
        for site, t in zip(sites, (first, second), strict=True):
            rows = _rows(site, t)
            y = self._apply(site, rows)
            if y is rows:
                out.append(t)
            else:
                b, h, n, d = t.shape
                out.append(y.reshape(b, n, h, d).transpose(1, 2))
        return out[0], out[1]

    def remove(self) -> None:
        """Detach every hook."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        attached = _ATTACHED.get(self._key, [])
        if self in attached:
            attached.remove(self)
        self._memo.clear()
        self._pending.clear()
        self._lead.clear()
        self._scratch_cache = None

    def __enter__(self) -> HFSiteHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
