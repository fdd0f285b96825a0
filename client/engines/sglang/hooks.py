"""Where the SGLang plugin captures (SGLang 0.5.23; every hooked name is checked by tests/engines).

All hooks go through SGLang's ``HookRegistry`` (applied by ``load_plugins()`` in each process;
only the scheduler process runs the hooked code):

- ``Scheduler.run_batch`` (AROUND): the batch's rows -> a :class:`StepPlan` (extend / mixed
  batches: each request's positions ``[prefix_len, extend_end)`` with ids from
  ``full_untruncated_fill_ids``; decode batches: one row at ``seqlen - 1``), in ``batch.reqs``
  order, which is the forward's row order; speculative verify and draft batches are not recorded
  (their requests end with the gap ``unrecorded_positions``). Then the forward, then the rows.
- ``Scheduler.process_batch_result`` (AFTER): requests of the batch that finished are sealed
  (``FINISH_ABORT``: a gap ``aborted``); their ending dict is kept in :data:`ENDINGS` by request id.
- ``FusedMoE.forward`` (AROUND): sets the MoE site ``layers.{layer_id}.mlp.input`` and its
  decode-side g (1 / ``w13_input_scale_quant`` where the layer has it) for FlashInfer's entries,
  wrapped on first use (:func:`tracestore.client.engines.capture.install_flashinfer`); with
  ``routing=1`` also the layer whose routing an entry that routes from ``routing_logits`` hands
  back through a ``routing_replay_out`` buffer (top_k and the expert count from the call's
  ``top_k`` and ``num_experts``), where the installed FlashInfer entry takes one. The FC2
  input is quantized inside the kernel: never recorded.
- ``sglang.srt.layers.moe.topk.capture_routed_experts_if_allowed`` (AFTER, ``routing=1``, the
  default): SGLang's single routed-experts capture site (every top-k backend in ``topk.py``
  calls it, by module global, with the logical ids before the EPLB remap; draft models' configs
  set ``allow_routed_experts_capture`` False and are skipped). The ids are recorded as the
  ``routed_experts`` site ``layers.{layer_id}.mlp.router``: top_k = ``topk_config.top_k`` less
  its fused shared-expert slots (columns after the routed ones, dropped), the expert count from
  the model's config (``num_experts`` / ``n_routed_experts`` / ``num_local_experts``); ids only.
  A kernel that routes inside itself (FlashInfer TRT-LLM with SGLang's bypassed top-k) calls no
  capture site: there the FlashInfer entry is asked for ``routing_replay_out`` instead (below).
- ``LinearBase.__init__`` (AFTER, ``sites=all``): keeps each linear's ``prefix`` for its site name.
- ``ModelOptFp4LinearMethod.apply`` (AROUND, ``sites=all``): a prequantized ``(codes, scales)``
  input is recorded; otherwise the module-level ``fp4_quantize`` the method calls is wrapped to
  record what it returns (scales swizzled 128×4, g = 1 / ``layer.input_scale_inv``).

Overlap scheduling runs the forward on another thread while the scheduler prepares the next
batch: rows could not be told apart, so with it on the plugin records nothing and logs why
(start SGLang with ``--disable-overlap-schedule`` to record). The same holds for SGLang's CUDA
graphs (the hooks are Python; the graph-safe capture is wired for vLLM only): start SGLang with
``--cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from tracestore.client.engines.capture import SCOPE, install_flashinfer, site_name
from tracestore.client.engines.codes import record_rows
from tracestore.client.engines.recording import EngineRecorder
from tracestore.client.engines.routing import route_spec
from tracestore.client.engines.rows import RowMapper, Scheduled, StepPlan
from tracestore.client.engines.setting import RecordSetting

log = logging.getLogger("tracestore.client.engines")

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
FUSED_MOE = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE"
MODELOPT = "sglang.srt.layers.quantization.modelopt_quant"
LINEAR_BASE = "sglang.srt.layers.linear.LinearBase"
TOPK = "sglang.srt.layers.moe.topk"
N_EXPERTS_ATTRS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")

ENGINE: EngineRecorder | None = None
MAPPER: RowMapper | None = None
ENDINGS: dict[str, dict[str, Any]] = {}  # request id -> its ending dict (trajectory, n_tokens, gap, trace_ref)
_DENSE = threading.local()
_warned_overlap = False
N_EXPERTS: int | None = None  # routed experts of the served model (from its config, at the first batch)
_warned_routing: set[str] = set()


def _capture(site: str, codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> None:
    if ENGINE is not None:
        ENGINE.capture(site, codes, scales, g)


def _bits() -> int:
    return 1 if ENGINE is None else ENGINE.setting.bits


def _route(spec: Any, ids: torch.Tensor) -> None:
    if ENGINE is not None:
        try:
            ENGINE.capture_route(spec, ids)
        except Exception:
            log.exception("tracestore: recording the routing of %s failed", spec.name)


def register_hooks(setting: RecordSetting, engine: EngineRecorder | None = None) -> list[str]:
    """Register the hooks with SGLang's ``HookRegistry`` (applied by ``load_plugins``); returns the targets."""
    global ENGINE, MAPPER
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    ENGINE = engine if engine is not None else EngineRecorder(setting)
    MAPPER = RowMapper(block=1)
    targets = [
        (f"{SCHEDULER}.run_batch", around_run_batch, HookType.AROUND),
        (f"{SCHEDULER}.process_batch_result", after_process_batch_result, HookType.AFTER),
        (f"{FUSED_MOE}.forward", around_moe_forward, HookType.AROUND),
    ]
    if setting.routing:
        targets.append((f"{TOPK}.capture_routed_experts_if_allowed", after_capture_routed_experts, HookType.AFTER))
    if setting.sites == "all":
        targets.append((f"{LINEAR_BASE}.__init__", after_linear_init, HookType.AFTER))
        targets.append((f"{MODELOPT}.ModelOptFp4LinearMethod.apply", around_linear_apply, HookType.AROUND))
        import importlib

        if callable(getattr(importlib.import_module(MODELOPT), "fp4_quantize", None)):  # None without sgl-kernel (CPU)
            targets.append((f"{MODELOPT}.fp4_quantize", around_fp4_quantize, HookType.AROUND))
    for target, hook, kind in targets:
        HookRegistry.register(target, hook, kind)
    return [t for t, _, _ in targets]


