/* quant_k23.c — Q2_K, Q3_K and IQ4_XS weights x Q8_K activations (what
 * llama.cpp's x86 build pairs them with): dequantisation, the matrix
 * kernels (scalar definition, AVX2, AVX-512), and the weight quantisers of
 * `lockstep quantize --type q2_k|q3_k` and its _S/_M/_L mixes, which also
 * need Q5_K (quant_kq.c) and Q6_K: the algorithms of ggml's reference
 * quantisers (what llama-quantize runs without an importance matrix), the
 * searches of Q2_K and Q6_K with AVX2 twins that give the same bytes.
 * Layouts: quant_impl.h.
 *
 * Kernels, all levels: per super-block an exact integer sum of
 * scale_j * (q . a)_j over the sub-blocks, one int->float conversion and one
 * FMA with d*da into float lanes; Q2_K's mins go through the activation's
 * bsums (sum_j m_j * bsum_j) into a second accumulator scaled by dmin*da
 * and subtracted at the end; Q3_K's -4 offset is -4 * sum_j s_j * bsum_j,
 * folded into the integer sum. Every output of a level takes that same
 * sequence whether it is computed alone (decode) or in a tile of several
 * tokens or rows, so results are batch invariant. Weights are kept
 * unsigned (Q2_K 0..3, Q3_K 0..7) for vpmaddubsw / vpdpbusd; IQ4_XS's signed
 * code-book values go in as |w| with w's sign moved onto the activation
 * (|w| <= 127: pairs of products stay inside vpmaddubsw's i16). */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "quant/simd_x86.h"

/* ggml's kvalues_iq4nl: the non-uniform 4-bit code book of IQ4_NL/IQ4_XS. */
static const int8_t k_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* ===================================================================== */
/* Scalar: field access, dequantisation, dot products                     */
/* ===================================================================== */

/* The 16 signed scales of a Q3_K super-block (stored +32 in 6 bits: low 4
 * bits in nibble j/8 of byte j%8, high 2 bits at bit 2*(j/4) of byte 8+j%4). */
