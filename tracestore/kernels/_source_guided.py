"""CUDA C source, third part of ``_source.SOURCE``: the training-side kernels ``guided.py`` launches.

``guided_b1`` (b = 1, rule "bracket": a Newton-step quotient and ``guided_b1_mag``, G blocks per
thread) and ``guided_fwd`` (every b and rule by the table of ``_lut.py``, and RTN fake-quant as
MODE 1), with ``rtn_block`` (the RTN fallback) and the per-block helpers. Builds on
``_source_common.py`` and on ``fast_div`` from ``_source_record.py``, both earlier in the
translation unit.
"""

from __future__ import annotations

GUIDED = r"""
/* ---------------------------------------------------------------- training side */

/* docs/numerics.md §8: RTN fake-quant of one block with the training side's own block scale and the
   (sane) record g — the fallback for rows without a record and blocks with a NaN scale byte. */
template <int FMT, int BLK>
__device__ __forceinline__ void rtn_block(const float* v, float gr, float* out) {
    float gf = FMT == F_NVFP4 ? sane_g(gr) : 1.f;
    float mul, sv;
    block_scale<FMT, BLK>(v, gf, &mul, &sv);
#pragma unroll
    for (int i = 0; i < BLK; ++i) {
        float val = rtn_value(__fmul_rn(v[i], mul));
        out[i] = FMT == F_NVFP4 ? __fmul_rn(__fmul_rn(val, sv), gf) : __fmul_rn(val, sv);
    }
}

/* y = (±m·sf)·g[·ts] for a decided magnitude m, the reference's evaluation order (§7). */
template <int TS>
__device__ __forceinline__ float guided_value(float m, u32 sig, float sfv, float gr, float tsv) {
    float y = __fmul_rn(__fmul_rn(__uint_as_float(__float_as_uint(m) | sig), sfv), gr);
    return TS ? __fmul_rn(y, tsv) : y;
}

/* TRACE guided rounding of one block, b = 1, rule "bracket" (the paper's configuration).

   Fast path — s in [2^-20, 2^20] and every |x| in [2^-100, inf): z = x/s by one Newton step from
   the block's correctly rounded reciprocal r: q0 = x·r, z = q0 + (x − q0·s)·r with the residual
   exact in an FMA. By Markstein's theorem (IBM J. Res. Dev. 34(1), 1990; Muller et al., Handbook
   of Floating-Point Arithmetic, ch. on division: r within ½ulp of 1/s and q0 within 1 ulp of x/s
   give RN(q0 + (x − q0·s)·r) = RN(x/s)) that is the correctly rounded quotient whenever nothing
   under- or overflows, which those bounds guarantee (z >= 2^-120 is normal, the residual's last
   bit is >= 2^-147); a huge |x| overflows to z = ±inf or NaN, and min(NaN, 6) = 6 saturates as
   the reference does. s > 0, so the output sign is x's. Blocks with a zero, tiny, infinite or NaN
   element, or s outside the range, take the exact path: __fdiv_rn per element.
   The decision is guided_b1_mag: two directed adds and a few integer ops, no table. */
template <int DT, int FMT, int TS>
__device__ __forceinline__ void guided_b1_block(const float* v, u32 sb, u32 cw, bool ok, float gr, float tsv,
                                                float* out) {
    const int BLK = FMT == F_NVFP4 ? 16 : 32;
    float sfv = FMT == F_NVFP4 ? e4m3_decode(sb) : e8m0_decode(sb);
    if (!ok || sfv != sfv) {
        rtn_block<FMT, BLK>(v, gr, out);
        return;
    }
    float s = __fmul_rn(sfv, gr);
    if (TS) s = __fmul_rn(s, tsv);
    bool fast = s >= 9.5367431640625e-07f && s <= 1048576.f;   /* 2^-20 .. 2^20 (NaN: no) */
    if (fast) {
        const float r = __frcp_rn(s);
        bool bad = false;
#pragma unroll
        for (int i = 0; i < BLK; ++i) {
            float xf = v[i];
            u32 xb = __float_as_uint(xf);
            bad |= xb * 2u - 0x1B000000u >= 0xE4000000u;   /* |x| outside [2^-100, inf): 0, tiny, inf, NaN */
            float q0 = __fmul_rn(xf, r);
            float z = __fmaf_rn(__fmaf_rn(-q0, s, xf), r, q0);
            out[i] = guided_value<TS>(guided_b1_mag(fabsf(z), cw >> i), xb & 0x80000000u, sfv, gr, tsv);
        }
        fast = !bad;
    }
    if (!fast) {
        const bool szero = s == 0.f;
#pragma unroll
        for (int i = 0; i < BLK; ++i) {
            float xf = v[i];
            float z = __fdiv_rn(xf, s);
            u32 sig = (z == z) ? (__float_as_uint(z) & 0x80000000u) : 0u;   /* NaN z -> code 7 (+6) */
            float yv = guided_value<TS>(guided_b1_mag(fabsf(z), cw >> i), sig, sfv, gr, tsv);
            if (szero) yv = __uint_as_float(__float_as_uint(xf) & 0x80000000u);
            out[i] = xf != xf ? xf : yv;
        }
    }
}

/* G consecutive blocks of one row per thread (loads first); ng = nb / G. */
template <int DT, int FMT, int TS, int G>
__global__ void guided_b1(const u8* __restrict__ x, i64 x_stride, u32 n_rows, u32 ng, u32 div_m, u32 div_sh,
                          const u8* __restrict__ codes, i64 c_stride, const u8* __restrict__ scales, i64 s_stride,
                          const float* __restrict__ g, int g_per_row, const float* __restrict__ ts,
                          const u8* __restrict__ valid, const i64* __restrict__ rows, const u8* __restrict__ mask,
                          u8* __restrict__ y, i64 y_stride) {
    const int BLK = FMT == F_NVFP4 ? 16 : 32;
    const int ESZ = DT == DT_F32 ? 4 : 2;
    u32 idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_rows * ng) return;
    u32 row = fast_div(idx, div_m, div_sh), blk0 = (idx - row * ng) * G;
    float v[G][BLK];
#pragma unroll
    for (int gi = 0; gi < G; ++gi)
        load_block<DT, BLK>(x + (i64)row * x_stride + (i64)(blk0 + gi) * (BLK * ESZ), v[gi]);
    i64 grow = rows ? rows[row] : (i64)row;
    u32 sb[G], cw[G];
#pragma unroll
    for (int gi = 0; gi < G; ++gi) {
        sb[gi] = scales[grow * s_stride + blk0 + gi];
        const u8* cp = codes + grow * c_stride + (i64)(blk0 + gi) * (BLK / 8);
        cw[gi] = BLK == 16 ? (u32)*reinterpret_cast<const u16*>(cp) : *reinterpret_cast<const u32*>(cp);
    }
    float gr = FMT == F_NVFP4 ? sane_g(g[g_per_row ? grow : 0]) : 1.f;   /* docs/numerics.md §3 */
    float tsv = TS ? ts[grow] : 1.f;
    bool ok = (!valid || valid[grow]) && (!mask || mask[row]);
#pragma unroll
    for (int gi = 0; gi < G; ++gi) {
        float out[BLK];
        guided_b1_block<DT, FMT, TS>(v[gi], sb[gi], cw[gi], ok, gr, tsv, out);
        store_block<DT, BLK>(y + (i64)row * y_stride + (i64)(blk0 + gi) * (BLK * ESZ), out);
    }
}

/* TRACE guided rounding (docs/numerics.md §7) for every b and rule, and RTN fake-quant (MODE 1), one
   thread per block.

   z = x / s exactly as the reference rounds it, without a division per element: a per-block
   reciprocal r, q0 = x·r and one Newton step with the exact FMA residual e = x − q0·s give z
   within an ulp; every §7 decision changes only at multiples of 0.25, so where 4|z| is more than
   2^-18 from an integer the rounding of z cannot matter, and elsewhere (or for blocks whose s is
   outside [2^-100, 2^100]) the correctly rounded __fdiv_rn is used.
   Decision: a table lookup: region 2*floor(4|z|) + (4|z| not an integer) = floor + ceil,
   clamped at 48 (|z| >= 6), indexed by the recorded bits (b = 4: relative to z's sign); the table
   comes from the torch reference (kernels/_lut.py). No conversion instructions per element. */
template <int DT, int FMT, int BITS, int MODE>
__global__ void guided_fwd(const u8* __restrict__ x, i64 x_stride, u32 n_rows, u32 nb,
                           const u8* __restrict__ codes, i64 c_stride, const u8* __restrict__ scales, i64 s_stride,
                           const float* __restrict__ g, int g_per_row, const float* __restrict__ ts,
                           const u8* __restrict__ valid, const i64* __restrict__ rows, const u8* __restrict__ mask,
                           const float* __restrict__ lut, u8* __restrict__ y, i64 y_stride) {
    const int BLK = FMT == F_NVFP4 ? 16 : 32;
    const int ESZ = DT == DT_F32 ? 4 : 2;
    const int NC = BITS == 4 ? 16 : (1 << BITS);
    const bool USE_LUT = MODE == 0;
    __shared__ float slut[USE_LUT ? NC * LUT_REGIONS : 1];
    if (USE_LUT)
        for (int i = threadIdx.x; i < NC * LUT_REGIONS; i += blockDim.x) slut[i] = lut[i];
    __syncthreads();
    u32 idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_rows * nb) return;
    u32 row = idx / nb, blk = idx - row * nb;
    float v[BLK], out[BLK];
    load_block<DT, BLK>(x + (i64)row * x_stride + (i64)blk * (BLK * ESZ), v);
    i64 grow = rows ? rows[row] : (i64)row;
    float gr = FMT == F_NVFP4 ? sane_g(g[g_per_row ? grow : 0]) : 1.f;   /* docs/numerics.md §3 */
    bool fallback = MODE == 1;
    float sfv = 0.f;
    u64 cw0 = 0ull, cw1 = 0ull;
    if (MODE == 0) {
        u32 sb = scales[grow * s_stride + blk];
        sfv = FMT == F_NVFP4 ? e4m3_decode(sb) : e8m0_decode(sb);
        bool ok = (!valid || valid[grow]) && (!mask || mask[row]);
        fallback = !ok || sfv != sfv;
        const u8* cp = codes + grow * c_stride + (i64)blk * (BLK * BITS / 8);
        if (BLK == 16) {
#pragma unroll
            for (int w = 0; w < BITS; ++w) cw0 |= (u64)reinterpret_cast<const u16*>(cp)[w] << (16 * w);
        } else {
#pragma unroll
            for (int w = 0; w < BITS; ++w) {
                u64 wv = reinterpret_cast<const u32*>(cp)[w];
                if (w < 2) cw0 |= wv << (32 * w); else cw1 |= wv << (32 * (w - 2));
            }
        }
    }
    if (!fallback) {
        float s = __fmul_rn(sfv, gr);
        float tsv = ts ? ts[grow] : 1.f;
        if (ts) s = __fmul_rn(s, tsv);
        float as = fabsf(s);
        const bool newton = as >= 7.88860905e-31f && as <= 1.26765060e30f;   /* 2^-100 .. 2^100 */
        const float r = __frcp_rn(s);
        const bool szero = s == 0.f;
        const u32 cmask = BITS == 4 ? 15u : ((1u << BITS) - 1u);
#pragma unroll
        for (int i = 0; i < BLK; ++i) {
            const int pos = i * BITS;
            u64 c64 = pos < 64 ? ((cw0 >> pos) | (pos + BITS > 64 ? (cw1 << (64 - pos)) : 0ull)) : (cw1 >> (pos - 64));
            u32 cbits = (u32)c64 & cmask;
            float xf = v[i];
            float z;
            if (newton) {
                float q0 = __fmul_rn(xf, r);
                z = __fmaf_rn(__fmaf_rn(-q0, s, xf), r, q0);
                float a4 = __fmul_rn(fabsf(z), 4.f);
                float d = __fadd_rn(a4, -__fadd_rn(__fadd_rn(a4, RND_MAGIC), -RND_MAGIC));
                if (!(fabsf(d) > 3.81469727e-06f) && !(a4 > 24.5f)) z = __fdiv_rn(xf, s);   /* near a grid point */
            } else {
                z = __fdiv_rn(xf, s);
            }
            float a = fabsf(z);
            u32 sig = (z == z) ? (__float_as_uint(z) & 0x80000000u) : 0u;   /* NaN z -> code 7 (+6) */
            float q = fminf(__fmul_rn(a, 4.f), 24.f);                       /* NaN -> 24 */
            u32 reg = (__float_as_uint(__fadd_rd(q, FLOOR_MAGIC)) & 63u) +
                      (__float_as_uint(__fadd_ru(q, FLOOR_MAGIC)) & 63u);
            u32 ci = BITS == 4 ? (cbits ^ (sig >> 28)) : cbits;              /* sig >> 28 = 8 when negative */
            float m = slut[ci * LUT_REGIONS + reg];
            float yv = __fmul_rn(__fmul_rn(__uint_as_float(__float_as_uint(m) | sig), sfv), gr);
            if (ts) yv = __fmul_rn(yv, tsv);
            if (szero) yv = __uint_as_float(__float_as_uint(xf) & 0x80000000u);
            if (xf != xf) yv = xf;
            out[i] = yv;
        }
    } else {
        rtn_block<FMT, BLK>(v, gr, out);
    }
    store_block<DT, BLK>(y + (i64)row * y_stride + (i64)blk * (BLK * ESZ), out);
}
"""
