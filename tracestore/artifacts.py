"""Per-token rollout artifacts stored beside the FP4 records: routed experts and log-probs.

An artifact is a site of the run (:class:`~tracestore.records.SiteSpec` of a kind in
:data:`~tracestore.records.ARTIFACT_KINDS`) whose rows travel and are stored exactly as FP4
records are (chunks, checksums, seals, prefix links, attempts, retention); the kind says how a
row's two payload columns read (docs/data-model.md, "Artifacts"):

- ``routed_experts`` of MoE layer L (site ``layers.{L}.mlp.router``, width = top_k): codes hold the
  top_k logical (pre-EPLB) expert ids, uint8 (n_experts <= 256) or uint16 little-endian, in the
  router's slot order; scales hold one flag byte then, when the site declares ``gate``, the top_k
  gate weights (float32 or bfloat16, little-endian).
- ``logprobs`` (site ``logprobs``, width 1): the row at position p holds, float32, the log-prob of
  the token the forward at p sampled (token p + 1); scales the flag byte.

The flag byte's bit 0 says the row is valid: a row written for a token whose artifact the engine
did not produce (a prefix-cache hit that ran no forward, a retracted or aborted request) is stored
with flag 0 so the key stays write-once and the gap is explicit. Everything here is numpy.

Example::

    site = routed_experts_site(layer=3, top_k=2, n_experts=8, gate="float32")
    ids, gate = np.array([[1, 5], [0, 7]]), np.ones((2, 2), np.float32)
    codes, scales = encode_routing(site, ids, gate)
    rows = decode_routing(site, codes, scales)   # rows.experts int64 [2, 2], rows.valid [True, True]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tracestore.errors import ConfigError, DTypeError, ShapeError
from tracestore.records import GATE_FORMATS, SiteSpec

FLAG_VALID = 1  # bit 0 of a row's flag byte
LOGPROBS_SITE = "logprobs"


def router_site_name(layer: int) -> str:
    """The site name of MoE layer ``layer``'s routing: ``layers.{layer}.mlp.router``."""
    return f"layers.{int(layer)}.mlp.router"


def routed_experts_site(
    layer: int, top_k: int, n_experts: int, gate: str | None = None, name: str | None = None
) -> SiteSpec:
    """The ``routed_experts`` site of MoE layer ``layer`` (ids uint8 up to 256 experts, else uint16;
    ``gate`` None, ``"float32"`` or ``"bfloat16"``)."""
    return SiteSpec(name or router_site_name(layer), "routed_experts", layer, top_k, n_experts=n_experts, gate=gate)


def logprobs_site(name: str = LOGPROBS_SITE, layer: int = 0) -> SiteSpec:
    """The ``logprobs`` site (one float32 per token)."""
    return SiteSpec(name, "logprobs", layer, 1)


@dataclasses.dataclass(frozen=True)
class RoutingRows:
    """Decoded ``routed_experts`` rows: ``experts`` int64 [rows, top_k], ``gate`` float32
    [rows, top_k] or None, ``valid`` bool [rows] (stored, present in the read and flagged valid)."""

    experts: np.ndarray
    gate: np.ndarray | None
    valid: np.ndarray


@dataclasses.dataclass(frozen=True)
class Routing:
    """One MoE layer's recorded routing aligned row for row to a training microbatch, as tensors
    (what ``GuidanceReader.read`` returns for a ``routed_experts`` site): ``experts`` int64
    [rows, top_k], ``gate`` float32 [rows, top_k] or None, ``valid`` bool [rows] (False: no valid
    record, the router runs live); ``site`` its declaration. Tensors are duck-typed (no torch
    import here)."""

    site: SiteSpec
    experts: Any
    valid: Any
    gate: Any = None

    @property
    def n_rows(self) -> int:
        return int(self.experts.shape[0])

    @property
    def top_k(self) -> int:
        return self.site.width

    def to(self, device: Any, non_blocking: bool = False) -> Routing:
        """The same rows with every tensor moved to ``device``."""
        gate = None if self.gate is None else self.gate.to(device, non_blocking=non_blocking)
        return dataclasses.replace(
            self,
            experts=self.experts.to(device, non_blocking=non_blocking),
            valid=self.valid.to(device, non_blocking=non_blocking),
            gate=gate,
        )


@dataclasses.dataclass(frozen=True)
class LogProbs:
    """Recorded log-probs aligned to a training microbatch: ``values`` float32 [rows], ``valid``
    bool [rows] (what ``GuidanceReader.read`` returns for a ``logprobs`` site)."""

    site: SiteSpec
    values: Any
    valid: Any

    @property
    def n_rows(self) -> int:
        return int(self.values.shape[0])

    def to(self, device: Any, non_blocking: bool = False) -> LogProbs:
        return dataclasses.replace(
            self,
            values=self.values.to(device, non_blocking=non_blocking),
            valid=self.valid.to(device, non_blocking=non_blocking),
        )


def _kind(site: SiteSpec, kind: str) -> None:
    if site.kind != kind:
        raise ConfigError(f"site {site.name} is of kind {site.kind!r}; expected a {kind} site")


def _valid(valid: object, n: int) -> np.ndarray:
    if valid is None:
        return np.ones(n, dtype=bool)
    v = np.asarray(valid)
    if v.dtype != np.bool_ or v.shape != (n,):
        raise ShapeError(f"valid must be bool [{n}], got {v.dtype} {list(v.shape)}")
    return v


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), r)


