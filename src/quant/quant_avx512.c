/* quant_avx512.c — AVX-512 kernels (F, BW, VL, DQ, VNNI, VBMI, GFNI; BF16
 * where present): lk_quant_matmul for every supported weight type. (The
 * AVX-512 Q8_0 and Q8_K activation quantisers are in quant_act.c.)
 *
 * Why they look the way they do. Decode reads every weight byte once per
 * token, so a kernel is good when it retires a block faster than memory
 * delivers it (~13-16 GB/s on one SPR core: a Q4_0 block of 18 bytes every
 * ~3 cycles), and on one core 4-bit formats are close to compute-bound. So:
 *  - Q4_0 and Q8_0 decode work on groups of 4 blocks per 512-bit register:
 *    two-table byte permutes (vpermt2b) gather the 4 blocks' quants out of
 *    their packed 18- or 34-byte records, two vpdpbusd do the products
 *    (64 or 128), more permutes gather the scales. Decode rearranges the
 *    activation row once per call and reduces 4 rows' sums into one vector
 *    before scaling. Both types' few tokens put 16 rows in the lanes
 *    (quant_gemm_avx512.c, lk_quant_q4q8_rows_avx512). That is for the
 *    file's layout: the model repacks Q4_0 and Q8_0 at load into 16-row
 *    groups (q4_0_r16, q8_0_r16: quant.h), whose decode and few tokens
 *    take the rows-in-lanes kernel with no transposes and (Q8_0) no
 *    permutes, and whose GEMM packing is loads and nibble splits.
 *  - K-quants: one super-block per step, per-sub-block scales applied in the
 *    integer domain with vpdpwssd (i16-sized dot x scale per lane), mins
 *    through the activation's bsums.
 *  - every decode tile streams 4 rows with software prefetch of the tiles
 *    ahead (pf_range); so do the register tiles of a few tokens (a batch of
 *    2-4 sequences decoding together is as memory-bound as one: without it
 *    two sequences decoded slower in total than one).
 *  - prefill: from a few tokens on (per type, quant_impl.h) the GEMM of
 *    quant_gemm_avx512.c for the quantised types (weights packed per call
 *    into L1 panels, reused by up to 128 tokens); below that, and for the
 *    float types always, R rows x T tokens register tiles (K-quants and
 *    floats here, Q4_0/Q8_0 rows in lanes), weights decoded once per tile
 *    and reused for T tokens.
 *
 * vpdpbusd multiplies unsigned by signed bytes, so weights are made unsigned
 * (Q4_0 nibbles are 0..15; Q8_0 is flipped to w+128; K-quant quants are
 * unsigned) and the offset is removed with a per-lane correction computed
 * from the activations only: sum (q-8)*a = sum q*a - 8*sum a. Integer sums
 * per block are exact in any order.
 *
 * Batch invariance: every type is batch invariant here. Q4_0, Q8_0 and
 * the K-quants give the scalar code's bits: decode (Q4_0, Q8_0:
 * q4q8_dec4_buf, each block's exact integer sum, then per row s = s + sum *
 * (d_w * d_a) block after block; K-quants: kq_tile, each
 * super-block's exact integer sums, then the scalar float work with 4 (row,
 * token) pairs in the lanes), a few tokens (lk_quant_q4q8_rows_avx512: 16
 * rows in the lanes; kq_tile) and the GEMMs from LK_GEMM_MIN_TOK tokens
 * (the same arithmetic, each K block continuing the row's sum from y) all
 * do the scalar reference's operations in its order; test_quant checks them
 * bit for bit against the scalar level. The float types take the register
 * tiles for every token count: 16 FMA lanes (BF16 with AVX512_BF16:
 * vdpbf16ps lanes) per (row, token), the row's chunks in order, added by
 * one tree at the end, whatever the tile shape (F32 rows of at most
 * FLS_MAX_N elements, small models' matrices: that tree for 16 sums at
 * once, hsum16). From FLA_MIN_TOK tokens
 * the tiles grow to 4 rows x 6 tokens and F16 / BF16-without-AVX512_BF16
 * activations are widened to fp32 once per call (exact, so the same bits),
 * which made F16 prefill faster than the rows-in-lanes float GEMM that
 * summed along the row from 16 tokens (another order than decode's, so a
 * server's output changed with its load; it is gone): 2048 x 5632 x 64 on
 * Zen 5, one thread, bench_quant: F16 97 -> 109-152 GFLOP/s, BF16 116 ->
 * 178, F32 117 -> 80. */
#include <immintrin.h>

#include "quant/simd_x86.h"

/* ===================================================================== */
/* Permute tables                                                          */
/* ===================================================================== */

/* Built once at fill time (the dispatch table's init), read-only after. */
static uint8_t k_q40_qs[64], k_q80_lo[64], k_q80_hi[64], k_q80_d[64], k_q40_d2[64], k_q80_d2[2][64];
/* Q4_K/Q5_K: the two sub-blocks whose scales lanes 0-7 and 8-15 of weight
 * vector k take (v0 = [sb0|sb2], v1 = [sb1|sb3], ...) */
static const int k_sub_pairs[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
/* Q4_K/Q5_K 4-row decode (kq_tile): the rows' 16-byte heads (d, dmin, the
 * 12 bytes of 6-bit scales and mins) in the 4 128-bit lanes of a vector;
 * vpshufb patterns that unpack them there (a: the low 6 or 4 bits, b: the
 * high nibbles of bytes 8..11, c: the top 2 bits of bytes 0..7, to bits 4-5;
 * lane byte j = sub-block j's scale, 8 + j its min), then vpermb patterns
 * that put row r's scales where k_sc_mins puts them (sc[r][k]), the rows'
 * mins as i16 (row r in 128-bit lane r: m) and their d, dmin as the first 8
 * words (d: vpermw) */
static uint8_t k_hd_a[64], k_hd_amask[64], k_hd_b[64], k_hd_c[64], k_hd_sc[4][4][64], k_hd_m[64];
static uint16_t k_hd_d[32];

static void build_tables(void) {
    for (int i = 0; i < 64; i++) {
        int k = i / 16, j = i % 16;
        /* Q4_0 group of 4 blocks (72 B) read as p[0..63] | p[8..71]: byte x
         * of the group is table index x (< 64) or x - 8 + 64. */
        int x = 18 * k + 2 + j;
        k_q40_qs[i] = (uint8_t)(x < 64 ? x : x + 56);
        /* 4-row decode: word 4k + r = scale of block k of row r, taken from
         * the first 64 bytes of rows r&~1 and r|1 (a two-row table) */
        int wd = i / 2, kb = wd / 4, rr = wd % 4;
        k_q40_d2[i] = (uint8_t)(i < 32 ? 64 * (rr & 1) + 18 * kb + (i & 1) : 0);
        /* Q8_0 4-row decode: the same words, blocks 0-1 from the first 64
         * bytes of rows r&~1 and r|1 ([0]), blocks 2-3 from the next 64
         * ([1]: block k's scale at 34k - 64) */
        k_q80_d2[0][i] = (uint8_t)(i < 32 && kb < 2 ? 64 * (rr & 1) + 34 * kb + (i & 1) : 0);
        k_q80_d2[1][i] = (uint8_t)(i < 32 && kb >= 2 ? 64 * (rr & 1) + 34 * kb - 64 + (i & 1) : 0);
        /* Q8_0 group (136 B): lo = quants 0..15 of each block from
         * p[0..127]; hi = quants 16..31 from p[8..135]. */
        k_q80_lo[i] = (uint8_t)(34 * k + 2 + j);
        k_q80_hi[i] = (uint8_t)(34 * k + 18 + j - 8);
        k_q80_d[i] = (uint8_t)(i < 32 ? 34 * (i / 8) + (i & 1) : 0);
        /* the heads: q[x] (scale byte x) at lane byte 4 + x */
        const int j2 = i % 16;
        k_hd_a[i] = (uint8_t)(j2 < 4 ? 4 + j2 : j2 < 8 ? 12 + (j2 - 4) : j2 < 12 ? 8 + (j2 - 8) : 0x80);
        k_hd_amask[i] = (uint8_t)(j2 < 4 || (j2 >= 8 && j2 < 12) ? 63 : j2 < 8 ? 0x0F : 0);
        k_hd_b[i] = (uint8_t)(j2 >= 12 ? j2 : 0x80);
        k_hd_c[i] = (uint8_t)(j2 >= 4 && j2 < 8 ? j2 : j2 >= 12 ? 8 + (j2 - 12) : 0x80);
        for (int r = 0; r < 4; r++)
            for (int kk = 0; kk < 4; kk++) k_hd_sc[r][kk][i] = (uint8_t)(16 * r + k_sub_pairs[kk][i / 4 < 8 ? 0 : 1]);
        k_hd_m[i] = (uint8_t)(16 * (i / 16) + 8 + (i % 16) / 2);
        if (i < 32) k_hd_d[i] = (uint16_t)(i < 4 ? 8 * i : i < 8 ? 8 * (i - 4) + 1 : 0);
    }
}

typedef struct {
    __m512i q40_qs, q80_lo, q80_hi, q80_d, m0f;
} lk_tabs;

LK_T512 static LK_INL lk_tabs tabs_load(void) {
    lk_tabs t;
    t.q40_qs = _mm512_loadu_si512(k_q40_qs);
    t.q80_lo = _mm512_loadu_si512(k_q80_lo);
    t.q80_hi = _mm512_loadu_si512(k_q80_hi);
    t.q80_d = _mm512_loadu_si512(k_q80_d);
    t.m0f = _mm512_set1_epi8(0x0F);
    return t;
}

LK_T512 static LK_INL float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

/* x >> 4 in every byte in one instruction (GF(2) affine map whose matrix
 * rows pick input bits 4..7 for output bits 0..3), instead of a 16-bit
 * shift and a mask: 4-bit formats spend a good share of their uops here. */
LK_T512 static LK_INL __m512i hi_nibble(__m512i x) {
    return _mm512_gf2p8affine_epi64_epi8(x, _mm512_set1_epi64(0x1020408000000000ll), 0);
}

/* Software prefetch for decode tiles. A tile reads R rows side by side, so R
 * short streams start cold at every tile: with 1-2 KiB rows the hardware
 * prefetchers never get ahead and each tile waits for memory at its start
 * (decode ran at 57 % of the read bandwidth on SPR for 2048-wide Q4_0 rows).
 * Rows are R*ws apart (`tile` bytes), so later tiles are further along the
 * same walk: each step prefetches, into L1, the bytes the next tile reads at
 * this offset, and into L2 those of the tile 3 ahead. One tile ahead took
 * Q4_0 decode to a median 79 % of the probe over 7 shapes x 2 runs on an idle
 * 16-core SPR; adding the L2 prefetch 3 tiles ahead to 87 % (2 or 4 tiles, or
 * L2 only, measured 84-86 %). Prefetching past the matrix is harmless:
 * prefetches do not fault. The distance is a tuning choice
 * (lk_quant_set_prefetch: d tiles ahead into L1, d + 2 into L2; d = 1 is
 * the above, 0 none). */
static LK_INL void pf_range(const uint8_t *p, size_t tile, size_t len) {
    const size_t d = (size_t)lk_quant_pf_tiles();
    if (d == 0) return;
    for (size_t o = 0; o < len; o += 64) {
        _mm_prefetch((const char *)p + d * tile + o, _MM_HINT_T0);
        _mm_prefetch((const char *)p + (d + 2) * tile + o, _MM_HINT_T1);
    }
}

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

/* ---- Q4_0 and Q8_0 decode (one token) ------------------------------------
 * The activation row is rearranged once per call into a stack buffer (per
 * group of 4 blocks: quants lo/hi in the weights' lane order, scales as 16
 * floats, each block's offset correction -8 * sum(a), for Q8_0's flipped
 * weights -128 * sum(a)), so its permutes are paid once for all rows
 * instead of once per 4 rows. Long rows go in column chunks of PG_CHUNK
 * groups (24 KiB of buffer), each row's sum continued from y chunk after
 * chunk. */
enum { PG_LO = 0, PG_HI = 64, PG_D = 128, PG_NEGR = 192, PG_BYTES = 256, PG_CHUNK = 96 };

LK_T512 static void q80_prep(const lk_tabs *tb, const uint8_t *a, int64_t gn, uint8_t *buf, bool is_q8) {
    const __m512i kofs = _mm512_set1_epi8(is_q8 ? (char)0x80 : 8);
    for (int64_t g = 0; g < gn; g++, buf += PG_BYTES) {
        q8grp A = q80_load(tb, a + (size_t)g * 4 * LK_Q80_BYTES);
        __m512i c = q80_negsum(&A, kofs);
        _mm512_store_si512(buf + PG_LO, A.lo);
        _mm512_store_si512(buf + PG_HI, A.hi);
        _mm512_store_ps(buf + PG_D, A.d);
        /* per block: the 4 lanes' total in each of them */
        c = _mm512_add_epi32(c, _mm512_shuffle_epi32(c, _MM_PERM_BADC));
        c = _mm512_add_epi32(c, _mm512_shuffle_epi32(c, _MM_PERM_CDAB));
        _mm512_store_si512(buf + PG_NEGR, c);
    }
}

/* Q4_0 or Q8_0, 4 rows: instead of scaling each row's 16 partial sums
 * separately (a scale permute + fp16 conversion + multiply per row), the 4
 * rows' integer sums are transposed and added so that lane 4k + r holds row
 * r's exact sum for block k; one conversion and one multiply then serve all
 * 4 rows, and one fp16 conversion gives all 16 (row, block) scales. Each
 * row's products are then added onto its sum (acc, lane r, starting from y)
 * block after block, k = 0..3 in the 128-bit quarters of the vector: the
 * scalar reference's arithmetic, and so the bits of the register tiles and
 * the GEMM (batch invariance). Decode of 4-bit weights on one core is close
 * to compute-bound, so uops per byte matter. Q8_0's group of 4 blocks is 136
 * bytes: quants 0..15 of each block come out of bytes 0..127 and 16..31 out
 * of bytes 8..135 (one two-table permute each, then flipped to w + 128),
 * and the scales out of two two-row tables per row pair. (Q8_0 decode took
 * the rows-in-lanes kernel before, whose in-register transposes and scale
 * gathers held it to 35 GB/s on a Zen 5 core with the weights in cache.) */
LK_T512 static LK_INL void q4q8_dec4_buf(const bool is_q8, const lk_tabs *tb, const uint8_t *buf, int64_t gn,
                                         const uint8_t *w, size_t ws, float *out) {
    const size_t gb = 4 * (is_q8 ? LK_Q80_BYTES : LK_Q40_BYTES);
    const __m512i d2 = _mm512_loadu_si512(k_q40_d2);
    const __m512i e0 = _mm512_loadu_si512(k_q80_d2[0]), e1 = _mm512_loadu_si512(k_q80_d2[1]);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m128 acc = _mm_loadu_ps(out);
    for (int64_t g = 0; g < gn; g++, buf += PG_BYTES) {
        const uint8_t *p0 = w + (size_t)g * gb;
        __m512i alo = _mm512_load_si512(buf + PG_LO), ahi = _mm512_load_si512(buf + PG_HI);
        __m512i S[4], L0[4], L1[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const uint8_t *p = p0 + r * ws;
            pf_range(p, 4 * ws, gb);
            L0[r] = _mm512_loadu_si512(p);
            if (is_q8) {
                L1[r] = _mm512_loadu_si512(p + 64);
                __m512i lo = _mm512_permutex2var_epi8(L0[r], tb->q80_lo, L1[r]);
                __m512i hi = _mm512_permutex2var_epi8(_mm512_loadu_si512(p + 8), tb->q80_hi,
                                                      _mm512_loadu_si512(p + 72));
                S[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(lo, flip), alo),
                                           _mm512_xor_si512(hi, flip), ahi);
            } else {
                __m512i q = _mm512_permutex2var_epi8(L0[r], tb->q40_qs, _mm512_loadu_si512(p + 8));
                __m512i lo = _mm512_and_si512(q, tb->m0f);
                S[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, alo), hi_nibble(q), ahi);
            }
        }
        /* lane 4k + r <- sum of row r's 4 lanes of block k */
        __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(S[0], S[1]), _mm512_unpackhi_epi32(S[0], S[1]));
        __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(S[2], S[3]), _mm512_unpackhi_epi32(S[2], S[3]));
        __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
        __m512i dw;
        if (is_q8) {
            /* word 4k + r: rows 0-1 / 2-3 (bytes i % 8 < 4 / >= 4), blocks
             * 0-1 / 2-3 (bytes 0-15 / 16-31) */
            dw = _mm512_ternarylogic_epi32(_mm512_maskz_permutex2var_epi8(0x0F0Full, L0[0], e0, L0[1]),
                                           _mm512_maskz_permutex2var_epi8(0xF0F0ull, L0[2], e0, L0[3]),
                                           _mm512_maskz_permutex2var_epi8(0x0F0F0000ull, L1[0], e1, L1[1]), 0xFE);
            dw = _mm512_or_si512(dw, _mm512_maskz_permutex2var_epi8(0xF0F00000ull, L1[2], e1, L1[3]));
        } else {
            dw = _mm512_mask_blend_epi16(0xCCCCu, _mm512_permutex2var_epi8(L0[0], d2, L0[1]),
                                         _mm512_permutex2var_epi8(L0[2], d2, L0[3]));
        }
        __m512 sc = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(dw)), _mm512_load_ps(buf + PG_D));
        u = _mm512_add_epi32(u, _mm512_load_si512(buf + PG_NEGR));
        /* row r's block k at lane 4k + r: added onto lane r of acc, k in order */
        const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(u), sc);
        acc = _mm_add_ps(acc, _mm512_castps512_ps128(p));
        acc = _mm_add_ps(acc, _mm512_extractf32x4_ps(p, 1));
        acc = _mm_add_ps(acc, _mm512_extractf32x4_ps(p, 2));
        acc = _mm_add_ps(acc, _mm512_extractf32x4_ps(p, 3));
    }
    _mm_storeu_ps(out, acc);
}

