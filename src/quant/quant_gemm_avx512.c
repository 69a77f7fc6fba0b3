/* quant_gemm_avx512.c — prefill (many tokens at once) for Q4_0 / Q8_0
 * (Q8_0 activations) and Q4_K / Q5_K / Q6_K (Q8_K activations) weights, as
 * a blocked GEMM with packed weights (float weights take quant_avx512.c's
 * register tiles for every token count). lk_quant_matmul's
 * AVX-512 entries call it from LK_GEMM_MIN_TOK* tokens on (quant_impl.h);
 * decode (1 token) never comes here.
 *
 * Why a different kernel from decode. Prefill multiplies each weight by
 * dozens to hundreds of tokens, so the cost that matters is instructions per
 * multiply, not bytes per weight. The register tiles of quant_avx512.c
 * re-decode nibbles and re-permute activations every 3 tokens and scale
 * every 4-block partial sum: ~10 uops per 2 vpdpbusd. Here:
 *
 *  - Weights are packed once per (token block, K block) into an L1-resident
 *    panel: 16 rows interleaved per zmm (lane = row), int8 already unpacked
 *    and made unsigned, one vector per 4 quants of a block, the 16 rows'
 *    block scales as floats. Packing is reused by every token of the block
 *    (128); the next panel's rows are prefetched while the tiles run.
 *  - Activations stay in their Q8_0 rows: each 4-byte group of quants is a
 *    broadcast memory operand of vpdpbusd (no shuffles at all), so one
 *    instruction does 4 products for 16 rows, and the i32 lane of a row
 *    collects that row's whole block sum in 8 instructions.
 *  - Per (16 rows, token, block): the accumulator starts at the activation's
 *    offset correction (a broadcast load: -8*sum(a) for Q4_0's unsigned
 *    nibbles, -128*sum(a) for Q8_0 made unsigned by +128), 8 vpdpbusd, then
 *    one convert and the scalar reference's float work (d_w*d_a, times the
 *    sum, added): 8 useful uops in 12 (vpdpbusd and the float ops share
 *    ports 0 and 5 on SPR, 2 a cycle; measured ~400 GFLOP/s on one core, the
 *    port bound at ~2.7 GHz).
 *  - Outputs come out as 16 consecutive rows of y: no horizontal sums.
 *
 * Micro-tile: 3 row groups (48 rows) x 4 tokens = 12 i32 + 12 f32
 * accumulators; per 4-quant step 3 weight loads and 4 broadcasts feed 12
 * vpdpbusd, so loads (2-3 a cycle) never limit. Blocking: K blocks of
 * GK_KB blocks keep the 48-row panel (27 KB) in L1 across all token tiles;
 * token blocks of GK_TB keep the activations and y in L2. Stack: the panel
 * and the activation terms (when the call derives them), under 300 KB
 * (K-quants under 70 KB; pool threads have the default 8 MB).
 *
 * Integer block sums are exact and the float work per block is the scalar
 * reference's in its order, and each K block's accumulators start from what
 * the previous K blocks left in y (gk_init), so every row gives the scalar
 * code's bits whatever its length; the decode and small-batch kernels keep
 * the same order (batch invariance: quant_avx512.c). (An FMA instead
 * of multiply + add would save ~8 %, at the price of different roundings
 * from the scalar code and llama.cpp.) The K-quants: see their section
 * below. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "quant/simd_x86.h"

enum {
    GK_ROWS = 16, /* rows per interleaved group: one zmm lane per row */
    GK_RG = 3,    /* row groups per micro-tile */
    GK_T = 4,     /* tokens per micro-tile */
    GK_KB = 16,   /* blocks per K block: GK_RG*16 rows x 16 blocks x 36 B = 27 KB, in L1 */
    GK_TB = 128,  /* tokens per token block (weights packed once per block) */
    GK_KSB = 256, /* blocks per K super-block (activation terms prepared at once: LK_TERMS_KB) */
    GK_VEC = 9,   /* zmm per (row group, block): 8 quant vectors + 16 float scales */
};

/* The packed panel: [row group][block][vector][64 bytes]. */
typedef struct {
    _Alignas(64) uint8_t v[GK_RG][GK_KB][GK_VEC][64];
} gk_panel;

/* Per-token, per-block activation terms of one (token block, K block):
 * the block's scale as float and the offset correction of the weights
 * (lk_act_terms, quant.h), derived by the call (gk_act) or read where the
 * kernels part put them (gk_terms: token t, block b at [t * GK_KSB + b]). */
typedef struct {
    float   d[GK_TB][GK_KSB];
    int32_t corr[GK_TB][GK_KSB];
} gk_act;
typedef struct {
    const float   *d;
    const int32_t *corr;
} gk_terms;
_Static_assert((int)GK_KSB == (int)LK_TERMS_KB, "the GEMM reads lk_act_terms in its own K blocks");

/* The terms of tokens t0.. from block b0 on (a multiple of LK_TERMS_KB) in
 * T, if T holds them for offset k; else false. */
static inline bool terms_at(const lk_act_terms *T, int32_t k, int64_t t0, int64_t b0, gk_terms *out) {
    if (!T || T->k != k) return false;
    const size_t i = (size_t)((b0 / LK_TERMS_KB * T->ntok + t0) * LK_TERMS_KB);
    out->d = T->d + i;
    out->corr = T->corr + i;
    return true;
}

/* x >> 4 in every byte (GF(2) affine map picking input bits 4..7). */
LK_T512 static LK_INL __m512i gk_hi_nibble(__m512i x) {
    return _mm512_gf2p8affine_epi64_epi8(x, _mm512_set1_epi64(0x1020408000000000ll), 0);
}

/* 16 rows x 16 bytes (row r at p[r]) -> 4 vectors, vector k lane r = bytes
 * 4k..4k+3 of row r. Z_j holds rows j, j+4, j+8, j+12 in its 128-bit lanes;
 * a 4x4 dword transpose inside each 128-bit lane finishes it. */
LK_T512 static LK_INL void gk_transpose16x4(const __m128i q[16], __m512i out[4]) {
    __m512i z[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        __m512i v = _mm512_castsi128_si512(q[j]);
        v = _mm512_inserti32x4(v, q[j + 4], 1);
        v = _mm512_inserti32x4(v, q[j + 8], 2);
        z[j] = _mm512_inserti32x4(v, q[j + 12], 3);
    }
    __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);
    out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3);
    out[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* The fp16 at p + r*ws (r < nr; 0 beyond) of 16 rows as floats: two
 * 8-lane gathers with 64-bit offsets (any row stride), their low 16 bits.
 * (Sixteen 2-byte stores read back as one vector would stall on store
 * forwarding: that was a third of the packing time.) */
LK_T512 static LK_INL __m512 gk_gather_h16(const uint8_t *p, size_t ws, int nr) {
    const __m512i idx = _mm512_mullo_epi64(_mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7), _mm512_set1_epi64((long long)ws));
    const __mmask16 m = (__mmask16)((1u << nr) - 1);
    __m512i g0 = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), (__mmask8)m, idx, p, 1);
    __m512i g1 = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), (__mmask8)(m >> 8), idx, p + 8 * ws, 1);
    __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi64_epi16(g0)), _mm512_cvtepi64_epi16(g1), 1);
    return _mm512_cvtph_ps(h);
}

/* The 16 bytes at p + r*ws (r < 16; zero for r >= nr unless full) of 16
 * rows, unrolled so that they stay in registers (the packers below are
 * compiled per type and for full groups apart: versions with the type and
 * the row count unknown kept these loads in rolled loops through stack
 * arrays, and packing took 40 % of a 16-token Q4_0 GEMM). */
LK_T512 static LK_INL void gk_load16(const uint8_t *p, size_t ws, int nr, const bool full, __m128i q[16]) {
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++)
        q[r] = full || r < nr ? _mm_loadu_si128((const __m128i *)(p + (size_t)r * ws)) : _mm_setzero_si128();
}

/* Bytes off..off+15 of a super-block of 16 rows as 4 vectors (vector i,
 * lane r: row r's bytes off+4i..off+4i+3): transposed from the file's rows
 * (p: the first row's super-block), or as stored in a repacked K-quant
 * group (r16; p: the super-block's first vector, lk_kr16_at). */
LK_T512 static LK_INL void gkk_rows4(const bool r16, const uint8_t *p, size_t off, size_t ws, int nr, const bool full,
                                   __m512i out[4]) {
    if (r16) {
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) out[i] = _mm512_loadu_si512(p + 16 * off + 64 * i);
        return;
    }
    __m128i q[16];
    gk_load16(p + off, ws, nr, full, q);
    gk_transpose16x4(q, out);
}

/* A whole group of Q4_0_R16 or Q8_0_R16 (q8; w: its first row; nb blocks a
 * row), block b: its 16 rows' quants as the 8 unsigned vectors of a panel
 * (Q4_0: vector k < 4 the low nibbles, quants 4k..; k + 4 the high
 * nibbles; Q8_0: quants 4k.., + 128 as stored) and their scales. The layout
 * is the one the packing below makes of the file's rows, so this is all
 * that is left of it. gk_r16_quants: the quant vectors alone, q the
 * block's quants (gq_tile's pairs walk finds them without lk_r16_at). */
LK_T512 static LK_INL void gk_r16_quants(const bool q8, const uint8_t *q, __m512i v[8]) {
    if (q8) {
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) v[k] = _mm512_loadu_si512(q + 64 * k);
        return;
    }
    const __m512i m0f = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const __m512i x = _mm512_loadu_si512(q + 64 * k);
        v[k + 4] = gk_hi_nibble(x);
        v[k] = _mm512_and_si512(x, m0f);
    }
}
LK_T512 static LK_INL void gk_r16_block(const bool q8, const uint8_t *w, int64_t nb, int64_t b, __m512i v[8],
                                      __m512 *d) {
    size_t qo, dof;
    lk_r16_at(q8, b, nb, &qo, &dof);
    gk_r16_quants(q8, w + qo, v);
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + dof)));
}

/* Packs rows [0, nr) (nr <= 16; missing rows are zero) x blocks [b0, b0+kb)
 * of Q4_0 or Q8_0 rows into out[b][9][64] (Q4_0_R16's whole groups:
 * gk_pack_r16). */
LK_T512 static LK_INL void gk_pack_body(const bool is_q8, const bool full, const uint8_t *w, size_t ws, int nr,
                                      int64_t b0, int kb, uint8_t (*out)[GK_VEC][64]) {
    const size_t bb = is_q8 ? LK_Q80_BYTES : LK_Q40_BYTES;
    const __m512i m0f = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    for (int b = 0; b < kb; b++) {
        const uint8_t *p = w + (size_t)(b0 + b) * bb;
        __m128i q[16];
        __m512i v[8];
        gk_load16(p + 2, ws, nr, full, q);
        gk_transpose16x4(q, v);
        if (is_q8) {
            gk_load16(p + 18, ws, nr, full, q);
            gk_transpose16x4(q, v + 4);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) v[k] = _mm512_xor_si512(v[k], flip);
        } else {
            /* Q4_0 quants 0..15 are the low nibbles of bytes 0..15, 16..31
             * the high nibbles: vector k < 4 = low nibbles of bytes 4k..,
             * vector k + 4 = their high nibbles (quants 16 + 4k..) */
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                v[k + 4] = gk_hi_nibble(v[k]);
                v[k] = _mm512_and_si512(v[k], m0f);
            }
        }
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) _mm512_store_si512(out[b][k], v[k]);
        _mm512_store_ps(out[b][8], gk_gather_h16(p, ws, full ? 16 : nr));
    }
}

LK_T512 static void gk_pack_r16(const bool q8, const uint8_t *w, int64_t nb, int64_t b0, int kb,
                              uint8_t (*out)[GK_VEC][64]) {
    for (int b = 0; b < kb; b++) {
        __m512i v[8];
        __m512 d;
        gk_r16_block(q8, w, nb, b0 + b, v, &d);
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) _mm512_store_si512(out[b][k], v[k]);
        _mm512_store_ps(out[b][8], d);
    }
}

LK_T512 static void gk_pack_group(const int fmt, const uint8_t *w, size_t ws, int nr, int64_t nb, int64_t b0, int kb,
                                uint8_t (*out)[GK_VEC][64]) {
    if (lk_fmt_r16(fmt) && nr == GK_ROWS) {
        if (fmt == LK_FMT_Q8R16) gk_pack_r16(true, w, nb, b0, kb, out);
        else gk_pack_r16(false, w, nb, b0, kb, out);
    } else if (lk_fmt_q8(fmt)) {
        if (nr == GK_ROWS) gk_pack_body(true, true, w, ws, nr, b0, kb, out);
        else gk_pack_body(true, false, w, ws, nr, b0, kb, out);
    } else {
        if (nr == GK_ROWS) gk_pack_body(false, true, w, ws, nr, b0, kb, out);
        else gk_pack_body(false, false, w, ws, nr, b0, kb, out);
    }
}

/* Scale and offset correction of every (token, block) of the tile: tokens
 * [0, tb) x blocks [b0, b0 + kb) into d / corr, rows `ld` apart. */
LK_T512 static void gk_prep(const bool is_q8, const uint8_t *a, size_t as, int tb, int64_t b0, int kb, float *d,
                          int32_t *corr, int ld) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const int32_t k = is_q8 ? 128 : 8;
    for (int t = 0; t < tb; t++)
        for (int b = 0; b < kb; b++) {
            const uint8_t *p = a + (size_t)t * as + (size_t)(b0 + b) * LK_Q80_BYTES;
            d[t * ld + b] = _cvtsh_ss(lk_ld_u16(p));
            /* sum of 32 signed quants = sum of (q + 128) - 32*128 */
            __m256i s = _mm256_sad_epu8(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 2)), flip),
                                        _mm256_setzero_si256());
            __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            int32_t sum = (int32_t)(_mm_cvtsi128_si64(s2) + _mm_extract_epi64(s2, 1)) - 32 * 128;
            corr[t * ld + b] = -k * sum;
        }
}

/* lk_act_terms_rows, one token: token t's row of Q8_0 blocks in lk_act_terms' K blocks */
LK_T512 void lk_act_terms_row_avx512(const lk_act_terms *T, int64_t t, const void *a, int64_t n) {
    const int64_t nb = n / LK_QK;
    for (int64_t b0 = 0; b0 < nb; b0 += LK_TERMS_KB) {
        const size_t i = (size_t)((b0 / LK_TERMS_KB * T->ntok + t) * LK_TERMS_KB);
        gk_prep(T->k == 128, a, 0, 1, b0, (int)LK_MIN((int64_t)LK_TERMS_KB, nb - b0), T->d + i, T->corr + i, LK_TERMS_KB);
    }
}

/* One micro-tile: RG row groups x T tokens over kb blocks. wp: the panel;
 * at[t]: token t's activation row at the K block's first block; act/t0: its
 * (token, block) terms; y: row 0 of token 0 of the tile. nlast: valid rows
 * of the last group (masked store). add: accumulate into y (not the first
 * K block). */
/* Every micro-tile's epilogue: rows g*16.. of tokens t (acc[g*ld + t]) into y,
 * the last group masked to `nlast` rows, added to y's values when `add` (a
 * later K block). */