static inline void q3k_scales(const uint8_t *sc, int8_t out[16]) {
    for (int j = 0; j < 16; j++)
        out[j] = (int8_t)((((sc[j % 8] >> (4 * (j / 8))) & 15) | ((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4) - 32);
}

/* Element e of a Q2_K/Q3_K super-block's 2-bit field: halves of 128, each
 * 4 groups of 32 taking bit pairs 0-1, 2-3, 4-5, 6-7 of the half's 32 bytes. */
static inline int k2_low(const uint8_t *qs, int e) { return (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3; }

/* Q3_K element e as a signed value: -4 unless bit e/32 of hmask[e%32] is set. */
static inline int q3k_val(const uint8_t *b, int e) {
    return k2_low(b + LK_Q3K_QS, e) - (((b[e % 32] >> (e / 32)) & 1) ? 0 : 4);
}

/* IQ4_XS sub-block ib's 6-bit scale (stored +32). */
static inline int iq4xs_scale(const uint8_t *b, int ib) {
    return (((b[LK_IQ4XS_SL + ib / 2] >> (4 * (ib % 2))) & 15) | ((lk_ld_u16(b + LK_IQ4XS_SH) >> (2 * ib)) & 3) << 4) - 32;
}
static inline int iq4xs_val(const uint8_t *b, int e) {
    const uint8_t *qs = b + LK_IQ4XS_QS + 16 * (e / 32);
    int j = e % 32;
    return k_iq4nl[j < 16 ? qs[j] & 15 : qs[j - 16] >> 4];
}

bool lk_k23_dequantize(lk_type t, const uint8_t *b, float *y, int64_t nb) {
    switch (t) {
    case LK_TYPE_Q2_K:
        for (int64_t i = 0; i < nb; i++, b += LK_Q2K_BYTES, y += LK_QK_K) {
            float d = lk_ld_h(b + LK_Q2K_D), dmin = lk_ld_h(b + LK_Q2K_D + 2);
            for (int e = 0; e < LK_QK_K; e++) {
                uint8_t s = b[e / 16];
                y[e] = d * (float)(s & 15) * (float)k2_low(b + LK_Q2K_QS, e) - dmin * (float)(s >> 4);
            }
        }
        return true;
    case LK_TYPE_Q3_K:
        for (int64_t i = 0; i < nb; i++, b += LK_Q3K_BYTES, y += LK_QK_K) {
            float d = lk_ld_h(b + LK_Q3K_D);
            int8_t sc[16];
            q3k_scales(b + LK_Q3K_SC, sc);
            for (int e = 0; e < LK_QK_K; e++) y[e] = d * (float)sc[e / 16] * (float)q3k_val(b, e);
        }
        return true;
    case LK_TYPE_IQ4_XS:
        for (int64_t i = 0; i < nb; i++, b += LK_IQ4XS_BYTES, y += LK_QK_K) {
            float d = lk_ld_h(b);
            for (int e = 0; e < LK_QK_K; e++) y[e] = d * (float)iq4xs_scale(b, e / 32) * (float)iq4xs_val(b, e);
        }
        return true;
    default:
        return false;
    }
}

static inline int q8k_bsum(const uint8_t *a, int g) { return lk_ld_i16(a + LK_Q8K_BS + 2 * g); }

/* Q2_K: x = d*sc_j*q - dmin*m_j per sub-block j of 16, so
 *   dot = d*da * sum_j sc_j (q . q8)_j - dmin*da * sum_j m_j bsum_j */
static float dot_q2_k(int64_t n, const uint8_t *w, const uint8_t *a) {
    float s = 0;
    for (int64_t i = 0; i < n / LK_QK_K; i++, w += LK_Q2K_BYTES, a += LK_Q8K_BYTES) {
        const int8_t *q8 = (const int8_t *)(a + LK_Q8K_QS);
        int sumi = 0, summ = 0;
        for (int j = 0; j < 16; j++) {
            int si = 0;
            for (int l = 0; l < 16; l++) si += k2_low(w + LK_Q2K_QS, 16 * j + l) * q8[16 * j + l];
            sumi += (w[j] & 15) * si;
            summ += (w[j] >> 4) * q8k_bsum(a, j);
        }
        float da = lk_ld_f32(a);
        s += lk_ld_h(w + LK_Q2K_D) * da * (float)sumi - lk_ld_h(w + LK_Q2K_D + 2) * da * (float)summ;
    }
    return s;
}

static float dot_q3_k(int64_t n, const uint8_t *w, const uint8_t *a) {
    float s = 0;
    for (int64_t i = 0; i < n / LK_QK_K; i++, w += LK_Q3K_BYTES, a += LK_Q8K_BYTES) {
        const int8_t *q8 = (const int8_t *)(a + LK_Q8K_QS);
        int8_t sc[16];
        q3k_scales(w + LK_Q3K_SC, sc);
        int sumi = 0;
        for (int j = 0; j < 16; j++) {
            int si = 0;
            for (int l = 0; l < 16; l++) si += q3k_val(w, 16 * j + l) * q8[16 * j + l];
            sumi += sc[j] * si;
        }
        s += lk_ld_h(w + LK_Q3K_D) * lk_ld_f32(a) * (float)sumi;
    }
    return s;
}

static float dot_iq4_xs(int64_t n, const uint8_t *w, const uint8_t *a) {
    float s = 0;
    for (int64_t i = 0; i < n / LK_QK_K; i++, w += LK_IQ4XS_BYTES, a += LK_Q8K_BYTES) {
        const int8_t *q8 = (const int8_t *)(a + LK_Q8K_QS);
        int sumi = 0;
        for (int ib = 0; ib < 8; ib++) {
            int si = 0;
            for (int l = 0; l < 32; l++) si += iq4xs_val(w, 32 * ib + l) * q8[32 * ib + l];
            sumi += iq4xs_scale(w, ib) * si;
        }
        s += lk_ld_h(w) * lk_ld_f32(a) * (float)sumi;
    }
    return s;
}

bool lk_k23_dot_scalar(lk_type t, int64_t n, const uint8_t *w, const uint8_t *a, float *out) {
    switch (t) {
    case LK_TYPE_Q2_K: *out = dot_q2_k(n, w, a); return true;
    case LK_TYPE_Q3_K: *out = dot_q3_k(n, w, a); return true;
    case LK_TYPE_IQ4_XS: *out = dot_iq4_xs(n, w, a); return true;
    default: return false;
    }
}

#define LK_SCALAR_MM(T, TY)                                                                        \
    static void mm_##T(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,           \
                       const void *a, size_t as, float *y, size_t ys) {                           \
        for (int64_t k = 0; k < ntok; k++)                                                         \
            for (int64_t r = 0; r < nrows; r++)                                                    \
                y[(size_t)k * ys + (size_t)r] = dot_##T(n, (const uint8_t *)w + (size_t)r * ws,    \
                                                        (const uint8_t *)a + (size_t)k * as);      \
    }
LK_SCALAR_MM(q2_k, LK_TYPE_Q2_K)
LK_SCALAR_MM(q3_k, LK_TYPE_Q3_K)
LK_SCALAR_MM(iq4_xs, LK_TYPE_IQ4_XS)

/* ===================================================================== */
/* Weight quantisers (ggml's reference algorithms)                         */
/* ===================================================================== */

/* Q2_K: per sub-block of 16 a scale/min fit (quant_kq.c's, or its AVX2
 * twins: the same bits) with |x| weights and absolute error; scales and
 * mins to 4 bits against the super-block's d, dmin. */
static void quant_q2_k_with(const float *x, void *dst, int64_t n, const lk_kq_impl *im) {
    static const lk_kfit grid = {3, 15, -0.5f, 0.1f, true};
    uint8_t *b = dst;
    for (int64_t ib = 0; ib < n / LK_QK_K; ib++, x += LK_QK_K, b += LK_Q2K_BYTES) {
        uint8_t L[LK_QK_K];
        float w[16], mins[16], scales[16], max_scale = 0, max_min = 0;
        for (int j = 0; j < 16; j++) {
            for (int l = 0; l < 16; l++) w[l] = fabsf(x[16 * j + l]);
            scales[j] = im->fit(&grid, 16, x + 16 * j, w, L + 16 * j, &mins[j]);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        uint8_t *sc = b;
        uint16_t hd = 0, hm = 0;
        if (max_scale > 0) {
            float iscale = 15.f / max_scale;
            for (int j = 0; j < 16; j++) sc[j] = (uint8_t)lk_nearest(iscale * scales[j]);
            hd = lk_fp32_to_fp16(max_scale / 15.f);
        } else {
            memset(sc, 0, 16);
        }
        if (max_min > 0) {
            float iscale = 15.f / max_min;
            for (int j = 0; j < 16; j++) sc[j] |= (uint8_t)((unsigned)lk_nearest(iscale * mins[j]) << 4); /* unsigned: a NaN min's INT_MIN shifts defined */
            hm = lk_fp32_to_fp16(max_min / 15.f);
        }
        memcpy(b + LK_Q2K_D, &hd, 2);
        memcpy(b + LK_Q2K_D + 2, &hm, 2);
        for (int j = 0; j < 16; j++) {
            const float d = lk_fp16_to_fp32(hd) * (float)(sc[j] & 0xF);
            if (d == 0) continue;
            im->levels(x + 16 * j, 16, lk_fp16_to_fp32(hm) * (float)(sc[j] >> 4), d, 3, L + 16 * j);
        }
        uint8_t *qs = b + LK_Q2K_QS;
        for (int j = 0; j < LK_QK_K; j += 128)
            for (int l = 0; l < 32; l++)
                qs[j / 4 + l] = (uint8_t)(L[j + l] | L[j + l + 32] << 2 | L[j + l + 64] << 4 | L[j + l + 96] << 6);
    }
}
static void quant_q2_k(const float *x, void *dst, int64_t n) { quant_q2_k_with(x, dst, n, &lk_kq_scalar); }
static void quant_q2_k_avx2(const float *x, void *dst, int64_t n) { quant_q2_k_with(x, dst, n, &lk_kq_avx2); }

/* ggml's make_q3_quants with rmse: L in [-nmax, nmax-1] for the scale
 * -nmax/max (max: the signed element of largest magnitude), then up to 5
 * passes that move single elements to the level that raises the weighted
 * (x^2) correlation sum(w x l)^2 / sum(w l^2). Returns the scale. */
static float q3_fit(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }
    if (amax < 1e-15f) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float iscale = -nmax / max, sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = lk_nearest(iscale * x[i]);
        l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
        L[i] = (int8_t)l;
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; itry++) {
        int changed = 0;
        for (int i = 0; i < n; i++) {
            float w = x[i] * x[i], slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                int nl = lk_nearest(x[i] * sl2 / slx);
                nl = nl < -nmax ? -nmax : nl > nmax - 1 ? nmax - 1 : nl;
                if (nl != L[i]) {
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)nl;
                        sumlx = slx;
                        suml2 = sl2;
                        changed++;
                    }
                }
            }
        }
        if (!changed) break;
    }
    return suml2 > 0 ? sumlx / suml2 : 0.0f;
}