/* Q4_0 / Q8_0 decode: 4-row tiles over column chunks of the prepared
 * activation, each row's sum continued from y chunk after chunk; the blocks
 * past the last group of 4, and the rows past the last 4-row tile, continue
 * it in the same order. */
LK_T512 static LK_INL void q4q8_decode(const bool is_q8, int64_t n, int64_t nrows, const uint8_t *w, size_t ws,
                                       const uint8_t *a, float *y) {
    const lk_tabs tb = tabs_load();
    const size_t bb = is_q8 ? LK_Q80_BYTES : LK_Q40_BYTES;
    const int64_t nb = n / LK_QK, ng = nb / 4, nr4 = nrows & ~(int64_t)3;
    _Alignas(64) uint8_t buf[PG_CHUNK * PG_BYTES];
    for (int64_t r = 0; r < nr4; r++) y[r] = 0;
    for (int64_t g0 = 0; g0 < ng; g0 += PG_CHUNK) {
        int64_t gn = LK_MIN((int64_t)PG_CHUNK, ng - g0);
        q80_prep(&tb, a + (size_t)g0 * 4 * LK_Q80_BYTES, gn, buf, is_q8);
        const uint8_t *wc = w + (size_t)g0 * 4 * bb;
        for (int64_t r = 0; r + 4 <= nr4; r += 4) q4q8_dec4_buf(is_q8, &tb, buf, gn, wc + (size_t)r * ws, ws, y + r);
    }
    for (int64_t r = 0; r < nr4 && nb > ng * 4; r++) {
        const uint8_t *wr = w + (size_t)r * ws;
        float s = y[r];
        for (int64_t b = ng * 4; b < nb; b++) {
            const uint8_t *wb = wr + (size_t)b * bb, *ab = a + (size_t)b * LK_Q80_BYTES;
            const int8_t *q8 = (const int8_t *)(ab + 2);
            int sumi = 0;
            if (is_q8)
                sumi = lk_q8_dot32((const int8_t *)(wb + 2), q8);
            else
                for (int j = 0; j < 16; j++) sumi += ((wb[2 + j] & 0xF) - 8) * q8[j] + ((wb[2 + j] >> 4) - 8) * q8[j + 16];
            s += (float)sumi * (lk_ld_h(wb) * lk_ld_h(ab));
        }
        y[r] = s;
    }
    if (nr4 < nrows) lk_quant_q4q8_rows_avx512(is_q8 ? LK_FMT_Q80 : LK_FMT_Q40, n, nrows - nr4, w + (size_t)nr4 * ws, ws, 1, a, 0, NULL,
                                                  y + nr4, 0);
}

LK_T512 static void q40_decode(int64_t n, int64_t nrows, const uint8_t *w, size_t ws, const uint8_t *a, float *y) {
    q4q8_decode(false, n, nrows, w, ws, a, y);
}

LK_T512 static void q80_decode(int64_t n, int64_t nrows, const uint8_t *w, size_t ws, const uint8_t *a, float *y) {
    q4q8_decode(true, n, nrows, w, ws, a, y);
}

/* ===================================================================== */
/* K-quants x Q8_K                                                         */
/* ===================================================================== */

/* A Q8_K super-block for Q4_K/Q5_K: the 8 sub-blocks of 32 rearranged into
 * the order the weights' nibbles come in (v0 = [sb0|sb2], v1 = [sb1|sb3],
 * v2 = [sb4|sb6], v3 = [sb5|sb7]), sums of each sub-block (8 x i16) for the
 * min term, and the scale. For Q6_K the natural order (v_k = elements
 * 64k..64k+63) and the 16 bsums as they are. */
typedef struct { __m512i v[4]; __m256i bs; __m128 d; } q8kgrp;

LK_T512 static LK_INL q8kgrp q8k_load_4k(const uint8_t *p) {
    __m512i l0 = _mm512_loadu_si512(p + 4), l1 = _mm512_loadu_si512(p + 68);
    __m512i l2 = _mm512_loadu_si512(p + 132), l3 = _mm512_loadu_si512(p + 196);
    q8kgrp g;
    g.v[0] = _mm512_shuffle_i64x2(l0, l1, 0x44);
    g.v[1] = _mm512_shuffle_i64x2(l0, l1, 0xEE);
    g.v[2] = _mm512_shuffle_i64x2(l2, l3, 0x44);
    g.v[3] = _mm512_shuffle_i64x2(l2, l3, 0xEE);
    __m256i b = _mm256_loadu_si256((const __m256i *)(p + LK_Q8K_BS));
    /* pairs of 16-sums -> 8 sums of 32 (|x| <= 32*127, fits i16) */
    g.bs = _mm256_castsi128_si256(_mm_hadd_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    g.d = _mm_set1_ps(lk_ld_f32(p));
    return g;
}

LK_T512 static LK_INL q8kgrp q8k_load_6k(const uint8_t *p) {
    q8kgrp g;
    #pragma GCC unroll 4
    for (int k = 0; k < 4; k++) g.v[k] = _mm512_loadu_si512(p + 4 + 64 * k);
    g.bs = _mm256_loadu_si256((const __m256i *)(p + LK_Q8K_BS));
    g.d = _mm_set1_ps(lk_ld_f32(p));
    return g;
}

/* A decoded weight super-block: unsigned quants v[4] in the activation
 * group's order, per-lane scales sc[4] as i32 lanes whose high 16 bits are
 * zero (so vpdpwssd multiplies each lane's i16-sized dot by its scale),
 * mins (Q4_K/Q5_K: 8 x i16) or scales as i16 (Q6_K: 16 x i16) for the
 * activation-sum term, and [d, dmin] as floats. */
typedef struct { __m512i v[4], sc[4]; __m256i m; __m128 dd; } kwgrp;

/* Unpacks the 12-byte 6-bit scales/mins of Q4_K/Q5_K: bytes of *sc and *m
 * are sub-blocks 0..7 (the format's packing, see lk_k_scale_min). */
static LK_INL void k_scales_unpack(const uint8_t *q, uint64_t *sc, uint64_t *m) {
    uint32_t w0, w1, w2;
    memcpy(&w0, q, 4); memcpy(&w1, q + 4, 4); memcpy(&w2, q + 8, 4);
    uint32_t sc_lo = w0 & 0x3f3f3f3fu, m_lo = w1 & 0x3f3f3f3fu;
    uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | ((w0 >> 6) & 0x03030303u) << 4;
    uint32_t m_hi = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 6) & 0x03030303u) << 4;
    *sc = sc_lo | (uint64_t)sc_hi << 32;
    *m = m_lo | (uint64_t)m_hi << 32;
}

typedef struct { __m512i idx4k[4], idx6k[4], m0f, m30, q6h01, q6h23, q5h[4]; } ktabs;

LK_T512 static LK_INL ktabs ktabs_load(void) {
    ktabs t;
    #pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        t.idx4k[k] = _mm512_mask_mov_epi32(_mm512_set1_epi32(k_sub_pairs[k][0]), 0xFF00,
                                           _mm512_set1_epi32(k_sub_pairs[k][1]));
        /* Q6_K: v_k lanes 4i..4i+3 are sub-block 4k+i (16 elements each) */
        t.idx6k[k] = _mm512_set_epi32(4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 2, 4 * k + 2,
                                      4 * k + 2, 4 * k + 2, 4 * k + 1, 4 * k + 1, 4 * k + 1, 4 * k + 1,
                                      4 * k, 4 * k, 4 * k, 4 * k);
    }
    t.m0f = _mm512_set1_epi8(0x0F);
    t.m30 = _mm512_set1_epi8(0x30);
    /* Q6_K: qh's 2-bit field f (bits 2f, 2f+1) to bits 4, 5 of each byte:
     * output bit i takes the parity of the input AND matrix byte 7 - i */
#define Q6H(f) ((long long)((1ull << (2 * (f))) << 24 | (1ull << (2 * (f) + 1)) << 16))
    t.q6h01 = _mm512_setr_epi64(Q6H(0), Q6H(0), Q6H(0), Q6H(0), Q6H(1), Q6H(1), Q6H(1), Q6H(1));
    t.q6h23 = _mm512_setr_epi64(Q6H(2), Q6H(2), Q6H(2), Q6H(2), Q6H(3), Q6H(3), Q6H(3), Q6H(3));
#undef Q6H
    /* Q5_K: bit j of each qh byte to bit 4 (output bit 4 is the parity of
     * matrix byte 3 and the input), j = the sub-block of vector k's lower
     * and upper half (q5k_quants) */
#define Q5H(j) ((long long)((1ull << (j)) << 24))
    #pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const int lo = 4 * (k / 2) + k % 2, hi = lo + 2;
        t.q5h[k] = _mm512_setr_epi64(Q5H(lo), Q5H(lo), Q5H(lo), Q5H(lo), Q5H(hi), Q5H(hi), Q5H(hi), Q5H(hi));
    }
#undef Q5H
    return t;
}