LK_T512 static LK_INL void gk_store(const int RG, const int T, const __m512 *acc, const int ld, float *y, size_t ys,
                                  int nlast, bool add) {
#pragma GCC unroll 4
    for (int g = 0; g < RG; g++) {
        __mmask16 m = g == RG - 1 ? (__mmask16)((1u << nlast) - 1) : 0xFFFF;
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            float *yp = y + (size_t)t * ys + (size_t)g * GK_ROWS;
            __m512 v = acc[g * ld + t];
            if (add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, yp));
            _mm512_mask_storeu_ps(yp, m, v);
        }
    }
}

/* The quantised tiles' accumulators at the start of a K block: zero for the
 * first, else what y holds, so a row's blocks are added one after another
 * onto one sum from its first block to its last, as the scalar reference
 * adds them (and as decode does: the same bits whatever the K blocking and
 * the call's token count). */
LK_T512 static LK_INL void gk_init(const int RG, const int T, __m512 *acc, const int ld, const float *y, size_t ys,
                                 int nlast, bool add) {
#pragma GCC unroll 4
    for (int g = 0; g < RG; g++) {
        __mmask16 m = g == RG - 1 ? (__mmask16)((1u << nlast) - 1) : 0xFFFF;
#pragma GCC unroll 8
        for (int t = 0; t < T; t++)
            acc[g * ld + t] = add ? _mm512_maskz_loadu_ps(m, y + (size_t)t * ys + (size_t)g * GK_ROWS) : _mm512_setzero_ps();
    }
}

LK_T512 static LK_INL void gk_tile(const int RG, const int T, const gk_panel *wp, const uint8_t *const *at,
                                 const gk_terms *act, int t0, int b1, int kb, float *y, size_t ys, int nlast,
                                 bool add) {
    __m512 fa[GK_RG][GK_T];
    gk_init(RG, T, &fa[0][0], GK_T, y, ys, nlast, add);
    for (int b = 0; b < kb; b++) {
        __m512i ia[GK_RG][GK_T];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            __m512i c = _mm512_set1_epi32(act->corr[(t0 + t) * GK_KSB + b1 + b]);
#pragma GCC unroll 4
            for (int g = 0; g < RG; g++) ia[g][t] = c;
        }
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
#pragma GCC unroll 4
            for (int g = 0; g < RG; g++) {
                __m512i wv = _mm512_load_si512(wp->v[g][b][k]);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++)
                    ia[g][t] = _mm512_dpbusd_epi32(ia[g][t], wv,
                                                   _mm512_set1_epi32(lk_ld_i32(at[t] + (size_t)b * LK_Q80_BYTES + 2 + 4 * k)));
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < RG; g++) {
            __m512 wd = _mm512_load_ps(wp->v[g][b][8]);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                fa[g][t] = _mm512_add_ps(fa[g][t], _mm512_mul_ps(_mm512_cvtepi32_ps(ia[g][t]),
                                           _mm512_mul_ps(wd, _mm512_set1_ps(act->d[(t0 + t) * GK_KSB + b1 + b]))));
        }
    }
    gk_store(RG, T, &fa[0][0], GK_T, y, ys, nlast, false);
}

typedef void (*gk_tile_fn)(const gk_panel *wp, const uint8_t *const *at, const gk_terms *act, int t0, int b1,
                           int kb, float *y, size_t ys, int nlast, bool add);
#define GK_TILE(RG, T)                                                                                  \
    LK_T512 static void gk_tile_##RG##x##T(const gk_panel *wp, const uint8_t *const *at, const gk_terms *act, \
                                         int t0, int b1, int kb, float *y, size_t ys, int nlast, bool add) { \
        gk_tile(RG, T, wp, at, act, t0, b1, kb, y, ys, nlast, add);                                      \
    }
GK_TILE(1, 1) GK_TILE(1, 2) GK_TILE(1, 3) GK_TILE(1, 4)
GK_TILE(2, 1) GK_TILE(2, 2) GK_TILE(2, 3) GK_TILE(2, 4)
GK_TILE(3, 1) GK_TILE(3, 2) GK_TILE(3, 3) GK_TILE(3, 4)
static const gk_tile_fn k_tiles[GK_RG][GK_T] = {
    {gk_tile_1x1, gk_tile_1x2, gk_tile_1x3, gk_tile_1x4},
    {gk_tile_2x1, gk_tile_2x2, gk_tile_2x3, gk_tile_2x4},
    {gk_tile_3x1, gk_tile_3x2, gk_tile_3x3, gk_tile_3x4},
};

LK_T512 void lk_quant_gemm_q4q8_avx512(int fmt, int64_t n, int64_t nrows, const void *w, size_t ws,
                                     int64_t ntok, const void *a, size_t as, const lk_act_terms *terms, float *y,
                                     size_t ys) {
    const bool is_q8 = lk_fmt_q8(fmt);
    const uint8_t *W = w, *A = a;
    const int64_t nb = n / LK_QK;
    const size_t bb = is_q8 ? LK_Q80_BYTES : LK_Q40_BYTES;
    gk_panel wp;
    gk_act act;
    for (int64_t t0 = 0; t0 < ntok; t0 += GK_TB) {
        const int tb = (int)LK_MIN((int64_t)GK_TB, ntok - t0);
        for (int64_t s0 = 0; s0 < nb; s0 += GK_KSB) {
            const int ksb = (int)LK_MIN((int64_t)GK_KSB, nb - s0);
            gk_terms tm;
            if (!terms_at(terms, is_q8 ? 128 : 8, t0, s0, &tm)) {
                gk_prep(is_q8, A + (size_t)t0 * as, as, tb, s0, ksb, &act.d[0][0], &act.corr[0][0], GK_KSB);
                tm = (gk_terms){&act.d[0][0], &act.corr[0][0]};
            }
            for (int64_t r0 = 0; r0 < nrows; r0 += GK_RG * GK_ROWS) {
                const int nr = (int)LK_MIN((int64_t)(GK_RG * GK_ROWS), nrows - r0);
                const int rg = (nr + GK_ROWS - 1) / GK_ROWS, nlast = nr - (rg - 1) * GK_ROWS;
                for (int b1 = 0; b1 < ksb; b1 += GK_KB) {
                    const int kb = LK_MIN(GK_KB, ksb - b1);
                    const int64_t b0 = s0 + b1;
                    for (int g = 0; g < rg; g++)
                        gk_pack_group(fmt, W + (size_t)(r0 + g * GK_ROWS) * ws, ws,
                                      LK_MIN(GK_ROWS, nr - g * GK_ROWS), nb, b0, kb, wp.v[g]);
                    /* The next panel to pack (next K block of these rows, else
                     * the first of the next rows): short pieces of 48 rows that
                     * the hardware prefetchers do not follow, so packing waited
                     * on memory (a quarter of the GEMM's time). Its lines are
                     * requested a few rows per tile while the tiles compute. */
                    int64_t pr0 = r0, pb = b1 + kb;
                    if (pb >= ksb) pr0 += GK_RG * GK_ROWS, pb = 0;
                    const int pnr = pr0 < nrows ? (int)LK_MIN((int64_t)(GK_RG * GK_ROWS), nrows - pr0) : 0;
                    const size_t plo = (size_t)(s0 + pb) * bb, phi = (size_t)(s0 + LK_MIN(pb + GK_KB, ksb)) * bb;
                    const int ntl = (tb + GK_T - 1) / GK_T;
                    for (int t = 0, ti = 0; t < tb; t += GK_T, ti++) {
                        for (int r = ti * pnr / ntl; r < (ti + 1) * pnr / ntl; r++) {
                            const int64_t gr = pr0 + r / GK_ROWS * GK_ROWS;
                            if (lk_fmt_r16(fmt) && gr + GK_ROWS <= nrows) {
                                /* a whole group's blocks [plo, phi) are 16 (phi - plo)
                                 * bytes from 16 plo on: a sixteenth of them per row */
                                const uint8_t *rp = W + (size_t)gr * ws + 16 * plo + (size_t)(r % GK_ROWS) * (phi - plo);
                                for (size_t o = 0; o < phi - plo; o += 64) _mm_prefetch((const char *)rp + o, _MM_HINT_T1);
                                continue;
                            }
                            const uint8_t *rp = W + (size_t)(pr0 + r) * ws;
                            for (size_t o = plo & ~(size_t)63; o < phi; o += 64)
                                _mm_prefetch((const char *)rp + o, _MM_HINT_T1);
                        }
                        const int tt = LK_MIN(GK_T, tb - t);
                        const uint8_t *at[GK_T];
                        for (int i = 0; i < tt; i++)
                            at[i] = A + (size_t)(t0 + t + i) * as + (size_t)b0 * LK_Q80_BYTES;
                        k_tiles[rg - 1][tt - 1](&wp, at, &tm, t, b1, kb, y + (size_t)(t0 + t) * ys + (size_t)r0,
                                                ys, nlast, b0 > 0);
                    }
                }
            }
        }
    }
}

/* ===================================================================== */
/* Q4_0 / Q8_0 through AMX-INT8 tiles                                     */
/* ===================================================================== */

/* The same product on the Xeons' tile units (lk_quant_set_amx, quant.h).
 * A tile product TDPBSSD multiplies a tile of 16 tokens x 32 signed bytes
 * (one block of each token's Q8_0 quants, read in place from the
 * activation rows, `as` apart) by a tile of 8 x 64 bytes: the panel's 8
 * vectors of a block, lane r = 4 quants of row r, which is the layout
 * AMX wants for its second operand ("VNNI" order). The panel here holds
 * the weights signed (Q4_0's nibbles - 8, Q8_0's quants as they were), so
 * the integer sum of a (token, row, block) comes out whole, with no offset
 * correction. One product does 16 x 16 x 32 multiply-adds; a tile store
 * hands the 16 x 16 sums to the vector units, which do the scalar
 * reference's float work per block, in its order, on 16 accumulators (one
 * per token, lanes = rows): so every row gives the other paths' bits.
 *
 * The float work is now the cost: 4 uops per 16 sums (convert, d_w*d_a,
 * times, add), against 8 vpdpbusd + the same 4 in the vector GEMM. A tile
 * product's result comes late (tens of cycles), so the products run one
 * block ahead: block b+1's product is issued before block b's sums are
 * stored, and the tile unit and the vector units overlap. Block b's sums
 * are worked one step later still, after block b+1's store: the vector
 * loads then meet a tile store that has had a block's time to reach the
 * cache (worked right after their own store, 64-512 tokens ran 1.09-1.25x
 * slower on the Sapphire Rapids guest: BENCHMARKS.md, thirty-second
 * session).
 *
 * Tiles: 0 and 1 the sums (blocks alternate), 2 and 3 the activations, 4
 * and 5 the weights. The call's last tokens, when they are not 16, are
 * copied into 16 zeroed rows first (a tile load reads 16 rows; the
 * activations past the last token may not be there), so every tile is
 * 16 rows and one configuration serves the whole call.
 *
 * Emulated (E, emu): the same kernel with the tile instructions done in C
 * on a thread's copy of the tile registers (lk_quant_amx_emulate), so that the
 * packing, the tile addressing and the tails are tested where there is no
 * AMX. */
enum {
    AX_T = 16,  /* tokens per tile */
    AX_RG = 4,  /* row groups per panel */
    AX_KB = 32, /* blocks per K block: the panel 4 x 32 x 576 B = 72 KB, in L2 */
    AX_TB = 128 /* tokens per token block (weights packed once per block) */
};
typedef struct {
    _Alignas(64) uint8_t v[AX_RG][AX_KB][GK_VEC][64];
} ax_panel;

/* The 64-byte tile configuration (palette 1): bytes per row and rows of
 * each tile register. */
typedef struct {
    uint8_t  palette, start_row, pad[14];
    uint16_t colsb[16];
    uint8_t  rows[16];
} ax_cfg;
_Static_assert(sizeof(ax_cfg) == 64, "the tile configuration is 64 bytes");

/* The emulated tile registers of this thread. */
typedef struct {
    ax_cfg cfg;
    _Alignas(64) uint8_t t[8][16][64];
} ax_emu_regs;
static _Thread_local ax_emu_regs ax_emu;

static void ax_emu_load(int t, const uint8_t *p, size_t s) {
    for (int r = 0; r < ax_emu.cfg.rows[t]; r++) memcpy(ax_emu.t[t][r], p + (size_t)r * s, ax_emu.cfg.colsb[t]);
}
static void ax_emu_store(int t, uint8_t *p, size_t s) {
    for (int r = 0; r < ax_emu.cfg.rows[t]; r++) memcpy(p + (size_t)r * s, ax_emu.t[t][r], ax_emu.cfg.colsb[t]);
}
static void ax_emu_zero(int t) { memset(ax_emu.t[t], 0, sizeof ax_emu.t[t]); }
/* TDPBSSD c, a, b: c[m][n] += sum over k of a[m][4k+i] * b[k][4n+i], i < 4, all signed */
static void ax_emu_dp(int c, int a, int b) {
    for (int m = 0; m < ax_emu.cfg.rows[c]; m++)
        for (int n = 0; n < ax_emu.cfg.colsb[c] / 4; n++) {
            int32_t s;
            memcpy(&s, ax_emu.t[c][m] + 4 * n, 4);
            for (int k = 0; k < ax_emu.cfg.colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++)
                    s += (int8_t)ax_emu.t[a][m][4 * k + i] * (int8_t)ax_emu.t[b][k][4 * n + i];
            memcpy(ax_emu.t[c][m] + 4 * n, &s, 4);
        }
}

/* The tile instructions (t, c, a, b: tile numbers, literals), or their
 * emulation when E. Every load and store is a compiler barrier too: the
 * packer's stores must land before a tile load reads them. */
#define AX_LOAD(E, t, p, s)                                                                                    \
    do {                                                                                                       \
        if (E) ax_emu_load(t, (const uint8_t *)(p), (s));                                                      \
        else __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void *)(p)), "r"((long)(s)) : "memory"); \
    } while (0)
#define AX_STORE(E, t, p, s)                                                                                   \
    do {                                                                                                       \
        if (E) ax_emu_store(t, (uint8_t *)(p), (s));                                                           \
        else __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void *)(p)), "r"((long)(s)) : "memory"); \
    } while (0)
#define AX_ZERO(E, t)                                                  \
    do {                                                               \
        if (E) ax_emu_zero(t);                                         \
        else __asm__ volatile("tilezero %%tmm" #t ::);                 \
    } while (0)
#define AX_DP(E, c, a, b)                                                          \
    do {                                                                           \
        if (E) ax_emu_dp(c, a, b);                                                 \
        else __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::);    \
    } while (0)
/* a block's product into sums tile c from activations tile ta and weights
 * tile tw (literals) */
#define AX_ISSUE(E, c, ta, tw, pa, as, pb) \
    do {                                   \
        AX_LOAD(E, ta, pa, as);            \
        AX_LOAD(E, tw, pb, 64);            \
        AX_ZERO(E, c);                     \
        AX_DP(E, c, ta, tw);               \
    } while (0)

/* T: the tokens of a sums and an activations tile (their rows) */
static void ax_config(bool emu, int T) {
    ax_cfg c = {.palette = 1};
    for (int t = 0; t < 2; t++) {
        c.rows[t] = (uint8_t)T, c.colsb[t] = 64;            /* sums */
        c.rows[2 + t] = (uint8_t)T, c.colsb[2 + t] = LK_QK; /* activations */
        c.rows[4 + t] = LK_QK / 4, c.colsb[4 + t] = 64;     /* weights */
    }
    if (emu) {
        ax_emu.cfg = c;
        memset(ax_emu.t, 0, sizeof ax_emu.t);
    } else {
        __asm__ volatile("ldtilecfg %0" ::"m"(c));
    }
}