/* Q3_K: per sub-block of 16 a symmetric 3-bit fit; the 16 scales to signed
 * 6 bits against d = max_scale / -32 (max_scale: the signed largest). */
static void quant_q3_k(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst;
    for (int64_t ib = 0; ib < n / LK_QK_K; ib++, x += LK_QK_K, b += LK_Q3K_BYTES) {
        int8_t L[LK_QK_K];
        float scales[16], max_scale = 0, amax = 0;
        for (int j = 0; j < 16; j++) {
            scales[j] = q3_fit(16, 4, x + 16 * j, L + 16 * j);
            if (fabsf(scales[j]) > amax) { amax = fabsf(scales[j]); max_scale = scales[j]; }
        }
        uint8_t *sc = b + LK_Q3K_SC;
        memset(sc, 0, 12);
        uint16_t hd = 0;
        if (max_scale != 0) {
            float iscale = -32.f / max_scale;
            for (int j = 0; j < 16; j++) {
                int l = lk_nearest(iscale * scales[j]);
                l = (l < -32 ? -32 : l > 31 ? 31 : l) + 32;
                if (j < 8) sc[j] = (uint8_t)(l & 0xF);
                else sc[j - 8] |= (uint8_t)((l & 0xF) << 4);
                sc[8 + j % 4] |= (uint8_t)((l >> 4) << (2 * (j / 4)));
            }
            hd = lk_fp32_to_fp16(1 / iscale);
        }
        memcpy(b + LK_Q3K_D, &hd, 2);
        int8_t s16[16];
        q3k_scales(sc, s16);
        uint8_t U[LK_QK_K];
        for (int j = 0; j < 16; j++) {
            const float d = lk_fp16_to_fp32(hd) * (float)s16[j];
            if (d == 0) {
                /* ggml keeps the fit's level here (L + 4) */
                for (int i = 0; i < 16; i++) U[16 * j + i] = (uint8_t)(L[16 * j + i] + 4);
                continue;
            }
            for (int i = 0; i < 16; i++) {
                int l = lk_nearest(x[16 * j + i] / d);
                U[16 * j + i] = (uint8_t)((l < -4 ? -4 : l > 3 ? 3 : l) + 4);
            }
        }
        uint8_t *hm = b;
        memset(hm, 0, 32);
        for (int e = 0; e < LK_QK_K; e++)
            if (U[e] > 3) {
                hm[e % 32] |= (uint8_t)(1 << (e / 32));
                U[e] -= 4;
            }
        uint8_t *qs = b + LK_Q3K_QS;
        for (int j = 0; j < LK_QK_K; j += 128)
            for (int l = 0; l < 32; l++)
                qs[j / 4 + l] = (uint8_t)(U[j + l] | U[j + l + 32] << 2 | U[j + l + 64] << 4 | U[j + l + 96] << 6);
    }
}

