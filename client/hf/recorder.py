"""FP4 fake quantization at every hooked site of a transformers model, recorded into
``RolloutRecorder``\\ s (:class:`FP4SiteRecorder`), and the recorder outputs of one forward's FP4
codes (:func:`site_outputs`): the readable CPU/any-device rollout path built on
:class:`tracestore.client.hf.hooks.HFSiteHooks`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from tracestore.client.hf.hooks import HFSiteHooks, HookedSite
from tracestore.client.hf.layouts import Layout
from tracestore.client.hf.routing import RoutingCapture

from tracestore.errors import ConfigError, ShapeError


def site_outputs(
    records: dict[str, tuple[torch.Tensor, torch.Tensor, float]], run_spec: Any, rows: torch.Tensor | None = None
) -> dict[str, Any]:
    """``RolloutRecorder`` outputs for the sites of ``run_spec`` from one forward's full FP4 codes.

    ``records[site] = (codes uint8 [B, T, w] in 0..15, scales uint8 [B, T, w/block], g)``; each
    declared site's low ``bits`` are packed (``tracestore.packing.pack_bits``) into rows ordered
    batch-major, which matches segments ``[(trajectory_b, start, start+T) for b in batch]``;
    ``rows`` (int64 indices into the ``B*T`` batch-major rows) keeps those rows only, in that order.
    A ``routed_experts`` site's record is ``(ids [B, T, top_k], gate values [B, T, top_k], g)``
    (:class:`~tracestore.client.hf.routing.RoutingCapture`); ``logprobs`` sites are skipped (the
    sampler's, recorded with ``record_forward`` by the caller).
    """
    from tracestore.packing import pack_bits
    from tracestore.site_output import SiteOutput

    out = {}
    for site in run_spec.sites:
        if site.kind == "logprobs":  # the sampler's, not the model's: record_forward them yourself
            continue
        if site.name not in records:
            raise ConfigError(
                f"run {run_spec.run} declares site {site.name!r} but this forward produced no record for it"
            )
        codes, scales, g = records[site.name]
        b, t, w = codes.shape
        if site.kind == "routed_experts":  # (ids [B, T, top_k], gate values [B, T, top_k])
            from tracestore.client.hf.routing import routing_output

            out[site.name] = routing_output(site, codes.reshape(b * t, w), scales.reshape(b * t, w), rows)
            continue
        if w != site.width:
            raise ShapeError(
                f"run {run_spec.run} declares site {site.name} with width {site.width}, the model's is {w} "
                f"(codes {tuple(codes.shape)})"
            )
        codes, scales = codes.reshape(b * t, w), scales.reshape(b * t, -1)
        if rows is not None:
            codes, scales = codes.index_select(0, rows), scales.index_select(0, rows)
        out[site.name] = SiteOutput(pack_bits(codes, site.bits), scales, g)
    return out


Record = tuple[torch.Tensor, torch.Tensor, Any]  # (codes [B, T, w], scales [B, T, w/block], g)


class FP4SiteRecorder:
    """NVFP4/MXFP4 fake quantization at every hooked site, recorded into ``RolloutRecorder``\\ s.

    Each site's input is quantized with a per-forward decode-side global scale (``quantize``:
    ``g = amax/2688`` of that forward's tensor), the model consumes the dequantized value, and
    every model forward inside a :meth:`forward` block is handed to every recorder (the sites its
    run declares, low ``bits`` packed) when the block exits cleanly: one forward, or a whole
    ``generate()`` (prefill and every decode step, each with its own g). Rows are batch-major:
    ``segments`` lists one ``(trajectory, start, end)`` per batch row. This is the readable
    CPU/any-device path; ``tracestore.kernels.record_from_activations`` is the graph-safe GPU capture.

    Routing: where a recorder's run declares ``routed_experts`` sites (``routing=None``, the
    default; ``True``/``False`` forces it), every MoE block's chosen top-k is recorded beside the
    FP4 sites (:class:`~tracestore.client.hf.routing.RoutingCapture`; gate weights when the site
    declares them). ``moe=False, kv=False, fake_quant=False`` records routing without FP4 sites.

    Example::

        with FP4SiteRecorder(model, [recorder]) as fp4:
            # positions 0 .. P+n-2 enter the model; the last sampled token never does
            with fp4.forward([("traj-0", 0, None), ("traj-1", 0, None)]):
                model.generate(prompt, max_new_tokens=n, **fp4.hooks.cache_kwargs(fp4.hooks.new_cache()))
    """

    def __init__(
        self,
        model: Any,
        recorders: Iterable[Any] = (),
        *,
        fmt: str = "nvfp4",
        fake_quant: bool = True,
        layers: Iterable[int] | None = None,
        kv: bool = True,
        layout: Layout | None = None,
        moe: bool = True,
        stack: bool = False,
        routing: bool | None = None,
    ) -> None:
        from tracestore.formats import get_format

        self.fmt = get_format(fmt)
        self.fake_quant = fake_quant
        self.recorders = list(recorders)
        self.records: dict[str, Record] = {}
        self._steps: list[dict[str, Record]] = []
        self._where: list[_Where | None] = []  # per forward: where its tokens sit in their sequences
        self._active = False
        self.model = model
        self.hooks = HFSiteHooks(model, self._site, layers=layers, kv=kv, layout=layout, moe=moe, stack=stack,
                                 owner="FP4SiteRecorder")  # fmt: skip
        self.routing: RoutingCapture | None = None
        try:
            if routing is None:
                routing = any(s.kind == "routed_experts" for r in self.recorders for s in r.run_spec.sites)
            if routing:
                self.routing = RoutingCapture(model, layers=layers, layout=layout, on_route=self._route)
            bad = [s for s in self.hooks.sites if s.width % self.fmt.block]
            if bad:
                raise ShapeError(
                    f"{self.fmt} quantizes blocks of {self.fmt.block} values; these sites' widths are not a multiple: "
                    + ", ".join(f"{s.name} (width {s.width})" for s in bad[:6])
                    + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
                )
            hooked: dict[str, Any] = {s.name: s for s in self.hooks.sites}
            routers = {} if self.routing is None else self.routing.by_site
            for rec in self.recorders:
                missing = [s.name for s in rec.run_spec.sites if s.name not in hooked and s.name not in routers
                           and s.kind != "logprobs"]  # fmt: skip
                if missing:
                    raise ConfigError(
                        f"run {rec.run_spec.run} declares sites this model has no hook for: {missing[:4]}; "
                        f"hooked sites are named like {sorted(hooked)[:3]}"
                    )
                wrong = [
                    f"{s.name} (declared {s.width}, model {hooked[s.name].width})"
                    for s in rec.run_spec.sites
                    if s.name in hooked and s.width != hooked[s.name].width
                ] + [
                    f"{s.name} (declared top-{s.width} of {s.n_experts}, model top-{routers[s.name].top_k} of "
                    f"{routers[s.name].n_experts})"
                    for s in rec.run_spec.sites
                    if s.name in routers
                    and (s.width, s.n_experts) != (routers[s.name].top_k, routers[s.name].n_experts)
                ]
                if wrong:
                    raise ShapeError(
                        f"run {rec.run_spec.run} declares sites with widths the model does not have: {wrong[:4]}"
                    )
            self._step_hook = model.register_forward_pre_hook(self._new_step, with_kwargs=True)
        except BaseException:
            self.remove()
            raise

    def _new_step(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if self._active:
            self._steps.append({})
            self._where.append(_where_of(args, kwargs))

    def _site(self, site: HookedSite, x: torch.Tensor) -> torch.Tensor | None:
        from tracestore.fp4 import dequantize, quantize

        b, t, w = x.shape
        q = quantize(x.detach().reshape(b * t, w), self.fmt)
        if self._active:
            if not self._steps or site.name in self._steps[-1]:  # a forward not entered through the model
                self._steps.append({})
                self._where.append(None)
            self._steps[-1][site.name] = (q.codes.reshape(b, t, w), q.scales.reshape(b, t, -1), float(q.global_scale))
        return dequantize(q).reshape(b, t, w).to(x.dtype) if self.fake_quant else None

    def _route(self, router: Any, ids: torch.Tensor, values: torch.Tensor, lead: tuple[int, ...] | None) -> None:
        if not self._active:
            return
        if not self._steps or router.site in self._steps[-1]:  # a forward not entered through the model
            self._steps.append({})
            self._where.append(None)
        where = self._where[-1]
        if lead is None and where is not None:
            lead = tuple(where.pos.shape)
        if lead is None:
            raise ConfigError(
                f"{router.site}: the MoE block's input is not [batch, tokens, hidden]; cannot place its rows"
            )
        b, t = lead
        k = ids.shape[-1]
        self._steps[-1][router.site] = (ids.reshape(b, t, k), values.reshape(b, t, k), 1.0)

    @contextlib.contextmanager
    def forward(self, segments: Sequence[tuple[str, int, int | None]]) -> Iterator[dict[str, Record]]:
        """Around one model forward or a whole ``generate()`` over ``segments``; records every
        forward when the block exits cleanly. Yields ``{site: (codes, scales, g)}``, filled on exit:
        codes uint8 [B, positions, w] and scales of all the block's forwards in order, ``g`` the
        float of a single forward, else float32 [B, positions] (each forward's g on its rows).

        ``segments`` is one ``(trajectory, start, end)`` per batch row of the forwards (per returned
        sequence of a ``generate(num_return_sequences=k)``). A row's tokens are placed by their
        index in the row's own sequence: the model's ``position_ids``, else the count of
        ``attention_mask`` ones before them, else the cache length; padding (mask 0) is never
        recorded. The row's first position in the block is recorded at ``start``. A forward that
        feeds positions again from the first (no cache) records only the new ones; one that starts
        before the last recorded position (the cache was cut back: rejected draft tokens of
        assisted or speculative decoding) drops what was recorded from there on. The positions a
        row records must be contiguous and, with ``end`` given, number ``end - start``. Beam
        search is refused (:class:`~tracestore.errors.ConfigError`): its rows are reordered between
        forwards and belong to no returned sequence.
        """
        self.records = {}
        self._steps = []
        self._where = []
        self._active = True
        restore = _guard_generate(self.model)
        try:
            yield self.records
        finally:
            self._active = False
            restore()
        kept = [(s, w) for s, w in zip(self._steps, self._where, strict=True) if s]
        self._steps, self._where = [], []
        if not kept:
            if self.recorders:
                raise ConfigError(
                    "FP4SiteRecorder.forward: no model forward reached a hooked site inside the block (was the "
                    "model called inside the `with fp4.forward(...)` block, is it the model these hooks were "
                    "attached to, and not a torch.compile'd copy of it?)"
                )
            return
        steps = [s for s, _ in kept]
        placed = _place(list(segments), steps, [w for _, w in kept])
        self.records.update(_concat(steps))
        # each forward's input token ids of the rows it records: every chunk's token identity
        ids = [None if w is None or w.ids is None else w.ids.reshape(-1)[rows] for (_, w), (_, rows) in
               zip(kept, placed, strict=True)]  # fmt: skip
        for rec in self.recorders:
            for step, (segs, rows), tok in zip(steps, placed, ids, strict=True):
                if segs:
                    rec.record_forward(segs, site_outputs(step, rec.run_spec, rows), token_ids=tok)

    def remove(self) -> None:
        self.hooks.remove()
        if self.routing is not None:
            self.routing.remove()
        handle = getattr(self, "_step_hook", None)
        if handle is not None:
            handle.remove()

    def __enter__(self) -> FP4SiteRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where one model forward's input tokens sit: ``pos`` int64 [B, T], each token's index in its
    own sequence (padding not counted); ``valid`` bool [B, T], False for padding; ``ids`` int64
    [B, T], the input token ids (None: the forward got ``inputs_embeds``)."""

    pos: torch.Tensor
    valid: torch.Tensor
    ids: torch.Tensor | None = None


def _cache_length(kwargs: dict[str, Any]) -> int:
    position = kwargs.get("cache_position")
    if isinstance(position, torch.Tensor) and position.numel():
        return int(position.reshape(-1)[0])
    for key in ("cache", "past_key_values"):
        cache = kwargs.get(key)
        if cache is not None and hasattr(cache, "get_seq_length"):
            with contextlib.suppress(Exception):  # a hybrid cache whose layer 0 keeps no length
                return int(cache.get_seq_length())
    return 0


def _where_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Where | None:
    """The positions of a model forward's tokens (None: no ``input_ids``/``inputs_embeds`` to size
    them by). With a 2-D ``attention_mask`` covering the tokens: the count of ones before each, its
    zeros padding. Else from ``position_ids`` (a 4-D mask, as a static cache passes): a token is
    padding when a later token of its row sits at the same or an earlier position (left padding
    repeats the first position). Else the cache length onwards, nothing padding."""
    ref = kwargs.get("input_ids")
    if ref is None and args and isinstance(args[0], torch.Tensor):
        ref = args[0]
    tokens = None
    if isinstance(ref, torch.Tensor) and ref.dim() == 2 and not (ref.is_floating_point() or ref.is_complex()):
        tokens = ref.detach().to("cpu", torch.int64)
    if ref is None:
        ref = kwargs.get("inputs_embeds")
    if not isinstance(ref, torch.Tensor) or ref.dim() < 2:
        return None
    b, t = int(ref.shape[0]), int(ref.shape[1])
    where = _positions(b, t, args, kwargs)
    return dataclasses.replace(where, ids=tokens)


def _positions(b: int, t: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Where:
    """Positions and padding of a forward of ``b`` rows of ``t`` tokens (see :func:`_where_of`)."""
    given = kwargs.get("position_ids")
    if isinstance(given, torch.Tensor) and given.dim() == 3:
        given = given[0]  # multimodal RoPE: [3, B, T], the text positions first
    ids = None
    if isinstance(given, torch.Tensor) and given.dim() == 2 and given.shape[1] == t and given.shape[0] in (1, b):
        ids = given.detach().to("cpu", torch.int64).expand(b, t)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == b and mask.shape[1] >= t:
        m = mask.detach().to("cpu")
        valid = m[:, -t:].bool()
        counted = m.long().cumsum(-1)[:, -t:] - 1
        if ids is None or torch.equal(ids[valid], counted[valid]):
            return _Where(counted.clone(), valid.clone())
    if ids is not None:
        later = torch.full((b, 1), torch.iinfo(torch.int64).max)
        after = torch.cat([ids[:, 1:].flip(-1).cummin(-1).values.flip(-1), later], -1)
        return _Where(ids.clone(), ids < after)
    start = _cache_length(kwargs)
    return _Where(torch.arange(start, start + t).expand(b, t).clone(), torch.ones(b, t, dtype=torch.bool))


def _guard_generate(model: Any) -> Callable[[], None]:
    """Refuse beam search on ``model.generate`` until the returned function is called."""
    own = "generate" in vars(model)
    inner = getattr(model, "generate", None)
    if inner is None:
        return lambda: None

    def generate(*args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
        if int(beams) > 1:
            raise ConfigError(
                f"generate(num_beams={beams}) inside FP4SiteRecorder.forward: beam search cannot be recorded, "
                "it reorders its rows (beams) between forwards, so a row's records belong to no one returned "
                "sequence; record sampling groups instead (do_sample=True, num_return_sequences=k, one segment "
                "per returned sequence)"
            )
        return inner(*args, **kwargs)

    model.generate = generate

    def restore() -> None:
        if own:
            model.generate = inner
        else:
            vars(model).pop("generate", None)

    return restore


def _place(
    segments: list[tuple[str, int, int | None]], steps: list[dict[str, Record]], wheres: list[_Where | None]
) -> list[tuple[list[tuple[str, int, int]], torch.Tensor]]:
    """Each forward's segments and the batch-major row indices they record (see
    :meth:`FP4SiteRecorder.forward` for the rules)."""
    shapes = [tuple(next(iter(s.values()))[0].shape[:2]) for s in steps]
    batch = shapes[0][0]
    if any(b != batch for b, _ in shapes):
        raise ConfigError(f"the block ran forwards of different batch sizes {sorted({b for b, _ in shapes})}; "
                          "record them in separate FP4SiteRecorder.forward blocks")  # fmt: skip
    if len(segments) != batch:
        hint = (
            f" (generate(num_return_sequences={batch // len(segments)}) runs {batch} rows: give one segment per "
            "returned sequence)"
            if segments and batch % len(segments) == 0
            else ""
        )
        raise ConfigError(
            f"the block's forwards have {batch} batch rows; segments must be one (trajectory, start, end) per "
            f"batch row, got {len(segments)}{hint}"
        )
    mark = [0] * batch  # per row: one past the last position recorded
    base: list[int | None] = [None] * batch  # per row: the first position the block saw
    positions: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []
    for (b_, t), where in zip(shapes, wheres, strict=True):
        if where is None:  # a forward not entered through the model: it continues each row
            pos = torch.tensor(mark, dtype=torch.int64)[:, None] + torch.arange(t)
            where = _Where(pos, torch.ones(b_, t, dtype=torch.bool))
        keep = where.valid.clone()
        for b in range(batch):
            pb = where.pos[b][where.valid[b]]
            if not pb.numel():
                continue
            lo = int(pb.min())
            if base[b] is None:
                base[b] = lo
            if lo < mark[b]:
                if lo == base[b]:  # the whole sequence again (no cache): only the new positions
                    keep[b] &= where.pos[b] >= mark[b]
                else:  # the cache was cut back (rejected draft tokens): forget what follows lo
                    for earlier_pos, earlier_keep in zip(positions, kept, strict=True):
                        earlier_keep[b] &= earlier_pos[b] < lo
                    mark[b] = lo
            if keep[b].any():
                mark[b] = max(mark[b], int(where.pos[b][keep[b]].max()) + 1)
        positions.append(where.pos)
        kept.append(keep)
    covered = [sorted(int(p) for pos, keep in zip(positions, kept, strict=True) for p in pos[b][keep[b]])
               for b in range(batch)]  # fmt: skip
    for b, (traj, start, end) in enumerate(segments):
        got = covered[b]
        lo = base[b] or 0
        if got != list(range(lo, lo + len(got))) or (end is not None and len(got) != int(end) - int(start)):
            raise ConfigError(
                f"the block ran {len(steps)} model forward(s); batch row {b} ({traj!r}) recorded {len(got)} "
                f"position(s) {_span(got)}, which must be contiguous"
                + (f" and number end - start = {int(end) - int(start)}" if end is not None else "")
                + f"; forwards of {' + '.join(str(t) for _, t in shapes[:8])}{' + ...' if len(shapes) > 8 else ''} "
                "tokens per row"
            )
    out = []
    for (_, t), pos, keep in zip(shapes, positions, kept, strict=True):
        segs: list[tuple[str, int, int]] = []
        rows: list[torch.Tensor] = []
        for b, (traj, start, _) in enumerate(segments):
            js = keep[b].nonzero().flatten()
            if not js.numel():
                continue
            p = pos[b][js]
            if p.numel() > 1 and not bool((p[1:] > p[:-1]).all()):
                raise ConfigError(f"batch row {b} ({traj!r}): a forward's positions do not increase along the row")
            cuts = [0, *((p[1:] != p[:-1] + 1).nonzero().flatten() + 1).tolist(), p.numel()]
            for i, j in zip(cuts[:-1], cuts[1:], strict=True):
                first = int(start) + int(p[i]) - (base[b] or 0)
                segs.append((traj, first, first + (j - i)))
                rows.append(b * t + js[i:j])
        out.append((segs, torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)))
    return out


def _span(got: list[int]) -> str:
    if not got:
        return "(none)"
    return f"{got[0]}..{got[-1]}" if len(got) > 1 else str(got[0])


def _concat(steps: list[dict[str, Record]]) -> dict[str, Record]:
    if len(steps) == 1:
        return dict(steps[0])
    out: dict[str, Record] = {}
    for name in steps[0]:
        parts = [s[name] for s in steps if name in s]
        if len(parts) != len(steps):
            raise ConfigError(f"site {name} was recorded in {len(parts)} of the block's {len(steps)} forwards")
        codes = torch.cat([p[0] for p in parts], dim=1)
        scales = torch.cat([p[1] for p in parts], dim=1)
        g = torch.cat([torch.full(p[0].shape[:2], p[2], dtype=torch.float32, device=p[0].device) for p in parts], 1)
        out[name] = (codes, scales, g)
    return out
