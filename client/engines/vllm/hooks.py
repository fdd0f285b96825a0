"""Where the vLLM plugin captures (vLLM 0.32.0; every hooked name is checked by tests/engines).

- **MoE expert inputs (FC1)**: ``flashinfer.fused_moe.trtllm_fp4_block_scale_moe`` and
  ``..._routed_moe`` (vLLM's trtllm NVFP4 experts look them up as module attributes at call time)
  are wrapped by :func:`tracestore.client.engines.capture.wrap_moe_entry`; the site is the MoE
  runner whose ``_forward_impl`` is running (``MoERunner.layer_name``, e.g.
  ``model.layers.3.mlp.experts`` -> ``layers.3.mlp.input``). The FC2 input is quantized inside the
  FlashInfer kernel: it is never seen, never recorded.
- **Dense NVFP4 linears**: ``apply_weights`` of every ``NvFp4LinearKernel`` subclass sets the
  layer's site (``layers.{i}.<path>.input``, from ``layer.prefix``) while it runs; an input that
  arrives already quantized (a ``QuantizedActivation``: ``data`` uint8 codes, ``scale`` swizzled
  128×4 E4M3) is recorded there. Recorded only with ``sites=all``.
- **CPU emulation** (vLLM's pure-torch NVFP4 path): ``ref_nvfp4_quant_dequant`` — the module global
  ``run_nvfp4_emulations`` calls and the binding ``fused_moe/utils.py`` imported by name — is
  wrapped so the codes and scales vLLM's own ``ref_nvfp4_quant`` produces are recorded under the
  running site (the first quantization inside a MoE runner is its FC1 input; later ones, FC2, are
  not recorded), and the dequantized result the engine uses is the original function's.
- **Routing** (``routing=1``, the default): each MoE runner's chosen experts through vLLM's own
  routed-experts capture points, bound when ``BaseModelLoader.load_model`` has loaded the target
  model (not a draft model; before any forward, so compiled and captured graphs hold the calls)
  as vLLM's ``bind_routed_experts_capturer`` binds its own: the router's ``capture_fn``
  (``BaseRouter.set_capture_fn``: ``_select_experts`` calls it with the logical top-k ids before
  the EPLB mapping) or, for a monolithic kernel that routes inside (FlashInfer's fused MoE), a
  ``RoutedExpertsSink`` on the runner's ``routed_experts`` whose buffer vLLM passes to the kernel
  as ``routing_replay_out``. A capture function vLLM (or anyone) bound already is kept and called
  first. Recorded as the ``routed_experts`` site ``layers.{layer_id}.mlp.router`` (top_k =
  ``moe_config.experts_per_token``, ``num_logical_experts`` experts; ids only, no gate weights).
  Not recorded under data parallelism (the router may see other ranks' tokens) nor for a router
  or kernel without a capture point (logged once per layer).
- **Rows**: ``GPUModelRunner.execute_model`` clears the capture before the forward and afterwards
  hands it to :class:`~tracestore.client.engines.recording.EngineRecorder` with the step plan the
  KV connector bound (:mod:`.connector`) and the worker's own request order
  (``input_batch.req_ids``).

- **Compiled and CUDA-graph forwards** (``enforce_eager=False``): every hook above routes its codes
  through :data:`GRAPH` (:class:`~tracestore.client.engines.graph.GraphCapture`), a registered torch
  op that ``torch.compile`` keeps in its graph and a CUDA graph captures: its Python runs while
  dynamo traces or a graph is captured, its copies into the slab at every replay.
  The worker-role connector turns it on from ``model_config.enforce_eager``; the warm-up
  (``profile_run``) notes the sites;
  ``capture_model`` (or the first ``execute_model``) arms the slab at ``max_num_batched_tokens``
  rows on the runner's device (with speculative decoding, plus spare rows that keep draft rows on
  the device until the scheduler confirms them: :func:`held_rows`); after each forward the plan's
  rows are committed from the slab (padded rows of a captured batch size are never named by the
  plan).
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any, cast

import torch
from tracestore.client.engines.capture import SCOPE, patch_attr, site_name
from tracestore.client.engines.capture import install_flashinfer as _install_flashinfer
from tracestore.client.engines.codes import codes_from_values, record_rows
from tracestore.client.engines.graph import GraphCapture
from tracestore.client.engines.recording import EngineRecorder
from tracestore.client.engines.routing import route_spec
from tracestore.client.engines.setting import RecordSetting

from tracestore.packing import pack_bits, pack_fp4
from tracestore.records import SiteSpec

log = logging.getLogger("tracestore.client.engines")

EMU = "vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils"
MOE_UTILS = "vllm.model_executor.layers.fused_moe.utils"
RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
NVFP4_KERNELS = "vllm.model_executor.kernels.linear.nvfp4"
MODEL_RUNNER = "vllm.v1.worker.gpu_model_runner"
BASE_ROUTER = "vllm.model_executor.layers.fused_moe.router.base_router"
CAPTURER = "vllm.model_executor.layers.fused_moe.routed_experts_capturer"
MODULAR = "vllm.model_executor.layers.fused_moe.modular_kernel"
LOADER = "vllm.model_executor.model_loader.base_loader"

ENGINE: EngineRecorder | None = None
GRAPH: GraphCapture | None = None  # graph-safe capture, active for compiled / CUDA-graph forwards
LOCAL_WORKER = False  # a worker-role connector exists in this process (it records; seal here)
PLAN = threading.local()  # .value: the step plan the connector bound for the coming forward
_MOE_SEEN = threading.local()  # .n: quantizations seen inside the running MoE runner
_ROUTE_WARNED: set[str] = set()


def _capture(site: str, codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> None:
    if GRAPH is not None and not GRAPH.armed:  # an eager warm-up declares its sites for the slab
        GRAPH.note(site, codes.shape[1] * 8 // _bits())
    if ENGINE is not None:
        ENGINE.capture(site, codes, scales, g)


def _bits() -> int:
    return 1 if ENGINE is None else ENGINE.setting.bits


def _graph() -> GraphCapture | None:
    """The graph capture while it is active (hooks then record through its op), else None. Under
    dynamo's tracing always the op: the eager path reads device data on the host."""
    if GRAPH is not None and (GRAPH.active or torch.compiler.is_compiling()):
        return GRAPH
    return None


