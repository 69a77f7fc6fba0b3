/* quant_q4q8_avx2.c — Q4_0 and Q8_0 weights x Q8_0 activations on AVX2 (no
 * VNNI), with eight rows in the eight lanes of a register, in the scalar
 * reference's arithmetic: the same bits as `dot_q4_0` / `dot_q8_0` in
 * quant.c for every row, token and call shape.
 *
 * The arithmetic, per (row, token) and block b of 32 elements, in block
 * order:   s = s + (float)isum_b * (d_w * d_a)
 * where isum_b = sum w * a is the block's exact integer sum (Q4_0: w = q - 8).
 * Every path here (decode, a few tokens, prefill) does exactly that, so a
 * token's row has one value whatever the call's token count (batch
 * invariance) and whatever the SIMD level (AVX-512 keeps the same order),
 * and it is what the scalar code computes.
 *
 * Why rows in lanes. A block's products are summed within a row, and the
 * float work is per block; with a row's 32 products spread over the lanes
 * (the old tiles, and llama.cpp's vec_dot), each (row, token, block) costs a
 * conversion and a fused multiply-add into 8 lanes, and the lanes are added
 * at the end in a tree, another order than the scalar code's. With lane r =
 * row r, a block's 8 vpmaddubsw against broadcast 4-byte groups of the
 * activation give 8 rows' sums at once, and the float work (one
 * conversion, two multiplies, one add) is shared by 8 rows. Q4_0: the
 * 16-bit pairs are summed before one vpmaddwd widens them (a pair is at
 * most 2*15*128 and eight of them fit in int16), its offset as -8 * sum(a)
 * per (token, block). Q8_0: |w| times the activation with w's sign, each
 * pair widened on its own (a pair reaches 2*128*127), so Q8_0 gains the
 * scalar order and batch invariance here, not speed. Rows reach the lanes by
 * dword transposes of 8 rows' quant records (Q4_0: 4x4 in each 128-bit half
 * of the 16-byte nibble records, vector k holding quants 4k..4k+3 in its
 * low nibbles and 16+4k.. in its high ones, the record's own order; Q8_0:
 * 8x8 of the 32-byte records).
 *
 *  - Decode and up to 4 tokens: transposed in registers per block, used by
 *    the call's tokens at once.
 *  - From LK_Q40_GEMM_TOK tokens: a GEMM; 8 rows x 64 blocks (Q8_0: 32) are
 *    transposed once into an L1 panel (17-18 KB) that every token of a
 *    chunk of 64 reads, and each (token, block)'s scale and offset
 *    correction are made once per chunk, not per 8 rows.
 *
 * Rows past the end of a matrix are zero lanes (their stores skipped); a
 * row's lane never mixes with another's, so a row's result does not depend
 * on the rows beside it. */
#include <immintrin.h>

#include "quant/simd_x86.h"

enum {
    QR = 8,       /* rows per group (one per lane) */
    QT = 4,       /* tokens per register tile */
    Q_TC = 64,    /* tokens per GEMM chunk */
    Q_KBMAX = 64, /* blocks per GEMM panel: Q4_0 64 x 288 B, Q8_0 32 x 544 B (18 / 17 KB) */
};
/* per block of a group: vectors (Q4_0: 8 unsigned quant vectors; Q8_0: 8 of
 * |w|, then 8 of w for the signs), then the 8 scales as floats */
#define Q_NV(Q) ((Q) ? 16 : 8)
#define Q_KB(Q) ((Q) ? 32 : 64)
#define Q_BB(Q) ((size_t)((Q) ? LK_Q80_BYTES : LK_Q40_BYTES))

/* 8 rows' block b (row r at w + r*ws; rows >= nr are zero) -> v: vector k's
 * lane r holds quants 4k..4k+3 of row r (Q4_0: k >= 4 are quants
 * 16+4(k-4).., the high nibbles; Q8_0: v[k] = |w|, v[8 + k] = w); *d = the
 * rows' scales. */
