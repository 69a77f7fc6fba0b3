/* Small F32 vector kernels for attention: dot products of a query with cached
 * keys and weighted sums of cached values, F32 or F16 cache. gcc does not
 * vectorise float reductions at -O2 (it may not reorder the sums), so the
 * SIMD versions are written out; the level is chosen once at run time.
 *
 * Every level gives the same bits (a cluster of AVX2 and scalar nodes, or a
 * Mac beside a PC, must agree): the scalar code is the AVX2 code's
 * arithmetic written out lane by lane, not a plainer loop. A dot product
 * keeps 16 partial sums, element i (below the last multiple of 8) going to
 * partial i mod 16 by a fused multiply-add; the partials are summed by the
 * tree of sum16(); the last n mod 8 elements are fused onto that sum in
 * order. An axpy is one fused multiply-add per element. The exponentials
 * (softmax, SwiGLU) are expf at the scalar and AVX2 levels. */
#include "kernels/kernels.h"

#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* The AVX2 kernels' reduction of 16 partial sums (two registers of 8): the
 * registers added lane by lane, then the upper half of what is left added
 * onto the lower, 8 -> 4 -> 2 -> 1 (hsum256 below). */
static float sum16(const float p[16]) {
    float h[8];
    for (int j = 0; j < 8; j++) h[j] = p[j] + p[j + 8];
    for (int w = 4; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) h[j] += h[j + w];
    return h[0];
}

/* fmaf: one rounding per multiply-add, as the SIMD levels' FMA instructions
 * (libm's, or the instruction itself where the compiler targets FMA). */
static float dot_scalar(const float *a, const float *b, int64_t n) {
    float p[16] = {0};
    const int64_t n8 = n & ~(int64_t)7;
    for (int64_t i = 0; i < n8; i++) p[i % 16] = fmaf(a[i], b[i], p[i % 16]);
    float s = sum16(p);
    for (int64_t i = n8; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
}
static void axpy_scalar(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}
static float dot_f16_scalar(const float *a, const uint16_t *b, int64_t n) {
    float p[16] = {0};
    const int64_t n8 = n & ~(int64_t)7;
    for (int64_t i = 0; i < n8; i++) p[i % 16] = fmaf(a[i], lk_fp16_to_fp32(b[i]), p[i % 16]);
    float s = sum16(p);
    for (int64_t i = n8; i < n; i++) s = fmaf(a[i], lk_fp16_to_fp32(b[i]), s);
    return s;
}
static void axpy_f16_scalar(float *y, float a, const uint16_t *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = fmaf(a, lk_fp16_to_fp32(x[i]), y[i]);
}

static double expsum_scalar(float *x, int64_t n, float sub) {
    double sum = 0;
    for (int64_t i = 0; i < n; i++) { x[i] = expf(x[i] - sub); sum += x[i]; }
    return sum;
}
static void swiglu_scalar(float *gate, const float *up, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512vl,avx2,fma,f16c")))

AVX2 static float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* Partials 0-7 in s0, 8-15 in s1 (the file comment's order); a last block
 * of 8 below n goes to s0, as its elements are partials 0-7. */
AVX2 static float dot_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    if (i + 8 <= n) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0), i += 8;
    float s = hsum256(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
}
AVX2 static void axpy_avx2(float *y, float a, const float *x, int64_t n) {
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}
AVX2 static inline __m256 ld_f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
AVX2 static float dot_f16_avx2(const float *a, const uint16_t *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), ld_f16x8(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), ld_f16x8(b + i + 8), s1);
    }
    if (i + 8 <= n) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), ld_f16x8(b + i), s0), i += 8;
    float s = hsum256(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s = fmaf(a[i], lk_fp16_to_fp32(b[i]), s);
    return s;
}
AVX2 static void axpy_f16_avx2(float *y, float a, const uint16_t *x, int64_t n) {
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, ld_f16x8(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(a, lk_fp16_to_fp32(x[i]), y[i]);
}
AVX512 static float dot_avx512(const float *a, const float *b, int64_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    float s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}
AVX512 static void axpy_avx512(float *y, float a, const float *x, int64_t n) {
    __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

/* e^x, 16 lanes: x = k ln2 + r (Cody-Waite, |r| <= ln2/2), e^r by its Taylor
 * polynomial to degree 7 (truncation below 5e-9 relative), times 2^k by
 * vscalefps; within 2 ulp of expf. Below -87.3 it is 0 (expf: a denormal
 * or 0), above 88.7 it saturates at ~3e38 (expf: inf). */
AVX512 static inline __m512 exp512(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), r);
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
 * libm's scalar expf. The sum stays in double as the scalar code's. */
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
    return _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
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
AVX512 static void av4_avx512(float *out, size_t os, const float *S, size_t ss, const float *V, int64_t npos, int nq,
                              int64_t hd) {
    int64_t i = 0;
    for (; i + 64 <= hd; i += 64) {
        __m512 acc[4][4];
        for (int q = 0; q < 4; q++)
            for (int c = 0; c < 4; c++) acc[q][c] = q < nq ? _mm512_loadu_ps(out + q * os + i + 16 * c) : _mm512_setzero_ps();
        for (int64_t p = 0; p < npos; p++) {
            const float *v = V + p * hd + i;
            __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
            __m512 v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) {
                if (q >= nq) break;
                __m512 a = _mm512_set1_ps(S[q * ss + p]);
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
            for (int64_t p = 0; p < npos; p++) a = _mm512_fmadd_ps(_mm512_set1_ps(S[q * ss + p]), _mm512_loadu_ps(V + p * hd + i), a);
            _mm512_storeu_ps(out + q * os + i, a);
        }
    for (; i < hd; i++) /* axpy_avx512's scalar tail: not fused */
        for (int q = 0; q < nq; q++) {
            float a = out[q * os + i];
            for (int64_t p = 0; p < npos; p++) a += S[q * ss + p] * V[p * hd + i];
            out[q * os + i] = a;
        }
}
static void av4_generic(float *out, size_t os, const float *S, size_t ss, const float *V, int64_t npos, int nq,
                        int64_t hd);

typedef struct {
    const char *name; /* the SIMD level these kernels belong to */
    float (*dot)(const float *, const float *, int64_t);
    void (*axpy)(float *, float, const float *, int64_t);
    float (*dot_f16)(const float *, const uint16_t *, int64_t);
    void (*axpy_f16)(float *, float, const uint16_t *, int64_t);
    double (*expsum)(float *, int64_t, float);
    void (*swiglu)(float *, const float *, int64_t);
    void (*av4)(float *, size_t, const float *, size_t, const float *, int64_t, int, int64_t);
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
    vec_ops o = { "scalar", dot_scalar, axpy_scalar, dot_f16_scalar, axpy_f16_scalar, expsum_scalar, swiglu_scalar,
                  av4_generic };
    g_tables[LK_SIMD_SCALAR] = o;
    o = (vec_ops){ "avx2", dot_avx2, axpy_avx2, dot_f16_avx2, axpy_f16_avx2, expsum_scalar, swiglu_scalar, av4_generic };
    g_tables[LK_SIMD_AVX2] = o;
    o.name = "avx512";
    o.dot = dot_avx512;
    o.axpy = axpy_avx512;
    o.expsum = expsum_avx512;
    o.swiglu = swiglu_avx512;
    o.av4 = av4_avx512;
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
float lk_vec_dot_f16(const float *a, const uint16_t *b, int64_t n) { return ops()->dot_f16(a, b, n); }
void lk_vec_axpy_f16(float *y, float a, const uint16_t *x, int64_t n) { ops()->axpy_f16(y, a, x, n); }
double lk_vec_exp_sum(float *x, int64_t n, float sub) { return ops()->expsum(x, n, sub); }
void lk_vec_swiglu(float *gate, const float *up, int64_t n) { ops()->swiglu(gate, up, n); }

/* Other levels: one axpy per query and position, as before. */
static void av4_generic(float *out, size_t os, const float *S, size_t ss, const float *V, int64_t npos, int nq,
                        int64_t hd) {
    for (int q = 0; q < nq; q++) {
        for (int64_t p = 0; p < npos; p++) ops()->axpy(out + q * os, S[q * ss + p], V + p * hd, hd);
    }
}
void lk_vec_attn_av_f32(float *out, size_t out_stride, const float *S, size_t s_stride, const float *V, int64_t npos,
                        int nq, int64_t hd) {
    LK_ASSERT(nq >= 1 && nq <= 4);
    ops()->av4(out, out_stride, S, s_stride, V, npos, nq, hd);
}
