"""The engine half of the vLLM end-to-end test, run as its own process (vLLM keeps global state).

``python vllm_e2e_engine.py MODEL_DIR OUT_JSON`` with ``TRACESTORE_RECORD`` set: registers vLLM's
pure-torch NVFP4 linear kernel for the CPU (vLLM ships it, but lists no NVFP4 kernel for
``PlatformEnum.CPU``), runs ``LLM.generate`` with the tracestore connector (the plugin itself loads
through its ``vllm.general_plugins`` entry point), and writes every request's prompt ids, output
ids and ``kv_transfer_params["tracestore"]`` to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    model, out_path = sys.argv[1], sys.argv[2]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
        kv_transfer_config={
            "kv_connector": "TraceStoreConnector",
            "kv_connector_module_path": "tracestore.client.engines.vllm.connector",
            "kv_role": "kv_both",
        },
    )
    prompts = ["the quick brown fox jumps", "four bit floating point rounding", "rollout engines and trainers"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.8, seed=0, ignore_eos=True))
    rows = []
    for o in outs:
        rows.append(
            {
                "request": o.request_id,
                "prompt_ids": list(o.prompt_token_ids or []),
                "output_ids": list(o.outputs[0].token_ids),
                "tracestore": (o.kv_transfer_params or {}).get("tracestore"),
            }
        )
    from tracestore.client.engines.vllm import hooks

    ok = hooks.ENGINE is not None and hooks.ENGINE.close(60)
    stats = None if hooks.ENGINE is None else hooks.ENGINE.stats
    with open(out_path, "w") as f:
        json.dump({"requests": rows, "flushed": ok, "stats": stats}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
