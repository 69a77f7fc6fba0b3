/* Small F32 vector kernels for attention: scores of queries against cached
 * keys and weighted sums of cached values (an F16 cache's pages widened to
 * F32 as they are loaded, which is exact: the bits of the F32 kernels on
 * the widened pages); and the exponentials of softmax and SwiGLU.
 * gcc does not vectorise float reductions at -O2 (it may not reorder the
 * sums), so the SIMD versions are written out; the level is chosen once at
 * run time.
 *
 * Every level gives the same bits (a cluster of AVX-512, AVX2 and scalar
 * nodes, or a Mac beside a PC, must agree), so every level does the same
 * float operations on every element, in the same order; the scalar code is
 * that arithmetic written out lane by lane, the reference a new level
 * copies:
 *   - a dot product keeps 32 partial sums, element i below the last
 *     multiple of 8 going to partial i mod 32 by a fused multiply-add (AVX2:
 *     4 registers of 8; AVX-512: 2 of 16); sum32() adds them by halves,
 *     32 -> 16 -> 8 -> 4 -> 2 -> 1; the last n mod 8 elements are fused
 *     onto that sum in order;
 *   - an axpy is one fused multiply-add per element;
 *   - e^x is exp_poly() (Cody-Waite reduction, a degree-7 polynomial in
 *     fused multiply-adds, scaled by 2^k): within 2 ulp of expf, and the
 *     same function at every level, which libm's expf is not;
 *   - exp_sum adds the exponentials in double into 16 partial sums, element
 *     i to partial i mod 16, summed by halves like sum32's last steps;
 *   - sumsq (RMSNorm's sum of squares, in double like ggml) adds x*x, exact
 *     in double, into 8 partial sums, element i to partial i mod 8 (the
 *     last n mod 8 elements to partials 0, 1, ... in order), then
 *     ((s0+s4)+(s1+s5))+((s2+s6)+(s3+s7));
 *   - attention's kernels keep the keys in the lanes, so each lane is one
 *     key's scalar code: a score is a chain of fused multiply-adds over the
 *     head's elements in order; the running softmax's sums go in double,
 *     key p into partial p mod 8 (qk_scalar, sm_scalar). */
#include "kernels/kernels.h"
#include "quant/simd_x86.h"

#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* The SIMD kernels' reduction of 32 float partial sums: the upper half
 * added onto the lower, lane by lane, until one is left (AVX2: 4 registers
 * -> 2 -> 1, then hsum256; AVX-512: 2 -> 1 -> its halves, then hsum256). */
static float sum32(float p[32]) {
    for (int w = 16; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) p[j] += p[j + w];
    return p[0];
}

/* lk_fmaf (kernels.h): one rounding per multiply-add, as the SIMD levels'
 * FMA instructions. */
static float dot_scalar(const float *a, const float *b, int64_t n) {
    float p[32] = {0};
    const int64_t n8 = n & ~(int64_t)7;
    for (int64_t i = 0; i < n8; i++) p[i % 32] = lk_fmaf(a[i], b[i], p[i % 32]);
    float s = sum32(p);
    for (int64_t i = n8; i < n; i++) s = lk_fmaf(a[i], b[i], s);
    return s;
}
static void axpy_scalar(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = lk_fmaf(a, x[i], y[i]);
}
/* fp16 -> fp32 is exact: every level gives the same values */
static void f16_to_f32_scalar(float *y, const uint16_t *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = lk_fp16_to_fp32(x[i]);
}

/* e^x: x = k ln2 + r (Cody-Waite: ln2 in two parts, |r| <= ln2/2), e^r by
 * its Taylor polynomial to degree 7 (truncation below 5e-9 relative), times
 * 2^k; within 2 ulp of expf. Below -87.3 (and NaN) it is 0 (expf: a
 * denormal or 0), above 88.7 it saturates at ~3e38 (expf: inf). The SIMD
 * versions (exp256, exp512) do these operations per lane. */
#define EXP_LO (-87.3f)
#define EXP_HI 88.7f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693145751953125f
#define EXP_LN2_LO 1.428606765330187e-06f
/* 2^e for e in [-126, 127], from its bits */
static inline float pow2i(int e) {
    const uint32_t u = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float exp_poly(float x) {
    if (!(x >= EXP_LO)) return 0;
    x = x > EXP_HI ? EXP_HI : x;
    /* k = x log2(e) rounded to nearest, ties to even (|k| < 2^22: adding
     * and subtracting 1.5 2^23 leaves no fraction bits; rintf is a libm call) */
    const float k = (x * EXP_LOG2E + 0x1.8p23f) - 0x1.8p23f;
    float r = lk_fmaf(-k, EXP_LN2_HI, x);
    r = lk_fmaf(-k, EXP_LN2_LO, r);
    float p = 1.f / 5040;
    p = lk_fmaf(p, r, 1.f / 720);
    p = lk_fmaf(p, r, 1.f / 120);
    p = lk_fmaf(p, r, 1.f / 24);
    p = lk_fmaf(p, r, 1.f / 6);
    p = lk_fmaf(p, r, 0.5f);
    p = lk_fmaf(p, r, 1.f);
    p = lk_fmaf(p, r, 1.f);
    /* p 2^k with one rounding (to a denormal near EXP_LO, else exact), in
     * two exact powers of two since 2^128 is not a float */
    const int ki = (int)k, k1 = ki / 2;
    return p * pow2i(k1) * pow2i(ki - k1);
}

/* The sum in double, as llama.cpp's ggml_float; 16 partials (see above). */
static double expsum_scalar(float *x, int64_t n, float sub) {
    double p[16] = {0};
    for (int64_t i = 0; i < n; i++) {
        x[i] = exp_poly(x[i] - sub);
        p[i % 16] += x[i];
    }
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) p[j] += p[j + w];
    return p[0];
}
static double sumsq_fold(const double s[8]) { return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7])); }

