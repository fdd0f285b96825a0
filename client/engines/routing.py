"""An engine's routing (the top-k expert ids of each MoE layer) as ``routed_experts`` record rows.

Every engine hands its capture point the chosen experts of one MoE layer as an integer tensor
``[T, >= top_k]`` (one row per token of the forward, padding included; the first ``top_k``
columns are the routed experts, in the router's slot order, as logical pre-EPLB ids). This module
turns them into the rows docs/data-model.md "Artifacts" lays out for a ``routed_experts`` site
(:func:`tracestore.artifacts.routed_experts_site`, named ``layers.{L}.mlp.router`` as
:class:`~tracestore.client.hf.routing.RoutingCapture` names it, so a trainer's
``RoutingReplayHooks`` finds them):

- :func:`route_rows`: ``(codes, flags, g)`` of a forward's rows by tensor ops on the ids' device
  (ids as uint8, or uint16 little-endian byte pairs past 256 experts; the flag byte 1 = valid;
  g 1.0), for the eager path;
- :class:`RouteBuffers`: static per-site rows for graph-safe capture (allocated once, the flag
  column filled with 1), into which :meth:`RouteBuffers.write` copies a forward's ids with device
  ops only: a CUDA graph replays the copy with its new ids.

Gate weights are not recorded (the sites declare no ``gate``): the engines' capture points pass
the ids alone, and the trainer's replay recomputes the weights from its live router.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tracestore.artifacts import routed_experts_site
from tracestore.errors import ShapeError
from tracestore.kernels import RecordSlab
from tracestore.records import SiteSpec


def route_spec(layer: int, top_k: int, n_experts: int) -> SiteSpec:
    """The ``routed_experts`` site of decoder layer ``layer`` (``layers.{layer}.mlp.router``), ids only."""
    return routed_experts_site(int(layer), int(top_k), int(n_experts))


def route_codes(ids: torch.Tensor, spec: SiteSpec) -> torch.Tensor:
    """The code bytes of ``ids`` (integers ``[T, >= top_k]``; the first ``top_k`` columns are
    kept): uint8 ``[T, code_bytes]`` on the ids' device."""
    if ids.dim() != 2 or ids.shape[1] < spec.width:
        raise ShapeError(f"{spec.name}: routing ids must be [tokens, >= top_k={spec.width}], got {list(ids.shape)}")
    i32 = ids[:, : spec.width].to(torch.int32)
    if spec.format == "uint16":
        return torch.stack([i32 & 0xFF, (i32 >> 8) & 0xFF], dim=-1).to(torch.uint8).reshape(ids.shape[0], -1)
    return i32.to(torch.uint8)


def route_rows(ids: torch.Tensor, spec: SiteSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, flags, g)`` of a forward's routing rows for :meth:`EngineRecorder.capture`:
    codes uint8 ``[T, code_bytes]``, flags uint8 ``[T, 1]`` all 1 (valid), g float32 ``[1]`` = 1."""
    codes = route_codes(ids, spec)
    flags = torch.ones(codes.shape[0], 1, dtype=torch.uint8, device=codes.device)
    return codes, flags, torch.ones(1, dtype=torch.float32, device=codes.device)


class RouteBuffers:
    """Static rows of the ``routed_experts`` sites ``specs`` (``capacity`` rows each, on ``device``),
    for graph-safe capture, held in one :class:`~tracestore.kernels.RecordSlab` (:attr:`slab`, so
    a commit stages every routing site with one copy): ``codes[name]`` uint8 ``[capacity,
    code_bytes]`` and ``flags[name]`` uint8 ``[capacity, 1]`` (all 1) are views into it, ``g``
    float32 ``[1]`` (1.0; the slab's g columns are 1.0 too)."""

    def __init__(self, specs: Iterable[SiteSpec], capacity: int, device: torch.device | str) -> None:
        if capacity < 1:
            raise ShapeError(f"capacity must be >= 1 row, got {capacity}")
        self.specs = {s.name: s for s in specs}
        gated = [s.name for s in self.specs.values() if s.scale_bytes != 1]
        if gated:
            raise ShapeError(f"routing sites {gated} declare gate bytes; the engines' capture records ids only")
        self.capacity = int(capacity)
        self.slab = RecordSlab.allocate(tuple(self.specs.values()), self.capacity, device)
        self.codes = {n: self.slab[n].codes for n in self.specs}
        self.flags = {n: self.slab[n].scales for n in self.specs}
        for f in self.flags.values():
            f.fill_(1)
        self.g = torch.ones(1, dtype=torch.float32, device=device)

    def write(self, site: str, ids: torch.Tensor) -> int:
        """Copy ``ids``' rows ``[0, min(T, capacity))`` into ``site``'s codes (device ops only);
        returns the rows written."""
        spec = self.specs[site]
        n = min(int(ids.shape[0]), self.capacity)
        if n:
            self.codes[site][:n].copy_(route_codes(ids[:n], spec))
        return n

    def rows(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each site's full-capacity ``(codes, flags, g)``."""
        return {n: (self.codes[n], self.flags[n], self.g) for n in self.specs}

    def gather(self, index: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each site's rows ``index`` (an int64 tensor on the buffers' device), in order."""
        return {
            n: (self.codes[n].index_select(0, index), self.flags[n].index_select(0, index), self.g) for n in self.specs
        }
