/* K-quant weight quantisers with a min (Q4_K, Q5_K: `gen-model --type q4_k`
 * and `quantize`), following ggml's reference quantisers (no importance
 * matrix): per 32-element sub-block a weighted least-squares fit of scale
 * and min over a small grid of candidate scales, then 6-bit packing of the
 * sub-block scales and mins against the super-block's d and dmin. The
 * weights favour large-magnitude elements (sqrt(mean x^2) + |x|). Matching
 * the reference makes our files byte-identical to llama-quantize's
 * (tests/test_quant_kq.c checks against synth-llama-q4_k_m and q5_k_m).
 *
 * The fit itself (lk_kfit_scale_min) also serves Q2_K (quant_k23.c), and
 * has an AVX2 twin that returns the same bits: the search is nearly all of
 * the quantisers' time. */
#include "quant/quant_impl.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

/* What both versions of the search begin with: min (<= 0), max, the
 * weight sums, and the first guess nmax / (max - min): its levels in L, its
 * scale and weighted error. False for a constant sub-block (L zeroed,
 * *neg_min set): nothing to search. */
typedef struct { float min, max, sum_w, sum_x, scale, best; } kfit_start;

static bool kfit_begin(const lk_kfit *p, int n, const float *x, const float *w, uint8_t *L, float *neg_min,
                       kfit_start *s) {
    const int nmax = p->nmax;
    float min = x[0], max = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        memset(L, 0, (size_t)n);
        *neg_min = -min;
        return false;
    }
    float iscale = nmax / (max - min), scale = 1 / iscale, best = 0;
    for (int i = 0; i < n; i++) {
        int l = lk_nearest(iscale * (x[i] - min));
        L[i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
        float diff = scale * L[i] + min - x[i];
        diff = p->use_mad ? fabsf(diff) : diff * diff;
        best += w[i] * diff;
    }
    *s = (kfit_start){min, max, sum_w, sum_x, scale, best};
    return true;
}

/* ggml's make_qkx2_quants, in its float operations and their order (the
 * error is w * (diff * diff)). */
