"""The SGLang scheduler process's place in SGLang's parallel layout, read from its process-wide
parallel context (``sglang.srt.runtime_context.get_parallel()``, published by SGLang's launcher in
each scheduler process before the ``Scheduler`` is built): the ranks for the ``sidecar=``
placeholders of the recording setting (:mod:`tracestore.client.engines.setting`), whether this
process records, and the layouts whose rows no one process can record.

SGLang runs one scheduler per tensor-parallel rank; the ranks of a TP group schedule the same
batch and, outside the layouts :func:`refusal` names, hold every token of it at the MoE expert
input (FC1) and at the inputs of column-parallel linears (replicated after the previous layer's
all-reduce). So TP rank 0 records and the others would record the same rows again (as the vLLM
plugin does). Inputs of row-parallel linears are split across the ranks and are not recorded.
"""

from __future__ import annotations

from typing import Any


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


def recording_rank() -> bool:
    """Whether this scheduler process records: rank 0 of its tensor-parallel group
    (``get_parallel().tp_rank``; SGLang's data-parallel replicas each have their own TP group, so
    each replica's rank 0 records, to the sidecar ``{dp_rank}`` names)."""
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank) == 0


def refusal(is_moe: bool, dense: bool) -> str | None:
    """Why TP rank 0's forward rows are not its scheduler's batch in this process's layout (None:
    they are), for a model with MoE layers (``is_moe``) recorded with the dense sites too
    (``dense``, ``sites=all``). Read after SGLang's ``initialize_moe_config`` (its MoE flags):

    - pipeline parallelism: no one process runs every layer, so no one recorder has the run's sites;
    - attention data parallelism (``attn_dp_size`` > 1, DP attention): each attention-DP group
      has its own scheduler and requests, and at the FFN the groups' tokens are gathered (or, with
      an all-to-all MoE backend, sent to their experts' ranks): the FFN's rows are other
      schedulers' tokens too;
    - attention context parallelism (``attn_cp_size`` > 1): a context-parallel prefill splits a
      request's tokens across the CP ranks (and gathers them again at a MoE);
    - a MoE whose input is a rank-local token shard (SGLang's
      ``is_moe_input_scattered_across_dp_ranks``: an all-to-all backend such as DeepEP, or DWDP):
      rank 0's FC1 rows are a share of the batch;
    - with dense sites, input-scattered attention or LayerNorm sequence parallelism: between
      layers each attention-TP rank holds a slice of the batch's rows.
    """
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    fix = (
        "Run replicas with data parallelism instead (--dp-size: each replica's TP rank 0 records), "
        "or unset TRACESTORE_RECORD."
    )
    if int(p.pp_size) > 1:
        return (
            "tracestore records within one process per engine and does not support pipeline parallelism "
            "(each stage runs other layers); use tensor parallelism, or unset TRACESTORE_RECORD."
        )
    if bool(p.attn_dp_enabled):
        return (
            "tracestore cannot record SGLang's data-parallel attention (attn_dp_size "
            f"{int(p.attn_dp_size)}): each attention-DP group schedules its own requests, and the FFN "
            "runs on the groups' gathered tokens (or tokens sent to their experts' ranks), so a rank's "
            f"MoE and FFN input rows are not its own batch's. {fix}"
        )
    if int(p.attn_cp_size) > 1:
        return (
            f"tracestore cannot record SGLang's attention context parallelism (attn_cp_size {int(p.attn_cp_size)}): "
            f"a context-parallel prefill splits each request's tokens across the CP ranks. {fix}"
        )
    if is_moe:
        from sglang.srt.layers.moe.utils import is_moe_input_scattered_across_dp_ranks

        if is_moe_input_scattered_across_dp_ranks():
            return (
                "tracestore cannot record a MoE whose input SGLang scatters across the ranks (an all-to-all "
                "MoE backend, --moe-a2a-backend, or DWDP): each rank's expert input is a share of the "
                "batch's tokens. Use --moe-a2a-backend none, or unset TRACESTORE_RECORD."
            )
    if dense:
        from sglang.srt.layers.layer_boundary.layout import input_scattered_configured
        from sglang.srt.layers.layernorm_sp import layernorm_sp_enabled

        if input_scattered_configured() or layernorm_sp_enabled():
            return (
                "tracestore cannot record dense sites (sites=all) with input-scattered attention or "
                "LayerNorm sequence parallelism: between layers each attention-TP rank holds a slice of "
                "the batch's rows. Turn those off, or record the MoE sites only (sites=moe)."
            )
    return None


def row_parallel_slice(layer: Any) -> bool:
    """Whether ``layer``'s input is a tensor-parallel slice of the site (a row-parallel linear with
    TP > 1: ``input_size_per_partition`` = ``input_size`` / TP)."""
    part = getattr(layer, "input_size_per_partition", None)
    size = getattr(layer, "input_size", None)
    return isinstance(part, int) and isinstance(size, int) and part != size
