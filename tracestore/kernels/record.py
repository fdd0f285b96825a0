"""Rollout-side record capture (docs/integration.md): activations / engine FP4 codes / paged KV -> records.

Anatomy: a static :class:`RecordBuffer` slab per site (allocated once, before any graph capture)
and three launchers that write a forward's rows into it at ``row_offset``. This module owns the
launchers (and ``stage_rows``, ``compute_global_scale``); the buffers, :class:`RecordBuffer` and
:class:`RecordSlab`, are in ``slab.py`` and re-exported here. On a GPU each launcher is one CUDA
kernel (``_source_record.py``) on torch's current stream: no allocation, no sync, no host read of
device data, so the calls can live inside a captured ``torch.cuda.CUDAGraph`` (call each once
before capturing so its kernel is compiled and loaded). On the CPU the same calls run the torch
reference (``quantize`` + ``pack_bits`` + ``unswizzle_scales``) into the same buffers.

Example::

    slab = RecordBuffer.allocate(site, capacity=4096, device="cuda")
    g = torch.ones(1, device="cuda")                      # the engine's decode-side global scale
    rows = record_from_activations(x, site, slab, row_offset=256, global_scale=g)
    # rows.codes uint8[N, width*b/8], rows.scales uint8[N, width/16], rows.global_scale float32[N]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tracestore.errors import ConfigError, DTypeError, ShapeError
from tracestore.formats import FP4Format, packed_row_bytes
from tracestore.fp4 import quantize, quantize_blocks, resolve_global_scale, sane_global_scales
from tracestore.layouts import padded_shape, unswizzle_scales
from tracestore.packing import pack_bits, pack_fp4, unpack_fp4

from . import _launch as L
from ._common import (
    DTYPE_CODE,
    check_aligned,
    check_float,
    check_rows_2d,
    check_uint8,
    fmt_code,
    same_device,
    site_params,
    use_gpu,
)
from ._params import AmaxAbs, FinalizeG, RecordAct, RecordCodes, RecordKV, RowDiv, RowsOut, StageRows
from .branch import join_pending
from .slab import RecordBuffer, RecordSlab
from .slab import SlabField as SlabField  # re-exported: the layout of a RecordSlab row

ScaleLayout = ("rowmajor", "swizzled128x4")


def stage_rows(slab: RecordSlab, n_rows: int, ring: torch.Tensor, slot: torch.Tensor) -> None:
    """Copy the slab's rows ``[0, n_rows)`` into ``ring[slot]`` on torch's current stream.

    ``ring`` uint8[slots, >= n_rows*row_bytes] on the slab's device, ``slot`` an int32 tensor of one
    element on that device, read on the device: one kernel, no allocation, no sync, so a captured
    CUDA graph writes whichever slot was selected before its replay. The CPU runs the same copy."""
    n_bytes = n_rows * slab.row_bytes
    check_uint8(ring, "ring")
    if ring.dim() != 2 or ring.shape[1] < n_bytes or not ring.is_contiguous() or not 0 < n_rows <= slab.capacity:
        raise ShapeError(
            f"ring must be a contiguous uint8[slots, >= {n_bytes}] for {n_rows} rows of {slab.row_bytes} B "
            f"(slab capacity {slab.capacity}), got {list(ring.shape)}"
        )
    if slot.dtype != torch.int32 or slot.numel() != 1:
        raise DTypeError(f"slot must be an int32 tensor of one element, got {slot.dtype}{list(slot.shape)}")
    same_device("ring", ring, slab.device)
    same_device("slot", slot, slab.device)
    if not use_gpu(slab.device):
        ring[int(slot.reshape(()).item()), :n_bytes].copy_(slab.data[:n_rows].reshape(-1))
        return
    join_pending(slab.device)  # record kernels forked onto a RecordBranch finish before the copy
    if ring.data_ptr() % 16 or ring.shape[1] % 16:
        raise ShapeError("ring must start on a 16-byte boundary with rows a multiple of 16 bytes")
    n16 = n_bytes // 16
    grid = max(1, min(132 * 4, (n16 + 255) // 256))
    L.launch_grid(
        "stage_rows",
        slab.device,
        grid,
        StageRows(src=slab.data, n16=n16, ring=ring, slot_bytes=ring.shape[1], slot=slot),
    )


# scale blocks per thread in record_from_activations (1, 2 or 4; bench_kernels compares them)
BLOCKS_PER_THREAD = 2
# record_act's per-element formulation (bit flags of ``V`` in kernels/_source_record.py;
# bench_kernels compares them, the GPU tests run every one): 0 = integer-pipe arithmetic, 5 = the
# magic number by FMUL and the amax on packed 16-bit pairs.
RECORD_VARIANT = 5  # H200: 0.0802 ms, against 0.0927 ms with 0
RECORD_VARIANTS = (0, 5)


def blocks_per_thread(nb: int, want: int) -> int:
    """The largest of ``want``, 2, 1 that divides a row's ``nb`` blocks."""
    for g in (want, 2, 1):
        if g <= want and nb % g == 0:
            return g
    return 1