static double sumsq_scalar(const float *x, int64_t n) {
    double s[8] = { 0 };
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += (double)x[i + j] * x[i + j];
    for (int j = 0; i < n; i++, j++) s[j] += (double)x[i] * x[i];
    return sumsq_fold(s);
}

/* The largest element, NaN skipped (a NaN never compares greater), and
 * x[i] *= s: both exact, so every level gives the same bits. */
static float max_scalar(const float *x, int64_t n) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}
static void scale_scalar(float *x, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}
/* RMSNorm's last pass, out[i] = (x[i] * s) * w[i]: two exact roundings in
 * that order at every level (no fused multiply-add) */
static void scale_mul_scalar(float *out, const float *x, float s, const float *w, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * s * w[i];
}

static void swiglu_scalar(float *gate, const float *up, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        gate[i] = g / (1.0f + exp_poly(-g)) * up[i];
    }
}

/* ---- attention with the keys in lanes (lk_vec_attn_qk, _softmax).
 * The reference, which every level copies lane by lane: a score is one
 * fused multiply-add per element of the head, in order, from 0; the
 * softmax's first pass (scaling, soft-capping, the largest; exact per
 * element, a NaN never compares greater) runs over a query's live keys, the
 * factor of the old sum is exp_poly(old - new) when the maximum grows, and
 * the block's exponentials are added in double, key p into partial p mod 8
 * in key order from 0, the partials then as ((0 + 4) + (2 + 6)) + ((1 + 5)
 * + (3 + 7)) (att_fold), that block sum onto the old sum times the
 * factor. */
/* Key p's first element in pages K of F32 (h false) or F16 (h true):
 * the kernels take a page as a pointer of either kind (lk_vec_attn_qk,
 * _qk_f16 copy theirs into one array) */
static inline const void *att_key(const void *const *K, bool h, int64_t p) {
    return (const char *)K[p / LK_ATT_KW] + (size_t)(p % LK_ATT_KW) * (h ? 2 : 4);
}
/* element i of x, F32 or F16 (h: widened) */
static inline float att_elem(bool h, const void *x, int64_t i) {
    return h ? lk_fp16_to_fp32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}
static void qk_scalar(float *S, size_t ss, const float *q, size_t qs, int nq, const void *const *K, bool h, int64_t nk,
                      int64_t hd) {
    for (int g = 0; g < nq; g++)
        for (int64_t p = 0; p < nk; p++) {
            const void *k = att_key(K, h, p);
            float acc = 0.f;
            for (int64_t d = 0; d < hd; d++)
                acc = lk_fmaf(q[(size_t)g * qs + (size_t)d], att_elem(h, k, d * LK_ATT_KW), acc);
            S[(size_t)g * ss + (size_t)p] = acc;
        }
}
static inline double att_fold(const double s[8]) { return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7])); }
/* the factor step: bm, the block's largest, against the running mx */
static inline float att_grow(float bm, float *mx) {
    float al = 1.f;
    if (bm > *mx) {
        if (*mx != -INFINITY) al = exp_poly(*mx - bm);
        *mx = bm;
    }
    return al;
}
/* a row's first pass: its live keys [a, b) scaled (and capped) in place, their largest */
static float sm_first(float *x, int64_t a, int64_t b, float scale, float cap) {
    float bm = -INFINITY;
    for (int64_t p = a; p < b; p++) {
        float v = x[p] * scale;
        if (cap > 0) v = cap * tanhf(v / cap);
        x[p] = v;
        bm = v > bm ? v : bm;
    }
    return bm;
}
static void sm_scalar(float *S, size_t ss, int64_t nb, const int32_t *a, const int32_t *b, int nq, float scale,
                      float cap, float *mx, double *sum, float *al) {
    const int64_t nr = (nb + 15) / 16 * 16;
    for (int g = 0; g < nq; g++) {
        float *x = S + (size_t)g * ss;
        al[g] = att_grow(sm_first(x, a[g], b[g], scale, cap), &mx[g]);
        double ps[8] = {0};
        for (int64_t p = 0; p < nr; p++) {
            x[p] = p >= a[g] && p < b[g] ? exp_poly(x[p] - mx[g]) : 0.f;
            ps[p % 8] += x[p];
        }
        sum[g] = sum[g] * al[g] + att_fold(ps);
    }
}

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512vl,avx2,fma,f16c")))

/* sum32's last steps on 8 lanes: 8 -> 4 -> 2 -> 1 */
AVX2 static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* sumsq: partials 0-3 and 4-7 in two registers (the product of two floats
 * is exact in double, so a fused multiply-add rounds as the add does) */
