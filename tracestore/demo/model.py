"""A small, randomly initialised MoE causal LM built from its transformers config (no weights)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from tracestore.errors import ConfigError, require


@dataclasses.dataclass(frozen=True)
class Arch:
    """How a :class:`ModelSpec` maps onto one transformers model type: the config keys of the
    number of routed experts and of the expert FFN width (None: set by ``extra``), extra config
    entries, and how it is built (``attn`` implementation; ``multimodal``: a vision-language
    wrapper around the MoE text model)."""

    experts: str | None
    ffn: str | None
    extra: Callable[[ModelSpec], dict[str, Any]] = lambda spec: {}
    attn: str = "sdpa"
    multimodal: bool = False
    model_type: str | None = None  # AutoConfig model type when it differs from the arch name


def _shared(key: str) -> Callable[[ModelSpec], dict[str, Any]]:
    return lambda spec: {key: spec.expert_hidden}


def _mla(spec: ModelSpec) -> dict[str, Any]:
    # MLA: all heads read one latent (kv_heads x head_dim wide) and one rotary key (head_dim wide)
    return {
        "num_key_value_heads": spec.heads,
        "kv_lora_rank": spec.kv_width,
        "q_lora_rank": None,
        "qk_rope_head_dim": spec.head_dim,
        "qk_nope_head_dim": spec.head_dim,
        "v_head_dim": spec.head_dim,
        "head_dim": spec.head_dim,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,  # dense first layer, like the released models
        "n_group": 1,
        "topk_group": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


def _linear_attention(spec: ModelSpec) -> dict[str, Any]:
    # hybrid: linear-attention (gated DeltaNet) and full-attention layers alternate
    return {
        "layer_types": ["linear_attention", "full_attention"] * (spec.layers // 2)
        + ["linear_attention"] * (spec.layers % 2),
        "linear_key_head_dim": spec.head_dim,
        "linear_value_head_dim": spec.head_dim,
        "linear_num_key_heads": spec.kv_heads,
        "linear_num_value_heads": spec.heads,
        "shared_expert_intermediate_size": spec.expert_hidden,
    }


def _jamba(spec: ModelSpec) -> dict[str, Any]:
    # Mamba and attention layers alternate (attention at odd layers); every layer is MoE
    return {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 1,
        "expert_layer_offset": 0,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    }


def _gpt_oss(spec: ModelSpec) -> dict[str, Any]:
    return {
        "layer_types": ["sliding_attention", "full_attention"] * (spec.layers // 2)
        + ["sliding_attention"] * (spec.layers % 2),
        "sliding_window": 128,
    }


def _llama4(spec: ModelSpec) -> dict[str, Any]:
    return {"intermediate_size_mlp": 2 * spec.expert_hidden, "moe_layers": list(range(spec.layers))}


def _alternate(spec: ModelSpec, first: str, second: str) -> list[str]:
    return [first if i % 2 == 0 else second for i in range(spec.layers)]


def _minimax(spec: ModelSpec) -> dict[str, Any]:
    # full attention and lightning (linear) attention alternate; every layer is MoE
    return {"layer_types": _alternate(spec, "full_attention", "linear_attention")}


def _granite_hybrid(spec: ModelSpec) -> dict[str, Any]:
    # Mamba-2 and attention layers alternate; every layer is MoE with a shared MLP beside the block
    return {
        "layer_types": _alternate(spec, "linear_attention", "attention"),
        "mamba_n_heads": spec.heads,
        "shared_intermediate_size": spec.expert_hidden,
        "mamba_d_head": spec.head_dim,
        "mamba_expand": 1,
        "mamba_d_state": 8,
        "mamba_chunk_size": 8,
    }


def _nemotron_h(spec: ModelSpec) -> dict[str, Any]:
    # one mixer per layer: attention, MoE, Mamba-2, MoE, ... A first layer without a KV cache (MoE)
    # breaks transformers 5.25's generate() (its prefill asks cache layer 0 for its length)
    pattern = ("full_attention", "moe", "linear_attention", "moe")
    return {
        "layers_block_type": [pattern[i % 4] for i in range(spec.layers)],
        "n_shared_experts": 1,
        "moe_shared_expert_intermediate_size": spec.expert_hidden,
        "mamba_num_heads": spec.heads,
        "mamba_head_dim": spec.head_dim,
        "n_groups": 1,
        "ssm_state_size": 8,
        "chunk_size": 8,
    }


def _dbrx(spec: ModelSpec) -> dict[str, Any]:
    return {
        "d_model": spec.hidden,
        "n_heads": spec.heads,
        "n_layers": spec.layers,
        "max_seq_len": 4096,
        "attn_config": {"kv_n_heads": spec.kv_heads, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": spec.expert_hidden, "moe_num_experts": spec.experts, "moe_top_k": spec.top_k},
    }


ARCHS: dict[str, Arch] = {
    "qwen3_moe": Arch("num_experts", "moe_intermediate_size"),
    "qwen2_moe": Arch("num_experts", "moe_intermediate_size", _shared("shared_expert_intermediate_size")),
    "mixtral": Arch("num_local_experts", "intermediate_size"),
    "olmoe": Arch("num_experts", "intermediate_size"),
    "phimoe": Arch("num_local_experts", "intermediate_size"),
    "gpt_oss": Arch("num_local_experts", "intermediate_size", _gpt_oss, attn="eager"),  # sinks: no sdpa
    "granitemoe": Arch("num_local_experts", "intermediate_size"),
    "granitemoeshared": Arch("num_local_experts", "intermediate_size", _shared("shared_intermediate_size")),
    "deepseek_v2": Arch("n_routed_experts", "moe_intermediate_size", _mla),
    "deepseek_v3": Arch("n_routed_experts", "moe_intermediate_size", _mla),
    "llama4": Arch("num_local_experts", "intermediate_size", _llama4, model_type="llama4_text"),
    "jamba": Arch("num_experts", "intermediate_size", _jamba),
    "qwen3_next": Arch("num_experts", "moe_intermediate_size", _linear_attention),
    "qwen3_5_moe": Arch("num_experts", "moe_intermediate_size", _linear_attention, model_type="qwen3_5_moe_text"),
    "dbrx": Arch(None, None, _dbrx),
    "qwen3_vl_moe": Arch("num_experts", "moe_intermediate_size", multimodal=True),
    "minimax": Arch("num_local_experts", "intermediate_size", _minimax),
    "granitemoehybrid": Arch("num_local_experts", "intermediate_size", _granite_hybrid),
    "lfm2_moe": Arch(
        "num_experts",
        "moe_intermediate_size",
        lambda spec: {"layer_types": _alternate(spec, "conv", "full_attention"), "num_dense_layers": 0},
    ),
    "nemotron_h": Arch("n_routed_experts", "moe_intermediate_size", _nemotron_h),
    "jetmoe": Arch("num_local_experts", "intermediate_size", lambda spec: {"kv_channels": spec.head_dim}),
}
"""``--arch`` values: transformers MoE model types (llama4 and qwen3_5_moe build the text-only
causal LM; qwen3_vl_moe the vision-language model, whose language model the hooks resolve to).
Hybrids: jamba, granitemoehybrid, nemotron_h (Mamba), qwen3_next, qwen3_5_moe, minimax (linear
attention), lfm2_moe (short convolutions); MLA: deepseek_v2, deepseek_v3."""
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Sizes of the demo model. ``hidden`` and ``hidden/heads*kv_heads`` must be multiples of 16
    (the NVFP4 block), so every quantized site has whole blocks. MLA models (deepseek_*) cache a
    latent ``kv_heads*head_dim`` wide and a rotary key ``head_dim`` wide."""

    arch: str = "qwen3_moe"
    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 2
    experts: int = 8
    top_k: int = 2
    expert_hidden: int = 128
    vocab: int = 1024

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ConfigError(f"arch must be one of {sorted(ARCHS)} (transformers MoE model types), got {self.arch!r}")
        for name in ("layers", "hidden", "heads", "kv_heads", "experts", "top_k", "expert_hidden", "vocab"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.layers < 2:
            raise ConfigError(f"layers must be >= 2 (the compact mode records the latter half), got {self.layers}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ConfigError(
                f"hidden ({self.hidden}) must divide by heads ({self.heads}) and heads by kv_heads ({self.kv_heads})"
            )
        if self.hidden % 16 or self.kv_width % 16 or self.head_dim % 2:
            raise ConfigError(
                f"hidden ({self.hidden}) and the K/V row width kv_heads*head_dim ({self.kv_width}) must be "
                f"multiples of 16, the NVFP4 block size, and head_dim ({self.head_dim}) even"
            )
        if self.top_k > self.experts:
            raise ConfigError(f"top_k ({self.top_k}) must be <= experts ({self.experts})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def _text_kwargs(spec: ModelSpec) -> dict[str, Any]:
    arch = ARCHS[spec.arch]
    kwargs: dict[str, Any] = {
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "num_experts_per_tok": spec.top_k,
        "max_position_embeddings": 4096,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }
    if arch.experts is not None:
        kwargs[arch.experts] = spec.experts
    if arch.ffn is not None:
        kwargs[arch.ffn] = spec.expert_hidden
    if arch.ffn != "intermediate_size":
        kwargs["intermediate_size"] = 2 * spec.expert_hidden  # dense MLP layers, if the arch has any
    kwargs.update(arch.extra(spec))
    return kwargs


def build_config(spec: ModelSpec) -> Any:
    """The transformers config for ``spec`` (``AutoConfig.for_model``)."""
    transformers = require("transformers", "demo")
    arch = ARCHS[spec.arch]
    model_type = arch.model_type or spec.arch
    if not arch.multimodal:
        return transformers.AutoConfig.for_model(model_type, **_text_kwargs(spec))  # type: ignore[attr-defined]
    # a tiny vision tower; the demo feeds text only
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 4,
        "out_hidden_size": spec.hidden,
        "spatial_merge_size": 2,
        "temporal_patch_size": 1,
        "deepstack_visual_indexes": [0],
    }
    special = {"image_token_id": 3, "video_token_id": 4, "vision_start_token_id": 5, "vision_end_token_id": 6}
    return transformers.AutoConfig.for_model(  # type: ignore[attr-defined]
        model_type, text_config=_text_kwargs(spec), vision_config=vision, **special
    )


def build_model(spec: ModelSpec, *, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> Any:
    """A randomly initialised model for ``spec`` in eval mode: ``AutoModelForCausalLM`` (sdpa
    attention; eager where the arch has no sdpa path), or ``AutoModelForImageTextToText`` for a
    multimodal arch."""
    transformers = require("transformers", "demo")
    arch = ARCHS[spec.arch]
    torch.manual_seed(seed)
    auto = transformers.AutoModelForImageTextToText if arch.multimodal else transformers.AutoModelForCausalLM  # type: ignore[attr-defined]
    model = auto.from_config(build_config(spec), dtype=dtype, attn_implementation=arch.attn)
    return model.to(device).eval()
