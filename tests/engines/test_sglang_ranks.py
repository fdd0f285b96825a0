"""SGLang 0.5.23 under tensor parallelism: only TP rank 0 records, layouts whose rows rank 0 cannot
record are refused before the model loads, and row-parallel inputs (a slice of the site) are not
recorded. Driven by SGLang's own configuration (``ServerArgs``, published into its process-wide
parallel context as its launcher does in each scheduler process), its real
``Scheduler.init_moe_gemm_config`` and its real linear layers, on the CPU."""

from __future__ import annotations

import ast
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.managers.schedule_batch",
    reason="SGLang is not importable here: the engine venv (.ci/engines-venv) runs these",
)
pytestmark = pytest.mark.engines

import torch  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from tracestore.client.engines.recording import EngineRecorder  # noqa: E402
from tracestore.client.engines.rows import RowMapper  # noqa: E402
from tracestore.client.engines.setting import parse_setting  # noqa: E402
from tracestore.client.engines.sglang import hooks  # noqa: E402

from tests.engines import _ast  # noqa: E402
from tracestore.errors import ConfigError  # noqa: E402

MODEL_PATH = ""
MOE = SimpleNamespace(hf_text_config=SimpleNamespace(num_experts=8, num_experts_per_tok=2))
DENSE = SimpleNamespace(hf_text_config=SimpleNamespace(hidden_size=32))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local model directory for SGLang's argument resolution (it reads the model's config)."""
    d = tmp_path_factory.mktemp("model")
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 128,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def hooked(model_dir: Path) -> Iterator[None]:
    """The plugin's config hook applied to SGLang's real ``Scheduler.init_moe_gemm_config``."""
    global MODEL_PATH
    MODEL_PATH = str(model_dir)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in (
        (f"{hooks.SCHEDULER}.init_moe_gemm_config", hooks.after_scheduler_config),
        (f"{hooks.LINEAR_BASE}.__init__", hooks.after_linear_init),  # (the linears' site names)
    ):
        if target not in HookRegistry._patched:
            HookRegistry.register(target, hook, HookType.AFTER)
            HookRegistry.apply_hooks()
    old = hooks.ENGINE, hooks.MAPPER
    try:
        yield
    finally:
        hooks.ENGINE, hooks.MAPPER = old
        reset_context()


def start(world_rank: int, model: Any, sites: str = "moe", **server: Any) -> None:
    """A scheduler process of ``ServerArgs(**server)`` at ``world_rank`` up to SGLang's MoE and
    GEMM config (its launcher publishes the config, then ``Scheduler.__init__`` runs this step)."""
    publish(
        ServerArgs(model_path=MODEL_PATH, device="cpu", skip_tokenizer_init=True, **server),
        role="scheduler",
        ranks=SpawnRanks(world_rank=world_rank),
    )
    hooks.ENGINE = EngineRecorder(parse_setting(f"sidecar=127.0.0.1:1 run=tp policy_version=0 sites={sites}"))
    hooks.MAPPER = RowMapper(block=1)
    Scheduler.init_moe_gemm_config(SimpleNamespace(model_config=model))


def test_the_config_hook_runs_in_each_scheduler_before_the_model_loads() -> None:
    """Each scheduler process publishes its config before building the ``Scheduler``, whose
    ``__init__`` sets the model config and the MoE flags (``init_moe_gemm_config``) before it
    builds the model worker; an exception there is logged and stops the engine."""
    init = _ast.functions(_ast.source_tree("sglang.srt.managers.scheduler"), "__init__")
    calls = [
        _ast.dotted(n.func)
        for fn in init
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and _ast.dotted(n.func).startswith("self.init_")
    ]
    assert "self.init_moe_gemm_config" in calls and "self.init_model_worker" in calls
    assert calls.index("self.init_model_config") < calls.index("self.init_moe_gemm_config")
    assert calls.index("self.init_moe_gemm_config") < calls.index("self.init_model_worker")
    from sglang.srt.managers import scheduler as sched_mod

    src = inspect.getsource(sched_mod.run_scheduler_process)
    assert src.index("publish(") < src.index("scheduler = Scheduler(server_args, port_args)")
    assert "except Exception" in src and "parent_process.send_signal(signal.SIGQUIT)" in src


@pytest.mark.parametrize("world_rank", [0, 1])
def test_only_tensor_parallel_rank_0_records(hooked: None, world_rank: int) -> None:
    start(world_rank, MOE, tp_size=2)
    assert (hooks.ENGINE is not None) == (world_rank == 0)


def test_each_data_parallel_replica_records_on_its_rank_0(hooked: None) -> None:
    """``--dp-size`` replicas (no DP attention) are separate engines, each with its own TP group."""
    publish(
        ServerArgs(model_path=MODEL_PATH, device="cpu", skip_tokenizer_init=True, tp_size=2, dp_size=2),
        role="scheduler",
        ranks=SpawnRanks(world_rank=0, dp_rank=1),
    )
    hooks.ENGINE = EngineRecorder(parse_setting("sidecar=unix:///s/{dp_rank}.sock run=tp policy_version=0"))
    Scheduler.init_moe_gemm_config(SimpleNamespace(model_config=MOE))
    assert hooks.ENGINE is not None
    from tracestore.client.engines.sglang.ranks import engine_ranks

    hooks.ENGINE.ranks = engine_ranks
    assert hooks.ENGINE.address() == "unix:///s/1.sock"


@pytest.mark.parametrize(
    ("model", "sites", "server", "why"),
    [
        (MOE, "moe", dict(tp_size=4, attn_dp_size=2, enable_dp_attention=True), "data-parallel attention"),
        (DENSE, "moe", dict(tp_size=4, attn_dp_size=2, enable_dp_attention=True), "data-parallel attention"),
        (MOE, "moe", dict(tp_size=2, pp_size=2), "pipeline parallelism"),
        (MOE, "moe", dict(tp_size=2, attn_cp_size=2), "context parallelism"),
        (MOE, "moe", dict(tp_size=2, ep_size=2, moe_a2a_backend="deepep"), "all-to-all"),
        (MOE, "all", dict(tp_size=2, enable_attn_tp_input_scattered=True), "input-scattered"),
    ],
)
def test_layouts_rank_0_cannot_record_are_refused(
    hooked: None, model: Any, sites: str, server: dict[str, Any], why: str
) -> None:
    with pytest.raises(ConfigError, match=why):
        start(0, model, sites, **server)


@pytest.mark.parametrize(
    ("model", "sites", "server"),
    [
        (DENSE, "all", dict(tp_size=2, ep_size=2, moe_a2a_backend="deepep")),  # no MoE to dispatch
        (MOE, "moe", dict(tp_size=2, enable_attn_tp_input_scattered=True)),  # the MoE input is the whole batch
        (MOE, "moe", dict(tp_size=2, ep_size=2)),  # experts split, tokens not
    ],
)
def test_layouts_rank_0_records(hooked: None, model: Any, sites: str, server: dict[str, Any]) -> None:
    start(0, model, sites, **server)
    assert hooks.ENGINE is not None


def test_row_parallel_inputs_are_not_recorded_under_tp(hooked: None) -> None:
    """SGLang's real linears at TP 2 (rank 0): a row-parallel input is a slice of the site (not
    recorded), a column-parallel one the whole site; at TP 1 both are whole."""
    from sglang.srt.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    def site_during_apply(layer: torch.nn.Module) -> Any:
        return hooks.around_linear_apply(lambda m, lay, x, b: hooks._DENSE.site, None, layer, torch.zeros(2, 32))

    for tp, sliced in ((2, True), (1, False)):
        start(0, DENSE, "all", tp_size=tp)
        down = RowParallelLinear(64, 32, bias=False, prefix="model.layers.0.mlp.down_proj")
        up = MergedColumnParallelLinear(32, [64, 64], bias=False, prefix="model.layers.0.mlp.gate_up_proj")
        assert down.input_size_per_partition == 64 // tp
        site = site_during_apply(down)
        assert site is None if sliced else site[0] == "layers.0.mlp.down_proj.input"
        assert site_during_apply(up)[0] == "layers.0.mlp.gate_up_proj.input"
        reset_context()
