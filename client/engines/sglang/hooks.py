"""Where the SGLang plugin captures (SGLang 0.5.23; every hooked name is checked by tests/engines).

All hooks go through SGLang's ``HookRegistry`` (applied by ``load_plugins()`` in each process;
only the scheduler process runs the hooked code):

- ``Scheduler.init_moe_gemm_config`` (AFTER: the model config and SGLang's MoE flags are set, the
  model is not loaded yet): only tensor-parallel rank 0 records; a parallel layout whose rows
  rank 0 cannot record (:func:`.ranks.refusal`: pipeline parallelism, DP attention, attention CP,
  a scattered MoE input) raises a ``ConfigError``, so the scheduler process fails to start with
  the reason.
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
  record what it returns (scales swizzled 128×4, g = 1 / ``layer.input_scale_inv``). A
  row-parallel linear's input under TP is a slice of the site: not recorded.

- **CUDA graphs** (SGLang's default: decode graphs, and breakable prefill graphs on CUDA): the
  hooks above record through :data:`GRAPH` (:class:`~tracestore.client.engines.graph.GraphCapture`)
  whenever a graph runner captures or runs, so each site's codes reach the slab by the registered
  op a captured graph replays (no Python, no host read at replay); forwards SGLang runs eagerly
  (batches no captured size fits) record through the eager path as before.
  ``DecodeCudaGraphRunner.capture`` / ``PrefillCudaGraphRunner.capture`` (AROUND): the op path is
  on while a runner captures; ``FullCudaGraphBackend.capture_one`` /
  ``BreakableCudaGraphBackend.capture_one`` (AROUND): the slab is armed before the second of the
  two warm-up forwards SGLang runs before each capture (the first notes every site), at the
  largest graph forward (:func:`graph_capacity`: the decode runner's largest captured batch times
  its tokens per request, the prefill runner's largest token bucket). These are SGLang's own
  methods reached through the plugin's ``HookRegistry``: no fork, and they run once per process
  before any request. ``DecodeCudaGraphRunner.execute`` / ``PrefillCudaGraphRunner.execute``
  (AROUND): the forward is a replay (its rows are read from the slab) and its real row count
  is the ``ForwardBatch``'s (``input_ids`` rows, read from the shape): SGLang pads a replay to a
  captured size after them (``raw_bs`` < ``bs``, ``raw_num_tokens`` < the bucket); the padded
  rows are written by the graph and never named by the plan. A replay whose real row count is
  not the plan's commits nothing (its requests end with a gap).

Overlap scheduling runs the forward on another thread while the scheduler prepares the next
batch: rows could not be told apart, so with it on the plugin records nothing and logs why
(start SGLang with ``--disable-overlap-schedule`` to record). Speculative decoding is not
recorded (the verify forward's rows are the drafts, not the batch's one row per request; the
draft model runs the same hooked layers): the plugin stops recording in that process and says
why.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from tracestore.client.engines.capture import SCOPE, install_flashinfer, site_name
from tracestore.client.engines.codes import record_rows
from tracestore.client.engines.graph import GraphCapture
from tracestore.client.engines.recording import EngineRecorder
from tracestore.client.engines.routing import route_spec
from tracestore.client.engines.rows import RowMapper, Scheduled, StepPlan
from tracestore.client.engines.setting import RecordSetting

from tracestore.errors import ConfigError

from .graphs import cuda_graph_config, graph_capacity, runner_device
from .ranks import recording_rank, refusal, row_parallel_slice

log = logging.getLogger("tracestore.client.engines")

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
FUSED_MOE = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE"
MODELOPT = "sglang.srt.layers.quantization.modelopt_quant"
LINEAR_BASE = "sglang.srt.layers.linear.LinearBase"
TOPK = "sglang.srt.layers.moe.topk"
RUNNERS = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner",
)
BACKENDS = (
    "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend.FullCudaGraphBackend",
    "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend.BreakableCudaGraphBackend",
)
N_EXPERTS_ATTRS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")

ENGINE: EngineRecorder | None = None
MAPPER: RowMapper | None = None
GRAPH: GraphCapture | None = None  # graph-safe capture: on while a graph runner captures or replays
ENDINGS: dict[str, dict[str, Any]] = {}  # request id -> its ending dict (trajectory, n_tokens, gap, trace_ref)
_DENSE = threading.local()
_warned_overlap = False
_warned_graph = False
N_EXPERTS: int | None = None  # routed experts of the served model (from its config, at the first batch)
_warned_routing: set[str] = set()


class _Capturing(threading.local):
    """The graph runner whose ``capture`` is running on this thread (None: none)."""

    runner: Any = None


class _Replay(threading.local):
    """The forward's replay: ``rows`` its real row count (None: the forward ran eagerly)."""

    rows: int | None = None


