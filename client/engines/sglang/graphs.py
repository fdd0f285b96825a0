"""SGLang's CUDA-graph facts the plugin needs: how large a forward its graphs run, on which device.

The hooks that use them (graph capture, arming, replay) are in :mod:`.hooks`.
"""

from __future__ import annotations

from typing import Any

import torch


def graph_capacity(runner: Any, cuda_graph_config: Any = None) -> int:
    """Rows of the slab: the largest forward any of SGLang's graphs runs, padding included. The
    capturing ``runner``'s own (a decode runner's ``max_num_token``: its largest captured batch
    times tokens per request; a prefill runner's ``max_num_tokens``: its largest token bucket),
    and, from ``cuda_graph_config`` (SGLang's resolved ``CudaGraphConfig``; the prefill graphs are
    captured before the decode graphs, on one slab), the other phase's: the largest decode batch
    size times ``decode_num_tokens_per_req()``, the largest prefill token bucket."""
    sizes = [int(getattr(runner, "max_num_token", 0) or 0), int(getattr(runner, "max_num_tokens", 0) or 0)]
    if cuda_graph_config is not None:
        decode, prefill = cuda_graph_config.decode, cuda_graph_config.prefill
        if decode.backend != "disabled" and decode.bs:
            sizes.append(max(decode.bs) * int(runner.model_runner.decode_num_tokens_per_req()))
        if prefill.backend != "disabled" and prefill.bs:
            sizes.append(max(prefill.bs))
    return max(sizes)


def cuda_graph_config() -> Any:
    """SGLang's resolved ``CudaGraphConfig`` of this process (set once its server arguments are)."""
    from sglang.srt.runtime_context import get_exec

    return get_exec().graph.cuda_graph_config


def runner_device(model_runner: Any) -> torch.device:
    """The device a ``ModelRunner`` runs on (``cuda`` with its ``gpu_id``)."""
    dev = str(model_runner.device)
    return torch.device(dev, int(model_runner.gpu_id)) if dev == "cuda" else torch.device(dev)