LK_T2 static LK_INL void q_rows(const int Q, const uint8_t *w, size_t ws, int nr, int64_t b, __m256i *v, __m256 *d) {
    static const uint8_t zero[LK_Q80_BYTES];
    const uint8_t *p[QR];
#pragma GCC unroll 8
    for (int r = 0; r < QR; r++) p[r] = r < nr ? w + (size_t)r * ws + (size_t)b * Q_BB(Q) : zero;
    if (!Q) {
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
    } else {
        /* 8x8 dword transpose: rows' 32 quant bytes -> vector k = dword k of each row */
        __m256i Y[8], t[8], u[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) Y[r] = _mm256_loadu_si256((const __m256i *)(p[r] + 2));
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            t[2 * j] = _mm256_unpacklo_epi32(Y[2 * j], Y[2 * j + 1]);
            t[2 * j + 1] = _mm256_unpackhi_epi32(Y[2 * j], Y[2 * j + 1]);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* rows 4h..4h+3 */
            u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);     /* dwords 0 | 4 */
            u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);     /* 1 | 5 */
            u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]); /* 2 | 6 */
            u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]); /* 3 | 7 */
        }
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const __m256i lo = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);
            const __m256i hi = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);
            v[8 + k] = lo;
            v[12 + k] = hi;
            v[k] = _mm256_abs_epi8(lo);
            v[4 + k] = _mm256_abs_epi8(hi);
        }
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

/* -8 * (sum of a Q8_0 block's 32 quants) in every lane: Q4_0's offset */
LK_T2 static LK_INL __m256i q4_corr(const uint8_t *ab) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(ab + 2));
    __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
    s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0x4E));
    s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0xB1));
    s = _mm256_add_epi32(s, _mm256_permute2x128_si256(s, s, 0x01));
    return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s, 3));
}

/* 8 rows' exact integer sums of one block against one token's block
 * (quants at aq) plus corr. Q4_0: eight vpmaddubsw summed in int16 (a pair
 * is at most 2*15*128, eight of them fit), one vpmaddwd; Q8_0: |w| times
 * the activation with w's sign, each widened (a pair reaches 2*128*127). */
LK_T2 static LK_INL __m256i q_isum(const int Q, const __m256i *v, const uint8_t *aq, __m256i corr) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (!Q) {
        __m256i s16 = _mm256_maddubs_epi16(v[0], _mm256_set1_epi32(lk_ld_i32(aq)));
#pragma GCC unroll 8
        for (int k = 1; k < 8; k++)
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[k], _mm256_set1_epi32(lk_ld_i32(aq + 4 * k))));
        return _mm256_add_epi32(_mm256_madd_epi16(s16, ones), corr);
    }
    __m256i s = corr;
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++)
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(v[k], _mm256_sign_epi8(
                                                      _mm256_set1_epi32(lk_ld_i32(aq + 4 * k)), v[8 + k])), ones));
    return s;
}

/* acc + (float)isum * (wd * da), per lane: the scalar reference's block step */
LK_T2 static LK_INL __m256 q_fstep(__m256 acc, __m256i isum, __m256 wd, float da) {
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(wd, _mm256_set1_ps(da))));
}

/* Rows [0, nr) of y as a vector (zero lanes past nr). */
LK_T2 static LK_INL __m256 q_load(const float *y, int nr) {
    if (nr == QR) return _mm256_loadu_ps(y);
    float tmp[QR] = { 0 };
    memcpy(tmp, y, sizeof(float) * (size_t)nr);
    return _mm256_loadu_ps(tmp);
}

/* Stores rows [0, nr) of an accumulator to y. */
LK_T2 static LK_INL void q_store(__m256 acc, float *y, int nr) {
    if (nr == QR) {
        _mm256_storeu_ps(y, acc);
        return;
    }
    float tmp[QR];
    _mm256_storeu_ps(tmp, acc);
    memcpy(y, tmp, sizeof(float) * (size_t)nr);
}

/* The activation terms of tokens [0, tc) x blocks [b0, b0 + kb): scale as
 * float and (Q4_0) offset correction, into d/corr rows `ld` apart. */
LK_T2 static void q_prep(const int Q, const uint8_t *a, size_t as, int tc, int64_t b0, int kb, float *d,
                         int32_t *corr, int ld) {
    for (int t = 0; t < tc; t++)
        for (int b = 0; b < kb; b++) {
            const uint8_t *ab = a + (size_t)t * as + (size_t)(b0 + b) * LK_Q80_BYTES;
            d[t * ld + b] = _cvtsh_ss(lk_ld_u16(ab));
            corr[t * ld + b] = Q ? 0 : _mm256_cvtsi256_si32(q4_corr(ab));
        }
}