AVX2 static double sumsq_avx2(const float *x, int64_t n) {
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), b = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
        lo = _mm256_fmadd_pd(a, a, lo);
        hi = _mm256_fmadd_pd(b, b, hi);
    }
    double s[8];
    _mm256_storeu_pd(s, lo);
    _mm256_storeu_pd(s + 4, hi);
    for (int j = 0; i < n; i++, j++) s[j] += (double)x[i] * x[i];
    return sumsq_fold(s);
}

/* expsum's last steps on 4 doubles: 4 -> 2 -> 1 */
AVX2 static inline double hsum256d(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
}
AVX2 static inline __m256 ld_f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* Partials 0-7, 8-15, 16-23, 24-31 in s0..s3; after the blocks of 32,
 * what is left in blocks of 8 goes to s0, s1, s2, as its elements are
 * those partials. */
AVX2 static float dot_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    if (i + 8 <= n) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0), i += 8;
        if (i + 8 <= n) {
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s1), i += 8;
            if (i + 8 <= n) s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s2), i += 8;
        }
    }
    float r = hsum256(_mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3)));
    for (; i < n; i++) r = fmaf(a[i], b[i], r);
    return r;
}

AVX2 static void axpy_avx2(float *y, float a, const float *x, int64_t n) {
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}
AVX2 static void f16_to_f32_avx2(float *y, const uint16_t *x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, ld_f16x8(x + i));
    for (; i < n; i++) y[i] = lk_fp16_to_fp32(x[i]);
}
/* maxps gives its second operand when either is NaN: the running maximum,
 * as max_scalar's comparison does. Softmax's max and scale passes ran one
 * scalar element a time: 5 % of a 1024-token prefill, five times its
 * exponentials. */
AVX2 static float max_avx2(const float *x, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + i), m);
    float l[8];
    _mm256_storeu_ps(l, m);
    /* the lanes, then the tail: the scalar order's comparisons */
    const float r = max_scalar(l, 8), t = max_scalar(x + i, n - i);
    return t > r ? t : r;
}
AVX2 static void scale_avx2(float *x, int64_t n, float s) {
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
    for (; i < n; i++) x[i] *= s;
}
AVX2 static void scale_mul_avx2(float *out, const float *x, float s, const float *w, int64_t n) {
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs), _mm256_loadu_ps(w + i)));
    scale_mul_scalar(out + i, x + i, s, w + i, n - i);
}

/* exp_poly on 8 lanes. 2^k is applied as two exact powers of two, 2^(k/2)
 * and 2^(k - k/2), both normal for k in [-126, 128] (2^128 is not a float):
 * the first product is exact, the second rounds once, as ldexpf does. */
AVX2 static inline __m256 exp256(__m256 x) {
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(1.f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i ki = _mm256_cvtps_epi32(k), k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
    const __m256i bias = _mm256_set1_epi32(127);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23)));
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23)));
    return _mm256_and_ps(p, live); /* NaN and below EXP_LO: 0 */
}
/* Lanes [0, m) of 8 as an all-ones mask. */
AVX2 static inline __m256i first_lanes(int64_t m) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)LK_MIN(m, 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
AVX2 static double expsum_avx2(float *x, int64_t n, float sub) {
    const __m256 vs = _mm256_set1_ps(sub);
    __m256d p[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    for (int64_t i = 0; i < n; i += 16)
        for (int h = 0; h < 2; h++) { /* partials 8h .. 8h+7 in p[2h], p[2h+1] */
            const __m256i m = first_lanes(n - i - 8 * h);
            const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_maskload_ps(x + i + 8 * h, m), vs)),
                                           _mm256_castsi256_ps(m));
            _mm256_maskstore_ps(x + i + 8 * h, m, e);
            p[2 * h] = _mm256_add_pd(p[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            p[2 * h + 1] = _mm256_add_pd(p[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
    return hsum256d(_mm256_add_pd(_mm256_add_pd(p[0], p[2]), _mm256_add_pd(p[1], p[3])));
}
/* Attention's scores with the keys in lanes (qk_scalar's chain per lane):
 * tiles of QG queries x V vectors of VW keys, the queries broadcast. A
 * tile's vector v is keys [VW v, VW v + VW) of the block, in page VW v /
 * LK_ATT_KW. */
typedef void (*qkt_fn)(float *S, size_t ss, const float *q, size_t qs, const void *const *K, int64_t v0, int64_t hd);
/* Query groups of 8, 4, 2, 1; per group the vectors in tiles of
 * vmax[group], then one each of the halves below it: tab[group][i] has V =
 * vmax >> i. A group of 8 reads a block's keys once for a decode head
 * group of 8, where 4 + 4 read them twice (on a 2-core Zen 5 the two
 * measured alike: decode at 2048 positions 50.4-53.7 against 50.1-52.9
 * tok/s). */
static void qk_drive(const qkt_fn tab[4][4], const int vmax[4], int vw, float *S, size_t ss, const float *q,
                     size_t qs, int nq, const void *const *K, int64_t nk, int64_t hd) {
    const int64_t nv = (nk + vw - 1) / vw;
    for (int g = 0; g < nq;) {
        const int gi = nq - g >= 8 ? 0 : nq - g >= 4 ? 1 : nq - g >= 2 ? 2 : 3;
        int64_t v = 0;
        for (int i = 0; i < 4 && (vmax[gi] >> i) >= 1; i++) {
            const int V = vmax[gi] >> i;
            while (nv - v >= V) {
                tab[gi][i](S + (size_t)g * ss, ss, q + (size_t)g * qs, qs, K, v, hd);
                v += V;
                if (i) break;
            }
        }
        g += 8 >> gi;
    }
}
AVX2 static LK_INL void qk8_tile(const int QG, const int V, const bool H, float *S, size_t ss, const float *q,
                                 size_t qs, const void *const *K, int64_t v0, int64_t hd) {
    __m256 acc[8][8];
    const void *kp[8];
#pragma GCC unroll 8
    for (int j = 0; j < V; j++) kp[j] = att_key(K, H, (v0 + j) * 8);
#pragma GCC unroll 8
    for (int g = 0; g < QG; g++)
#pragma GCC unroll 8
        for (int j = 0; j < V; j++)
            acc[g][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
        __m256 k[8];
#pragma GCC unroll 8
        for (int j = 0; j < V; j++)
            k[j] = H ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)kp[j] + d * LK_ATT_KW)))
                     : _mm256_loadu_ps((const float *)kp[j] + d * LK_ATT_KW);
#pragma GCC unroll 8
        for (int g = 0; g < QG; g++) {
            const __m256 qb = _mm256_broadcast_ss(q + (size_t)g * qs + (size_t)d);
#pragma GCC unroll 8
            for (int j = 0; j < V; j++) acc[g][j] = _mm256_fmadd_ps(qb, k[j], acc[g][j]);
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < QG; g++)
#pragma GCC unroll 8
        for (int j = 0; j < V; j++) _mm256_storeu_ps(S + (size_t)g * ss + (size_t)(v0 + j) * 8, acc[g][j]);
}
/* qk8_T_QG_V: T f (F32 keys) or h (F16 keys, H: widened as they are loaded) */
#define QK8_FN(T, H, QG, V)                                                                                     \
    AVX2 static void qk8_##T##_##QG##_##V(float *S, size_t ss, const float *q, size_t qs, const void *const *K,  \
                                          int64_t v0, int64_t hd) {                                             \
        qk8_tile(QG, V, H, S, ss, q, qs, K, v0, hd);                                                              \
    }