# -- rows ---------------------------------------------------------------------------------------


def batch_rows(batch: Any, mapper: RowMapper) -> list[Scheduled] | None:
    """The forward's rows of an SGLang ``ScheduleBatch`` as :class:`Scheduled` entries in
    ``batch.reqs`` order (new requests are added to ``mapper``); None for a batch that is not
    recorded (idle, speculative verify or draft)."""
    mode = batch.forward_mode
    if mode is None or mode.is_idle() or mode.is_target_verify() or getattr(mode, "is_draft_extend", lambda: False)():
        return None
    out = []
    for req in batch.reqs:
        rid = str(req.rid)
        if not mapper.known(rid):
            mapper.add(rid, list(req.origin_input_ids))
        if mode.is_decode():
            pos = req.seqlen - 1
            full = list(req.origin_input_ids) + list(req.output_ids)
            out.append(Scheduled(rid, pos, 1, 0, [full[pos]]))
        elif mode.is_extend():
            start, end = int(req.prefix_len), int(req.extend_end)
            out.append(Scheduled(rid, start, end - start, 0, list(req.full_untruncated_fill_ids[start:end])))
        else:
            return None
    return out


def runs_cuda_graphs(scheduler: Any) -> bool:
    """Whether the scheduler's model runner replays CUDA graphs (a decode or prefill graph runner
    other than its eager runner): the plugin's hooks would not run inside them."""
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    if runner is None:
        return False
    eager = getattr(runner, "eager_runner", None)
    for attr in ("decode_cuda_graph_runner", "prefill_cuda_graph_runner"):
        r = getattr(runner, attr, None)
        if r is not None and r is not eager:
            return True
    return False


def around_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """``Scheduler.run_batch``: plan the batch's rows, run it, record them."""
    global _warned_overlap
    if ENGINE is None or MAPPER is None:
        return original(scheduler, batch, *args, **kwargs)
    if getattr(scheduler, "enable_overlap", False) or runs_cuda_graphs(scheduler):
        if not _warned_overlap:
            log.error(
                "tracestore: SGLang runs with overlap scheduling or CUDA graphs; nothing is recorded "
                "(start it with --disable-overlap-schedule and --cuda-graph-backend-decode=disabled "
                "--cuda-graph-backend-prefill=disabled to record)"
            )
            _warned_overlap = True
        return original(scheduler, batch, *args, **kwargs)
    install_flashinfer(_capture, _bits, route=_route)
    _note_n_experts(scheduler)
    plan: StepPlan | None = None
    try:
        rows = batch_rows(batch, MAPPER)
        plan = None if rows is None else MAPPER.step(rows)
    except Exception:
        log.exception("tracestore: mapping the batch's rows failed; not recorded")
    ENGINE.discard_forward()
    result = original(scheduler, batch, *args, **kwargs)
    if plan is not None:
        try:
            ENGINE.end_forward(plan)
        except Exception:
            log.exception("tracestore: recording the batch failed")
    ENGINE.discard_forward()
    return result


