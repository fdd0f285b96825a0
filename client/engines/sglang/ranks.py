"""The SGLang scheduler process's ranks, for the ``sidecar=`` placeholders of the recording
setting (:mod:`tracestore.client.engines.setting`), read from SGLang's process-wide parallel
context (``sglang.srt.runtime_context.get_parallel()``, published by SGLang's launcher in each
scheduler process)."""

from __future__ import annotations


def engine_ranks() -> dict[str, int]:
    """``{"rank", "dp_rank"}`` of this scheduler process: ``dp_rank`` is SGLang's replica index
    (``dp_rank``; ``None``, no data-parallel controller, is 0); ``rank`` is ``dp_rank ×
    launch_world_size + launch_world_rank`` — SGLang's replicas each build their own WORLD group, so
    its rank there repeats across replicas, and this numbering is the one vLLM's world group uses."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    dp = p.dp_rank
    dp = 0 if dp is None else int(dp)
    return {"rank": dp * int(p.launch_world_size) + int(p.launch_world_rank), "dp_rank": dp}
