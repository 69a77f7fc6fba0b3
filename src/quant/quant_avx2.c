/* quant_avx2.c — AVX2 + FMA + F16C kernels (no VNNI: CPUs from Haswell and
 * Zen 1 on): lk_quant_matmul for every supported weight type and the Q8_0 /
 * Q8_K activation quantisers.
 *
 * Without vpdpbusd the byte dot product is vpmaddubsw (u8 x s8 -> pairs
 * summed into saturating i16) followed by vpmaddwd (i16 pairs -> i32). The
 * i16 stage never saturates here: Q4_0 nibbles and K-quant quants are at most
 * 63 (2*63*127 < 32767), and Q8_0 x Q8_0 uses |w| x sign(a, w) (2*128*127 <
 * 32767). Weights are unsigned where the format allows and offsets removed
 * with activation-only corrections, as in the AVX-512 file; several rows
 * share each activation block (R x T register tiles, same driver). The
 * K-quants keep the scalar reference's arithmetic (kq_tile2), so they are
 * batch invariant and equal to the scalar level, as Q4_0 and Q8_0 are
 * (quant_q4q8_avx2.c); the float types sum in 8 FMA lanes. */
#include <immintrin.h>

#include "quant/simd_x86.h"

LK_T2 static LK_INL float h2f(const uint8_t *p) { return _cvtsh_ss(lk_ld_u16(p)); }

/* Q4_0 and Q8_0 are quant_q4q8_avx2.c: rows in lanes, the scalar order. */

/* ===================================================================== */
/* K-quants x Q8_K                                                         */
/* ===================================================================== */

static LK_INL void k_scales_unpack(const uint8_t *q, uint64_t *sc, uint64_t *m) {
    uint32_t w0, w1, w2;
    memcpy(&w0, q, 4); memcpy(&w1, q + 4, 4); memcpy(&w2, q + 8, 4);
    uint32_t sc_lo = w0 & 0x3f3f3f3fu, m_lo = w1 & 0x3f3f3f3fu;
    uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | ((w0 >> 6) & 0x03030303u) << 4;
    uint32_t m_hi = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 6) & 0x03030303u) << 4;
    *sc = sc_lo | (uint64_t)sc_hi << 32;
    *m = m_lo | (uint64_t)m_hi << 32;
}

/* One super-block of one weight row x T Q8_K activation rows (token t's
 * block at a + t*as): the exact integer sums of sc_j * (q . a)_j over the 8
 * (Q4_K/Q5_K) or 16 (Q6_K) sub-blocks, added into is[t]'s 8 i32 lanes (Q6_K
 * folds its -32 offset in as 32 * sum_j sc_j*bsum_j); Q4_K/Q5_K: sum_j m_j *
 * bsum_j into mm[t]'s 4 lanes. The weights are decoded once for the T
 * tokens. Integer sums are exact in any order, so how the lanes split the
 * work does not show in the result. */