/* One row group (16 rows, the last `nlast` of them valid) x 16 tokens (the
 * first T of them real) over kb blocks. pg: the group's blocks in the
 * panel; a: the first token's quants of the K block's first block (as
 * apart); d: the first token's activation scale of that block (tokens dld
 * apart); y: row 0 of the first token; add: a later K block (start from
 * y). */
LK_T512 static LK_INL void ax_tile(const bool E, const int T, const uint8_t (*pg)[GK_VEC][64], const uint8_t *a,
                                 size_t as, const float *d, int dld, int kb, float *y, size_t ys, int nlast, bool add) {
    __m512 fa[AX_T];
    _Alignas(64) int32_t cb[2][AX_T][16];
    const __mmask16 m = (__mmask16)((1u << nlast) - 1);
#pragma GCC unroll 16
    for (int t = 0; t < AX_T; t++)
        fa[t] = t < T && add ? _mm512_maskz_loadu_ps(m, y + (size_t)t * ys) : _mm512_setzero_ps();
    AX_ISSUE(E, 0, 2, 4, a, as, pg[0][0]);
    for (int b = 0; b <= kb; b++) {
        const int b1 = b + 1;
        if (b1 < kb) {
            if (b1 & 1) AX_ISSUE(E, 1, 3, 5, a + (size_t)b1 * LK_Q80_BYTES, as, pg[b1][0]);
            else AX_ISSUE(E, 0, 2, 4, a + (size_t)b1 * LK_Q80_BYTES, as, pg[b1][0]);
        }
        if (b < kb) {
            if (b & 1) AX_STORE(E, 1, cb[b & 1], 64);
            else AX_STORE(E, 0, cb[b & 1], 64);
        }
        if (b == 0) continue;
        const int bf = b - 1;
        int32_t(*c)[16] = cb[bf & 1];
        const __m512 wd = _mm512_load_ps(pg[bf][8]);
#pragma GCC unroll 16
        for (int t = 0; t < AX_T; t++)
            if (t < T)
                fa[t] = _mm512_add_ps(fa[t], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[t])),
                                                           _mm512_mul_ps(wd, _mm512_set1_ps(d[(size_t)t * dld + bf]))));
    }
#pragma GCC unroll 16
    for (int t = 0; t < AX_T; t++)
        if (t < T) _mm512_mask_storeu_ps(y + (size_t)t * ys, m, fa[t]);
}

typedef void (*ax_tile_fn)(int T, const uint8_t (*pg)[GK_VEC][64], const uint8_t *a, size_t as, const float *d,
                           int dld, int kb, float *y, size_t ys, int nlast, bool add);
#define AX_TILE(name, E, FULL)                                                                                 \
    LK_T512 static void name(int T, const uint8_t (*pg)[GK_VEC][64], const uint8_t *a, size_t as, const float *d, \
                           int dld, int kb, float *y, size_t ys, int nlast, bool add) {                       \
        ax_tile(E, FULL ? AX_T : T, pg, a, as, d, dld, kb, y, ys, nlast, add);                                \
    }
AX_TILE(ax_tile_hw16, false, true) AX_TILE(ax_tile_hwmt, false, false)
AX_TILE(ax_tile_emu16, true, true) AX_TILE(ax_tile_emumt, true, false)

LK_T512 void lk_quant_gemm_q4q8_amx(bool emu, int fmt, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                                  const void *a, size_t as, const lk_act_terms *terms, float *y, size_t ys) {
    const bool is_q8 = lk_fmt_q8(fmt);
    const uint8_t *W = w, *A = a;
    const int64_t nb = n / LK_QK;
    const int mt = ntok % AX_T ? (int)(ntok % AX_T) : AX_T;
    const ax_tile_fn tile16 = emu ? ax_tile_emu16 : ax_tile_hw16, tilemt = emu ? ax_tile_emumt : ax_tile_hwmt;
    const __m512i sub8 = _mm512_set1_epi8(8), flip = _mm512_set1_epi8((char)0x80);
    ax_panel wp;
    _Alignas(64) float dl[AX_TB * GK_KSB]; /* the activations' scales, when the call derives them */
    /* the last tokens' K block of quants, 16 rows (those past the call's zero) */
    _Alignas(64) uint8_t pad[AX_T][AX_KB * LK_Q80_BYTES];
    memset(pad, 0, sizeof pad);
    ax_config(emu, AX_T);
    for (int64_t t0 = 0; t0 < ntok; t0 += AX_TB) {
        const int tb = (int)LK_MIN((int64_t)AX_TB, ntok - t0);
        for (int64_t s0 = 0; s0 < nb; s0 += GK_KSB) {
            const int ksb = (int)LK_MIN((int64_t)GK_KSB, nb - s0);
            /* token t's scale of block s0 + b at d[t * GK_KSB + b]: the
             * terms' (any offset: the scales are the same), or derived */
            const float *d = dl;
            if (terms && terms->ntok == ntok)
                d = terms->d + (size_t)((s0 / LK_TERMS_KB * ntok + t0) * LK_TERMS_KB);
            else
                for (int t = 0; t < tb; t++)
                    for (int b = 0; b < ksb; b++)
                        dl[t * GK_KSB + b] = _cvtsh_ss(lk_ld_u16(A + (size_t)(t0 + t) * as + (size_t)(s0 + b) * LK_Q80_BYTES));
            for (int64_t r0 = 0; r0 < nrows; r0 += AX_RG * GK_ROWS) {
                const int nr = (int)LK_MIN((int64_t)(AX_RG * GK_ROWS), nrows - r0);
                const int rg = (nr + GK_ROWS - 1) / GK_ROWS, nlast = nr - (rg - 1) * GK_ROWS;
                for (int b1 = 0; b1 < ksb; b1 += AX_KB) {
                    const int kb = LK_MIN(AX_KB, ksb - b1);
                    const int64_t b0 = s0 + b1;
                    for (int g = 0; g < rg; g++) {
                        gk_pack_group(fmt, W + (size_t)(r0 + g * GK_ROWS) * ws, ws, LK_MIN(GK_ROWS, nr - g * GK_ROWS),
                                      nb, b0, kb, wp.v[g]);
                        /* signed: Q4_0's nibbles - 8, Q8_0's + 128 undone */
                        for (int b = 0; b < kb; b++)
#pragma GCC unroll 8
                            for (int k = 0; k < 8; k++) {
                                const __m512i v = _mm512_load_si512(wp.v[g][b][k]);
                                _mm512_store_si512(wp.v[g][b][k], is_q8 ? _mm512_xor_si512(v, flip) : _mm512_sub_epi8(v, sub8));
                            }
                    }
                    for (int t = 0; t < tb; t += AX_T) {
                        const bool full = tb - t >= AX_T;
                        const uint8_t *at = A + (size_t)(t0 + t) * as + (size_t)b0 * LK_Q80_BYTES;
                        size_t ats = as;
                        if (!full) {
                            for (int i = 0; i < mt; i++) memcpy(pad[i], at + (size_t)i * as, (size_t)kb * LK_Q80_BYTES);
                            at = pad[0], ats = sizeof pad[0];
                        }
                        for (int g = 0; g < rg; g++)
                            (full ? tile16 : tilemt)(mt, (const uint8_t(*)[GK_VEC][64])wp.v[g], at + 2, ats,
                                                     d + (size_t)t * GK_KSB + b1, GK_KSB, kb,
                                                     y + (size_t)(t0 + t) * ys + (size_t)(r0 + g * GK_ROWS), ys,
                                                     g == rg - 1 ? nlast : GK_ROWS, b0 > 0);
                    }
                }
            }
        }
    }
    if (!emu) __asm__ volatile("tilerelease" ::);
}

/* The repacked Q4_0 / Q8_0 through AMX-INT8 tiles for a few tokens (a
 * server's decode steps of 12-63 sequences). The kernel above packs a
 * panel of 64 rows x 32 blocks before its products, worth it when 128
 * tokens share the panel; at 16 tokens its packing took about as long as
 * its products, and the vector kernels stayed ahead. Here a 16-row group
 * streams block by block: the block's vectors are made signed in
 * registers and stored to a 512-byte buffer that stays in L1, loaded as
 * the weights tile, and the product of block b runs while block b - 1's
 * sums are stored and worked (the float work per block as above, in the
 * scalar reference's order: the same bits). A token tile is 16 tokens
 * (the last one overlapping the one before) or, in a call of fewer, the
 * call's tokens (the tile configuration takes their count as its rows, so
 * no activation row is read past the call's). */
/* the software prefetch's distance in a group's run of bytes (1 and 4 KB
 * measured alike on the Sapphire Rapids guest; without it a 16-token
 * product from memory took 1.4-1.5x as long) */
enum { AXF_PF = 2048 };
typedef void (*axf_group_fn)(int T, int tlo, const uint8_t *wg, int64_t nb, const uint8_t *a, size_t as,
                             const float *d, int64_t sk, int64_t st, float *y, size_t ys);

/* One 16-row group x T tokens over all nb blocks, the outputs of tokens
 * [tlo, T). wg: the group; a: the first token's row (as apart); d: token
 * t's scale of block b at d[b / LK_TERMS_KB * sk + t * st + b % LK_TERMS_KB]
 * (the terms' layout, or a table's); y: row 0 of the first token. */
LK_T512 static LK_INL void axf_group(const bool E, const bool q8, const int T, const int tlo, const uint8_t *wg,
                                   int64_t nb, const uint8_t *a, size_t as, const float *d, int64_t sk, int64_t st, float *y,
                                   size_t ys) {
    __m512 fa[AX_T];
    _Alignas(64) int32_t cb[2][AX_T][16];
    _Alignas(64) uint8_t wb[2][8][64];
    const __m512i sub8 = _mm512_set1_epi8(8), flip = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 16
    for (int t = 0; t < AX_T; t++) fa[t] = _mm512_setzero_ps();
    __m512 wdp = _mm512_setzero_ps();
    for (int64_t b = 0; b <= nb; b++) {
        __m512 wd = _mm512_setzero_ps();
        if (b < nb) {
            __m512i v[8];
            {
                /* the group is one run of bytes: this block's share of it, AXF_PF bytes ahead */
                const size_t bb = lk_r16_qbytes(q8) + 32, at = (size_t)b * bb + AXF_PF;
                for (size_t o = 0; o < bb; o += 64) _mm_prefetch((const char *)wg + at + o, _MM_HINT_T0);
            }
            gk_r16_block(q8, wg, nb, b, v, &wd);
            uint8_t(*o)[64] = wb[b & 1];
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) _mm512_store_si512(o[k], q8 ? _mm512_xor_si512(v[k], flip) : _mm512_sub_epi8(v[k], sub8));
            const uint8_t *ab = a + (size_t)b * LK_Q80_BYTES + 2;
            if (b & 1) AX_ISSUE(E, 1, 3, 5, ab, as, o);
            else AX_ISSUE(E, 0, 2, 4, ab, as, o);
        }
        if (b > 0) {
            const int64_t bp = b - 1;
            int32_t(*c)[16] = cb[bp & 1];
            if (bp & 1) AX_STORE(E, 1, c, 64);
            else AX_STORE(E, 0, c, 64);
            const float *db = d + bp / LK_TERMS_KB * sk + bp % LK_TERMS_KB;
#pragma GCC unroll 16
            for (int t = 0; t < AX_T; t++)
                if (t < T && t >= tlo)
                    fa[t] = _mm512_add_ps(fa[t], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[t])),
                                                               _mm512_mul_ps(wdp, _mm512_set1_ps(db[(size_t)t * (size_t)st]))));
        }
        wdp = wd;
    }
#pragma GCC unroll 16
    for (int t = 0; t < AX_T; t++)
        if (t < T && t >= tlo) _mm512_storeu_ps(y + (size_t)t * ys, fa[t]);
}

#define AXF_GROUP(name, E, Q8, FULL)                                                                           \
    LK_T512 static void name(int T, int tlo, const uint8_t *wg, int64_t nb, const uint8_t *a, size_t as,       \
                           const float *d, int64_t sk, int64_t st, float *y, size_t ys) {                      \
        axf_group(E, Q8, FULL ? AX_T : T, FULL ? tlo : 0, wg, nb, a, as, d, sk, st, y, ys);                    \
    }
AXF_GROUP(axf_hw4_16, false, false, true) AXF_GROUP(axf_hw4_mt, false, false, false)
AXF_GROUP(axf_hw8_16, false, true, true) AXF_GROUP(axf_hw8_mt, false, true, false)
AXF_GROUP(axf_emu4_16, true, false, true) AXF_GROUP(axf_emu4_mt, true, false, false)
AXF_GROUP(axf_emu8_16, true, true, true) AXF_GROUP(axf_emu8_mt, true, true, false)

bool lk_quant_amx_few_fits(int64_t n, int64_t nrows, int64_t ntok) {
    return nrows % GK_ROWS == 0 && n % LK_QK == 0 && ntok * (n / LK_QK) <= LK_AMX_FEW_SCALES;
}

LK_T512 void lk_quant_gemm_q4q8_amx_few(bool emu, int fmt, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                            const void *a, size_t as, const lk_act_terms *terms, float *y, size_t ys) {
    LK_ASSERT(lk_fmt_r16(fmt) && lk_quant_amx_few_fits(n, nrows, ntok));
    const bool q8 = fmt == LK_FMT_Q8R16;
    const uint8_t *W = w, *A = a;
    const int64_t nb = n / LK_QK;
    /* every (token, block) scale as a float: the terms' (read in place),
     * else a table of them, token-major */
    float dl[LK_AMX_FEW_SCALES];
    const float *d = dl;
    int64_t sk = LK_TERMS_KB, st = nb;
    if (terms && terms->ntok == ntok) d = terms->d, sk = ntok * LK_TERMS_KB, st = LK_TERMS_KB;
    else
        for (int64_t t = 0; t < ntok; t++)
            for (int64_t b = 0; b < nb; b++) dl[t * nb + b] = _cvtsh_ss(lk_ld_u16(A + (size_t)t * as + (size_t)b * LK_Q80_BYTES));
    const axf_group_fn full = emu ? (q8 ? axf_emu8_16 : axf_emu4_16) : (q8 ? axf_hw8_16 : axf_hw4_16);
    const axf_group_fn part = emu ? (q8 ? axf_emu8_mt : axf_emu4_mt) : (q8 ? axf_hw8_mt : axf_hw4_mt);
    /* a group's token tiles one after the other, its bytes still in L2 for
     * the second; past 16 tokens the last tile is the call's last 16
     * tokens, those before tlo already done (one configuration serves
     * the whole call) */
    const int T = (int)LK_MIN((int64_t)AX_T, ntok);
    ax_config(emu, T);
    for (int64_t r0 = 0; r0 < nrows; r0 += GK_ROWS)
        for (int64_t t0 = 0; t0 < ntok; t0 += AX_T) {
            const int64_t ts = T < AX_T ? 0 : LK_MIN(t0, ntok - AX_T);
            (T == AX_T ? full : part)(T, (int)(t0 - ts), W + (size_t)r0 * ws, nb, A + (size_t)ts * as, as,
                                      d + ts * st, sk, st, y + (size_t)ts * ys + (size_t)r0, ys);
        }
    if (!emu) __asm__ volatile("tilerelease" ::);
}

