"""Where the quantization sites sit in a transformers decoder: a small registry of layouts.

A :class:`Layout` says, for one ``config.model_type``, where
:class:`~tracestore.client.hf.hooks.HFSiteHooks` finds what it hooks, as dotted attribute paths:

- ``layers``: the decoder-layer ``ModuleList``, relative to the text backbone. The backbone is found
  by walking down from the model through wrapper attributes (``language_model`` first, then
  ``model``, ``transformer``, ...) until that path exists, so ``Qwen3VLMoeForConditionalGeneration``
  resolves to ``model.language_model`` and ``DbrxForCausalLM`` (``layers="blocks"``) to
  ``transformer``; vision towers are never entered.
- ``attention``: relative to a decoder layer, the attention module that writes the KV cache; a
  ``ModuleList`` there is several attention modules in one decoder layer (LongCat-Flash: two MLA
  sublayers, each with its own cache slot), whose sites take the prefixes ``attn``, ``attn1``,
  ``attn2``, ... (see the site names below). A layer whose type in the config is one of
  ``no_kv_types`` (``linear_attention``, ``mamba``, ``conv``...) or whose mixer is one of the paths
  in ``no_kv`` has no K/V sites, just as a layer whose ``moe`` path holds a dense MLP has no
  MoE-input site. An attention module that runs without writing K/V into its cache is an error
  naming the layer (its sites would never be seen).
- ``moe``: relative to a decoder layer, the sparse-MoE block (a module with ``experts`` or a
  ``router``; JetMoE's has a router and parallel-expert linears); ``None`` takes the shallowest
  submodule that owns ``experts``.
- ``moe_inline``: for a decoder layer that holds its experts itself, with no MoE block module
  (Gemma 4: ``router`` and ``experts`` are children of the layer), the path of the module, relative
  to the decoder layer, whose first positional argument is the MoE input (tokens flattened,
  ``[batch*tokens, hidden]``; the site sees it as ``[batch, tokens, hidden]``). Gemma 4's is
  ``experts``: its input is the residual after ``pre_feedforward_layernorm_2``, what the expert
  GEMMs consume and an FP4 engine quantizes; its router reads the un-normalized residual, which the
  site leaves as it is. A layer without that module is dense (no MoE-input site).
- ``kv_reused``: an attribute of the attention module that is true where the layer reuses another
  layer's K/V instead of writing its own (Gemma 4's ``is_kv_shared_layer``): no K/V sites there.
- ``shared``: relative to a decoder layer, the shared expert, if any (``AUTO``: a child of the layer
  named like ``shared*mlp`` / ``shared*expert``). Inside the MoE block (Qwen2-MoE, DeepSeek,
  Llama 4, Qwen3-Next) it already consumes the block's hooked input. Beside the block
  (Granite-MoE-Shared's ``shared_mlp``) it gets the same values as the MoE-input site: FP4 engines
  quantize the MoE layer's input once and feed it to routed and shared experts alike, so the shared
  expert has no site of its own (a shared expert that receives another tensor is an error).
- ``kv``: how the two tensors the attention passes to ``cache.update`` become sites (:data:`GQA` or
  :data:`MLA`; ``None`` picks MLA when the attention module has ``kv_lora_rank``).

Site names are ``layers.{i}.{suffix}``, ``i`` the decoder layer's index: ``mlp.input`` (kind
``moe_input``, width hidden_size, whether hooked at a MoE block or at ``moe_inline``); with
:data:`GQA` ``attn.k`` / ``attn.v`` (post-RoPE key/value rows with the K/V heads flattened, width
kv_heads x head_dim); with :data:`MLA` ``attn.kv_latent`` (the compressed latent after
``kv_a_layernorm``, width kv_lora_rank, kind ``other``) and ``attn.k_rope`` (the post-RoPE rotary
key shared by all heads, width qk_rope_head_dim, kind ``key``): what an MLA engine caches and
quantizes, and what a training forward computes at the same place. Where ``attention`` is a
``ModuleList``, attention module ``j`` of the layer names its sites with ``attn{j}`` in place of
``attn`` for ``j >= 1`` (module 0 keeps ``attn``): LongCat-Flash's layer ``i`` has
``layers.{i}.attn.kv_latent`` / ``layers.{i}.attn.k_rope`` (``self_attn[0]``) and
``layers.{i}.attn1.kv_latent`` / ``layers.{i}.attn1.k_rope`` (``self_attn[1]``), next to its one
``layers.{i}.mlp.input`` (the shortcut MoE block).

A new architecture is one entry::

    register_layout("my_moe", Layout(moe="block_sparse_moe", shared="shared_mlp", no_kv=("mamba",)))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from tracestore.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

SiteKind = Literal["moe_input", "key", "value", "other"]  # the record kinds of tracestore.records
Widths = Callable[[Any, Any], "tuple[int, int]"]  # (text config, attention module) -> widths of the two sites

# Wrapper attributes walked from the model down to its text backbone, in this order.
WRAPPERS = ("language_model", "model", "transformer", "text_model", "decoder")


def _linear_width(module: Any, name: str) -> int | None:
    proj = getattr(module, name, None)
    width = getattr(proj, "out_features", None)
    return int(width) if isinstance(width, int) else None


def gqa_widths(cfg: Any, attn: Any) -> tuple[int, int]:
    """K and V row widths of (grouped-query) multi-head attention: ``k_proj``/``v_proj`` output
    widths, else K/V heads x head_dim from the attention module or the config."""
    heads = getattr(attn, "num_key_value_heads", None) or getattr(cfg, "num_key_value_heads", None)
    heads = int(heads or cfg.num_attention_heads)
    head_dim = getattr(attn, "head_dim", None) or getattr(cfg, "head_dim", None)
    head_dim = int(head_dim or cfg.hidden_size // cfg.num_attention_heads)
    k = _linear_width(attn, "k_proj") or heads * head_dim
    return k, _linear_width(attn, "v_proj") or k  # no v_proj (Gemma 4's K = V attention): V has K's heads


def mla_widths(cfg: Any, attn: Any) -> tuple[int, int]:
    """Multi-head latent attention: (kv_lora_rank, qk_rope_head_dim)."""
    rank = getattr(attn, "kv_lora_rank", None) or cfg.kv_lora_rank
    rope = getattr(attn, "qk_rope_head_dim", None) or cfg.qk_rope_head_dim
    return int(rank), int(rope)


@dataclasses.dataclass(frozen=True)
class KVStyle:
    """How the two tensors an attention module hands to ``cache.update(first, second, layer_idx)``
    (each ``[batch, heads, tokens, head_dim]``) become sites: ``sites`` gives each one's name suffix
    and record kind, ``widths(text_config, attention)`` their values per token."""

    name: str
    sites: tuple[tuple[str, SiteKind], tuple[str, SiteKind]]
    widths: Widths


GQA = KVStyle("gqa", (("attn.k", "key"), ("attn.v", "value")), gqa_widths)
MLA = KVStyle("mla", (("attn.kv_latent", "other"), ("attn.k_rope", "key")), mla_widths)


def single_kv_widths(cfg: Any, attn: Any) -> tuple[int, int]:
    """One K/V head shared by every query head (DeepSeek-V4: its ``kv_proj`` output is cached as
    both K and V): head_dim each."""
    head_dim = int(getattr(attn, "head_dim", None) or cfg.head_dim)
    return head_dim, head_dim


SINGLE_KV = KVStyle("single-kv", GQA.sites, single_kv_widths)


def get_path(root: Any, path: str) -> Any:
    """``root.a.b`` for ``path="a.b"``, or None where an attribute is missing."""
    node = root
    for part in path.split("."):
        try:
            node = getattr(node, part, None)
        except Exception:  # a property that cannot answer on this object
            return None
        if node is None:
            return None
    return node


AUTO = "auto"
"""``Layout.shared = AUTO``: a direct child of the decoder layer named like ``shared*mlp`` /
``shared*expert`` that sits beside the MoE block is its shared expert."""

NO_KV_TYPES = ("linear_attention", "mamba", "mamba2", "conv", "mlp", "moe")
"""Per-layer types (``config.layer_types`` / ``config.layers_block_type``) of layers without a KV cache."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Module paths of one architecture (see the module docstring for each field). ``no_kv_types``:
    a layer whose type in the config (``layer_types`` or ``layers_block_type``) is one of these has
    no K/V sites, even where its mixer sits at ``attention`` (MiniMax's lightning attention)."""

    layers: str = "layers"
    attention: str = "self_attn"
    moe: str | None = "mlp"
    shared: str | None = None
    kv: KVStyle | None = GQA
    no_kv: tuple[str, ...] = ()
    no_kv_types: tuple[str, ...] = NO_KV_TYPES
    moe_inline: str | None = None
    kv_reused: str | None = None

    def moe_block(self, layer: nn.Module) -> nn.Module | None:
        """The layer's sparse-MoE block (with ``experts`` or a ``router``); None if dense."""
        if self.moe is None:
            for _, module in sorted(layer.named_modules(), key=lambda kv: kv[0].count(".")):
                if module is not layer and hasattr(module, "experts"):
                    return module
            return None
        block = get_path(layer, self.moe)
        return block if block is not None and (hasattr(block, "experts") or hasattr(block, "router")) else None

    def inline_moe(self, layer: nn.Module) -> nn.Module | None:
        """For a layer holding its experts itself: the module at ``moe_inline`` that takes the MoE
        input, or None (no ``moe_inline``, or a dense layer without that module)."""
        return None if self.moe_inline is None else get_path(layer, self.moe_inline)

    def shared_expert(self, layer: nn.Module, block: nn.Module) -> tuple[str, nn.Module] | None:
        """``(path, module)`` of the layer's shared expert, or None."""
        if self.shared == AUTO:
            for name, child in layer.named_children():
                if child is not block and "shared" in name and ("mlp" in name or "expert" in name):
                    return name, child
            return None
        module = None if self.shared is None else get_path(layer, self.shared)
        return None if module is None else (str(self.shared), module)

    def attention_module(self, layer: nn.Module) -> nn.Module | None:
        return get_path(layer, self.attention)

    def kv_style(self, attn: Any) -> KVStyle:
        if self.kv is not None:
            return self.kv
        return MLA if hasattr(attn, "kv_lora_rank") else GQA

    def kv_free(self, cfg: Any, index: int, layer: nn.Module) -> str | None:
        """Why decoder layer ``index`` has no KV cache (its type in the config, or its
        attention-less mixer at one of ``no_kv``), or None."""
        for attr in ("layer_types", "layers_block_type"):
            try:
                types = getattr(cfg, attr, None)
            except Exception:  # a property that cannot answer for this config
                types = None
            if isinstance(types, (list, tuple)) and index < len(types) and types[index] in self.no_kv_types:
                return f"config.{attr}[{index}] = {types[index]!r}"
        mixer = next((p for p in self.no_kv if get_path(layer, p) is not None), None)
        if mixer is not None:
            return f"its mixer at {mixer!r}"
        if self.kv_reused is not None:
            attn = self.attention_module(layer)
            if attn is not None and getattr(attn, self.kv_reused, False) is True:
                return f"its attention reuses another layer's K/V ({self.attention}.{self.kv_reused})"
        return None


DEFAULT = Layout(moe=None, shared=AUTO, kv=None)
"""Layout of an unregistered architecture: ``layers``, ``self_attn``, the shallowest submodule
owning ``experts``, an ``AUTO`` shared expert, MLA when the attention has ``kv_lora_rank``; layers
without ``self_attn`` are skipped for K/V (the hooks refuse a model where no layer has one)."""

_HYBRID_LINEAR = ("linear_attn",)

LAYOUTS: dict[str, Layout] = {
    "qwen3_moe": Layout(),
    "qwen3_vl_moe_text": Layout(),
    "qwen2_moe": Layout(shared="mlp.shared_expert"),
    "qwen3_next": Layout(shared="mlp.shared_expert", no_kv=_HYBRID_LINEAR),
    "qwen3_5_moe_text": Layout(shared="mlp.shared_expert", no_kv=_HYBRID_LINEAR),
    "mixtral": Layout(),
    "olmoe": Layout(),
    "phimoe": Layout(),
    "gpt_oss": Layout(),
    "deepseek_v2": Layout(shared="mlp.shared_experts", kv=MLA),
    "deepseek_v3": Layout(shared="mlp.shared_experts", kv=MLA),
    # the shallowest module owning experts and an AUTO shared expert, as for unregistered types
    "deepseek_v4": dataclasses.replace(DEFAULT, kv=SINGLE_KV),
    "granitemoe": Layout(moe="block_sparse_moe"),
    "granitemoeshared": Layout(moe="block_sparse_moe", shared="shared_mlp"),
    "llama4_text": Layout(moe="feed_forward", shared="feed_forward.shared_expert"),
    "jamba": Layout(moe="feed_forward", no_kv=("mamba",)),
    "dbrx": Layout(layers="blocks", attention="norm_attn_norm.attn", moe="ffn"),
    "minimax": Layout(),  # linear-attention layers (config.layer_types) have their lightning attention at self_attn
    "jetmoe": Layout(attention="self_attention"),
    "granitemoehybrid": Layout(moe="block_sparse_moe", shared="shared_mlp", no_kv=("mamba",)),
    "lfm2_moe": Layout(moe="feed_forward", no_kv=("conv",)),
    "nemotron_h": Layout(attention="mixer", moe="mixer"),  # one mixer per layer, typed by layers_block_type
    # experts and router on the decoder layer itself; the MoE input is what its experts consume
    "gemma4_text": Layout(moe_inline="experts", kv_reused="is_kv_shared_layer"),
    # two MLA attention modules per layer (self_attn[0] -> attn.*, self_attn[1] -> attn1.*), one MoE block
    "longcat_flash": Layout(kv=MLA),
}
"""Registered layouts by the text config's ``model_type`` (the ones the test suite runs)."""


def register_layout(model_type: str, layout: Layout) -> None:
    """Declare (or replace) the layout of ``model_type``."""
    if not isinstance(layout, Layout):
        raise ConfigError(f"layout for {model_type!r} must be a Layout, got {type(layout).__name__}")
    LAYOUTS[str(model_type)] = layout


def text_config(model: Any) -> Any:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "get_text_config"):
        raise ConfigError(
            f"{type(model).__name__} has no transformers config; expected a transformers decoder-only "
            "causal LM (e.g. Qwen3MoeForCausalLM) or a multimodal model wrapping one"
        )
    return cfg.get_text_config()