#define QK8_FNS(T, H)                                                                                           \
    QK8_FN(T, H, 8, 1) QK8_FN(T, H, 4, 2) QK8_FN(T, H, 4, 1) QK8_FN(T, H, 2, 4) QK8_FN(T, H, 2, 2)              \
    QK8_FN(T, H, 2, 1) QK8_FN(T, H, 1, 8) QK8_FN(T, H, 1, 4) QK8_FN(T, H, 1, 2) QK8_FN(T, H, 1, 1)              \
    static const qkt_fn k_qk8_##T[4][4] = {{qk8_##T##_8_1},                                                     \
                                           {qk8_##T##_4_2, qk8_##T##_4_1},                                      \
                                           {qk8_##T##_2_4, qk8_##T##_2_2, qk8_##T##_2_1},                       \
                                           {qk8_##T##_1_8, qk8_##T##_1_4, qk8_##T##_1_2, qk8_##T##_1_1}};
QK8_FNS(f, false)
QK8_FNS(h, true)
static const int k_qk8_vmax[4] = {1, 2, 4, 8};
AVX2 static void qk_avx2(float *S, size_t ss, const float *q, size_t qs, int nq, const void *const *K, bool h,
                         int64_t nk, int64_t hd) {
    qk_drive(h ? k_qk8_h : k_qk8_f, k_qk8_vmax, 8, S, ss, q, qs, nq, K, nk, hd);
}
/* sm_scalar on 8 keys a vector: partials 0-3 in s[0], 4-7 in s[1] */
AVX2 static void sm_avx2(float *S, size_t ss, int64_t nb, const int32_t *a, const int32_t *b, int nq, float scale,
                         float cap, float *mx, double *sum, float *al) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 vs = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    for (int g = 0; g < nq; g++) {
        float *x = S + (size_t)g * ss;
        const __m256i va = _mm256_set1_epi32(a[g]), vb = _mm256_set1_epi32(b[g]);
        float bm;
        if (cap > 0) bm = sm_first(x, a[g], b[g], scale, cap);
        else {
            __m256 m = ninf;
            for (int64_t p = a[g] / 8 * 8; p < b[g]; p += 8) {
                const __m256i vp = _mm256_add_epi32(_mm256_set1_epi32((int)p), lane);
                const __m256 live = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(va, vp), _mm256_cmpgt_epi32(vb, vp)));
                const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + p), vs);
                _mm256_storeu_ps(x + p, v);
                m = _mm256_max_ps(_mm256_blendv_ps(ninf, v, live), m);
            }
            float l[8];
            _mm256_storeu_ps(l, m);
            bm = max_scalar(l, 8);
        }
        al[g] = att_grow(bm, &mx[g]);
        const __m256 vm = _mm256_set1_ps(mx[g]);
        __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
        for (int64_t p = 0; p < nb; p += 8) {
            const __m256i vp = _mm256_add_epi32(_mm256_set1_epi32((int)p), lane);
            const __m256 live = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(va, vp), _mm256_cmpgt_epi32(vb, vp)));
            const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(x + p), vm)), live);
            _mm256_storeu_ps(x + p, e);
            s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        if ((nb + 7) / 8 % 2) _mm256_storeu_ps(x + (nb + 7) / 8 * 8, _mm256_setzero_ps()); /* up to 16 */
        sum[g] = sum[g] * al[g] + hsum256d(_mm256_add_pd(s0, s1));
    }
}
AVX2 static void swiglu_avx2(float *gate, const float *up, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) gate[i] = gate[i] / (1.0f + exp_poly(-gate[i])) * up[i];
}