def recording_rank() -> bool:
    """Whether this worker process records: rank 0 of its tensor-parallel group (True without
    model parallelism). Every rank of a TP group holds the same MoE FC1 input and the same inputs
    of column-parallel linears (replicated after the previous layer's all-reduce), so one rank's
    records are complete and another's would be the same rows again; rank 0 exists at every TP
    size. Inputs of row-parallel linears are split across the ranks and are not recorded under TP
    (:func:`_wrap_apply_weights`)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    return int(ps.get_tp_group().rank_in_group) == 0


def engine_ranks() -> dict[str, int]:
    """This worker's ranks for the ``sidecar=`` placeholders: ``rank``, its rank in vLLM's world
    group (with data parallelism vLLM's world spans the replicas: ``data_parallel_rank × TP × PP``
    plus the rank within the replica), and ``dp_rank``, its rank in the data-parallel group (0
    without model parallelism set up)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"rank": 0, "dp_rank": 0}
    return {"rank": int(ps.get_world_group().rank), "dp_rank": int(ps.get_dp_group().rank_in_group)}


def disable(why: str) -> None:
    """Record nothing in this process (the hooks stay, and pass every call through)."""
    global ENGINE
    log.info("tracestore: this process records nothing: %s", why)
    ENGINE = None
    if GRAPH is not None:
        GRAPH.active = False


def set_graph_mode(enforce_eager: bool) -> None:
    """The engine's execution mode, from its config (the worker-role connector calls this before
    graphs are captured): compiled or CUDA-graph forwards (``enforce_eager=False``) record through
    the op."""
    if GRAPH is not None:
        GRAPH.active = not enforce_eager