def layout_for(model: Any) -> tuple[str, Layout]:
    """``(model_type, layout)`` of ``model``'s text config: registered, else :data:`DEFAULT`."""
    model_type = str(getattr(text_config(model), "model_type", "") or "")
    outer = str(getattr(model.config, "model_type", "") or "")
    for key in (model_type, outer):
        if key in LAYOUTS:
            return key, LAYOUTS[key]
    return model_type or outer, DEFAULT


def decoder_layers(model: Any, layout: Layout) -> tuple[str, list[nn.Module]]:
    """``(path, layers)``: the dotted path from ``model`` to its decoder layers, and the layers."""
    from torch import nn

    node, path = model, ""
    for _ in range(len(WRAPPERS) + 2):
        found = get_path(node, layout.layers)
        if isinstance(found, nn.ModuleList):
            return (f"{path}.{layout.layers}" if path else layout.layers), list(found)
        step = next((n for n in WRAPPERS if isinstance(get_path(node, n), nn.Module)), None)
        if step is None:
            break
        node, path = get_path(node, step), (f"{path}.{step}" if path else step)
    raise ConfigError(
        f"{type(model).__name__} has no decoder-layer list {layout.layers!r} on its text backbone (searched "
        f"through {', '.join(WRAPPERS)}); register its layout with tracestore.client.hf.layouts.register_layout"
    )
