"""MoE routing of a transformers model: captured in a rollout (:class:`RoutingCapture`), replayed
in training (:class:`RoutingReplayHooks`, rollout routing replay "R3").

Every MoE block of the registered layouts (:mod:`tracestore.client.hf.layouts`: the block at
``Layout.moe``, or the decoder layer's ``router`` where the layer holds its experts itself) picks
its experts with one ``torch.topk`` over the router's ``[tokens, n_experts]`` scores, ``k`` the
model's top_k. While the block runs, a ``TorchFunctionMode`` sees that call (and only calls with
that ``k`` over a last dimension of ``n_experts``; group-limited routing's group top-k calls have
other shapes and pass through):

- capture keeps the chosen ids (and the top-k values the call returned, the gate weights at
  selection before any renormalization) for the site ``layers.{i}.mlp.router``;
- replay returns the recorded ids instead, with values gathered from the live scores at those ids,
  so the block weights its experts from the live router (gradients reach the router) while the
  experts are the rollout's; rows without valid routing keep the live choice and are counted.

Nothing in the model is edited; the hooks are module forward hooks. Token rows are the block's
``[batch * tokens]`` rows, batch-major: a padded batch's rows are those of
``MicrobatchPlan.padded``, one packed row those of ``MicrobatchPlan.from_cu_seqlens``, as for
:class:`~tracestore.client.hf.train_hooks.GuidedFP4Hooks`.

Example::

    r3 = RoutingReplayHooks(model)
    rows = reader.read(plan, token_ids=input_ids)      # {site: Guidance | Routing}
    r3.set_routing(rows)                               # Routing entries (GuidedFP4Hooks: the rest)
    loss = loss_fn(model(input_ids).logits); loss.backward()
    r3.stats                                           # replayed / fallback rows, live agreement
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from tracestore.client.hf.layouts import Layout, decoder_layers, get_path, layout_for, text_config

from tracestore.artifacts import Routing, router_site_name
from tracestore.errors import ConfigError, ShapeError
from tracestore.records import SiteSpec

_TOP_K = ("top_k", "num_experts_per_tok", "moe_topk", "top_k_experts", "moe_top_k", "num_experts_per_token")
_N_EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "n_experts")


def _int_attr(objs: Iterable[Any], names: tuple[str, ...]) -> int | None:
    for obj in objs:
        for name in names:
            try:
                v = getattr(obj, name, None)
            except Exception:  # a property that cannot answer here
                v = None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


@dataclasses.dataclass(frozen=True)
class MoERouter:
    """One MoE layer's routing: its ``site`` name, decoder ``layer``, the ``module`` whose forward
    runs the routing top-k, ``top_k`` and ``n_experts``."""

    site: str
    layer: int
    module: torch.nn.Module
    top_k: int
    n_experts: int

    def spec(self, gate: str | None = None) -> SiteSpec:
        """This router as a ``routed_experts`` :class:`~tracestore.records.SiteSpec`."""
        return SiteSpec(self.site, "routed_experts", self.layer, self.top_k, n_experts=self.n_experts, gate=gate)


def moe_routers(model: Any, *, layers: Iterable[int] | None = None, layout: Layout | None = None) -> list[MoERouter]:
    """The MoE routers of ``model`` in layer order (dense layers have none). ``top_k`` and
    ``n_experts`` come from the block (or its router) where it names them, else from the text
    config (``ffn_config`` too); zero-computation experts (``zero_expert_num``) count as experts."""
    cfg = text_config(model)
    lay = layout if layout is not None else layout_for(model)[1]
    _, decoder = decoder_layers(model, lay)
    wanted = range(len(decoder)) if layers is None else sorted(set(layers))
    out = []
    for i in wanted:
        if not 0 <= i < len(decoder):
            raise ConfigError(f"layer {i} is out of range: the model has {len(decoder)} decoder layers")
        layer = decoder[i]
        scope = lay.moe_block(layer)
        if scope is None and lay.inline_moe(layer) is not None:
            scope = get_path(layer, "router")
        if scope is None:
            continue
        near = [scope, *scope.children()]
        conf = [cfg, getattr(cfg, "ffn_config", None)]
        k = _int_attr(near, _TOP_K) or _int_attr(conf, _TOP_K)
        n = _int_attr(near, _N_EXPERTS) or _int_attr(conf, _N_EXPERTS)
        zero = _int_attr(conf, ("zero_expert_num",))
        if zero and n is not None:  # LongCat-Flash: zero-computation experts take the ids after the routed ones
            n = (_int_attr(conf, ("n_routed_experts",)) or n) + zero
        if k is None or n is None:
            raise ConfigError(
                f"layer {i} ({type(scope).__name__}): cannot tell its top_k and number of experts (looked for "
                f"{_TOP_K} and {_N_EXPERTS} on the block, its children and the config)"
            )
        out.append(MoERouter(router_site_name(i), i, scope, k, n))
    return out


class _TopK(TorchFunctionMode):
    """Hands the block's routing top-k call to ``hooks._topk``; every other call runs as it is."""

    def __init__(self, hooks: _RouterHooks, router: MoERouter) -> None:
        super().__init__()
        self.hooks, self.router = hooks, router
        self.hit = False
        self.lead: tuple[int, ...] | None = None  # the block input's [batch, tokens], when it is 3-D

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.topk or func is torch.Tensor.topk:
            x = args[0] if args else kwargs.get("input")
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            r = self.router
            if (
                isinstance(x, torch.Tensor)
                and x.dim() == 2
                and dim in (-1, 1)
                and k == r.top_k
                and x.shape[1] == r.n_experts
            ):
                self.hit = True
                return self.hooks._topk(r, func, args, kwargs, self.lead)
        return func(*args, **kwargs)