/* What both versions of qx_fit begin with: max (the signed element of
 * largest magnitude) and the first guess -nmax/max: its levels (+nmax) in
 * L, its scale and its weighted correlation best = scale * sum(w x l).
 * False for an all-zero sub-block (L zeroed, the scale 0). */
static bool qx_begin(int n, int nmax, const float *x, int8_t *L, float *max_out, float *scale, float *best) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }
    if (amax < 1e-15f) {
        memset(L, 0, (size_t)n);
        return false;
    }
    float iscale = -nmax / max, sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = lk_nearest(iscale * x[i]);
        l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
        L[i] = (int8_t)(l + nmax);
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    *max_out = max;
    *scale = suml2 != 0 ? sumlx / suml2 : 0.0f;
    *best = *scale * sumlx;
    return true;
}

/* ggml's make_qx_quants, rmse_type 1 (weights x^2): levels in
 * [-nmax, nmax-1] for the scale -nmax/max, then 18 nearby scales
 * -(nmax + 0.1 is)/max, keeping the best weighted correlation. L: l + nmax. */
static float qx_fit(int n, int nmax, const float *x, int8_t *L) {
    float max, scale, best;
    if (!qx_begin(n, nmax, x, L, &max, &scale, &best)) return 0.f;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        float iscale = -(nmax + 0.1f * is) / max;
        float sumlx = 0, suml2 = 0;
        for (int i = 0; i < n; i++) {
            int l = lk_nearest(iscale * x[i]);
            l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++) {
                int l = lk_nearest(iscale * x[i]);
                L[i] = (int8_t)(nmax + (l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* The same bits, the 18 candidate scales in 3 ymm of 8 lanes (AVX2 only, no
 * FMA: each lane does qx_fit's float operations in its order, vcvtps2dq
 * rounds as lk_nearest; test_quant_kq compares the bytes); only the choice
 * among the candidates, which depends on the best so far, stays sequential,
 * on their 18 pairs of sums. */
#define LK_T2_NOFMA __attribute__((target("avx2")))
LK_T2_NOFMA static float qx_fit_avx2(int n, int nmax, const float *x, int8_t *L) {
    enum { NC = 18, NV = 3 }; /* candidates is = -9..-1, 1..9 in lanes 0..17 */
    float max, scale, best;
    if (!qx_begin(n, nmax, x, L, &max, &scale, &best)) return 0.f;
    const __m256i lo = _mm256_set1_epi32(-nmax), hi = _mm256_set1_epi32(nmax - 1);
    __m256 isc[NV], slx[NV], sl2[NV];
    for (int v = 0; v < NV; v++) {
        __m256i c = _mm256_add_epi32(_mm256_set1_epi32(8 * v), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        /* is = c - 9 below 9, c - 8 from 9 on (lanes past 17: is 10..15, ignored) */
        __m256i is = _mm256_sub_epi32(c, _mm256_add_epi32(_mm256_set1_epi32(9), _mm256_cmpgt_epi32(c, _mm256_set1_epi32(8))));
        __m256 num = _mm256_add_ps(_mm256_set1_ps((float)nmax), _mm256_mul_ps(_mm256_set1_ps(0.1f), _mm256_cvtepi32_ps(is)));
        isc[v] = _mm256_div_ps(_mm256_xor_ps(num, _mm256_set1_ps(-0.f)), _mm256_set1_ps(max));
        slx[v] = sl2[v] = _mm256_setzero_ps();
    }
    for (int i = 0; i < n; i++) {
        const float w = x[i] * x[i];
        const __m256 vx = _mm256_set1_ps(x[i]), vw = _mm256_set1_ps(w), vwx = _mm256_set1_ps(w * x[i]);
        for (int v = 0; v < NV; v++) {
            __m256i li = _mm256_cvtps_epi32(_mm256_mul_ps(isc[v], vx));
            __m256 l = _mm256_cvtepi32_ps(_mm256_min_epi32(_mm256_max_epi32(li, lo), hi));
            slx[v] = _mm256_add_ps(slx[v], _mm256_mul_ps(vwx, l));
            sl2[v] = _mm256_add_ps(sl2[v], _mm256_mul_ps(_mm256_mul_ps(vw, l), l));
        }
    }
    _Alignas(32) float c_isc[8 * NV], c_slx[8 * NV], c_sl2[8 * NV];
    for (int v = 0; v < NV; v++) {
        _mm256_store_ps(c_isc + 8 * v, isc[v]);
        _mm256_store_ps(c_slx + 8 * v, slx[v]);
        _mm256_store_ps(c_sl2 + 8 * v, sl2[v]);
    }
    int win = -1;
    for (int c = 0; c < NC; c++)
        if (c_sl2[c] > 0 && c_slx[c] * c_slx[c] > best * c_sl2[c]) {
            win = c;
            scale = c_slx[c] / c_sl2[c];
            best = scale * c_slx[c];
        }
    if (win >= 0)
        for (int i = 0; i < n; i++) {
            int l = lk_nearest(c_isc[win] * x[i]);
            L[i] = (int8_t)(nmax + (l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l));
        }
    return scale;
}

/* Q6_K: per sub-block of 16 a 6-bit symmetric fit (qx_fit or its twin);
 * the scales to int8 against d = max_scale / -128. */
static void quant_q6_k_fit(const float *x, void *dst, int64_t n, float (*fit)(int, int, const float *, int8_t *)) {
    uint8_t *b = dst;
    for (int64_t ib = 0; ib < n / LK_QK_K; ib++, x += LK_QK_K, b += LK_Q6K_BYTES) {
        int8_t L[LK_QK_K];
        float scales[16], max_scale = 0, max_abs = 0;
        for (int j = 0; j < 16; j++) {
            scales[j] = fit(16, 32, x + 16 * j, L + 16 * j);
            if (fabsf(scales[j]) > max_abs) { max_abs = fabsf(scales[j]); max_scale = scales[j]; }
        }
        if (max_abs < 1e-15f) {
            memset(b, 0, LK_Q6K_BYTES);
            continue;
        }
        float iscale = -128.f / max_scale;
        uint16_t hd = lk_fp32_to_fp16(1 / iscale);
        memcpy(b + LK_Q6K_D, &hd, 2);
        int8_t *sc = (int8_t *)(b + LK_Q6K_SC);
        for (int j = 0; j < 16; j++) {
            int v = lk_nearest(iscale * scales[j]);
            sc[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; j++) {
            float d = lk_fp16_to_fp32(hd) * sc[j];
            if (d == 0) continue;
            for (int i = 0; i < 16; i++) {
                int l = lk_nearest(x[16 * j + i] / d);
                L[16 * j + i] = (int8_t)((l < -32 ? -32 : l > 31 ? 31 : l) + 32);
            }
        }
        uint8_t *ql = b + LK_Q6K_QL, *qh = b + LK_Q6K_QH;
        for (int j = 0; j < LK_QK_K; j += 128, ql += 64, qh += 32)
            for (int l = 0; l < 32; l++) {
                const uint8_t q1 = L[j + l] & 0xF, q2 = L[j + l + 32] & 0xF;
                const uint8_t q3 = L[j + l + 64] & 0xF, q4 = L[j + l + 96] & 0xF;
                ql[l] = (uint8_t)(q1 | q3 << 4);
                ql[l + 32] = (uint8_t)(q2 | q4 << 4);
                qh[l] = (uint8_t)((L[j + l] >> 4) | (L[j + l + 32] >> 4) << 2 | (L[j + l + 64] >> 4) << 4 |
                                  (L[j + l + 96] >> 4) << 6);
            }
    }
}
static void quant_q6_k(const float *x, void *dst, int64_t n) { quant_q6_k_fit(x, dst, n, qx_fit); }
static void quant_q6_k_avx2(const float *x, void *dst, int64_t n) { quant_q6_k_fit(x, dst, n, qx_fit_avx2); }

void lk_k23_fill_scalar(lk_quant_ops *ops) {
    ops->mm[LK_TYPE_Q2_K] = mm_q2_k;
    ops->mm[LK_TYPE_Q3_K] = mm_q3_k;
    ops->mm[LK_TYPE_IQ4_XS] = mm_iq4_xs;
    ops->quant[LK_TYPE_Q2_K] = quant_q2_k;
    ops->quant[LK_TYPE_Q3_K] = quant_q3_k;
    ops->quant[LK_TYPE_Q6_K] = quant_q6_k;
}

/* ===================================================================== */
/* AVX2                                                                    */
/* ===================================================================== */

/* The 16 signed Q3_K scales as bytes, unpacked in registers (a scalar
 * unpack stored to memory and reloaded as a vector stalled on store
 * forwarding: Q3_K decode ran at a third of the bandwidth): dword k holds
 * scales 4k..4k+3, low nibbles from bytes 0-7 (k >= 2: their high nibbles),
 * high 2 bits from bits 2k..2k+1 of bytes 8-11. */
LK_T2 static LK_INL __m128i q3k_scales_v(const uint8_t *p) {
    uint32_t a2;
    memcpy(&a2, p + 8, 4);
    __m128i x = _mm_shuffle_epi32(_mm_loadl_epi64((const __m128i *)p), 0x44); /* a0 a1 a0 a1 */
    x = _mm_and_si128(_mm_srlv_epi32(x, _mm_setr_epi32(0, 0, 4, 4)), _mm_set1_epi8(0x0F));
    __m128i h = _mm_srlv_epi32(_mm_set1_epi32((int)a2), _mm_setr_epi32(0, 2, 4, 6));
    h = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi8(3)), 4);
    return _mm_sub_epi8(_mm_or_si128(x, h), _mm_set1_epi8(32));
}

/* The 8 IQ4_XS sub-block scales (-32) as i16: nibbles of scales_l in
 * sub-block order, the 2-bit highs of scales_h spread to one per byte by
 * pdep. */
LK_T2 static LK_INL __m128i iq4xs_scales_v(const uint8_t *b) {
    uint32_t sl;
    memcpy(&sl, b + LK_IQ4XS_SL, 4);
    uint64_t hb = _pdep_u64(lk_ld_u16(b + LK_IQ4XS_SH), 0x0303030303030303ull);
    __m128i x = _mm_cvtsi32_si128((int)sl), m0f = _mm_set1_epi8(0x0F);
    __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(x, m0f), _mm_and_si128(_mm_srli_epi16(x, 4), m0f));
    __m128i ls = _mm_or_si128(nib, _mm_slli_epi16(_mm_cvtsi64_si128((long long)hb), 4));
    return _mm_sub_epi16(_mm_cvtepu8_epi16(ls), _mm_set1_epi16(32));
}

/* i16 word pattern selecting scale 2g (low 128-bit lane) and 2g+1 (high)
 * from a vector holding 8 i16 scales in each lane. */
LK_T2 static LK_INL __m256i pair_idx(int g) {
    return _mm256_setr_m128i(_mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * g))),
                             _mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * g + 1))));
}

