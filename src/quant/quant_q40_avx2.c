/* quant_q40_avx2.c — Q4_0 weights x Q8_0 activations on AVX2 (no VNNI),
 * with eight rows in the eight lanes of a register, in the scalar
 * reference's arithmetic: the same bits as `dot_q4_0` in quant.c for every
 * row, token and call shape.
 *
 * The arithmetic, per (row, token) and block b of 32 elements, in block
 * order:   s = s + (float)isum_b * (d_w * d_a)
 * where isum_b = sum (q - 8) * a is the block's exact integer sum. Every
 * path here (decode, a few tokens, prefill) does exactly that, so a token's
 * row has one value whatever the call's token count (batch invariance) and
 * whatever the SIMD level (AVX-512's GEMM keeps the same order), and it is
 * what the scalar code computes.
 *
 * Why rows in lanes. A block's products are summed within a row, and the
 * float work is per block; with a row's 32 products spread over the lanes
 * (the old tiles, and llama.cpp's vec_dot), each (row, token, block) costs a
 * conversion and a fused multiply-add into 8 lanes, and the lanes are added
 * at the end in a tree, another order than the scalar code's. With lane r =
 * row r, a block's 8 vpmaddubsw against broadcast 4-byte groups of the
 * activation give 8 rows' sums at once in 16-bit pairs (a pair is at most
 * 2*15*128 and eight of them fit in int16), one vpmaddwd widens them, and
 * the float work (one conversion, two multiplies, one add) is shared by 8
 * rows. Rows reach the lanes by a 4x4 dword transpose in each 128-bit half
 * of 8 rows' 16-byte nibble records (12 shuffles per 8 row-blocks):
 * vector k holds quants 4k..4k+3 of each row in its low nibbles and
 * 16+4k..16+4k+3 in its high ones (the Q4_0 record's own order).
 *
 *  - Decode and up to 4 tokens: transposed in registers per block, used by
 *    the call's tokens at once.
 *  - From LK_Q40_GEMM_TOK tokens: a GEMM; 8 rows x 64 blocks are
 *    transposed and unpacked once into an L1 panel (18 KB) that every token
 *    of a chunk of 64 reads, and each (token, block)'s scale and offset
 *    correction (-8 * sum a) are made once per chunk, not per 8 rows.
 *
 * Rows past the end of a matrix are zero lanes (their stores skipped); a
 * row's lane never mixes with another's, so a row's result does not depend
 * on the rows beside it. */
#include <immintrin.h>

#include "quant/quant_impl.h"

#define LK_T2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#define LK_INL inline __attribute__((always_inline))

enum {
    Q4R = 8,      /* rows per group (one per lane) */
    Q4T = 4,      /* tokens per register tile */
    Q4_KB = 64,   /* blocks per GEMM panel: 64 x 288 B = 18 KB */
    Q4_TC = 64,   /* tokens per GEMM chunk */
};

static LK_INL int32_t ld_i32(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* 8 rows' block b (row r at w + r*ws; rows >= nr are zero) -> v[0..7]: v[k]
 * lane r = quants 4k..4k+3 (k < 4) or 16+4(k-4).. (k >= 4) of row r as
 * unsigned bytes; *d = the rows' scales. */
LK_T2 static LK_INL void q4_rows(const uint8_t *w, size_t ws, int nr, int64_t b, __m256i v[8], __m256 *d) {
    static const uint8_t zero[LK_Q40_BYTES];
    const uint8_t *p[Q4R];
#pragma GCC unroll 8
    for (int r = 0; r < Q4R; r++) p[r] = r < nr ? w + (size_t)r * ws + (size_t)b * LK_Q40_BYTES : zero;
    __m256i Y[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
        Y[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p[j] + 2))),
                                       _mm_loadu_si128((const __m128i *)(p[j + 4] + 2)), 1);
    const __m256i t0 = _mm256_unpacklo_epi32(Y[0], Y[1]), t1 = _mm256_unpackhi_epi32(Y[0], Y[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(Y[2], Y[3]), t3 = _mm256_unpackhi_epi32(Y[2], Y[3]);
    const __m256i V[4] = { _mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                           _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3) };
    const __m256i m = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_and_si256(V[k], m);
        v[k + 4] = _mm256_and_si256(_mm256_srli_epi16(V[k], 4), m);
    }
    __m128i h = _mm_cvtsi32_si128(lk_ld_u16(p[0]));
    h = _mm_insert_epi16(h, lk_ld_u16(p[1]), 1);
    h = _mm_insert_epi16(h, lk_ld_u16(p[2]), 2);
    h = _mm_insert_epi16(h, lk_ld_u16(p[3]), 3);
    h = _mm_insert_epi16(h, lk_ld_u16(p[4]), 4);
    h = _mm_insert_epi16(h, lk_ld_u16(p[5]), 5);
    h = _mm_insert_epi16(h, lk_ld_u16(p[6]), 6);
    h = _mm_insert_epi16(h, lk_ld_u16(p[7]), 7);
    *d = _mm256_cvtph_ps(h);
}

