"""vLLM generating with tracestore recording: the one setting plus the KV connector in the engine config.

Run beside a sidecar (``tracestore serve``) with vLLM 0.32.0 and ``tracestore[vllm]`` installed::

    TRACESTORE_RECORD="sidecar=127.0.0.1:7433 run=example-run policy_version=0" \
        python examples/engine/vllm_record.py MODEL_DIR

It generates two samples for each of two prompts (n = 2: the prompt is stored once, the second
sample links to it) and prints one JSON line per sample: its trajectory, token count, gap (null
when sealed) and TraceRef. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the scheduler and the model
in this process, so each request's seal is queued when it finishes and its TraceRef comes back on
the request output. ``enforce_eager=True``: the capture hooks are Python and do not run inside
replayed CUDA graphs.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    setting = os.environ.get("TRACESTORE_RECORD", "")
    if not setting.strip():
        print("set TRACESTORE_RECORD (sidecar=... run=... policy_version=...)", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(
        sys.argv[1],
        enforce_eager=True,
        max_model_len=256,
        kv_transfer_config={
            "kv_connector": "TraceStoreConnector",
            "kv_connector_module_path": "tracestore.client.engines.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"tracestore": setting},
        },
    )
    outs = llm.generate(
        ["The capital of France is", "FP4 rounding"], SamplingParams(n=2, max_tokens=16, temperature=1.0)
    )
    for out in outs:
        params = (out.kv_transfer_params or {}).get("tracestore", {})
        print(json.dumps({"request": out.request_id, **params}))
    from tracestore.client.engines.vllm import hooks

    return 0 if hooks.ENGINE is None or hooks.ENGINE.close(60) else 1


if __name__ == "__main__":
    sys.exit(main())
