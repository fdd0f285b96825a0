"""Sweep: HFSiteHooks on every decoder-only MoE causal LM that the installed transformers ships.

The model types come from ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; each config class's default config is
shrunk to tiny sizes (2 layers, hidden 64, 4 heads, 2 K/V heads of 16, 4 experts, top-2, FFN 32-64,
vocab 256; each config's own field names where they exist), the model is built with a fixed seed,
and kept when a module owns ``experts`` (or the registry finds its MoE block). For each: an identity
callback ``HFSiteHooks(model, lambda site, x: None)`` leaves greedy ``generate()`` (KV cache on)
unchanged and every MoE layer's site is seen. A type whose *unhooked* tiny model cannot be built or
cannot generate is skipped with the reason (a config or transformers quirk, not the hooks); a type
that only fails with the hooks attached is a failure.
"""

from __future__ import annotations

import functools
import inspect
import json

import pytest

torch = pytest.importorskip("torch", reason="the hook helper needs torch")
transformers = pytest.importorskip("transformers", reason="the hook helper needs the demo extra (transformers)")

from tracestore.client.hf.hooks import HFSiteHooks  # noqa: E402
from tracestore.client.hf.layouts import decoder_layers, layout_for  # noqa: E402

pytestmark = pytest.mark.slow

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, VOCAB = 2, 64, 4, 2, 16, 4, 2, 256
B, PROMPT, NEW = 2, 5, 3
# field -> tiny value, applied where the default config has the field (each family's own names)
TINY: dict[str, object] = {
    **dict.fromkeys(LAYER_KEYS := ("num_hidden_layers", "num_layers", "n_layer", "n_layers"), LAYERS),
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim"), HIDDEN),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads", "num_key_value_groups"),
                    KV_HEADS),
    **dict.fromkeys(("head_dim", "kv_channels", "global_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_rope_head_dim",
                     "attention_head_dim", "linear_key_head_dim", "linear_value_head_dim", "swa_head_dim"), HEAD_DIM),
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
                     "n_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "top_k", "moe_topk", "moe_top_k", "num_experts_per_token", "top_k_experts",
                     "moe_k", "num_selected_experts"), TOP_K),
    **dict.fromkeys(("intermediate_size", "ffn_hidden_size", "ffn_dim", "n_inner"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
                     "expert_ffn_hidden_size", "moe_ffn_hidden_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers", "first_dense_layers"), 0),
    **dict.fromkeys(("n_group", "topk_group", "decoder_sparse_step", "moe_layer_freq", "expert_interval"), 1),
    "vocab_size": VOCAB, "max_position_embeddings": 512, "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "sliding_window": 64,
    "linear_num_key_heads": HEADS, "linear_num_value_heads": HEADS, "mlp_only_layers": [],
    "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 1, "expert_layer_offset": 0,
    "enable_moe_block": True, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "tie_word_embeddings": False,
}  # fmt: skip
SUB_CONFIGS = ("text_config", "attn_config", "ffn_config")  # nested dicts shrunk the same way
_QWEN4_EXP = {"indexer_n_heads": HEADS, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 8,
              "indexer_compress_ratio": 4, "hc_lowrank": 16}  # fmt: skip
_DOTS3_NOTE = {"num_key_value_heads": HEADS, "index_head_dim": HEAD_DIM, "index_n_heads": HEADS, "index_topk": 8,
               "head_dim": 2 * HEAD_DIM,
               "per_layer_config": {1: {"num_attention_heads": HEADS, "num_key_value_heads": HEADS,
                                        "q_lora_rank": 32, "kv_lora_rank": 32, "head_dim": 2 * HEAD_DIM,
                                        "qk_nope_head_dim": HEAD_DIM, "qk_rope_head_dim": HEAD_DIM,
                                        "v_head_dim": HEAD_DIM}}}  # fmt: skip
_INKLING2 = {"unpadded_vocab_size": VOCAB, "swa_num_attention_heads": HEADS, "swa_num_key_value_heads": KV_HEADS,
             "n_layers_per_attn_res_block": 1}  # fmt: skip
# per-type fields the shared TINY table cannot express (validators tying fields together, special-token ids, ...);
# a "text_config" entry is merged into the (shrunk) text sub-config
OVERRIDES: dict[str, dict] = {
    "dots3_note_text": _DOTS3_NOTE,
    "dots3_note": {"text_config": _DOTS3_NOTE, "vision_config": {"adapter_out_dim": HIDDEN},
                   "audio_config": {"adapter_out_dim": HIDDEN}},
    "qwen4_exp_text": _QWEN4_EXP, "qwen4_exp": {"text_config": _QWEN4_EXP},
    "inkling2_text": _INKLING2, "inkling2_loop_text": {**_INKLING2, "loop_layer_index_start": 1,
                                                       "loop_layer_index_end": LAYERS, "loop_num_passes": 2,
                                                       "loop_gate_rank": 8},
    "bailing_hybrid": {"linear_head_dim": HEAD_DIM, "linear_num_heads": HEADS, "num_expert_group": 1,
                       "layer_group_size": 2},
    "zaya": {"num_experts_per_tok": 1, "router_hidden_size": 16},
}  # fmt: skip


def causal_lm_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t in CONFIG_MAPPING_NAMES)


