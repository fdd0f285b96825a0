"""Writes a tiny random Qwen3-MoE checkpoint in ModelOpt's NVFP4 format, with an offline tokenizer.

``write_checkpoint(dir, moe=False)``: 2 layers, hidden 256, 8 experts top-2, the router in bf16,
the experts NVFP4 with ``moe=True`` (bf16 otherwise), the attention projections NVFP4 — per weight ``weight`` uint8
``[out, in/2]`` (element 2j in the low nibble), ``weight_scale`` float8_e4m3fn ``[out, in/16]``,
``weight_scale_2`` float32 (decode-side g, shared by the fused q/k/v shards) and ``input_scale``
float32 (the activation's decode-side g) — quantized with tracestore's reference. The tokenizer is
a byte-level BPE trained on a few sentences (nothing is downloaded).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tracestore import NVFP4, quantize
from tracestore.packing import pack_fp4

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "four bit floating point rounding amplifies tiny differences",
    "rollout engines and trainers must agree on every code",
] * 20
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT = ("gate_proj", "up_proj", "down_proj")
INPUT_G = 8.0 / 2688  # decode-side g of the attention inputs (activations under ~8 in magnitude)


def write_tokenizer(path: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return int(tok.get_vocab_size())


def _quantized(name: str, moe: bool) -> bool:
    if any(f"self_attn.{p}.weight" in name for p in PROJ):
        return True
    return moe and ".mlp.experts." in name and any(f".{p}.weight" in name for p in EXPERT)


def write_checkpoint(path: str | Path, seed: int = 0, moe: bool = False) -> Path:
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if moe:  # transformers fuses the experts; ModelOpt checkpoints (and vLLM's loader) name each one
        for key in [k for k in state if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
            base, fused = key.rsplit(".", 1)
            t = state.pop(key)
            for e in range(t.shape[0]):
                if fused == "gate_up_proj":  # [E, 2I, H]: gate rows first, then up
                    half = t.shape[1] // 2
                    state[f"{base}.{e}.gate_proj.weight"] = t[e, :half].contiguous()
                    state[f"{base}.{e}.up_proj.weight"] = t[e, half:].contiguous()
                else:  # [E, H, I]
                    state[f"{base}.{e}.down_proj.weight"] = t[e].contiguous()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not _quantized(name, moe):
            out[name] = t
            continue
        prefix = name.removesuffix(".weight")
        layer, proj = prefix.rsplit(".", 1)
        group = (
            PROJ[:3] if proj in PROJ[:3] else ("gate_proj", "up_proj") if proj in ("gate_proj", "up_proj") else (proj,)
        )
        g = max(float(state[f"{layer}.{p}.weight"].float().abs().max()) for p in group) / 2688
        q = quantize(t.float(), NVFP4, g)
        out[f"{prefix}.weight"] = pack_fp4(q.codes)
        out[f"{prefix}.weight_scale"] = q.scales.view(torch.float8_e4m3fn)
        out[f"{prefix}.weight_scale_2"] = torch.tensor(g, dtype=torch.float32)
        out[f"{prefix}.input_scale"] = torch.tensor(INPUT_G, dtype=torch.float32)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    config["torch_dtype"] = "bfloat16"
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "ignore": ["lm_head", "model.layers.*.mlp.gate"] + ([] if moe else ["model.layers.*.mlp.experts*"]),
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path