/* Partials 0-15 and 16-31 in s0, s1; what is left after the blocks of 32 in
 * a block of 16 (s0) and one of 8 (the next partials' lower half). */
AVX512 static float dot_avx512(const float *a, const float *b, int64_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    if (i + 16 <= n) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        i += 16;
        if (i + 8 <= n)
            s1 = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(0xFF, a + i), _mm512_maskz_loadu_ps(0xFF, b + i), s1, 0xFF), i += 8;
    } else if (i + 8 <= n) {
        s0 = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(0xFF, a + i), _mm512_maskz_loadu_ps(0xFF, b + i), s0, 0xFF);
        i += 8;
    }
    const __m512 h = _mm512_add_ps(s0, s1);
    float r = hsum256(_mm256_add_ps(_mm512_castps512_ps256(h),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(h), 1))));
    for (; i < n; i++) r = fmaf(a[i], b[i], r);
    return r;
}
AVX512 static void axpy_avx512(float *y, float a, const float *x, int64_t n) {
    __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

/* exp_poly on 16 lanes (vscalefps: p 2^k, rounded once). */
AVX512 static inline __m512 exp512(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, k));
}
/* Softmax's middle pass and SwiGLU were a sixth of a 512-token prefill in
 * libm's scalar expf. Partials 0-7 in s0, 8-15 in s1 (masked lanes add 0);
 * summed by halves, written out rather than _mm512_reduce_add_pd, whose
 * order is the compiler's. */
AVX512 static double sumsq_avx512(const float *x, int64_t n) {
    __m512d acc = _mm512_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m512d a = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
        acc = _mm512_fmadd_pd(a, a, acc);
    }
    double s[8];
    _mm512_storeu_pd(s, acc);
    for (int j = 0; i < n; i++, j++) s[j] += (double)x[i] * x[i];
    return sumsq_fold(s);
}

AVX512 static double expsum_avx512(float *x, int64_t n, float sub) {
    const __m512 vs = _mm512_set1_ps(sub);
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), vs));
        e = _mm512_maskz_mov_ps(m, e);
        _mm512_mask_storeu_ps(x + i, m, e);
        s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    const __m512d h = _mm512_add_pd(s0, s1);
    return hsum256d(_mm256_add_pd(_mm512_castpd512_pd256(h), _mm512_extractf64x4_pd(h, 1)));
}
/* qk8_tile on 16 keys a vector */
AVX512 static LK_INL void qk16_tile(const int QG, const int V, const bool H, float *S, size_t ss, const float *q,
                                    size_t qs, const void *const *K, int64_t v0, int64_t hd) {
    __m512 acc[8][8];
    const void *kp[8];
#pragma GCC unroll 8
    for (int j = 0; j < V; j++) kp[j] = att_key(K, H, (v0 + j) * 16);
#pragma GCC unroll 8
    for (int g = 0; g < QG; g++)
#pragma GCC unroll 8
        for (int j = 0; j < V; j++)
            acc[g][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
        __m512 k[8];
#pragma GCC unroll 8
        for (int j = 0; j < V; j++)
            k[j] = H ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)kp[j] + d * LK_ATT_KW)))
                     : _mm512_loadu_ps((const float *)kp[j] + d * LK_ATT_KW);
#pragma GCC unroll 8
        for (int g = 0; g < QG; g++) {
            const __m512 qb = _mm512_set1_ps(q[(size_t)g * qs + (size_t)d]);
#pragma GCC unroll 8
            for (int j = 0; j < V; j++) acc[g][j] = _mm512_fmadd_ps(qb, k[j], acc[g][j]);
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < QG; g++)
#pragma GCC unroll 8
        for (int j = 0; j < V; j++) _mm512_storeu_ps(S + (size_t)g * ss + (size_t)(v0 + j) * 16, acc[g][j]);
}
#define QK16_FN(T, H, QG, V)                                                                                    \
    AVX512 static void qk16_##T##_##QG##_##V(float *S, size_t ss, const float *q, size_t qs, const void *const *K, \
                                             int64_t v0, int64_t hd) {                                          \
        qk16_tile(QG, V, H, S, ss, q, qs, K, v0, hd);                                                             \
    }