/* -8 * (sum of a Q8_0 block's 32 quants) in every lane */
LK_T2 static LK_INL __m256i q4_corr(const uint8_t *ab) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(ab + 2));
    __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
    s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0x4E));
    s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0xB1));
    s = _mm256_add_epi32(s, _mm256_permute2x128_si256(s, s, 0x01));
    return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s, 3));
}

/* One block of 8 rows (v, wd) against one token's block (quants at aq):
 * acc += (float)(isum + corr) * (wd * da), per lane. */
LK_T2 static LK_INL __m256 q4_step(const __m256i v[8], __m256 wd, const uint8_t *aq, __m256i corr, float da,
                                   __m256 acc) {
    __m256i s16 = _mm256_maddubs_epi16(v[0], _mm256_set1_epi32(ld_i32(aq)));
#pragma GCC unroll 8
    for (int k = 1; k < 8; k++)
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[k], _mm256_set1_epi32(ld_i32(aq + 4 * k))));
    const __m256i isum = _mm256_add_epi32(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)), corr);
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(wd, _mm256_set1_ps(da))));
}

/* Rows [0, nr) of y as a vector (zero lanes past nr). */
LK_T2 static LK_INL __m256 q4_load(const float *y, int nr) {
    if (nr == Q4R) return _mm256_loadu_ps(y);
    float tmp[Q4R] = { 0 };
    memcpy(tmp, y, sizeof(float) * (size_t)nr);
    return _mm256_loadu_ps(tmp);
}

/* Stores rows [0, nr) of token t's accumulator to y. */
LK_T2 static LK_INL void q4_store(__m256 acc, float *y, int nr) {
    if (nr == Q4R) {
        _mm256_storeu_ps(y, acc);
        return;
    }
    float tmp[Q4R];
    _mm256_storeu_ps(tmp, acc);
    memcpy(y, tmp, sizeof(float) * (size_t)nr);
}

/* Per (token, block) of a call's chunk of blocks: the activation's scale
 * and offset correction, made once for all the call's rows. */
enum { Q4_DKB = 256 };
typedef struct { float d[Q4T][Q4_DKB]; int32_t corr[Q4T][Q4_DKB]; } q4_dact;

/* Register tile: 8 rows (nr valid) x T tokens over blocks [b0, b0 + kb);
 * the accumulators start from y when `cont` (a later chunk of blocks).
 * Prefetches the group `pf` bytes below (the next group's lines while this
 * one computes). */
LK_T2 static LK_INL void q4_tile(const int T, int64_t b0, int kb, const uint8_t *w, size_t ws, int nr,
                                 const uint8_t *a, size_t as, const q4_dact *A, float *y, size_t ys, size_t pf,
                                 bool cont) {
    __m256 acc[Q4T];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) acc[t] = cont ? q4_load(y + (size_t)t * ys, nr) : _mm256_setzero_ps();
    size_t next_pf = (size_t)b0 * LK_Q40_BYTES;
    for (int b = 0; b < kb; b++) {
        if (pf && (size_t)(b0 + b) * LK_Q40_BYTES >= next_pf) {
            for (int r = 0; r < nr; r++) _mm_prefetch((const char *)w + (size_t)r * ws + pf + next_pf, _MM_HINT_T0);
            next_pf += 64;
        }
        __m256i v[8];
        __m256 wd;
        q4_rows(w, ws, nr, b0 + b, v, &wd);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            acc[t] = q4_step(v, wd, a + (size_t)t * as + (size_t)(b0 + b) * LK_Q80_BYTES + 2,
                             _mm256_set1_epi32(A->corr[t][b]), A->d[t][b], acc[t]);
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) q4_store(acc[t], y + (size_t)t * ys, nr);
}

