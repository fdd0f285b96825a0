"""Rollout-side record buffers: the static rows the record launchers (``record.py``) write into.

:class:`RecordBuffer` holds one site's caller-owned record rows (packed low-b code bits, scale
bytes, decode-side g per row, optionally the engine's packed FP4 codes). :class:`RecordSlab` holds
every site's rows of one forward in one allocation, row-major across sites (each site's place in a
row is a :class:`SlabField`), so a recorder stages a forward with one copy; ``slab[name]`` is that
site's RecordBuffer, strided views into the slab. Allocate either once, before any CUDA graph
capture: the launchers write into them in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from tracestore.errors import ConfigError, DTypeError, ShapeError
from tracestore.formats import FP4Format, get_format, packed_row_bytes
from tracestore.fp4 import e2m1_table, scale_values
from tracestore.packing import unpack_fp4

from ._common import check_uint8, site_params


@dataclasses.dataclass(frozen=True)
class RecordBuffer:
    """Caller-owned record rows of one site: ``codes`` uint8[cap, width*bits/8], ``scales``
    uint8[cap, width/block] (row-major), ``global_scale`` float32[cap] (decode-side g per row; 1.0
    for MX), optional ``fp4`` uint8[cap, width/2] (the packed FP4 codes an engine's GEMM eats)."""

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    fp4: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_uint8(self.codes, "codes")
        check_uint8(self.scales, "scales")
        if self.global_scale.dtype != torch.float32:
            raise DTypeError(f"global_scale must be float32, got {self.global_scale.dtype}")
        cap = self.codes.shape[0] if self.codes.dim() == 2 else -1
        if self.scales.dim() != 2 or self.scales.shape[0] != cap or tuple(self.global_scale.shape) != (cap,):
            raise ShapeError(
                f"codes/scales must be 2-D and global_scale 1-D with one row count, got {list(self.codes.shape)}, "
                f"{list(self.scales.shape)}, {list(self.global_scale.shape)}"
            )
        if self.fp4 is not None and (check_uint8(self.fp4, "fp4").dim() != 2 or self.fp4.shape[0] != cap):
            raise ShapeError(f"fp4 must be uint8[{cap}, width/2], got {list(self.fp4.shape)}")
        for t in (self.scales, self.global_scale, *(() if self.fp4 is None else (self.fp4,))):
            if t.device != self.codes.device:
                raise ConfigError(
                    f"all RecordBuffer tensors must be on one device, got {self.codes.device} and {t.device}"
                )

    @classmethod
    def allocate(
        cls, site: Any, capacity: int, device: torch.device | str = "cuda", *, with_fp4: bool = False
    ) -> RecordBuffer:
        """Zeroed buffers for ``capacity`` rows of ``site`` (once, outside graph capture)."""
        width, fmt, bits = site_params(site)
        if capacity < 1:
            raise ShapeError(f"capacity must be >= 1 row, got {capacity}")
        return cls(
            codes=torch.zeros(capacity, packed_row_bytes(width, bits), dtype=torch.uint8, device=device),
            scales=torch.zeros(capacity, width // fmt.block, dtype=torch.uint8, device=device),
            global_scale=torch.ones(capacity, dtype=torch.float32, device=device),
            fp4=torch.zeros(capacity, width // 2, dtype=torch.uint8, device=device) if with_fp4 else None,
        )

    @property
    def capacity(self) -> int:
        return int(self.codes.shape[0])

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dequantize(self, fmt: FP4Format | str) -> torch.Tensor:
        """The values the engine's FP4 GEMM consumes, float32 [rows, width]: ``(m(code)·sf)·g`` per
        row in that order (docs/numerics.md §3) from ``fp4`` (needs ``with_fp4=True``)."""
        if self.fp4 is None:
            raise ConfigError("dequantize needs the packed FP4 codes: allocate with with_fp4=True")
        f = get_format(fmt)
        codes = unpack_fp4(self.fp4)
        n, width = codes.shape
        if self.scales.shape[1] * f.block != width:
            raise ShapeError(f"{f} blocks of {f.block} do not match {self.scales.shape[1]} scales for width {width}")
        y = e2m1_table(codes.device)[codes.long()].reshape(n, -1, f.block) * scale_values(self.scales, f).unsqueeze(-1)
        if f.has_global_scale:
            y = y * self.global_scale.reshape(n, 1, 1)
        return y.reshape(n, width)

    def rows(self, start: int, n: int) -> RecordBuffer:
        """A view of rows ``[start, start+n)`` (no copy)."""
        if start < 0 or n < 0 or start + n > self.capacity:
            raise ShapeError(f"rows [{start}, {start + n}) are outside the buffer's {self.capacity} rows")
        sl = slice(start, start + n)
        return RecordBuffer(
            self.codes[sl], self.scales[sl], self.global_scale[sl], None if self.fp4 is None else self.fp4[sl]
        )


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclasses.dataclass(frozen=True)
class SlabField:
    """Where one site's columns sit in a :class:`RecordSlab` row (byte offsets and widths)."""

    name: str
    codes: int
    code_bytes: int
    scales: int
    scale_bytes: int
    g: int  # offset of the float32 decode-side g


def _slab_layout(sites: Sequence[Any]) -> tuple[list[SlabField], int]:
    """Each site's fields in a slab row (8-byte aligned) and the row's bytes (a multiple of 16)."""
    first = int(getattr(sites[0], "rows_per_token", 1)) if sites else 1
    odd = next((s for s in sites if int(getattr(s, "rows_per_token", 1)) != first), None)
    if odd is not None:
        raise ShapeError(
            f"site {odd.name} has rows_per_token {odd.rows_per_token}, {sites[0].name} {first}: the sites of "
            "one RecordSlab share a row index (use one slab per rows_per_token)"
        )
    fields, off = [], 0
    for site in sites:
        if getattr(site, "is_artifact", False):  # (a routed_experts site: ids, flag and gate bytes)
            cb, sb = int(site.code_bytes), int(site.scale_bytes)
        else:
            width, fmt, bits = site_params(site)
            cb, sb = packed_row_bytes(width, bits), width // fmt.block
        c = _align(off, 8)
        sc = _align(c + cb, 8)
        g = _align(sc + sb, 8)
        fields.append(SlabField(site.name, c, cb, sc, sb, g))
        off = g + 4
    return fields, _align(off, 16)


class RecordSlab:
    """Every site's record rows of one forward in one device allocation, row-major across sites.

    ``data`` uint8[capacity, row_bytes]: row r holds, for each site in order, its packed code bytes,
    its scale bytes and its float32 g (8-byte aligned fields, rows padded to 16 bytes). Rows
    ``[0, n)`` of every site are therefore one contiguous range, so a recorder stages a whole
    forward with one copy whatever the number of sites (``RolloutRecorder.record_slab``).
    ``slab[name]`` is that site's :class:`RecordBuffer` (strided views into ``data``) for the
    ``record_*`` launchers. All sites share one row index, so they must have one
    ``rows_per_token``. ``with_fp4=True`` adds per-site packed FP4 buffers (not staged). An
    artifact site (``SiteSpec.is_artifact``, e.g. ``routed_experts``) gets its stored code and
    scale bytes (ids; flag and gate bytes) and a g of 1.0; the caller writes them (the
    ``record_*`` launchers take FP4 sites only).

    Example::

        slab = RecordSlab.allocate(run_spec.sites, capacity=256, device="cuda")
        record_from_activations(x, site, slab[site.name], global_scale=g)   # per site, in the forward
        rec.record_slab(segments, slab)                                    # once per forward
    """

    def __init__(self, sites: Sequence[Any], data: torch.Tensor, fp4: dict[str, torch.Tensor] | None = None) -> None:
        sites = tuple(sites)
        if not sites:
            raise ConfigError("a RecordSlab needs at least one site")
        names = [getattr(s, "name", None) for s in sites]
        if None in names or len(set(names)) != len(names):
            raise ConfigError(f"RecordSlab sites need distinct names (SiteSpec), got {names}")
        fields, row_bytes = _slab_layout(sites)
        check_uint8(data, "data")
        if data.dim() != 2 or data.shape[1] != row_bytes or not data.is_contiguous() or data.shape[0] < 1:
            raise ShapeError(
                f"RecordSlab data must be a contiguous uint8[capacity, {row_bytes}] for these sites, got "
                f"{list(data.shape)}"
            )
        if data.data_ptr() % 16:
            raise ShapeError("RecordSlab data must start on a 16-byte boundary")
        self.sites = sites
        self.data = data
        self.layout = tuple(fields)
        self.row_bytes = row_bytes
        self.rows_per_token = int(getattr(sites[0], "rows_per_token", 1))
        gview = data.view(torch.float32)
        self.buffers: dict[str, RecordBuffer] = {}
        fp4 = fp4 or {}
        for f in fields:
            self.buffers[f.name] = RecordBuffer(
                data[:, f.codes : f.codes + f.code_bytes],
                data[:, f.scales : f.scales + f.scale_bytes],
                gview[:, f.g // 4],
                fp4.get(f.name),
            )

    @classmethod
    def allocate(
        cls, sites: Sequence[Any], capacity: int, device: torch.device | str = "cuda", *, with_fp4: bool = False
    ) -> RecordSlab:
        """A zeroed slab of ``capacity`` rows (g rows 1.0) for ``sites`` (once, before capture)."""
        if capacity < 1:
            raise ShapeError(f"capacity must be >= 1 row, got {capacity}")
        sites = tuple(sites)
        data = torch.zeros(capacity, _slab_layout(sites)[1], dtype=torch.uint8, device=device)
        fp4 = None
        if with_fp4:
            fp4 = {
                s.name: torch.zeros(capacity, site_params(s)[0] // 2, dtype=torch.uint8, device=device)
                for s in sites
                if not getattr(s, "is_artifact", False)
            }
        slab = cls(sites, data, fp4)
        for b in slab.buffers.values():
            b.global_scale.fill_(1.0)
        return slab

    @property
    def capacity(self) -> int:
        return int(self.data.shape[0])

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.layout)

    def __getitem__(self, name: str) -> RecordBuffer:
        try:
            return self.buffers[name]
        except KeyError:
            raise ConfigError(f"this RecordSlab has no site {name!r}: {list(self.buffers)}") from None

    def __repr__(self) -> str:
        return f"RecordSlab({len(self.layout)} sites, {self.capacity} x {self.row_bytes} B on {self.device})"
