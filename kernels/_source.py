"""CUDA C source of every tracestore kernel (compiled by NVRTC through CuPy, see ``_launch.py``).

Arithmetic follows shared/numerics.md bit for bit: explicit ``__fmul_rn``/``__fdiv_rn`` and
``-fmad=false`` (a fused multiply-add would round once where the reference rounds twice), NaN-
propagating block amax (integer max over |x| bit patterns: every NaN pattern sorts above +inf,
where ``fmaxf`` would drop it, §3), and no CUDA headers (bf16/fp16 conversions are PTX ``cvt``),
so NVRTC needs no include path.

Thread mapping everywhere: one thread per (row, scale block). A bf16 NVFP4 block is 32 bytes of
input (two 16-byte loads) and ``2*b`` bytes of packed bits; consecutive threads touch consecutive
blocks, so a warp reads 1 KiB and writes 64·b bytes contiguously.
"""

from __future__ import annotations

SOURCE = r"""
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define F_NVFP4 0
#define F_MXFLOOR 1
#define F_MXRCEIL 2
#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2
#define ONE_SIXTH __uint_as_float(0x3E2AAAABu)   /* float32(1/6), as the reference's _f32(1.0/6.0) */
#define FLT_MAX_F __uint_as_float(0x7F7FFFFFu)
#define LUT_REGIONS 49

__device__ __forceinline__ float bf16_to_f(u32 h) { return __uint_as_float(h << 16); }
__device__ __forceinline__ float f16_to_f(u16 h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ u16 f_to_bf16(float f) {
    u16 h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ u16 f_to_f16(float f) {
    u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}

/* Load BLK consecutive elements (16-byte aligned) as float32. */
template <int DT, int BLK>
__device__ __forceinline__ void load_block(const u8* __restrict__ p, float* v) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
    if (DT == DT_F32) {
#pragma unroll
        for (int i = 0; i < BLK / 4; ++i) {
            uint4 w = q[i];
            v[4 * i] = __uint_as_float(w.x); v[4 * i + 1] = __uint_as_float(w.y);
            v[4 * i + 2] = __uint_as_float(w.z); v[4 * i + 3] = __uint_as_float(w.w);
        }
    } else {
#pragma unroll
        for (int i = 0; i < BLK / 8; ++i) {
            uint4 w = q[i];
            u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (DT == DT_BF16) {
                    v[8 * i + 2 * j] = bf16_to_f(ws[j] & 0xFFFFu);
                    v[8 * i + 2 * j + 1] = bf16_to_f(ws[j] >> 16);
                } else {
                    v[8 * i + 2 * j] = f16_to_f((u16)(ws[j] & 0xFFFFu));
                    v[8 * i + 2 * j + 1] = f16_to_f((u16)(ws[j] >> 16));
                }
            }
        }
    }
}

template <int DT, int BLK>
__device__ __forceinline__ void store_block(u8* __restrict__ p, const float* v);

/* 1.5·2^23: h + RND_MAGIC rounds h (0 <= h < 2^22) to an integer (RNE) held in the low bits */
#define RND_MAGIC 12582912.f
#define FLOOR_MAGIC 8388608.f  /* 2^23: __fadd_rd / __fadd_ru with it give floor / ceil in the low bits */

/* RTN magnitude code (0..7) of a = |z| without conversion instructions (they run at a quarter of
   the FP32 rate on Hopper; F2I/I2F were the bottleneck of the first version: 0.21 vs 0.13 ms).
   E2M1 spacing is 0.5 on [0,2], 1 on [2,4], 2 on [4,6]: round-half-even of a·2, a, a/2 on those
   ranges lands on the even code at every tie of §2 (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
   3.5->4, 5->4); h is capped so 6 saturates and the magic add stays exact; NaN -> 7. */
__device__ __forceinline__ u32 rtn_mag(float a) {
    float mult = a < 2.f ? 2.f : (a < 4.f ? 1.f : 0.5f);
    float cap = a < 4.f ? 4.f : 3.f;
    u32 off = a < 2.f ? 0u : (a < 4.f ? 2u : 4u);
    float h = fminf(__fmul_rn(a, mult), cap);
    return (__float_as_uint(__fadd_rn(h, RND_MAGIC)) & 7u) + off;
}

/* Only the low bit (b = 1) of the RTN code: off is even, so it is the parity of the rounded h. */
__device__ __forceinline__ u32 rtn_bit0(float a) {
    float mult = a < 2.f ? 2.f : (a < 4.f ? 1.f : 0.5f);
    float cap = a < 4.f ? 4.f : 3.f;
    return __float_as_uint(__fadd_rn(fminf(__fmul_rn(a, mult), cap), RND_MAGIC)) & 1u;
}

/* NaN-propagating running max of |v| (PTX max.NaN, sm_80+): numerics.md §3 wants a NaN amax. */
__device__ __forceinline__ float absmax_nan(float m, float v) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(v)));
    return r;
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}

template <int DT, int BLK>
__device__ __forceinline__ void store_block(u8* __restrict__ p, const float* v) {
    uint4* q = reinterpret_cast<uint4*>(p);
    if (DT == DT_F32) {
#pragma unroll
        for (int i = 0; i < BLK / 4; ++i)
            q[i] = make_uint4(__float_as_uint(v[4 * i]), __float_as_uint(v[4 * i + 1]),
                              __float_as_uint(v[4 * i + 2]), __float_as_uint(v[4 * i + 3]));
    } else {
#pragma unroll
        for (int i = 0; i < BLK / 8; ++i) {
            u32 ws[4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
                ws[j] = DT == DT_BF16 ? pack_bf16x2(v[8 * i + 2 * j], v[8 * i + 2 * j + 1])
                                      : pack_f16x2(v[8 * i + 2 * j], v[8 * i + 2 * j + 1]);
            q[i] = make_uint4(ws[0], ws[1], ws[2], ws[3]);
        }
    }
}

/* float32 -> E4M3 byte for v >= 0 or NaN (a block amax product): RNE, saturate 448 (0x7E), NaN -> 0x7F. */
__device__ __forceinline__ u32 e4m3_encode_pos(float v) {
    if (v != v) return 0x7Fu;
    float a = fminf(v, 448.f);
    if (a < 0.015625f) return (u32)__float2int_rn(__fmul_rn(a, 512.f));   /* subnormal step 2^-9, exact scaling */
    u32 u = __float_as_uint(a);
    int e = (int)(u >> 23) - 127;
    u32 mant = (u & 0x7FFFFFu) | 0x800000u;
    u32 n = mant >> 20, rem = mant & 0xFFFFFu;
    if (rem > 0x80000u || (rem == 0x80000u && (n & 1u))) n += 1u;   /* carry into the next binade is fine */
    return (u32)((e + 7) * 8) + n - 8u;
}

__device__ __forceinline__ float e4m3_decode(u32 b) {
    if ((b & 0x7Fu) == 0x7Fu) return __uint_as_float(0x7FC00000u);
    u32 e = (b >> 3) & 15u, m = b & 7u;
    float v = e == 0u ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -v : v;
}

__device__ __forceinline__ float pow2i(int e) {   /* 2^e for e in [-127, 127], exact */
    return e >= -126 ? __uint_as_float((u32)(e + 127) << 23) : __uint_as_float(0x00400000u);
}

__device__ __forceinline__ float e8m0_decode(u32 b) {
    return b == 0xFFu ? __uint_as_float(0x7FC00000u) : pow2i((int)b - 127);
}

/* numerics.md §4: E8M0 byte from a block amax (>= 0 or NaN). */
__device__ __forceinline__ u32 mx_scale_byte(float amax, int rceil) {
    if (!(amax <= FLT_MAX_F)) return 0xFFu;
    if (amax == 0.f) return 0u;
    int k, e;
    if (!rceil) {
        frexpf(amax, &e);
        k = e - 1 - 2;
    } else {
        float v = __fdiv_rn(amax, 6.f);
        if (v == 0.f) k = -127;
        else { float m = frexpf(v, &e); k = (m == 0.5f) ? e - 1 : e; }
    }
    k = max(-127, min(127, k));
    return (u32)(k + 127);
}

/* Decode-side g as the reference resolves it: 0 or non-finite -> 1 (numerics.md §3). */
__device__ __forceinline__ float sane_g(float g) {
    return (fabsf(g) <= FLT_MAX_F && g != 0.f) ? g : 1.f;
}


/* RTN value m(code)·sign of z = x·mul without conversions: the rounded h over mult is m exactly. */
__device__ __forceinline__ float rtn_value(float z) {
    float a = fabsf(z);
    float mult = a < 2.f ? 2.f : (a < 4.f ? 1.f : 0.5f);
    float inv = a < 2.f ? 0.5f : (a < 4.f ? 1.f : 2.f);
    float cap = a < 4.f ? 4.f : 3.f;
    float r = __fadd_rn(__fadd_rn(fminf(__fmul_rn(a, mult), cap), RND_MAGIC), -RND_MAGIC);
    u32 sig = (z == z) ? (__float_as_uint(z) & 0x80000000u) : 0u;   /* NaN -> code 7 = +6 */
    return __uint_as_float(__float_as_uint(__fmul_rn(r, inv)) | sig);
}

/* Block scale byte and the multiplier mapping x onto the E2M1 grid (NVFP4 enc, MX 2^-k), §3/§4. */
template <int FMT, int BLK>
__device__ __forceinline__ u32 block_scale(const float* v, float g, float* mul, float* scale_value) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < BLK; ++i) amax = absmax_nan(amax, v[i]);
    if (FMT == F_NVFP4) {
        float s_enc = __fdiv_rn(1.f, g);
        u32 sf = e4m3_encode_pos(__fmul_rn(amax, __fmul_rn(s_enc, ONE_SIXTH)));
        float sv = e4m3_decode(sf);
        float enc = __fdiv_rn(s_enc, sv);
        if (enc > FLT_MAX_F) enc = FLT_MAX_F;   /* NaN (a NaN block) stays NaN -> codes 7 */
        *mul = enc;
        *scale_value = sv;
        return sf;
    } else {
        u32 sb = mx_scale_byte(amax, FMT == F_MXRCEIL);
        *mul = sb == 0xFFu ? __uint_as_float(0x7FC00000u) : pow2i(127 - (int)sb);   /* exact power of two */
        *scale_value = e8m0_decode(sb);
        return sb;
    }
}

template <int BLK, int BITS>
__device__ __forceinline__ void store_acc(u8* __restrict__ out, u64 acc0, u64 acc1) {
    if (BLK == 16) {
        u16* o = reinterpret_cast<u16*>(out);
#pragma unroll
        for (int w = 0; w < BITS; ++w) o[w] = (u16)(acc0 >> (16 * w));
    } else {
        u32* o = reinterpret_cast<u32*>(out);
#pragma unroll
        for (int w = 0; w < BITS; ++w) o[w] = (u32)(w < 2 ? (acc0 >> (32 * w)) : (acc1 >> (32 * (w - 2))));
    }
}

/* Pack the low BITS of BLK codes (b=4: the whole code), element i at bit offset i*BITS, LSB first,
   and store the BLK*BITS/8 bytes (2-byte words for NVFP4 blocks, 4-byte words for MX blocks). */
template <int BLK, int BITS>
__device__ __forceinline__ void store_bits(u8* __restrict__ out, const u32* codes) {
    u64 acc0 = 0ull, acc1 = 0ull;
    const u32 mask = BITS == 4 ? 15u : ((1u << BITS) - 1u);
#pragma unroll
    for (int i = 0; i < BLK; ++i) {
        u64 c = (u64)(codes[i] & mask);
        const int pos = i * BITS;
        if (pos < 64) {
            acc0 |= c << pos;
            if (pos + BITS > 64) acc1 |= c >> (64 - pos);
        } else {
            acc1 |= c << (pos - 64);
        }
    }
    if (BLK == 16) {
        u16* o = reinterpret_cast<u16*>(out);
#pragma unroll
        for (int w = 0; w < BITS; ++w) o[w] = (u16)(acc0 >> (16 * w));
    } else {
        u32* o = reinterpret_cast<u32*>(out);
#pragma unroll
        for (int w = 0; w < BITS; ++w) o[w] = (u32)(w < 2 ? (acc0 >> (32 * w)) : (acc1 >> (32 * (w - 2))));
    }
}

/* Engines' packed FP4 (element 2j low nibble) of one block: 8 bytes (NVFP4) or 16 (MX). */
template <int BLK>
__device__ __forceinline__ void store_fp4(u8* __restrict__ out, const u32* codes) {
    u64 w0 = 0ull, w1 = 0ull;
#pragma unroll
    for (int i = 0; i < 16 && i < BLK; ++i) w0 |= (u64)(codes[i] & 15u) << (4 * i);
#pragma unroll
    for (int i = 16; i < BLK; ++i) w1 |= (u64)(codes[i] & 15u) << (4 * (i - 16));
    if (BLK == 16) *reinterpret_cast<u64*>(out) = w0;
    else *reinterpret_cast<uint4*>(out) = make_uint4((u32)w0, (u32)(w0 >> 32), (u32)w1, (u32)(w1 >> 32));
}

/* ---------------------------------------------------------------- rollout side */

/* |x| amax of a contiguous tensor into *amax_bits (pre-zeroed), as uint32 float bits (NaN wins). */
template <int DT>
__global__ void amax_abs(const u8* __restrict__ x, i64 n16 /* 16-byte words */, u32* __restrict__ amax_bits) {
    u32 m = 0u;
    const uint4* q = reinterpret_cast<const uint4*>(x);
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (i64)gridDim.x * blockDim.x) {
        uint4 w = q[i];
        u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (DT == DT_F32) m = max(m, ws[j] & 0x7FFFFFFFu);
            else {
                float a = DT == DT_BF16 ? bf16_to_f(ws[j] & 0xFFFFu) : f16_to_f((u16)(ws[j] & 0xFFFFu));
                float b = DT == DT_BF16 ? bf16_to_f(ws[j] >> 16) : f16_to_f((u16)(ws[j] >> 16));
                m = max(m, max(__float_as_uint(a) & 0x7FFFFFFFu, __float_as_uint(b) & 0x7FFFFFFFu));
            }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if ((threadIdx.x & 31) == 0 && m) atomicMax(amax_bits, m);
}

/* g = amax/2688 in float32, 0 or non-finite -> 1 (numerics.md §3), written over the amax bits. */
__global__ void finalize_g(float* __restrict__ g) {
    float amax = __uint_as_float(*reinterpret_cast<u32*>(g));
    *g = sane_g(__fdiv_rn(amax, 2688.f));
}

template <int DT, int FMT, int BITS, int FP4OUT>
__global__ void record_act(const u8* __restrict__ x, i64 x_stride, u32 n_rows, u32 nb,
                           const float* __restrict__ g_ptr,
                           u8* __restrict__ codes_out, i64 c_stride, u8* __restrict__ scales_out, i64 s_stride,
                           float* __restrict__ g_out, u8* __restrict__ fp4_out, i64 f_stride) {
    const int BLK = FMT == F_NVFP4 ? 16 : 32;
    const int ESZ = DT == DT_F32 ? 4 : 2;
    u32 idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_rows * nb) return;
    u32 row = idx / nb, blk = idx - row * nb;
    float v[BLK];
    load_block<DT, BLK>(x + (i64)row * x_stride + (i64)blk * (BLK * ESZ), v);
    float g = FMT == F_NVFP4 ? sane_g(*g_ptr) : 1.f;
    float mul, sv;
    u32 sf = block_scale<FMT, BLK>(v, g, &mul, &sv);
    const u32 mask = BITS == 4 ? 15u : ((1u << BITS) - 1u);
    u64 acc0 = 0ull, acc1 = 0ull, f0 = 0ull, f1 = 0ull;
#pragma unroll
    for (int i = 0; i < BLK; ++i) {
        float z = __fmul_rn(v[i], mul);
        u32 c;
        if (BITS == 1 && !FP4OUT) c = rtn_bit0(fabsf(z));            /* b = 1: the mantissa bit only */
        else if (BITS < 4 && !FP4OUT) c = rtn_mag(fabsf(z));        /* b <= 3: the sign bit is not kept */
        else c = (z != z) ? 7u : (rtn_mag(fabsf(z)) | ((__float_as_uint(z) >> 31) << 3));
        u64 cb = (u64)(c & mask);
        const int pos = i * BITS;
        if (pos < 64) {
            acc0 |= cb << pos;
            if (pos + BITS > 64) acc1 |= cb >> (64 - pos);
        } else {
            acc1 |= cb << (pos - 64);
        }
        if (FP4OUT) {
            if (i < 16) f0 |= (u64)c << (4 * i); else f1 |= (u64)c << (4 * (i - 16));
        }
    }
    store_acc<BLK, BITS>(codes_out + (i64)row * c_stride + (i64)blk * (BLK * BITS / 8), acc0, acc1);
    scales_out[(i64)row * s_stride + blk] = (u8)sf;
    if (FP4OUT) {
        u8* fo = fp4_out + (i64)row * f_stride + (i64)blk * (BLK / 2);
        if (BLK == 16) *reinterpret_cast<u64*>(fo) = f0;
        else *reinterpret_cast<uint4*>(fo) = make_uint4((u32)f0, (u32)(f0 >> 32), (u32)f1, (u32)(f1 >> 32));
    }
    if (blk == 0 && g_out) g_out[row] = g;
}

__device__ __forceinline__ i64 swizzled_offset(u32 r, u32 c, u32 cols_padded) {
    /* numerics.md §5 */
    return ((i64)(r >> 7) * (cols_padded >> 2) + (c >> 2)) * 512 + (r & 31u) * 16 + ((r & 127u) >> 5) * 4 + (c & 3u);
}

/* Unpack BLK codes from BLK/2 packed bytes (8 or 16, aligned). */
template <int BLK>
__device__ __forceinline__ void load_fp4(const u8* __restrict__ p, u32* codes) {
    u64 w0, w1 = 0ull;
    if (BLK == 16) w0 = *reinterpret_cast<const u64*>(p);
    else {
        uint4 q = *reinterpret_cast<const uint4*>(p);
        w0 = (u64)q.x | ((u64)q.y << 32); w1 = (u64)q.z | ((u64)q.w << 32);
    }
#pragma unroll
    for (int i = 0; i < 16 && i < BLK; ++i) codes[i] = (u32)(w0 >> (4 * i)) & 15u;
#pragma unroll
    for (int i = 16; i < BLK; ++i) codes[i] = (u32)(w1 >> (4 * (i - 16))) & 15u;
}

/* b = 1 of 16 packed codes in a u64 (code i in nibble i): gather bit 0 of every nibble. */
__device__ __forceinline__ u32 nibble_lsbs16(u64 w) {
    w &= 0x1111111111111111ull;
    w = (w | (w >> 3)) & 0x0303030303030303ull;
    w = (w | (w >> 6)) & 0x000F000F000F000Full;
    w = (w | (w >> 12)) & 0x000000FF000000FFull;
    return (u32)((w | (w >> 24)) & 0xFFFFull);
}

/* G consecutive blocks per thread (G = 2 for NVFP4 rows with an even block count: 16-byte loads). */
template <int BLK, int BITS, int SWZ, int G>
__global__ void record_codes(const u8* __restrict__ packed, i64 p_stride, const u8* __restrict__ scales, i64 s_stride,
                             u32 n_rows, u32 nb, u8* __restrict__ codes_out, i64 c_stride,
                             u8* __restrict__ scales_out, i64 so_stride, const float* __restrict__ g_ptr,
                             float* __restrict__ g_out) {
    u32 idx = blockIdx.x * blockDim.x + threadIdx.x;
    u32 ng = nb / G;
    if (idx >= n_rows * ng) return;
    u32 row = idx / ng, blk0 = (idx - row * ng) * G;
    const u8* src = packed + (i64)row * p_stride + (i64)blk0 * (BLK / 2);
    u8* dst = codes_out + (i64)row * c_stride + (i64)blk0 * (BLK * BITS / 8);
    if (BLK == 16 && G == 2 && BITS == 1) {
        uint4 q = *reinterpret_cast<const uint4*>(src);
        u32 lo = nibble_lsbs16((u64)q.x | ((u64)q.y << 32)), hi = nibble_lsbs16((u64)q.z | ((u64)q.w << 32));
        *reinterpret_cast<u32*>(dst) = lo | (hi << 16);
    } else if (BITS == 4) {   /* b = 4 keeps whole codes: the packed bytes themselves */
#pragma unroll
        for (int gi = 0; gi < G; ++gi) {
            if (BLK == 16) reinterpret_cast<u64*>(dst)[gi] = reinterpret_cast<const u64*>(src)[gi];
            else reinterpret_cast<uint4*>(dst)[gi] = reinterpret_cast<const uint4*>(src)[gi];
        }
    } else {
#pragma unroll
        for (int gi = 0; gi < G; ++gi) {
            u32 codes[BLK];
            load_fp4<BLK>(src + gi * (BLK / 2), codes);
            store_bits<BLK, BITS>(dst + gi * (BLK * BITS / 8), codes);
        }
    }
#pragma unroll
    for (int gi = 0; gi < G; ++gi) {
        u32 c = blk0 + gi;
        /* s_stride is the padded column count for a swizzled buffer */
        u8 sb = SWZ ? scales[swizzled_offset(row, c, (u32)s_stride)] : scales[(i64)row * s_stride + c];
        scales_out[(i64)row * so_stride + c] = sb;
    }
    if (blk0 == 0 && g_out) g_out[row] = g_ptr ? *g_ptr : 1.f;
}

/* One request's tokens from a paged FP4 cache: pool [pages, page_size, row bytes] (any strides
   for the first two dims), scales [pages, page_size, nb]. page_table int32 or int64. */
template <int BLK, int BITS>
__global__ void record_kv(const u8* __restrict__ pool, i64 pool_page, i64 pool_slot,
                          const u8* __restrict__ spool, i64 spool_page, i64 spool_slot,
                          const void* __restrict__ page_table, int pt64, u32 page_size, u32 token_start,
                          u32 n_tokens, u32 nb, u8* __restrict__ codes_out, i64 c_stride,
                          u8* __restrict__ scales_out, i64 so_stride, const float* __restrict__ g_ptr,
                          float* __restrict__ g_out) {
    u32 idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_tokens * nb) return;
    u32 t = idx / nb, blk = idx - t * nb;
    u32 pos = token_start + t;
    i64 page = pt64 ? reinterpret_cast<const i64*>(page_table)[pos / page_size]
                    : (i64)reinterpret_cast<const int*>(page_table)[pos / page_size];
    u32 slot = pos % page_size;
    u32 codes[BLK];
    load_fp4<BLK>(pool + page * pool_page + (i64)slot * pool_slot + (i64)blk * (BLK / 2), codes);
    store_bits<BLK, BITS>(codes_out + (i64)t * c_stride + (i64)blk * (BLK * BITS / 8), codes);
    scales_out[(i64)t * so_stride + blk] = spool[page * spool_page + (i64)slot * spool_slot + blk];
    if (blk == 0 && g_out) g_out[t] = g_ptr ? *g_ptr : 1.f;
}

/* ---------------------------------------------------------------- training side */

/* TRACE guided rounding (numerics.md §7) and RTN fake-quant (MODE 1), one thread per block.

   z = x / s exactly as the reference rounds it, without a division per element: a per-block
   reciprocal r, q0 = x·r and one Newton step with the exact FMA residual e = x − q0·s give z
   within an ulp; every §7 decision changes only at multiples of 0.25, so where 4|z| is more than
   2^-18 from an integer the rounding of z cannot matter, and elsewhere (or for blocks whose s is
   outside [2^-100, 2^100]) the correctly rounded __fdiv_rn is used.
   Decision: b = 1 with rule "bracket" (ARITH) in arithmetic — the bracket end whose bit 0 equals
   the record — else a table lookup: region 2*floor(4|z|) + (4|z| not an integer) = floor + ceil,
   clamped at 48 (|z| >= 6), indexed by the recorded bits (b = 4: relative to z's sign); the table
   comes from the torch reference (kernels/_lut.py). No conversion instructions per element. */
template <int DT, int FMT, int BITS, int MODE, int ARITH>
__global__ void guided_fwd(const u8* __restrict__ x, i64 x_stride, u32 n_rows, u32 nb,
                           const u8* __restrict__ codes, i64 c_stride, const u8* __restrict__ scales, i64 s_stride,
                           const float* __restrict__ g, int g_per_row, const float* __restrict__ ts,
                           const u8* __restrict__ valid, const i64* __restrict__ rows, const u8* __restrict__ mask,
                           const float* __restrict__ lut, u8* __restrict__ y, i64 y_stride) {
    const int BLK = FMT == F_NVFP4 ? 16 : 32;
    const int ESZ = DT == DT_F32 ? 4 : 2;
    const int NC = BITS == 4 ? 16 : (1 << BITS);
    const bool USE_LUT = MODE == 0 && !ARITH;
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
    float gr = FMT == F_NVFP4 ? g[g_per_row ? grow : 0] : 1.f;
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
            float m;
            if (ARITH) {
                float mult = a < 2.f ? 2.f : (a < 4.f ? 1.f : 0.5f);
                float inv = a < 2.f ? 0.5f : (a < 4.f ? 1.f : 2.f);
                u32 off = a < 2.f ? 0u : (a < 4.f ? 2u : 4u);
                float h = fminf(__fmul_rn(a, mult), 3.5f);
                float fl = __fadd_rd(h, FLOOR_MAGIC), cl = __fadd_ru(h, FLOOR_MAGIC);
                u32 km = (__float_as_uint(fl) & 7u) + off;                 /* k-: the bracket's lower code */
                bool up = (fl != cl) && ((km & 1u) != cbits);               /* off-grid and k- does not match */
                m = __fmul_rn(__fadd_rn(up ? cl : fl, -FLOOR_MAGIC), inv);
                if (!(a < 6.f)) m = 6.f;                                    /* saturate (and NaN) */
            } else {
                float q = fminf(__fmul_rn(a, 4.f), 24.f);                   /* NaN -> 24 */
                u32 reg = (__float_as_uint(__fadd_rd(q, FLOOR_MAGIC)) & 63u) +
                          (__float_as_uint(__fadd_ru(q, FLOOR_MAGIC)) & 63u);
                u32 ci = BITS == 4 ? (cbits ^ (sig >> 28)) : cbits;          /* sig >> 28 = 8 when negative */
                m = slut[ci * LUT_REGIONS + reg];
            }
            float yv = __fmul_rn(__fmul_rn(__uint_as_float(__float_as_uint(m) | sig), sfv), gr);
            if (ts) yv = __fmul_rn(yv, tsv);
            if (szero) yv = __uint_as_float(__float_as_uint(xf) & 0x80000000u);
            if (xf != xf) yv = xf;
            out[i] = yv;
        }
    } else {
        /* numerics.md §8: RTN with the training side's own block scale and the (sane) record g */
        float gf = FMT == F_NVFP4 ? sane_g(gr) : 1.f;
        float mul, sv;
        block_scale<FMT, BLK>(v, gf, &mul, &sv);
#pragma unroll
        for (int i = 0; i < BLK; ++i) {
            float val = rtn_value(__fmul_rn(v[i], mul));
            out[i] = FMT == F_NVFP4 ? __fmul_rn(__fmul_rn(val, sv), gf) : __fmul_rn(val, sv);
        }
    }
    store_block<DT, BLK>(y + (i64)row * y_stride + (i64)blk * (BLK * ESZ), out);
}
"""