/* ternary logic 0xEC: (A & C) | B */
#define LK_AND_OR(a, b, c) _mm512_ternarylogic_epi32(a, b, c, 0xEC)

LK_T512 static LK_INL void k_sc_mins(const ktabs *kt, const uint8_t *scales, kwgrp *w) {
    uint64_t sc, m;
    k_scales_unpack(scales, &sc, &m);
    __m512i s32 = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc));
    #pragma GCC unroll 4
    for (int k = 0; k < 4; k++) w->sc[k] = _mm512_permutexvar_epi32(kt->idx4k[k], s32);
    w->m = _mm256_castsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m)));
}

/* The quants of a Q4_K super-block (v[] of a kwgrp). */
LK_T512 static LK_INL void q4k_quants(const ktabs *kt, const uint8_t *p, kwgrp *w) {
    __m512i q0 = _mm512_loadu_si512(p + LK_Q4K_QS), q1 = _mm512_loadu_si512(p + LK_Q4K_QS + 64);
    w->v[0] = _mm512_and_si512(q0, kt->m0f);
    w->v[1] = hi_nibble(q0);
    w->v[2] = _mm512_and_si512(q1, kt->m0f);
    w->v[3] = hi_nibble(q1);
}

LK_T512 static LK_INL kwgrp q4k_wload(const ktabs *kt, const uint8_t *p) {
    kwgrp w;
    q4k_quants(kt, p, &w);
    k_sc_mins(kt, p + LK_Q4K_SC, &w);
    w.dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(lk_ld_u16(p) | (uint32_t)lk_ld_u16(p + 2) << 16)));
    return w;
}

/* The quants of a Q5_K super-block (v[] of a kwgrp). */
LK_T512 static LK_INL void q5k_quants(const ktabs *kt, const uint8_t *p, kwgrp *w) {
    __m512i q0 = _mm512_loadu_si512(p + LK_Q5K_QS), q1 = _mm512_loadu_si512(p + LK_Q5K_QS + 64);
    __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + LK_Q5K_QH)));
    /* The 5th bit of sub-block j is bit j of qh[l]: vector k holds
     * sub-blocks 4 (k / 2) + k % 2 and that + 2 in its halves, whose bits
     * one affine map per vector moves to bit 4 (the rest zero) */
    w->v[0] = LK_AND_OR(q0, _mm512_gf2p8affine_epi64_epi8(qh, kt->q5h[0], 0), kt->m0f);
    w->v[1] = LK_AND_OR(_mm512_srli_epi16(q0, 4), _mm512_gf2p8affine_epi64_epi8(qh, kt->q5h[1], 0), kt->m0f);
    w->v[2] = LK_AND_OR(q1, _mm512_gf2p8affine_epi64_epi8(qh, kt->q5h[2], 0), kt->m0f);
    w->v[3] = LK_AND_OR(_mm512_srli_epi16(q1, 4), _mm512_gf2p8affine_epi64_epi8(qh, kt->q5h[3], 0), kt->m0f);
}

LK_T512 static LK_INL kwgrp q5k_wload(const ktabs *kt, const uint8_t *p) {
    kwgrp w;
    q5k_quants(kt, p, &w);
    k_sc_mins(kt, p + LK_Q5K_SC, &w);
    w.dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(lk_ld_u16(p) | (uint32_t)lk_ld_u16(p + 2) << 16)));
    return w;
}

LK_T512 static LK_INL kwgrp q6k_wload(const ktabs *kt, const uint8_t *p) {
    kwgrp w;
    /* half h: ql[64h..] low nibbles = elements [0..63] of the half, high
     * nibbles [64..127]; the top 2 bits of element 32k+l are bits 2k..2k+1
     * of qh[32h+l], moved to bits 4-5 (the rest zero) by one GF(2) affine
     * map per vector whose matrix differs between its 256-bit halves */
    #pragma GCC unroll 4
    for (int h = 0; h < 2; h++) {
        __m512i ql = _mm512_loadu_si512(p + LK_Q6K_QL + 64 * h);
        __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + LK_Q6K_QH + 32 * h)));
        w.v[2 * h] = LK_AND_OR(ql, _mm512_gf2p8affine_epi64_epi8(qh, kt->q6h01, 0), kt->m0f);
        w.v[2 * h + 1] = _mm512_or_si512(hi_nibble(ql), _mm512_gf2p8affine_epi64_epi8(qh, kt->q6h23, 0));
    }
    __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + LK_Q6K_SC)));
    __m512i s32 = _mm512_cvtepu16_epi32(sc16); /* i16 scale in the low half, zero high half */
    #pragma GCC unroll 4
    for (int k = 0; k < 4; k++) w.sc[k] = _mm512_permutexvar_epi32(kt->idx6k[k], s32);
    w.m = sc16;
    /* F16C, not the portable converter: this runs once per row and block */
    w.dd = _mm_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(lk_ld_u16(p + LK_Q6K_D))));
    return w;
}

/* The exact totals of four vectors' 16 i32 lanes, in lanes 0..3 (integer
 * adds: any order gives them). */
LK_T512 static LK_INL __m128i red4_i32(__m512i s0, __m512i s1, __m512i s2, __m512i s3) {
    const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(s0, s1), _mm512_unpackhi_epi32(s0, s1));
    const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(s2, s3), _mm512_unpackhi_epi32(s2, s3));
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
    const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* R rows x T tokens (R * T <= 4: 1 x 1..4 for a few tokens, 4 x 1 for
 * decode), in the scalar reference's arithmetic (dot_k45 / dot_q6_k in
 * quant.c), as the AVX2 tiles and the GEMM of quant_gemm_avx512.c: per
 * super-block each (row, token) pair's exact integer sums (sum_j sc_j *
 * (q . a)_j over 16 i32 lanes, Q6_K's -32 offset folded in; Q4_K/Q5_K's
 * sum_j m_j * bsum_j), then s = s + ((d*da)*(float)sumi - (dmin*da)*
 * (float)summ) (Q6_K: s = s + (d*da)*(float)sumi), super-block after
 * super-block. The pairs sit in 4 float lanes, so the conversions, the
 * multiplies and the add serve four pairs. Decode (T = 1): the activation
 * super-block is prepared once and each row's weights decoded and used at
 * once; a few tokens (R = 1): the row's weights are decoded once and used
 * for T tokens. */
LK_T512 static LK_INL void kq_tile(const int R, const int T, const int kind, int64_t n,
                                   const uint8_t *w, size_t ws, const uint8_t *a, size_t as,
                                   float *y, size_t ys) {
    const ktabs kt = ktabs_load();
    const size_t bb = kind == 4 ? LK_Q4K_BYTES : kind == 5 ? LK_Q5K_BYTES : LK_Q6K_BYTES;
    const int64_t nb = n / LK_QK_K;
    /* Q4_K/Q5_K decode: the rows' scales and min terms taken 4 rows at once */
    const bool dec4 = T == 1 && R == 4 && kind != 6;
    __m128 s = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        __m512i S[4];
        __m128i M[4];
        float dw[4] = {0, 0, 0, 0}, dm[4] = {0, 0, 0, 0}, da[4] = {0, 0, 0, 0};
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) S[p] = _mm512_setzero_si512(), M[p] = _mm_setzero_si128();
        q8kgrp A1;
        if (T == 1) A1 = kind == 6 ? q8k_load_6k(a + (size_t)i * LK_Q8K_BYTES) : q8k_load_4k(a + (size_t)i * LK_Q8K_BYTES);
        /* decode: the 4 rows' scales and mins unpacked at once (k_hd_*) */
        __m512i hs = _mm512_setzero_si512(), SM = _mm512_setzero_si512();
        if (dec4) {
            const uint8_t *w0 = w + (size_t)i * bb;
            hs = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)w0));
            hs = _mm512_inserti32x4(hs, _mm_loadu_si128((const __m128i *)(w0 + ws)), 1);
            hs = _mm512_inserti32x4(hs, _mm_loadu_si128((const __m128i *)(w0 + 2 * ws)), 2);
            hs = _mm512_inserti32x4(hs, _mm_loadu_si128((const __m128i *)(w0 + 3 * ws)), 3);
            const __m512i lo = _mm512_and_si512(_mm512_shuffle_epi8(hs, _mm512_loadu_si512(k_hd_a)),
                                                _mm512_loadu_si512(k_hd_amask));
            const __m512i hn = _mm512_srli_epi16(_mm512_shuffle_epi8(hs, _mm512_loadu_si512(k_hd_b)), 4);
            const __m512i top = _mm512_srli_epi16(_mm512_shuffle_epi8(hs, _mm512_loadu_si512(k_hd_c)), 2);
            /* lo | (hn & 0x0F) | (top & 0x30) */
            SM = _mm512_or_si512(lo, _mm512_ternarylogic_epi32(_mm512_and_si512(hn, kt.m0f), top, kt.m30, 0xF8));
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *wp = w + r * ws + (size_t)i * bb;
            pf_range(wp, R * ws, bb);
            kwgrp W;
            if (dec4) {
                if (kind == 4) q4k_quants(&kt, wp, &W);
                else q5k_quants(&kt, wp, &W);
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++)
                    W.sc[k] = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, _mm512_loadu_si512(k_hd_sc[r][k]), SM);
            } else {
                W = kind == 4 ? q4k_wload(&kt, wp) : kind == 5 ? q5k_wload(&kt, wp) : q6k_wload(&kt, wp);
            }
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                const int p = r * T + t;
                q8kgrp A = A1;
                if (T > 1) {
                    const uint8_t *ap = a + t * as + (size_t)i * LK_Q8K_BYTES;
                    A = kind == 6 ? q8k_load_6k(ap) : q8k_load_4k(ap);
                }
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++)
                    S[p] = _mm512_dpwssd_epi32(S[p], _mm512_dpbusd_epi32(_mm512_setzero_si512(), W.v[k], A.v[k]), W.sc[k]);
                if (kind == 6)
                    S[p] = _mm512_sub_epi32(S[p], _mm512_zextsi256_si512(_mm256_slli_epi32(_mm256_madd_epi16(W.m, A.bs), 5)));
                else if (!dec4)
                    M[p] = _mm_madd_epi16(_mm256_castsi256_si128(W.m), _mm256_castsi256_si128(A.bs));
                if (!dec4) {
                    dw[p] = _mm_cvtss_f32(W.dd);
                    dm[p] = _mm_cvtss_f32(_mm_movehdup_ps(W.dd));
                    da[p] = _mm_cvtss_f32(A.d);
                }
            }
        }
        const __m128i si = red4_i32(S[0], S[1], S[2], S[3]);
        if (dec4) {
            /* decode: the 4 rows' d and dmin in one conversion, their min
             * terms in one vpmaddwd (row r's 8 mins in 128-bit lane r, times
             * the 8 sub-block sums), each lane's total by two swaps */
            const __m256 dd = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi16(_mm512_loadu_si512(k_hd_d), hs)));
            const __m128 d4 = _mm256_castps256_ps128(dd), m4 = _mm256_extractf128_ps(dd, 1);
            const __m512i mw = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, _mm512_loadu_si512(k_hd_m), SM);
            __m512i mi = _mm512_madd_epi16(mw, _mm512_broadcast_i32x4(_mm256_castsi256_si128(A1.bs)));
            mi = _mm512_add_epi32(mi, _mm512_shuffle_epi32(mi, _MM_PERM_BADC));
            mi = _mm512_add_epi32(mi, _mm512_shuffle_epi32(mi, _MM_PERM_CDAB));
            const __m128i sm = _mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), mi));
            s = lk_kq_fin4(false, si, sm, d4, m4, _mm_broadcastss_ps(A1.d), s);
        } else {
            const __m128i sm = kind == 6 ? _mm_setzero_si128()
                                         : _mm_hadd_epi32(_mm_hadd_epi32(M[0], M[1]), _mm_hadd_epi32(M[2], M[3]));
            s = lk_kq_fin4(kind == 6, si, sm, _mm_setr_ps(dw[0], dw[1], dw[2], dw[3]),
                           _mm_setr_ps(dm[0], dm[1], dm[2], dm[3]), _mm_setr_ps(da[0], da[1], da[2], da[3]), s);
        }
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