/* One super-block of one row x one Q8_K row: kind 2 Q2_K, 3 Q3_K, 4 IQ4_XS. */
LK_T2 static LK_INL void k23_block2(const int kind, const uint8_t *w, const uint8_t *a, __m256 *acc, __m256 *accm) {
    const int8_t *q8 = (const int8_t *)(a + LK_Q8K_QS);
    const float da = lk_ld_f32(a);
    const __m256i m03 = _mm256_set1_epi8(3);
    __m256i isum = _mm256_setzero_si256();
    if (kind == 2 || kind == 3) {
        __m256i sc16, bs = _mm256_loadu_si256((const __m256i *)(a + LK_Q8K_BS)), hm = _mm256_setzero_si256();
        const uint8_t *qs;
        if (kind == 2) {
            __m128i s = _mm_loadu_si128((const __m128i *)w);
            sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(s, _mm_set1_epi8(0x0F)));
            __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), _mm_set1_epi8(0x0F)));
            *accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins, bs)),
                                    _mm256_set1_ps(lk_ld_h(w + LK_Q2K_D + 2) * da), *accm);
            qs = w + LK_Q2K_QS;
        } else {
            sc16 = _mm256_cvtepi8_epi16(q3k_scales_v(w + LK_Q3K_SC));
            hm = _mm256_loadu_si256((const __m256i *)w);
            qs = w + LK_Q3K_QS;
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            /* scales 8h..8h+7 in both 128-bit lanes */
            __m256i sch = h ? _mm256_permute4x64_epi64(sc16, 0xEE) : _mm256_permute4x64_epi64(sc16, 0x44); /* immediates (clang) */
            __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++) {
                __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * g), m03);
                if (kind == 3) { /* high bit: bit 4h+g of hmask[l] -> bit 2 */
                    __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + g), _mm256_set1_epi8(1));
                    v = _mm256_or_si256(v, _mm256_slli_epi16(hb, 2));
                }
                __m256i p = _mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i *)(q8 + 128 * h + 32 * g)));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, _mm256_shuffle_epi8(sch, pair_idx(g))));
            }
        }
        if (kind == 3) /* the -4 offset: 4 * sum_j s_j * bsum_j */
            isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 2));
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(lk_ld_h(w + (kind == 2 ? LK_Q2K_D : LK_Q3K_D)) * da),
                               *acc);
    } else {
        const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)k_iq4nl));
        const __m256i m0f = _mm256_set1_epi8(0x0F);
        const __m256i sc = _mm256_broadcastsi128_si256(iq4xs_scales_v(w));
