"""Record capture: CPU path against the reference, errors, and (marker gpu) the CUDA kernels bit for
bit against the same reference, inside and outside a captured CUDA graph."""

import itertools

import pytest
import torch

import tracestore.kernels.record as KR
from tracestore.errors import ConfigError, DTypeError, ShapeError
from tracestore.formats import MXFP4, MXFP4_RCEIL, NVFP4
from tracestore.fp4 import quantize, resolve_global_scale
from tracestore.kernels import (
    RecordBuffer,
    compute_global_scale,
    record_from_activations,
    record_from_codes,
    record_kv_pages,
)
from tracestore.kernels.testing import assert_bits_equal, capture_graph
from tracestore.layouts import swizzle_scales
from tracestore.packing import pack_bits, pack_fp4
from tracestore.records import SiteSpec

FORMATS = {"nvfp4": NVFP4, "mxfp4": MXFP4, "mxfp4-rceil": MXFP4_RCEIL}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def site(fmt="nvfp4", blocks=5, bits=1, kind="moe_input"):
    return SiteSpec("layers.3.mlp.input", kind, 3, blocks * FORMATS[fmt].block, fmt, bits)


def activations(n, width, dtype, gen, device="cpu"):
    x = torch.randn(n, width, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
    if n > 2:
        x[1, : width // 2] = 0.0  # an all-zero block
        x[2, 3] = float("nan")  # a NaN block
        x[2, -1] = float("inf")
    return x.to(dtype).to(device)


def expected(x, s, g):
    q = quantize(x.cpu(), s.fmt, g)
    return pack_bits(q.codes, s.bits), q.scales, q.global_scale, pack_fp4(q.codes)


def poisoned(s, cap, device, with_fp4=True):
    out = RecordBuffer.allocate(s, cap, device, with_fp4=with_fp4)
    out.codes.fill_(0xAB)
    out.scales.fill_(0xCD)
    out.global_scale.fill_(-7.0)
    if out.fp4 is not None:
        out.fp4.fill_(0xEF)
    return out


def check_rows(out, off, x, s, g):
    codes, scales, gval, fp4 = expected(x, s, g)
    n = x.shape[0]
    assert_bits_equal(out.codes[off : off + n], codes.to(out.device), "codes")
    assert_bits_equal(out.scales[off : off + n], scales.to(out.device), "scales")
    assert_bits_equal(out.global_scale[off : off + n].cpu(), torch.full((n,), gval), "global_scale")
    if out.fp4 is not None:
        assert_bits_equal(out.fp4[off : off + n], fp4.to(out.device), "fp4")


def check_untouched(out, lo, hi):
    assert bool((out.codes[:lo] == 0xAB).all()) and bool((out.codes[hi:] == 0xAB).all())
    assert bool((out.scales[:lo] == 0xCD).all()) and bool((out.scales[hi:] == 0xCD).all())


# ------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("fmt, bits", list(itertools.product(FORMATS, [1, 2, 3, 4])))
def test_cpu_record_from_activations(fmt, bits, gen):
    s = site(fmt, 7, bits)
    x = activations(5, s.width, torch.bfloat16, gen)
    out = poisoned(s, 9, "cpu")
    g = 0.02 if fmt == "nvfp4" else None
    rows = record_from_activations(x, s, out, row_offset=3, global_scale=g)
    assert rows.codes.shape == (5, s.code_bytes)
    check_rows(out, 3, x, s, g)
    check_untouched(out, 3, 8)


def test_cpu_global_scale_from_amax_and_tensor(gen):
    s = site("nvfp4", 3)
    x = activations(4, s.width, torch.float32, gen)[3:]  # finite rows only
    out = poisoned(s, 4, "cpu")
    record_from_activations(x, s, out)
    check_rows(out, 0, x, s, None)
    record_from_activations(x, s, out, global_scale=torch.tensor([0.5]))
    check_rows(out, 0, x, s, 0.5)
    g = compute_global_scale(x, torch.zeros(1))
    assert_bits_equal(g.reshape(()), resolve_global_scale(x, None))


@pytest.mark.parametrize("fmt, bits, layout", list(itertools.product(FORMATS, [1, 4], ["rowmajor", "swizzled128x4"])))
def test_cpu_record_from_codes(fmt, bits, layout, gen):
    s = site(fmt, 5, bits)
    x = activations(3, s.width, torch.float32, gen)
    g = 0.03 if fmt == "nvfp4" else None
    q = quantize(x, s.fmt, g)
    sc = swizzle_scales(q.scales, fill=0x55) if layout != "rowmajor" else q.scales
    out = poisoned(s, 6, "cpu")
    record_from_codes(pack_fp4(q.codes), sc, s, out, row_offset=2, scale_layout=layout, global_scale=g)
    assert_bits_equal(out.codes[2:5], pack_bits(q.codes, bits))
    assert_bits_equal(out.scales[2:5], q.scales)
    check_untouched(out, 2, 5)


def kv_cache(pages, page_size, heads, head_dim, fmt, gen, device="cpu"):
    pool = torch.randint(0, 256, (pages, page_size, heads, head_dim // 2), generator=gen, dtype=torch.uint8)
    sc = torch.randint(0, 256, (pages, page_size, heads, head_dim // fmt.block), generator=gen, dtype=torch.uint8)
    return pool.to(device), sc.to(device)


def kv_expected(pool, sc, table, start, n, bits):
    ps = pool.shape[1]
    rows_c, rows_s = [], []
    for t in range(start, start + n):
        p, slot = int(table[t // ps]), t % ps
        rows_c.append(pool[p, slot].reshape(-1))
        rows_s.append(sc[p, slot].reshape(-1))
    packed = torch.stack(rows_c).cpu()
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(n, -1)
    return pack_bits(codes, bits), torch.stack(rows_s).cpu()


@pytest.mark.parametrize("bits", [1, 3])
def test_cpu_record_kv_pages(bits, gen):
    heads, hd = 2, 32
    s = SiteSpec("layers.3.attn.k", "key", 3, heads * hd, "nvfp4", bits)
    k, ks = kv_cache(6, 4, heads, hd, NVFP4, gen)
    v, vs = kv_cache(6, 4, heads, hd, NVFP4, gen)
    table = torch.tensor([5, 0, 3, 2], dtype=torch.int32)
    ok, ov = poisoned(s, 12, "cpu"), poisoned(s, 12, "cpu")
    record_kv_pages((k, v), (ks, vs), table, 11, s, (ok, ov), token_start=2, row_offset=1, global_scale=(0.5, 0.25))
    for pool, sc, out, g in ((k, ks, ok, 0.5), (v, vs, ov, 0.25)):
        c, sx = kv_expected(pool, sc, table, 2, 11, bits)
        assert_bits_equal(out.codes[1:12], c)
        assert_bits_equal(out.scales[1:12], sx)
        assert bool((out.global_scale[1:12] == g).all())


def test_errors(gen):
    s = site("nvfp4", 4)
    out = RecordBuffer.allocate(s, 4, "cpu")
    x = activations(3, s.width, torch.float32, gen)
    with pytest.raises(ShapeError, match="do not fit"):
        record_from_activations(x, s, out, row_offset=2)
    with pytest.raises(ShapeError, match=r"\[\.\.\., 64\]"):
        record_from_activations(x[:, :48], s, out)
    with pytest.raises(DTypeError):
        record_from_activations(x.to(torch.float64), s, out)
    with pytest.raises(ConfigError, match="no global scale"):
        ms = site("mxfp4", 2)
        record_from_activations(x, ms, RecordBuffer.allocate(ms, 4, "cpu"), global_scale=1.0)
    with pytest.raises(ShapeError, match="code bytes"):
        record_from_activations(x, site("nvfp4", 4, bits=2), out)
    packed = torch.zeros(3, 32, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="global_scale"):
        record_from_codes(packed, torch.zeros(3, 4, dtype=torch.uint8), s, out)
    with pytest.raises(ConfigError, match="scale_layout"):
        record_from_codes(packed, torch.zeros(3, 4, dtype=torch.uint8), s, out, global_scale=1.0, scale_layout="x")
    with pytest.raises(ShapeError, match="swizzled"):
        record_from_codes(
            packed, torch.zeros(3, 4, dtype=torch.uint8), s, out, global_scale=1.0, scale_layout="swizzled128x4"
        )
    with pytest.raises(ConfigError, match="RecordBuffer"):
        record_from_activations(x, s, object())  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match="pages"):
        k, ks = kv_cache(2, 4, 2, 32, NVFP4, gen)
        record_kv_pages(k, ks, torch.tensor([0, 1], dtype=torch.int32), 9, site("nvfp4", 4), out, global_scale=1.0)
    with pytest.raises(DTypeError, match="page_table"):
        record_kv_pages(k, ks, torch.tensor([0.0, 1.0]), 2, site("nvfp4", 4), out, global_scale=1.0)


# ------------------------------------------------------------- the decode-side g rule (numerics §3)

# A decode-side g that is not a positive finite float32 is stored as 1.0, the g the trainer uses
# (docs/numerics.md §3); a positive subnormal g is a positive finite number and is kept bit for bit.
BAD_G = {
    "zero": 0.0,
    "neg-zero": -0.0,
    "inf": float("inf"),
    "neg-inf": float("-inf"),
    "nan": float("nan"),
    "negative": -0.5,
    "neg-max": -3.0e38,
}
SUBNORMAL_G = 2.0**-140  # a float32 subnormal: 1/g overflows to inf
ROW_G = [*BAD_G.values(), 0.75, SUBNORMAL_G]  # one g per row, bad and good mixed
ROW_G_STORED = [1.0] * len(BAD_G) + [0.75, SUBNORMAL_G]


def g_forms(g, n, device="cpu"):
    """``global_scale`` arguments that all carry the value ``g``: a float, a one-element float32 tensor,
    and one value per row (``n`` rows)."""
    return {
        "float": g,
        "tensor": torch.tensor([g], dtype=torch.float32, device=device),
        "per-row": torch.full((n,), g, dtype=torch.float32, device=device),
    }


def assert_g_stored(out, lo, want):
    got = out.global_scale[lo : lo + len(want)].cpu()
    assert_bits_equal(got, torch.tensor(want, dtype=torch.float32), "global_scale")


@pytest.mark.parametrize("form", ["float", "tensor", "per-row"])
@pytest.mark.parametrize("g", BAD_G.values(), ids=BAD_G.keys())
def test_cpu_record_from_codes_stores_degenerate_g_as_one(g, form, gen):
    s = site("nvfp4", 3)
    q = quantize(activations(4, s.width, torch.float32, gen), NVFP4, 1.0)
    out = poisoned(s, 6, "cpu")
    record_from_codes(pack_fp4(q.codes), q.scales, s, out, row_offset=1, global_scale=g_forms(g, 4)[form])
    assert_g_stored(out, 1, [1.0] * 4)
    assert_bits_equal(out.codes[1:5], pack_bits(q.codes, 1))


def test_cpu_record_from_codes_per_row_g_mixed(gen):
    s = site("nvfp4", 2)
    n = len(ROW_G)
    q = quantize(activations(n, s.width, torch.float32, gen), NVFP4, 1.0)
    out = poisoned(s, n + 2, "cpu")
    record_from_codes(pack_fp4(q.codes), q.scales, s, out, row_offset=2, global_scale=torch.tensor(ROW_G))
    assert_g_stored(out, 2, ROW_G_STORED)


@pytest.mark.parametrize("g", BAD_G.values(), ids=BAD_G.keys())
def test_cpu_record_kv_pages_stores_degenerate_g_as_one(g, gen):
    heads, hd = 2, 32
    s = SiteSpec("layers.3.attn.k", "key", 3, heads * hd, "nvfp4", 1)
    k, ks = kv_cache(6, 4, heads, hd, NVFP4, gen)
    v, vs = kv_cache(6, 4, heads, hd, NVFP4, gen)
    table = torch.tensor([5, 0, 3, 2], dtype=torch.int32)
    ok, ov = poisoned(s, 12, "cpu"), poisoned(s, 12, "cpu")
    gs = (g, torch.tensor([g], dtype=torch.float32))
    record_kv_pages((k, v), (ks, vs), table, 11, s, (ok, ov), token_start=2, row_offset=1, global_scale=gs)
    assert_g_stored(ok, 1, [1.0] * 11)
    assert_g_stored(ov, 1, [1.0] * 11)
    # one g per token
    ow = poisoned(s, 12, "cpu")
    record_kv_pages(k, ks, table, len(ROW_G), s, ow, token_start=2, row_offset=1, global_scale=torch.tensor(ROW_G))
    assert_g_stored(ow, 1, ROW_G_STORED)


@pytest.mark.parametrize("form", ["float", "tensor", "per-row"])
@pytest.mark.parametrize("g", BAD_G.values(), ids=BAD_G.keys())
def test_cpu_record_from_activations_degenerate_g_is_one(g, form, gen):
    """The rows are quantized with g = 1 and store g = 1."""
    s = site("nvfp4", 3)
    x = activations(4, s.width, torch.bfloat16, gen)
    out = poisoned(s, 6, "cpu")
    record_from_activations(x, s, out, row_offset=1, global_scale=g_forms(g, 4)[form])
    check_rows(out, 1, x, s, 1.0)


def test_cpu_record_from_activations_per_row_g_mixed(gen):
    s = site("nvfp4", 2)
    n = len(ROW_G)
    x = activations(n, s.width, torch.float32, gen)
    out = poisoned(s, n + 1, "cpu")
    record_from_activations(x, s, out, row_offset=1, global_scale=torch.tensor(ROW_G))
    for i, g in enumerate(ROW_G_STORED):
        check_rows(out, 1 + i, x[i : i + 1], s, g)


def test_cpu_subnormal_g_is_kept(gen):
    """A positive subnormal g is used as given (docs/numerics.md §3): 1/g overflows to inf, so a
    nonzero block saturates at scale byte 0x7E with codes ±6 and an all-zero block gets scale byte
    0x7F (0·inf is NaN), which readers treat as a block without a record (§8)."""
    s = site("nvfp4", 2)
    x = torch.zeros(1, s.width)
    x[0, 16:] = torch.linspace(-1, 1, 16)
    x[0, 24] = 0.0
    out = poisoned(s, 1, "cpu")
    record_from_activations(x, s, out, global_scale=SUBNORMAL_G)
    assert_g_stored(out, 0, [SUBNORMAL_G])
    assert out.scales[0].tolist() == [0x7F, 0x7E]
    codes = quantize(x, NVFP4, SUBNORMAL_G).codes[0]
    assert codes[:16].eq(7).all() and codes[16:].tolist() == [15] * 8 + [0] + [7] * 7


# ------------------------------------------------------------------------------------------- GPU

SHAPES = [(1, 1), (7, 13), (129, 31), (300, 128)]  # (rows, blocks): one row, primes, 128+1 rows


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, dtype, bits", list(itertools.product(FORMATS, DTYPES, [1, 2, 3, 4])))
def test_gpu_record_from_activations_exact(fmt, dtype, bits, gen):
    for n, blocks in SHAPES:
        s = site(fmt, blocks, bits)
        x = activations(n, s.width, dtype, gen, "cuda")
        out = poisoned(s, n + 5, "cuda")
        if fmt == "nvfp4":
            g = torch.tensor([0.0137], device="cuda")
            record_from_activations(x, s, out, row_offset=3, global_scale=g)
            check_rows(out, 3, x, s, g.cpu())
            record_from_activations(x, s, out, row_offset=2)  # g from the device amax
            check_rows(out, 2, x, s, None)
        else:
            record_from_activations(x, s, out, row_offset=3)
            check_rows(out, 3, x, s, None)
        check_untouched(out, 2, n + 3)


@pytest.fixture
def record_variant(request):
    """Run a test with record_act's per-element formulation ``request.param`` (kernels/_source.py, V)."""
    old = KR.RECORD_VARIANT
    KR.RECORD_VARIANT = request.param
    yield request.param
    KR.RECORD_VARIANT = old


@pytest.mark.gpu
@pytest.mark.parametrize("record_variant", KR.RECORD_VARIANTS, indirect=True)
@pytest.mark.parametrize("fmt, dtype, bits", list(itertools.product(FORMATS, DTYPES, [1, 3])))
def test_gpu_record_variants_exact(record_variant, fmt, dtype, bits, gen):
    """Every per-element formulation bench_kernels compares is bit-exact on the awkward shapes, with
    and without the paired stores (an odd row offset breaks their alignment)."""
    for n, blocks in SHAPES:
        s = site(fmt, blocks, bits)
        x = activations(n, s.width, dtype, gen, "cuda")
        for off in (2, 3):
            out = poisoned(s, n + 5, "cuda", with_fp4=False)
            g = torch.tensor([0.0137], device="cuda") if fmt == "nvfp4" else None
            record_from_activations(x, s, out, row_offset=off, global_scale=g)
            check_rows(out, off, x, s, None if g is None else g.cpu())
            check_untouched(out, off, n + off)


def e2m1_tie_values(dtype: torch.dtype) -> torch.Tensor:
    """Every E2M1 codeword and rounding tie (docs/numerics.md §2) and their neighbours 1 and 2 ulps either
    side in ``dtype``, both signs, ±0 and the dtype's smallest subnormals; all |v| <= 6."""
    base = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0]).to(dtype)
    iv = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    bits = base.view(iv)
    near = [bits + k for k in (-2, -1, 1, 2)]
    vals = torch.cat([bits, *near]).view(dtype)
    vals = vals[(vals >= 0) & (vals <= 6)]
    tiny = torch.tensor([1, 2, 3], dtype=iv).view(dtype)  # smallest positive subnormals
    vals = torch.cat([vals, tiny])
    return torch.cat([vals, -vals])


@pytest.mark.gpu
@pytest.mark.parametrize("record_variant", KR.RECORD_VARIANTS, indirect=True)
@pytest.mark.parametrize("fmt, dtype, bits", list(itertools.product(FORMATS, DTYPES, [1, 2, 3, 4])))
def test_gpu_record_e2m1_ties(record_variant, fmt, dtype, bits, gen):
    """Values on every E2M1 tie, codeword and their ulp neighbours: each block holds a 6.0 (at a
    rotating position), so with g = 1 the block's multiplier is exactly 1 (NVFP4: sf = 0x38; MX: 2^0)
    and x lands on the ties themselves, where the per-element rounding decides."""
    blk = FORMATS[fmt].block
    pool = e2m1_tie_values(dtype)
    pool = pool[torch.randperm(pool.numel(), generator=gen)]
    per = blk - 1
    nblk = (pool.numel() + per - 1) // per
    pool = torch.cat([pool, pool[: nblk * per - pool.numel()]])
    blocks = pool.view(nblk, per).float()
    six = torch.full((nblk, 1), 6.0)
    rows = []
    for b in range(nblk):
        k = b % blk
        rows.append(torch.cat([blocks[b, :k], six[b], blocks[b, k:]]))
    x = torch.stack(rows).to(dtype)  # one block per row... then several blocks per row below
    n_blocks_per_row = 7
    pad = (-x.shape[0]) % n_blocks_per_row
    x = torch.cat([x, x[:pad]]).reshape(-1, n_blocks_per_row * blk)
    s = site(fmt, n_blocks_per_row, bits)
    xg = x.cuda()
    g = torch.ones(1, device="cuda") if fmt == "nvfp4" else None
    for with_fp4 in (False, True):  # the engine's FP4 codes too: another per-element path
        out = poisoned(s, x.shape[0], "cuda", with_fp4=with_fp4)
        record_from_activations(xg, s, out, global_scale=g)
        check_rows(out, 0, x, s, None if g is None else g.cpu())
    q = quantize(x, s.fmt, None if g is None else g.cpu().reshape(()))
    if fmt == "nvfp4":
        assert bool((q.scales == 0x38).all()), "the test's blocks must have scale 1.0 (sf 0x38)"
    else:
        assert bool((q.scales == 127).all()), "the test's blocks must have scale 2^0"


def e4m3_edge_amaxes(g: float) -> torch.Tensor:
    """Block amaxes whose float32 product amax·((1/g)·(1/6)) lands on every E4M3 value, every midpoint
    between neighbours (the RNE ties) and one float32 ulp either side, plus saturation and NaN."""
    vals = torch.tensor(sorted({e4m3_value(b) for b in range(0x7F)}), dtype=torch.float64)
    mids = (vals[1:] + vals[:-1]) / 2
    targets = torch.cat([vals, mids, torch.tensor([448.0, 464.0, 500.0, 1e30])]).float()
    targets = torch.cat([targets, torch.nextafter(targets, targets * 2 + 1), torch.nextafter(targets, -targets)])
    s6 = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(g, dtype=torch.float32) * (1.0 / 6.0)
    s6 = s6.float()
    amax = (targets.double() / s6.double()).float()
    for _ in range(3):  # walk amax by ulps until amax·s6 rounds onto the target where one exists
        prod = amax * s6
        amax = torch.where(prod < targets, torch.nextafter(amax, amax * 2 + 1), amax)
        amax = torch.where(amax * s6 > targets, torch.nextafter(amax, -amax), amax)
    return torch.cat([amax[amax > 0], torch.tensor([float("inf"), float("nan")])])


def e4m3_value(byte: int) -> float:
    e, m = (byte >> 3) & 15, byte & 7
    return m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)


@pytest.mark.gpu
@pytest.mark.parametrize("g", [1.0, 0.0137])
def test_gpu_record_scale_byte_edges(g, gen):
    """The scale byte of every E4M3 tie and boundary (the kernel encodes with the hardware cvt and
    reads enc = s_enc/sf from a per-CTA table) against the reference, in fp32 activations."""
    amax = e4m3_edge_amaxes(g)
    n, blocks = amax.numel(), 3
    s = site("nvfp4", blocks, 1)
    x = torch.rand(n, s.width, generator=gen) * 2 - 1
    x = x * amax.nan_to_num(1.0, posinf=1.0)[:, None] * 0.99
    x[:, 5] = amax  # the block's amax (block 0); the other blocks hold smaller values
    x[:, 16 + 7] = -amax
    x = x.cuda()
    out = poisoned(s, n, "cuda")
    gt = torch.tensor([g], device="cuda")
    record_from_activations(x, s, out, global_scale=gt)
    check_rows(out, 0, x, s, gt.cpu())


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_record_large_exact(fmt, gen):
    """65536 × 2048 bf16: every row compared with the reference run on the GPU, 64 rows on the CPU."""
    s = site(fmt, 2048 // FORMATS[fmt].block, 1)
    x = (torch.randn(65536, 2048, device="cuda") * 2).to(torch.bfloat16)
    out = poisoned(s, 65536, "cuda", with_fp4=False)
    g = torch.tensor([0.0021], device="cuda") if fmt == "nvfp4" else None
    record_from_activations(x, s, out, global_scale=g)
    q = quantize(x, s.fmt, None if g is None else g.reshape(()))
    assert_bits_equal(out.codes, pack_bits(q.codes, 1), "codes (GPU reference)")
    assert_bits_equal(out.scales, q.scales, "scales (GPU reference)")
    idx = torch.randint(0, 65536, (64,), generator=gen)
    check_rows(
        RecordBuffer(out.codes[idx], out.scales[idx], out.global_scale[idx]),
        0,
        x[idx],
        s,
        None if g is None else g.cpu(),
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fmt, bits, layout", list(itertools.product(FORMATS, [1, 2, 3, 4], ["rowmajor", "swizzled128x4"]))
)
def test_gpu_record_from_codes_exact(fmt, bits, layout, gen):
    for n, blocks in SHAPES:
        s = site(fmt, blocks, bits)
        codes = torch.randint(0, 16, (n, s.width), generator=gen, dtype=torch.uint8)
        scales = torch.randint(0, 256, (n, blocks), generator=gen, dtype=torch.uint8)
        sc = swizzle_scales(scales, fill=0x55) if layout != "rowmajor" else scales
        out = poisoned(s, n + 4, "cuda")
        g = torch.tensor([0.75], device="cuda") if fmt == "nvfp4" else None
        record_from_codes(pack_fp4(codes).cuda(), sc.cuda(), s, out, row_offset=4, scale_layout=layout, global_scale=g)
        assert_bits_equal(out.codes[4:], pack_bits(codes, bits).cuda(), f"codes {n}x{blocks}")
        assert_bits_equal(out.scales[4:], scales.cuda(), f"scales {n}x{blocks}")
        assert bool((out.global_scale[4:] == (0.75 if g is not None else 1.0)).all())
        check_untouched(out, 4, n + 4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fmt, bits, pt_dtype", [("nvfp4", 1, torch.int32), ("nvfp4", 4, torch.int64), ("mxfp4", 2, torch.int32)]
)
def test_gpu_record_kv_pages_exact(fmt, bits, pt_dtype, gen):
    f = FORMATS[fmt]
    heads, hd = 8, 64 if fmt == "nvfp4" else 128
    s = SiteSpec("layers.3.attn.k", "key", 3, heads * hd, fmt, bits)
    k, ks = kv_cache(40, 16, heads, hd, f, gen, "cuda")
    v, vs = kv_cache(40, 16, heads, hd, f, gen, "cuda")
    table = torch.randperm(40, generator=gen)[:20].to(pt_dtype)
    ok, ov = poisoned(s, 400, "cuda"), poisoned(s, 400, "cuda")
    g = (torch.tensor([0.5], device="cuda"), 0.25) if fmt == "nvfp4" else None
    record_kv_pages((k, v), (ks, vs), table.cuda(), 301, s, (ok, ov), token_start=13, row_offset=7, global_scale=g)
    for pool, sc, out in ((k, ks, ok), (v, vs, ov)):
        c, sx = kv_expected(pool.cpu(), sc.cpu(), table, 13, 301, bits)
        assert_bits_equal(out.codes[7:308], c.cuda())
        assert_bits_equal(out.scales[7:308], sx.cuda())
    if g is not None:
        assert bool((ok.global_scale[7:308] == 0.5).all()) and bool((ov.global_scale[7:308] == 0.25).all())


@pytest.mark.gpu
@pytest.mark.parametrize("record_variant", KR.RECORD_VARIANTS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_record_from_activations_degenerate_g(record_variant, dtype, gen):
    """record_act quantizes with and stores the g of docs/numerics.md §3, like the CPU path: each
    degenerate g as a float, one-element tensor and per-row tensor, and one g per row mixing
    degenerate, normal and subnormal values; every row bit for bit against the CPU launcher."""
    s = site("nvfp4", 13)
    n = len(ROW_G)
    x = activations(n, s.width, dtype, gen)
    cases = [(f"{k} {form}", v) for k, g in BAD_G.items() for form, v in g_forms(g, n).items()]
    cases += [("subnormal", SUBNORMAL_G), ("mixed per-row", torch.tensor(ROW_G))]
    for what, g in cases:
        want, got = poisoned(s, n + 3, "cpu"), poisoned(s, n + 3, "cuda")
        record_from_activations(x, s, want, row_offset=3, global_scale=g)
        gd = g.cuda() if isinstance(g, torch.Tensor) else g
        record_from_activations(x.cuda(), s, got, row_offset=3, global_scale=gd)
        for name in ("codes", "scales", "global_scale", "fp4"):
            assert_bits_equal(getattr(got, name).cpu(), getattr(want, name), f"{what}: {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["rowmajor", "swizzled128x4"])
def test_gpu_record_from_codes_degenerate_g(layout, gen):
    """record_codes stores the g of docs/numerics.md §3 (0, negative, non-finite -> 1; subnormal kept),
    like the CPU path, for a float, a one-element tensor and one g per row."""
    for n, blocks in [(len(ROW_G), 2), (len(ROW_G), 13)]:  # paired (even block count) and single blocks
        s = site("nvfp4", blocks, 1)
        codes = torch.randint(0, 16, (n, s.width), generator=gen, dtype=torch.uint8)
        scales = torch.randint(0, 256, (n, blocks), generator=gen, dtype=torch.uint8)
        sc = swizzle_scales(scales, fill=0x55) if layout != "rowmajor" else scales
        cases = [(f"{k} {form}", v) for k, g in BAD_G.items() for form, v in g_forms(g, n).items()]
        cases += [("subnormal", SUBNORMAL_G), ("mixed per-row", torch.tensor(ROW_G))]
        for what, g in cases:
            want, got = poisoned(s, n + 4, "cpu"), poisoned(s, n + 4, "cuda")
            record_from_codes(pack_fp4(codes), sc, s, want, row_offset=4, scale_layout=layout, global_scale=g)
            gd = g.cuda() if isinstance(g, torch.Tensor) else g
            record_from_codes(
                pack_fp4(codes).cuda(), sc.cuda(), s, got, row_offset=4, scale_layout=layout, global_scale=gd
            )
            for name in ("codes", "scales", "global_scale"):
                assert_bits_equal(getattr(got, name).cpu(), getattr(want, name), f"{n}x{blocks} {what}: {name}")
            if what == "mixed per-row":
                assert_g_stored(got, 4, ROW_G_STORED)


@pytest.mark.gpu
def test_gpu_record_kv_pages_degenerate_g(gen):
    """record_kv stores the g of docs/numerics.md §3, like the CPU path."""
    heads, hd = 2, 32
    s = SiteSpec("layers.3.attn.k", "key", 3, heads * hd, "nvfp4", 1)
    k, ks = kv_cache(6, 4, heads, hd, NVFP4, gen)
    table = torch.tensor([5, 0, 3, 2], dtype=torch.int32)
    n = len(ROW_G)
    cases = [(f"{k_} {form}", v) for k_, g in BAD_G.items() for form, v in g_forms(g, n).items()]
    cases += [("subnormal", SUBNORMAL_G), ("mixed per-row", torch.tensor(ROW_G))]
    for what, g in cases:
        want, got = poisoned(s, n + 1, "cpu"), poisoned(s, n + 1, "cuda")
        record_kv_pages(k, ks, table, n, s, want, token_start=2, row_offset=1, global_scale=g)
        gd = g.cuda() if isinstance(g, torch.Tensor) else g
        record_kv_pages(k.cuda(), ks.cuda(), table.cuda(), n, s, got, token_start=2, row_offset=1, global_scale=gd)
        for name in ("codes", "scales", "global_scale"):
            assert_bits_equal(getattr(got, name).cpu(), getattr(want, name), f"{what}: {name}")


@pytest.mark.gpu
def test_gpu_compute_global_scale(gen):
    for dtype in DTYPES:
        x = activations(33, 256, dtype, gen, "cuda")[3:]
        g = compute_global_scale(x, torch.zeros(1, device="cuda"))
        assert_bits_equal(g.reshape(()).cpu(), resolve_global_scale(x.cpu(), None), str(dtype))
    for bad in (torch.zeros(4, 32, device="cuda"), torch.full((4, 32), float("nan"), device="cuda")):
        assert float(compute_global_scale(bad, torch.zeros(1, device="cuda"))) == 1.0


@pytest.mark.gpu
def test_gpu_record_in_cuda_graph(gen):
    """Two forwards of different sizes share one slab; the graph is replayed on new activations and
    a new global scale, and every row equals the reference."""
    s = site("nvfp4", 128, 1)
    ms = site("mxfp4", 64, 2)
    xa = torch.zeros(256, s.width, dtype=torch.bfloat16, device="cuda")
    xb = torch.zeros(64, s.width, dtype=torch.bfloat16, device="cuda")
    g = torch.ones(1, device="cuda")
    codes_in = torch.zeros(129, s.width // 2, dtype=torch.uint8, device="cuda")
    swz_in = torch.zeros(
        swizzle_scales(torch.zeros(129, 128, dtype=torch.uint8)).numel(), dtype=torch.uint8, device="cuda"
    )
    slab = poisoned(s, 1024, "cuda")
    mslab = poisoned(ms, 512, "cuda")
    cslab = poisoned(s, 256, "cuda")

    def step():
        record_from_activations(xa, s, slab, row_offset=0, global_scale=g)
        record_from_activations(xb, s, slab, row_offset=256)  # g from this tensor's amax, on the device
        record_from_activations(xa, ms, mslab, row_offset=100)
        record_from_codes(codes_in, swz_in, s, cslab, row_offset=5, scale_layout="swizzled128x4", global_scale=g)

    graph = capture_graph(step)  # (one warm-up call compiles and loads every kernel first)
    for trial in range(2):
        xa.copy_(activations(256, s.width, torch.bfloat16, gen, "cuda"))
        xb.copy_((torch.randn(64, s.width, generator=gen) * (trial + 1)).to(torch.bfloat16).cuda())
        g.fill_(0.01 * (trial + 1))
        codes = torch.randint(0, 16, (129, s.width), generator=gen, dtype=torch.uint8)
        scales = torch.randint(0, 256, (129, 128), generator=gen, dtype=torch.uint8)
        codes_in.copy_(pack_fp4(codes).cuda())
        swz_in.copy_(swizzle_scales(scales).cuda())
        graph.replay()
        torch.cuda.synchronize()
        check_rows(slab, 0, xa, s, g.cpu())
        check_rows(slab, 256, xb, s, None)
        check_rows(mslab, 100, xa, ms, None)
        assert_bits_equal(cslab.codes[5:134], pack_bits(codes, 1).cuda())
        assert_bits_equal(cslab.scales[5:134], scales.cuda())
        check_untouched(slab, 0, 320)