def after_process_batch_result(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """``Scheduler.process_batch_result``: seal the batch's finished requests (aborted: a gap)."""
    if ENGINE is None or MAPPER is None:
        return None
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    for req in getattr(batch, "reqs", None) or ():
        rid = str(req.rid)
        if req.finished() and MAPPER.known(rid):
            full = list(req.origin_input_ids) + list(req.output_ids)
            ending = MAPPER.finish(rid, full, aborted=isinstance(req.finished_reason, FINISH_ABORT))
            ENDINGS[rid] = ENGINE.end_request(ending)
    return None


# -- sites --------------------------------------------------------------------------------------


def model_n_experts(hf_text_config: Any) -> int | None:
    """The routed expert count a model's (text) config names, or None."""
    for name in N_EXPERTS_ATTRS:
        v = getattr(hf_text_config, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _note_n_experts(scheduler: Any) -> None:
    global N_EXPERTS
    if N_EXPERTS is None:
        cfg = getattr(getattr(scheduler, "model_config", None), "hf_text_config", None)
        N_EXPERTS = None if cfg is None else model_n_experts(cfg)


def _warn_routing(key: str, why: str) -> None:
    if key not in _warned_routing:
        _warned_routing.add(key)
        log.error("tracestore: routing not recorded: %s", why)


def after_capture_routed_experts(result: Any, *args: Any, **kwargs: Any) -> None:
    """``topk.capture_routed_experts_if_allowed(topk_config, layer_id, topk_ids)``: record the
    layer's routed ids (see the module docstring)."""
    if ENGINE is None or not ENGINE.setting.routing:
        return None
    names = ("topk_config", "layer_id", "topk_ids")
    got = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    config, layer, ids = got.get("topk_config"), got.get("layer_id"), got.get("topk_ids")
    if config is None or ids is None or not getattr(config, "allow_routed_experts_capture", True):
        return None  # a draft model's router: not the policy's routing
    if layer is None:
        _warn_routing("layer", "a top-k call without its layer_id")
        return None
    if N_EXPERTS is None:
        _warn_routing("experts", f"the model's config names no expert count ({', '.join(N_EXPERTS_ATTRS)})")
        return None
    try:
        top_k = int(config.top_k) - int(getattr(config, "num_shared_topk_slots", 0) or 0)
        ENGINE.capture_route(route_spec(int(layer), top_k, N_EXPERTS), ids)
    except Exception:
        log.exception("tracestore: recording the routing of layer %s failed", layer)
    return None


def around_moe_forward(original: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
    """``FusedMoE.forward``: the MoE site (and its g) for FlashInfer's entries while it runs."""
    enc = getattr(layer, "w13_input_scale_quant", None)
    g = None if not isinstance(enc, torch.Tensor) else (1.0 / enc.float()).reshape(-1)[:1]
    outer = (SCOPE.name, SCOPE.g, SCOPE.route_layer)
    routing = ENGINE is not None and ENGINE.setting.routing and not getattr(layer, "is_draft", False)
    SCOPE.enter(f"layers.{int(layer.layer_id)}.mlp.input", g, int(layer.layer_id) if routing else None)
    try:
        return original(layer, *args, **kwargs)
    finally:
        SCOPE.name, SCOPE.g, SCOPE.route_layer = outer


def after_linear_init(result: Any, layer: Any, *args: Any, **kwargs: Any) -> None:
    """``LinearBase.__init__``: keep the layer's ``prefix`` (most SGLang linears do not store it)."""
    import inspect

    try:
        bound = inspect.signature(_linear_base_init()).bind(layer, *args, **kwargs)
        layer._tracestore_prefix = str(bound.arguments.get("prefix", "") or "")
    except TypeError:
        layer._tracestore_prefix = str(kwargs.get("prefix", "") or "")
    return None


def _linear_base_init() -> Any:
    from sglang.srt.layers.linear import LinearBase

    init = LinearBase.__init__
    return getattr(init, "__wrapped__", init)


def around_linear_apply(original: Any, method: Any, layer: Any, x: Any, bias: Any = None) -> Any:
    """``ModelOptFp4LinearMethod.apply``: record a prequantized input; else mark the layer's site
    for ``fp4_quantize``."""
    prefix = str(getattr(layer, "prefix", "") or getattr(layer, "_tracestore_prefix", "") or "")
    name = site_name(prefix) if "layers." in prefix else None
    g = _input_g(layer)
    if name is not None and isinstance(x, tuple) and getattr(layer, "_accepts_prequantized_fp4", False):
        try:
            codes, sf = x
            _capture(
                name,
                *record_rows(
                    codes.reshape(-1, codes.shape[-1]), sf, layout="swizzled128x4", bits=_bits(), global_scale=g
                ),
            )
        except Exception:
            log.exception("tracestore: recording %s failed", name)
        name = None
    outer = getattr(_DENSE, "site", None)
    _DENSE.site = None if name is None else (name, g)
    try:
        return original(method, layer, x, bias)
    finally:
        _DENSE.site = outer


def _input_g(layer: Any) -> torch.Tensor | None:
    enc = getattr(layer, "input_scale_inv", None)
    return None if not isinstance(enc, torch.Tensor) else (1.0 / enc.float()).reshape(-1)[:1]


def around_fp4_quantize(original: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``modelopt_quant.fp4_quantize``: record what it returns under the running linear's site."""
    out = original(x, *args, **kwargs)
    site = getattr(_DENSE, "site", None)
    if site is not None:
        name, g = site
        try:
            codes, sf = out[0], out[1]
            _capture(
                name,
                *record_rows(
                    codes.reshape(-1, codes.shape[-1]), sf, layout="swizzled128x4", bits=_bits(), global_scale=g
                ),
            )
        except Exception:
            log.exception("tracestore: recording %s failed", name)
        _DENSE.site = None
    return out