#define QK16_FNS(T, H)                                                                                          \
    QK16_FN(T, H, 8, 2) QK16_FN(T, H, 8, 1) QK16_FN(T, H, 4, 4) QK16_FN(T, H, 4, 2) QK16_FN(T, H, 4, 1)         \
    QK16_FN(T, H, 2, 8) QK16_FN(T, H, 2, 4) QK16_FN(T, H, 2, 2) QK16_FN(T, H, 2, 1) QK16_FN(T, H, 1, 8)         \
    QK16_FN(T, H, 1, 4) QK16_FN(T, H, 1, 2) QK16_FN(T, H, 1, 1)                                                 \
    static const qkt_fn k_qk16_##T[4][4] = {{qk16_##T##_8_2, qk16_##T##_8_1},                                   \
                                            {qk16_##T##_4_4, qk16_##T##_4_2, qk16_##T##_4_1},                   \
                                            {qk16_##T##_2_8, qk16_##T##_2_4, qk16_##T##_2_2, qk16_##T##_2_1},   \
                                            {qk16_##T##_1_8, qk16_##T##_1_4, qk16_##T##_1_2, qk16_##T##_1_1}};
QK16_FNS(f, false)
QK16_FNS(h, true)
static const int k_qk16_vmax[4] = {2, 4, 8, 8};
AVX512 static void qk_avx512(float *S, size_t ss, const float *q, size_t qs, int nq, const void *const *K, bool h,
                             int64_t nk, int64_t hd) {
    qk_drive(h ? k_qk16_h : k_qk16_f, k_qk16_vmax, 16, S, ss, q, qs, nq, K, nk, hd);
}
/* sm_scalar on 16 keys a vector: partial r in lane r of s */
AVX512 static void sm_avx512(float *S, size_t ss, int64_t nb, const int32_t *a, const int32_t *b, int nq, float scale,
                             float cap, float *mx, double *sum, float *al) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 vs = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int g = 0; g < nq; g++) {
        float *x = S + (size_t)g * ss;
        const __m512i va = _mm512_set1_epi32(a[g]), vb = _mm512_set1_epi32(b[g]);
        float bm;
        if (cap > 0) bm = sm_first(x, a[g], b[g], scale, cap);
        else {
            __m512 m = ninf;
            for (int64_t p = a[g] / 16 * 16; p < b[g]; p += 16) {
                const __m512i vp = _mm512_add_epi32(_mm512_set1_epi32((int)p), lane);
                const __mmask16 live = _mm512_cmple_epi32_mask(va, vp) & _mm512_cmpgt_epi32_mask(vb, vp);
                const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + p), vs);
                _mm512_storeu_ps(x + p, v);
                m = _mm512_mask_max_ps(m, live, v, m);
            }
            bm = _mm512_reduce_max_ps(m); /* exact in any order: the lanes hold no NaN */
        }
        al[g] = att_grow(bm, &mx[g]);
        const __m512 vm = _mm512_set1_ps(mx[g]);
        __m512d s = _mm512_setzero_pd();
        for (int64_t p = 0; p < nb; p += 16) {
            const __m512i vp = _mm512_add_epi32(_mm512_set1_epi32((int)p), lane);
            const __mmask16 live = _mm512_cmple_epi32_mask(va, vp) & _mm512_cmpgt_epi32_mask(vb, vp);
            const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_loadu_ps(x + p), vm)));
            _mm512_storeu_ps(x + p, e);
            s = _mm512_add_pd(s, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            s = _mm512_add_pd(s, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
        }
        sum[g] = sum[g] * al[g] + hsum256d(_mm256_add_pd(_mm512_castpd512_pd256(s), _mm512_extractf64x4_pd(s, 1)));
    }
}
AVX512 static float max_avx512(const float *x, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_loadu_ps(x + i), m);
    float l[16];
    _mm512_storeu_ps(l, m);
    /* the lanes, then the tail: the scalar order's comparisons */
    const float r = max_scalar(l, 16), t = max_scalar(x + i, n - i);
    return t > r ? t : r;
}
AVX512 static void scale_avx512(float *x, int64_t n, float s) {
    const __m512 vs = _mm512_set1_ps(s);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vs));
    }
}
AVX512 static void scale_mul_avx512(float *out, const float *x, float s, const float *w, int64_t n) {
    const __m512 vs = _mm512_set1_ps(s);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vs);
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
    }
}
AVX512 static void swiglu_avx512(float *gate, const float *up, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 y = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), _mm512_maskz_loadu_ps(m, up + i));
        _mm512_mask_storeu_ps(gate + i, m, y);
    }
}

/* Weighted sums of value rows for up to 4 queries at once: each value row
 * is loaded once for the group instead of once per query (one axpy call per
 * query and position before). Per output element the same fused
 * multiply-adds in the same order as axpy_avx512, so the results are those
 * of one axpy per position. */