#define Q4_TILE(T)                                                                                             \
    LK_T2 static void q4_tile_##T(int64_t b0, int kb, const uint8_t *w, size_t ws, int nr, const uint8_t *a,  \
                                  size_t as, const q4_dact *A, float *y, size_t ys, size_t pf, bool cont) {   \
        q4_tile(T, b0, kb, w, ws, nr, a, as, A, y, ys, pf, cont);                                              \
    }
Q4_TILE(1) Q4_TILE(2) Q4_TILE(3) Q4_TILE(4)
typedef void (*q4_tile_fn)(int64_t b0, int kb, const uint8_t *w, size_t ws, int nr, const uint8_t *a, size_t as,
                           const q4_dact *A, float *y, size_t ys, size_t pf, bool cont);
static const q4_tile_fn k_q4_tiles[Q4T + 1] = { NULL, q4_tile_1, q4_tile_2, q4_tile_3, q4_tile_4 };

/* ---- GEMM ---------------------------------------------------------------- */

/* A panel: [block][8 quant vectors, then the 8 scales as floats][32 bytes]. */
typedef struct { _Alignas(32) uint8_t v[Q4_KB][9][32]; } q4_panel;
/* Per (token, block) of a chunk: the activation's scale and correction. */
typedef struct { float d[Q4_TC][Q4_KB]; int32_t corr[Q4_TC][Q4_KB]; } q4_act;

LK_T2 static void q4_pack(const uint8_t *w, size_t ws, int nr, int64_t b0, int kb, q4_panel *P) {
    for (int b = 0; b < kb; b++) {
        __m256i v[8];
        __m256 wd;
        q4_rows(w, ws, nr, b0 + b, v, &wd);
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) _mm256_store_si256((__m256i *)P->v[b][k], v[k]);
        _mm256_store_ps((float *)P->v[b][8], wd);
    }
}

/* The activation terms of tokens [0, tc) x blocks [b0, b0 + kb): scale as
 * float and correction, into d/corr rows `ld` apart. */
LK_T2 static void q4_prep(const uint8_t *a, size_t as, int tc, int64_t b0, int kb, float *d, int32_t *corr, int ld) {
    for (int t = 0; t < tc; t++)
        for (int b = 0; b < kb; b++) {
            const uint8_t *ab = a + (size_t)t * as + (size_t)(b0 + b) * LK_Q80_BYTES;
            d[t * ld + b] = _cvtsh_ss(lk_ld_u16(ab));
            corr[t * ld + b] = _mm256_cvtsi256_si32(q4_corr(ab));
        }
}

/* 8 rows x T tokens over a panel's kb blocks; the accumulators start from y
 * after the first panel (the block order of one long sum). */
LK_T2 static LK_INL void q4_gtile(const int T, const q4_panel *P, int kb, const uint8_t *a, size_t as, int64_t b0,
                                  const q4_act *A, int t0, float *y, size_t ys, int nr, bool cont) {
    __m256 acc[Q4T];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) acc[t] = cont ? q4_load(y + (size_t)t * ys, nr) : _mm256_setzero_ps();
    for (int b = 0; b < kb; b++) {
        __m256i s16[Q4T];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const __m256i v = _mm256_load_si256((const __m256i *)P->v[b][k]);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                const uint8_t *aq = a + (size_t)t * as + (size_t)(b0 + b) * LK_Q80_BYTES + 2 + 4 * k;
                const __m256i p = _mm256_maddubs_epi16(v, _mm256_set1_epi32(ld_i32(aq)));
                s16[t] = k ? _mm256_add_epi16(s16[t], p) : p;
            }
        }
        const __m256 wd = _mm256_load_ps((const float *)P->v[b][8]);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const __m256i isum = _mm256_add_epi32(_mm256_madd_epi16(s16[t], _mm256_set1_epi16(1)),
                                                  _mm256_set1_epi32(A->corr[t0 + t][b]));
            acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(isum),
                                                         _mm256_mul_ps(wd, _mm256_set1_ps(A->d[t0 + t][b]))));
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) q4_store(acc[t], y + (size_t)t * ys, nr);
}