/* Loads 16 elements (fewer under `m`) of a float-type row as fp32. */
LK_T512 static LK_INL __m512 fl_load(const int kind, const uint8_t *p, __mmask16 m) {
    if (kind == 32) return _mm512_maskz_loadu_ps(m, p);
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if (kind == 16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 8 fp16 (kind 16) or bf16 (kind 0) elements as fp32 */
LK_T512 static LK_INL __m256 fl_load8(const int kind, const uint8_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (kind == 16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 16 fp16 (kind 16) or bf16 (kind 0) elements in a register as fp32 */
LK_T512 static LK_INL __m512 fl_wide(const int kind, __m256i h) {
    if (kind == 16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Weights and activations of the same float type: FMA in fp32 (products of
 * fp16/bf16 values are exact in fp32). 2 x 16 elements per step so each
 * accumulator chain has room; the tail goes through masked loads. F16
 * (and BF16 without AVX512_BF16) decode, one token, takes one of two
 * loops, the same fused multiply-adds in the same order either way (so
 * the same bits), chosen per CPU (`roll`: lk_quant_dec_roll, the tuner's
 * droll):
 *  - unrolled: each 16-lane accumulator as two 8-lane halves fed 16 bytes
 *    at a time, the four rows' loads and conversions scheduled together,
 *    prefetches by pf_range: on the Xeon device host 100-104 % of the
 *    probe at one thread (it had beaten zmm conversions of 32-byte loads
 *    on the Zen 5 too);
 *  - rolled: each row's 32 elements of a step in one 64-byte load widened
 *    in registers, the rows one after another, one prefetch a row and
 *    step at the tuner's distance: on the Zen 5 (2026-12-04, TinyLlama
 *    F16 `bench -t 1`, rounds alternating) 11.0-13.1 tok/s against
 *    8.2-11.0 unrolled, on the Xeon 6.8 against 7.5 (BENCHMARKS.md,
 *    sixteenth session). */
LK_T512 static LK_INL void fl_tile(const int R, const int T, const int kind, const bool roll, int64_t n,
                                   const uint8_t *w, size_t ws, const uint8_t *a, size_t as,
                                   float *y, size_t ys) {
    const int es = kind == 32 ? 4 : 2;
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    int64_t i = 0;
    if (T == 1 && kind != 32 && roll) {
        /* decode, rolled: each row's 32 elements of a step in one 64-byte
         * load, widened in registers; the activations' likewise */
        const size_t pd = (size_t)lk_quant_pf_tiles() * R * ws;
        for (; i + 32 <= n; i += 32) {
            const __m512i av = _mm512_loadu_si512(a + i * 2);
            const __m512 a0 = fl_wide(kind, _mm512_castsi512_si256(av)),
                         a1 = fl_wide(kind, _mm512_extracti64x4_epi64(av, 1));
#pragma GCC unroll 1
            for (int r = 0; r < R; r++) {
                const uint8_t *wr = w + r * ws + i * 2;
                if (pd) _mm_prefetch((const char *)wr + pd, _MM_HINT_T0);
                const __m512i wv = _mm512_loadu_si512(wr);
                acc[r][0] = _mm512_fmadd_ps(fl_wide(kind, _mm512_castsi512_si256(wv)), a0, acc[r][0]);
                acc[r][0] = _mm512_fmadd_ps(fl_wide(kind, _mm512_extracti64x4_epi64(wv, 1)), a1, acc[r][0]);
            }
        }
    } else if (T == 1 && kind != 32) {
        /* decode, unrolled: each 16-lane accumulator as two 8-lane halves
         * (lane-wise the same fused multiply-adds) */
        __m256 lo[4], hi[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) lo[r] = _mm256_setzero_ps(), hi[r] = _mm256_setzero_ps();
        for (; i + 16 <= n; i += 16) {
            const __m256 alo = fl_load8(kind, a + i * 2), ahi = fl_load8(kind, a + i * 2 + 16);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const uint8_t *wr = w + r * ws + i * 2;
                if ((i & 31) == 0) pf_range(wr, R * ws, 64);
                lo[r] = _mm256_fmadd_ps(fl_load8(kind, wr), alo, lo[r]);
                hi[r] = _mm256_fmadd_ps(fl_load8(kind, wr + 16), ahi, hi[r]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[r][0] = _mm512_insertf32x8(_mm512_castps256_ps512(lo[r]), hi[r], 1);
    }
    for (; i + 32 <= n; i += 32) {
        __m512 w0[4], w1[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            pf_range(w + r * ws + i * es, R * ws, 32 * es);
            w0[r] = fl_load(kind, w + r * ws + i * es, 0xFFFF);
            w1[r] = fl_load(kind, w + r * ws + (i + 16) * es, 0xFFFF);
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            __m512 a0 = fl_load(kind, a + t * as + i * es, 0xFFFF);
            __m512 a1 = fl_load(kind, a + t * as + (i + 16) * es, 0xFFFF);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                acc[r][t] = _mm512_fmadd_ps(w0[r], a0, acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(w1[r], a1, acc[r][t]);
            }
        }
    }
    for (; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            __m512 a0 = fl_load(kind, a + t * as + i * es, m);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                acc[r][t] = _mm512_fmadd_ps(fl_load(kind, w + r * ws + i * es, m), a0, acc[r][t]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) y[t * ys + r] = hsum(acc[r][t]);
}

/* ---- prefill: activations as fp32, tiles of 4 rows x 6 tokens ---------- */

/* One 16-element step of every (row, token) accumulator at element i:
 * loaded whole, or under mask m (masked) */
LK_T512 static LK_INL void fla_step(const int R, const int T, const int kind, const bool masked, const uint8_t *w,
                                    size_t ws, const float *a, size_t as, int64_t i, __mmask16 m, bool pf,
                                    __m512 acc[4][6]) {
    const int es = kind == 32 ? 4 : 2;
    __m512 wv[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        if (pf && (i & 31) == 0) pf_range(w + r * ws + i * es, R * ws, 32 * es);
        wv[r] = fl_load(kind, w + r * ws + i * es, masked ? m : 0xFFFF);
    }
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
        const __m512 av = masked ? _mm512_maskz_loadu_ps(m, a + t * as + i) : _mm512_loadu_ps(a + t * as + i);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], av, acc[r][t]);
    }
}

/* The fl_tile / bf_tile arithmetic with the activations already in fp32
 * (F32, F16 and BF16 without AVX512_BF16: fp16/bf16 -> fp32 is exact, so
 * converting once per call instead of per tile changes no bit) and a
 * larger tile: 24 accumulators, 4 weight vectors converted once per 6
 * tokens, each token's fp32 elements loaded once for the 4 rows. Each
 * (row, token) accumulator takes the row's 16-element chunks in order, the
 * last one masked, then the same hsum: fl_tile's chain (which steps 32
 * elements as two chunks), so decode and prefill agree bit for bit.
 * Full steps load unmasked: a masked load costs a uop on the FMA ports of
 * Intel cores (Sapphire Rapids: 10 of them beside a step's 24 FMAs and 4
 * conversions). */
LK_T512 static LK_INL void fla_tile(const int R, const int T, const int kind, int64_t n, const uint8_t *w,
                                    size_t ws, const float *a, size_t as, float *y, size_t ys, bool pf) {
    __m512 acc[4][6];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 6
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) fla_step(R, T, kind, false, w, ws, a, as, i, 0, pf, acc);
    if (i < n) fla_step(R, T, kind, true, w, ws, a, as, i, (__mmask16)((1u << (n - i)) - 1), pf, acc);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 6
        for (int t = 0; t < T; t++) y[t * ys + r] = hsum(acc[r][t]);
}

/* BF16 x BF16 with AVX512_BF16: vdpbf16ps does 32 products per instruction
 * into fp32 (as ggml's BF16 dot on such CPUs). */
#define LK_T512BF                                                                              \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma," \
                          "f16c,bmi,bmi2,gfni,avx512bf16")))

/* One 32-element step of every (row, token) accumulator at element i:
 * weights and activations loaded whole, or under mask m (masked), the
 * weights' lines R rows ahead prefetched when pf. */
LK_T512BF static LK_INL void bf_step(const int R, const int T, const bool masked, const uint8_t *w, size_t ws,
                                     const uint8_t *a, size_t as, int64_t i, __mmask32 m, bool pf,
                                     __m512 acc[4][6]) {
    __m512i wv[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        if (pf) pf_range(w + r * ws + i * 2, R * ws, 64);
        wv[r] = masked ? _mm512_maskz_loadu_epi16(m, w + r * ws + i * 2) : _mm512_loadu_si512(w + r * ws + i * 2);
    }
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
        const uint8_t *ap = a + t * as + i * 2;
        __m512bh av = (__m512bh)(masked ? _mm512_maskz_loadu_epi16(m, ap) : _mm512_loadu_si512(ap));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wv[r], av);
    }
}

/* One row's 32-element decode step into its two 8-lane halves (bf_tile's
 * one-token loops): lanes 0-7 take the step's first 16 elements, 8-15 the
 * next 16 */
LK_T512BF static LK_INL void bf_half_step(__m256 *lo, __m256 *hi, const uint8_t *wr, __m256i alo, __m256i ahi) {
    *lo = _mm256_dpbf16_ps(*lo, (__m256bh)_mm256_loadu_si256((const __m256i *)wr), (__m256bh)alo);
    *hi = _mm256_dpbf16_ps(*hi, (__m256bh)_mm256_loadu_si256((const __m256i *)(wr + 32)), (__m256bh)ahi);
}

/* The chain of each (row, token) accumulator over the row's 32-element
 * steps, the last one masked, then one hsum, for decode and 2-3 tokens:
 * every step masked and prefetching (on Zen 5 unmasked full steps streamed
 * a 2048 x 5632 decode at 19.7-23.7 GB/s against 22.0-25.7). Prefill
 * takes the same chain in bf_slab, so decode and prefill agree bit for
 * bit. */
LK_T512BF static LK_INL void bf_tile(const int R, const int T, const bool roll, int64_t n, const uint8_t *w,
                                     size_t ws, const uint8_t *a, size_t as, float *y, size_t ys) {
    __m512 acc[4][6];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 6
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    int64_t i = 0;
    if (T == 1) {
        /* one token: each 16-lane accumulator as two 8-lane halves, lanes
         * 0-7 fed a step's first 16 elements and 8-15 the next 16, so
         * lane by lane the same vdpbf16ps, and the same bits. On the Zen 5
         * the 32-byte loads streamed the weights faster than 64-byte ones
         * under masks. The rows loop rolled or unrolled as fl_tile's
         * (`roll`): TinyLlama BF16 `bench -t 1`, three rounds alternating,
         * 13.3-13.9 tok/s rolled against 11.3-11.7 unrolled on the Zen 5,
         * 6.9-7.1 against 7.9-8.2 on the Xeon. */
        __m256 lo[4], hi[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) lo[r] = _mm256_setzero_ps(), hi[r] = _mm256_setzero_ps();
        if (roll) {
            const size_t pd = (size_t)lk_quant_pf_tiles() * R * ws;
            for (; i + 32 <= n; i += 32) {
                const __m256i alo = _mm256_loadu_si256((const __m256i *)(a + i * 2)),
                              ahi = _mm256_loadu_si256((const __m256i *)(a + i * 2 + 32));
#pragma GCC unroll 1
                for (int r = 0; r < R; r++) {
                    const uint8_t *wr = w + r * ws + i * 2;
                    if (pd) _mm_prefetch((const char *)wr + pd, _MM_HINT_T0);
                    bf_half_step(&lo[r], &hi[r], wr, alo, ahi);
                }
            }
        } else {
            for (; i + 32 <= n; i += 32) {
                const __m256i alo = _mm256_loadu_si256((const __m256i *)(a + i * 2)),
                              ahi = _mm256_loadu_si256((const __m256i *)(a + i * 2 + 32));
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const uint8_t *wr = w + r * ws + i * 2;
                    pf_range(wr, R * ws, 64);
                    bf_half_step(&lo[r], &hi[r], wr, alo, ahi);
                }
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[r][0] = _mm512_insertf32x8(_mm512_castps256_ps512(lo[r]), hi[r], 1);
    }
    for (; i < n; i += 32)
        bf_step(R, T, true, w, ws, a, as, i, n - i >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (n - i)) - 1), true, acc);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 6
        for (int t = 0; t < T; t++) y[t * ys + r] = hsum(acc[r][t]);
}

/* ===================================================================== */
/* Tile instantiations and tile sets                                       */
/* ===================================================================== */

#define LK_TILE_FN(attr, name, R, T, call)                                                   \
    attr static void name##_##R##x##T(int64_t n, const uint8_t *w, size_t ws,              \
                                       const uint8_t *a, size_t as, float *y, size_t ys) { \
        call;                                                                              \
    }