/* ---- decode and a few tokens: register tiles ------------------------------ */

/* Per (token, block) of a call's chunk of blocks: the activation's terms,
 * made once for all the call's rows; up to Q_DCH chunks' at once (32 KB). */
enum { Q_DKB = 256, Q_DCH = 4 };
typedef struct { float d[QT][Q_DKB]; int32_t corr[QT][Q_DKB]; } q_dact;

/* 8 rows (nr valid) x T tokens over blocks [b0, b0 + kb); the accumulators
 * start from y when `cont` (a later chunk of blocks). Prefetches the group
 * `pf` bytes below (the next group's lines while this one computes). */
LK_T2 static LK_INL void q_tile(const int Q, const int T, int64_t b0, int kb, const uint8_t *w, size_t ws, int nr,
                                const uint8_t *a, size_t as, const q_dact *A, float *y, size_t ys, size_t pf,
                                bool cont) {
    __m256 acc[QT];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) acc[t] = cont ? q_load(y + (size_t)t * ys, nr) : _mm256_setzero_ps();
    size_t next_pf = (size_t)b0 * Q_BB(Q);
    for (int b = 0; b < kb; b++) {
        lk_quant_pf_group(w, ws, nr, pf, (size_t)(b0 + b) * Q_BB(Q), &next_pf);
        __m256i v[16];
        __m256 wd;
        q_rows(Q, w, ws, nr, b0 + b, v, &wd);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            acc[t] = q_fstep(acc[t], q_isum(Q, v, a + (size_t)t * as + (size_t)(b0 + b) * LK_Q80_BYTES + 2,
                                            _mm256_set1_epi32(A->corr[t][b])),
                             wd, A->d[t][b]);
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) q_store(acc[t], y + (size_t)t * ys, nr);
}

typedef void (*q_tile_fn)(int64_t b0, int kb, const uint8_t *w, size_t ws, int nr, const uint8_t *a, size_t as,
                          const q_dact *A, float *y, size_t ys, size_t pf, bool cont);
#define Q_TILE(Q, T)                                                                                           \
    LK_T2 static void q_tile_##Q##_##T(int64_t b0, int kb, const uint8_t *w, size_t ws, int nr, const uint8_t *a, \
                                       size_t as, const q_dact *A, float *y, size_t ys, size_t pf, bool cont) {  \
        q_tile(Q, T, b0, kb, w, ws, nr, a, as, A, y, ys, pf, cont);                                            \
    }
Q_TILE(0, 1) Q_TILE(0, 2) Q_TILE(0, 3) Q_TILE(0, 4)
Q_TILE(1, 1) Q_TILE(1, 2) Q_TILE(1, 3) Q_TILE(1, 4)
static const q_tile_fn k_tiles[2][QT + 1] = {
    { NULL, q_tile_0_1, q_tile_0_2, q_tile_0_3, q_tile_0_4 },
    { NULL, q_tile_1_1, q_tile_1_2, q_tile_1_3, q_tile_1_4 },
};

/* ---- GEMM ------------------------------------------------------------------ */

/* A panel: per block Q_NV vectors, then the 8 scales as floats (32 bytes each). */
typedef struct { _Alignas(32) uint8_t v[Q_KBMAX * 9 * 32]; } q_panel;
/* Per (token, block) of a chunk: the activation's scale and correction. */
typedef struct { float d[Q_TC][Q_KBMAX]; int32_t corr[Q_TC][Q_KBMAX]; } q_act;

LK_T2 static void q_pack(const int Q, const uint8_t *w, size_t ws, int nr, int64_t b0, int kb, q_panel *P) {
    const size_t bs = (size_t)(Q_NV(Q) + 1) * 32;
    for (int b = 0; b < kb; b++) {
        __m256i v[16];
        __m256 wd;
        q_rows(Q, w, ws, nr, b0 + b, v, &wd);
        uint8_t *o = P->v + (size_t)b * bs;
        for (int k = 0; k < Q_NV(Q); k++) _mm256_store_si256((__m256i *)(o + 32 * k), v[k]);
        _mm256_store_ps((float *)(o + 32 * Q_NV(Q)), wd);
    }
}

/* 8 rows x T tokens over a panel's kb blocks; the accumulators start from y
 * after the first panel (the block order of one long sum). */