#pragma GCC unroll 8
        for (int ib = 0; ib < 8; ib++) {
            __m128i q = _mm_loadu_si128((const __m128i *)(w + LK_IQ4XS_QS + 16 * ib));
            __m256i v = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1), m0f);
            __m256i wv = _mm256_shuffle_epi8(tab, v);
            __m256i av = _mm256_loadu_si256((const __m256i *)(q8 + 32 * ib));
            __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv));
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)(0x0100 + 0x0202 * ib)))));
        }
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(lk_ld_h(w) * da), *acc);
    }
}

LK_T2 static LK_INL void k23_tile2(const int R, const int T, const int kind, int64_t n, const uint8_t *w, size_t ws,
                                   const uint8_t *a, size_t as, float *y, size_t ys) {
    const size_t bb = kind == 2 ? LK_Q2K_BYTES : kind == 3 ? LK_Q3K_BYTES : LK_IQ4XS_BYTES;
    __m256 acc[4][4], accm[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps(), accm[r][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / LK_QK_K; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *wp = w + r * ws + (size_t)i * bb;
            pf_range_l1(wp, R * ws, bb);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                k23_block2(kind, wp, a + t * as + (size_t)i * LK_Q8K_BYTES, &acc[r][t], &accm[r][t]);
        }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) y[t * ys + r] = hsum8(acc[r][t]) - (kind == 2 ? hsum8(accm[r][t]) : 0.f);
}

