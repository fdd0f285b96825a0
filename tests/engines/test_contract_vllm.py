"""Contract: every vLLM symbol the tracestore plugin hooks exists in the installed tree, with the
signature and call shape the plugin relies on. An engine bump that moves one fails here, loudly."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: the engine venv (.ci/engines-venv) runs these")
pytestmark = pytest.mark.engines

from tests.engines import _ast  # noqa: E402

VALIDATED = "0.32.0"


def params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_version_is_the_validated_one() -> None:
    import vllm
    from tracestore.client.engines.vllm import VALIDATED_VERSIONS

    assert vllm.__version__.split("+")[0] == VALIDATED
    assert VALIDATED in VALIDATED_VERSIONS


def test_general_plugins_group_and_loader() -> None:
    import vllm.plugins as plugins

    assert plugins.DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    assert params(plugins.load_general_plugins) == []
    # each plugin function is called bare, outside any try: a plugin that raises stops the engine
    tree = _ast.functions(_ast.source_tree("vllm.plugins"), "load_general_plugins")[0]
    assert any(
        isinstance(c.func, _ast.ast.Name) and c.func.id == "func"
        for c in _ast.ast.walk(tree)
        if isinstance(c, _ast.ast.Call)
    )


@pytest.mark.parametrize(
    "entry, needed",
    [
        ("trtllm_fp4_block_scale_moe", {"hidden_states", "hidden_states_scale", "per_token_scale", "routing_logits"}),
        ("trtllm_fp4_block_scale_routed_moe", {"hidden_states", "hidden_states_scale", "topk_ids"}),
    ],
)
def test_flashinfer_moe_entry_is_a_module_attribute_at_call_time(entry: str, needed: set[str]) -> None:
    mod = "vllm.model_executor.layers.fused_moe.experts.trtllm_nvfp4_moe"
    tree = _ast.source_tree(mod)
    found = list(_ast.calls(tree, f"flashinfer.fused_moe.{entry}"))
    assert found, f"{mod} no longer calls flashinfer.fused_moe.{entry}"
    for call in found:
        assert needed <= _ast.keywords(call), (entry, _ast.keywords(call))
    # `import flashinfer` inside the calling function: the attribute is looked up at each call
    fns = [
        f
        for f in _ast.functions(tree, "_invoke_kernel") + _ast.functions(tree, "apply")
        if list(_ast.calls(f, f"flashinfer.fused_moe.{entry}"))
    ]
    assert fns and all(
        any(isinstance(n, _ast.ast.Import) and n.names[0].name == "flashinfer" for n in _ast.ast.walk(f)) for f in fns
    )


def test_per_token_input_scale_is_linear_layout() -> None:
    tree = _ast.source_tree("vllm.model_executor.layers.quantization.utils.flashinfer_utils")
    fn = _ast.functions(tree, "quantize_nvfp4_per_token_input")[0]
    call = next(_ast.calls(fn, "nvfp4_quantize"))
    kw = {k.arg: _ast.dotted(k.value) for k in call.keywords}
    assert kw["sfLayout"] == "SfLayout.layout_linear"


def test_nvfp4_linear_kernel_apply_weights() -> None:
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel

    assert params(NvFp4LinearKernel.apply_weights) == ["self", "layer", "x", "bias"]
    assert inspect.signature(NvFp4LinearKernel.apply_weights).parameters["bias"].default is None
    assert issubclass(EmulationNvFp4LinearKernel, NvFp4LinearKernel)
    assert params(EmulationNvFp4LinearKernel.apply_weights) == ["self", "layer", "x", "bias"]


def test_register_linear_kernel() -> None:
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum

    assert params(linear.register_linear_kernel)[:3] == ["kernel_class", "platform", "kernel_type"]
    assert PlatformEnum.CPU not in linear._POSSIBLE_NVFP4_KERNELS  # hence the registration on CPU


def test_kv_connector_base() -> None:
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    assert "kv_connector_module_path" in KVTransferConfig.__dataclass_fields__
    assert "kv_connector_extra_config" in KVTransferConfig.__dataclass_fields__
    assert params(KVConnectorBase_V1.build_connector_meta) == ["self", "scheduler_output"]
    assert params(KVConnectorBase_V1.request_finished) == ["self", "request", "block_ids"]
    assert params(KVConnectorBase_V1.__init__)[:4] == ["self", "vllm_config", "role", "kv_cache_config"]
    assert params(KVConnectorBase_V1.bind_connector_metadata) == ["self", "connector_metadata"]
    assert params(KVConnectorBase_V1.on_new_request) == ["self", "request"]
    assert KVConnectorBase_V1.__abstractmethods__ == {
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
    }
    assert inspect.isclass(KVConnectorMetadata)


def test_scheduler_output_fields() -> None:
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    assert {"req_id", "prompt_token_ids", "num_computed_tokens"} <= set(NewRequestData.__dataclass_fields__)
    assert {"req_ids", "num_computed_tokens", "resumed_req_ids"} <= set(CachedRequestData.__dataclass_fields__)
    assert {
        "scheduled_new_reqs",
        "scheduled_cached_reqs",
        "num_scheduled_tokens",
        "scheduled_spec_decode_tokens",
        "finished_req_ids",
        "preempted_req_ids",
        "kv_connector_metadata",
    } <= set(SchedulerOutput.__dataclass_fields__)


def test_request_fields() -> None:
    from vllm.v1.request import Request, RequestStatus

    for name in ("request_id", "prompt_token_ids", "all_token_ids", "num_computed_tokens", "spec_token_ids", "status"):
        assert (
            name in Request.__init__.__code__.co_names
            or hasattr(Request, name)
            or name in inspect.getsource(Request.__init__)
        ), name
    assert RequestStatus.FINISHED_ABORTED.is_finished(RequestStatus.FINISHED_ABORTED)


def test_ref_nvfp4_quant_and_its_lookups() -> None:
    from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils as emu

    assert params(emu.ref_nvfp4_quant) == ["x", "global_scale", "block_size"]
    assert params(emu.ref_nvfp4_quant_dequant) == ["x", "global_scale", "block_size"]
    # the linear path looks ref_nvfp4_quant_dequant up as a module global at call time
    tree = _ast.source_tree(emu.__name__)
    run = _ast.functions(tree, "run_nvfp4_emulations")[0]
    assert list(_ast.calls(run, "ref_nvfp4_quant_dequant"))
    # the MoE path imports it by name into fused_moe/utils.py: both bindings must be patched
    imports = _ast.from_imports(_ast.source_tree("vllm.model_executor.layers.fused_moe.utils"))
    assert (emu.__name__, "ref_nvfp4_quant_dequant") in imports


def test_model_runner_hooks_for_graph_capture() -> None:
    """The graph path wraps ``capture_model`` and ``execute_model`` (arm the slab at
    ``max_num_tokens`` rows on ``device``; the largest forward and every captured size fit in
    ``max_num_batched_tokens``); the worker-role connector reads ``model_config.enforce_eager``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert params(GPUModelRunner.capture_model) == ["self"]
    assert params(GPUModelRunner.execute_model)[:2] == ["self", "scheduler_output"]
    tree = _ast.source_tree("vllm.v1.worker.gpu_model_runner")
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner")
    init = _ast.functions(cls, "__init__")[0]
    assigned = {_ast.dotted(t) for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets}
    assert {"self.model_config", "self.device", "self.max_num_tokens"} <= assigned
    dummy = ast.unparse(_ast.functions(tree, "_dummy_run")[0])
    assert "assert num_tokens <= self.max_num_tokens" in dummy  # every forward, captured sizes included
    vcfg = inspect.getsource(importlib.import_module("vllm.config.vllm"))
    assert "max_cudagraph_capture_size = min(max_num_tokens, max_cudagraph_capture_size)" in vcfg
    from vllm.config import ModelConfig

    assert "enforce_eager" in ModelConfig.__dataclass_fields__
