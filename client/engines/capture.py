"""Hooks shared by the engine plugins: which site a call belongs to, and the capturing wrappers.

- :class:`SiteScope`: the MoE layer (site name and decode-side global scale) whose forward is
  running on this thread, set by a forward pre-hook on each MoE module and cleared after it;
  the FlashInfer entry, which receives no layer, records under it.
- :func:`wrap_moe_entry`: wraps a FlashInfer fused-MoE entry (``trtllm_fp4_block_scale_moe`` /
  ``trtllm_fp4_block_scale_routed_moe``): when its ``hidden_states`` are packed FP4 codes
  (``uint8 [T, H/2]``) it records them with ``hidden_states_scale`` (E4M3, linear layout) and,
  on the per-token path, ``per_token_scale`` (float32 ``[T]``), then calls the entry unchanged.
  With a :class:`~tracestore.client.engines.graph.GraphCapture` active, the same call goes through
  its graph-safe op into the slab instead (compiled or CUDA-graph forwards). Given a ``route``
  callback, a call that routes inside the kernel (``routing_logits`` given) while
  :data:`SCOPE` names a routing layer gets a ``routing_replay_out`` buffer (int16 ``[T, top_k]``,
  where the entry accepts one and the caller passed none), which the kernel fills with the experts
  it chose; they go to ``route`` as the layer's ``routed_experts`` site afterwards.
- :func:`patch_attr`: replaces a module attribute by a wrapper once (idempotent: a wrapped
  attribute carries ``__tracestore_wrapped__`` and is not wrapped again).
- :func:`site_name`: an engine module prefix (``model.layers.3.mlp.experts``) -> the site name
  :class:`HFSiteHooks` uses for the same tensor (``layers.3.mlp.input``) or, for dense linear
  inputs, ``layers.{i}.<module path>.input``.

Hooks never change what the engine computes: a wrapper calls the original with the original
arguments and returns its result; a recording failure is logged and counted, never raised into
the engine, except bad wiring found at install time.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import threading
from collections.abc import Callable
from typing import Any

import torch

from tracestore.errors import ValidationError

from .codes import record_rows
from .graph import GraphCapture
from .routing import route_spec

log = logging.getLogger("tracestore.client.engines")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def site_name(prefix: str, moe: bool = False) -> str:
    """Site name for an engine module ``prefix``: MoE blocks and their experts ->
    ``layers.{i}.mlp.input``; anything else -> ``layers.{i}.{rest}.input``. A prefix without
    ``layers.{i}.`` raises."""
    m = _LAYER.search(prefix)
    if m is None:
        raise ValidationError(f"module {prefix!r} is not under layers.{{i}}.: no site name for it")
    layer, rest = m.group(1), m.group(2)
    if moe:
        return f"layers.{layer}.mlp.input"
    return f"layers.{layer}.{rest}.input"


class SiteScope(threading.local):
    """The MoE site whose layer runs on this thread: ``name`` and decode-side ``g`` (None: per token);
    ``route_layer``: the decoder layer whose routing a kernel that routes inside may hand back
    (None: not asked for)."""

    name: str | None = None
    g: torch.Tensor | float | None = None
    route_layer: int | None = None

    def enter(self, name: str, g: torch.Tensor | float | None, route_layer: int | None = None) -> None:
        self.name, self.g, self.route_layer = name, g, route_layer

    def leave(self) -> None:
        self.name, self.g, self.route_layer = None, None, None


SCOPE = SiteScope()
Capture = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], None]
Route = Callable[[Any, torch.Tensor], None]  # (routed_experts SiteSpec, ids [T, top_k])


def patch_attr(owner: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``owner.attr`` by ``make(original)`` unless it is already a tracestore wrapper.
    Returns True when it patched."""
    current = getattr(owner, attr)
    if getattr(current, "__tracestore_wrapped__", None) is not None:
        return False
    wrapper = make(current)
    wrapper.__tracestore_wrapped__ = current  # type: ignore[attr-defined]
    setattr(owner, attr, wrapper)
    return True


def unpatch_attr(owner: Any, attr: str) -> bool:
    """Undo :func:`patch_attr` (True when there was a wrapper to remove)."""
    current = getattr(owner, attr)
    original = getattr(current, "__tracestore_wrapped__", None)
    if original is None:
        return False
    setattr(owner, attr, original)
    return True


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: never pass it what it may refuse
        return False