/* Q4_0 / Q8_0: decode 4x1, prefill 4x3 */
#define LK_Q_TILES(name, isq8, dec4)                                                                          \
    LK_TILE_FN(LK_T512, name, 4, 1, q4q8_tile(4, 1, isq8, n, w, ws, a, as, y, ys))                   \
    LK_TILE_FN(LK_T512, name, 4, 2, q4q8_tile(4, 2, isq8, n, w, ws, a, as, y, ys))                   \
    LK_TILE_FN(LK_T512, name, 4, 3, q4q8_tile(4, 3, isq8, n, w, ws, a, as, y, ys))                   \
    LK_TILE_FN(LK_T512, name, 1, 1, q4q8_tile(1, 1, isq8, n, w, ws, a, as, y, ys))                   \
    LK_TILE_FN(LK_T512, name, 1, 2, q4q8_tile(1, 2, isq8, n, w, ws, a, as, y, ys))                   \
    LK_TILE_FN(LK_T512, name, 1, 3, q4q8_tile(1, 3, isq8, n, w, ws, a, as, y, ys))                   \
    static const lk_tileset name##_set = {dec4, name##_1x1, 4, 3,                                   \
                                          {{NULL, name##_1x1, name##_1x2, name##_1x3, NULL},        \
                                           {NULL, name##_4x1, name##_4x2, name##_4x3, NULL}}};

/* K-quants: decode 4 rows, a few tokens 1x4 */
#define LK_K_TILES(name, kind)                                                                 \
    LK_TILE_FN(LK_T512, name, 4, 1, kq_tile(4, 1, kind, n, w, ws, a, as, y, ys))            \
    LK_TILE_FN(LK_T512, name, 1, 1, kq_tile(1, 1, kind, n, w, ws, a, as, y, ys))            \
    LK_TILE_FN(LK_T512, name, 1, 2, kq_tile(1, 2, kind, n, w, ws, a, as, y, ys))            \
    LK_TILE_FN(LK_T512, name, 1, 3, kq_tile(1, 3, kind, n, w, ws, a, as, y, ys))            \
    LK_TILE_FN(LK_T512, name, 1, 4, kq_tile(1, 4, kind, n, w, ws, a, as, y, ys))            \
    static const lk_tileset name##_set = {name##_4x1, name##_1x1, 1, 4,                    \
                                          {{NULL, name##_1x1, name##_1x2, name##_1x3, name##_1x4}, \
                                           {NULL, name##_1x1, name##_1x2, name##_1x3, name##_1x4}}};
LK_K_TILES(q4k, 4)
LK_K_TILES(q5k, 5)
LK_K_TILES(q6k, 6)

/* float types: decode 4x1, prefill 4x3 */
#define LK_F_TILES(attr, name, CALL)                                                          \
    LK_TILE_FN(attr, name, 4, 1, CALL(4, 1)) LK_TILE_FN(attr, name, 4, 2, CALL(4, 2))         \
    LK_TILE_FN(attr, name, 4, 3, CALL(4, 3)) LK_TILE_FN(attr, name, 1, 1, CALL(1, 1))         \
    LK_TILE_FN(attr, name, 1, 2, CALL(1, 2)) LK_TILE_FN(attr, name, 1, 3, CALL(1, 3))         \
    static const lk_tileset name##_set = {name##_4x1, name##_1x1, 4, 3,                     \
                                          {{NULL, name##_1x1, name##_1x2, name##_1x3, NULL}, \
                                           {NULL, name##_4x1, name##_4x2, name##_4x3, NULL}}};
#define F32_CALL(R, T) fl_tile(R, T, 32, false, n, w, ws, a, as, y, ys)
#define F16_CALL(R, T) fl_tile(R, T, 16, false, n, w, ws, a, as, y, ys)
#define BFC_CALL(R, T) fl_tile(R, T, 0, false, n, w, ws, a, as, y, ys)
#define BF_CALL(R, T) bf_tile(R, T, false, n, w, ws, a, as, y, ys)
LK_F_TILES(LK_T512, f32, F32_CALL)
LK_F_TILES(LK_T512, f16, F16_CALL)
LK_F_TILES(LK_T512, bfc, BFC_CALL)
LK_F_TILES(LK_T512BF, bf, BF_CALL)
/* the same sets with the rolled 4-row decode tile (lk_quant_set_dec_roll) */
#define LK_F_ROLLED(attr, name, CALL)                                                                  \
    LK_TILE_FN(attr, name##r, 4, 1, CALL)                                                             \
    static const lk_tileset name##r_set = {name##r_4x1, name##_1x1, 4, 3,                             \
                                           {{NULL, name##_1x1, name##_1x2, name##_1x3, NULL},          \
                                            {NULL, name##_4x1, name##_4x2, name##_4x3, NULL}}};
LK_F_ROLLED(LK_T512, f16, fl_tile(4, 1, 16, true, n, w, ws, a, as, y, ys))
LK_F_ROLLED(LK_T512, bfc, fl_tile(4, 1, 0, true, n, w, ws, a, as, y, ys))
LK_F_ROLLED(LK_T512BF, bf, bf_tile(4, 1, true, n, w, ws, a, as, y, ys))

#define LK_MM_FN(name)                                                                      \
    static void mm_##name(int64_t n, int64_t nrows, const void *w, size_t w_stride,         \
                          int64_t ntok, const void *a, size_t a_stride, float *y,           \
                          size_t y_stride) {                                                \
        lk_quant_run_tiles(&name##_set, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride); \
    }
/* The first token count that takes the GEMM: LK_GEMM_MIN_TOK unless the
 * tuner chose otherwise (lk_quant_set_gemm_tok: on a Zen 5 the rows
 * kernel beats the GEMM up to about 8 tokens, on the Xeon not at 5). */
static inline int64_t gemm_min_tok(void) {
    const int v = lk_quant_gemm_tok();
    return v ? v : LK_GEMM_MIN_TOK;
}
static inline int64_t gemm_min_tok_r16(void) {
    const int v = lk_quant_gemm_tok();
    return v ? v : lk_gemm_min_tok_r16();
}
static inline int64_t gemm_min_tok_kr16(int kind) {
    const int v = lk_quant_gemm_tok();
    return v ? v : lk_gemm_min_tok_kr16(kind);
}

/* AMX from lk_quant_amx_min_tok() tokens on (0: never) */
static inline bool amx_takes(int64_t ntok) {
    const int m = lk_quant_amx_min_tok();
    return m > 0 && ntok >= m;
}
#define AMX_OR(fmt)                                                                                             \
    if (amx_takes(ntok)) {                                                                                      \
        lk_quant_gemm_q4q8_amx(lk_quant_amx_emulating(), fmt, n, nrows, w, w_stride, ntok, a, a_stride, T, y, y_stride); \
        return;                                                                                                 \
    }
/* the repacked types' few-token AMX kernel, from lk_quant_amx_few_min_tok()
 * tokens up to where the panel kernel takes over */
static inline bool amx_few_takes(int64_t n, int64_t nrows, int64_t ntok) {
    const int m = lk_quant_amx_few_min_tok();
    return m > 0 && ntok >= m && lk_quant_amx_few_fits(n, nrows, ntok);
}
#define AMX_FEW_OR(fmt)                                                                                        \
    if (amx_few_takes(n, nrows, ntok)) {                                                                       \
        lk_quant_gemm_q4q8_amx_few(lk_quant_amx_emulating(), fmt, n, nrows, w, w_stride, ntok, a, a_stride, T, y, y_stride); \
        return;                                                                                                \
    }

/* Q4_0: one arithmetic for every token count (the scalar reference's, so
 * batch invariant): decode through the prepared-activation 4-row kernel,
 * then rows in lanes in tiles of up to 6 tokens, then the GEMM (or AMX's
 * tiles). The _t entries take the activations' terms (lk_act_terms; NULL:
 * derived). */
static void mm_q40_t(int64_t n, int64_t nrows, const void *w, size_t w_stride, int64_t ntok, const void *a,
                     size_t a_stride, const lk_act_terms *T, float *y, size_t y_stride) {
    AMX_OR(LK_FMT_Q40)
    if (ntok == 1) q40_decode(n, nrows, w, w_stride, a, y);
    else if (ntok < gemm_min_tok()) lk_quant_q4q8_rows_avx512(LK_FMT_Q40, n, nrows, w, w_stride, ntok, a, a_stride, T, y, y_stride);
    else lk_quant_gemm_q4q8_avx512(LK_FMT_Q40, n, nrows, w, w_stride, ntok, a, a_stride, T, y, y_stride);
}
/* Q4_0_R16 (repacked at load): the same arithmetic again, decode and few
 * tokens with the rows in the lanes as they are stored, the GEMM without
 * its transposes */
static void mm_q40r16_t(int64_t n, int64_t nrows, const void *w, size_t w_stride, int64_t ntok, const void *a,
                        size_t a_stride, const lk_act_terms *T, float *y, size_t y_stride) {
    AMX_OR(LK_FMT_R16)
    AMX_FEW_OR(LK_FMT_R16)
    if (ntok < gemm_min_tok_r16()) lk_quant_q4q8_rows_avx512(LK_FMT_R16, n, nrows, w, w_stride, ntok, a, a_stride, T, y, y_stride);
    else lk_quant_gemm_q4q8_avx512(LK_FMT_R16, n, nrows, w, w_stride, ntok, a, a_stride, T, y, y_stride);
}
static void mm_q80r16_t(int64_t n, int64_t nrows, const void *w, size_t w_stride, int64_t ntok, const void *a,
                        size_t a_stride, const lk_act_terms *T, float *y, size_t y_stride) {
    AMX_OR(LK_FMT_Q8R16)
    AMX_FEW_OR(LK_FMT_Q8R16)
    if (ntok < gemm_min_tok_r16()) lk_quant_q4q8_rows_avx512(LK_FMT_Q8R16, n, nrows, w, w_stride, ntok, a, a_stride, T, y, y_stride);
    else lk_quant_gemm_q4q8_avx512(LK_FMT_Q8R16, n, nrows, w, w_stride, ntok, a, a_stride, T, y, y_stride);
}
/* Q8_0: the same one arithmetic; decode as Q4_0's, a few tokens rows in lanes */
static void mm_q80_t(int64_t n, int64_t nrows, const void *w, size_t w_stride, int64_t ntok, const void *a,
                     size_t a_stride, const lk_act_terms *T, float *y, size_t y_stride) {
    AMX_OR(LK_FMT_Q80)
    if (ntok == 1) q80_decode(n, nrows, w, w_stride, a, y);
    else if (ntok < gemm_min_tok()) lk_quant_q4q8_rows_avx512(LK_FMT_Q80, n, nrows, w, w_stride, ntok, a, a_stride, T, y, y_stride);
    else lk_quant_gemm_q4q8_avx512(LK_FMT_Q80, n, nrows, w, w_stride, ntok, a, a_stride, T, y, y_stride);
}
#undef AMX_OR
#define MM_NO_TERMS(name)                                                                                      \
    static void name(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as, \
                     float *y, size_t ys) {                                                                    \
        name##_t(n, nrows, w, ws, ntok, a, as, NULL, y, ys);                                                   \
    }
MM_NO_TERMS(mm_q40) MM_NO_TERMS(mm_q40r16) MM_NO_TERMS(mm_q80r16) MM_NO_TERMS(mm_q80)
/* K-quants: prefill through the GEMM (quant_gemm_avx512.c) */
static void mm_q4k(int64_t n, int64_t nrows, const void *w, size_t w_stride, int64_t ntok, const void *a,
                   size_t a_stride, float *y, size_t y_stride) {
    if (ntok >= gemm_min_tok()) lk_quant_gemm_q4k_avx512(n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride);
    else lk_quant_run_tiles(&q4k_set, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride);
}
static void mm_q5k(int64_t n, int64_t nrows, const void *w, size_t w_stride, int64_t ntok, const void *a,
                   size_t a_stride, float *y, size_t y_stride) {
    if (ntok >= gemm_min_tok()) lk_quant_gemm_q5k_avx512(n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride);
    else lk_quant_run_tiles(&q5k_set, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride);
}
static void mm_q6k(int64_t n, int64_t nrows, const void *w, size_t w_stride, int64_t ntok, const void *a,
                   size_t a_stride, float *y, size_t y_stride) {
    if (ntok >= LK_GEMM_MIN_TOK_Q6K) lk_quant_gemm_q6k_avx512(n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride);
    else lk_quant_run_tiles(&q6k_set, n, nrows, w, w_stride, ntok, a, a_stride, y, y_stride);
}
/* The repacked K-quants: below the GEMM's threshold (as the repacked
 * Q4_0's) 16 rows in the lanes as stored, the rows past the last whole
 * group through the file type's kernel; from it the GEMM, packing from the
 * groups without transposes */
static LK_INL void mm_kr16(int kind, lk_qmm_fn file_mm, int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok,
                           const void *a, size_t as, float *y, size_t ys) {
    if (ntok >= gemm_min_tok_kr16(kind)) {
        lk_quant_gemm_kr16_avx512(kind, n, nrows, w, ws, ntok, a, as, y, ys);
        return;
    }
    const int64_t full = nrows / 16 * 16;
    if (full) lk_quant_kr16_rows_avx512(kind, n, full, w, ws, ntok, a, as, y, ys);
    if (full < nrows) file_mm(n, nrows - full, (const uint8_t *)w + (size_t)full * ws, ws, ntok, a, as, y + full, ys);
}
static void mm_q4kr16(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as,
                      float *y, size_t ys) {
    mm_kr16(4, mm_q4k, n, nrows, w, ws, ntok, a, as, y, ys);
}
static void mm_q5kr16(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as,
                      float *y, size_t ys) {
    mm_kr16(5, mm_q5k, n, nrows, w, ws, ntok, a, as, y, ys);
}
static void mm_q6kr16(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as,
                      float *y, size_t ys) {
    mm_kr16(6, mm_q6k, n, nrows, w, ws, ntok, a, as, y, ys);
}
/* The prefill driver of the float types from FLA_MIN_TOK tokens: F16 and
 * BF16 activations are converted to fp32 into a stack buffer of
 * FLA_BUF_FLOATS, as many tokens at a time as fit (rows padded to 16), F32
 * ones are read in place; then 4-row groups x 6-token tiles, each group's
 * weights read from memory once per buffer of tokens. Rows too long for
 * FLA_MIN_TOK tokens in the buffer, and calls of fewer than FLA_MIN_ROWS
 * rows (a thread's share of a small matrix at many threads, where widening
 * the whole token block would cost more than a sixteenth of the products),
 * take the 4 x 3 tiles. */
enum { FLA_MIN_TOK = 4, FLA_MIN_ROWS = 16, FLA_T = 6, FLA_BUF_FLOATS = 128 * 1024 /* 512 KB of the thread's stack */ };
/* A prefill tile: a = its first token, as = the token stride in the
 * tile's units (floats for fla_tile, bytes for bf_tile) */
typedef void (*fla_fn)(int64_t n, const uint8_t *w, size_t ws, const void *a, size_t as, float *y, size_t ys, bool pf);
#define FLA_FN(name, kind, R, T)                                                                               \
    LK_T512 static void name##_##R##x##T(int64_t n, const uint8_t *w, size_t ws, const void *a, size_t as,    \
                                         float *y, size_t ys, bool pf) {                                      \
        fla_tile(R, T, kind, n, w, ws, (const float *)a, as, y, ys, pf);                                      \
    }
#define FLA_SET(name, kind)                                                                                    \
    FLA_FN(name, kind, 4, 1) FLA_FN(name, kind, 4, 2) FLA_FN(name, kind, 4, 3) FLA_FN(name, kind, 4, 4)        \
    FLA_FN(name, kind, 4, 5) FLA_FN(name, kind, 4, 6) FLA_FN(name, kind, 1, 1) FLA_FN(name, kind, 1, 2)        \
    FLA_FN(name, kind, 1, 3) FLA_FN(name, kind, 1, 4) FLA_FN(name, kind, 1, 5) FLA_FN(name, kind, 1, 6)        \
    static const fla_fn name##_tiles[2][FLA_T] = {                                                             \
        {name##_1x1, name##_1x2, name##_1x3, name##_1x4, name##_1x5, name##_1x6},                              \
        {name##_4x1, name##_4x2, name##_4x3, name##_4x4, name##_4x5, name##_4x6}};
FLA_SET(fla32, 32)
FLA_SET(fla16, 16)
FLA_SET(flab, 0)

/* n fp16 / bf16 values as fp32, zeros up to the next multiple of 16, in
 * 16-element chunks `step` floats apart (16: one row) */
LK_T512 static void fla_widen(const int kind, int64_t n, const uint8_t *src, float *dst, size_t step) {
    for (int64_t c = 0; c < n; c += 16, dst += step) {
        const __mmask16 m = n - c >= 16 ? 0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        _mm512_storeu_ps(dst, kind == 16 ? fl_load(16, src + 2 * c, m) : fl_load(0, src + 2 * c, m));
    }
}

/* nt tokens (a: the first, astep bytes apart, `as` in the tiles' units)
 * through 4 x 6 tiles: rows in blocks of rb (a multiple of 4), in a block
 * the 6-token tiles outside its 4-row groups (rb = 4: each row group's
 * tiles one after another), every group prefetching its weights in its
 * first tile */
static void fla_walk(const fla_fn (*tiles)[FLA_T], int64_t n, int64_t nrows, const uint8_t *W, size_t ws,
                     int64_t nt, const uint8_t *a, size_t astep, size_t as, float *y, size_t ys, int64_t rb) {
    for (int64_t b0 = 0; b0 < nrows; b0 += rb) {
        const int64_t b1 = LK_MIN(nrows, b0 + rb);
        for (int64_t t = 0; t < nt; t += FLA_T) {
            const int tt = (int)LK_MIN((int64_t)FLA_T, nt - t);
            for (int64_t r = b0, step; r < b1; r += step) {
                const int rr = b1 - r >= 4;
                step = rr ? 4 : 1;
                tiles[rr][tt - 1](n, W + (size_t)r * ws, ws, a + (size_t)t * astep, as, y + (size_t)t * ys + (size_t)r,
                                  ys, t == 0);
            }
        }
    }
}

static void fla_run(const int kind, const lk_tileset *small, int64_t n, int64_t nrows, const void *w, size_t ws,
                    int64_t ntok, const void *a, size_t as, float *y, size_t ys) {
    const size_t ld = ((size_t)n + 15) & ~(size_t)15;
    const int64_t tc = kind == 32 ? 64 : (int64_t)(FLA_BUF_FLOATS / ld);
    if (ntok < FLA_MIN_TOK || tc < FLA_MIN_TOK || (kind == 32 && as % 4) || (kind != 32 && nrows < FLA_MIN_ROWS)) {
        lk_quant_run_tiles(small, n, nrows, w, ws, ntok, a, as, y, ys);
        return;
    }
    const fla_fn(*tiles)[FLA_T] = kind == 32 ? fla32_tiles : kind == 16 ? fla16_tiles : flab_tiles;
    _Alignas(64) float buf[kind == 32 ? 1 : FLA_BUF_FLOATS];
    const uint8_t *W = w, *A = a;
    for (int64_t t0 = 0; t0 < ntok; t0 += tc) {
        const int64_t t1 = LK_MIN(ntok, t0 + tc);
        const float *act = (const float *)(const void *)(A + (size_t)t0 * as);
        size_t ald = as / 4;
        if (kind != 32) {
            for (int64_t t = t0; t < t1; t++) fla_widen(kind, n, A + (size_t)t * as, buf + (size_t)(t - t0) * ld, 16);
            act = buf;
            ald = ld;
        }
        fla_walk(tiles, n, nrows, W, ws, t1 - t0, (const uint8_t *)act, ald * 4, ald, y + (size_t)t0 * ys, ys, 4);
    }
}

/* float types: one arithmetic for every token count (batch invariant; see
 * the header): the register tiles, from FLA_MIN_TOK tokens with fp32
 * activations in 4 x 6 tiles (BF16 with AVX512_BF16: vdpbf16ps tiles) */
#define LK_MM_FLA_FN(name, kind)                                                                \
    static void mm_##name(int64_t n, int64_t nrows, const void *w, size_t w_stride,             \
                          int64_t ntok, const void *a, size_t a_stride, float *y,               \
                          size_t y_stride) {                                                    \
        fla_run(kind, lk_quant_dec_roll() ? &name##r_set : &name##_set, n, nrows, w, w_stride, ntok, a, \
                a_stride, y, y_stride);                                                         \
    }
LK_MM_FLA_FN(f16, 16)

/* F16_R16 (quant_impl.h): the 16 rows of a group in the lanes, each row's
 * products fused into one sum in element order (its scalar code's
 * arithmetic, for every token count). Tiles of G groups x T tokens: per
 * element one 32-byte load and conversion per group and one broadcast
 * multiply-add per accumulator, so a 2 x 12 tile converts once per 12
 * products where the F16 rows' 4 x 6 tiles convert once per 6, and no
 * horizontal sums. The tile's T tokens come as one panel of fp32, element
 * k of token t at p[(k / 16) 16 T + 16 t + k % 16]: every broadcast of a
 * 16-element chunk is one pointer and a constant offset, where T token
 * pointers cost the 2 x 12 tile its general registers (spills, and 23
 * vector moves per 48 multiply-adds from gcc). pd: bytes ahead to prefetch
 * each group's stream (0: none; the first token tile of a group reads it
 * from memory). */
LK_T512 static LK_INL void hr_tile(const int G, const int T, int64_t n, const uint8_t *w, size_t gs,
                                   const float *p, float *y, size_t ys, size_t pd) {
    __m512 acc[4][12];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 12
        for (int t = 0; t < T; t++) acc[g][t] = _mm512_setzero_ps();
#define HR_STEP(wk, pk)                                                                                     \
    do {                                                                                                      \
        __m512 wv[4];                                                                                         \
        _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) wv[g] =                                           \
            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)((wk) + (size_t)g * gs)));      \
        _Pragma("GCC unroll 12") for (int t = 0; t < T; t++) {                                                \
            const __m512 av = _mm512_set1_ps((pk)[16 * t]);                                                   \
            _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) acc[g][t] = _mm512_fmadd_ps(wv[g], av, acc[g][t]); \
        }                                                                                                     \
    } while (0)
    /* 16 elements a step, each group's next line prefetched every other
     * element (a loop without the prefetches when pd is 0) */
#define HR_CHUNKS(PF)                                                                                       \
    for (int64_t c = 0; c < n / 16; c++, w += 512, p += 16 * T) {                                             \
        _Pragma("GCC unroll 16") for (int kk = 0; kk < 16; kk++) {                                            \
            if ((PF) && kk % 2 == 0)                                                                          \
                _Pragma("GCC unroll 4") for (int g = 0; g < G; g++)                                           \
                    _mm_prefetch((const char *)(w + (size_t)g * gs + pd + 32 * kk), _MM_HINT_T0);              \
            HR_STEP(w + 32 * kk, p + kk);                                                                     \
        }                                                                                                     \
    }
    if (pd)
        HR_CHUNKS(1)
    else
        HR_CHUNKS(0)
#undef HR_CHUNKS
    for (int kk = 0; kk < (int)(n % 16); kk++) HR_STEP(w + 32 * kk, p + kk);
#undef HR_STEP
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 12
        for (int t = 0; t < T; t++) _mm512_storeu_ps(y + (size_t)t * ys + 16 * (size_t)g, acc[g][t]);
}
/* a rows-in-lanes tile (hr_tile, br_tile) of G groups x T tokens, p its
 * tokens' panel */
typedef void (*lanes_fn)(int64_t n, const uint8_t *w, size_t gs, const void *p, float *y, size_t ys, size_t pd);
#define HR_FN(G, T)                                                                                         \
    LK_T512 static void hr_##G##x##T(int64_t n, const uint8_t *w, size_t gs, const void *p, float *y,        \
                                     size_t ys, size_t pd) {                                                 \
        hr_tile(G, T, n, w, gs, p, y, ys, pd);                                                              \
    }
enum { HR_T = LK_TERMS_WIDE_T, HR_DEC_T = 3, HR_PD = 2048 /* bytes per prefetch tile (lk_quant_prefetch) */ };
HR_FN(4, 1) HR_FN(4, 2) HR_FN(4, 3)
HR_FN(2, 1) HR_FN(2, 2) HR_FN(2, 3) HR_FN(2, 4) HR_FN(2, 5) HR_FN(2, 6)
HR_FN(2, 7) HR_FN(2, 8) HR_FN(2, 9) HR_FN(2, 10) HR_FN(2, 11) HR_FN(2, 12)
HR_FN(1, 1) HR_FN(1, 2) HR_FN(1, 3) HR_FN(1, 4) HR_FN(1, 5) HR_FN(1, 6)
HR_FN(1, 7) HR_FN(1, 8) HR_FN(1, 9) HR_FN(1, 10) HR_FN(1, 11) HR_FN(1, 12)
/* [G = 1, 2, 4 as 0, 1, 2][T - 1] */
static const lanes_fn k_hr[3][HR_T] = {
    {hr_1x1, hr_1x2, hr_1x3, hr_1x4, hr_1x5, hr_1x6, hr_1x7, hr_1x8, hr_1x9, hr_1x10, hr_1x11,
     hr_1x12},
    {hr_2x1, hr_2x2, hr_2x3, hr_2x4, hr_2x5, hr_2x6, hr_2x7, hr_2x8, hr_2x9, hr_2x10, hr_2x11,
     hr_2x12},
    {hr_4x1, hr_4x2, hr_4x3}};

/* Tokens t0..t1-1 of ntok (fp16 rows of n elements, token t0's at a, `as`
 * bytes apart) widened to fp32 into their places in the panels of HR_T
 * tokens at p (hr_run's layout: a panel's 16-element chunk c holds its
 * tokens' chunks c one after another), zeros up to the next multiple of 16.
 * Chunk by chunk, so that the stores of a panel's tokens fill consecutive
 * lines: token by token, each store went to a line a panel's width from the
 * last, and the activations' pass of an F16 pp64 took a third more (1.9-2.5
 * against 1.3-1.6 % of the products on the Xeon guest). */
LK_T512 static void hr_widen_tokens(int64_t n, int64_t ntok, int64_t t0, int64_t t1, const uint8_t *a, size_t as,
                                    float *p) {
    const size_t ld = ((size_t)n + 15) & ~(size_t)15;
    for (int64_t s0 = t0, s1; s0 < t1; s0 = s1) {
        const int64_t P0 = s0 / HR_T * HR_T;
        s1 = LK_MIN(t1, P0 + HR_T);
        const size_t step = 16 * (size_t)LK_MIN((int64_t)HR_T, ntok - P0);
        float *base = p + (size_t)P0 * ld + 16 * (size_t)(s0 - P0);
        for (int64_t c = 0; c < n; c += 16, base += step) {
            const __mmask16 m = n - c >= 16 ? 0xFFFF : (__mmask16)((1u << (n - c)) - 1);
            for (int64_t t = s0; t < s1; t++)
                _mm512_storeu_ps(base + 16 * (size_t)(t - s0), fl_load(16, a + (size_t)(t - t0) * as + 2 * c, m));
        }
    }
}

/* nt tokens over ng groups of a rows-in-lanes layout (F16_R16, BF16_R16)
 * through its tiles k[G = 1, 2, 4 as 0, 1, 2][T - 1]: up to HR_DEC_T
 * tokens 4 groups at a time (4 chains in flight, decode's stream), more 2
 * groups x HR_T tokens, each group step's token tiles one after another,
 * the first prefetching pd bytes ahead (0: none). The tiles' panels of
 * tokens t.. at p + t pb bytes. */
static void lanes_walk(const lanes_fn k[3][HR_T], int64_t n, int64_t ng, const uint8_t *W, size_t gs, int64_t nt,
                       const uint8_t *p, size_t pb, float *y, size_t ys, size_t pd) {
    const int gmax = nt <= HR_DEC_T ? 4 : 2;
    for (int64_t g = 0, step; g < ng; g += step) {
        step = ng - g >= gmax ? gmax : ng - g >= 2 ? 2 : 1;
        const int gi = step == 4 ? 2 : step == 2 ? 1 : 0;
        for (int64_t t = 0; t < nt; t += HR_T) {
            const int tt = (int)LK_MIN((int64_t)HR_T, nt - t);
            k[gi][tt - 1](n, W + (size_t)g * gs, gs, p + (size_t)t * pb, y + (size_t)t * ys + 16 * (size_t)g, ys,
                          t == 0 ? pd : 0);
        }
    }
}

/* The whole groups: tokens widened to fp32 (as many at a time as fla_run's
 * buffer holds) in panels of HR_T (hr_tile), or all of them read from the
 * activations' terms (`wide`: act_terms_row made them once), then through
 * lanes_walk, prefetching HR_PD bytes ahead per the tuner's prefetch tile
 * (on the Xeon guest's decode 2 KB streamed 18.2-18.6 GB/s, 1 KB
 * 17.0-17.2, 4 KB 17.3, none 15.5-15.9). */
static void hr_run(int64_t n, int64_t ng, const uint8_t *W, size_t gs, int64_t ntok, const uint8_t *A, size_t as,
                   const float *wide, float *y, size_t ys) {
    const size_t ld = ((size_t)n + 15) & ~(size_t)15;
    const int64_t tc = wide ? ntok : (int64_t)(FLA_BUF_FLOATS / ld);
    if (tc < 1) { /* rows of more than FLA_BUF_FLOATS elements: the same sums in scalar code */
        lk_quant_f16r16_seq(n, ng * 16, W, gs / 16, ntok, A, as, y, ys);
        return;
    }
    _Alignas(64) float stack[wide ? 1 : FLA_BUF_FLOATS];
    const size_t pd = (size_t)lk_quant_pf_tiles() * HR_PD;
    for (int64_t t0 = 0; t0 < ntok; t0 += tc) {
        const int64_t nt = LK_MIN(ntok, t0 + tc) - t0;
        const float *buf = wide ? wide : stack;
        if (!wide) hr_widen_tokens(n, nt, 0, nt, A + (size_t)t0 * as, as, stack);
        lanes_walk(k_hr, n, ng, W, gs, nt, (const uint8_t *)buf, ld * sizeof(float), y + (size_t)t0 * ys, ys, pd);
    }
}
static void mm_f16r16_t(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as,
                        const lk_act_terms *T, float *y, size_t ys) {
    const int64_t full = nrows / 16 * 16;
    if (full) hr_run(n, full / 16, w, 16 * ws, ntok, a, as, T && T->k == LK_TERMS_WIDE ? T->wide : NULL, y, ys);
    if (full < nrows) mm_f16(n, nrows - full, (const uint8_t *)w + (size_t)full * ws, ws, ntok, a, as, y + full, ys);
}
MM_NO_TERMS(mm_f16r16)
/* lk_act_terms_rows: the Q8_0 kernels' (quant_gemm_avx512.c) or the F16
 * rows widened into hr_run's panels, token by token, or the BF16 rows
 * into AMX's tiles */
static void act_terms_rows(const lk_act_terms *T, int64_t t0, int64_t t1, const void *a, size_t as, int64_t n) {
    if (T->k == LK_TERMS_TILES) {
        lk_act_terms_rows_bf16_tiles(T, t0, t1, a, as, n);
        return;
    }
    if (T->k == LK_TERMS_WIDE) {
        hr_widen_tokens(n, T->ntok, t0, t1, (const uint8_t *)a, as, T->wide);
        return;
    }
    for (int64_t t = t0; t < t1; t++) lk_act_terms_row_avx512(T, t, (const char *)a + (size_t)(t - t0) * as, n);
}

/* F32 rows of at most FLS_MAX_N elements, FLS_MIN_ROWS rows or more
 * (the matrices of small F32 models; written for attention's scores, which
 * have their own kernels in kernels/vec.c now): per (row, token) the tiles'
 * chain (16 lanes, the 16-element chunks in order from zero, the last one
 * loaded under a mask), then 16 rows' sums at once. hsum, the tiles' last
 * step, adds lane i + 8 onto lane i, then i + 4, i + 2, i + 1; hsum16 does
 * those same additions for 16 rows in 15 vector adds and 30 shuffles
 * instead of 16 reductions of ~9 instructions each, which for rows of 64
 * cost more than the products. The same bits as the tiles (floating-point
 * addition is commutative), so every token count gives them. */
enum { FLS_MAX_N = 256, FLS_MIN_ROWS = 8 };

/* r[k] = hsum(a[k]) for k < 16, the same bits (lk_fold16). */
LK_T512 static LK_INL __m512 hsum16(const __m512 a[16]) { return lk_fold16(a, LK_FOLD_ADD); }

/* NT tokens (1 or 2) against NR rows (8, or fewer at the end: the
 * others' sums are zero and not stored): accumulator 8 t + k is row k
 * with token t, so hsum16's lanes 0-7 are the first token's rows and 8-15
 * the second's. Two tokens per row load: loads, not products, bound the
 * one-token form (16 loads per 16 products). The first tile of a row group
 * (pf) prefetches the next group's lines: decode's head groups read each
 * page of keys from memory once, and without it their scores ran slower
 * than the 4 x 6 tiles', which prefetch so. */
LK_T512 static LK_INL void fls_tile(const int NR, const int NT, int64_t n, const uint8_t *w, size_t ws,
                                    const float *a, size_t as, float *y, size_t ys, bool pf) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) acc[k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 a0 = _mm512_maskz_loadu_ps(m, a + i), a1 = NT > 1 ? _mm512_maskz_loadu_ps(m, a + as + i) : a0;
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            if (k >= NR) break;
            const float *wr = (const float *)(const void *)(w + (size_t)k * ws) + i;
            if (pf) _mm_prefetch((const char *)(wr + 2 * ws), _MM_HINT_T0); /* the next 8 rows' line */
            const __m512 wv = _mm512_maskz_loadu_ps(m, wr);
            acc[k] = _mm512_fmadd_ps(wv, a0, acc[k]);
            if (NT > 1) acc[8 + k] = _mm512_fmadd_ps(wv, a1, acc[8 + k]);
        }
    }
    const __m512 r = hsum16(acc);
    const __mmask8 mr = (__mmask8)((1u << NR) - 1);
    _mm256_mask_storeu_ps(y, mr, _mm512_castps512_ps256(r));
    if (NT > 1) _mm256_mask_storeu_ps(y + ys, mr, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)));
}
typedef void (*fls_fn)(int64_t n, const uint8_t *w, size_t ws, const float *a, size_t as, float *y, size_t ys,
                       bool pf);
#define FLS_FN(R, T)                                                                                          \
    LK_T512 static void fls_##R##x##T(int64_t n, const uint8_t *w, size_t ws, const float *a, size_t as,     \
                                      float *y, size_t ys, bool pf) {                                        \
        fls_tile(R, T, n, w, ws, a, as, y, ys, pf);                                                           \
    }
FLS_FN(1, 1) FLS_FN(2, 1) FLS_FN(3, 1) FLS_FN(4, 1) FLS_FN(5, 1) FLS_FN(6, 1) FLS_FN(7, 1) FLS_FN(8, 1)
FLS_FN(1, 2) FLS_FN(2, 2) FLS_FN(3, 2) FLS_FN(4, 2) FLS_FN(5, 2) FLS_FN(6, 2) FLS_FN(7, 2) FLS_FN(8, 2)
static const fls_fn k_fls[2][8] = {{fls_1x1, fls_2x1, fls_3x1, fls_4x1, fls_5x1, fls_6x1, fls_7x1, fls_8x1},
                                   {fls_1x2, fls_2x2, fls_3x2, fls_4x2, fls_5x2, fls_6x2, fls_7x2, fls_8x2}};

static void mm_f32(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as,
                   float *y, size_t ys) {
    if (n > FLS_MAX_N || nrows < FLS_MIN_ROWS || as % 4) {
        fla_run(32, &f32_set, n, nrows, w, ws, ntok, a, as, y, ys);
        return;
    }
    const uint8_t *W = w, *A = a;
    for (int64_t r0 = 0; r0 < nrows; r0 += 8) {
        const int nr = (int)LK_MIN((int64_t)8, nrows - r0);
        for (int64_t t = 0; t < ntok; t += 2) {
            const int nt = (int)LK_MIN((int64_t)2, ntok - t);
            k_fls[nt - 1][nr - 1](n, W + (size_t)r0 * ws, ws, (const float *)(const void *)(A + (size_t)t * as), as / 4,
                                  y + (size_t)t * ys + (size_t)r0, ys, t == 0 && r0 + 8 < nrows);
        }
    }
}

LK_MM_FLA_FN(bfc, 0)
/* BF16 with AVX512_BF16: vdpbf16ps on the bf16 activations as they are
 * (no conversion to amortise), from FLA_MIN_TOK tokens in 4 x 6 tiles: the
 * 4 x 3 tiles' chain per (row, token), with twice the tokens per weight
 * load. */
enum { BF6_L1 = 32 * 1024, BF6_BLOCK = 256 * 1024, BF6_TCHUNK = 64, BFK_ROWS = 64 };

/* A prefill tile's chain over the elements [i0, i1) of its rows (a K
 * slab; [0, n) for rows that need none): the accumulators from zero at
 * the first slab, else from park (row r, token t at park[(6 r + t) 16]),
 * and back to park, or at the matrix's last slab its hsums to y. Each
 * (row, token) accumulator thus takes bf_tile's 32-element steps in the
 * same order, the last one masked: the same bits, slab by slab. Full
 * steps load unmasked and prefetch the weights only when pf (the first
 * tile of a row group: the later ones find the rows in cache); that took a
 * 2048 x 2048 x 64 BF16 product from 209 to 301-331 GFLOP/s on one Zen 5
 * core (best of 40; the vdpbf16ps peak measures 440). */
LK_T512BF static LK_INL void bf_slab(const int R, const int T, int64_t i0, int64_t i1, int64_t n, const uint8_t *w,
                                     size_t ws, const uint8_t *a, size_t as, float *park, float *y, size_t ys,
                                     bool pf) {
    __m512 acc[4][6];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 6
        for (int t = 0; t < T; t++) acc[r][t] = i0 ? _mm512_load_ps(park + (6 * r + t) * 16) : _mm512_setzero_ps();
    int64_t i = i0;
    for (; i + 32 <= i1; i += 32) bf_step(R, T, false, w, ws, a, as, i, 0, pf, acc);
    if (i < i1) bf_step(R, T, true, w, ws, a, as, i, (__mmask32)((1u << (i1 - i)) - 1), false, acc);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 6
        for (int t = 0; t < T; t++) {
            if (i1 == n) y[t * ys + r] = hsum(acc[r][t]);
            else _mm512_store_ps(park + (6 * r + t) * 16, acc[r][t]);
        }
}
typedef void (*bfk_fn)(int64_t i0, int64_t i1, int64_t n, const uint8_t *w, size_t ws, const uint8_t *a, size_t as,
                       float *park, float *y, size_t ys, bool pf);
#define BFK_FN(R, T)                                                                                              \
    LK_T512BF static void bfk_##R##x##T(int64_t i0, int64_t i1, int64_t n, const uint8_t *w, size_t ws,           \
                                        const uint8_t *a, size_t as, float *park, float *y, size_t ys, bool pf) { \
        bf_slab(R, T, i0, i1, n, w, ws, a, as, park, y, ys, pf);                                                  \
    }