#define Q4_GTILE(T)                                                                                            \
    LK_T2 static void q4_gtile_##T(const q4_panel *P, int kb, const uint8_t *a, size_t as, int64_t b0,        \
                                   const q4_act *A, int t0, float *y, size_t ys, int nr, bool cont) {         \
        q4_gtile(T, P, kb, a, as, b0, A, t0, y, ys, nr, cont);                                                 \
    }
Q4_GTILE(1) Q4_GTILE(2) Q4_GTILE(3) Q4_GTILE(4)
typedef void (*q4_gtile_fn)(const q4_panel *P, int kb, const uint8_t *a, size_t as, int64_t b0, const q4_act *A,
                            int t0, float *y, size_t ys, int nr, bool cont);
static const q4_gtile_fn k_q4_gtiles[Q4T + 1] = { NULL, q4_gtile_1, q4_gtile_2, q4_gtile_3, q4_gtile_4 };

LK_T2 static void q4_gemm(int64_t nb, int64_t nrows, const uint8_t *W, size_t ws, int64_t ntok, const uint8_t *A,
                          size_t as, float *y, size_t ys) {
    q4_panel P;
    q4_act act;
    for (int64_t t0 = 0; t0 < ntok; t0 += Q4_TC) {
        const int tc = (int)LK_MIN((int64_t)Q4_TC, ntok - t0);
        const uint8_t *at = A + (size_t)t0 * as;
        for (int64_t b0 = 0; b0 < nb; b0 += Q4_KB) {
            const int kb = (int)LK_MIN((int64_t)Q4_KB, nb - b0);
            q4_prep(at, as, tc, b0, kb, &act.d[0][0], &act.corr[0][0], Q4_KB);
            for (int64_t r0 = 0; r0 < nrows; r0 += Q4R) {
                const int nr = (int)LK_MIN((int64_t)Q4R, nrows - r0);
                q4_pack(W + (size_t)r0 * ws, ws, nr, b0, kb, &P);
                for (int t = 0; t < tc; t += Q4T) {
                    const int tt = LK_MIN(Q4T, tc - t);
                    k_q4_gtiles[tt](&P, kb, at + (size_t)t * as, as, b0, &act, t,
                                    y + (size_t)(t0 + t) * ys + (size_t)r0, ys, nr, b0 > 0);
                }
            }
        }
    }
}

/* The Q4_0 matrix kernel of the AVX2 level (lk_quant_matmul's contract). */
LK_T2 void lk_quant_mm_q40_avx2(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a,
                          size_t as, float *y, size_t ys) {
    const int64_t nb = n / LK_QK;
    const uint8_t *W = w, *A = a;
    if (ntok >= LK_Q40_GEMM_TOK) {
        q4_gemm(nb, nrows, W, ws, ntok, A, as, y, ys);
        return;
    }
    const int d = lk_quant_pf_tiles();
    q4_dact act;
    for (int64_t t = 0; t < ntok; t += Q4T) {
        const int tt = (int)LK_MIN((int64_t)Q4T, ntok - t);
        const uint8_t *at = A + (size_t)t * as;
        for (int64_t b0 = 0; b0 < nb; b0 += Q4_DKB) {
            const int kb = (int)LK_MIN((int64_t)Q4_DKB, nb - b0);
            q4_prep(at, as, tt, b0, kb, &act.d[0][0], &act.corr[0][0], Q4_DKB);
            for (int64_t r0 = 0; r0 < nrows; r0 += Q4R) {
                const int nr = (int)LK_MIN((int64_t)Q4R, nrows - r0);
                /* prefetch the group d below while it is inside the matrix */
                const size_t pf = d && r0 + (int64_t)(d + 1) * Q4R <= nrows ? (size_t)d * Q4R * ws : 0;
                k_q4_tiles[tt](b0, kb, W + (size_t)r0 * ws, ws, nr, at, as, &act, y + (size_t)t * ys + (size_t)r0, ys,
                               t == 0 ? pf : 0, b0 > 0);
            }
        }
    }
}