AVX512 static LK_INL __m512 av_ld16(const bool H, const void *V, int64_t at) {
    return H ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)V + at)))
             : _mm512_loadu_ps((const float *)V + at);
}
/* V: F32 rows, or F16 (H) widened as they are loaded */
AVX512 static LK_INL void av4_tile(const bool H, float *out, size_t os, const float *S, size_t ss, size_t ps,
                                   const void *V, int64_t npos, int nq, int64_t hd) {
    int64_t i = 0;
    for (; i + 64 <= hd; i += 64) {
        __m512 acc[4][4];
        for (int q = 0; q < 4; q++)
            for (int c = 0; c < 4; c++) acc[q][c] = q < nq ? _mm512_loadu_ps(out + q * os + i + 16 * c) : _mm512_setzero_ps();
        for (int64_t p = 0; p < npos; p++) {
            const int64_t v = p * hd + i;
            __m512 v0 = av_ld16(H, V, v), v1 = av_ld16(H, V, v + 16);
            __m512 v2 = av_ld16(H, V, v + 32), v3 = av_ld16(H, V, v + 48);
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) {
                if (q >= nq) break;
                __m512 a = _mm512_set1_ps(S[q * ss + p * ps]);
                acc[q][0] = _mm512_fmadd_ps(a, v0, acc[q][0]);
                acc[q][1] = _mm512_fmadd_ps(a, v1, acc[q][1]);
                acc[q][2] = _mm512_fmadd_ps(a, v2, acc[q][2]);
                acc[q][3] = _mm512_fmadd_ps(a, v3, acc[q][3]);
            }
        }
        for (int q = 0; q < nq; q++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + q * os + i + 16 * c, acc[q][c]);
    }
    for (; i + 16 <= hd; i += 16) /* head sizes that are not a multiple of 64 */
        for (int q = 0; q < nq; q++) {
            __m512 a = _mm512_loadu_ps(out + q * os + i);
            for (int64_t p = 0; p < npos; p++) a = _mm512_fmadd_ps(_mm512_set1_ps(S[q * ss + p * ps]), av_ld16(H, V, p * hd + i), a);
            _mm512_storeu_ps(out + q * os + i, a);
        }
    for (; i < hd; i++) /* axpy_avx512's scalar tail */
        for (int q = 0; q < nq; q++) {
            float a = out[q * os + i];
            for (int64_t p = 0; p < npos; p++) a = fmaf(S[q * ss + p * ps], att_elem(H, V, p * hd + i), a);
            out[q * os + i] = a;
        }
}
AVX512 static void av4_avx512(float *out, size_t os, const float *S, size_t ss, size_t ps, const void *V, bool h,
                              int64_t npos, int nq, int64_t hd) {
    if (h) av4_tile(true, out, os, S, ss, ps, V, npos, nq, hd);
    else av4_tile(false, out, os, S, ss, ps, V, npos, nq, hd);
}
static void av4_generic(float *out, size_t os, const float *S, size_t ss, size_t ps, const void *V, bool h,
                        int64_t npos, int nq, int64_t hd);

typedef struct {
    const char *name; /* the SIMD level these kernels belong to */
    float (*dot)(const float *, const float *, int64_t);
    void (*axpy)(float *, float, const float *, int64_t);
    void (*f16_to_f32)(float *, const uint16_t *, int64_t);
    double (*expsum)(float *, int64_t, float);
    void (*swiglu)(float *, const float *, int64_t);
    void (*av4)(float *, size_t, const float *, size_t, size_t, const void *, bool, int64_t, int, int64_t);
    void (*qk)(float *, size_t, const float *, size_t, int, const void *const *, bool, int64_t, int64_t);
    double (*sumsq)(const float *, int64_t);
    float (*max)(const float *, int64_t);
    void (*scale)(float *, int64_t, float);
    void (*scale_mul)(float *, const float *, float, const float *, int64_t);
    void (*sm)(float *, size_t, int64_t, const int32_t *, const int32_t *, int, float, float, float *, double *, float *);
} vec_ops;

/* One table per level the CPU runs, built once; g_ops points at the one in
 * force: the highest that the program's CPU probe allows (lk_cpu: LK_SIMD
 * caps it). The AVX-512 code needs only F and VL besides the AVX2 set, so
 * it runs on CPUs below the quant kernels' avx512 level too, unless LK_SIMD
 * says otherwise. lk_vec_set_simd swaps the pointer (tests). */
static vec_ops g_tables[LK_SIMD_LEVELS];
static const uint32_t k_need[LK_SIMD_LEVELS] = {
    [LK_SIMD_SCALAR] = 0,
    [LK_SIMD_AVX2] = LK_CPU_AVX2 | LK_CPU_FMA | LK_CPU_F16C,
    [LK_SIMD_AVX512] = LK_CPU_AVX2 | LK_CPU_FMA | LK_CPU_F16C | LK_CPU_AVX512F | LK_CPU_AVX512VL,
};
static const vec_ops *_Atomic g_ops;

static void pick(void) {
    vec_ops o = { "scalar", dot_scalar, axpy_scalar, f16_to_f32_scalar, expsum_scalar, swiglu_scalar,
                  av4_generic, qk_scalar, sumsq_scalar, max_scalar, scale_scalar,
                  scale_mul_scalar, sm_scalar };
    g_tables[LK_SIMD_SCALAR] = o;
    o = (vec_ops){ "avx2", dot_avx2, axpy_avx2, f16_to_f32_avx2, expsum_avx2, swiglu_avx2, av4_generic,
                   qk_avx2, sumsq_avx2, max_avx2, scale_avx2, scale_mul_avx2, sm_avx2 };
    g_tables[LK_SIMD_AVX2] = o;
    o.name = "avx512";
    o.dot = dot_avx512;
    o.axpy = axpy_avx512;
    o.expsum = expsum_avx512;
    o.swiglu = swiglu_avx512;
    o.av4 = av4_avx512;
    o.qk = qk_avx512;
    o.sumsq = sumsq_avx512;
    o.max = max_avx512;
    o.scale = scale_avx512;
    o.scale_mul = scale_mul_avx512;
    o.sm = sm_avx512;
    g_tables[LK_SIMD_AVX512] = o;
    int l = LK_SIMD_AVX512;
    while (l > LK_SIMD_SCALAR && !lk_cpu_can((lk_simd_level)l, k_need[l])) l--;
    g_ops = &g_tables[l];
}

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static inline const vec_ops *ops(void) {
    const vec_ops *o = g_ops;
    if (__builtin_expect(o == NULL, 0)) { pthread_once(&g_once, pick); o = g_ops; }
    return o;
}