#define LK_TILE_FN(attr, name, R, T, call)                                                 \
    attr static void name##_##R##x##T(int64_t n, const uint8_t *w, size_t ws,              \
                                      const uint8_t *a, size_t as, float *y, size_t ys) {  \
        call;                                                                              \
    }
/* decode 4 rows x 1 token; prefill 1 row x up to 4 tokens (as the other
 * K-quants: a super-block's decoded weights are too many registers to
 * keep several rows) */
#define LK_TILES_1x4(attr, name, CALL)                                                     \
    LK_TILE_FN(attr, name, 4, 1, CALL(4, 1)) LK_TILE_FN(attr, name, 1, 1, CALL(1, 1))      \
    LK_TILE_FN(attr, name, 1, 2, CALL(1, 2)) LK_TILE_FN(attr, name, 1, 3, CALL(1, 3))      \
    LK_TILE_FN(attr, name, 1, 4, CALL(1, 4))                                               \
    static const lk_tileset name##_set = {name##_4x1, name##_1x1, 1, 4,                    \
                                          {{NULL, name##_1x1, name##_1x2, name##_1x3, name##_1x4}, \
                                           {NULL, name##_1x1, name##_1x2, name##_1x3, name##_1x4}}};
#define LK_MM_FN(name)                                                                          \
    static void mm_##name(int64_t n, int64_t nrows, const void *w, size_t w_stride,             \
                          int64_t ntok, const void *a, size_t a_stride, float *y,               \
                          size_t y_stride) {                                                    \
        lk_quant_run_tiles(&name##_set, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride); \
    }

#define Q2K_2(R, T) k23_tile2(R, T, 2, n, w, ws, a, as, y, ys)
#define Q3K_2(R, T) k23_tile2(R, T, 3, n, w, ws, a, as, y, ys)
#define IQ4_2(R, T) k23_tile2(R, T, 4, n, w, ws, a, as, y, ys)
LK_TILES_1x4(LK_T2, q2ka2, Q2K_2)
LK_TILES_1x4(LK_T2, q3ka2, Q3K_2)
LK_TILES_1x4(LK_T2, iq4a2, IQ4_2)
LK_MM_FN(q2ka2)
LK_MM_FN(q3ka2)
LK_MM_FN(iq4a2)

void lk_k23_fill_avx2(lk_quant_ops *ops) {
    ops->mm[LK_TYPE_Q2_K] = mm_q2ka2;
    ops->mm[LK_TYPE_Q3_K] = mm_q3ka2;
    ops->mm[LK_TYPE_IQ4_XS] = mm_iq4a2;
    ops->quant[LK_TYPE_Q2_K] = quant_q2_k_avx2;
    ops->quant[LK_TYPE_Q6_K] = quant_q6_k_avx2;
}

/* ===================================================================== */
/* AVX-512 (F, BW, VL, DQ, VNNI)                                           */
/* ===================================================================== */

/* One super-block per step in 4 vectors of 64 elements (the activation's
 * natural order), as quant_avx512.c's Q6_K: vpdpbusd gives 16 lanes of 4
 * products, lanes 4i..4i+3 of vector k are sub-block 4k+i (of 16), and
 * vpdpwssd multiplies each lane by its sub-block's scale (an i16 in the
 * lane's low half, zero high half: lanes are at most 4*7*128, inside i16).
 * IQ4_XS (sub-blocks of 32, products up to 4*127*127) scales its lanes with
 * vpmulld instead. Written on a machine without AVX-512: the scalar
 * reference defines the values, tests/test_quant_types.c checks this code
 * wherever the CPU has it. */

/* lane index vectors: vector k's lanes 4i..4i+3 <- sub-block 4k+i */
LK_T512 static LK_INL __m512i sub16_idx(int k) {
    return _mm512_set_epi32(4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 2, 4 * k + 2, 4 * k + 2, 4 * k + 2,
                            4 * k + 1, 4 * k + 1, 4 * k + 1, 4 * k + 1, 4 * k, 4 * k, 4 * k, 4 * k);
}

/* bytes shifted right by s0 in the low 256 bits and s1 in the high 256 */
LK_T512 static LK_INL __m512i srl2(__m512i v, int s0, int s1) {
    return _mm512_srlv_epi16(v, _mm512_mask_mov_epi16(_mm512_set1_epi16((short)s0), 0xFFFF0000u, _mm512_set1_epi16((short)s1)));
}

LK_T512 static LK_INL void k23_block512(const int kind, const uint8_t *w, const uint8_t *a, __m512 *acc, __m256 *accm) {
    const float da = lk_ld_f32(a);
    __m512i isum = _mm512_setzero_si512();
    if (kind == 2 || kind == 3) {
        const __m512i m03 = _mm512_set1_epi8(3), m01 = _mm512_set1_epi8(1);
        __m256i bs = _mm256_loadu_si256((const __m256i *)(a + LK_Q8K_BS)), sc16;
        const uint8_t *qs;
        __m512i hm = _mm512_setzero_si512();
        if (kind == 2) {
            __m128i s = _mm_loadu_si128((const __m128i *)w);
            sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(s, _mm_set1_epi8(0x0F)));
            __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), _mm_set1_epi8(0x0F)));
            *accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins, bs)),
                                    _mm256_set1_ps(lk_ld_h(w + LK_Q2K_D + 2) * da), *accm);
            qs = w + LK_Q2K_QS;
        } else {
            sc16 = _mm256_cvtepi8_epi16(q3k_scales_v(w + LK_Q3K_SC));
            hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)w));
            qs = w + LK_Q3K_QS;
        }
        __m512i s32 = _mm512_cvtepu16_epi32(sc16); /* i16 scale in each lane's low half */
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            /* elements 64k..64k+63: half h = k/2, bit pairs 2g, 2g+2 (g = 2(k%2)) */
            int h = k / 2, g = 2 * (k % 2);
            __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * h)));
            __m512i v = _mm512_and_si512(srl2(q, 2 * g, 2 * g + 2), m03);
            if (kind == 3) /* high bits: bits 2k and 2k+1 of hmask[l] -> bit 2 */
                v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(srl2(hm, 2 * k, 2 * k + 1), m01), 2));
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_loadu_si512(a + LK_Q8K_QS + 64 * k));
            isum = _mm512_dpwssd_epi32(isum, p, _mm512_permutexvar_epi32(sub16_idx(k), s32));
        }
        if (kind == 3) {
            __m256i c = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 2);
            isum = _mm512_sub_epi32(isum, _mm512_zextsi256_si512(c));
        }
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum),
                               _mm512_set1_ps(lk_ld_h(w + (kind == 2 ? LK_Q2K_D : LK_Q3K_D)) * da), *acc);
    } else {
        const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)k_iq4nl));
        const __m512i m0f = _mm512_set1_epi8(0x0F);
        /* 128-bit lanes of vector k: [low nibbles | high nibbles] of the 16
         * bytes of sub-block 2k, then of 2k+1: elements 64k..64k+63 in order */
        const __m512i dup = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3);
        const __m512i sh = _mm512_setr_epi64(0, 0, 0x0004000400040004ll, 0x0004000400040004ll, 0, 0,
                                             0x0004000400040004ll, 0x0004000400040004ll);
        const __m512i s32 = _mm512_castsi256_si512(_mm256_cvtepi16_epi32(iq4xs_scales_v(w)));
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(w + LK_IQ4XS_QS + 32 * k));
            __m512i v = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi64(dup, _mm512_castsi256_si512(q)), sh), m0f);
            __m512i wv = _mm512_shuffle_epi8(tab, v);
            __m512i av = _mm512_loadu_si512(a + LK_Q8K_QS + 64 * k);
            av = _mm512_mask_sub_epi8(av, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), av);
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(wv), av);
            __m512i sc = _mm512_permutexvar_epi32(_mm512_mask_mov_epi32(_mm512_set1_epi32(2 * k), 0xFF00,
                                                                        _mm512_set1_epi32(2 * k + 1)), s32);
            isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(p, sc));
        }
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(lk_ld_h(w) * da), *acc);
    }
}

