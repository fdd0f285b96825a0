"""The engine half of the vLLM end-to-end test, run as its own process (vLLM keeps global state).

``python vllm_e2e_engine.py MODEL_DIR OUT_JSON [--moe] [--mp] [--spec] [--cases] [--compiled]``
with ``TRACESTORE_RECORD`` set: registers
vLLM's pure-torch NVFP4 linear kernel for the CPU (vLLM ships it, but lists no NVFP4 kernel for
``PlatformEnum.CPU``), with ``--moe`` gives the NVFP4 emulation experts a CPU path
(:func:`cpu_nvfp4_experts`) and selects them (``moe_backend="emulation"``), runs ``LLM.generate``
with the tracestore connector (the plugin itself loads through its ``vllm.general_plugins`` entry
point), and writes every request's prompt ids, output ids and ``kv_transfer_params["tracestore"]``
to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys


def cpu_nvfp4_experts() -> None:
    """Give vLLM's NVFP4 emulation experts a CPU path (their ``apply`` is a Triton kernel): expert
    weights dequantized with tracestore's reference (``m * sf * g``, g = ``g1_alphas`` /
    ``g2_alphas`` per expert, as vLLM's kernel applies them), activations quantize-dequantized by
    vLLM's own ``moe_kernel_quantize_input(..., quantization_emulation=True)`` — a1 once on
    ``[tokens, hidden]``, a2 on each expert's rows — then SiLU-and-mul, matmuls, routing weights."""
    import torch
    from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import (
        Nvfp4QuantizationEmulationTritonExperts as Experts,
    )
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    from tracestore import NVFP4
    from tracestore.fp4 import dequantize_codes
    from tracestore.packing import unpack_fp4

    def deq(w: torch.Tensor, sf: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return dequantize_codes(unpack_fp4(w), sf.view(torch.uint8), g.float().reshape(()), NVFP4)

    def qdq(a: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return moe_kernel_quantize_input(
            A=a, A_scale=scale, quant_dtype="nvfp4", per_act_token_quant=False, quantization_emulation=True
        )[0]

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):  # fmt: skip
        qc = self.quant_config
        ROUTED.append(topk_ids.clone())  # the experts this layer's rows go to (truth for the routing records)
        a1 = qdq(hidden_states, qc.a1_gscale).float()
        out = torch.zeros(hidden_states.shape, dtype=torch.float32)
        # every expert over every token, weighted by its routing (0 where not routed): no
        # value-dependent shapes, so torch.compile traces it whole; a2's quantization is per row,
        # so a routed row's values are those of quantizing the expert's rows alone
        for e in range(w1.shape[0]):
            sel = (topk_ids == e).float()
            wgt = sel.sum(-1) if apply_router_weight_on_input else (sel * topk_weights.float()).sum(-1)
            h = a1 @ deq(w1[e], self.w1_scale_val[e], qc.g1_alphas[e]).T
            half = h.shape[1] // 2
            act = (torch.nn.functional.silu(h[:, :half]) * h[:, half:]).to(hidden_states.dtype)
            y = qdq(act, qc.a2_gscale).float() @ deq(w2[e], self.w2_scale_val[e], qc.g2_alphas[e]).T
            out = out + y * wgt.unsqueeze(1)
        output.copy_(out.reshape(output.shape).to(output.dtype))

    Experts.apply = apply
    Experts._supports_current_device = staticmethod(lambda: True)  # its Triton parent allows CUDA / XPU only


_cpu_done = False
ROUTED: list = []  # topk_ids the experts consumed, one per MoE layer call, since the forward began
TRUTH: dict[str, dict[int, list[list[int]]]] = {}  # request id -> position -> per MoE layer, the ids


def watch_routing() -> None:
    """Keep, after every forward of the one-process engine, each scheduled row's experts as the
    test's CPU experts consumed them (layer by call order), keyed by request id and position
    (``GPUModelRunner.positions``; rows laid out in ``input_batch.req_ids`` order). A position
    computed again later (a rejected draft) keeps its last forward's ids."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    inner = GPUModelRunner.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        ROUTED.clear()
        out = inner(self, scheduler_output, *args, **kwargs)
        sched = scheduler_output.num_scheduled_tokens
        total = sum(sched.values()) if sched else 0
        if total and ROUTED:
            pos = self.positions[:total].tolist()
            row = 0
            for rid in self.input_batch.req_ids:
                for _ in range(sched.get(rid, 0)):
                    TRUTH.setdefault(rid, {})[int(pos[row])] = [t[row].tolist() for t in ROUTED]
                    row += 1
        return out

    GPUModelRunner.execute_model = execute_model


def cpu_nvfp4() -> None:
    """vLLM's NVFP4 emulation on the CPU: the linear kernel registered for ``PlatformEnum.CPU`` and
    the experts' CPU path (once per process; also a ``vllm.general_plugins`` entry point with --mp)."""
    global _cpu_done
    if _cpu_done:
        return
    _cpu_done = True
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    cpu_nvfp4_experts()


def plugin_dir(root: str) -> str:
    """A directory holding a test-only distribution whose ``vllm.general_plugins`` entry point is
    :func:`cpu_nvfp4`, so that vLLM's spawned processes (which run no code of this script) get it
    too; put it and this file's directory on PYTHONPATH."""
    info = os.path.join(root, "tracestore_test_cpu_nvfp4-0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: tracestore-test-cpu-nvfp4\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\ntracestore_test_cpu_nvfp4 = vllm_e2e_engine:cpu_nvfp4\n")
    return root


def main() -> int:
    model, out_path = sys.argv[1], sys.argv[2]
    moe = "--moe" in sys.argv[3:]
    if "--mp" in sys.argv[3:]:  # vLLM's default: EngineCore and the worker in processes of their own
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        here = os.path.dirname(os.path.abspath(__file__))
        extra = [plugin_dir(os.path.join(os.path.dirname(out_path), "plugins")), here]
        os.environ["PYTHONPATH"] = os.pathsep.join(extra + [p for p in [os.environ.get("PYTHONPATH", "")] if p])
        sys.path[:0] = extra
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if moe:
        cpu_nvfp4()
        if "--mp" not in sys.argv[3:]:
            watch_routing()
    from vllm import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="bfloat16",
        enforce_eager="--compiled" not in sys.argv[3:],  # compiled: dynamo + inductor, the graph op in it
        max_model_len=256,
        **({"moe_backend": "emulation"} if moe else {}),
        **(
            {
                "speculative_config": {
                    "method": "ngram",
                    "num_speculative_tokens": 3,
                    "prompt_lookup_max": 3,
                    "prompt_lookup_min": 1,
                }
            }
            if "--spec" in sys.argv[3:]
            else {}
        ),
        enable_prefix_caching=True,
        block_size=32,  # (the CPU default, 128, is longer than these prompts; CPU attention needs a multiple of 32)
        kv_transfer_config={
            "kv_connector": "TraceStoreConnector",
            "kv_connector_module_path": "tracestore.client.engines.vllm.connector",
            "kv_role": "kv_both",
        },
    )
    prompts = ["the quick brown fox jumps", "four bit floating point rounding", "rollout engines and trainers"]
    greedy = "--spec" in sys.argv[3:]  # a random model decoding greedily repeats itself: ngram drafts get accepted
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0 if greedy else 0.8, seed=0, ignore_eos=True)
    )
    if "--cases" in sys.argv[3:]:  # the scheduler's own row cases: a GRPO group, then a prefix-cache hit
        long = [(7 * i) % 97 + 3 for i in range(72)]
        group = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
        outs += llm.generate([{"prompt_token_ids": long}], group)
        outs += llm.generate(
            [{"prompt_token_ids": long[:64] + [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True)
        )
    rows = []
    for o in outs:
        rows.append(
            {
                "request": o.request_id,
                "prompt_ids": list(o.prompt_token_ids or []),
                "output_ids": list(o.outputs[0].token_ids),
                "all_output_ids": [list(c.token_ids) for c in o.outputs],
                "num_cached_tokens": o.num_cached_tokens,
                "tracestore": (o.kv_transfer_params or {}).get("tracestore"),
            }
        )
    from tracestore.client.engines.vllm import hooks

    ok = hooks.ENGINE is not None and hooks.ENGINE.close(60)
    stats = None if hooks.ENGINE is None else hooks.ENGINE.stats
    graph = None
    if hooks.GRAPH is not None:
        graph = {"active": hooks.GRAPH.active, "armed": hooks.GRAPH.armed, **hooks.GRAPH.stats}
    with open(out_path, "w") as f:
        ended = None if hooks.ENGINE is None else hooks.ENGINE.ended
        json.dump(
            {"requests": rows, "flushed": ok, "stats": stats, "ended": ended, "graph": graph, "routing": TRUTH}, f
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
