/* quant_avx512.c — AVX-512 kernels (F, BW, VL, DQ, VNNI, VBMI; BF16 where
 * present): lk_quant_matmul for every supported weight type and the Q8_0 /
 * Q8_K activation quantisers.
 *
 * Why they look the way they do. Decode reads every weight byte once per
 * token, so a kernel is good when it retires a block faster than memory
 * delivers it (~16 GB/s on one core here: a Q4_0 block of 18 bytes every
 * ~3 cycles). ggml's kernels spend most of that on shuffles per block, so
 * ours work on groups of 4 blocks per 512-bit register, with one two-table
 * byte permute (vpermt2b) gathering the 4 blocks' quants out of their packed
 * 18/34-byte records, one vpdpbusd per 64 products, and the block scales
 * gathered by one more permute. Several weight rows share each activation
 * group (decode: R rows x 1 token; prefill: R rows x T tokens register tiles,
 * weights decoded once per tile and reused for T tokens).
 *
 * vpdpbusd multiplies unsigned by signed bytes, so weights are made unsigned
 * (Q4_0 nibbles are 0..15; Q8_0 is flipped to w+128; K-quant quants are
 * unsigned) and the offset is removed with a per-lane correction computed
 * from the activations only: sum (q-8)*a = sum q*a - 8*sum a. Integer sums
 * per block are exact; only the float scaling and summation order differ
 * from the scalar reference. */
#include <immintrin.h>

#include "quant/quant_impl.h"

#define LK_T512                                                                                \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma," \
                          "f16c,bmi,bmi2")))
#define LK_INL inline __attribute__((always_inline))

/* ===================================================================== */
/* Permute tables                                                          */
/* ===================================================================== */

/* Built once at fill time (the dispatch table's init), read-only after. */
static uint8_t k_q40_qs[64], k_q40_d[64], k_q80_lo[64], k_q80_hi[64], k_q80_d[64];

static void build_tables(void) {
    for (int i = 0; i < 64; i++) {
        int k = i / 16, j = i % 16;
        /* Q4_0 group of 4 blocks (72 B) read as p[0..63] | p[8..71]: byte x
         * of the group is table index x (< 64) or x - 8 + 64. */
        int x = 18 * k + 2 + j;
        k_q40_qs[i] = (uint8_t)(x < 64 ? x : x + 56);
        /* the 4 fp16 scales, each repeated 4 times (16 words) */
        k_q40_d[i] = (uint8_t)(i < 32 ? 18 * (i / 8) + (i & 1) : 0);
        /* Q8_0 group (136 B): lo = quants 0..15 of each block from
         * p[0..127]; hi = quants 16..31 from p[8..135]. */
        k_q80_lo[i] = (uint8_t)(34 * k + 2 + j);
        k_q80_hi[i] = (uint8_t)(34 * k + 18 + j - 8);
        k_q80_d[i] = (uint8_t)(i < 32 ? 34 * (i / 8) + (i & 1) : 0);
    }
}

typedef struct {
    __m512i q40_qs, q40_d, q80_lo, q80_hi, q80_d, m0f;
} lk_tabs;

LK_T512 static LK_INL lk_tabs tabs_load(void) {
    lk_tabs t;
    t.q40_qs = _mm512_loadu_si512(k_q40_qs);
    t.q40_d = _mm512_loadu_si512(k_q40_d);
    t.q80_lo = _mm512_loadu_si512(k_q80_lo);
    t.q80_hi = _mm512_loadu_si512(k_q80_hi);
    t.q80_d = _mm512_loadu_si512(k_q80_d);
    t.m0f = _mm512_set1_epi8(0x0F);
    return t;
}

LK_T512 static LK_INL float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

/* ===================================================================== */
/* Q4_0 and Q8_0 weights x Q8_0 activations                                */
/* ===================================================================== */

/* A group of 4 Q8_0 activation blocks, laid out to meet the weights:
 * 128-bit lane k holds block k; `lo` its quants 0..15, `hi` 16..31; `d` its
 * scale in 4 float lanes. `neg8`/`neg128` = -8*sum / -128*sum of each lane's 4
 * quants: the offset correction of Q4_0 and (flipped) Q8_0 weights. */
typedef struct { __m512i lo, hi; __m512 d; } q8grp;

LK_T512 static LK_INL q8grp q80_load(const lk_tabs *tb, const uint8_t *p) {
    __m512i a0 = _mm512_loadu_si512(p), a1 = _mm512_loadu_si512(p + 64);
    __m512i a2 = _mm512_loadu_si512(p + 8), a3 = _mm512_loadu_si512(p + 72);
    q8grp g;
    g.lo = _mm512_permutex2var_epi8(a0, tb->q80_lo, a1);
    g.hi = _mm512_permutex2var_epi8(a2, tb->q80_hi, a3);
    g.d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi8(a0, tb->q80_d, a1)));
    return g;
}

/* -k * (sum of each lane's 4 activation quants), k a byte constant */
LK_T512 static LK_INL __m512i q80_negsum(const q8grp *a, __m512i k) {
    __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k, a->lo);
    c = _mm512_dpbusd_epi32(c, k, a->hi);
    return _mm512_sub_epi32(_mm512_setzero_si512(), c);
}

typedef struct { __m512i lo, hi; __m512 d; } wgrp;

LK_T512 static LK_INL wgrp q40_wload(const lk_tabs *tb, const uint8_t *p) {
    __m512i l0 = _mm512_loadu_si512(p), l1 = _mm512_loadu_si512(p + 8);
    __m512i q = _mm512_permutex2var_epi8(l0, tb->q40_qs, l1);
    wgrp w;
    w.lo = _mm512_and_si512(q, tb->m0f);
    w.hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), tb->m0f);
    w.d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi8(tb->q40_d, l0)));
    return w;
}