def install(setting: RecordSetting, engine: EngineRecorder | None = None) -> list[str]:
    """Install every hook in this process; returns what was patched (``module:attr``). Idempotent."""
    global ENGINE, GRAPH
    ENGINE = engine if engine is not None else EngineRecorder(setting)
    if ENGINE.ranks is None:
        ENGINE.ranks = engine_ranks
    if GRAPH is None:
        GRAPH = GraphCapture(setting.bits)
        GRAPH.install()
    ENGINE.graph = GRAPH
    done: list[str] = []
    done += install_flashinfer()
    runner = importlib.import_module(RUNNER).MoERunner
    if patch_attr(runner, "_forward_impl", _wrap_moe_runner):
        done.append(f"{RUNNER}:MoERunner._forward_impl")
    if setting.sites == "all":
        done += _install_dense()
    emu = importlib.import_module(EMU)
    for mod in (emu, importlib.import_module(MOE_UTILS)):
        if patch_attr(mod, "ref_nvfp4_quant_dequant", functools.partial(_wrap_ref_quant_dequant, emu)):
            done.append(f"{mod.__name__}:ref_nvfp4_quant_dequant")
    if setting.routing:
        loader = importlib.import_module(LOADER).BaseModelLoader
        if patch_attr(loader, "load_model", _wrap_load_model):
            done.append(f"{LOADER}:BaseModelLoader.load_model")
    mr = importlib.import_module(MODEL_RUNNER).GPUModelRunner
    if patch_attr(mr, "execute_model", _wrap_execute_model):
        done.append(f"{MODEL_RUNNER}:GPUModelRunner.execute_model")
    if patch_attr(mr, "capture_model", _wrap_capture_model):
        done.append(f"{MODEL_RUNNER}:GPUModelRunner.capture_model")
    log.info("tracestore: vLLM hooks installed: %s", ", ".join(done) or "none (already installed)")
    return done


def install_flashinfer() -> list[str]:
    """Wrap FlashInfer's fused-MoE FP4 entries where FlashInfer is importable (GPU builds)."""
    return _install_flashinfer(_capture, _bits, GRAPH)


def _moe_g(runner: Any) -> torch.Tensor | None:
    """Decode-side g of a MoE runner's FC1 input on the static-scale path (1 / vLLM's a1_gscale)."""
    qc = getattr(getattr(runner, "quant_method", None), "moe_quant_config", None)
    enc = getattr(qc, "a1_gscale", None)
    return None if enc is None else (1.0 / enc.float()).reshape(-1)[:1]


def _wrap_moe_runner(fn: Any) -> Any:
    @functools.wraps(fn)
    def _forward_impl(self: Any, *args: Any, **kwargs: Any) -> Any:
        if ENGINE is None:  # this process records nothing: no site, so the entry's wrapper passes through
            return fn(self, *args, **kwargs)
        outer = (SCOPE.name, SCOPE.g, getattr(_MOE_SEEN, "n", 0))
        SCOPE.enter(site_name(str(self.layer_name), moe=True), _moe_g(self))
        _MOE_SEEN.n = 0
        try:
            return fn(self, *args, **kwargs)
        finally:
            SCOPE.name, SCOPE.g, _MOE_SEEN.n = outer

    return _forward_impl


def runner_route_spec(runner: Any) -> SiteSpec:
    """The ``routed_experts`` site of a vLLM ``MoERunner``: ``layers.{layer_id}.mlp.router``,
    top_k ``moe_config.experts_per_token`` over ``moe_config.num_logical_experts`` experts."""
    cfg = runner.moe_config
    return route_spec(int(runner.layer_id), int(cfg.experts_per_token), int(cfg.num_logical_experts))


def _route(spec: SiteSpec, ids: torch.Tensor) -> None:
    """Record one MoE layer's routed expert ids (``[T, >= top_k]``) of the running forward."""
    if ENGINE is None:
        return
    try:
        graph = _graph()
        if graph is not None:
            graph.route(spec, ids)
        else:
            if GRAPH is not None and not GRAPH.armed:  # an eager warm-up declares the site for the slab
                GRAPH.note_route(spec)
            ENGINE.capture_route(spec, ids)
    except Exception:
        log.exception("tracestore: recording the routing of %s failed", spec.name)


def route_capture_fn(spec: SiteSpec, prev: Any = None) -> Any:
    """The capture function bound at a vLLM capture point: calls ``prev`` (a capture function bound
    there before, e.g. vLLM's own ``RoutedExpertsCapturer``), then records the ids under ``spec``."""

    def capture(ids: torch.Tensor) -> None:
        if prev is not None:
            prev(ids)
        _route(spec, ids)

    capture.__tracestore_route__ = spec  # type: ignore[attr-defined]
    return capture


def _warn_route(spec: SiteSpec, why: str) -> None:
    if spec.name not in _ROUTE_WARNED:
        _ROUTE_WARNED.add(spec.name)
        log.error("tracestore: %s: routing not recorded: %s", spec.name, why)


def _monolithic_experts(runner: Any) -> Any:
    """The fused-experts object of a runner's monolithic kernel, found as vLLM's
    ``bind_routed_experts_capturer`` finds it (None where there is none)."""
    qm = runner.routed_experts.quant_method
    return getattr(getattr(getattr(qm, "moe_kernel", None), "impl", None), "fused_experts", None)