LK_T2 static LK_INL void k_isum(const int kind, const int T, const uint8_t *w, const uint8_t *a, size_t as,
                                __m256i *is, __m128i *mm) {
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    if (kind == 4 || kind == 5) {
        uint64_t sc, m;
        k_scales_unpack(w + (kind == 4 ? LK_Q4K_SC : LK_Q5K_SC), &sc, &m);
        /* sc_j as i16 words in both 128-bit lanes; shuffle_epi8 broadcasts one */
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
        const uint8_t *qs = w + (kind == 4 ? LK_Q4K_QS : LK_Q5K_QS);
        const __m256i qh = kind == 5 ? _mm256_loadu_si256((const __m256i *)(w + LK_Q5K_QH)) : _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(q, m0f);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m0f);
            if (kind == 5) {
                /* bit 2j / 2j+1 of qh[l] is the 5th bit of sub-block 2j / 2j+1 */
                const __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * j))), b1 = _mm256_set1_epi8((char)(2 << (2 * j)));
                const __m256i m10 = _mm256_set1_epi8(0x10);
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), m10));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), m10));
            }
            const __m256i s0 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * j))));
            const __m256i s1 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * j + 1))));
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                const int8_t *q8 = (const int8_t *)(a + (size_t)t * as + LK_Q8K_QS);
                const __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(q8 + 64 * j)));
                const __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q8 + 64 * j + 32)));
                is[t] = _mm256_add_epi32(is[t], _mm256_add_epi32(_mm256_madd_epi16(p0, s0), _mm256_madd_epi16(p1, s1)));
            }
        }
        const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m));
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const uint8_t *at = a + (size_t)t * as;
            const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)(at + LK_Q8K_BS)),
                                              _mm_loadu_si128((const __m128i *)(at + LK_Q8K_BS + 16)));
            mm[t] = _mm_madd_epi16(m16, bs);
        }
    } else {
        const uint8_t *ql = w + LK_Q6K_QL, *qhp = w + LK_Q6K_QH;
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(w + LK_Q6K_SC));
        const __m256i m03 = _mm256_set1_epi8(3);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(qhp + 32 * h));
            __m256i v[4];
            v[0] = _mm256_or_si256(_mm256_and_si256(l0, m0f), _mm256_slli_epi16(_mm256_and_si256(qh, m03), 4));
            v[1] = _mm256_or_si256(_mm256_and_si256(l1, m0f),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m03), 4));
            v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m0f),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m03), 4));
            v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m0f),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m03), 4));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                /* elements 128h + 32k .. +31: sub-blocks g and g+1, g = 8h + 2k */
                const int g = 8 * h + 2 * k;
                const __m128i idx = _mm_set_epi8((char)(g + 1), (char)(g + 1), (char)(g + 1), (char)(g + 1),
                                                 (char)(g + 1), (char)(g + 1), (char)(g + 1), (char)(g + 1),
                                                 (char)g, (char)g, (char)g, (char)g, (char)g, (char)g, (char)g, (char)g);
                const __m256i s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, idx));
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    const int8_t *q8 = (const int8_t *)(a + (size_t)t * as + LK_Q8K_QS);
                    const __m256i p = _mm256_maddubs_epi16(v[k], _mm256_loadu_si256((const __m256i *)(q8 + 128 * h + 32 * k)));
                    is[t] = _mm256_add_epi32(is[t], _mm256_madd_epi16(p, s));
                }
            }
        }
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const __m256i c = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(a + (size_t)t * as + LK_Q8K_BS)));
            is[t] = _mm256_sub_epi32(is[t], _mm256_slli_epi32(c, 5));
        }
    }
}

/* R rows x T tokens (R * T <= 4: 1 x 1..4 for prefill, 4 x 1 for decode),
 * in the scalar reference's arithmetic (dot_k45 / dot_q6_k in quant.c): per
 * super-block the exact integer sums, then
 *   s = s + ((d_w*d_a)*(float)sumi - (dmin_w*d_a)*(float)summ)
 * (Q6_K: s = s + (d_w*d_a)*(float)sumi), super-block after super-block. The
 * (row, token) pairs sit in the 4 float lanes, so one conversion, the
 * multiplies and the add serve four pairs; their integer sums reach the
 * lanes through one tree of horizontal adds. Every tile shape does each
 * pair's arithmetic the same way, so a token's outputs do not depend on the
 * call's token count (batch invariance) and equal the scalar level's. */
