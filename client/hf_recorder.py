"""FP4 fake quantization at every hooked site of a transformers model, recorded into
``RolloutRecorder``\\ s (:class:`FP4SiteRecorder`), and the recorder outputs of one forward's FP4
codes (:func:`site_outputs`): the readable CPU/any-device rollout path built on
:class:`tracestore.client.hf_hooks.HFSiteHooks`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from tracestore.client.hf_hooks import HFSiteHooks, HookedSite
from tracestore.client.hf_layouts import Layout

from tracestore.errors import ConfigError, ShapeError


def site_outputs(records: dict[str, tuple[torch.Tensor, torch.Tensor, float]], run_spec: Any) -> dict[str, Any]:
    """``RolloutRecorder`` outputs for the sites of ``run_spec`` from one forward's full FP4 codes.

    ``records[site] = (codes uint8 [B, T, w] in 0..15, scales uint8 [B, T, w/block], g)``; each
    declared site's low ``bits`` are packed (``tracestore.packing.pack_bits``) into rows ordered
    batch-major, which matches segments ``[(trajectory_b, start, start+T) for b in batch]``.
    """
    from tracestore.client.recorder import SiteOutput

    from tracestore.packing import pack_bits

    out = {}
    for site in run_spec.sites:
        if site.name not in records:
            raise ConfigError(
                f"run {run_spec.run} declares site {site.name!r} but this forward produced no record for it"
            )
        codes, scales, g = records[site.name]
        b, t, w = codes.shape
        if w != site.width:
            raise ShapeError(
                f"run {run_spec.run} declares site {site.name} with width {site.width}, the model's is {w} "
                f"(codes {tuple(codes.shape)})"
            )
        out[site.name] = SiteOutput(pack_bits(codes.reshape(b * t, w), site.bits), scales.reshape(b * t, -1), g)
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
    ) -> None:
        from tracestore.formats import get_format

        self.fmt = get_format(fmt)
        self.fake_quant = fake_quant
        self.recorders = list(recorders)
        self.records: dict[str, Record] = {}
        self._steps: list[dict[str, Record]] = []
        self._active = False
        self.hooks = HFSiteHooks(model, self._site, layers=layers, kv=kv, layout=layout, moe=moe)
        try:
            bad = [s for s in self.hooks.sites if s.width % self.fmt.block]
            if bad:
                raise ShapeError(
                    f"{self.fmt} quantizes blocks of {self.fmt.block} values; these sites' widths are not a multiple: "
                    + ", ".join(f"{s.name} (width {s.width})" for s in bad[:6])
                    + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
                )
            hooked = {s.name: s for s in self.hooks.sites}
            for rec in self.recorders:
                missing = [s.name for s in rec.run_spec.sites if s.name not in hooked]
                if missing:
                    raise ConfigError(
                        f"run {rec.run_spec.run} declares sites this model has no hook for: {missing[:4]}; "
                        f"hooked sites are named like {sorted(hooked)[:3]}"
                    )
                wrong = [
                    f"{s.name} (declared {s.width}, model {hooked[s.name].width})"
                    for s in rec.run_spec.sites
                    if s.width != hooked[s.name].width
                ]
                if wrong:
                    raise ShapeError(
                        f"run {rec.run_spec.run} declares sites with widths the model does not have: {wrong[:4]}"
                    )
            self._step_hook = model.register_forward_pre_hook(self._new_step)
        except BaseException:
            self.hooks.remove()
            raise

    def _new_step(self, module: Any, args: Any) -> None:
        if self._active:
            self._steps.append({})

    def _site(self, site: HookedSite, x: torch.Tensor) -> torch.Tensor | None:
        from tracestore.fp4 import dequantize, quantize

        b, t, w = x.shape
        q = quantize(x.detach().reshape(b * t, w), self.fmt)
        if self._active:
            if not self._steps or site.name in self._steps[-1]:  # a forward not entered through the model
                self._steps.append({})
            self._steps[-1][site.name] = (q.codes.reshape(b, t, w), q.scales.reshape(b, t, -1), float(q.global_scale))
        return dequantize(q).reshape(b, t, w).to(x.dtype) if self.fake_quant else None

    @contextlib.contextmanager
    def forward(self, segments: Sequence[tuple[str, int, int | None]]) -> Iterator[dict[str, Record]]:
        """Around one model forward or a whole ``generate()`` over ``segments``; records every
        forward when the block exits cleanly. Yields ``{site: (codes, scales, g)}``, filled on exit:
        codes uint8 [B, positions, w] and scales of all the block's forwards in order, ``g`` the
        float of a single forward, else float32 [B, positions] (each forward's g on its rows).

        Over several forwards, ``segments`` is one ``(trajectory, start, end)`` per batch row with
        ``end - start`` = the positions the forwards covered (``end=None``: whatever they covered);
        forward k is recorded at positions ``start + (T_0 + ... + T_{k-1})`` onwards.
        """
        self.records = {}
        self._steps = []
        self._active = True
        try:
            yield self.records
        finally:
            self._active = False
        steps = [s for s in self._steps if s]
        self._steps = []
        if not steps:
            if self.recorders:
                raise ConfigError("FP4SiteRecorder.forward: no model forward reached a hooked site inside the block")
            return
        per_step = _step_segments(list(segments), steps)
        self.records.update(_concat(steps))
        for rec in self.recorders:
            for step, segs in zip(steps, per_step, strict=True):
                rec.record_forward(segs, site_outputs(step, rec.run_spec))

    def remove(self) -> None:
        self.hooks.remove()
        handle = getattr(self, "_step_hook", None)
        if handle is not None:
            handle.remove()

    def __enter__(self) -> FP4SiteRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _step_segments(
    segments: list[tuple[str, int, int | None]], steps: list[dict[str, Record]]
) -> list[list[tuple[str, int, int]]]:
    """Each forward's segments: one forward keeps ``segments`` as given; several split each batch
    row's segment by the positions each forward covered."""
    lengths = [next(iter(s.values()))[0].shape[1] for s in steps]
    batch = next(iter(steps[0].values()))[0].shape[0]
    total = sum(lengths)
    rows_like = len(segments) == batch
    if len(steps) == 1 and not any(end is None for _, _, end in segments):
        return [[(t, int(start), int(end)) for t, start, end in segments]]  # type: ignore[arg-type]
    bad = [s for s in segments if s[2] is not None and int(s[2]) - int(s[1]) != total]
    if not rows_like or bad:
        raise ConfigError(
            f"the block ran {len(steps)} model forward(s) covering {total} positions per batch row "
            f"({' + '.join(map(str, lengths[:8]))}{' + ...' if len(lengths) > 8 else ''}); segments must be one "
            f"(trajectory, start, end) per batch row ({batch}) with end - start = {total} or end None, got "
            f"{len(segments)} segment(s){', e.g. ' + repr(bad[0]) if bad else ''}"
        )
    out, offset = [], 0
    for n in lengths:
        out.append([(t, int(start) + offset, int(start) + offset + n) for t, start, _ in segments])
        offset += n
    return out


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