def bind_model_routing(model: Any) -> list[str]:
    """Bind the routing capture of every ``MoERunner`` of ``model`` (:func:`bind_routing`) and
    declare their sites to the graph capture; returns the bound sites."""
    runner_cls = importlib.import_module(RUNNER).MoERunner
    bound = []
    for module in model.modules():
        if isinstance(module, runner_cls) and bind_routing(module) is not None:
            spec = runner_route_spec(module)
            if GRAPH is not None:
                GRAPH.note_route(spec)
            bound.append(spec.name)
    return bound


def _wrap_load_model(fn: Any) -> Any:
    @functools.wraps(fn)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = fn(self, *args, **kwargs)
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        model_config = kwargs.get("model_config", args[1] if len(args) > 1 else None)
        if ENGINE is None or model_config is not getattr(vllm_config, "model_config", None):
            return model  # recording off, or a draft model: its routing is not the policy's
        par = getattr(vllm_config, "parallel_config", None)
        if int(getattr(par, "data_parallel_size", 1) or 1) > 1:  # a router may see every DP rank's tokens
            log.error("tracestore: data parallelism: routing is not recorded (the FP4 sites are)")
            return model
        try:
            sites = bind_model_routing(model)
            log.info("tracestore: routing captured at %d MoE layers", len(sites))
        except Exception:
            log.exception("tracestore: binding the routing capture failed; routing is not recorded")
        return model

    return load_model


def bind_routing(runner: Any) -> str | None:
    """Make sure ``runner`` (a vLLM ``MoERunner``) hands its routing to :func:`route_capture_fn`:
    through a ``RoutedExpertsSink`` for a monolithic kernel that supports ``routing_replay_out``,
    else the router's ``capture_fn``. Returns ``"sink"``, ``"router"`` or None (no capture point:
    logged once). Idempotent; a foreign capture function found bound is chained, not replaced."""
    spec = runner_route_spec(runner)
    if runner.routed_experts.quant_method.is_monolithic:
        mono = importlib.import_module(MODULAR).FusedMoEExpertsMonolithic
        fused = _monolithic_experts(runner)
        sink = runner.routed_experts.routing_sink
        if not (isinstance(fused, mono) and fused.supports_routing_replay_capture()):
            if sink is not None and getattr(sink.capture_fn, "__tracestore_route__", None) is not None:
                runner.routed_experts.routing_sink = None  # ours only: vLLM refuses a sink this kernel cannot fill
            _warn_route(spec, f"the monolithic MoE kernel {type(fused).__name__} has no routing_replay_out")
            return None
        if sink is None:
            sink_cls = importlib.import_module(CAPTURER).RoutedExpertsSink
            runner.routed_experts.routing_sink = sink_cls(fused.moe_config, route_capture_fn(spec))
        elif getattr(sink.capture_fn, "__tracestore_route__", None) is None:
            sink.capture_fn = route_capture_fn(spec, sink.capture_fn)
        return "sink"
    router = runner.router
    if not isinstance(router, importlib.import_module(BASE_ROUTER).BaseRouter):
        _warn_route(spec, f"the router {type(router).__name__} has no capture_fn")
        return None
    if getattr(router.capture_fn, "__tracestore_route__", None) is None:
        router.set_capture_fn(route_capture_fn(spec, router.capture_fn))
    return "router"


_DENSE = threading.local()  # .name: the dense site whose apply_weights is running


def _install_dense() -> list[str]:
    import pkgutil

    pkg = importlib.import_module(NVFP4_KERNELS)
    base = importlib.import_module(f"{NVFP4_KERNELS}.base").NvFp4LinearKernel
    for m in pkgutil.iter_modules(pkg.__path__):
        try:
            importlib.import_module(f"{NVFP4_KERNELS}.{m.name}")
        except Exception:  # a backend whose own imports fail here (GPU libraries) is never selected
            sys.modules.setdefault(f"{NVFP4_KERNELS}.{m.name}", None)  # type: ignore[arg-type]
    done = []
    for mod in [importlib.import_module("vllm._custom_ops")] + [
        sys.modules[f"{NVFP4_KERNELS}.{m.name}"] for m in pkgutil.iter_modules(pkg.__path__)
    ]:
        quant = None if mod is None else getattr(mod, "scaled_fp4_quant", None)
        if callable(quant) and patch_attr(mod, "scaled_fp4_quant", _wrap_scaled_fp4_quant):
            done.append(f"{mod.__name__}:scaled_fp4_quant")
    todo = list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if "apply_weights" in vars(cls) and patch_attr(cls, "apply_weights", _wrap_apply_weights):
            done.append(f"{cls.__module__}:{cls.__name__}.apply_weights")
    return done


