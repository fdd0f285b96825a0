"""CUDA C source of every tracestore kernel (compiled by NVRTC through CuPy, see ``_launch.py``).

Arithmetic follows docs/numerics.md bit for bit: explicit ``__fmul_rn``/``__fdiv_rn`` and
``-fmad=false`` (a fused multiply-add would round once where the reference rounds twice), NaN-
propagating block amax (PTX ``max.NaN``, where ``fmaxf`` would drop a NaN, §3), and no CUDA
headers (bf16/fp16 conversions are PTX ``cvt``), so NVRTC needs no include path.

Thread mapping: one thread per (row, scale block), or G consecutive blocks of a row per thread
(``record_act``, ``guided_b1``: all loads issued first; G = 2 measured best for NVFP4 on the H200).
A bf16 NVFP4 block is 32 bytes of input (two 16-byte loads) and ``2*b`` bytes of packed bits;
consecutive threads touch consecutive blocks. These kernels are bound by instruction issue more
than by the access pattern, so the per-element arithmetic avoids conversion instructions and
compare/select chains (see ``e2m1_magic``), and keeps work off the integer/logic pipe, which
issues at half the FP32 rate on Hopper (``rtn_sum_fmul``, ``absmax2``; ``record_block``'s V).
Reading the SASS needs no GPU: ``nvcc -cubin -arch=sm_90 -fmad=false --ftz=false`` over
``SOURCE`` plus an explicit instantiation, then ``cuobjdump -sass`` (Triton's wheel ships one).
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

/* Decode-side g as the reference resolves it: 0 or non-finite -> 1 (docs/numerics.md §3). */
__device__ __forceinline__ float sane_g(float g) {
    return (fabsf(g) <= FLT_MAX_F && g != 0.f) ? g : 1.f;
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

/* g = amax/2688 in float32, 0 or non-finite -> 1 (docs/numerics.md §3), written over the amax bits. */
__global__ void finalize_g(float* __restrict__ g) {
    float amax = __uint_as_float(*reinterpret_cast<u32*>(g));
    *g = sane_g(__fdiv_rn(amax, 2688.f));
}

/* row = idx / d without a division instruction (Granlund & Montgomery, PLDI 1994, round-up
   multiplier): for idx < 2^31, m = floor(2^(31+l)/d) + 1 with l = ceil(log2 d) fits 32 bits and
   row = umulhi(idx, m) >> (l - 1). The host computes (m, sh) (kernels/_launch.py fastdiv); m = 0
   means d = 1. A hardware-free u32 division costs ~20 instructions, conversions among them. */
__device__ __forceinline__ u32 fast_div(u32 idx, u32 m, u32 sh) {
    return m ? (__umulhi(idx, m) >> sh) : idx;
}

/* float32 -> E4M3 byte for v >= 0 or NaN in one instruction (sm_89+: RNE into subnormals,
   saturation to 448 = 0x7E, NaN -> 0x7F with the sign dropped), the same as e4m3_encode_pos. */
__device__ __forceinline__ u32 e4m3_cvt(float v) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.f), "f"(v));
    return (u32)r & 0x7Fu;
#else   /* no FP8 conversion before Ada/Hopper */
    return e4m3_encode_pos(v);
#endif
}

/* One block of record_from_activations from its raw input words ``w`` (BLK elements): returns the
   scale byte and leaves the packed low-b bits in acc0/acc1 and the engine's FP4 nibbles in f0/f1.
   NVFP4 takes the multiplier enc = s_enc/sf for the block's scale byte from ``enc_tab`` (one
   correctly rounded division per E4M3 value per CTA instead of one per block).

   The kernel is bound by the integer/logic pipe (LOP3, IMNMX, FMNMX issue at half the FP32 rate
   on Hopper), so V moves per-element work off it (bench_kernels compares; both are bit-exact):
   bit 0: the magic number on the FP32 pipe (rtn_sum_fmul) instead of e2m1_magic, and for b > 1
          or the engine's FP4 the code from the sum by one add (rtn_mag_sum);
   bit 2: the block amax on packed bf16x2/f16x2 words (absmax2) instead of one max per element.
   H200, bf16 [65536, 2048], NVFP4 b = 1: V0 0.0927 ms, bit 0 alone 0.0865 ms, V5 0.0802 ms (87%).
   (Packing the bits by IMAD.HI instead of LOP3 was tried: ptxas turns it into LEA.HI, same pipe,
   no gain.) */
template <int DT, int FMT, int BITS, int FP4OUT, int V>
__device__ __forceinline__ u32 record_block(const u32* w, float g, float s_enc, float s6, const float* enc_tab,
                                            u64* acc0_out, u64* acc1_out, u64* f0_out, u64* f1_out) {
    const int BLK = FMT == F_NVFP4 ? 16 : 32;
    float v[BLK];
    words_to_floats<DT, BLK>(w, v);
    float mul;
    u32 sf;
    float amax;
    if ((V & 4) && DT != DT_F32) {
        u32 m = absmax2<DT>(w[0], w[1]);   /* signs are garbage (xor of the inputs'); magnitudes exact */
#pragma unroll
        for (int j = 2; j < BLK / 2; ++j) m = absmax2<DT>(m, w[j]);
        float lo = DT == DT_BF16 ? bf16_to_f(m & 0xFFFFu) : f16_to_f((u16)(m & 0xFFFFu));
        float hi = DT == DT_BF16 ? bf16_to_f(m >> 16) : f16_to_f((u16)(m >> 16));
        amax = absmax_nan(fabsf(lo), hi);
    } else {
        amax = block_amax<BLK>(v);
    }
    if (FMT == F_NVFP4) {
        float p = __fmul_rn(amax, s6);
        if (enc_tab != nullptr && (p >= 0.f || p != p)) {
            sf = e4m3_cvt(p);
            mul = enc_tab[sf];
        } else {   /* a negative decode-side g, or per-row g (no table): the general path */
            sf = e4m3_encode_pos(p);
            mul = __fdiv_rn(s_enc, e4m3_decode(sf));
            if (mul > FLT_MAX_F) mul = FLT_MAX_F;
        }
    } else {
        float sv;
        sf = block_scale_of<FMT>(amax, g, &mul, &sv);
    }
    const u32 mask = BITS == 4 ? 15u : ((1u << BITS) - 1u);
    const bool NARROW = BLK * BITS <= 32;   /* NVFP4 b <= 2, MX b = 1: one 32-bit accumulator */
    u32 acc32 = 0u;
    u64 acc0 = 0ull, acc1 = 0ull, f0 = 0ull, f1 = 0ull;
#pragma unroll
    for (int i = 0; i < BLK; ++i) {
        float z = __fmul_rn(v[i], mul);
        const int pos = i * BITS;
        if (BITS == 1 && !FP4OUT) {   /* b = 1: the mantissa bit only, the parity of the rounded sum */
            acc32 |= ((V & 1) ? rtn_sum_fmul(fabsf(z)) & 1u : rtn_bit0(fabsf(z))) << pos;
            continue;
        }
        u32 c;
        if ((V & 1) && BITS < 4 && !FP4OUT) {
            c = rtn_mag_sum(rtn_sum_fmul(fabsf(z)));   /* b <= 3: the sign bit is not kept */
        } else if (V & 1) {
            /* z clamped to [-6, 6], NaN -> +6 (fminf returns the number): code 7 without a sign,
               as the reference, and no NaN test per element */
            const float zc = fmaxf(fminf(z, 6.f), -6.f);
            c = rtn_mag_sum(magic_sum(fabsf(zc))) | ((__float_as_uint(zc) >> 31) << 3);
        } else if (BITS < 4 && !FP4OUT) {
            c = rtn_mag(fabsf(z));   /* b <= 3: the sign bit is not kept */
        } else {
            c = (z != z) ? 7u : (rtn_mag(fabsf(z)) | ((__float_as_uint(z) >> 31) << 3));
        }
        if (NARROW) {
            acc32 |= (c & mask) << pos;
        } else {
            u64 cb = (u64)(c & mask);
            if (pos < 64) {
                acc0 |= cb << pos;
                if (pos + BITS > 64) acc1 |= cb >> (64 - pos);
            } else {
                acc1 |= cb << (pos - 64);
            }
        }
        if (FP4OUT) {
            if (i < 16) f0 |= (u64)c << (4 * i); else f1 |= (u64)c << (4 * (i - 16));
        }
    }
    if (NARROW) acc0 = acc32;
    *acc0_out = acc0;
    *acc1_out = acc1;
    *f0_out = f0;
    *f1_out = f1;
    return sf;
}

/* G consecutive scale blocks of one row per thread (all loads issued first); ng = nb / G groups
   per row, row = fast_div(idx, div_m, div_sh). PAIR (G = 2, NVFP4, b = 1; the launcher checks
   4-byte aligned code rows and 2-byte aligned scale rows): the two blocks' code bits go out as one
   4-byte store and their scale bytes as one 2-byte store. */
template <int DT, int FMT, int BITS, int FP4OUT, int G, int V, int PAIR, int PR>
__global__ void record_act(const u8* __restrict__ x, i64 x_stride, u32 n_rows, u32 ng, u32 div_m, u32 div_sh,
                           const float* __restrict__ g_ptr,
                           u8* __restrict__ codes_out, i64 c_stride, u8* __restrict__ scales_out, i64 s_stride,
                           float* __restrict__ g_out, i64 g_stride, u8* __restrict__ fp4_out, i64 f_stride) {
    const int BLK = FMT == F_NVFP4 ? 16 : 32;
    const int ESZ = DT == DT_F32 ? 4 : 2;
    const int NW = BLK * ESZ / 4;
    /* PR (NVFP4 only): one decode-side g per row, g_ptr[row]; enc = s_enc/sf is then divided per
       block (no per-CTA table: rows of one CTA have different g). g_out is strided (g_stride
       floats per row: a RecordSlab interleaves every site's rows). */
    __shared__ float enc_tab[FMT == F_NVFP4 && !PR ? 128 : 1];
    float g = FMT == F_NVFP4 && !PR ? sane_g(*g_ptr) : 1.f;
    float s_enc = 0.f, s6 = 0.f;
    if (FMT == F_NVFP4 && !PR) {
        s_enc = __fdiv_rn(1.f, g);
        s6 = __fmul_rn(s_enc, ONE_SIXTH);
        if (threadIdx.x < 128) {   /* enc for every scale byte 0..127 (127: NaN stays NaN) */
            float e = __fdiv_rn(s_enc, e4m3_decode(threadIdx.x));
            enc_tab[threadIdx.x] = e > FLT_MAX_F ? FLT_MAX_F : e;
        }
        __syncthreads();
    }
    u32 idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_rows * ng) return;
    u32 row = fast_div(idx, div_m, div_sh), blk0 = (idx - row * ng) * G;
    if (FMT == F_NVFP4 && PR) {
        g = sane_g(g_ptr[row]);
        s_enc = __fdiv_rn(1.f, g);
        s6 = __fmul_rn(s_enc, ONE_SIXTH);
    }
    u32 w[G][NW];
#pragma unroll
    for (int gi = 0; gi < G; ++gi) load_words<NW>(x + (i64)row * x_stride + (i64)(blk0 + gi) * (BLK * ESZ), w[gi]);
    u32 sf[G];
    u64 a0[G], a1[G], f0[G], f1[G];
#pragma unroll
    for (int gi = 0; gi < G; ++gi)
        sf[gi] = record_block<DT, FMT, BITS, FP4OUT, V>(w[gi], g, s_enc, s6, PR ? nullptr : enc_tab, &a0[gi], &a1[gi],
                                                        &f0[gi], &f1[gi]);
    u8* co = codes_out + (i64)row * c_stride + (i64)blk0 * (BLK * BITS / 8);
    u8* so = scales_out + (i64)row * s_stride + blk0;
    if (PAIR && G == 2 && BLK == 16 && BITS == 1 && !FP4OUT) {
        *reinterpret_cast<u32*>(co) = (u32)a0[0] | ((u32)a0[1] << 16);
        *reinterpret_cast<u16*>(so) = (u16)(sf[0] | (sf[1] << 8));
    } else {
#pragma unroll
        for (int gi = 0; gi < G; ++gi) {
            store_acc<BLK, BITS>(co + gi * (BLK * BITS / 8), a0[gi], a1[gi]);
            so[gi] = (u8)sf[gi];
            if (FP4OUT) {
                u8* fo = fp4_out + (i64)row * f_stride + (i64)(blk0 + gi) * (BLK / 2);
                if (BLK == 16) *reinterpret_cast<u64*>(fo) = f0[gi];
                else *reinterpret_cast<uint4*>(fo) = make_uint4((u32)f0[gi], (u32)(f0[gi] >> 32), (u32)f1[gi],
                                                               (u32)(f1[gi] >> 32));
            }
        }
    }
    if (blk0 == 0 && g_out) g_out[(i64)row * g_stride] = g;
}

__device__ __forceinline__ i64 swizzled_offset(u32 r, u32 c, u32 cols_padded) {
    /* docs/numerics.md §5 */
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

/* G consecutive blocks per thread (G = 2 for NVFP4 rows with an even block count: 16-byte loads);
   ng = nb / G groups per row, row = fast_div(idx, div_m, div_sh). PAIR (G = 2, scale buffers
   2-byte aligned with even strides): the two scale bytes move as one 2-byte load and store — they
   are adjacent in both layouts, since blk0 is even and a swizzled 4-column group starts at an
   even offset (docs/numerics.md §5). */
template <int BLK, int BITS, int SWZ, int G, int PAIR>
__global__ void record_codes(const u8* __restrict__ packed, i64 p_stride, const u8* __restrict__ scales, i64 s_stride,
                             u32 n_rows, u32 ng, u32 div_m, u32 div_sh, u8* __restrict__ codes_out, i64 c_stride,
                             u8* __restrict__ scales_out, i64 so_stride, const float* __restrict__ g_ptr,
                             i64 g_in_stride, float* __restrict__ g_out, i64 g_stride) {
    u32 idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_rows * ng) return;
    u32 row = fast_div(idx, div_m, div_sh), blk0 = (idx - row * ng) * G;
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
    /* s_stride is the padded column count for a swizzled buffer */
    if (PAIR && G == 2) {
        i64 at = SWZ ? swizzled_offset(row, blk0, (u32)s_stride) : (i64)row * s_stride + blk0;
        *reinterpret_cast<u16*>(scales_out + (i64)row * so_stride + blk0) = *reinterpret_cast<const u16*>(scales + at);
    } else {
#pragma unroll
        for (int gi = 0; gi < G; ++gi) {
            u32 c = blk0 + gi;
            u8 sb = SWZ ? scales[swizzled_offset(row, c, (u32)s_stride)] : scales[(i64)row * s_stride + c];
            scales_out[(i64)row * so_stride + c] = sb;
        }
    }
    if (blk0 == 0 && g_out) g_out[(i64)row * g_stride] = g_ptr ? g_ptr[(i64)row * g_in_stride] : 1.f;
}

/* One request's tokens from a paged FP4 cache: pool [pages, page_size, row bytes] (any strides
   for the first two dims), scales [pages, page_size, nb]. page_table int32 or int64. */
template <int BLK, int BITS>
__global__ void record_kv(const u8* __restrict__ pool, i64 pool_page, i64 pool_slot,
                          const u8* __restrict__ spool, i64 spool_page, i64 spool_slot,
                          const void* __restrict__ page_table, int pt64, u32 page_size, u32 token_start,
                          u32 n_tokens, u32 nb, u8* __restrict__ codes_out, i64 c_stride,
                          u8* __restrict__ scales_out, i64 so_stride, const float* __restrict__ g_ptr,
                          i64 g_in_stride, float* __restrict__ g_out, i64 g_stride) {
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
    if (blk == 0 && g_out) g_out[(i64)t * g_stride] = g_ptr ? g_ptr[(i64)t * g_in_stride] : 1.f;
}

/* A RecordSlab's first rows (n16 16-byte words) into slot *slot of a device ring (slot_bytes
   apart): the capturable half of RolloutRecorder's graph staging. The slot is read on the device,
   so one captured graph writes whichever slot the host selected before its replay. */
__global__ void stage_rows(const uint4* __restrict__ src, i64 n16, u8* __restrict__ ring, i64 slot_bytes,
                           const int* __restrict__ slot) {
    uint4* dst = reinterpret_cast<uint4*>(ring + (i64)(*slot) * slot_bytes);
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (i64)gridDim.x * blockDim.x) dst[i] = src[i];
}

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
    float gr = FMT == F_NVFP4 ? g[g_per_row ? grow : 0] : 1.f;
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