def _shrink(values: dict, n_layers: int | None) -> dict:
    out = {}
    for key, value in values.items():
        if key in TINY:
            out[key] = TINY[key]
        elif key in SUB_CONFIGS and isinstance(value, dict):
            sub_n = next((value[k] for k in LAYER_KEYS if isinstance(value.get(k), int)), n_layers)
            out[key] = {**value, **_shrink(value, sub_n)}  # a wrapper's text config has its own layer count
        elif isinstance(value, (list, tuple)) and n_layers and len(value) == n_layers and n_layers != LAYERS:
            # per-layer lists (layer_types, ...): the first entry, then the first that differs (else the last)
            out[key] = [value[0], next((v for v in value if v != value[0]), value[-1])]
        elif key == "per_layer_config" and isinstance(value, dict):
            out[key] = {k: v for k, v in value.items() if str(k).isdigit() and int(k) < LAYERS}
        elif key == "hybrid_override_pattern" and isinstance(value, str):
            out[key] = "E*"  # Nemotron-H: MoE mixer, then attention
    return out


@functools.cache
def tiny_config(model_type: str) -> object:
    cls = transformers.CONFIG_MAPPING[model_type]
    default = cls().to_dict()
    n = next((default[k] for k in LAYER_KEYS if k in default), None)
    kwargs = _shrink(default, n if isinstance(n, int) else None)
    if "kv_lora_rank" in default and "num_key_value_heads" in kwargs:
        kwargs["num_key_value_heads"] = HEADS  # MLA: every head has its own K/V from the latent
    for key, value in OVERRIDES.get(model_type, {}).items():
        kwargs[key] = {**kwargs[key], **value} if key in SUB_CONFIGS and isinstance(kwargs.get(key), dict) else value
    cfg = cls(**kwargs)
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError("encoder-decoder")
    return cfg


def _moe_layers(model) -> list[int]:  # noqa: ANN001
    _, layout = layout_for(model)
    _, layers = decoder_layers(model, layout)
    out = []
    for i, layer in enumerate(layers):
        owns = any(hasattr(m, "experts") for m in layer.modules())
        if owns or layout.moe_block(layer) is not None or layout.inline_moe(layer) is not None:
            out.append(i)
    return out


def _reason(e: BaseException) -> str:
    """The exception's first lines (a validation error names its field on the second), short."""
    return " ".join(line.strip() for line in str(e).splitlines()[:3] if line.strip())[:300]


@functools.cache
def tiny_model(model_type: str) -> tuple[object, object]:
    """(model, None) or (None, the reason it cannot be built tiny)."""
    try:
        cfg = tiny_config(model_type)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        return model.eval(), None
    except Exception as e:  # noqa: BLE001 - the reason is reported as the skip
        return None, f"{type(e).__name__}: {_reason(e)}"


def _is_moe(model) -> bool:  # noqa: ANN001
    try:
        return bool(_moe_layers(model))
    except Exception:  # noqa: BLE001 - no decoder-layer list: look for experts anywhere
        return any(hasattr(m, "experts") for m in model.modules())


def _mentions_experts(model_type: str) -> bool:
    """Cheap pre-filter at collection: the modeling module of the type mentions experts."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    try:
        model_cls = getattr(transformers, name)
        return "experts" in inspect.getsource(inspect.getmodule(model_cls))
    except Exception:  # noqa: BLE001 - cannot tell: keep it, the test decides
        return True


CANDIDATES = [t for t in causal_lm_types() if _mentions_experts(t)]


def generate(model, hooks: HFSiteHooks | None = None) -> torch.Tensor:  # noqa: ANN001
    ids = torch.randint(8, VOCAB, (B, PROMPT), generator=torch.Generator().manual_seed(2))
    kw = hooks.cache_kwargs(hooks.new_cache()) if hooks is not None else {}
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, use_cache=True, **kw)  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread():  # noqa: ANN202 - tiny ops on a shared 2-core box
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("model_type", CANDIDATES)
def test_identity_hooks_keep_generate_and_see_every_moe_layer(model_type: str) -> None:
    model, why = tiny_model(model_type)
    if model is None:
        pytest.skip(f"{model_type}: the tiny model cannot be built without hooks: {why}")
    if not _is_moe(model):
        pytest.skip(f"{model_type}: dense (no module owns experts at this config)")
    try:
        ref = generate(model)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"{model_type}: unhooked generate() fails: {type(e).__name__}: {_reason(e)}")
    seen: set[str] = set()
    with HFSiteHooks(model, lambda site, x: seen.add(site.name)) as hooks:
        names = [s.name for s in hooks.sites]
        out = generate(model, hooks)
    assert torch.equal(out, ref), f"{model_type}: an identity callback changed the generation"
    moe_sites = {f"layers.{i}.mlp.input" for i in _moe_layers(model)}
    assert moe_sites, f"{model_type}: no MoE layer found"
    assert moe_sites <= set(names), f"{model_type}: MoE layers without a site: {sorted(moe_sites - set(names))}"
    assert set(names) <= seen, f"{model_type}: sites never seen: {sorted(set(names) - seen)}"


if __name__ == "__main__":  # discovery aid: python tests/client/hf/test_hf_hooks_sweep.py
    print(json.dumps(CANDIDATES))
