"""SiteRows: one site's rows of a read aligned to a plan, the one container a read's rows travel
in from storage (:class:`~tracestore.storage.reader.StoreReader`, read processes, the sidecar) to a
trainer's tensors; and where a read puts them: the column range of each site, the per-site shapes
of a read (:func:`read_layout`) and one buffer laid out for all of them (:func:`output_sections`,
:func:`output_arrays`). numpy only."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tracestore.errors import ConfigError, ValidationError
from tracestore.records import SiteSpec

ColumnRange = tuple[int, int]


@dataclasses.dataclass
class SiteRows:
    """One site's records aligned to a plan: row ``i`` is the plan's ``i``-th row.

    ``codes`` uint8 ``[n_rows, code_bytes]`` and ``scales`` uint8 ``[n_rows, scale_bytes]`` (of the
    column range), ``global_scale`` float32 ``[n_rows]`` (1.0 where invalid), ``token_scales``
    float32 ``[n_rows]`` or None when no record of the site carries them, ``valid`` bool
    ``[n_rows]``, ``policy_version`` int64 ``[n_rows]`` (-1 where invalid), ``stale`` bool
    ``[n_rows]`` (older than ``max_staleness`` with ``stale="flag"``).
    ``n_rows = plan.n_tokens * site.rows_per_token``. The arrays of all sites of one read (all but
    ``token_scales`` and ``stale``) are views into one buffer.
    """

    site: SiteSpec
    columns: ColumnRange
    codes: np.ndarray
    scales: np.ndarray
    global_scale: np.ndarray
    token_scales: np.ndarray | None
    valid: np.ndarray
    policy_version: np.ndarray
    stale: np.ndarray

    @property
    def n_rows(self) -> int:
        return int(self.valid.shape[0])


@dataclasses.dataclass(frozen=True)
class OutputArrays:
    """Where one site's rows of a read go (``StoreReader.read(out=...)``): ``codes`` uint8
    ``[n_rows, code_bytes]``, ``scales`` uint8 ``[n_rows, scale_bytes]`` (of the column range),
    ``policy_version`` int64, ``global_scale`` float32 and ``valid`` bool ``[n_rows]``, all
    C-contiguous and writable (:meth:`StoreReader.layout` gives the shapes)."""

    codes: np.ndarray
    scales: np.ndarray
    policy_version: np.ndarray
    global_scale: np.ndarray
    valid: np.ndarray


def checked_out(
    site: SiteSpec, n: int, cb: int, sb: int, out: Mapping[str, OutputArrays]
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``out[site]`` checked against the read's shapes (one :func:`read_layout` entry: ``n`` rows of
    ``cb`` code and ``sb`` scale bytes): (n_rows, codes, scales, pv, g, valid)."""
    o = out.get(site.name)
    if not isinstance(o, OutputArrays):
        raise ValidationError(f"out has no OutputArrays for site {site.name}")
    want = (
        ("codes", o.codes, np.uint8, (n, cb)),
        ("scales", o.scales, np.uint8, (n, sb)),
        ("policy_version", o.policy_version, np.int64, (n,)),
        ("global_scale", o.global_scale, np.float32, (n,)),
        ("valid", o.valid, np.bool_, (n,)),
    )
    for name, a, dtype, shape in want:
        if (
            not isinstance(a, np.ndarray)
            or a.dtype != dtype
            or a.shape != shape
            or not a.flags.c_contiguous
            or not a.flags.writeable
        ):
            got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ValidationError(
                f"out[{site.name!r}].{name} must be a writable C-contiguous {np.dtype(dtype)} array of shape "
                f"{shape}, got {got}"
            )
    return n, o.codes, o.scales, o.policy_version, o.global_scale, o.valid


Layout = Sequence[tuple[SiteSpec, int, int, int]]  # per site: (site, n_rows, code_bytes, scale_bytes)


def read_layout(
    sites: Sequence[SiteSpec], cols: Mapping[str, ColumnRange], n_tokens: int
) -> list[tuple[SiteSpec, int, int, int]]:
    out = []
    for s in sites:
        (c0, c1), (s0, s1) = s.byte_spans(cols[s.name])
        out.append((s, n_tokens * s.rows_per_token, c1 - c0, s1 - s0))
    return out


def output_sections(layout: Layout) -> tuple[int, list[tuple[int, int, int, int, int]]]:
    """One buffer for all of a read's rows: its size in bytes and, per site of ``layout``, the
    offsets of its codes, scales, policy_version, global_scale and valid (each 64-byte aligned)."""
    at = 0
    sections = []
    for _, n, cb, sb in layout:
        offs = []
        for nbytes in (n * cb, n * sb, 8 * n, 4 * n, n):
            offs.append(at)
            at += -(-nbytes // 64) * 64
        sections.append((offs[0], offs[1], offs[2], offs[3], offs[4]))
    return max(at, 1), sections


def output_arrays(
    buf: np.ndarray,
    layout: Layout,
    sections: Sequence[tuple[int, int, int, int, int]],
    tokens: tuple[int, int] | None = None,
) -> dict[str, OutputArrays]:
    """Every site's :class:`OutputArrays` as views of ``buf`` (uint8, laid out by
    :func:`output_sections`); ``tokens=(t0, t1)``: only the rows of those plan tokens."""
    out = {}
    for (site, n, cb, sb), (oc, os_, op, og, ov) in zip(layout, sections, strict=True):
        r0, r1 = (0, n) if tokens is None else (tokens[0] * site.rows_per_token, tokens[1] * site.rows_per_token)
        k = r1 - r0
        out[site.name] = OutputArrays(
            buf[oc + r0 * cb : oc + r1 * cb].reshape(k, cb),
            buf[os_ + r0 * sb : os_ + r1 * sb].reshape(k, sb),
            buf[op + 8 * r0 : op + 8 * r1].view(np.int64),
            buf[og + 4 * r0 : og + 4 * r1].view(np.float32),
            buf[ov + r0 : ov + r1].view(np.bool_),
        )
    return out


def column_range(site: SiteSpec, columns: object) -> ColumnRange:
    """The values ``[a, b)`` of ``site`` a read returns: ``columns`` is None (all), a pair for every
    FP4 site, or ``{site: pair}``. An artifact site is read whole; a pair for it in a mapping must
    be its full width."""
    if columns is None:
        return (0, site.width)
    if isinstance(columns, Mapping):
        got = columns.get(site.name)
        if site.is_artifact and got is not None:
            site.byte_spans(_pair(got))  # refuses anything but the whole row
        return column_range(site, got)
    if site.is_artifact:
        return (0, site.width)  # a pair for every site narrows the FP4 sites only
    a, b = _pair(columns)
    block = site.fmt.block
    if not 0 <= a < b <= site.width or a % block or b % block or (a * site.bits) % 8 or (b * site.bits) % 8:
        raise ConfigError(
            f"site {site.name}: column range [{a}, {b}) must lie in [0, {site.width}] and be aligned to the "
            f"{site.format} block {block} (and to whole code bytes at b={site.bits})"
        )
    return (a, b)


def _pair(columns: object) -> ColumnRange:
    try:
        pair: tuple[Any, ...] = tuple(columns)  # type: ignore[call-overload,arg-type]
        if len(pair) != 2:
            raise ValueError("not a pair")
        return int(pair[0]), int(pair[1])
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"columns must be (start, end) in values or a {{site: (start, end)}} dict, got {columns!r}"
        ) from exc