LK_T512 static LK_INL wgrp q80_wload(const lk_tabs *tb, const uint8_t *p) {
    q8grp g = q80_load(tb, p);
    __m512i flip = _mm512_set1_epi8((char)0x80);
    wgrp w = {_mm512_xor_si512(g.lo, flip), _mm512_xor_si512(g.hi, flip), g.d};
    return w;
}

/* One R x T register tile over `ng` groups of 4 blocks: rows w + r*ws,
 * activation rows a + t*as. is_q8: weights are Q8_0 (else Q4_0). Leftover
 * blocks (nb % 4) go through the scalar code. */
LK_T512 static LK_INL void q4q8_tile(const int R, const int T, const bool is_q8, int64_t n,
                                     const uint8_t *w, size_t ws, const uint8_t *a, size_t as,
                                     float *y, size_t ys) {
    const lk_tabs tb = tabs_load();
    const int64_t nb = n / LK_QK, ng = nb / 4;
    const size_t wbb = is_q8 ? LK_Q80_BYTES : LK_Q40_BYTES;
    const __m512i kofs = _mm512_set1_epi8(is_q8 ? (char)0x80 : 8);
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        wgrp W[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + r * ws + (size_t)g * 4 * wbb;
            W[r] = is_q8 ? q80_wload(&tb, p) : q40_wload(&tb, p);
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            q8grp A = q80_load(&tb, a + t * as + (size_t)g * 4 * LK_Q80_BYTES);
            __m512i neg = q80_negsum(&A, kofs);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m512i s = _mm512_dpbusd_epi32(neg, W[r].lo, A.lo);
                s = _mm512_dpbusd_epi32(s, W[r].hi, A.hi);
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(W[r].d, A.d), acc[r][t]);
            }
        }
    }
    const int64_t tail = (nb - ng * 4) * LK_QK;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            float s = hsum(acc[r][t]);
            if (tail)
                s += lk_quant_dot_scalar(is_q8 ? LK_TYPE_Q8_0 : LK_TYPE_Q4_0, tail,
                                         w + r * ws + (size_t)ng * 4 * wbb,
                                         a + t * as + (size_t)ng * 4 * LK_Q80_BYTES);
            y[t * ys + r] = s;
        }
}

/* Instantiations: the tile shapes the drivers use. */
#define LK_TILE_FN(name, body, R, T)                                                          \
    LK_T512 static void name##_##R##x##T(int64_t n, const uint8_t *w, size_t ws,              \
                                           const uint8_t *a, size_t as, float *y, size_t ys) { \
        body(R, T, n, w, ws, a, as, y, ys);                                                   \
    }

#define Q40_BODY(R, T, ...) q4q8_tile(R, T, false, __VA_ARGS__)
#define Q80_BODY(R, T, ...) q4q8_tile(R, T, true, __VA_ARGS__)
#define LK_TILES(name, body)                                                      \
    LK_TILE_FN(name, body, 4, 1) LK_TILE_FN(name, body, 1, 1)                    \
    LK_TILE_FN(name, body, 4, 3) LK_TILE_FN(name, body, 4, 2)                    \
    LK_TILE_FN(name, body, 1, 3) LK_TILE_FN(name, body, 1, 2)                    \
    static const lk_tile_fn name##_tiles[2][4] = {                                \
        {NULL, name##_1x1, name##_1x2, name##_1x3},                               \
        {NULL, name##_4x1, name##_4x2, name##_4x3},                               \
    };

typedef void (*lk_tile_fn)(int64_t n, const uint8_t *w, size_t ws, const uint8_t *a, size_t as,
                           float *y, size_t ys);

LK_TILES(q40, Q40_BODY)
LK_TILES(q80, Q80_BODY)

/* The driver shared by all types: decode walks 4 rows at a time over the one
 * activation row; prefill takes tokens in chunks that stay in L2 (64 tokens)
 * and, inside a chunk, 4-row x 3-token tiles, so each weight group is decoded
 * once per 3 tokens and each row chunk is read from memory once per 64
 * tokens. */
static void run_tiles(const lk_tile_fn tiles[2][4], int64_t n, int64_t nrows, const void *w,
                      size_t ws, int64_t ntok, const void *a, size_t as, float *y, size_t ys) {
    const uint8_t *W = w, *A = a;
    enum { TCHUNK = 64, RT = 4, TT = 3 };
    for (int64_t t0 = 0; t0 < ntok; t0 += TCHUNK) {
        int64_t t1 = LK_MIN(ntok, t0 + TCHUNK);
        int64_t step;
        for (int64_t r = 0; r < nrows; r += step) {
            int rr = nrows - r >= RT;
            step = rr ? RT : 1;
            for (int64_t t = t0; t < t1; t += TT) {
                int tt = (int)LK_MIN((int64_t)TT, t1 - t);
                tiles[rr][tt](n, W + (size_t)r * ws, ws, A + (size_t)t * as, as,
                              y + (size_t)t * ys + (size_t)r, ys);
            }
        }
    }
}

#define LK_MM_FN(name)                                                                       \
    static void mm_##name(int64_t n, int64_t nrows, const void *w, size_t w_stride,          \
                          int64_t ntok, const void *a, size_t a_stride, float *y,            \
                          size_t y_stride) {                                                 \
        run_tiles(name##_tiles, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride);      \
    }
LK_MM_FN(q40)
LK_MM_FN(q80)

void lk_quant_fill_avx512(lk_quant_ops *ops) {
    build_tables();
    ops->name = "avx512";
    ops->mm[LK_TYPE_Q4_0] = mm_q40;
    ops->mm[LK_TYPE_Q8_0] = mm_q80;
}
