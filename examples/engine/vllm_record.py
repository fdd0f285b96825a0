"""vLLM generating with tracestore recording: the one setting plus the KV connector in the engine config.

Run beside a sidecar (``tracestore serve``) with vLLM 0.32.0 and ``tracestore[vllm]`` installed::

    TRACESTORE_RECORD="sidecar=127.0.0.1:7433 run=example-run policy_version=0" \\
        python examples/engine/vllm_record.py MODEL_DIR [--eager]

It generates a group of two samples for each of two prompts (GRPO-style: each sample its own
request, so each request output carries its own TraceRef; the prompt is stored once, the second
sample links to it) and prints one JSON line per sample: its trajectory, token count, gap (null
when sealed) and TraceRef. vLLM's asynchronous scheduling (its default on GPUs) stays on: each
decode row is committed once the next step learns its token id (the plugin refuses it only
together with speculative decoding). CUDA graphs and torch.compile stay on (the capture goes
through a graph-safe op); ``--eager`` runs without them.
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the scheduler and the model in this process, so each
request's seal is queued when it finishes; in vLLM's default layout the worker seals it one step
later, and the TraceRef comes back on the output all the same.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--eager"]
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    setting = os.environ.get("TRACESTORE_RECORD", "")
    if not setting.strip():
        print("set TRACESTORE_RECORD (sidecar=... run=... policy_version=...)", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(
        args[0],
        enforce_eager="--eager" in sys.argv[1:],
        max_model_len=256,
        kv_transfer_config={
            "kv_connector": "TraceStoreConnector",
            "kv_connector_module_path": "tracestore.client.engines.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"tracestore": setting},
        },
    )
    prompts = ["The capital of France is", "FP4 rounding"]
    group = 2  # samples per prompt, each its own request (an n > 1 output carries one sample's params)
    outs = llm.generate(
        [p for p in prompts for _ in range(group)],
        [SamplingParams(max_tokens=16, temperature=1.0, seed=k) for _ in prompts for k in range(group)],
    )
    for out in outs:
        params = (out.kv_transfer_params or {}).get("tracestore", {})
        print(json.dumps({"request": out.request_id, **params}))
    from tracestore.client.engines.vllm import hooks

    return 0 if hooks.ENGINE is None or hooks.ENGINE.close(60) else 1


if __name__ == "__main__":
    sys.exit(main())