def wrap_moe_entry(
    fn: Callable[..., Any],
    capture: Capture,
    bits: Callable[[], int],
    graph: GraphCapture | None = None,
    route: Route | None = None,
) -> Callable[..., Any]:
    """A FlashInfer fused-MoE entry that records its FC1 input under :data:`SCOPE`'s site first:
    through ``graph``'s op while it is active (compiled or graph-captured forwards), else eagerly
    through ``capture``; with ``route``, the experts the kernel routes to (see the module
    docstring)."""
    replayable = route is not None and _accepts(fn, "routing_replay_out")

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        spec, replay = None, None
        logits = kwargs.get("routing_logits")
        if (
            replayable
            and SCOPE.route_layer is not None
            and logits is not None
            and kwargs.get("routing_replay_out") is None
        ):
            try:
                spec = route_spec(SCOPE.route_layer, int(kwargs["top_k"]), int(kwargs["num_experts"]))
                replay = torch.empty(logits.shape[0], spec.width, dtype=torch.int16, device=logits.device)
                kwargs["routing_replay_out"] = replay
            except Exception:
                log.exception("tracestore: asking the MoE kernel of layer %s for its routing failed", SCOPE.route_layer)
                spec, replay = None, None
        out = _entry(*args, **kwargs)
        if replay is not None and route is not None:
            route(spec, replay)
        return out

    def _entry(*args: Any, **kwargs: Any) -> Any:
        x = kwargs.get("hidden_states")
        site = SCOPE.name
        if site is not None and isinstance(x, torch.Tensor) and x.dtype == torch.uint8:
            try:
                # per_token_scale is decode-side: FlashInfer's nvfp4QuantAndPerTokenScaleKernel
                # (csrc/nv_internal/tensorrt_llm/kernels/quantization.cuh, flashinfer-ai/flashinfer
                # at fb28d72) writes rowAmax·globalScaleInv (amax/(448·6)) and quantizes with its
                # reciprocal; the fused MoE passes it to the GEMMs as perTokenSfA (a multiplier).
                pts = kwargs.get("per_token_scale")
                if graph is not None and (graph.active or torch.compiler.is_compiling()):
                    graph.record(
                        site,
                        x.reshape(-1, x.shape[-1]),
                        kwargs["hidden_states_scale"],
                        "linear",
                        x.shape[-1] * 2,
                        global_scale=None if pts is not None else _device_g(SCOPE.g, x.device),
                        token_scale=None if pts is None else pts.reshape(-1),
                    )
                else:
                    codes, scales, g = record_rows(
                        x.reshape(-1, x.shape[-1]),
                        kwargs["hidden_states_scale"],
                        layout="linear",
                        bits=bits(),
                        global_scale=None if pts is not None else SCOPE.g,
                        token_scale=None if pts is None else pts.reshape(-1).to(torch.float32),
                    )
                    capture(site, codes, scales, g)
            except Exception:  # never into the engine: the forward goes on unrecorded
                log.exception("tracestore: recording the MoE input of %s failed", site)
        return fn(*args, **kwargs)

    return entry


def _device_g(g: torch.Tensor | float | None, device: torch.device) -> torch.Tensor | None:
    """A decode-side g as a one-element float32 tensor on ``device`` (a float becomes a ``full``, no
    host-to-device copy); None stays None."""
    if g is None:
        return None
    if isinstance(g, torch.Tensor):
        return g.reshape(-1)[:1].to(device=device, dtype=torch.float32)
    return torch.full((1,), float(g), dtype=torch.float32, device=device)


MOE_ENTRIES = ("trtllm_fp4_block_scale_moe", "trtllm_fp4_block_scale_routed_moe")


def install_flashinfer(
    capture: Capture, bits: Callable[[], int], graph: GraphCapture | None = None, route: Route | None = None
) -> list[str]:
    """Wrap FlashInfer's fused-MoE FP4 entries on ``flashinfer.fused_moe`` and ``flashinfer`` (both
    engines import them from either, inside the calling function: the attribute is read at each
    call) where FlashInfer is importable (GPU builds). Returns what was patched; idempotent."""
    import importlib

    done = []
    for name in ("flashinfer.fused_moe", "flashinfer"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for entry in MOE_ENTRIES:
            if hasattr(mod, entry) and patch_attr(
                mod, entry, lambda fn: wrap_moe_entry(fn, capture, bits, graph, route)
            ):
                done.append(f"{name}:{entry}")
    return done
