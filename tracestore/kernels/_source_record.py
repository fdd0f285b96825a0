"""CUDA C source, second part of ``_source.SOURCE``: the rollout-side kernels ``record.py`` launches.

``amax_abs`` and ``finalize_g`` (the decode-side NVFP4 g), ``record_act`` (activations -> records,
one block at a time in ``record_block``, whose ``V`` flags select the per-element formulation),
``record_codes`` (an engine's packed FP4 codes, row-major or swizzled scales), ``record_kv`` (a
paged FP4 KV cache) and ``stage_rows`` (a RecordSlab's rows into a device ring), with their
helpers; among them ``fast_div``, which the guided kernels (``_source_guided.py``, later in the
same translation unit) use too. Builds on ``_source_common.py``.
"""

from __future__ import annotations

RECORD = r"""
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
        } else {   /* per-row g (no table): the general path */
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
    /* the g the trainer uses: 0, negative or non-finite -> 1 (docs/numerics.md §3) */
    if (blk0 == 0 && g_out) g_out[(i64)row * g_stride] = g_ptr ? sane_g(g_ptr[(i64)row * g_in_stride]) : 1.f;
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
    if (blk == 0 && g_out) g_out[(i64)t * g_stride] = g_ptr ? sane_g(g_ptr[(i64)t * g_in_stride]) : 1.f;
}

/* A RecordSlab's first rows (n16 16-byte words) into slot *slot of a device ring (slot_bytes
   apart): the capturable half of RolloutRecorder's graph staging. The slot is read on the device,
   so one captured graph writes whichever slot the host selected before its replay. */
__global__ void stage_rows(const uint4* __restrict__ src, i64 n16, u8* __restrict__ ring, i64 slot_bytes,
                           const int* __restrict__ slot) {
    uint4* dst = reinterpret_cast<uint4*>(ring + (i64)(*slot) * slot_bytes);
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (i64)gridDim.x * blockDim.x) dst[i] = src[i];
}
"""