/* ===================================================================== */
/* BF16 through AMX-BF16 tiles                                            */
/* ===================================================================== */

/* Every BF16 product, one token or many, on CPUs with AMX-BF16 (Xeons from
 * Sapphire Rapids on; lk_quant_fill_avx512 picks it). There vdpbf16ps
 * retires one per 2 cycles (TinyLlama BF16 prefill ran at 95 % of its
 * peak, half the fp32 FMAs'), while a tile product TDPBF16PS does 16 rows
 * x 16 tokens x 32 elements: one Sapphire Rapids core multiplied 2048 x
 * 5632 x 16 at 418 GFLOP/s against ~110 (BENCHMARKS.md, seventeenth
 * session).
 *
 * C[row][token] += A[row][k] * B[k][token]: A is 16 weight rows' 32
 * elements of a K step, loaded from the rows in place (64 bytes each, ws
 * apart); B is the step's activations in the pair-interleaved order AMX
 * wants (16 rows of pairs, row kk = elements 2kk and 2kk+1 of every
 * token), made once per matrix by the activations' pass (LK_TERMS_TILES)
 * or else packed per call; one token's B is its row as it is (16 rows of 4
 * bytes). So decode reads the weights where they are, nothing repacked at
 * load. Two row groups by two token tiles at a time: 4 C tiles, so that
 * each A tile loaded serves two products (3 tile loads for 2 products ran
 * 2048 x 2048 x 64 at 704 GFLOP/s on one Sapphire Rapids core, 4 for 4 at
 * 934).
 *
 * Bits: the tile unit's sum of a step's products is its own (it matches
 * no sequential order of fp32 additions we tried), but it is the same for
 * every token count: each (row, token) sum is its C element's chain over
 * the row's K steps in order, from zero, every step (the last one
 * zero-padded) the same instruction on the same 32 pairs, whether the
 * step's tile holds 1 token or 16 and whether C waited in memory between
 * K chunks (stored and loaded exactly). Decode and prefill agree bit for
 * bit (test_quant bf16_amx), the batch invariance of the other paths, and
 * only this path's own bits: results differ from vdpbf16ps's and fp32
 * FMAs' by roundings, so AMX-BF16 is a CPU feature (LK_CPU_OFF=amxbf16
 * turns it off), not a tuning choice.
 *
 * Emulated (emu): the tile instructions in C (TDPBF16PS in its documented
 * order: per pair, the even element's product added, then the odd's), so
 * that tests check the packing, tails and chunking where there is no AMX;
 * emulated and real tiles give different bits. */
enum {
    BX_KC = 2048, /* elements of a K chunk */
    BX_TS = 64,   /* tokens packed at a time: 64 x 2048 elements, 256 KB */
    BX_RB = 256   /* rows per block: their C tiles wait in 64 KB between chunks */
};

/* TDPBF16PS c, a, b emulated: c[m][n] += a[m][2k+i] * b[k][2n+i] (k, then
 * i = 0, 1), denormal inputs and results flushed to zero */
static float bx_ftz(float x) { return fabsf(x) < 0x1p-126f ? 0.0f * x : x; }
static void bx_emu_dp(int c, int a, int b) {
    for (int m = 0; m < ax_emu.cfg.rows[c]; m++)
        for (int n = 0; n < ax_emu.cfg.colsb[c] / 4; n++) {
            float s;
            memcpy(&s, ax_emu.t[c][m] + 4 * n, 4);
            for (int k = 0; k < ax_emu.cfg.colsb[a] / 4; k++)
                for (int i = 0; i < 2; i++) {
                    uint16_t x, z;
                    memcpy(&x, ax_emu.t[a][m] + 4 * k + 2 * i, 2);
                    memcpy(&z, ax_emu.t[b][k] + 4 * n + 2 * i, 2);
                    s = bx_ftz(s + bx_ftz(lk_bf16_to_fp32(x)) * bx_ftz(lk_bf16_to_fp32(z)));
                }
            memcpy(ax_emu.t[c][m] + 4 * n, &s, 4);
        }
}
#define BX_DP(E, c, a, b)                                                          \
    do {                                                                           \
        if (E) bx_emu_dp(c, a, b);                                                 \
        else __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::);  \
    } while (0)

/* Tiles: 0 and 1 the sums of two row groups (r0 rows and r1 rows; r1 = 0:
 * one group), 2 and 3 their weights, 4 the activations of nt tokens (1:
 * decode, the row in place; else 16, packed, the missing ones zero); 5
 * the next 16 tokens' activations and 6, 7 their sums of the two groups. */
static void bx_config(bool emu, int r0, int r1, int nt) {
    ax_cfg c = {.palette = 1};
    c.rows[0] = c.rows[2] = (uint8_t)r0;
    c.rows[1] = c.rows[3] = (uint8_t)r1;
    c.colsb[0] = (uint16_t)(4 * nt), c.colsb[2] = 64;
    c.colsb[1] = r1 ? (uint16_t)(4 * nt) : 0, c.colsb[3] = r1 ? 64 : 0;
    c.rows[4] = c.rows[5] = 16, c.colsb[4] = c.colsb[5] = (uint16_t)(4 * nt);
    c.rows[6] = (uint8_t)r0, c.colsb[6] = (uint16_t)(4 * nt);
    c.rows[7] = (uint8_t)r1, c.colsb[7] = r1 ? (uint16_t)(4 * nt) : 0;
    if (emu) {
        ax_emu.cfg = c;
        memset(ax_emu.t, 0, sizeof ax_emu.t);
    } else {
        __asm__ volatile("ldtilecfg %0" ::"m"(c));
    }
}

/* The step of elements k..k+31 of rows [r, r + nr) for tile loading: the
 * rows in place when the step is whole, else their tail copied into `pad`
 * with zeros after it (a tile load reads all 64 bytes) */
static const uint8_t *bx_rows(const uint8_t *w, size_t ws, int nr, int64_t n, int64_t k, uint8_t pad[16][64],
                              size_t *stride) {
    if (k + 32 <= n) {
        *stride = ws;
        return w + (size_t)k * 2;
    }
    memset(pad, 0, 16 * 64);
    for (int i = 0; i < nr; i++) memcpy(pad[i], w + (size_t)i * ws + (size_t)k * 2, (size_t)(n - k) * 2);
    *stride = 64;
    return pad[0];
}

/* Activations into AMX-BF16's tile layout, packed per call (bx_pack) or
 * once per matrix (LK_TERMS_TILES; quant.h gives the layout): tokens
 * u0..u1-1 of one tile (token u0's row at a, the next ones as bytes apart)
 * into the 1 KB of K step s at `step`, each token's pairs down column
 * 4 (t % 16) of rows 0..15, past n zero; columns from cz on (the tokens a
 * last tile lacks; 64: none) zeroed. A call that writes the whole tile
 * transposes its tokens' rows in registers and stores 16 whole lines; one
 * that writes some of its tokens (lk_act_terms_rows by token ranges)
 * scatters their columns. The scatters took 1.6 % of a BF16 pp64's
 * products on the Xeon guest (perf, one thread), the transpose 1.1 %. */
LK_T512 static LK_INL void bxt_step(uint8_t *step, const uint8_t *a, size_t as, int64_t u0, int64_t u1, int64_t s,
                                    int64_t n, int cz) {
    const int64_t k = s * 32, ne = LK_MIN((int64_t)32, n - k);
    const __mmask32 m = ne == 32 ? ~(__mmask32)0 : (__mmask32)((1u << ne) - 1);
    if (u0 % 16 == 0 && (u1 - u0 == 16 || cz == 4 * (u1 - u0))) {
        /* the whole tile's tokens: their 64-byte rows transposed as 16 x
         * 16 dwords (row kk = dword kk of every token; the tokens the tile
         * lacks are zeros), 16 stores of whole lines */
        __m512i r[16], t[16];
        for (int i = 0; i < 16; i++)
            r[i] = i < u1 - u0 ? _mm512_maskz_loadu_epi16(m, a + (size_t)i * as + (size_t)k * 2) : _mm512_setzero_si512();
        for (int i = 0; i < 16; i += 2) {
            t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
            t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        }
        /* r[4i + j]: in 128-bit lane L, column 4L + j of rows 4i..4i+3 */
        for (int i = 0; i < 16; i += 4) {
            r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
            r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
            r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
            r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
        }
        for (int j = 0; j < 4; j++) {
            const __m512i x0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), x1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
            const __m512i y0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44), y1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
            _mm512_storeu_si512(step + 64 * j, _mm512_shuffle_i32x4(x0, y0, 0x88));
            _mm512_storeu_si512(step + 64 * (4 + j), _mm512_shuffle_i32x4(x0, y0, 0xDD));
            _mm512_storeu_si512(step + 64 * (8 + j), _mm512_shuffle_i32x4(x1, y1, 0x88));
            _mm512_storeu_si512(step + 64 * (12 + j), _mm512_shuffle_i32x4(x1, y1, 0xDD));
        }
        return;
    }
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(64));
    for (int64_t t = u0; t < u1; t++) {
        const __m512i v = _mm512_maskz_loadu_epi16(m, a + (size_t)(t - u0) * as + (size_t)k * 2);
        _mm512_i32scatter_epi32(step + 4 * (t % 16), rows, v, 1);
    }
    for (int kk = 0; cz < 64 && kk < 16; kk++) memset(step + 64 * kk + cz, 0, (size_t)(64 - cz));
}

/* Tokens t0..t0+nt-1's elements of K steps s0..s0+cs-1 into pk[s][j]: the
 * tile of step s0+s for tokens 16j..16j+15 (row kk: the pairs 2kk, 2kk+1
 * of each token, token t at bytes 4(t % 16)); past n, and tokens past nt,
 * zero */
LK_T512 static void bx_pack(const uint8_t *at, size_t as, int nt, int64_t n, int64_t s0, int cs,
                          uint8_t (*pk)[BX_TS / 16][16][64]) {
    for (int s = 0; s < cs; s++)
        for (int u0 = 0; u0 < nt; u0 += 16) {
            const int u1 = LK_MIN(nt, u0 + 16);
            bxt_step(pk[s][u0 / 16][0], at + (size_t)u0 * as, as, u0, u1, s0 + s, n, u1 - u0 < 16 ? 4 * (u1 - u0) : 64);
        }
}

/* lk_act_terms_rows for LK_TERMS_TILES: a tile's tokens step by step (the
 * 1 KB of a step stays in L1 while its tokens fill it; token by token, each
 * wrote 16 lines of every step, 64 KB for 2048 elements, and missed L1 at
 * every store); the range that holds the last token zeroes the columns of
 * the tokens its tile lacks */
LK_T512 void lk_act_terms_rows_bf16_tiles(const lk_act_terms *T, int64_t t0, int64_t t1, const void *a, size_t as,
                                          int64_t n) {
    const int64_t nsteps = (n + 31) / 32;
    for (int64_t u0 = t0; u0 < t1;) {
        const int64_t u1 = LK_MIN(t1, (u0 / 16 + 1) * 16);
        uint8_t *tile = T->tiles + (size_t)(u0 / 16) * (size_t)nsteps * 1024;
        const int cz = u1 == T->ntok && T->ntok % 16 ? 4 * (int)(T->ntok % 16) : 64;
        for (int64_t s = 0; s < nsteps; s++)
            bxt_step(tile + (size_t)s * 1024, (const uint8_t *)a + (size_t)(u0 - t0) * as, as, u0, u1, s, n, cz);
        u0 = u1;
    }
}

/* lk_act_terms_part for LK_TERMS_TILES: a share of the (tile, K step)
 * pairs, all of a tile's tokens each (a token range's tiles share every
 * line with the next range's: 16 threads filling 64 tokens' tiles by token
 * ranges took a fifth of a prefill's products on the 16-core Xeon) */
LK_T512 void lk_act_terms_part_bf16_tiles(const lk_act_terms *T, int part, int nparts, const void *a, size_t as,
                                          int64_t n) {
    const int64_t nsteps = (n + 31) / 32, units = (T->ntok + 15) / 16 * nsteps;
    const int64_t v0 = units * part / nparts, v1 = units * (part + 1) / nparts;
    for (int64_t v = v0; v < v1; v++) {
        const int64_t J = v / nsteps, u0 = 16 * J, u1 = LK_MIN(T->ntok, u0 + 16);
        const int cz = u1 - u0 < 16 ? 4 * (int)(u1 - u0) : 64;
        bxt_step(T->tiles + (size_t)v * 1024, (const uint8_t *)a + (size_t)u0 * as, as, u0, u1, v % nsteps, n, cz);
    }
}