LK_T2 static LK_INL void kq_tile2(const int R, const int T, const int kind, int64_t n,
                                  const uint8_t *w, size_t ws, const uint8_t *a, size_t as,
                                  float *y, size_t ys) {
    const size_t bb = kind == 4 ? LK_Q4K_BYTES : kind == 5 ? LK_Q5K_BYTES : LK_Q6K_BYTES;
    const size_t dof = kind == 6 ? LK_Q6K_D : 0;
    __m128 s = _mm_setzero_ps();
    for (int64_t i = 0; i < n / LK_QK_K; i++) {
        __m256i is[4];
        __m128i mm[4];
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) is[p] = _mm256_setzero_si256(), mm[p] = _mm_setzero_si128();
        const uint8_t *ai = a + (size_t)i * LK_Q8K_BYTES;
        float dw[4] = {0, 0, 0, 0}, dm[4] = {0, 0, 0, 0}, da[4] = {0, 0, 0, 0};
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *wp = w + r * ws + (size_t)i * bb;
            pf_range_l1(wp, R * ws, bb);
            k_isum(kind, T, wp, ai, as, &is[r * T], &mm[r * T]);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                dw[r * T + t] = h2f(wp + dof);
                if (kind != 6) dm[r * T + t] = h2f(wp + 2);
                da[r * T + t] = lk_ld_f32(ai + (size_t)t * as);
            }
        }
        /* lane p = the exact total of is[p] */
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(is[0], is[1]), _mm256_hadd_epi32(is[2], is[3]));
        const __m128i si = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        const __m128i sm = kind == 6 ? _mm_setzero_si128()
                                     : _mm_hadd_epi32(_mm_hadd_epi32(mm[0], mm[1]), _mm_hadd_epi32(mm[2], mm[3]));
        s = lk_kq_fin4(kind == 6, si, sm, _mm_setr_ps(dw[0], dw[1], dw[2], dw[3]), _mm_setr_ps(dm[0], dm[1], dm[2], dm[3]),
                       _mm_setr_ps(da[0], da[1], da[2], da[3]), s);
    }
    float o[4];
    _mm_storeu_ps(o, s);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) y[t * ys + r] = o[r * T + t];
}

/* ===================================================================== */
/* F32, F16, BF16                                                          */
/* ===================================================================== */

LK_T2 static LK_INL __m256 fl_load2(const int kind, const uint8_t *p) {
    if (kind == 32) return _mm256_loadu_ps((const float *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (kind == 16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 16 elements per step (2 accumulators per pair); elements past the last
 * multiple of 8 go through the scalar dot. */
LK_T2 static LK_INL void fl_tile2(const int R, const int T, const int kind, int64_t n,
                                  const uint8_t *w, size_t ws, const uint8_t *a, size_t as,
                                  float *y, size_t ys) {
    const int es = kind == 32 ? 4 : 2;
    __m256 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        /* the T activation vectors first, then one weight vector at a time:
         * R*T accumulators + T + 1 registers (16 for 4 x 3; loading the R
         * weight vectors first needed 17, and the spilled accumulator's
         * store-to-load chain halved the tile's speed) */
        __m256 av[4];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) av[t] = fl_load2(kind, a + t * as + i * es);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            if ((i & 15) == 0) pf_range_l1(w + r * ws + i * es, R * ws, 16 * es);
            const __m256 wv = fl_load2(kind, w + r * ws + i * es);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) acc[r][t] = _mm256_fmadd_ps(wv, av[t], acc[r][t]);
        }
    }
    const lk_type ty = kind == 32 ? LK_TYPE_F32 : kind == 16 ? LK_TYPE_F16 : LK_TYPE_BF16;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            float s = hsum8(acc[r][t]);
            if (i < n) s += lk_quant_dot_scalar(ty, n - i, w + r * ws + i * es, a + t * as + i * es);
            y[t * ys + r] = s;
        }
}

/* ===================================================================== */
/* Activation quantisers (also used by the AVX-512 level: a few hundred     */
/* elements per token, far from the matmul's cost)                         */
/* ===================================================================== */