LK_T2 static LK_INL void q_gtile(const int Q, const int T, const q_panel *P, int kb, const uint8_t *a, size_t as,
                                 int64_t b0, const q_act *A, int t0, float *y, size_t ys, int nr, bool cont) {
    const size_t bs = (size_t)(Q_NV(Q) + 1) * 32;
    __m256 acc[QT];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) acc[t] = cont ? q_load(y + (size_t)t * ys, nr) : _mm256_setzero_ps();
    for (int b = 0; b < kb; b++) {
        const uint8_t *o = P->v + (size_t)b * bs;
        const uint8_t *aq = a + (size_t)(b0 + b) * LK_Q80_BYTES + 2;
        __m256i s[QT];
        if (!Q) {
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m256i v = _mm256_load_si256((const __m256i *)(o + 32 * k));
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    const __m256i p = _mm256_maddubs_epi16(v, _mm256_set1_epi32(lk_ld_i32(aq + (size_t)t * as + 4 * k)));
                    s[t] = k ? _mm256_add_epi16(s[t], p) : p;
                }
            }
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                s[t] = _mm256_add_epi32(_mm256_madd_epi16(s[t], _mm256_set1_epi16(1)),
                                        _mm256_set1_epi32(A->corr[t0 + t][b]));
        } else {
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m256i av = _mm256_load_si256((const __m256i *)(o + 32 * k));
                const __m256i sv = _mm256_load_si256((const __m256i *)(o + 32 * (8 + k)));
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    const __m256i p = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(av, _mm256_sign_epi8(_mm256_set1_epi32(lk_ld_i32(aq + (size_t)t * as + 4 * k)), sv)),
                        _mm256_set1_epi16(1));
                    s[t] = k ? _mm256_add_epi32(s[t], p) : p;
                }
            }
        }
        const __m256 wd = _mm256_load_ps((const float *)(o + 32 * Q_NV(Q)));
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[t] = q_fstep(acc[t], s[t], wd, A->d[t0 + t][b]);
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) q_store(acc[t], y + (size_t)t * ys, nr);
}

typedef void (*q_gtile_fn)(const q_panel *P, int kb, const uint8_t *a, size_t as, int64_t b0, const q_act *A,
                           int t0, float *y, size_t ys, int nr, bool cont);
#define Q_GTILE(Q, T)                                                                                          \
    LK_T2 static void q_gtile_##Q##_##T(const q_panel *P, int kb, const uint8_t *a, size_t as, int64_t b0,   \
                                        const q_act *A, int t0, float *y, size_t ys, int nr, bool cont) {    \
        q_gtile(Q, T, P, kb, a, as, b0, A, t0, y, ys, nr, cont);                                               \
    }
Q_GTILE(0, 1) Q_GTILE(0, 2) Q_GTILE(0, 3) Q_GTILE(0, 4)
Q_GTILE(1, 1) Q_GTILE(1, 2) Q_GTILE(1, 3) Q_GTILE(1, 4)
static const q_gtile_fn k_gtiles[2][QT + 1] = {
    { NULL, q_gtile_0_1, q_gtile_0_2, q_gtile_0_3, q_gtile_0_4 },
    { NULL, q_gtile_1_1, q_gtile_1_2, q_gtile_1_3, q_gtile_1_4 },
};

LK_T2 static void q_gemm(const int Q, int64_t nb, int64_t nrows, const uint8_t *W, size_t ws, int64_t ntok,
                         const uint8_t *A, size_t as, float *y, size_t ys) {
    q_panel P;
    q_act act;
    const int KB = Q_KB(Q);
    for (int64_t t0 = 0; t0 < ntok; t0 += Q_TC) {
        const int tc = (int)LK_MIN((int64_t)Q_TC, ntok - t0);
        const uint8_t *at = A + (size_t)t0 * as;
        for (int64_t b0 = 0; b0 < nb; b0 += KB) {
            const int kb = (int)LK_MIN((int64_t)KB, nb - b0);
            q_prep(Q, at, as, tc, b0, kb, &act.d[0][0], &act.corr[0][0], Q_KBMAX);
            for (int64_t r0 = 0; r0 < nrows; r0 += QR) {
                const int nr = (int)LK_MIN((int64_t)QR, nrows - r0);
                q_pack(Q, W + (size_t)r0 * ws, ws, nr, b0, kb, &P);
                for (int t = 0; t < tc; t += QT) {
                    const int tt = LK_MIN(QT, tc - t);
                    k_gtiles[Q][tt](&P, kb, at + (size_t)t * as, as, b0, &act, t,
                                    y + (size_t)(t0 + t) * ys + (size_t)r0, ys, nr, b0 > 0);
                }
            }
        }
    }
}

