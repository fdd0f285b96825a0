"""CUDA C source, first part of ``_source.SOURCE``: what both kernel families build on.

Typedefs and the format/dtype codes (``F_*``, ``DT_*``), bf16/fp16 conversions by PTX ``cvt``, block
loads and stores, E2M1 rounding by one float32 add (``e2m1_magic``, the RTN code helpers, the b = 1
bracket decision ``guided_b1_mag``), NaN-propagating block amax (``absmax_nan``, ``absmax2``), E4M3
and E8M0 scale encoding and decoding, the block scale of §3/§4, and bit and FP4 packing. Device
functions only: the kernels are in ``_source_record.py`` and ``_source_guided.py``.
"""

from __future__ import annotations

COMMON = r"""
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

/* NW consecutive 32-bit words (16-byte aligned), by 16-byte loads. */
template <int NW>
__device__ __forceinline__ void load_words(const u8* __restrict__ p, u32* w) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < NW / 4; ++i) {
        uint4 t = q[i];
        w[4 * i] = t.x; w[4 * i + 1] = t.y; w[4 * i + 2] = t.z; w[4 * i + 3] = t.w;
    }
}

/* BLK elements held in raw words (element 2j in the low half of word j for 16-bit types) as float32. */
template <int DT, int BLK>
__device__ __forceinline__ void words_to_floats(const u32* w, float* v) {
#pragma unroll
    for (int j = 0; j < (DT == DT_F32 ? BLK : BLK / 2); ++j) {
        if (DT == DT_F32) {
            v[j] = __uint_as_float(w[j]);
        } else if (DT == DT_BF16) {
            v[2 * j] = bf16_to_f(w[j] & 0xFFFFu);
            v[2 * j + 1] = bf16_to_f(w[j] >> 16);
        } else {
            v[2 * j] = f16_to_f((u16)(w[j] & 0xFFFFu));
            v[2 * j + 1] = f16_to_f((u16)(w[j] >> 16));
        }
    }
}

/* Load BLK consecutive elements (16-byte aligned) as float32. */
template <int DT, int BLK>
__device__ __forceinline__ void load_block(const u8* __restrict__ p, float* v) {
    u32 w[DT == DT_F32 ? BLK : BLK / 2];
    load_words<DT == DT_F32 ? BLK : BLK / 2>(p, w);
    words_to_floats<DT, BLK>(w, v);
}

template <int DT, int BLK>
__device__ __forceinline__ void store_block(u8* __restrict__ p, const float* v);

/* 1.5·2^23: h + RND_MAGIC rounds h (0 <= h < 2^22) to an integer (RNE) held in the low bits */
#define RND_MAGIC 12582912.f
#define FLOOR_MAGIC 8388608.f  /* 2^23: __fadd_rd / __fadd_ru with it give floor / ceil in the low bits */

/* E2M1 rounding by one float32 add (no conversion instructions: they issue at a quarter of the
   FP32 rate on Hopper, and compare/select chains load the half-rate integer/logic pipe).
   The E2M1 grid is a float format with one fraction bit, exponents 0..2 and a subnormal step of
   0.5: spacing 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6]. For a6 = min(a, 6) the magic number
   M = 1.5·2^(E+22), E = max(exponent(a6), 0), has exactly that spacing as its ulp, and a6 + M stays
   in M's binade, so one add rounds a6 onto the grid in the add's own rounding mode (RN: ties to
   the even multiple = the even code, docs/numerics.md §2; RD/RU: the bracket ends of §7). The low
   mantissa bits of the sum count multiples n of the spacing, and code = n + 2E, so the parity of
   the sum's last bit is the parity of the code. Verified against the torch reference on 8M values
   including every tie and its neighbouring ulps (and by the GPU tests). */
__device__ __forceinline__ float e2m1_magic(float a6) {
    u32 m = max((__float_as_uint(a6) & 0x7F800000u) | 0x00400000u, 0x3FC00000u);   /* 1.5·2^E, E >= 0 */
    return __uint_as_float(m + (22u << 23));
}

/* RTN magnitude code (0..7) of a = |z| (NaN -> 7: fminf returns the number). */
__device__ __forceinline__ u32 rtn_mag(float a) {
    float a6 = fminf(a, 6.f);
    float M = e2m1_magic(a6);
    u32 t = __float_as_uint(__fadd_rn(a6, M));
    return (t & 7u) + 2u * ((__float_as_uint(M) >> 23) - 149u);
}

/* Only the low bit (b = 1) of the RTN code: the parity of the rounded sum. */
__device__ __forceinline__ u32 rtn_bit0(float a) {
    float a6 = fminf(a, 6.f);
    return __float_as_uint(__fadd_rn(a6, e2m1_magic(a6))) & 1u;
}

/* The same rounded sum with the magic number built on the FP32 pipe: M = 2^E · 1.5·2^22 (an exact
   product: a power of two times a constant), E = max(exponent(a6), 0) taken as max(a6 & exp bits,
   1.0f) on the raw bits. One integer/logic op fewer than e2m1_magic (which needs an AND, an OR, a
   max and an add, each at half the FP32 rate on Hopper: 16 lanes/clk per SM sub-partition). The
   sum's bit 0 is the code's parity, as in rtn_bit0. */
__device__ __forceinline__ u32 magic_sum(float a6) {   /* a6 in [0, 6] */
    float p2 = __uint_as_float(max(__float_as_uint(a6) & 0x7F800000u, 0x3F800000u));
    return __float_as_uint(__fadd_rn(a6, __fmul_rn(p2, 6291456.f)));
}
__device__ __forceinline__ u32 rtn_sum_fmul(float a) { return magic_sum(fminf(a, 6.f)); }

/* The RTN magnitude code (0..7) from that sum t = bits(a6 + M), M = 1.5·2^(E+22): t's low bits
   count the n spacings of a6 and t >> 22 = 2(149 + E) + 1 (n <= 4 never reaches bit 22), so
   code = n + 2E = (t & 7) + (t >> 22) - 299 — one IADD3, where rtn_mag decodes E from M's
   exponent. Checked against a nearest-even E2M1 table on 2M values and every tie ±3 ulps. */
__device__ __forceinline__ u32 rtn_mag_sum(u32 t) { return (t & 7u) + (t >> 22) - 299u; }

/* TRACE's choice for b = 1, rule "bracket" (docs/numerics.md §7): of the bracket ends
   k- <= a <= k+ the one whose code has the recorded low bit; a on a codeword is that codeword
   (then both directed sums agree), a >= 6 saturates. ``bitv``'s bit 0 is the record bit (the
   rest is ignored). Returns the magnitude m. */
__device__ __forceinline__ float guided_b1_mag(float a, u32 bitv) {
    float a6 = fminf(a, 6.f);
    float M = e2m1_magic(a6);
    u32 lo = __float_as_uint(__fadd_rd(a6, M)), hi = __float_as_uint(__fadd_ru(a6, M));
    u32 t = lo + ((lo ^ bitv) & (hi - lo));   /* hi - lo is 1 off the grid, 0 on it */
    return __fadd_rn(__uint_as_float(t), -M);
}

/* NaN-propagating running max of |v| (PTX max.NaN, sm_80+): docs/numerics.md §3 wants a NaN amax. */
__device__ __forceinline__ float absmax_nan(float m, float v) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(v)));
    return r;
}

/* Running |x| amax of two packed 16-bit floats per word, NaN-propagating (max.NaN.xorsign.abs,
   sm_86+): half the max instructions of the float32 loop, exact (a max selects, it does not round).
   The caller takes |.| of the final halves. */
template <int DT>
__device__ __forceinline__ u32 absmax2(u32 m, u32 w) {
#if __CUDA_ARCH__ >= 860
    u32 r;   /* one HMNMX2 with |.| on both inputs; the result's sign bits are the inputs' xor */
    if (DT == DT_BF16) asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(m), "r"(w));
    else asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(r) : "r"(m), "r"(w));
    return r;
#else   /* unsigned max of the magnitude bits: a NaN's bits exceed inf's, so NaN still wins */
    return __vmaxu2(m & 0x7FFF7FFFu, w & 0x7FFF7FFFu);
#endif
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

/* docs/numerics.md §4: E8M0 byte from a block amax (>= 0 or NaN). */
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

/* Decode-side g as the reference resolves it (sane_global_scales): a g that is not a positive finite
   number (0, -0, negative, +-inf, NaN: both comparisons fail) -> 1; positive subnormals are kept
   (docs/numerics.md §3). */
__device__ __forceinline__ float sane_g(float g) {
    return (g > 0.f && g <= FLT_MAX_F) ? g : 1.f;
}


/* RTN value m(code)·sign of z (NaN z -> +6, code 7). */
__device__ __forceinline__ float rtn_value(float z) {
    float a6 = fminf(fabsf(z), 6.f);
    float M = e2m1_magic(a6);
    float m = __fadd_rn(__fadd_rn(a6, M), -M);
    u32 sig = (z == z) ? (__float_as_uint(z) & 0x80000000u) : 0u;
    return __uint_as_float(__float_as_uint(m) | sig);
}

/* Block scale byte and the multiplier mapping x onto the E2M1 grid (NVFP4 enc, MX 2^-k), §3/§4,
   from the block's NaN-propagating amax. */
template <int FMT>
__device__ __forceinline__ u32 block_scale_of(float amax, float g, float* mul, float* scale_value) {
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

template <int BLK>
__device__ __forceinline__ float block_amax(const float* v) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < BLK; ++i) amax = absmax_nan(amax, v[i]);
    return amax;
}

template <int FMT, int BLK>
__device__ __forceinline__ u32 block_scale(const float* v, float g, float* mul, float* scale_value) {
    return block_scale_of<FMT>(block_amax<BLK>(v), g, mul, scale_value);
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
    store_acc<BLK, BITS>(out, acc0, acc1);
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
"""