/* 8 i32 x 4 -> 32 i8 in order (values already in [-127, 127]) */
LK_T2 static LK_INL __m256i pack_i32x4(__m256i i0, __m256i i1, __m256i i2, __m256i i3) {
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

LK_T2 static LK_INL float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* roundf (half away from zero), as ggml's quantize_row_q8_0_ref */
LK_T2 static LK_INL __m256i round_away(__m256 x) {
    __m256 t = _mm256_round_ps(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256 absf = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_sub_ps(x, t));
    __m256 one = _mm256_or_ps(_mm256_and_ps(x, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(1.0f));
    t = _mm256_add_ps(t, _mm256_and_ps(_mm256_cmp_ps(absf, _mm256_set1_ps(0.5f), _CMP_GE_OQ), one));
    return _mm256_cvtps_epi32(t);
}

/* Q8_0 rows, two roundings. Weights (act false) bit-exact with the scalar
 * quant_q8_0: d = amax/127, id = 1/d, q = roundf(x*id) (half away from
 * zero, as ggml's quantize_row_q8_0_ref). The matmul's activations (act
 * true) as lk_act_q8_0_scalar makes them (llama.cpp's x86
 * quantize_row_q8_0): id = 127/amax, round half to even (vcvtps2dq under
 * the default rounding mode, as nearbyintf). Both: the same max, one
 * product per element, so the same bytes as the scalar code; the scalar
 * activation loop was 4 % of a 16-token prefill at one thread on Zen 3
 * (perf: the function, fmaxf and nearbyintf calls). */
LK_T2 static LK_INL void q8_0_rows_avx2(const float *x, void *dst, int64_t n, const bool act) {
    uint8_t *b = dst;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < n / LK_QK; i++, x += LK_QK, b += LK_Q80_BYTES) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(x + 8 * k);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
        }
        const float amax = hmax8(m);
        const float d = amax / 127.f;
        const float id = act ? (amax != 0 ? 127.f / amax : 0.0f) : (d != 0 ? 1.0f / d : 0.0f);
        uint16_t h = lk_fp32_to_fp16(d);
        memcpy(b, &h, 2);
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int k = 0; k < 4; k++) {
            const __m256 p = _mm256_mul_ps(v[k], vid);
            q[k] = act ? _mm256_cvtps_epi32(p) : round_away(p);
        }
        _mm256_storeu_si256((__m256i *)(b + 2), pack_i32x4(q[0], q[1], q[2], q[3]));
    }
}

LK_T2 static void quant_q8_0_avx2(const float *x, void *dst, int64_t n) { q8_0_rows_avx2(x, dst, n, false); }
LK_T2 static void act_q8_0_avx2(const float *x, void *dst, int64_t n) { q8_0_rows_avx2(x, dst, n, true); }

/* Bit-exact with the scalar quant_q8_k: max = the first element of largest
 * magnitude (signed), iscale = -127/max, q = min(127, round-half-even). */
LK_T2 static void quant_q8_k_avx2(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < n / LK_QK_K; i++, x += LK_QK_K, b += LK_Q8K_BYTES) {
        /* four chains of the max (exact: any order gives the same) */
        __m256 m4[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int k = 0; k < 32; k++) m4[k & 3] = _mm256_max_ps(m4[k & 3], _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * k)));
        float amax = hmax8(_mm256_max_ps(_mm256_max_ps(m4[0], m4[1]), _mm256_max_ps(m4[2], m4[3])));
        if (amax == 0) { memset(b, 0, LK_Q8K_BYTES); continue; }
        float max = 0;
        __m256 va = _mm256_set1_ps(amax);
        for (int k = 0; k < 32; k++) {
            int msk = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * k)), va, _CMP_EQ_OQ));
            if (msk) { max = x[8 * k + __builtin_ctz((unsigned)msk)]; break; }
        }
        float iscale = -127.f / max;
        __m256 vs = _mm256_set1_ps(iscale);
        const __m256i c127 = _mm256_set1_epi32(127);
        for (int g = 0; g < 8; g++) { /* 32 elements = 2 bsum groups */
            __m256i q[4];
            for (int k = 0; k < 4; k++)
                q[k] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 32 * g + 8 * k), vs)), c127);
            _mm256_storeu_si256((__m256i *)(b + LK_Q8K_QS + 32 * g), pack_i32x4(q[0], q[1], q[2], q[3]));
            /* the two 16-element sums (exact integers, any order): lane 0
             * of the 128-bit halves' sum is the first, lane 1 the second */
            __m256i t = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            t = _mm256_hadd_epi32(t, t);
            const __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            const int16_t bs[2] = {(int16_t)_mm_cvtsi128_si32(s2), (int16_t)_mm_extract_epi32(s2, 1)};
            memcpy(b + LK_Q8K_BS + 2 * (2 * g), bs, 4);
        }
        float d = 1 / iscale;
        memcpy(b, &d, 4);
    }
}