def _wrap_apply_weights(fn: Any) -> Any:
    @functools.wraps(fn)
    def apply_weights(self: Any, layer: Any, x: Any, bias: Any = None) -> Any:
        if ENGINE is None:
            return fn(self, layer, x, bias)
        prefix = getattr(layer, "prefix", "")
        name = site_name(prefix) if "layers." in prefix else None
        if getattr(layer, "input_is_parallel", False) and int(getattr(layer, "tp_size", 1) or 1) > 1:
            name = None  # a row-parallel input under TP: each rank holds a slice of it
        data, scale = getattr(x, "data", None), getattr(x, "scale", None)
        if name is not None and isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and scale is not None:
            try:  # already quantized by a fused producer: the codes this GEMM eats
                enc = getattr(layer, "input_global_scale_inv", None)
                g = None if enc is None else (1.0 / enc.float()).reshape(-1)[:1]
                graph = _graph()
                if graph is not None:
                    packed = data.reshape(-1, data.shape[-1])
                    graph.record(name, packed, scale, "swizzled128x4", packed.shape[1] * 2, global_scale=g)
                else:
                    _capture(
                        name,
                        *record_rows(
                            data.reshape(-1, data.shape[-1]),
                            scale,
                            layout="swizzled128x4",
                            bits=_bits(),
                            global_scale=g,
                        ),
                    )
            except Exception:
                log.exception("tracestore: recording %s failed", name)
            name = None
        outer = getattr(_DENSE, "name", None)
        _DENSE.name = name
        try:
            return fn(self, layer, x, bias)
        finally:
            _DENSE.name = outer

    return apply_weights


def sf_layout(rows: int, is_sf_swizzled_layout: bool, backend: str) -> str:
    """The scale layout ``vllm._custom_ops.scaled_fp4_quant`` returns: 8x4 for a ``trtllm`` backend
    at m <= 32, else swizzled 128x4, or linear when not swizzled."""
    if "trtllm" in backend and rows <= 32:
        return "8x4"
    return "swizzled128x4" if is_sf_swizzled_layout else "linear"