LK_T512 static LK_INL void k23_tile512(const int R, const int T, const int kind, int64_t n, const uint8_t *w,
                                       size_t ws, const uint8_t *a, size_t as, float *y, size_t ys) {
    const size_t bb = kind == 2 ? LK_Q2K_BYTES : kind == 3 ? LK_Q3K_BYTES : LK_IQ4XS_BYTES;
    __m512 acc[4][4];
    __m256 accm[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps(), accm[r][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / LK_QK_K; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *wp = w + r * ws + (size_t)i * bb;
            pf_range_l1(wp, R * ws, bb);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                k23_block512(kind, wp, a + t * as + (size_t)i * LK_Q8K_BYTES, &acc[r][t], &accm[r][t]);
        }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            y[t * ys + r] = _mm512_reduce_add_ps(acc[r][t]) - (kind == 2 ? hsum8(accm[r][t]) : 0.f);
}

#define Q2K_5(R, T) k23_tile512(R, T, 2, n, w, ws, a, as, y, ys)
#define Q3K_5(R, T) k23_tile512(R, T, 3, n, w, ws, a, as, y, ys)
#define IQ4_5(R, T) k23_tile512(R, T, 4, n, w, ws, a, as, y, ys)
LK_TILES_1x4(LK_T512, q2ka5, Q2K_5)
LK_TILES_1x4(LK_T512, q3ka5, Q3K_5)
LK_TILES_1x4(LK_T512, iq4a5, IQ4_5)
LK_MM_FN(q2ka5)
LK_MM_FN(q3ka5)
LK_MM_FN(iq4a5)

void lk_k23_fill_avx512(lk_quant_ops *ops) {
    ops->mm[LK_TYPE_Q2_K] = mm_q2ka5;
    ops->mm[LK_TYPE_Q3_K] = mm_q3ka5;
    ops->mm[LK_TYPE_IQ4_XS] = mm_iq4a5;
}