BFK_FN(4, 1) BFK_FN(4, 2) BFK_FN(4, 3) BFK_FN(4, 4) BFK_FN(4, 5) BFK_FN(4, 6)
BFK_FN(1, 1) BFK_FN(1, 2) BFK_FN(1, 3) BFK_FN(1, 4) BFK_FN(1, 5) BFK_FN(1, 6)
static const bfk_fn bfk_tiles[2][FLA_T] = {{bfk_1x1, bfk_1x2, bfk_1x3, bfk_1x4, bfk_1x5, bfk_1x6},
                                           {bfk_4x1, bfk_4x2, bfk_4x3, bfk_4x4, bfk_4x5, bfk_4x6}};

/* nt tokens through the tiles: tokens outside, every row group of a block
 * of rows (rb, sized for L2) through a 6-token tile's K slab of S elements
 * (sized so that the tile's activations stay in L1) before the next slab,
 * so that the activations are read from L1 and the weights from L2; the
 * accumulators wait in park between slabs (rb at most BFK_ROWS then). For
 * rows too long for one slab (an FFN's down matrix), whole rows read a
 * tile's activations from L2 as well as the weights: a 2048 x 5632 x 64
 * product on one Zen 5 core, the two alternated pass by pass, 226-232 ->
 * 246-265 GFLOP/s (medians of 31; the vdpbf16ps peak: 432). */