LK_T512 void lk_quant_bf16_amx(bool emu, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                             const void *a, size_t as, const lk_act_terms *terms, float *y, size_t ys) {
    enum { KS = BX_KC / 32, TJ = BX_TS / 16 };
    const uint8_t *W = w, *A = a;
    const int64_t nsteps = (n + 31) / 32;
    const bool dec = ntok == 1;
    /* the activations' tiles made once per matrix (lk_act_terms), else packed here */
    const uint8_t *tiles = !dec && terms && terms->k == LK_TERMS_TILES ? terms->tiles : NULL;
    LK_ASSERT(!tiles || terms->ntok == ntok);
    _Alignas(64) uint8_t pk[dec ? 1 : KS][TJ][16][64]; /* packed activations, 256 KB (on the stack as fla_run's) */
    _Alignas(64) float park[BX_RB / 16][TJ][16][16];             /* C between chunks, 64 KB */
    _Alignas(64) float cout[16][16];
    _Alignas(64) uint8_t wpad[2][16][64], apad[64];
    int cfg = -1;
    for (int64_t ts0 = 0; ts0 < ntok; ts0 += BX_TS) {
        const int nts = (int)LK_MIN((int64_t)BX_TS, ntok - ts0);
        const int nj = (nts + 15) / 16;
        const uint8_t *at = A + (size_t)ts0 * as;
        int64_t packed = -1; /* the chunk pk holds */
        for (int64_t rb0 = 0; rb0 < nrows; rb0 += BX_RB) {
            const int64_t rbn = LK_MIN((int64_t)BX_RB, nrows - rb0);
            for (int64_t c0 = 0; c0 < nsteps; c0 += KS) {
                const int cs = (int)LK_MIN((int64_t)KS, nsteps - c0);
                const bool last = c0 + cs == nsteps;
                if (!dec && !tiles && packed != c0) bx_pack(at, as, nts, n, c0, cs, pk), packed = c0;
                for (int64_t g = 0; g < rbn; g += 32) {
                    const int r0 = (int)LK_MIN((int64_t)16, rbn - g);
                    const int r1 = (int)LK_MAX((int64_t)0, LK_MIN((int64_t)16, rbn - g - 16));
                    const int want = (r0 << 16) | (r1 << 8) | (dec ? 1 : 16);
                    if (want != cfg) bx_config(emu, r0, r1, dec ? 1 : 16), cfg = want;
                    const uint8_t *w0 = W + (size_t)(rb0 + g) * ws, *w1 = w0 + 16 * ws;
                    /* token tiles by pairs: each weight tile loaded serves
                     * two products (tiles 0, 1 and 6, 7 the sums of tokens j
                     * and j + 1; 4 and 5 their activations) */
                    for (int j = 0; j < nj; j += 2) {
                        const bool two = j + 1 < nj;
                        const int pr = g / 16 + (r1 > 0);
                        float(*pc0)[16] = park[g / 16][j], (*pc1)[16] = park[pr][j];
                        float(*pc6)[16] = park[g / 16][j + two], (*pc7)[16] = park[pr][j + two];
                        if (c0 == 0) {
                            AX_ZERO(emu, 0);
                            if (r1) AX_ZERO(emu, 1);
                            if (two) AX_ZERO(emu, 6);
                            if (two && r1) AX_ZERO(emu, 7);
                        } else {
                            AX_LOAD(emu, 0, pc0, 64);
                            if (r1) AX_LOAD(emu, 1, pc1, 64);
                            if (two) AX_LOAD(emu, 6, pc6, 64);
                            if (two && r1) AX_LOAD(emu, 7, pc7, 64);
                        }
                        for (int s = 0; s < cs; s++) {
                            const int64_t k = (c0 + s) * 32;
                            if (tiles) {
                                const uint8_t *tp = tiles + ((size_t)(ts0 / 16 + j) * (size_t)nsteps + (size_t)(c0 + s)) * 1024;
                                AX_LOAD(emu, 4, tp, 64);
                                if (two) AX_LOAD(emu, 5, tp + (size_t)nsteps * 1024, 64);
                            } else if (!dec) {
                                AX_LOAD(emu, 4, pk[s][j], 64);
                                if (two) AX_LOAD(emu, 5, pk[s][j + 1], 64);
                            } else if (k + 32 <= n) {
                                AX_LOAD(emu, 4, at + (size_t)k * 2, 4);
                            } else {
                                memset(apad, 0, sizeof apad);
                                memcpy(apad, at + (size_t)k * 2, (size_t)(n - k) * 2);
                                AX_LOAD(emu, 4, apad, 4);
                            }
                            size_t st;
                            const uint8_t *p0 = bx_rows(w0, ws, r0, n, k, wpad[0], &st);
                            AX_LOAD(emu, 2, p0, st);
                            BX_DP(emu, 0, 2, 4);
                            if (two) BX_DP(emu, 6, 2, 5);
                            if (r1) {
                                const uint8_t *p1 = bx_rows(w1, ws, r1, n, k, wpad[1], &st);
                                AX_LOAD(emu, 3, p1, st);
                                BX_DP(emu, 1, 3, 4);
                                if (two) BX_DP(emu, 7, 3, 5);
                            }
                        }
                        if (!last) {
                            AX_STORE(emu, 0, pc0, 64);
                            if (r1) AX_STORE(emu, 1, pc1, 64);
                            if (two) AX_STORE(emu, 6, pc6, 64);
                            if (two && r1) AX_STORE(emu, 7, pc7, 64);
                            continue;
                        }
                        for (int jj = 0; jj < 1 + two; jj++) {
                            float *yr = y + (size_t)(ts0 + 16 * (j + jj)) * ys + (size_t)(rb0 + g);
                            const int nt = LK_MIN(16, nts - 16 * (j + jj));
                            for (int h = 0; h < (r1 ? 2 : 1); h++) {
                                const int nr = h ? r1 : r0;
                                if (dec) {
                                    /* one token: the sums are the rows in order */
                                    if (h) AX_STORE(emu, 1, yr + 16, 4);
                                    else AX_STORE(emu, 0, yr, 4);
                                    continue;
                                }
                                if (jj) {
                                    if (h) AX_STORE(emu, 7, cout, 64);
                                    else AX_STORE(emu, 6, cout, 64);
                                } else {
                                    if (h) AX_STORE(emu, 1, cout, 64);
                                    else AX_STORE(emu, 0, cout, 64);
                                }
                                for (int t = 0; t < nt; t++)
                                    for (int i = 0; i < nr; i++) yr[(size_t)t * ys + 16 * h + i] = cout[i][t];
                            }
                        }
                    }
                }
            }
        }
    }
    if (!emu) __asm__ volatile("tilerelease" ::);
}

/* ===================================================================== */
/* Q4_0 / Q8_0 decode and a few tokens, rows in lanes                     */
/* ===================================================================== */

/* Below LK_GEMM_MIN_TOK tokens Q4_0 and Q8_0 come here (the repacked
 * q4_0_r16 / q8_0_r16 for decode too), so that every token count gives a
 * row the GEMM's bits, which are the scalar reference's (quant_q4q8_avx2.c
 * has the AVX2 twin of Q4_0 and the reasoning): 16 rows' block in the
 * lanes (the file's rows transposed in registers, no panel, nothing stored;
 * a repacked group's block loaded as it is), unsigned as the GEMM's panels
 * are (Q4_0 nibbles; Q8_0 + 128), each token's 8 vpdpbusd from its offset
 * correction, then per block one conversion, two multiplies and an add for
 * 16 rows. Tiles of up to 6 tokens (8 weight vectors, 6 accumulators and
 * each token's two chains of 4 vpdpbusd still fit the registers) share each
 * block's unpacking among more tokens than 4 did: on a Zen 5 core
 * (bench_quant 2048 x 5632, alternating builds, hot) 12 tokens 516-564 ->
 * 576-589 GFLOP/s, and TinyLlama Q4_0 at 2 threads decoding 6 / 12 / 16
 * sequences 247-265 / 309-337 / 317-332 -> 302-322 / 333-359 / 352-368
 * tok/s. (One chain of 8 per token, 4 tokens: slower.) */
enum { GQ_T = 6, GQ_KB = LK_TERMS_KB, GQ_TMAX = 16 };
/* the activation terms of up to GQ_TMAX tokens (32 KB), when the call
 * derives them. Its K blocks are the terms' (LK_TERMS_KB), 256 blocks: a
 * matrix of up to 8192 columns is one pass over its row groups, each
 * group's bytes read in one run (with 128 blocks a 5632-column matrix took
 * two passes, each reading every group's bytes in two pieces, past the
 * prefetches' reach). */
typedef struct { float d[GQ_TMAX][GQ_KB]; int32_t corr[GQ_TMAX][GQ_KB]; } gq_act;

LK_T512 static LK_INL void gq_rows(const int fmt, const bool full, const uint8_t *w, size_t ws, int nr, int64_t nb,
                                 int64_t b, __m512i v[8], __m512 *d) {
    if (lk_fmt_r16(fmt) && full) {
        gk_r16_block(fmt == LK_FMT_Q8R16, w, nb, b, v, d);
        return;
    }
    const bool is_q8 = lk_fmt_q8(fmt);
    const size_t bb = is_q8 ? LK_Q80_BYTES : LK_Q40_BYTES;
    const uint8_t *p = w + (size_t)b * bb;
    __m128i q[16];
    gk_load16(p + 2, ws, nr, full, q);
    gk_transpose16x4(q, v);
    if (is_q8) {
        gk_load16(p + 18, ws, nr, full, q);
        gk_transpose16x4(q, v + 4);
        const __m512i flip = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) v[k] = _mm512_xor_si512(v[k], flip);
    } else {
        const __m512i m0f = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            v[k + 4] = gk_hi_nibble(v[k]);
            v[k] = _mm512_and_si512(v[k], m0f);
        }
    }
    *d = gk_gather_h16(p, ws, full ? 16 : nr);
}

/* One block's products for T tokens into acc: v, wd its 16 rows' quants and
 * scales (gq_rows), bk its index for the activations */
LK_T512 static LK_INL void gq_block(const int T, const __m512i v[8], __m512 wd, int64_t bk, const uint8_t *a,
                                  size_t as, const gk_terms *A, int t0, int b, __m512 acc[GQ_T]) {
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
        const uint8_t *aq = a + (size_t)t * as + (size_t)bk * LK_Q80_BYTES + 2;
        const int ta = t0 + t;
        /* two chains of 4 (exact integers: the same sum), so that one
         * token's block does not wait 8 vpdpbusd latencies */
        __m512i ia = _mm512_set1_epi32(A->corr[ta * GQ_KB + b]), ib = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            ia = _mm512_dpbusd_epi32(ia, v[k], _mm512_set1_epi32(lk_ld_i32(aq + 4 * k)));
            ib = _mm512_dpbusd_epi32(ib, v[k + 4], _mm512_set1_epi32(lk_ld_i32(aq + 16 + 4 * k)));
        }
        ia = _mm512_add_epi32(ia, ib);
        acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_cvtepi32_ps(ia),
                                                     _mm512_mul_ps(wd, _mm512_set1_ps(A->d[ta * GQ_KB + b]))));
    }
}

LK_T512 static LK_INL void gq_tile(const int fmt, const bool full, const int T, int64_t nb, int64_t b0, int kb,
                                 const uint8_t *w, size_t ws, int nr, const uint8_t *a, size_t as, const gk_terms *A,
                                 int t0, float *y, size_t ys, size_t pf, size_t far, bool cont) {
    const bool q8 = lk_fmt_q8(fmt);
    const size_t bb = q8 ? LK_Q80_BYTES : LK_Q40_BYTES;
    const bool r16 = lk_fmt_r16(fmt) && full;
    const __mmask16 m = (__mmask16)((1u << nr) - 1);
    __m512 acc[GQ_T];
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) acc[t] = cont ? _mm512_maskz_loadu_ps(m, y + (size_t)t * ys) : _mm512_setzero_ps();
    int b = 0;
    if (r16) {
        /* A repacked group is one run of bytes, a pair of blocks (quants,
         * quants, scales, scales: lk_r16_at) a whole number of lines: each
         * pair prefetches its own lines pf bytes ahead (into L1) and far
         * bytes ahead (into L2: lk_quant_set_far; past the matrix's end it
         * asks for lines nobody reads, and never faults), one prefetch a
         * line, unrolled, half of them before each block. A rolled loop of
         * them a block (5 lines for 4.5) and the block's place computed
         * afresh (lk_r16_at) cost a Zen 5 core a sixth to a third of its
         * speed from cache: bench_quant 2048 x 5632 Q4_0_R16 one thread
         * 50.6 -> 59.2 GB/s hot (L3), 512 x 2048 58.9 -> 75.9 (L2), from
         * memory 21.5 -> 22.9; TinyLlama Q4_0 at 2 threads 68.1 -> 73.2
         * tok/s (medians of 5-6 alternations). b0 is even (a multiple of
         * GQ_KB), so pairs are the layout's.
         * The pairs loop is unrolled by 4 (a count of pairs, so that gcc
         * can): on the Zen 5, one thread, streaming from memory, Q4_0_R16
         * went from three quarters of a probe of the same bytes to all of
         * it (bench_quant BENCH_PAIRED 2048 x 5632: 74.5-79.7 % -> 86.2-
         * 113.5 %; Q8_0_R16 72.1-83.3 -> 96.0-111.4 %), TinyLlama Q4_0
         * decode 42.4-43.4 -> 49.7-52.5 tok/s, with the same speed from
         * cache. Unrolled by 2 or 8 it stayed where it was; what the
         * out-of-order core gains from 4 is not visible without counters
         * (BENCHMARKS.md, forty-second session). */
        const size_t qb = lk_r16_qbytes(q8), pb = 2 * qb + 64;
        const uint8_t *p = w + (size_t)(b0 / 2) * pb;
        const int npairs = (int)LK_MIN((int64_t)kb / 2, (nb - b0) / 2);
#pragma GCC unroll 4
        for (int i = 0; i < npairs; i++, b += 2, p += pb) {
            const size_t half = pb / 128 * 64 + 64; /* the first block's share of the lines */
            if (pf) {
#pragma GCC unroll 9
                for (size_t o = 0; o < half; o += 64) __builtin_prefetch(p + pf + o, 0, 3);
            }
            if (far) {
#pragma GCC unroll 9
                for (size_t o = 0; o < half; o += 64) __builtin_prefetch(p + far + o, 0, 2);
            }
            __m512i v[8];
            gk_r16_quants(q8, p, v);
            gq_block(T, v, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * qb))), b0 + b, a, as, A, t0,
                     b, acc);
            if (pf) {
#pragma GCC unroll 9
                for (size_t o = half; o < pb; o += 64) __builtin_prefetch(p + pf + o, 0, 3);
            }
            if (far) {
#pragma GCC unroll 9
                for (size_t o = half; o < pb; o += 64) __builtin_prefetch(p + far + o, 0, 2);
            }
            gk_r16_quants(q8, p + qb, v);
            gq_block(T, v, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * qb + 32))), b0 + b + 1, a,
                     as, A, t0, b + 1, acc);
        }
    }
    size_t next_pf = (size_t)(b0 + b) * bb;
    for (; b < kb; b++) {
        /* a file row's block, or a repacked group's last unpaired one */
        if (!r16) lk_quant_pf_group(w, ws, nr, pf, (size_t)(b0 + b) * bb, &next_pf);
        __m512i v[8];
        __m512 wd;
        gq_rows(fmt, full, w, ws, nr, nb, b0 + b, v, &wd);
        gq_block(T, v, wd, b0 + b, a, as, A, t0, b, acc);
    }
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) _mm512_mask_storeu_ps(y + (size_t)t * ys, m, acc[t]);
}

/* per type, token count, and full 16-row groups apart (see gk_load16) */
#define GQ_TILE(Q, F, T)                                                                                          \
    LK_T512 static void gq_tile_##Q##_##F##_##T(int64_t nb, int64_t b0, int kb, const uint8_t *w, size_t ws, int nr, \
                                              const uint8_t *a, size_t as, const gk_terms *A, int t0, float *y,   \
                                              size_t ys, size_t pf, size_t far, bool cont) {                      \
        gq_tile(Q, F, T, nb, b0, kb, w, ws, nr, a, as, A, t0, y, ys, pf, far, cont);                              \
    }
#define GQ_TILES(Q, F)                                                                                       \
    GQ_TILE(Q, F, 1) GQ_TILE(Q, F, 2) GQ_TILE(Q, F, 3) GQ_TILE(Q, F, 4) GQ_TILE(Q, F, 5) GQ_TILE(Q, F, 6)
