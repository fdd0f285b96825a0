"""A small, randomly initialised MoE causal LM built from its transformers config (no weights)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tracestore.errors import ConfigError, require

# arch -> config keys for (number of experts, expert FFN width); the rest are shared names.
ARCHS: dict[str, tuple[str, str]] = {
    "qwen3_moe": ("num_experts", "moe_intermediate_size"),
    "qwen2_moe": ("num_experts", "moe_intermediate_size"),
    "mixtral": ("num_local_experts", "intermediate_size"),
    "olmoe": ("num_experts", "intermediate_size"),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Sizes of the demo model. ``hidden`` and ``hidden/heads*kv_heads`` must be multiples of 16
    (the NVFP4 block), so every quantized site has whole blocks."""

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
        if self.hidden % 16 or self.kv_width % 16:
            raise ConfigError(
                f"hidden ({self.hidden}) and the K/V row width kv_heads*head_dim ({self.kv_width}) must be "
                "multiples of 16, the NVFP4 block size"
            )
        if self.top_k > self.experts:
            raise ConfigError(f"top_k ({self.top_k}) must be <= experts ({self.experts})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def build_config(spec: ModelSpec) -> Any:
    """The transformers config for ``spec`` (``AutoConfig.for_model``)."""
    transformers = require("transformers", "demo")
    n_experts_key, ffn_key = ARCHS[spec.arch]
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
        n_experts_key: spec.experts,
        ffn_key: spec.expert_hidden,
    }
    if ffn_key != "intermediate_size":
        kwargs["intermediate_size"] = 2 * spec.expert_hidden  # dense MLP layers, if the arch has any
    if spec.arch == "qwen2_moe":
        kwargs["shared_expert_intermediate_size"] = spec.expert_hidden
    return transformers.AutoConfig.for_model(spec.arch, **kwargs)  # type: ignore[attr-defined]


def build_model(spec: ModelSpec, *, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> Any:
    """A randomly initialised ``AutoModelForCausalLM`` for ``spec`` in eval mode, sdpa attention."""
    transformers = require("transformers", "demo")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(  # type: ignore[attr-defined]
        build_config(spec), dtype=dtype, attn_implementation="sdpa"
    )
    return model.to(device).eval()