CAPTURING = _Capturing()
REPLAY = _Replay()


def _capture(site: str, codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> None:
    if ENGINE is not None:
        ENGINE.capture(site, codes, scales, g)


def _bits() -> int:
    return 1 if ENGINE is None else ENGINE.setting.bits


def _graph() -> GraphCapture | None:
    """The graph capture while hooks must record through its op: a graph runner is capturing or
    replaying (:data:`GRAPH` active), a CUDA stream is being captured, or dynamo is tracing."""
    if GRAPH is None or ENGINE is None:
        return None
    return GRAPH if GRAPH.active or torch.compiler.is_compiling() or _stream_capturing() else None


def _stream_capturing() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _record(site: str, packed: torch.Tensor, sf: torch.Tensor, g: torch.Tensor | None) -> None:
    """A dense site's codes (``packed`` uint8 ``[T, K/2]``, ``sf`` swizzled 128×4): through the
    op under graphs, else record rows for this forward."""
    rows = packed.reshape(-1, packed.shape[-1])
    graph = _graph()
    if graph is not None:
        graph.record(site, rows, sf, "swizzled128x4", rows.shape[1] * 2, global_scale=g)
        return
    _capture(site, *record_rows(rows, sf, layout="swizzled128x4", bits=_bits(), global_scale=g))


def _route(spec: Any, ids: torch.Tensor) -> None:
    if ENGINE is None:
        return
    try:
        graph = _graph()
        if graph is not None:
            if not graph.armed:  # a warm-up forward declares the site for the slab
                graph.note_route(spec)
            graph.route(spec, ids)
        else:
            ENGINE.capture_route(spec, ids)
    except Exception:
        log.exception("tracestore: recording the routing of %s failed", spec.name)


def _install_flashinfer() -> list[str]:
    return install_flashinfer(_capture, _bits, GRAPH, route=_route)


def disable(why: str, level: int = logging.ERROR) -> None:
    """Record nothing in this process from now on (the hooks stay, and pass every call through)."""
    global ENGINE
    if ENGINE is not None:
        log.log(level, "tracestore: this process records nothing: %s", why)
    ENGINE = None
    if GRAPH is not None:
        GRAPH.active = False


def register_hooks(setting: RecordSetting, engine: EngineRecorder | None = None) -> list[str]:
    """Register the hooks with SGLang's ``HookRegistry`` (applied by ``load_plugins``); returns the targets."""
    global ENGINE, MAPPER, GRAPH
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    ENGINE = engine if engine is not None else EngineRecorder(setting)
    if ENGINE.ranks is None:
        from .ranks import engine_ranks

        ENGINE.ranks = engine_ranks  # the sidecar= placeholders
    MAPPER = RowMapper(block=1)
    if GRAPH is None:
        GRAPH = GraphCapture(setting.bits)
        GRAPH.install()
    ENGINE.graph = GRAPH
    targets = [
        (f"{SCHEDULER}.init_moe_gemm_config", after_scheduler_config, HookType.AFTER),
        (f"{SCHEDULER}.run_batch", around_run_batch, HookType.AROUND),
        (f"{SCHEDULER}.process_batch_result", after_process_batch_result, HookType.AFTER),
        (f"{FUSED_MOE}.forward", around_moe_forward, HookType.AROUND),
    ]
    for runner in RUNNERS:
        targets.append((f"{runner}.capture", around_graph_capture, HookType.AROUND))
        targets.append((f"{runner}.execute", around_graph_execute, HookType.AROUND))
    for backend in BACKENDS:
        targets.append((f"{backend}.capture_one", around_capture_one, HookType.AROUND))
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


# -- CUDA graphs ----------------------------------------------------------------------------------


def _arm(runner: Any) -> None:
    """Allocate the slab for the sites the warm-up noted (:func:`graph_capacity` rows) on the
    runner's device; logged when it cannot."""
    if GRAPH is None or GRAPH.armed:
        return
    try:
        try:
            config = cuda_graph_config()
        except Exception:  # no resolved config (tests): the runner's own size
            config = None
        cap = graph_capacity(runner, config)
        if not GRAPH.arm(cap, runner_device(runner.model_runner)):
            log.error("tracestore: no site was seen before SGLang captured its CUDA graphs: they record nothing")
    except Exception:
        log.exception("tracestore: arming the graph capture failed; CUDA graphs record nothing")


def around_graph_capture(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """``DecodeCudaGraphRunner.capture`` / ``PrefillCudaGraphRunner.capture``: hooks record through
    the op while the runner captures (see the module docstring). A speculative worker (target or
    draft) stops recording in this process."""
    mr = getattr(runner, "model_runner", None)
    if ENGINE is None or GRAPH is None or mr is None:
        return original(runner, *args, **kwargs)
    if mr.spec_algorithm.is_speculative():
        disable("speculative decoding is not recorded (verify rows are drafts; the draft model runs the same hooks)")
        return original(runner, *args, **kwargs)
    _install_flashinfer()
    _note_n_experts(mr)  # (the ModelRunner's model config: routing sites are declared at capture)
    outer = CAPTURING.runner, GRAPH.active
    CAPTURING.runner, GRAPH.active = runner, True
    try:
        return original(runner, *args, **kwargs)
    finally:
        CAPTURING.runner, GRAPH.active = outer
        if GRAPH.stats["unarmed_capture"]:
            log.error("tracestore: a CUDA graph was captured before the slab was armed: its forwards end with a gap")


def around_capture_one(original: Any, backend: Any, shape_key: Any, *args: Any, **kwargs: Any) -> Any:
    """``FullCudaGraphBackend.capture_one`` / ``BreakableCudaGraphBackend.capture_one(shape_key,
    forward_fn, ...)``: SGLang calls ``forward_fn`` twice eagerly, then once under capture; the
    slab is armed before each call outside a capture until it is (the first warm-up notes the
    sites, so the second arms)."""
    runner = CAPTURING.runner
    if runner is None or GRAPH is None or GRAPH.armed:
        return original(backend, shape_key, *args, **kwargs)
    args_l = list(args)
    forward_fn = kwargs["forward_fn"] if "forward_fn" in kwargs else args_l[0]

    def armed_forward() -> Any:
        if GRAPH is not None and not GRAPH.armed and not _stream_capturing() and (GRAPH.widths or GRAPH.routes):
            _arm(runner)
        return forward_fn()

    if "forward_fn" in kwargs:
        kwargs["forward_fn"] = armed_forward
    else:
        args_l[0] = armed_forward
    return original(backend, shape_key, *args_l, **kwargs)


def around_graph_execute(original: Any, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """``DecodeCudaGraphRunner.execute`` / ``PrefillCudaGraphRunner.execute(forward_batch)``: this
    forward replays a graph; its real rows are the batch's ``input_ids`` rows (the shape: no host
    read), the padded rows after them are never committed."""
    mr = getattr(runner, "model_runner", None)
    if ENGINE is not None and GRAPH is not None and mr is not None and not mr.is_draft_worker:
        GRAPH.active = True  # (until the scheduler's next batch: its rows are read from the slab)
        REPLAY.rows = int(forward_batch.input_ids.shape[0])
    return original(runner, forward_batch, *args, **kwargs)


# -- rows ---------------------------------------------------------------------------------------


def after_scheduler_config(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """``Scheduler.init_moe_gemm_config``: refuse a layout whose rows TP rank 0 cannot record
    (``ConfigError``, naming the fix); a TP rank other than 0 records nothing."""
    if ENGINE is None:
        return None
    cfg = getattr(getattr(scheduler, "model_config", None), "hf_text_config", None)
    why = refusal(cfg is not None and model_n_experts(cfg) is not None, ENGINE.setting.sites == "all")
    if why is not None:
        raise ConfigError(why)
    if not recording_rank():
        disable("tensor-parallel rank > 0: rank 0 of the group records the same rows", logging.INFO)
    return None


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
    other than its eager runner)."""
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    if runner is None:
        return False
    eager = getattr(runner, "eager_runner", None)
    for attr in ("decode_cuda_graph_runner", "prefill_cuda_graph_runner"):
        r = getattr(runner, attr, None)
        if r is not None and r is not eager:
            return True
    return False


def _refusal(scheduler: Any) -> str | None:
    """Why this scheduler's batches cannot be recorded (None: they can)."""
    if getattr(scheduler, "enable_overlap", False):
        return "SGLang runs with overlap scheduling (start it with --disable-overlap-schedule to record)"
    spec = getattr(scheduler, "spec_algorithm", None)
    if spec is not None and spec.is_speculative():
        return "speculative decoding is not recorded (verify rows are drafts, not one row per request)"
    return None


def around_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """``Scheduler.run_batch``: plan the batch's rows, run it, record them (from the slab after a
    graph replay, from the captured rows after an eager forward)."""
    global _warned_overlap, _warned_graph
    if ENGINE is None or MAPPER is None:
        return original(scheduler, batch, *args, **kwargs)
    why = _refusal(scheduler)
    if why is not None:
        if why.startswith("speculative"):
            disable(why)
        elif not _warned_overlap:
            log.error("tracestore: nothing is recorded: %s", why)
            _warned_overlap = True
        return original(scheduler, batch, *args, **kwargs)
    if runs_cuda_graphs(scheduler) and (GRAPH is None or not GRAPH.armed) and not _warned_graph:
        log.error("tracestore: SGLang captured CUDA graphs before the slab was armed: replayed forwards end with a gap")
        _warned_graph = True
    _install_flashinfer()
    _note_n_experts(scheduler)
    plan: StepPlan | None = None
    try:
        rows = batch_rows(batch, MAPPER)
        plan = None if rows is None else MAPPER.step(rows)
    except Exception:
        log.exception("tracestore: mapping the batch's rows failed; not recorded")
    ENGINE.discard_forward()
    if GRAPH is not None:
        GRAPH.active = False  # an eager forward unless a graph runner's execute says otherwise
    REPLAY.rows = None
    try:
        result = original(scheduler, batch, *args, **kwargs)
        if plan is not None and ENGINE is not None:
            _end_forward(ENGINE, plan)
    finally:
        if ENGINE is not None:
            ENGINE.discard_forward()
        if GRAPH is not None:
            GRAPH.active = False
        REPLAY.rows = None
    return result


def _end_forward(engine: EngineRecorder, plan: StepPlan) -> None:
    """Record the forward's planned rows; a replay whose real row count is not the plan's is
    committed as a forward that captured nothing (its requests end with a gap)."""
    replayed = REPLAY.rows
    planned = sum(n for _, n in plan.order)
    if replayed is not None and replayed != planned:
        log.error("tracestore: a graph replay ran %d rows, the batch plans %d: not recorded", replayed, planned)
        engine.discard_forward()
        if GRAPH is not None:
            GRAPH.active = False  # the slab's rows are not read
    try:
        engine.end_forward(plan)
    except Exception:
        log.exception("tracestore: recording the batch failed")
    _mark_failed(engine)


def _mark_failed(engine: EngineRecorder) -> None:
    """Trajectories whose rows never reached the recorder stop being prefix sources, and end with a gap."""
    for trajectory in engine.take_failed():
        if MAPPER is not None:
            MAPPER.mark_gap(trajectory)


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
    _mark_failed(ENGINE)
    return None


# -- sites --------------------------------------------------------------------------------------


def model_n_experts(hf_text_config: Any) -> int | None:
    """The routed expert count a model's (text) config names, or None."""
    for name in N_EXPERTS_ATTRS:
        v = getattr(hf_text_config, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _note_n_experts(owner: Any) -> None:
    """The served model's expert count, from ``owner.model_config`` (a Scheduler or ModelRunner)."""
    global N_EXPERTS
    if N_EXPERTS is None:
        cfg = getattr(getattr(owner, "model_config", None), "hf_text_config", None)
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
        spec = route_spec(int(layer), top_k, N_EXPERTS)
    except Exception:
        log.exception("tracestore: recording the routing of layer %s failed", layer)
        return None
    _route(spec, ids)
    return None


def around_moe_forward(original: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
    """``FusedMoE.forward``: the MoE site (and its g) for FlashInfer's entries while it runs."""
    if ENGINE is None:  # this process records nothing: no site, so the entries' wrappers pass through
        return original(layer, *args, **kwargs)
    enc = getattr(layer, "w13_input_scale_quant", None)
    g = None if not isinstance(enc, torch.Tensor) else (1.0 / enc.float()).reshape(-1)[:1]
    outer = (SCOPE.name, SCOPE.g, SCOPE.route_layer)
    routing = ENGINE.setting.routing and not getattr(layer, "is_draft", False)
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
    if ENGINE is None:
        return original(method, layer, x, bias)
    prefix = str(getattr(layer, "prefix", "") or getattr(layer, "_tracestore_prefix", "") or "")
    name = site_name(prefix) if "layers." in prefix and not row_parallel_slice(layer) else None
    g = _input_g(layer)
    if name is not None and isinstance(x, tuple) and getattr(layer, "_accepts_prequantized_fp4", False):
        try:
            codes, sf = x
            _record(name, codes, sf, g)
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
            _record(name, out[0], out[1], g)
        except Exception:
            log.exception("tracestore: recording %s failed", name)
        _DENSE.site = None
    return out