GQ_TILES(0, 0) GQ_TILES(0, 1) GQ_TILES(1, 0) GQ_TILES(1, 1) GQ_TILES(2, 1) GQ_TILES(3, 1)
/* a row of k_gq_tiles: the tiles of GQ_TILES(Q, F), by token count */
#define GQ_ROW(Q, F)                                                                                    \
    {NULL, gq_tile_##Q##_##F##_1, gq_tile_##Q##_##F##_2, gq_tile_##Q##_##F##_3, gq_tile_##Q##_##F##_4, \
     gq_tile_##Q##_##F##_5, gq_tile_##Q##_##F##_6}
typedef void (*gq_tile_fn)(int64_t nb, int64_t b0, int kb, const uint8_t *w, size_t ws, int nr, const uint8_t *a,
                           size_t as, const gk_terms *A, int t0, float *y, size_t ys, size_t pf, size_t far,
                           bool cont);
/* [fmt][whole group of 16 rows]: the rows past a repacked type's whole
 * groups are the file type's rows */
static const gq_tile_fn k_gq_tiles[4][2][GQ_T + 1] = {
    {GQ_ROW(0, 0), GQ_ROW(0, 1)},
    {GQ_ROW(1, 0), GQ_ROW(1, 1)},
    {GQ_ROW(0, 0), GQ_ROW(2, 1)},
    {GQ_ROW(1, 0), GQ_ROW(3, 1)},
};
#undef GQ_ROW

/* The prefetch distance of a repacked group, one run of bytes read in
 * order: d times 4 rows ahead, as far as the 4-row decode tiles look (16
 * rows ahead, as for a file's rows, is past L1: on a Zen 5 core that read
 * 20 % slower from cache and no faster from memory than no prefetch at
 * all), rows counted at most 4 KiB long. Past 16 KiB ahead the lines
 * left L1 before their reads: bench_quant 4096 x 18432 one thread, pf=1,
 * 78 % of the probe streamed with 41 KiB (Q4_0_R16; 4 KiB rows: 100 %),
 * Q8_0_R16 4096 x 7168 92 -> 97-100 % (30 -> 16 KiB). */
static inline size_t r16_pf(int d, size_t ws) { return (size_t)d * 4 * LK_MIN(ws, (size_t)4096); }

/* The prefetch distance of the group of nr rows at r0: a repacked group's
 * (r16_pf), or file rows' d groups below while that is inside the matrix */
static inline size_t group_pf(int fmt, int d, int64_t r0, int nr, int64_t nrows, size_t ws) {
    if (lk_fmt_r16(fmt) && nr == 16) return r16_pf(d, ws);
    return d && r0 + (int64_t)(d + 1) * 16 <= nrows ? (size_t)d * 16 * ws : 0;
}

/* Whether the few-token kernels take their token tiles inside each row
 * group (lk_quant_set_rows_inner, quant.h, says when) */
static inline bool rows_inner(size_t bytes) { return (int64_t)bytes > lk_quant_rows_inner(); }

LK_T512 void lk_quant_q4q8_rows_avx512(int fmt, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                                     const void *a, size_t as, const lk_act_terms *terms, float *y, size_t ys) {
    const bool is_q8 = lk_fmt_q8(fmt);
    const int64_t nb = n / LK_QK;
    const uint8_t *W = w, *A = a;
    const int d = lk_quant_pf_tiles();
    const size_t far = lk_fmt_r16(fmt) ? lk_quant_far_bytes(is_q8) : 0;
    gq_act act;
    /* Token tiles inside each row group when the call's weights would not
     * stay in cache between passes (rows_inner): up to GQ_TMAX tokens at
     * once, a group's weights from memory once (prefetched by its first
     * tile), from L1 for its other tiles. Otherwise (a thread's share of a
     * matrix that fits its L2) the tiles outside the groups: the first pass
     * streams the weights from memory with its prefetches, the others read
     * them from L2. */
    const bool inner = rows_inner((size_t)nrows * ws);
    const int nc = (int)((nb + GQ_KB - 1) / GQ_KB); /* K blocks of the terms */
    for (int64_t t1 = 0; t1 < ntok; t1 += GQ_TMAX) {
        const int tn = (int)LK_MIN((int64_t)GQ_TMAX, ntok - t1);
        const uint8_t *at = A + (size_t)t1 * as;
        gk_terms tm;
        const bool given = terms_at(terms, is_q8 ? 128 : 8, t1, 0, &tm);
        if (inner && nc > 1 && (given || nc * tn <= GQ_TMAX)) {
            /* A row longer than one K block (more than 8192 columns: Wo
             * and down of the 8B-class models and up) from memory: each
             * row group's K blocks one after another, so the matrix is
             * read as one run of bytes, as a shorter one is (the repacked
             * layout keeps a group's blocks in order), its prefetches
             * ahead of the reads. K blocks outside the groups read every
             * group in pieces, each from a cold start and with its
             * prefetches in the next piece, long evicted when read:
             * bench_quant 4096 x 18432 one thread 8.3 GB/s of 13.6
             * streamed (Q4_0_R16), 16384 columns 8.5. The terms of every
             * K block at once: the caller's, or derived into act, laid
             * out as lk_act_terms lays them (K block c's token t at
             * (c tn + t) GQ_KB). */
            if (!given)
                for (int c = 0; c < nc; c++)
                    gk_prep(is_q8, at, as, tn, (int64_t)c * GQ_KB, (int)LK_MIN((int64_t)GQ_KB, nb - (int64_t)c * GQ_KB),
                            &act.d[c * tn][0], &act.corr[c * tn][0], GQ_KB);
            for (int64_t r0 = 0; r0 < nrows; r0 += 16) {
                const int nr = (int)LK_MIN((int64_t)16, nrows - r0);
                const size_t pf = group_pf(fmt, d, r0, nr, nrows, ws);
                for (int c = 0; c < nc; c++) {
                    const int64_t b0 = (int64_t)c * GQ_KB;
                    const int kb = (int)LK_MIN((int64_t)GQ_KB, nb - b0);
                    gk_terms tc;
                    if (given) terms_at(terms, is_q8 ? 128 : 8, t1, b0, &tc);
                    else tc = (gk_terms){&act.d[c * tn][0], &act.corr[c * tn][0]};
                    for (int t = 0; t < tn; t += GQ_T) {
                        const int tt = LK_MIN(GQ_T, tn - t);
                        k_gq_tiles[fmt][nr == 16][tt](nb, b0, kb, W + (size_t)r0 * ws, ws, nr, at + (size_t)t * as, as,
                                                      &tc, t, y + (size_t)(t1 + t) * ys + (size_t)r0, ys,
                                                      t == 0 ? pf : 0, t == 0 && nr == 16 ? far : 0, b0 > 0);
                    }
                }
            }
            continue;
        }
        for (int64_t b0 = 0; b0 < nb; b0 += GQ_KB) {
            const int kb = (int)LK_MIN((int64_t)GQ_KB, nb - b0);
            if (!terms_at(terms, is_q8 ? 128 : 8, t1, b0, &tm)) {
                gk_prep(is_q8, at, as, tn, b0, kb, &act.d[0][0], &act.corr[0][0], GQ_KB);
                tm = (gk_terms){&act.d[0][0], &act.corr[0][0]};
            }
            for (int t2 = 0; t2 < tn; t2 += inner ? tn : GQ_T)
            for (int64_t r0 = 0; r0 < nrows; r0 += 16) {
                const int nr = (int)LK_MIN((int64_t)16, nrows - r0);
                const size_t pf = group_pf(fmt, d, r0, nr, nrows, ws);
                for (int t = t2; t < (inner ? tn : LK_MIN(tn, t2 + GQ_T)); t += GQ_T) {
                    const int tt = LK_MIN(GQ_T, tn - t);
                    const bool first = t1 + t == 0 || (inner && t == 0); /* the tile that reads from memory */
                    k_gq_tiles[fmt][nr == 16][tt](nb, b0, kb, W + (size_t)r0 * ws, ws, nr, at + (size_t)t * as, as, &tm,
                                                  t, y + (size_t)(t1 + t) * ys + (size_t)r0, ys, first ? pf : 0,
                                                  first && nr == 16 ? far : 0, b0 > 0);
                }
            }
        }
    }
}

/* ===================================================================== */
/* Q4_K weights x Q8_K activations                                        */
/* ===================================================================== */

/* The same scheme for Q4_K super-blocks (256 elements: 8 sub-blocks of 32
 * with 6-bit scales sc_j and mins m_j, fp16 d and dmin):
 *   dot = d*da * sum_j sc_j * (q.a)_j  -  dmin*da * sum_j m_j * (sum a)_j
 * Per (16 rows, token, sub-block): 8 vpdpbusd in two halves of 16 elements
 * (a half's sum, at most 16*15*127, fits the i16 that vpdpwssd reads), each
 * half times the rows' sc_j by one vpdpwssd into the super-block's integer
 * sum; per super-block 4 vpdpwssd give sum_j m_j * (sum a)_j from the
 * activation's bsums (pairs of sub-block sums as i16). The float work per
 * super-block is the scalar reference's, in its order:
 *   s += (d*da)*sumi - (dmin*da)*summ,
 * about 92 uops per 64 vpdpbusd. Three accumulator sets (half sums, the
 * super-block's integer sum, the float sum) leave room for 2 x 4 tiles. */
enum {
    GK4_RG = 2,     /* row groups per micro-tile */
    GK4_T = 4,      /* tokens per micro-tile */
    GK4_KB = 2,     /* super-blocks per K block: 2 x 2 x 89 x 64 B = 23 KB panel */
    GK4_KSB = 16,   /* super-blocks per activation prep */
    /* vectors 0..63 of a (row group, super-block): quants 4v..4v+3 (Q4_K/Q5_K:
     * sub-block v/8, Q6_K: group v/4); then for Q4_K/Q5_K: */
    GK4_SC = 64,    /* sc_0 .. sc_7 (i32 lanes) */
    GK4_MM = 72,    /* m_{2i} | m_{2i+1} << 16, i = 0..3 */
    GK4_D = 76,     /* d, then dmin (floats); 78 vectors in all */
    /* for Q6_K: */
    GK6_SC = 64,    /* scale of group g (16 quants) as i32, g = 0..15 */
    GK6_SP = 80,    /* (sc_2i, sc_2i+1) as i16 pairs, i = 0..7 */
    GK6_D = 88,     /* d (floats) */
    GKK_VEC = 89,   /* vectors per (row group, super-block): the larger layout */
};

typedef struct {
    _Alignas(64) uint8_t v[GK4_RG][GK4_KB][GKK_VEC][64];
} gk4_panel;

typedef struct {
    float   d[GK_TB][GK4_KSB];
    int32_t sp[GK_TB][GK4_KSB][4]; /* (S_2i, S_2i+1) as i16 pairs, S_j = sum of sub-block j */
} gk4_act;

/* Q4_K (kind 4) or Q5_K (kind 5: the fifth bit of element l of sub-block j
 * is bit j of qh[l]). */
LK_T512 static LK_INL void gk4_pack_body(const int kind, const bool r16, const bool full, const uint8_t *w, size_t ws,
                                       int nr, int64_t nb, int64_t s0, int kb, uint8_t (*out)[GKK_VEC][64]) {
    const __m512i m0f = _mm512_set1_epi8(0x0F), m3f = _mm512_set1_epi32(63), mf = _mm512_set1_epi32(15),
                  m3 = _mm512_set1_epi32(3);
    for (int s = 0; s < kb; s++) {
        const size_t bb = kind == 4 ? LK_Q4K_BYTES : LK_Q5K_BYTES, qso = kind == 4 ? LK_Q4K_QS : LK_Q5K_QS;
        size_t qo = (size_t)(s0 + s) * bb, dof;
        if (r16) lk_kr16_at(bb, s0 + s, nb, &qo, &dof);
        const uint8_t *p = w + qo;
        /* the first 16 bytes of each row's super-block: d | dmin | 12 bytes
         * of 6-bit scales and mins; transposed, lane r of h[1..3] holds
         * scale bytes 0-3, 4-7, 8-11 of row r, unpacked in all lanes at once
         * (lk_k_scale_min's packing) */
        __m512i h[4];
        gkk_rows4(r16, p, 0, ws, nr, full, h);
        _mm512_store_ps(out[s][GK4_D], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h[0])));
        _mm512_store_ps(out[s][GK4_D + 1], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h[0], 16))));
        __m512i sc[8], mn[8];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            sc[j] = _mm512_and_si512(_mm512_srli_epi32(h[1], 8 * j), m3f);
            mn[j] = _mm512_and_si512(_mm512_srli_epi32(h[2], 8 * j), m3f);
            sc[j + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(h[3], 8 * j), mf),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h[1], 8 * j + 6), m3), 4));
            mn[j + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(h[3], 8 * j + 4), mf),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h[2], 8 * j + 6), m3), 4));
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) _mm512_store_si512(out[s][GK4_SC + j], sc[j]);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            _mm512_store_si512(out[s][GK4_MM + i], _mm512_or_si512(mn[2 * i], _mm512_slli_epi32(mn[2 * i + 1], 16)));
        /* Q5_K: qh bytes 4k..4k+3 of the 16 rows in qh[k] */
        __m512i qh[8];
        if (kind == 5)
            for (int c = 0; c < 2; c++) gkk_rows4(r16, p, LK_Q5K_QH + 16 * c, ws, nr, full, qh + 4 * c);
        /* quant bytes 16c..16c+15 (c = 0..7) of the 16 rows: byte 32q + l
         * holds element l of sub-block 2q (low nibble) and of 2q+1 (high) */
        for (int c = 0; c < 8; c++) {
            __m512i v[4];
            gkk_rows4(r16, p, qso + 16 * c, ws, nr, full, v);
            const int j = 2 * (c / 2), k0 = 4 * (c & 1);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                __m512i lo = _mm512_and_si512(v[i], m0f), hi = gk_hi_nibble(v[i]);
                if (kind == 5) {
                    /* bit j (j+1) of qh moved to bit 4; 16-bit shifts, the
                     * bits crossing bytes land outside the 0x10 mask */
                    const __m512i h = qh[k0 + i], m10 = _mm512_set1_epi8(0x10);
                    __m512i h0 = j <= 4 ? _mm512_slli_epi16(h, 4 - j) : _mm512_srli_epi16(h, j - 4);
                    __m512i h1 = j + 1 <= 4 ? _mm512_slli_epi16(h, 3 - j) : _mm512_srli_epi16(h, j - 3);
                    lo = _mm512_or_si512(lo, _mm512_and_si512(h0, m10));
                    hi = _mm512_or_si512(hi, _mm512_and_si512(h1, m10));
                }
                _mm512_store_si512(out[s][8 * j + k0 + i], lo);
                _mm512_store_si512(out[s][8 * (j + 1) + k0 + i], hi);
            }
        }
    }
}

/* Q6_K (256 quants: 4 low bits in ql[128], 2 high bits in qh[64], 16
 * int8 scales of 16 quants, fp16 d): element e = 128h + 32k + l takes its low
 * nibble from ql[64h + 32(k&1) + l] (low nibble for k < 2) and bits 2k, 2k+1
 * of qh[32h + l]; packed as q + 32 (0..63, unsigned for vpdpbusd), vector
 * 4g + kk = quants 16g + 4kk .. +3. The -32 comes back through the bsums. */