/* Which level the vector kernels run ("scalar", "avx2", "avx512"), so tests
 * can check that LK_SIMD reaches them. */
const char *lk_vec_simd_name(void) { return ops()->name; }
lk_simd_level lk_vec_simd_level(void) { return (lk_simd_level)(ops() - g_tables); }

bool lk_vec_set_simd(const char *level) {
    lk_simd_level l;
    (void)ops();
    if (!lk_simd_level_parse(level, &l) || (lk_cpu()->feat & k_need[l]) != k_need[l]) return false;
    g_ops = &g_tables[l];
    return true;
}

float lk_vec_dot_f32(const float *a, const float *b, int64_t n) { return ops()->dot(a, b, n); }
void lk_vec_axpy_f32(float *y, float a, const float *x, int64_t n) { ops()->axpy(y, a, x, n); }
void lk_vec_f16_to_f32(float *y, const uint16_t *x, int64_t n) { ops()->f16_to_f32(y, x, n); }
double lk_vec_exp_sum(float *x, int64_t n, float sub) { return ops()->expsum(x, n, sub); }
void lk_vec_swiglu(float *gate, const float *up, int64_t n) { ops()->swiglu(gate, up, n); }
double lk_vec_sumsq(const float *x, int64_t n) { return ops()->sumsq(x, n); }
float lk_vec_max(const float *x, int64_t n) { return ops()->max(x, n); }
void lk_vec_scale(float *x, int64_t n, float s) { ops()->scale(x, n, s); }
void lk_vec_scale_mul(float *out, const float *x, float s, const float *w, int64_t n) { ops()->scale_mul(out, x, s, w, n); }

/* Other levels: one axpy per query and position, as before; an F16 row
 * widened first, a piece at a time (an axpy is elementwise, so the pieces
 * give the bits of one call). */
static void av4_generic(float *out, size_t os, const float *S, size_t ss, size_t ps, const void *V, bool h,
                        int64_t npos, int nq, int64_t hd) {
    enum { PIECE = 256 };
    float w[PIECE];
    for (int64_t p = 0; p < npos; p++)
        for (int64_t i = 0; i < hd; i += PIECE) {
            const int64_t n = LK_MIN((int64_t)PIECE, hd - i);
            const float *v = w;
            if (h) ops()->f16_to_f32(w, (const uint16_t *)V + p * hd + i, n);
            else v = (const float *)V + p * hd + i;
            for (int q = 0; q < nq; q++) ops()->axpy(out + q * os + i, S[q * ss + p * ps], v, n);
        }
}
void lk_vec_attn_av_f32(float *out, size_t out_stride, const float *S, size_t q_stride, size_t p_stride,
                        const float *V, int64_t npos, int nq, int64_t hd) {
    LK_ASSERT(nq >= 1 && nq <= 4);
    ops()->av4(out, out_stride, S, q_stride, p_stride, V, false, npos, nq, hd);
}
void lk_vec_attn_av_f16(float *out, size_t out_stride, const float *S, size_t q_stride, size_t p_stride,
                        const uint16_t *V, int64_t npos, int nq, int64_t hd) {
    LK_ASSERT(nq >= 1 && nq <= 4);
    ops()->av4(out, out_stride, S, q_stride, p_stride, V, true, npos, nq, hd);
}
/* The pages as pointers of one kind for the tiles, 64 pages (2048 keys) at
 * a time: a score depends on its own key alone, so the pieces give the
 * bits of one call. */
#define QK_RUN(K, h)                                                                                            \
    do {                                                                                                        \
        LK_ASSERT(nq >= 1);                                                                                     \
        enum { PAGES = 64 };                                                                                    \
        const void *pk[PAGES];                                                                                  \
        for (int64_t p0 = 0; p0 < nk; p0 += (int64_t)PAGES * LK_ATT_KW) {                                     \
            const int64_t n = LK_MIN((int64_t)PAGES * LK_ATT_KW, nk - p0);                                     \
            for (int64_t j = 0; j < (n + LK_ATT_KW - 1) / LK_ATT_KW; j++) pk[j] = K[p0 / LK_ATT_KW + j];       \
            ops()->qk(S + p0, ss, q, q_stride, nq, pk, h, n, hd);                                               \
        }                                                                                                       \
    } while (0)
void lk_vec_attn_qk(float *S, size_t ss, const float *q, size_t q_stride, int nq, const float *const *K, int64_t nk,
                    int64_t hd) {
    QK_RUN(K, false);
}
void lk_vec_attn_qk_f16(float *S, size_t ss, const float *q, size_t q_stride, int nq, const uint16_t *const *K,
                        int64_t nk, int64_t hd) {
    QK_RUN(K, true);
}
void lk_vec_attn_softmax(float *S, size_t ss, int64_t nb, const int32_t *a, const int32_t *b, int nq, float scale,
                         float cap, float *mx, double *sum, float *al) {
    LK_ASSERT(nq >= 1);
    ops()->sm(S, ss, nb, a, b, nq, scale, cap, mx, sum, al);
}