def _wrap_scaled_fp4_quant(fn: Any) -> Any:
    @functools.wraps(fn)
    def scaled_fp4_quant(
        input: torch.Tensor,
        input_global_scale: torch.Tensor,
        is_sf_swizzled_layout: bool = True,
        backend: str = "none",
        padded_n: int | None = None,
    ) -> Any:
        out = fn(input, input_global_scale, is_sf_swizzled_layout, backend, padded_n)
        name = getattr(_DENSE, "name", None)
        if name is not None and ENGINE is not None:
            try:
                x = input.reshape(-1, input.shape[-1])
                rows, n = x.shape
                n_pad = n if padded_n is None else padded_n
                codes, sf = out
                layout = sf_layout(rows, is_sf_swizzled_layout, backend)
                graph = _graph()
                if graph is not None:
                    g_dec = (1.0 / input_global_scale.float()).reshape(-1)[:1]
                    graph.record(name, codes.reshape(rows, n_pad // 2), sf, layout, n, global_scale=g_dec)
                    _DENSE.name = None
                    return out
                c, s, g = record_rows(
                    codes.reshape(rows, n_pad // 2),
                    sf,
                    layout=layout,
                    bits=_bits(),
                    global_scale=(1.0 / input_global_scale.float()).reshape(-1)[:1],
                )
                width_bytes = n * _bits() // 8
                _capture(name, c[:, :width_bytes].contiguous(), s[:, : n // 16].contiguous(), g)
            except Exception:
                log.exception("tracestore: recording %s failed", name)
            _DENSE.name = None  # one quantization per consumer call
        return out

    return scaled_fp4_quant


def record_ref_quant(
    x: torch.Tensor, global_scale: torch.Tensor, block_size: int, emu: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Record rows of vLLM's own ``ref_nvfp4_quant(x, global_scale, block_size)`` (``global_scale``
    encode-side, as vLLM passes it): ``(codes, scales, g)`` with ``g`` = 1 / ``global_scale``."""
    values, sf = emu.ref_nvfp4_quant(x, global_scale, block_size)
    codes = codes_from_values(values)
    scales = sf.to(torch.float8_e4m3fn).view(torch.uint8)
    g = (1.0 / global_scale.float()).reshape(-1)[:1]
    return pack_bits(codes, _bits()), scales, g


def _wrap_ref_quant_dequant(emu: Any, fn: Any) -> Any:
    @functools.wraps(fn)
    def ref_nvfp4_quant_dequant(x: torch.Tensor, global_scale: torch.Tensor, block_size: int) -> torch.Tensor:
        site = None
        if SCOPE.name is not None:  # inside a MoE runner: its first quantization is the FC1 input
            n = getattr(_MOE_SEEN, "n", 0)
            _MOE_SEEN.n = n + 1
            site = SCOPE.name if n == 0 else None
        elif getattr(_DENSE, "name", None) is not None:
            site = _DENSE.name
        if site is not None and ENGINE is not None and x.ndim == 2 and block_size == 16:
            try:
                graph = _graph()
                if graph is not None:
                    values, sf = emu.ref_nvfp4_quant(x, global_scale, block_size)
                    packed = pack_fp4(codes_from_values(values, check=False))
                    g_dec = (1.0 / global_scale.float()).reshape(-1)[:1]
                    sf_bytes = sf.to(torch.float8_e4m3fn).view(torch.uint8)
                    graph.record(site, packed, sf_bytes, "linear", x.shape[1], global_scale=g_dec)
                else:
                    _capture(site, *record_ref_quant(x, global_scale, block_size, emu))
            except Exception:
                log.exception("tracestore: recording %s failed", site)
        return fn(x, global_scale, block_size)

    return ref_nvfp4_quant_dequant


def held_rows(runner: Any) -> int:
    """Spare slab rows for rows awaiting confirmation: twice ``max_num_reqs`` × (``num_spec_tokens``
    drafts, plus one row whose input id is not known yet under asynchronous scheduling). Each
    running request holds at most those of one step; the factor leaves room for preempted requests,
    whose rows are dropped only when they are scheduled again. 0 with neither."""
    k = int(getattr(runner, "num_spec_tokens", 0) or 0) + int(bool(getattr(runner, "use_async_scheduling", False)))
    return 2 * int(getattr(runner, "max_num_reqs", 0) or 0) * k


def _arm(runner: Any) -> None:
    """Allocate the graph capture's slab for the sites the warm-up noted (largest forward, padding
    included: ``max_num_tokens``; plus :func:`held_rows` spare rows), on the runner's device."""
    if GRAPH is not None and GRAPH.active and not GRAPH.armed:
        cap = int(getattr(runner, "max_num_tokens", 0) or 0)
        if not GRAPH.arm(cap, runner.device, spare=held_rows(runner)):
            log.error("tracestore: no site was seen before %s: nothing will be recorded", "arming")


def _wrap_capture_model(fn: Any) -> Any:
    @functools.wraps(fn)
    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            _arm(self)
        except Exception:
            log.exception("tracestore: arming the graph capture failed; CUDA graphs record nothing")
        return fn(self, *args, **kwargs)

    return capture_model


def worker_order(req_ids: Sequence[str], scheduled: dict[str, int]) -> list[tuple[str, int]]:
    """The forward's layout: ``(request_id, tokens scheduled)`` of the requests in the worker's
    batch order (``req_ids``) that this step schedules (C-level passes when every one is)."""
    ns = list(map(scheduled.get, req_ids))
    if None not in ns:
        return list(zip(req_ids, cast(list[int], ns), strict=True))
    return [(rid, n) for rid, n in zip(req_ids, ns, strict=True) if n is not None]


def _wrap_execute_model(fn: Any) -> Any:
    @functools.wraps(fn)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if ENGINE is not None:
            ENGINE.discard_forward()
            try:
                _arm(self)
            except Exception:
                log.exception("tracestore: arming the graph capture failed")
        out = fn(self, scheduler_output, *args, **kwargs)
        plan = getattr(PLAN, "value", None)
        PLAN.value = None
        if ENGINE is not None and plan is not None:
            order = worker_order(self.input_batch.req_ids, scheduler_output.num_scheduled_tokens)
            try:
                ENGINE.end_forward(plan, order)
            except Exception:
                log.exception("tracestore: recording the step failed; its requests are left unsealed")
        elif ENGINE is not None:
            ENGINE.discard_forward()
        return out

    return execute_model