def _from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def encode_routing(
    site: SiteSpec, experts: np.ndarray, gate: np.ndarray | None = None, valid: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scales)`` uint8 rows of ``site`` from ``experts`` (integers [rows, top_k]),
    ``gate`` (float [rows, top_k]; required exactly when the site declares one) and ``valid``
    (bool [rows], default all). Invalid rows are stored with ids 0 and gate 0."""
    _kind(site, "routed_experts")
    e = np.asarray(experts)
    if e.ndim != 2 or e.shape[1] != site.width or not np.issubdtype(e.dtype, np.integer):
        raise ShapeError(
            f"{site.name}: experts must be integers [rows, top_k={site.width}], got {e.dtype} {list(e.shape)}"
        )
    n = e.shape[0]
    v = _valid(valid, n)
    if (site.gate is None) != (gate is None):
        raise ConfigError(f"{site.name}: the site declares gate={site.gate!r}; give gate weights exactly then")
    ids = np.where(v[:, None], e, 0)
    if ids.size and (ids.min() < 0 or ids.max() >= site.n_experts):
        raise ShapeError(
            f"{site.name}: expert ids must lie in [0, {site.n_experts}), got {int(ids.min())}..{int(ids.max())}"
        )
    codes = np.ascontiguousarray(ids.astype("<u2" if site.format == "uint16" else np.uint8)).view(np.uint8)
    parts = [v.astype(np.uint8)[:, None]]
    if gate is not None:
        gw = np.asarray(gate, dtype=np.float32)
        if gw.shape != e.shape:
            raise ShapeError(f"{site.name}: gate must be float [rows, top_k] = {list(e.shape)}, got {list(gw.shape)}")
        gw = np.where(v[:, None], gw, np.float32(0))
        raw = _to_bf16(gw).astype("<u2") if site.gate == "bfloat16" else gw.astype("<f4")
        parts.append(np.ascontiguousarray(raw).view(np.uint8))
    return codes.reshape(n, site.code_bytes), np.ascontiguousarray(np.concatenate(parts, axis=1))


def decode_routing(
    site: SiteSpec, codes: np.ndarray, scales: np.ndarray, present: np.ndarray | None = None
) -> RoutingRows:
    """Decode ``routed_experts`` rows (uint8 ``codes`` [rows, code_bytes], ``scales`` [rows,
    scale_bytes]); ``present`` (bool [rows], e.g. a read's ``valid``) marks the rows that hold a
    stored record: a row is valid when present and flagged valid."""
    _kind(site, "routed_experts")
    codes, scales = _rows(site, codes, scales)
    n = codes.shape[0]
    ids = codes.view("<u2") if site.format == "uint16" else codes
    valid = (scales[:, 0] & FLAG_VALID).astype(bool) & _valid(present, n)
    gate = None
    if site.gate is not None:
        raw = np.ascontiguousarray(scales[:, 1:])
        gate = _from_bf16(raw.view("<u2")) if site.gate == "bfloat16" else raw.view("<f4").astype(np.float32)
        gate = gate.reshape(n, site.width)
    return RoutingRows(ids.astype(np.int64).reshape(n, site.width), gate, valid)


def encode_logprobs(
    site: SiteSpec, logprobs: np.ndarray, valid: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scales)`` uint8 rows of a ``logprobs`` site from float ``logprobs`` [rows]."""
    _kind(site, "logprobs")
    lp = np.asarray(logprobs, dtype=np.float32).reshape(-1)
    v = _valid(valid, lp.shape[0])
    lp = np.where(v, lp, np.float32(0)).astype("<f4")
    return np.ascontiguousarray(lp).view(np.uint8).reshape(-1, 4), v.astype(np.uint8)[:, None].copy()


def decode_logprobs(
    site: SiteSpec, codes: np.ndarray, scales: np.ndarray, present: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(logprobs float32 [rows], valid bool [rows])`` of ``logprobs`` rows."""
    _kind(site, "logprobs")
    codes, scales = _rows(site, codes, scales)
    valid = (scales[:, 0] & FLAG_VALID).astype(bool) & _valid(present, codes.shape[0])
    return codes.view("<f4")[:, 0].astype(np.float32), valid


def _rows(site: SiteSpec, codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    c, s = np.ascontiguousarray(codes), np.ascontiguousarray(scales)
    if c.dtype != np.uint8 or s.dtype != np.uint8:
        raise DTypeError(f"{site.name}: codes and scales must be uint8, got {c.dtype} and {s.dtype}")
    if (
        c.ndim != 2
        or s.ndim != 2
        or c.shape != (c.shape[0], site.code_bytes)
        or s.shape != (c.shape[0], site.scale_bytes)
    ):
        raise ShapeError(
            f"{site.name}: expected codes [rows, {site.code_bytes}] and scales [rows, {site.scale_bytes}] "
            f"({site.payload_layout}), got {list(c.shape)} and {list(s.shape)}"
        )
    return c, s


def routing_bytes_per_token(n_moe_layers: int, top_k: int, n_experts: int, gate: str | None = None) -> int:
    """Stored payload bytes per token of routing over ``n_moe_layers`` layers (ids, the flag byte
    and gate weights; before compression and per-chunk overhead)."""
    ids = 1 if n_experts <= 256 else 2
    return n_moe_layers * (top_k * ids + 1 + (top_k * GATE_FORMATS[gate] if gate else 0))


__all__ = [
    "FLAG_VALID",
    "LOGPROBS_SITE",
    "LogProbs",
    "Routing",
    "RoutingRows",
    "decode_logprobs",
    "decode_routing",
    "encode_logprobs",
    "encode_routing",
    "logprobs_site",
    "routed_experts_site",
    "router_site_name",
    "routing_bytes_per_token",
]