def _rows_out(rows: RecordBuffer, g: torch.Tensor | None) -> RowsOut:
    """The output arguments record_codes and record_kv end with: code and scale rows, g in (one
    value, or one per row) and g out (strided: a :class:`RecordSlab` interleaves its sites)."""
    return RowsOut(
        codes_out=rows.codes,
        c_stride=rows.codes.stride(0),
        scales_out=rows.scales,
        so_stride=rows.scales.stride(0),
        g_ptr=g,
        g_in_stride=1 if g is not None and g.numel() > 1 else 0,
        g_out=rows.global_scale,
        g_stride=rows.global_scale.stride(0),
    )


def _check_out(out: Any, width: int, fmt: FP4Format, bits: int, row_offset: int, n: int) -> RecordBuffer:
    if not isinstance(out, RecordBuffer):
        raise ConfigError(
            f"out must be a RecordBuffer (RecordBuffer.allocate(site, capacity)), got {type(out).__name__}"
        )
    want_c, want_s = packed_row_bytes(width, bits), width // fmt.block
    if out.codes.shape[1] != want_c or out.scales.shape[1] != want_s:
        raise ShapeError(
            f"out rows must hold {want_c} code bytes and {want_s} scale bytes for width {width}, {fmt}, "
            f"bits={bits}; got {out.codes.shape[1]} and {out.scales.shape[1]}"
        )
    if row_offset < 0 or row_offset + n > out.capacity:
        raise ShapeError(
            f"rows [{row_offset}, {row_offset + n}) do not fit the buffer's {out.capacity} rows; "
            "allocate a larger slab or flush it first"
        )
    if n >= 2**31 // max(1, want_s):
        raise ShapeError(f"{n} rows × {want_s} blocks exceed one launch (2^31 blocks); split the call")
    return out


def _g_tensor(
    global_scale: Any, fmt: FP4Format, device: torch.device, slot: torch.Tensor, n: int = 1
) -> torch.Tensor | None:
    """The decode-side g as a device float32 tensor of one element, or of ``n`` (one per row, e.g.
    per-token NVFP4 activation scales), or None for MX.

    A Python float is written into ``slot`` (a row of the output's global_scale): under graph
    capture that value is baked into the graph, so pass a tensor when g changes per step."""
    if not fmt.has_global_scale:
        if global_scale is not None:
            raise ConfigError(f"{fmt} has no global scale; pass global_scale=None")
        return None
    if isinstance(global_scale, torch.Tensor):
        if global_scale.dtype != torch.float32 or global_scale.numel() not in (1, n) or global_scale.dim() > 1:
            raise ShapeError(
                f"global_scale must be a float32 tensor of one element or one per row ({n}) (decode-side g), got "
                f"{global_scale.dtype}{list(global_scale.shape)}"
            )
        same_device("global_scale", global_scale, device)
        if global_scale.numel() > 1 and not global_scale.is_contiguous():
            raise ShapeError("a per-row global_scale must be contiguous")
        return global_scale.reshape(-1)
    if isinstance(global_scale, (int, float)) and not isinstance(global_scale, bool):
        slot.fill_(float(global_scale))
        return slot
    raise ConfigError(
        f"global_scale must be a float32 device tensor, a float or None, got {type(global_scale).__name__}"
    )