LK_T512 static LK_INL void gk6_pack_body(const bool r16, const bool full, const uint8_t *w, size_t ws, int nr,
                                       int64_t nb, int64_t s0, int kb, uint8_t (*out)[GKK_VEC][64]) {
    const __m512i m0f = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30), mlo = _mm512_set1_epi32(0xFFFF);
    for (int s = 0; s < kb; s++) {
        size_t qo = (size_t)(s0 + s) * LK_Q6K_BYTES, dof = 0;
        if (r16) lk_kr16_at(LK_Q6K_BYTES, s0 + s, nb, &qo, &dof);
        const uint8_t *p = w + qo;
        __m512i ql[32], qh[16], sv[4];
        for (int c = 0; c < 12; c++) /* ql then qh: contiguous bytes */
            gkk_rows4(r16, p, LK_Q6K_QL + 16 * c, ws, nr, full, c < 8 ? ql + 4 * c : qh + 4 * (c - 8));
        for (int g = 0; g < 16; g++) {
            const int h = g / 8, k = (g / 2) & 3;
#pragma GCC unroll 4
            for (int kk = 0; kk < 4; kk++) {
                const int l = 16 * (g & 1) + 4 * kk;
                __m512i lo = ql[(64 * h + 32 * (k & 1) + l) / 4], hv = qh[(32 * h + l) / 4];
                lo = k < 2 ? _mm512_and_si512(lo, m0f) : gk_hi_nibble(lo);
                hv = k == 0 ? _mm512_slli_epi16(hv, 4) : k == 1 ? _mm512_slli_epi16(hv, 2)
                   : k == 2 ? hv : _mm512_srli_epi16(hv, 2);
                _mm512_store_si512(out[s][4 * g + kk], _mm512_or_si512(lo, _mm512_and_si512(hv, m30)));
            }
        }
        gkk_rows4(r16, p, LK_Q6K_SC, ws, nr, full, sv);
        __m512i sc[16];
#pragma GCC unroll 16
        for (int g = 0; g < 16; g++) {
            sc[g] = _mm512_srai_epi32(_mm512_slli_epi32(sv[g / 4], 24 - 8 * (g % 4)), 24);
            _mm512_store_si512(out[s][GK6_SC + g], sc[g]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            _mm512_store_si512(out[s][GK6_SP + i],
                               _mm512_or_si512(_mm512_and_si512(sc[2 * i], mlo), _mm512_slli_epi32(sc[2 * i + 1], 16)));
        _mm512_store_ps(out[s][GK6_D], r16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + dof)))
                                           : gk_gather_h16(p + LK_Q6K_D, ws, full ? 16 : nr));
    }
}

/* The K-quant packers per type, full groups and repacked groups apart (see
 * gk_load16; r16: a whole repacked group) */
LK_T512 static void gk4_pack_group(const int kind, const bool r16, const uint8_t *w, size_t ws, int nr, int64_t nb,
                                 int64_t s0, int kb, uint8_t (*out)[GKK_VEC][64]) {
    if (kind == 4) {
        if (r16) gk4_pack_body(4, true, true, w, ws, nr, nb, s0, kb, out);
        else if (nr == GK_ROWS) gk4_pack_body(4, false, true, w, ws, nr, nb, s0, kb, out);
        else gk4_pack_body(4, false, false, w, ws, nr, nb, s0, kb, out);
    } else {
        if (r16) gk4_pack_body(5, true, true, w, ws, nr, nb, s0, kb, out);
        else if (nr == GK_ROWS) gk4_pack_body(5, false, true, w, ws, nr, nb, s0, kb, out);
        else gk4_pack_body(5, false, false, w, ws, nr, nb, s0, kb, out);
    }
}

LK_T512 static void gk6_pack_group(const bool r16, const uint8_t *w, size_t ws, int nr, int64_t nb, int64_t s0, int kb,
                                 uint8_t (*out)[GKK_VEC][64]) {
    if (r16) gk6_pack_body(true, true, w, ws, nr, nb, s0, kb, out);
    else if (nr == GK_ROWS) gk6_pack_body(false, true, w, ws, nr, nb, s0, kb, out);
    else gk6_pack_body(false, false, w, ws, nr, nb, s0, kb, out);
}

LK_T512 static void gk4_prep(const uint8_t *a, size_t as, int tb, int64_t s0, int ksb, gk4_act *act) {
    for (int t = 0; t < tb; t++)
        for (int s = 0; s < ksb; s++) {
            const uint8_t *p = a + (size_t)t * as + (size_t)(s0 + s) * LK_Q8K_BYTES;
            act->d[t][s] = lk_ld_f32(p);
            for (int i = 0; i < 4; i++) {
                int s_lo = lk_ld_i16(p + LK_Q8K_BS + 8 * i) + lk_ld_i16(p + LK_Q8K_BS + 8 * i + 2);
                int s_hi = lk_ld_i16(p + LK_Q8K_BS + 8 * i + 4) + lk_ld_i16(p + LK_Q8K_BS + 8 * i + 6);
                act->sp[t][s][i] = (int32_t)((uint32_t)(uint16_t)s_lo | (uint32_t)s_hi << 16);
            }
        }
}

/* One RG x T micro-tile over kb super-blocks (kind 4: Q4_K, 5: Q5_K, 6: Q6_K). */
LK_T512 static LK_INL void gkk_tile(const int kind, const int RG, const int T, const gk4_panel *wp,
                                  const uint8_t *const *at, const gk4_act *act, int t0, int s1, int kb, float *y,
                                  size_t ys, int nlast, bool add) {
    __m512 fa[GK4_RG][GK4_T];
    gk_init(RG, T, &fa[0][0], GK4_T, y, ys, nlast, add);
    for (int s = 0; s < kb; s++) {
        __m512i is[GK4_RG][GK4_T];
        if (kind != 6) {
#pragma GCC unroll 4
            for (int g = 0; g < RG; g++)
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) is[g][t] = _mm512_setzero_si512();
        } else {
            /* Q6_K: sum_g sc_g * (q+32).a over group g, minus 32 * sum_g sc_g * bsum_g */
#pragma GCC unroll 4
            for (int g = 0; g < RG; g++)
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    __m512i c = _mm512_setzero_si512();
#pragma GCC unroll 8
                    for (int i = 0; i < 8; i++)
                        c = _mm512_dpwssd_epi32(c, _mm512_load_si512(wp->v[g][s][GK6_SP + i]),
                                                _mm512_set1_epi32(lk_ld_i32(at[t] + (size_t)s * LK_Q8K_BYTES + LK_Q8K_BS + 4 * i)));
                    is[g][t] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(c, 5));
                }
        }
        /* Steps of NV quant vectors (4*NV quants), then times the scale.
         * kind 4: halves of sub-blocks (16 quants, sums up to 16*15*127 fit
         * vpdpwssd's i16); kind 5: quarters (5-bit quants: 8*31*127); kind
         * 6: groups of 16 with their own scale, by vpmulld (a group's sum of
         * (q+32)*a, up to 128016, does not fit an i16). */
        const int NV = kind == 5 ? 2 : 4;
        for (int step = 0; step < 64 / NV; step++) {
            __m512i ps[GK4_RG][GK4_T];
#pragma GCC unroll 4
            for (int g = 0; g < RG; g++)
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) ps[g][t] = _mm512_setzero_si512();
            /* vector v = quants 4v..4v+3 (K4/K5: sub-block v/8; K6: group v/4) */
            const int v0 = NV * step;
#pragma GCC unroll 4
            for (int kk = 0; kk < NV; kk++) {
#pragma GCC unroll 4
                for (int g = 0; g < RG; g++) {
                    __m512i wv = _mm512_load_si512(wp->v[g][s][v0 + kk]);
#pragma GCC unroll 4
                    for (int t = 0; t < T; t++)
                        ps[g][t] = _mm512_dpbusd_epi32(ps[g][t], wv, _mm512_set1_epi32(lk_ld_i32(
                            at[t] + (size_t)s * LK_Q8K_BYTES + LK_Q8K_QS + 4 * (v0 + kk))));
                }
            }
#pragma GCC unroll 4
            for (int g = 0; g < RG; g++) {
                __m512i sc = _mm512_load_si512(wp->v[g][s][kind != 6 ? GK4_SC + v0 / 8 : GK6_SC + step]);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++)
                    is[g][t] = kind != 6 ? _mm512_dpwssd_epi32(is[g][t], ps[g][t], sc)
                                         : _mm512_add_epi32(is[g][t], _mm512_mullo_epi32(ps[g][t], sc));
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < RG; g++) {
            __m512 dd = _mm512_load_ps(wp->v[g][s][kind != 6 ? GK4_D : GK6_D]);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                __m512 ad = _mm512_set1_ps(act->d[t0 + t][s1 + s]);
                __m512 v = _mm512_mul_ps(_mm512_mul_ps(dd, ad), _mm512_cvtepi32_ps(is[g][t]));
                if (kind != 6) {
                    /* s += (d*da)*sumi - (dmin*da)*summ, as the scalar reference */
                    __m512 dm = _mm512_load_ps(wp->v[g][s][GK4_D + 1]);
                    __m512i im = _mm512_setzero_si512();
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++)
                        im = _mm512_dpwssd_epi32(im, _mm512_load_si512(wp->v[g][s][GK4_MM + i]),
                                                 _mm512_set1_epi32(act->sp[t0 + t][s1 + s][i]));
                    v = _mm512_sub_ps(v, _mm512_mul_ps(_mm512_mul_ps(dm, ad), _mm512_cvtepi32_ps(im)));
                }
                fa[g][t] = _mm512_add_ps(fa[g][t], v);
            }
        }
    }
    gk_store(RG, T, &fa[0][0], GK4_T, y, ys, nlast, false);
}

typedef void (*gk4_tile_fn)(const gk4_panel *wp, const uint8_t *const *at, const gk4_act *act, int t0, int s1,
                            int kb, float *y, size_t ys, int nlast, bool add);
#define GKK_TILE(K, RG, T)                                                                                    \
    LK_T512 static void gk##K##_tile_##RG##x##T(const gk4_panel *wp, const uint8_t *const *at, const gk4_act *act, \
                                             int t0, int s1, int kb, float *y, size_t ys, int nlast, bool add) { \
        gkk_tile(K, RG, T, wp, at, act, t0, s1, kb, y, ys, nlast, add);                                        \
    }
GKK_TILE(4, 1, 1) GKK_TILE(4, 1, 2) GKK_TILE(4, 1, 3) GKK_TILE(4, 1, 4)
GKK_TILE(4, 2, 1) GKK_TILE(4, 2, 2) GKK_TILE(4, 2, 3) GKK_TILE(4, 2, 4)
GKK_TILE(5, 1, 1) GKK_TILE(5, 1, 2) GKK_TILE(5, 1, 3) GKK_TILE(5, 1, 4)
GKK_TILE(5, 2, 1) GKK_TILE(5, 2, 2) GKK_TILE(5, 2, 3) GKK_TILE(5, 2, 4)
GKK_TILE(6, 1, 1) GKK_TILE(6, 1, 2) GKK_TILE(6, 1, 3) GKK_TILE(6, 1, 4)
GKK_TILE(6, 2, 1) GKK_TILE(6, 2, 2) GKK_TILE(6, 2, 3) GKK_TILE(6, 2, 4)
static const gk4_tile_fn k4_tiles[3][GK4_RG][GK4_T] = {
    {{gk4_tile_1x1, gk4_tile_1x2, gk4_tile_1x3, gk4_tile_1x4},
     {gk4_tile_2x1, gk4_tile_2x2, gk4_tile_2x3, gk4_tile_2x4}},
    {{gk5_tile_1x1, gk5_tile_1x2, gk5_tile_1x3, gk5_tile_1x4},
     {gk5_tile_2x1, gk5_tile_2x2, gk5_tile_2x3, gk5_tile_2x4}},
    {{gk6_tile_1x1, gk6_tile_1x2, gk6_tile_1x3, gk6_tile_1x4},
     {gk6_tile_2x1, gk6_tile_2x2, gk6_tile_2x3, gk6_tile_2x4}},
};

LK_T512 static void gkk_gemm(const int kind, const bool r16, int64_t n, int64_t nrows, const uint8_t *W, size_t ws,
                           int64_t ntok, const uint8_t *A, size_t as, float *y, size_t ys) {
    const size_t bb = kind == 4 ? LK_Q4K_BYTES : kind == 5 ? LK_Q5K_BYTES : LK_Q6K_BYTES;
    const int64_t nb = n / LK_QK_K;
    const int PR = GK4_RG * GK_ROWS;
    gk4_panel wp;
    gk4_act act;
    for (int64_t t0 = 0; t0 < ntok; t0 += GK_TB) {
        const int tb = (int)LK_MIN((int64_t)GK_TB, ntok - t0);
        for (int64_t s0 = 0; s0 < nb; s0 += GK4_KSB) {
            const int ksb = (int)LK_MIN((int64_t)GK4_KSB, nb - s0);
            gk4_prep(A + (size_t)t0 * as, as, tb, s0, ksb, &act);
            for (int64_t r0 = 0; r0 < nrows; r0 += PR) {
                const int nr = (int)LK_MIN((int64_t)PR, nrows - r0);
                const int rg = (nr + GK_ROWS - 1) / GK_ROWS, nlast = nr - (rg - 1) * GK_ROWS;
                for (int b1 = 0; b1 < ksb; b1 += GK4_KB) {
                    const int kb = LK_MIN(GK4_KB, ksb - b1);
                    const int64_t b0 = s0 + b1;
                    for (int g = 0; g < rg; g++) {
                        const uint8_t *wg = W + (size_t)(r0 + g * GK_ROWS) * ws;
                        const int ng = LK_MIN(GK_ROWS, nr - g * GK_ROWS);
                        if (kind != 6) gk4_pack_group(kind, r16 && ng == GK_ROWS, wg, ws, ng, nb, b0, kb, wp.v[g]);
                        else gk6_pack_group(r16 && ng == GK_ROWS, wg, ws, ng, nb, b0, kb, wp.v[g]);
                    }
                    /* prefetch the next panel while the tiles run (see the Q4_0 driver) */
                    int64_t pr0 = r0, pb = b1 + kb;
                    if (pb >= ksb) pr0 += PR, pb = 0;
                    const int pnr = pr0 < nrows ? (int)LK_MIN((int64_t)PR, nrows - pr0) : 0;
                    const size_t plo = (size_t)(s0 + pb) * bb, phi = (size_t)(s0 + LK_MIN(pb + GK4_KB, ksb)) * bb;
                    const int ntl = (tb + GK4_T - 1) / GK4_T;
                    for (int t = 0, ti = 0; t < tb; t += GK4_T, ti++) {
                        for (int r = ti * pnr / ntl; r < (ti + 1) * pnr / ntl; r++) {
                            /* a repacked group's super-blocks are one run of
                             * 16 x their bytes (Q6_K's d by pairs aside) */
                            const bool rg16 = r16 && pnr - r / GK_ROWS * GK_ROWS >= GK_ROWS;
                            const uint8_t *rp = rg16 ? W + (size_t)(pr0 + r / GK_ROWS * GK_ROWS) * ws + (size_t)(r % GK_ROWS) * (phi - plo)
                                                     : W + (size_t)(pr0 + r) * ws;
                            const size_t lo = rg16 ? 16 * plo : plo & ~(size_t)63, hi = rg16 ? lo + phi - plo : phi;
                            for (size_t o = lo; o < hi; o += 64) _mm_prefetch((const char *)rp + o, _MM_HINT_T1);
                        }
                        const int tt = LK_MIN(GK4_T, tb - t);
                        const uint8_t *at[GK4_T];
                        for (int i = 0; i < tt; i++)
                            at[i] = A + (size_t)(t0 + t + i) * as + (size_t)b0 * LK_Q8K_BYTES;
                        k4_tiles[kind - 4][rg - 1][tt - 1](&wp, at, &act, t, b1, kb,
                                                            y + (size_t)(t0 + t) * ys + (size_t)r0, ys, nlast, b0 > 0);
                    }
                }
            }
        }
    }
}

LK_T512 void lk_quant_gemm_q4k_avx512(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                                    const void *a, size_t as, float *y, size_t ys) {
    gkk_gemm(4, false, n, nrows, w, ws, ntok, a, as, y, ys);
}

LK_T512 void lk_quant_gemm_q5k_avx512(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                                    const void *a, size_t as, float *y, size_t ys) {
    gkk_gemm(5, false, n, nrows, w, ws, ntok, a, as, y, ys);
}