static void bf_walk(int64_t n, int64_t nrows, const uint8_t *W, size_t ws, int64_t nt, const uint8_t *a, size_t as,
                      float *y, size_t ys, int64_t S, int64_t rb) {
    _Alignas(64) float park[BFK_ROWS * 6 * 16];
    for (int64_t b0 = 0; b0 < nrows; b0 += rb) {
        const int64_t b1 = LK_MIN(nrows, b0 + rb);
        for (int64_t t = 0; t < nt; t += FLA_T) {
            const int tt = (int)LK_MIN((int64_t)FLA_T, nt - t);
            for (int64_t i0 = 0; i0 < n; i0 += S)
                for (int64_t r = b0, step; r < b1; r += step) {
                    const int rr = b1 - r >= 4;
                    step = rr ? 4 : 1;
                    bfk_tiles[rr][tt - 1](i0, LK_MIN(n, i0 + S), n, W + (size_t)r * ws, ws, a + (size_t)t * as, as,
                                          S < n ? park + (size_t)(r - b0) * 6 * 16 : NULL, y + (size_t)t * ys + (size_t)r,
                                          ys, t == 0);
                }
        }
    }
}

static void mm_bf(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a,
                  size_t as, float *y, size_t ys) {
    if (ntok < FLA_MIN_TOK) {
        lk_quant_run_tiles(lk_quant_dec_roll() ? &bfr_set : &bf_set, n, nrows, w, ws, ntok, a, as, y, ys);
        return;
    }
    const uint8_t *A = a;
    /* 64 tokens at a time (their rows stay in L2), through bf_walk:
     * slabs of equal whole steps, as few as fit L1 (one, whole rows, when
     * a tile's tokens fit it); rows per block sized for L2, at most what
     * park holds when there are slabs */
    const int64_t steps = (n + 31) / 32, nsl = ((int64_t)FLA_T * (int64_t)as + BF6_L1 - 1) / BF6_L1;
    const int64_t S = (steps + nsl - 1) / nsl * 32;
    int64_t rb = LK_MAX((int64_t)4, (int64_t)(BF6_BLOCK / ws) / 4 * 4);
    if (S < n) rb = LK_MIN((int64_t)BFK_ROWS, rb);
    for (int64_t t0 = 0; t0 < ntok; t0 += BF6_TCHUNK)
        bf_walk(n, nrows, w, ws, LK_MIN(ntok, t0 + BF6_TCHUNK) - t0, A + (size_t)t0 * as, as, y + (size_t)t0 * ys,
                  ys, S, rb);
}

