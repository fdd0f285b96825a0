"""RecordSlab (every site's rows in one allocation), per-row global scales in the record kernels,
and stage_rows: the CPU path against the reference, and (marker gpu) the CUDA kernels bit for bit
against the CPU path, in and out of a captured CUDA graph."""

import itertools

import pytest
import torch

from tracestore.errors import DTypeError, ShapeError
from tracestore.fp4 import quantize
from tracestore.kernels import (
    RecordSlab,
    record_from_activations,
    record_from_codes,
    record_kv_pages,
    stage_rows,
)
from tracestore.kernels.testing import assert_bits_equal, capture_graph
from tracestore.packing import pack_bits, pack_fp4
from tracestore.records import SiteSpec

SITES = (
    SiteSpec("layers.0.mlp.input", "moe_input", 0, 160, "nvfp4", 1),
    SiteSpec("layers.0.attn.k", "key", 0, 64, "nvfp4", 3),
    SiteSpec("layers.1.mlp.input", "moe_input", 1, 96, "mxfp4", 2),
    SiteSpec("layers.1.attn.v", "value", 1, 64, "nvfp4", 4),
)


def rows_x(n, width, gen, dtype=torch.float32):
    x = torch.randn(n, width, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
    x[1, :16] = 0.0
    return x.to(dtype)


def test_slab_layout_is_aligned_and_views_are_the_sites_rows():
    slab = RecordSlab.allocate(SITES, 7, "cpu", with_fp4=True)
    assert slab.row_bytes % 16 == 0 and slab.data.shape == (7, slab.row_bytes)
    for f, s in zip(slab.layout, SITES, strict=True):
        assert f.codes % 8 == 0 and f.scales % 8 == 0 and f.g % 8 == 0
        b = slab[s.name]
        assert b.codes.shape == (7, s.code_bytes) and b.scales.shape == (7, s.scale_bytes)
        assert b.global_scale.shape == (7,) and bool((b.global_scale == 1.0).all())
        assert b.codes.stride(0) == slab.row_bytes and b.global_scale.stride(0) == slab.row_bytes // 4
    with pytest.raises(ShapeError, match="rows_per_token"):
        RecordSlab.allocate((SITES[0], SiteSpec("layers.2.mlp.input", "moe_input", 2, 64, rows_per_token=4)), 4, "cpu")


def test_cpu_per_row_global_scale_is_the_reference_row_by_row(gen):
    for s in (SITES[0], SITES[1], SITES[3]):
        slab = RecordSlab.allocate(SITES, 9, "cpu", with_fp4=True)
        x = rows_x(6, s.width, gen)
        g = torch.rand(6, generator=gen) / 50
        g[2] = 0.0  # 0 -> 1 (docs/numerics.md §3)
        r = record_from_activations(x, s, slab[s.name], row_offset=2, global_scale=g)
        for i in range(6):
            q = quantize(x[i : i + 1], s.fmt, g[i])
            assert torch.equal(r.codes[i : i + 1], pack_bits(q.codes, s.bits)), (s.name, i)
            assert torch.equal(r.scales[i : i + 1], q.scales) and torch.equal(r.fp4[i : i + 1], pack_fp4(q.codes))
            assert float(r.global_scale[i]) == q.global_scale
        from tracestore.fp4 import dequantize

        assert torch.equal(r.dequantize(s.fmt)[3:4], dequantize(quantize(x[3:4], s.fmt, g[3])))
        with pytest.raises(ShapeError, match="one per row"):
            record_from_activations(x, s, slab[s.name], global_scale=torch.ones(5))


def test_cpu_record_from_codes_per_row_global_scale(gen):
    s = SITES[0]
    slab = RecordSlab.allocate(SITES, 4, "cpu")
    q = quantize(rows_x(4, s.width, gen), s.fmt, 0.01)
    g = torch.tensor([0.5, 0.25, 2.0, 4.0])
    r = record_from_codes(pack_fp4(q.codes), q.scales, s, slab[s.name], global_scale=g)
    assert torch.equal(r.global_scale, g) and torch.equal(r.codes, pack_bits(q.codes, 1))


def test_stage_rows_cpu_and_errors():
    slab = RecordSlab.allocate(SITES, 5, "cpu")
    slab.data.random_(0, 256)
    ring = torch.zeros(3, 5 * slab.row_bytes, dtype=torch.uint8)
    stage_rows(slab, 4, ring, torch.tensor([2], dtype=torch.int32))
    assert torch.equal(ring[2, : 4 * slab.row_bytes], slab.data[:4].reshape(-1)) and not ring[:2].any()
    with pytest.raises(ShapeError):
        stage_rows(slab, 6, ring, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(DTypeError):
        stage_rows(slab, 1, ring, torch.tensor([0]))


# --------------------------------------------------------------------------------------- GPU


def _poison(slab):
    slab.data.fill_(0xA5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, fp4", list(itertools.product([torch.float32, torch.bfloat16, torch.float16], [0, 1])))
def test_gpu_slab_and_per_row_g_exact(dtype, fp4, gen):
    """Every site of a slab on the GPU, scalar and per-row g, equals the CPU path bit for bit;
    bytes outside the written rows and fields stay as they were."""
    n, cap = 300, 333
    cpu = RecordSlab.allocate(SITES, cap, "cpu", with_fp4=bool(fp4))
    gpu = RecordSlab.allocate(SITES, cap, "cuda", with_fp4=bool(fp4))
    _poison(cpu)
    _poison(gpu)
    for i, s in enumerate(SITES):
        x = rows_x(n, s.width, gen, dtype)
        if s.fmt.name != "nvfp4":
            g = None
        elif i % 2:
            g = torch.rand(n, generator=gen) / 40
            g[5] = 0.0
        else:
            g = torch.tensor([0.0123])
        record_from_activations(x, s, cpu[s.name], row_offset=11, global_scale=g)
        record_from_activations(x.cuda(), s, gpu[s.name], row_offset=11, global_scale=None if g is None else g.cuda())
        if fp4:
            assert_bits_equal(gpu[s.name].fp4[11 : 11 + n], cpu[s.name].fp4[11 : 11 + n].cuda(), f"{s.name} fp4")
    assert_bits_equal(gpu.data, cpu.data.cuda(), "slab")


@pytest.mark.gpu
def test_gpu_slab_codes_and_kv_per_row_g_exact(gen):
    s = SITES[0]
    cpu = RecordSlab.allocate(SITES, 64, "cpu")
    gpu = RecordSlab.allocate(SITES, 64, "cuda")
    _poison(cpu)
    _poison(gpu)
    q = quantize(rows_x(40, s.width, gen), s.fmt, 0.01)
    g = torch.rand(40, generator=gen)
    record_from_codes(pack_fp4(q.codes), q.scales, s, cpu[s.name], row_offset=3, global_scale=g)
    record_from_codes(pack_fp4(q.codes).cuda(), q.scales.cuda(), s, gpu[s.name], row_offset=3, global_scale=g.cuda())
    k = SITES[1]  # 64 wide: 2 heads x 32
    pool = torch.randint(0, 256, (6, 8, 2, 16), dtype=torch.uint8, generator=gen)
    spool = torch.randint(0, 127, (6, 8, 2, 2), dtype=torch.uint8, generator=gen)
    table = torch.tensor([4, 1, 5, 0, 2], dtype=torch.int32)
    gk = torch.rand(30, generator=gen)
    record_kv_pages(pool, spool, table, 30, k, cpu[k.name], token_start=3, row_offset=20, global_scale=gk)
    record_kv_pages(
        pool.cuda(),
        spool.cuda(),
        table.cuda(),
        30,
        k,
        gpu[k.name],
        token_start=3,
        row_offset=20,
        global_scale=gk.cuda(),
    )
    assert_bits_equal(gpu.data, cpu.data.cuda(), "slab")


@pytest.mark.gpu
def test_gpu_stage_rows_in_a_cuda_graph_follows_the_slot(gen):
    """One captured graph (record kernels + stage_rows) writes the ring slot selected before each replay."""
    s = SITES[0]
    slab = RecordSlab.allocate(SITES, 256, "cuda")
    ring = torch.zeros(2, 256 * slab.row_bytes, dtype=torch.uint8, device="cuda")
    slot = torch.zeros(1, dtype=torch.int32, device="cuda")
    x = torch.zeros(256, s.width, device="cuda", dtype=torch.bfloat16)
    g = torch.ones(256, device="cuda")

    def step():
        record_from_activations(x, s, slab[s.name], global_scale=g)
        stage_rows(slab, 200, ring, slot)

    graph = capture_graph(step)
    for k in range(4):
        x.copy_(rows_x(256, s.width, gen, torch.bfloat16).cuda())
        g.copy_(torch.rand(256, generator=gen).cuda() / 30)
        slot.fill_(k % 2)
        graph.replay()
        torch.cuda.synchronize()
        want = slab.data[:200].reshape(-1)
        assert_bits_equal(ring[k % 2, : want.numel()], want, f"replay {k}")
        cpu = RecordSlab.allocate(SITES, 256, "cpu")
        record_from_activations(x.cpu(), s, cpu[s.name], global_scale=g.cpu())
        f = slab.layout[0]
        assert_bits_equal(slab.data[:, f.codes : f.g + 4], cpu.data[:, f.codes : f.g + 4].cuda(), f"replay {k} rows")