float lk_kfit_scale_min(const lk_kfit *p, int n, const float *x, const float *w, uint8_t *L, float *neg_min) {
    const int nmax = p->nmax;
    uint8_t Laux[32];
    LK_ASSERT(n <= 32);
    kfit_start s0;
    if (!kfit_begin(p, n, x, w, L, neg_min, &s0)) return 0.f;
    float min = s0.min, max = s0.max, sum_w = s0.sum_w, sum_x = s0.sum_x, scale = s0.scale, best = s0.best;
    for (int is = 0; is <= p->nstep; is++) {
        float iscale = (p->rmin + p->rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = lk_nearest(iscale * (x[i] - min));
            l = l < 0 ? 0 : l > nmax ? nmax : l;
            Laux[i] = (uint8_t)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float err = 0;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = p->use_mad ? fabsf(diff) : diff * diff;
                err += w[i] * diff;
            }
            if (err < best) {
                memcpy(L, Laux, (size_t)n);
                best = err;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *neg_min = -min;
    return scale;
}

/* The same search, 8 candidate scales at a time in the lanes of a ymm (AVX2;
 * FMA deliberately not enabled, so no compiler may fuse a multiply and an
 * add here: every lane does the scalar code's float operations in its order,
 * and rounds with vcvtps2dq, which lk_nearest mirrors, so the result is the
 * scalar one bit for bit; test_quant_kq checks the bytes). The reference's
 * loop is sequential in one way: a candidate that wins replaces `min`, and
 * the later candidates use the new min (in x - min and in max - min). So a
 * window of 8 candidates is tried with the current min, the first winner
 * in it is taken, and the next window starts just after it (after the
 * window when none won): each candidate the reference tries with some min
 * is tried here with the same min, in a few windows instead of 16-21
 * scalar passes. */
#define LK_T2 __attribute__((target("avx2")))

LK_T2 float lk_kfit_scale_min_avx2(const lk_kfit *p, int n, const float *x, const float *w, uint8_t *L,
                                   float *neg_min) {
    enum { NMAX_N = 32 };
    const int nmax = p->nmax, nstep = p->nstep;
    LK_ASSERT(n <= NMAX_N);
    kfit_start s0;
    if (!kfit_begin(p, n, x, w, L, neg_min, &s0)) return 0.f;
    float min = s0.min, scale = s0.scale, best = s0.best;
    const float max = s0.max;
    float win_iscale = 0, win_min = 0; /* the last winner's iscale and the min it used */
    bool won = false;
    const __m256 zero = _mm256_setzero_ps(), vsw = _mm256_set1_ps(s0.sum_w), vsx = _mm256_set1_ps(s0.sum_x);
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i izero = _mm256_setzero_si256(), imax = _mm256_set1_epi32(nmax);
    for (int c0 = 0; c0 <= nstep;) {
        /* lanes: candidates c0..c0+7 (those past nstep are computed and ignored) */
        __m256 isv = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_set1_epi32(c0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        __m256 isc = _mm256_div_ps(_mm256_add_ps(_mm256_add_ps(_mm256_set1_ps(p->rmin), _mm256_mul_ps(_mm256_set1_ps(p->rdelta), isv)),
                                                 _mm256_set1_ps((float)nmax)),
                                   _mm256_set1_ps(max - min));
        __m256 sl = zero, sl2 = zero, sxl = zero, lv[NMAX_N];
        for (int i = 0; i < n; i++) {
            __m256i li = _mm256_cvtps_epi32(_mm256_mul_ps(isc, _mm256_set1_ps(x[i] - min)));
            __m256 l = _mm256_cvtepi32_ps(_mm256_min_epi32(_mm256_max_epi32(li, izero), imax));
            lv[i] = l;
            __m256 wl = _mm256_mul_ps(_mm256_set1_ps(w[i]), l);
            sl = _mm256_add_ps(sl, wl);
            sl2 = _mm256_add_ps(sl2, _mm256_mul_ps(wl, l));
            sxl = _mm256_add_ps(sxl, _mm256_mul_ps(wl, _mm256_set1_ps(x[i])));
        }
        __m256 D = _mm256_sub_ps(_mm256_mul_ps(vsw, sl2), _mm256_mul_ps(sl, sl));
        __m256 tsc = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(vsw, sxl), _mm256_mul_ps(vsx, sl)), D);
        __m256 tmn = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sl2, vsx), _mm256_mul_ps(sl, sxl)), D);
        __m256 pos = _mm256_cmp_ps(tmn, zero, _CMP_GT_OQ);
        tmn = _mm256_blendv_ps(tmn, zero, pos);
        tsc = _mm256_blendv_ps(tsc, _mm256_div_ps(sxl, sl2), pos);
        __m256 err = zero;
        for (int i = 0; i < n; i++) {
            __m256 diff = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(tsc, lv[i]), tmn), _mm256_set1_ps(x[i]));
            diff = p->use_mad ? _mm256_andnot_ps(sign, diff) : _mm256_mul_ps(diff, diff);
            err = _mm256_add_ps(err, _mm256_mul_ps(_mm256_set1_ps(w[i]), diff));
        }
        /* the winners: D > 0 and err < best (ordered: NaN never wins) */
        __m256 ok = _mm256_and_ps(_mm256_cmp_ps(D, zero, _CMP_GT_OQ), _mm256_cmp_ps(err, _mm256_set1_ps(best), _CMP_LT_OQ));
        unsigned mask = (unsigned)_mm256_movemask_ps(ok) & (nstep - c0 >= 7 ? 0xFFu : (1u << (nstep - c0 + 1)) - 1);
        if (!mask) {
            c0 += 8;
            continue;
        }
        const int k = __builtin_ctz(mask);
        _Alignas(32) float c_err[8], c_scale[8], c_min[8], c_isc[8];
        _mm256_store_ps(c_err, err);
        _mm256_store_ps(c_scale, tsc);
        _mm256_store_ps(c_min, tmn);
        _mm256_store_ps(c_isc, isc);
        best = c_err[k];
        scale = c_scale[k];
        win_iscale = c_isc[k];
        win_min = min;
        min = c_min[k];
        won = true;
        c0 += k + 1;
    }
    if (won)
        for (int i = 0; i < n; i++) {
            int l = lk_nearest(win_iscale * (x[i] - win_min));
            L[i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
        }
    *neg_min = -min;
    return scale;
}

void lk_klevels(const float *x, int n, float dm, float d, int nmax, uint8_t *L) {
    for (int i = 0; i < n; i++) {
        int v = lk_nearest((x[i] + dm) / d);
        L[i] = (uint8_t)(v < 0 ? 0 : v > nmax ? nmax : v);
    }
}

/* The same per element, 8 at a time (vdivps is vdivss 8 times over). */
LK_T2 void lk_klevels_avx2(const float *x, int n, float dm, float d, int nmax, uint8_t *L) {
    const __m256 vdm = _mm256_set1_ps(dm), vd = _mm256_set1_ps(d);
    const __m256i hi = _mm256_set1_epi32(nmax);
    LK_ASSERT(n % 8 == 0);
    for (int i = 0; i < n; i += 8) {
        __m256i q = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_add_ps(_mm256_loadu_ps(x + i), vdm), vd));
        q = _mm256_min_epi32(_mm256_max_epi32(q, _mm256_setzero_si256()), hi);
        __m128i q16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(L + i), _mm_packus_epi16(q16, q16));
    }
}

const lk_kq_impl lk_kq_scalar = {lk_kfit_scale_min, lk_klevels};
const lk_kq_impl lk_kq_avx2 = {lk_kfit_scale_min_avx2, lk_klevels_avx2};