/* BF16_R16 (quant_impl.h) with AVX512_BF16: the 16 rows of a group in the
 * lanes, one vdpbf16ps per pair of elements and (group, token), each row's
 * sum in its lane from the first pair to the last, for every token count
 * (lk_quant_bf16r16_seq's arithmetic): a decode reads each group as one
 * stream of whole lines, with no horizontal sums, where the BF16 rows' 4-row
 * tiles read 4 streams of half lines (bench_quant 2048 x 5632, one Zen 5
 * core: the BF16 rows streamed 24-26 GB/s, F16_R16 29-34). Tiles of G
 * groups x T tokens. The tokens come as one panel, a chunk of 16 pairs
 * (64 bytes) of each token after the other: chunk c of token t at
 * p + 64 (T c + t), so that every broadcast of a chunk's pairs is one
 * pointer and a constant offset (a token's row is its own panel). pd: bytes
 * ahead to prefetch each group's stream, a line a step (0: none; the first
 * token tile of a group reads it from memory). */
LK_T512BF static LK_INL void br_tile(const int G, const int T, int64_t n, const uint8_t *w, size_t gs,
                                     const uint8_t *p, float *y, size_t ys, size_t pd) {
    __m512 acc[4][12];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 12
        for (int t = 0; t < T; t++) acc[g][t] = _mm512_setzero_ps();
#define BR_STEP(LOAD, PO)                                                                                          \
    do {                                                                                                           \
        __m512bh wv[4];                                                                                            \
        _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) wv[g] = (__m512bh)(LOAD);                              \
        _Pragma("GCC unroll 12") for (int t = 0; t < T; t++) {                                                     \
            const __m512bh av = (__m512bh)_mm512_set1_epi32(lk_ld_i32(p + 64 * t + (PO)));                         \
            _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) acc[g][t] = _mm512_dpbf16_ps(acc[g][t], wv[g], av); \
        }                                                                                                          \
    } while (0)
#define BR_CHUNKS(PF)                                                                                              \
    for (int64_t c = 0; c < np / 16; c++, w += 1024, p += 64 * T) {                                               \
        _Pragma("GCC unroll 16") for (int jj = 0; jj < 16; jj++) {                                                 \
            if (PF)                                                                                                \
                _Pragma("GCC unroll 4") for (int g = 0; g < G; g++)                                                \
                    _mm_prefetch((const char *)(w + (size_t)g * gs + pd + 64 * jj), _MM_HINT_T0);                   \
            BR_STEP(_mm512_loadu_si512(w + (size_t)g * gs + 64 * jj), 4 * jj);                                     \
        }                                                                                                          \
    }
    const int64_t np = n / 2;
    if (pd)
        BR_CHUNKS(1)
    else
        BR_CHUNKS(0)
    int jj = 0;
    for (; jj < (int)(np % 16); jj++) BR_STEP(_mm512_loadu_si512(w + (size_t)g * gs + 64 * jj), 4 * jj);
    /* an odd last element: a pair of it (the low half) and a zero */
    if (n & 1)
        BR_STEP(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(w + (size_t)g * gs + 64 * jj))),
                4 * jj);
#undef BR_CHUNKS
#undef BR_STEP
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 12
        for (int t = 0; t < T; t++) _mm512_storeu_ps(y + (size_t)t * ys + 16 * (size_t)g, acc[g][t]);
}
#define BR_FN(G, T)                                                                                      \
    LK_T512BF static void br_##G##x##T(int64_t n, const uint8_t *w, size_t gs, const void *p, float *y,   \
                                       size_t ys, size_t pd) {                                            \
        br_tile(G, T, n, w, gs, p, y, ys, pd);                                                            \
    }
enum { BR_T = HR_T }; /* the tiles' tokens: lanes_walk's */
BR_FN(4, 1) BR_FN(4, 2) BR_FN(4, 3)
BR_FN(2, 1) BR_FN(2, 2) BR_FN(2, 3) BR_FN(2, 4) BR_FN(2, 5) BR_FN(2, 6)
BR_FN(2, 7) BR_FN(2, 8) BR_FN(2, 9) BR_FN(2, 10) BR_FN(2, 11) BR_FN(2, 12)
BR_FN(1, 1) BR_FN(1, 2) BR_FN(1, 3) BR_FN(1, 4) BR_FN(1, 5) BR_FN(1, 6)
BR_FN(1, 7) BR_FN(1, 8) BR_FN(1, 9) BR_FN(1, 10) BR_FN(1, 11) BR_FN(1, 12)
/* [G = 1, 2, 4 as 0, 1, 2][T - 1] */
static const lanes_fn k_br[3][BR_T] = {
    {br_1x1, br_1x2, br_1x3, br_1x4, br_1x5, br_1x6, br_1x7, br_1x8, br_1x9, br_1x10, br_1x11, br_1x12},
    {br_2x1, br_2x2, br_2x3, br_2x4, br_2x5, br_2x6, br_2x7, br_2x8, br_2x9, br_2x10, br_2x11, br_2x12},
    {br_4x1, br_4x2, br_4x3}};

/* Tokens [0, nt) (bf16 rows of n elements, `as` bytes apart) as panels of
 * BR_T tokens at p (br_tile's layout: the panel of tokens t0.. at
 * p + 64 t0 C, C the rows' chunks of 64 bytes, the last one, and with it an
 * odd last element's pair, filled with zeros) */
LK_T512 static void br_panels(int64_t n, int64_t nt, const uint8_t *a, size_t as, uint8_t *p) {
    const int64_t C = (2 * n + 63) / 64;
    for (int64_t t0 = 0; t0 < nt; t0 += BR_T) {
        const int64_t tt = LK_MIN((int64_t)BR_T, nt - t0);
        for (int64_t t = 0; t < tt; t++) {
            const uint8_t *at = a + (size_t)(t0 + t) * as;
            uint8_t *q = p + 64 * (size_t)(t0 * C + t);
            for (int64_t c = 0; c < C; c++, q += 64 * (size_t)tt) {
                const int64_t left = 2 * n - 64 * c;
                const __mmask64 m = left >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << left) - 1;
                _mm512_storeu_si512(q, _mm512_maskz_loadu_epi8(m, at + 64 * c));
            }
        }
    }
}

/* The whole groups: one token of an even row read in place, else the
 * tokens in panels (as many at a time as the buffer holds), through
 * lanes_walk, prefetching as F16_R16's (HR_PD bytes per prefetch tile). */
static void br_run(int64_t n, int64_t ng, const uint8_t *W, size_t gs, int64_t ntok, const uint8_t *A, size_t as,
                   float *y, size_t ys) {
    const int64_t C = (2 * n + 63) / 64;
    const bool inplace = ntok == 1 && !(n & 1);
    int64_t tc = inplace ? 1 : (int64_t)(4 * FLA_BUF_FLOATS / 64) / C;
    if (tc > BR_T) tc = tc / BR_T * BR_T;
    if (tc < 1) { /* rows of more than 2^18 elements: the same sums in scalar code */
        lk_quant_bf16r16_seq(n, ng * 16, W, gs / 16, ntok, A, as, y, ys);
        return;
    }
    _Alignas(64) uint8_t stack[inplace ? 1 : 4 * FLA_BUF_FLOATS];
    const size_t pd = (size_t)lk_quant_pf_tiles() * HR_PD;
    for (int64_t t0 = 0; t0 < ntok; t0 += tc) {
        const int64_t nt = LK_MIN(ntok, t0 + tc) - t0;
        const uint8_t *buf = inplace ? A : stack;
        if (!inplace) br_panels(n, nt, A + (size_t)t0 * as, as, stack);
        lanes_walk(k_br, n, ng, W, gs, nt, buf, 64 * (size_t)C, y + (size_t)t0 * ys, ys, pd);
    }
}
static void mm_bf16r16(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as,
                       float *y, size_t ys) {
    const int64_t full = nrows / 16 * 16;
    if (full) br_run(n, full / 16, w, 16 * ws, ntok, a, as, y, ys);
    if (full < nrows) mm_bf(n, nrows - full, (const uint8_t *)w + (size_t)full * ws, ws, ntok, a, as, y + full, ys);
}

/* BF16 on CPUs with AMX-BF16: every token count through the tiles
 * (lk_quant_bf16_amx), the activations' tiles packed by the call or, in
 * the _t twin, once per matrix (LK_TERMS_TILES) */
static void mm_bfx_t(int64_t n, int64_t nrows, const void *w, size_t ws, int64_t ntok, const void *a, size_t as,
                     const lk_act_terms *T, float *y, size_t ys) {
    lk_quant_bf16_amx(false, n, nrows, w, ws, ntok, a, as, T, y, ys);
}
MM_NO_TERMS(mm_bfx)
#undef MM_NO_TERMS

/* F16 and BF16 rows (the activations of F16/BF16 weights), the AVX2
 * converters' bits 16 at a time (quant_avx2.c says why those are
 * lk_fp32_to_fp16's and lk_fp32_to_bf16's): F16 by vcvtps2ph, a group with
 * a NaN through the scalar code; BF16 by the scalar code's integer rounding.
 * On the Xeon guest the AVX2 BF16 converter was 2.2 % of a BF16 prefill's
 * products (pp64, one thread). */
LK_T512 static void f16_rows_avx512(const float *x, void *dst, int64_t n) {
    uint8_t *d = dst;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) break;
        _mm256_storeu_si256((__m256i *)(d + 2 * i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    lk_quant_f16_rows(x + i, d + 2 * i, n - i);
}

LK_T512 static void bf16_rows_avx512(const float *x, void *dst, int64_t n) {
    uint8_t *d = dst;
    int64_t i = 0;
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    for (; i + 16 <= n; i += 16) {
        const __m512i u = _mm512_loadu_si512(x + i);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
        const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, abs), inf);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(64)));
        _mm256_storeu_si256((__m256i *)(d + 2 * i), _mm512_cvtepi32_epi16(r));
    }
    lk_quant_bf16_rows(x + i, d + 2 * i, n - i);
}

void lk_quant_fill_avx512(lk_quant_ops *ops) {
    build_tables();
    ops->name = "avx512";
    ops->act[LK_TYPE_Q8_0] = lk_act_q8_0_avx512;
    ops->quant[LK_TYPE_Q8_K] = lk_act_q8_k_avx512;
    ops->quant[LK_TYPE_F16] = f16_rows_avx512;
    ops->quant[LK_TYPE_BF16] = bf16_rows_avx512;
    ops->mm[LK_TYPE_Q4_0] = mm_q40;
    ops->mm[LK_TYPE_Q4_0_R16] = mm_q40r16;
    ops->mm[LK_TYPE_Q8_0_R16] = mm_q80r16;
    ops->mm[LK_TYPE_Q8_0] = mm_q80;
    ops->mm_terms[LK_TYPE_Q4_0] = mm_q40_t;
    ops->mm_terms[LK_TYPE_Q4_0_R16] = mm_q40r16_t;
    ops->mm_terms[LK_TYPE_Q8_0_R16] = mm_q80r16_t;
    ops->mm_terms[LK_TYPE_Q8_0] = mm_q80_t;
    ops->terms_rows = act_terms_rows;
    ops->terms_part = lk_act_terms_part_bf16_tiles;
    ops->mm_terms[LK_TYPE_F16_R16] = mm_f16r16_t;
    ops->mm[LK_TYPE_Q4_K] = mm_q4k;
    ops->mm[LK_TYPE_Q5_K] = mm_q5k;
    ops->mm[LK_TYPE_Q6_K] = mm_q6k;
    ops->mm[LK_TYPE_Q4_K_R16] = mm_q4kr16;
    ops->mm[LK_TYPE_Q5_K_R16] = mm_q5kr16;
    ops->mm[LK_TYPE_Q6_K_R16] = mm_q6kr16;
    ops->mm[LK_TYPE_F32] = mm_f32;
    ops->mm[LK_TYPE_F16] = mm_f16;
    ops->mm[LK_TYPE_F16_R16] = mm_f16r16;
    const uint32_t feat = lk_cpu()->feat;
    ops->mm[LK_TYPE_BF16] = (feat & LK_CPU_AMXBF16) ? mm_bfx : (feat & LK_CPU_AVX512BF16) ? mm_bf : mm_bfc;
    ops->mm_terms[LK_TYPE_BF16] = (feat & LK_CPU_AMXBF16) ? mm_bfx_t : NULL;
    /* BF16_R16 where vdpbf16ps is the BF16 kernel's arithmetic (with
     * AMX-BF16 the tiles are faster at every token count) */
    if ((feat & LK_CPU_AVX512BF16) && !(feat & LK_CPU_AMXBF16)) ops->mm[LK_TYPE_BF16_R16] = mm_bf16r16;
}