LK_T512 void lk_quant_gemm_q6k_avx512(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                                    const void *a, size_t as, float *y, size_t ys) {
    gkk_gemm(6, false, n, nrows, w, ws, ntok, a, as, y, ys);
}

LK_T512 void lk_quant_gemm_kr16_avx512(int kind, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                                     const void *a, size_t as, float *y, size_t ys) {
    gkk_gemm(kind, true, n, nrows, w, ws, ntok, a, as, y, ys);
}

/* ===================================================================== */
/* Repacked K-quants (Q4_K_R16, Q5_K_R16, Q6_K_R16) below the GEMM         */
/* ===================================================================== */

/* Decode and the few tokens below the GEMM's threshold: 16 rows in the
 * lanes, each super-block's vectors loaded as stored (lk_kr16_at), the
 * quants made unsigned bytes in registers (nibble splits; Q5_K's fifth and
 * Q6_K's top bits moved into place by one GF(2) affine map), vpdpbusd
 * against the token's 4 activation bytes broadcast, then gkk_tile's integer
 * steps and its float work per token: the GEMM's bits, which are the scalar
 * reference's. No panel and no activation buffer: the mins and Q6_K's -32
 * come from the activation's bsums read in place. */
enum { GKR_T = 4 };

/* Bit j of every byte of x to bit 4 (two: and bit j + 1 to bit 5), the
 * other bits zero: output bit i is the parity of the matrix's byte 7 - i
 * and the input byte. */
LK_T512 static LK_INL __m512i gkr_bits(__m512i x, int j, bool two) {
    uint64_t m = (uint64_t)(1u << j) << 24;
    if (two) m |= (uint64_t)(1u << (j + 1)) << 16;
    return _mm512_gf2p8affine_epi64_epi8(x, _mm512_set1_epi64((long long)m), 0);
}

/* The prefetch of a group's super-block: pf bytes ahead in the group's run */
static LK_INL void gkr_pf(const uint8_t *p, size_t len, size_t pf) {
    if (!pf) return;
    for (size_t o = 0; o < len; o += 64) __builtin_prefetch(p + pf + o, 0, 3);
}
/* Part j of S of the same lines, spread over the super-block's steps (Q4_K,
 * Q5_K: one matrix from memory, one core, prefetch spread / all at a
 * super-block's start: the Xeon 12.3-14.3 / 10.7-13.5 GB/s, Zen 5 30.3-32.5
 * / 27.6-31.9; Q6_K no better spread, so it keeps the one burst) */
static LK_INL void gkr_pf_part(const uint8_t *p, size_t len, size_t pf, int j, int S) {
    if (!pf) return;
    const size_t L = (len + 63) / 64;
    for (size_t l = L * (size_t)j / (size_t)S; l < L * (size_t)(j + 1) / (size_t)S; l++)
        __builtin_prefetch(p + pf + 64 * l, 0, 3);
}

/* Q4_K (kind 4) or Q5_K (kind 5): one whole group of 16 rows, T tokens */
LK_T512 static LK_INL void gkr_tile45(const int kind, const int T, int64_t nb, const uint8_t *g, const uint8_t *a,
                                    size_t as, float *y, size_t ys, size_t pf) {
    const size_t bb = kind == 4 ? LK_Q4K_BYTES : LK_Q5K_BYTES;
    const int vq = (kind == 4 ? LK_Q4K_QS : LK_Q5K_QS) / 4, vh = LK_Q5K_QH / 4;
    /* Q4_K: halves of sub-blocks (16 quants) per vpdpwssd; Q5_K quarters
     * (gkk_tile says why); independent chains of them for few tokens */
    const int NV = kind == 4 ? 4 : 2, IC = T <= 2 ? 4 : 2;
    const __m512i m0f = _mm512_set1_epi8(0x0F), m3f = _mm512_set1_epi32(63), mf = _mm512_set1_epi32(15),
                  m3 = _mm512_set1_epi32(3);
    __m512 acc[GKR_T];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nb; s++) {
        const uint8_t *p = g + 16 * bb * (size_t)s;
        const __m512i h0 = _mm512_loadu_si512(p), h1 = _mm512_loadu_si512(p + 64), h2 = _mm512_loadu_si512(p + 128),
                      h3 = _mm512_loadu_si512(p + 192);
        __m512i sc[8], mn[8];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            sc[j] = _mm512_and_si512(_mm512_srli_epi32(h1, 8 * j), m3f);
            mn[j] = _mm512_and_si512(_mm512_srli_epi32(h2, 8 * j), m3f);
            sc[j + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(h3, 8 * j), mf),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h1, 8 * j + 6), m3), 4));
            mn[j + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(h3, 8 * j + 4), mf),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h2, 8 * j + 6), m3), 4));
        }
        __m512i is[GKR_T][4];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
#pragma GCC unroll 4
            for (int c = 0; c < IC; c++) is[t][c] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) /* sub-blocks 2q (low nibbles) and 2q + 1 (high) */
#pragma GCC unroll 4
            for (int u = 0; u < 8 / NV; u++) {
                gkr_pf_part(p, 16 * bb, pf, q * (8 / NV) + u, 4 * (8 / NV));
                __m512i pl[GKR_T], ph[GKR_T];
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) pl[t] = ph[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int i = NV * u; i < NV * (u + 1); i++) { /* quants 4i..4i+3 of both */
                    const __m512i x = _mm512_loadu_si512(p + 64 * (vq + 8 * q + i));
                    __m512i lo = _mm512_and_si512(x, m0f), hi = gk_hi_nibble(x);
                    if (kind == 5) {
                        const __m512i qh = _mm512_loadu_si512(p + 64 * (vh + i));
                        lo = _mm512_or_si512(lo, gkr_bits(qh, 2 * q, false));
                        hi = _mm512_or_si512(hi, gkr_bits(qh, 2 * q + 1, false));
                    }
#pragma GCC unroll 4
                    for (int t = 0; t < T; t++) {
                        const uint8_t *aq = a + (size_t)t * as + (size_t)s * LK_Q8K_BYTES + LK_Q8K_QS + 64 * q + 4 * i;
                        pl[t] = _mm512_dpbusd_epi32(pl[t], lo, _mm512_set1_epi32(lk_ld_i32(aq)));
                        ph[t] = _mm512_dpbusd_epi32(ph[t], hi, _mm512_set1_epi32(lk_ld_i32(aq + 32)));
                    }
                }
                const int c = 2 * (u % (IC / 2));
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    is[t][c] = _mm512_dpwssd_epi32(is[t][c], pl[t], sc[2 * q]);
                    is[t][c + 1] = _mm512_dpwssd_epi32(is[t][c + 1], ph[t], sc[2 * q + 1]);
                }
            }
        const __m512 dd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h0)),
                     dm = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h0, 16)));
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const uint8_t *at = a + (size_t)t * as + (size_t)s * LK_Q8K_BYTES;
            /* sum_j m_j * (bsum_2j + bsum_2j+1): m_j in both i16 halves */
            __m512i im0 = _mm512_setzero_si512(), im1 = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int j = 0; j < 8; j += 2) {
                im0 = _mm512_dpwssd_epi32(im0, _mm512_or_si512(mn[j], _mm512_slli_epi32(mn[j], 16)),
                                          _mm512_set1_epi32(lk_ld_i32(at + LK_Q8K_BS + 4 * j)));
                im1 = _mm512_dpwssd_epi32(im1, _mm512_or_si512(mn[j + 1], _mm512_slli_epi32(mn[j + 1], 16)),
                                          _mm512_set1_epi32(lk_ld_i32(at + LK_Q8K_BS + 4 * j + 4)));
            }
            __m512i isum = _mm512_add_epi32(is[t][0], is[t][1]);
            if (IC == 4) isum = _mm512_add_epi32(isum, _mm512_add_epi32(is[t][2], is[t][3]));
            /* s += (d*da)*sumi - (dmin*da)*summ, as the scalar reference */
            const __m512 ad = _mm512_set1_ps(lk_ld_f32(at));
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(dd, ad), _mm512_cvtepi32_ps(isum));
            v = _mm512_sub_ps(v, _mm512_mul_ps(_mm512_mul_ps(dm, ad), _mm512_cvtepi32_ps(_mm512_add_epi32(im0, im1))));
            acc[t] = _mm512_add_ps(acc[t], v);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) _mm512_storeu_ps(y + (size_t)t * ys, acc[t]);
}

/* Q6_K: one whole group of 16 rows, T tokens. Group g of 16 quants (scale
 * sc_g) is vectors 4g..4g+3 of gk6_pack_body's layout, made here from the
 * stored ql and qh vectors: sum_g sc_g * (q+32).a_g - 32 * sum_g sc_g * bsum_g */
LK_T512 static LK_INL void gkr_tile6(const int T, int64_t nb, const uint8_t *g, const uint8_t *a, size_t as, float *y,
                                   size_t ys, size_t pf) {
    const __m512i m0f = _mm512_set1_epi8(0x0F);
    const __mmask32 odd = 0xAAAAAAAAu;
    __m512 acc[GKR_T];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nb; s++) {
        size_t qo, dof;
        lk_kr16_at(LK_Q6K_BYTES, s, nb, &qo, &dof);
        const uint8_t *p = g + qo;
        gkr_pf(g + 16 * LK_Q6K_BYTES * (size_t)s, 16 * LK_Q6K_BYTES, pf);
        __m512i sv[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) sv[c] = _mm512_loadu_si512(p + 64 * (LK_Q6K_SC / 4 + c));
        /* the -32 term: scales (sc_2i, sc_2i+1) as i16 pairs against the
         * bsum pairs */
        __m512i is[GKR_T][2];
        {
            __m512i c0[GKR_T], c1[GKR_T];
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) c0[t] = c1[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const __m512i lo = _mm512_srai_epi16(_mm512_slli_epi16(sv[c], 8), 8), hi = _mm512_srai_epi16(sv[c], 8);
                const __m512i sp0 = _mm512_mask_blend_epi16(odd, lo, _mm512_slli_epi32(hi, 16)),
                              sp1 = _mm512_mask_blend_epi16(odd, _mm512_srli_epi32(lo, 16), hi);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    const uint8_t *bs = a + (size_t)t * as + (size_t)s * LK_Q8K_BYTES + LK_Q8K_BS + 8 * c;
                    c0[t] = _mm512_dpwssd_epi32(c0[t], sp0, _mm512_set1_epi32(lk_ld_i32(bs)));
                    c1[t] = _mm512_dpwssd_epi32(c1[t], sp1, _mm512_set1_epi32(lk_ld_i32(bs + 4)));
                }
            }
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                is[t][0] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_add_epi32(c0[t], c1[t]), 5));
                is[t][1] = _mm512_setzero_si512();
            }
        }
#pragma GCC unroll 16
        for (int gi = 0; gi < 16; gi++) {
            const int h = gi / 8, k = (gi / 2) & 3, gl = gi & 1;
            const __m512i scg = _mm512_srai_epi32(_mm512_slli_epi32(sv[gi / 4], 24 - 8 * (gi % 4)), 24);
            __m512i ps[GKR_T];
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) ps[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int kk = 0; kk < 4; kk++) {
                const __m512i ql = _mm512_loadu_si512(p + 64 * (LK_Q6K_QL / 4 + 16 * h + 8 * (k & 1) + 4 * gl + kk));
                const __m512i qh = _mm512_loadu_si512(p + 64 * (LK_Q6K_QH / 4 + 8 * h + 4 * gl + kk));
                const __m512i hb = gkr_bits(qh, 2 * k, true); /* (ql & 0x0F) | hb: one vpternlogd */
                const __m512i q = k < 2 ? _mm512_ternarylogic_epi32(ql, hb, m0f, 0xEC)
                                        : _mm512_or_si512(gk_hi_nibble(ql), hb);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++)
                    ps[t] = _mm512_dpbusd_epi32(ps[t], q, _mm512_set1_epi32(lk_ld_i32(
                        a + (size_t)t * as + (size_t)s * LK_Q8K_BYTES + LK_Q8K_QS + 16 * gi + 4 * kk)));
            }
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) is[t][gl] = _mm512_add_epi32(is[t][gl], _mm512_mullo_epi32(ps[t], scg));
        }
        const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + dof)));
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const __m512 ad = _mm512_set1_ps(lk_ld_f32(a + (size_t)t * as + (size_t)s * LK_Q8K_BYTES));
            acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(dd, ad),
                                                         _mm512_cvtepi32_ps(_mm512_add_epi32(is[t][0], is[t][1]))));
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) _mm512_storeu_ps(y + (size_t)t * ys, acc[t]);
}

typedef void (*gkr_tile_fn)(int64_t nb, const uint8_t *g, const uint8_t *a, size_t as, float *y, size_t ys, size_t pf);
#define GKR_TILE(K, T)                                                                                          \
    LK_T512 static void gkr_tile_##K##_##T(int64_t nb, const uint8_t *g, const uint8_t *a, size_t as, float *y,   \
                                         size_t ys, size_t pf) {                                                \
        if (K == 6) gkr_tile6(T, nb, g, a, as, y, ys, pf);                                                      \
        else gkr_tile45(K, T, nb, g, a, as, y, ys, pf);                                                         \
    }
GKR_TILE(4, 1) GKR_TILE(4, 2) GKR_TILE(4, 3) GKR_TILE(4, 4)
GKR_TILE(5, 1) GKR_TILE(5, 2) GKR_TILE(5, 3) GKR_TILE(5, 4)
GKR_TILE(6, 1) GKR_TILE(6, 2) GKR_TILE(6, 3) GKR_TILE(6, 4)
static const gkr_tile_fn k_gkr_tiles[3][GKR_T] = {
    {gkr_tile_4_1, gkr_tile_4_2, gkr_tile_4_3, gkr_tile_4_4},
    {gkr_tile_5_1, gkr_tile_5_2, gkr_tile_5_3, gkr_tile_5_4},
    {gkr_tile_6_1, gkr_tile_6_2, gkr_tile_6_3, gkr_tile_6_4},
};

LK_T512 void lk_quant_kr16_rows_avx512(int kind, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                                     const void *a, size_t as, float *y, size_t ys) {
    LK_ASSERT(kind >= 4 && kind <= 6 && nrows % GK_ROWS == 0);
    const int64_t nb = n / LK_QK_K;
    const uint8_t *W = w, *A = a;
    /* a group is one run of bytes, read in order: d times 4 rows ahead, as
     * the repacked Q4_0's rows kernel */
    const size_t pf = (size_t)lk_quant_pf_tiles() * 4 * ws;
    /* the token tiles inside each group where the Q4_0 rows kernel takes
     * them there (rows_inner) */
    const bool inner = rows_inner((size_t)nrows * ws);
    for (int64_t t2 = 0; t2 < ntok; t2 += inner ? ntok : GKR_T)
        for (int64_t r0 = 0; r0 < nrows; r0 += GK_ROWS)
            for (int64_t t = t2; t < (inner ? ntok : LK_MIN(ntok, t2 + GKR_T)); t += GKR_T) {
                const int tt = (int)LK_MIN((int64_t)GKR_T, ntok - t);
                k_gkr_tiles[kind - 4][tt - 1](nb, W + (size_t)r0 * ws, A + (size_t)t * as, as,
                                              y + (size_t)t * ys + (size_t)r0, ys, t == 0 ? pf : 0);
            }
}