class _RouterHooks:
    """Forward hooks that run each router's block under its :class:`_TopK` mode."""

    def __init__(self, model: Any, layers: Iterable[int] | None, layout: Layout | None) -> None:
        if hasattr(model, "_orig_mod") or any(
            getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()
        ):
            raise ConfigError(
                f"{type(self).__name__} on a torch.compile'd model: a compiled graph does not run hooks added after "
                "it was compiled; attach the hooks to the plain model, then compile it"
            )
        self.routers = moe_routers(model, layers=layers, layout=layout)
        if not self.routers:
            raise ConfigError(f"{type(model).__name__} has no MoE block in the hooked layers: nothing routes")
        self.by_site = {r.site: r for r in self.routers}
        self._handles: list[Any] = []
        self._modes: dict[int, list[_TopK]] = {}
        for r in self.routers:
            self._handles.append(r.module.register_forward_pre_hook(self._enter(r)))
            self._handles.append(r.module.register_forward_hook(self._exit(r), always_call=True))

    def _enter(self, r: MoERouter) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            mode = _TopK(self, r)
            if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 3:
                mode.lead = tuple(args[0].shape[:2])
            mode.__enter__()
            self._modes.setdefault(id(module), []).append(mode)

        return hook

    def _exit(self, r: MoERouter) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            stack = self._modes.get(id(module))
            if not stack:
                return
            mode = stack.pop()
            mode.__exit__(None, None, None)
            if not mode.hit and output is not None:
                raise ConfigError(
                    f"{r.site} ({type(module).__name__}): the block ran without a torch.topk(k={r.top_k}) over its "
                    f"{r.n_experts} experts' scores, so its routing cannot be seen or replayed (a router that picks "
                    "experts another way, e.g. PhiMoE's sparsemixer, is not supported)"
                )

        return hook

    def _topk(
        self, r: MoERouter, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], lead: tuple[int, ...] | None
    ) -> Any:
        raise NotImplementedError

    def remove(self) -> None:
        """Detach every hook."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class RoutingCapture(_RouterHooks):
    """Records the experts every MoE router of ``model`` chooses (see the module docstring).

    After a forward, :attr:`last` holds ``{site: (ids int64 [rows, top_k], values float32
    [rows, top_k])}`` of that forward (the block's ``[batch * tokens]`` rows); ``on_route(router,
    ids, values, lead)``, when given, is called at each routing instead (``lead``: the block input's
    ``(batch, tokens)``, or None when it is not 3-D). :meth:`site_outputs` makes the
    ``RolloutRecorder.record_forward`` outputs of a run's ``routed_experts`` sites from them.
    ``layers`` limits the layers (default all), ``layout`` overrides the registered one.
    """

    def __init__(
        self, model: Any, *, layers: Iterable[int] | None = None, layout: Layout | None = None, on_route: Any = None
    ) -> None:
        super().__init__(model, layers, layout)
        self.on_route = on_route
        self.last: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def sites(self, gate: str | None = None) -> list[SiteSpec]:
        """The ``routed_experts`` sites of the hooked routers (for a ``RunSpec``)."""
        return [r.spec(gate) for r in self.routers]

    def _topk(
        self, r: MoERouter, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], lead: tuple[int, ...] | None
    ) -> Any:
        out = func(*args, **kwargs)
        ids, values = out[1].detach(), out[0].detach().float()
        if self.on_route is not None:
            self.on_route(r, ids, values, lead)
        else:
            self.last[r.site] = (ids, values)
        return out

    def site_outputs(self, run_spec: Any, rows: torch.Tensor | None = None) -> dict[str, Any]:
        """``{site: SiteOutput}`` of the last forward for the ``routed_experts`` sites ``run_spec``
        declares (``rows``: the batch-major rows to keep, in order)."""
        out = {}
        for site in run_spec.sites:
            if site.kind != "routed_experts":
                continue
            if site.name not in self.last:
                raise ConfigError(
                    f"run {run_spec.run} declares {site.name} but the last forward routed no tokens there"
                )
            ids, values = self.last[site.name]
            out[site.name] = routing_output(site, ids, values, rows)
        return out


def routing_output(
    site: SiteSpec, ids: torch.Tensor, values: torch.Tensor | None, rows: torch.Tensor | None = None
) -> Any:
    """The ``SiteOutput`` of routing rows (``ids`` integer [rows, top_k], ``values`` the gate
    weights, used when the site declares ``gate``), encoded on the tensors' device as
    docs/data-model.md "Artifacts" lays them out; every row valid."""
    from tracestore.site_output import SiteOutput

    if ids.dim() != 2 or ids.shape[1] != site.width:
        raise ShapeError(f"{site.name}: routing ids must be [rows, top_k={site.width}], got {list(ids.shape)}")
    if rows is not None:
        ids = ids.index_select(0, rows.to(ids.device))
        values = None if values is None else values.index_select(0, rows.to(values.device))
    n = ids.shape[0]
    i32 = ids.to(torch.int32)
    if site.format == "uint16":
        codes = torch.stack([i32 & 0xFF, i32 >> 8], dim=-1).to(torch.uint8).reshape(n, 2 * site.width)
    else:
        codes = i32.to(torch.uint8)
    parts = [torch.ones(n, 1, dtype=torch.uint8, device=ids.device)]
    if site.gate is not None:
        if values is None:
            raise ConfigError(f"{site.name} declares gate={site.gate!r}: give the gate weights")
        dt = torch.bfloat16 if site.gate == "bfloat16" else torch.float32
        parts.append(values.to(dt).contiguous().view(torch.uint8).reshape(n, -1))
    return SiteOutput(codes.contiguous(), torch.cat(parts, dim=1).contiguous(), 1.0)


class RoutingReplayHooks(_RouterHooks):
    """Rollout routing replay (R3) for training a transformers MoE model (see the module docstring).

    :meth:`set_routing` takes the microbatch's :class:`~tracestore.artifacts.Routing` rows
    (``GuidanceReader.read`` results; other entries, such as FP4 ``Guidance``, are skipped, so one
    read feeds this and :class:`~tracestore.client.hf.train_hooks.GuidedFP4Hooks`). In each MoE
    block the router's top-k ids become the recorded ones on valid rows, its values are gathered
    from the live scores at those ids (so gate weights, their renormalization and their gradients
    come from the live router); rows without valid routing (padding, the unrecorded last position,
    missing or masked records) and blocks with no routing given run the live router.
    :attr:`stats` counts per router call: ``replayed_rows``, ``fallback_rows``, ``live_agreed_rows``
    (replayed rows whose live top-k set already equals the recorded one) and ``live_blocks``
    (block calls without routing). Counting synchronizes once per block call; ``count=False``
    skips it. Use as a context manager or call :meth:`remove`.
    """

    def __init__(
        self, model: Any, *, layers: Iterable[int] | None = None, layout: Layout | None = None, count: bool = True
    ) -> None:
        super().__init__(model, layers, layout)
        self.count = bool(count)
        self._routing: dict[str, Routing] = {}
        self.stats = {"replayed_rows": 0, "fallback_rows": 0, "live_agreed_rows": 0, "live_blocks": 0}

    def set_routing(self, rows: Mapping[str, Any] | None) -> RoutingReplayHooks:
        """The next microbatch's routing ``{site: Routing}`` (other entries skipped), kept until
        replaced (a checkpointed backward recomputes with it). A site without a router here, or
        routing of another top_k or expert count, is refused."""
        routing = {k: v for k, v in dict(rows or {}).items() if isinstance(v, Routing)}
        for name, r in routing.items():
            router = self.by_site.get(name)
            if router is None:
                raise ConfigError(f"routing for {name}, which is not a hooked router: {list(self.by_site)}")
            if (r.site.width, r.site.n_experts) != (router.top_k, router.n_experts):
                raise ConfigError(
                    f"routing for {name} is top-{r.site.width} of {r.site.n_experts} experts; the model's router is "
                    f"top-{router.top_k} of {router.n_experts}"
                )
        self._routing = routing
        return self

    def reset_stats(self) -> None:
        for k in self.stats:
            self.stats[k] = 0

    def _topk(
        self, r: MoERouter, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], lead: tuple[int, ...] | None
    ) -> Any:
        live = func(*args, **kwargs)
        rec = self._routing.get(r.site)
        if rec is None:
            self.stats["live_blocks"] += 1
            return live
        x = args[0] if args else kwargs["input"]
        if rec.n_rows != x.shape[0]:
            raise ShapeError(
                f"{r.site}: routing has {rec.n_rows} rows but the router scores {x.shape[0]} tokens; read it for this "
                "microbatch's plan, rows batch-major"
            )
        experts = rec.experts.to(x.device, torch.int64)
        valid = rec.valid.to(x.device, torch.bool)
        idx = torch.where(valid[:, None], experts, live[1])
        values = x.gather(1, idx)
        if self.count:
            agreed = (live[1].sort(dim=1).values == experts.sort(dim=1).values).all(dim=1) & valid
            n_valid = int(valid.sum())
            self.stats["replayed_rows"] += n_valid
            self.stats["fallback_rows"] += int(valid.numel()) - n_valid
            self.stats["live_agreed_rows"] += int(agreed.sum())
        return torch.return_types.topk((values, idx))

    def remove(self) -> None:
        super().remove()
        self._routing = {}


__all__ = ["MoERouter", "RoutingCapture", "RoutingReplayHooks", "moe_routers", "routing_output"]
