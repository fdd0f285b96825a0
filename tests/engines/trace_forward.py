"""The trainer half of the vLLM end-to-end test: a TRACE forward of the checkpoint in transformers.

The trainer's weights are the checkpoint's (NVFP4 attention projections dequantized with
tracestore's reference); every recorded dense site's input is rounded with
:func:`tracestore.guided_round` toward the engine's record (forward pre-hooks on the consuming
``nn.Linear``: q/k/v share the ``qkv_proj`` site; the MoE site on the experts module, whose
router reads the unrounded input as the engine's does). :func:`trace_forward` returns, per site, the
values the trainer's FP4 rounding produced and the values the engine's codes decode to, so a test
can count where they differ (with and without guidance).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tracestore import NVFP4, dequantize, guided_round, quantize
from tracestore.fp4 import dequantize_codes
from tracestore.packing import unpack_bits, unpack_fp4


def load_trainer_model(path: str | Path) -> Any:
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    raw.pop("quantization_config", None)
    cfg = Qwen3MoeConfig(
        **{k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype", "transformers_version")}
    )
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    tensors = load_file(str(path / "model.safetensors"))
    state = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        if f"{name}_scale" in tensors:  # an NVFP4 weight: dequantize as the engine's emulation does
            codes = unpack_fp4(t)
            w = dequantize_codes(codes, tensors[f"{name}_scale"].view(torch.uint8), tensors[f"{name}_scale_2"], NVFP4)
            state[name] = w.to(torch.bfloat16)
        else:
            state[name] = t
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key in [k for k in state if ".mlp.experts." in k and k.endswith(".weight")]:
        base, rest = key.split(".mlp.experts.", 1)
        e, proj, _ = rest.split(".")
        experts.setdefault(base, {}).setdefault(int(e), {})[proj] = state.pop(key)
    for base, per in experts.items():  # back to transformers' fused expert tensors
        n = len(per)
        state[f"{base}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in range(n)]
        )
        state[f"{base}.mlp.experts.down_proj"] = torch.stack([per[e]["down_proj"] for e in range(n)])
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    return model


def trace_forward(
    model: Any, ids: list[int], records: dict[str, Any], guided: bool = True
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Run ``model`` on ``ids`` (one sequence) with every site of ``records`` (site -> ``SiteRows`` of
    the sequence's positions, codes recorded with b = 4) rounded to FP4: toward the record when
    ``guided``, else plain RTN with the record's g. Returns site -> (trainer values, engine values)
    over the recorded rows."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []

    def site_of(module_name: str) -> str | None:
        parts = module_name.split(".")
        if "layers" not in parts or len(parts) < parts.index("layers") + 4:
            return None
        i = parts[parts.index("layers") + 1]
        if parts[-2:] == ["mlp", "experts"]:  # the experts' input; the router reads the unrounded one
            return f"layers.{i}.mlp.input"
        if parts[-2] != "self_attn":
            return None
        proj = parts[-1]
        if proj in ("q_proj", "k_proj", "v_proj"):
            return f"layers.{i}.self_attn.qkv_proj.input"
        if proj == "o_proj":
            return f"layers.{i}.self_attn.o_proj.input"
        return None

    def make_hook(site: str) -> Any:
        rows = records[site]
        valid = torch.from_numpy(rows.valid)
        codes4 = torch.from_numpy(rows.codes)
        scales = torch.from_numpy(rows.scales)
        g = torch.from_numpy(rows.global_scale).reshape(-1, 1)

        def hook(mod: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            flat = x.reshape(-1, x.shape[-1]).float()
            n = flat.shape[0]
            width = flat.shape[1]
            engine = torch.zeros_like(flat)
            out = flat.clone()
            for r in range(n):
                if not bool(valid[r]):
                    continue
                e_codes = unpack_bits(codes4[r : r + 1], 4, width)
                engine[r] = dequantize_codes(e_codes, scales[r : r + 1], g[r], NVFP4)[0]
                if guided:
                    out[r] = guided_round(
                        flat[r : r + 1], codes4[r : r + 1], scales[r : r + 1], g[r], bits=4, fmt=NVFP4
                    )[0]
                else:
                    out[r] = dequantize(quantize(flat[r : r + 1], NVFP4, g[r]))[0]
            seen[site] = (out[valid], engine[valid])
            return (out.to(x.dtype).reshape(x.shape), *args[1:])

        return hook

    for name, mod in model.named_modules():
        site = site_of(name)
        if site is not None and site in records:
            handles.append(mod.register_forward_pre_hook(make_hook(site)))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen
