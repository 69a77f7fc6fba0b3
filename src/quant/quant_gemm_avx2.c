/* quant_gemm_avx2.c — prefill (two or more tokens at once) for Q4_K / Q5_K /
 * Q6_K (Q8_K activations) on AVX2 + FMA
 * + F16C machines (no VNNI, no AVX-512: Zen 1-3, Haswell to Skylake client).
 * quant_avx2.c's matmul entries call it from 2 tokens on when it is on (off
 * by default: see Measured below); decode (1 token) keeps its register
 * tiles.
 *
 * The numbers are the decode kernels' bits, not merely close to them: the
 * scalar reference's (dot_k45 / dot_q6_k in quant.c). Per (row, token) and
 * super-block the exact integer sums (sc_j * (q . a)_j in 8 i32 lanes, then
 * their total; the mins' sum_j m_j * bsum_j), then
 * s = s + ((d*da)*(float)sumi - (dmin*da)*(float)summ), super-block after
 * super-block. So the AVX2 level is batch invariant (test_quant's
 * matmul_batch_invariant: a token's outputs do not depend on how many
 * tokens share the call, which the engine's batched decode relies on) and
 * equal to the scalar level. Only where the work is done changes:
 *
 *  - Each weight super-block is unpacked once per token chunk (up to 64
 *    tokens) instead of once per register tile of up to 4 tokens: R rows'
 *    block is decoded into a small L1 buffer, then every token of the chunk
 *    is multiplied with it.
 *  - A token's bsum pairs are made once per R rows.
 *  - The (row, token) pairs' sums live in an L1 array (R x chunk floats).
 *
 * Weights are read from memory once per chunk (rows stream in order, R
 * streams the hardware prefetchers follow); the chunk's activations (64 x
 * 5632 elements of Q8_0: 388 KB) stay in L2.
 *
 * Tuning: R (rows per pass, 1..4) and the token chunk (8..64) change speed,
 * never results (every (row, token) pair's arithmetic is the same whichever
 * is chosen); lk_quant_gemm_avx2_force sets them for the test that checks
 * exactly that.
 *
 * Measured (AMD EPYC Zen 5, AVX2 level, one thread, 2048 x 5632 x 64
 * tokens, weights from memory, `BENCH_GEMM=R,C BENCH_LEVEL=avx2
 * bench_quant 2048 5632 64`), GFLOP/s, the register tiles of quant_avx2.c /
 * this GEMM at R = 1, 2, 4: Q4_K 94 / 77, 77, 71; Q5_K 90 / 75, 65, 74;
 * Q6_K 94 / 66, 77, 72. Decoding a weight super-block once per chunk buys
 * less than the chunk's extra loads and stores of the decoded vectors cost.
 * So it is off by default (the tiles take prefill) and stays as a tuning
 * choice the tuner measures, proven to give the same bits (rows > 0 turns
 * it on). Q4_0 and Q8_0 are quant_q4q8_avx2.c (rows in lanes). */
#include <immintrin.h>
#include <stdatomic.h>

#include "quant/simd_x86.h"

enum { G2_TMAX = 64, G2_RMAX = 4 };

/* forced choices: rows per pass (0 or -1: GEMM off), tokens per chunk (0: default) */
static _Atomic int g_rows, g_chunk;

void lk_quant_gemm_avx2_force(int rows, int chunk) {
    LK_ASSERT(rows >= -1 && rows <= G2_RMAX && chunk >= 0 && chunk <= G2_TMAX);
    atomic_store(&g_rows, rows);
    atomic_store(&g_chunk, chunk);
}

void lk_quant_gemm_avx2_get(int *rows, int *chunk) {
    *rows = atomic_load(&g_rows);
    *chunk = atomic_load(&g_chunk);
}

/* off unless forced on (see the header's measurements) */
bool lk_quant_gemm_avx2_on(void) { return atomic_load(&g_rows) > 0; }

static void g2_choice(int def_rows, int def_chunk, int *rows, int *chunk) {
    int r = atomic_load(&g_rows), c = atomic_load(&g_chunk);
    *rows = r ? r : def_rows;
    *chunk = c ? c : def_chunk;
}

LK_T2 static LK_INL float g2_h2f(const uint8_t *p) { return _cvtsh_ss(lk_ld_u16(p)); }

typedef void (*g2_pass_fn)(int64_t nb, const uint8_t *w, size_t ws, int tc, const uint8_t *a, size_t as, float *y,
                           size_t ys, float *acc);

/* ===================================================================== */
/* Q4_K / Q5_K / Q6_K x Q8_K                                               */
/* ===================================================================== */

/* One super-block of one row, decoded: vector k (0..7) holds the unsigned
 * quants of elements 32k..32k+31 and s[k] their sub-block scales as i16
 * (the multipliers of vpmaddwd); Q4_K/Q5_K: the 8 mins as i16; Q6_K: the 16
 * signed scales as i16 (the -32 offset's correction). */
typedef struct {
    __m256i q[8], s[8];
    __m256i sc6;
    __m128i mins;
    float d, dmin;
} kq_unp;

static LK_INL void g2_k_scales(const uint8_t *q, uint64_t *sc, uint64_t *m) {
    uint32_t w0, w1, w2;
    memcpy(&w0, q, 4); memcpy(&w1, q + 4, 4); memcpy(&w2, q + 8, 4);
    uint32_t sc_lo = w0 & 0x3f3f3f3fu, m_lo = w1 & 0x3f3f3f3fu;
    uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | ((w0 >> 6) & 0x03030303u) << 4;
    uint32_t m_hi = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 6) & 0x03030303u) << 4;
    *sc = sc_lo | (uint64_t)sc_hi << 32;
    *m = m_lo | (uint64_t)m_hi << 32;
}

LK_T2 static LK_INL void kq_unpack(const int kind, const uint8_t *w, kq_unp *u) {
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    if (kind == 4 || kind == 5) {
        uint64_t sc, m;
        g2_k_scales(w + (kind == 4 ? LK_Q4K_SC : LK_Q5K_SC), &sc, &m);
        __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
        u->mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m));
        u->d = g2_h2f(w);
        u->dmin = g2_h2f(w + 2);
        const uint8_t *qs = w + (kind == 4 ? LK_Q4K_QS : LK_Q5K_QS);
        __m256i qh = kind == 5 ? _mm256_loadu_si256((const __m256i *)(w + LK_Q5K_QH)) : _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(q, m0f);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m0f);
            if (kind == 5) {
                __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * j))), b1 = _mm256_set1_epi8((char)(2 << (2 * j)));
                __m256i m10 = _mm256_set1_epi8(0x10);
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), m10));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), m10));
            }
            u->q[2 * j] = lo;
            u->q[2 * j + 1] = hi;
            u->s[2 * j] = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * j))));
            u->s[2 * j + 1] = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * j + 1))));
        }
    } else {
        const uint8_t *ql = w + LK_Q6K_QL, *qhp = w + LK_Q6K_QH;
        __m128i sc8 = _mm_loadu_si128((const __m128i *)(w + LK_Q6K_SC));
        const __m256i m03 = _mm256_set1_epi8(3);
        u->d = g2_h2f(w + LK_Q6K_D);
        u->sc6 = _mm256_cvtepi8_epi16(sc8);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(qhp + 32 * h));
            __m256i *v = u->q + 4 * h;
            v[0] = _mm256_or_si256(_mm256_and_si256(l0, m0f), _mm256_slli_epi16(_mm256_and_si256(qh, m03), 4));
            v[1] = _mm256_or_si256(_mm256_and_si256(l1, m0f),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m03), 4));
            v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m0f),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m03), 4));
            v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m0f),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m03), 4));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                int g = 8 * h + 2 * k;
                __m128i idx = _mm_set_epi8((char)(g + 1), (char)(g + 1), (char)(g + 1), (char)(g + 1),
                                           (char)(g + 1), (char)(g + 1), (char)(g + 1), (char)(g + 1),
                                           (char)g, (char)g, (char)g, (char)g, (char)g, (char)g, (char)g, (char)g);
                u->s[4 * h + k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, idx));
            }
        }
    }
}

/* The exact total of 8 i32 lanes (integer adds: any order gives it) */
LK_T2 static LK_INL int g2_hsum_i8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

LK_T2 static LK_INL int g2_hsum_i4(__m128i s) {
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* R rows x T tokens of one super-block (u: the rows, decoded; ap[t]: token
 * t's Q8_K block): the integer sums in T*R registers (each activation
 * vector loaded once for the R rows, each weight vector once for the T
 * tokens), then each pair's float work in the scalar order (dot_k45 /
 * dot_q6_k): acc = acc + ((d*da)*(float)sumi - (dmin*da)*(float)summ). */
LK_T2 static LK_INL void kq_tile(const int R, const int T, const int kind, const kq_unp *u,
                                 const uint8_t *const *ap, float *acc) {
    __m256i is[G2_RMAX][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) is[r][t] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        __m256i wv[G2_RMAX], sv[G2_RMAX];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) wv[r] = u[r].q[k], sv[r] = u[r].s[k];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            __m256i av = _mm256_loadu_si256((const __m256i *)(ap[t] + LK_Q8K_QS + 32 * k));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                is[r][t] = _mm256_add_epi32(is[r][t], _mm256_madd_epi16(_mm256_maddubs_epi16(wv[r], av), sv[r]));
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
        const float da = lk_ld_f32(ap[t]);
        if (kind != 6) {
            __m128i bs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)(ap[t] + LK_Q8K_BS)),
                                        _mm_loadu_si128((const __m128i *)(ap[t] + LK_Q8K_BS + 16)));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int sumi = g2_hsum_i8(is[r][t]), summ = g2_hsum_i4(_mm_madd_epi16(u[r].mins, bs));
                float *pa = &acc[r * G2_TMAX + t];
                *pa += u[r].d * da * (float)sumi - u[r].dmin * da * (float)summ;
            }
        } else {
            __m256i bs6 = _mm256_loadu_si256((const __m256i *)(ap[t] + LK_Q8K_BS));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int sumi = g2_hsum_i8(_mm256_sub_epi32(is[r][t], _mm256_slli_epi32(_mm256_madd_epi16(u[r].sc6, bs6), 5)));
                acc[r * G2_TMAX + t] += u[r].d * da * (float)sumi;
            }
        }
    }
}

/* R rows x tc tokens, all super-blocks: tiles of R rows x (4 tokens for R
 * <= 2, else 2), the chunk's last tokens in a shorter tile. acc: the pairs'
 * sums, index r*G2_TMAX + t. */
LK_T2 static LK_INL void kq_pass(const int R, const int kind, int64_t nb, const uint8_t *w, size_t ws, int tc,
                                 const uint8_t *a, size_t as, float *y, size_t ys, float *acc) {
    const size_t bb = kind == 4 ? LK_Q4K_BYTES : kind == 5 ? LK_Q5K_BYTES : LK_Q6K_BYTES;
    const int TT = R <= 2 ? 4 : 2;
    for (int r = 0; r < R; r++)
        for (int t = 0; t < tc; t++) acc[r * G2_TMAX + t] = 0;
    kq_unp u[G2_RMAX];
    for (int64_t i = 0; i < nb; i++) {
        for (int r = 0; r < R; r++) kq_unpack(kind, w + (size_t)r * ws + (size_t)i * bb, &u[r]);
        for (int t = 0; t < tc; t += TT) {
            const uint8_t *ap[4];
            const int tt = LK_MIN(TT, tc - t);
            for (int k = 0; k < tt; k++) ap[k] = a + (size_t)(t + k) * as + (size_t)i * LK_Q8K_BYTES;
            float *pa = acc + t;
            switch (tt) {
            case 4: kq_tile(R, 4 > TT ? TT : 4, kind, u, ap, pa); break;
            case 3: kq_tile(R, 3 > TT ? TT : 3, kind, u, ap, pa); break;
            case 2: kq_tile(R, 2, kind, u, ap, pa); break;
            default: kq_tile(R, 1, kind, u, ap, pa); break;
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < tc; t++) y[(size_t)t * ys + (size_t)r] = acc[r * G2_TMAX + t];
}

#define KQ_PASS(R, K)                                                                                       \
    LK_T2 static void kq_pass_##R##_##K(int64_t nb, const uint8_t *w, size_t ws, int tc, const uint8_t *a,   \
                                        size_t as, float *y, size_t ys, float *acc) {                       \
        kq_pass(R, K, nb, w, ws, tc, a, as, y, ys, acc);                                                    \
    }
KQ_PASS(1, 4) KQ_PASS(2, 4) KQ_PASS(3, 4) KQ_PASS(4, 4)
KQ_PASS(1, 5) KQ_PASS(2, 5) KQ_PASS(3, 5) KQ_PASS(4, 5)
KQ_PASS(1, 6) KQ_PASS(2, 6) KQ_PASS(3, 6) KQ_PASS(4, 6)
static const g2_pass_fn k_kq[3][G2_RMAX] = {
    {kq_pass_1_4, kq_pass_2_4, kq_pass_3_4, kq_pass_4_4},
    {kq_pass_1_5, kq_pass_2_5, kq_pass_3_5, kq_pass_4_5},
    {kq_pass_1_6, kq_pass_2_6, kq_pass_3_6, kq_pass_4_6},
};

/* ===================================================================== */
/* Driver                                                                  */
/* ===================================================================== */

/* Token chunks of `chunk`, rows in passes of R (the last rows in a shorter
 * pass). */
static void g2_run(const g2_pass_fn *passes, int R, int chunk, int64_t nb, int64_t nrows, const uint8_t *W,
                   size_t ws, int64_t ntok, const uint8_t *A, size_t as, float *y, size_t ys) {
    float acc[G2_RMAX * G2_TMAX];
    for (int64_t t0 = 0; t0 < ntok; t0 += chunk) {
        const int tc = (int)LK_MIN((int64_t)chunk, ntok - t0);
        for (int64_t r0 = 0; r0 < nrows; r0 += R) {
            const int rr = (int)LK_MIN((int64_t)R, nrows - r0);
            passes[rr - 1](nb, W + (size_t)r0 * ws, ws, tc, A + (size_t)t0 * as, as,
                           y + (size_t)t0 * ys + (size_t)r0, ys, acc);
        }
    }
}

void lk_quant_gemm_kq_avx2(int kind, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                           const void *a, size_t as, float *y, size_t ys) {
    LK_ASSERT(kind >= 4 && kind <= 6);
    int R, chunk;
    g2_choice(2, 32, &R, &chunk);
    g2_run(k_kq[kind - 4], R, chunk, n / LK_QK_K, nrows, w, ws, ntok, a, as, y, ys);
}