def compute_global_scale(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Decode-side NVFP4 g = amax(|x|)/2688 (0 or non-finite -> 1, §3) into ``out`` (float32, 1 element).

    Three graph-safe launches on the GPU (zero, amax with atomics, finalize); the reference
    ``resolve_global_scale`` on the CPU. Returns ``out``.
    """
    x = check_float(x)
    if out.dtype != torch.float32 or out.numel() != 1:
        raise ShapeError(f"out must be a float32 tensor with one element, got {out.dtype}{list(out.shape)}")
    same_device("out", out, x.device)
    if not use_gpu(x.device):
        out.copy_(resolve_global_scale(x, None).reshape(out.shape))
        return out
    if not x.is_contiguous():
        raise ShapeError("x must be contiguous for compute_global_scale on the GPU")
    check_aligned(x.reshape(-1, x.shape[-1]), "x", 16)
    out.zero_()
    n16 = x.numel() * x.element_size() // 16
    grid = max(1, min(132 * 8, (n16 + 255) // 256))
    dt = DTYPE_CODE[x.dtype]
    L.launch_grid(f"amax_abs<{dt}>", x.device, grid, AmaxAbs(x=x, n16=n16, amax_bits=out))
    L.launch_grid("finalize_g", x.device, 1, FinalizeG(g=out))
    return out


def record_from_activations(
    x: torch.Tensor,
    site: Any,
    out: RecordBuffer,
    *,
    row_offset: int = 0,
    global_scale: torch.Tensor | float | None = None,
) -> RecordBuffer:
    """RTN-quantize activations as the engine would and record them (docs/numerics.md §3, §4, §6).

    ``x`` [N, width] float32/bfloat16/float16 (or [..., width], contiguous); writes rows
    ``[row_offset, row_offset+N)`` of ``out``: packed low-b bits, scale bytes, g per row, and the
    packed FP4 codes if ``out.fp4`` exists. NVFP4 ``global_scale`` is decode-side: a float32
    device tensor of one element or one per row (graph-safe), a float, or None = amax(|x|)/2688
    computed on the device (two extra small launches). A g that is 0, negative or not finite is
    quantized with and stored as 1.0 (docs/numerics.md §3). Returns the written rows as a
    :class:`RecordBuffer` view.
    """
    width, fmt, bits = site_params(site)
    x = check_rows_2d(check_float(x), "x", width)
    n = x.shape[0]
    _check_out(out, width, fmt, bits, row_offset, n)
    same_device("out", out.codes, x.device)
    rows = out.rows(row_offset, n)
    if n == 0:
        return rows
    slot = out.global_scale[row_offset : row_offset + 1]
    g: torch.Tensor | None
    if fmt.has_global_scale and global_scale is None:
        g = compute_global_scale(x, slot)
    else:
        g = _g_tensor(global_scale, fmt, x.device, slot, n)
    per_row = g is not None and g.numel() > 1
    if not use_gpu(x.device):
        if per_row:  # one g per row: docs/numerics.md §3 row by row, 0 / negative / non-finite -> 1
            assert g is not None
            gr = sane_global_scales(g)
            codes_b, sf = quantize_blocks(x.float().reshape(n, -1, fmt.block), fmt, gr.reshape(n, 1))
            codes = codes_b.reshape(n, width)
            rows.scales.copy_(sf)
            rows.global_scale.copy_(gr)
        else:
            q = quantize(x, fmt, None if g is None else g.reshape(()))
            codes = q.codes
            rows.scales.copy_(q.scales)
            rows.global_scale.fill_(q.global_scale)
        rows.codes.copy_(pack_bits(codes, bits))
        if rows.fp4 is not None:
            rows.fp4.copy_(pack_fp4(codes))
        return rows
    check_aligned(x, "x", 16)
    dt, fc = DTYPE_CODE[x.dtype], fmt_code(fmt)
    fp4 = rows.fp4
    # G consecutive scale blocks per thread (G = BLOCKS_PER_THREAD when it divides the row's block
    # count, else 1): instruction count, not the access pattern, bounds this kernel.
    nb = width // fmt.block
    group = blocks_per_thread(nb, BLOCKS_PER_THREAD)
    # two NVFP4 blocks' code bits (b = 1) as one 4-byte store and their scale bytes as one 2-byte store
    pair = (
        group == 2
        and fmt.block == 16
        and bits == 1
        and fp4 is None
        and rows.codes.data_ptr() % 4 == 0
        and rows.codes.stride(0) % 4 == 0
        and rows.scales.data_ptr() % 2 == 0
        and rows.scales.stride(0) % 2 == 0
    )
    name = f"record_act<{dt},{fc},{bits},{int(fp4 is not None)},{group},{RECORD_VARIANT},{int(pair)},{int(per_row)}>"
    L.launch(
        name,
        x.device,
        n * (nb // group),
        RecordAct(
            x=x,
            x_stride=x.stride(0) * x.element_size(),
            n_rows=n,
            div=RowDiv.of(nb // group),
            g_ptr=g,
            codes_out=rows.codes,
            c_stride=rows.codes.stride(0),
            scales_out=rows.scales,
            s_stride=rows.scales.stride(0),
            g_out=rows.global_scale,
            g_stride=rows.global_scale.stride(0),
            fp4_out=fp4,
            f_stride=0 if fp4 is None else fp4.stride(0),
        ),
    )
    return rows


def record_from_codes(
    packed_fp4: torch.Tensor,
    scales: torch.Tensor,
    site: Any,
    out: RecordBuffer,
    *,
    row_offset: int = 0,
    scale_layout: str = "rowmajor",
    global_scale: torch.Tensor | float | None = None,
) -> RecordBuffer:
    """Record the engine's own packed FP4 codes (element 2j in the low nibble) and scale bytes.

    ``packed_fp4`` uint8[N, width/2]; ``scales`` uint8[N, width/block] row-major, or for
    ``scale_layout="swizzled128x4"`` CUTLASS's swizzled buffer (any shape, R'·C' bytes,
    docs/numerics.md §5). NVFP4 needs the engine's decode-side ``global_scale`` (float32 device
    tensor of one element or one per row, or a float); a g that is 0, negative or not finite is
    stored as 1.0, the g the trainer uses (docs/numerics.md §3). Writes rows ``[row_offset,
    row_offset+N)`` of ``out`` and returns them.
    """
    width, fmt, bits = site_params(site)
    packed_fp4 = check_rows_2d(check_uint8(packed_fp4, "packed_fp4"), "packed_fp4", width // 2)
    check_uint8(scales, "scales")
    n, nb = packed_fp4.shape[0], width // fmt.block
    if scale_layout not in ScaleLayout:
        raise ConfigError(f"scale_layout must be one of {ScaleLayout}, got {scale_layout!r}")
    swz = scale_layout == "swizzled128x4"
    if swz:
        rp, cp = padded_shape(n, nb)
        if scales.numel() != rp * cp or not scales.is_contiguous():
            raise ShapeError(
                f"a swizzled scale buffer for {n}×{nb} scales is a contiguous {rp}×{cp} = {rp * cp} bytes "
                f"(rows padded to 128, columns to 4), got {list(scales.shape)}"
            )
    else:
        scales = check_rows_2d(scales, "scales", nb)
        if scales.shape[0] != n:
            raise ShapeError(f"scales must have {n} rows like packed_fp4, got {scales.shape[0]}")
    _check_out(out, width, fmt, bits, row_offset, n)
    for name_, t in (("packed_fp4", packed_fp4), ("scales", scales)):
        same_device(name_, t, out.device)
    if fmt.has_global_scale and global_scale is None:
        raise ConfigError("NVFP4 records need the engine's decode-side global_scale (a float32 tensor or float)")
    rows = out.rows(row_offset, n)
    if n == 0:
        return rows
    g = _g_tensor(global_scale, fmt, out.device, out.global_scale[row_offset : row_offset + 1], n)
    if not use_gpu(out.device):
        codes = unpack_fp4(packed_fp4)
        rows.codes.copy_(pack_bits(codes, bits))
        rows.scales.copy_(unswizzle_scales(scales, n, nb) if swz else scales)
        rows.global_scale.copy_(sane_global_scales(g).expand(n) if g is not None else torch.ones(n))
        return rows
    check_aligned(packed_fp4, "packed_fp4", fmt.block // 2)
    # two NVFP4 blocks per thread (16-byte loads) where rows have an even block count and the
    # buffers allow it (bench_kernels measures both)
    pair = (
        fmt.block == 16
        and nb % 2 == 0
        and packed_fp4.data_ptr() % 16 == 0
        and packed_fp4.stride(0) % 16 == 0
        and rows.codes.data_ptr() % 8 == 0
    )
    grp = 2 if pair else 1
    # the pair's two scale bytes as one 2-byte load and store where both buffers allow it
    pair_scales = (
        pair
        and scales.data_ptr() % 2 == 0
        and (swz or scales.stride(0) % 2 == 0)
        and rows.scales.data_ptr() % 2 == 0
        and rows.scales.stride(0) % 2 == 0
    )
    ng = nb // grp
    L.launch(
        f"record_codes<{fmt.block},{bits},{int(swz)},{grp},{int(pair_scales)}>",
        out.device,
        n * ng,
        RecordCodes(
            packed=packed_fp4,
            p_stride=packed_fp4.stride(0),
            scales=scales,
            s_stride=padded_shape(n, nb)[1] if swz else scales.stride(0),
            n_rows=n,
            div=RowDiv.of(ng),
            out=_rows_out(rows, g),
        ),
    )
    return rows


def _one_kv(
    pool: torch.Tensor,
    spool: torch.Tensor,
    page_table: torch.Tensor,
    n_tokens: int,
    site: Any,
    out: RecordBuffer,
    token_start: int,
    row_offset: int,
    global_scale: Any,
    name: str,
) -> RecordBuffer:
    width, fmt, bits = site_params(site)
    check_uint8(pool, f"{name} pool")
    check_uint8(spool, f"{name} scales")
    if pool.dim() != 4 or spool.dim() != 4 or pool.shape[:3] != spool.shape[:3]:
        raise ShapeError(
            f"{name} pool must be [pages, page_size, heads, head_dim/2] and its scales "
            f"[pages, page_size, heads, head_dim/{fmt.block}], got {list(pool.shape)} and {list(spool.shape)}"
        )
    pages, page_size, heads, half = pool.shape
    if heads * half * 2 != width or spool.shape[3] * fmt.block != half * 2:
        raise ShapeError(
            f"{name}: heads×head_dim = {heads}×{half * 2} with {spool.shape[3]} scales per head does not match "
            f"the site (width {width}, {fmt} blocks of {fmt.block})"
        )
    if pool.stride(3) != 1 or pool.stride(2) != half or spool.stride(3) != 1 or spool.stride(2) != spool.shape[3]:
        raise ShapeError(f"{name}: each slot's heads×head_dim bytes (and scales) must be contiguous")
    _check_out(out, width, fmt, bits, row_offset, n_tokens)
    same_device(f"{name} pool", pool, out.device)
    same_device(f"{name} scales", spool, out.device)
    rows = out.rows(row_offset, n_tokens)
    if n_tokens == 0:
        return rows
    if fmt.has_global_scale and global_scale is None:
        raise ConfigError(f"{name}: NVFP4 KV records need the cache's decode-side global_scale")
    g = _g_tensor(global_scale, fmt, out.device, out.global_scale[row_offset : row_offset + 1], n_tokens)
    if not use_gpu(out.device):
        pos = torch.arange(token_start, token_start + n_tokens)
        pg = page_table.long()[pos // page_size]
        slot = pos % page_size
        codes = unpack_fp4(pool[pg, slot].reshape(n_tokens, width // 2))
        rows.codes.copy_(pack_bits(codes, bits))
        rows.scales.copy_(spool[pg, slot].reshape(n_tokens, -1))
        rows.global_scale.copy_(sane_global_scales(g).expand(n_tokens) if g is not None else torch.ones(n_tokens))
        return rows
    base_ok = pool.data_ptr() % (fmt.block // 2) == 0 and (pool.stride(0) % (fmt.block // 2)) == 0
    if not base_ok or (pool.stride(1) % (fmt.block // 2)):
        raise ShapeError(f"{name} pool must be aligned to {fmt.block // 2} bytes per page and slot")
    L.launch(
        f"record_kv<{fmt.block},{bits}>",
        out.device,
        n_tokens * (width // fmt.block),
        RecordKV(
            pool=pool,
            pool_page=pool.stride(0),
            pool_slot=pool.stride(1),
            spool=spool,
            spool_page=spool.stride(0),
            spool_slot=spool.stride(1),
            page_table=page_table,
            pt64=int(page_table.dtype == torch.int64),
            page_size=page_size,
            token_start=token_start,
            n_tokens=n_tokens,
            nb=width // fmt.block,
            out=_rows_out(rows, g),
        ),
    )
    return rows


def _pair(v: Any, name: str) -> tuple[Any, ...]:
    if isinstance(v, (tuple, list)):
        return tuple(v)
    return (v,)


def record_kv_pages(
    kv_pool: torch.Tensor | Sequence[torch.Tensor],
    kv_scales: torch.Tensor | Sequence[torch.Tensor],
    page_table: torch.Tensor,
    n_tokens: int,
    site: Any,
    out: RecordBuffer | Sequence[RecordBuffer],
    *,
    token_start: int = 0,
    row_offset: int = 0,
    global_scale: Any = None,
) -> tuple[RecordBuffer, ...]:
    """Gather one request's tokens ``[token_start, token_start+n_tokens)`` from a paged FP4 KV cache.

    ``kv_pool`` uint8[pages, page_size, heads, head_dim/2] (or a ``(k_pool, v_pool)`` pair, with
    ``kv_scales``, ``site``, ``out`` and ``global_scale`` pairs to match), ``kv_scales``
    uint8[pages, page_size, heads, head_dim/block], ``page_table`` int32/int64[≥ pages used] the
    request's pages in order. Token ``t`` lives at page ``page_table[t // page_size]``, slot
    ``t % page_size``; its record row is heads×head_dim wide. Page ids are trusted (they are read on
    the device, never synchronized to the host). NVFP4 ``global_scale``: the cache's decode-side g
    per cache (float32 device tensor of one element or one per token, or a float); a g that is 0,
    negative or not finite is stored as 1.0 (docs/numerics.md §3). Returns the written rows per
    cache.
    """
    pools, spools = _pair(kv_pool, "kv_pool"), _pair(kv_scales, "kv_scales")
    k = len(pools)
    sites = _pair(site, "site") if isinstance(site, (tuple, list)) else (site,) * k
    outs = _pair(out, "out")
    gs = tuple(global_scale) if isinstance(global_scale, (tuple, list)) else (global_scale,) * k
    if not (len(spools) == len(sites) == len(outs) == len(gs) == k) or k not in (1, 2):
        raise ShapeError("pass one cache or a (K, V) pair, with as many scale pools, sites, outputs and global scales")
    if not isinstance(page_table, torch.Tensor) or page_table.dtype not in (torch.int32, torch.int64):
        raise DTypeError("page_table must be an int32 or int64 tensor of page ids")
    if page_table.dim() != 1 or not page_table.is_contiguous():
        raise ShapeError(f"page_table must be a contiguous 1-D tensor, got {list(page_table.shape)}")
    page_size = pools[0].shape[1] if pools[0].dim() == 4 else 1
    if n_tokens < 0 or token_start < 0:
        raise ShapeError(f"token_start and n_tokens must be >= 0, got {token_start}, {n_tokens}")
    if n_tokens and -(-(token_start + n_tokens) // page_size) > page_table.shape[0]:
        raise ShapeError(
            f"tokens up to {token_start + n_tokens} need {-(-(token_start + n_tokens) // page_size)} pages of "
            f"{page_size}, the page table has {page_table.shape[0]}"
        )
    same_device("page_table", page_table, outs[0].device)
    names = ("k", "v") if k == 2 else ("kv",)
    return tuple(
        _one_kv(pools[i], spools[i], page_table, n_tokens, sites[i], outs[i], token_start, row_offset, gs[i], names[i])
        for i in range(k)
    )