/* prefetch the group d below while it is inside the matrix */
static inline size_t q_group_pf(int d, int64_t r0, int64_t nrows, size_t ws) {
    return d && r0 + (int64_t)(d + 1) * QR <= nrows ? (size_t)d * QR * ws : 0;
}

LK_T2 static void q_mm(const int Q, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                       const void *a, size_t as, float *y, size_t ys) {
    const int64_t nb = n / LK_QK;
    const uint8_t *W = w, *A = a;
    if (ntok >= LK_Q40_GEMM_TOK) {
        q_gemm(Q, nb, nrows, W, ws, ntok, A, as, y, ys);
        return;
    }
    const int d = lk_quant_pf_tiles();
    const int nc = (int)((nb + Q_DKB - 1) / Q_DKB);
    q_dact act[Q_DCH];
    for (int64_t t = 0; t < ntok; t += QT) {
        const int tt = (int)LK_MIN((int64_t)QT, ntok - t);
        const uint8_t *at = A + (size_t)t * as;
        if (nc > 1 && nc <= Q_DCH) {
            /* A row of 2-4 K blocks (8193-32768 columns: Llama-3-8B's down,
             * 70B's): each group's K blocks in turn, the terms of all of
             * them made first, so a group's rows are read to their ends
             * before the next group's, as a shorter row's are. K blocks
             * outside the groups read every row in pieces, with gaps the
             * prefetchers start over at: bench_quant 4096 x 18432 Q4_0, one
             * thread on the SPR guest, 84 -> 101 % of the probe streamed
             * (7168 columns: 103 % either way). */
            for (int c = 0; c < nc; c++)
                q_prep(Q, at, as, tt, (int64_t)c * Q_DKB, (int)LK_MIN((int64_t)Q_DKB, nb - (int64_t)c * Q_DKB),
                       &act[c].d[0][0], &act[c].corr[0][0], Q_DKB);
            for (int64_t r0 = 0; r0 < nrows; r0 += QR) {
                const int nr = (int)LK_MIN((int64_t)QR, nrows - r0);
                const size_t pf = q_group_pf(d, r0, nrows, ws);
                for (int c = 0; c < nc; c++) {
                    const int64_t b0 = (int64_t)c * Q_DKB;
                    k_tiles[Q][tt](b0, (int)LK_MIN((int64_t)Q_DKB, nb - b0), W + (size_t)r0 * ws, ws, nr, at, as, &act[c],
                                   y + (size_t)t * ys + (size_t)r0, ys, t == 0 ? pf : 0, c > 0);
                }
            }
            continue;
        }
        for (int64_t b0 = 0; b0 < nb; b0 += Q_DKB) {
            const int kb = (int)LK_MIN((int64_t)Q_DKB, nb - b0);
            q_prep(Q, at, as, tt, b0, kb, &act[0].d[0][0], &act[0].corr[0][0], Q_DKB);
            for (int64_t r0 = 0; r0 < nrows; r0 += QR) {
                const int nr = (int)LK_MIN((int64_t)QR, nrows - r0);
                const size_t pf = q_group_pf(d, r0, nrows, ws);
                k_tiles[Q][tt](b0, kb, W + (size_t)r0 * ws, ws, nr, at, as, &act[0], y + (size_t)t * ys + (size_t)r0, ys,
                               t == 0 ? pf : 0, b0 > 0);
            }
        }
    }
}

/* The Q4_0 and Q8_0 matrix kernels of the AVX2 level (lk_quant_matmul's contract). */
LK_T2 void lk_quant_mm_q40_avx2(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a,
                                size_t as, float *y, size_t ys) {
    q_mm(0, n, nrows, w, ws, ntok, a, as, y, ys);
}
LK_T2 void lk_quant_mm_q80_avx2(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a,
                                size_t as, float *y, size_t ys) {
    q_mm(1, n, nrows, w, ws, ntok, a, as, y, ys);
}