/* ===================================================================== */
/* Tiles                                                                   */
/* ===================================================================== */

#define LK_TILE_FN(name, R, T, call)                                                       \
    LK_T2 static void name##_##R##x##T(int64_t n, const uint8_t *w, size_t ws,             \
                                       const uint8_t *a, size_t as, float *y, size_t ys) { \
        call;                                                                              \
    }
#define LK_TILES_4x3(name, CALL, dec4, dec1)                                               \
    LK_TILE_FN(name, 4, 1, CALL(4, 1)) LK_TILE_FN(name, 4, 2, CALL(4, 2))                  \
    LK_TILE_FN(name, 4, 3, CALL(4, 3)) LK_TILE_FN(name, 1, 1, CALL(1, 1))                  \
    LK_TILE_FN(name, 1, 2, CALL(1, 2)) LK_TILE_FN(name, 1, 3, CALL(1, 3))                  \
    static const lk_tileset name##_set = {dec4, dec1, 4, 3,                               \
                                          {{NULL, name##_1x1, name##_1x2, name##_1x3, NULL}, \
                                           {NULL, name##_4x1, name##_4x2, name##_4x3, NULL}}};
#define LK_TILES_1x4(name, CALL)                                                           \
    LK_TILE_FN(name, 4, 1, CALL(4, 1)) LK_TILE_FN(name, 1, 1, CALL(1, 1))                  \
    LK_TILE_FN(name, 1, 2, CALL(1, 2)) LK_TILE_FN(name, 1, 3, CALL(1, 3))                  \
    LK_TILE_FN(name, 1, 4, CALL(1, 4))                                                     \
    static const lk_tileset name##_set = {name##_4x1, name##_1x1, 1, 4,                   \
                                          {{NULL, name##_1x1, name##_1x2, name##_1x3, name##_1x4}, \
                                           {NULL, name##_1x1, name##_1x2, name##_1x3, name##_1x4}}};

#define Q4K_CALL(R, T) kq_tile2(R, T, 4, n, w, ws, a, as, y, ys)
#define Q5K_CALL(R, T) kq_tile2(R, T, 5, n, w, ws, a, as, y, ys)
#define Q6K_CALL(R, T) kq_tile2(R, T, 6, n, w, ws, a, as, y, ys)
#define F32_CALL(R, T) fl_tile2(R, T, 32, n, w, ws, a, as, y, ys)
#define F16_CALL(R, T) fl_tile2(R, T, 16, n, w, ws, a, as, y, ys)
#define BF_CALL(R, T) fl_tile2(R, T, 0, n, w, ws, a, as, y, ys)
LK_TILES_1x4(q4k, Q4K_CALL)
LK_TILES_1x4(q5k, Q5K_CALL)
LK_TILES_1x4(q6k, Q6K_CALL)
LK_TILES_4x3(f32, F32_CALL, f32_4x1, f32_1x1)
LK_TILES_4x3(f16, F16_CALL, f16_4x1, f16_1x1)
LK_TILES_4x3(bf, BF_CALL, bf_4x1, bf_1x1)

#define LK_MM_FN(name)                                                                          \
    static void mm_##name(int64_t n, int64_t nrows, const void *w, size_t w_stride,             \
                          int64_t ntok, const void *a, size_t a_stride, float *y,               \
                          size_t y_stride) {                                                    \
        lk_quant_run_tiles(&name##_set, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride); \
    }
/* 2+ tokens: the prefill GEMM of quant_gemm_avx2.c when a tuning choice
 * turns it on (the same bits as these tiles, each weight block decoded once
 * per chunk of tokens instead of per tile; no faster on Zen 3, so off by
 * default) */
#define LK_MM_GEMM_FN(name, GEMM_CALL)                                                          \
    static void mm_##name(int64_t n, int64_t nrows, const void *w, size_t w_stride,             \
                          int64_t ntok, const void *a, size_t a_stride, float *y,               \
                          size_t y_stride) {                                                    \
        if (ntok >= 2 && lk_quant_gemm_avx2_on()) GEMM_CALL;                                    \
        else lk_quant_run_tiles(&name##_set, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride); \
    }
LK_MM_GEMM_FN(q4k, lk_quant_gemm_kq_avx2(4, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride))
LK_MM_GEMM_FN(q5k, lk_quant_gemm_kq_avx2(5, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride))
LK_MM_GEMM_FN(q6k, lk_quant_gemm_kq_avx2(6, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride))
LK_MM_FN(f32)
LK_MM_FN(f16)
LK_MM_FN(bf)

/* F16 and BF16 rows (weights, and the activations of F16/BF16 weights)
 * with the bits of lk_fp32_to_fp16 / lk_fp32_to_bf16, 8 at a time. F16:
 * vcvtps2ph rounds to nearest even as the scalar code does, to subnormals
 * and to infinity alike; only a NaN's payload would differ, so a group with
 * a NaN goes through the scalar code. BF16: the scalar code's integer
 * rounding. With the scalar converters, an F16 prefill spent 9 % of its
 * time in its activations' pass (bench --profile, 16-core Xeon,
 * 2026-12-02). */
LK_T2 static void f16_rows_avx2(const float *x, void *dst, int64_t n) {
    uint8_t *d = dst;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) break;
        _mm_storeu_si128((__m128i *)(d + 2 * i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    lk_quant_f16_rows(x + i, d + 2 * i, n - i);
}

LK_T2 static void bf16_rows_avx2(const float *x, void *dst, int64_t n) {
    uint8_t *d = dst;
    int64_t i = 0;
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
    const __m256i abs = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    for (; i + 8 <= n; i += 8) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(x + i));
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
        r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(64)), nan);
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i *)(d + 2 * i), _mm256_castsi256_si128(p));
    }
    lk_quant_bf16_rows(x + i, d + 2 * i, n - i);
}

void lk_quant_fill_avx2(lk_quant_ops *ops) {
    ops->name = "avx2";
    ops->mm[LK_TYPE_Q4_0] = lk_quant_mm_q40_avx2;
    ops->mm[LK_TYPE_Q8_0] = lk_quant_mm_q80_avx2;
    ops->mm[LK_TYPE_Q4_K] = mm_q4k;
    ops->mm[LK_TYPE_Q5_K] = mm_q5k;
    ops->mm[LK_TYPE_Q6_K] = mm_q6k;
    ops->mm[LK_TYPE_F32] = mm_f32;
    ops->mm[LK_TYPE_F16] = mm_f16;
    ops->mm[LK_TYPE_BF16] = mm_bf;
    ops->quant[LK_TYPE_Q8_0] = quant_q8_0_avx2;
    ops->quant[LK_TYPE_Q8_K] = quant_q8_k_avx2;
    ops->act[LK_TYPE_Q8_0] = act_q8_0_avx2;
    ops->quant[LK_TYPE_Q4_K] = lk_quantize_row_q4_k_avx2;
    ops->quant[LK_TYPE_Q5_K] = lk_quantize_row_q5_k_avx2;
    ops->quant[LK_TYPE_F16] = f16_rows_avx2;
    ops->quant[LK_TYPE_BF16] = bf16_rows_avx2;
}
