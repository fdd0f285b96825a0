"""One rank of the parallel tests (tests/engines/test_vllm_parallel.py), as its own process:
``python vllm_tp_rank.py RANK WORLD PORT OUT_JSON [DP_RANK DP_SIZE]``. Initialises vLLM's own
parallel state (gloo, TP = WORLD; with DP_SIZE, vLLM's offline data-parallel mode from its
``VLLM_DP_*`` variables, the world spanning the replicas), builds the worker-role connector and
real Column/RowParallelLinear layers, and writes what the plugin decided on this rank: whether it
records, its sites, its ranks and the sidecar address its ``sidecar=`` template gives."""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dp_rank, dp_size = (int(sys.argv[5]), int(sys.argv[6])) if len(sys.argv) > 6 else (0, 1)
    os.environ.setdefault("VLLM_DIST_IDENT", f"tracestore-tp-{port}")  # the CPU communicator's group name
    if dp_size > 1:  # vLLM's offline data parallelism: every replica's process meets at one port
        os.environ.update(
            VLLM_DP_SIZE=str(dp_size),
            VLLM_DP_RANK=str(dp_rank),
            VLLM_DP_MASTER_IP="127.0.0.1",
            VLLM_DP_MASTER_PORT=port,
        )
    sidecar = "unix:///run/ts/{dp_rank}-{rank:02d}.sock"
    os.environ["TRACESTORE_RECORD"] = f"sidecar={sidecar} run=tp policy_version=0 sites=all writer=tp-{rank}"
    from tracestore.client.engines.vllm import hooks
    from tracestore.client.engines.vllm.connector import TraceStoreConnector
    from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    cfg = VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=world),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TraceStoreConnector",
            kv_role="kv_both",
            kv_connector_module_path="tracestore.client.engines.vllm.connector",
        ),
    )
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(
            world_size=world,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        TraceStoreConnector(cfg, KVConnectorRole.WORKER, None)
        col = ColumnParallelLinear(64, 32, bias=False, prefix="model.layers.0.self_attn.qkv_proj")
        row = RowParallelLinear(64, 32, bias=False, prefix="model.layers.0.self_attn.o_proj")
        names = {}
        for label, layer in (("column", col), ("row", row)):
            seen = hooks._wrap_apply_weights(lambda self, layer, x, bias: getattr(hooks._DENSE, "name", None))
            names[label] = seen(None, layer, None)
    with open(out, "w") as f:
        json.dump(
            {
                "tp_rank": ps.get_tp_group().rank_in_group,
                "tp_size": ps.get_tp_group().world_size,
                "records": hooks.ENGINE is not None,
                "world_rank": ps.get_world_group().rank,
                "ranks": hooks.engine_ranks(),
                "address": None if hooks.ENGINE is None else hooks.ENGINE.address(),
                "sites": names,
                "row_input_is_parallel": bool(row.input_is_parallel),
            },
            f,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