/* Q4_K (bits 4) and Q5_K (bits 5): the same fit per sub-block of 32 on
 * their grids (ggml's: Q4_K 21 scales from nmax - 1, Q5_K 16 from
 * nmax - 0.5), the same 6-bit scale packing; they differ in the packing of
 * the levels (Q5_K's fifth bits in qh). */
static void quantize_row_k45(const int bits, const float *x, void *dst, int64_t n, const lk_kq_impl *im) {
    const lk_kfit p = bits == 4 ? (lk_kfit){15, 20, -1.f, 0.1f, false} : (lk_kfit){31, 15, -0.5f, 0.1f, false};
    const size_t bb = bits == 4 ? LK_Q4K_BYTES : LK_Q5K_BYTES;
    uint8_t *b = dst;
    for (int64_t ib = 0; ib < n / LK_QK_K; ib++, x += LK_QK_K, b += bb) {
        uint8_t L[LK_QK_K];
        float w[32], mins[8], scales[8], max_scale = 0, max_min = 0;
        for (int j = 0; j < 8; j++) {
            const float *xs = x + 32 * j;
            float sum_x2 = 0;
            for (int l = 0; l < 32; l++) sum_x2 += xs[l] * xs[l];
            float av_x = sqrtf(sum_x2 / 32);
            for (int l = 0; l < 32; l++) w[l] = av_x + fabsf(xs[l]);
            scales[j] = im->fit(&p, 32, xs, w, L + 32 * j, &mins[j]);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_min = max_min > 0 ? 63.f / max_min : 0.f;
        uint8_t *sc = b + LK_Q4K_SC; /* = LK_Q5K_SC */
        memset(sc, 0, 12);
        for (int j = 0; j < 8; j++) {
            int ls = lk_nearest(inv_scale * scales[j]), lm = lk_nearest(inv_min * mins[j]);
            ls = ls > 63 ? 63 : ls;
            lm = lm > 63 ? 63 : lm;
            /* 6-bit packing: sub-blocks 0-3 in the low 6 bits of bytes 0-3
             * (scales) and 4-7 (mins); sub-blocks 4-7 as nibbles in bytes
             * 8-11 with their top 2 bits in the top bits of bytes 0-7 */
            if (j < 4) {
                sc[j] = (uint8_t)ls;
                sc[j + 4] = (uint8_t)lm;
            } else {
                sc[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
                sc[j - 4] |= (uint8_t)((unsigned)ls >> 4 << 6); /* unsigned: the same low bits, */
                sc[j] |= (uint8_t)((unsigned)lm >> 4 << 6);     /* defined for a NaN's INT_MIN */
            }
        }
        uint16_t hd = lk_fp32_to_fp16(max_scale / 63.f), hm = lk_fp32_to_fp16(max_min / 63.f);
        memcpy(b, &hd, 2);
        memcpy(b + 2, &hm, 2);
        const float d_all = lk_fp16_to_fp32(hd), dmin_all = lk_fp16_to_fp32(hm);
        for (int j = 0; j < 8; j++) {
            uint8_t s, m;
            lk_k_scale_min(j, sc, &s, &m);
            const float d = d_all * s;
            if (d == 0) continue;
            im->levels(x + 32 * j, 32, dmin_all * m, d, p.nmax, L + 32 * j);
        }
        if (bits == 4) {
            uint8_t *q = b + LK_Q4K_QS;
            for (int j = 0; j < LK_QK_K; j += 64, q += 32)
                for (int l = 0; l < 32; l++) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
            continue;
        }
        /* Q5_K: low nibbles as Q4_K; the fifth bit of element j + l (j a
         * multiple of 64) in bit j/32 of qh[l], of j + l + 32 in bit j/32 + 1 */
        uint8_t *qh = b + LK_Q5K_QH, *ql = b + LK_Q5K_QS;
        memset(qh, 0, 32);
        uint8_t m1 = 1, m2 = 2;
        for (int j = 0; j < LK_QK_K; j += 64, ql += 32, m1 <<= 2, m2 <<= 2)
            for (int l = 0; l < 32; l++) {
                int l1 = L[j + l], l2 = L[j + l + 32];
                if (l1 > 15) { l1 -= 16; qh[l] |= m1; }
                if (l2 > 15) { l2 -= 16; qh[l] |= m2; }
                ql[l] = (uint8_t)(l1 | l2 << 4);
            }
    }
}

void lk_quantize_row_q4_k(const float *x, void *dst, int64_t n) { quantize_row_k45(4, x, dst, n, &lk_kq_scalar); }
void lk_quantize_row_q4_k_avx2(const float *x, void *dst, int64_t n) {
    quantize_row_k45(4, x, dst, n, &lk_kq_avx2);
}
void lk_quantize_row_q5_k(const float *x, void *dst, int64_t n) { quantize_row_k45(5, x, dst, n, &lk_kq_scalar); }
void lk_quantize_row_q5_k_avx2(const float *x, void *dst, int64_t n) {
    quantize_row_k45(5, x, dst, n, &lk_kq_avx2);
}
