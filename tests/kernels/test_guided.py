"""guided_fp4 / rtn_fp4: the custom ops against the reference (CPU), STE gradients, torch.compile,
errors; and (marker gpu) the CUDA kernel bit for bit against the CPU op, in and out of a CUDA graph."""

import itertools

import pytest
import torch

import tracestore.kernels.guided as kg
from tracestore.errors import ConfigError, DTypeError, ShapeError
from tracestore.formats import MXFP4, MXFP4_RCEIL, NVFP4
from tracestore.fp4 import dequantize, quantize, sane_global_scales, scale_values
from tracestore.guidance import Guidance
from tracestore.guided import guided_round, rtn_fake_quant
from tracestore.kernels import guided_fp4, rtn_fp4
from tracestore.kernels.testing import assert_bits_equal
from tracestore.packing import pack_bits


def dequantize_scale(byte: torch.Tensor) -> torch.Tensor:
    return scale_values(byte, NVFP4)


FORMATS = {"nvfp4": NVFP4, "mxfp4": MXFP4, "mxfp4-rceil": MXFP4_RCEIL}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_case(n, blocks, fmt, bits, dtype, gen, rule="bracket", *, per_row_g=True, extras=True, noise=0.02):
    """Rollout activations -> records; training activations = rollout ones plus relative noise."""
    f = FORMATS[fmt]
    width = blocks * f.block
    xr = torch.randn(n, width, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
    rows_c, rows_s, gs = [], [], []
    for i in range(n):  # one forward per row: per-row global scales
        q = quantize(xr[i : i + 1], f, None)
        rows_c.append(pack_bits(q.codes, bits))
        rows_s.append(q.scales)
        gs.append(q.global_scale)
    codes, scales = torch.cat(rows_c), torch.cat(rows_s)
    g = torch.tensor(gs, dtype=torch.float32) if per_row_g else float(gs[0])
    xt = xr * (1 + noise * torch.randn(n, width, generator=gen))
    if extras and n > 3:
        xt[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
        scales[1, 0] = f.nan_scale_byte  # a NaN-scale record -> RTN fallback
        scales[2, -1] = 0  # a zero scale -> signed zero (NVFP4) / tiny scale (MX)
        xt[3] = xr[3]  # identity row
    ts = None
    valid = None
    if extras and n > 4:
        valid = torch.ones(n, dtype=torch.bool)
        valid[4] = False
    return xt.to(dtype), Guidance(codes, scales, g, bits, f, rule, token_scales=ts, valid=valid)


def reference(x, gd, rows=None, mask=None):
    codes, scales, g, ts, valid = gd.codes, gd.scales, gd.global_scale, gd.token_scales, gd.valid
    g = torch.as_tensor(g, dtype=torch.float32)
    if rows is not None:
        codes, scales = codes[rows], scales[rows]
        g = g[rows] if g.dim() else g
        ts = None if ts is None else ts[rows]
        valid = None if valid is None else valid[rows]
    ok = valid
    if mask is not None:
        ok = mask if ok is None else ok & mask
    fb = sane_global_scales(g) if gd.fmt.has_global_scale else None
    return guided_round(
        x, codes, scales, g, gd.bits, gd.fmt, gd.rule, token_scales=ts, valid=ok, fallback_global_scale=fb
    )


# ------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("fmt, bits, rule", list(itertools.product(FORMATS, [1, 2, 3, 4], ["bracket", "paper"])))
def test_cpu_guided_equals_reference(fmt, bits, rule, gen):
    x, gd = make_case(6, 3, fmt, bits, torch.bfloat16, gen, rule)
    assert_bits_equal(guided_fp4(x, gd), reference(x, gd))


def test_cpu_rows_mask_token_scales(gen):
    x, gd = make_case(8, 2, "nvfp4", 1, torch.float32, gen)
    gd = Guidance(
        gd.codes, gd.scales, gd.global_scale, 1, NVFP4, token_scales=torch.rand(8, generator=gen) + 0.5, valid=gd.valid
    )
    rows = torch.randperm(8, generator=gen)[:5]
    mask = torch.tensor([True, False, True, True, False])
    y = guided_fp4(x[:5], gd, rows=rows, mask=mask)
    assert_bits_equal(y, reference(x[:5], gd, rows, mask))
    # masked rows are RTN with the record's g
    g = gd.global_scale[rows[1]]
    assert_bits_equal(y[1], rtn_fake_quant(x[1:2], NVFP4, g).reshape(-1))


DEGENERATE_G = {"zero": 0.0, "neg-zero": -0.0, "inf": float("inf"), "neg-inf": float("-inf"), "nan": float("nan")}
DEGENERATE_G["negative"] = -0.5


def with_g(gd, g):
    return Guidance(gd.codes, gd.scales, g, gd.bits, gd.fmt, gd.rule, token_scales=gd.token_scales, valid=gd.valid)


def degenerate_cases(gen, device="cpu"):
    """(x, guidance with a degenerate g, the same guidance with g = 1) for a scalar g and one per row,
    b = 1 bracket (guided_b1) and b = 2 paper (the table kernel), rows with and without records."""
    for (name, g), (bits, rule) in itertools.product(DEGENERATE_G.items(), [(1, "bracket"), (2, "paper")]):
        x, gd = make_case(6, 3, "nvfp4", bits, torch.float32, gen, rule, per_row_g=False)
        row_g = torch.tensor([g, 0.75, g, g, 1.0, g], dtype=torch.float32)
        row_one = torch.tensor([1.0, 0.75, 1.0, 1.0, 1.0, 1.0], dtype=torch.float32)
        yield f"{name} b{bits} scalar", x, with_g(gd, g), with_g(gd, 1.0)
        yield f"{name} b{bits} per-row", x, with_g(gd, row_g), with_g(gd, row_one)


def test_cpu_degenerate_g_means_one(gen):
    """docs/numerics.md §3: a record g that is 0, negative or not finite is used as 1, in guided
    values and in the RTN fallback alike."""
    for what, x, bad, one in degenerate_cases(gen):
        assert_bits_equal(guided_fp4(x, bad), guided_fp4(x, one), what)


def test_cpu_identity_invariant(gen):
    """docs/numerics.md §9 invariant 1: training x == rollout x -> output == rollout's dequantized value."""
    for fmt, bits, rule in itertools.product(FORMATS, [1, 2, 4], ["bracket", "paper"]):
        xr = torch.randn(4, 64, generator=gen)
        q = quantize(xr, FORMATS[fmt], None)
        gd = Guidance(pack_bits(q.codes, bits), q.scales, q.global_scale, bits, FORMATS[fmt], rule)
        assert_bits_equal(guided_fp4(xr, gd), dequantize(q), f"{fmt} b={bits} {rule}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_ste_gradients(dtype, gen):
    x, gd = make_case(5, 2, "nvfp4", 2, dtype, gen, extras=False)
    x = x.requires_grad_()
    up = torch.randn(x.shape, generator=gen).to(dtype)
    (guided_fp4(x, gd) * up).sum().backward()
    assert_bits_equal(x.grad, up)
    x.grad = None
    (rtn_fp4(x, "mxfp4") * up).sum().backward()
    assert_bits_equal(x.grad, up)


def test_cpu_rtn_equals_reference(gen):
    x = torch.randn(3, 96, generator=gen).to(torch.bfloat16)
    assert_bits_equal(rtn_fp4(x, "nvfp4"), rtn_fake_quant(x, NVFP4))
    assert_bits_equal(rtn_fp4(x, "nvfp4", 0.01), rtn_fake_quant(x, NVFP4, 0.01))
    assert_bits_equal(rtn_fp4(x, "mxfp4-rceil"), rtn_fake_quant(x, MXFP4_RCEIL))


def test_cpu_torch_compile_fullgraph(gen):
    x, gd = make_case(4, 2, "nvfp4", 1, torch.float32, gen, extras=False)

    def f(a):
        return guided_fp4(a, gd) * 2 + rtn_fp4(a, "nvfp4", 0.05)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert_bits_equal(compiled(x), f(x))
    xg = x.clone().requires_grad_()
    compiled(xg).sum().backward()
    assert_bits_equal(xg.grad, torch.full_like(x, 3.0))


def test_cpu_opcheck(gen):
    x, gd = make_case(4, 2, "nvfp4", 1, torch.float32, gen, extras=False)
    x.requires_grad_()
    g = torch.as_tensor(gd.global_scale)
    args = (x, gd.codes, gd.scales, g, None, None, None, None, 1, "nvfp4", "bracket")
    torch.library.opcheck(kg._guided_fp4_op, args)
    torch.library.opcheck(kg._rtn_fp4_op, (x, torch.tensor(0.01), "mxfp4"))


def test_errors(gen):
    x, gd = make_case(4, 2, "nvfp4", 1, torch.float32, gen, extras=False)
    with pytest.raises(ShapeError, match="rows"):
        guided_fp4(x[:3], gd)
    with pytest.raises(ShapeError, match=r"\[\.\.\., 32\]"):
        guided_fp4(x[:, :16], gd)
    with pytest.raises(DTypeError, match="rows"):
        guided_fp4(x, gd, rows=torch.arange(4, dtype=torch.int32))
    with pytest.raises(ShapeError, match="mask"):
        guided_fp4(x, gd, mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(DTypeError):
        guided_fp4(x.double(), gd)
    with pytest.raises(ConfigError, match="Guidance"):
        guided_fp4(x, object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no global scale"):
        rtn_fp4(x, "mxfp4", 1.0)
    with pytest.raises(ShapeError, match="multiple"):
        rtn_fp4(x[:, :20], "nvfp4")


# ------------------------------------------------------------------------------------------- GPU


def gpu_vs_cpu(x, gd, rows=None, mask=None, what=""):
    y = guided_fp4(
        x.cuda(), gd.to("cuda"), None if rows is None else rows.cuda(), None if mask is None else mask.cuda()
    )
    assert_bits_equal(y.cpu(), guided_fp4(x, gd, rows, mask), what)


@pytest.fixture(params=[False, True], ids=["b1kernel", "table"])
def decide(request, monkeypatch):
    """b = 1 bracket runs guided_b1 by default; the general table kernel must agree."""
    monkeypatch.setattr(kg, "_TABLE_B1", request.param)
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, dtype, bits", list(itertools.product(FORMATS, DTYPES, [1, 2, 3, 4])))
def test_gpu_guided_exact(fmt, dtype, bits, decide, gen):
    for rule, (n, blocks) in itertools.product(["bracket", "paper"], [(1, 1), (7, 13), (129, 31)]):
        x, gd = make_case(n, blocks, fmt, bits, dtype, gen, rule, per_row_g=n % 2 == 1)
        gpu_vs_cpu(x, gd, what=f"{rule} {n}x{blocks}")


@pytest.mark.gpu
def test_gpu_guided_degenerate_g(decide, gen):
    """The kernels use a degenerate record g as 1 (docs/numerics.md §3), like the reference."""
    for what, x, bad, one in degenerate_cases(gen):
        gpu_vs_cpu(x, bad, what=what)
        y = guided_fp4(x.cuda(), bad.to("cuda"))
        assert_bits_equal(y.cpu(), guided_fp4(x, one), what)


@pytest.mark.gpu
def test_gpu_guided_rows_mask_token_scales(decide, gen):
    for fmt in FORMATS:
        x, gd = make_case(64, 5, fmt, 1, torch.bfloat16, gen)
        gd = Guidance(
            gd.codes,
            gd.scales,
            gd.global_scale,
            1,
            gd.fmt,
            token_scales=torch.rand(64, generator=gen) + 0.5,
            valid=gd.valid,
        )
        rows = torch.randint(0, 64, (100,), generator=gen)
        mask = torch.rand(100, generator=gen) > 0.2
        xs = torch.cat([x, x[:36]])
        gpu_vs_cpu(xs, gd, rows, mask, fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_guided_region_boundaries(fmt, decide, gen):
    """x = z·s exactly for z on every multiple of 0.25 (MX: s = 4; NVFP4: scale byte 1.5, g = 1),
    plus the float neighbours of those x: every tie and bracket edge of docs/numerics.md §2/§7, every
    recorded code, and the kernel's near-grid exact-division path."""
    f = FORMATS[fmt]
    grid = torch.arange(0, 28, dtype=torch.float32) * 0.25
    s, byte = (4.0, 129) if fmt == "mxfp4" else (1.5, 0x3C)
    xs = grid * s
    up, down = torch.nextafter(xs, torch.full_like(xs, 99.0)), torch.nextafter(xs, torch.zeros_like(xs))
    xs = torch.cat([xs, up, down, torch.tensor([1e-45, 1e-40, 1e-30])])
    xs = torch.cat([xs, -xs])
    n, blocks = xs.numel(), 3
    width = f.block * blocks
    x = xs.repeat_interleave(width).reshape(n, width)
    for bits, rule in itertools.product([1, 2, 3, 4], ["bracket", "paper"]):
        codes = torch.randint(0, 16 if bits == 4 else 1 << bits, (n, width), generator=gen, dtype=torch.uint8)
        gd = Guidance(pack_bits(codes, bits), torch.full((n, blocks), byte, dtype=torch.uint8), 1.0, bits, f, rule)
        gpu_vs_cpu(x, gd, what=f"{fmt} b={bits} {rule}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_guided_b1_quotient_edges(dtype, gen):
    """guided_b1's Newton quotient where it could go wrong: per-row g over 2^-60..2^60 and every scale
    byte (so s inside and outside the fast range [2^-20, 2^20], negative and zero), x = (grid point ±
    0..2 ulps)·s for every multiple of 0.25 in [0, 7], and x tiny, subnormal, zero, huge, inf, NaN."""
    n_rows = 512
    f = NVFP4
    byte = torch.randint(0, 256, (n_rows, 8), generator=gen, dtype=torch.uint8)
    g = torch.exp2(torch.randint(-60, 61, (n_rows,), generator=gen).float()) * (1 + torch.rand(n_rows, generator=gen))
    s = (dequantize_scale(byte) * g[:, None]).repeat_interleave(16, 1)  # [n, 128]
    grid = (torch.arange(0, 29, dtype=torch.float32) * 0.25)[torch.randint(0, 29, s.shape, generator=gen)]
    x = grid * s * torch.where(torch.rand(s.shape, generator=gen) < 0.5, -1.0, 1.0)
    for _ in range(2):
        step = torch.rand(s.shape, generator=gen) < 0.4
        x = torch.where(step, torch.nextafter(x, torch.where(torch.rand(s.shape, generator=gen) < 0.5, -9e9, 9e9)), x)
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-42, 1e-38, 7e-31, 1e-20, 3e38, -3e38, float("inf"), float("nan")])
    pick = torch.rand(s.shape, generator=gen) < 0.02
    x = torch.where(pick, special[torch.randint(0, special.numel(), s.shape, generator=gen)], x)
    codes = torch.randint(0, 2, (n_rows, 128), generator=gen, dtype=torch.uint8)
    gd = Guidance(pack_bits(codes, 1), byte, g, 1, f)
    gpu_vs_cpu(x.to(dtype), gd, what=str(dtype))


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_guided_b1_matches_table_large(gen, monkeypatch):
    """65536 × 2048 fp32 with per-row g spread over 2^-30..2^30: guided_b1 against the general table
    kernel on the GPU (both bit-exact to the reference on the sampled tests), every element."""
    n, width = 65536, 2048
    x = torch.randn(n, width, device="cuda") * torch.exp2(torch.randint(-30, 31, (n, 1), device="cuda").float())
    q = quantize(x, NVFP4, None)
    g = torch.exp2(torch.randint(-30, 31, (n,), device="cuda").float()) * (1 + torch.rand(n, device="cuda"))
    gd = Guidance(pack_bits(q.codes, 1), q.scales, g, 1, NVFP4)
    xt = x * (1 + 0.02 * torch.randn(n, width, device="cuda"))
    monkeypatch.setattr(kg, "_TABLE_B1", False)
    y_fast = guided_fp4(xt, gd)
    monkeypatch.setattr(kg, "_TABLE_B1", True)
    y_table = guided_fp4(xt, gd)
    assert_bits_equal(y_fast, y_table)


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_guided_large(gen):
    """65536 × 2048 bf16, b = 1: GPU kernel vs the same op's CPU reference on 96 sampled rows."""
    n, width = 65536, 2048
    xr = (torch.randn(n, width, device="cuda") * 2).to(torch.bfloat16)
    q = quantize(xr, NVFP4, torch.tensor(0.002, device="cuda"))
    gd = Guidance(pack_bits(q.codes, 1), q.scales, torch.full((n,), 0.002, device="cuda"), 1, NVFP4)
    xt = (xr.float() * (1 + 0.02 * torch.randn(n, width, device="cuda"))).to(torch.bfloat16)
    y = guided_fp4(xt, gd)
    idx = torch.randint(0, n, (96,), generator=gen)
    g_cpu = gd.to("cpu")
    sub = Guidance(g_cpu.codes[idx], g_cpu.scales[idx], g_cpu.global_scale[idx], 1, NVFP4)
    assert_bits_equal(y[idx.cuda()].cpu(), guided_fp4(xt[idx.cuda()].cpu(), sub))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, dtype", list(itertools.product(FORMATS, DTYPES)))
def test_gpu_rtn_exact(fmt, dtype, gen):
    x = (torch.randn(77, 13 * 32, generator=gen) * 5).to(dtype)
    x[0, 0] = float("nan")
    x[1, :32] = 0
    for g in [None, 0.01, torch.tensor([0.003])] if fmt == "nvfp4" else [None]:
        gg = g.cuda() if isinstance(g, torch.Tensor) else g
        assert_bits_equal(rtn_fp4(x.cuda(), fmt, gg).cpu(), rtn_fp4(x, fmt, g), f"g={g}")


@pytest.mark.gpu
def test_gpu_gradients_and_compile(gen):
    x, gd = make_case(33, 4, "nvfp4", 1, torch.bfloat16, gen, extras=False)
    xg, gdg = x.cuda().requires_grad_(), gd.to("cuda")
    up = torch.randn(x.shape, device="cuda").to(torch.bfloat16)
    (guided_fp4(xg, gdg) * up).sum().backward()
    assert_bits_equal(xg.grad, up)
    xg.grad = None
    (rtn_fp4(xg, "nvfp4") * up).sum().backward()
    assert_bits_equal(xg.grad, up)
    f = torch.compile(lambda a: guided_fp4(a, gdg) + 1, fullgraph=True)
    assert_bits_equal(f(xg.detach()), guided_fp4(xg.detach(), gdg) + 1)


@pytest.mark.gpu
def test_gpu_guided_in_cuda_graph(gen):
    x, gd = make_case(200, 16, "nvfp4", 1, torch.bfloat16, gen, extras=False)
    xs, gdg = x.cuda(), gd.to("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        guided_fp4(xs, gdg)
        rtn_fp4(xs, "nvfp4", 0.01)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = guided_fp4(xs, gdg)
        r = rtn_fp4(xs, "nvfp4", 0.01)
    for _ in range(2):
        x2, _ = make_case(200, 16, "nvfp4", 1, torch.bfloat16, gen, extras=False)
        xs.copy_(x2.cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert_bits_equal(y.cpu(), guided_fp4(x2, gd))
        assert_bits_equal(r.cpu(), rtn_fp4(x2, "nvfp4", 0.01))
